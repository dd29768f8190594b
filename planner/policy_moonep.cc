// Policy `moonep`: perfect balance with the fewest replicas (heuristic; see docs/planner.md).
//
// Donors are ranks whose home load exceeds their capacity; receivers have room. Each step takes
// the largest item on either side -- a donor chunk (the donor's excess, bounded by its largest
// remaining expert) or a receiver's room -- and fits it best on the other side:
//   * a room no larger than the largest chunk is filled whole by one replica: from a donor expert
//     whose chunk fits it exactly when there is one (that closes both), else from the largest
//     chunk (big rooms to big donors: filling the largest rooms from the tightest chunks left the
//     hottest expert the many small rooms, e.g. 52 replicas of it at R=4096, E=8192, Zipf 0.3,
//     where this rule makes 17-24 and fewer replicas in all);
//   * otherwise the largest chunk goes whole into the receiver whose room fits it most tightly.
// Every step closes a chunk or a room, so replicas <= chunks + receivers - exact matches. Ties go
// to the same node as the other side (topology), then to the lower rank. When the slot limit makes
// the perfect capacities unreachable, a binary search finds the smallest maximum load the same
// procedure reaches.
#include <algorithm>
#include <cassert>

#include "moonep/core/status.h"
#include "planner/plan_builder.h"
#include "planner/planner.h"
#include "planner/policy.h"

namespace moonep::planner {
namespace {

struct Balancer {
  const PolicyInput& in;
  PolicyScratch& sc;
  Decisions& dec;
  int32_t R, S, epn, rpn;
  bool worst_fit;  // fallback variant: chunks go to the largest room instead of the tightest
  // Donors: sc.order2[i] = rank, sc.excess[i] = excess; their experts at sc.order[i*epn..],
  // sorted by remaining tokens, descending.
  int32_t num_donors = 0;
  int32_t mark = 0;  // FillRoom's stamp in sc.donor_mark of donors homing an expert the room holds
  // Each donor's chunk, and the open donors (chunk > 0: excess left) ordered by chunk, largest
  // first (ties: lower index), at positions [0, open_donors), with their chunks mirrored in that
  // order and each donor's position in it. Chunks only fall, so an Apply moves its donor toward
  // the end, and out of the order when it closes; a room's search walks the order from the
  // largest chunk and stops at the first chunk that cannot win.
  int32_t open_donors = 0;
  std::vector<int64_t>& chunk = sc.donor_chunk;
  std::vector<int32_t>& by_chunk = sc.donor_by_chunk;
  std::vector<int64_t>& sorted_chunk = sc.donor_sorted_chunk;
  std::vector<int32_t>& chunk_pos = sc.donor_chunk_pos;

  // Counting filter over the values a room could match exactly: every donor's excess and every
  // remaining token count of its experts (counts per hash bucket). A room whose size hashes to
  // an empty bucket has no exact fit, so FillRoom can search by largest chunk and stop early.
  std::vector<int32_t>& fit_count = sc.exact_fit_count;
  uint32_t fit_shift = 64;
  size_t FitBucket(int64_t v) const {
    return static_cast<size_t>((static_cast<uint64_t>(v) * 0x9E3779B97F4A7C15ull) >> fit_shift);
  }
  void FitAdd(int64_t v, int32_t delta) { fit_count[FitBucket(v)] += delta; }
  bool MayFitExactly(int64_t y) const { return fit_count[FitBucket(y)] != 0; }
  void SetExcess(int32_t i, int64_t x) {
    FitAdd(sc.excess[i], -1);
    sc.excess[i] = x;
    FitAdd(x, 1);
  }

  int32_t Node(int32_t rank) const { return rpn > 0 ? rank / rpn : rank; }
  // Donor index of expert e's home rank, -1 when that rank is no donor.
  int32_t DonorOf(int32_t e) const { return sc.donor_index[in.plan->home[e]]; }
  int64_t Remaining(int32_t e) const { return dec.home_keep[e]; }
  int32_t* Experts(int32_t i) { return sc.order.data() + static_cast<size_t>(i) * epn; }
  // Remaining tokens of Experts(i), mirrored in place (contiguous for FillRoom's scan).
  int64_t* Rem(int32_t i) { return sc.donor_rem.data() + static_cast<size_t>(i) * epn; }
  bool CanTake(int32_t d, int32_t e, bool closes_room) const {
    const int32_t free = S - dec.slots_used[d];
    if (dec.SlotOf(d, e, S) >= 0) return true;
    // A replica that leaves room behind needs a second free slot for what fills the rest.
    return closes_room ? free >= 1 : free >= 2;
  }

