#include "planner/plan_builder.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cmath>

#include "absl/base/attributes.h"
#include "moonep/core/status.h"

namespace moonep::planner {

absl::Status ResolveConfig(const PlannerConfig& in, PlannerConfig* out) {
  *out = in;
  MOONEP_CHECK_ARG(in.num_ranks > 0, "num_ranks must be positive, got %d", in.num_ranks);
  MOONEP_CHECK_ARG(in.num_experts > 0, "num_experts must be positive, got %d", in.num_experts);
  MOONEP_CHECK_ARG(in.num_experts % in.num_ranks == 0,
                   "num_experts (%d) must be divisible by num_ranks (%d)", in.num_experts,
                   in.num_ranks);
  const int32_t epn = in.num_experts / in.num_ranks;
  if (out->slots < 0) out->slots = epn;
  MOONEP_CHECK_ARG(in.slots >= -1, "slots must be >= 1 (or -1 for E/R), got %d", in.slots);
  MOONEP_CHECK_ARG(out->slots <= in.num_experts, "slots (%d) must not exceed num_experts (%d)",
                   out->slots, in.num_experts);
  // A rank's groups (home experts, then slots) are counted in int32; with one rank nothing else
  // bounds the sum. Checked before the home map of E entries is built.
  MOONEP_CHECK_ARG(int64_t{epn} + out->slots <= INT32_MAX,
                   "num_experts / num_ranks + slots = %d groups per rank is too large (at most "
                   "2^31 - 1)", int64_t{epn} + out->slots);
  MOONEP_CHECK_ARG(in.pad_multiple >= 1, "pad_multiple must be >= 1, got %d", in.pad_multiple);
  MOONEP_CHECK_ARG(in.ranks_per_node >= 0, "ranks_per_node must be >= 0, got %d", in.ranks_per_node);
  // (Byte stats are rows or replicas times these, saturating at INT64_MAX.)
  constexpr int64_t kMaxBytes = int64_t{1} << 40;
  MOONEP_CHECK_ARG(in.row_bytes >= 0 && in.row_bytes <= kMaxBytes,
                   "row_bytes must be in [0, 2^40], got %d", in.row_bytes);
  MOONEP_CHECK_ARG(in.expert_bytes >= 0 && in.expert_bytes <= kMaxBytes,
                   "expert_bytes must be in [0, 2^40], got %d", in.expert_bytes);
  if (out->home.empty()) {
    out->home.resize(in.num_experts);
    for (int32_t e = 0; e < in.num_experts; ++e) out->home[e] = e / epn;
  } else {
    MOONEP_CHECK_ARG(static_cast<int32_t>(in.home.size()) == in.num_experts,
                     "home has %d entries, need num_experts = %d", in.home.size(), in.num_experts);
    std::vector<int32_t> per_rank(in.num_ranks, 0);
    for (int32_t e = 0; e < in.num_experts; ++e) {
      MOONEP_CHECK_ARG(in.home[e] >= 0 && in.home[e] < in.num_ranks,
                       "home[%d] = %d is not a rank in [0, %d)", e, in.home[e], in.num_ranks);
      ++per_rank[in.home[e]];
    }
    for (int32_t r = 0; r < in.num_ranks; ++r) {
      MOONEP_CHECK_ARG(per_rank[r] == epn, "home map gives rank %d %d experts, need E/R = %d", r,
                       per_rank[r], epn);
    }
  }
  if (!in.speeds.empty()) {
    MOONEP_CHECK_ARG(static_cast<int32_t>(in.speeds.size()) == in.num_ranks,
                     "speeds has %d entries, need num_ranks = %d", in.speeds.size(), in.num_ranks);
    for (int32_t r = 0; r < in.num_ranks; ++r) {
      MOONEP_CHECK_ARG(std::isfinite(in.speeds[r]) && in.speeds[r] > 0,
                       "speeds[%d] = %g must be finite and positive", r, in.speeds[r]);
    }
  }
  MOONEP_CHECK_ARG(in.eplb_period >= 1, "eplb_period must be >= 1, got %d", in.eplb_period);
  MOONEP_CHECK_ARG(in.replica_cost_intra >= 0 && in.replica_cost_intra <= kMaxReplicaCost,
                   "replica_cost_intra must be in [0, 2^52], got %d", in.replica_cost_intra);
  MOONEP_CHECK_ARG(in.replica_cost_inter >= 0 && in.replica_cost_inter <= kMaxReplicaCost,
                   "replica_cost_inter must be in [0, 2^52], got %d", in.replica_cost_inter);
  MOONEP_CHECK_ARG(in.row_cost_intra >= 0 && in.row_cost_intra <= kMaxRowCost,
                   "row_cost_intra must be in [0, 2^40], got %d", in.row_cost_intra);
  MOONEP_CHECK_ARG(in.row_cost_inter >= 0 && in.row_cost_inter <= kMaxRowCost,
                   "row_cost_inter must be in [0, 2^40], got %d", in.row_cost_inter);
  return absl::OkStatus();
}

absl::Status CheckCounts(const PlannerConfig& resolved, absl::Span<const int64_t> counts) {
  const size_t need = static_cast<size_t>(resolved.num_ranks) * resolved.num_experts;
  MOONEP_CHECK_ARG(counts.size() == need, "counts has %d entries, need R*E = %d*%d = %d",
                   counts.size(), resolved.num_ranks, resolved.num_experts, need);
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0) {
      return InvalidArgument("counts[%d][%d] = %d is negative", i / resolved.num_experts,
                             i % resolved.num_experts, counts[i]);
    }
  }
  return absl::OkStatus();
}

