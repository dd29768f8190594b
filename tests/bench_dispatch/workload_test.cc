// The benchmark's workload: calibrated routing must hit its target skew, be valid routing (ids in
// range, no expert twice per token, T * K entries per rank, counts that match the ids), and be
// reproducible; the data values must be exact in every dtype, so the benchmark's bitwise checks
// are sound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "bench/dispatch/workload.h"

namespace moonep::bench {
namespace {

void ExpectValid(const Routing& r) {
  const int32_t R = r.num_ranks, E = r.num_experts, K = r.top_k;
  const int64_t T = r.tokens;
  ASSERT_EQ(r.ids.size(), static_cast<size_t>(R * T * K));
  std::vector<int64_t> counts(static_cast<size_t>(R) * E, 0), totals(E, 0);
  for (int32_t s = 0; s < R; ++s) {
    const int32_t* ids = r.ids_of(s);
    for (int64_t t = 0; t < T; ++t) {
      std::set<int32_t> seen;
      for (int32_t k = 0; k < K; ++k) {
        const int32_t e = ids[t * K + k];
        ASSERT_GE(e, 0);
        ASSERT_LT(e, E);
        ASSERT_TRUE(seen.insert(e).second) << "rank " << s << " token " << t << " takes " << e << " twice";
        ++counts[static_cast<size_t>(s) * E + e];
        ++totals[e];
      }
    }
  }
  EXPECT_EQ(counts, r.counts);
  EXPECT_EQ(totals, r.totals);
  for (int32_t s = 0; s < R; ++s) {
    int64_t sum = 0;
    for (int32_t e = 0; e < E; ++e) sum += r.counts[static_cast<size_t>(s) * E + e];
    EXPECT_EQ(sum, T * K) << "rank " << s;
  }
  EXPECT_DOUBLE_EQ(r.maxvio, MaxVio(r.totals));
}

TEST(BenchWorkload, MaxVioDefinition) {
  EXPECT_DOUBLE_EQ(MaxVio(std::vector<int64_t>{5, 5, 5, 5}), 0.0);
  EXPECT_DOUBLE_EQ(MaxVio(std::vector<int64_t>{10, 2, 4, 4}), 1.0);  // mean 5, max 10
  EXPECT_DOUBLE_EQ(MaxVio(std::vector<int64_t>{0, 0}), 0.0);
}

TEST(BenchWorkload, ZipfTotalsSumAndCap) {
  std::vector<int32_t> order(16);
  std::iota(order.begin(), order.end(), 0);
  for (double s : {0.0, 0.5, 1.0, 2.0, 8.0, 50.0}) {
    std::vector<int64_t> totals;
    ZipfTotals(s, order, 4 * 100 * 2, 4 * 100, &totals);
    EXPECT_EQ(std::accumulate(totals.begin(), totals.end(), int64_t{0}), 800) << s;
    for (int64_t c : totals) EXPECT_LE(c, 400) << s;
    // Popularity follows the order (non-increasing).
    for (size_t i = 1; i < totals.size(); ++i) EXPECT_GE(totals[i - 1] + 1, totals[i]) << s;
  }
}

TEST(BenchWorkload, HitsTargetMaxvio) {
  struct Case {
    int32_t R, E, K;
    int64_t T;
  };
  for (const Case& c : {Case{2, 8, 2, 64}, Case{4, 16, 2, 256}, Case{8, 64, 4, 128},
                        Case{16, 256, 8, 512}, Case{3, 9, 1, 50}}) {
    const double reachable = static_cast<double>(c.E) / c.K - 1.0;
    for (double target : {0.0, 0.25, 1.0, 2.0, 4.0, reachable}) {
      if (target > reachable) continue;
      RoutingSpec spec{c.R, c.E, c.K, c.T, {SkewSpec::Kind::kMaxvio, target}, 7};
      auto r = MakeRouting(spec);
      ASSERT_TRUE(r.ok()) << r.status();
      ExpectValid(*r);
      // maxvio moves in steps of E / (R T K) (one token of the hottest expert).
      const double step = static_cast<double>(c.E) / (static_cast<double>(c.R) * c.T * c.K);
      EXPECT_NEAR(r->maxvio, target, step + 1e-9)
          << "R=" << c.R << " E=" << c.E << " K=" << c.K << " T=" << c.T;
    }
  }
}

TEST(BenchWorkload, ZipfExponentIsUsedAsGiven) {
  RoutingSpec spec{4, 16, 2, 128, {SkewSpec::Kind::kZipf, 1.0}, 3};
  auto r = MakeRouting(spec);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectValid(*r);
  EXPECT_EQ(r->zipf_s, 1.0);
  EXPECT_GT(r->maxvio, 1.0);  // Zipf(1) over 16 experts: the top one has ~3x the mean
}

TEST(BenchWorkload, Reproducible) {
  RoutingSpec spec{4, 16, 2, 100, {SkewSpec::Kind::kMaxvio, 2.0}, 11};
  auto a = MakeRouting(spec), b = MakeRouting(spec);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->ids, b->ids);
  spec.seed = 12;
  auto c = MakeRouting(spec);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->ids, c->ids);
}

