#include "planner/sim/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "moonep/core/status.h"

namespace moonep::sim {

const char* RoutingKindName(RoutingKind kind) {
  switch (kind) {
    case RoutingKind::kUniform: return "uniform";
    case RoutingKind::kZipf: return "zipf";
    case RoutingKind::kHotspot: return "hotspot";
    case RoutingKind::kDrift: return "drift";
    case RoutingKind::kDomain: return "domain";
    case RoutingKind::kCoactivation: return "coactivation";
  }
  return "invalid";
}

bool ParseRoutingKind(const std::string& name, RoutingKind* kind) {
  for (RoutingKind k : {RoutingKind::kUniform, RoutingKind::kZipf, RoutingKind::kHotspot,
                        RoutingKind::kDrift, RoutingKind::kDomain, RoutingKind::kCoactivation}) {
    if (name == RoutingKindName(k)) {
      *kind = k;
      return true;
    }
  }
  return false;
}

absl::Status ValidateRoutingParams(const RoutingParams& p) {
  MOONEP_CHECK_ARG(p.num_ranks > 0, "ranks must be positive, got %d", p.num_ranks);
  MOONEP_CHECK_ARG(p.num_experts > 0, "experts must be positive, got %d", p.num_experts);
  MOONEP_CHECK_ARG(p.topk >= 1 && p.topk <= p.num_experts, "topk must be in [1, experts = %d], got %d",
                   p.num_experts, p.topk);
  MOONEP_CHECK_ARG(p.tokens_per_rank >= 0, "tokens must be >= 0, got %d", p.tokens_per_rank);
  MOONEP_CHECK_ARG(std::isfinite(p.zipf_s) && p.zipf_s >= 0 && p.zipf_s <= 10,
                   "zipf_s must be in [0, 10], got %g", p.zipf_s);
  // Sizes that only one model uses are checked for that model (their defaults may not fit others).
  const bool hotspot = p.kind == RoutingKind::kHotspot, domain = p.kind == RoutingKind::kDomain;
  const bool coact = p.kind == RoutingKind::kCoactivation;
  MOONEP_CHECK_ARG(!hotspot || (p.hot_experts >= 0 && p.hot_experts <= p.num_experts),
                   "hot_experts must be in [0, experts = %d], got %d", p.num_experts, p.hot_experts);
  MOONEP_CHECK_ARG(std::isfinite(p.hot_factor) && p.hot_factor >= 1 && p.hot_factor <= 1e6,
                   "hot_factor must be in [1, 1e6], got %g", p.hot_factor);
  MOONEP_CHECK_ARG(std::isfinite(p.drift_sigma) && p.drift_sigma >= 0 && p.drift_sigma <= 10,
                   "drift_sigma must be in [0, 10], got %g", p.drift_sigma);
  MOONEP_CHECK_ARG(std::isfinite(p.drift_theta) && p.drift_theta >= 0 && p.drift_theta <= 1,
                   "drift_theta must be in [0, 1], got %g", p.drift_theta);
  MOONEP_CHECK_ARG(!domain || (p.domains >= 1 && p.domains <= p.num_ranks),
                   "domains must be in [1, ranks = %d], got %d", p.num_ranks, p.domains);
  MOONEP_CHECK_ARG(!coact || (p.coact_group >= 1 && p.coact_group <= p.num_experts),
                   "coact_group must be in [1, experts = %d], got %d", p.num_experts, p.coact_group);
  MOONEP_CHECK_ARG(std::isfinite(p.coact_prob) && p.coact_prob >= 0 && p.coact_prob <= 1,
                   "coact_prob must be in [0, 1], got %g", p.coact_prob);
  return absl::OkStatus();
}

namespace {

// Unbiased enough for the sizes here (n < 2^31): the top 64 bits of a 128-bit product.
inline uint64_t Bounded(Rng& rng, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(rng()) * n) >> 64);
}

