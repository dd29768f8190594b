// ValidatePlan: an independent check of every Plan invariant (it does not reuse FinalizePlan).
#include <algorithm>

#include "moonep/core/status.h"
#include "planner/planner.h"

namespace moonep::planner {

namespace {
#define PLAN_CHECK(cond, ...)                                                             \
  do {                                                                                    \
    if (!(cond)) return ::moonep::InvalidArgument(__VA_ARGS__);                            \
  } while (0)
}  // namespace

absl::Status ValidatePlan(const Plan& p, absl::Span<const int64_t> counts) {
  // Shape.
  PLAN_CHECK(p.num_ranks > 0 && p.num_experts > 0, "shape: num_ranks %d / num_experts %d not positive",
             p.num_ranks, p.num_experts);
  const int32_t R = p.num_ranks, E = p.num_experts;
  PLAN_CHECK(E % R == 0 && p.experts_per_rank == E / R, "shape: experts_per_rank %d != E/R", p.experts_per_rank);
  PLAN_CHECK(p.slots >= 0 && p.pad_multiple >= 1, "shape: slots %d or pad_multiple %d out of range", p.slots,
             p.pad_multiple);
  const int32_t epn = E / R, S = p.slots, G = epn + S;
  const size_t RE = static_cast<size_t>(R) * E, RS = static_cast<size_t>(R) * S, RG = static_cast<size_t>(R) * G;
  PLAN_CHECK(p.home.size() == static_cast<size_t>(E) && p.home_group.size() == static_cast<size_t>(E) &&
                 p.local_experts.size() == static_cast<size_t>(E) && p.alloc.size() == RE &&
                 p.slot_expert.size() == RS && p.slot_alloc.size() == RS && p.group_offset.size() == RG &&
                 p.group_count.size() == RG && p.group_padded.size() == RG && p.rank_rows.size() == static_cast<size_t>(R) &&
                 p.piece_begin.size() == static_cast<size_t>(E) + 1,
             "shape: an array has the wrong size");
  const size_t P = p.piece_dest.size();
  PLAN_CHECK(p.piece_start.size() == P && p.piece_count.size() == P && p.piece_row.size() == P,
             "shape: piece arrays differ in size");
  PLAN_CHECK(counts.size() == RE, "counts: %d entries, need R*E = %d", counts.size(), RE);
  for (size_t i = 0; i < RE; ++i) PLAN_CHECK(counts[i] >= 0, "counts: entry %d is negative", i);

  // Home map.
  for (int32_t e = 0; e < E; ++e) {
    PLAN_CHECK(p.home[e] >= 0 && p.home[e] < R, "home: expert %d has home %d", e, p.home[e]);
    PLAN_CHECK(p.home_group[e] >= 0 && p.home_group[e] < epn &&
                   p.local_experts[static_cast<size_t>(p.home[e]) * epn + p.home_group[e]] == e,
               "home: expert %d is not at its home group", e);
  }

  // Replica slots: valid expert, not on its home rank (unless the plan says home_replicas: then
  // the slot computes slot_alloc of the alloc[e][home] tokens), no expert twice on a rank.
  std::vector<int64_t> home_slot(E, 0);  // tokens of e in a slot on its own home rank
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < S; ++s) {
      const size_t i = static_cast<size_t>(d) * S + s;
      const int32_t e = p.slot_expert[i];
      PLAN_CHECK(e >= -1 && e < E, "slots: rank %d slot %d holds invalid expert %d", d, s, e);
      if (e < 0) {
        PLAN_CHECK(p.slot_alloc[i] == 0, "slots: unused slot %d of rank %d has %d tokens", s, d, p.slot_alloc[i]);
        continue;
      }
      PLAN_CHECK(p.home_replicas || p.home[e] != d,
                 "no replica on home: rank %d slot %d replicates its own expert %d", d, s, e);
      for (int32_t s2 = 0; s2 < s; ++s2) {
        PLAN_CHECK(p.slot_expert[static_cast<size_t>(d) * S + s2] != e,
                   "no duplicates: expert %d twice on rank %d (slots %d and %d)", e, d, s2, s);
      }
      if (p.home[e] == d) {
        PLAN_CHECK(p.slot_alloc[i] >= 0 && p.slot_alloc[i] <= p.alloc[static_cast<size_t>(e) * R + d],
                   "slots: home-rank slot %d of rank %d computes %d tokens of expert %d, alloc %d", s, d,
                   p.slot_alloc[i], e, p.alloc[static_cast<size_t>(e) * R + d]);
        home_slot[e] = p.slot_alloc[i];
        continue;
      }
      PLAN_CHECK(p.slot_alloc[i] == p.alloc[static_cast<size_t>(e) * R + d],
                 "slots: slot_alloc of rank %d slot %d != alloc[%d][%d]", d, s, e, d);
    }
  }

  // Allocation: holders only, conservation per expert.
  std::vector<int64_t> totals(E, 0);
  for (int32_t src = 0; src < R; ++src) {
    for (int32_t e = 0; e < E; ++e) totals[e] += counts[static_cast<size_t>(src) * E + e];
  }
  for (int32_t e = 0; e < E; ++e) {
    int64_t sum = 0;
    for (int32_t d = 0; d < R; ++d) {
      const int64_t a = p.alloc[static_cast<size_t>(e) * R + d];
      PLAN_CHECK(a >= 0, "alloc: alloc[%d][%d] = %d is negative", e, d, a);
      if (a > 0) {
        PLAN_CHECK(p.GroupOf(d, e) >= 0, "alloc: rank %d computes %d tokens of expert %d but holds no copy", d, a, e);
      }
      sum += a;
    }
    PLAN_CHECK(sum == totals[e], "conservation per expert: expert %d has %d tokens, alloc sums to %d", e,
               totals[e], sum);
  }

  // Layouts: counts match alloc, padding, in bounds, non-overlapping.
  PlanStats expect;
  for (int32_t d = 0; d < R; ++d) {
    int64_t end = 0, load = 0, before = 0;
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (int32_t g = 0; g < G; ++g) {
      const size_t i = static_cast<size_t>(d) * G + g;
      const int32_t e = p.ExpertOfGroup(d, g);
      int64_t want = e < 0 ? 0 : p.alloc[static_cast<size_t>(e) * R + d];
      if (e >= 0 && p.home[e] == d) {  // a home-rank slot splits alloc[e][d] with the home group
        want = g < epn ? want - home_slot[e] : home_slot[e];
      }
      PLAN_CHECK(p.group_count[i] == want, "layout: rank %d group %d has count %d, alloc says %d", d, g,
                 p.group_count[i], want);
      const int64_t n = p.group_count[i], padded = p.group_padded[i];
      PLAN_CHECK(padded >= n && padded % p.pad_multiple == 0 && padded - n < p.pad_multiple,
                 "padding: rank %d group %d pads %d rows to %d (multiple %d)", d, g, n, padded, p.pad_multiple);
      PLAN_CHECK(p.group_offset[i] >= 0 && p.group_offset[i] + padded <= p.rank_rows[d],
                 "layout bounds: rank %d group %d [%d, %d) beyond rank_rows %d", d, g, p.group_offset[i],
                 p.group_offset[i] + padded, p.rank_rows[d]);
      if (padded > 0) spans.push_back({p.group_offset[i], p.group_offset[i] + padded});
      end = std::max(end, p.group_offset[i] + padded);
      load += n;
      if (g < epn) before += totals[e];
    }
    std::sort(spans.begin(), spans.end());
    for (size_t k = 1; k < spans.size(); ++k) {
      PLAN_CHECK(spans[k].first >= spans[k - 1].second, "layout overlap: rank %d groups overlap at row %d", d,
                 spans[k].first);
    }
    PLAN_CHECK(load <= p.rank_rows[d], "capacity: rank %d computes %d rows but holds %d", d, load, p.rank_rows[d]);
    expect.max_load_after = std::max(expect.max_load_after, load);
    expect.max_load_before = std::max(expect.max_load_before, before);
  }

  // Pieces: cover each expert's canonical order exactly, land in consecutive rows of the group.
  std::vector<int64_t> filled(RG, 0);  // rows used so far per (rank, group)
  std::vector<int64_t> per_rank(R, 0);
  for (int32_t e = 0; e < E; ++e) {
    const int32_t b = p.piece_begin[e], f = p.piece_begin[e + 1];
    PLAN_CHECK(b >= 0 && b <= f && static_cast<size_t>(f) <= P && (e > 0 || b == 0) &&
                   (e + 1 < E || static_cast<size_t>(f) == P),
               "pieces: piece_begin of expert %d out of order", e);
    int64_t pos = 0;
    for (int32_t q = b; q < f; ++q) {
      const int32_t d = p.piece_dest[q];
      PLAN_CHECK(d >= 0 && d < R, "pieces: piece %d of expert %d has destination %d", q, e, d);
      PLAN_CHECK(p.piece_count[q] > 0, "pieces: piece %d of expert %d is empty", q, e);
      PLAN_CHECK(p.piece_start[q] == pos,
                 "conservation per (source, expert): expert %d positions [%d, %d) are %s", e,
                 std::min(pos, p.piece_start[q]), std::max(pos, p.piece_start[q]),
                 p.piece_start[q] > pos ? "computed nowhere" : "computed twice");
      int32_t g = p.GroupOf(d, e);
      PLAN_CHECK(g >= 0, "pieces: rank %d computes a piece of expert %d but holds no copy", d, e);
      if (p.home_replicas && d == p.home[e]) {
        // Two groups of e on this rank: the piece belongs to the one whose next row it starts at.
        for (int32_t s = 0; s < S; ++s) {
          const size_t k = static_cast<size_t>(d) * G + epn + s;
          if (p.slot_expert[static_cast<size_t>(d) * S + s] == e &&
              p.piece_row[q] == p.group_offset[k] + filled[k] &&
              filled[k] + p.piece_count[q] <= p.group_count[k]) {
            g = epn + s;
          }
        }
      }
      const size_t i = static_cast<size_t>(d) * G + g;
      PLAN_CHECK(p.piece_row[q] == p.group_offset[i] + filled[i],
                 "pieces: piece %d of expert %d lands at row %d of rank %d, expected %d", q, e, p.piece_row[q], d,
                 p.group_offset[i] + filled[i]);
      filled[i] += p.piece_count[q];
      pos += p.piece_count[q];
    }
    PLAN_CHECK(pos == totals[e],
               "conservation per (source, expert): pieces of expert %d cover %d of %d positions", e, pos,
               totals[e]);
  }
  for (size_t i = 0; i < RG; ++i) {
    PLAN_CHECK(filled[i] == p.group_count[i], "pieces: rank %d group %d gets %d rows from pieces, count %d",
               static_cast<int>(i / G), static_cast<int>(i % G), filled[i], p.group_count[i]);
  }

  // Stats.
  const PlanStats& st = p.stats;
  int64_t total = 0;
  for (int64_t t : totals) total += t;
  int32_t replicas = 0;
  for (int32_t e : p.slot_expert) replicas += e >= 0;
  PLAN_CHECK(st.total_tokens == total, "stats: total_tokens %d != %d", st.total_tokens, total);
  PLAN_CHECK(st.replicas == replicas, "stats: replicas %d != %d", st.replicas, replicas);
  PLAN_CHECK(st.max_load_after == expect.max_load_after, "stats: max_load_after %d != %d", st.max_load_after,
             expect.max_load_after);
  PLAN_CHECK(st.max_load_before == expect.max_load_before, "stats: max_load_before %d != %d",
             st.max_load_before, expect.max_load_before);
  PLAN_CHECK(st.rows_local + st.rows_travel_intra + st.rows_travel_inter == total,
             "stats: local + travelling rows %d != total %d",
             st.rows_local + st.rows_travel_intra + st.rows_travel_inter, total);
  PLAN_CHECK(st.prefetch_intra + st.prefetch_inter == replicas, "stats: prefetches %d != replicas %d",
             st.prefetch_intra + st.prefetch_inter, replicas);
  return absl::OkStatus();
}

}  // namespace moonep::planner
