// Host allocations that cannot fit are refused with an error (before the zero-fill that would
// run the process into the out-of-memory killer): the check against /proc/meminfo.
#include "moonep/core/host_memory.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace moonep {
namespace {

TEST(HostMemoryTest, AvailableIsAtMostMemAvailableOfProcMeminfo) {
  std::ifstream meminfo("/proc/meminfo");
  if (!meminfo) GTEST_SKIP() << "no /proc/meminfo";
  std::string key;
  int64_t kib = -1;
  while (meminfo >> key) {
    if (key == "MemAvailable:") {
      meminfo >> kib;
      break;
    }
    std::getline(meminfo, key);
  }
  ASSERT_GT(kib, 0);
  const HostMemoryRoom room = HostMemoryRoomNow();
  const int64_t bytes = room.bytes;
  const int64_t total = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  EXPECT_GE(bytes, 0);
  EXPECT_LE(bytes, total);
  // Read again a moment later: at most the file's figure (other processes move it: within a
  // quarter of it, or 512 MiB where little is free), and near it unless a cgroup bounds it.
  const double slack = std::max(0.25 * kib * 1024, 512.0 * (1 << 20));
  EXPECT_LE(static_cast<double>(bytes), static_cast<double>(kib) * 1024 + slack);
  if (room.cgroup_dir.empty()) {
    EXPECT_NEAR(static_cast<double>(bytes), static_cast<double>(kib) * 1024, slack);
    EXPECT_NE(room.source.find("MemAvailable"), std::string::npos) << room.source;
  } else {
    EXPECT_NE(room.source.find("memory cgroup"), std::string::npos) << room.source;
  }
}

TEST(HostMemoryTest, AllocationsAboveAvailableAreRefusedNamingWhat) {
  const int64_t available = HostMemoryAvailableBytes();
  if (available < 0) GTEST_SKIP() << "MemAvailable cannot be read here";
  EXPECT_TRUE(CheckHostAllocation(0, "nothing").ok());
  EXPECT_TRUE(CheckHostAllocation(4096, "a page").ok());
  const uint64_t too_much = static_cast<uint64_t>(available) * 2 + (uint64_t{1} << 30);
  const absl::Status s = CheckHostAllocation(too_much, "the test's buffer");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("the test's buffer"), std::string::npos) << s;
  EXPECT_NE(s.message().find(std::to_string(too_much)), std::string::npos) << s;
  EXPECT_NE(s.message().find(HostMemoryRoomNow().cgroup_dir.empty() ? "MemAvailable"
                                                                     : "memory cgroup"),
            std::string::npos) << s;
  EXPECT_FALSE(CheckHostAllocation(UINT64_MAX, "everything").ok());
}

// A fake cgroup tree: files under a temporary directory, and mountinfo lines that mount it.
class CgroupTree {
 public:
  CgroupTree() {
    char tmpl[] = "/tmp/moonep_cgroup_XXXXXX";  // mkdtemp's template
    root_ = mkdtemp(tmpl) ? std::string(tmpl) : std::string();
  }
  ~CgroupTree() {
    if (!root_.empty()) std::system(("rm -rf '" + root_ + "'").c_str());
  }
  const std::string& root() const { return root_; }
  void Write(const std::string& relative, const std::string& text) {
    const std::string path = root_ + "/" + relative;
    std::system(("mkdir -p '" + path.substr(0, path.rfind('/')) + "'").c_str());
    std::ofstream(path) << text;
  }
  // A mountinfo line: cgroup `mounted` (the root field) at root()/`at`, of fstype `type` with
  // super options `options`.
  std::string Mount(const std::string& mounted, const std::string& at, const std::string& type,
                    const std::string& options) const {
    return "35 31 0:32 " + mounted + " " + root_ + at + " rw,relatime shared:9 - " + type + " " +
           type + " " + options + "\n";
  }

 private:
  std::string root_;
};

constexpr int64_t kMiB = int64_t{1} << 20;