TEST(BenchWorkload, BadSpecsNameTheFlag) {
  auto unreachable = MakeRouting({4, 16, 2, 64, {SkewSpec::Kind::kMaxvio, 7.5}, 1});
  ASSERT_FALSE(unreachable.ok());
  EXPECT_NE(unreachable.status().message().find("--maxvio"), absl::string_view::npos);
  auto negative = MakeRouting({4, 16, 2, 64, {SkewSpec::Kind::kMaxvio, -1}, 1});
  EXPECT_FALSE(negative.ok());
  auto topk = MakeRouting({4, 16, 17, 64, {SkewSpec::Kind::kMaxvio, 0}, 1});
  ASSERT_FALSE(topk.ok());
  EXPECT_NE(topk.status().message().find("--topk"), absl::string_view::npos);
  auto tokens = MakeRouting({4, 16, 2, 0, {SkewSpec::Kind::kMaxvio, 0}, 1});
  ASSERT_FALSE(tokens.ok());
  EXPECT_NE(tokens.status().message().find("--tokens"), absl::string_view::npos);
  auto zipf = MakeRouting({4, 16, 2, 8, {SkewSpec::Kind::kZipf, -0.5}, 1});
  ASSERT_FALSE(zipf.ok());
  EXPECT_NE(zipf.status().message().find("--zipf"), absl::string_view::npos);
}

TEST(BenchWorkload, TokensTimesTopkAboveTheTransportLimitNameTheFlags) {
  // --tokens=2^60 --topk=8: R * T * K used to overflow and the ids' allocation threw
  // std::length_error. T * K is bounded by the transports' limit on entries per rank (2^31 - 1).
  auto huge = MakeRouting({4, 16, 8, int64_t{1} << 60, {SkewSpec::Kind::kMaxvio, 0}, 1});
  ASSERT_FALSE(huge.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(huge.status())) << huge.status();
  EXPECT_NE(huge.status().message().find("--tokens * --topk"), absl::string_view::npos)
      << huge.status();
  auto edge = MakeRouting({1, 16, 8, (int64_t{1} << 28), {SkewSpec::Kind::kMaxvio, 0}, 1});
  ASSERT_FALSE(edge.ok());  // 2^28 * 8 = 2^31: one past the limit
  EXPECT_NE(edge.status().message().find("2147483647"), absl::string_view::npos) << edge.status();
}

TEST(BenchWorkload, ValuesAreExactInEveryDtype) {
  // Products and K-term sums of these values must be exact in fp32, and the inputs exact in bf16.
  for (int64_t i = 0; i < 2000; ++i) {
    for (float v : {TokenValue(1, i, 3), TopkWeightValue(2, i, 1), GradValue(0, i, 7),
                    HomeGradValue(3, 1, i), SlotGradValue(2, 3, 2, i)}) {
      EXPECT_EQ(BFloat16::FromFloat(v).ToFloat(), v);
      EXPECT_EQ(std::ldexp(v, 8), std::round(std::ldexp(v, 8)));  // a multiple of 1/256
      EXPECT_LE(std::abs(v), 1.0f);
    }
  }
}

}  // namespace
}  // namespace moonep::bench
