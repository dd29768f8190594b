// The Planner: checks input, runs the configured policy's decisions, then FinalizePlan.
#include "planner/planner.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>

#include "moonep/core/status.h"
#include "planner/policy.h"

namespace moonep::planner {

struct Planner::State {
  PlannerConfig config;  // resolved
  PolicyInput input;
  PolicyScratch scratch;
  Decisions decisions;
  BuildScratch build;
  bool contiguous_home = false;  // home(e) = e / (E/R): rank d homes experts [d * E/R, (d+1) * E/R)
};

Planner::Planner() : state_(new State) {}
Planner::~Planner() = default;

const PlannerConfig& Planner::config() const { return state_->config; }

absl::StatusOr<std::unique_ptr<Planner>> Planner::Create(const PlannerConfig& config) {
  std::unique_ptr<Planner> planner(new Planner);
  MOONEP_RETURN_IF_ERROR(ResolveConfig(config, &planner->state_->config));
  const PlannerConfig& c = planner->state_->config;
  MOONEP_CHECK_ARG(c.slots >= 1, "slots must be >= 1 (or -1 for E/R), got %d (every policy needs a "
                   "slot; policy none never fills one: it keeps every expert at home)", c.slots);
  MOONEP_CHECK_ARG(c.policy >= Policy::kNone && c.policy <= Policy::kTestForceReplicas,
                   "policy %d is not a known policy", static_cast<int>(c.policy));
  if (c.policy == Policy::kFasterMoEShadow) {
    MOONEP_CHECK_ARG(std::isfinite(c.shadow_compute_s_per_token) && c.shadow_compute_s_per_token >= 0,
                     "shadow_compute_s_per_token must be finite and >= 0, got %g",
                     c.shadow_compute_s_per_token);
    MOONEP_CHECK_ARG(std::isfinite(c.shadow_broadcast_s_per_byte) && c.shadow_broadcast_s_per_byte >= 0,
                     "shadow_broadcast_s_per_byte must be finite and >= 0, got %g",
                     c.shadow_broadcast_s_per_byte);
  }
  MOONEP_CHECK_ARG(c.eplb_redundant >= -1, "eplb_redundant must be >= -1, got %d", c.eplb_redundant);
  if (c.policy == Policy::kEplb) {
    const int32_t redundant = c.eplb_redundant < 0 ? c.num_ranks : c.eplb_redundant;
    MOONEP_CHECK_ARG(redundant % c.num_ranks == 0,
                     "eplb_redundant (%d) must be a multiple of num_ranks (%d)", redundant, c.num_ranks);
    // A copy off its home takes a replica slot (beyond them it falls back home), so more than
    // R * slots redundant experts place nothing more; the bound also keeps EPLB's E + redundant
    // physical experts (its memory and time per re-plan) in check.
    const int64_t slots_total = static_cast<int64_t>(c.num_ranks) * c.slots;
    MOONEP_CHECK_ARG(redundant <= slots_total,
                     "eplb_redundant (%d) must not exceed num_ranks * slots = %d (one copy per "
                     "replica slot)", redundant, slots_total);
    MOONEP_CHECK_ARG(int64_t{c.num_experts} + redundant <= INT32_MAX,
                     "num_experts + eplb_redundant = %d physical experts is too large",
                     int64_t{c.num_experts} + redundant);
  }
  MOONEP_CHECK_ARG(c.eplb_num_groups >= 0, "eplb_num_groups must be >= 0, got %d", c.eplb_num_groups);
  // Loads are summed in int64: reject shapes whose sizes overflow the index arithmetic.
  MOONEP_CHECK_ARG(static_cast<int64_t>(c.num_ranks) * c.num_experts <= (int64_t{1} << 40),
                   "num_ranks * num_experts = %d is too large",
                   static_cast<int64_t>(c.num_ranks) * c.num_experts);
  MOONEP_CHECK_ARG(static_cast<int64_t>(c.num_ranks) * c.slots <= (int64_t{1} << 31) - 1,
                   "num_ranks * slots = %d is too large", static_cast<int64_t>(c.num_ranks) * c.slots);
  bool contiguous = true;
  const int32_t epn = c.num_experts / c.num_ranks;
  for (int32_t e = 0; e < c.num_experts; ++e) contiguous = contiguous && c.home[e] == e / epn;
  planner->state_->contiguous_home = contiguous;
  return planner;
}

namespace {

// Whether `plan` already has this config's shape, so only its nonzero alloc entries need clearing.
bool SameShape(const PlannerConfig& c, const Plan& plan) {
  const size_t R = c.num_ranks, E = c.num_experts, S = c.slots;
  return plan.num_ranks == c.num_ranks && plan.num_experts == c.num_experts &&
         plan.slots == c.slots && plan.pad_multiple == c.pad_multiple &&
         plan.ranks_per_node == c.ranks_per_node && plan.home_replicas == HomeReplicas(c) &&
         plan.alloc.size() == E * R &&
         plan.slot_expert.size() == R * S && plan.slot_alloc.size() == R * S &&
         plan.home.size() == E && plan.local_experts.size() == E && plan.home_group.size() == E &&
         plan.group_offset.size() == R * (E / R + S) && plan.piece_begin.size() == E + 1 &&
         std::equal(plan.home.begin(), plan.home.end(), c.home.begin());
}

void PreparePlan(const PlannerConfig& c, Plan* plan) {
  if (!SameShape(c, *plan)) {
    InitPlan(c, plan);
    plan->slot_alloc.assign(static_cast<size_t>(c.num_ranks) * c.slots, 0);
    return;
  }
  const int32_t R = c.num_ranks, E = c.num_experts, S = c.slots;
  // A plan made by this library has nonzero alloc only at holders: home and filled slots. Every
  // home entry is written again by EmitAlloc, so only the slots' entries need clearing
  // (slot_expert and slot_alloc are overwritten whole by EmitAlloc). Its slots are filled in
  // order (every policy's Decisions add a rank's replicas at slots_used, and EmitAlloc copies
  // them), so a rank's used slots end at its first unused one (asserted in debug builds).
  const int32_t* slot_expert = plan->slot_expert.data();
  int64_t* alloc = plan->alloc.data();
  for (int32_t d = 0; d < R; ++d) {
    const int32_t* se = slot_expert + static_cast<size_t>(d) * S;
    int32_t s = 0;
    for (; s < S && se[s] >= 0; ++s) {
      if (se[s] < E) alloc[static_cast<size_t>(se[s]) * R + d] = 0;
    }
    assert(std::all_of(se + s, se + S, [](int32_t e) { return e < 0; }));
  }
  plan->stats = PlanStats{};
}

// Writes the decisions into alloc, slot_expert and slot_alloc.
void EmitAlloc(const PlannerConfig& c, const Decisions& dec, Plan* plan) {
  const int32_t R = c.num_ranks, E = c.num_experts, S = c.slots;
  int64_t* alloc = plan->alloc.data();
  const int32_t* home = plan->home.data();
  for (int32_t e = 0; e < E; ++e) alloc[static_cast<size_t>(e) * R + home[e]] = dec.home_keep[e];
  std::copy(dec.slot_expert.begin(), dec.slot_expert.end(), plan->slot_expert.begin());
  std::copy(dec.slot_amount.begin(), dec.slot_amount.end(), plan->slot_alloc.begin());
  const int32_t* slot_expert = dec.slot_expert.data();
  const int64_t* slot_amount = dec.slot_amount.data();
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < dec.slots_used[d]; ++s) {  // slots fill in order
      const size_t i = static_cast<size_t>(d) * S + s;
      alloc[static_cast<size_t>(slot_expert[i]) * R + d] += slot_amount[i];  // += : a home-rank slot
    }
  }
}