void ComputeSourceOffsets(absl::Span<const int64_t> counts, int32_t num_ranks, int32_t num_experts,
                          std::vector<int64_t>* offsets) {
  const size_t E = num_experts;
  offsets->resize((static_cast<size_t>(num_ranks) + 1) * E);
  int64_t* out = offsets->data();
  std::fill(out, out + E, 0);
  for (int32_t s = 0; s < num_ranks; ++s) {
    const int64_t* prev = out + s * E;
    const int64_t* row = counts.data() + s * E;
    int64_t* next = out + (s + 1) * E;
    for (size_t e = 0; e < E; ++e) next[e] = prev[e] + row[e];
  }
}

void InitPlan(const PlannerConfig& c, Plan* plan) {
  const int32_t R = c.num_ranks, E = c.num_experts, epn = E / R, G = epn + c.slots;
  plan->num_ranks = R;
  plan->num_experts = E;
  plan->experts_per_rank = epn;
  plan->slots = c.slots;
  plan->pad_multiple = c.pad_multiple;
  plan->ranks_per_node = c.ranks_per_node;
  plan->home_replicas = HomeReplicas(c);
  plan->home.assign(c.home.begin(), c.home.end());
  plan->local_experts.resize(static_cast<size_t>(R) * epn);
  plan->home_group.resize(E);
  std::vector<int32_t> filled(R, 0);
  for (int32_t e = 0; e < E; ++e) {
    const int32_t r = c.home[e];
    plan->home_group[e] = filled[r];
    plan->local_experts[static_cast<size_t>(r) * epn + filled[r]++] = e;
  }
  plan->alloc.assign(static_cast<size_t>(E) * R, 0);
  plan->slot_expert.assign(static_cast<size_t>(R) * c.slots, -1);
  plan->slot_alloc.assign(static_cast<size_t>(R) * c.slots, 0);
  plan->group_offset.assign(static_cast<size_t>(R) * G, 0);
  plan->group_count.assign(static_cast<size_t>(R) * G, 0);
  plan->group_padded.assign(static_cast<size_t>(R) * G, 0);
  plan->rank_rows.assign(R, 0);
  plan->piece_begin.assign(E + 1, 0);
  plan->piece_dest.clear();
  plan->piece_start.clear();
  plan->piece_count.clear();
  plan->piece_row.clear();
  plan->stats = PlanStats{};
}

namespace {

// n * bytes for the byte stats (n, bytes >= 0), INT64_MAX when past it: 2^52 rows of 2^40 bytes
// do not fit.
int64_t SaturatingBytes(int64_t n, int64_t bytes) {
  int64_t v = 0;
  return __builtin_mul_overflow(n, bytes, &v) ? INT64_MAX : v;
}

int64_t Overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0));
}

// FinalizeHolders' layout on the planner's path (home_keep given, each rank's used slots first):
// each rank's groups back to back. With the default home map (kContiguous) rank d homes experts
// [d * epn, (d + 1) * epn), so its home groups' counts are a slice of home_keep. Out of line, so
// that its few live values stay in registers.
struct RankLayout {
  // in
  int32_t R, epn, S;
  int64_t pad;
  const int64_t *home_keep, *home_load, *slot_alloc;
  const int32_t* local_experts;
  // out
  int64_t *group_count, *group_offset, *group_padded, *rank_rows;
  int64_t* home_row;                                  // [E] row of each expert's home group
  int64_t tokens = 0, max_before = 0, max_after = 0;  // sum and maxima of the loads

  // Each rank's groups: counts (a slot's is its slot_alloc), offsets, padding; rank_rows,
  // home_row and the loads.
  template <bool kPadded, bool kContiguous>
  ABSL_ATTRIBUTE_NOINLINE void Lay() {
    const int32_t G = epn + S;
    const int64_t p = pad;
    int64_t tok = 0, hi_before = 0, hi_after = 0;
    for (int32_t d = 0; d < R; ++d) {
      const size_t base = static_cast<size_t>(d) * G;
      int64_t* gc = group_count + base;
      int64_t* go = group_offset + base;
      int64_t* gp = group_padded + base;
      const int32_t* local = local_experts + static_cast<size_t>(d) * epn;
      const int64_t* keep = home_keep + static_cast<size_t>(d) * epn;  // kContiguous
      int64_t* hr = home_row + static_cast<size_t>(d) * epn;            // kContiguous
      const int64_t* sa = slot_alloc + static_cast<size_t>(d) * S;
      int64_t row = 0, after = 0;
      auto lay = [&](int32_t g, int64_t n) {
        const int64_t rows = kPadded ? (n + p - 1) / p * p : n;
        gc[g] = n;
        go[g] = row;
        gp[g] = rows;
        row += rows;
        if (kPadded) after += n;
      };
      for (int32_t g = 0; g < epn; ++g) {
        if (kContiguous) {
          hr[g] = row;
          lay(g, keep[g]);
        } else {
          home_row[local[g]] = row;
          lay(g, home_keep[local[g]]);
        }
      }
      for (int32_t s = 0; s < S; ++s) lay(epn + s, sa[s]);
      if (!kPadded) after = row;
      rank_rows[d] = row;
      tok += after;
      hi_before = std::max(hi_before, home_load[d]);
      hi_after = std::max(hi_after, after);
    }
    tokens = tok;
    max_before = hi_before;
    max_after = hi_after;
  }
};

