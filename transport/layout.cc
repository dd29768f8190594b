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
                             int32_t top_k, SendLayout* out, WorkerPool* pool) {
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

  // The passes over the entries run on P chunks of whole tokens (one per thread of `pool`; one
  // below kMinEntriesPerChunk entries a chunk). Per-chunk counts and a prefix over the chunks
  // between passes make every result the one a single pass in token order gives.
  const int64_t threads = pool != nullptr ? pool->size() : 1;
  const int64_t P = std::max<int64_t>(1, std::min(threads, n / kMinEntriesPerChunk));
  auto token_begin = [&](int64_t c) { return num_tokens * c / P; };
  auto run = [&](auto&& fn) {
    if (P == 1) {
      fn(int64_t{0});
    } else {
      pool->Run(P, [&fn](int64_t c, int) { fn(c); });
    }
  };
  const int32_t* ids = topk_ids.data();

  // Pass 1, per chunk: entries per expert.
  // Per-chunk arrays are kChunkPad elements (at least 64 bytes) apart, so that no cache line holds
  // two chunks' counters: shared lines made the dedup pass 3x slower on two threads.
  constexpr int64_t kChunkPad = 16;
  auto padded = [](int64_t v) { return (v + 2 * kChunkPad - 1) / kChunkPad * kChunkPad; };
  const int64_t count_stride = padded(E);
  out->chunk_count.resize(static_cast<size_t>(P * count_stride));
  int64_t* chunk_count = out->chunk_count.data();
  run([&](int64_t c) {
    int64_t* count = chunk_count + c * count_stride;
    std::fill(count, count + E, 0);
    const int64_t lo = token_begin(c) * top_k, hi = token_begin(c + 1) * top_k;
    for (int64_t i = lo; i < hi; ++i) {
      const int32_t e = ids[i];
      if (e >= 0) ++count[e];
    }
  });
  // An expert's entries in token order: the j-th is at position offsets[src][e] + j. Each chunk's
  // count becomes the j of its first entry of the expert.
  int64_t routed = 0;
  for (int32_t e = 0; e < E; ++e) {
    int64_t have = 0;
    for (int64_t c = 0; c < P; ++c) {
      int64_t& v = chunk_count[c * count_stride + e];
      const int64_t cnt = v;
      v = have;
      have += cnt;
    }
    const int64_t want = offsets[static_cast<size_t>(src + 1) * E + e] -
                         offsets[static_cast<size_t>(src) * E + e];
    MOONEP_CHECK_ARG(have == want,
                     "routing of rank %d has %d entries of expert %d but the counts say %d", src,
                     have, e, want);
    routed += have;
  }

  // This rank's runs, destinations in order and each destination's runs in row order: the order
  // of the entries' list, so a run's entries start at its `pos` there. Then the runs again per
  // expert in order of j, which must cover each expert's [0, count) exactly.
  std::vector<SendLayout::Run>& runs = out->runs;
  runs.clear();
  out->entry_begin.resize(static_cast<size_t>(R) + 1);
  int64_t placed = 0;
  for (int32_t d = 0; d < R; ++d) {
    out->entry_begin[d] = placed;
    ForEachRun(plan, offsets.data(), src, d,
               [&](int32_t, int32_t e, int64_t j0, int64_t row, int64_t cnt) {
                 runs.push_back(SendLayout::Run{j0, cnt, row, placed, d, e});
                 placed += cnt;
               });
  }
  out->entry_begin[R] = placed;
  MOONEP_CHECK_ARG(placed == routed, "plan places %d of rank %d's %d routed entries", placed, src,
                   routed);
  std::vector<int64_t>& run_begin = out->expert_run_begin;
  run_begin.assign(static_cast<size_t>(E) + 1, 0);
  for (const SendLayout::Run& r : runs) ++run_begin[r.expert + 1];
  for (int32_t e = 0; e < E; ++e) run_begin[e + 1] += run_begin[e];
  std::vector<SendLayout::Run>& by_expert = out->expert_runs;
  by_expert.resize(runs.size());
  {
    std::vector<int64_t>& cursor = out->expert_cursor;
    cursor.assign(run_begin.begin(), run_begin.end() - 1);
    for (const SendLayout::Run& r : runs) by_expert[cursor[r.expert]++] = r;
  }
  for (int32_t e = 0; e < E; ++e) {
    SendLayout::Run* first = by_expert.data() + run_begin[e];
    SendLayout::Run* last = by_expert.data() + run_begin[e + 1];
    std::sort(first, last,
              [](const SendLayout::Run& a, const SendLayout::Run& b) { return a.j0 < b.j0; });
    int64_t covered = 0;
    for (const SendLayout::Run* r = first; r != last; ++r) {
      MOONEP_CHECK_ARG(r->j0 == covered,
                       "plan: the runs of expert %d from rank %d do not cover its entries once "
                       "(one starts at %d, %d are covered before it)",
                       e, src, r->j0, covered);
      covered += r->count;
    }
    const int64_t want = offsets[static_cast<size_t>(src + 1) * E + e] -
                         offsets[static_cast<size_t>(src) * E + e];
    MOONEP_CHECK_ARG(covered == want,
                     "plan: the runs of expert %d from rank %d cover %d of its %d entries", e, src,
                     covered, want);
  }

  out->entries.resize(static_cast<size_t>(routed));
  out->entry_unique.resize(static_cast<size_t>(routed));
  int32_t* entries = out->entries.data();
  int32_t* entry_unique = out->entry_unique.data();

  // Pass 2, per chunk, in token order: each entry's j (the chunk's cursor of its expert), its run,
  // destination and row, and its place in the entries' list. An entry without an expert gets
  // none (-1), so no old destination survives in a reused layout. A chunk's entries of a run are a
  // contiguous part of the run's entries (chunks hold consecutive tokens).
  out->dest_rank.resize(static_cast<size_t>(n));
  out->dest_row.resize(static_cast<size_t>(n));
  int32_t* dest_rank = out->dest_rank.data();
  int64_t* dest_row = out->dest_row.data();
  out->entry_pos.resize(static_cast<size_t>(n));
  int32_t* entry_pos = out->entry_pos.data();
  const SendLayout::Run* expert_runs = by_expert.data();
  const int64_t* expert_begin = run_begin.data();
  out->chunk_run.resize(static_cast<size_t>(P * count_stride));
  run([&](int64_t c) {
    int64_t* cursor = chunk_count + c * count_stride;
    // The run of each expert that holds the chunk's next entry: j only grows within a chunk, so
    // an expert split into many runs costs a step per run, not a search per entry.
    int64_t* at_run = out->chunk_run.data() + c * count_stride;
    for (int32_t e = 0; e < E; ++e) {
      int64_t q = expert_begin[e];
      while (q + 1 < expert_begin[e + 1] &&
             cursor[e] >= expert_runs[q].j0 + expert_runs[q].count) {
        ++q;
      }
      at_run[e] = q;
    }
    const int64_t lo = token_begin(c) * top_k, hi = token_begin(c + 1) * top_k;
    for (int64_t i = lo; i < hi; ++i) {
      const int32_t e = ids[i];
      if (e < 0) {
        dest_rank[i] = -1;
        dest_row[i] = -1;
        continue;
      }
      const int64_t j = cursor[e]++;
      const SendLayout::Run* r = expert_runs + at_run[e];
      if (j >= r->j0 + r->count) {  // the runs cover [0, count): no step for most experts
        do {
          ++r;
        } while (j >= r->j0 + r->count);
        at_run[e] = r - expert_runs;
      }
      const int64_t at = r->pos + (j - r->j0);
      dest_rank[i] = r->dest;
      dest_row[i] = r->row + (j - r->j0);
      entries[at] = static_cast<int32_t>(i);
      entry_pos[i] = static_cast<int32_t>(at);
    }
  });

  // Pass 3, per chunk, the dedup: one row per (token, destination). Tokens are visited in
  // increasing order, so each
  // destination's unique list comes out sorted. One pass gives every entry its index among its
  // destination's unique rows (within its chunk): per destination, the last token seen and the
  // index it got, so a second entry of the same token reuses it (no scan over the token's earlier
  // entries, and no branch on the data: the scan's mispredictions made it the layout's costliest
  // loop). Slot 0 of the per-destination arrays takes the entries without a destination.
  const int64_t slots = R + 1, stride = padded(slots);  // per-chunk arrays on their own lines
  out->entry_unique_index.resize(static_cast<size_t>(n));
  out->dedup_last_token.resize(static_cast<size_t>(P * stride));
  out->dedup_last_index.resize(static_cast<size_t>(P * stride));
  out->dedup_count.resize(static_cast<size_t>(P * stride));
  int32_t* uidx = out->entry_unique_index.data();
  run([&](int64_t c) {
    int64_t* last_token = out->dedup_last_token.data() + c * stride;
    int32_t* last_index = out->dedup_last_index.data() + c * stride;
    int32_t* unique_count = out->dedup_count.data() + c * stride;
    std::fill(last_token, last_token + slots, -1);
    std::fill(last_index, last_index + slots, 0);
    std::fill(unique_count, unique_count + slots, 0);
    for (int64_t t = token_begin(c); t < token_begin(c + 1); ++t) {
      for (int32_t k = 0; k < top_k; ++k) {
        const int64_t i = t * top_k + k;
        const size_t d = static_cast<size_t>(dest_rank[i] + 1);
        const bool dup = last_token[d] == t;
        const int32_t u = dup ? last_index[d] : unique_count[d];
        unique_count[d] += dup ? 0 : 1;
        last_index[d] = u;
        last_token[d] = t;
        uidx[i] = u;
      }
    }
  });
  // Each chunk's count per destination becomes the index of its first unique row there.
  out->unique_begin.resize(static_cast<size_t>(R) + 1);
  out->unique_begin[0] = 0;
  for (int32_t d = 0; d < R; ++d) {
    int64_t have = 0;
    for (int64_t c = 0; c < P; ++c) {
      int32_t& v = out->dedup_count[c * stride + d + 1];
      const int32_t cnt = v;
      v = static_cast<int32_t>(have);
      have += cnt;
    }
    out->unique_begin[d + 1] = out->unique_begin[d] + have;
  }
  out->unique_tokens.resize(static_cast<size_t>(out->unique_begin[R]));
  // Pass 4, per chunk: the entries' indices made global, each destination's unique tokens in
  // token order (a token's entries to one destination all write the same slot with the same
  // value), and each entry's index at its place in the list. A chunk writes its own contiguous
  // part of each destination's tokens and of each run's entries, as in pass 2.
  run([&](int64_t c) {
    const int32_t* base = out->dedup_count.data() + c * stride;
    const int64_t* begin = out->unique_begin.data();
    int32_t* tokens = out->unique_tokens.data();
    for (int64_t t = token_begin(c); t < token_begin(c + 1); ++t) {
      for (int32_t k = 0; k < top_k; ++k) {
        const int64_t i = t * top_k + k;
        const int32_t d = dest_rank[i];
        if (d < 0) continue;
        const int32_t u = base[d + 1] + uidx[i];
        tokens[begin[d] + u] = static_cast<int32_t>(t);
        entry_unique[entry_pos[i]] = u;
      }
    }
  });
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
