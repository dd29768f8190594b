// The workload of moonep-bench-dispatch: routing with a controlled skew, and data whose every value
// is a pure function of its coordinates, so any rank can compute what any buffer must hold.
//
// Routing. The skew is set on the per-expert totals C_e (summed over source ranks), not drawn:
//   - Zipf(s): C_e proportional to 1 / rank(e)^s, rank = position in a seeded permutation of the
//     experts (so hot experts land on arbitrary ranks), water-filled so no C_e exceeds R * T (a
//     token takes an expert at most once), rounded to integers by largest remainder with
//     sum(C) = R * T * K exactly;
//   - a target maxvio = max_e(C_e / mean) - 1: the Zipf exponent that reaches it, by bisection
//     (maxvio grows with s; the largest reachable value is E / K - 1, when K experts take every
//     token).
// Each expert's total is split evenly over source ranks (remainders dealt round-robin, so every
// rank has exactly T * K entries), and each rank's entries are laid out column-major over its
// T x K grid in a random expert order: an expert's c <= T consecutive cells hit c distinct tokens,
// so no token takes an expert twice. Tokens and each token's k order are then shuffled.
//
// Data values are small dyadic rationals (x in {-1, -7/8, ..., 1}, top-k weights in
// {1/16, ..., 1}, gradients in {-1, -3/4, ..., 1}), so weighted sums of them are exact in fp32
// whatever the order, and every transport result can be compared bit for bit.
#pragma once

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moonep/core/dtype.h"

namespace moonep::bench {

// The transports' limit on entries (tokens * top_k) per rank: kMaxEntries of transport/layout.h.
constexpr int64_t kMaxEntriesPerRank = INT32_MAX;

struct SkewSpec {
  enum class Kind { kMaxvio, kZipf };
  Kind kind = Kind::kMaxvio;
  double value = 0.0;  // target maxvio, or the Zipf exponent
  std::string Label() const;
};

struct RoutingSpec {
  int32_t num_ranks = 0;    // R
  int32_t num_experts = 0;  // E
  int32_t top_k = 0;        // K
  int64_t tokens = 0;       // T per rank
  SkewSpec skew;
  uint64_t seed = 1;
};

struct Routing {
  int32_t num_ranks = 0, num_experts = 0, top_k = 0;
  int64_t tokens = 0;
  std::vector<int64_t> totals;  // [E]
  std::vector<int64_t> counts;  // [R * E]
  std::vector<int32_t> ids;     // [R * T * K], rank-major then token-major
  double zipf_s = 0.0;          // exponent used
  double maxvio = 0.0;          // achieved: MaxVio(totals)

  const int32_t* ids_of(int32_t rank) const {
    return ids.data() + static_cast<size_t>(rank) * tokens * top_k;
  }
};

// max_e(totals[e] / mean) - 1; 0 for no tokens.
double MaxVio(absl::Span<const int64_t> totals);

// Integer totals of Zipf(s) over `order` (order[i] is the expert of popularity rank i + 1):
// sum = entries, each <= cap. Requires entries <= cap * E.
void ZipfTotals(double s, absl::Span<const int32_t> order, int64_t entries, int64_t cap,
                std::vector<int64_t>* totals);

// Validates the spec (naming the flag at fault) and builds the routing of every rank.
absl::StatusOr<Routing> MakeRouting(const RoutingSpec& spec);

// Value generators (pure functions of their coordinates).
uint64_t Mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d);
// x[t][col] of a rank: one full hash per row, then one multiply per element (checks of large
// dispatches recompute every received element, every iteration).
inline uint64_t TokenKey(int32_t rank, int64_t token) { return Mix(1, rank, token, 0); }
inline float TokenValueOfKey(uint64_t key, int64_t col) {
  uint64_t z = (key ^ (static_cast<uint64_t>(col) * 0x9e3779b97f4a7c15ull)) * 0xd6e8feb86659fd93ull;
  z ^= z >> 32;
  return static_cast<float>(static_cast<int64_t>(z % 17) - 8) / 8.0f;
}
inline float TokenValue(int32_t rank, int64_t token, int64_t col) {
  return TokenValueOfKey(TokenKey(rank, token), col);
}
inline float TopkWeightValue(int32_t rank, int64_t token, int32_t k) {
  return static_cast<float>(1 + Mix(2, rank, token, k) % 16) / 16.0f;
}
inline float GradValue(int32_t rank, int64_t token, int64_t col) {  // dy of the layer
  return static_cast<float>(static_cast<int64_t>(Mix(3, rank, token, col) % 9) - 4) / 32.0f;
}
// Expert parameter m (0 gate [H,I], 1 up [H,I], 2 down [I,H]) element i, before rounding to
// the dtype: uniform in [-scale, scale] with scale 1/sqrt(fan-in).
double WeightValue(int32_t expert, int32_t m, int64_t i, int64_t hidden, int64_t intermediate);
// Parameter gradients for the reduction: home value of expert e, and replica value of (rank, e).
inline float HomeGradValue(int32_t expert, int32_t m, int64_t i) {
  return static_cast<float>(static_cast<int64_t>(Mix(5, expert, m, i) % 9) - 4) / 4.0f;
}
inline float SlotGradValue(int32_t rank, int32_t expert, int32_t m, int64_t i) {
  return static_cast<float>(static_cast<int64_t>(Mix(6 + 7 * static_cast<uint64_t>(rank), expert,
                                                     m, i) % 9) - 4) / 4.0f;
}

// Fills `out` (count elements of `dtype`) with WeightValue(expert, m, 0..count-1) rounded.
void FillWeights(int32_t expert, int32_t m, int64_t hidden, int64_t intermediate, DType dtype,
                 int64_t count, void* out);

}  // namespace moonep::bench
