// MOONEP_DEBUG_FILE, read once per process: core_logging_file_test sets it to a path with %h and
// %p (every line must land in that file, under the host and pid substituted), and
// core_logging_bad_file_test to a path that cannot be opened (logging falls back to stderr, saying
// so). Without the variable the tests skip. core_worker_pool_stuck_test runs the worker pool's
// warning test below with a short MOONEP_TIMEOUT_MS.
#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_replace.h"
#include "moonep/core/logging.h"
#include "moonep/core/worker_pool.h"

namespace moonep::log {
namespace {

std::string ShortHostName() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) return "unknown";
  std::string name(host);
  return name.substr(0, name.find('.'));
}

TEST(DebugFileTest, LinesGoToTheFileWithHostAndPidSubstituted) {
  const char* path = std::getenv("MOONEP_DEBUG_FILE");
  const char* expect_bad = std::getenv("MOONEP_TEST_DEBUG_FILE_UNOPENABLE");
  if (path == nullptr || expect_bad != nullptr) GTEST_SKIP() << "run by core_logging_file_test";
  const std::string resolved = absl::StrReplaceAll(
      path, {{"%h", ShortHostName()}, {"%p", std::to_string(static_cast<long>(getpid()))}});
  ASSERT_NE(resolved, path) << "the registration's path has %h and %p";
  std::remove(resolved.c_str());
  const std::string marker = "logging-test-marker-" + std::to_string(static_cast<long>(getpid()));
  ::testing::internal::CaptureStderr();
  MOONEP_WARN("%s one", marker);
  SetRank(5);
  MOONEP_WARN("%s two", marker);
  SetRank(-1);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find(marker), std::string::npos) << "logged to stderr too: " << err;
  std::ifstream in(resolved);
  ASSERT_TRUE(in.good()) << "no log file at " << resolved;
  std::stringstream text;
  text << in.rdbuf();
  const std::string prefix = ShortHostName() + ":" + std::to_string(static_cast<long>(getpid())) + ":" +
                             std::to_string(static_cast<long>(syscall(SYS_gettid)));
  EXPECT_NE(text.str().find(prefix + " [rank -1] MoonEP WARN " + marker + " one\n"), std::string::npos)
      << text.str();
  EXPECT_NE(text.str().find(prefix + " [rank 5] MoonEP WARN " + marker + " two\n"), std::string::npos)
      << text.str();
  std::remove(resolved.c_str());
}

TEST(DebugFileTest, AnUnopenablePathFallsBackToStderrSayingSo) {
  const char* path = std::getenv("MOONEP_DEBUG_FILE");
  if (path == nullptr || std::getenv("MOONEP_TEST_DEBUG_FILE_UNOPENABLE") == nullptr) {
    GTEST_SKIP() << "run by core_logging_bad_file_test";
  }
  ::testing::internal::CaptureStderr();
  MOONEP_WARN("fallback line");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(std::string("cannot open MOONEP_DEBUG_FILE=") + path + "; logging to stderr"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("MoonEP WARN fallback line\n"), std::string::npos) << err;
}

// A worker-pool task that does not return (a library call blocked on a worker thread) keeps the
// caller waiting, since the task may still write its buffers, but not silently: a WARN once per
// MOONEP_TIMEOUT_MS (core_worker_pool_stuck_test sets it to 200 ms).
TEST(WorkerPoolTest, AWaitForAStuckTaskSaysSoEveryTimeout) {
  if (std::getenv("MOONEP_TEST_POOL_STUCK") == nullptr) {
    GTEST_SKIP() << "run by core_worker_pool_stuck_test";
  }
  WorkerPool pool(2, std::chrono::microseconds(0));
  ASSERT_EQ(pool.size(), 2);
  std::atomic<bool> started{false};
  std::atomic<int> ran{0};
  ::testing::internal::CaptureStderr();
  const auto begin = std::chrono::steady_clock::now();
  pool.Run(2, [&](int64_t, int worker) {
    if (worker == 0) {
      // The caller's task: return once the worker holds the other one (bounded).
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!started.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    } else {
      started = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(900));
    }
    ++ran;
  });
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                              begin).count();
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(started.load()) << "the worker never took a task";
  EXPECT_EQ(ran.load(), 2);
  EXPECT_GE(ms, 900);  // Run waited for the stuck task: it never abandons one
  EXPECT_NE(err.find("worker pool: 1 of 2 tasks of this phase still running after"),
            std::string::npos)
      << err;
  // 900 ms at 200 ms per warning: at least 2 (the first after ~200 ms, then every 200 ms).
  size_t count = 0;
  for (size_t at = err.find("still running"); at != std::string::npos;
       at = err.find("still running", at + 1)) {
    ++count;
  }
  EXPECT_GE(count, 2u) << err;
}

}  // namespace
}  // namespace moonep::log
