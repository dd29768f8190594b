#include "transport/layout.h"

#include <algorithm>

#include "moonep/core/status.h"
#include "planner/plan_builder.h"

namespace moonep::transport {

absl::Status ValidateRouting(absl::Span<const int32_t> topk_ids, int64_t num_tokens, int32_t top_k,
                             int32_t num_experts) {
  MOONEP_CHECK_ARG(num_tokens >= 0, "num_tokens must be >= 0, got %d", num_tokens);
  MOONEP_CHECK_ARG(top_k >= 1, "top_k must be >= 1, got %d", top_k);
  MOONEP_CHECK_ARG(num_experts >= 1, "num_experts must be >= 1, got %d", num_experts);
  MOONEP_CHECK_ARG(num_tokens <= kMaxEntries / top_k,
                   "num_tokens * top_k = %d * %d is above %d, the most entries a rank can route",
                   num_tokens, top_k, kMaxEntries);
  const int64_t n = num_tokens * top_k;
  MOONEP_CHECK_ARG(static_cast<int64_t>(topk_ids.size()) == n,
                   "topk_ids has %d entries, need num_tokens * top_k = %d * %d", topk_ids.size(),
                   num_tokens, top_k);
  MOONEP_CHECK_ARG(n == 0 || topk_ids.data() != nullptr, "topk_ids is null");
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* ids = topk_ids.data() + t * top_k;
    for (int32_t k = 0; k < top_k; ++k) {
      const int32_t e = ids[k];
      if (e < -1 || e >= num_experts) {
        return InvalidArgument("topk_ids[%d][%d] = %d is not an expert id in [-1, %d)", t, k, e,
                               num_experts);
      }
      if (e < 0) continue;
      for (int32_t j = 0; j < k; ++j) {
        if (ids[j] == e) {
          return InvalidArgument("topk_ids[%d] names expert %d twice (k = %d and %d)", t, e, j, k);
        }
      }
    }
  }
  return absl::OkStatus();
}

void CountRouting(absl::Span<const int32_t> topk_ids, int32_t num_experts, int64_t* counts) {
  std::fill(counts, counts + num_experts, 0);
  for (int32_t e : topk_ids) {
    if (e >= 0) ++counts[e];
  }
}

