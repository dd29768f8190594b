#include "moonep/core/host_memory.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_format.h"
#include "moonep/core/status.h"

namespace moonep {

namespace {

// Limits at or above this are "no limit" (cgroup v1 reports none as 2^63 rounded down to a page).
constexpr int64_t kNoLimitFrom = int64_t{1} << 62;

int64_t MemAvailableBytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return -1;
  char line[256];
  long long kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib >= 0 && kib <= INT64_MAX / 1024 ? static_cast<int64_t>(kib) * 1024 : -1;
}

bool ReadText(const std::string& path, std::string* text) {
  std::ifstream in(path);
  if (!in) return false;
  std::ostringstream all;
  all << in.rdbuf();
  *text = all.str();
  return true;
}

// A file holding one non-negative number; "max" (cgroup v2's no limit) reads as kNoLimitFrom.
bool ReadNumber(const std::string& path, int64_t* value) {
  std::string text;
  if (!ReadText(path, &text)) return false;
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  if (text == "max") {
    *value = kNoLimitFrom;
    return true;
  }
  if (text.empty() || text.size() > 19) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == nullptr || *end != '\0' || v < 0) return false;
  *value = v;
  return true;
}

// A memory.stat file's "key value" lines (negative values left out), read once.
std::unordered_map<std::string, int64_t> ReadStat(const std::string& path) {
  std::unordered_map<std::string, int64_t> stat;
  std::ifstream in(path);
  std::string k;
  long long v = 0;
  while (in >> k >> v) {
    if (v >= 0) stat.emplace(k, v);
  }
  return stat;
}

int64_t StatOr0(const std::unordered_map<std::string, int64_t>& stat, const std::string& key) {
  const auto it = stat.find(key);
  return it == stat.end() ? 0 : it->second;
}

bool IsDir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string Unescape(const std::string& field) {
  std::string out;
  for (size_t i = 0; i < field.size(); ++i) {
    if (field[i] == '\\' && i + 3 < field.size() &&
        std::isdigit(static_cast<unsigned char>(field[i + 1]))) {
      out += static_cast<char>(std::strtol(field.substr(i + 1, 3).c_str(), nullptr, 8));
      i += 3;
    } else {
      out += field[i];
    }
  }
  return out;
}

struct CgroupMount {
  std::string root;   // the cgroup mounted there (mountinfo's root field)
  std::string point;  // where
};

// The mount of cgroup v1's memory controller (`v2` false: fstype "cgroup" with "memory" among its
// super options) or of cgroup v2 (fstype "cgroup2"), from /proc/self/mountinfo's text.
bool FindCgroupMount(const std::string& mountinfo, bool v2, CgroupMount* mount) {
  std::istringstream lines(mountinfo);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::vector<std::string> f;
    std::string w;
    while (in >> w) f.push_back(w);
    size_t dash = 0;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (f.size() < 5 || dash + 1 >= f.size()) continue;
    const std::string& type = f[dash + 1];
    const std::string super = dash + 3 < f.size() ? f[dash + 3] : std::string();
    bool match = v2 ? type == "cgroup2" : false;
    if (!v2 && type == "cgroup") {
      std::istringstream opts(super);
      std::string o;
      while (std::getline(opts, o, ',')) match = match || o == "memory";
    }
    if (!match) continue;
    mount->root = Unescape(f[3]);
    mount->point = Unescape(f[4]);
    return true;
  }
  return false;
}

// The process's cgroup (`path` from /proc/self/cgroup) as a directory under `mount`: its path
// below the mount's root; "" where it is not under it (not visible here) or does not exist.
std::string DirUnder(const CgroupMount& mount, const std::string& path) {
  std::string rel;
  if (mount.root == "/") {
    rel = path;
  } else if (path.compare(0, mount.root.size(), mount.root) == 0 &&
             (path.size() == mount.root.size() || path[mount.root.size()] == '/')) {
    rel = path.substr(mount.root.size());
  } else {
    return "";
  }
  while (!rel.empty() && rel.back() == '/') rel.pop_back();
  const std::string dir = mount.point + rel;
  return IsDir(dir) ? dir : "";
}

// Room under one level's limit: limit - (usage - file pages), at least 0.
int64_t RoomUnder(int64_t limit, int64_t usage, int64_t file) {
  const int64_t working = std::max<int64_t>(0, usage - std::min(file, usage));
  return std::max<int64_t>(0, limit - working);
}

std::string RoomSource(int64_t room, int64_t limit, const std::string& file, int64_t usage,
                       int64_t cache) {
  return absl::StrFormat("%d bytes are left under the memory cgroup's limit of %d bytes (%s; usage "
                         "%d, of which %d file pages)",
                         room, limit, file, usage, cache);
}

}  // namespace

