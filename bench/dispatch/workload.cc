#include "bench/dispatch/workload.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/strings/str_format.h"
#include "moonep/core/status.h"

namespace moonep::bench {

std::string SkewSpec::Label() const {
  return kind == Kind::kZipf ? absl::StrFormat("zipf=%g", value)
                             : absl::StrFormat("maxvio=%g", value);
}

uint64_t Mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  // splitmix64 finalizer over a combination of the four coordinates.
  auto fin = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t h = fin(a + 0x9e3779b97f4a7c15ull);
  h = fin(h ^ (b + 0x632be59bd9b4e019ull));
  h = fin(h ^ (c + 0x85ebca6b0f7c1e35ull));
  return fin(h ^ (d + 0xc2b2ae3d27d4eb4full));
}

double WeightValue(int32_t expert, int32_t m, int64_t i, int64_t hidden, int64_t intermediate) {
  const double fan_in = static_cast<double>(m == 2 ? intermediate : hidden);
  const double u = static_cast<double>(Mix(4, expert, m, i) % 2001) / 1000.0 - 1.0;
  return u / std::sqrt(fan_in);
}

void FillWeights(int32_t expert, int32_t m, int64_t hidden, int64_t intermediate, DType dtype,
                 int64_t count, void* out) {
  for (int64_t i = 0; i < count; ++i) {
    StoreFromFloat(out, dtype, static_cast<size_t>(i),
                   static_cast<float>(WeightValue(expert, m, i, hidden, intermediate)));
  }
}

double MaxVio(absl::Span<const int64_t> totals) {
  if (totals.empty()) return 0.0;
  const int64_t sum = std::accumulate(totals.begin(), totals.end(), int64_t{0});
  if (sum == 0) return 0.0;
  const int64_t mx = *std::max_element(totals.begin(), totals.end());
  return static_cast<double>(mx) * static_cast<double>(totals.size()) / static_cast<double>(sum) -
         1.0;
}

void ZipfTotals(double s, absl::Span<const int32_t> order, int64_t entries, int64_t cap,
                std::vector<int64_t>* totals) {
  const size_t E = order.size();
  std::vector<double> p(E);  // by popularity rank, non-increasing
  for (size_t i = 0; i < E; ++i) p[i] = std::pow(static_cast<double>(i + 1), -s);
  // Water-filling: the j most popular are capped, the rest get c * p_i with c filling the rest.
  std::vector<double> suffix(E + 1, 0.0);
  for (size_t i = E; i-- > 0;) suffix[i] = suffix[i + 1] + p[i];
  size_t capped = 0;
  double c = 0.0;
  for (; capped < E; ++capped) {
    c = static_cast<double>(entries - static_cast<int64_t>(capped) * cap) / suffix[capped];
    if (c * p[capped] <= static_cast<double>(cap)) break;
  }
  std::vector<double> quota(E);
  for (size_t i = 0; i < E; ++i) {
    quota[i] = i < capped ? static_cast<double>(cap) : std::min<double>(cap, c * p[i]);
  }
  // Largest remainder, never above cap.
  std::vector<int64_t> q(E);
  int64_t assigned = 0;
  for (size_t i = 0; i < E; ++i) {
    q[i] = std::min<int64_t>(cap, static_cast<int64_t>(std::floor(quota[i])));
    assigned += q[i];
  }
  std::vector<size_t> idx(E);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    return quota[a] - std::floor(quota[a]) > quota[b] - std::floor(quota[b]);
  });
  for (size_t j = 0; assigned < entries; j = (j + 1) % E) {
    if (q[idx[j]] < cap) {
      ++q[idx[j]];
      ++assigned;
    }
  }
  for (size_t j = E; assigned > entries && j-- > 0;) {  // floating error on the other side
    if (q[idx[j]] > 0) {
      --q[idx[j]];
      --assigned;
    }
  }
  totals->assign(E, 0);
  for (size_t i = 0; i < E; ++i) (*totals)[order[i]] = q[i];
}

