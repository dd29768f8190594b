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
#include "planner/plan_builder.h"
#include "planner/planner.h"
#include "planner/policy.h"
#include "tests/planner/brute_force.h"
#include "tests/planner/weighed_cost.h"

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
  // The planner's sparse FinalizeHolders must equal the reference FinalizePlan byte for byte.
  Plan again = plan;
  BuildScratch scratch;
  EXPECT_TRUE(FinalizePlan(planner.value()->config(), counts, &again, &scratch).ok());
  EXPECT_EQ(SerializePlan(again), SerializePlan(plan)) << PolicyName(c.policy);
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
  int64_t sum_moonep = 0, sum_greedy = 0, sum_opt = 0, sum_moonep_both = 0, sum_opt_both = 0;
  int both = 0;
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
            if (greedy_perfect) {
              sum_greedy += greedy.stats.replicas;
              sum_moonep_both += mine.stats.replicas;
              sum_opt_both += bf.min_replicas;
              ++both;
            }
          } else if (bf.exhausted) {
            ++infeasible_known;
            EXPECT_FALSE(mine_perfect) << "brute force says infeasible, yet moonep found a perfect plan";
          }
        }
      }
    }
  }
  std::printf("[brute force] %d cases, %d perfect-feasible, %d proven infeasible; moonep optimal in %d; "
              "replica gap to optimum: mean %.2f%%, worst %.0f%%; replicas total moonep %lld vs optimum %lld; "
              "on the %d cases moonep-greedy also balanced: moonep %lld, moonep-greedy %lld, optimum %lld\n",
              cases, feasible, infeasible_known, optimal, 100.0 * gap_sum / std::max(feasible, 1),
              100.0 * gap_worst, static_cast<long long>(sum_moonep), static_cast<long long>(sum_opt), both,
              static_cast<long long>(sum_moonep_both), static_cast<long long>(sum_greedy),
              static_cast<long long>(sum_opt_both));
  EXPECT_LT(gap_sum / std::max(feasible, 1), 0.05);
}


// ---- Property tests on random matrices ------------------------------------------------------

enum class Skew { kUniform, kZipf, kOneExpert, kAllZero, kEmptyRank, kRaggedRanks };

// counts[R][E] for `tokens` tokens per rank with top-k routing, drawn from a skew model.
std::vector<int64_t> MakeCounts(Skew skew, int R, int E, int64_t tokens, int K, double zipf,
                                std::mt19937_64& rng) {
  std::vector<double> p(E, 1.0);
  std::vector<int> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  if (skew == Skew::kZipf) {
    for (int i = 0; i < E; ++i) p[perm[i]] = 1.0 / std::pow(i + 1.0, zipf);
  }
  double sum = std::accumulate(p.begin(), p.end(), 0.0);
  std::vector<int64_t> counts(static_cast<size_t>(R) * E, 0);
  if (skew == Skew::kAllZero) return counts;
  std::uniform_real_distribution<double> noise(0.8, 1.2);
  for (int s = 0; s < R; ++s) {
    int64_t t = tokens;
    if (skew == Skew::kEmptyRank && s == R / 2) t = 0;
    if (skew == Skew::kRaggedRanks) t = tokens * (1 + static_cast<int64_t>(rng() % 16)) / 8;
    const int64_t rows = t * K;
    if (skew == Skew::kOneExpert) {
      counts[static_cast<size_t>(s) * E + perm[0]] = rows;
      continue;
    }
    for (int e = 0; e < E; ++e) {
      counts[static_cast<size_t>(s) * E + e] = static_cast<int64_t>(rows * p[e] / sum * noise(rng));
    }
  }
  return counts;
}

TEST(PlannerProperties, EveryPolicyValidatesAndMoonEPBeatsGreedy) {
  std::mt19937_64 rng(7);
  struct Shape { int R, E, slots, rpn; int64_t tokens; int K; };
  const std::vector<Shape> shapes = {{2, 4, -1, 0, 64, 2},      {4, 16, -1, 2, 256, 4},
                                     {8, 32, 2, 4, 512, 4},     {16, 64, -1, 8, 1024, 8},
                                     {64, 256, -1, 8, 4096, 8}, {128, 896, 4, 8, 4096, 16},
                                     {256, 512, 1, 16, 512, 8}};
  int64_t rep_moonep = 0, rep_greedy = 0, travel_moonep = 0, travel_greedy = 0;
  int plans = 0, fewer_replicas = 0, more_travel_cases = 0, greedy_worse_balance = 0, compared = 0;
  int more_travel_fewer_replicas = 0;
  for (const Shape& sh : shapes) {
    for (Skew skew : {Skew::kUniform, Skew::kZipf, Skew::kOneExpert, Skew::kAllZero, Skew::kEmptyRank,
                      Skew::kRaggedRanks}) {
      for (double zipf : {0.5, 1.2, 2.0}) {
        if (skew != Skew::kZipf && zipf != 1.2) continue;
        auto counts = MakeCounts(skew, sh.R, sh.E, sh.tokens, sh.K, zipf, rng);
        PlannerConfig c;
        c.num_ranks = sh.R;
        c.num_experts = sh.E;
        c.slots = sh.slots;
        c.ranks_per_node = sh.rpn;
        c.pad_multiple = 1 + static_cast<int>(rng() % 3) * 4;
        Plan by_policy[6];
        for (int pol = 0; pol < 6; ++pol) {
          c.policy = static_cast<Policy>(pol);
          by_policy[pol] = MustPlan(c, counts);
          ++plans;
        }
        const Plan& mine = by_policy[static_cast<int>(Policy::kMoonEP)];
        const Plan& greedy = by_policy[static_cast<int>(Policy::kMoonEPGreedy)];
        const int64_t lb = LoadLowerBound(Planner::Create(c).value()->config(), counts);
        EXPECT_LE(mine.stats.max_load_after, greedy.stats.max_load_after);
        if (mine.stats.max_load_after == greedy.stats.max_load_after) {
          EXPECT_LE(mine.stats.replicas, greedy.stats.replicas) << "R=" << sh.R << " E=" << sh.E;
        }
        EXPECT_GE(mine.stats.max_load_after, lb);
        const int64_t tm = mine.stats.rows_travel_intra + mine.stats.rows_travel_inter;
        const int64_t tg = greedy.stats.rows_travel_intra + greedy.stats.rows_travel_inter;
        if (mine.stats.max_load_after < greedy.stats.max_load_after) {
          ++greedy_worse_balance;
          continue;
        }
        if (mine.stats.replicas == greedy.stats.replicas) {
          // Same balance and replicas: moonep keeps greedy's decisions unless its own travel less.
          EXPECT_LE(tm, tg) << "R=" << sh.R << " E=" << sh.E;
        }
        rep_moonep += mine.stats.replicas;
        rep_greedy += greedy.stats.replicas;
        travel_moonep += tm;
        travel_greedy += tg;
        fewer_replicas += mine.stats.replicas < greedy.stats.replicas;
        more_travel_cases += tm > tg;
        more_travel_fewer_replicas += tm > tg && mine.stats.replicas < greedy.stats.replicas;
        ++compared;
      }
    }
  }
  std::printf("[properties] %d plans validated; moonep-greedy balanced worse on %d inputs; on the %d "
              "inputs balanced equally: replicas moonep %lld vs moonep-greedy %lld (fewer in %d inputs); "
              "travelling rows moonep %lld vs moonep-greedy %lld (more in %d inputs, %d of them with "
              "fewer replicas)\n",
              plans, greedy_worse_balance, compared, static_cast<long long>(rep_moonep),
              static_cast<long long>(rep_greedy), fewer_replicas,
              static_cast<long long>(travel_moonep), static_cast<long long>(travel_greedy), more_travel_cases,
              more_travel_fewer_replicas);
  EXPECT_LE(rep_moonep, rep_greedy);
  // Travelling more than greedy only ever buys a replica less (goal 2 before goal 3).
  EXPECT_EQ(more_travel_cases, more_travel_fewer_replicas);
}

