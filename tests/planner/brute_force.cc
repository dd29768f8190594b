#include "tests/planner/brute_force.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <utility>

#include "tests/planner/weighed_cost.h"

namespace moonep::planner::testing {
namespace {

// Edmonds-Karp on a dense matrix (a handful of nodes).
int64_t MaxFlow(std::vector<std::vector<int64_t>> cap, int s, int t) {
  const int n = static_cast<int>(cap.size());
  int64_t flow = 0;
  std::vector<int> prev(n);
  while (true) {
    std::fill(prev.begin(), prev.end(), -1);
    prev[s] = s;
    std::vector<int> queue{s};
    for (size_t q = 0; q < queue.size() && prev[t] < 0; ++q) {
      const int u = queue[q];
      for (int v = 0; v < n; ++v) {
        if (prev[v] < 0 && cap[u][v] > 0) {
          prev[v] = u;
          queue.push_back(v);
        }
      }
    }
    if (prev[t] < 0) return flow;
    int64_t push = std::numeric_limits<int64_t>::max();
    for (int v = t; v != s; v = prev[v]) push = std::min(push, cap[prev[v]][v]);
    for (int v = t; v != s; v = prev[v]) {
      cap[prev[v]][v] -= push;
      cap[v][prev[v]] += push;
    }
    flow += push;
  }
}

}  // namespace

BruteForceResult BruteForceMinReplicas(int R, int E, int slots, const std::vector<int>& home,
                                       const std::vector<int64_t>& totals,
                                       const std::vector<int64_t>& lo, const std::vector<int64_t>& hi,
                                       int max_replicas) {
  const int64_t kInf = int64_t{1} << 50;
  // Nodes: s, experts, ranks, t, SS, TT (lower bounds via the usual reduction).
  const int s = 0, t = E + R + 1, SS = E + R + 2, TT = E + R + 3, n = E + R + 4;
  std::vector<std::pair<int, int>> pairs;  // candidate replicas (expert, rank)
  for (int e = 0; e < E; ++e) {
    if (totals[e] == 0) continue;
    for (int d = 0; d < R; ++d) {
      if (d != home[e]) pairs.push_back({e, d});
    }
  }
  int64_t need = 0;
  std::vector<std::vector<int64_t>> base(n, std::vector<int64_t>(n, 0));
  for (int e = 0; e < E; ++e) {
    base[SS][1 + e] += totals[e];
    base[s][TT] += totals[e];
    need += totals[e];
    base[1 + e][1 + E + home[e]] = kInf;
  }
  for (int d = 0; d < R; ++d) {
    base[1 + E + d][t] = hi[d] - lo[d];
    base[SS][t] += lo[d];
    base[1 + E + d][TT] += lo[d];
    need += lo[d];
  }
  base[t][s] = kInf;
  auto feasible = [&](const std::vector<int>& chosen) {
    auto cap = base;
    for (int i : chosen) cap[1 + pairs[i].first][1 + E + pairs[i].second] = kInf;
    return MaxFlow(std::move(cap), SS, TT) == need;
  };
  BruteForceResult result;
  std::vector<int> chosen, used(R, 0);
  bool found = false;
  std::function<void(int, int)> search = [&](int start, int k) {
    if (found) return;
    if (k == 0) {
      found = feasible(chosen);
      return;
    }
    for (int i = start; i + k <= static_cast<int>(pairs.size()) && !found; ++i) {
      const int d = pairs[i].second;
      if (used[d] >= slots) continue;
      ++used[d];
      chosen.push_back(i);
      search(i + 1, k - 1);
      chosen.pop_back();
      --used[d];
    }
  };
  const int most = std::min<int>(static_cast<int>(pairs.size()), R * slots);
  for (int k = 0; k <= std::min(most, max_replicas); ++k) {
    search(0, k);
    if (found) {
      result.min_replicas = k;
      return result;
    }
  }
  result.exhausted = max_replicas >= most;
  return result;
}

int64_t BruteForceMinWeighedCost(int R, int E, int slots, const std::vector<int>& home,
                                 const std::vector<int64_t>& totals, int rpn, int64_t cost_intra,
                                 int64_t cost_inter) {
  const int64_t kInf = int64_t{1} << 50;
  const int s = 0, t = E + R + 1, n = E + R + 2;
  std::vector<std::pair<int, int>> pairs;  // candidate replicas (expert, rank)
  for (int e = 0; e < E; ++e) {
    for (int d = 0; d < R; ++d) {
      if (d != home[e] && totals[e] > 0) pairs.push_back({e, d});
    }
  }
  const int64_t total = std::accumulate(totals.begin(), totals.end(), int64_t{0});
  const std::vector<int32_t> home32(home.begin(), home.end());
  // Does some allocation over home + `chosen` keep every rank at or below L?
  const auto fits = [&](const std::vector<int>& chosen, int64_t L) {
    std::vector<std::vector<int64_t>> cap(n, std::vector<int64_t>(n, 0));
    for (int e = 0; e < E; ++e) {
      cap[s][1 + e] = totals[e];
      cap[1 + e][1 + E + home[e]] = kInf;
    }
    for (int i : chosen) cap[1 + pairs[i].first][1 + E + pairs[i].second] = kInf;
    for (int d = 0; d < R; ++d) cap[1 + E + d][t] = L;
    return MaxFlow(std::move(cap), s, t) == total;
  };
  int64_t best = std::numeric_limits<int64_t>::max();
  std::vector<int> chosen, used(R, 0);
  std::function<void(int)> visit = [&](int start) {
    // This set: the least L by bisection (L = total always fits), plus its transfers.
    int64_t lo = 0, hi = total;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (fits(chosen, mid)) hi = mid; else lo = mid + 1;
    }
    std::vector<std::pair<int, int>> replicas;
    for (int i : chosen) replicas.push_back(pairs[i]);
    const int64_t transfers =
        static_cast<int64_t>(ChainTransferCost(R, rpn, cost_intra, cost_inter, home32, replicas));
    best = std::min(best, hi + transfers);
    for (int i = start; i < static_cast<int>(pairs.size()); ++i) {
      const int d = pairs[i].second;
      if (used[d] >= slots) continue;
      ++used[d];
      chosen.push_back(i);
      visit(i + 1);
      chosen.pop_back();
      --used[d];
    }
  };
  visit(0);
  return best;
}

}  // namespace moonep::planner::testing
