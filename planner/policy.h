// Internal interface between the Planner and its policies. A policy reads per-expert totals (and,
// where it needs locality, point look-ups of per-source counts) and writes Decisions: how many
// tokens of each expert stay home and which expert each replica slot computes, with how many
// tokens. Decisions are O(E + R * slots); the dense Plan::alloc is written from them afterwards.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "planner/plan.h"
#include "planner/plan_builder.h"

namespace moonep::planner {

struct Decisions {
  std::vector<int64_t> home_keep;    // [E] tokens of e computed on its home rank
  std::vector<int32_t> slot_expert;  // [R * S] expert of each slot, -1 unused
  std::vector<int64_t> slot_amount;  // [R * S] tokens of that expert computed in the slot
  std::vector<int32_t> slots_used;   // [R] slots filled so far (slots fill in order)

  void Reset(int32_t num_ranks, int32_t num_experts, int32_t slots,
             absl::Span<const int64_t> totals);
  // Adds `amount` tokens of `expert` on `rank` (merging with an existing replica of it there)
  // and takes them from the home's share. Returns false when no slot is free.
  bool Move(int32_t rank, int32_t expert, int64_t amount, int32_t slots);
  // Move for an expert `rank` does not hold yet (asserted in debug builds).
  bool Add(int32_t rank, int32_t expert, int64_t amount, int32_t slots);
  // Slot of `expert` on `rank`, or -1.
  int32_t SlotOf(int32_t rank, int32_t expert, int32_t slots) const;
};

// A max-queue of distinct keys that are only ever lowered (GreedyFill's donors and receivers):
// the keys sorted once, ascending, behind a sentinel 0 (the largest leaves from the end in O(1)),
// and a binary max-heap of the keys lowered since (heap[0] is 0 when it is empty): a key that
// leaves unlowered costs O(1), a lowered one O(log) of the heap's size.
template <typename Key>
struct LoweringQueue {
  Key* sorted;  // [-1, ns): sorted[-1] = 0
  int32_t ns;
  Key* heap;    // [0, nh), or heap[0] = 0 when nh = 0
  int32_t nh = 0;
  // Lays an empty heap and room for n sorted keys over buf (2 * n + 2 keys: sentinel, sorted
  // keys, heap); the caller writes the keys to sorted[0, n) in ascending order. Returns the end.
  Key* Attach(Key* buf, int32_t n) {
    sorted = buf + 1;
    sorted[-1] = 0;
    ns = n;
    heap = sorted + n;
    heap[0] = 0;
    nh = 0;
    return buf + 2 * static_cast<size_t>(n) + 2;
  }
  // The largest key; 0 when the queue is empty.
  Key Top() const { return std::max(sorted[ns - 1], heap[0]); }
  // Replaces the top key `top` by `x`, or drops it when x = 0 (x < top).
  void LowerTop(Key top, Key x) {
    if (top == sorted[ns - 1]) {
      --ns;
      if (x != 0) {  // push x
        int32_t i = nh++;
        for (; i > 0 && heap[(i - 1) / 2] < x; i = (i - 1) / 2) heap[i] = heap[(i - 1) / 2];
        heap[i] = x;
      }
      return;
    }
    if (x == 0) {  // pop: the last key goes down from the root
      x = heap[--nh];
      if (nh == 0) {
        heap[0] = 0;
        return;
      }
    }
    int32_t i = 0;
    for (int32_t c = 1; c < nh; c = 2 * i + 1) {
      if (c + 1 < nh && heap[c + 1] > heap[c]) ++c;
      if (heap[c] < x) break;
      heap[i] = heap[c];
      i = c;
    }
    heap[i] = x;
  }
};

// Everything a policy may read. `counts` is null when only totals are known (Planner::Decide).
struct PolicyInput {
  const PlannerConfig* config = nullptr;  // resolved
  const Plan* plan = nullptr;             // home, local_experts, home_group filled
  absl::Span<const int64_t> totals;       // [E]
  const int64_t* counts = nullptr;        // [R * E] or null
  const int64_t* row_sums = nullptr;      // [R] each source's sum of counts (weighing rows) or null
  int64_t total = 0;
  std::vector<int64_t> home_load;         // [R]
  // counts[src][e], or an even split of the total over sources when counts are unknown.
  int64_t Count(int32_t src, int32_t expert) const;
  // Prefix over sources: sum of Count(s, expert) for s < x (block prefix sums when counts are
  // known: block_prefix[(x / block_size) * E + e] holds the sum before x's block).
  const int64_t* block_prefix = nullptr;
  int32_t block_size = 0;
  int32_t block_shift = -1;  // log2(block_size) when it is a power of two
  int64_t Col(int32_t expert, int32_t x) const;
};

// Reusable scratch of the policies (keeps steady-state planning free of allocation).
struct PolicyScratch {
  std::vector<int64_t> cap, room, excess, load;
  std::vector<int32_t> order, order2, rank_order;
  std::vector<int64_t> remaining;
  struct Room {
    int64_t room;
    int32_t rank;
  };
  std::vector<Room> rooms;
  // moonep: Balancer::Init's rooms, sorted, before any move: the cross-check's GreedyFill starts
  // from the same order (like donor_sorted).
  std::vector<Room> rooms_sorted;
  struct Chunk {
    int64_t amount;
    int32_t expert;
  };
  std::vector<Chunk> chunks;
  std::vector<int64_t> donor_chunk;  // moonep: each donor's current chunk
  // moonep: the donors by chunk, largest first (ties: lower index), their chunks in that order
  // and each donor's position in it.
  std::vector<int32_t> donor_by_chunk, donor_chunk_pos;
  std::vector<int64_t> donor_sorted_chunk;
  std::vector<int64_t> donor_rem;    // moonep: remaining tokens of each donor's sorted experts
  std::vector<int32_t> donor_index;  // moonep: [R] donor index of each rank, -1 if none
  std::vector<int32_t> donor_mark;   // moonep: per donor, FillRoom's stamp
  std::vector<int32_t> donor_node;   // moonep: per donor, its node
  std::vector<int32_t> exact_fit_count;  // moonep: FillRoom's filter of exactly fitting values
  // moonep: each donor's experts by decreasing total (ties: lower id), as Balancer::Init sorted
  // them before any move: the cross-check's GreedyFill starts from the same order.
  std::vector<int32_t> donor_sorted;
  std::vector<int64_t> eplb_sum;    // running sum of totals since the last eplb re-plan
  int64_t eplb_steps_summed = 0;
  int64_t eplb_step = 0;
  std::vector<int32_t> eplb_replica_begin, eplb_replica_rank;  // last eplb placement (CSR by expert)
  std::vector<int32_t> greedy_donor, greedy_receiver;  // moonep-greedy: donors' and receivers' ranks
  std::vector<uint64_t> greedy_keys;            // moonep-greedy: their queues (GreedyFill)
  std::vector<unsigned __int128> greedy_keys_w;  // (wide keys)
  std::vector<int64_t> greedy_rem;  // moonep-greedy: remaining tokens of each donor's sorted experts
  Decisions alt;                   // moonep: the greedy decisions it is compared with
  // LocalRows: each decision set's replicas per expert as lists by increasing rank (list_head
  // [2 * E], all -1 between calls), the touched experts (experts replicated in either set, as
  // bits: touched_bits [ceil(E / 64)], all zero between calls) and each set's placement.
  std::vector<int32_t> list_head, list_next, by_expert_rank;
  std::vector<int64_t> by_expert_amount, by_expert_slot;
  std::vector<int32_t> touched;
  std::vector<uint64_t> touched_bits;
  ReplicaPlacement placed[2];
  // LocalRows' look-up table for col(e, x) (rebuilt when col_key = {R, E, block size} changes):
  // col(e, x) = block_prefix[col_row[x] + e] plus (before x's block's middle) or minus (after
  // it) the counts of the sources [col_lo[x], col_hi[x]) (the nearer block prefix; the range
  // holds x itself when subtracting, so x < col_hi[x] exactly then).
  std::vector<int64_t> col_row;
  std::vector<int32_t> col_lo, col_hi;
  int64_t col_key[3] = {-1, -1, -1};
  // moonep: which placed[k] holds the final decisions' placement, -1 when none (LocalRows did not
  // run for them); the Planner resets it before each MakePlan and hands it to FinalizeHolders.
  int32_t placement = -1;
  // moonep, weighing replicas: each rank's load and its replica transfers (in and out, intra and
  // inter: 4 per rank), each expert's highest holder so far (-1: none; all -1 between uses), the
  // best decisions seen, and the speed weights.
  std::vector<int64_t> weigh_load;
  std::vector<int32_t> weigh_count;
  std::vector<int32_t> weigh_last_holder;
  std::vector<int64_t> weights;
  Decisions weigh_best;
  // Rows in the objective (row costs set): each rank's rows [r * 4]: received intra, inter, sent
  // intra, inter; for the plan with no replica (computed once per plan) and for the plan costed.
  std::vector<int64_t> weigh_rows_base, weigh_rows;
  // ... and each expert's replicas by increasing rank (CSR: begin [E + 1]) with their positions.
  std::vector<int32_t> weigh_rep_begin, weigh_rep_fill, weigh_rep_rank;
  std::vector<int64_t> weigh_rep_start, weigh_rep_end, weigh_rep_col;
  struct WeighInterval {  // levels (a, b] and the transfer costs of their ends' plans
    __int128 a, ta, b, tb;
  };
  std::vector<WeighInterval> weigh_intervals;
};

// Rows computed on their own source rank among the experts replicated in `a` or `b`, for each
// (placement rule of FinalizePlan: a replica on rank d takes the positions starting at source d's
// own tokens; the home keeps the rest). Unreplicated experts contribute the same to both. Leaves
// each set's placement in sc->placed[0] (a) and [1] (b).
void LocalRows(const PolicyInput& in, const Decisions& a, const Decisions& b, PolicyScratch* sc,
               int64_t* local_a, int64_t* local_b);

absl::Status DecideNone(const PolicyInput& in, PolicyScratch* scratch, Decisions* out);
absl::Status DecideMoonEP(const PolicyInput& in, PolicyScratch* scratch, Decisions* out);
absl::Status DecideMoonEPGreedy(const PolicyInput& in, PolicyScratch* scratch, Decisions* out);
absl::Status DecideEplb(const PolicyInput& in, PolicyScratch* scratch, Decisions* out);
absl::Status DecideFasterMoEShadow(const PolicyInput& in, PolicyScratch* scratch, Decisions* out);
absl::Status DecideTestForceReplicas(const PolicyInput& in, PolicyScratch* scratch, Decisions* out);

// The published greedy's moves toward capacities `cap` (resets `dec`); true when all excess moved.
// `presorted`: start from the orders moonep's Balancer::Init leaves in sc for the same
// capacities instead of sorting: sc->donor_sorted (each donor's experts by decreasing total, ties
// to the lower id, donors in increasing rank, epn per donor) and sc->rooms_sorted (the receivers
// by (room, rank) ascending). Each is checked while it is read (a donor group out of order or
// holding another rank's expert; a rank that is no receiver of `cap` with that room, or out of
// order) and sorted anew when it is not that order.
bool GreedyFill(const PolicyInput& in, absl::Span<const int64_t> cap, PolicyScratch* sc,
                Decisions* dec, bool presorted = false);

// The rows a plan moves as moonep's weighing estimates them (docs/planner.md "Rows in the
// objective"), from the plan's decisions (alloc at each home, slot_expert and slot_alloc) and
// `counts` ([R * E]; null: an even split of `totals` over the sources, as Decide assumes): per rank
// [r * 4], rows received inside its node, across nodes, sent inside, across. For tests: the
// search computes the same from its decisions.
void EstimatePlanRows(const PlannerConfig& resolved, const Plan& plan, const int64_t* counts,
                      absl::Span<const int64_t> totals, std::vector<int64_t>* rows);

// Integer speed weights (all 1 without speeds): round(speed / max_speed * 2^20), at least 1.
void SpeedWeights(const PlannerConfig& resolved, std::vector<int64_t>* weights);

}  // namespace moonep::planner