TEST(PlannerProperties, LargestShapeValidates) {
  std::mt19937_64 rng(99);
  const int R = 1024, E = 8192;
  auto counts = MakeCounts(Skew::kZipf, R, E, 2048, 8, 1.2, rng);
  PlannerConfig c;
  c.num_ranks = R;
  c.num_experts = E;
  c.ranks_per_node = 8;
  for (Policy pol : {Policy::kMoonEP, Policy::kMoonEPGreedy}) {
    c.policy = pol;
    const Plan plan = MustPlan(c, counts);
    if (pol == Policy::kMoonEP) {
      EXPECT_TRUE(Perfect(RankLoads(plan), plan.stats.total_tokens));
    }
    std::printf("[R=1024 E=8192] %s: replicas %d, max/mean %.4f (before %.3f)\n", PolicyName(pol),
                plan.stats.replicas, plan.stats.imbalance_after(), plan.stats.imbalance_before());
  }
}


// ---- Real data ------------------------------------------------------------------------------

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The integer arrays of the first JSON array after `key` (after position `from`): [[..],[..]] or [..].
std::vector<std::vector<int64_t>> IntArraysAfter(const std::string& json, const std::string& key, size_t from = 0) {
  std::vector<std::vector<int64_t>> out;
  size_t pos = json.find("\"" + key + "\"", from);
  if (pos == std::string::npos) return out;
  pos = json.find('[', pos);
  int depth = 0;
  std::vector<int64_t> cur;
  for (; pos < json.size(); ++pos) {
    const char ch = json[pos];
    if (ch == '[') {
      ++depth;
      cur.clear();
    } else if (ch == ']') {
      if (!cur.empty() || depth >= 1) out.push_back(cur);
      cur.clear();
      if (--depth == 0) break;
    } else if (ch == '-' || (ch >= '0' && ch <= '9')) {
      size_t end = pos;
      cur.push_back(std::stoll(json.substr(pos), &end));
      pos += end - 1;
    }
  }
  // Drop the empty outer array entry of a nested array.
  out.erase(std::remove_if(out.begin(), out.end(), [](const std::vector<int64_t>& v) { return v.empty(); }),
            out.end());
  return out;
}

const char* kLoadsPath = MOONEP_SHARED_DATA "/published_expert_loads.json";

TEST(PlannerRealData, EplbReproducesReadmeExample) {
  const std::string json = ReadFile(kLoadsPath);
  if (json.empty()) GTEST_SKIP() << "missing " << kLoadsPath;
  const size_t at = json.find("\"eplb_readme\"");
  ASSERT_NE(at, std::string::npos);
  const auto weight = IntArraysAfter(json, "weight", at);
  const auto reference = IntArraysAfter(json, "phy2log_reference", at);
  ASSERT_EQ(weight.size(), 2u);
  ASSERT_EQ(reference.size(), 2u);
  for (size_t layer = 0; layer < 2; ++layer) {
    std::vector<int32_t> phy2log, logcnt;
    ASSERT_TRUE(EplbRebalance(weight[layer], 16, 4, 2, 8, &phy2log, &logcnt).ok());
    std::vector<int32_t> want_cnt(12, 0);
    for (int64_t e : reference[layer]) ++want_cnt[e];
    EXPECT_EQ(logcnt, want_cnt) << "layer " << layer;
    // Placement up to ties: each GPU holds the same multiset of experts, or, where it differs,
    // the swapped experts carry equal load per replica (a tie EPLB's sort breaks arbitrarily).
    int differing = 0;
    for (int g = 0; g < 8; ++g) {
      std::vector<int64_t> mine{phy2log[2 * g], phy2log[2 * g + 1]};
      std::vector<int64_t> ref{reference[layer][2 * g], reference[layer][2 * g + 1]};
      std::sort(mine.begin(), mine.end());
      std::sort(ref.begin(), ref.end());
      if (mine != ref) ++differing;
    }
    std::printf("[eplb readme] layer %zu: replica counts equal; %d of 8 GPUs differ in placement\n", layer,
                differing);
    EXPECT_EQ(differing, 0) << "layer " << layer << ": " << ::testing::PrintToString(phy2log);
  }
}

TEST(PlannerRealData, EveryPolicyOnPublishedLoads) {
  const std::string json = ReadFile(kLoadsPath);
  if (json.empty()) GTEST_SKIP() << "missing " << kLoadsPath;
  std::vector<std::vector<int64_t>> vectors;
  for (size_t at = json.find("\"layers\""); at != std::string::npos; at = json.find("\"layers\"", at + 1)) {
    for (auto& v : IntArraysAfter(json, "layers", at)) vectors.push_back(v);
  }
  for (auto& v : IntArraysAfter(json, "weight", json.find("\"eplb_readme\""))) vectors.push_back(v);
  ASSERT_GE(vectors.size(), 3u);
  std::mt19937_64 rng(3);
  for (const auto& totals : vectors) {
    const int E = static_cast<int>(totals.size());
    for (int R = 2; R <= E; ++R) {
      if (E % R != 0) continue;
      auto counts = SpreadTotals(R, totals, rng);
      PlannerConfig c;
      c.num_ranks = R;
      c.num_experts = E;
      c.ranks_per_node = R % 2 == 0 ? 2 : 0;
      for (int pol = 0; pol < 6; ++pol) {
        c.policy = static_cast<Policy>(pol);
        const Plan plan = MustPlan(c, counts);
        if (c.policy == Policy::kMoonEP) {
          std::printf("[real E=%d R=%d] moonep: max/mean %.3f -> %.3f with %d replicas\n", E, R,
                      plan.stats.imbalance_before(), plan.stats.imbalance_after(), plan.stats.replicas);
          EXPECT_EQ(plan.stats.max_load_after, LoadLowerBound(Planner::Create(c).value()->config(), counts));
        }
      }
    }
  }
}

// ---- Determinism, Decide, bad input ---------------------------------------------------------

TEST(PlannerDeterminism, SameBytesAcrossRunsAndThreads) {
  std::mt19937_64 rng(5);
  auto counts = MakeCounts(Skew::kZipf, 64, 256, 4096, 8, 1.2, rng);
  for (int pol = 0; pol < 6; ++pol) {
    PlannerConfig c;
    c.num_ranks = 64;
    c.num_experts = 256;
    c.ranks_per_node = 8;
    c.pad_multiple = 8;
    c.policy = static_cast<Policy>(pol);
    const std::string reference = SerializePlan(MustPlan(c, counts));
    std::vector<std::string> got(4);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        auto planner = Planner::Create(c).value();
        Plan plan;
        for (int rep = 0; rep < 3; ++rep) {  // reused plan storage must not change the bytes
          if (!planner->MakePlan(counts, &plan).ok()) return;
          if (c.policy == Policy::kEplb) break;  // eplb keeps history: one step per planner
        }
        got[t] = SerializePlan(plan);
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < 4; ++t) EXPECT_EQ(got[t], reference) << PolicyName(c.policy) << " thread " << t;
  }
}

