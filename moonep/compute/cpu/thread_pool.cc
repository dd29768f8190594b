#include "moonep/compute/cpu/thread_pool.h"

namespace moonep::compute::cpu {

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  workers_.reserve(num_threads_ - 1);
  for (int w = 1; w < num_threads_; ++w) workers_.emplace_back([this, w] { WorkerLoop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Drain(int worker) {
  for (;;) {
    const int64_t task = next_.fetch_add(1, std::memory_order_relaxed);
    if (task >= num_tasks_) return;
    fn_(context_, task, worker);
  }
}

void ThreadPool::RunImpl(int64_t num_tasks, TaskFn fn, void* context) {
  if (num_tasks <= 0) return;
  if (num_threads_ == 1 || num_tasks == 1) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(context, t, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = fn;
    context_ = context;
    num_tasks_ = num_tasks;
    next_.store(0, std::memory_order_relaxed);
    busy_ = num_threads_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  Drain(0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return busy_ == 0; });
}

void ThreadPool::WorkerLoop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    Drain(worker);
    std::lock_guard<std::mutex> lock(mutex_);
    if (--busy_ == 0) done_cv_.notify_one();
  }
}

}  // namespace moonep::compute::cpu
