// The planner benchmark's shapes and routing counts, shared by moonep-bench-planner and the
// same-process A/B harness (bench/planner/ab).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace moonep::planner::bench {

struct Shape {
  const char* name;
  int R, E, K;
  int64_t tokens;  // per rank
};
inline constexpr Shape kShapes[] = {
    {"EP64_E256_K8", 64, 256, 8, 4096},
    {"EP128_E896_K16", 128, 896, 16, 4096},
    {"EP1024_E8192_K8", 1024, 8192, 8, 4096},
};

// counts[R][E]: each rank routes tokens*K entries over a Zipf(exponent) popularity on a fixed
// random permutation of experts, with +-20% per-rank noise (expected counts, not sampled tokens).
inline std::vector<int64_t> ZipfCounts(const Shape& s, double exponent, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> perm(s.E);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<double> p(s.E);
  for (int i = 0; i < s.E; ++i) p[perm[i]] = 1.0 / std::pow(i + 1.0, exponent);
  const double sum = std::accumulate(p.begin(), p.end(), 0.0);
  std::uniform_real_distribution<double> noise(0.8, 1.2);
  std::vector<int64_t> counts(static_cast<size_t>(s.R) * s.E);
  for (int r = 0; r < s.R; ++r) {
    for (int e = 0; e < s.E; ++e) {
      counts[static_cast<size_t>(r) * s.E + e] =
          static_cast<int64_t>(static_cast<double>(s.tokens * s.K) * p[e] / sum * noise(rng));
    }
  }
  return counts;
}

}  // namespace moonep::planner::bench