// FinalizeHolders' pieces of runs of unreplicated experts, on the planner's path (home_keep
// given): each is one piece on its home, none without tokens. (Their row stats come from the home
// sums, their tokens from the group counts.)
struct HomeRun {
  // in
  const int64_t *totals, *home_keep, *home_row;
  const int32_t* home;
  int32_t* piece_begin;
  int32_t* piece_dest;
  int64_t *piece_start, *piece_count, *piece_row;
  // in/out
  int32_t pieces = 0;
  bool mismatch = false;  // some home_keep[e] != totals[e]: the caller names it
  // Lays the unreplicated experts [e0, e1). Checks first (branch-free, vectorised); when none of
  // them has zero tokens, each is one piece at P + (e - e0) and the pieces are copies of
  // per-expert arrays; otherwise the general loop.
  void LayRange(int32_t e0, int32_t e1) {
    uint64_t zero = 0, diff = 0;
    for (int32_t e = e0; e < e1; ++e) {
      const int64_t N = totals[e];
      zero |= static_cast<uint64_t>(N - 1) >> 63;  // N == 0 (totals are >= 0)
      diff |= static_cast<uint64_t>(home_keep[e] ^ N);
    }
    mismatch |= diff != 0;
    if (zero != 0) {
      Lay(e0, e1);
      return;
    }
    const int32_t P = pieces, n = e1 - e0;
    for (int32_t k = 0; k < n; ++k) piece_begin[e0 + k] = P + k;
    std::copy(home + e0, home + e1, piece_dest + P);
    std::fill(piece_start + P, piece_start + P + n, 0);
    std::copy(totals + e0, totals + e1, piece_count + P);
    std::copy(home_row + e0, home_row + e1, piece_row + P);
    pieces = P + n;
  }
  // Lays the unreplicated experts [e, end).
  void Lay(int32_t e, int32_t end) {
    int32_t P = pieces;
    for (; e < end; ++e) {
      piece_begin[e] = P;
      const int64_t N = totals[e];
      if (N == 0) continue;
      piece_dest[P] = home[e];
      piece_start[P] = 0;
      piece_count[P] = N;
      piece_row[P] = home_row[e];
      ++P;
    }
    pieces = P;
  }
};

}  // namespace

