// The executors' MOONEP_* variables, as their creation reads them. Every knob is read once per
// process, so each case runs in a fresh process: a gtest death test in the "threadsafe" style
// re-executes this binary for the case, with the variable set, and the case prints what creation
// returned and exits 0; the parent matches that line. No GPU needed: the CUDA executor checks its
// variables before any CUDA call.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "moonep/compute/cpu/cpu_executor.h"
#include "moonep/compute/executor.h"
#include "moonep/core/env.h"
#ifdef MOONEP_TEST_CUDA_EXECUTOR
#include "moonep/compute/cuda/cuda_executor.h"
#endif

namespace moonep::compute {
namespace {

// Sets `name` to `value` for this test (and the child it re-executes), restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

class EnvKnobsTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

// In the child: prints `line` on stderr and exits 0 (the parent matches the line).
[[noreturn]] void Report(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  std::_Exit(0);
}

std::string Describe(const absl::Status& s) {
  if (s.ok()) return "OK";
  return std::string(absl::StatusCodeToString(s.code())) + ": " + std::string(s.message());
}

ExecutorConfig SmallConfig(int32_t num_threads = 0) {
  ExecutorConfig c;
  c.hidden = 32;
  c.intermediate = 16;
  c.dtype = DType::kFloat32;
  c.max_rows = 64;
  c.num_threads = num_threads;
  return c;
}

// What CpuExecutor::Create gives: "threads N" or the status.
[[noreturn]] void CreateCpuAndReport(int32_t num_threads) {
  std::string line;
  {
    auto ex = cpu::CpuExecutor::Create(SmallConfig(num_threads));
    line = ex.ok() ? "threads " + std::to_string((*ex)->num_threads()) : Describe(ex.status());
  }
  Report(line);
}

TEST_F(EnvKnobsTest, NegativeNumThreadsFailsCpuExecutorCreationNamingIt) {
  // It meant every core, silently.
  ScopedEnv env("MOONEP_NUM_THREADS", "-1");
  EXPECT_EXIT(CreateCpuAndReport(0), ::testing::ExitedWithCode(0),
              "INVALID_ARGUMENT: MOONEP_NUM_THREADS=-1: out of range \\[0, 9223372036854775807\\]");
}

TEST_F(EnvKnobsTest, MalformedNumThreadsFailsCpuExecutorCreationNamingIt) {
  ScopedEnv env("MOONEP_NUM_THREADS", "4 threads");
  EXPECT_EXIT(CreateCpuAndReport(0), ::testing::ExitedWithCode(0),
              "INVALID_ARGUMENT: MOONEP_NUM_THREADS=4 threads: not a base-10 integer");
}

TEST_F(EnvKnobsTest, BadNumThreadsFailsEvenWhenTheConfigSetsTheThreads) {
  // Checked like MOONEP_HOST_THREADS: a typo fails whatever the config says.
  ScopedEnv env("MOONEP_NUM_THREADS", "-3");
  EXPECT_EXIT(CreateCpuAndReport(2), ::testing::ExitedWithCode(0),
              "INVALID_ARGUMENT: MOONEP_NUM_THREADS=-3");
}

TEST_F(EnvKnobsTest, NumThreadsIsUsedWhenTheConfigLeavesItOpen) {
  ScopedEnv env("MOONEP_NUM_THREADS", "3");
  EXPECT_EXIT(CreateCpuAndReport(0), ::testing::ExitedWithCode(0), "threads 3\n");
  EXPECT_EXIT(CreateCpuAndReport(2), ::testing::ExitedWithCode(0), "threads 2\n");
}

TEST_F(EnvKnobsTest, NumThreadsBeyondInt64IsCappedAtTheMaximum) {
  // Digits beyond int64 are a large count (capped at kMaxExecutorThreads like 5000 would be), not
  // a malformed value.
  ScopedEnv env("MOONEP_NUM_THREADS", "99999999999999999999");
  EXPECT_EXIT(CreateCpuAndReport(1), ::testing::ExitedWithCode(0), "threads 1\n");
  EXPECT_EXIT(CreateCpuAndReport(0), ::testing::ExitedWithCode(0),
              "threads " + std::to_string(kMaxExecutorThreads) + "\n");
}

TEST_F(EnvKnobsTest, TimeoutBeyondInt64IsCappedNotRefused) {
  // It was refused as "not a base-10 integer" although the documentation caps large timeouts.
  ScopedEnv env("MOONEP_TIMEOUT_MS", "99999999999999999999");
  EXPECT_EXIT(Report(Describe(param::CheckedTimeoutMs().status()) + " timeout " +
                     std::to_string(param::TimeoutMs())),
              ::testing::ExitedWithCode(0), "OK timeout 1000000000000\n");
}

TEST_F(EnvKnobsTest, NegativeTimeoutBeyondInt64IsOutOfRange) {
  ScopedEnv env("MOONEP_TIMEOUT_MS", "-99999999999999999999");
  EXPECT_EXIT(Report(Describe(param::CheckedTimeoutMs().status())), ::testing::ExitedWithCode(0),
              "INVALID_ARGUMENT: MOONEP_TIMEOUT_MS=-99999999999999999999: out of range \\[1, ");
}

#ifdef MOONEP_TEST_CUDA_EXECUTOR

// What CudaExecutor::Create gives when the environment (or the options) are refused before any
// CUDA call: an InvalidArgument, on a machine with or without a GPU. With a good environment the
// result depends on the machine, so only "not InvalidArgument" is reported then.
[[noreturn]] void CreateCudaAndReport(int num_streams = 0) {
  std::string line;
  {
    cuda::CudaExecutorOptions o;
    o.num_streams = num_streams;
    auto ex = cuda::CudaExecutor::Create(SmallConfig(), o);
    line = !ex.ok() && absl::IsInvalidArgument(ex.status()) ? Describe(ex.status())
                                                            : std::string("not refused");
  }
  Report(line);
}

[[noreturn]] void CheckCudaEnvAndReport() { Report(Describe(cuda::CheckCudaGemmEnvironment())); }

TEST_F(EnvKnobsTest, CudaGemmStreamsOutsideOneToSixteenIsRefusedNotClamped) {
  // 0 gave one stream (not the default 4), 17 gave 16, without a word.
  for (const char* bad : {"0", "17", "-4"}) {
    ScopedEnv env("MOONEP_CUDA_GEMM_STREAMS", bad);
    EXPECT_EXIT(CheckCudaEnvAndReport(), ::testing::ExitedWithCode(0),
                std::string("INVALID_ARGUMENT: MOONEP_CUDA_GEMM_STREAMS=") + bad +
                    ": out of range \\[1, 16\\]");
    EXPECT_EXIT(CreateCudaAndReport(), ::testing::ExitedWithCode(0),
                std::string("INVALID_ARGUMENT: MOONEP_CUDA_GEMM_STREAMS=") + bad);
  }
  ScopedEnv env("MOONEP_CUDA_GEMM_STREAMS", "4x");
  EXPECT_EXIT(CheckCudaEnvAndReport(), ::testing::ExitedWithCode(0),
              "INVALID_ARGUMENT: MOONEP_CUDA_GEMM_STREAMS=4x: not a base-10 integer");
}

TEST_F(EnvKnobsTest, CudaGemmStreamsInRangeIsAccepted) {
  for (const char* good : {"1", "16"}) {
    ScopedEnv env("MOONEP_CUDA_GEMM_STREAMS", good);
    EXPECT_EXIT(CheckCudaEnvAndReport(), ::testing::ExitedWithCode(0), "OK\n");
    EXPECT_EXIT(CreateCudaAndReport(), ::testing::ExitedWithCode(0), "not refused\n");
  }
}

TEST_F(EnvKnobsTest, NegativeCudaGemmThresholdsAreRefused) {
  for (const char* name :
       {"MOONEP_CUDA_GEMM_STREAMS_MIN_ROWS", "MOONEP_CUDA_GEMM_PERSISTENT_MAX_ROWS"}) {
    {
      ScopedEnv env(name, "-1");
      EXPECT_EXIT(CreateCudaAndReport(), ::testing::ExitedWithCode(0),
                  std::string("INVALID_ARGUMENT: ") + name + "=-1: out of range \\[0, ");
    }
    {
      ScopedEnv env(name, "0");  // 0 is a threshold like any other
      EXPECT_EXIT(CheckCudaEnvAndReport(), ::testing::ExitedWithCode(0), "OK\n");
    }
  }
}

TEST_F(EnvKnobsTest, UnknownCudaGemmStrategyIsRefusedBeforeAnyCudaCall) {
  ScopedEnv env("MOONEP_CUDA_GEMM_STRATEGY", "fastest");
  EXPECT_EXIT(CreateCudaAndReport(), ::testing::ExitedWithCode(0),
              "INVALID_ARGUMENT: MOONEP_CUDA_GEMM_STRATEGY: GEMM strategy 'fastest' is not one of");
}

TEST_F(EnvKnobsTest, CudaExecutorOptionsStreamsAboveSixteenAreRefused) {
  EXPECT_EXIT(CreateCudaAndReport(17), ::testing::ExitedWithCode(0),
              "INVALID_ARGUMENT: options.num_streams 17 is outside \\[0, 16\\]");
  EXPECT_EXIT(CreateCudaAndReport(-1), ::testing::ExitedWithCode(0),
              "INVALID_ARGUMENT: options.num_streams -1 is outside \\[0, 16\\]");
}

#endif  // MOONEP_TEST_CUDA_EXECUTOR

}  // namespace
}  // namespace moonep::compute