// EmitAlloc plus the load and replica stats (Decide: no pieces follow).
void EmitDecisions(const PlannerConfig& c, const Decisions& dec, const PolicyInput& in,
                   Plan* plan) {
  const int32_t R = c.num_ranks, E = c.num_experts, S = c.slots, epn = E / R;
  EmitAlloc(c, dec, plan);
  PlanStats& st = plan->stats;
  st = PlanStats{};
  st.total_tokens = in.total;
  st.mean_load = static_cast<double>(in.total) / R;
  for (int32_t d = 0; d < R; ++d) {
    int64_t after = 0;
    for (int32_t g = 0; g < epn; ++g) {
      after += dec.home_keep[plan->local_experts[static_cast<size_t>(d) * epn + g]];
    }
    for (int32_t s = 0; s < S; ++s) {
      const size_t i = static_cast<size_t>(d) * S + s;
      const int32_t e = dec.slot_expert[i];
      if (e < 0) continue;
      after += dec.slot_amount[i];
      ++st.replicas;
    }
    st.max_load_before = std::max(st.max_load_before, in.home_load[d]);
    st.max_load_after = std::max(st.max_load_after, after);
  }
}

absl::Status RunPolicy(const PlannerConfig& c, const PolicyInput& in, PolicyScratch* scratch,
                       Decisions* dec) {
  // moonep resets the decisions itself before each attempt (TryBalance), except when it returns
  // at once (one rank or no slots).
  if (c.policy != Policy::kMoonEP || c.num_ranks == 1 || c.slots == 0) {
    dec->Reset(c.num_ranks, c.num_experts, c.slots, in.totals);
  }
  switch (c.policy) {
    case Policy::kNone: return DecideNone(in, scratch, dec);
    case Policy::kMoonEP: return DecideMoonEP(in, scratch, dec);
    case Policy::kMoonEPGreedy: return DecideMoonEPGreedy(in, scratch, dec);
    case Policy::kEplb: return DecideEplb(in, scratch, dec);
    case Policy::kFasterMoEShadow: return DecideFasterMoEShadow(in, scratch, dec);
    case Policy::kTestForceReplicas: return DecideTestForceReplicas(in, scratch, dec);
  }
  return InvalidArgument("policy %d is not a known policy", static_cast<int>(c.policy));
}

