// Decisions bookkeeping and the baseline policies: none, moonep-greedy (the published MoonEP
// greedy), fastermoe-shadow and the test-only test-force-replicas.
#include <algorithm>
#include <cassert>

#include "moonep/core/status.h"
#include "planner/planner.h"
#include "planner/policy.h"

namespace moonep::planner {

void Decisions::Reset(int32_t R, int32_t E, int32_t S, absl::Span<const int64_t> totals) {
  home_keep.assign(totals.begin(), totals.end());
  (void)E;
  const size_t n = static_cast<size_t>(R) * S;
  if (slot_expert.size() == n && slot_amount.size() == n && slots_used.size() == static_cast<size_t>(R)) {
    // Same shape: slots fill in order, so only the used prefix of each rank's slots needs clearing.
    for (int32_t d = 0; d < R; ++d) {
      const size_t base = static_cast<size_t>(d) * S;
      for (int32_t s = 0; s < slots_used[d]; ++s) {
        slot_expert[base + s] = -1;
        slot_amount[base + s] = 0;
      }
      slots_used[d] = 0;
    }
    return;
  }
  slot_expert.assign(n, -1);
  slot_amount.assign(n, 0);
  slots_used.assign(R, 0);
}

int32_t Decisions::SlotOf(int32_t rank, int32_t expert, int32_t S) const {
  const int32_t* slot = slot_expert.data() + static_cast<size_t>(rank) * S;
  for (int32_t s = 0; s < slots_used[rank]; ++s) {
    if (slot[s] == expert) return s;
  }
  return -1;
}

bool Decisions::Move(int32_t rank, int32_t expert, int64_t amount, int32_t S) {
  const int32_t s = SlotOf(rank, expert, S);
  if (s < 0) return Add(rank, expert, amount, S);
  slot_amount[static_cast<size_t>(rank) * S + s] += amount;
  home_keep[expert] -= amount;
  return true;
}

bool Decisions::Add(int32_t rank, int32_t expert, int64_t amount, int32_t S) {
  assert(SlotOf(rank, expert, S) < 0);
  if (slots_used[rank] >= S) return false;
  const size_t i = static_cast<size_t>(rank) * S + slots_used[rank]++;
  slot_expert[i] = expert;
  slot_amount[i] = amount;  // (an unused slot's amount is 0)
  home_keep[expert] -= amount;
  return true;
}

int64_t PolicyInput::Count(int32_t src, int32_t expert) const {
  if (counts != nullptr) return counts[static_cast<size_t>(src) * config->num_experts + expert];
  const int64_t R = config->num_ranks, t = totals[expert];
  return t / R + (src < t % R ? 1 : 0);
}

int64_t PolicyInput::Col(int32_t expert, int32_t x) const {
  const int32_t R = config->num_ranks, E = config->num_experts;
  if (counts == nullptr || block_prefix == nullptr) {
    const int64_t t = totals[expert];
    return x * (t / R) + std::min<int64_t>(x, t % R);
  }
  const int32_t b = block_shift >= 0 ? x >> block_shift : x / block_size;
  int64_t v = block_prefix[static_cast<size_t>(b) * E + expert];
  for (int32_t s = b * block_size; s < x; ++s) v += counts[static_cast<size_t>(s) * E + expert];
  return v;
}

namespace {

int64_t Overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0));
}

// Rows of expert e (N tokens, home columns [h0, h1)) computed on their own source rank when its
// replicas, by increasing rank, are placed at [start[j], end[j]) (j < n), col_of/own_of holding
// col(e, rank) and counts[rank][e] of each (a replica on the home rank, had it one, has col_of =
// h0 and own_of = h1 - h0, so it counts the same).
int64_t PlacedLocalRows(int64_t N, int64_t h0, int64_t h1, const int64_t* col_of, const int64_t* own_of,
                        const int64_t* start, const int64_t* end, int32_t n) {
  int64_t pos = 0, local = 0;
  for (int32_t j = 0; j < n; ++j) {
    local += Overlap(pos, start[j], h0, h1);  // home piece before the replica
    local += Overlap(start[j], end[j], col_of[j], col_of[j] + own_of[j]);
    pos = end[j];
  }
  return local + Overlap(pos, N, h0, h1);
}

}  // namespace

