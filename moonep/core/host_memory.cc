#include "moonep/core/host_memory.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

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

// The value of `key` in a memory.stat file ("key value" lines).
bool StatValue(const std::string& path, const std::string& key, int64_t* value) {
  std::ifstream in(path);
  std::string k;
  long long v = 0;
  while (in >> k >> v) {
    if (k == key) {
      if (v < 0) return false;
      *value = v;
      return true;
    }
  }
  return false;
}

bool IsDir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The process's cgroup directory under `base` (`path` from /proc/self/cgroup), else `base` itself
// (a cgroup namespace mounts the process's own cgroup there).
std::string CgroupDir(const std::string& base, const std::string& path) {
  if (path.empty() || path == "/") return base;
  const std::string dir = base + path;
  return IsDir(dir) ? dir : base;
}

// Room under one level's limit: limit - (usage - inactive file pages), at least 0.
int64_t RoomUnder(int64_t limit, int64_t usage, int64_t inactive) {
  const int64_t working = std::max<int64_t>(0, usage - std::min(inactive, usage));
  return std::max<int64_t>(0, limit - working);
}

std::string RoomSource(int64_t room, int64_t limit, const std::string& file, int64_t usage,
                       int64_t inactive) {
  return absl::StrFormat("%d bytes are left under the memory cgroup's limit of %d bytes (%s; usage "
                         "%d, of which %d inactive file pages)",
                         room, limit, file, usage, inactive);
}

}  // namespace

HostMemoryRoom CgroupMemoryRoom(const std::string& cgroup_root, const std::string& self_cgroup) {
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
  if (v1) {
    const std::string dir = CgroupDir(cgroup_root + "/memory", v1_path);
    int64_t limit = kNoLimitFrom, hierarchical = kNoLimitFrom, usage = 0, inactive = 0;
    std::string file = dir + "/memory.limit_in_bytes";
    if (!ReadNumber(file, &limit)) limit = kNoLimitFrom;
    if (StatValue(dir + "/memory.stat", "hierarchical_memory_limit", &hierarchical) &&
        hierarchical < limit) {
      limit = hierarchical;
      file = dir + "/memory.stat hierarchical_memory_limit";
    }
    if (limit >= kNoLimitFrom || !ReadNumber(dir + "/memory.usage_in_bytes", &usage)) return room;
    if (!StatValue(dir + "/memory.stat", "total_inactive_file", &inactive)) {
      StatValue(dir + "/memory.stat", "inactive_file", &inactive);
    }
    room.bytes = RoomUnder(limit, usage, inactive);
    room.source = RoomSource(room.bytes, limit, file, usage, inactive);
    room.cgroup_dir = dir;
    return room;
  }
  if (!v2) return room;
  // Every level from the process's cgroup up to the mount's root: the tightest room.
  std::string dir = CgroupDir(cgroup_root, v2_path);
  while (true) {
    int64_t limit = 0, usage = 0, inactive = 0;
    if (ReadNumber(dir + "/memory.max", &limit) && limit < kNoLimitFrom &&
        ReadNumber(dir + "/memory.current", &usage)) {
      StatValue(dir + "/memory.stat", "inactive_file", &inactive);
      const int64_t here = RoomUnder(limit, usage, inactive);
      if (room.bytes < 0 || here < room.bytes) {
        room.bytes = here;
        room.source = RoomSource(here, limit, dir + "/memory.max", usage, inactive);
        room.cgroup_dir = dir;
      }
    }
    if (dir.size() <= cgroup_root.size()) break;
    const size_t slash = dir.rfind('/');
    if (slash == std::string::npos || slash < cgroup_root.size()) break;
    dir = dir.substr(0, std::max(slash, cgroup_root.size()));
  }
  return room;
}

namespace {

std::string SelfCgroup() {
  std::string text;
  return ReadText("/proc/self/cgroup", &text) ? text : std::string();
}

}  // namespace

HostMemoryRoom HostMemoryRoomNow() {
  HostMemoryRoom room;
  room.bytes = MemAvailableBytes();
  if (room.bytes >= 0) {
    room.source = absl::StrFormat("the node has %d bytes available (MemAvailable, /proc/meminfo)",
                                  room.bytes);
  }
  const HostMemoryRoom cgroup = CgroupMemoryRoom("/sys/fs/cgroup", SelfCgroup());
  if (cgroup.bytes >= 0 && (room.bytes < 0 || cgroup.bytes < room.bytes)) return cgroup;
  return room;
}

int64_t HostMemoryAvailableBytes() { return HostMemoryRoomNow().bytes; }

std::string HostMemoryNodeKey() {
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
  // identity of the limiting cgroup's directory (device and inode, folded into 16 hex digits so
  // that the key stays within the 64 bytes the runtime's node check keeps) tells them apart.
  const HostMemoryRoom cgroup = CgroupMemoryRoom("/sys/fs/cgroup", SelfCgroup());
  struct stat st;
  if (cgroup.bytes >= 0 && ::stat(cgroup.cgroup_dir.c_str(), &st) == 0) {
    const uint64_t id = static_cast<uint64_t>(st.st_dev) * 0x9E3779B97F4A7C15ull ^
                        static_cast<uint64_t>(st.st_ino);
    key += absl::StrFormat(" cg%016x", id);
  }
  return key;
}

absl::Status CheckHostAllocation(uint64_t bytes, absl::string_view what) {
  // Nothing to allocate (a staging already at its size, every step): no files read.
  if (bytes == 0) return absl::OkStatus();
  const HostMemoryRoom room = HostMemoryRoomNow();
  if (room.bytes < 0 || bytes <= static_cast<uint64_t>(room.bytes)) return absl::OkStatus();
  return OutOfMemory("cannot allocate %d host bytes for %s: %s", bytes, what, room.source);
}

}  // namespace moonep