absl::Status CheckPlanForTransport(const planner::Plan& plan, absl::Span<const int64_t> counts) {
  const int32_t R = plan.num_ranks, E = plan.num_experts;
  MOONEP_CHECK_ARG(R >= 1 && E >= 1, "plan: num_ranks (%d) and num_experts (%d) must be positive",
                   R, E);
  MOONEP_CHECK_ARG(plan.experts_per_rank >= 0 && plan.slots >= 0 &&
                       static_cast<int64_t>(plan.experts_per_rank) * R == E,
                   "plan: experts_per_rank (%d) * num_ranks (%d) != num_experts (%d)",
                   plan.experts_per_rank, R, E);
  MOONEP_CHECK_ARG(static_cast<int64_t>(counts.size()) == static_cast<int64_t>(R) * E,
                   "counts has %d entries, plan needs R*E = %d", counts.size(),
                   static_cast<int64_t>(R) * E);
  const int32_t G = plan.num_groups();
  const size_t RG = static_cast<size_t>(R) * G;
  MOONEP_CHECK_ARG(plan.home.size() == static_cast<size_t>(E) &&
                       plan.home_group.size() == static_cast<size_t>(E) &&
                       plan.local_experts.size() == static_cast<size_t>(E) &&
                       plan.slot_expert.size() == static_cast<size_t>(R) * plan.slots &&
                       plan.group_offset.size() == RG && plan.group_count.size() == RG &&
                       plan.group_padded.size() == RG &&
                       plan.rank_rows.size() == static_cast<size_t>(R) &&
                       plan.piece_begin.size() == static_cast<size_t>(E) + 1,
                   "plan: array sizes do not match R = %d, E = %d, slots = %d", R, E, plan.slots);
  const size_t P = plan.piece_dest.size();
  MOONEP_CHECK_ARG(plan.piece_start.size() == P && plan.piece_count.size() == P &&
                       plan.piece_row.size() == P && plan.piece_begin[0] == 0 &&
                       static_cast<size_t>(plan.piece_begin[E]) == P,
                   "plan: piece arrays are inconsistent");
  for (int32_t e = 0; e < E; ++e) {
    MOONEP_CHECK_ARG(plan.home[e] >= 0 && plan.home[e] < R, "plan: home[%d] = %d is not a rank", e,
                     plan.home[e]);
  }
  for (int32_t i = 0; i < R * plan.slots; ++i) {
    MOONEP_CHECK_ARG(plan.slot_expert[i] >= -1 && plan.slot_expert[i] < E,
                     "plan: slot_expert[%d] = %d is not an expert", i, plan.slot_expert[i]);
  }
  for (int32_t i = 0; i < E; ++i) {
    MOONEP_CHECK_ARG(plan.local_experts[i] >= 0 && plan.local_experts[i] < E,
                     "plan: local_experts[%d] = %d is not an expert", i, plan.local_experts[i]);
  }
  // The groups this check fills (GroupOf: home_group, then slots) must be the groups ForEachRun
  // reads (ExpertOfGroup: local_experts, then slots), or rows checked against one group land in
  // another: each expert's home group computes it, ...
  const int32_t epn = plan.experts_per_rank;
  for (int32_t e = 0; e < E; ++e) {
    MOONEP_CHECK_ARG(plan.home_group[e] >= 0 && plan.home_group[e] < epn,
                     "plan: home_group[%d] = %d is not a home group (experts_per_rank = %d)", e,
                     plan.home_group[e], epn);
    const size_t at = static_cast<size_t>(plan.home[e]) * epn + plan.home_group[e];
    MOONEP_CHECK_ARG(plan.local_experts[at] == e,
                     "plan: expert %d is home group %d of rank %d, but local_experts[%d] = %d", e,
                     plan.home_group[e], plan.home[e], at, plan.local_experts[at]);
  }
  // ... and each used slot is its expert's only group on its rank (no expert twice on a rank, no
  // replica on the expert's home rank unless the plan has home_replicas, whose pieces pick their
  // group by row).
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < plan.slots; ++s) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * plan.slots + s];
      if (e < 0 || (plan.home_replicas && plan.home[e] == d)) continue;
      const int32_t g = plan.GroupOf(d, e);
      MOONEP_CHECK_ARG(g == epn + s,
                       "plan: slot %d of rank %d holds expert %d, which rank %d computes in group "
                       "%d already", s, d, e, d, g);
    }
  }
  // Every expert's pieces inside the piece arrays, before any piece is read.
  for (int32_t e = 0; e < E; ++e) {
    MOONEP_CHECK_ARG(plan.piece_begin[e + 1] >= plan.piece_begin[e] &&
                         static_cast<size_t>(plan.piece_begin[e + 1]) <= P,
                     "plan: piece_begin[%d] = %d is not in [piece_begin[%d] = %d, %d pieces]",
                     e + 1, plan.piece_begin[e + 1], e, plan.piece_begin[e], P);
  }
  // Groups back to back inside rank_rows.
  for (int32_t d = 0; d < R; ++d) {
    int64_t row = 0;
    for (int32_t g = 0; g < G; ++g) {
      const size_t i = static_cast<size_t>(d) * G + g;
      MOONEP_CHECK_ARG(plan.group_offset[i] >= row && plan.group_count[i] >= 0 &&
                           plan.group_padded[i] >= plan.group_count[i] &&
                           plan.group_padded[i] <= INT64_MAX - plan.group_offset[i],
                       "plan: group %d of rank %d overlaps the previous one or has bad sizes", g, d);
      row = plan.group_offset[i] + plan.group_padded[i];
    }
    MOONEP_CHECK_ARG(row <= plan.rank_rows[d], "plan: rank %d's groups end at row %d > rank_rows %d",
                     d, row, plan.rank_rows[d]);
  }
  // Pieces: cover [0, total_e) in order; rows of each (rank, group) filled back to back.
  std::vector<int64_t> filled(RG, 0);
  for (int32_t e = 0; e < E; ++e) {
    int64_t total = 0;
    for (int32_t s = 0; s < R; ++s) {
      const int64_t c = counts[static_cast<size_t>(s) * E + e];
      MOONEP_CHECK_ARG(c >= 0, "counts[%d][%d] = %d is negative", s, e, c);
      total += c;
    }
    int64_t pos = 0;
    for (int32_t p = plan.piece_begin[e]; p < plan.piece_begin[e + 1]; ++p) {
      const int32_t d = plan.piece_dest[p];
      MOONEP_CHECK_ARG(d >= 0 && d < R, "plan: piece %d of expert %d goes to rank %d", p, e, d);
      MOONEP_CHECK_ARG(plan.piece_start[p] == pos && plan.piece_count[p] > 0,
                       "plan: pieces of expert %d do not cover its order contiguously (piece %d)",
                       e, p);
      int32_t g = plan.GroupOf(d, e);
      MOONEP_CHECK_ARG(g >= 0, "plan: piece %d sends expert %d to rank %d, which does not hold it",
                       p, e, d);
      if (plan.home_replicas && d == plan.home[e]) {
        // A home-rank replica: e has a slot group on its home rank too; the piece belongs to the
        // group whose rows hold its first row.
        for (int32_t s = 0; s < plan.slots; ++s) {
          const size_t j = static_cast<size_t>(d) * G + plan.experts_per_rank + s;
          if (plan.slot_expert[static_cast<size_t>(d) * plan.slots + s] == e &&
              plan.piece_row[p] >= plan.group_offset[j] &&
              plan.piece_row[p] < plan.group_offset[j] + plan.group_padded[j]) {
            g = plan.experts_per_rank + s;
          }
        }
      }
      const size_t i = static_cast<size_t>(d) * G + g;
      MOONEP_CHECK_ARG(plan.piece_row[p] == plan.group_offset[i] + filled[i] &&
                           plan.piece_count[p] <= plan.group_count[i] - filled[i],
                       "plan: piece %d of expert %d does not fill group %d of rank %d in order", p,
                       e, g, d);
      filled[i] += plan.piece_count[p];
      pos += plan.piece_count[p];
    }
    MOONEP_CHECK_ARG(pos == total, "plan: pieces of expert %d cover %d positions, it has %d tokens",
                     e, pos, total);
  }
  for (size_t i = 0; i < RG; ++i) {
    MOONEP_CHECK_ARG(filled[i] == plan.group_count[i],
                     "plan: group %d of rank %d has %d rows but its pieces fill %d", i % G, i / G,
                     plan.group_count[i], filled[i]);
  }
  return absl::OkStatus();
}

