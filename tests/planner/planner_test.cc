// Planner tests. Every plan made here is checked with ValidatePlan; balance and replica counts are
// compared with an exhaustive search on tiny cases and with moonep-greedy on random matrices.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "planner/eplb.h"
#include "planner/planner.h"
#include "tests/planner/brute_force.h"

namespace moonep::planner {
namespace {

using testing::BruteForceMinReplicas;

std::vector<int64_t> RankLoads(const Plan& p) {
  std::vector<int64_t> load(p.num_ranks, 0);
  const int32_t G = p.num_groups();
  for (int32_t d = 0; d < p.num_ranks; ++d) {
    for (int32_t g = 0; g < G; ++g) load[d] += p.group_count[static_cast<size_t>(d) * G + g];
  }
  return load;
}

Plan MustPlan(const PlannerConfig& c, const std::vector<int64_t>& counts) {
  auto planner = Planner::Create(c);
  EXPECT_TRUE(planner.ok()) << planner.status();
  Plan plan;
  if (!planner.ok()) return plan;
  const absl::Status s = (*planner)->MakePlan(counts, &plan);
  EXPECT_TRUE(s.ok()) << PolicyName(c.policy) << ": " << s;
  const absl::Status v = ValidatePlan(plan, counts);
  EXPECT_TRUE(v.ok()) << PolicyName(c.policy) << ": " << v;
  return plan;
}

// counts[R][E] whose per-expert totals are `totals`, spread over sources pseudo-randomly.
std::vector<int64_t> SpreadTotals(int R, const std::vector<int64_t>& totals, std::mt19937_64& rng) {
  const int E = static_cast<int>(totals.size());
  std::vector<int64_t> counts(static_cast<size_t>(R) * E, 0);
  for (int e = 0; e < E; ++e) {
    for (int64_t k = 0; k < totals[e]; ++k) ++counts[static_cast<size_t>(rng() % R) * E + e];
  }
  return counts;
}

bool Perfect(const std::vector<int64_t>& loads, int64_t total) {
  const int64_t R = static_cast<int64_t>(loads.size()), lo = total / R, hi = (total + R - 1) / R;
  for (int64_t l : loads) {
    if (l < lo || l > hi) return false;
  }
  return true;
}

// ---- Exhaustive small cases against brute force -------------------------------------------

TEST(PlannerBruteForce, PerfectWheneverFeasibleAndFewReplicas) {
  std::mt19937_64 rng(12345);
  int cases = 0, feasible = 0, optimal = 0, infeasible_known = 0;
  double gap_sum = 0, gap_worst = 0;
  int64_t sum_moonep = 0, sum_greedy = 0, sum_opt = 0;
  for (int R : {2, 3, 4}) {
    for (int epn : {1, 2}) {
      const int E = R * epn;
      for (int S : {1, 2}) {
        for (int iter = 0; iter < 45; ++iter) {
          std::vector<int64_t> totals(E);
          const int kind = iter % 3;
          for (int e = 0; e < E; ++e) {
            totals[e] = kind == 0 ? rng() % 7 : kind == 1 ? (rng() % 4 == 0 ? rng() % 13 : rng() % 3) : rng() % 10;
          }
          auto counts = SpreadTotals(R, totals, rng);
          PlannerConfig c;
          c.num_ranks = R;
          c.num_experts = E;
          c.slots = S;
          const Plan mine = MustPlan(c, counts);
          c.policy = Policy::kMoonEPGreedy;
          const Plan greedy = MustPlan(c, counts);
          const int64_t T = std::accumulate(totals.begin(), totals.end(), int64_t{0});
          std::vector<int> home(E);
          for (int e = 0; e < E; ++e) home[e] = e / epn;
          std::vector<int64_t> lo(R, T / R), hi(R, (T + R - 1) / R);
          const auto bf = BruteForceMinReplicas(R, E, S, home, totals, lo, hi, 6);
          ++cases;
          const bool mine_perfect = Perfect(RankLoads(mine), T);
          const bool greedy_perfect = Perfect(RankLoads(greedy), T);
          if (greedy_perfect && mine_perfect) {
            EXPECT_LE(mine.stats.replicas, greedy.stats.replicas) << "R=" << R << " E=" << E << " S=" << S;
          }
          EXPECT_LE(mine.stats.max_load_after, greedy.stats.max_load_after);
          if (bf.min_replicas >= 0) {
            ++feasible;
            EXPECT_TRUE(mine_perfect) << "perfect balance is feasible with " << bf.min_replicas
                                      << " replicas but moonep reached max " << mine.stats.max_load_after
                                      << " (R=" << R << " E=" << E << " S=" << S << ") totals " << ::testing::PrintToString(totals);
            if (!mine_perfect) continue;
            EXPECT_GE(mine.stats.replicas, bf.min_replicas);
            const int gap = mine.stats.replicas - bf.min_replicas;
            optimal += gap == 0;
            const double rel = bf.min_replicas > 0 ? static_cast<double>(gap) / bf.min_replicas : 0.0;
            gap_sum += rel;
            gap_worst = std::max(gap_worst, rel);
            sum_moonep += mine.stats.replicas;
            sum_opt += bf.min_replicas;
            if (greedy_perfect) sum_greedy += greedy.stats.replicas;
          } else if (bf.exhausted) {
            ++infeasible_known;
            EXPECT_FALSE(mine_perfect) << "brute force says infeasible, yet moonep found a perfect plan";
          }
        }
      }
    }
  }
  std::printf("[brute force] %d cases, %d perfect-feasible, %d proven infeasible; moonep optimal in %d; "
              "replica gap to optimum: mean %.2f%%, worst %.0f%%; replicas total moonep %lld, optimum %lld, "
              "greedy %lld (on cases greedy also balanced)\n",
              cases, feasible, infeasible_known, optimal, 100.0 * gap_sum / std::max(feasible, 1),
              100.0 * gap_worst, static_cast<long long>(sum_moonep), static_cast<long long>(sum_opt),
              static_cast<long long>(sum_greedy));
  EXPECT_LT(gap_sum / std::max(feasible, 1), 0.05);
}

}  // namespace
}  // namespace moonep::planner