void LocalRows(const PolicyInput& in, const Decisions& a, const Decisions& b, PolicyScratch* sc,
               int64_t* local_a, int64_t* local_b) {
  const PlannerConfig& c = *in.config;
  const int32_t R = c.num_ranks, E = c.num_experts, S = c.slots;
  // Each set's replicas of each expert as a list by increasing rank: head[k * E + e] is the
  // first (-1 when none; all -1 between calls), next[j] the following one. Built in one pass per
  // set over the ranks in decreasing order, each replica pushed at the front of its list; the
  // experts touched are marked in a bit set, read back in increasing order below.
  sc->list_head.resize(2 * static_cast<size_t>(E), -1);
  sc->touched_bits.resize((static_cast<size_t>(E) + 63) / 64, 0);
  sc->touched.resize(E);
  const size_t cap = 2 * static_cast<size_t>(R) * S;
  sc->list_next.resize(cap);
  sc->by_expert_rank.resize(cap);
  sc->by_expert_amount.resize(cap);
  sc->by_expert_slot.resize(cap);
  // Raw pointers: stores through them cannot alias the vectors' own bookkeeping.
  int32_t* head = sc->list_head.data();
  int32_t* next = sc->list_next.data();
  int32_t* rank = sc->by_expert_rank.data();
  int64_t* amount = sc->by_expert_amount.data();
  int64_t* slot = sc->by_expert_slot.data();
  uint64_t* bits = sc->touched_bits.data();
  int32_t j = 0;
  const Decisions* both[2] = {&a, &b};
  for (int k = 0; k < 2; ++k) {
    const int32_t* used = both[k]->slots_used.data();
    const int32_t* slot_expert = both[k]->slot_expert.data();
    const int64_t* slot_amount = both[k]->slot_amount.data();
    int32_t* hk = head + static_cast<size_t>(k) * E;
    for (int32_t d = R - 1; d >= 0; --d) {
      const size_t base = static_cast<size_t>(d) * S;
      const int32_t u = used[d];
      for (int32_t s = 0; s < u; ++s, ++j) {
        const int32_t e = slot_expert[base + s];
        bits[e >> 6] |= uint64_t{1} << (e & 63);
        rank[j] = d;
        amount[j] = slot_amount[base + s];
        slot[j] = static_cast<int64_t>(base) + s;
        next[j] = hk[e];
        hk[e] = j;
      }
    }
  }
  int32_t* touched = sc->touched.data();  // increasing
  int32_t T = 0;
  for (size_t w = 0; w < sc->touched_bits.size(); ++w) {
    for (uint64_t x = bits[w]; x != 0; x &= x - 1) {
      touched[T++] = static_cast<int32_t>(w * 64) + __builtin_ctzll(x);
    }
    bits[w] = 0;
  }
  // Each set's placement (handed to FinalizeHolders for the set that wins): its replicated
  // experts in increasing order, their replicas' ranks, slots, amounts, col(e, d), counts[d][e]
  // and positions, and each expert's home columns.
  for (ReplicaPlacement& pl : sc->placed) {
    if (pl.experts.size() < static_cast<size_t>(E)) {
      for (auto* v : {&pl.experts, &pl.begin}) v->resize(static_cast<size_t>(E) + 1);
      for (auto* v : {&pl.home_col, &pl.home_own}) v->resize(static_cast<size_t>(E) + 1);
    }
    if (pl.rank.size() < cap / 2) {
      pl.rank.resize(cap / 2);
      for (auto* v : {&pl.slot, &pl.amount, &pl.col, &pl.own, &pl.start, &pl.end}) v->resize(cap / 2);
    }
  }
  // col(e, x) and counts[x][e] together: from the nearer block prefix around x (the one after
  // x's block minus x's entry and those after it; a table per rank, built once per shape), or an
  // even split when counts are unknown.
  const int64_t* counts = in.counts;
  const int64_t* bp = in.block_prefix;
  const int32_t B = in.block_size;
  const bool known = counts != nullptr && bp != nullptr;
  const int64_t* totals = in.totals.data();
  if (known && (sc->col_key[0] != R || sc->col_key[1] != E || sc->col_key[2] != B)) {
    sc->col_row.resize(R);
    sc->col_lo.resize(R);
    sc->col_hi.resize(R);
    for (int32_t x = 0; x < R; ++x) {
      const int32_t blk = x / B, b0 = blk * B, b1 = std::min(R, b0 + B);
      const bool before = x - b0 <= b1 - 1 - x;
      sc->col_row[x] = static_cast<int64_t>(before ? blk : blk + 1) * E;
      sc->col_lo[x] = before ? b0 : x;
      sc->col_hi[x] = before ? x : b1;
    }
    sc->col_key[0] = R;
    sc->col_key[1] = E;
    sc->col_key[2] = B;
  }
  const int64_t* col_row = sc->col_row.data();
  const int32_t* col_lo = sc->col_lo.data();
  const int32_t* col_hi = sc->col_hi.data();
  auto col_own = [&](int32_t e, int32_t x, int64_t* own_x) -> int64_t {
    if (!known) {
      const int64_t t = totals[e], q = t / R, r = t % R;
      *own_x = counts != nullptr ? counts[static_cast<size_t>(x) * E + e] : q + (x < r ? 1 : 0);
      return x * q + std::min<int64_t>(x, r);
    }
    const int64_t* ce = counts + e;
    *own_x = ce[static_cast<size_t>(x) * E];
    const int32_t lo = col_lo[x], hi = col_hi[x];
    int64_t sum = 0;
    for (int32_t s = lo; s < hi; ++s) sum += ce[static_cast<size_t>(s) * E];
    const int64_t v = bp[col_row[x] + e];
    return x < hi ? v - sum : v + sum;
  };
  const int32_t* home = in.plan->home.data();
  // The two placements (a: set a, b: set b); set b's look-ups read set a's.
  ReplicaPlacement& pa = sc->placed[0];
  ReplicaPlacement& pb = sc->placed[1];
  const int32_t* a_rank = pa.rank.data();
  const int64_t* a_col = pa.col.data();
  const int64_t* a_own = pa.own.data();
  int32_t ja = 0, jb = 0, na_exp = 0, nb_exp = 0;  // replicas and experts placed in each set
  int64_t local[2] = {0, 0};
  for (int32_t t = 0; t < T; ++t) {
    const int32_t e = touched[t], h = home[e];
    const int64_t N = totals[e];
    // The home's columns once for both sets; each replica's once per (set, rank), and a rank
    // that holds e in both sets is looked up once (both lists are by increasing rank).
    int64_t h_own;
    const int64_t h0 = col_own(e, h, &h_own), h1 = h0 + h_own;
    // Each set's replicas of e placed as FinalizeHolders places them: each at its own column or
    // after the previous one, whichever is later; when the last one runs past N they shift left.
    auto place = [&](int32_t k, ReplicaPlacement& pl, int32_t q0, auto&& lookup) -> int32_t {
      int32_t* pr = pl.rank.data() + q0;
      int64_t* pcol = pl.col.data() + q0;
      int64_t* pown = pl.own.data() + q0;
      int64_t* pstart = pl.start.data() + q0;
      int64_t* pend = pl.end.data() + q0;
      int64_t* pslot = pl.slot.data() + q0;
      int64_t* pamount = pl.amount.data() + q0;
      int32_t n = 0;
      for (int32_t i = head[static_cast<size_t>(k) * E + e]; i >= 0; i = next[i], ++n) {
        const int32_t x = rank[i];
        pr[n] = x;
        pslot[n] = slot[i];
        pamount[n] = amount[i];
        pcol[n] = lookup(x, &pown[n]);
      }
      LayReplicas(N, pcol, pamount, pstart, pend, n);
      local[k] += PlacedLocalRows(N, h0, h1, pcol, pown, pstart, pend, n);
      return n;
    };
    const int32_t na = place(0, pa, ja, [&](int32_t x, int64_t* own) { return col_own(e, x, own); });
    // Set b's look-ups: a rank that holds e in set a too is looked up once (both lists are by
    // increasing rank).
    int32_t p = ja;
    const int32_t nb = place(1, pb, jb, [&](int32_t x, int64_t* own) {
      while (p < ja + na && a_rank[p] < x) ++p;
      if (p < ja + na && a_rank[p] == x) {
        *own = a_own[p];
        return a_col[p];
      }
      return col_own(e, x, own);
    });
    // e's replicas in a set (if any) close as one entry of that set's expert list.
    auto close = [&](ReplicaPlacement& pl, int32_t n, int32_t& n_exp, int32_t& placed_n) {
      if (n == 0) return;
      pl.experts[n_exp] = e;
      pl.begin[n_exp] = placed_n;
      pl.home_col[n_exp] = h0;
      pl.home_own[n_exp] = h_own;
      ++n_exp;
      placed_n += n;
    };
    close(pa, na, na_exp, ja);
    close(pb, nb, nb_exp, jb);
    head[e] = -1;
    head[E + e] = -1;
  }
  pa.num = na_exp;
  pa.begin[na_exp] = ja;
  pb.num = nb_exp;
  pb.begin[nb_exp] = jb;
  *local_a = local[0];
  *local_b = local[1];
}