// Fills in.home_load and in.total from in.totals; fails on negative or overflowing totals.
// `contiguous`: rank d homes experts [d * epn, (d + 1) * epn).
absl::Status SumLoads(const PlannerConfig& c, const Plan& plan, bool contiguous, PolicyInput* in) {
  constexpr int64_t kMaxTokens = int64_t{1} << 52;
  const int32_t R = c.num_ranks, epn = c.num_experts / R;
  in->home_load.resize(R);
  int64_t* home_load = in->home_load.data();
  const int32_t* local = plan.local_experts.data();
  const int64_t* totals = in->totals.data();
  // Entries below 2^52 (no bit >= 52 in their OR) sum without overflow over fewer than 2^11 of
  // them, so the loads are checked once, at the end; the slow path below names the offending
  // entry. (Unsigned: a bad entry wraps instead of overflowing, and is caught by the check.) One
  // home group of every rank at a time: E/R loops over the ranks (R loops over the E/R home
  // experts each were vectorised with peeling, dearer for a handful of entries).
  uint64_t bits = 0, total_u = 0;
  bool checked = epn < 2048;
  if (checked) {
    uint64_t* load = reinterpret_cast<uint64_t*>(home_load);
    std::fill(load, load + R, 0);
    for (int32_t g = 0; g < epn; ++g) {
      if (contiguous) {
        for (int32_t d = 0; d < R; ++d) {
          const uint64_t t = static_cast<uint64_t>(totals[static_cast<size_t>(d) * epn + g]);
          bits |= t;
          load[d] += t;
        }
      } else {
        for (int32_t d = 0; d < R; ++d) {
          const uint64_t t = static_cast<uint64_t>(totals[local[static_cast<size_t>(d) * epn + g]]);
          bits |= t;
          load[d] += t;
        }
      }
    }
    // With no entry at or above 2^52 each load is below 2^63; once the total passes 2^52 the
    // check stays failed.
    bool over = (bits >> 52) != 0;
    for (int32_t d = 0; d < R; ++d) {
      total_u += load[d];
      over |= load[d] > static_cast<uint64_t>(kMaxTokens) || total_u > static_cast<uint64_t>(kMaxTokens);
    }
    checked = !over;
  }
  if (checked) {
    in->total = static_cast<int64_t>(total_u);
    return absl::OkStatus();
  }
  int64_t total = 0;
  for (int32_t d = 0; d < R; ++d) {
    int64_t load = 0;
    for (int32_t g = 0; g < epn; ++g) {
      const int32_t e = local[static_cast<size_t>(d) * epn + g];
      const int64_t t = totals[e];
      MOONEP_CHECK_ARG(t >= 0, "expert_totals[%d] = %d is negative", e, t);
      MOONEP_CHECK_ARG(t <= kMaxTokens, "the tokens of expert %d sum to %d, past 2^52", e, t);
      MOONEP_CHECK_ARG(t <= kMaxTokens - load, "token totals overflow: rank %d load exceeds 2^52", d);
      load += t;
    }
    home_load[d] = load;
    MOONEP_CHECK_ARG(load <= kMaxTokens - total, "token totals overflow: sum exceeds 2^52");
    total += load;
  }
  in->total = total;
  return absl::OkStatus();
}

