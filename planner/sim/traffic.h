// From a plan and one step's routing to per-rank work and traffic, at three levels of detail:
//
//   tokens  full plan (pieces) + every token's top-k: exact. A token's row goes once to each rank
//           that computes one of its experts (dedup), found through the plan's pieces of each
//           expert's canonical order, exactly as the runtime places it.
//   counts  full plan + counts[R][E]: rows per (source, destination) exact from the pieces; the
//           dedup is estimated (below), since counts do not say which experts share a token.
//   totals  decisions only (alloc, slot_expert) + per-expert totals: where each expert's tokens
//           come from is the routing model's expectation (or a trace's counts), and the placement
//           rule of FinalizePlan is approximated per holder: a holder with `a` tokens of expert e
//           takes min(a, own) from its own rank, then min(a, node) - min(a, own) from its node,
//           and the rest from other nodes, where own / node are the expected tokens of e that
//           come from the holder's rank / node. Sources send in proportion to their tokens.
// Dedup estimate (counts, totals): if source s sends r of its T*K rows to destination d, d holds a
// share q = r / (T*K) of s's choices; treat that as d holding q*E of the E experts, of which each
// token draws K without replacement. The rows needed are then T * (1 - prod_{i<K} (1 - qE/(E-i))):
// exact for uniform routing, the independent-choice T * (1 - (1 - q)^K) when E >> K. In `totals`,
// a destination's rows are spread evenly over the sources of its node (intra) and the other nodes
// (inter).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "planner/plan.h"
#include "planner/sim/cost_model.h"
#include "planner/sim/routing.h"

namespace moonep::sim {

enum class Detail : int32_t { kTokens = 0, kCounts = 1, kTotals = 2 };
const char* DetailName(Detail detail);

// Per-step figures of one plan.
struct PlanMetrics {
  int64_t total_tokens = 0;     // routed (token, expert) pairs
  int64_t max_load = 0;         // rows on the busiest rank
  double mean_load = 0;
  int32_t replicas = 0;
  int32_t prefetch_intra = 0, prefetch_inter = 0;  // replicas whose home is on / off the node
                                                   // (as PlanStats; the hops are in RankTraffic)
  int64_t rows_local = 0;       // (token, expert) rows computed on their source rank
  int64_t rows_intra = 0;       // ... computed on another rank of the node (before dedup)
  int64_t rows_inter = 0;       // ... computed on another node (before dedup)
  int64_t dispatch_intra = 0;   // rows sent inside nodes after dedup
  int64_t dispatch_inter = 0;   // rows sent across nodes after dedup
  Detail detail = Detail::kTokens;
  double imbalance() const { return mean_load > 0 ? max_load / mean_load : 1.0; }
};

// Expected tokens of expert e that come from rank r (own) and from r's node (node).
using LocalityFn = std::function<void(int32_t rank, int32_t expert, double* own, double* node)>;

class TrafficCounter {
 public:
  // Loads, replicas, and prefetch and reduce hops per rank, from alloc and slot_expert (every
  // policy).
  void Placement(const planner::Plan& plan, RankTraffic* traffic, PlanMetrics* metrics);

  // `tokens`: plan must carry pieces (MakePlan / FinalizePlan), routing must have topk_ids.
  void FromTokens(const planner::Plan& plan, const StepRouting& routing, RankTraffic* traffic,
                  PlanMetrics* metrics);
  // `counts`: plan must carry pieces; routing must have counts. topk = 0 leaves rows undeduped.
  void FromCounts(const planner::Plan& plan, const StepRouting& routing, RankTraffic* traffic,
                  PlanMetrics* metrics);
  // `totals`: decisions only. `locality` gives where each expert's tokens come from.
  void FromTotals(const planner::Plan& plan, const StepRouting& routing, const LocalityFn& locality,
                  RankTraffic* traffic, PlanMetrics* metrics);

 private:
  std::vector<int64_t> offsets_;   // (R + 1) * E source offsets
  std::vector<int32_t> cursor_;    // [E] current piece of each expert
  std::vector<int32_t> seen_;      // [E] tokens of the current source seen per expert
  std::vector<int64_t> pair_rows_; // [R * R] rows source -> destination (counts detail)
  std::vector<int32_t> node_;      // [R] node of each rank
  std::vector<int32_t> dests_;     // [K] destinations of one token
  std::vector<int32_t> last_holder_;  // [E] highest holder rank so far (ChainHops)

  void ChainHops(const planner::Plan& plan, RankTraffic* traffic);
};

// Expected rows after dedup when `rows` of a source's tokens*topk choices (of `experts`) go to one
// destination (the estimate above).
double DedupRows(double rows, double tokens, int32_t topk, int32_t experts);

}  // namespace moonep::sim
