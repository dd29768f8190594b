// Everything of a Plan that follows from the placement decisions (alloc and replica slots): the
// pieces of each expert's canonical order, the compute layouts and the stats. Every policy
// decides alloc + slot_expert and then calls FinalizePlan, so all policies share one definition of
// where a token lands.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "planner/plan.h"

namespace moonep::planner {

// Checks a config and fills defaults: slots (-1 -> E/R), home (empty -> e / (E/R)), speeds.
absl::Status ResolveConfig(const PlannerConfig& in, PlannerConfig* out);

// Checks counts against a resolved config: size R*E, no negative entry.
absl::Status CheckCounts(const PlannerConfig& resolved, absl::Span<const int64_t> counts);

// Prefix sums of counts over sources: offsets[s * E + e] = sum_{s' < s} counts[s' * E + e], for
// s in [0, R] (so offsets has (R + 1) * E entries and row R holds each expert's total).
void ComputeSourceOffsets(absl::Span<const int64_t> counts, int32_t num_ranks, int32_t num_experts,
                          std::vector<int64_t>* offsets);

// The placement's last step, shared by FinalizeHolders and the policies' count of local rows:
// replicas laid left to right ([start[j], end[j]), each at or after the previous one's end) that
// run past n_tokens shift left, the last to end at n_tokens and each earlier one where the next
// starts. Nothing moves when the last one ends in time.
inline void ShiftReplicasLeft(int64_t n_tokens, int64_t* start, int64_t* end, int32_t n) {
  if (n == 0 || end[n - 1] <= n_tokens) return;
  int64_t limit = n_tokens;
  for (int32_t j = n - 1; j >= 0; --j) {
    if (end[j] > limit) {
      start[j] -= end[j] - limit;
      end[j] = limit;
    }
    limit = start[j];
  }
}

// The placement rule for one expert's n replicas in increasing rank (FinalizeHolders, the
// policies' count of local rows, weighing's row estimate): replica j, of amount[j] tokens, starts
// at its own rank's first position col[j] or where the previous one ends, whichever is later; then
// ShiftReplicasLeft. `amount` may be `end` (each is read before it is written).
inline void LayReplicas(int64_t n_tokens, const int64_t* col, const int64_t* amount, int64_t* start,
                        int64_t* end, int32_t n) {
  int64_t cursor = 0;
  for (int32_t j = 0; j < n; ++j) {
    start[j] = std::max(col[j], cursor);
    cursor = end[j] = start[j] + amount[j];
  }
  ShiftReplicasLeft(n_tokens, start, end, n);
}

// One decision set's replicas, placed by the rule of FinalizePlan: what FinalizeHolders computes
// for them before it lays pieces, handed over by a caller that has computed it already (moonep's
// cross-check counts local rows with it). Replicas of experts[i] are [begin[i], begin[i + 1]), by
// increasing rank. The vectors are buffers: only their first num (+ 1) or begin[num] entries count.
struct ReplicaPlacement {
  int32_t num = 0;                          // replicated experts
  std::vector<int32_t> experts;             // the replicated experts, increasing
  std::vector<int32_t> begin;               // [num + 1]
  std::vector<int64_t> home_col, home_own;  // per experts[i] with home h: col(e, h), counts[h][e]
  std::vector<int32_t> rank;                // per replica: its rank d
  std::vector<int64_t> slot;                // d * slots + its slot index
  std::vector<int64_t> amount;              // its tokens (slot_alloc)
  std::vector<int64_t> col, own;            // col(e, d) and counts[d][e]
  std::vector<int64_t> start, end;          // its positions [start, end) in e's canonical order
};

// Reusable scratch for FinalizePlan (keeps steady-state planning free of allocation).
struct BuildScratch {
  std::vector<int64_t> src_offsets;      // (R + 1) * E
  std::vector<int32_t> replica_begin;    // FinalizePlan: E + 1, replicas of e by increasing rank;
                                         // FinalizeHolders: per replicated expert (+ 1)
  std::vector<int32_t> replicated;       // FinalizeHolders: the replicated experts, increasing
  std::vector<int32_t> replica_count;    // FinalizeHolders: [E] replicas per expert, zero between calls
  std::vector<int32_t> replica_rank;
  std::vector<int64_t> replica_start, replica_end;
  std::vector<int64_t> replica_col, replica_own;  // FinalizeHolders: col(e, d) and counts[d][e]
  std::vector<int64_t> next_row;         // per (rank, group): next free row while laying pieces
  std::vector<int64_t> home_row;         // FinalizeHolders: [E] first row of each expert's home group
  std::vector<int64_t> column;           // R + 1: prefix sums of one expert's counts over sources
  // Per-block prefix sums of counts over sources (blocks of block_size consecutive ranks, which
  // divides ranks_per_node when set): block_prefix[b * E + e] = sum of counts[s][e] over s < b * B,
  // for b in [0, NB]. FinalizeHolders fills them when block_size is 0; a caller that already
  // passes over counts may fill them (with BlockSize()) to save a pass.
  int32_t block_size = 0;
  std::vector<int64_t> block_prefix;
  // Over every expert e with home h: the sum of counts[h][e] (home_own_sum) and of counts[s][e]
  // over the ranks s of h's node (home_node_sum; = home_own_sum when flat). Valid when home_cols
  // is set (the caller's pass over counts summed them); FinalizeHolders sums them otherwise.
  bool home_cols = false;
  int64_t home_own_sum = 0, home_node_sum = 0;
  // [R] each source's sum of counts, from the same pass, only when the config weighs rows
  // (PlannerConfig::weighs_rows: moonep's estimate of the rows a plan moves reads it).
  std::vector<int64_t> row_sums;
  // Set by a caller whose home map is the default one, home(e) = e / (E/R): FinalizeHolders then
  // reads each rank's home group counts as a slice of home_keep.
  bool contiguous_home = false;
  // Per-rank tables for FinalizeHolders (no division per look-up), rebuilt when the key changes:
  // block_row[x] = (x / B) * E, block_first[x] = x / B * B for x in [0, R]; node_lo/node_hi: offsets
  // of the rank's node range in block_prefix; node_id: its node (the rank when flat).
  int64_t table_key[4] = {-1, -1, -1, -1};  // R, E, B, ranks_per_node
  std::vector<int64_t> block_row, node_lo, node_hi;
  std::vector<int32_t> block_first, node_id;
};

// Source blocks for FinalizeHolders: 8 ranks (a prefix of one expert's column is then the
// nearer block prefix plus or minus at most 4 entries; the counts pass writes one prefix row per
// 8 sources), else 4 when 8 does not divide the node size, else the node size (node ranges must
// be block prefixes). A node size above R is one node of all R ranks, whose range ends at the
// totals row whatever the block: 8 (the node size there once made the block count overflow).
inline int32_t BlockSize(const PlannerConfig& resolved) {
  const int32_t rpn = resolved.ranks_per_node;
  if (rpn <= 0 || rpn % 8 == 0 || rpn > resolved.num_ranks) return 8;
  return rpn % 4 == 0 ? 4 : rpn;
}

// Source blocks of B ranks covering R ranks: ceil(R / B) (R > 0, B > 0), without overflow.
inline int32_t NumBlocks(int32_t R, int32_t B) { return (R - 1) / B + 1; }

// Whether plans of this config may hold replicas on their expert's home rank (Plan::home_replicas):
// test-force-replicas with test_home_replicas at one rank.
inline bool HomeReplicas(const PlannerConfig& resolved) {
  return resolved.policy == Policy::kTestForceReplicas && resolved.test_home_replicas &&
         resolved.num_ranks == 1;
}

// Prepares `plan` for a resolved config: sizes every array and fills home, local_experts and
// home_group; alloc and slot_expert are zeroed / set to -1.
void InitPlan(const PlannerConfig& resolved, Plan* plan);

// Given plan->alloc and plan->slot_expert set by a policy, fills pieces, layouts and stats.
// Placement rule: a replica on rank d takes the positions that start at source d's own tokens of
// the expert and continue with the following sources (so its own tokens need not travel, and the
// next ones come from neighbouring ranks, i.e. the same node first); replicas are laid in
// increasing rank and shifted left when they would run past the end; the home rank keeps the rest.
// Fails with InvalidArgument when the decisions are inconsistent (conservation, slots, capacity).
absl::Status FinalizePlan(const PlannerConfig& resolved, absl::Span<const int64_t> counts,
                          Plan* plan, BuildScratch* scratch);

// FinalizePlan for decisions whose alloc is nonzero only at holders (the home and the ranks whose
// slots hold the expert) and whose slot_alloc matches alloc, as Planner policies produce: the
// same pieces, layouts and stats, without reading all of alloc or writing every source offset
// (only replicated experts' columns of counts are summed). `totals` are the per-expert totals.
// `home_keep` ([E], optional) is alloc[e][home(e)] as the caller wrote it and `home_load` ([R],
// optional) each rank's home load: given, they save strided reads (and the caller vouches that
// slot_alloc equals alloc at every slot, which is then not read back from alloc, and that each
// rank's used slots come first). `placed` (optional, only used with home_keep and home_load):
// the decisions' replicas already placed, as FinalizeHolders would place them; the caller vouches
// for them (the checks of the slots and of conservation that FinalizeHolders makes otherwise are
// not repeated; debug builds of the Planner compare the plan with the one made without them).
absl::Status FinalizeHolders(const PlannerConfig& resolved, absl::Span<const int64_t> counts,
                             absl::Span<const int64_t> totals, Plan* plan, BuildScratch* scratch,
                             const int64_t* home_keep = nullptr, const int64_t* home_load = nullptr,
                             const ReplicaPlacement* placed = nullptr);

// A group's rows in a compute layout: its `rows` rounded up to the padding multiple (the plan's
// group_padded).
inline int64_t PaddedRows(int64_t rows, int64_t multiple) {
  return multiple > 1 ? (rows + multiple - 1) / multiple * multiple : rows;
}

// Node of a rank for stats and topology rules (each rank its own node when ranks_per_node == 0).
inline int32_t NodeOf(const Plan& plan, int32_t rank) {
  return plan.ranks_per_node > 0 ? rank / plan.ranks_per_node : rank;
}

}  // namespace moonep::planner
