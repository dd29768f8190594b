// Routing models: each model's statistics against its definition, and determinism.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <functional>

#include "gtest/gtest.h"
#include "planner/sim/routing.h"

namespace moonep::sim {
namespace {

RoutingParams Params(RoutingKind kind, int32_t R, int32_t E, int32_t K, int32_t T) {
  RoutingParams p;
  p.kind = kind;
  p.num_ranks = R;
  p.num_experts = E;
  p.topk = K;
  p.tokens_per_rank = T;
  return p;
}

std::unique_ptr<RoutingModel> Make(const RoutingParams& p) {
  auto m = RoutingModel::Create(p);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(*m);
}

// Every model: K distinct valid experts per token, counts sum to T*K per rank, totals = column sums.
TEST(RoutingTest, TokensAreConsistentForEveryModel) {
  for (RoutingKind kind : {RoutingKind::kUniform, RoutingKind::kZipf, RoutingKind::kHotspot,
                           RoutingKind::kDrift, RoutingKind::kDomain, RoutingKind::kCoactivation}) {
    RoutingParams p = Params(kind, 6, 24, 4, 300);
    p.zipf_s = 1.2;
    auto m = Make(p);
    StepRouting s;
    for (int step = 0; step < 3; ++step) {
      m->NextTokens(&s);
      ASSERT_EQ(s.topk_ids.size(), size_t{6} * 300 * 4) << RoutingKindName(kind);
      std::vector<int64_t> counts(6 * 24, 0), totals(24, 0);
      for (int32_t r = 0; r < 6; ++r) {
        for (int32_t t = 0; t < 300; ++t) {
          const int32_t* ids = s.topk_ids.data() + (static_cast<size_t>(r) * 300 + t) * 4;
          std::set<int32_t> distinct(ids, ids + 4);
          ASSERT_EQ(distinct.size(), 4u) << RoutingKindName(kind);
          for (int32_t k = 0; k < 4; ++k) {
            ASSERT_GE(ids[k], 0);
            ASSERT_LT(ids[k], 24);
            ++counts[r * 24 + ids[k]];
            ++totals[ids[k]];
          }
        }
        int64_t row = 0;
        for (int32_t e = 0; e < 24; ++e) row += s.counts[r * 24 + e];
        EXPECT_EQ(row, 300 * 4) << RoutingKindName(kind) << " rank " << r;
      }
      EXPECT_EQ(counts, s.counts) << RoutingKindName(kind);
      EXPECT_EQ(totals, s.totals) << RoutingKindName(kind);
      for (int32_t r = 0; r < 6; ++r) {
        const std::vector<double>& dist = m->Distribution(r);
        EXPECT_NEAR(std::accumulate(dist.begin(), dist.end(), 0.0), 1.0, 1e-12);
      }
    }
  }
}

TEST(RoutingTest, SameSeedSameOutputOtherSeedOther) {
  for (RoutingKind kind : {RoutingKind::kZipf, RoutingKind::kHotspot, RoutingKind::kDrift,
                           RoutingKind::kDomain, RoutingKind::kCoactivation}) {
    RoutingParams p = Params(kind, 4, 16, 2, 100);
    auto a = Make(p), b = Make(p);
    p.seed = 2;
    auto c = Make(p);
    StepRouting sa, sb, sc;
    bool any_diff = false;
    for (int step = 0; step < 4; ++step) {
      a->NextTokens(&sa);
      b->NextTokens(&sb);
      c->NextTokens(&sc);
      EXPECT_EQ(sa.topk_ids, sb.topk_ids) << RoutingKindName(kind);
      any_diff = any_diff || sa.topk_ids != sc.topk_ids;
      a->NextTotals(&sa);
      b->NextTotals(&sb);
      EXPECT_EQ(sa.totals, sb.totals) << RoutingKindName(kind);
    }
    EXPECT_TRUE(any_diff) << RoutingKindName(kind);
  }
}

// Least-squares slope of log(count) against log(Zipf rank), over ranks with enough samples.
double FittedExponent(const std::vector<int64_t>& totals, const std::vector<int32_t>& order,
                      double min_count) {
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  int n = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const double c = static_cast<double>(totals[order[i]]);
    if (c < min_count) break;
    const double x = std::log(i + 1.0), y = std::log(c);
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
    ++n;
  }
  EXPECT_GE(n, 10);
  return -(n * sxy - sx * sy) / (n * sxx - sx * sx);
}

// With K = 1 every choice is one draw from Zipf(s): the fitted exponent recovers s.
TEST(RoutingTest, ZipfExponentIsRecovered) {
  for (double s : {0.3, 0.7, 1.0, 1.5}) {
    RoutingParams p = Params(RoutingKind::kZipf, 4, 128, 1, 50000);
    p.zipf_s = s;
    p.seed = 7;
    auto m = Make(p);
    std::vector<int64_t> totals(128, 0);
    StepRouting st;
    for (int step = 0; step < 5; ++step) {
      m->NextTokens(&st);
      for (int32_t e = 0; e < 128; ++e) totals[e] += st.totals[e];
    }
    EXPECT_NEAR(FittedExponent(totals, m->popularity_order(0), 200), s, 0.05) << "s = " << s;
  }
}

// K > 1 is successive sampling without replacement: compare with the exact inclusion
// probabilities, enumerated over every ordered K-tuple of a small E. At s = 1.5 the draws are
// accepted by rejection; at s = 8 and 10 one expert holds 99.6 % and 99.9 % of the mass, so most
// later choices come from the prefix-sum draw after 64 rejections.
class SuccessiveSampling : public ::testing::TestWithParam<double> {};

TEST_P(SuccessiveSampling, TopKIsSuccessiveSamplingWithoutReplacement) {
  const int32_t E = 6, K = 3, T = 200000;
  RoutingParams p = Params(RoutingKind::kZipf, 1, E, K, T);
  p.zipf_s = GetParam();
  auto m = Make(p);
  StepRouting st;
  m->NextTokens(&st);
  const std::vector<double>& q = m->Distribution(0);
  std::vector<double> inclusion(E, 0.0);
  for (int a = 0; a < E; ++a) {
    for (int b = 0; b < E; ++b) {
      for (int c = 0; c < E; ++c) {
        if (a == b || a == c || b == c) continue;
        const double pr = q[a] * q[b] / (1 - q[a]) * q[c] / (1 - q[a] - q[b]);
        inclusion[a] += pr;
        inclusion[b] += pr;
        inclusion[c] += pr;
      }
    }
  }
  for (int32_t e = 0; e < E; ++e) {
    const double expected = inclusion[e] * T;
    const double sigma = std::sqrt(T * inclusion[e] * (1 - inclusion[e]));
    EXPECT_NEAR(static_cast<double>(st.totals[e]), expected, 5 * sigma + 1) << "expert " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Skew, SuccessiveSampling, ::testing::Values(1.5, 8.0, 10.0));

// Heavy skew on many experts: later choices come from the prefix-sum draw (and, where the mass
// left is below its resolution, the exact scan); every token still gets K distinct valid ids.
TEST(RoutingTest, HeavySkewOnManyExpertsDrawsDistinctIds) {
  RoutingParams p = Params(RoutingKind::kZipf, 4, 8192, 8, 256);
  p.zipf_s = 10;
  auto m = Make(p);
  StepRouting st;
  m->NextTokens(&st);
  for (int32_t r = 0; r < 4; ++r) {
    const int32_t* ids = st.topk_ids.data() + static_cast<size_t>(r) * 256 * 8;
    for (int32_t t = 0; t < 256; ++t) {
      std::set<int32_t> distinct(ids + t * 8, ids + t * 8 + 8);
      ASSERT_EQ(distinct.size(), 8u);
      ASSERT_GE(*distinct.begin(), 0);
      ASSERT_LT(*distinct.rbegin(), 8192);
    }
  }
  // K = E = 64: the last choices' mass (64^-10 of the first's) is below the prefix sums'
  // resolution, so they come from the exact scan.
  RoutingParams all = Params(RoutingKind::kZipf, 1, 64, 64, 32);
  all.zipf_s = 10;
  auto m2 = Make(all);
  m2->NextTokens(&st);
  for (int32_t t = 0; t < 32; ++t) {
    std::set<int32_t> distinct(st.topk_ids.data() + t * 64, st.topk_ids.data() + t * 64 + 64);
    ASSERT_EQ(distinct.size(), 64u);
  }
}

TEST(RoutingTest, UniformIsFlat) {
  RoutingParams p = Params(RoutingKind::kUniform, 8, 64, 8, 4000);
  auto m = Make(p);
  StepRouting st;
  m->NextTokens(&st);
  const double mean = 8.0 * 4000 * 8 / 64, sigma = std::sqrt(mean);
  for (int32_t e = 0; e < 64; ++e) EXPECT_NEAR(st.totals[e], mean, 5 * sigma) << e;
  for (double v : m->Distribution(3)) EXPECT_DOUBLE_EQ(v, 1.0 / 64);
}

TEST(RoutingTest, HotspotSpikesChosenExpertsEachStep) {
  RoutingParams p = Params(RoutingKind::kHotspot, 2, 32, 1, 40000);
  p.zipf_s = 0;  // flat base: a hot expert's weight is exactly hot_factor times the others'
  p.hot_experts = 2;
  p.hot_factor = 10;
  auto m = Make(p);
  StepRouting st;
  std::set<int32_t> hot_seen;
  for (int step = 0; step < 6; ++step) {
    m->NextTokens(&st);
    const std::vector<double>& d = m->Distribution(0);
    std::vector<int32_t> hot;
    for (int32_t e = 0; e < 32; ++e) {
      if (d[e] > 2.0 / 32) hot.push_back(e);
    }
    ASSERT_EQ(hot.size(), 2u);
    for (int32_t e = 0; e < 32; ++e) {
      const double want = (std::count(hot.begin(), hot.end(), e) ? 10.0 : 1.0) / 50.0;
      EXPECT_NEAR(d[e], want, 1e-12);
      const double n = 2.0 * 40000, sigma = std::sqrt(n * want * (1 - want));
      EXPECT_NEAR(st.totals[e], n * want, 5 * sigma);
    }
    hot_seen.insert(hot.begin(), hot.end());
  }
  EXPECT_GT(hot_seen.size(), 2u);  // the spiking experts change between steps
}

TEST(RoutingTest, DriftIsARandomWalkOfLogWeights) {
  const int32_t E = 4096, steps = 25;
  RoutingParams p = Params(RoutingKind::kDrift, 1, E, 1, 1);
  p.zipf_s = 0.5;
  p.drift_sigma = 0.1;
  auto m = Make(p);
  StepRouting st;
  m->NextTokens(&st);
  const std::vector<double> first = m->Distribution(0);
  for (int i = 1; i < steps; ++i) m->NextTokens(&st);
  // log p_t - log p_0 = (sum of steps - 1) normals, up to a constant shared by every expert.
  std::vector<double> diff(E);
  for (int32_t e = 0; e < E; ++e) diff[e] = std::log(m->Distribution(0)[e] / first[e]);
  const double mean = std::accumulate(diff.begin(), diff.end(), 0.0) / E;
  double var = 0;
  for (double d : diff) var += (d - mean) * (d - mean);
  var /= E - 1;
  EXPECT_NEAR(var, (steps - 1) * 0.01, 0.1 * (steps - 1) * 0.01);

  // theta = 1 pulls every step fully back: sigma alone, not accumulated.
  p.drift_theta = 1.0;
  auto back = Make(p);
  back->NextTokens(&st);
  const std::vector<double> start = back->Distribution(0);
  for (int i = 1; i < steps; ++i) back->NextTokens(&st);
  double var1 = 0, mean1 = 0;
  for (int32_t e = 0; e < E; ++e) mean1 += std::log(back->Distribution(0)[e] / start[e]) / E;
  for (int32_t e = 0; e < E; ++e) {
    const double d = std::log(back->Distribution(0)[e] / start[e]) - mean1;
    var1 += d * d / (E - 1);
  }
  EXPECT_NEAR(var1, 0.01, 0.002);
}

TEST(RoutingTest, DomainsHaveTheirOwnPopularity) {
  RoutingParams p = Params(RoutingKind::kDomain, 8, 64, 1, 20000);
  p.zipf_s = 1.2;
  p.domains = 4;
  auto m = Make(p);
  StepRouting st;
  m->NextTokens(&st);
  std::set<int32_t> tops;
  for (int32_t r = 0; r < 8; ++r) {
    EXPECT_EQ(m->DomainOf(r), r / 2);
    const int64_t* row = st.counts.data() + r * 64;
    const int32_t top = static_cast<int32_t>(std::max_element(row, row + 64) - row);
    EXPECT_EQ(top, m->popularity_order(m->DomainOf(r))[0]) << "rank " << r;
    tops.insert(top);
  }
  EXPECT_GT(tops.size(), 1u);
  // Expected shares: a rank's share of an expert follows its domain's weight of it.
  m->NextTotals(&st);
  for (int32_t e = 0; e < 64; ++e) {
    double sum = 0;
    for (int32_t r = 0; r < 8; ++r) sum += m->ExpectedShare(r, e);
    EXPECT_NEAR(sum, 1.0, 1e-9);
  }
}

TEST(RoutingTest, CoactivationKeepsLaterChoicesInTheGroup) {
  // Groups depend only on the seed: learn them from a model whose later choices always stay in
  // the group, then measure how often they stay with coact_prob = 0.6.
  const int32_t E = 64, G = 8;
  RoutingParams p = Params(RoutingKind::kCoactivation, 2, E, 2, 20000);
  p.zipf_s = 0;  // flat: an out-of-group draw lands in the group with chance (G-1)/(E-1)
  p.coact_group = G;
  p.coact_prob = 1.0;
  StepRouting st;
  Make(p)->NextTokens(&st);
  std::vector<std::set<int32_t>> group(E);
  for (size_t t = 0; t < st.topk_ids.size() / 2; ++t) {
    const int32_t a = st.topk_ids[2 * t], b = st.topk_ids[2 * t + 1];
    group[a].insert(b);
    group[b].insert(a);
  }
  for (int32_t e = 0; e < E; ++e) EXPECT_EQ(group[e].size(), size_t{G - 1}) << e;
  for (double prob : {0.0, 0.6}) {
    p.coact_prob = prob;
    Make(p)->NextTokens(&st);
    const int64_t n = static_cast<int64_t>(st.topk_ids.size() / 2);
    int64_t stayed = 0;
    for (int64_t t = 0; t < n; ++t) stayed += group[st.topk_ids[2 * t]].count(st.topk_ids[2 * t + 1]);
    const double want = prob + (1 - prob) * (G - 1.0) / (E - 1.0);
    EXPECT_NEAR(static_cast<double>(stayed) / n, want, 5 * std::sqrt(want * (1 - want) / n)) << prob;
  }
}

TEST(RoutingTest, TotalsMatchTheModelInExpectation) {
  // K = 1: water-filling is exact, so the mean of the totals is N * p.
  RoutingParams p = Params(RoutingKind::kZipf, 16, 64, 1, 1000);
  p.zipf_s = 1.0;
  auto m = Make(p);
  StepRouting st;
  std::vector<double> mean(64, 0.0);
  const int steps = 200;
  for (int i = 0; i < steps; ++i) {
    m->NextTotals(&st);
    EXPECT_EQ(std::accumulate(st.totals.begin(), st.totals.end(), int64_t{0}), 16 * 1000);
    EXPECT_TRUE(st.counts.empty());
    for (int32_t e = 0; e < 64; ++e) mean[e] += static_cast<double>(st.totals[e]) / steps;
  }
  const std::vector<double>& q = m->Distribution(0);
  for (int32_t e = 0; e < 64; ++e) {
    const double n = 16000.0, sd = std::sqrt(n * q[e] * (1 - q[e]) / steps);
    EXPECT_NEAR(mean[e], n * q[e], 5 * sd + 0.01) << e;
  }
}

TEST(RoutingTest, InclusionProbabilitiesWaterFill) {
  std::vector<double> pi;
  InclusionProbabilities({0.25, 0.25, 0.25, 0.25}, 2, &pi);
  for (double v : pi) EXPECT_DOUBLE_EQ(v, 0.5);
  InclusionProbabilities({0.7, 0.1, 0.1, 0.1}, 2, &pi);
  EXPECT_DOUBLE_EQ(pi[0], 1.0);
  for (int i = 1; i < 4; ++i) EXPECT_NEAR(pi[i], 1.0 / 3, 1e-12);
  InclusionProbabilities({0.5, 0.3, 0.15, 0.05}, 3, &pi);
  EXPECT_NEAR(std::accumulate(pi.begin(), pi.end(), 0.0), 3.0, 1e-12);
  for (size_t i = 1; i < pi.size(); ++i) EXPECT_LE(pi[i], pi[i - 1]);
  for (double v : pi) EXPECT_LE(v, 1.0);
}

TEST(RoutingTest, InvalidParamsNameTheParameter) {
  struct Case {
    std::function<void(RoutingParams*)> change;
    const char* name;
  } cases[] = {
      {[](RoutingParams* p) { p->num_ranks = 0; }, "ranks"},
      {[](RoutingParams* p) { p->topk = 17; }, "topk"},
      {[](RoutingParams* p) { p->zipf_s = -1; }, "zipf_s"},
      {[](RoutingParams* p) { p->hot_factor = 0.5; }, "hot_factor"},
      {[](RoutingParams* p) { p->drift_theta = 2; }, "drift_theta"},
      {[](RoutingParams* p) { p->domains = 5; }, "domains"},
      {[](RoutingParams* p) { p->coact_prob = 1.5; }, "coact_prob"},
      {[](RoutingParams* p) { p->coact_group = 0; }, "coact_group"},
      {[](RoutingParams* p) { p->tokens_per_rank = -1; }, "tokens"},
  };
  for (const Case& c : cases) {
    RoutingParams p = Params(RoutingKind::kZipf, 4, 16, 2, 10);
    c.change(&p);
    if (std::string(c.name) == "domains") p.kind = RoutingKind::kDomain;
    if (std::string(c.name) == "coact_group") p.kind = RoutingKind::kCoactivation;
    auto m = RoutingModel::Create(p);
    ASSERT_FALSE(m.ok()) << c.name;
    EXPECT_NE(m.status().message().find(c.name), std::string::npos) << m.status();
  }
}

}  // namespace
}  // namespace moonep::sim