// dst[e] = src[e] + sum of rows [s0, s1) of counts (src may be dst), eight rows per sweep (a
// block of 8 sources: dst written once; two 4-row sweeps measured 15 % slower), and
// returns the OR of every entry read (bits >= 52 or the sign set: a bad entry). Sums wrap
// (unsigned) until the caller has rejected bad entries; valid ones never wrap.
// Not under ThreadSanitizer: the clones' ifunc resolver runs while the dynamic loader relocates
// libmoonep, before the sanitizer's runtime is initialised, and its instrumented entry crashes
// every binary linked against the library.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx2", "default")))
#endif
uint64_t AddRows(const int64_t* __restrict counts_signed, int32_t s0, int32_t s1, int32_t E,
                 const int64_t* src_signed, int64_t* dst_signed) {
  const uint64_t* __restrict counts = reinterpret_cast<const uint64_t*>(counts_signed);
  const uint64_t* src = reinterpret_cast<const uint64_t*>(src_signed);
  uint64_t* dst = reinterpret_cast<uint64_t*>(dst_signed);
  uint64_t bits = 0;
  const size_t n = static_cast<size_t>(E);
  int32_t s = s0;
  if (s1 - s0 >= 8) {
    for (; s + 8 <= s1; s += 8) {
      const uint64_t* __restrict r0 = counts + static_cast<size_t>(s) * n;
      const uint64_t* __restrict r1 = r0 + n;
      const uint64_t* __restrict r2 = r1 + n;
      const uint64_t* __restrict r3 = r2 + n;
      const uint64_t* __restrict r4 = r3 + n;
      const uint64_t* __restrict r5 = r4 + n;
      const uint64_t* __restrict r6 = r5 + n;
      const uint64_t* __restrict r7 = r6 + n;
      for (size_t e = 0; e < n; ++e) {
        const uint64_t a = r0[e], b = r1[e], x = r2[e], y = r3[e];
        const uint64_t a2 = r4[e], b2 = r5[e], x2 = r6[e], y2 = r7[e];
        dst[e] = src[e] + (((a + b) + (x + y)) + ((a2 + b2) + (x2 + y2)));
        bits |= ((a | b) | (x | y)) | ((a2 | b2) | (x2 | y2));
      }
      src = dst;
    }
  }
  if (s1 - s >= 4) {
    for (; s + 4 <= s1; s += 4) {
      const uint64_t* __restrict r0 = counts + static_cast<size_t>(s) * n;
      const uint64_t* __restrict r1 = r0 + n;
      const uint64_t* __restrict r2 = r1 + n;
      const uint64_t* __restrict r3 = r2 + n;
      for (size_t e = 0; e < n; ++e) {
        const uint64_t a = r0[e], b = r1[e], x = r2[e], y = r3[e];
        dst[e] = src[e] + ((a + b) + (x + y));
        bits |= (a | b) | (x | y);
      }
      src = dst;
    }
  }
  if (s + 2 <= s1) {
    const uint64_t* __restrict r0 = counts + static_cast<size_t>(s) * n;
    const uint64_t* __restrict r1 = r0 + n;
    for (size_t e = 0; e < n; ++e) {
      const uint64_t a = r0[e], b = r1[e];
      dst[e] = src[e] + (a + b);
      bits |= a | b;
    }
    src = dst;
    s += 2;
  }
  if (s < s1) {
    const uint64_t* __restrict r0 = counts + static_cast<size_t>(s) * n;
    for (size_t e = 0; e < n; ++e) {
      dst[e] = src[e] + r0[e];
      bits |= r0[e];
    }
    src = dst;
    ++s;
  }
  if (src != dst) std::copy(src, src + n, dst);  // no rows
  return bits;
}