absl::Status DecideNone(const PolicyInput&, PolicyScratch*, Decisions*) { return absl::OkStatus(); }

namespace {

// GreedyFill's moves on queues of keys value * 2^bits + (2^bits - 1 - index), the index being
// the donor's index and the receiver's rank (see GreedyFill).
template <typename Key>
bool GreedyMoves(const PolicyInput& in, PolicyScratch* sc, Decisions* dec, int32_t num_donors,
                 int32_t num_receivers, int32_t bits, std::vector<Key>* keys,
                 bool presorted, absl::Span<const int64_t> cap) {
  const int32_t S = in.config->slots, epn = in.config->num_experts / in.config->num_ranks;
  const int32_t* receiver_rank = sc->greedy_receiver.data();
  const int64_t* excess = sc->excess.data();
  const int64_t* room = sc->room.data();
  const Key mask = (Key{1} << bits) - 1;
  keys->resize(2 * (static_cast<size_t>(num_donors) + num_receivers + 2));
  LoweringQueue<Key> donors, receivers;  // the largest excess / room last (ties: lowest rank)
  receivers.Attach(donors.Attach(keys->data(), num_donors), num_receivers);
  for (int32_t i = 0; i < num_donors; ++i) {
    donors.sorted[i] = (static_cast<Key>(excess[i]) << bits) | (mask - i);
  }
  std::sort(donors.sorted, donors.sorted + num_donors);
  const std::vector<PolicyScratch::Room>& rooms = sc->rooms_sorted;
  // The handed order is used only when it is the receivers' sorted order: strictly ascending by
  // (room, rank), so its ranks are distinct, each one a receiver of these capacities with that
  // room, and as many as the receivers. Anything else (say, an order left by other capacities) is
  // sorted anew.
  bool use_rooms = presorted && rooms.size() == static_cast<size_t>(num_receivers);
  if (use_rooms) {
    // Balancer::Init's order, by (room, rank) ascending, is the keys' but for runs of equal
    // rooms, where the keys want the ranks descending: each run is written reversed.
    const int32_t R = in.config->num_ranks;
    Key* q = receivers.sorted;
    int32_t run = 0;  // the current run of equal rooms is [run, i)
    for (int32_t i = 0; i < num_receivers && use_rooms; ++i) {
      const int32_t r = rooms[i].rank;
      use_rooms = r >= 0 && r < R && rooms[i].room > 0 &&
                  in.home_load[r] - cap[r] == -rooms[i].room &&
                  (i == 0 || rooms[i - 1].room < rooms[i].room ||
                   (rooms[i - 1].room == rooms[i].room && rooms[i - 1].rank < r));
      if (rooms[i].room != rooms[run].room) {
        std::reverse(q + run, q + i);
        run = i;
      }
      q[i] = (static_cast<Key>(rooms[i].room) << bits) | (mask - r);
    }
    std::reverse(q + run, q + num_receivers);
  }
  if (!use_rooms) {
    for (int32_t i = 0; i < num_receivers; ++i) {
      receivers.sorted[i] = (static_cast<Key>(room[i]) << bits) | (mask - receiver_rank[i]);
    }
    std::sort(receivers.sorted, receivers.sorted + num_receivers);
  }
#ifndef NDEBUG
  for (int32_t i = 0; i < num_receivers; ++i) {  // the keys of the receivers, in order
    const int32_t d = receiver_rank[i];
    assert(std::binary_search(receivers.sorted, receivers.sorted + num_receivers,
                              (static_cast<Key>(room[i]) << bits) | (mask - d)));
    assert(i == 0 || receivers.sorted[i - 1] < receivers.sorted[i]);
  }
#endif
  // The top key lowered by `moved` tokens (dropped at value 0: its key is then at most mask).
  auto lower = [&](LoweringQueue<Key>& q, Key top, int64_t moved) {
    const Key x = top - (static_cast<Key>(moved) << bits);
    q.LowerTop(top, x <= mask ? 0 : x);
  };
  while (true) {
    const Key dk = donors.Top(), rk = receivers.Top();
    if (dk == 0) return true;
    if (rk == 0) return false;
    const int32_t hi = static_cast<int32_t>(mask - (dk & mask));
    const int32_t d = static_cast<int32_t>(mask - (rk & mask));
    const int64_t room_d = static_cast<int64_t>(rk >> bits);
    int64_t quota = std::min(static_cast<int64_t>(dk >> bits), room_d);
    int32_t* ord = sc->order.data() + static_cast<size_t>(hi) * epn;
    int64_t* rem = sc->greedy_rem.data() + static_cast<size_t>(hi) * epn;
    int64_t moved = 0;
    bool full = false;  // d ran out of slots: it takes no more
    int32_t taken = 0;  // experts ord[0 .. taken) lost tokens
    for (int32_t i = 0; i < epn && quota > 0; ++i) {
      const int32_t e = ord[i];
      const int64_t a = std::min(quota, rem[i]);
      if (a <= 0) break;
      // A new replica: every move closes its donor or its receiver (quota = the smaller of the
      // two, and the donor's experts hold at least its excess), so a (donor, receiver) pair meets
      // in one move only, and a move gives each expert once: d never holds e yet.
      if (!dec->Add(d, e, a, S)) {
        full = true;
        break;
      }
      rem[i] -= a;
      quota -= a;
      moved += a;
      taken = i + 1;
    }
    // Restore the order: the experts that lost tokens are a prefix and the rest is still sorted,
    // so each of them, last first, moves right to its place (held in registers: swapping pairs in
    // memory stalled on store forwarding).
    for (int32_t i = taken - 1; i >= 0; --i) {
      const int64_t r = rem[i];
      const int32_t o = ord[i];
      int32_t j = i;
      while (j + 1 < epn && (r != rem[j + 1] ? r < rem[j + 1] : o > ord[j + 1])) {
        rem[j] = rem[j + 1];
        ord[j] = ord[j + 1];
        ++j;
      }
      rem[j] = r;
      ord[j] = o;
    }
    lower(donors, dk, moved);
    lower(receivers, rk, full ? room_d : moved);
  }
}

}  // namespace

