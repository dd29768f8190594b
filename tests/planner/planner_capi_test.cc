// The planner C API, through the public header only, checked against ValidatePlan-level
// invariants recomputed here (conservation, layout, pieces).
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
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
  // A failed Plan drops the previous plan, and the accessors say which call failed (they said
  // "no plan yet: call moonepPlannerPlan first" although it had been called).
  counts[2] = -4;
  EXPECT_EQ(moonepPlannerPlan(planner, counts.data(), counts.size()), moonepInvalidArgument);
  EXPECT_EQ(moonepPlannerGetAlloc(planner, alloc, 32), moonepInvalidUsage);
  EXPECT_NE(std::string(moonepPlannerGetLastError(planner)).find("the last moonepPlannerPlan failed"),
            std::string::npos) << moonepPlannerGetLastError(planner);
  EXPECT_EQ(moonepPlannerDestroy(planner), moonepSuccess);
  EXPECT_EQ(moonepPlannerDestroy(nullptr), moonepSuccess);
}

TEST(PlannerCApi, ShapeLimitsAreRefusedAtCreation) {
  moonepPlannerConfig_t config = MOONEP_PLANNER_CONFIG_INITIALIZER;
  moonepPlanner_t planner = nullptr;
  // One rank, E = 2^30 + 2, slots = E: E/R + slots passes 2^31 - 1 (GetShape's num_groups came
  // back negative: -2147483644).
  config.num_ranks = 1;
  config.num_experts = (1 << 30) + 2;
  config.slots = -1;
  EXPECT_EQ(moonepPlannerCreate(&config, &planner), moonepInvalidArgument);
  EXPECT_NE(std::string(moonepGetLastThreadError()).find("groups per rank is too large"),
            std::string::npos) << moonepGetLastThreadError();
  EXPECT_EQ(planner, nullptr);
  // slots below -1: the message states the rule slots 0 is also held to (>= 1, or -1).
  config.num_experts = 8;
  config.slots = -2;
  EXPECT_EQ(moonepPlannerCreate(&config, &planner), moonepInvalidArgument);
  EXPECT_NE(std::string(moonepGetLastThreadError()).find("slots must be >= 1 (or -1 for E/R)"),
            std::string::npos) << moonepGetLastThreadError();
}

// A small planned planner: R = 4, E = 8, skewed counts (so there are replicas).
constexpr int kR = 4, kE = 8;

moonepPlannerConfig_t SmallConfig() {
  moonepPlannerConfig_t config = MOONEP_PLANNER_CONFIG_INITIALIZER;
  config.num_ranks = kR;
  config.num_experts = kE;
  return config;
}

