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

// Largest value among n slots (values >= 0, only ever lowered by Set), ties to the lowest index,
// in O(1); Set is O(log n). Each node holds its winner as one key, value * 2^b + (2^b - 1 - index)
// with b bits for the index, so the larger key is the larger value with ties to the lower index,
// and an update is a branch-free max up the path. Keys are 64-bit when the largest value at Build
// leaves room for the index bits (always below 4096 slots: values are at most 2^52), else 128-bit.
struct MaxTree {
  int32_t leaves = 1;
  int32_t index_bits = 0;
  uint32_t mask = 0;  // 2^index_bits - 1: the index bits of a key
  bool wide = false;
  std::vector<uint64_t> tree;             // narrow keys
  std::vector<unsigned __int128> tree_w;  // wide keys
  template <typename Key>
  Key MakeKey(int64_t v, int32_t i) const {
    return (static_cast<Key>(static_cast<uint64_t>(v)) << index_bits) | (mask - static_cast<uint32_t>(i));
  }
  template <typename Key>
  static void BuildKeys(const MaxTree& m, absl::Span<const int64_t> values, std::vector<Key>* tree) {
    const int32_t n = static_cast<int32_t>(values.size());
    tree->assign(2 * static_cast<size_t>(m.leaves), 0);  // 0: the minimum, value 0
    Key* t = tree->data();
    for (int32_t i = 0; i < n; ++i) t[m.leaves + i] = m.MakeKey<Key>(values[i], i);
    for (int32_t v = m.leaves - 1; v >= 1; --v) t[v] = std::max(t[2 * v], t[2 * v + 1]);
  }
  // `max_value` bounds every value Set will ever store (at least the largest of `values`).
  void Build(absl::Span<const int64_t> values, int64_t max_value = 0) {
    const int32_t n = static_cast<int32_t>(values.size());
    leaves = 1;
    index_bits = 0;
    while (leaves < n) {
      leaves *= 2;
      ++index_bits;
    }
    mask = static_cast<uint32_t>((uint64_t{1} << index_bits) - 1);
    int64_t top = max_value;
    for (int64_t v : values) top = std::max(top, v);
    int32_t value_bits = 0;
    while (value_bits < 63 && (top >> value_bits) != 0) ++value_bits;
    wide = value_bits + index_bits > 64;
    if (wide) {
      BuildKeys(*this, values, &tree_w);
    } else {
      BuildKeys(*this, values, &tree);
    }
  }
  template <typename Key>
  void SetKey(Key* t, int32_t i, int64_t v) {
    // The path's winner stays in a register: each level only loads the sibling (independent of
    // the previous level), so the chain is one compare per level, not a store-load round trip.
    // (A 64-bit unsigned index: no sign extension per level.)
    size_t x = static_cast<size_t>(leaves) + static_cast<uint32_t>(i);
    Key cur = MakeKey<Key>(v, i);
    t[x] = cur;
    for (; x > 1; x >>= 1) {
      cur = std::max(cur, t[x ^ 1]);
      t[x >> 1] = cur;
    }
  }
  void Set(int32_t i, int64_t v) {
    if (wide) {
      SetKey(tree_w.data(), i, v);
    } else {
      SetKey(tree.data(), i, v);
    }
  }
  // The winner of tree node `node` (1 = root; leaves at [leaves, 2 * leaves)) and its value;
  // padding has value 0.
  int32_t Winner(int32_t node) const {
    const uint32_t low = wide ? static_cast<uint32_t>(tree_w[node] & mask) : static_cast<uint32_t>(tree[node] & mask);
    return static_cast<int32_t>(mask - low);
  }
  int64_t WinnerValue(int32_t node) const {
    return wide ? static_cast<int64_t>(tree_w[node] >> index_bits) : static_cast<int64_t>(tree[node] >> index_bits);
  }
  // The largest value among all slots but i (0 when there is none).
  int64_t MaxValueExcept(int32_t i) const {
    const size_t leaf = static_cast<size_t>(leaves) + static_cast<uint32_t>(i);
    if (wide) {
      unsigned __int128 k = 0;
      for (size_t x = leaf; x > 1; x >>= 1) k = std::max(k, tree_w[x ^ 1]);
      return static_cast<int64_t>(k >> index_bits);
    }
    uint64_t k = 0;
    for (size_t x = leaf; x > 1; x >>= 1) k = std::max(k, tree[x ^ 1]);
    return static_cast<int64_t>(k >> index_bits);
  }
  // Index of the largest value when it is > 0, else -1.
  int32_t Top() const {
    // (A key holds value 0 exactly when it is at most mask.)
    if (wide) {
      const unsigned __int128 k = tree_w[1];
      return k <= mask ? -1 : static_cast<int32_t>(mask - static_cast<uint32_t>(k & mask));
    }
    const uint64_t k = tree[1];
    return k <= mask ? -1 : static_cast<int32_t>(mask - static_cast<uint32_t>(k & mask));
  }
};

// Everything a policy may read. `counts` is null when only totals are known (Planner::Decide).
struct PolicyInput {
  const PlannerConfig* config = nullptr;  // resolved
  const Plan* plan = nullptr;             // home, local_experts, home_group filled
  absl::Span<const int64_t> totals;       // [E]
  const int64_t* counts = nullptr;        // [R * E] or null
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
// `sorted` (optional): each donor's experts by decreasing total, ties to the lower id, donors in
// increasing rank (epn per donor), as moonep's Balancer::Init leaves them in donor_sorted for
// the same capacities; used instead of sorting when its size matches. When given, the receivers'
// order is taken from sc->rooms_sorted too (Balancer::Init's sorted rooms for the same
// capacities) when its size matches.
bool GreedyFill(const PolicyInput& in, absl::Span<const int64_t> cap, PolicyScratch* sc,
                Decisions* dec, const std::vector<int32_t>* sorted = nullptr);

// Integer speed weights (all 1 without speeds): round(speed / max_speed * 2^20), at least 1.
void SpeedWeights(const PlannerConfig& resolved, std::vector<int64_t>* weights);

}  // namespace moonep::planner