// Published MoonEP greedy (GreedyFill): the most overloaded home group gives exactly the room of the rank with
// the most room; inside the group the quota goes to the experts with the most remaining tokens
// first. Same perfect-balance capacities as `moonep`, so the two are compared on equal targets.
bool GreedyFill(const PolicyInput& in, absl::Span<const int64_t> cap, PolicyScratch* sc,
                Decisions* dec, bool presorted) {
  const PlannerConfig& c = *in.config;
  const int32_t R = c.num_ranks, S = c.slots, epn = c.num_experts / R;
  dec->Reset(R, c.num_experts, S, in.totals);
  // Donors (excess > 0) and receivers (room > 0), each in increasing rank. Each move takes the
  // largest excess and the largest room (ties: lowest rank) and lowers one of them to 0 (or both),
  // the other by as much: two LoweringQueues of keys value * 2^bits + index complement (the
  // larger key is the larger value with ties to the lower index). At EP128 most moves close a
  // receiver that was never lowered (O(1)), and the lowered keys are few (a heap of ~20).
  // (Buffers of at least R entries; the first num_donors / num_receivers count.)
  for (auto* v : {&sc->greedy_donor, &sc->greedy_receiver}) {
    if (v->size() < static_cast<size_t>(R)) v->resize(R);
  }
  for (auto* v : {&sc->excess, &sc->room}) {
    if (v->size() < static_cast<size_t>(R)) v->resize(R);
  }
  int32_t* donors = sc->greedy_donor.data();
  int32_t* receivers = sc->greedy_receiver.data();
  int64_t* excess = sc->excess.data();
  int64_t* room = sc->room.data();
  int32_t num_donors = 0, num_receivers = 0;
  int64_t top = 0;
  for (int32_t d = 0; d < R; ++d) {
    const int64_t diff = in.home_load[d] - cap[d];
    if (diff > 0) {
      donors[num_donors] = d;
      excess[num_donors++] = diff;
      top = std::max(top, diff);
    } else if (diff < 0 && S > 0) {
      receivers[num_receivers] = d;
      room[num_receivers++] = -diff;
      top = std::max(top, -diff);
    }
  }
  // Each donor group's experts, most remaining tokens first (ties by expert id), kept sorted
  // across moves (only the group's own experts lose tokens, so an insertion pass restores it);
  // rem mirrors their remaining tokens contiguously.
  const int64_t* keep = dec->home_keep.data();
  auto before = [&](int32_t a, int32_t b) {
    const int64_t ka = keep[a], kb = keep[b];
    return ka != kb ? ka > kb : a < b;
  };
  const size_t n_sorted = static_cast<size_t>(num_donors) * epn;
  sc->order.resize(n_sorted);
  sc->greedy_rem.resize(n_sorted);
  // The handed order is used only when it is the one the sort below would give (keep = totals
  // after Reset): each donor's group strictly ordered by `before` and all homed on that donor, so
  // a permutation of its experts. Anything else is sorted anew.
  const std::vector<int32_t>& sorted = sc->donor_sorted;
  bool use_sorted = presorted && sorted.size() == n_sorted;
  if (use_sorted) {  // copied with its remaining tokens, checked on the way
    const int32_t* home = in.plan->home.data();
    const uint32_t E = static_cast<uint32_t>(c.num_experts);
    for (int32_t i = 0; i < num_donors && use_sorted; ++i) {
      const size_t p0 = static_cast<size_t>(i) * epn;
      const int32_t* from = sorted.data() + p0;
      int32_t* ord = sc->order.data() + p0;
      int64_t* rem = sc->greedy_rem.data() + p0;
      bool ok = true;
      for (int32_t g = 0; g < epn; ++g) {
        const int32_t e = from[g];
        ok = ok && static_cast<uint32_t>(e) < E && home[e] == donors[i];
        const int64_t r = ok ? keep[e] : 0;
        ok = ok && (g == 0 || rem[g - 1] > r || (rem[g - 1] == r && ord[g - 1] < e));
        ord[g] = e;
        rem[g] = r;
      }
      use_sorted = ok;
    }
  }
  if (!use_sorted) {
    for (int32_t i = 0; i < num_donors; ++i) {
      const int32_t* local = in.plan->local_experts.data() + static_cast<size_t>(donors[i]) * epn;
      int32_t* ord = sc->order.data() + static_cast<size_t>(i) * epn;
      std::copy(local, local + epn, ord);
      std::sort(ord, ord + epn, before);
      int64_t* rem = sc->greedy_rem.data() + static_cast<size_t>(i) * epn;
      for (int32_t g = 0; g < epn; ++g) rem[g] = keep[ord[g]];
    }
  }
  // Index bits for a rank; 64-bit keys when the values leave room for them.
  int32_t bits = 0;
  while ((1 << bits) < R) ++bits;
  int32_t value_bits = 0;
  while (value_bits < 63 && (top >> value_bits) != 0) ++value_bits;
  if (value_bits + bits <= 64) {
    return GreedyMoves(in, sc, dec, num_donors, num_receivers, bits, &sc->greedy_keys,
                       presorted, cap);
  }
  return GreedyMoves(in, sc, dec, num_donors, num_receivers, bits, &sc->greedy_keys_w,
                     presorted, cap);
}