std::vector<int64_t> SmallCounts() {
  std::vector<int64_t> counts(kR * kE, 5);
  for (int s = 0; s < kR; ++s) counts[s * kE] = 100 + s;
  return counts;
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Every planner entry point except create / destroy / last error, called on `p` with output
// buffers poisoned beforehand; `outputs_untouched` reports whether all of them still hold the
// poison afterwards.
struct EveryCall {
  const char* name;
  std::function<moonepResult_t(moonepPlanner_t)> call;
};

std::vector<EveryCall> EveryPlannerCall(bool* outputs_untouched) {
  static std::vector<int64_t> counts = SmallCounts();
  static int ints[4];
  static int64_t i64[4][64];
  static char bytes[1 << 14];
  static int32_t i32[64];
  static size_t size;
  static moonepPlanStats_t stats;
  auto poison = [] {
    std::memset(ints, 0x5A, sizeof(ints));
    std::memset(i64, 0x5A, sizeof(i64));
    std::memset(bytes, 0x5A, sizeof(bytes));
    std::memset(i32, 0x5A, sizeof(i32));
    std::memset(&size, 0x5A, sizeof(size));
    std::memset(&stats, 0x5A, sizeof(stats));
    stats.size = sizeof(stats);
  };
  poison();
  *outputs_untouched = true;
  auto check = [outputs_untouched](moonepResult_t r) {
    moonepPlanStats_t expected_stats;
    std::memset(&expected_stats, 0x5A, sizeof(expected_stats));
    expected_stats.size = sizeof(expected_stats);
    auto all = [](const void* p, size_t n) {
      for (size_t i = 0; i < n; ++i) {
        if (static_cast<const unsigned char*>(p)[i] != 0x5A) return false;
      }
      return true;
    };
    if (!all(ints, sizeof(ints)) || !all(i64, sizeof(i64)) || !all(i32, sizeof(i32)) ||
        !all(bytes, sizeof(bytes)) || !all(&size, sizeof(size)) ||
        std::memcmp(&stats, &expected_stats, sizeof(stats)) != 0) {
      *outputs_untouched = false;
    }
    return r;
  };
  return {
      {"moonepPlannerPlan",
       [=](moonepPlanner_t p) {
         return check(moonepPlannerPlan(p, counts.data(), counts.size()));
       }},
      {"moonepPlannerGetShape",
       [=](moonepPlanner_t p) {
         return check(moonepPlannerGetShape(p, &ints[0], &ints[1], &ints[2], &ints[3]));
       }},
      {"moonepPlannerGetStats",
       [=](moonepPlanner_t p) { return check(moonepPlannerGetStats(p, &stats)); }},
      {"moonepPlannerGetAlloc",
       [=](moonepPlanner_t p) { return check(moonepPlannerGetAlloc(p, i64[0], 64)); }},
      {"moonepPlannerGetSlots",
       [=](moonepPlanner_t p) { return check(moonepPlannerGetSlots(p, i32, i64[0], 64)); }},
      {"moonepPlannerGetLayout",
       [=](moonepPlanner_t p) {
         return check(moonepPlannerGetLayout(p, 0, i64[0], i64[1], i64[2], 64, &i64[3][0]));
       }},
      {"moonepPlannerGetPieces",
       [=](moonepPlanner_t p) {
         return check(moonepPlannerGetPieces(p, 0, &ints[0], i32, i64[0], i64[1], i64[2], 64));
       }},
      {"moonepPlannerSerialize",
       [=](moonepPlanner_t p) {
         return check(moonepPlannerSerialize(p, bytes, sizeof(bytes), &size));
       }},
  };
}

// Checks that every entry point refuses `p` with `expected` and a message naming the call and
// containing `message`, writing nothing.
void ExpectEveryCallRefuses(moonepPlanner_t p, moonepResult_t expected,
                            const std::string& message) {
  bool untouched = false;
  for (const EveryCall& c : EveryPlannerCall(&untouched)) {
    EXPECT_EQ(c.call(p), expected) << c.name;
    const std::string error = moonepGetLastThreadError();
    EXPECT_TRUE(Contains(error, c.name)) << c.name << ": " << error;
    EXPECT_TRUE(Contains(error, message)) << c.name << ": " << error;
    EXPECT_TRUE(untouched) << c.name << " wrote through its outputs";
  }
}

TEST(PlannerCApiHandles, EveryCallWorksOnALivePlanner) {
  // The same calls as the refusal tests below, on a live planner: they succeed and write.
  const moonepPlannerConfig_t config = SmallConfig();
  moonepPlanner_t p = nullptr;
  ASSERT_EQ(moonepPlannerCreate(&config, &p), moonepSuccess) << moonepGetLastThreadError();
  bool untouched = true;
  for (const EveryCall& c : EveryPlannerCall(&untouched)) {
    EXPECT_EQ(c.call(p), moonepSuccess) << c.name << ": " << moonepGetLastThreadError();
  }
  EXPECT_FALSE(untouched);
  EXPECT_EQ(moonepPlannerDestroy(p), moonepSuccess);
}

TEST(PlannerCApiHandles, UseAfterDestroyAndDoubleDestroyAreRefused) {
  const moonepPlannerConfig_t config = SmallConfig();
  moonepPlanner_t p = nullptr;
  ASSERT_EQ(moonepPlannerCreate(&config, &p), moonepSuccess) << moonepGetLastThreadError();
  const std::vector<int64_t> counts = SmallCounts();
  ASSERT_EQ(moonepPlannerPlan(p, counts.data(), counts.size()), moonepSuccess);
  ASSERT_EQ(moonepPlannerDestroy(p), moonepSuccess);
  // No planner is created from here on, so `p`'s address cannot belong to a new one.
  ExpectEveryCallRefuses(p, moonepInvalidUsage, "not a live planner");
  EXPECT_TRUE(Contains(moonepPlannerGetLastError(p), "not a live planner"));
  EXPECT_EQ(moonepPlannerDestroy(p), moonepInvalidUsage);
  EXPECT_TRUE(Contains(moonepGetLastThreadError(), "moonepPlannerDestroy"));
  EXPECT_TRUE(Contains(moonepGetLastThreadError(), "not a live planner"));
  EXPECT_EQ(moonepPlannerDestroy(p), moonepInvalidUsage);  // and again: no crash
}

TEST(PlannerCApiHandles, NullPlannerIsRefused) {
  ExpectEveryCallRefuses(nullptr, moonepInvalidArgument, "planner is NULL");
  EXPECT_STREQ(moonepPlannerGetLastError(nullptr), "planner is NULL");
  EXPECT_EQ(moonepPlannerDestroy(nullptr), moonepSuccess);  // documented no-op
  EXPECT_STREQ(moonepGetLastThreadError(), "");
}

TEST(PlannerCApiHandles, PointersThatWereNeverPlannersAreRefused) {
  // Memory that was never a planner (read or freed through it, this would crash or corrupt it).
  alignas(64) unsigned char fake[512];
  std::memset(fake, 0xC3, sizeof(fake));
  const auto fake_planner = reinterpret_cast<moonepPlanner_t>(fake);
  ExpectEveryCallRefuses(fake_planner, moonepInvalidUsage, "not a live planner");
  EXPECT_TRUE(Contains(moonepPlannerGetLastError(fake_planner), "not a live planner"));
  EXPECT_EQ(moonepPlannerDestroy(fake_planner), moonepInvalidUsage);
  for (unsigned char b : fake) ASSERT_EQ(b, 0xC3) << "the fake planner was written";

  // A pointer into a live planner is not a planner either; the live one is unaffected.
  const moonepPlannerConfig_t config = SmallConfig();
  moonepPlanner_t p = nullptr;
  ASSERT_EQ(moonepPlannerCreate(&config, &p), moonepSuccess) << moonepGetLastThreadError();
  const auto inner = reinterpret_cast<moonepPlanner_t>(reinterpret_cast<char*>(p) + 8);
  ExpectEveryCallRefuses(inner, moonepInvalidUsage, "not a live planner");
  EXPECT_EQ(moonepPlannerDestroy(inner), moonepInvalidUsage);
  int r = 0;
  EXPECT_EQ(moonepPlannerGetShape(p, &r, nullptr, nullptr, nullptr), moonepSuccess);
  EXPECT_EQ(r, kR);
  EXPECT_EQ(moonepPlannerDestroy(p), moonepSuccess);
}

TEST(PlannerCApiStructs, StatsAreWrittenOnlyUpToTheCallersSize) {
  const moonepPlannerConfig_t config = SmallConfig();
  moonepPlanner_t p = nullptr;
  ASSERT_EQ(moonepPlannerCreate(&config, &p), moonepSuccess) << moonepGetLastThreadError();
  const std::vector<int64_t> counts = SmallCounts();
  ASSERT_EQ(moonepPlannerPlan(p, counts.data(), counts.size()), moonepSuccess);
  moonepPlanStats_t full = MOONEP_PLAN_STATS_INITIALIZER;
  ASSERT_EQ(moonepPlannerGetStats(p, &full), moonepSuccess);
  EXPECT_EQ(full.size, sizeof(full));
  EXPECT_EQ(full.total_tokens, std::accumulate(counts.begin(), counts.end(), int64_t{0}));
  EXPECT_GT(full.replicas, 0);

  // An older caller's struct: `size` is the minimum (today, the first version's whole layout),
  // in a larger buffer whose bytes past `size` are poisoned and must stay so.
  constexpr size_t kMin = MOONEP_PLAN_STATS_MIN_SIZE;
  static_assert(kMin > sizeof(size_t) && kMin <= sizeof(moonepPlanStats_t), "min size");
  alignas(moonepPlanStats_t) unsigned char buffer[sizeof(moonepPlanStats_t) + 64];
  std::memset(buffer, 0xA5, sizeof(buffer));
  const size_t min_size = kMin;
  std::memcpy(buffer, &min_size, sizeof(min_size));
  ASSERT_EQ(moonepPlannerGetStats(p, reinterpret_cast<moonepPlanStats_t*>(buffer)), moonepSuccess)
      << moonepGetLastThreadError();
  moonepPlanStats_t expected = full;
  expected.size = kMin;
  EXPECT_EQ(std::memcmp(buffer, &expected, kMin), 0) << "the fields within size";
  for (size_t i = kMin; i < sizeof(buffer); ++i) ASSERT_EQ(buffer[i], 0xA5) << "byte " << i;

  // A newer caller's struct (larger than the library's): the library writes the fields it
  // knows, says so in `size`, and leaves the rest alone.
  std::memset(buffer, 0xA5, sizeof(buffer));
  const size_t newer = sizeof(moonepPlanStats_t) + 32;
  std::memcpy(buffer, &newer, sizeof(newer));
  ASSERT_EQ(moonepPlannerGetStats(p, reinterpret_cast<moonepPlanStats_t*>(buffer)), moonepSuccess)
      << moonepGetLastThreadError();
  EXPECT_EQ(std::memcmp(buffer, &full, sizeof(full)), 0);
  for (size_t i = sizeof(full); i < sizeof(buffer); ++i) ASSERT_EQ(buffer[i], 0xA5) << "byte " << i;

  // Below the minimum: refused, message names the struct, the size and the minimum; no write.
  std::memset(buffer, 0xA5, sizeof(buffer));
  const size_t small = kMin - 8;
  std::memcpy(buffer, &small, sizeof(small));
  EXPECT_EQ(moonepPlannerGetStats(p, reinterpret_cast<moonepPlanStats_t*>(buffer)),
            moonepInvalidArgument);
  const std::string error = moonepGetLastThreadError();
  EXPECT_TRUE(Contains(error, "moonepPlanStats_t")) << error;
  EXPECT_TRUE(Contains(error, std::to_string(small))) << error;
  EXPECT_TRUE(Contains(error, std::to_string(kMin))) << error;
  EXPECT_EQ(std::memcmp(buffer, &small, sizeof(small)), 0);
  for (size_t i = sizeof(small); i < sizeof(buffer); ++i) {
    ASSERT_EQ(buffer[i], 0xA5) << "byte " << i;
  }
  EXPECT_EQ(moonepPlannerDestroy(p), moonepSuccess);
}

TEST(PlannerCApiStructs, ConfigSizeAndVersionAreChecked) {
  moonepPlanner_t p = nullptr;
  // Below the minimum: refused with the struct, the size and the minimum named.
  moonepPlannerConfig_t config = SmallConfig();
  config.size = MOONEP_PLANNER_CONFIG_MIN_SIZE - 1;
  EXPECT_EQ(moonepPlannerCreate(&config, &p), moonepInvalidArgument);
  std::string error = moonepGetLastThreadError();
  EXPECT_TRUE(Contains(error, "moonepPlannerConfig_t")) << error;
  EXPECT_TRUE(Contains(error, std::to_string(MOONEP_PLANNER_CONFIG_MIN_SIZE - 1))) << error;
  EXPECT_TRUE(Contains(error, std::to_string(MOONEP_PLANNER_CONFIG_MIN_SIZE))) << error;
  EXPECT_EQ(p, nullptr);

  // Exactly the minimum (the first version's fields): accepted, and every field is used.
  config = SmallConfig();
  config.size = MOONEP_PLANNER_CONFIG_MIN_SIZE;
  config.slots = 1;
  config.eplb_period = 3;  // the last field of the first version
  config.policy = moonepPolicyEplb;
  ASSERT_EQ(moonepPlannerCreate(&config, &p), moonepSuccess) << moonepGetLastThreadError();
  int slots = 0;
  EXPECT_EQ(moonepPlannerGetShape(p, nullptr, nullptr, &slots, nullptr), moonepSuccess);
  EXPECT_EQ(slots, 1);
  EXPECT_EQ(moonepPlannerDestroy(p), moonepSuccess);

  // A newer caller's larger struct (unknown fields after ours): accepted, ours read.
  struct Newer {
    moonepPlannerConfig_t known;
    int64_t unknown[4];
  } newer;
  std::memset(&newer, 0x7F, sizeof(newer));
  newer.known = SmallConfig();
  newer.known.size = sizeof(newer);
  newer.known.slots = 2;
  ASSERT_EQ(moonepPlannerCreate(&newer.known, &p), moonepSuccess) << moonepGetLastThreadError();
  EXPECT_EQ(moonepPlannerGetShape(p, nullptr, nullptr, &slots, nullptr), moonepSuccess);
  EXPECT_EQ(slots, 2);
  EXPECT_EQ(moonepPlannerDestroy(p), moonepSuccess);

  // Version: 0 (never initialised) and another major version are refused, naming the field.
  for (int version : {0, MOONEP_VERSION_CODE(MOONEP_MAJOR + 1, 0, 0)}) {
    config = SmallConfig();
    config.version = version;
    EXPECT_EQ(moonepPlannerCreate(&config, &p), moonepInvalidArgument) << version;
    error = moonepGetLastThreadError();
    EXPECT_TRUE(Contains(error, "config->version is " + std::to_string(version))) << error;
    EXPECT_EQ(p, nullptr);
  }
  // A later minor version of the same major is accepted.
  config = SmallConfig();
  config.version = MOONEP_VERSION_CODE(MOONEP_MAJOR, MOONEP_MINOR + 1, 0);
  ASSERT_EQ(moonepPlannerCreate(&config, &p), moonepSuccess) << moonepGetLastThreadError();
  EXPECT_EQ(moonepPlannerDestroy(p), moonepSuccess);
}

// Creates a planner from `config`, plans `counts` and reads the stats back; the creation's result.
moonepResult_t PlanStatsOf(const moonepPlannerConfig_t& config, const std::vector<int64_t>& counts,
                           moonepPlanStats_t* stats) {
  moonepPlanner_t p = nullptr;
  const moonepResult_t r = moonepPlannerCreate(&config, &p);
  if (r != moonepSuccess) return r;
  EXPECT_EQ(moonepPlannerPlan(p, counts.data(), counts.size()), moonepSuccess)
      << moonepPlannerGetLastError(p);
  EXPECT_EQ(moonepPlannerGetStats(p, stats), moonepSuccess);
  EXPECT_EQ(moonepPlannerDestroy(p), moonepSuccess);
  return r;
}

// 0.2.0's replica costs: read from a 0.2.0 struct (the planner weighs replicas), ignored past a
// 0.1.0 caller's size, and refused out of range. The case is worked by hand in planner_test
// (PlannerWeighing.HandWorkedCases): no replica at a cost of 501, three unweighed.
// 0.2.0's fields start at 0.1.0's sizeof (LP64: 80), as the append rule says.
static_assert(sizeof(void*) != 8 || offsetof(moonepPlannerConfig_t, replica_cost_intra) == 80,
              "moonepPlannerConfig_t: 0.2.0's fields must start where 0.1.0's struct ended");
TEST(PlannerCApiStructs, ReplicaCostsAreRead) {
  const std::vector<int64_t> counts = {1000, 0, 0, 0,  0, 400, 0, 0,  0, 0, 400, 0,  0, 0, 0, 200};
  const auto plan = [&](const moonepPlannerConfig_t& config, moonepPlanStats_t* stats) {
    return PlanStatsOf(config, counts, stats);
  };
  moonepPlannerConfig_t config = MOONEP_PLANNER_CONFIG_INITIALIZER;
  EXPECT_EQ(config.replica_cost_intra, 0);
  EXPECT_EQ(config.replica_cost_inter, 0);
  config.num_ranks = 4;
  config.num_experts = 4;
  config.slots = 2;
  config.replica_cost_inter = 501;
  moonepPlanStats_t stats = MOONEP_PLAN_STATS_INITIALIZER;
  ASSERT_EQ(plan(config, &stats), moonepSuccess) << moonepGetLastThreadError();
  EXPECT_EQ(stats.replicas, 0);
  EXPECT_EQ(stats.max_load_after, 1000);
  // A 0.1.0 caller: the costs are not its fields (its sizeof, and the minimum size), and are not
  // read even when what lies there would be refused.
  config.replica_cost_intra = -7;
  for (size_t size : {offsetof(moonepPlannerConfig_t, replica_cost_intra),
                      size_t{MOONEP_PLANNER_CONFIG_MIN_SIZE}}) {
    config.size = size;
    ASSERT_EQ(plan(config, &stats), moonepSuccess) << size << ": " << moonepGetLastThreadError();
    EXPECT_EQ(stats.replicas, 3) << size;
    EXPECT_EQ(stats.max_load_after, 500) << size;
  }
  config.replica_cost_intra = 0;
  config.size = sizeof(config);
  config.replica_cost_intra = -5;
  EXPECT_EQ(plan(config, &stats), moonepInvalidArgument);
  EXPECT_TRUE(Contains(moonepGetLastThreadError(), "replica_cost_intra must be in [0, 2^52], got -5"))
      << moonepGetLastThreadError();
}

// 0.3.0's row costs: read from a 0.3.0 struct, ignored past a 0.2.0 caller's size, and refused out
// of range. The case is worked by hand in planner_test (PlannerWeighingRows.HandWorkedCase): one
// replica with rows weighed, none without.
static_assert(sizeof(void*) != 8 || offsetof(moonepPlannerConfig_t, row_cost_intra) == 96,
              "moonepPlannerConfig_t: 0.3.0's fields must start where 0.2.0's struct ended");
TEST(PlannerCApiStructs, RowCostsAreRead) {
  const std::vector<int64_t> counts = {0, 10, 100, 0};
  const auto plan = [&](const moonepPlannerConfig_t& config, moonepPlanStats_t* stats) {
    return PlanStatsOf(config, counts, stats);
  };
  moonepPlannerConfig_t config = MOONEP_PLANNER_CONFIG_INITIALIZER;
  EXPECT_EQ(config.row_cost_intra, 0);
  EXPECT_EQ(config.row_cost_inter, 0);
  config.num_ranks = 2;
  config.num_experts = 2;
  config.replica_cost_inter = 60;
  config.row_cost_inter = 1024;
  moonepPlanStats_t stats = MOONEP_PLAN_STATS_INITIALIZER;
  ASSERT_EQ(plan(config, &stats), moonepSuccess) << moonepGetLastThreadError();
  EXPECT_EQ(stats.replicas, 1);
  EXPECT_EQ(stats.max_load_after, 55);
  // A 0.2.0 caller: the row costs are not its fields, and are not read even when what lies there
  // would be refused.
  config.row_cost_intra = -7;
  config.size = offsetof(moonepPlannerConfig_t, row_cost_intra);
  ASSERT_EQ(plan(config, &stats), moonepSuccess) << moonepGetLastThreadError();
  EXPECT_EQ(stats.replicas, 0);
  EXPECT_EQ(stats.max_load_after, 100);
  config.size = sizeof(config);
  EXPECT_EQ(plan(config, &stats), moonepInvalidArgument);
  EXPECT_TRUE(Contains(moonepGetLastThreadError(), "row_cost_intra must be in [0, 2^40], got -7"))
      << moonepGetLastThreadError();
}

TEST(PlannerCApiHandles, DistinctPlannersOnManyThreads) {
  // Each thread creates, plans, reads back and destroys its own planners, with failing calls in
  // between; the registry is shared. Every thread must get the reference bytes and its own errors.
  const moonepPlannerConfig_t config = SmallConfig();
  const std::vector<int64_t> counts = SmallCounts();
  std::vector<char> reference;
  {
    moonepPlanner_t p = nullptr;
    ASSERT_EQ(moonepPlannerCreate(&config, &p), moonepSuccess);
    ASSERT_EQ(moonepPlannerPlan(p, counts.data(), counts.size()), moonepSuccess);
    size_t size = 0;
    ASSERT_EQ(moonepPlannerSerialize(p, nullptr, 0, &size), moonepSuccess);
    reference.resize(size);
    ASSERT_EQ(moonepPlannerSerialize(p, reference.data(), size, &size), moonepSuccess);
    ASSERT_EQ(moonepPlannerDestroy(p), moonepSuccess);
  }
  constexpr int kThreads = 8, kRounds = 40;
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      int& bad = failures[t];
      for (int round = 0; round < kRounds; ++round) {
        moonepPlanner_t p[2] = {nullptr, nullptr};
        for (auto& h : p) bad += moonepPlannerCreate(&config, &h) != moonepSuccess;
        if (p[0] == nullptr || p[1] == nullptr) return;
        int64_t alloc[kR * kE];
        bad += moonepPlannerGetAlloc(p[0], alloc, kR * kE) != moonepInvalidUsage;  // no plan yet
        bad += !Contains(moonepPlannerGetLastError(p[0]), "no plan yet");
        bad += !Contains(moonepGetLastThreadError(), "no plan yet");
        for (auto h : p) bad += moonepPlannerPlan(h, counts.data(), counts.size()) != moonepSuccess;
        bad += std::string(moonepPlannerGetLastError(p[0])) != "";
        std::vector<char> bytes(reference.size() + 1);
        size_t size = 0;
        bad += moonepPlannerSerialize(p[1], bytes.data(), bytes.size(), &size) != moonepSuccess;
        bytes.resize(size);
        bad += bytes != reference;
        moonepPlanStats_t stats = MOONEP_PLAN_STATS_INITIALIZER;
        bad += moonepPlannerGetStats(p[0], &stats) != moonepSuccess;
        bad += stats.total_tokens != std::accumulate(counts.begin(), counts.end(), int64_t{0});
        for (auto h : p) bad += moonepPlannerDestroy(h) != moonepSuccess;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
}

}  // namespace