// One pass over counts. block_prefix[(b * E) + e] = sum of counts[s][e] over s < b * B, for b in
// [0, NB]; row NB holds the totals. While each block is hot it also sums, over all experts, the
// count of each one's home rank (home_own_sum) and the counts of its home's node (home_node_sum;
// = home_own_sum when flat): the row stats of the experts laid whole on their home, which then
// need no look-up into counts. Fails on a negative entry or an entry >= 2^52 (a total above 2^52:
// SumLoads, which the caller runs next). `contiguous`: rank s homes experts [s * epn,
// (s + 1) * epn) (the default home map), so a block's home columns are slices of its rows and a
// node's home experts one range.
absl::Status SumCountBlocks(const int64_t* counts, const Plan& plan, int32_t B, bool contiguous,
                            bool row_sums, BuildScratch* build) {
  constexpr int64_t kMaxTokens = int64_t{1} << 52;
  const int32_t R = plan.num_ranks, E = plan.num_experts, epn = plan.experts_per_rank;
  const int32_t rpn = plan.ranks_per_node;
  const int32_t NB = NumBlocks(R, B);
  const size_t n = static_cast<size_t>(E);
  // Row 0 (the sums before block 0) is all zero: zeroed when the shape changes and never written
  // otherwise (this pass writes rows 1..NB; FinalizeHolders' own fill assigns zeros to it).
  const size_t bp_size = static_cast<size_t>(NB + 1) * n;
  if (build->block_prefix.size() != bp_size) build->block_prefix.assign(bp_size, 0);
  int64_t* bp = build->block_prefix.data();
  uint64_t own_sum = 0, node_sum = 0;  // unsigned: no overflow before the total is checked
  const int32_t* local = plan.local_experts.data();
  assert(std::all_of(bp, bp + n, [](int64_t v) { return v == 0; }));
  // A sum above 2^52 shows as the sign bit of 2^52 - sum (sums stay below 2^63 throughout: each
  // check covers fewer than 2048 rows of entries below 2^52 on top of a checked sum).
  auto over_max = [&](const int64_t* v) {
    uint64_t sign = 0;
    for (size_t e = 0; e < n; ++e) sign |= static_cast<uint64_t>(kMaxTokens - v[e]);
    return (sign >> 63) != 0;
  };
  auto fail_over = [&](const int64_t* v) -> absl::Status {
    for (int32_t e = 0; e < E; ++e) {
      MOONEP_CHECK_ARG(v[e] <= kMaxTokens, "counts of expert %d sum past 2^52", e);
    }
    return absl::OkStatus();
  };
  int32_t since_check = 0;
  for (int32_t b = 0; b < NB; ++b) {
    int64_t* blk = bp + static_cast<size_t>(b + 1) * n;
    const int32_t end = std::min(R, (b + 1) * B);
    for (int32_t s0 = b * B; s0 < end; s0 += 1024) {
      const int32_t s1 = std::min(end, s0 + 1024);
      if ((AddRows(counts, s0, s1, E, s0 == b * B ? blk - n : blk, blk) >> 52) != 0) {
        for (int32_t s = s0; s < s1; ++s) {
          const int64_t* row = counts + static_cast<size_t>(s) * n;
          for (int32_t e = 0; e < E; ++e) {
            MOONEP_CHECK_ARG(row[e] >= 0, "counts[%d][%d] = %d is negative", s, e, row[e]);
            MOONEP_CHECK_ARG(row[e] < kMaxTokens, "counts[%d][%d] = %d is not below 2^52", s, e, row[e]);
          }
        }
      }
      // Each source's sum while its row is still in the cache (unsigned: it may wrap here, but a
      // plan is only made once SumLoads has checked that the whole total is below 2^52).
      if (row_sums) {
        for (int32_t s = s0; s < s1; ++s) {
          const uint64_t* row = reinterpret_cast<const uint64_t*>(counts) + static_cast<size_t>(s) * n;
          uint64_t sum = 0;
          for (size_t e = 0; e < n; ++e) sum += row[e];
          build->row_sums[s] = static_cast<int64_t>(sum);
        }
      }
      // (The totals, row NB, are checked by SumLoads, which reads them next.)
      since_check += s1 - s0;
      if (since_check >= 1024 && s1 < R) {
        if (over_max(blk)) MOONEP_RETURN_IF_ERROR(fail_over(blk));
        since_check = 0;
      }
    }
    // Home columns of the block's ranks, from the rows just read.
    if (contiguous) {
      for (int32_t s = b * B; s < end; ++s) {
        // counts[s][s * epn + g]
        const int64_t* row = counts + static_cast<size_t>(s) * (n + epn);
        for (int32_t g = 0; g < epn; ++g) own_sum += static_cast<uint64_t>(row[g]);
      }
    } else {
      for (int32_t s = b * B; s < end; ++s) {
        const int64_t* row = counts + static_cast<size_t>(s) * n;
        const int32_t* ex = local + static_cast<size_t>(s) * epn;
        for (int32_t g = 0; g < epn; ++g) own_sum += static_cast<uint64_t>(row[ex[g]]);
      }
    }
    // Node sums of the experts homed on nodes that end with this block (blocks divide nodes).
    if (rpn > 0) {
      // B divides rpn (or equals it), so at most one node ends here: the one holding rank end-1.
      const int32_t n0 = (end - 1) / rpn * rpn, n1 = std::min(R, n0 + rpn);
      if (n1 == end) {
        const int64_t* lo = bp + static_cast<size_t>(n0 / B) * n;
        if (contiguous) {
          const size_t e0 = static_cast<size_t>(n0) * epn, e1 = static_cast<size_t>(n1) * epn;
          for (size_t e = e0; e < e1; ++e) node_sum += static_cast<uint64_t>(blk[e] - lo[e]);
        } else {
          for (int32_t s = n0; s < n1; ++s) {
            const int32_t* ex = local + static_cast<size_t>(s) * epn;
            for (int32_t g = 0; g < epn; ++g) node_sum += static_cast<uint64_t>(blk[ex[g]] - lo[ex[g]]);
          }
        }
      }
    }
  }
  // (Both sums are at most the total, which SumLoads checks before they are used.)
  build->home_own_sum = static_cast<int64_t>(own_sum);
  build->home_node_sum = static_cast<int64_t>(rpn > 0 ? node_sum : own_sum);
  build->home_cols = true;
  return absl::OkStatus();
}

}  // namespace