absl::Status DecideMoonEPGreedy(const PolicyInput& in, PolicyScratch* sc, Decisions* dec) {
  const PlannerConfig& c = *in.config;
  if (c.slots == 0 || c.num_ranks == 1) return absl::OkStatus();
  BalancedCapacities(c, in.home_load, in.total, &sc->cap);
  GreedyFill(in, sc->cap, sc, dec);
  return absl::OkStatus();
}

// FasterMoE dynamic shadowing: broadcast the hottest experts to every rank, each rank then computes
// its own tokens of a shadowed expert; keep adding while the modelled step time falls. Modelled
// time = max rank load * compute_s_per_token + shadowed experts * expert_bytes * s_per_byte (a
// pipelined broadcast costs about one expert's bytes over a link).
absl::Status DecideFasterMoEShadow(const PolicyInput& in, PolicyScratch* sc, Decisions* dec) {
  const PlannerConfig& c = *in.config;
  const int32_t R = c.num_ranks, E = c.num_experts, S = c.slots;
  if (S == 0 || R == 1) return absl::OkStatus();
  sc->order.resize(E);
  for (int32_t e = 0; e < E; ++e) sc->order[e] = e;
  std::sort(sc->order.begin(), sc->order.end(), [&](int32_t a, int32_t b) {
    return in.totals[a] != in.totals[b] ? in.totals[a] > in.totals[b] : a < b;
  });
  sc->load.assign(in.home_load.begin(), in.home_load.end());
  sc->remaining.assign(R, 0);
  const double broadcast_s = static_cast<double>(c.expert_bytes) * c.shadow_broadcast_s_per_byte;
  int64_t max_load = *std::max_element(sc->load.begin(), sc->load.end());
  double time = static_cast<double>(max_load) * c.shadow_compute_s_per_token;
  for (int32_t k = 0; k < std::min(S, E); ++k) {
    const int32_t e = sc->order[k];
    const int32_t h = in.plan->home[e];
    if (in.totals[e] == 0) break;
    // Candidate loads: every other rank takes its own tokens of e.
    int64_t new_max = 0;
    for (int32_t d = 0; d < R; ++d) {
      const int64_t own = d == h ? 0 : in.Count(d, e);
      sc->remaining[d] = own;
      int64_t l = sc->load[d] + own;
      if (d == h) l -= in.totals[e] - in.Count(h, e);
      new_max = std::max(new_max, l);
    }
    const double new_time = static_cast<double>(new_max) * c.shadow_compute_s_per_token +
                            (k + 1) * broadcast_s;
    if (!(new_time < time)) break;
    time = new_time;
    for (int32_t d = 0; d < R; ++d) {
      if (d == h || sc->remaining[d] == 0) continue;
      sc->load[d] += sc->remaining[d];
      sc->load[h] -= sc->remaining[d];
      if (!dec->Move(d, e, sc->remaining[d], S)) {
        return Internal("fastermoe-shadow: rank %d ran out of slots", d);
      }
    }
  }
  return absl::OkStatus();
}

