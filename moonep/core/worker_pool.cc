#include "moonep/core/worker_pool.h"

#include <system_error>

#include "moonep/core/env.h"
#include "moonep/core/logging.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MOONEP_PAUSE() _mm_pause()
#else
#define MOONEP_PAUSE() std::this_thread::yield()
#endif

namespace moonep {

WorkerPool::WorkerPool(int threads, std::chrono::microseconds spin)
    : spin_(spin), warn_every_(param::TimeoutMs()) {
  const int want = threads < 1 ? 1 : threads;
  threads_.reserve(static_cast<size_t>(want - 1));
  for (int w = 1; w < want; ++w) {
    try {
      threads_.emplace_back([this, w] { Loop(w); });
    } catch (const std::system_error&) {
      break;  // the system refused another thread: run with those started
    }
  }
  size_ = 1 + static_cast<int>(threads_.size());
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

bool WorkerPool::Claim(uint64_t gen, int worker, int64_t* task,
                       const Task** fn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (gen_.load(std::memory_order_relaxed) != gen) return false;
  int64_t t = worker;
  if (t >= tasks_ || claimed_[static_cast<size_t>(t)]) {
    while (next_ < tasks_ && claimed_[static_cast<size_t>(next_)]) ++next_;
    if (next_ >= tasks_) return false;
    t = next_;
  }
  claimed_[static_cast<size_t>(t)] = 1;
  *task = t;
  *fn = fn_;
  return true;
}

void WorkerPool::Run(int64_t tasks, Task fn) {
  if (tasks <= 0) return;
  std::unique_lock<std::mutex> owner(run_mu_, std::try_to_lock);
  if (size_ == 1 || tasks == 1 || !owner.owns_lock()) {
    for (int64_t t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
  uint64_t gen;
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    tasks_ = tasks;
    next_ = 0;
    claimed_.assign(static_cast<size_t>(tasks), 0);
    done_.store(0, std::memory_order_relaxed);
    gen = gen_.load(std::memory_order_relaxed) + 1;
    gen_.store(gen, std::memory_order_release);
    wake = parked_ > 0;
  }
  if (wake) cv_.notify_all();
  int64_t task;
  const Task* f;
  while (Claim(gen, 0, &task, &f)) {
    (*f)(task, 0);
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
  // Every task is claimed; wait for the workers' calls to return (they are running, not asleep;
  // on a crowded node one may be descheduled, so the wait yields after a while). A call that does
  // not return cannot be abandoned: it may still write the caller's buffers. So the wait has no
  // deadline, but says so once per MOONEP_TIMEOUT_MS instead of hanging silently (a task blocked
  // in a library call, e.g. a BLAS allocation retried under a memory limit).
  std::chrono::steady_clock::time_point start, warn_at;
  for (int64_t i = 0; done_.load(std::memory_order_acquire) < tasks; ++i) {
    if (i < 4096) {
      MOONEP_PAUSE();
      continue;
    }
    std::this_thread::yield();
    // The clock every 64 yields: on a crowded node a yield can take a scheduler slice, and 4096 of
    // them took ~0.9 s (a warning due every 200 ms came once; seen in the suite under ctest -j2).
    if (i % 64 != 0) continue;
    const auto now = std::chrono::steady_clock::now();
    if (i == 4096) {
      start = now;
      warn_at = now + warn_every_;
    } else if (now >= warn_at) {
      MOONEP_WARN("worker pool: %d of %d tasks of this phase still running after %d ms; a worker "
                  "thread is blocked (in a library call?) and cannot be stopped, so the caller "
                  "keeps waiting", tasks - done_.load(std::memory_order_acquire), tasks,
                  std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count());
      warn_at = now + warn_every_;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  fn_ = nullptr;
}

void WorkerPool::Loop(int worker) {
  uint64_t seen = 0;  // the generation before any Run: a worker started late still sees the first
  for (;;) {
    // Poll for a new phase for spin_, then sleep until one comes.
    auto until = std::chrono::steady_clock::now() + spin_;
    for (int i = 0;; ++i) {
      if (stop_.load(std::memory_order_acquire)) return;
      if (gen_.load(std::memory_order_acquire) != seen) break;
      MOONEP_PAUSE();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) {
        std::unique_lock<std::mutex> lock(mu_);
        ++parked_;
        cv_.wait(lock, [&] {
          return stop_.load(std::memory_order_relaxed) ||
                 gen_.load(std::memory_order_relaxed) != seen;
        });
        --parked_;
        if (stop_.load(std::memory_order_relaxed)) return;
        break;
      }
    }
    seen = gen_.load(std::memory_order_acquire);
    int64_t task;
    const Task* f;
    while (Claim(seen, worker, &task, &f)) {
      (*f)(task, worker);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }
}

}  // namespace moonep