absl::Status FinalizePlan(const PlannerConfig& c, absl::Span<const int64_t> counts, Plan* plan,
                          BuildScratch* scratch) {
  const int32_t R = c.num_ranks, E = c.num_experts, epn = E / R, S = c.slots, G = epn + S;
  ComputeSourceOffsets(counts, R, E, &scratch->src_offsets);
  const int64_t* totals = scratch->src_offsets.data() + static_cast<size_t>(R) * E;

  // Replicas per expert, by increasing rank; checks slot rules on the way.
  scratch->replica_begin.assign(E + 1, 0);
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = plan->slot_expert[static_cast<size_t>(d) * S + s];
      if (e < 0) continue;
      MOONEP_CHECK_ARG(e < E, "slot %d of rank %d holds expert %d, not in [0, %d)", s, d, e, E);
      MOONEP_CHECK_ARG(plan->home_replicas || plan->home[e] != d,
                       "rank %d holds a replica of its own expert %d", d, e);
      ++scratch->replica_begin[e + 1];
    }
  }
  for (int32_t e = 0; e < E; ++e) scratch->replica_begin[e + 1] += scratch->replica_begin[e];
  const int32_t num_replicas = scratch->replica_begin[E];
  scratch->replica_rank.resize(num_replicas);
  scratch->replica_start.resize(num_replicas);
  scratch->replica_end.resize(num_replicas);
  std::vector<int64_t>& replica_slot = scratch->next_row;  // slot index d * S + s of each replica
  replica_slot.resize(num_replicas);
  {
    std::vector<int32_t>& cursor = scratch->replica_begin;  // reuse: shift back afterwards
    for (int32_t d = 0; d < R; ++d) {
      for (int32_t s = 0; s < S; ++s) {
        const int32_t e = plan->slot_expert[static_cast<size_t>(d) * S + s];
        if (e >= 0) {
          replica_slot[cursor[e]] = static_cast<int64_t>(d) * S + s;
          scratch->replica_rank[cursor[e]++] = d;
        }
      }
    }
    for (int32_t e = E; e > 0; --e) cursor[e] = cursor[e - 1];
    cursor[0] = 0;
  }

  // Conservation, capacity of slots, and layout counts.
  const int32_t* rb = scratch->replica_begin.data();
  for (int32_t e = 0; e < E; ++e) {
    int64_t sum = 0;
    for (int32_t d = 0; d < R; ++d) {
      const int64_t a = plan->alloc[static_cast<size_t>(e) * R + d];
      MOONEP_CHECK_ARG(a >= 0, "alloc[%d][%d] = %d is negative", e, d, a);
      sum += a;
    }
    MOONEP_CHECK_ARG(sum == totals[e], "expert %d: alloc sums to %d but it has %d tokens", e, sum,
                     totals[e]);
    for (int32_t j = rb[e]; j < rb[e + 1]; ++j) {
      for (int32_t i = rb[e]; i < j; ++i) {
        MOONEP_CHECK_ARG(scratch->replica_rank[i] != scratch->replica_rank[j],
                         "expert %d has two replicas on rank %d", e, scratch->replica_rank[j]);
      }
    }
  }
  // A slot on its expert's home rank (home_replicas) keeps the slot_alloc the caller set; the
  // home group computes the rest of alloc[e][home].
  plan->slot_alloc.resize(static_cast<size_t>(R) * S);
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t g = 0; g < G; ++g) {
      const int32_t e = plan->ExpertOfGroup(d, g);
      int64_t n = e < 0 ? 0 : plan->alloc[static_cast<size_t>(e) * R + d];
      if (g >= epn) {
        int64_t& slot_alloc = plan->slot_alloc[static_cast<size_t>(d) * S + (g - epn)];
        if (e >= 0 && plan->home[e] == d) {
          n = slot_alloc;
          MOONEP_CHECK_ARG(n >= 0, "slot %d of rank %d: slot_alloc %d is negative", g - epn, d, n);
          int64_t& home_count = plan->group_count[static_cast<size_t>(d) * G + plan->home_group[e]];
          MOONEP_CHECK_ARG(home_count >= n, "expert %d: its home-rank slot computes %d of the %d tokens on rank %d",
                           e, n, home_count, d);
          home_count -= n;
        }
        slot_alloc = n;
      }
      plan->group_count[static_cast<size_t>(d) * G + g] = n;
    }
  }
  // Every token of an expert must be computed by a rank that holds it.
  for (int32_t e = 0; e < E; ++e) {
    int64_t held = plan->alloc[static_cast<size_t>(e) * R + plan->home[e]];
    for (int32_t j = rb[e]; j < rb[e + 1]; ++j) {
      if (scratch->replica_rank[j] == plan->home[e]) continue;  // inside alloc[e][home]
      held += plan->alloc[static_cast<size_t>(e) * R + scratch->replica_rank[j]];
    }
    MOONEP_CHECK_ARG(held == totals[e],
                     "expert %d: %d of its tokens are allocated to ranks that hold no copy of it",
                     e, totals[e] - held);
  }

  // Layout: padded groups back to back.
  for (int32_t d = 0; d < R; ++d) {
    int64_t row = 0;
    for (int32_t g = 0; g < G; ++g) {
      const size_t i = static_cast<size_t>(d) * G + g;
      const int64_t n = plan->group_count[i];
      plan->group_offset[i] = row;
      plan->group_padded[i] = PaddedRows(n, c.pad_multiple);
      row += plan->group_padded[i];
    }
    plan->rank_rows[d] = row;
  }

  // Pieces.
  plan->piece_dest.clear();
  plan->piece_start.clear();
  plan->piece_count.clear();
  plan->piece_row.clear();
  auto add_piece = [&](int32_t dest, int64_t start, int64_t count, int64_t row) {
    if (count <= 0) return;
    plan->piece_dest.push_back(dest);
    plan->piece_start.push_back(start);
    plan->piece_count.push_back(count);
    plan->piece_row.push_back(row);
  };
  for (int32_t e = 0; e < E; ++e) {
    plan->piece_begin[e] = static_cast<int32_t>(plan->piece_dest.size());
    const int64_t N = totals[e];
    const int32_t first = rb[e], last = rb[e + 1];
    int64_t cursor = 0;
    for (int32_t j = first; j < last; ++j) {
      const int32_t d = scratch->replica_rank[j];
      const int64_t a = plan->slot_alloc[replica_slot[j]];
      const int64_t want = scratch->src_offsets[static_cast<size_t>(d) * E + e];
      scratch->replica_start[j] = std::max(want, cursor);
      scratch->replica_end[j] = scratch->replica_start[j] + a;
      cursor = scratch->replica_end[j];
    }
    int64_t limit = N;  // shift left from the end when the replicas ran past N
    for (int32_t j = last - 1; j >= first; --j) {
      const int64_t a = scratch->replica_end[j] - scratch->replica_start[j];
      if (scratch->replica_end[j] > limit) {
        scratch->replica_end[j] = limit;
        scratch->replica_start[j] = limit - a;
      }
      limit = scratch->replica_start[j];
    }
    int64_t pos = 0, home_rows = 0;
    const int32_t h = plan->home[e];
    const int64_t home_row = plan->group_offset[static_cast<size_t>(h) * G + plan->home_group[e]];
    for (int32_t j = first; j < last; ++j) {
      add_piece(h, pos, scratch->replica_start[j] - pos, home_row + home_rows);
      home_rows += std::max<int64_t>(0, scratch->replica_start[j] - pos);
      const int32_t d = scratch->replica_rank[j];
      add_piece(d, scratch->replica_start[j], scratch->replica_end[j] - scratch->replica_start[j],
                plan->group_offset[static_cast<size_t>(d) * G + epn + replica_slot[j] % S]);
      pos = scratch->replica_end[j];
    }
    add_piece(h, pos, N - pos, home_row + home_rows);
  }
  plan->piece_begin[E] = static_cast<int32_t>(plan->piece_dest.size());

  // Row stats.
  PlanStats& st = plan->stats;
  st = PlanStats{};
  for (int32_t e = 0; e < E; ++e) {
    for (int32_t p = plan->piece_begin[e]; p < plan->piece_begin[e + 1]; ++p) {
      const int32_t d = plan->piece_dest[p];
      const int64_t p0 = plan->piece_start[p], p1 = p0 + plan->piece_count[p];
      const int64_t* col = scratch->src_offsets.data() + e;
      const int64_t local = Overlap(p0, p1, col[static_cast<size_t>(d) * E], col[static_cast<size_t>(d + 1) * E]);
      int64_t same_node = local;
      if (c.ranks_per_node > 0) {
        const int32_t n0 = d / c.ranks_per_node * c.ranks_per_node;
        const int32_t n1 = std::min(R, n0 + c.ranks_per_node);
        same_node = Overlap(p0, p1, col[static_cast<size_t>(n0) * E], col[static_cast<size_t>(n1) * E]);
      }
      st.rows_local += local;
      st.rows_travel_intra += same_node - local;
      st.rows_travel_inter += plan->piece_count[p] - same_node;
    }
  }
  for (int32_t e = 0; e < E; ++e) {
    st.total_tokens += totals[e];
    for (int32_t j = rb[e]; j < rb[e + 1]; ++j) {
      if (NodeOf(*plan, scratch->replica_rank[j]) == NodeOf(*plan, plan->home[e])) {
        ++st.prefetch_intra;
      } else {
        ++st.prefetch_inter;
      }
    }
  }
  st.replicas = num_replicas;
  for (int32_t d = 0; d < R; ++d) {
    int64_t before = 0, after = 0;
    for (int32_t g = 0; g < epn; ++g) before += totals[plan->local_experts[static_cast<size_t>(d) * epn + g]];
    for (int32_t g = 0; g < G; ++g) after += plan->group_count[static_cast<size_t>(d) * G + g];
    st.max_load_before = std::max(st.max_load_before, before);
    st.max_load_after = std::max(st.max_load_after, after);
  }
  st.mean_load = static_cast<double>(st.total_tokens) / R;
  st.dispatch_bytes_intra = SaturatingBytes(st.rows_travel_intra, c.row_bytes);
  st.dispatch_bytes_inter = SaturatingBytes(st.rows_travel_inter, c.row_bytes);
  st.prefetch_bytes_intra = st.reduce_bytes_intra = SaturatingBytes(st.prefetch_intra, c.expert_bytes);
  st.prefetch_bytes_inter = st.reduce_bytes_inter = SaturatingBytes(st.prefetch_inter, c.expert_bytes);
  return absl::OkStatus();
}

