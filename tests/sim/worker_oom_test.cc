// Out of memory on a simulator worker thread is the run's error, not std::terminate (which ended
// moonep-sim with SIGABRT). Here every allocation made off the main thread fails, as a worker's
// plan would under a memory limit: this binary replaces operator new, so it is a test of its own.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "planner/sim/simulator.h"

namespace {

std::atomic<bool> fail_off_main{false};
std::atomic<int64_t> failed{0};
std::thread::id main_thread;

}  // namespace

void* operator new(std::size_t size) {
  if (fail_off_main.load() && std::this_thread::get_id() != main_thread) {
    ++failed;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(size > 0 ? size : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace moonep::sim {
namespace {

TEST(WorkerOutOfMemoryTest, IsTheRunsOutOfMemoryError) {
  SimOptions o;
  o.routing.kind = RoutingKind::kZipf;
  o.routing.num_ranks = 8;
  o.routing.num_experts = 64;
  o.routing.topk = 2;
  o.routing.tokens_per_rank = 64;
  o.steps = 1000;  // the run ends at the first step a worker takes a policy
  o.policies = {planner::Policy::kMoonEP, planner::Policy::kMoonEPGreedy, planner::Policy::kEplb,
                planner::Policy::kFasterMoEShadow};
  o.cost.hidden = 64;
  o.cost.intermediate = 64;
  o.threads = 5;  // the main thread and four workers share the five policies of each step
  auto sim = Simulator::Create(o);
  ASSERT_TRUE(sim.ok()) << sim.status();
  main_thread = std::this_thread::get_id();
  fail_off_main = true;
  auto result = (*sim)->Run(nullptr, nullptr);
  fail_off_main = false;
  ASSERT_GT(failed.load(), 0) << "no worker thread planned a policy in " << o.steps << " steps";
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
  // The main thread's error (moonep-sim prints it for std::bad_alloc there), with the step and
  // policy it happened at.
  const std::string expected(OutOfMemoryError(o, (*sim)->detail() == Detail::kTotals).message());
  const std::string message(result.status().message());
  EXPECT_NE(message.find("step "), std::string::npos) << message;
  EXPECT_NE(message.find(", policy "), std::string::npos) << message;
  EXPECT_NE(message.find(expected), std::string::npos) << message;
  EXPECT_NE(message.find("lower --ranks, --experts, --tokens or --threads"), std::string::npos)
      << message;
}

}  // namespace
}  // namespace moonep::sim
