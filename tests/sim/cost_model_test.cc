// Cost model: FLOPs, bytes and phase times against hand-computed values; presets; stats helpers.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/sim/cost_model.h"
#include "planner/sim/stats.h"

namespace moonep::sim {
namespace {

CostConfig Config() {
  CostConfig c;
  c.hidden = 1000;
  c.intermediate = 500;
  c.tflops = 100;
  c.ranks_per_node = 2;
  c.intra_gbps = 100;
  c.inter_gbps = 10;
  return c;
}

TEST(CostModelTest, FlopsAndBytes) {
  CostConfig c = Config();
  c.training = false;
  EXPECT_DOUBLE_EQ(c.flops_per_token(), 6.0 * 1000 * 500);
  c.training = true;
  EXPECT_DOUBLE_EQ(c.flops_per_token(), 18.0 * 1000 * 500);
  EXPECT_EQ(c.row_bytes(), 2000);
  EXPECT_EQ(c.expert_weight_bytes(), 3LL * 1000 * 500 * 2);
  EXPECT_EQ(c.expert_grad_bytes(), 3LL * 1000 * 500 * 4);
}

// An expert above 2^40 bytes is refused (its byte counts would pass int64); the DeepSeek-V3
// expert (3 x 7168 x 2048 x 4-byte gradients) is far below.
TEST(CostModelTest, ExpertsAbove2To40BytesAreRefused) {
  CostConfig c = Config();
  EXPECT_TRUE(ValidateCostConfig(c).ok());
  c.hidden = 7168;
  c.intermediate = 2048;
  EXPECT_TRUE(ValidateCostConfig(c).ok());
  c.hidden = c.intermediate = 1 << 30;
  const absl::Status s = ValidateCostConfig(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("2^40"), std::string::npos) << s;
  c.hidden = INT32_MAX;
  c.intermediate = INT32_MAX;
  EXPECT_FALSE(ValidateCostConfig(c).ok());
}

TEST(CostModelTest, PhaseTimesFromTheSlowestRank) {
  CostConfig c = Config();
  RankTraffic tr;
  tr.Reset(4);
  tr.load = {100, 400, 200, 100};
  tr.send_intra = {50, 0, 0, 0};
  tr.recv_intra = {0, 80, 0, 0};   // rank 1: 80 rows over intra
  tr.send_inter = {0, 0, 30, 0};
  tr.recv_inter = {0, 0, 0, 30};   // rank 2 / 3: 30 rows over inter
  tr.prefetch_out_inter = {1, 0, 0, 0};  // one replica of a rank-0 expert on rank 3
  tr.prefetch_in_inter = {0, 0, 0, 1};
  tr.reduce_out_inter = {0, 0, 0, 1};
  tr.reduce_in_inter = {1, 0, 0, 0};
  const StepTime t = EstimateStepTime(c, 8, tr);
  const double intra = 100e9, inter = 10e9;
  const double rows = std::max(80 * 2000 / intra, 30 * 2000 / inter);
  EXPECT_DOUBLE_EQ(t.compute, 400 * c.flops_per_token() / 100e12);
  EXPECT_DOUBLE_EQ(t.dispatch, 2 * rows);  // forward + backward
  EXPECT_DOUBLE_EQ(t.combine, 2 * rows);
  const double prefetch = c.expert_weight_bytes() / inter;
  EXPECT_DOUBLE_EQ(t.prefetch, std::max(0.0, prefetch - rows));  // hidden under forward dispatch
  EXPECT_DOUBLE_EQ(t.reduce, c.expert_grad_bytes() / inter);
  EXPECT_DOUBLE_EQ(t.counts, 3.0 * 8 * 4 / inter);  // 4 ranks over 2 nodes: inter-node allgather
  EXPECT_DOUBLE_EQ(t.total, t.counts + t.prefetch + t.dispatch + t.compute + t.combine + t.reduce);

  c.overlap_prefetch = false;
  c.training = false;
  const StepTime f = EstimateStepTime(c, 8, tr);
  EXPECT_DOUBLE_EQ(f.prefetch, prefetch);
  EXPECT_DOUBLE_EQ(f.dispatch, rows);
  EXPECT_DOUBLE_EQ(f.reduce, 0.0);
  EXPECT_DOUBLE_EQ(f.compute, 400 * 6.0 * 1000 * 500 / 100e12);

  // One node: the allgather stays on the intra-node links.
  c.ranks_per_node = 4;
  EXPECT_DOUBLE_EQ(EstimateStepTime(c, 8, tr).counts, 3.0 * 8 * 4 / intra);
  const StepTime lb = EstimateComputeOnly(c, 4, 8, 200);
  EXPECT_DOUBLE_EQ(lb.total, lb.counts + 200 * c.flops_per_token() / 100e12);
}

// Each rank computes its padded rows at tflops x its speed, and the compute phase is the slowest
// rank's; the links do not change. Figures worked out by hand: 18 * 1000 * 500 = 9e6 FLOPs a token.
TEST(CostModelTest, EachRankComputesAtItsSpeed) {
  CostConfig c = Config();
  RankTraffic tr;
  tr.Reset(4);
  tr.load = {100, 400, 200, 100};
  tr.padded = {128, 400, 200, 0};  // 0: not known, the load counts
  tr.send_inter = {0, 0, 30, 0};
  tr.recv_inter = {0, 0, 0, 30};
  const StepTime plain = EstimateStepTime(c, 8, tr);
  EXPECT_DOUBLE_EQ(plain.compute, 400 * 9e6 / 100e12);  // rank 1's 400 rows
  // Rank times 128 / 1, 400 / 2, 200 / 0.25, 100 / 0.5 rows at 100 TFLOP/s: rank 2's 800.
  c.speeds = {1, 2, 0.25, 0.5};
  const StepTime fast_and_slow = EstimateStepTime(c, 8, tr);
  EXPECT_DOUBLE_EQ(fast_and_slow.compute, 200 * 9e6 / 25e12);
  EXPECT_DOUBLE_EQ(fast_and_slow.compute, 7.2e-5);
  EXPECT_DOUBLE_EQ(fast_and_slow.dispatch, plain.dispatch);
  EXPECT_DOUBLE_EQ(fast_and_slow.combine, plain.combine);
  EXPECT_DOUBLE_EQ(fast_and_slow.counts, plain.counts);
  EXPECT_DOUBLE_EQ(fast_and_slow.total - fast_and_slow.compute, plain.total - plain.compute);
  // The padding counts at the rank's speed: rank 0's 128 rows at 0.1 take 1280.
  c.speeds = {0.1, 1, 1, 1};
  EXPECT_DOUBLE_EQ(EstimateStepTime(c, 8, tr).compute, 128 * 9e6 / 10e12);
  // Every speed 1 is the machine without speeds, to the bit.
  c.speeds = {1, 1, 1, 1};
  EXPECT_EQ(EstimateStepTime(c, 8, tr).compute, plain.compute);
  EXPECT_EQ(EstimateStepTime(c, 8, tr).total, plain.total);

  // The lower bound's row: a level is in tokens of the fastest rank (here 2: 200 TFLOP/s).
  c.speeds = {1, 2, 0.25, 0.5};
  EXPECT_DOUBLE_EQ(EstimateComputeOnly(c, 4, 8, 400).compute, 400 * 9e6 / 200e12);
  c.speeds.clear();
  EXPECT_DOUBLE_EQ(EstimateComputeOnly(c, 4, 8, 400).compute, 400 * 9e6 / 100e12);
}

// moonep-weighed's costs are in tokens of the fastest rank's compute, as the planner's levels are
// (PlannerConfig::replica_cost_intra): a rank twice as fast makes every transfer worth twice the
// tokens; slow ranks alone change nothing. By hand: a replica's fp32 gradients are 6e6 bytes,
// 6e-5 s at 100 GB/s and 6e-4 s at 10 GB/s; a token is 9e-8 s at 100 TFLOP/s; a row's dispatch
// and combine, both passes, 8000 bytes, in 1/1024 tokens.
TEST(CostModelTest, ReplicaAndRowCostsAreInTokensOfTheFastestRank) {
  CostConfig c = Config();
  int64_t intra = 0, inter = 0;
  for (const std::vector<double>& speeds :
       {std::vector<double>{}, std::vector<double>{1, 0.5, 0.25, 1}}) {
    c.speeds = speeds;
    ReplicaCosts(c, &intra, &inter);
    EXPECT_EQ(intra, 667);   // 6e-5 / 9e-8 = 666.7
    EXPECT_EQ(inter, 6667);  // 6e-4 / 9e-8
    RowCosts(c, &intra, &inter);
    EXPECT_EQ(intra, 910);   // 8e-8 / 9e-8 * 1024 = 910.2
    EXPECT_EQ(inter, 9102);
  }
  c.speeds = {1, 2, 0.5, 1};  // a token of the fastest rank: 4.5e-8 s
  ReplicaCosts(c, &intra, &inter);
  EXPECT_EQ(intra, 1333);
  EXPECT_EQ(inter, 13333);
  RowCosts(c, &intra, &inter);
  EXPECT_EQ(intra, 1820);  // 8e-8 / 4.5e-8 * 1024 = 1820.4
  EXPECT_EQ(inter, 18204);
}

TEST(CostModelTest, InvalidConfigNamesTheField) {
  CostConfig c = Config();
  c.inter_gbps = 0;
  absl::Status s = ValidateCostConfig(c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("inter_gbps"), std::string::npos);
  c = Config();
  c.hidden = 0;
  EXPECT_NE(ValidateCostConfig(c).message().find("hidden"), std::string::npos);
  // Rates so small (or large) that a phase's time would overflow to infinity are refused, each
  // naming its flag; the bounds themselves are accepted.
  for (double bad : {1e-300, 4.9e-324, 1e-7, 2e9, std::nan(""), HUGE_VAL, -1.0}) {
    for (const char* field : {"tflops", "intra_gbps", "inter_gbps"}) {
      c = Config();
      double* rate = std::string(field) == "tflops" ? &c.tflops
                     : std::string(field) == "intra_gbps" ? &c.intra_gbps : &c.inter_gbps;
      *rate = bad;
      s = ValidateCostConfig(c);
      ASSERT_FALSE(s.ok()) << field << " " << bad;
      EXPECT_NE(s.message().find(std::string(field) + " must be in [1e-6, 1e9]"),
                std::string::npos) << s.message();
      for (double edge : {1e-6, 1e9}) {
        *rate = edge;
        EXPECT_TRUE(ValidateCostConfig(c).ok()) << field << " " << edge;
      }
    }
  }
  // A rank's speed likewise, naming the rank.
  for (double bad : {0.0, -1.0, 1e-7, 2e6, std::nan(""), HUGE_VAL}) {
    c = Config();
    c.speeds = {1, bad};
    s = ValidateCostConfig(c);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.message().find("the speed of rank 1 must be in [1e-6, 1e6]"), std::string::npos)
        << s.message();
  }
  for (double edge : {1e-6, 1e6}) {
    c.speeds = {edge, 1};
    EXPECT_TRUE(ValidateCostConfig(c).ok()) << edge;
  }
}

TEST(CostModelTest, PresetsAreTheIssueShapes) {
  const Preset* d = FindPreset("deepseek-v3-ep64");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->ranks, 64);
  EXPECT_EQ(d->experts, 256);
  EXPECT_EQ(d->topk, 8);
  EXPECT_EQ(d->hidden, 7168);
  EXPECT_EQ(d->intermediate, 2048);
  const Preset* k = FindPreset("kimi-k3.1-like-ep128");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->ranks, 128);
  EXPECT_EQ(k->experts, 896);
  EXPECT_EQ(k->topk, 16);
  const Preset* m = FindPreset("mixtral-ep8");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->experts, 8);
  EXPECT_EQ(m->topk, 2);
  EXPECT_EQ(m->hidden, 4096);
  EXPECT_EQ(m->intermediate, 14336);
  EXPECT_EQ(FindPreset("gpt-5"), nullptr);
  for (const Preset& p : Presets()) EXPECT_EQ(p.experts % p.ranks, 0) << p.name;
}