TEST(PlannerDecide, MatchesMakePlanDecisions) {
  std::mt19937_64 rng(11);
  auto counts = MakeCounts(Skew::kZipf, 16, 64, 1024, 4, 1.0, rng);
  std::vector<int64_t> totals(64, 0);
  for (int s = 0; s < 16; ++s) {
    for (int e = 0; e < 64; ++e) totals[e] += counts[s * 64 + e];
  }
  for (Policy pol : {Policy::kNone, Policy::kMoonEP, Policy::kMoonEPGreedy, Policy::kEplb,
                     Policy::kTestForceReplicas}) {
    PlannerConfig c;
    c.num_ranks = 16;
    c.num_experts = 64;
    c.policy = pol;
    const Plan full = MustPlan(c, counts);
    std::vector<int64_t> split(counts.size());
    for (int s = 0; s < 16; ++s) {
      for (int e = 0; e < 64; ++e) split[s * 64 + e] = totals[e] / 16 + (s < totals[e] % 16 ? 1 : 0);
    }
    const Plan even = MustPlan(c, split);
    auto planner = Planner::Create(c).value();
    Plan decided;
    for (int rep = 0; rep < 2; ++rep) {
      ASSERT_TRUE(planner->Decide(totals, &decided).ok());
      if (pol == Policy::kEplb) break;
    }
    // moonep breaks a tie with moonep-greedy by travelling rows, estimated in Decide from an
    // even split of each total: compare it with MakePlan on such counts.
    const Plan& ref = pol == Policy::kMoonEP ? even : full;
    if (pol == Policy::kMoonEP) {
      EXPECT_EQ(decided.stats.replicas, full.stats.replicas);
      EXPECT_EQ(decided.stats.max_load_after, full.stats.max_load_after);
    }
    EXPECT_EQ(decided.alloc, ref.alloc) << PolicyName(pol);
    EXPECT_EQ(decided.slot_expert, ref.slot_expert) << PolicyName(pol);
    EXPECT_EQ(decided.slot_alloc, ref.slot_alloc) << PolicyName(pol);
    EXPECT_EQ(decided.stats.replicas, full.stats.replicas);
    EXPECT_EQ(decided.stats.max_load_after, full.stats.max_load_after);
    EXPECT_EQ(decided.stats.max_load_before, full.stats.max_load_before);
  }
}

// One-rank mode of test-force-replicas: the slots hold copies of the rank's own experts and take
// half of their tokens (the home rule is waived only for these plans, flagged home_replicas).
TEST(PlannerTestForceReplicas, OneRankModeRoutesThroughOwnSlots) {
  std::mt19937_64 rng(5);
  for (int32_t E : {1, 4, 6}) {
    for (int32_t S : {-1, 1, 3, 8}) {
      if (S > E) continue;
      std::vector<int64_t> counts(E);
      for (int32_t e = 0; e < E; ++e) counts[e] = e == 1 ? 0 : static_cast<int64_t>(rng() % 50) + 1;
      PlannerConfig c;
      c.num_ranks = 1;
      c.num_experts = E;
      c.slots = S;
      c.pad_multiple = 4;
      c.policy = Policy::kTestForceReplicas;
      c.test_home_replicas = true;
      const Plan p = MustPlan(c, counts);  // validates, and equals the dense FinalizePlan
      ASSERT_TRUE(p.home_replicas);
      const int32_t slots = S < 0 ? E : S, used = std::min(slots, E);
      EXPECT_EQ(p.stats.replicas, used);
      EXPECT_EQ(p.stats.max_load_after, std::accumulate(counts.begin(), counts.end(), int64_t{0}));
      // Independent expectation: slot s holds expert s with floor(t/2) tokens, the home group the
      // rest; every token of e lands on exactly one row, in order, home and slot rows disjoint.
      for (int32_t s = 0; s < slots; ++s) {
        const int32_t e = s < E ? s : -1;
        ASSERT_EQ(p.slot_expert[s], e);
        if (e < 0) continue;
        EXPECT_EQ(p.slot_alloc[s], counts[e] / 2);
        EXPECT_EQ(p.alloc[e], counts[e]);
        EXPECT_EQ(p.group_count[p.home_group[e]], counts[e] - counts[e] / 2);
        EXPECT_EQ(p.group_count[E + s], counts[e] / 2);
      }
      const int32_t G = p.num_groups();
      std::vector<int> hits(static_cast<size_t>(p.rank_rows[0]), 0);
      for (int32_t e = 0; e < E; ++e) {
        int64_t pos = 0;
        for (int32_t q = p.piece_begin[e]; q < p.piece_begin[e + 1]; ++q) {
          EXPECT_EQ(p.piece_dest[q], 0);
          EXPECT_EQ(p.piece_start[q], pos);
          pos += p.piece_count[q];
          for (int64_t r = p.piece_row[q]; r < p.piece_row[q] + p.piece_count[q]; ++r) ++hits[r];
        }
        EXPECT_EQ(pos, counts[e]);
      }
      for (int32_t g = 0; g < G; ++g) {
        for (int64_t r = p.group_offset[g]; r < p.group_offset[g] + p.group_padded[g]; ++r) {
          EXPECT_EQ(hits[r], r < p.group_offset[g] + p.group_count[g] ? 1 : 0) << "row " << r;
        }
      }
      // The same plan without the flag breaks the home rule.
      if (used > 0) {
        Plan q = p;
        q.home_replicas = false;
        const absl::Status v = ValidatePlan(q, counts);
        EXPECT_FALSE(v.ok());
        EXPECT_NE(std::string(v.message()).find("no replica on home"), std::string::npos) << v;
      }
      // Decide (totals only) agrees with MakePlan.
      auto planner = Planner::Create(c).value();
      Plan decided;
      for (int rep = 0; rep < 2; ++rep) ASSERT_TRUE(planner->Decide(counts, &decided).ok());
      EXPECT_EQ(decided.alloc, p.alloc);
      EXPECT_EQ(decided.slot_alloc, p.slot_alloc);
      EXPECT_EQ(decided.stats.replicas, p.stats.replicas);
    }
  }
  // The option changes nothing for other policies, nor for test-force-replicas at R > 1.
  std::mt19937_64 rng2(6);
  for (int32_t R : {1, 4}) {
    auto counts = MakeCounts(Skew::kZipf, R, 8, 256, 2, 1.2, rng2);
    for (Policy pol : {Policy::kNone, Policy::kMoonEP, Policy::kMoonEPGreedy, Policy::kEplb,
                       Policy::kFasterMoEShadow, Policy::kTestForceReplicas}) {
      if (pol == Policy::kTestForceReplicas && R == 1) continue;
      PlannerConfig c;
      c.num_ranks = R;
      c.num_experts = 8;
      c.policy = pol;
      const std::string plain = SerializePlan(MustPlan(c, counts));
      c.test_home_replicas = true;
      const Plan p = MustPlan(c, counts);
      EXPECT_FALSE(p.home_replicas) << PolicyName(pol);
      EXPECT_EQ(SerializePlan(p), plain) << PolicyName(pol) << " R=" << R;
    }
  }
}

TEST(PlannerBadInput, ClearErrors) {
  auto expect_error = [](const PlannerConfig& c, const std::string& needle) {
    auto p = Planner::Create(c);
    ASSERT_FALSE(p.ok()) << needle;
    EXPECT_NE(std::string(p.status().message()).find(needle), std::string::npos) << p.status();
  };
  PlannerConfig c;
  c.num_ranks = 0;
  c.num_experts = 8;
  expect_error(c, "num_ranks");
  c.num_ranks = 3;
  expect_error(c, "divisible");
  c.num_ranks = 4;
  c.slots = 0;
  expect_error(c, "slots");
  c.slots = -1;
  c.home = {0, 0, 1, 1, 2, 2, 3};
  expect_error(c, "home");
  c.home.clear();
  c.speeds = {1, 2, -1, 1};
  expect_error(c, "speeds");
  c.speeds.clear();
  c.pad_multiple = 0;
  expect_error(c, "pad_multiple");
  c.pad_multiple = 1;
  auto planner = Planner::Create(c).value();
  Plan plan;
  std::vector<int64_t> counts(32, 1);
  EXPECT_TRUE(planner->MakePlan(counts, &plan).ok());
  counts[9] = -4;
  absl::Status s = planner->MakePlan(counts, &plan);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("negative"), std::string::npos) << s;
  counts.resize(31);
  s = planner->MakePlan(counts, &plan);
  EXPECT_NE(std::string(s.message()).find("counts has 31"), std::string::npos) << s;
  EXPECT_FALSE(planner->Decide(std::vector<int64_t>(7, 1), &plan).ok());
  EXPECT_FALSE(planner->MakePlan(std::vector<int64_t>(32, 1), nullptr).ok());
  std::vector<int64_t> huge(32, int64_t{1} << 62);
  EXPECT_FALSE(planner->MakePlan(huge, &plan).ok());
}