void BuildAlias(const std::vector<double>& p, std::vector<double>* prob,
                std::vector<int32_t>* alias, std::vector<double>* scratch) {
  const int32_t n = static_cast<int32_t>(p.size());
  prob->assign(n, 1.0);
  alias->resize(n);
  std::iota(alias->begin(), alias->end(), 0);
  scratch->resize(n);
  std::vector<int32_t> small, large;
  small.reserve(n);
  large.reserve(n);
  for (int32_t i = 0; i < n; ++i) {
    (*scratch)[i] = p[i] * n;
    ((*scratch)[i] < 1.0 ? small : large).push_back(i);
  }
  while (!small.empty() && !large.empty()) {
    const int32_t s = small.back(), l = large.back();
    small.pop_back();
    (*prob)[s] = (*scratch)[s];
    (*alias)[s] = l;
    (*scratch)[l] -= 1.0 - (*scratch)[s];
    if ((*scratch)[l] < 1.0) {
      large.pop_back();
      small.push_back(l);
    }
  }
  // Leftovers are 1 up to rounding.
}

}  // namespace

void InclusionProbabilities(const std::vector<double>& p, int32_t topk, std::vector<double>* pi) {
  const size_t n = p.size();
  pi->assign(n, 0.0);
  // Water-filling: experts whose scaled weight reaches 1 are capped; the rest share K - capped.
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
  double rest_mass = 0;
  for (double v : p) rest_mass += v;
  int32_t capped = 0;
  while (capped < topk && rest_mass > 0 &&
         p[order[capped]] * (topk - capped) / rest_mass >= 1.0) {
    rest_mass -= p[order[capped]];
    ++capped;
  }
  for (int32_t i = 0; i < capped; ++i) (*pi)[order[i]] = 1.0;
  if (rest_mass > 0) {
    const double c = (topk - capped) / rest_mass;
    for (size_t i = capped; i < n; ++i) (*pi)[order[i]] = std::min(1.0, c * p[order[i]]);
  } else {
    // Remaining experts have zero weight: successive sampling takes them uniformly.
    const double each = n > static_cast<size_t>(capped) ? double(topk - capped) / (n - capped) : 0;
    for (size_t i = capped; i < n; ++i) (*pi)[order[i]] = each;
  }
}

