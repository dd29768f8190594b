// The persistent grouped GEMM's host-side schedule (see persistent_gemm.h): the split tail's time
// model, which remainders run transposed, and the cost-balanced assignment of units to clusters.
// Plain C++ (no device code), so it builds and its tests run without nvcc's device passes.
#include <algorithm>
#include <cmath>
#include <vector>

#include "moonep/compute/cuda/persistent_gemm.h"
#include "moonep/core/status.h"

namespace moonep::compute::cuda {
namespace {

// The split tail's model (TailCost, PlanSchedule), from the H200 traces: a K-step of a whole tile
// and of a narrow (128-column) one, publishing a part's fp32 partial, and the last part's read of
// each other part's partial (us; whole / narrow).
constexpr double kStepUs = 0.67, kNarrowStepUs = 0.47;
constexpr double kPublishUs = 3.5, kNarrowPublishUs = 2.2;
constexpr double kFixupUs = 2.3, kNarrowFixupUs = 1.9;

}  // namespace

// The tail's modeled time in microseconds, from the H200 traces in docs/cuda-history.md ("Where a
// unit's time goes", "Tenth session"), with the per-step, publish and fix-up costs above; the part
// that arrives last reads every other part's partial. Parts beyond the clusters would run in
// further rounds (kWorkspaceRounds bounds them; unsplit narrow units beyond the clusters are not
// bounded, having no partials).
double PersistentGemm::TailCost(int rest, int slots, int k_iters, bool narrow, int split) {
  if (rest <= 0) return 0.0;
  const int items = rest * (narrow ? 2 : 1);
  const int rounds = (items * split + slots - 1) / slots;
  const double step = narrow ? kNarrowStepUs : kStepUs;
  const double main = rounds * ((k_iters + split - 1) / split) * step;
  if (split == 1) return main;
  return main + (narrow ? kNarrowPublishUs : kPublishUs) + (split - 1) * (narrow ? kNarrowFixupUs : kFixupUs);
}

absl::StatusOr<PersistentGemm::TailChoice> PersistentGemm::ChooseTail(int rest, int slots, int k_iters,
                                                                      const TailOptions& o) {
  TailChoice best{false, 1, TailCost(rest, slots, k_iters, false, 1)};
  if (rest <= 0 || !o.split) return best;
  // A split needs >= 4 K-steps a part and its partials in the workspace (kWorkspaceRounds rounds).
  auto fits = [&](bool narrow, int split) {
    const int parts = rest * (narrow ? 2 : 1) * split;
    return split == 1 || (parts <= kWorkspaceRounds * slots && k_iters / split >= 4);
  };
  if (o.force_split > 0) {
    if (o.force_split > 1 && !fits(o.force_narrow, o.force_split)) {
      return InvalidArgument("persistent GEMM: a forced tail of %d %s parts per unit does not fit "
                             "(%d tail units, %d slots, %d K-steps)",
                             o.force_split, o.force_narrow ? "narrow" : "whole", rest, slots, k_iters);
    }
    return TailChoice{o.force_narrow, o.force_split,
                      TailCost(rest, slots, k_iters, o.force_narrow, o.force_split)};
  }
  for (bool narrow : {false, true}) {
    if (narrow && !o.narrow) continue;
    for (int split = 1; split <= o.max_split; ++split) {
      if (!fits(narrow, split)) continue;
      const double cost = TailCost(rest, slots, k_iters, narrow, split);
      if (cost < best.cost) best = TailChoice{narrow, split, cost};
    }
  }
  return best;
}

bool PersistentGemm::PrefersSwap(int64_t rows, int n_tiles) {
  const int64_t rest = rows % kTileN;
  if (rest == 0) return false;
  const double plain = rest <= kTileM ? n_tiles / 2 : n_tiles;
  // A margin of 2 %: near a tie the proven plain tiles run.
  return n_tiles * SwapCost(SwapRows(rest)) < 0.98 * plain;
}

absl::StatusOr<PersistentGemm::Schedule> PersistentGemm::PlanSchedule(const std::vector<double>& costs,
                                                                      int clusters, int k_iters, int max_split,
                                                                      int force_tail, int force_split,
                                                                      int sorted_last) {
  if (clusters < 1 || clusters > kMaxScheduleClusters) {
    return InvalidArgument("persistent GEMM schedule: %d clusters (1..%d)", clusters, kMaxScheduleClusters);
  }
  const int units = static_cast<int>(costs.size());
  for (double c : costs) {
    if (!(c > 0.0)) return InvalidArgument("persistent GEMM schedule: a unit's cost is not positive");
  }
  const bool forced = force_split > 0;
  if (forced && (force_tail < 1 || force_tail > std::min(kMaxTailUnits, units) || force_split < 2 ||
                 force_tail * force_split > clusters || k_iters / force_split < 4)) {
    return InvalidArgument("persistent GEMM schedule: a forced tail of %d units in %d parts does not fit "
                           "(%d units, %d clusters, %d K-steps)",
                           force_tail, force_split, units, clusters, k_iters);
  }
  std::vector<int> order(units);
  for (int i = 0; i < units; ++i) order[i] = i;
  const int sorted = sorted_last < 0 ? units : std::min(units, sorted_last);
  std::stable_sort(order.end() - sorted, order.end(), [&](int x, int y) { return costs[x] > costs[y]; });
  // Each unit in that order to the least loaded cluster (a binary heap on (load, cluster): ties to
  // the lowest index).
  std::vector<double> load(clusters, 0.0);
  std::vector<int> where(units), heap(clusters);
  for (int c = 0; c < clusters; ++c) heap[c] = c;
  auto before = [&](int x, int y) { return load[x] < load[y] || (load[x] == load[y] && x < y); };
  for (int i : order) {
    const int c = heap[0];
    where[i] = c;
    load[c] += costs[i];
    for (int j = 0;;) {  // sift the root down
      int m = j;
      const int l = 2 * j + 1, r = l + 1;
      if (l < clusters && before(heap[l], heap[m])) m = l;
      if (r < clusters && before(heap[r], heap[m])) m = r;
      if (m == j) break;
      std::swap(heap[j], heap[m]);
      j = m;
    }
  }
  // Improvement: the most loaded cluster gives a unit to, or trades one with, one of the least
  // loaded ones while that lowers the larger of the two loads (the best such move each round, a
  // bounded number of rounds). Costs take few distinct values (whole units and a few transposed
  // widths), so this works on counts per value and cluster; the units are then placed back, each
  // on its first cluster where that cluster still has room for its value, so most stay in the
  // place (and time) the assignment gave them.
  std::vector<double> values(costs.begin(), costs.end());
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  const int nv = static_cast<int>(values.size());
  if (nv <= 16 && clusters > 1 && units > 0) {
    std::vector<int> value_of(units);
    for (int u = 0; u < units; ++u) {
      value_of[u] = static_cast<int>(std::lower_bound(values.begin(), values.end(), costs[u]) - values.begin());
    }
    std::vector<int> count(static_cast<size_t>(clusters) * nv, 0);
    auto cnt = [&](int c, int v) -> int& { return count[static_cast<size_t>(c) * nv + v]; };
    for (int u = 0; u < units; ++u) ++cnt(where[u], value_of[u]);
    bool changed = false;
    constexpr int kCandidates = 8;  // the least loaded clusters tried against the most loaded
    int lows[kCandidates];
    for (int round = 0; round < 4 * clusters; ++round) {
      int big = 0, nlow = 0;
      for (int c = 0; c < clusters; ++c) {  // the most loaded and the kCandidates least loaded
        if (load[c] > load[big]) big = c;
        int j = nlow < kCandidates ? nlow++ : kCandidates;
        while (j > 0 && load[c] < load[lows[j - 1]]) {
          if (j < kCandidates) lows[j] = lows[j - 1];
          --j;
        }
        if (j < kCandidates) lows[j] = c;
      }
      double best = load[big] - 1e-9;
      int to = -1, give = -1, take = -1;  // take < 0: a move
      for (int q = 0; q < nlow; ++q) {
        const int small = lows[q];
        if (small == big) continue;
        for (int x = 0; x < nv; ++x) {
          if (cnt(big, x) == 0) continue;
          const double moved = std::max(load[big] - values[x], load[small] + values[x]);
          if (moved < best) {
            best = moved;
            to = small;
            give = x;
            take = -1;
          }
          for (int y = 0; y < x; ++y) {  // values ascending: values[y] < values[x]
            if (cnt(small, y) == 0) continue;
            const double d = values[x] - values[y];
            const double traded = std::max(load[big] - d, load[small] + d);
            if (traded < best) {
              best = traded;
              to = small;
              give = x;
              take = y;
            }
          }
        }
      }
      if (to < 0) break;
      --cnt(big, give);
      ++cnt(to, give);
      load[big] -= values[give];
      load[to] += values[give];
      if (take >= 0) {
        --cnt(to, take);
        ++cnt(big, take);
        load[to] -= values[take];
        load[big] += values[take];
      }
      changed = true;
    }
    if (changed) {  // place the units back
      std::vector<int> placed(units, -1);
      for (int i : order) {
        int& room = cnt(where[i], value_of[i]);
        if (room > 0) {
          --room;
          placed[i] = where[i];
        }
      }
      for (int i : order) {
        if (placed[i] >= 0) continue;
        for (int c = 0; c < clusters; ++c) {
          if (cnt(c, value_of[i]) > 0) {
            --cnt(c, value_of[i]);
            placed[i] = c;
            break;
          }
        }
      }
      where.swap(placed);
    }
  }
  // Each cluster's units in assignment order.
  std::vector<int> start(clusters + 1, 0), members(units);
  for (int u = 0; u < units; ++u) ++start[where[u] + 1];
  for (int c = 0; c < clusters; ++c) start[c + 1] += start[c];
  {
    std::vector<int> fill(start.begin(), start.end() - 1);
    for (int i : order) members[fill[where[i]]++] = i;
  }
  std::vector<int> by_load(clusters);
  auto sort_clusters = [&](const std::vector<double>& l) {
    for (int c = 0; c < clusters; ++c) by_load[c] = c;
    std::sort(by_load.begin(), by_load.end(), [&](int x, int y) { return l[x] < l[y] || (l[x] == l[y] && x < y); });
  };
  // The tail: the last units of the most loaded clusters out of them and split, each part on its
  // own cluster, the least loaded first, where the model finds that shorter. A split
  // part's fixed costs in whole-tile times (TailCost's): publishing its partial, and for the last
  // part reading each other one.
  const double tile_us = kStepUs * k_iters;
  const double publish = kPublishUs / tile_us, fixup = kFixupUs / tile_us;
  Schedule s;
  s.makespan = units > 0 ? *std::max_element(load.begin(), load.end()) : 0.0;
  // Tail candidates: the units last in each cluster's list, the most loaded clusters' first.
  std::vector<int> last;
  sort_clusters(load);
  for (int q = clusters - 1; q >= 0; --q) {
    const int c = by_load[q];
    if (start[c + 1] > start[c]) last.push_back(members[start[c + 1] - 1]);
  }
  std::vector<double> rest = load;
  int best_tail = 0;
  const int max_tail = std::min(kMaxTailUnits, static_cast<int>(last.size()));
  if (max_split >= 2) sort_clusters(rest);
  std::vector<int> pos(clusters);
  for (int q = 0; q < clusters; ++q) pos[by_load[q]] = q;
  for (int t = 1; t <= max_tail && max_split >= 2; ++t) {
    // One cluster's load drops: it moves towards the front of the order (ties: lower index).
    const int c = where[last[t - 1]];
    rest[c] -= costs[last[t - 1]];
    for (int q = pos[c]; q > 0; --q) {
      const int o = by_load[q - 1];
      if (rest[o] < rest[c] || (rest[o] == rest[c] && o < c)) break;
      by_load[q] = o;
      pos[o] = q;
      by_load[q - 1] = c;
      pos[c] = q - 1;
    }
    if (forced && t != force_tail) continue;
    const double base = rest[by_load[clusters - 1]];
    for (int split = 2; split <= max_split; ++split) {
      if (forced && split != force_split) continue;
      if (t * split > clusters || k_iters / split < 4) break;  // (more parts fit no better)
      if (!forced && base >= s.makespan - 1e-9) break;
      double makespan = base;
      for (int v = 0; v < t * split && (forced || makespan < s.makespan - 1e-9); ++v) {
        makespan = std::max(makespan, rest[by_load[v]] + costs[last[v / split]] / split + publish +
                                          (split - 1) * fixup);
      }
      if (forced || makespan < s.makespan - 1e-9) {
        s.makespan = makespan;
        s.split = split;
        best_tail = t;
      }
    }
  }
  if (forced && best_tail == 0) {
    return InvalidArgument("persistent GEMM schedule: a forced tail of %d units needs %d clusters with units",
                           force_tail, force_tail);
  }
  // The lists: whole units in assignment order, the tail's parts on the least loaded clusters.
  std::vector<char> in_tail(units, 0);
  for (int t = 0; t < best_tail; ++t) in_tail[last[t]] = 1;
  s.start.assign(1, 0);
  s.units.reserve(units);
  for (int c = 0; c < clusters; ++c) {
    for (int i = start[c]; i < start[c + 1]; ++i) {
      if (!in_tail[members[i]]) s.units.push_back(members[i]);
    }
    s.start.push_back(static_cast<int>(s.units.size()));
  }
  if (best_tail > 0) {
    rest = load;
    for (int t = 0; t < best_tail; ++t) rest[where[last[t]]] -= costs[last[t]];
    sort_clusters(rest);
    s.tail_units.assign(last.begin(), last.begin() + best_tail);
    for (int v = 0; v < best_tail * s.split; ++v) s.tail_cluster.push_back(by_load[v]);
  } else {
    s.split = 1;
  }
  return s;
}

}  // namespace moonep::compute::cuda