absl::Status BuildSendLayout(const planner::Plan& plan, absl::Span<const int64_t> offsets,
                             int32_t src, absl::Span<const int32_t> topk_ids, int64_t num_tokens,
                             int32_t top_k, SendLayout* out) {
  const int32_t R = plan.num_ranks, E = plan.num_experts;
  const int64_t n = num_tokens * top_k;
  MOONEP_CHECK_ARG(src >= 0 && src < R, "source rank %d is not in [0, %d)", src, R);
  MOONEP_CHECK_ARG(offsets.size() == (static_cast<size_t>(R) + 1) * E,
                   "offsets has %d entries, need (R+1)*E", offsets.size());
  MOONEP_CHECK_ARG(static_cast<int64_t>(topk_ids.size()) == n, "topk_ids has %d entries, need %d",
                   topk_ids.size(), n);
  out->num_ranks = R;
  out->num_tokens = num_tokens;
  out->top_k = top_k;

  // Entries of each expert in token order: the j-th is at position offsets[src][e] + j.
  out->bucket_begin.assign(static_cast<size_t>(E) + 1, 0);
  for (int32_t e : topk_ids) {
    if (e >= 0) ++out->bucket_begin[e + 1];
  }
  for (int32_t e = 0; e < E; ++e) {
    const int64_t want = offsets[static_cast<size_t>(src + 1) * E + e] -
                         offsets[static_cast<size_t>(src) * E + e];
    MOONEP_CHECK_ARG(out->bucket_begin[e + 1] == want,
                     "routing of rank %d has %d entries of expert %d but the counts say %d", src,
                     out->bucket_begin[e + 1], e, want);
    out->bucket_begin[e + 1] += out->bucket_begin[e];
  }
  out->bucket_entries.resize(static_cast<size_t>(out->bucket_begin[E]));
  {
    // Fill with a cursor per expert; restore bucket_begin afterwards.
    std::vector<int64_t>& cursor = out->bucket_begin;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t e = topk_ids[i];
      if (e >= 0) out->bucket_entries[cursor[e]++] = static_cast<int32_t>(i);
    }
    for (int32_t e = E; e > 0; --e) cursor[e] = cursor[e - 1];
    cursor[0] = 0;
  }

  // -1 first: an entry that a faulty plan leaves unplaced must not keep an old destination.
  const int64_t routed = out->bucket_begin[E];
  out->dest_rank.assign(static_cast<size_t>(n), -1);
  out->dest_row.assign(static_cast<size_t>(n), -1);
  out->entry_begin.resize(static_cast<size_t>(R) + 1);
  out->entries.resize(static_cast<size_t>(routed));
  int32_t* entries = out->entries.data();
  int32_t* dest_rank = out->dest_rank.data();
  int64_t* dest_row = out->dest_row.data();
  int64_t placed = 0;  // passes `routed` only for a faulty plan, which is refused below
  for (int32_t d = 0; d < R; ++d) {
    out->entry_begin[d] = placed;
    ForEachRun(plan, offsets.data(), src, d,
               [&](int32_t, int32_t e, int64_t j0, int64_t row, int64_t cnt) {
                 const int32_t* bucket = out->bucket_entries.data() + out->bucket_begin[e] + j0;
                 if (cnt > routed - placed) {  // more entries than there are: write none
                   placed += cnt;
                   return;
                 }
                 for (int64_t i = 0; i < cnt; ++i) {
                   dest_rank[bucket[i]] = d;
                   dest_row[bucket[i]] = row + i;
                   entries[placed + i] = bucket[i];
                 }
                 placed += cnt;
               });
  }
  out->entry_begin[R] = placed;
  MOONEP_CHECK_ARG(placed == routed, "plan places %d of rank %d's %d routed entries", placed, src,
                   routed);

  // Dedup: one row per (token, destination). Tokens are visited in increasing order, so each
  // destination's unique list comes out sorted. One pass gives every entry its index among its
  // destination's unique rows: per destination, the last token seen and the index it got, so a
  // second entry of the same token reuses it (no scan over the token's earlier entries, and no
  // branch on the data: the scan's mispredictions made it the layout's costliest loop).
  // Slot 0 of the per-destination arrays takes the entries without a destination.
  out->unique_begin.assign(static_cast<size_t>(R) + 1, 0);
  out->entry_unique_index.resize(static_cast<size_t>(n));
  std::vector<int64_t>& last_token = out->dedup_last_token;
  std::vector<int32_t>& last_index = out->dedup_last_index;
  std::vector<int32_t>& unique_count = out->dedup_count;
  last_token.assign(static_cast<size_t>(R) + 1, -1);
  last_index.assign(static_cast<size_t>(R) + 1, 0);
  unique_count.assign(static_cast<size_t>(R) + 1, 0);
  const int32_t* dest = out->dest_rank.data();
  int32_t* uidx = out->entry_unique_index.data();
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int32_t k = 0; k < top_k; ++k) {
      const int64_t i = t * top_k + k;
      const size_t d = static_cast<size_t>(dest[i] + 1);
      const bool dup = last_token[d] == t;
      const int32_t u = dup ? last_index[d] : unique_count[d];
      unique_count[d] += dup ? 0 : 1;
      last_index[d] = u;
      last_token[d] = t;
      uidx[i] = d == 0 ? -1 : u;
    }
  }
  for (int32_t d = 0; d < R; ++d) out->unique_begin[d + 1] = out->unique_begin[d] + unique_count[d + 1];
  out->unique_tokens.resize(static_cast<size_t>(out->unique_begin[R]));
  // Each destination's unique tokens, in token order: every entry writes its token at its unique
  // index (a token's entries to one destination all write the same slot with the same value).
  {
    const int64_t* begin = out->unique_begin.data();
    int32_t* tokens = out->unique_tokens.data();
    for (int64_t t = 0, i = 0; t < num_tokens; ++t) {
      for (int32_t k = 0; k < top_k; ++k, ++i) {
        if (dest[i] >= 0) tokens[begin[dest[i]] + uidx[i]] = static_cast<int32_t>(t);
      }
    }
  }
  out->entry_unique.resize(out->entries.size());
  for (size_t i = 0; i < out->entries.size(); ++i) {
    out->entry_unique[i] = out->entry_unique_index[out->entries[i]];
  }
  return absl::OkStatus();
}

void BuildReceiveLayout(const planner::Plan& plan, absl::Span<const int64_t> offsets, int32_t dest,
                        ReceiveLayout* out) {
  const int32_t R = plan.num_ranks;
  out->num_ranks = R;
  out->rank_rows = plan.rank_rows[dest];
  out->run_begin.resize(static_cast<size_t>(R) + 1);
  out->rows_begin.resize(static_cast<size_t>(R) + 1);
  out->run_row.clear();
  out->run_count.clear();
  int64_t rows = 0;
  for (int32_t s = 0; s < R; ++s) {
    out->run_begin[s] = static_cast<int64_t>(out->run_row.size());
    out->rows_begin[s] = rows;
    ForEachRun(plan, offsets.data(), s, dest,
               [&](int32_t, int32_t, int64_t, int64_t row, int64_t cnt) {
                 out->run_row.push_back(row);
                 out->run_count.push_back(cnt);
                 rows += cnt;
               });
  }
  out->run_begin[R] = static_cast<int64_t>(out->run_row.size());
  out->rows_begin[R] = rows;
}

}  // namespace moonep::transport