TEST(PlannerValidate, NamesTheBrokenInvariant) {
  std::mt19937_64 rng(1);
  auto counts = MakeCounts(Skew::kZipf, 8, 32, 256, 4, 1.5, rng);
  PlannerConfig c;
  c.num_ranks = 8;
  c.num_experts = 32;
  const Plan good = MustPlan(c, counts);
  ASSERT_GT(good.stats.replicas, 0);
  auto broken = [&](auto mutate, const std::string& needle) {
    Plan p = good;
    mutate(p);
    const absl::Status s = ValidatePlan(p, counts);
    EXPECT_FALSE(s.ok()) << needle;
    EXPECT_NE(std::string(s.message()).find(needle), std::string::npos) << s;
  };
  int slot = 0;
  while (good.slot_expert[slot] < 0) ++slot;
  const int d = slot / good.slots, e = good.slot_expert[slot];
  broken([&](Plan& p) { p.alloc[static_cast<size_t>(e) * 8 + d] += 1; }, "slot_alloc");
  broken([&](Plan& p) { p.slot_expert[slot] = p.home.size() ? p.local_experts[d * 4] : 0; }, "no replica on home");
  broken([&](Plan& p) { p.piece_start[1] += 1; }, "conservation per (source, expert)");
  broken([&](Plan& p) { p.group_padded[0] += 1; }, "padding");
  broken([&](Plan& p) { p.group_offset[1] = 0; p.group_offset[0] = 0; p.group_count[0] += 0; p.group_offset[2] = p.group_offset[1]; }, "");
  broken([&](Plan& p) { p.stats.replicas += 1; }, "stats: replicas");
  broken([&](Plan& p) { p.alloc.pop_back(); }, "shape");
}


TEST(PlannerSpeeds, BalancesTimeNotTokens) {
  std::mt19937_64 rng(21);
  const int R = 8, E = 32;
  auto counts = MakeCounts(Skew::kZipf, R, E, 2048, 4, 1.0, rng);
  PlannerConfig c;
  c.num_ranks = R;
  c.num_experts = E;
  c.speeds = {1, 1, 2, 2, 1, 0.5, 1, 4};
  const Plan plan = MustPlan(c, counts);
  const auto loads = RankLoads(plan);
  // Capacities are floor/ceil of T * w_d / sum(w), w = speed / max speed * 2^20 (exact here).
  const int64_t T = plan.stats.total_tokens;
  const double W = 12.5;
  int64_t sum = 0;
  for (int d = 0; d < R; ++d) {
    const double ideal = T * c.speeds[d] / W;
    EXPECT_GE(loads[d], static_cast<int64_t>(std::floor(ideal))) << "rank " << d;
    EXPECT_LE(loads[d], static_cast<int64_t>(std::ceil(ideal))) << "rank " << d;
    sum += loads[d];
  }
  EXPECT_EQ(sum, T);
}

TEST(PlannerTopology, ReplicasStayInTheHomeNodeWhenEquallyGood) {
  // Two nodes of two ranks; rank 0 is hot, ranks 1 (same node) and 2 (other node) have equal room.
  const int R = 4, E = 4;
  std::vector<int64_t> counts(R * E, 0);
  counts[0] = 40;  // source 0 -> expert 0 (home rank 0)
  counts[1] = 10;  // expert 1 (home 1)
  counts[2] = 10;  // expert 2 (home 2)
  counts[3] = 40;  // expert 3 (home 3)
  PlannerConfig c;
  c.num_ranks = R;
  c.num_experts = E;
  c.ranks_per_node = 2;
  const Plan plan = MustPlan(c, counts);
  EXPECT_EQ(plan.stats.max_load_after, 25);
  EXPECT_EQ(plan.stats.replicas, 2);
  EXPECT_EQ(plan.stats.prefetch_inter, 0) << "replicas left the home node";
}

TEST(PlannerPadding, PadsLayoutsNotLoads) {
  std::mt19937_64 rng(8);
  auto counts = MakeCounts(Skew::kZipf, 8, 32, 1000, 4, 1.3, rng);
  PlannerConfig c;
  c.num_ranks = 8;
  c.num_experts = 32;
  c.pad_multiple = 64;
  const Plan padded = MustPlan(c, counts);
  c.pad_multiple = 1;
  const Plan plain = MustPlan(c, counts);
  EXPECT_EQ(padded.alloc, plain.alloc);
  EXPECT_EQ(padded.stats.max_load_after, (padded.stats.total_tokens + 7) / 8);
  for (size_t i = 0; i < padded.group_padded.size(); ++i) EXPECT_EQ(padded.group_padded[i] % 64, 0);
}

// ---- Weighing replicas (PlannerConfig::replica_cost_*) --------------------------------------

using testing::Weighed;
using testing::WeighPlan;

// Worked by hand: one hot expert, and where the cost of a replica tips the choice.
TEST(PlannerWeighing, HandWorkedCases) {
  // R = 2: expert 0 (1000 tokens) on rank 0, expert 1 (none) on rank 1. One replica halves the
  // level (500 + c against 1000): worth it below c = 500; at 500 the tie keeps the balanced plan.
  for (int rpn : {0, 2}) {
    for (int64_t c : {int64_t{0}, int64_t{1}, int64_t{499}, int64_t{500}, int64_t{501}, kMaxReplicaCost}) {
      PlannerConfig cfg;
      cfg.num_ranks = 2;
      cfg.num_experts = 2;
      cfg.ranks_per_node = rpn;
      (rpn > 0 ? cfg.replica_cost_intra : cfg.replica_cost_inter) = c;
      (rpn > 0 ? cfg.replica_cost_inter : cfg.replica_cost_intra) = 7;  // the other link: unused
      const Plan p = MustPlan(cfg, {600, 0, 400, 0});
      const bool replica = c <= 500;
      EXPECT_EQ(p.stats.replicas, replica ? 1 : 0) << "rpn=" << rpn << " c=" << c;
      EXPECT_EQ(p.stats.max_load_after, replica ? 500 : 1000) << "rpn=" << rpn << " c=" << c;
    }
  }
  // R = 4, flat: expert 0 holds 1000 on rank 0; ranks 1-3 home 400, 400 and 200 (total 2000).
  // Balanced (level 500) needs three replicas of expert 0, on ranks 1, 2 and 3; their gradients
  // reduce along the chain 1 -> 2 -> 3 -> 0, so no rank sends or receives more than one: 500 + c.
  // One replica on rank 3 (room L - 200 >= 1000 - L) needs L >= 600: 600 + c; two need L >= 534:
  // 534 + c. No replica: 1000. So balanced up to c = 500 (the tie keeps the balanced plan), none
  // above. (Were every replica's gradient sent to the home, balanced would cost 500 + 3c, and one
  // replica would win at c = 100.)
  PlannerConfig cfg;
  cfg.num_ranks = 4;
  cfg.num_experts = 4;
  cfg.slots = 2;
  const std::vector<int64_t> counts = {1000, 0, 0, 0,  0, 400, 0, 0,  0, 0, 400, 0,  0, 0, 0, 200};
  for (int64_t c : {int64_t{30}, int64_t{100}, int64_t{499}, int64_t{500}}) {
    cfg.replica_cost_inter = c;
    const Plan p = MustPlan(cfg, counts);
    EXPECT_EQ(p.stats.max_load_after, 500) << c;
    EXPECT_EQ(p.stats.replicas, 3) << c;
    for (int32_t r = 1; r < 4; ++r) EXPECT_EQ(p.slot_expert[r * 2], 0) << c << " rank " << r;
  }
  cfg.replica_cost_inter = 501;
  EXPECT_EQ(MustPlan(cfg, counts).stats.replicas, 0);
}

