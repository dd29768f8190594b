#include "moonep/core/worker_pool.h"
#include <cstdio>
#include <thread>
#include <vector>
using namespace moonep;
int main() {
  int bad = 0;
  for (int threads : {2, 3, 5}) {
    WorkerPool pool(threads, std::chrono::microseconds(30));
    std::vector<int64_t> data(64, 0);
    for (int phase = 0; phase < 2000; ++phase) {
      const int64_t tasks = 1 + phase % 7;
      // caller writes, workers read (publication), workers write, caller reads (join)
      for (int64_t t = 0; t < tasks; ++t) data[t] = phase;
      pool.Run(tasks, [&](int64_t t, int) { data[t] = data[t] * 2 + 1; });
      for (int64_t t = 0; t < tasks; ++t) bad += data[t] != phase * 2 + 1;
      if (phase % 500 == 499) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    // two callers on one pool
    auto caller = [&pool](int seed, int* errs) {
      std::vector<int64_t> out(16);
      for (int phase = 0; phase < 1000; ++phase) {
        const int64_t tasks = 1 + (phase + seed) % 9;
        pool.Run(tasks, [&](int64_t t, int) { out[t] = t * 10 + seed; });
        for (int64_t t = 0; t < tasks; ++t) *errs += out[t] != t * 10 + seed;
      }
    };
    int e1 = 0, e2 = 0;
    std::thread a(caller, 1, &e1), b(caller, 2, &e2);
    a.join(); b.join();
    bad += e1 + e2;
  }
  printf("bad=%d\n", bad);
  return bad != 0;
}