  void Init(absl::Span<const int64_t> cap) {
    sc.order2.clear();
    sc.excess.clear();
    sc.rooms.clear();
    sc.donor_index.resize(R);
    for (int32_t d = 0; d < R; ++d) {
      const int64_t diff = in.home_load[d] - cap[d];
      sc.donor_index[d] = diff > 0 ? static_cast<int32_t>(sc.order2.size()) : -1;
      if (diff > 0) {
        sc.order2.push_back(d);
        sc.excess.push_back(diff);
      } else if (diff < 0 && S > 0) {
        sc.rooms.push_back({-diff, d});
      }
    }
    num_donors = static_cast<int32_t>(sc.order2.size());
    sc.order.resize(static_cast<size_t>(num_donors) * epn);
    sc.donor_rem.resize(static_cast<size_t>(num_donors) * epn);
    // Each donor's experts by decreasing total, ties to the lower id (remaining = total before
    // any move): an insertion sort that carries the totals along (they are donor_rem).
    const int64_t* totals = in.totals.data();
    for (int32_t i = 0; i < num_donors; ++i) {
      const int32_t* local = in.plan->local_experts.data() + static_cast<size_t>(sc.order2[i]) * epn;
      int32_t* ex = Experts(i);
      int64_t* rem = Rem(i);
      for (int32_t p = 0; p < epn; ++p) {
        const int32_t e = local[p];
        const int64_t v = totals[e];
        int32_t q = p;
        for (; q > 0 && (rem[q - 1] < v || (rem[q - 1] == v && ex[q - 1] > e)); --q) {
          ex[q] = ex[q - 1];
          rem[q] = rem[q - 1];
        }
        ex[q] = e;
        rem[q] = v;
      }
    }
    sc.donor_sorted.assign(sc.order.begin(), sc.order.end());
    sc.donor_mark.assign(num_donors, 0);
    sc.donor_node.resize(num_donors);
    for (int32_t i = 0; i < num_donors; ++i) sc.donor_node[i] = Node(sc.order2[i]);
    mark = 0;
    std::sort(sc.rooms.begin(), sc.rooms.end(), RoomOrder());
    sc.rooms_sorted.assign(sc.rooms.begin(), sc.rooms.end());  // GreedyFill's receivers (cross-check)
    chunk.resize(num_donors);
    by_chunk.resize(num_donors);
    for (int32_t i = 0; i < num_donors; ++i) {
      chunk[i] = Chunk(i);
      by_chunk[i] = i;
    }
    std::sort(by_chunk.begin(), by_chunk.end(), [this](int32_t a, int32_t b) {
      return chunk[a] != chunk[b] ? chunk[a] > chunk[b] : a < b;
    });
    sorted_chunk.resize(num_donors);
    chunk_pos.resize(num_donors);
    open_donors = 0;
    for (int32_t p = 0; p < num_donors; ++p) {
      sorted_chunk[p] = chunk[by_chunk[p]];
      chunk_pos[by_chunk[p]] = p;
      open_donors += sorted_chunk[p] > 0;
    }
    // About 16 buckets per value: a false "maybe" (the full scan) on ~6% of rooms.
    const size_t values = static_cast<size_t>(num_donors) * (epn + 1);
    int32_t bits = 4;
    while ((size_t{1} << bits) < 16 * values) ++bits;
    fit_shift = 64 - bits;
    // All zero between runs (TryBalance ends with FilterAll(-1)): cleared only when it resizes.
    if (fit_count.size() != size_t{1} << bits) fit_count.assign(size_t{1} << bits, 0);
    assert(std::all_of(fit_count.begin(), fit_count.end(), [](int32_t n) { return n == 0; }));
    FilterAll(1);
  }
  // Adds `delta` for every value the filter counts: the donors' excesses and their experts'
  // remaining tokens (every change to them goes through SetExcess or Apply, which keep the
  // filter equal to these counts, so FilterAll(-1) leaves it all zero).
  void FilterAll(int32_t delta) {
    for (int32_t i = 0; i < num_donors; ++i) {
      FitAdd(sc.excess[i], delta);
      for (int32_t p = 0; p < epn; ++p) FitAdd(Rem(i)[p], delta);
    }
  }

  // Donor i's chunk after a move, and its place in the order: past every donor now ahead of it
  // (all of them when it closes; it then leaves the order).
  void Update(int32_t i) {
    const int64_t c = sc.excess[i] == 0 ? 0 : Chunk(i);
    assert(c <= chunk[i]);
    chunk[i] = c;
    int32_t* order = by_chunk.data();
    int64_t* val = sorted_chunk.data();
    int32_t* pos = chunk_pos.data();
    const int32_t last = open_donors - 1;  // (a local: the stores below cannot change it)
    int32_t p = pos[i];
    assert(p <= last);  // only open donors move
    for (; p < last; ++p) {
      const int64_t b = val[p + 1];
      const int32_t k = order[p + 1];
      if (c > b || (c == b && i < k)) break;
      order[p] = k;
      val[p] = b;
      pos[k] = p;
    }
    order[p] = i;
    val[p] = c;
    pos[i] = p;
    if (c == 0) --open_donors;
  }

  static bool RoomLess(const PolicyScratch::Room& a, const PolicyScratch::Room& b) {
    return a.room != b.room ? a.room < b.room : a.rank < b.rank;
  }
  // RoomLess as a function object, so that std::sort and the binary searches inline it.
  struct RoomOrder {
    bool operator()(const PolicyScratch::Room& a, const PolicyScratch::Room& b) const {
      return RoomLess(a, b);
    }
  };

  // Moves `amount` of donor i's expert at position j to receiver at rooms[k]; keeps orders.
  bool Apply(int32_t i, int32_t j, size_t k, int64_t amount) {
    int32_t* ex = Experts(i);
    const int32_t e = ex[j];
    const int32_t d = sc.rooms[k].rank;
    if (!dec.Move(d, e, amount, S)) return false;
    SetExcess(i, sc.excess[i] - amount);
    // Expert lost tokens: bubble it toward the end to keep the descending order.
    int64_t* rem = Rem(i);
    FitAdd(rem[j], -1);
    rem[j] = Remaining(e);
    FitAdd(rem[j], 1);
    {  // (The moving entry stays in registers: pairwise swaps in memory stall on forwarding.)
      const int64_t r = rem[j];
      int32_t p = j;
      for (; p + 1 < epn; ++p) {
        const int64_t b = rem[p + 1];
        if (r > b || (r == b && e < ex[p + 1])) break;
        ex[p] = ex[p + 1];
        rem[p] = b;
      }
      ex[p] = e;
      rem[p] = r;
    }
    Update(i);
    sc.rooms[k].room -= amount;
    if (sc.rooms[k].room == 0) {
      sc.rooms.erase(sc.rooms.begin() + k);
    } else {
      for (size_t p = k; p > 0 && RoomLess(sc.rooms[p], sc.rooms[p - 1]); --p) {
        std::swap(sc.rooms[p], sc.rooms[p - 1]);
      }
    }
    return true;
  }

