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

}  // namespace moonep::planner::testing
