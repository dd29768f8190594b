// ab_main OLD.so NEW.so SHAPE POLICY CHECK DECIDE BLOCKS ITERS: loads two planner builds (ab_lib.cc)
// into one process and alternates blocks of ITERS plans of each on the same inputs; prints the
// medians and minimums of the per-block times and the median of the per-pair ratios new / old.
// With N=n in the environment it runs n plans of NEW.so only and exits (for callgrind).
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

typedef void* (*Setup)(int, int, int, int);
typedef double (*Block)(void*, int);

int main(int argc, char** argv) {
  if (argc < 9) {
    std::fprintf(stderr, "usage: %s OLD.so NEW.so SHAPE POLICY CHECK DECIDE BLOCKS ITERS\n", argv[0]);
    return 2;
  }
  void* la = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  void* lb = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
  if (!la || !lb) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  const int shape = atoi(argv[3]), policy = atoi(argv[4]), check = atoi(argv[5]),
            decide = atoi(argv[6]), blocks = atoi(argv[7]), iters = atoi(argv[8]);
  Setup sa = (Setup)dlsym(la, "ab_setup"), sb = (Setup)dlsym(lb, "ab_setup");
  Block ba = (Block)dlsym(la, "ab_block"), bb = (Block)dlsym(lb, "ab_block");
  void* hb = sb(shape, policy, check, decide);
  if (const char* n = getenv("N")) {
    bb(hb, atoi(n));
    return 0;
  }
  void* ha = sa(shape, policy, check, decide);
  ba(ha, iters);
  bb(hb, iters);
  std::vector<double> a, b, r;
  for (int k = 0; k < blocks; ++k) {
    const double x = ba(ha, iters), y = bb(hb, iters);
    a.push_back(x);
    b.push_back(y);
    r.push_back(y / x);
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  std::sort(r.begin(), r.end());
  std::printf("shape %d policy %d check %d decide %d: old median %.2f min %.2f us | new median %.2f "
              "min %.2f us | new/old median of pair ratios %.3f\n",
              shape, policy, check, decide, a[blocks / 2], a[0], b[blocks / 2], b[0], r[blocks / 2]);
  return 0;
}
