// The objective of PlannerConfig::replica_cost_* (and row_cost_*), computed from a finished Plan
// (its layouts and replica slots), apart from the planner's own CostOf (which reads its
// decisions): the highest rank level (load in the fastest rank's tokens, rounded up) plus the
// highest rank transfer cost, the replicas' gradients reducing along chains, plus, with row costs,
// the highest rank row cost.
// Header-only: planner_test and the standalone fuzz target both use it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "planner/plan.h"
#include "planner/policy.h"

namespace moonep::planner::testing {

struct Weighed {
  int64_t level = 0, transfers = 0, rows = 0;  // saturated at INT64_MAX / 4 each (so total()
  int64_t total() const { return level + transfers + rows; }  // cannot wrap)
  __int128 exact = 0;  // level + transfers + rows unsaturated (extreme costs pass 2^63)
};

// The highest rank transfer cost of a set of replicas (expert, rank), the weights and gradients
// moving along each expert's chain (transport/common/replica_chain.h): the prefetch from the home
// to its holders in increasing rank, the reduce from them, in the same order, to the home. Per rank
// and link class (intra, inter: the two ranks of a hop on one node or not; every hop is inter when
// flat), the most hops it sends or receives in either, times that class's cost.
inline __int128 ChainTransferCost(int R, int rpn, int64_t cost_intra, int64_t cost_inter,
                                  const std::vector<int32_t>& home,
                                  std::vector<std::pair<int, int>> replicas) {
  std::sort(replicas.begin(), replicas.end());  // by expert, then rank
  // [d][prefetch 0/1][in intra, in inter, out intra, out inter]
  std::vector<int64_t> k(static_cast<size_t>(R) * 8, 0);
  const auto hop = [&](int from, int to, int prefetch) {
    const int inter = rpn > 0 ? from / rpn != to / rpn : 1;
    ++k[static_cast<size_t>(from) * 8 + 4 * prefetch + 2 + inter];
    ++k[static_cast<size_t>(to) * 8 + 4 * prefetch + inter];
  };
  for (size_t i = 0; i < replicas.size(); ++i) {
    const int e = replicas[i].first, d = replicas[i].second;
    const bool first = i == 0 || replicas[i - 1].first != e;
    const bool last = i + 1 == replicas.size() || replicas[i + 1].first != e;
    hop(first ? home[static_cast<size_t>(e)] : replicas[i - 1].second, d, 1);
    hop(d, last ? home[static_cast<size_t>(e)] : replicas[i + 1].second, 0);
  }
  __int128 transfers = 0;
  for (int d = 0; d < R; ++d) {
    const int64_t* c = k.data() + static_cast<size_t>(d) * 8;
    transfers = std::max<__int128>(transfers, static_cast<__int128>(std::max({c[0], c[2], c[4], c[6]})) * cost_intra);
    transfers = std::max<__int128>(transfers, static_cast<__int128>(std::max({c[1], c[3], c[5], c[7]})) * cost_inter);
  }
  return transfers;
}

// Per-rank rows [r * 4]: received intra, received inter, sent intra, sent inter.
using RankRows = std::vector<int64_t>;

// The rows a plan moves, from its pieces: expert e's canonical order lists its sources' tokens in
// increasing source rank (counts[s * E + e] each), and a piece's positions come from the sources
// whose ranges they overlap. Exact (`estimate` false), or the planner's estimate of them
// (docs/planner.md "Rows in the objective"): the same receives, but a source's token that another
// rank computes leaves on the class of the link to the expert's home, unless the source is the
// home. With `no_replica`, the rows of keeping every expert home instead.
inline RankRows PlanRows(const Plan& p, const std::vector<int64_t>& counts, bool estimate,
                         bool no_replica = false) {
  const int R = p.num_ranks, E = p.num_experts, rpn = p.ranks_per_node;
  const auto cls = [rpn](int a, int b) { return rpn > 0 ? a / rpn != b / rpn : 1; };
  RankRows rows(static_cast<size_t>(R) * 4, 0);
  for (int e = 0; e < E; ++e) {
    const int h = p.home[e];
    int64_t total = 0;
    for (int s = 0; s < R; ++s) total += counts[static_cast<size_t>(s) * E + e];
    const auto piece = [&](int d, int64_t lo, int64_t hi) {
      int64_t at = 0;
      for (int s = 0; s < R && at < hi; ++s) {
        const int64_t c = counts[static_cast<size_t>(s) * E + e];
        const int64_t n = std::max<int64_t>(0, std::min(hi, at + c) - std::max(lo, at));
        at += c;
        if (n == 0 || s == d) continue;
        rows[static_cast<size_t>(d) * 4 + cls(s, d)] += n;
        rows[static_cast<size_t>(s) * 4 + 2 + (estimate && s != h ? cls(s, h) : cls(s, d))] += n;
      }
    };
    if (no_replica) {
      piece(h, 0, total);
      continue;
    }
    for (int32_t i = p.piece_begin[e]; i < p.piece_begin[e + 1]; ++i) {
      piece(p.piece_dest[i], p.piece_start[i], p.piece_start[i] + p.piece_count[i]);
    }
  }
  return rows;
}

// The highest rank row cost of per-rank rows, in tokens (row costs are in 1/kRowCostScale tokens),
// rounded up.
inline __int128 RowCost(const PlannerConfig& resolved, const RankRows& rows) {
  __int128 worst = 0;
  for (size_t d = 0; d < rows.size() / 4; ++d) {
    const int64_t* k = rows.data() + d * 4;
    worst = std::max<__int128>(worst, static_cast<__int128>(std::max(k[0], k[2])) * resolved.row_cost_intra);
    worst = std::max<__int128>(worst, static_cast<__int128>(std::max(k[1], k[3])) * resolved.row_cost_inter);
  }
  return (worst + kRowCostScale - 1) / kRowCostScale;
}

// `resolved` is the planner's resolved config; `no_replica`: the cost of keeping every expert home
// instead (the highest home load, as a level; transfers 0). With row costs, `counts` (the plan's)
// gives the rows term.
inline Weighed WeighPlan(const PlannerConfig& resolved, const Plan& p, bool no_replica = false,
                         const std::vector<int64_t>* counts = nullptr) {
  const int R = p.num_ranks, S = p.slots, G = p.num_groups(), rpn = resolved.ranks_per_node;
  std::vector<int64_t> w;
  SpeedWeights(resolved, &w);
  const int64_t w_max = *std::max_element(w.begin(), w.end());
  std::vector<int64_t> load(R, 0);
  std::vector<std::pair<int, int>> replicas;  // (expert, rank)
  if (no_replica) {
    for (int e = 0; e < p.num_experts; ++e) {
      for (int d = 0; d < R; ++d) load[p.home[e]] += p.alloc[static_cast<size_t>(e) * R + d];
    }
  } else {
    for (int d = 0; d < R; ++d) {
      for (int g = 0; g < G; ++g) load[d] += p.group_count[static_cast<size_t>(d) * G + g];
      for (int s = 0; s < S; ++s) {
        const int e = p.slot_expert[static_cast<size_t>(d) * S + s];
        if (e >= 0) replicas.push_back({e, d});
      }
    }
  }
  __int128 level = 0;
  for (int d = 0; d < R; ++d) {
    level = std::max<__int128>(level, (static_cast<__int128>(load[d]) * w_max + w[d] - 1) / w[d]);
  }
  const __int128 transfers = ChainTransferCost(R, rpn, resolved.replica_cost_intra,
                                               resolved.replica_cost_inter, p.home, replicas);
  __int128 rows = 0;
  if (resolved.weighs_rows() && counts != nullptr) {
    rows = RowCost(resolved, PlanRows(p, *counts, /*estimate=*/true, no_replica));
  }
  const __int128 cap = INT64_MAX / 4;
  return {static_cast<int64_t>(std::min(level, cap)), static_cast<int64_t>(std::min(transfers, cap)),
          static_cast<int64_t>(std::min(rows, cap)), level + transfers + rows};
}

}  // namespace moonep::planner::testing