  // Donor i's chunk: its excess, bounded by its largest remaining expert.
  int64_t Chunk(int32_t i) { return std::min(sc.excess[i], Remaining(Experts(i)[0])); }

  // One step's move: `amount` tokens of donor i's expert at position j to the receiver at
  // rooms[k]. `beyond_excess` (FillRoom's slot-bound fallback): the amount exceeds the donor's
  // excess, and its rank becomes a receiver of the difference.
  struct Step {
    int32_t i = -1, j = 0;
    size_t k = 0;
    int64_t amount = 0;
    bool beyond_excess = false;
  };

  // Each step chooses a move (PlaceChunk or FillRoom) and makes it.
  bool Run() {
    while (true) {
      if (open_donors == 0) return true;  // all excess placed
      const int32_t best = by_chunk[0];
      const int64_t best_chunk = sorted_chunk[0];
      if (sc.rooms.empty()) return false;
      Step step;
      if (!(best_chunk < sc.rooms.back().room && PlaceChunk(best, best_chunk, &step)) &&
          !FillRoom(sc.rooms.size() - 1, &step)) {
        return false;
      }
      const int64_t x = sc.excess[step.i];
      if (step.beyond_excess) SetExcess(step.i, step.amount);  // Apply takes it all
      if (!Apply(step.i, step.j, step.k, step.amount)) return false;
      if (step.beyond_excess) {
        const PolicyScratch::Room room{step.amount - x, sc.order2[step.i]};
        sc.rooms.insert(std::upper_bound(sc.rooms.begin(), sc.rooms.end(), room, RoomOrder()), room);
      }
    }
  }

  // FillRoom's candidate ranking for room y on rank d: each donor i gives its key (see Consider)
  // and the largest wins.
  struct RoomSearch {
    int64_t y;
    int32_t d, d_node;
    bool has_free;
    // The best key so far as two words: (exact << 56 | v) and (close << 33 | node << 32 | ~index).
    uint64_t best_fit = 0, best_tie = 0;
    int32_t bi = -1, bj = -1;
    int64_t BestV() const { return static_cast<int64_t>(best_fit & ((uint64_t{1} << 56) - 1)); }
  };
  // Ranks donor i for the room: key (exact fit v == y, v, closes the donor's excess, same node,
  // lower index), largest wins. Exact fits all have v == y, so among them the key orders by close,
  // node, index; among inexact ones by the largest v first: the order of the rules above.
  void Consider(int32_t i, RoomSearch* q) {
    const int64_t y = q->y;
    // chunk = min(excess, largest remaining expert): below y, the donor cannot fill the room.
    if (chunk[i] < y) return;
    const int64_t x = sc.excess[i];
    const int64_t* rem = Rem(i);
    // Last expert (smallest) whose remaining tokens are >= y.
    int32_t lo = 1;
    while (lo < epn && rem[lo] >= y) ++lo;
    int32_t j = lo - 1;
    if (sc.donor_mark[i] == mark) {
      // Prefer an expert d already holds (no new slot), else the tightest one.
      const int32_t* ex = Experts(i);
      for (int32_t p = 0; p < lo; ++p) {
        if (dec.SlotOf(q->d, ex[p], S) >= 0) {
          j = p;
          break;
        }
      }
      if (!CanTake(q->d, ex[j], true)) return;
    } else if (!q->has_free) {
      return;
    }
    const int64_t v = std::min(x, rem[j]);
    const uint64_t fit = (static_cast<uint64_t>(v == y) << 56) | static_cast<uint64_t>(v);  // v < 2^52
    if (fit < q->best_fit) return;  // loses whatever its tie-break key (most candidates)
    const bool close = x == y;
    const bool node = sc.donor_node[i] == q->d_node;
    const uint64_t tie = (static_cast<uint64_t>(close) << 33) | (static_cast<uint64_t>(node) << 32) |
                         (0xffffffffu - static_cast<uint32_t>(i));
    if (fit > q->best_fit || tie > q->best_tie) {
      q->best_fit = fit;
      q->best_tie = tie;
      q->bi = i;
      q->bj = j;
    }
  }