TEST(StatsTest, QuantilesWithinResolution) {
  std::mt19937_64 rng(3);
  std::lognormal_distribution<double> dist(0.0, 1.0);
  std::vector<double> values;
  Distribution d;
  for (int i = 0; i < 20000; ++i) {
    values.push_back(dist(rng));
    d.Add(values.back());
  }
  std::sort(values.begin(), values.end());
  for (double q : {0.01, 0.5, 0.9, 0.99, 1.0}) {
    const double exact = values[std::max<size_t>(1, std::ceil(q * values.size())) - 1];
    EXPECT_GE(d.Quantile(q), exact * (1 - 1e-12)) << q;
    EXPECT_LE(d.Quantile(q), exact * 1.001 + 1e-12) << q;
  }
  double sum = 0;
  for (double v : values) sum += v;
  EXPECT_NEAR(d.mean(), sum / values.size(), 1e-9);
  EXPECT_EQ(d.max(), values.back());
}

// Values beyond the histogram's range (an infinite or huge step time) land in its last bucket:
// they used to be cast to an int out of range and index before the buckets.
TEST(StatsTest, ValuesBeyondTheRangeLandInTheLastBucket) {
  Distribution d;
  for (double v : {2.0, 1e300, HUGE_VAL, 0.0, -5.0}) d.Add(v);
  EXPECT_EQ(d.count(), 5);
  EXPECT_EQ(d.max(), HUGE_VAL);
  EXPECT_GE(d.Quantile(1.0), 1e9 * (1 - 1e-9));  // the last bucket's upper edge
  EXPECT_LE(d.Quantile(0.6), 2.0 * 1.001);        // the third smallest is 2
  EXPECT_GE(d.Quantile(0.6), 2.0);
}

TEST(StatsTest, SeriesKeepsBoundedPointsAndExactMeans) {
  DownsampledSeries s(8);
  for (int i = 0; i < 1000; ++i) s.Add(i);
  const auto pts = s.Points();
  EXPECT_LE(pts.size(), 8u);
  EXPECT_EQ(s.steps(), 1000);
  double covered = 0;
  for (const auto& p : pts) {
    // Values are the step numbers: a run's mean is its middle step, its max its last.
    EXPECT_DOUBLE_EQ(p.mean, (p.first_step + p.last_step) / 2);
    EXPECT_DOUBLE_EQ(p.max, p.last_step);
    covered += p.last_step - p.first_step + 1;
  }
  EXPECT_EQ(covered, 1000);
}

}  // namespace
}  // namespace moonep::sim
