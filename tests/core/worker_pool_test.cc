// WorkerPool: every task runs exactly once per Run, whatever the pool's size, with workers awake
// (back-to-back phases) or asleep (after their spin); the caller sees every task's writes.
#include "moonep/core/worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace moonep {
namespace {

TEST(WorkerPoolTest, EveryTaskRunsOnceInEveryPhase) {
  for (int threads : {1, 2, 3, 8}) {
    WorkerPool pool(threads, std::chrono::microseconds(50));
    EXPECT_EQ(pool.size(), threads);
    std::vector<int> hits;
    for (int phase = 0; phase < 300; ++phase) {
      const int64_t tasks = phase % 11;  // 0 .. 10, fewer and more than threads
      hits.assign(static_cast<size_t>(tasks), 0);
      // Plain writes: Run must publish them to the caller.
      pool.Run(tasks, [&](int64_t t, int) { hits[static_cast<size_t>(t)] += 1; });
      for (int64_t t = 0; t < tasks; ++t) ASSERT_EQ(hits[t], 1) << "phase " << phase << " task " << t;
      // Every 50 phases the workers go to sleep; the next phase must wake them (or run without).
      if (phase % 50 == 49) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
}

TEST(WorkerPoolTest, TasksRunOnSeveralThreadsWhenTheyTakeLong) {
  WorkerPool pool(4, std::chrono::microseconds(100000));
  std::atomic<int> running{0}, most{0};
  pool.Run(4, [&](int64_t, int) {  // wakes the workers
    const int now = running.fetch_add(1) + 1;
    int m = most.load();
    while (now > m && !most.compare_exchange_weak(m, now)) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    running.fetch_sub(1);
  });
  EXPECT_GE(most.load(), 2);  // awake workers take tasks while the caller runs one
}

// Two threads sharing a pool (transports of one process share theirs): each Run gets every one
// of its own tasks once; the one that finds the workers taken runs its tasks itself.
TEST(WorkerPoolTest, ConcurrentRunsOnASharedPoolEachRunTheirOwnTasks) {
  WorkerPool pool(3, std::chrono::microseconds(50));
  auto caller = [&pool](int seed, bool* ok) {
    std::vector<int64_t> out;
    for (int phase = 0; phase < 400; ++phase) {
      const int64_t tasks = 1 + (phase + seed) % 9;
      out.assign(static_cast<size_t>(tasks), 0);
      pool.Run(tasks, [&](int64_t t, int) { out[static_cast<size_t>(t)] += t * 10 + seed; });
      for (int64_t t = 0; t < tasks; ++t) {
        if (out[t] != t * 10 + seed) *ok = false;
      }
    }
  };
  bool ok_a = true, ok_b = true;
  std::thread a(caller, 1, &ok_a), b(caller, 2, &ok_b);
  a.join();
  b.join();
  EXPECT_TRUE(ok_a);
  EXPECT_TRUE(ok_b);
}

TEST(WorkerPoolTest, ANonPositiveSizeIsOneThread) {
  WorkerPool pool(0);
  EXPECT_EQ(pool.size(), 1);
  int64_t sum = 0;
  pool.Run(5, [&](int64_t t, int) { sum += t; });
  EXPECT_EQ(sum, 10);
}

}  // namespace
}  // namespace moonep
