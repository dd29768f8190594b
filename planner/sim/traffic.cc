#include "planner/sim/traffic.h"

#include <algorithm>
#include <cmath>

#include "planner/plan_builder.h"

namespace moonep::sim {

using planner::Plan;

const char* DetailName(Detail detail) {
  switch (detail) {
    case Detail::kTokens: return "tokens";
    case Detail::kCounts: return "counts";
    case Detail::kTotals: return "totals";
  }
  return "invalid";
}

double DedupRows(double rows, double tokens, int32_t topk, int32_t experts) {
  if (rows <= 0 || tokens <= 0 || topk <= 1) return std::max(0.0, rows);
  const double q = std::min(1.0, rows / (tokens * topk));
  // The destination holds a share q of the choices, as if it held q*E of E experts that a token
  // draws K of without replacement: P(no choice lands there) = prod_i (1 - qE / (E - i)).
  double none = 1.0;
  const double held = q * experts;
  for (int32_t i = 0; i < topk && none > 0; ++i) {
    none *= experts - i > 0 ? std::max(0.0, 1.0 - held / (experts - i)) : 0.0;
  }
  return tokens * (1.0 - none);
}

// The hops of every expert's replica chain: its holders in increasing rank, the prefetch from the
// home to the lowest, the reduce from the highest to the home.
void TrafficCounter::ChainHops(const Plan& plan, RankTraffic* tr) {
  const int32_t R = plan.num_ranks, S = plan.slots;
  const auto hop = [&](int32_t from, int32_t to, bool prefetch) {
    const bool intra = planner::NodeOf(plan, from) == planner::NodeOf(plan, to);
    if (prefetch) {
      ++(intra ? tr->prefetch_out_intra : tr->prefetch_out_inter)[from];
      ++(intra ? tr->prefetch_in_intra : tr->prefetch_in_inter)[to];
    } else {
      ++(intra ? tr->reduce_out_intra : tr->reduce_out_inter)[from];
      ++(intra ? tr->reduce_in_intra : tr->reduce_in_inter)[to];
    }
  };
  last_holder_.assign(plan.num_experts, -1);
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * S + s];
      if (e < 0) continue;
      const int32_t prev = last_holder_[e];
      hop(prev < 0 ? plan.home[e] : prev, d, true);
      if (prev >= 0) hop(prev, d, false);
      last_holder_[e] = d;
    }
  }
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * S + s];
      if (e >= 0 && last_holder_[e] == d) hop(d, plan.home[e], false);
    }
  }
}

void TrafficCounter::Placement(const Plan& plan, RankTraffic* tr, PlanMetrics* m) {
  const int32_t R = plan.num_ranks, E = plan.num_experts, S = plan.slots;
  tr->Reset(R);
  *m = PlanMetrics{};
  for (int32_t e = 0; e < E; ++e) {
    const int32_t h = plan.home[e];
    const int64_t a = plan.alloc[static_cast<size_t>(e) * R + h];
    tr->load[h] += a;
    // The plan's group_padded, which Decide does not fill.
    tr->padded[h] += planner::PaddedRows(a, plan.pad_multiple);
    m->total_tokens += a;
  }
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * S + s];
      if (e < 0) continue;
      const int64_t a = plan.alloc[static_cast<size_t>(e) * R + d];
      tr->load[d] += a;
      tr->padded[d] += planner::PaddedRows(a, plan.pad_multiple);
      m->total_tokens += a;
      ++m->replicas;
      const int32_t h = plan.home[e];
      ++(planner::NodeOf(plan, h) == planner::NodeOf(plan, d) ? m->prefetch_intra : m->prefetch_inter);
    }
  }
  ChainHops(plan, tr);
  for (int32_t d = 0; d < R; ++d) m->max_load = std::max(m->max_load, tr->load[d]);
  m->mean_load = static_cast<double>(m->total_tokens) / R;
}

void TrafficCounter::FromTokens(const Plan& plan, const StepRouting& routing, RankTraffic* tr,
                                PlanMetrics* m) {
  Placement(plan, tr, m);
  m->detail = Detail::kTokens;
  const int32_t R = plan.num_ranks, E = plan.num_experts, K = routing.topk;
  planner::ComputeSourceOffsets(routing.counts, R, E, &offsets_);
  cursor_.assign(plan.piece_begin.begin(), plan.piece_begin.end() - 1);
  const int32_t* ids = routing.topk_ids.data();
  node_.resize(R);
  for (int32_t r = 0; r < R; ++r) node_[r] = planner::NodeOf(plan, r);
  dests_.resize(K);
  int32_t* dests = dests_.data();
  for (int32_t s = 0; s < R; ++s) {
    seen_.assign(E, 0);
    const int32_t node_s = node_[s];
    const int64_t* off = offsets_.data() + static_cast<size_t>(s) * E;
    for (int32_t t = 0; t < routing.tokens[s]; ++t, ids += K) {
      int32_t n = 0;
      for (int32_t k = 0; k < K; ++k) {
        const int32_t e = ids[k];
        if (e < 0) continue;
        // Positions of e's canonical order grow with (source, token): one cursor per expert.
        const int64_t pos = off[e] + seen_[e]++;
        int32_t c = cursor_[e];
        while (pos >= plan.piece_start[c] + plan.piece_count[c]) ++c;
        cursor_[e] = c;
        const int32_t d = plan.piece_dest[c];
        if (d == s) {
          ++m->rows_local;
          continue;
        }
        if (node_[d] == node_s) ++m->rows_intra;
        else ++m->rows_inter;
        if (std::find(dests, dests + n, d) == dests + n) dests[n++] = d;
      }
      for (int32_t i = 0; i < n; ++i) {
        const int32_t d = dests[i];
        if (node_[d] == node_s) {
          ++tr->send_intra[s];
          ++tr->recv_intra[d];
          ++m->dispatch_intra;
        } else {
          ++tr->send_inter[s];
          ++tr->recv_inter[d];
          ++m->dispatch_inter;
        }
      }
    }
  }
}

