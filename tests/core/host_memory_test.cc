// Host allocations that cannot fit are refused with an error (before the zero-fill that would
// run the process into the out-of-memory killer): the check against /proc/meminfo.
#include "moonep/core/host_memory.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>

namespace moonep {
namespace {

TEST(HostMemoryTest, AvailableIsMemAvailableOfProcMeminfo) {
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
  const int64_t bytes = HostMemoryAvailableBytes();
  const int64_t total = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  EXPECT_GT(bytes, 0);
  EXPECT_LE(bytes, total);
  // Read again a moment later: near the file's figure (other processes move it: within a quarter
  // of it, or 512 MiB where little is free).
  const double slack = std::max(0.25 * kib * 1024, 512.0 * (1 << 20));
  EXPECT_NEAR(static_cast<double>(bytes), static_cast<double>(kib) * 1024, slack);
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
  EXPECT_NE(s.message().find("MemAvailable"), std::string::npos) << s;
  EXPECT_FALSE(CheckHostAllocation(UINT64_MAX, "everything").ok());
}

}  // namespace
}  // namespace moonep