  // Fills the room at rooms[k] whole from the donor expert with the tightest chunk >= room (the
  // move goes to *step; false when no donor can).
  bool FillRoom(size_t k, Step* step) {
    const int64_t y = sc.rooms[k].room;
    const int32_t d = sc.rooms[k].rank;
    // Donors homing an expert that d already holds ("marked") are the only ones whose choice
    // depends on d's slots (the held expert is preferred and needs no free slot); the others take
    // their tightest expert and need a free slot on d.
    ++mark;
    const int32_t* held = dec.slot_expert.data() + static_cast<size_t>(d) * S;
    for (int32_t s = 0; s < dec.slots_used[d]; ++s) {
      const int32_t i = DonorOf(held[s]);
      if (i >= 0) sc.donor_mark[i] = mark;
    }
    RoomSearch q{y, d, Node(d), dec.slots_used[d] < S};
    const int32_t* order = by_chunk.data();
    const int64_t* val = sorted_chunk.data();
    if (MayFitExactly(y)) {
      // Some donor may fit exactly: rank every donor whose chunk reaches the room (the others
      // cannot fill it).
      for (int32_t p = 0; p < open_donors && val[p] >= y; ++p) Consider(order[p], &q);
    } else {
      // No exact fit: the winner has the largest v among the candidates, and v <= chunk. Marked
      // donors first, then the others from the largest chunk down: only donors whose chunk is at
      // least y and the best v so far can win (equal ones still can, on the tie-break), so the
      // walk stops at the first chunk below that bound (it only rises as donors are ranked).
      for (int32_t s = 0; s < dec.slots_used[d]; ++s) {
        const int32_t i = DonorOf(held[s]);
        if (i >= 0) Consider(i, &q);  // a donor marked twice ranks the same twice
      }
      if (q.has_free) {
        for (int32_t p = 0; p < open_donors && val[p] >= y && val[p] >= q.BestV(); ++p) {
          const int32_t i = order[p];
          if (sc.donor_mark[i] != mark) Consider(i, &q);
        }
      }
    }
#ifndef NDEBUG
    {  // Debug builds (and the fuzz target) check the pruned search against ranking every donor.
      RoomSearch all{y, d, Node(d), dec.slots_used[d] < S};
      for (int32_t i = 0; i < num_donors; ++i) Consider(i, &all);
      assert(all.bi == q.bi && all.bj == q.bj && all.best_fit == q.best_fit && all.best_tie == q.best_tie);
    }
#endif
    int32_t bi = q.bi, bj = q.bj;
    if (bi >= 0) {
      *step = {bi, bj, k, y, false};
      return true;
    }
    // Slot-bound fallback: no donor has y to spare, so a donor with an expert of >= y tokens gives
    // y anyway (more than its excess) and becomes a receiver of what it over-gave.
    for (int32_t i = 0; i < num_donors; ++i) {
      if (sc.excess[i] == 0 || (bi >= 0 && sc.excess[i] <= sc.excess[bi])) continue;
      const int32_t* ex = Experts(i);
      for (int32_t j = 0; j < epn && Remaining(ex[j]) >= y; ++j) {
        if (CanTake(d, ex[j], true)) {
          bi = i;
          bj = j;
          break;
        }
      }
    }
    if (bi < 0) return false;
    *step = {bi, bj, k, y, true};
    return true;
  }

  // Places donor i's chunk whole into the receiver whose room fits it most tightly; when no room
  // can take it whole, fills the largest room that can be closed by part of it (the move goes to
  // *step; false when no room can take any of it).
  bool PlaceChunk(int32_t i, int64_t chunk, Step* step) {
    const int32_t e = Experts(i)[0];
    const int32_t h = sc.order2[i];
    const PolicyScratch::Room key{chunk, -1};
    const size_t first = std::lower_bound(sc.rooms.begin(), sc.rooms.end(), key, RoomOrder()) - sc.rooms.begin();
    if (worst_fit) {
      for (size_t k = sc.rooms.size(); k-- > first;) {
        if (CanTake(sc.rooms[k].rank, e, sc.rooms[k].room == chunk)) {
          *step = {i, 0, k, chunk, false};
          return true;
        }
      }
    }
    size_t pick = sc.rooms.size();
    for (size_t k = first; k < sc.rooms.size(); ++k) {
      if (pick < sc.rooms.size() && sc.rooms[k].room != sc.rooms[pick].room) break;
      const bool closes = sc.rooms[k].room == chunk;
      if (!CanTake(sc.rooms[k].rank, e, closes)) continue;
      if (pick == sc.rooms.size()) {
        pick = k;
        if (Node(sc.rooms[k].rank) == Node(h)) break;
      } else if (Node(sc.rooms[k].rank) == Node(h)) {
        pick = k;
        break;
      }
    }
    if (pick < sc.rooms.size()) {
      *step = {i, 0, pick, chunk, false};
      return true;
    }
    for (size_t k = first; k-- > 0;) {
      if (CanTake(sc.rooms[k].rank, e, true)) {
        *step = {i, 0, k, sc.rooms[k].room, false};
        return true;
      }
    }
    return false;
  }
};

bool TryBalance(const PolicyInput& in, absl::Span<const int64_t> cap, PolicyScratch* sc,
                Decisions* dec, bool worst_fit) {
  const PlannerConfig& c = *in.config;
  dec->Reset(c.num_ranks, c.num_experts, c.slots, in.totals);
  Balancer b{in, *sc, *dec, c.num_ranks, c.slots, c.num_experts / c.num_ranks, c.ranks_per_node,
             worst_fit};
  b.Init(cap);
  const bool balanced = b.Run();
  b.FilterAll(-1);  // the exact-fit filter back to all zero for the next Init
  return balanced;
}

// The best-fit procedure; when the slot limit defeats it, two fallbacks that spend slots
// differently (largest room first; the published greedy order).
bool TryAll(const PolicyInput& in, absl::Span<const int64_t> cap, PolicyScratch* sc, Decisions* dec) {
  return TryBalance(in, cap, sc, dec, false) || TryBalance(in, cap, sc, dec, true) ||
         GreedyFill(in, cap, sc, dec);
}

int32_t Replicas(const Decisions& dec) {
  int32_t n = 0;
  for (int32_t u : dec.slots_used) n += u;
  return n;
}

// Goals 2 and 3 as a guarantee against the published greedy on the same capacities: when greedy
// also balances perfectly, its decisions replace ours if they need fewer replicas, or as many
// replicas and fewer travelling rows (more rows computed on their source rank). Ties keep ours.
void KeepBetterOfGreedy(const PolicyInput& in, PolicyScratch* sc, Decisions* dec) {
  if (!GreedyFill(in, sc->cap, sc, &sc->alt, /*presorted=*/true)) return;
  const int32_t mine = Replicas(*dec), greedy = Replicas(sc->alt);
  bool take = greedy < mine;
  if (greedy == mine) {
    int64_t local_mine = 0, local_greedy = 0;
    LocalRows(in, *dec, sc->alt, sc, &local_mine, &local_greedy);
    take = local_greedy > local_mine;
    sc->placement = take ? 1 : 0;  // LocalRows placed the decisions kept: FinalizeHolders reuses it
  }
  if (take) std::swap(*dec, sc->alt);
}

// The levels a plan is searched at: caps floor(L * w_d / w_max) for the fastest rank's cap L, from
// `Top()`, where every cap holds its home load (no replica needed), down. L is kept in 128 bits: a
// slow rank's home load (< 2^52) times w_max / w_d (up to 2^20) can pass 2^63; a cap past
// INT64_MAX (far above the total) is clamped to it.
struct Levels {
  const PolicyInput& in;
  PolicyScratch& sc;
  std::vector<int64_t>& w = sc.weights;
  int64_t w_max = 1;

