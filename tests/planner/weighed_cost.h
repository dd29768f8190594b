// The objective of PlannerConfig::replica_cost_*, computed from a finished Plan (its layouts and
// replica slots), apart from the planner's own CostOf (which reads its decisions): the highest
// rank level (load in the fastest rank's tokens, rounded up) plus the highest rank transfer cost,
// the replicas' gradients reducing along chains.
// Header-only: planner_test and the standalone fuzz target both use it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "planner/plan.h"
#include "planner/policy.h"

namespace moonep::planner::testing {

struct Weighed {
  int64_t level = 0, transfers = 0;  // saturated at INT64_MAX / 2 each (so total() cannot wrap)
  int64_t total() const { return level + transfers; }
};

// The highest rank transfer cost of a set of replicas (expert, rank), the reduce moving along each
// expert's chain: its holders in increasing rank, then its home (transport/common/replica_chain.h).
// Per rank and link class (intra, inter: the two ranks of a hop on one node or not; every hop is
// inter when flat), the larger of hops sent and received, times that class's cost.
inline __int128 ChainTransferCost(int R, int rpn, int64_t cost_intra, int64_t cost_inter,
                                  const std::vector<int32_t>& home,
                                  std::vector<std::pair<int, int>> replicas) {
  std::sort(replicas.begin(), replicas.end());  // by expert, then rank
  std::vector<int64_t> k(static_cast<size_t>(R) * 4, 0);  // in intra, in inter, out intra, out inter
  const auto hop = [&](int from, int to) {
    const int inter = rpn > 0 ? from / rpn != to / rpn : 1;
    ++k[static_cast<size_t>(from) * 4 + 2 + inter];
    ++k[static_cast<size_t>(to) * 4 + inter];
  };
  for (size_t i = 0; i < replicas.size(); ++i) {
    const int e = replicas[i].first, d = replicas[i].second;
    const bool last = i + 1 == replicas.size() || replicas[i + 1].first != e;
    hop(d, last ? home[static_cast<size_t>(e)] : replicas[i + 1].second);
  }
  __int128 transfers = 0;
  for (int d = 0; d < R; ++d) {
    const int64_t* c = k.data() + static_cast<size_t>(d) * 4;
    transfers = std::max<__int128>(transfers, static_cast<__int128>(std::max(c[0], c[2])) * cost_intra);
    transfers = std::max<__int128>(transfers, static_cast<__int128>(std::max(c[1], c[3])) * cost_inter);
  }
  return transfers;
}

// `resolved` is the planner's resolved config; `no_replica`: the cost of keeping every expert home
// instead (the highest home load, as a level; transfers 0).
inline Weighed WeighPlan(const PlannerConfig& resolved, const Plan& p, bool no_replica = false) {
  const int R = p.num_ranks, S = p.slots, G = p.num_groups(), rpn = resolved.ranks_per_node;
  std::vector<int64_t> w;
  SpeedWeights(resolved, &w);
  const int64_t w_max = *std::max_element(w.begin(), w.end());
  std::vector<int64_t> load(R, 0);
  std::vector<std::pair<int, int>> replicas;  // (expert, rank)
  if (no_replica) {
    for (int e = 0; e < p.num_experts; ++e) {
      for (int d = 0; d < R; ++d) load[p.home[e]] += p.alloc[static_cast<size_t>(e) * R + d];
    }
  } else {
    for (int d = 0; d < R; ++d) {
      for (int g = 0; g < G; ++g) load[d] += p.group_count[static_cast<size_t>(d) * G + g];
      for (int s = 0; s < S; ++s) {
        const int e = p.slot_expert[static_cast<size_t>(d) * S + s];
        if (e >= 0) replicas.push_back({e, d});
      }
    }
  }
  __int128 level = 0;
  for (int d = 0; d < R; ++d) {
    level = std::max<__int128>(level, (static_cast<__int128>(load[d]) * w_max + w[d] - 1) / w[d]);
  }
  const __int128 transfers = ChainTransferCost(R, rpn, resolved.replica_cost_intra,
                                               resolved.replica_cost_inter, p.home, replicas);
  const __int128 cap = INT64_MAX / 2;
  return {static_cast<int64_t>(std::min(level, cap)), static_cast<int64_t>(std::min(transfers, cap))};
}

}  // namespace moonep::planner::testing
