// A pool of host threads for fork-join phases: the transport's per-dispatch layouts (a few phases
// of tens of microseconds each) and the CPU executor's tiles. Run() hands out task indices under a mutex, so which
// thread runs a task varies, never what the task computes. Thread w (the caller is 0) takes task w
// first when it is free, so consecutive phases over the same chunks of data find them in the same
// core's cache; then any task left. The calling thread takes tasks too, so a phase never waits for
// a sleeping worker to wake: the caller runs the tasks of workers that have not arrived.
// After a phase, workers poll for the next one for `spin` (so the phases of one call find them
// awake), then sleep on a condition variable (spin 0: at once).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace moonep {

class WorkerPool {
 public:
  // threads >= 1 counts the calling thread: threads - 1 workers are started (fewer where the
  // system refuses a thread: size() says how many run).
  explicit WorkerPool(int threads, std::chrono::microseconds spin = std::chrono::microseconds(200));
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return size_; }

  // Calls fn(task, worker) once for every task in [0, tasks), on this thread and the workers;
  // returns when every call has returned. `worker` in [0, size()) names the thread (0: the caller):
  // calls of one Run that run at once have distinct ones (per-thread scratch). A pool can be
  // shared: while another thread's Run holds the workers, this call runs every task on the calling
  // thread as worker 0 (it never waits for the other). fn must not call Run on the same pool.
  using Task = absl::FunctionRef<void(int64_t task, int worker)>;
  void Run(int64_t tasks, Task fn);

 private:
  void Loop(int worker);
  // Takes task `worker` of generation `gen` if it is free, else the next free one, if any is left.
  bool Claim(uint64_t gen, int worker, int64_t* task, const Task** fn);

  int size_ = 1;
  const std::chrono::microseconds spin_;
  // How long Run's wait for a worker's call goes between warnings (MOONEP_TIMEOUT_MS), read once
  // here: a first read inside Run's wait allocated (the knob's parse), in a call that must not.
  const std::chrono::milliseconds warn_every_;
  std::vector<std::thread> threads_;
  std::mutex run_mu_;  // held by the Run that has the workers
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};   // bumped per Run (under mu_)
  std::atomic<int64_t> done_{0};   // calls of the current Run that returned
  std::atomic<bool> stop_{false};
  int parked_ = 0;                 // workers asleep on cv_ (mu_)
  const Task* fn_ = nullptr;  // the current Run's (mu_)
  int64_t tasks_ = 0, next_ = 0;                          // (mu_) next_: no free task below
  std::vector<char> claimed_;                              // (mu_) per task of the current Run
};

}  // namespace moonep