// The transfer count the objective uses, by hand: R = 3, flat. Expert 0 (home 0) is held by ranks 1
// and 2, expert 1 (home 1) by rank 0. Prefetch 0 -> 1 -> 2 and 1 -> 0: rank 1 sends two copies.
// Reduce 1 -> 2 -> 0 and 0 -> 1: no rank sends or receives two. So the prefetch sets the count, 2.
// With expert 1 held by rank 2 instead: prefetch 0 -> 1 -> 2 and 1 -> 2 (rank 2 receives two), reduce
// 1 -> 2 -> 0 and 2 -> 1 (rank 2 sends two): 2 either way. Expert 0 alone: 1.
TEST(PlannerWeighing, TransfersCountThePrefetchAndTheReduce) {
  const std::vector<int32_t> home = {0, 1, 2};
  EXPECT_EQ(testing::ChainTransferCost(3, 0, 5, 7, home, {{0, 1}, {0, 2}, {1, 0}}), 14);
  EXPECT_EQ(testing::ChainTransferCost(3, 0, 5, 7, home, {{0, 1}, {0, 2}, {1, 2}}), 14);
  EXPECT_EQ(testing::ChainTransferCost(3, 0, 5, 7, home, {{0, 1}, {0, 2}}), 7);
  // Nodes {0, 1} and {2}: rank 1's two prefetch copies go one inside its node (to 0) and one
  // across (to 2), so no rank has two hops on one link class: 7, the inter cost.
  EXPECT_EQ(testing::ChainTransferCost(3, 2, 5, 7, home, {{0, 1}, {0, 2}, {1, 0}}), 7);
}

// Tiny cases against the exhaustive optimum of the same objective; every plan at most the
// perfectly balanced plan's cost and the cost of no replica.
TEST(PlannerWeighing, AgainstBruteForceAndNeverWorseThanEitherEnd) {
  std::mt19937_64 rng(2026);
  int cases = 0, optimal = 0;
  double gap_sum = 0, gap_worst = 0;
  for (int R : {2, 3, 4}) {
    for (int epn : {1, 2}) {
      const int E = R * epn;
      for (int S : {1, 2}) {
        if (R * epn * S > 12) continue;  // (R 4, E 8, 2 slots: millions of replica sets)
        for (int iter = 0; iter < 30; ++iter) {
          std::vector<int64_t> totals(E);
          for (int e = 0; e < E; ++e) totals[e] = rng() % 4 == 0 ? rng() % 40 : rng() % 8;
          auto counts = SpreadTotals(R, totals, rng);
          PlannerConfig c;
          c.num_ranks = R;
          c.num_experts = E;
          c.slots = S;
          c.ranks_per_node = iter % 2 == 0 ? 0 : 2;
          c.replica_cost_intra = 1 + static_cast<int64_t>(rng() % 8);
          c.replica_cost_inter = c.replica_cost_intra + static_cast<int64_t>(rng() % 8);
          const Plan mine = MustPlan(c, counts);
          const Weighed got = WeighPlan(c, mine);
          PlannerConfig plain = c;
          plain.replica_cost_intra = plain.replica_cost_inter = 0;
          const Weighed balanced = WeighPlan(c, MustPlan(plain, counts));  // costs priced as c's
          EXPECT_LE(got.total(), balanced.total()) << "R=" << R << " E=" << E << " S=" << S;
          EXPECT_LE(got.total(), mine.stats.max_load_before) << "R=" << R << " E=" << E << " S=" << S
              << " level " << got.level << " transfers " << got.transfers << " replicas " << mine.stats.replicas
              << " balanced " << balanced.level << "+" << balanced.transfers << " costs " << c.replica_cost_intra
              << "/" << c.replica_cost_inter << " rpn " << c.ranks_per_node << " totals " << ::testing::PrintToString(totals);
          std::vector<int> home(E);
          for (int e = 0; e < E; ++e) home[e] = e / epn;
          const int64_t opt = testing::BruteForceMinWeighedCost(R, E, S, home, totals, c.ranks_per_node,
                                                                c.replica_cost_intra, c.replica_cost_inter);
          ASSERT_GE(got.total(), opt) << "below the exhaustive optimum: R=" << R << " E=" << E;
          ++cases;
          optimal += got.total() == opt;
          const double gap = opt > 0 ? static_cast<double>(got.total() - opt) / opt : 0.0;
          gap_sum += gap;
          gap_worst = std::max(gap_worst, gap);
        }
      }
    }
  }
  std::printf("[weighing brute force] %d cases, moonep optimal in %d; cost gap to optimum mean "
              "%.2f%%, worst %.0f%%\n", cases, optimal, 100.0 * gap_sum / cases, 100.0 * gap_worst);
  EXPECT_LT(gap_sum / cases, 0.05);
}

// Random shapes (topology, slot limits, speeds, both paths of moonep): valid plans, never costlier
// than either end; zero costs change nothing; a replica costing 2^52 tokens is never made.
TEST(PlannerWeighing, RandomShapes) {
  std::mt19937_64 rng(99);
  struct Shape { int R, E, slots, rpn; int64_t tokens; int K; };
  const std::vector<Shape> shapes = {{4, 16, -1, 2, 256, 4}, {8, 32, 1, 4, 512, 4},
                                     {16, 64, -1, 8, 1024, 8}, {64, 256, -1, 8, 4096, 8},
                                     {64, 256, 1, 0, 4096, 8}};
  int fewer = 0, plans = 0;
  for (const Shape& sh : shapes) {
    for (double zipf : {0.5, 1.2}) {
      for (bool speeds : {false, true}) {
        auto counts = MakeCounts(Skew::kZipf, sh.R, sh.E, sh.tokens, sh.K, zipf, rng);
        PlannerConfig c;
        c.num_ranks = sh.R;
        c.num_experts = sh.E;
        c.slots = sh.slots;
        c.ranks_per_node = sh.rpn;
        if (speeds) {
          for (int d = 0; d < sh.R; ++d) c.speeds.push_back(d % 3 == 0 ? 0.5 : 1.0);
        }
        const Plan plain = MustPlan(c, counts);  // (costs 0: unchanged plans, planner_plan_hash)
        const int64_t mean = sh.tokens * sh.K;
        for (int64_t cost : {mean / 64, mean / 8, mean / 2, 4 * mean}) {
          c.replica_cost_intra = cost;
          c.replica_cost_inter = 3 * cost;
          const PlannerConfig resolved = Planner::Create(c).value()->config();
          const Plan mine = MustPlan(c, counts);
          const Weighed got = WeighPlan(resolved, mine);
          PlannerConfig none = c;
          none.policy = Policy::kNone;
          const Plan none_plan = MustPlan(none, counts);
          EXPECT_LE(got.total(), WeighPlan(resolved, plain).total()) << sh.R << " " << cost;
          EXPECT_LE(got.total(), WeighPlan(resolved, none_plan).total()) << sh.R << " " << cost;
          fewer += mine.stats.replicas < plain.stats.replicas;
          ++plans;
        }
        // Rows in the objective (at the simulator's ratio of a row to a transfer, about 1 : 3000
        // tokens): the same guarantees in the terms with rows.
        for (int64_t cost : {mean / 8, mean / 2}) {
          c.replica_cost_intra = cost;
          c.replica_cost_inter = 3 * cost;
          c.row_cost_intra = 600;
          c.row_cost_inter = 2200;
          const PlannerConfig resolved = Planner::Create(c).value()->config();
          const Plan mine = MustPlan(c, counts);
          const Weighed got = WeighPlan(resolved, mine, false, &counts);
          PlannerConfig unweighed = c;
          unweighed.replica_cost_intra = unweighed.replica_cost_inter = 0;
          EXPECT_LE(got.total(), WeighPlan(resolved, MustPlan(unweighed, counts), false, &counts).total())
              << sh.R << " " << cost;
          EXPECT_LE(got.total(), WeighPlan(resolved, mine, true, &counts).total()) << sh.R << " " << cost;
          ++plans;
        }
        c.row_cost_intra = c.row_cost_inter = 0;
        c.replica_cost_intra = c.replica_cost_inter = kMaxReplicaCost;
        EXPECT_EQ(MustPlan(c, counts).stats.replicas, 0);
      }
    }
  }
  std::printf("[weighing] %d weighed plans, %d with fewer replicas than the balanced plan\n", plans, fewer);
  EXPECT_GT(fewer, 0);
}

