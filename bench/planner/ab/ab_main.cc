// ab_main OLD.so NEW.so SHAPE POLICY CHECK DECIDE BLOCKS ITERS: loads two planner builds (ab_lib.cc)
// into one process and alternates blocks of ITERS plans of each on the same inputs; prints the
// medians and minimums of the per-block times and the median of the per-pair ratios new / old.
// With N=n in the environment it runs n plans of NEW.so only and exits (for callgrind).
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ab_args.h"

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
  AbArgs args;
  if (!ParseAbArgs(argv + 3, &args)) return 2;
  const int shape = args.shape, policy = args.policy, check = args.check, decide = args.decide,
            blocks = args.blocks, iters = args.iters;
  Setup sa = (Setup)dlsym(la, "ab_setup"), sb = (Setup)dlsym(lb, "ab_setup");
  Block ba = (Block)dlsym(la, "ab_block"), bb = (Block)dlsym(lb, "ab_block");
  if (!sa || !sb || !ba || !bb) {
    std::fprintf(stderr, "dlsym: ab_setup/ab_block missing: %s\n", dlerror());
    return 1;
  }
  void* hb = sb(shape, policy, check, decide);
  if (hb == nullptr) return 1;  // ab_setup said why
  if (const char* n = getenv("N")) {
    bb(hb, atoi(n));
    return 0;
  }
  void* ha = sa(shape, policy, check, decide);
  if (ha == nullptr) return 1;
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
