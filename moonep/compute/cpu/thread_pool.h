// A fixed pool of worker threads for the CPU executor. Run() hands out task indices dynamically
// (an atomic counter), so which worker runs a task varies, never what the task computes: every
// result is independent of the thread count. The calling thread is worker 0.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace moonep::compute::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }

  // Calls fn(task, worker) for every task in [0, num_tasks), worker in [0, size()); returns when
  // all are done. `fn` is called by reference: no allocation per call.
  template <typename Fn>
  void Run(int64_t num_tasks, Fn& fn) {
    RunImpl(num_tasks, &Invoke<Fn>, &fn);
  }

 private:
  using TaskFn = void (*)(void* context, int64_t task, int worker);
  template <typename Fn>
  static void Invoke(void* context, int64_t task, int worker) {
    (*static_cast<Fn*>(context))(task, worker);
  }
  void RunImpl(int64_t num_tasks, TaskFn fn, void* context);
  void WorkerLoop(int worker);
  void Drain(int worker);

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;  // bumped per Run; workers wait for a new one
  int busy_ = 0;             // workers still draining the current Run
  bool stop_ = false;
  TaskFn fn_ = nullptr;
  void* context_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_{0};
};

}  // namespace moonep::compute::cpu
