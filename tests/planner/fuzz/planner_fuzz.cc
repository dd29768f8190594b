// libFuzzer target: arbitrary bytes become a planner config and counts; the planner must return an
// error or a plan that ValidatePlan accepts (and Decide must agree with it on the decisions).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "planner/planner.h"
#include "tests/planner/weighed_cost.h"

namespace {

struct Bytes {
  const uint8_t* data;
  size_t size, pos = 0;
  uint8_t Next() { return pos < size ? data[pos++] : 0; }
  int64_t NextCount() {
    const uint8_t tag = Next();
    if (tag == 0xFF) return -static_cast<int64_t>(Next());         // rare negative entry
    if (tag == 0xFE) return int64_t{1} << (40 + Next() % 24);      // rare huge entry
    return (tag & 0x80) ? (tag & 0x7F) * 37 + Next() : tag & 0x3F;  // skewed small counts
  }
};

void Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", what, std::string(s.message()).c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moonep::planner;
  Bytes in{data, size};
  PlannerConfig c;
  c.num_ranks = in.Next() % 9;                       // 0 is invalid
  const int epn = 1 + in.Next() % 4;
  c.num_experts = c.num_ranks * epn + (in.Next() % 16 == 0 ? 1 : 0);  // sometimes not divisible
  c.slots = static_cast<int>(in.Next() % 7) - 1;     // -1 (default) .. 5, 0 is invalid
  c.pad_multiple = in.Next() % 6;                    // 0 is invalid
  c.ranks_per_node = in.Next() % 4;
  c.policy = static_cast<Policy>(in.Next() % 7);     // 6 is not a policy
  c.eplb_period = 1 + in.Next() % 3;
  const uint8_t flags = in.Next();
  if ((flags & 1) && c.num_ranks > 0) {
    for (int d = 0; d < c.num_ranks; ++d) c.speeds.push_back((in.Next() % 8) * 0.5);  // 0 invalid
  }
  if ((flags & 2) && c.num_ranks > 0) {
    for (int e = 0; e < c.num_experts; ++e) c.home.push_back(in.Next() % (c.num_ranks + 1));
  }
  if (flags & 8) {  // weigh replicas (sometimes out of range: refused)
    c.replica_cost_intra = static_cast<int64_t>(in.Next() % 16) - 1;
    c.replica_cost_inter = (flags & 16) ? kMaxReplicaCost + (in.Next() % 2) : in.Next() % 64;
    if (flags & 32) {  // and rows (sometimes out of range: refused)
      c.row_cost_intra = static_cast<int64_t>(in.Next() % 4096) - 1;
      c.row_cost_inter = (flags & 64) ? kMaxRowCost + (in.Next() % 2) : in.Next() % 8192;
    }
  }
  auto planner = Planner::Create(c);
  if (!planner.ok()) return 0;
  const PlannerConfig& rc = (*planner)->config();
  const size_t n = static_cast<size_t>(rc.num_ranks) * rc.num_experts;
  Plan plan, decided;
  for (int step = 0; step < 2; ++step) {
    std::vector<int64_t> counts(n + ((flags & 4) ? 1 : 0));
    for (auto& x : counts) x = in.NextCount();
    const absl::Status s = (*planner)->MakePlan(counts, &plan);
    if (!s.ok()) continue;
    const absl::Status v = ValidatePlan(plan, counts);
    if (!v.ok()) Fail("invalid plan", v);
    if (rc.policy == Policy::kMoonEP && plan.stats.max_load_after < LoadLowerBound(rc, counts)) {
      Fail("below the lower bound", absl::OkStatus());
    }
    // Weighing never costs more than no replica at all, nor than the unweighed (balanced) plan,
    // in its own terms: the highest rank level (load in the fastest rank's tokens) plus the highest
    // rank transfer cost (plus, with row costs, the highest rank row cost).
    if (rc.policy == Policy::kMoonEP && rc.weighs_replicas()) {
      PlannerConfig unweighed = c;
      unweighed.replica_cost_intra = unweighed.replica_cost_inter = 0;
      unweighed.row_cost_intra = unweighed.row_cost_inter = 0;
      Plan balanced;
      const absl::Status b = (*Planner::Create(unweighed))->MakePlan(counts, &balanced);
      if (!b.ok()) Fail("the unweighed plan failed where the weighed one succeeded", b);
      using moonep::planner::testing::WeighPlan;
      // (Unsaturated: costs near their limits take the terms past 2^63.)
      const __int128 mine = WeighPlan(rc, plan, false, &counts).exact;
      const __int128 ends[2] = {WeighPlan(rc, balanced, false, &counts).exact,
                                WeighPlan(rc, plan, true, &counts).exact};
      if (mine > ends[0]) Fail("weighing made a plan costlier than the balanced one", absl::OkStatus());
      if (mine > ends[1]) Fail("weighing made a plan costlier than no replica", absl::OkStatus());
    }
    // Decide on the same totals (a fresh planner: eplb keeps history) gives the same decisions.
    if (step == 0 && rc.policy != Policy::kFasterMoEShadow) {
      std::vector<int64_t> totals(rc.num_experts, 0);
      for (size_t i = 0; i < n; ++i) totals[i % rc.num_experts] += counts[i];
      auto fresh = Planner::Create(c);
      const absl::Status d = (*fresh)->Decide(totals, &decided);
      if (!d.ok()) Fail("Decide failed where MakePlan succeeded", d);
      // moonep breaks a tie with moonep-greedy (same balance and replicas) by travelling rows,
      // which Decide estimates from an even split of the totals: only the choice may differ.
      // Weighing starts from that choice and can then end elsewhere: with it, Decide only has to
      // succeed (its plan's decisions are checked by the Planner's own assertions).
      if (rc.policy == Policy::kMoonEP) {
        if (!rc.weighs_replicas() && (decided.stats.replicas != plan.stats.replicas ||
                                      decided.stats.max_load_after != plan.stats.max_load_after)) {
          Fail("Decide disagrees with MakePlan on replicas or balance", absl::OkStatus());
        }
      } else if (decided.alloc != plan.alloc || decided.slot_expert != plan.slot_expert) {
        Fail("Decide disagrees with MakePlan", absl::OkStatus());
      }
    }
  }
  return 0;
}
