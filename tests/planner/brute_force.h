// Exact minimum replica count by exhaustive search (tiny instances only), the oracle for the
// moonep heuristic: enumerates replica sets by increasing size and checks with a max flow whether
// some allocation over home + replicas gives every rank a load in [lo[d], hi[d]].
#pragma once

#include <cstdint>
#include <vector>

namespace moonep::planner::testing {

struct BruteForceResult {
  int min_replicas = -1;  // -1: none up to max_replicas
  bool exhausted = false; // true when every replica set (up to the slot limit) was tried
};

BruteForceResult BruteForceMinReplicas(int R, int E, int slots, const std::vector<int>& home,
                                       const std::vector<int64_t>& totals,
                                       const std::vector<int64_t>& lo, const std::vector<int64_t>& hi,
                                       int max_replicas);

// The least max(rank load) + max(rank transfer cost) over every replica set within the slot limit
// (the objective of PlannerConfig::replica_cost_*, equal speeds): for each set, the least max load
// any allocation over home + replicas reaches (a bisection with max flows), plus what the set
// transfers, the reduce moving along each expert's chain (holders in increasing rank, then home):
// per rank, max(intra count * cost_intra, inter count * cost_inter), counting on each link class
// the larger of hops sent and received (ChainTransferCost in weighed_cost.h); ranks d and h share a
// node when d / rpn == h / rpn (rpn 0: flat, every hop inter).
int64_t BruteForceMinWeighedCost(int R, int E, int slots, const std::vector<int>& home,
                                 const std::vector<int64_t>& totals, int rpn, int64_t cost_intra,
                                 int64_t cost_inter);

}  // namespace moonep::planner::testing