  Levels(const PolicyInput& input, PolicyScratch* scratch) : in(input), sc(*scratch) {
    SpeedWeights(*in.config, &w);
    w_max = *std::max_element(w.begin(), w.end());
  }
  // The fastest rank's cap at which every rank's cap holds its home load.
  __int128 Top() const {
    __int128 top = 0;
    for (size_t d = 0; d < w.size(); ++d) {
      top = std::max(top, (static_cast<__int128>(in.home_load[d]) * w_max + w[d] - 1) / w[d]);
    }
    return top;
  }
  // A rank's load in the fastest rank's tokens (rounded up).
  __int128 Level(size_t d, int64_t load) const {
    return (static_cast<__int128>(load) * w_max + w[d] - 1) / w[d];
  }
  // The capacities of level L, in sc.remaining.
  absl::Span<const int64_t> Caps(__int128 L) {
    std::vector<int64_t>& cap = sc.remaining;
    cap.resize(w.size());
    for (size_t d = 0; d < w.size(); ++d) {
      cap[d] = static_cast<int64_t>(std::min<__int128>(L * w[d] / w_max, INT64_MAX));
    }
    return cap;
  }
};

// What a decision set costs when replicas are weighed (PlannerConfig::replica_cost_*): the
// highest rank level, the highest rank transfer cost and (row costs set) the highest rank row
// cost, all in tokens of the fastest rank.
struct WeighedCost {
  __int128 level = 0, transfers = 0, rows = 0;
  __int128 total() const { return level + transfers + rows; }
};

// Rows in the objective: the rows a plan moves, from its decisions. Receives are exact: each
// replicated expert's holders are placed as FinalizePlan places them (a replica on rank d at its
// own source's first position or after the previous replica, whichever is later, shifted left
// when the last runs past the end; the home keeps the rest), and a holder receives the positions
// it computes from other sources, inside its node or across. Sends: a source sends each token it
// does not compute itself on the class of the link to the expert's home, except the home's own
// tokens, which go to the replicas that took them (exact there); a replica's other tokens leave
// their sources as if for the home.
struct RowEstimate {
  const PolicyInput& in;
  int32_t rpn;
  int32_t Node(int32_t r) const { return rpn > 0 ? r / rpn : r; }
  int32_t Class(int32_t a, int32_t b) const { return Node(a) != Node(b) ? 1 : 0; }
  // Positions of e's canonical order from d's own source, [r[0], r[1]), and from d's node,
  // [r[2], r[3]); `col` is Col(e, d) when known (-1: look it up).
  void Ranges(int32_t e, int32_t d, int64_t r[4], int64_t col = -1) const {
    r[0] = col >= 0 ? col : in.Col(e, d);
    r[1] = r[0] + in.Count(d, e);
    if (rpn <= 1) {
      r[2] = r[0];
      r[3] = r[1];
      return;
    }
    const int32_t lo = d / rpn * rpn, hi = std::min(lo + rpn, in.config->num_ranks);
    r[2] = in.Col(e, lo);
    r[3] = in.Col(e, hi);
  }
  static int64_t Overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
    return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0));
  }
  // rows[d * 4 + 0/1] += sign * what holder d, whose own and node ranges are `r` (Ranges), receives
  // to compute positions [s0, s1) of e: those from other sources of its node (intra) and from
  // other nodes (inter). Additive over disjoint ranges: the home's receives are those of [0, N)
  // less those of each replica's range.
  static void Receive(int32_t d, const int64_t r[4], int64_t s0, int64_t s1, int64_t sign,
                      int64_t* rows) {
    const int64_t node = Overlap(s0, s1, r[2], r[3]);
    rows[static_cast<size_t>(d) * 4] += sign * (node - Overlap(s0, s1, r[0], r[1]));
    rows[static_cast<size_t>(d) * 4 + 1] += sign * (s1 - s0 - node);
  }
  // The plan with no replica: every source sends its tokens of an expert homed elsewhere to the
  // home. The home's receives from its node's range and its own (O(E) look-ups); a source's sends
  // from its row's sum (the planner's pass over counts adds it when rows are weighed) less its
  // tokens of the experts homed on its node, intra unless homed on itself (O(R * E / nodes)).
  void Base(PolicyScratch* sc) const {
    const PlannerConfig& c = *in.config;
    const int32_t R = c.num_ranks, E = c.num_experts;
    const std::vector<int32_t>& home = in.plan->home;
    std::vector<int64_t>& rows = sc->weigh_rows_base;
    rows.assign(static_cast<size_t>(R) * 4, 0);
    int64_t r[4];
    for (int32_t e = 0; e < E; ++e) {
      Ranges(e, home[e], r);
      Receive(home[e], r, 0, in.totals[e], 1, rows.data());
    }
    // The experts homed on each node (each rank, when flat), as CSR.
    const int32_t nodes = rpn > 0 ? (R + rpn - 1) / rpn : R;
    std::vector<int32_t>& begin = sc->weigh_rep_begin;
    std::vector<int32_t>& fill = sc->weigh_rep_fill;
    std::vector<int32_t>& list = sc->weigh_rep_rank;
    begin.assign(static_cast<size_t>(nodes) + 1, 0);
    for (int32_t e = 0; e < E; ++e) ++begin[Node(home[e]) + 1];
    for (int32_t k = 0; k < nodes; ++k) begin[k + 1] += begin[k];
    fill.assign(begin.begin(), begin.end() - 1);
    list.resize(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) list[fill[Node(home[e])]++] = e;
    // Without counts (Decide), Count's even split: source s has t / R of each total t, plus one
    // where s < t % R; `above[s]` counts the totals with t % R > s.
    int64_t even = 0;
    std::vector<int64_t>& above = sc->weigh_rows;
    if (in.counts == nullptr) {
      above.assign(static_cast<size_t>(R) + 1, 0);
      for (int32_t e = 0; e < E; ++e) {
        even += in.totals[e] / R;
        ++above[in.totals[e] % R];
      }
      for (int32_t x = R - 1; x >= 0; --x) above[x] += above[x + 1];  // now: t % R >= x
    }
    for (int32_t s = 0; s < R; ++s) {
      int64_t sum = 0, node = 0, own = 0;
      if (in.row_sums != nullptr) {
        sum = in.row_sums[s];
      } else if (in.counts != nullptr) {
        const int64_t* row = in.counts + static_cast<size_t>(s) * E;
        for (int32_t e = 0; e < E; ++e) sum += row[e];
      } else {
        sum = even + above[s + 1];
      }
      const int32_t k = Node(s);
      for (int32_t i = begin[k]; i < begin[k + 1]; ++i) {
        const int64_t n = in.Count(s, list[i]);
        node += n;
        if (home[list[i]] == s) own += n;
      }
      rows[static_cast<size_t>(s) * 4 + 2] += node - own;
      rows[static_cast<size_t>(s) * 4 + 3] += sum - node;
    }
  }
};

