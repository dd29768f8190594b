// The Plan: the planner's output and the contract every other part reads (transport, executor,
// runtime, simulator). Plain data; for the same input it has identical bytes on every rank.
//
// Terms (see ../docs/planner.md):
//   R ranks, E experts, epn = E / R home experts per rank, `slots` replica slots per rank.
//   counts[src * E + e]: tokens of source rank `src` routed to expert `e` (once per top-k entry).
//   Each rank computes G = epn + slots groups: its epn home experts (in increasing expert id),
//   then its replica slots (slot s -> slot_expert[rank * slots + s], or -1 when unused).
//   Canonical order of expert e: the tokens of all sources that chose e, sources in increasing
//   rank, each source's tokens by increasing token index. Position p of that order belongs to
//   source s when src_offset(s, e) <= p < src_offset(s, e) + counts[s][e], where src_offset is
//   the prefix sum of counts[.][e] over sources (SourceOffsets() in plan_builder.h).
//   The plan cuts each expert's canonical order into pieces, each computed on one rank. The rows
//   of a group are that rank's pieces of the expert in increasing position, so they are ordered by
//   source rank, then token index. Group g of rank d occupies rows
//   [group_offset, group_offset + group_count) of d's compute layout, followed by padding up to
//   group_padded rows. Nothing here grows with R * E: a plan is O(E + R * slots).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moonep::planner {

enum class Policy : int32_t {
  kNone = 0,            // home placement only
  kMoonEP = 1,          // perfect balance, fewest replicas, locality (default)
  kMoonEPGreedy = 2,    // the published MoonEP greedy policy
  kEplb = 3,            // DeepSeek EPLB on an average of past counts, re-planned every N steps
  kFasterMoEShadow = 4, // FasterMoE dynamic shadowing
  kTestForceReplicas = 5,  // tests only: fills replica slots and splits experts aggressively
};

const char* PolicyName(Policy policy);
// Parses "none", "moonep", "moonep-greedy", "eplb", "fastermoe-shadow", "test-force-replicas".
bool ParsePolicy(const std::string& name, Policy* policy);

// The largest PlannerConfig::replica_cost_intra / _inter (tokens, like a rank's load).
inline constexpr int64_t kMaxReplicaCost = int64_t{1} << 52;
// PlannerConfig::row_cost_intra / _inter are in 1/kRowCostScale tokens; at most kMaxRowCost.
inline constexpr int64_t kRowCostScale = 1024;
inline constexpr int64_t kMaxRowCost = int64_t{1} << 40;

struct PlannerConfig {
  int32_t num_ranks = 0;
  int32_t num_experts = 0;
  int32_t slots = -1;          // replica slots per rank; -1 means E / R
  int32_t pad_multiple = 1;    // each group's rows padded to a multiple of this (GEMM alignment)
  int32_t ranks_per_node = 0;  // 0: flat topology; else ranks [n*rpn, (n+1)*rpn) form node n
                               // (above R: one node of every rank)
  std::vector<int32_t> home;   // [E] home rank of each expert; empty means e / (E / R)
  std::vector<double> speeds;  // [R] relative speeds (balance time, not tokens); empty: all 1
  Policy policy = Policy::kMoonEP;
  // Optional sizes so that stats can report bytes (0: stats report rows/experts only).
  int64_t row_bytes = 0;       // bytes of one dispatched token row (at most 2^40)
  int64_t expert_bytes = 0;    // bytes of one expert's parameters (prefetch = reduce size; <= 2^40)
  // eplb: re-plan every this many steps on the running average of past counts.
  int32_t eplb_period = 1;
  // fastermoe-shadow cost model (seconds per token of compute; seconds per byte of broadcast).
  double shadow_compute_s_per_token = 1e-6;
  double shadow_broadcast_s_per_byte = 1e-10;
  // eplb: redundant (extra physical) experts in total, spread over ranks (-1: R, one per rank; at
  // most R * slots, one per replica slot), and expert groups for its hierarchical policy (0: one
  // group per node when ranks_per_node is set, which selects the hierarchical policy; otherwise
  // the global policy).
  int32_t eplb_redundant = -1;
  int32_t eplb_num_groups = 0;
  // test-force-replicas only, one-rank mode: when num_ranks == 1, replica slots hold copies of
  // the rank's own experts (slot s -> its home group s, for s < E) and take a share of their
  // tokens, so a one-rank run still routes through replica slots, prefetch and reduce. Such a
  // plan has Plan::home_replicas set; every other plan keeps the rule "no replica of an expert on
  // its home rank". Ignored by other policies and when num_ranks > 1.
  bool test_home_replicas = false;
  // moonep: also run moonep-greedy on the same capacities and keep its decisions when they balance
  // as well with fewer replicas, or as many and fewer travelling rows (a per-input guarantee that
  // moonep is never worse than the published greedy; roughly doubles the policy's own time). With
  // replica costs (below) the guarantee holds for the plan weighing starts from, and weighing may
  // then give up balance for fewer transfers.
  bool moonep_check_greedy = true;
  // moonep: what replicas cost, so that it balances only as far as balancing pays (docs/planner.md
  // "Weighing replicas"). The cost of one replica transfer on a rank -- a replica's weights
  // arriving or leaving, its gradients leaving or arriving -- in tokens of the fastest rank's
  // compute: `intra` when the two ranks of the transfer share a node, `inter` otherwise (all, when
  // flat). The transfers are the hops along each expert's chain (transport/common/replica_chain.h):
  // the prefetch from its home to its holders in increasing rank, the reduce from them, in the same
  // order, to the home. A rank's transfer cost is the larger of its intra count times `intra` and
  // its inter count times `inter`, counting on each link class the most hops it sends or receives
  // in the prefetch or in the reduce.
  // When either is set, moonep searches the plans for caps from the balanced level up to no
  // replicas at all (a heuristic search: a branch and bound that takes the transfer cost to fall
  // with the level) for a low max(rank level) + max(rank transfer cost), a rank's level being its
  // load in tokens of the fastest rank; the plan it keeps never costs more than the plan moonep
  // makes without costs (the perfectly balanced one, or the slot-bound one when the slot limit
  // forbids perfect balance) or no replica at all. Both 0 (default): perfect balance whatever the replicas
  // cost. Each in [0, 2^52]; ignored by the other policies.
  int64_t replica_cost_intra = 0;
  int64_t replica_cost_inter = 0;
  // moonep, when it weighs replicas (above): what one token row sent or received costs, in
  // 1/kRowCostScale tokens of the fastest rank's compute, inside a node and across nodes (every
  // row, when flat); each in [0, kMaxRowCost]. The search then adds to a plan's cost the highest
  // rank row cost (the larger of its intra rows times `intra` and its inter rows times `inter`,
  // rows counted on each link class as the larger of sent and received), with the rows estimated
  // from the decisions (docs/planner.md "Rows in the objective"). Both 0: rows are left out.
  int64_t row_cost_intra = 0;
  int64_t row_cost_inter = 0;
  bool weighs_rows() const { return row_cost_intra != 0 || row_cost_inter != 0; }
  bool weighs_replicas() const { return replica_cost_intra != 0 || replica_cost_inter != 0; }
};

