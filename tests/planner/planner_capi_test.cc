// The planner C API, through the public header only, checked against ValidatePlan-level
// invariants recomputed here (conservation, layout, pieces).
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "moonep/moonep.h"

namespace {

TEST(PlannerCApi, PlanAndReadBack) {
  const int R = 8, E = 32;
  moonepPlannerConfig_t config = MOONEP_PLANNER_CONFIG_INITIALIZER;
  config.num_ranks = R;
  config.num_experts = E;
  config.pad_multiple = 4;
  config.ranks_per_node = 4;
  moonepPlanner_t planner = nullptr;
  ASSERT_EQ(moonepPlannerCreate(&config, &planner), moonepSuccess) << moonepGetLastThreadError();
  std::vector<int64_t> counts(R * E);
  std::mt19937 rng(2);
  for (int s = 0; s < R; ++s) {
    for (int e = 0; e < E; ++e) counts[s * E + e] = (e < 4 ? 200 : 10) + rng() % 20;
  }
  ASSERT_EQ(moonepPlannerPlan(planner, counts.data(), counts.size()), moonepSuccess)
      << moonepPlannerGetLastError(planner);
  int r = 0, e = 0, slots = 0, groups = 0;
  ASSERT_EQ(moonepPlannerGetShape(planner, &r, &e, &slots, &groups), moonepSuccess);
  EXPECT_EQ(r, R);
  EXPECT_EQ(e, E);
  EXPECT_EQ(slots, E / R);
  EXPECT_EQ(groups, E / R + slots);

  moonepPlanStats_t stats;
  stats.size = sizeof(stats);
  ASSERT_EQ(moonepPlannerGetStats(planner, &stats), moonepSuccess);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  EXPECT_EQ(stats.total_tokens, total);
  EXPECT_EQ(stats.max_load_after, (total + R - 1) / R);  // perfect balance
  EXPECT_GT(stats.replicas, 0);
  EXPECT_EQ(stats.rows_local + stats.rows_travel_intra + stats.rows_travel_inter, total);

  std::vector<int64_t> alloc(R * E);
  ASSERT_EQ(moonepPlannerGetAlloc(planner, alloc.data(), alloc.size()), moonepSuccess);
  std::vector<int32_t> slot_expert(R * slots);
  std::vector<int64_t> slot_tokens(R * slots);
  ASSERT_EQ(moonepPlannerGetSlots(planner, slot_expert.data(), slot_tokens.data(), slot_expert.size()),
            moonepSuccess);
  int used = 0;
  for (int i = 0; i < R * slots; ++i) {
    if (slot_expert[i] < 0) continue;
    ++used;
    EXPECT_EQ(slot_tokens[i], alloc[slot_expert[i] * R + i / slots]);
    EXPECT_NE(slot_expert[i] / (E / R), i / slots) << "replica on its home rank";
  }
  EXPECT_EQ(used, stats.replicas);
  for (int ex = 0; ex < E; ++ex) {
    int64_t sum = 0, expert_total = 0;
    for (int d = 0; d < R; ++d) sum += alloc[ex * R + d];
    for (int s = 0; s < R; ++s) expert_total += counts[s * E + ex];
    EXPECT_EQ(sum, expert_total) << "expert " << ex;
    int n = 0;
    ASSERT_EQ(moonepPlannerGetPieces(planner, ex, &n, nullptr, nullptr, nullptr, nullptr, 0), moonepSuccess);
    std::vector<int> dest(n);
    std::vector<int64_t> start(n), count(n), row(n);
    ASSERT_EQ(moonepPlannerGetPieces(planner, ex, &n, dest.data(), start.data(), count.data(), row.data(), n),
              moonepSuccess);
    int64_t pos = 0;
    std::vector<int64_t> per_rank(R, 0);
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(start[i], pos);
      pos += count[i];
      per_rank[dest[i]] += count[i];
    }
    EXPECT_EQ(pos, expert_total);
    for (int d = 0; d < R; ++d) EXPECT_EQ(per_rank[d], alloc[ex * R + d]);
  }
  for (int d = 0; d < R; ++d) {
    std::vector<int64_t> off(groups), cnt(groups), pad(groups);
    int64_t rows = 0;
    ASSERT_EQ(moonepPlannerGetLayout(planner, d, off.data(), cnt.data(), pad.data(), groups, &rows), moonepSuccess);
    int64_t end = 0;
    for (int g = 0; g < groups; ++g) {
      EXPECT_GE(off[g], end);
      EXPECT_EQ(pad[g] % 4, 0);
      EXPECT_GE(pad[g], cnt[g]);
      end = off[g] + pad[g];
    }
    EXPECT_LE(end, rows);
  }
  size_t size = 0;
  ASSERT_EQ(moonepPlannerSerialize(planner, nullptr, 0, &size), moonepSuccess);
  std::vector<char> bytes(size);
  ASSERT_EQ(moonepPlannerSerialize(planner, bytes.data(), bytes.size(), &size), moonepSuccess);
  // Same input through a second planner: identical bytes.
  moonepPlanner_t again = nullptr;
  ASSERT_EQ(moonepPlannerCreate(&config, &again), moonepSuccess);
  ASSERT_EQ(moonepPlannerPlan(again, counts.data(), counts.size()), moonepSuccess);
  std::vector<char> bytes2(size);
  ASSERT_EQ(moonepPlannerSerialize(again, bytes2.data(), bytes2.size(), &size), moonepSuccess);
  EXPECT_EQ(bytes, bytes2);
  EXPECT_EQ(moonepPlannerDestroy(again), moonepSuccess);
  EXPECT_EQ(moonepPlannerDestroy(planner), moonepSuccess);
}