absl::Status Planner::Decide(absl::Span<const int64_t> expert_totals, Plan* plan) {
  MOONEP_CHECK_ARG(plan != nullptr, "plan is null");
  State& st = *state_;
  const PlannerConfig& c = st.config;
  MOONEP_CHECK_ARG(static_cast<int32_t>(expert_totals.size()) == c.num_experts,
                   "expert_totals has %d entries, need num_experts = %d", expert_totals.size(),
                   c.num_experts);
  PreparePlan(c, plan);
  st.input.config = &c;
  st.input.plan = plan;
  st.input.totals = expert_totals;
  st.input.counts = nullptr;
  st.input.row_sums = nullptr;
  st.input.block_prefix = nullptr;
  MOONEP_RETURN_IF_ERROR(SumLoads(c, *plan, st.contiguous_home, &st.input));
  MOONEP_RETURN_IF_ERROR(RunPolicy(c, st.input, &st.scratch, &st.decisions));
  EmitDecisions(c, st.decisions, st.input, plan);
  return absl::OkStatus();
}

absl::Status Planner::MakePlan(absl::Span<const int64_t> counts, Plan* plan) {
  MOONEP_CHECK_ARG(plan != nullptr, "plan is null");
  State& st = *state_;
  const PlannerConfig& c = st.config;
  const int32_t R = c.num_ranks, E = c.num_experts;
  const size_t need = static_cast<size_t>(R) * E;
  MOONEP_CHECK_ARG(counts.size() == need, "counts has %d entries, need R*E = %d*%d = %d",
                   counts.size(), R, E, need);
  // One pass over counts: per-block prefix sums (row b of block_prefix = sum of the sources
  // before block b; row NB = the totals) and the home columns, negative entries and overflow
  // rejected.
  const int32_t block = BlockSize(c), NB = NumBlocks(R, block);
  PreparePlan(c, plan);
  st.build.block_size = 0;  // not valid until the pass completes
  st.build.home_cols = false;
  st.build.contiguous_home = st.contiguous_home;
  const bool row_sums = c.policy == Policy::kMoonEP && c.weighs_replicas() && c.weighs_rows();
  if (row_sums) st.build.row_sums.resize(static_cast<size_t>(R));
  MOONEP_RETURN_IF_ERROR(
      SumCountBlocks(counts.data(), *plan, block, st.contiguous_home, row_sums, &st.build));
  st.build.block_size = block;
  st.input.config = &c;
  st.input.plan = plan;
  // The totals are the pass's last block-prefix row (nothing writes block_prefix until the next
  // MakePlan).
  st.input.totals = absl::MakeConstSpan(st.build.block_prefix.data() + static_cast<size_t>(NB) * E, E);
  st.input.counts = counts.data();
  st.input.row_sums = row_sums ? st.build.row_sums.data() : nullptr;
  st.input.block_prefix = st.build.block_prefix.data();
  st.input.block_size = block;
  st.input.block_shift = -1;
  for (int32_t k = 0; k < 31; ++k) {
    if ((int32_t{1} << k) == block) st.input.block_shift = k;
  }
  MOONEP_RETURN_IF_ERROR(SumLoads(c, *plan, st.contiguous_home, &st.input));
  st.scratch.placement = -1;  // set by moonep's cross-check when it placed the decisions it keeps
  MOONEP_RETURN_IF_ERROR(RunPolicy(c, st.input, &st.scratch, &st.decisions));
  EmitAlloc(c, st.decisions, plan);
  const int64_t* home_keep = plan->home_replicas ? nullptr : st.decisions.home_keep.data();
  const ReplicaPlacement* placed =
      st.scratch.placement >= 0 ? &st.scratch.placed[st.scratch.placement] : nullptr;
#ifndef NDEBUG
  // Debug builds: the plan laid from the handed placement equals the one FinalizeHolders makes
  // with its own checks and placement.
  Plan own;
  if (placed != nullptr) {
    own = *plan;
    BuildScratch own_build = st.build;
    const absl::Status s = FinalizeHolders(c, counts, st.input.totals, &own, &own_build, home_keep,
                                           st.input.home_load.data());
    assert(s.ok());
  }
#endif
  MOONEP_RETURN_IF_ERROR(FinalizeHolders(c, counts, st.input.totals, plan, &st.build, home_keep,
                                         st.input.home_load.data(), placed));
#ifndef NDEBUG
  assert(placed == nullptr || SerializePlan(own) == SerializePlan(*plan));
  MOONEP_RETURN_IF_ERROR(Annotate(ValidatePlan(*plan, counts), "planner produced an invalid plan"));
#endif
  return absl::OkStatus();
}