// cgroup v2: every level from the process's cgroup up to the mount is read, and the tightest room
// wins: limit less usage without file pages (active and inactive). Levels without a limit ("max")
// and the mount's root (no memory.max) do not bound it; the lowest limited level keys the ranks.
TEST(HostMemoryTest, CgroupV2RoomIsTheTightestLevelsLimitLessItsWorkingSet) {
  CgroupTree t;
  ASSERT_FALSE(t.root().empty());
  const std::string mounts = t.Mount("/", "/v1cpu", "cgroup", "rw,cpu") +
                             t.Mount("/", "", "cgroup2", "rw,nsdelegate");
  t.Write("a/memory.max", std::to_string(1024 * kMiB) + "\n");
  t.Write("a/memory.current", std::to_string(512 * kMiB) + "\n");
  t.Write("a/memory.stat", "anon 100\nfile 200\ninactive_file " + std::to_string(100 * kMiB) +
                               "\nactive_file " + std::to_string(50 * kMiB) + "\n");
  t.Write("a/b/memory.max", "max\n");
  t.Write("a/b/memory.current", std::to_string(300 * kMiB) + "\n");
  t.Write("a/b/memory.stat", "inactive_file 0\n");
  HostMemoryRoom room = CgroupMemoryRoom(mounts, "0::/a/b\n");
  EXPECT_EQ(room.bytes, (1024 - (512 - 150)) * kMiB);
  EXPECT_EQ(room.cgroup_dir, t.root() + "/a");
  EXPECT_EQ(room.key_dir, t.root() + "/a");
  EXPECT_NE(room.source.find(t.root() + "/a/memory.max"), std::string::npos) << room.source;
  EXPECT_NE(room.source.find("memory cgroup"), std::string::npos) << room.source;
  // A tighter leaf wins, and keys the ranks.
  t.Write("a/b/memory.max", std::to_string(400 * kMiB) + "\n");
  room = CgroupMemoryRoom(mounts, "0::/a/b\n");
  EXPECT_EQ(room.bytes, 100 * kMiB);
  EXPECT_EQ(room.cgroup_dir, t.root() + "/a/b");
  EXPECT_EQ(room.key_dir, t.root() + "/a/b");
  // A leaf with a looser limit keys the ranks (the lowest limited level), the parent's is tighter.
  t.Write("a/b/memory.max", std::to_string(4000 * kMiB) + "\n");
  room = CgroupMemoryRoom(mounts, "0::/a/b\n");
  EXPECT_EQ(room.cgroup_dir, t.root() + "/a");
  EXPECT_EQ(room.key_dir, t.root() + "/a/b");
  // Usage above the limit leaves no room (0, not negative).
  t.Write("a/b/memory.max", std::to_string(400 * kMiB) + "\n");
  t.Write("a/b/memory.current", std::to_string(900 * kMiB) + "\n");
  EXPECT_EQ(CgroupMemoryRoom(mounts, "0::/a/b\n").bytes, 0);
}

// A container's mount shows its own cgroup: mountinfo's root field is the process's path (or a
// prefix of it), and the directory is the path below it. A path outside the mount's root is not
// visible here: no room is claimed for it.
TEST(HostMemoryTest, CgroupV2InAContainerReadsItsOwnCgroupAtTheMount) {
  CgroupTree t;
  ASSERT_FALSE(t.root().empty());
  t.Write("memory.max", std::to_string(2048 * kMiB) + "\n");
  t.Write("memory.current", std::to_string(48 * kMiB) + "\n");
  t.Write("memory.stat", "inactive_file 0\n");
  EXPECT_EQ(CgroupMemoryRoom(t.Mount("/", "", "cgroup2", "rw"), "0::/\n").bytes, 2000 * kMiB);
  const std::string pod = t.Mount("/kubepods/pod1/abc", "", "cgroup2", "rw");
  EXPECT_EQ(CgroupMemoryRoom(pod, "0::/kubepods/pod1/abc\n").bytes, 2000 * kMiB);
  EXPECT_EQ(CgroupMemoryRoom(pod, "0::/kubepods/pod2/xyz\n").bytes, -1);
  EXPECT_EQ(CgroupMemoryRoom(pod, "0::/kubepods/pod1/abcd\n").bytes, -1);
}