// The highest rank row cost of per-rank rows (RowEstimate's layout), in tokens, rounded up.
__int128 RowCost(const PlannerConfig& c, const std::vector<int64_t>& rows) {
  __int128 worst = 0;
  for (size_t r = 0; r < rows.size() / 4; ++r) {
    const int64_t* k = rows.data() + r * 4;
    worst = std::max({worst, static_cast<__int128>(std::max(k[0], k[2])) * c.row_cost_intra,
                      static_cast<__int128>(std::max(k[1], k[3])) * c.row_cost_inter});
  }
  return (worst + kRowCostScale - 1) / kRowCostScale;
}

// The rows `dec` moves per rank (RowEstimate; sc->weigh_rows_base must hold the rows of the plan
// with no replica), in sc->weigh_rows.
const std::vector<int64_t>& RowsOf(const PolicyInput& in, const Decisions& dec, PolicyScratch* sc) {
  const PlannerConfig& c = *in.config;
  const int32_t R = c.num_ranks, S = c.slots, E = c.num_experts;
  const RowEstimate est{in, c.ranks_per_node};
  const std::vector<int32_t>& home = in.plan->home;
  std::vector<int64_t>& rows = sc->weigh_rows;
  rows = sc->weigh_rows_base;
  // Each expert's replicas by increasing rank (CSR over experts).
  std::vector<int32_t>& begin = sc->weigh_rep_begin;
  begin.assign(static_cast<size_t>(E) + 1, 0);
  for (int32_t r = 0; r < R; ++r) {
    for (int32_t s = 0; s < dec.slots_used[r]; ++s) ++begin[dec.slot_expert[static_cast<size_t>(r) * S + s] + 1];
  }
  for (int32_t e = 0; e < E; ++e) begin[e + 1] += begin[e];
  const size_t n_rep = static_cast<size_t>(begin[E]);
  std::vector<int32_t>& fill = sc->weigh_rep_fill;
  fill.assign(begin.begin(), begin.end() - 1);
  std::vector<int32_t>& rank = sc->weigh_rep_rank;
  std::vector<int64_t>& start = sc->weigh_rep_start;
  std::vector<int64_t>& end = sc->weigh_rep_end;
  std::vector<int64_t>& col = sc->weigh_rep_col;
  col.resize(n_rep);
  rank.resize(n_rep);
  start.resize(n_rep);
  end.resize(n_rep);
  for (int32_t r = 0; r < R; ++r) {
    for (int32_t s = 0; s < dec.slots_used[r]; ++s) {
      const size_t i = static_cast<size_t>(r) * S + s;
      const int32_t q = fill[dec.slot_expert[i]]++;
      rank[q] = r;
      end[q] = dec.slot_amount[i];  // the amount, until placed
    }
  }
  for (int32_t e = 0; e < E; ++e) {
    const int32_t q0 = begin[e], n = begin[e + 1] - q0;
    if (n == 0) continue;
    const int32_t h = home[e];
    for (int32_t q = q0; q < q0 + n; ++q) col[q] = in.Col(e, rank[q]);
    LayReplicas(in.totals[e], col.data() + q0, end.data() + q0, start.data() + q0, end.data() + q0, n);
    int64_t hr[4], dr[4];
    est.Ranges(e, h, hr);
    for (int32_t q = q0; q < q0 + n; ++q) {
      const int32_t d = rank[q];
      est.Ranges(e, d, dr, col[q]);
      RowEstimate::Receive(h, hr, start[q], end[q], -1, rows.data());
      RowEstimate::Receive(d, dr, start[q], end[q], 1, rows.data());
      // d computes its own tokens in its range; the home sends its own tokens in it to d.
      rows[static_cast<size_t>(d) * 4 + 2 + est.Class(d, h)] -= RowEstimate::Overlap(start[q], end[q], dr[0], dr[1]);
      rows[static_cast<size_t>(h) * 4 + 2 + est.Class(h, d)] += RowEstimate::Overlap(start[q], end[q], hr[0], hr[1]);
    }
  }
  return rows;
}

// The highest rank row cost of `dec`, in tokens of the fastest rank, rounded up.
__int128 RowCostOf(const PolicyInput& in, const Decisions& dec, PolicyScratch* sc) {
  return RowCost(*in.config, RowsOf(in, dec, sc));
}