// With speeds, balanced capacities can leave a slow rank one token above the no-replica plan's
// level; when the replicas cross only a link that costs nothing, that plan transfers nothing
// either, and no replica must still win (found by review: level 4 against none's 3).
TEST(PlannerWeighing, NoReplicaWinsWithSpeedsWhenTheUsedLinkIsFree) {
  for (int rpn : {0, 3}) {
    PlannerConfig c;
    c.num_ranks = 3;
    c.num_experts = 3;
    c.speeds = {1.0, 0.25, 0.25};
    c.ranks_per_node = rpn;
    // Flat: every replica is inter, free here; one node: every replica is intra, free here.
    (rpn == 0 ? c.replica_cost_intra : c.replica_cost_inter) = rpn == 0 ? 5 : 1000;
    const Plan p = MustPlan(c, {3, 0, 0, 0, 0, 0, 0, 0, 0});
    const Weighed got = WeighPlan(Planner::Create(c).value()->config(), p);
    EXPECT_EQ(got.total(), 3) << "rpn " << rpn;
    EXPECT_EQ(p.stats.replicas, 0) << "rpn " << rpn;
  }
}

// ---- Rows in the objective (PlannerConfig::row_cost_*) ---------------------------------------

// Worked by hand: R = 2, flat. Expert 0 (home rank 0) has 100 tokens, all from source 1; expert 1
// (home rank 1) 10 tokens from source 0. A replica costs 60 tokens, a row 1 token.
// - No replica: level 100; rank 0 receives 100 rows: 100 + 100 = 200.
// - Home keeps L of expert 0, rank 1 computes the other 100 - L of its own tokens: level L
//   (L >= 55), one transfer (60), rank 0 receives L rows and source 1 sends L: L + 60 + L, least
//   at L = 55: 170.
// Without rows, that plan costs 55 + 60 = 115 against no replica's 100: no replica.
TEST(PlannerWeighingRows, HandWorkedCase) {
  const std::vector<int64_t> counts = {0, 10, 100, 0};
  PlannerConfig c;
  c.num_ranks = 2;
  c.num_experts = 2;
  c.replica_cost_inter = 60;
  Plan p = MustPlan(c, counts);
  EXPECT_EQ(p.stats.replicas, 0);
  c.row_cost_inter = kRowCostScale;
  p = MustPlan(c, counts);
  ASSERT_EQ(p.stats.replicas, 1);
  EXPECT_EQ(p.slot_expert[1], 0);
  EXPECT_EQ(p.stats.max_load_after, 55);
  const PlannerConfig resolved = Planner::Create(c).value()->config();
  const Weighed got = WeighPlan(resolved, p, false, &counts);
  EXPECT_EQ(got.level, 55);
  EXPECT_EQ(got.transfers, 60);
  EXPECT_EQ(got.rows, 55);
  EXPECT_EQ(WeighPlan(resolved, p, true, &counts).total(), 200);
  // Here the planner's estimate is exact: the replica computes only its own rank's tokens.
  std::vector<int64_t> est;
  EstimatePlanRows(resolved, p, counts.data(), std::vector<int64_t>{100, 10}, &est);
  EXPECT_EQ(est, testing::PlanRows(p, counts, false));
  EXPECT_EQ(est, (std::vector<int64_t>{0, 55, 0, 10, 0, 10, 0, 55}));  // flat: every row inter
  // The intra cost prices nothing on a flat topology.
  c.row_cost_inter = 0;
  c.row_cost_intra = kMaxRowCost;
  EXPECT_EQ(MustPlan(c, counts).stats.replicas, 0);
}

// The planner's estimate (EstimatePlanRows, what the search computes from its decisions) against
// the test's own statement of it (PlanRows with `estimate`, from the plan's pieces) and against the
// rows the pieces move: equal to the former everywhere, to the latter in every receive (and
// everywhere without replicas); the highest rank row cost (what the objective uses) close. Plans
// of every policy, flat and with nodes (one node short), with and without speeds.
TEST(PlannerWeighingRows, EstimateAgainstThePiecesRows) {
  std::mt19937_64 rng(7);
  double worst = 0, sum = 0;
  int n = 0;
  for (int rpn : {0, 4, 8, 5}) {
    for (double zipf : {0.5, 1.2}) {
      const int R = 32, E = 128;
      auto counts = MakeCounts(Skew::kZipf, R, E, 1024, 8, zipf, rng);
      std::vector<int64_t> totals(E, 0);
      for (int s = 0; s < R; ++s) {
        for (int e = 0; e < E; ++e) totals[e] += counts[static_cast<size_t>(s) * E + e];
      }
      for (Policy policy : {Policy::kNone, Policy::kMoonEP, Policy::kMoonEPGreedy, Policy::kEplb}) {
        for (int64_t cost : {int64_t{0}, int64_t{200}, int64_t{2000}}) {
          if (policy != Policy::kMoonEP && cost > 0) continue;
          PlannerConfig c;
          c.num_ranks = R;
          c.num_experts = E;
          c.ranks_per_node = rpn;
          c.policy = policy;
          c.row_cost_intra = 600;
          c.row_cost_inter = 2200;
          c.replica_cost_intra = cost;
          c.replica_cost_inter = 3 * cost;
          if (zipf > 1) {
            for (int d = 0; d < R; ++d) c.speeds.push_back(d % 4 == 0 ? 0.5 : 1.0);
          }
          const PlannerConfig resolved = Planner::Create(c).value()->config();
          const Plan p = MustPlan(c, counts);
          std::vector<int64_t> planner_est;
          EstimatePlanRows(resolved, p, counts.data(), totals, &planner_est);
          const testing::RankRows est = testing::PlanRows(p, counts, true);
          const testing::RankRows exact = testing::PlanRows(p, counts, false);
          ASSERT_EQ(planner_est, est) << "rpn " << rpn << " policy " << PolicyName(policy) << " cost " << cost;
          for (int d = 0; d < R; ++d) {
            for (int k : {0, 1}) EXPECT_EQ(est[d * 4 + k], exact[d * 4 + k]) << "rank " << d << " receives";
          }
          if (p.stats.replicas == 0) {
            EXPECT_EQ(est, exact) << "rpn " << rpn;
          }
          const double a = static_cast<double>(testing::RowCost(resolved, est));
          const double b = static_cast<double>(testing::RowCost(resolved, exact));
          const double err = std::abs(a - b) / b;
          worst = std::max(worst, err);
          sum += err;
          ++n;
          EXPECT_LT(err, 0.05) << "rpn " << rpn << " zipf " << zipf << " cost " << cost << ": estimate "
                               << a << " exact " << b << " replicas " << p.stats.replicas;
        }
      }
    }
  }
  std::printf("[weighing rows] %d plans: highest rank row cost, estimate against the pieces' rows: "
              "mean error %.2f%%, worst %.2f%%\n", n, 100.0 * sum / n, 100.0 * worst);
}

// Decide knows only the totals and takes each source to have an even share of them (its row sums
// in closed form); MakePlan on counts that are exactly that split reads the rows from the counts.
// Both must decide the same.
TEST(PlannerWeighingRows, DecideAgreesWithMakePlanOnEvenCounts) {
  std::mt19937_64 rng(11);
  for (int rpn : {0, 4}) {
    const int R = 16, E = 64;
    std::vector<int64_t> totals(E);
    for (int e = 0; e < E; ++e) totals[e] = static_cast<int64_t>(rng() % (e < 4 ? 4000 : 400));
    std::vector<int64_t> counts(static_cast<size_t>(R) * E);
    for (int s = 0; s < R; ++s) {
      for (int e = 0; e < E; ++e) counts[static_cast<size_t>(s) * E + e] = totals[e] / R + (s < totals[e] % R);
    }
    PlannerConfig c;
    c.num_ranks = R;
    c.num_experts = E;
    c.ranks_per_node = rpn;
    c.replica_cost_intra = 100;
    c.replica_cost_inter = 300;
    c.row_cost_intra = 600;
    c.row_cost_inter = 2200;
    const Plan made = MustPlan(c, counts);
    auto planner = Planner::Create(c).value();
    Plan decided;
    ASSERT_TRUE(planner->Decide(totals, &decided).ok());
    EXPECT_EQ(decided.alloc, made.alloc) << "rpn " << rpn;
    // The estimate on totals alone (an even split, row sums in closed form) is the one on counts
    // that are that split.
    std::vector<int64_t> on_totals, on_counts;
    const PlannerConfig resolved = planner->config();
    EstimatePlanRows(resolved, made, nullptr, totals, &on_totals);
    EstimatePlanRows(resolved, made, counts.data(), totals, &on_counts);
    EXPECT_EQ(on_totals, on_counts) << "rpn " << rpn;
    EXPECT_EQ(on_counts, testing::PlanRows(made, counts, true)) << "rpn " << rpn;
    EXPECT_EQ(decided.slot_expert, made.slot_expert) << "rpn " << rpn;
    EXPECT_GT(made.stats.replicas, 0) << "rpn " << rpn;
  }
}