// Tests only: every slot of every rank holds a distinct foreign expert (slot s of rank d takes
// group s % epn of rank (d + 1 + s / epn) % R), and each expert's tokens are split evenly over
// its home and all its replicas, so plans have many replicas and split experts for any counts.
// One-rank mode (config.test_home_replicas, R == 1, Plan::home_replicas): slot s holds the rank's
// own home group s (s < epn), split evenly with the home group the same way.
absl::Status DecideTestForceReplicas(const PolicyInput& in, PolicyScratch* sc, Decisions* dec) {
  const PlannerConfig& c = *in.config;
  const int32_t R = c.num_ranks, E = c.num_experts, S = c.slots, epn = E / R;
  sc->remaining.assign(E, 1);  // holders per expert
  if (in.plan->home_replicas) {
    for (int32_t s = 0; s < std::min(S, epn); ++s) {
      const int32_t e = in.plan->local_experts[s];
      dec->slot_expert[s] = e;
      dec->slots_used[0] = s + 1;
      ++sc->remaining[e];
    }
  }
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < S; ++s) {
      if (s / epn >= R - 1) break;
      const int32_t src = (d + 1 + s / epn) % R;
      const int32_t e = in.plan->local_experts[static_cast<size_t>(src) * epn + s % epn];
      const size_t i = static_cast<size_t>(d) * S + s;
      dec->slot_expert[i] = e;
      dec->slots_used[d] = s + 1;
      ++sc->remaining[e];
    }
  }
  // Shares: holder j of k gets t / k (+1 for the first t % k); the home is holder 0.
  sc->order.assign(E, 1);  // next holder index per expert
  for (int32_t e = 0; e < E; ++e) {
    const int64_t t = in.totals[e], k = sc->remaining[e];
    dec->home_keep[e] = t / k + (0 < t % k ? 1 : 0);
  }
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < dec->slots_used[d]; ++s) {
      const size_t i = static_cast<size_t>(d) * S + s;
      const int32_t e = dec->slot_expert[i];
      const int64_t t = in.totals[e], k = sc->remaining[e];
      const int32_t j = sc->order[e]++;
      dec->slot_amount[i] = t / k + (j < t % k ? 1 : 0);
    }
  }
  return absl::OkStatus();
}

}  // namespace moonep::planner
