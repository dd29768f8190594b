// phases_main NEW.so SHAPE POLICY CHECK DECIDE BLOCKS ITERS: times BLOCKS blocks of ITERS plans of
// one planner build (ab_lib.cc) in one process, on one planner and the same four inputs, and
// between blocks two fixed workloads that do not involve the planner: an L2-resident integer
// loop (`compute`) and a sequential read of 4 MiB (`stream`). Prints every block, then the blocks
// grouped by plan time (5 us bins) with the mean times of the two workloads in each group: when
// the plan time moves between groups while the workloads stay put, the machine's phase slows
// the planner's own accesses (docs/planner.md, "Seventh round").
#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "ab_args.h"

typedef void* (*Setup)(int, int, int, int);
typedef double (*Block)(void*, int);

namespace {

double Micros(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<uint64_t> table(32768);  // 256 KiB
std::vector<uint64_t> stream(1 << 19);  // 4 MiB

double Compute() {
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t x = 1, acc = 0;
  for (int i = 0; i < 400000; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    acc += table[x & 32767] + (x >> 3) * 7;
    table[(x >> 20) & 32767] = acc;
  }
  if (acc == 42) std::printf("!");
  return Micros(t0);
}

double Stream() {
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t acc = 0;
  for (size_t i = 0; i < stream.size(); i += 8) acc += stream[i];
  if (acc == 42) std::printf("!");
  return Micros(t0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) {
    std::fprintf(stderr, "usage: %s NEW.so SHAPE POLICY CHECK DECIDE BLOCKS ITERS\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  Setup setup = (Setup)dlsym(lib, "ab_setup");
  Block block = (Block)dlsym(lib, "ab_block");
  AbArgs args;
  if (!ParseAbArgs(argv + 2, &args)) return 2;
  const int shape = args.shape, policy = args.policy, check = args.check, decide = args.decide,
            blocks = args.blocks, iters = args.iters;
  if (setup == nullptr || block == nullptr) {
    std::fprintf(stderr, "dlsym: ab_setup/ab_block missing: %s\n", dlerror());
    return 1;
  }
  void* h = setup(shape, policy, check, decide);
  if (h == nullptr) return 1;  // ab_setup said why
  block(h, iters);
  struct Group {
    int n = 0;
    double compute = 0, stream = 0;
  };
  std::map<int, Group> groups;
  for (int b = 0; b < blocks; ++b) {
    const double c = Compute();
    const double t = block(h, iters);
    const double s = Stream();
    std::printf("block %d: plan %.1f us, compute %.0f us, stream %.0f us\n", b, t, c, s);
    Group& g = groups[static_cast<int>(t / 5) * 5];
    ++g.n;
    g.compute += c;
    g.stream += s;
  }
  std::printf("plan us (bin) | blocks | compute us (mean) | stream us (mean)\n");
  for (const auto& [bin, g] : groups) {
    std::printf("%d-%d | %d | %.0f | %.0f\n", bin, bin + 5, g.n, g.compute / g.n, g.stream / g.n);
  }
  return 0;
}