TEST(PlannerWeighingRows, CostsOutOfRangeAreRefused) {
  PlannerConfig c;
  c.num_ranks = 2;
  c.num_experts = 2;
  c.row_cost_intra = -1;
  auto p = Planner::Create(c);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("row_cost_intra must be in [0, 2^40], got -1"), std::string::npos)
      << p.status();
  c.row_cost_intra = 0;
  c.row_cost_inter = kMaxRowCost + 1;
  p = Planner::Create(c);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("row_cost_inter must be in [0, 2^40]"), std::string::npos)
      << p.status();
}

TEST(PlannerWeighing, CostsOutOfRangeAreRefused) {
  PlannerConfig c;
  c.num_ranks = 2;
  c.num_experts = 2;
  c.replica_cost_intra = -1;
  auto p = Planner::Create(c);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("replica_cost_intra must be in [0, 2^52], got -1"), std::string::npos)
      << p.status();
  c.replica_cost_intra = 0;
  c.replica_cost_inter = kMaxReplicaCost + 1;
  p = Planner::Create(c);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("replica_cost_inter must be in [0, 2^52]"), std::string::npos)
      << p.status();
}

TEST(PlannerSlotLimit, MinimisesMaxLoadWhenPerfectIsOutOfReach) {
  // One slot per rank and one very hot expert: it can be split over at most R ranks.
  const int R = 4, E = 8;
  std::vector<int64_t> counts(R * E, 1);
  counts[0] = 1000;
  PlannerConfig c;
  c.num_ranks = R;
  c.num_experts = E;
  c.slots = 1;
  const Plan plan = MustPlan(c, counts);
  const int64_t lb = LoadLowerBound(Planner::Create(c).value()->config(), counts);
  EXPECT_EQ(plan.stats.max_load_after, lb);
  std::printf("[slot limit] max/mean %.3f with %d replicas (lower bound %lld)\n", plan.stats.imbalance_after(),
              plan.stats.replicas, static_cast<long long>(lb));
}
// LoweringQueue (GreedyFill's donors and receivers) against a brute-force scan, with 64-bit and
// 128-bit keys: keys value * 2^bits + (2^bits - 1 - index), as GreedyFill makes them, so that
// they are distinct; Top is the largest (0 when empty), and LowerTop lowers it (often to 0, which
// drops it), as the greedy's moves do. Values go up to 2^52 (the planner's bound on a total).
template <typename Key>
void CheckLoweringQueue(int n, int64_t max_value, std::mt19937_64& rng) {
  int32_t bits = 0;
  while ((int64_t{1} << bits) < n) ++bits;
  const Key mask = (Key{1} << bits) - 1;
  auto key = [&](int64_t v, int i) { return (static_cast<Key>(v) << bits) | (mask - static_cast<Key>(i)); };
  std::vector<int64_t> v(n);
  std::vector<Key> buffer(2 * static_cast<size_t>(n) + 2);
  LoweringQueue<Key> q;
  q.Attach(buffer.data(), n);
  for (int i = 0; i < n; ++i) {
    v[i] = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(max_value));
    q.sorted[i] = key(v[i], i);
  }
  std::sort(q.sorted, q.sorted + q.ns);
  for (int step = 0;; ++step) {
    int top = -1;
    for (int i = 0; i < n; ++i) {
      if (v[i] > 0 && (top < 0 || v[i] > v[top])) top = i;
    }
    const Key k = q.Top();
    if (top < 0) {
      ASSERT_EQ(k, Key{0}) << "n=" << n << " step " << step;
      break;
    }
    ASSERT_EQ(k, key(v[top], top)) << "n=" << n << " step " << step;
    v[top] = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(v[top]));
    q.LowerTop(k, v[top] == 0 ? Key{0} : key(v[top], top));
    ASSERT_LE(step, 64 * n) << "n=" << n;  // every value falls at each step
  }
}

TEST(PlannerLoweringQueue, MatchesBruteForce) {
  std::mt19937_64 rng(5);
  for (int n : {1, 2, 7, 64, 300}) {
    for (int64_t max_value : {int64_t{3}, int64_t{1000}, int64_t{1} << 40}) {
      CheckLoweringQueue<uint64_t>(n, max_value, rng);
    }
  }
  CheckLoweringQueue<unsigned __int128>(5000, int64_t{1} << 52, rng);  // 13 + 52 bits: wide keys
}

// GreedyFill takes moonep's presorted orders (the donors' experts, the receivers' rooms) only
// when they are the sorted orders for the capacities it is given: orders of the right sizes that
// are not (left by other capacities, or corrupted) give the decisions it makes without them.
TEST(PlannerGreedyFill, UsesPresortedOrdersOnlyWhenTheyMatch) {
  std::mt19937_64 rng(11);
  PlannerConfig raw;
  raw.num_ranks = 16;
  raw.num_experts = 64;
  PlannerConfig c;
  ASSERT_TRUE(ResolveConfig(raw, &c).ok());
  const int32_t R = c.num_ranks, E = c.num_experts, epn = E / R;
  Plan plan;
  InitPlan(c, &plan);
  int stale_donors = 0, stale_rooms = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int64_t> totals(E);
    for (auto& t : totals) t = static_cast<int64_t>(rng() % 1000) * (rng() % 5 == 0 ? 20 : 1);
    PolicyInput in;
    in.config = &c;
    in.plan = &plan;
    in.totals = totals;
    in.home_load.assign(R, 0);
    for (int32_t e = 0; e < E; ++e) in.home_load[plan.home[e]] += totals[e];
    in.total = std::accumulate(totals.begin(), totals.end(), int64_t{0});
    std::vector<int64_t> cap;
    BalancedCapacities(c, in.home_load, in.total, &cap);
    PolicyScratch fresh;
    Decisions want;
    const bool want_ok = GreedyFill(in, cap, &fresh, &want);
    // The true orders: each donor's experts by decreasing total (ties: lower id), donors by
    // rank; the receivers by (room, rank) ascending.
    std::vector<int32_t> order;
    std::vector<PolicyScratch::Room> rooms;
    for (int32_t d = 0; d < R; ++d) {
      const int64_t diff = in.home_load[d] - cap[d];
      if (diff > 0) {
        std::vector<int32_t> ex(plan.local_experts.begin() + static_cast<size_t>(d) * epn,
                                plan.local_experts.begin() + static_cast<size_t>(d + 1) * epn);
        std::sort(ex.begin(), ex.end(), [&](int32_t a, int32_t b) {
          return totals[a] != totals[b] ? totals[a] > totals[b] : a < b;
        });
        order.insert(order.end(), ex.begin(), ex.end());
      } else if (diff < 0) {
        rooms.push_back({-diff, d});
      }
    }
    std::sort(rooms.begin(), rooms.end(),
              [](const PolicyScratch::Room& a, const PolicyScratch::Room& b) {
                return a.room != b.room ? a.room < b.room : a.rank < b.rank;
              });
    // Wrong orders of the right sizes: one that swaps two experts of a donor, or names an expert
    // of another rank; receivers' rooms reversed, or one rank replaced by a non-receiver.
    std::vector<int32_t> bad_order = order;
    if (!bad_order.empty()) {
      if (trial % 2 == 0 && epn > 1 && totals[bad_order[0]] != totals[bad_order[1]]) {
        std::swap(bad_order[0], bad_order[1]);
        ++stale_donors;
      } else if (trial % 2 == 1) {
        bad_order[0] = (bad_order[0] + epn) % E;
        ++stale_donors;
      }
    }
    std::vector<PolicyScratch::Room> bad_rooms = rooms;
    if (bad_rooms.size() >= 2 && trial % 3 != 2 &&
        bad_rooms.front().room != bad_rooms.back().room) {
      std::reverse(bad_rooms.begin(), bad_rooms.end());
      ++stale_rooms;
    } else if (!bad_rooms.empty() && trial % 3 == 2) {
      for (int32_t d = 0; d < R; ++d) {
        if (in.home_load[d] - cap[d] >= 0) {
          bad_rooms.back().rank = d;
          ++stale_rooms;
          break;
        }
      }
    }
    for (int k = 0; k < 3; ++k) {  // the true orders, a bad donor order, bad rooms
      PolicyScratch sc;
      sc.rooms_sorted = k == 2 ? bad_rooms : rooms;
      sc.donor_sorted = k == 1 ? bad_order : order;
      Decisions got;
      const bool got_ok = GreedyFill(in, cap, &sc, &got, /*presorted=*/true);
      ASSERT_EQ(got_ok, want_ok) << "trial " << trial << " case " << k;
      EXPECT_EQ(got.home_keep, want.home_keep) << "trial " << trial << " case " << k;
      EXPECT_EQ(got.slot_expert, want.slot_expert) << "trial " << trial << " case " << k;
      EXPECT_EQ(got.slot_amount, want.slot_amount) << "trial " << trial << " case " << k;
      EXPECT_EQ(got.slots_used, want.slots_used) << "trial " << trial << " case " << k;
    }
  }
  // The wrong orders were of the right sizes and did occur.
  EXPECT_GT(stale_donors, 100);
  EXPECT_GT(stale_rooms, 100);
}