absl::Status FinalizeHolders(const PlannerConfig& c, absl::Span<const int64_t> counts,
                             absl::Span<const int64_t> totals, Plan* plan, BuildScratch* scratch,
                             const int64_t* home_keep, const int64_t* home_load,
                             const ReplicaPlacement* placed) {
  const int32_t R = c.num_ranks, E = c.num_experts, epn = E / R, S = c.slots, G = epn + S;
  const int32_t rpn = c.ranks_per_node;
  const int64_t pad = c.pad_multiple;
  const int32_t* slot_expert = plan->slot_expert.data();
  const int64_t* slot_alloc = plan->slot_alloc.data();
  const int32_t* home = plan->home.data();
  const int64_t* alloc = plan->alloc.data();
  int64_t* group_count = plan->group_count.data();
  int64_t* group_offset = plan->group_offset.data();
  int64_t* group_padded = plan->group_padded.data();

  // The planner's decisions fill each rank's slots in order (a prefix), so with home_keep given
  // the scans stop at a rank's first unused slot.
  const bool prefix_slots = home_keep != nullptr && home_load != nullptr && !plan->home_replicas;
  // The replicated experts, increasing (rep_experts[0 .. n_rep)), and their replicas by
  // increasing rank: those of rep_experts[i] are [rep_begin[i], rep_begin[i + 1]), each with its
  // rank and slot index (rank * S + slot). Handed over with their placement (`placed`), or found
  // here from the slots.
  const int32_t* rep_experts;
  const int32_t* rep_begin;
  int32_t n_rep;
  const int32_t* rrank;
  const int64_t* rslot;
  if (prefix_slots && placed != nullptr) {
    rep_experts = placed->experts.data();
    rep_begin = placed->begin.data();
    n_rep = placed->num;
    rrank = placed->rank.data();
    rslot = placed->slot.data();
  } else {
    // Replicas of each expert, counted in replica_count (all zero between calls: only the
    // replicated experts' entries are set, and they are reset below, also on error), which then
    // serves as each one's cursor while the replicas are listed.
    std::vector<int32_t>& count = scratch->replica_count;
    if (count.size() != static_cast<size_t>(E)) count.assign(E, 0);
    int32_t* rcount = count.data();
    // Calls fn(d, s, e) for every used slot s of every rank d, by rank then slot.
    auto for_each_used_slot = [&](auto&& fn) -> absl::Status {
      for (int32_t d = 0; d < R; ++d) {
        const int32_t* se = slot_expert + static_cast<size_t>(d) * S;
        for (int32_t s = 0; s < S; ++s) {
          const int32_t e = se[s];
          if (e < 0) {
            if (prefix_slots) break;
            continue;
          }
          MOONEP_RETURN_IF_ERROR(fn(d, s, e));
        }
      }
      return absl::OkStatus();
    };
    std::vector<int32_t>& replicated = scratch->replicated;  // each once, sorted below
    replicated.clear();
    const absl::Status counted = for_each_used_slot([&](int32_t d, int32_t s, int32_t e) {
      MOONEP_CHECK_ARG(e < E, "slot %d of rank %d holds expert %d, not in [0, %d)", s, d, e, E);
      MOONEP_CHECK_ARG(plan->home_replicas || home[e] != d,
                       "rank %d holds a replica of its own expert %d", d, e);
      if (rcount[e]++ == 0) replicated.push_back(e);
      return absl::OkStatus();
    });
    if (!counted.ok()) {
      for (int32_t e : replicated) rcount[e] = 0;
      return counted;
    }
    std::sort(replicated.begin(), replicated.end());
    n_rep = static_cast<int32_t>(replicated.size());
    std::vector<int32_t>& rb = scratch->replica_begin;
    rb.resize(static_cast<size_t>(n_rep) + 1);
    int32_t acc = 0;
    for (int32_t i = 0; i < n_rep; ++i) {
      const int32_t e = replicated[i];
      rb[i] = acc;
      acc += rcount[e];
      rcount[e] = rb[i];  // the cursor
    }
    rb[n_rep] = acc;
    scratch->replica_rank.resize(acc);
    std::vector<int64_t>& replica_slot = scratch->next_row;  // d * S + s of each replica
    replica_slot.resize(acc);
    int32_t* rank_out = scratch->replica_rank.data();
    int64_t* slot_out = replica_slot.data();
    MOONEP_RETURN_IF_ERROR(for_each_used_slot([&](int32_t d, int32_t s, int32_t e) {
      const int32_t j = rcount[e]++;
      rank_out[j] = d;
      slot_out[j] = static_cast<int64_t>(d) * S + s;
      return absl::OkStatus();
    }));
    for (int32_t e : replicated) rcount[e] = 0;
    rep_experts = replicated.data();
    rep_begin = rb.data();
    rrank = rank_out;
    rslot = slot_out;
  }
  const int32_t num_replicas = rep_begin[n_rep];

  // Per rank: group counts (a home-rank slot takes its part out of the home group), layout
  // (padded groups back to back) and loads.
  PlanStats& st = plan->stats;
  st = PlanStats{};
  const int32_t* local_experts = plan->local_experts.data();
  int64_t* rank_rows = plan->rank_rows.data();
  // Row of each expert's home group (the pieces loop reads it per expert).
  scratch->home_row.resize(E);
  int64_t* home_row_of = scratch->home_row.data();
  int64_t total_tokens = 0;  // the sum of all group counts (= of totals once conservation holds)
  if (prefix_slots) {
    // Slot counts are slot_alloc: the caller's decisions leave no tokens in an unused slot
    // (asserted in debug builds, where ValidatePlan checks it again).
#ifndef NDEBUG
    for (size_t i = 0; i < static_cast<size_t>(R) * S; ++i) assert(slot_expert[i] >= 0 || slot_alloc[i] == 0);
#endif
    RankLayout lay{R, epn, S, pad, home_keep, home_load, slot_alloc, local_experts,
                   group_count, group_offset, group_padded, rank_rows, home_row_of};
    if (scratch->contiguous_home && pad == 1) {
      lay.Lay<false, true>();
    } else if (scratch->contiguous_home) {
      lay.Lay<true, true>();
    } else if (pad == 1) {
      lay.Lay<false, false>();
    } else {
      lay.Lay<true, false>();
    }
    total_tokens = lay.tokens;
    st.max_load_before = lay.max_before;
    st.max_load_after = lay.max_after;
  }
  for (int32_t d = 0; !prefix_slots && d < R; ++d) {
    const int32_t* local = plan->local_experts.data() + static_cast<size_t>(d) * epn;
    int64_t* gc = group_count + static_cast<size_t>(d) * G;
    int64_t before = 0, after = 0;
    if (home_keep != nullptr && home_load != nullptr) {
      for (int32_t g = 0; g < epn; ++g) gc[g] = home_keep[local[g]];
      before = home_load[d];
    } else {
      for (int32_t g = 0; g < epn; ++g) {
        const int32_t e = local[g];
        gc[g] = alloc[static_cast<size_t>(e) * R + d];
        before += totals[e];
      }
    }
    const int32_t* se = slot_expert + static_cast<size_t>(d) * S;
    const int64_t* sa = slot_alloc + static_cast<size_t>(d) * S;
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = se[s];
      int64_t n = 0;
      if (e >= 0) {
        // With home_keep given, the caller wrote alloc and slot_alloc from the same decisions.
        n = home_keep != nullptr ? sa[s] : alloc[static_cast<size_t>(e) * R + d];
        if (home[e] == d) {  // home_replicas: the slot's part of alloc[e][home]
          n = sa[s];
          int64_t& home_count = gc[plan->home_group[e]];
          MOONEP_CHECK_ARG(n >= 0 && n <= home_count,
                           "expert %d: its home-rank slot computes %d of the %d tokens on rank %d", e,
                           n, home_count, d);
          home_count -= n;
        }
      }
      MOONEP_CHECK_ARG(sa[s] == n, "slot %d of rank %d: slot_alloc %d != alloc %d", s, d, sa[s], n);
      gc[epn + s] = n;
    }
    int64_t row = 0;
    int64_t* go = group_offset + static_cast<size_t>(d) * G;
    int64_t* gp = group_padded + static_cast<size_t>(d) * G;
    if (pad == 1) {
      for (int32_t g = 0; g < G; ++g) {
        go[g] = row;
        gp[g] = gc[g];
        row += gc[g];
      }
    } else {
      for (int32_t g = 0; g < G; ++g) {
        go[g] = row;
        gp[g] = PaddedRows(gc[g], pad);
        row += gp[g];
      }
    }
    for (int32_t g = 0; g < G; ++g) after += gc[g];
    for (int32_t g = 0; g < epn; ++g) home_row_of[local[g]] = go[g];
    plan->rank_rows[d] = row;
    total_tokens += after;
    st.max_load_before = std::max(st.max_load_before, before);
    st.max_load_after = std::max(st.max_load_after, after);
  }

  // Source blocks: col(e, x) = sum of counts[s][e] for s < x is a block prefix plus < B entries.
  if (scratch->block_size <= 0) {
    scratch->home_cols = false;
    scratch->block_size = BlockSize(c);
    const int32_t B = scratch->block_size, NB = NumBlocks(R, B);
    std::vector<int64_t>& bp = scratch->block_prefix;
    bp.assign(static_cast<size_t>(NB + 1) * E, 0);
    for (int32_t b = 0; b < NB; ++b) {
      int64_t* blk = bp.data() + static_cast<size_t>(b + 1) * E;
      std::copy(blk - E, blk, blk);
      for (int32_t s = b * B; s < std::min(R, (b + 1) * B); ++s) {
        const int64_t* row = counts.data() + static_cast<size_t>(s) * E;
        for (int32_t e = 0; e < E; ++e) blk[e] += row[e];
      }
    }
  }
  const int32_t B = scratch->block_size;
  const int64_t* bp = scratch->block_prefix.data();
  const int64_t* cnt = counts.data();
  const int32_t NB = NumBlocks(R, B);
  if (scratch->table_key[0] != R || scratch->table_key[1] != E || scratch->table_key[2] != B ||
      scratch->table_key[3] != rpn) {
    scratch->block_row.resize(static_cast<size_t>(R) + 1);
    scratch->block_first.resize(static_cast<size_t>(R) + 1);
    scratch->node_lo.resize(R);
    scratch->node_hi.resize(R);
    scratch->node_id.resize(R);
    for (int32_t x = 0; x <= R; ++x) {
      scratch->block_row[x] = static_cast<int64_t>(x / B) * E;
      scratch->block_first[x] = x / B * B;
    }
    // With nodes, blocks divide nodes: a node's range is two block prefixes (the last node may
    // end at R inside a block: then its end is the total, row NB).
    for (int32_t r = 0; r < R; ++r) {
      scratch->node_id[r] = rpn > 0 ? r / rpn : r;
      if (rpn > 0) {
        const int32_t n0 = r / rpn * rpn, n1 = n0 + rpn;
        scratch->node_lo[r] = static_cast<int64_t>(n0 / B) * E;
        scratch->node_hi[r] = static_cast<int64_t>(n1 >= R ? NB : n1 / B) * E;
      }
    }
    scratch->table_key[0] = R;
    scratch->table_key[1] = E;
    scratch->table_key[2] = B;
    scratch->table_key[3] = rpn;
  }
  const int64_t* block_row = scratch->block_row.data();
  const int32_t* block_first = scratch->block_first.data();
  const int64_t* node_lo = scratch->node_lo.data();
  const int64_t* node_hi = scratch->node_hi.data();
  const int32_t* node_id = scratch->node_id.data();
  // col(e, x) and counts[x][e] together: from the block prefix before x's block adding the
  // entries before x, or from the one after it subtracting x's entry and those after, whichever
  // reads fewer entries of counts (at most B / 2 besides x's own).
  auto col_own = [&](int32_t e, int32_t x, int64_t* own) -> int64_t {
    const int64_t* c = cnt + e;
    const int32_t b0 = block_first[x], b1 = std::min(R, b0 + B);
    *own = c[static_cast<size_t>(x) * E];
    int64_t v;
    if (x - b0 <= b1 - 1 - x) {
      v = bp[block_row[x] + e];
      for (int32_t s = b0; s < x; ++s) v += c[static_cast<size_t>(s) * E];
    } else {
      v = bp[block_row[x] + E + e] - *own;
      for (int32_t s = x + 1; s < b1; ++s) v -= c[static_cast<size_t>(s) * E];
    }
    return v;
  };
  auto node_range = [&](int32_t e, int32_t rank, int64_t* lo, int64_t* hi) {
    *lo = bp[node_lo[rank] + e];
    *hi = bp[node_hi[rank] + e];
  };

  if (!scratch->home_cols) {
    int64_t own_sum = 0, node_sum = 0;
    for (int32_t e = 0; e < E; ++e) {
      const int32_t h = home[e];
      const int64_t own = cnt[static_cast<size_t>(h) * E + e];
      int64_t lo = 0, hi = own;
      if (rpn > 0) node_range(e, h, &lo, &hi);
      own_sum += own;
      node_sum += hi - lo;
    }
    scratch->home_own_sum = own_sum;
    scratch->home_node_sum = node_sum;
    scratch->home_cols = true;
  }

  // Pieces, rows and row stats, one expert at a time (at most 1 + 2 * replicas pieces each).
  const size_t max_pieces = static_cast<size_t>(E) + 2 * static_cast<size_t>(num_replicas);
  if (plan->piece_dest.size() < max_pieces) {
    plan->piece_dest.resize(max_pieces);
    plan->piece_start.resize(max_pieces);
    plan->piece_count.resize(max_pieces);
    plan->piece_row.resize(max_pieces);
  }
  int32_t* pdest = plan->piece_dest.data();
  int64_t* pstart = plan->piece_start.data();
  int64_t* pcount = plan->piece_count.data();
  int64_t* prow = plan->piece_row.data();
  int32_t* pbegin = plan->piece_begin.data();
  const int32_t* home_group = plan->home_group.data();
  // Each replica's placement: [rstart, rend) and col(e, d), counts[d][e] of its rank d (handed
  // over, or computed per expert below).
  const bool handed = prefix_slots && placed != nullptr;
  const int64_t *rstart, *rend, *rcol, *rown;                       // read by the pieces below
  int64_t *wstart = nullptr, *wend = nullptr, *wcol = nullptr, *wown = nullptr;  // written when not handed
  if (handed) {
    rstart = placed->start.data();
    rend = placed->end.data();
    rcol = placed->col.data();
    rown = placed->own.data();
  } else {
    for (auto* v : {&scratch->replica_start, &scratch->replica_end, &scratch->replica_col,
                    &scratch->replica_own}) {
      v->resize(num_replicas);
    }
    rstart = wstart = scratch->replica_start.data();
    rend = wend = scratch->replica_end.data();
    rcol = wcol = scratch->replica_col.data();
    rown = wown = scratch->replica_own.data();
  }
  int32_t P = 0;
  // Row stats: an unreplicated expert's rows are local on its home's own tokens, intra-node on
  // the rest of its home node's and inter-node otherwise, which the home sums count for every
  // expert; a replicated one's are taken out of them again and counted piece by piece. Every
  // token is in one piece, so the inter-node rows are the rest of total_tokens.
  int64_t rows_local = scratch->home_own_sum, rows_node = scratch->home_node_sum;
  int32_t prefetch_intra = 0;  // replicas on their home's node
  HomeRun run{totals.data(), home_keep, home_row_of, home, pbegin, pdest, pstart, pcount, prow};
  // The unreplicated experts before each replicated one (and after the last), then that one.
  for (int32_t i = 0, e = 0; i <= n_rep; ++i) {
    const int32_t next = i < n_rep ? rep_experts[i] : E;
    if (prefix_slots && e < next) {
      run.pieces = P;
      run.LayRange(e, next);
      P = run.pieces;
      if (run.mismatch) {
        for (; e < next; ++e) {
          MOONEP_CHECK_ARG(home_keep[e] >= 0, "alloc[%d][%d] = %d is negative", e, home[e], home_keep[e]);
          MOONEP_CHECK_ARG(home_keep[e] == totals[e], "expert %d: its holders compute %d of its %d tokens",
                           e, home_keep[e], totals[e]);
        }
      }
      e = next;
    }
    for (; e < next; ++e) {  // (without prefix_slots) one at a time
      pbegin[e] = P;
      const int64_t N = totals[e];
      const int32_t h = home[e];
      const int64_t held = group_count[static_cast<size_t>(h) * G + home_group[e]];
      MOONEP_CHECK_ARG(held >= 0, "alloc[%d][%d] = %d is negative", e, h, held);
      MOONEP_CHECK_ARG(held == N, "expert %d: its holders compute %d of its %d tokens", e, held, N);
      if (N == 0) continue;
      pdest[P] = h;
      pstart[P] = 0;
      pcount[P] = N;
      prow[P] = home_row_of[e];
      ++P;
    }
    if (i == n_rep) break;
    e = next + 1;
    const int32_t x = next;  // the replicated expert
    pbegin[x] = P;
    const int64_t N = totals[x];
    const int32_t h = home[x], first = rep_begin[i], last = rep_begin[i + 1];
    const int64_t home_row = home_row_of[x];
    // (The home group computes home_keep[x] when given: no home-rank slot takes a part of it.)
    int64_t held = prefix_slots ? home_keep[x] : group_count[static_cast<size_t>(h) * G + home_group[x]];
    MOONEP_CHECK_ARG(held >= 0, "alloc[%d][%d] = %d is negative", x, h, held);
    int64_t h0, h_own;
    if (handed) {
      for (int32_t j = first; j < last; ++j) held += rend[j] - rstart[j];
      h0 = placed->home_col[i];
      h_own = placed->home_own[i];
    } else {
      for (int32_t j = first; j < last; ++j) {
        MOONEP_CHECK_ARG(j == first || rrank[j] != rrank[j - 1], "expert %d has two replicas on rank %d",
                         x, rrank[j]);
        const int64_t a = slot_alloc[rslot[j]];
        MOONEP_CHECK_ARG(a >= 0, "alloc[%d][%d] = %d is negative", x, rrank[j], a);
        held += a;
        wcol[j] = col_own(x, rrank[j], &wown[j]);
        wend[j] = a;  // the amount, until laid
      }
      LayReplicas(N, wcol + first, wend + first, wstart + first, wend + first, last - first);
      h0 = col_own(x, h, &h_own);
    }
    MOONEP_CHECK_ARG(held == N, "expert %d: its holders compute %d of its %d tokens", x, held, N);
    // The home's own and node ranges, used by every home piece.
    const int64_t h1 = h0 + h_own;
    int64_t hn0 = h0, hn1 = h1;
    if (rpn > 0) node_range(x, h, &hn0, &hn1);
    rows_local -= h_own;
    rows_node -= hn1 - hn0;
    int64_t home_rows = 0, pos = 0;
    auto home_piece = [&](int64_t start, int64_t count) {
      pdest[P] = h;
      pstart[P] = start;
      pcount[P] = count;
      prow[P] = home_row + home_rows;
      ++P;
      home_rows += count;
      const int64_t p1 = start + count;
      const int64_t local = Overlap(start, p1, h0, h1);
      rows_local += local;
      rows_node += rpn > 0 ? Overlap(start, p1, hn0, hn1) : local;
    };
    const int32_t home_node = node_id[h];
    for (int32_t j = first; j < last; ++j) {
      const int32_t d = rrank[j];
      if (rstart[j] > pos) home_piece(pos, rstart[j] - pos);
      const int64_t count = rend[j] - rstart[j];
      prefetch_intra += node_id[d] == home_node;
      pos = rend[j];
      if (count <= 0) continue;
      const int64_t start = rstart[j], p1 = rend[j];
      pdest[P] = d;
      pstart[P] = start;
      pcount[P] = count;
      // Group epn + s of rank d, for slot index d * S + s: d * G + epn + s.
      prow[P] = group_offset[rslot[j] + static_cast<int64_t>(d + 1) * epn];
      ++P;
      int64_t local, same_node;
      if (d == h) {
        local = Overlap(start, p1, h0, h1);
        same_node = rpn > 0 ? Overlap(start, p1, hn0, hn1) : local;
      } else {
        local = Overlap(start, p1, rcol[j], rcol[j] + rown[j]);
        same_node = local;
        if (rpn > 0) {
          int64_t lo, hi;
          node_range(x, d, &lo, &hi);
          same_node = Overlap(start, p1, lo, hi);
        }
      }
      rows_local += local;
      rows_node += same_node;
    }
    if (N > pos) home_piece(pos, N - pos);
  }
  pbegin[E] = P;
  plan->piece_dest.resize(P);
  plan->piece_start.resize(P);
  plan->piece_count.resize(P);
  plan->piece_row.resize(P);
  st.total_tokens = total_tokens;
  st.rows_local = rows_local;
  st.rows_travel_intra = rows_node - rows_local;
  st.rows_travel_inter = total_tokens - rows_node;
  st.replicas = num_replicas;
  st.prefetch_intra = prefetch_intra;
  st.prefetch_inter = num_replicas - prefetch_intra;
  st.mean_load = static_cast<double>(st.total_tokens) / R;
  st.dispatch_bytes_intra = SaturatingBytes(st.rows_travel_intra, c.row_bytes);
  st.dispatch_bytes_inter = SaturatingBytes(st.rows_travel_inter, c.row_bytes);
  st.prefetch_bytes_intra = st.reduce_bytes_intra = SaturatingBytes(st.prefetch_intra, c.expert_bytes);
  st.prefetch_bytes_inter = st.reduce_bytes_inter = SaturatingBytes(st.prefetch_inter, c.expert_bytes);
  return absl::OkStatus();
}

}  // namespace moonep::planner