// cgroup v1: the memory controller's line and mount (co-mounted with cpu here); every visible
// level's memory.limit_in_bytes, and hierarchical_memory_limit for ancestors above the mount;
// "no limit" is 2^63 rounded down to a page.
TEST(HostMemoryTest, CgroupV1RoomReadsEveryLevelAndTheHierarchicalLimit) {
  CgroupTree t;
  ASSERT_FALSE(t.root().empty());
  const std::string mounts = t.Mount("/", "/cpu,memory", "cgroup", "rw,cpu,memory") +
                             t.Mount("/", "/unified", "cgroup2", "rw");
  const std::string self = "12:pids:/x\n4:cpu,memory:/job/7\n0::/\n";
  const std::string unlimited = "9223372036854771712\n";
  t.Write("cpu,memory/job/7/memory.limit_in_bytes", unlimited);
  t.Write("cpu,memory/job/7/memory.usage_in_bytes", std::to_string(700 * kMiB) + "\n");
  t.Write("cpu,memory/job/7/memory.stat",
          "cache 1\nhierarchical_memory_limit " + std::to_string(1000 * kMiB) +
              "\ntotal_inactive_file " + std::to_string(200 * kMiB) + "\ninactive_file 3\n");
  HostMemoryRoom room = CgroupMemoryRoom(mounts, self);
  EXPECT_EQ(room.bytes, (1000 - (700 - 200)) * kMiB);
  EXPECT_NE(room.source.find("hierarchical_memory_limit"), std::string::npos) << room.source;
  EXPECT_EQ(room.key_dir, t.root() + "/cpu,memory");  // the limit is above the mount
  // A visible parent with a tighter limit and its own (larger) usage.
  t.Write("cpu,memory/job/memory.limit_in_bytes", std::to_string(800 * kMiB) + "\n");
  t.Write("cpu,memory/job/memory.usage_in_bytes", std::to_string(750 * kMiB) + "\n");
  t.Write("cpu,memory/job/memory.stat", "total_active_file 0\n");
  room = CgroupMemoryRoom(mounts, self);
  EXPECT_EQ(room.bytes, 50 * kMiB);
  EXPECT_EQ(room.cgroup_dir, t.root() + "/cpu,memory/job");
  EXPECT_EQ(room.key_dir, t.root() + "/cpu,memory/job");
  // No limit anywhere: nothing to say.
  t.Write("cpu,memory/job/memory.limit_in_bytes", unlimited);
  t.Write("cpu,memory/job/7/memory.stat", "hierarchical_memory_limit 9223372036854771712\n");
  EXPECT_EQ(CgroupMemoryRoom(mounts, self).bytes, -1);
}

// Nothing readable, no memory line or mount, or malformed files: no cgroup room (-1), never a
// crash.
TEST(HostMemoryTest, CgroupRoomIsUnknownWhereNothingCanBeRead) {
  CgroupTree t;
  ASSERT_FALSE(t.root().empty());
  const std::string v2 = t.Mount("/", "", "cgroup2", "rw");
  EXPECT_EQ(CgroupMemoryRoom("", "0::/\n").bytes, -1);
  EXPECT_EQ(CgroupMemoryRoom(v2, "").bytes, -1);
  EXPECT_EQ(CgroupMemoryRoom("garbage\n1 2\n- - -\n", "0::/\n").bytes, -1);
  EXPECT_EQ(CgroupMemoryRoom(v2, "garbage without colons\n3:cpu:/\n").bytes, -1);
  EXPECT_EQ(CgroupMemoryRoom(v2, "0::/missing\n").bytes, -1);
  // The v1 line without a v1 memory mount, on a v2-only tree without a limit.
  EXPECT_EQ(CgroupMemoryRoom(v2, "4:memory:/\n").bytes, -1);
  t.Write("memory.max", "12ab\n");
  t.Write("memory.current", "5\n");
  EXPECT_EQ(CgroupMemoryRoom(v2, "0::/\n").bytes, -1);
  t.Write("memory.max", "-5\n");
  EXPECT_EQ(CgroupMemoryRoom(v2, "0::/\n").bytes, -1);
  t.Write("memory.max", "99999999999999999999999\n");
  EXPECT_EQ(CgroupMemoryRoom(v2, "0::/\n").bytes, -1);
  t.Write("memory.max", "1000\n");
  t.Write("memory.current", "\n");
  EXPECT_EQ(CgroupMemoryRoom(v2, "0::/\n").bytes, -1);
  t.Write("memory.current", "10\n");
  EXPECT_EQ(CgroupMemoryRoom(v2, "0::/\n").bytes, 990);
}