// ---- Extreme config values and counts: clear errors or valid plans, never a crash ----------

// ranks_per_node above R means one node holding every rank (as ranks_per_node = 8 at R = 4 always
// did); INT32_MAX once made the source-block count negative (a crash at R = 2) or zero (a plan
// that routed no token at R = 64).
TEST(PlannerExtremeConfig, RanksPerNodeAboveRanksIsOneNode) {
  std::mt19937_64 rng(31);
  for (int32_t R : {2, 5, 64}) {
    const int32_t E = 2 * R;
    const auto counts = MakeCounts(Skew::kZipf, R, E, 64, 2, 1.2, rng);
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    for (int32_t rpn : {R + 3, int32_t{1} << 30, INT32_MAX}) {
      PlannerConfig c;
      c.num_ranks = R;
      c.num_experts = E;
      c.ranks_per_node = rpn;
      const Plan plan = MustPlan(c, counts);
      EXPECT_EQ(plan.stats.total_tokens, total) << "R=" << R << " rpn=" << rpn;
      EXPECT_EQ(plan.piece_count.empty() ? 0 : std::accumulate(plan.piece_count.begin(),
                                                               plan.piece_count.end(), int64_t{0}),
                total) << "R=" << R << " rpn=" << rpn;
      EXPECT_EQ(plan.stats.rows_travel_inter, 0) << "one node: nothing crosses nodes";
      // The same decisions as a node of exactly R ranks.
      c.ranks_per_node = R;
      const Plan one_node = MustPlan(c, counts);
      EXPECT_EQ(plan.alloc, one_node.alloc) << "R=" << R << " rpn=" << rpn;
      EXPECT_EQ(plan.piece_start, one_node.piece_start) << "R=" << R << " rpn=" << rpn;
    }
  }
}

TEST(PlannerExtremeConfig, EplbRedundantIsBounded) {
  PlannerConfig c;
  c.num_ranks = 1;
  c.num_experts = 1;
  c.policy = Policy::kEplb;
  c.eplb_redundant = 1 << 30;  // once allocated gigabytes of physical experts per plan
  auto p = Planner::Create(c);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("eplb_redundant (1073741824)"), std::string::npos) << p.status();
  // At most one copy per replica slot: R * slots = 4 * 2.
  c.num_ranks = 4;
  c.num_experts = 8;
  c.eplb_redundant = 12;
  EXPECT_EQ(Planner::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.eplb_redundant = 8;
  std::vector<int64_t> counts(32, 1);
  counts[0] = 100;
  MustPlan(c, counts);
  c.eplb_redundant = -1;  // the default, R
  MustPlan(c, counts);
}

// eplb sums the totals of up to eplb_period steps: 2049 steps of 2^52 tokens pass 2^63. The sum
// saturates instead of wrapping to a negative weight (which failed the step with "negative weight").
TEST(PlannerExtremeConfig, EplbLongPeriodSumSaturates) {
  PlannerConfig c;
  c.num_ranks = 2;
  c.num_experts = 2;
  c.policy = Policy::kEplb;
  c.eplb_period = 2049;
  auto planner = Planner::Create(c);
  ASSERT_TRUE(planner.ok()) << planner.status();
  const std::vector<int64_t> totals = {int64_t{1} << 52, 0};
  Plan plan;
  std::string first;
  for (int step = 0; step <= 2049; ++step) {
    const absl::Status s = (*planner)->Decide(totals, &plan);
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s;
    if (step == 0) first = SerializePlan(plan);
  }
  // The re-plan at step 2049 still sees only expert 0 loaded: the placement of step 0.
  EXPECT_EQ(plan.stats.replicas, 1);
  EXPECT_EQ(SerializePlan(plan), first);
}

TEST(PlannerExtremeConfig, ByteSizesAreBoundedAndStatsSaturate) {
  PlannerConfig c;
  c.num_ranks = 2;
  c.num_experts = 2;
  c.row_bytes = int64_t{1} << 62;
  auto p = Planner::Create(c);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("row_bytes"), std::string::npos) << p.status();
  c.row_bytes = 0;
  c.expert_bytes = (int64_t{1} << 40) + 1;
  p = Planner::Create(c);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("expert_bytes"), std::string::npos) << p.status();
  // The largest sizes: 2^30 travelling rows of 2^40 bytes are past int64, reported as INT64_MAX.
  c.row_bytes = int64_t{1} << 40;
  c.expert_bytes = int64_t{1} << 40;
  std::vector<int64_t> counts = {int64_t{1} << 31, 0, 0, 0};  // source 0 -> expert 0, all of it
  const Plan plan = MustPlan(c, counts);
  ASSERT_EQ(plan.stats.rows_travel_inter, int64_t{1} << 30);
  EXPECT_EQ(plan.stats.dispatch_bytes_inter, INT64_MAX);
  EXPECT_EQ(plan.stats.prefetch_bytes_inter, int64_t{1} << 40);
  BuildScratch scratch;
  Plan again = plan;
  ASSERT_TRUE(FinalizePlan((*Planner::Create(c))->config(), counts, &again, &scratch).ok());
  EXPECT_EQ(again.stats.dispatch_bytes_inter, INT64_MAX);
}

// With speeds, the fastest rank's capacity L that lets a slow rank keep its home load can pass
// 2^63 (2^44 tokens x 2^20 / 1): it was truncated to 0 and the policy failed with "no reachable
// capacity". Rank 1 (speed 1e-6, one slot on rank 0) can shed one of its two 2^43 experts.
TEST(PlannerExtremeConfig, SpeedsCapacityPast2To63) {
  PlannerConfig c;
  c.num_ranks = 2;
  c.num_experts = 4;
  c.slots = 1;
  c.speeds = {1, 1e-6};
  std::vector<int64_t> counts(8, 0);
  counts[1 * 4 + 2] = int64_t{1} << 43;
  counts[1 * 4 + 3] = int64_t{1} << 43;
  for (Policy policy : {Policy::kMoonEP, Policy::kMoonEPGreedy}) {
    c.policy = policy;
    const Plan plan = MustPlan(c, counts);
    if (policy == Policy::kMoonEP) {
      EXPECT_EQ(RankLoads(plan)[1], int64_t{1} << 43);
      EXPECT_EQ(plan.stats.replicas, 1);
    }
  }
}

}  // namespace
}  // namespace moonep::planner
