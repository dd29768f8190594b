// Routing-skew models: synthetic top-k routing for R source ranks, E experts, K choices per token,
// T tokens per rank, one step at a time (nothing is kept across steps except a model's own state,
// so memory does not grow with the number of steps). See docs/simulator.md for each model.
//
// Every model is defined by a per-step draw distribution p_r over experts for each source rank r.
// A token takes K distinct experts: each choice draws from p_r, rejecting experts it already has
// (successive sampling without replacement), except that the co-activation model may take its
// later choices from the first choice's group. A step can be sampled two ways:
//   tokens: every token's K choices (topk_ids), the counts[R][E] matrix and the per-expert totals;
//           counts sum to T*K on every rank exactly.
//   totals: only the per-expert totals, drawn as one multinomial per domain with the marginal
//           inclusion probabilities of successive sampling approximated by water-filling
//           (pi_e = min(1, c * p_e), sum pi = K). Used at scales where R*T*K draws per step are
//           too many; its locality comes from ExpectedShare().
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moonep::sim {

enum class RoutingKind : int32_t {
  kUniform = 0,       // p_e = 1/E for every rank
  kZipf = 1,          // p_e ~ 1 / rank(e)^s, rank = position in a seeded random permutation
  kHotspot = 2,       // Zipf(s) base; each step `hot_experts` random experts get weight x hot_factor
  kDrift = 3,         // log-weights start at Zipf(s) and follow a random walk (Ornstein-Uhlenbeck)
  kDomain = 4,        // `domains` blocks of consecutive ranks, each its own Zipf(s) permutation
  kCoactivation = 5,  // Zipf(s); later choices of a token come from its first choice's group
};

const char* RoutingKindName(RoutingKind kind);
// "uniform", "zipf", "hotspot", "drift", "domain", "coactivation".
bool ParseRoutingKind(const std::string& name, RoutingKind* kind);

struct RoutingParams {
  RoutingKind kind = RoutingKind::kZipf;
  int32_t num_ranks = 0;        // R
  int32_t num_experts = 0;      // E
  int32_t topk = 0;             // K, 1 <= K <= E
  int32_t tokens_per_rank = 0;  // T
  double zipf_s = 0.3;          // Zipf exponent s >= 0 (every model but uniform)
  int32_t hot_experts = 4;      // hotspot: experts that spike in each step
  double hot_factor = 20.0;     // hotspot: weight multiplier of a spiking expert (>= 1)
  double drift_sigma = 0.1;     // drift: std-dev of each log-weight's step
  double drift_theta = 0.0;     // drift: pull back to the start per step, in [0, 1]; 0 = random walk
  int32_t domains = 4;          // domain: number of data domains, 1 <= domains <= R
  int32_t coact_group = 4;      // coactivation: experts per co-activation group (>= 1)
  double coact_prob = 0.5;      // coactivation: chance a later choice stays in the first's group
  uint64_t seed = 1;
};

absl::Status ValidateRoutingParams(const RoutingParams& params);

// One step of routing. Which fields are filled depends on how it was sampled (see above).
struct StepRouting {
  int32_t num_ranks = 0, num_experts = 0, topk = 0;
  std::vector<int64_t> tokens;    // [R] tokens of each source rank (a trace's can pass int32)
  std::vector<int32_t> topk_ids;  // [sum(tokens) * K], rank-major, token-major; empty if unknown
  std::vector<int64_t> counts;    // [R * E]; empty if unknown
  std::vector<int64_t> totals;    // [E] always
  bool has_tokens() const { return !topk_ids.empty(); }
  bool has_counts() const { return !counts.empty(); }
};

// xoshiro256** (Blackman & Vigna), seeded through splitmix64: fast, and the same sequence on every
// platform for a seed. A UniformRandomBitGenerator, so <random> distributions accept it.
class Rng {
 public:
  using result_type = uint64_t;
  explicit Rng(uint64_t seed);
  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return ~uint64_t{0}; }
  uint64_t operator()() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

class RoutingModel {
 public:
  static absl::StatusOr<std::unique_ptr<RoutingModel>> Create(const RoutingParams& params);
  ~RoutingModel();

  const RoutingParams& params() const { return params_; }

  // Advances to the next step and samples every token of it.
  void NextTokens(StepRouting* out);
  // Advances to the next step and samples only the per-expert totals.
  void NextTotals(StepRouting* out);

  // The current step's draw distribution of source rank r (sums to 1). Valid after Next*.
  const std::vector<double>& Distribution(int32_t rank) const;
  // Expected fraction of expert e's tokens that come from source rank r in the current step
  // (sums to 1 over r; 1/R for models whose ranks all draw alike). Valid after NextTotals.
  double ExpectedShare(int32_t rank, int32_t expert) const;
  // Domain of a rank (0 for every model but `domain`).
  int32_t DomainOf(int32_t rank) const;
  int32_t num_domains() const { return num_domains_; }
  // The permutation that gives each expert its Zipf rank: popularity_order(d)[i] is the expert
  // of rank i + 1 in domain d (before hot spots and drift).
  const std::vector<int32_t>& popularity_order(int32_t domain) const { return order_[domain]; }

 private:
  explicit RoutingModel(const RoutingParams& params);
  void AdvanceDistributions();
  void SampleRank(int32_t rank, int32_t* ids, int64_t* counts);
  int32_t DrawDistinct(int32_t domain, const int32_t* chosen, int32_t num_chosen);
  double Uniform01();

  RoutingParams params_;
  int32_t num_domains_ = 1;
  int64_t step_ = 0;
  Rng rng_;
  std::vector<std::vector<int32_t>> order_;      // [domain] Zipf permutation
  std::vector<std::vector<double>> base_log_;    // [domain][E] log-weight at start
  std::vector<std::vector<double>> log_weight_;  // [domain][E] current log-weight (drift)
  std::vector<std::vector<double>> prob_;        // [domain][E] current draw distribution
  // Alias tables of prob_ (Vose), rebuilt each step.
  std::vector<std::vector<double>> alias_prob_;
  std::vector<std::vector<int32_t>> alias_index_;
  std::vector<std::vector<double>> cdf_;         // [domain][E+1] prefix sums of prob_
  std::vector<int32_t> chosen_sorted_;           // DrawDistinct's scratch
  std::vector<char> taken_mark_;                 // DrawDistinct's scratch, [E]
  std::vector<double> share_;                    // [domain][E] flattened: share of one rank
  std::vector<int32_t> group_of_;                // coactivation: group of each expert
  std::vector<int32_t> group_members_;           // experts by group, coact_group per group
  std::vector<int32_t> hot_;                     // hotspot: this step's spiking experts
  std::vector<double> scratch_;
};

// Marginal inclusion probabilities of K-of-E successive sampling, approximated by water-filling:
// pi_e = min(1, c * p_e) with c chosen so that sum pi = K. Exposed for tests.
void InclusionProbabilities(const std::vector<double>& p, int32_t topk, std::vector<double>* pi);

}  // namespace moonep::sim