WeighedCost CostOf(const Levels& lv, const Decisions& dec, PolicyScratch* sc) {
  const PlannerConfig& c = *lv.in.config;
  const int32_t R = c.num_ranks, S = c.slots, rpn = c.ranks_per_node;
  const auto node = [rpn](int32_t r) { return rpn > 0 ? r / rpn : r; };
  const std::vector<int32_t>& home = lv.in.plan->home;
  std::vector<int64_t>& load = sc->weigh_load;
  // [r * 8]: the reduce's hops in intra, in inter, out intra, out inter; then the prefetch's.
  std::vector<int32_t>& n = sc->weigh_count;
  std::vector<int32_t>& last = sc->weigh_last_holder;
  load.assign(lv.in.home_load.begin(), lv.in.home_load.end());  // each slot's tokens move below
  n.assign(static_cast<size_t>(R) * 8, 0);
  if (last.size() != static_cast<size_t>(c.num_experts)) last.assign(c.num_experts, -1);
  const auto hop = [&](int32_t from, int32_t to, int prefetch) {
    const int inter = node(from) != node(to);
    ++n[static_cast<size_t>(from) * 8 + 4 * prefetch + 2 + inter];
    ++n[static_cast<size_t>(to) * 8 + 4 * prefetch + inter];
  };
  // The chains' hops (transport/common/replica_chain.h): each expert's holders in increasing
  // rank; the prefetch from the home to the lowest, the reduce from the highest to the home.
  for (int32_t r = 0; r < R; ++r) {
    for (int32_t s = 0; s < dec.slots_used[r]; ++s) {
      const size_t i = static_cast<size_t>(r) * S + s;
      const int32_t e = dec.slot_expert[i];
      load[r] += dec.slot_amount[i];
      load[home[e]] -= dec.slot_amount[i];  // (Decisions::Move takes them from the home's share)
      if (last[e] >= 0) hop(last[e], r, 0);
      hop(last[e] >= 0 ? last[e] : home[e], r, 1);
      last[e] = r;
    }
  }
  for (int32_t r = 0; r < R; ++r) {
    for (int32_t s = 0; s < dec.slots_used[r]; ++s) {
      const int32_t e = dec.slot_expert[static_cast<size_t>(r) * S + s];
      if (last[e] != r) continue;  // not the highest holder
      hop(r, home[e], 0);
      last[e] = -1;
    }
  }
  WeighedCost cost;
  for (int32_t r = 0; r < R; ++r) {
    // Per link class, the most hops the rank sends or receives in the prefetch or the reduce.
    const int32_t* k = n.data() + static_cast<size_t>(r) * 8;
    cost.level = std::max(cost.level, lv.Level(r, load[r]));
    cost.transfers = std::max(
        {cost.transfers,
         static_cast<__int128>(std::max({k[0], k[2], k[4], k[6]})) * c.replica_cost_intra,
         static_cast<__int128>(std::max({k[1], k[3], k[5], k[7]})) * c.replica_cost_inter});
  }
  if (c.weighs_rows()) cost.rows = RowCostOf(lv.in, dec, sc);
  return cost;
}

// Replaces `dec` (the balanced or slot-bound plan) by the plan of least WeighedCost::total found
// among the plans for levels from its own up to where a level alone costs as much as it, each made
// with capacities Caps(L) (the cheaper of the procedure's and moonep-greedy's). The transfer cost
// falls, about as a step function, as the level rises, so only each step's lowest level can win: a
// branch and bound bisects the intervals (a, b] whose ends have different transfer costs, best
// first by the lower bound a + 1 + T(b) of any level inside (rows, when weighed, cost at least 0:
// they can fall as the level rises too, so they add nothing to the bound), and drops an interval
// once that bound reaches the best plan's cost or it is at most `tolerance` levels wide (its right
// end is then within that of the step's start). Every plan made on the way is a candidate, and so
// is no replica at all. Ties keep the earlier plan.
void WeighReplicas(const PolicyInput& in, PolicyScratch* sc, Decisions* dec) {
  const PlannerConfig& c = *in.config;
  Levels lv(in, sc);
  Decisions& best = sc->weigh_best;
  best = *dec;
  if (c.weighs_rows()) RowEstimate{in, c.ranks_per_node}.Base(sc);
  const WeighedCost first = CostOf(lv, *dec, sc);
  __int128 best_total = first.total();
  bool replaced = false;
  // Transfer cost of level L's plan (left in *dec), which becomes the best when it costs less; a
  // level the slot limit defeats gives false. The plan of a level is the cheaper of the
  // procedure's (TryAll) and the published greedy's on the same capacities: the greedy order
  // often needs a transfer less on the busiest rank.
  const auto transfers_at = [&](__int128 L, __int128* t) {
    absl::Span<const int64_t> caps = lv.Caps(L);
    // TryAll without its last fallback, the greedy order, which is the other candidate anyway.
    bool ok = TryBalance(in, caps, sc, dec, false) || TryBalance(in, caps, sc, dec, true);
    WeighedCost cost;
    if (ok) cost = CostOf(lv, *dec, sc);
    if (GreedyFill(in, caps, sc, &sc->alt)) {
      const WeighedCost g = CostOf(lv, sc->alt, sc);
      if (!ok || g.total() < cost.total()) {
        std::swap(*dec, sc->alt);
        cost = g;
        ok = true;
      }
    }
    if (!ok) return false;
    *t = cost.transfers;
    if (cost.total() < best_total) {
      best_total = cost.total();
      best = *dec;
      replaced = true;
    }
    return true;
  };
  // 1/64 of the cheaper transfer: the level is searched no finer than that.
  const int64_t cheaper = c.replica_cost_intra == 0   ? c.replica_cost_inter
                          : c.replica_cost_inter == 0 ? c.replica_cost_intra
                                                      : std::min(c.replica_cost_intra, c.replica_cost_inter);
  const __int128 tolerance = std::max<int64_t>(1, cheaper / 64);
  using Interval = PolicyScratch::WeighInterval;
  const auto bound = [](const Interval& x) { return x.a + 1 + x.tb; };
  // Min-heap by bound, then by a (std heaps are max-heaps: the comparison is reversed).
  const auto later = [&](const Interval& x, const Interval& y) {
    return bound(x) != bound(y) ? bound(x) > bound(y) : x.a > y.a;
  };
  std::vector<Interval>& heap = sc->weigh_intervals;
  heap.clear();
  // From the plan's own level: its caps there may be looser than the balanced ones (which keep
  // the floor or ceiling of the mean), and so need fewer replicas at the same level.
  const __int128 top = lv.Top(), a = first.level, b = std::min(top, best_total - 1);
  __int128 ta = first.transfers, tb = 0, t = 0;
  if (first.transfers > 0) {
    if (transfers_at(a, &t)) ta = std::min(ta, t);
    if (ta > 0 && b > a && transfers_at(b, &tb) && ta > tb) heap.push_back({a, ta, b, tb});
  }
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Interval iv = heap.back();
    heap.pop_back();
    if (bound(iv) >= best_total) break;  // and every interval left
    if (iv.b - iv.a <= tolerance) continue;
    const __int128 mid = iv.a + (iv.b - iv.a) / 2;
    __int128 tm = iv.ta;  // a level the slot limit defeats: no step starts left of it
    transfers_at(mid, &tm);
    for (const Interval& part : {Interval{iv.a, iv.ta, mid, tm}, Interval{mid, tm, iv.b, iv.tb}}) {
      if (part.ta > part.tb) {
        heap.push_back(part);
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
  }
  // No replica at all costs `top` (its level; nothing transfers). The search reaches it only where
  // the transfer cost falls to 0 below the best, and not when the first plan's replicas all cross
  // a link that costs nothing but, with speeds, its capacities left a slow rank above `top`: so
  // it is a candidate here, whatever the search did.
  const __int128 none_rows = c.weighs_rows() ? RowCost(c, sc->weigh_rows_base) : 0;
  if (top + none_rows < best_total) {
    best.Reset(c.num_ranks, c.num_experts, c.slots, in.totals);
    replaced = true;
  }
  std::swap(*dec, best);
  // LocalRows' placement (sc->placement) belongs to the first plan only.
  if (replaced) sc->placement = -1;
}

}  // namespace