void SpeedWeights(const PlannerConfig& c, std::vector<int64_t>* weights) {
  weights->assign(c.num_ranks, 1);
  if (c.speeds.empty()) return;
  double max_speed = 0;
  for (double s : c.speeds) max_speed = std::max(max_speed, s);
  bool all_equal = true;
  for (int32_t d = 0; d < c.num_ranks; ++d) {
    (*weights)[d] = std::max<int64_t>(1, std::llround(c.speeds[d] / max_speed * (1 << 20)));
    all_equal = all_equal && (*weights)[d] == (*weights)[0];
  }
  if (all_equal) weights->assign(c.num_ranks, 1);
}

void BalancedCapacities(const PlannerConfig& c, absl::Span<const int64_t> home_load, int64_t total,
                        std::vector<int64_t>* cap) {
  const int32_t R = c.num_ranks;
  cap->assign(R, 0);
  if (c.speeds.empty()) {
    // Equal weights (no allocation): every rank has floor(total / R); when total % R != 0 the
    // extra tokens go by the same classes as below.
    const int64_t lo = total / R;
    int64_t extra = total % R;
    std::fill(cap->begin(), cap->end(), lo);
    const int64_t hi = lo + 1;
    for (int cls = 0; cls < 3 && extra > 0; ++cls) {
      for (int32_t d = 0; d < R && extra > 0; ++d) {
        if ((*cap)[d] != lo) continue;
        const int k = home_load[d] >= hi ? 0 : home_load[d] < lo ? 1 : 2;
        if (k != cls) continue;
        (*cap)[d] = hi;
        --extra;
      }
    }
    return;
  }
  std::vector<int64_t> w;
  SpeedWeights(c, &w);
  __int128 W = 0;
  for (int64_t x : w) W += x;
  int64_t assigned = 0;
  std::vector<char> has_frac(R, 0);
  for (int32_t d = 0; d < R; ++d) {
    const __int128 num = static_cast<__int128>(total) * w[d];
    (*cap)[d] = static_cast<int64_t>(num / W);
    has_frac[d] = num % W != 0;
    assigned += (*cap)[d];
  }
  int64_t extra = total - assigned;  // < R: ranks that get their ceiling
  if (extra == 0) return;
  // Classes: 0 = home load at or above the ceiling (keeping one more token saves a move),
  // 1 = below the floor (a receiver anyway), 2 = exactly at the floor (would receive only for it).
  for (int cls = 0; cls < 3 && extra > 0; ++cls) {
    for (int32_t d = 0; d < R && extra > 0; ++d) {
      if (!has_frac[d]) continue;
      const int64_t lo = (*cap)[d], hi = lo + 1;
      const int k = home_load[d] >= hi ? 0 : home_load[d] < lo ? 1 : 2;
      if (k != cls) continue;
      (*cap)[d] = hi;
      has_frac[d] = 0;
      --extra;
    }
  }
}

