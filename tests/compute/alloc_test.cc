// Steady state allocates nothing: after a first call has sized the executor's small index
// vectors, Forward and Backward make no heap allocation at all (counted by replacing the global
// operator new in this test binary).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "moonep/compute/cpu/cpu_executor.h"
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
