// The objective of PlannerConfig::replica_cost_*, computed from a finished Plan (its layouts and
// replica slots), apart from the planner's own CostOf (which reads its decisions): the highest
// rank level (load in the fastest rank's tokens, rounded up) plus the highest rank transfer cost.
// Header-only: planner_test and the standalone fuzz target both use it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "planner/plan.h"
#include "planner/policy.h"

namespace moonep::planner::testing {

struct Weighed {
  int64_t level = 0, transfers = 0;  // saturated at INT64_MAX / 2 each (so total() cannot wrap)
  int64_t total() const { return level + transfers; }
};

// `resolved` is the planner's resolved config; `no_replica`: the cost of keeping every expert home
// instead (the highest home load, as a level; transfers 0).
inline Weighed WeighPlan(const PlannerConfig& resolved, const Plan& p, bool no_replica = false) {
  const int R = p.num_ranks, S = p.slots, G = p.num_groups(), rpn = resolved.ranks_per_node;
  std::vector<int64_t> w;
  SpeedWeights(resolved, &w);
  const int64_t w_max = *std::max_element(w.begin(), w.end());
  std::vector<int64_t> load(R, 0), k(static_cast<size_t>(R) * 4, 0);  // in/out, intra/inter
  if (no_replica) {
    for (int e = 0; e < p.num_experts; ++e) {
      for (int d = 0; d < R; ++d) load[p.home[e]] += p.alloc[static_cast<size_t>(e) * R + d];
    }
  } else {
    for (int d = 0; d < R; ++d) {
      for (int g = 0; g < G; ++g) load[d] += p.group_count[static_cast<size_t>(d) * G + g];
      for (int s = 0; s < S; ++s) {
        const int e = p.slot_expert[static_cast<size_t>(d) * S + s];
        if (e < 0) continue;
        const int h = p.home[e];
        const int inter = rpn > 0 ? d / rpn != h / rpn : 1;
        ++k[d * 4 + inter];
        ++k[h * 4 + 2 + inter];
      }
    }
  }
  __int128 level = 0, transfers = 0;
  for (int d = 0; d < R; ++d) {
    level = std::max<__int128>(level, (static_cast<__int128>(load[d]) * w_max + w[d] - 1) / w[d]);
    transfers = std::max<__int128>(
        transfers, static_cast<__int128>(std::max(k[d * 4], k[d * 4 + 2])) * resolved.replica_cost_intra);
    transfers = std::max<__int128>(
        transfers, static_cast<__int128>(std::max(k[d * 4 + 1], k[d * 4 + 3])) * resolved.replica_cost_inter);
  }
  const __int128 cap = INT64_MAX / 2;
  return {static_cast<int64_t>(std::min(level, cap)), static_cast<int64_t>(std::min(transfers, cap))};
}

}  // namespace moonep::planner::testing