TEST(PlannerCApi, BadInputGetsAResultCode) {
  moonepPlannerConfig_t config = MOONEP_PLANNER_CONFIG_INITIALIZER;
  moonepPlanner_t planner = nullptr;
  EXPECT_EQ(moonepPlannerCreate(&config, &planner), moonepInvalidArgument);
  EXPECT_NE(std::string(moonepGetLastThreadError()).find("num_ranks"), std::string::npos);
  EXPECT_EQ(planner, nullptr);
  EXPECT_EQ(moonepPlannerCreate(nullptr, &planner), moonepInvalidArgument);
  EXPECT_EQ(moonepPlannerCreate(&config, nullptr), moonepInvalidArgument);
  config.num_ranks = 3;
  config.num_experts = 8;
  EXPECT_EQ(moonepPlannerCreate(&config, &planner), moonepInvalidArgument);
  config.num_ranks = 4;
  config.slots = 0;
  EXPECT_EQ(moonepPlannerCreate(&config, &planner), moonepInvalidArgument);
  config.slots = -1;
  config.size = 8;
  EXPECT_EQ(moonepPlannerCreate(&config, &planner), moonepInvalidArgument);
  config.size = sizeof(config);
  config.policy = static_cast<moonepPlannerPolicy_t>(17);
  EXPECT_EQ(moonepPlannerCreate(&config, &planner), moonepInvalidArgument);
  config.policy = moonepPolicyMoonEP;
  ASSERT_EQ(moonepPlannerCreate(&config, &planner), moonepSuccess);
  int64_t alloc[32];
  EXPECT_EQ(moonepPlannerGetAlloc(planner, alloc, 32), moonepInvalidUsage);  // no plan yet
  std::vector<int64_t> counts(32, 3);
  counts[5] = -1;
  EXPECT_EQ(moonepPlannerPlan(planner, counts.data(), counts.size()), moonepInvalidArgument);
  EXPECT_NE(std::string(moonepPlannerGetLastError(planner)).find("negative"), std::string::npos);
  counts[5] = 1;
  EXPECT_EQ(moonepPlannerPlan(planner, counts.data(), 31), moonepInvalidArgument);
  EXPECT_EQ(moonepPlannerPlan(planner, nullptr, 32), moonepInvalidArgument);
  ASSERT_EQ(moonepPlannerPlan(planner, counts.data(), counts.size()), moonepSuccess);
  EXPECT_STREQ(moonepPlannerGetLastError(planner), "");
  EXPECT_EQ(moonepPlannerGetAlloc(planner, alloc, 31), moonepInvalidArgument);  // too small
  EXPECT_EQ(moonepPlannerGetLayout(planner, 4, nullptr, nullptr, nullptr, 0, nullptr), moonepInvalidArgument);
  int n = 0;
  EXPECT_EQ(moonepPlannerGetPieces(planner, 32, &n, nullptr, nullptr, nullptr, nullptr, 0), moonepInvalidArgument);
  moonepPlanStats_t stats;
  stats.size = 4;
  EXPECT_EQ(moonepPlannerGetStats(planner, &stats), moonepInvalidArgument);
  EXPECT_EQ(moonepPlannerDestroy(planner), moonepSuccess);
  EXPECT_EQ(moonepPlannerDestroy(nullptr), moonepSuccess);
}

}  // namespace