void TrafficCounter::FromCounts(const Plan& plan, const StepRouting& routing, RankTraffic* tr,
                                PlanMetrics* m) {
  Placement(plan, tr, m);
  m->detail = Detail::kCounts;
  const int32_t R = plan.num_ranks, E = plan.num_experts, K = routing.topk;
  planner::ComputeSourceOffsets(routing.counts, R, E, &offsets_);
  pair_rows_.assign(static_cast<size_t>(R) * R, 0);
  for (int32_t e = 0; e < E; ++e) {
    auto off = [&](int32_t s) { return offsets_[static_cast<size_t>(s) * E + e]; };
    int32_t s = 0;
    for (int32_t p = plan.piece_begin[e]; p < plan.piece_begin[e + 1]; ++p) {
      const int64_t p0 = plan.piece_start[p], p1 = p0 + plan.piece_count[p];
      const int32_t d = plan.piece_dest[p];
      while (s < R && off(s + 1) <= p0) ++s;
      for (int32_t u = s; u < R && off(u) < p1; ++u) {
        const int64_t overlap = std::min(p1, off(u + 1)) - std::max(p0, off(u));
        if (overlap > 0) pair_rows_[static_cast<size_t>(u) * R + d] += overlap;
      }
    }
  }
  for (int32_t s = 0; s < R; ++s) {
    const int32_t node_s = planner::NodeOf(plan, s);
    const double tokens = routing.tokens.empty() ? 0.0 : routing.tokens[s];
    for (int32_t d = 0; d < R; ++d) {
      const int64_t rows = pair_rows_[static_cast<size_t>(s) * R + d];
      if (rows == 0) continue;
      if (d == s) {
        m->rows_local += rows;
        continue;
      }
      const int64_t sent = K > 0 ? std::llround(DedupRows(rows, tokens, K, E)) : rows;
      if (planner::NodeOf(plan, d) == node_s) {
        m->rows_intra += rows;
        m->dispatch_intra += sent;
        tr->send_intra[s] += sent;
        tr->recv_intra[d] += sent;
      } else {
        m->rows_inter += rows;
        m->dispatch_inter += sent;
        tr->send_inter[s] += sent;
        tr->recv_inter[d] += sent;
      }
    }
  }
}

void TrafficCounter::FromTotals(const Plan& plan, const StepRouting& routing,
                                const LocalityFn& locality, RankTraffic* tr, PlanMetrics* m) {
  Placement(plan, tr, m);
  m->detail = Detail::kTotals;
  const int32_t R = plan.num_ranks, E = plan.num_experts, S = plan.slots, K = routing.topk;
  std::vector<double> in_intra(R, 0.0), in_inter(R, 0.0);
  double local = 0, intra = 0, inter = 0;
  auto take = [&](int32_t e, int32_t d, int64_t a) {
    if (a <= 0) return;
    double own = 0, node = 0;
    locality(d, e, &own, &node);
    const double o = std::min<double>(a, own), n = std::max(o, std::min<double>(a, node));
    local += o;
    intra += n - o;
    inter += a - n;
    in_intra[d] += n - o;
    in_inter[d] += a - n;
  };
  for (int32_t e = 0; e < E; ++e) take(e, plan.home[e], plan.alloc[static_cast<size_t>(e) * R + plan.home[e]]);
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * S + s];
      if (e >= 0) take(e, d, plan.alloc[static_cast<size_t>(e) * R + d]);
    }
  }
  m->rows_local = std::llround(local);
  m->rows_intra = std::llround(intra);
  m->rows_inter = std::llround(inter);
  double sum_tokens = 0;
  for (int64_t t : routing.tokens) sum_tokens += static_cast<double>(t);
  const double mean_tokens = R > 0 ? sum_tokens / R : 0;
  double sent_intra = 0, sent_inter = 0;
  const int32_t rpn = plan.ranks_per_node > 0 ? plan.ranks_per_node : 1;
  for (int32_t d = 0; d < R; ++d) {
    const int32_t n0 = d / rpn * rpn, n1 = std::min(R, n0 + rpn);
    const int32_t peers_intra = n1 - n0 - 1, peers_inter = R - (n1 - n0);
    const double a = peers_intra > 0
        ? peers_intra * DedupRows(in_intra[d] / peers_intra, mean_tokens, K, E) : in_intra[d];
    const double b = peers_inter > 0
        ? peers_inter * DedupRows(in_inter[d] / peers_inter, mean_tokens, K, E) : in_inter[d];
    tr->recv_intra[d] = std::llround(a);
    tr->recv_inter[d] = std::llround(b);
    sent_intra += a;
    sent_inter += b;
  }
  for (int32_t s = 0; s < R; ++s) {
    const double w = sum_tokens > 0 ? routing.tokens[s] / sum_tokens : 1.0 / R;
    tr->send_intra[s] = std::llround(sent_intra * w);
    tr->send_inter[s] = std::llround(sent_inter * w);
  }
  m->dispatch_intra = std::llround(sent_intra);
  m->dispatch_inter = std::llround(sent_inter);
}

}  // namespace moonep::sim
