// Traffic counting against brute force over the plan's pieces, and against the planner's stats.
#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "planner/planner.h"
#include "planner/sim/traffic.h"

namespace moonep::sim {
namespace {

using planner::Plan;
using planner::Planner;
using planner::PlannerConfig;
using planner::Policy;

struct Case {
  int32_t R, E, K, T, rpn;
  double s;
};

StepRouting Sample(const Case& c, uint64_t seed, RoutingKind kind = RoutingKind::kZipf) {
  RoutingParams p;
  p.kind = kind;
  p.num_ranks = c.R;
  p.num_experts = c.E;
  p.topk = c.K;
  p.tokens_per_rank = c.T;
  p.zipf_s = c.s;
  p.seed = seed;
  auto m = RoutingModel::Create(p);
  EXPECT_TRUE(m.ok());
  StepRouting st;
  (*m)->NextTokens(&st);
  return st;
}

Plan MakePlan(const Case& c, Policy policy, const StepRouting& st) {
  PlannerConfig cfg;
  cfg.num_ranks = c.R;
  cfg.num_experts = c.E;
  cfg.ranks_per_node = c.rpn;
  cfg.policy = policy;
  auto planner = Planner::Create(cfg);
  EXPECT_TRUE(planner.ok()) << planner.status();
  Plan plan;
  absl::Status s = (*planner)->MakePlan(st.counts, &plan);
  EXPECT_TRUE(s.ok()) << s;
  return plan;
}

// Brute force: each (token, choice) finds its position in the expert's canonical order by
// counting, then the piece holding it by a linear search.
void BruteForce(const Plan& plan, const StepRouting& st, RankTraffic* tr, PlanMetrics* m) {
  const int32_t R = st.num_ranks, E = st.num_experts, K = st.topk;
  tr->Reset(R);
  *m = PlanMetrics{};
  auto node = [&](int32_t r) { return plan.ranks_per_node > 0 ? r / plan.ranks_per_node : r; };
  for (int32_t s = 0; s < R; ++s) {
    for (int32_t t = 0; t < st.tokens[s]; ++t) {
      std::set<int32_t> dests;
      for (int32_t k = 0; k < K; ++k) {
        const int32_t e = st.topk_ids[(static_cast<size_t>(s) * st.tokens[s] + t) * K + k];
        int64_t pos = 0;
        for (int32_t u = 0; u < s; ++u) pos += st.counts[u * E + e];
        for (int32_t t2 = 0; t2 < t; ++t2) {
          for (int32_t k2 = 0; k2 < K; ++k2) {
            pos += st.topk_ids[(static_cast<size_t>(s) * st.tokens[s] + t2) * K + k2] == e;
          }
        }
        int32_t dest = -1;
        for (int32_t p = plan.piece_begin[e]; p < plan.piece_begin[e + 1]; ++p) {
          if (plan.piece_start[p] <= pos && pos < plan.piece_start[p] + plan.piece_count[p]) {
            dest = plan.piece_dest[p];
          }
        }
        ASSERT_GE(dest, 0);
        tr->load[dest] += 1;
        if (dest == s) ++m->rows_local;
        else if (node(dest) == node(s)) ++m->rows_intra;
        else ++m->rows_inter;
        if (dest != s) dests.insert(dest);
      }
      for (int32_t d : dests) {
        if (node(d) == node(s)) {
          ++tr->send_intra[s];
          ++tr->recv_intra[d];
        } else {
          ++tr->send_inter[s];
          ++tr->recv_inter[d];
        }
      }
    }
  }
}

TEST(TrafficTest, TokensDetailIsExact) {
  const Case cases[] = {{8, 16, 2, 60, 4, 1.0}, {6, 12, 3, 40, 0, 1.5}, {4, 8, 4, 50, 2, 0.5}};
  for (const Case& c : cases) {
    for (Policy policy : {Policy::kNone, Policy::kMoonEP, Policy::kMoonEPGreedy, Policy::kEplb,
                          Policy::kFasterMoEShadow, Policy::kTestForceReplicas}) {
      const StepRouting st = Sample(c, 11);
      const Plan plan = MakePlan(c, policy, st);
      TrafficCounter counter;
      RankTraffic tr, ref;
      PlanMetrics m, refm;
      counter.FromTokens(plan, st, &tr, &m);
      BruteForce(plan, st, &ref, &refm);
      const std::string what = std::string(planner::PolicyName(policy)) + " R=" + std::to_string(c.R);
      EXPECT_EQ(tr.load, ref.load) << what;
      EXPECT_EQ(tr.send_intra, ref.send_intra) << what;
      EXPECT_EQ(tr.send_inter, ref.send_inter) << what;
      EXPECT_EQ(tr.recv_intra, ref.recv_intra) << what;
      EXPECT_EQ(tr.recv_inter, ref.recv_inter) << what;
      // Undeduplicated rows agree with the planner's own stats.
      EXPECT_EQ(m.rows_local, plan.stats.rows_local) << what;
      EXPECT_EQ(m.rows_intra, plan.stats.rows_travel_intra) << what;
      EXPECT_EQ(m.rows_inter, plan.stats.rows_travel_inter) << what;
      EXPECT_EQ(m.rows_local, refm.rows_local) << what;
      EXPECT_EQ(m.max_load, plan.stats.max_load_after) << what;
      EXPECT_EQ(m.replicas, plan.stats.replicas) << what;
      EXPECT_EQ(m.prefetch_intra, plan.stats.prefetch_intra) << what;
      EXPECT_EQ(m.prefetch_inter, plan.stats.prefetch_inter) << what;
      EXPECT_EQ(m.total_tokens, int64_t{c.R} * c.T * c.K) << what;
      int64_t sent = 0;
      for (int32_t r = 0; r < c.R; ++r) sent += tr.send_intra[r] + tr.send_inter[r];
      EXPECT_EQ(sent, m.dispatch_intra + m.dispatch_inter) << what;
      EXPECT_LE(sent, m.rows_intra + m.rows_inter) << what;
    }
  }
}

TEST(TrafficTest, CountsDetailHasExactRowsAndBoundedDedup) {
  const Case c = {8, 32, 4, 400, 4, 0.8};
  for (Policy policy : {Policy::kNone, Policy::kMoonEP, Policy::kTestForceReplicas}) {
    StepRouting st = Sample(c, 5);
    const Plan plan = MakePlan(c, policy, st);
    TrafficCounter counter;
    RankTraffic exact, est;
    PlanMetrics me, mc;
    counter.FromTokens(plan, st, &exact, &me);
    st.topk_ids.clear();
    counter.FromCounts(plan, st, &est, &mc);
    EXPECT_EQ(mc.rows_local, me.rows_local);
    EXPECT_EQ(mc.rows_intra, me.rows_intra);
    EXPECT_EQ(mc.rows_inter, me.rows_inter);
    EXPECT_EQ(est.load, exact.load);
    // Dedup never more than the rows, never less than rows / K.
    EXPECT_LE(mc.dispatch_intra + mc.dispatch_inter, mc.rows_intra + mc.rows_inter);
    EXPECT_GE(mc.dispatch_intra + mc.dispatch_inter, (mc.rows_intra + mc.rows_inter) / c.K);
  }
}

// On uniform routing a token's choices are independent enough that the dedup estimate should be
// close to the exact count.
TEST(TrafficTest, DedupEstimateIsCloseOnUniformRouting) {
  const Case c = {16, 64, 8, 500, 4, 0};
  StepRouting st = Sample(c, 9, RoutingKind::kUniform);
  const Plan plan = MakePlan(c, Policy::kNone, st);
  TrafficCounter counter;
  RankTraffic exact, est;
  PlanMetrics me, mc;
  counter.FromTokens(plan, st, &exact, &me);
  StepRouting counts_only = st;
  counts_only.topk_ids.clear();
  counter.FromCounts(plan, counts_only, &est, &mc);
  const double e = me.dispatch_intra + me.dispatch_inter, g = mc.dispatch_intra + mc.dispatch_inter;
  EXPECT_NEAR(g / e, 1.0, 0.01);
}

TEST(TrafficTest, TotalsDetailWithTrueLocalityMatchesPlacement) {
  const Case c = {8, 32, 4, 300, 4, 1.0};
  for (Policy policy : {Policy::kNone, Policy::kMoonEP, Policy::kMoonEPGreedy}) {
    StepRouting st = Sample(c, 21);
    PlannerConfig cfg;
    cfg.num_ranks = c.R;
    cfg.num_experts = c.E;
    cfg.ranks_per_node = c.rpn;
    cfg.policy = policy;
    auto planner = Planner::Create(cfg);
    ASSERT_TRUE(planner.ok());
    Plan decided;
    ASSERT_TRUE((*planner)->Decide(st.totals, &decided).ok());
    TrafficCounter counter;
    RankTraffic tr;
    PlanMetrics m;
    const LocalityFn locality = [&](int32_t rank, int32_t e, double* own, double* node) {
      *own = static_cast<double>(st.counts[rank * c.E + e]);
      *node = 0;
      const int32_t n0 = rank / c.rpn * c.rpn;
      for (int32_t r = n0; r < n0 + c.rpn; ++r) *node += st.counts[r * c.E + e];
    };
    counter.FromTotals(decided, st, locality, &tr, &m);
    EXPECT_EQ(m.max_load, decided.stats.max_load_after);
    EXPECT_EQ(m.replicas, decided.stats.replicas);
    EXPECT_EQ(m.total_tokens, int64_t{c.R} * c.T * c.K);
    EXPECT_NEAR(static_cast<double>(m.rows_local + m.rows_intra + m.rows_inter), m.total_tokens, 3);
    if (policy == Policy::kNone) {
      // Home placement: every expert's rows come from where they are; nothing is estimated.
      const Plan full = MakePlan(c, policy, st);
      EXPECT_EQ(m.rows_local, full.stats.rows_local);
      EXPECT_EQ(m.rows_intra, full.stats.rows_travel_intra);
      EXPECT_EQ(m.rows_inter, full.stats.rows_travel_inter);
    }
  }
}

TEST(TrafficTest, DedupRowsBounds) {
  EXPECT_DOUBLE_EQ(DedupRows(0, 100, 8, 64), 0);
  EXPECT_DOUBLE_EQ(DedupRows(50, 100, 1, 64), 50);
  EXPECT_DOUBLE_EQ(DedupRows(800, 100, 8, 64), 100);  // every choice lands there: one row per token
  const double d = DedupRows(100, 100, 8, 64);
  EXPECT_LE(d, 100);
  EXPECT_GE(d, 100.0 / 8);
  // Holding 8 of 64 experts: P(token misses) = C(56, 8) / C(64, 8).
  double miss = 1;
  for (int i = 0; i < 8; ++i) miss *= (56.0 - i) / (64.0 - i);
  EXPECT_NEAR(d, 100 * (1 - miss), 1e-9);
  // Many experts: independent choices.
  EXPECT_NEAR(DedupRows(100, 100, 8, 1 << 30), 100 * (1 - std::pow(1 - 100.0 / 800, 8)), 1e-6);
}

// Chain hops worked by hand (2 nodes of 2). Expert 0 (home 0) on ranks 1, 2, 3: prefetch 0 -> 1
// (intra), 1 -> 2 (inter), 2 -> 3 (intra); reduce 1 -> 2 (inter), 2 -> 3 (intra), 3 -> 0 (inter).
// Expert 1 (home 1) on rank 3: prefetch 1 -> 3 and reduce 3 -> 1, both inter.
TEST(TrafficTest, ReplicasMoveAlongChains) {
  Plan p;
  p.num_ranks = 4;
  p.num_experts = 4;
  p.experts_per_rank = 1;
  p.slots = 2;
  p.ranks_per_node = 2;
  p.home = {0, 1, 2, 3};
  p.home_group = {0, 0, 0, 0};
  p.alloc.assign(16, 0);
  p.alloc[0 * 4 + 0] = 10;
  p.alloc[0 * 4 + 1] = p.alloc[0 * 4 + 2] = p.alloc[0 * 4 + 3] = 5;
  p.alloc[1 * 4 + 1] = 6;
  p.alloc[1 * 4 + 3] = 2;
  p.slot_expert = {-1, -1, 0, -1, 0, -1, 0, 1};
  TrafficCounter counter;
  RankTraffic tr;
  PlanMetrics m;
  counter.Placement(p, &tr, &m);
  EXPECT_EQ(m.replicas, 4);
  EXPECT_EQ(m.prefetch_intra, 1);  // by replica and home, as PlanStats
  EXPECT_EQ(m.prefetch_inter, 3);
  EXPECT_EQ(tr.load, (std::vector<int64_t>{10, 11, 5, 7}));
  using V = std::vector<int32_t>;
  EXPECT_EQ(tr.prefetch_out_intra, (V{1, 0, 1, 0}));
  EXPECT_EQ(tr.prefetch_out_inter, (V{0, 2, 0, 0}));
  EXPECT_EQ(tr.prefetch_in_intra, (V{0, 1, 0, 1}));
  EXPECT_EQ(tr.prefetch_in_inter, (V{0, 0, 1, 1}));
  EXPECT_EQ(tr.reduce_out_intra, (V{0, 0, 1, 0}));
  EXPECT_EQ(tr.reduce_out_inter, (V{0, 1, 0, 2}));
  EXPECT_EQ(tr.reduce_in_intra, (V{0, 0, 0, 1}));
  EXPECT_EQ(tr.reduce_in_inter, (V{1, 1, 1, 0}));
  // The reduce's slowest rank is rank 3, sending two gradients across nodes (one per chain): two
  // transfer times, where gathering at the homes would cost rank 0 three.
  CostConfig c;
  c.ranks_per_node = 2;
  const StepTime t = EstimateStepTime(c, 4, tr);
  EXPECT_DOUBLE_EQ(t.reduce, 2 * static_cast<double>(c.expert_grad_bytes()) / (c.inter_gbps * 1e9));
}

}  // namespace
}  // namespace moonep::sim
