// Thirteenth session: the schedule model's makespans for the benchmark's Zipf shapes (n = 2048,
// 66 clusters), as in docs/cuda.md 'Thirteenth session'. Built against
// persistent_schedule.cc with cuda-schedule-unequal-parts-model-s13.patch applied (it prints
// the patch's Schedule fields; the no-tail column is max_split 1):
//   nvcc -std=c++17 -O2 -I. -Imoonep/include THIS moonep/compute/cuda/persistent_schedule.cc \
//     build-cuda/lib/libmoonep_core.a -labsl_status -labsl_strings -labsl_str_format_internal -labsl_statusor
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>
#include <algorithm>
#include "bench/gemm_cuda/bench_util.cuh"
#include "moonep/compute/cuda/persistent_gemm.h"
using moonep::compute::cuda::PersistentGemm;
using moonep::bench_gemm::GroupSizes;
int main(int argc, char** argv) {
  const int n_tiles = 8, k_iters = argc > 1 ? atoi(argv[1]) : 112;
  for (int g : {8, 32, 64}) for (int avg : {256, 512, 1024}) {
    auto sizes = GroupSizes(g, avg, true, argc > 2 ? atoi(argv[2]) : 1);
    std::vector<double> costs;
    for (auto rows : sizes) {
      bool swap = rows % 256 != 0 && PersistentGemm::PrefersSwap(rows, n_tiles);
      int m_tiles = swap ? rows / 256 * 2 : (rows + 127) / 128;
      int whole = (m_tiles / 2) * n_tiles + (swap ? 0 : (m_tiles % 2) * (n_tiles / 2));
      costs.insert(costs.end(), whole, 1.0);
      if (swap) costs.insert(costs.end(), n_tiles, PersistentGemm::SwapCost(PersistentGemm::SwapRows(rows % 256)));
    }
    double tot = 0; for (double c : costs) tot += c;
    auto t0 = std::chrono::steady_clock::now();
    auto s = PersistentGemm::PlanSchedule(costs, 66, k_iters, 8);
    auto t1 = std::chrono::steady_clock::now();
    auto s1 = PersistentGemm::PlanSchedule(costs, 66, k_iters, 1);
    printf("%2dx%4dz units %4zu avg %.3f  notail %.3f  tail %.3f (%+.1f%%)  split %d units %d parts %zu  %.0f us\n", g, avg, costs.size(), tot / 66,
           s1->makespan, s->makespan, 100 * (s->makespan / s1->makespan - 1), s->split, s->split_units, s->parts.size(),
           std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
}
