// Where every routed row goes: pure functions of (plan, counts, routing), no communication.
//
// The sender (a source rank) and the receiver (a destination rank) derive every row offset from
// the same function, ForEachRun, so nothing beyond the counts is exchanged to agree on them:
//   "tokens j0 .. j0+n-1 of source `src` among those that chose expert e (in token order) land at
//    rows row .. row+n-1 of rank `dest`'s compute layout (group g)".
// A run is the intersection of a plan piece of e on `dest` with src's positions
// [src_offset(src, e), src_offset(src, e) + counts[src][e]) in e's canonical order. Runs come in
// increasing row order (groups in order, pieces of a group in increasing position), which is the
// order in which a receiver lists the rows it gets from a source.
#pragma once

#include <climits>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "moonep/core/worker_pool.h"
#include "planner/plan.h"

namespace moonep::transport {

// Entries per rank (num_tokens * top_k) at most: the layouts index entries with int32.
constexpr int64_t kMaxEntries = INT32_MAX;

// Checks routing input of one rank: topk_ids has T*K entries (T*K <= kMaxEntries), each in [-1, E),
// and no expert twice within one token's top-k. Names the first offending (token, k).
absl::Status ValidateRouting(absl::Span<const int32_t> topk_ids, int64_t num_tokens, int32_t top_k,
                             int32_t num_experts);

// Counts of this rank's routing per expert (one per top-k entry); ids must be valid.
void CountRouting(absl::Span<const int32_t> topk_ids, int32_t num_experts, int64_t* counts);

// Checks that a plan fits counts[R*E] well enough for the transport to trust it with memory:
// sizes, home groups that agree with local_experts, slots that hold no expert twice on a rank,
// piece_begin within the piece arrays, pieces that cover each expert's order exactly, destinations
// that hold the expert, piece rows that fill their group back to back, groups inside rank_rows.
// The check is a pure function of (plan, counts), so every rank reaches the same verdict.
absl::Status CheckPlanForTransport(const planner::Plan& plan, absl::Span<const int64_t> counts);

// Calls fn(group, expert, first_j, row, n) for every run of source `src` on rank `dest`, in
// increasing row order. offsets: ComputeSourceOffsets of the counts ((R+1)*E entries). The plan
// must have passed CheckPlanForTransport.
template <typename Fn>
void ForEachRun(const planner::Plan& plan, const int64_t* offsets, int32_t src, int32_t dest,
                Fn&& fn) {
  const int32_t E = plan.num_experts, G = plan.num_groups();
  for (int32_t g = 0; g < G; ++g) {
    const int32_t e = plan.ExpertOfGroup(dest, g);
    if (e < 0) continue;
    const int64_t lo = offsets[static_cast<size_t>(src) * E + e];
    const int64_t hi = offsets[static_cast<size_t>(src + 1) * E + e];
    if (lo == hi) continue;
    // With home-rank replicas (plan.home_replicas) e has two groups on its home rank: each takes
    // the pieces whose rows it holds.
    int64_t row_lo = 0, row_hi = INT64_MAX;
    if (plan.home_replicas) {
      const size_t i = static_cast<size_t>(dest) * G + g;
      row_lo = plan.group_offset[i];
      row_hi = row_lo + plan.group_padded[i];
    }
    for (int32_t p = plan.piece_begin[e]; p < plan.piece_begin[e + 1]; ++p) {
      if (plan.piece_dest[p] != dest) continue;
      if (plan.piece_row[p] < row_lo || plan.piece_row[p] >= row_hi) continue;
      const int64_t start = plan.piece_start[p];
      const int64_t a = start > lo ? start : lo;
      const int64_t end = start + plan.piece_count[p];
      const int64_t b = end < hi ? end : hi;
      if (a < b) fn(g, e, a - lo, plan.piece_row[p] + (a - start), b - a);
    }
  }
}

// One rank as a sender. Entries are top-k slots, entry = t * K + k.
struct SendLayout {
  int32_t num_ranks = 0;
  int64_t num_tokens = 0;
  int32_t top_k = 0;
  std::vector<int32_t> dest_rank;     // [T*K] rank computing the entry, -1 when id is -1
  std::vector<int64_t> dest_row;      // [T*K] row in that rank's compute layout, -1 when none
  // Entries per destination, in increasing destination row (the receiver's order).
  std::vector<int64_t> entry_begin;   // [R+1]
  std::vector<int32_t> entries;
  std::vector<int32_t> entry_unique;  // per entry above: its token's index in unique_tokens of d
  // Dedup: distinct tokens per destination, increasing token index; one row each on the wire.
  std::vector<int64_t> unique_begin;  // [R+1]
  std::vector<int32_t> unique_tokens;

  // Scratch kept for reuse (steady state does not allocate).
  struct Run {  // a run of ForEachRun: entries j0 .. j0+count-1 (in token order) of `expert`
    int64_t j0, count, row, pos;  // row on `dest`; pos: where its entries start in `entries`
    int32_t dest, expert;
  };
  std::vector<Run> runs, expert_runs;       // in the order of `entries`; per expert by j0
  std::vector<int64_t> expert_run_begin;    // [E+1] into expert_runs
  std::vector<int64_t> expert_cursor;       // [E]
  std::vector<int64_t> chunk_count;         // [chunks][E, padded]
  std::vector<int64_t> chunk_run;           // [chunks][E, padded] into expert_runs
  std::vector<int32_t> entry_unique_index;  // [T*K] within the entry's chunk
  std::vector<int32_t> entry_pos;           // [T*K] place in `entries`
  std::vector<int64_t> dedup_last_token;    // [chunks][R+1, padded] (slot 0: no destination)
  std::vector<int32_t> dedup_last_index, dedup_count;

  int64_t rows_to(int32_t d) const { return entry_begin[d + 1] - entry_begin[d]; }
  int64_t unique_to(int32_t d) const { return unique_begin[d + 1] - unique_begin[d]; }
};

// The least entries a chunk of BuildSendLayout's passes takes: below, fewer threads than the
// pool has work on it (the fork and join of a phase cost about a microsecond each).
constexpr int64_t kMinEntriesPerChunk = 4096;

// Builds the send layout of rank `src` from its routing. Fails with InvalidArgument when the
// routing does not match counts[src] or the plan does not place every entry. With a pool its
// passes run on the pool's threads, in chunks of whole tokens; the layout is the same, bit for
// bit, for any pool or none.
absl::Status BuildSendLayout(const planner::Plan& plan, absl::Span<const int64_t> offsets,
                             int32_t src, absl::Span<const int32_t> topk_ids, int64_t num_tokens,
                             int32_t top_k, SendLayout* layout, WorkerPool* pool = nullptr);

// One rank as a receiver: the rows each source fills, as runs of consecutive rows.
struct ReceiveLayout {
  int32_t num_ranks = 0;
  int64_t rank_rows = 0;              // rows of this rank's compute layout (with padding)
  std::vector<int64_t> run_begin;     // [R+1] runs of source s: run_begin[s] .. run_begin[s+1]-1
  std::vector<int64_t> run_row;
  std::vector<int64_t> run_count;
  std::vector<int64_t> rows_begin;    // [R+1] prefix sums of rows per source (receive order)

  int64_t rows_from(int32_t s) const { return rows_begin[s + 1] - rows_begin[s]; }
};

void BuildReceiveLayout(const planner::Plan& plan, absl::Span<const int64_t> offsets, int32_t dest,
                        ReceiveLayout* layout);

}  // namespace moonep::transport