absl::StatusOr<Routing> MakeRouting(const RoutingSpec& spec) {
  const int32_t R = spec.num_ranks, E = spec.num_experts, K = spec.top_k;
  const int64_t T = spec.tokens;
  MOONEP_CHECK_ARG(R >= 1, "ranks must be >= 1, got %d", R);
  MOONEP_CHECK_ARG(E >= 1, "--experts must be >= 1, got %d", E);
  MOONEP_CHECK_ARG(K >= 1 && K <= E, "--topk must be in [1, experts=%d], got %d", E, K);
  MOONEP_CHECK_ARG(T >= 1, "--tokens must be >= 1, got %d", T);
  // Checked before any product: R * T * K must not overflow, and the transports index a rank's
  // entries with int32. R * T * K then fits int64 (R < 2^31).
  MOONEP_CHECK_ARG(T <= kMaxEntriesPerRank / K,
                   "--tokens * --topk = %d * %d is above %d, the most entries a rank can route",
                   T, K, kMaxEntriesPerRank);
  const int64_t entries = static_cast<int64_t>(R) * T * K, cap = static_cast<int64_t>(R) * T;

  Routing out;
  out.num_ranks = R;
  out.num_experts = E;
  out.top_k = K;
  out.tokens = T;
  std::mt19937_64 rng(spec.seed);
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);

  if (spec.skew.kind == SkewSpec::Kind::kZipf) {
    MOONEP_CHECK_ARG(spec.skew.value >= 0 && spec.skew.value <= 100,
                     "--zipf must be in [0, 100], got %g", spec.skew.value);
    out.zipf_s = spec.skew.value;
  } else {
    const double target = spec.skew.value, reachable = static_cast<double>(E) / K - 1.0;
    MOONEP_CHECK_ARG(target >= 0, "--maxvio must be >= 0, got %g", target);
    MOONEP_CHECK_ARG(target <= reachable + 1e-9,
                     "--maxvio=%g cannot be reached with experts=%d, topk=%d: the most skewed "
                     "routing (K experts take every token) has maxvio E/K - 1 = %g",
                     target, E, K, reachable);
    std::vector<int64_t> totals;
    auto vio = [&](double s) {
      ZipfTotals(s, order, entries, cap, &totals);
      return MaxVio(totals);
    };
    double lo = 0.0, hi = 1.0;
    if (vio(0.0) >= target) {
      hi = 0.0;
    } else {
      while (vio(hi) < target && hi < 1e4) hi *= 2;
      for (int it = 0; it < 100 && hi - lo > 1e-12; ++it) {
        const double mid = 0.5 * (lo + hi);
        (vio(mid) < target ? lo : hi) = mid;
      }
    }
    out.zipf_s = hi;
  }
  ZipfTotals(out.zipf_s, order, entries, cap, &out.totals);
  out.maxvio = MaxVio(out.totals);

  // Split each expert's total over sources: base share, remainders dealt round-robin.
  out.counts.assign(static_cast<size_t>(R) * E, 0);
  int32_t next = 0;
  for (int32_t e = 0; e < E; ++e) {
    const int64_t base = out.totals[e] / R, rem = out.totals[e] % R;
    for (int32_t r = 0; r < R; ++r) out.counts[static_cast<size_t>(r) * E + e] = base;
    for (int64_t i = 0; i < rem; ++i) {
      ++out.counts[static_cast<size_t>(next) * E + e];
      next = (next + 1) % R;
    }
  }

  // Per rank: column-major layout over the T x K grid in a random expert order, then shuffles.
  out.ids.assign(static_cast<size_t>(entries), -1);
  std::vector<int32_t> grid(static_cast<size_t>(T * K)), experts(E), perm(static_cast<size_t>(T));
  for (int32_t r = 0; r < R; ++r) {
    std::mt19937_64 rank_rng(spec.seed * 1000003ull + static_cast<uint64_t>(r) + 17);
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rank_rng);
    int64_t pos = 0;
    for (int32_t e : experts) {
      const int64_t c = out.counts[static_cast<size_t>(r) * E + e];
      for (int64_t i = 0; i < c; ++i, ++pos) {
        grid[static_cast<size_t>((pos % T) * K + pos / T)] = e;
      }
    }
    if (pos != T * K) return Internal("routing: rank %d has %d entries, want %d", r, pos, T * K);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rank_rng);
    int32_t* ids = out.ids.data() + static_cast<size_t>(r) * T * K;
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(grid.data() + static_cast<size_t>(perm[t]) * K, K, ids + t * K);
      std::shuffle(ids + t * K, ids + (t + 1) * K, rank_rng);
    }
  }
  return out;
}

}  // namespace moonep::bench