struct PlanStats {
  int64_t total_tokens = 0;       // sum(counts)
  int64_t max_load_before = 0;    // max rank load with home placement only
  int64_t max_load_after = 0;     // max rank load of this plan
  double mean_load = 0.0;         // total_tokens / R
  int32_t replicas = 0;           // replica slots in use, all ranks
  int64_t rows_local = 0;         // token rows computed on their source rank
  int64_t rows_travel_intra = 0;  // token rows (not deduplicated) sent inside a node
  int64_t rows_travel_inter = 0;  // token rows sent across nodes (all, when flat)
  int32_t prefetch_intra = 0;     // replicas whose home is on the same node
  int32_t prefetch_inter = 0;     // replicas whose home is on another node
  // (Byte stats saturate at INT64_MAX.)
  int64_t dispatch_bytes_intra = 0, dispatch_bytes_inter = 0;  // rows * row_bytes
  int64_t prefetch_bytes_intra = 0, prefetch_bytes_inter = 0;  // replicas * expert_bytes
  int64_t reduce_bytes_intra = 0, reduce_bytes_inter = 0;      // same as prefetch
  double imbalance_before() const { return mean_load > 0 ? max_load_before / mean_load : 1.0; }
  double imbalance_after() const { return mean_load > 0 ? max_load_after / mean_load : 1.0; }
};

struct Plan {
  int32_t num_ranks = 0;
  int32_t num_experts = 0;
  int32_t experts_per_rank = 0;  // epn
  int32_t slots = 0;
  int32_t pad_multiple = 1;
  int32_t ranks_per_node = 0;
  // Replica slots may hold an expert on its own home rank (only test-force-replicas with
  // PlannerConfig::test_home_replicas at one rank). Then rank home(e) computes e in two groups:
  // its home group and the slot; alloc[e][home] is their sum, slot_alloc[slot] the slot's part,
  // GroupOf() names the home group, and a piece belongs to the group whose rows hold piece_row.
  // A transport prefetches such a slot by a local copy and reduces it by a local add.
  bool home_replicas = false;

  std::vector<int32_t> home;           // [E]
  std::vector<int32_t> local_experts;  // [R * epn] rank r's home group g is expert local_experts[r*epn+g]
  std::vector<int32_t> home_group;     // [E] group index of expert e on its home rank
  std::vector<int64_t> alloc;          // [E * R] tokens of expert e computed on rank d: alloc[e*R + d]
  std::vector<int32_t> slot_expert;    // [R * slots] expert in each replica slot, -1 if unused
  std::vector<int64_t> slot_alloc;     // [R * slots] tokens computed in each slot (0 if unused);
                                       // equals alloc[slot_expert * R + rank] (added for O(R*slots) readers),
                                       // except for a slot on its expert's home rank (home_replicas)

  // Compute layout, G = epn + slots groups per rank, indexed [rank * G + g].
  std::vector<int64_t> group_offset;
  std::vector<int64_t> group_count;
  std::vector<int64_t> group_padded;
  std::vector<int64_t> rank_rows;      // [R] sum of group_padded: rows rank d must hold

  // Pieces of expert e: indices piece_begin[e] .. piece_begin[e+1]-1, in increasing start.
  // Piece p: rank piece_dest[p] computes positions [piece_start[p], piece_start[p] + piece_count[p])
  // of e's canonical order; the first of them lands at row piece_row[p] of that rank's compute
  // layout. The pieces of an expert are disjoint and cover [0, total tokens of e) exactly.
  std::vector<int32_t> piece_begin;    // [E + 1]
  std::vector<int32_t> piece_dest;
  std::vector<int64_t> piece_start;
  std::vector<int64_t> piece_count;
  std::vector<int64_t> piece_row;

  PlanStats stats;

  int32_t num_groups() const { return experts_per_rank + slots; }
  // Group index of expert e on rank d, or -1 when d does not compute e (the home group on the home
  // rank, even where home_replicas puts a second copy of e in a slot there).
  int32_t GroupOf(int32_t rank, int32_t expert) const;
  // Expert computed by group g of rank d (-1 for an unused slot).
  int32_t ExpertOfGroup(int32_t rank, int32_t group) const;
};

}  // namespace moonep::planner