int64_t LoadLowerBound(const PlannerConfig& c, absl::Span<const int64_t> counts) {
  const int32_t R = c.num_ranks, E = c.num_experts, epn = E / R;
  if (counts.size() != static_cast<size_t>(R) * E) return 0;
  std::vector<int64_t> totals(E, 0), home_load(R, 0);
  for (int32_t s = 0; s < R; ++s) {
    for (int32_t e = 0; e < E; ++e) totals[e] += counts[static_cast<size_t>(s) * E + e];
  }
  int64_t total = 0, max_home = 0;
  for (int32_t e = 0; e < E; ++e) {
    home_load[c.home[e]] += totals[e];
    total += totals[e];
  }
  for (int64_t l : home_load) max_home = std::max(max_home, l);
  if (c.slots == 0 || R == 1) return max_home;
  // Some rank computes at least the mean. (With speeds, balancing time may leave every rank
  // below the fastest rank's perfect capacity in tokens when slots run short, so the bound stays
  // at the unweighted mean.)
  int64_t bound = (total + R - 1) / R;
  if (c.speeds.empty()) {
    std::vector<int64_t> cap;
    BalancedCapacities(c, home_load, total, &cap);
    bound = *std::max_element(cap.begin(), cap.end());
    // An expert can be split over its home and at most min(R - 1, R * slots) replicas.
    const int64_t holders = 1 + std::min<int64_t>(R - 1, static_cast<int64_t>(R) * c.slots);
    for (int32_t e = 0; e < E; ++e) bound = std::max(bound, (totals[e] + holders - 1) / holders);
  }
  (void)epn;
  return bound;
}

namespace {

template <typename T>
void AppendVector(const std::vector<T>& v, std::string* out) {
  const uint64_t n = v.size();
  out->append(reinterpret_cast<const char*>(&n), sizeof(n));
  if (n) out->append(reinterpret_cast<const char*>(v.data()), n * sizeof(T));
}

template <typename T>
void AppendScalar(T x, std::string* out) {
  out->append(reinterpret_cast<const char*>(&x), sizeof(x));
}

}  // namespace

std::string SerializePlan(const Plan& p) {
  std::string out;
  out.append("MOONEPPLAN1");
  for (int32_t x : {p.num_ranks, p.num_experts, p.experts_per_rank, p.slots, p.pad_multiple,
                    p.ranks_per_node}) {
    AppendScalar(x, &out);
  }
  AppendVector(p.home, &out);
  AppendVector(p.local_experts, &out);
  AppendVector(p.home_group, &out);
  AppendVector(p.alloc, &out);
  AppendVector(p.slot_expert, &out);
  AppendVector(p.slot_alloc, &out);
  AppendVector(p.group_offset, &out);
  AppendVector(p.group_count, &out);
  AppendVector(p.group_padded, &out);
  AppendVector(p.rank_rows, &out);
  AppendVector(p.piece_begin, &out);
  AppendVector(p.piece_dest, &out);
  AppendVector(p.piece_start, &out);
  AppendVector(p.piece_count, &out);
  AppendVector(p.piece_row, &out);
  const PlanStats& s = p.stats;
  for (int64_t x : {s.total_tokens, s.max_load_before, s.max_load_after, s.rows_local,
                    s.rows_travel_intra, s.rows_travel_inter, s.dispatch_bytes_intra,
                    s.dispatch_bytes_inter, s.prefetch_bytes_intra, s.prefetch_bytes_inter,
                    s.reduce_bytes_intra, s.reduce_bytes_inter}) {
    AppendScalar(x, &out);
  }
  for (int32_t x : {s.replicas, s.prefetch_intra, s.prefetch_inter}) AppendScalar(x, &out);
  AppendScalar(s.mean_load, &out);
  if (p.home_replicas) out.append("HOMEREPLICAS");  // only then: other plans' bytes unchanged
  return out;
}

}  // namespace moonep::planner