HostMemoryRoom CgroupMemoryRoom(const std::string& mountinfo, const std::string& self_cgroup) {
  std::string v1_path, v2_path;
  bool v1 = false, v2 = false;
  std::istringstream lines(self_cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    std::istringstream names(controllers);
    std::string name;
    while (std::getline(names, name, ',')) {
      if (name == "memory") {
        v1 = true;
        v1_path = path;
      }
    }
    if (id == "0" && controllers.empty()) {
      v2 = true;
      v2_path = path;
    }
  }
  HostMemoryRoom room;
  CgroupMount mount;
  // cgroup v1's memory controller where it is mounted (a hybrid system also has a v2 line).
  const bool use_v1 = v1 && FindCgroupMount(mountinfo, /*v2=*/false, &mount);
  if (!use_v1 && !(v2 && FindCgroupMount(mountinfo, /*v2=*/true, &mount))) return room;
  const std::string leaf = DirUnder(mount, use_v1 ? v1_path : v2_path);
  if (leaf.empty()) return room;
  const std::string limit_file = use_v1 ? "/memory.limit_in_bytes" : "/memory.max";
  const std::string usage_file = use_v1 ? "/memory.usage_in_bytes" : "/memory.current";
  const std::string active = use_v1 ? "total_active_file" : "active_file";
  const std::string inactive = use_v1 ? "total_inactive_file" : "inactive_file";
  // Every level from the process's cgroup up to the mount's: the tightest room (usage counts the
  // level's whole subtree); the lowest level with a limit names the limit the ranks share.
  auto consider = [&](int64_t limit, const std::string& dir, const std::string& file) {
    int64_t usage = 0;
    if (limit >= kNoLimitFrom || !ReadNumber(dir + usage_file, &usage)) return;
    const auto stat = ReadStat(dir + "/memory.stat");
    const int64_t cache = StatOr0(stat, active) + StatOr0(stat, inactive);
    const int64_t here = RoomUnder(limit, usage, cache);
    if (room.key_dir.empty()) room.key_dir = dir;
    if (room.bytes < 0 || here < room.bytes) {
      room.bytes = here;
      room.source = RoomSource(here, limit, file, usage, cache);
      room.cgroup_dir = dir;
    }
  };
  std::string dir = leaf;
  while (true) {
    int64_t limit = 0;
    if (ReadNumber(dir + limit_file, &limit)) consider(limit, dir, dir + limit_file);
    if (dir.size() <= mount.point.size()) break;
    const size_t slash = dir.rfind('/');
    if (slash == std::string::npos || slash < mount.point.size()) break;
    dir = dir.substr(0, std::max(slash, mount.point.size()));
  }
  if (use_v1) {
    // Ancestors above the mount (not visible here) limit it too: v1's hierarchical limit, against
    // the process's own cgroup's usage (all it can see; the room may come out larger).
    const auto stat = ReadStat(leaf + "/memory.stat");
    const auto hierarchical = stat.find("hierarchical_memory_limit");
    if (hierarchical != stat.end()) {
      const std::string key = room.key_dir;
      consider(hierarchical->second, leaf, leaf + "/memory.stat hierarchical_memory_limit");
      room.key_dir = key.empty() ? mount.point : key;
    }
  }
  return room;
}

namespace {

HostMemoryRoom CgroupOfSelf() {
  std::string mountinfo, self;
  if (!ReadText("/proc/self/mountinfo", &mountinfo) || !ReadText("/proc/self/cgroup", &self)) {
    return HostMemoryRoom();
  }
  return CgroupMemoryRoom(mountinfo, self);
}

}  // namespace

HostMemoryRoom HostMemoryRoomNow() {
  HostMemoryRoom room;
  room.bytes = MemAvailableBytes();
  if (room.bytes >= 0) {
    room.source = absl::StrFormat("the node has %d bytes available (MemAvailable, /proc/meminfo)",
                                  room.bytes);
  }
  const HostMemoryRoom cgroup = CgroupOfSelf();
  if (cgroup.bytes >= 0 && (room.bytes < 0 || cgroup.bytes < room.bytes)) return cgroup;
  room.key_dir = cgroup.key_dir;  // a limit that is not the tightest still keys the ranks
  return room;
}

int64_t HostMemoryAvailableBytes() { return HostMemoryRoomNow().bytes; }

std::string HostMemoryNodeKey(const HostMemoryRoom& room) {
  std::string key;
  char text[128] = {};
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    const bool read = std::fgets(text, sizeof(text), f) != nullptr;
    std::fclose(f);
    key = read ? std::string(text) : std::string();
    while (!key.empty() && (key.back() == '\n' || key.back() == ' ')) key.pop_back();
    if (!key.empty()) key = "boot " + key;
  }
  if (key.empty() && gethostname(text, sizeof(text) - 1) == 0) key = "host " + std::string(text);
  if (key.empty()) return key;
  // Where a memory cgroup limits this process, its limit is not the other containers': the
  // identity of the lowest limited cgroup's directory (device and inode, folded into 16 hex
  // digits so that the key stays within the 64 bytes the runtime's node check keeps) tells them
  // apart.
  struct stat st;
  if (!room.key_dir.empty() && ::stat(room.key_dir.c_str(), &st) == 0) {
    const uint64_t id = static_cast<uint64_t>(st.st_dev) * 0x9E3779B97F4A7C15ull ^
                        static_cast<uint64_t>(st.st_ino);
    key += absl::StrFormat(" cg%016x", id);
  }
  return key;
}

absl::Status CheckHostAllocation(uint64_t bytes, absl::string_view what) {
  // Nothing to allocate (a staging already at its size, every step): no files read.
  if (bytes == 0) return absl::OkStatus();
  return CheckHostAllocation(bytes, what, HostMemoryRoomNow());
}

absl::Status CheckHostAllocation(uint64_t bytes, absl::string_view what,
                                 const HostMemoryRoom& room) {
  if (room.bytes < 0 || bytes <= static_cast<uint64_t>(room.bytes)) return absl::OkStatus();
  return OutOfMemory("cannot allocate %d host bytes for %s: %s", bytes, what, room.source);
}

}  // namespace moonep