void EstimatePlanRows(const PlannerConfig& resolved, const Plan& plan, const int64_t* counts,
                      absl::Span<const int64_t> totals, std::vector<int64_t>* rows) {
  const int32_t R = resolved.num_ranks, E = resolved.num_experts, S = resolved.slots;
  PolicyInput in;
  in.config = &resolved;
  in.plan = &plan;
  in.totals = totals;
  in.counts = counts;
  std::vector<int64_t> prefix;  // Col's block prefix, one source a block
  if (counts != nullptr) {
    prefix.assign(static_cast<size_t>(R + 1) * E, 0);
    for (int32_t s = 0; s < R; ++s) {
      for (int32_t e = 0; e < E; ++e) {
        const size_t i = static_cast<size_t>(s) * E + e;
        prefix[i + E] = prefix[i] + counts[i];
      }
    }
    in.block_prefix = prefix.data();
    in.block_size = 1;
    in.block_shift = 0;
  }
  Decisions dec;
  dec.Reset(R, E, S, totals);
  for (int32_t e = 0; e < E; ++e) dec.home_keep[e] = plan.alloc[static_cast<size_t>(e) * R + plan.home[e]];
  for (int32_t r = 0; r < R; ++r) {
    for (int32_t s = 0; s < S; ++s) {
      const size_t i = static_cast<size_t>(r) * S + s;
      if (plan.slot_expert[i] < 0) continue;
      const size_t j = static_cast<size_t>(r) * S + dec.slots_used[r]++;
      dec.slot_expert[j] = plan.slot_expert[i];
      dec.slot_amount[j] = plan.slot_alloc[i];
    }
  }
  PolicyScratch sc;
  RowEstimate{in, resolved.ranks_per_node}.Base(&sc);
  *rows = RowsOf(in, dec, &sc);
}

absl::Status DecideMoonEP(const PolicyInput& in, PolicyScratch* sc, Decisions* dec) {
  const PlannerConfig& c = *in.config;
  const int32_t R = c.num_ranks;
  if (R == 1 || c.slots == 0) return absl::OkStatus();
  BalancedCapacities(c, in.home_load, in.total, &sc->cap);
  if (TryAll(in, sc->cap, sc, dec)) {
    if (c.moonep_check_greedy) KeepBetterOfGreedy(in, sc, dec);
  } else {
    // The slot limit blocks perfect balance: find the smallest cap of the fastest rank, L, such
    // that capacities floor(L * w_d / w_max) are reachable.
    Levels lv(in, sc);
    __int128 lo = *std::max_element(sc->cap.begin(), sc->cap.end());
    __int128 hi = std::max(lo, lv.Top());
    // Invariant: hi reachable (every capacity >= home load), lo - 1 not known reachable.
    while (lo < hi) {
      const __int128 mid = lo + (hi - lo) / 2;
      if (TryAll(in, lv.Caps(mid), sc, dec)) hi = mid; else lo = mid + 1;
    }
    if (!TryAll(in, lv.Caps(hi), sc, dec)) {
      return Internal("moonep: no reachable capacity at L = %d",
                      static_cast<int64_t>(std::min<__int128>(hi, INT64_MAX)));
    }
  }
  if (c.weighs_replicas()) WeighReplicas(in, sc, dec);
  return absl::OkStatus();
}

}  // namespace moonep::planner