// Run by ARealMemoryCgroupLimitBoundsTheRoom as a child process: joins the cgroup it is given and
// prints whether it got in and the room it finds.
TEST(HostMemoryTest, ChildReportsItsRoom) {
  const char* procs = std::getenv("MOONEP_TEST_CGROUP_PROCS");
  if (procs == nullptr) GTEST_SKIP() << "run by ARealMemoryCgroupLimitBoundsTheRoom";
  std::FILE* f = std::fopen(procs, "w");
  const bool joined = f != nullptr && std::fprintf(f, "%d\n", static_cast<int>(getpid())) > 0 &&
                      std::fclose(f) == 0;
  const HostMemoryRoom room = HostMemoryRoomNow();
  std::printf("ROOM %d %lld %s\n", joined ? 1 : 0, static_cast<long long>(room.bytes),
              room.cgroup_dir.empty() ? "-" : room.cgroup_dir.c_str());
}

// Writes `text` to `path` (a cgroup file: the kernel's refusal shows at the flush).
bool WriteCgroupFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  const bool wrote = std::fputs(text.c_str(), f) >= 0;
  return std::fclose(f) == 0 && wrote;
}

// On a cgroup v1 memory hierarchy this process may write to (root, as on this project's VM): a
// child cgroup with a 1 GiB limit, a child process in it, and the room that process finds is that
// cgroup's, at most 1 GiB, whatever MemAvailable says. Skipped where no cgroup can be made, or the
// child cannot join it or does not see it.
TEST(HostMemoryTest, ARealMemoryCgroupLimitBoundsTheRoom) {
  if (std::getenv("MOONEP_TEST_CGROUP_PROCS") != nullptr) GTEST_SKIP() << "the child";
  std::ifstream self("/proc/self/cgroup");
  std::string line, path;
  while (std::getline(self, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    if (line.substr(a + 1, b - a - 1) == "memory") path = line.substr(b + 1);
  }
  if (path.empty()) GTEST_SKIP() << "no cgroup v1 memory controller here";
  std::string base = "/sys/fs/cgroup/memory" + (path == "/" ? std::string() : path);
  if (access(base.c_str(), W_OK) != 0) base = "/sys/fs/cgroup/memory";
  const std::string dir = base + "/moonep_test_" + std::to_string(getpid());
  if (mkdir(dir.c_str(), 0755) != 0) GTEST_SKIP() << "cannot make a cgroup under " << base;
  constexpr int64_t kLimit = int64_t{1} << 30;
  const bool limited = WriteCgroupFile(dir + "/memory.limit_in_bytes", std::to_string(kLimit));
  std::string out;
  char exe[4096] = {};
  if (limited && readlink("/proc/self/exe", exe, sizeof(exe) - 1) > 0) {
    const std::string command = "env -u GTEST_SHARD_INDEX -u GTEST_TOTAL_SHARDS "
                                "MOONEP_TEST_CGROUP_PROCS='" + dir + "/cgroup.procs' '" +
                                std::string(exe) +
                                "' --gtest_filter=HostMemoryTest.ChildReportsItsRoom 2>&1";
    if (std::FILE* child = popen(command.c_str(), "r")) {
      char buf[512];
      while (std::fgets(buf, sizeof(buf), child) != nullptr) out += buf;
      pclose(child);
    }
  }
  for (int i = 0; i < 100 && rmdir(dir.c_str()) != 0; ++i) usleep(10000);  // the child has exited
  if (!limited) GTEST_SKIP() << "cannot set a limit on " << dir;
  const size_t at = out.find("ROOM ");
  ASSERT_NE(at, std::string::npos) << out;
  int joined = 0;
  long long bytes = -1;
  char seen[4096] = {};
  ASSERT_EQ(std::sscanf(out.c_str() + at, "ROOM %d %lld %4095s", &joined, &bytes, seen), 3) << out;
  if (!joined) GTEST_SKIP() << "the child could not join " << dir;
  if (std::string(seen) != dir) {
    GTEST_SKIP() << "the child's cgroup is not visible as " << dir << " (it found " << seen << ")";
  }
  EXPECT_GT(bytes, 0) << out;
  EXPECT_LE(bytes, kLimit) << out;
}

}  // namespace
}  // namespace moonep
