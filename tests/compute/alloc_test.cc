// Steady state allocates nothing: after a first call has sized the executor's small index
// vectors, Forward and Backward make no heap allocation at all (counted by replacing the global
// operator new in this test binary).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>
#include <thread>

#include "moonep/compute/cpu/cpu_executor.h"
#include "moonep/core/worker_pool.h"
#include "tests/compute/problem.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};
}  // namespace

// The replacements below are malloc-based on purpose; GCC's mismatch check cannot see that.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

void* operator new(size_t size) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  void* p = std::malloc(size == 0 ? 1 : size);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](size_t size) { return operator new(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace moonep::compute {
namespace {

// First in this binary (a fresh process): a Run whose caller waits long enough for its wait to
// read the clock (a worker's task takes 20 ms). That wait read MOONEP_TIMEOUT_MS the first time
// it got there, and the knob's first read allocates: the executor test below failed about once
// in two full suite runs under ctest -j2, where the load made a wait of its own that long. The
// pool now reads the knob when it is made.
TEST(WorkerPool, ALongWaitAllocatesNothing) {
  WorkerPool pool(2);
  ASSERT_EQ(pool.size(), 2);
  std::atomic<int> long_tasks{0};
  auto run = [&](bool slow) {
    std::atomic<bool> taken{false};
    pool.Run(2, [&](int64_t, int worker) {
      if (worker != 0) {
        taken = true;
        if (slow) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          ++long_tasks;
        }
        return;
      }
      // The caller's task: return once a worker holds the other one (bounded), so that the
      // caller waits for it.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!taken.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    });
  };
  run(/*slow=*/false);  // sizes the pool's per-task state
  g_allocations = 0;
  g_counting = true;
  run(/*slow=*/true);
  g_counting = false;
  EXPECT_EQ(long_tasks.load(), 1) << "a worker did not take the slow task";
  EXPECT_EQ(g_allocations.load(), 0);
}

TEST(Executor, NoAllocationPerCallInSteadyState) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    testing::ProblemSpec spec;
    spec.hidden = 24;
    spec.intermediate = 16;
    spec.dtype = dt;
    spec.counts = {300, 0, 7, 40, 1};
    spec.pad_multiple = 8;
    testing::Problem p(spec);
    auto made = cpu::CpuExecutor::Create(ExecutorConfig{24, 16, dt, p.view.total_rows, 2});
    ASSERT_TRUE(made.ok());
    auto& ex = *made;
    testing::Buffer y(p.view.total_rows, 24, dt), dx(p.view.total_rows, 24, dt);
    ASSERT_TRUE(ex->Forward(p.view, p.x.view(), y.view(), {}).ok());
    ASSERT_TRUE(ex->Backward(p.view, p.x.view(), p.dy.view(), dx.view(), {}).ok());
    g_allocations = 0;
    g_counting = true;
    for (int rep = 0; rep < 3; ++rep) {
      ASSERT_TRUE(ex->Forward(p.view, p.x.view(), y.view(), {}).ok());
      ASSERT_TRUE(ex->Backward(p.view, p.x.view(), p.dy.view(), dx.view(), {}).ok());
    }
    g_counting = false;
    EXPECT_EQ(g_allocations.load(), 0) << DTypeName(dt);
  }
}

}  // namespace
}  // namespace moonep::compute