Rng::Rng(uint64_t seed) {
  for (uint64_t& word : s_) {
    uint64_t z = (seed += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    word = z ^ (z >> 31);
  }
}

RoutingModel::RoutingModel(const RoutingParams& params) : params_(params), rng_(params.seed) {}
RoutingModel::~RoutingModel() = default;

absl::StatusOr<std::unique_ptr<RoutingModel>> RoutingModel::Create(const RoutingParams& params) {
  MOONEP_RETURN_IF_ERROR(ValidateRoutingParams(params));
  std::unique_ptr<RoutingModel> m(new RoutingModel(params));
  const int32_t E = params.num_experts;
  m->num_domains_ = params.kind == RoutingKind::kDomain ? params.domains : 1;
  const int32_t D = m->num_domains_;
  m->order_.resize(D);
  m->base_log_.assign(D, std::vector<double>(E, 0.0));
  for (int32_t d = 0; d < D; ++d) {
    std::vector<int32_t>& order = m->order_[d];
    order.resize(E);
    std::iota(order.begin(), order.end(), 0);
    for (int32_t i = E - 1; i > 0; --i) std::swap(order[i], order[Bounded(m->rng_, i + 1)]);
    if (params.kind != RoutingKind::kUniform) {
      for (int32_t i = 0; i < E; ++i) m->base_log_[d][order[i]] = -params.zipf_s * std::log(i + 1.0);
    }
  }
  m->log_weight_ = m->base_log_;
  m->prob_.assign(D, std::vector<double>(E, 0.0));
  m->alias_prob_.resize(D);
  m->cdf_.resize(D);
  m->alias_index_.resize(D);
  m->share_.assign(static_cast<size_t>(D) * E, 0.0);
  if (params.kind == RoutingKind::kCoactivation) {
    m->group_members_.resize(E);
    std::iota(m->group_members_.begin(), m->group_members_.end(), 0);
    for (int32_t i = E - 1; i > 0; --i) {
      std::swap(m->group_members_[i], m->group_members_[Bounded(m->rng_, i + 1)]);
    }
    m->group_of_.resize(E);
    for (int32_t i = 0; i < E; ++i) m->group_of_[m->group_members_[i]] = i / params.coact_group;
  }
  return m;
}

double RoutingModel::Uniform01() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int32_t RoutingModel::DomainOf(int32_t rank) const {
  return static_cast<int32_t>(static_cast<int64_t>(rank) * num_domains_ / params_.num_ranks);
}

const std::vector<double>& RoutingModel::Distribution(int32_t rank) const {
  return prob_[DomainOf(rank)];
}

double RoutingModel::ExpectedShare(int32_t rank, int32_t expert) const {
  return share_[static_cast<size_t>(DomainOf(rank)) * params_.num_experts + expert];
}

void RoutingModel::AdvanceDistributions() {
  const int32_t E = params_.num_experts;
  if (params_.kind == RoutingKind::kHotspot) {
    // A fresh set of spiking experts every step: partial Fisher-Yates over expert ids.
    std::vector<int32_t> ids(E);
    std::iota(ids.begin(), ids.end(), 0);
    hot_.clear();
    for (int32_t i = 0; i < params_.hot_experts; ++i) {
      std::swap(ids[i], ids[i + Bounded(rng_, E - i)]);
      hot_.push_back(ids[i]);
    }
  }
  if (params_.kind == RoutingKind::kDrift && step_ > 0) {
    for (int32_t e = 0; e < E; ++e) {
      // Box-Muller; one normal per expert per step.
      const double u1 = 1.0 - Uniform01(), u2 = Uniform01();
      const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
      double& w = log_weight_[0][e];
      w += params_.drift_theta * (base_log_[0][e] - w) + params_.drift_sigma * z;
    }
  }
  ++step_;
  for (int32_t d = 0; d < num_domains_; ++d) {
    std::vector<double>& p = prob_[d];
    const std::vector<double>& lw = log_weight_[d];
    const double top = *std::max_element(lw.begin(), lw.end());
    for (int32_t e = 0; e < E; ++e) p[e] = std::exp(lw[e] - top);
    for (int32_t e : hot_) p[e] *= params_.hot_factor;
    const double sum = std::accumulate(p.begin(), p.end(), 0.0);
    for (double& v : p) v /= sum;
    BuildAlias(p, &alias_prob_[d], &alias_index_[d], &scratch_);
    std::vector<double>& cdf = cdf_[d];
    cdf.resize(static_cast<size_t>(E) + 1);
    cdf[0] = 0;
    for (int32_t e = 0; e < E; ++e) cdf[e + 1] = cdf[e] + p[e];
  }
}

int32_t RoutingModel::DrawDistinct(int32_t domain, const int32_t* chosen, int32_t num_chosen) {
  const int32_t E = params_.num_experts;
  auto taken = [&](int32_t e) { return std::find(chosen, chosen + num_chosen, e) != chosen + num_chosen; };
  const std::vector<double>& ap = alias_prob_[domain];
  const std::vector<int32_t>& ai = alias_index_[domain];
  // Rejection is exact successive sampling; after many rejections (a few experts hold almost all
  // the mass) draw from the renormalised rest directly.
  for (int attempt = 0; attempt < 64; ++attempt) {
    // One draw gives both the column (high bits of u * E) and the coin (its fraction).
    const unsigned __int128 x = static_cast<unsigned __int128>(rng_()) * static_cast<uint64_t>(E);
    const int32_t i = static_cast<int32_t>(x >> 64);
    const double coin = static_cast<double>(static_cast<uint64_t>(x) >> 11) * 0x1.0p-53;
    const int32_t e = coin < ap[i] ? i : ai[i];
    if (!taken(e)) return e;
  }
  // Successive sampling on the prefix sums: a point drawn uniformly in the mass left, moved past
  // the interval of every chosen expert at or before it, lands in the interval of the expert
  // drawn (O(K log K + log E); heavy skew reaches this on most later choices).
  const std::vector<double>& p = prob_[domain];
  const std::vector<double>& cdf = cdf_[domain];
  chosen_sorted_.assign(chosen, chosen + num_chosen);
  std::sort(chosen_sorted_.begin(), chosen_sorted_.end());
  double left = cdf[E];
  for (int32_t c : chosen_sorted_) left -= p[c];
  if (left > 0) {
    double x = Uniform01() * left;
    for (int32_t c : chosen_sorted_) {
      if (cdf[c] > x) break;
      x += p[c];
    }
    const int32_t e = static_cast<int32_t>(std::upper_bound(cdf.begin() + 1, cdf.end(), x) -
                                           (cdf.begin() + 1));
    if (e < E && p[e] > 0 && !taken(e)) return e;
  }
  // Rounding put the point outside every free interval (the mass left is below the prefix sums'
  // resolution): the exact scan, O(E).
  taken_mark_.assign(E, 0);
  for (int32_t c : chosen_sorted_) taken_mark_[c] = 1;
  double rest = 0;
  for (int32_t e = 0; e < E; ++e) rest += taken_mark_[e] ? 0.0 : p[e];
  int32_t drawn = -1;
  if (rest > 0) {
    double u = Uniform01() * rest;
    for (int32_t e = 0; e < E && drawn < 0; ++e) {
      if (taken_mark_[e] || p[e] <= 0) continue;
      u -= p[e];
      if (u < 0) drawn = e;
    }
    // u never went below 0 (rounding): the last free expert with weight.
    for (int32_t e = E - 1; e >= 0 && drawn < 0; --e) {
      if (!taken_mark_[e] && p[e] > 0) drawn = e;
    }
  }
  if (drawn < 0) {
    // Only zero-weight experts remain: take one uniformly.
    int32_t k = static_cast<int32_t>(Bounded(rng_, E - num_chosen));
    for (int32_t e = 0; e < E && drawn < 0; ++e) {
      if (!taken_mark_[e] && k-- == 0) drawn = e;
    }
  }
  return drawn >= 0 ? drawn : 0;  // drawn >= 0: num_chosen < E
}

void RoutingModel::SampleRank(int32_t rank, int32_t* ids, int64_t* counts) {
  const int32_t K = params_.topk, T = params_.tokens_per_rank, E = params_.num_experts;
  const int32_t domain = DomainOf(rank);
  const bool coact = params_.kind == RoutingKind::kCoactivation;
  const int32_t G = params_.coact_group;
  for (int32_t t = 0; t < T; ++t) {
    int32_t* chosen = ids + static_cast<size_t>(t) * K;
    for (int32_t k = 0; k < K; ++k) {
      int32_t e = -1;
      if (coact && k > 0 && Uniform01() < params_.coact_prob) {
        const int32_t g0 = group_of_[chosen[0]] * G, g1 = std::min(E, g0 + G);
        int32_t free = 0;
        for (int32_t j = g0; j < g1; ++j) {
          if (std::find(chosen, chosen + k, group_members_[j]) == chosen + k) ++free;
        }
        if (free > 0) {
          int32_t pick = static_cast<int32_t>(Bounded(rng_, free));
          for (int32_t j = g0; j < g1; ++j) {
            const int32_t m = group_members_[j];
            if (std::find(chosen, chosen + k, m) != chosen + k) continue;
            if (pick-- == 0) {
              e = m;
              break;
            }
          }
        }
      }
      if (e < 0) e = DrawDistinct(domain, chosen, k);
      chosen[k] = e;
      ++counts[e];
    }
  }
}

void RoutingModel::NextTokens(StepRouting* out) {
  AdvanceDistributions();
  const int32_t R = params_.num_ranks, E = params_.num_experts, K = params_.topk;
  const int32_t T = params_.tokens_per_rank;
  out->num_ranks = R;
  out->num_experts = E;
  out->topk = K;
  out->tokens.assign(R, T);
  out->topk_ids.resize(static_cast<size_t>(R) * T * K);
  out->counts.assign(static_cast<size_t>(R) * E, 0);
  out->totals.assign(E, 0);
  for (int32_t r = 0; r < R; ++r) {
    SampleRank(r, out->topk_ids.data() + static_cast<size_t>(r) * T * K,
               out->counts.data() + static_cast<size_t>(r) * E);
  }
  for (int32_t r = 0; r < R; ++r) {
    const int64_t* row = out->counts.data() + static_cast<size_t>(r) * E;
    for (int32_t e = 0; e < E; ++e) out->totals[e] += row[e];
  }
}

void RoutingModel::NextTotals(StepRouting* out) {
  AdvanceDistributions();
  const int32_t R = params_.num_ranks, E = params_.num_experts, K = params_.topk;
  const int32_t T = params_.tokens_per_rank, D = num_domains_;
  out->num_ranks = R;
  out->num_experts = E;
  out->topk = K;
  out->tokens.assign(R, T);
  out->topk_ids.clear();
  out->counts.clear();
  out->totals.assign(E, 0);
  std::vector<double> pi, q(E), expected(static_cast<size_t>(D) * E);
  std::vector<int64_t> ranks_in(D, 0);
  for (int32_t r = 0; r < R; ++r) ++ranks_in[DomainOf(r)];
  for (int32_t d = 0; d < D; ++d) {
    InclusionProbabilities(prob_[d], K, &pi);
    if (params_.kind == RoutingKind::kCoactivation) {
      // A later choice stays in the first choice's group with probability coact_prob and is then
      // uniform over the group: mix in the group mean of pi for that share of the choices.
      const int32_t G = params_.coact_group;
      const double mix = params_.coact_prob * (K - 1) / K;
      for (int32_t g0 = 0; g0 < E; g0 += G) {
        const int32_t g1 = std::min(E, g0 + G);
        double mean = 0;
        for (int32_t j = g0; j < g1; ++j) mean += pi[group_members_[j]];
        mean /= (g1 - g0);
        for (int32_t j = g0; j < g1; ++j) {
          const int32_t e = group_members_[j];
          q[e] = ((1 - mix) * pi[e] + mix * mean) / K;
        }
      }
    } else {
      for (int32_t e = 0; e < E; ++e) q[e] = pi[e] / K;
    }
    // One multinomial over the domain's N = ranks * T * K choices, by conditional binomials.
    int64_t n = ranks_in[d] * T * K;
    double mass = 1.0;
    for (int32_t e = 0; e < E && n > 0; ++e) {
      int64_t x = n;
      if (e + 1 < E) {
        const double pe = mass > 0 ? std::clamp(q[e] / mass, 0.0, 1.0) : 1.0;
        x = std::binomial_distribution<int64_t>(n, pe)(rng_);
      }
      out->totals[e] += x;
      n -= x;
      mass -= q[e];
    }
    for (int32_t e = 0; e < E; ++e) expected[static_cast<size_t>(d) * E + e] = q[e];
  }
  for (int32_t e = 0; e < E; ++e) {
    double all = 0;
    for (int32_t d = 0; d < D; ++d) all += ranks_in[d] * expected[static_cast<size_t>(d) * E + e];
    for (int32_t d = 0; d < D; ++d) {
      share_[static_cast<size_t>(d) * E + e] =
          all > 0 ? expected[static_cast<size_t>(d) * E + e] / all : 1.0 / R;
    }
  }
}

}  // namespace moonep::sim
