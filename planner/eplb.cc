// DeepSeek EPLB, transcribed from eplb.py (balanced_packing, replicate_experts,
// rebalance_experts_hierarchical) with integer loads, and the `eplb` baseline policy built on it.
#include "planner/eplb.h"

#include <algorithm>
#include <numeric>

#include "moonep/core/status.h"
#include "planner/policy.h"

namespace moonep::planner {
namespace {

using Wide = __int128;
// Loads per physical replica are w / count; scaling by lcm(1..16) keeps them exact for up to 16
// replicas of an expert (and deterministic beyond).
constexpr int64_t kReplicaScale = 720720;

// Packs n items into num_packs packs of n / num_packs items each: heaviest item first, into the
// lightest pack that still has room (lowest index on ties).
void BalancedPacking(const std::vector<Wide>& weight, int32_t num_packs, std::vector<int32_t>* pack,
                     std::vector<int32_t>* rank_in_pack) {
  const int32_t n = static_cast<int32_t>(weight.size()), per_pack = n / num_packs;
  pack->assign(n, 0);
  rank_in_pack->assign(n, 0);
  if (per_pack == 1) {
    std::iota(pack->begin(), pack->end(), 0);
    return;
  }
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return weight[a] > weight[b]; });
  std::vector<Wide> pack_weight(num_packs, 0);
  std::vector<int32_t> pack_items(num_packs, 0);
  for (int32_t item : order) {
    int32_t best = -1;
    for (int32_t p = 0; p < num_packs; ++p) {
      if (pack_items[p] < per_pack && (best < 0 || pack_weight[p] < pack_weight[best])) best = p;
    }
    (*pack)[item] = best;
    (*rank_in_pack)[item] = pack_items[best]++;
    pack_weight[best] += weight[item];
  }
}

// Adds num_phy - n replicas, each to the expert with the largest load per replica.
void ReplicateExperts(const std::vector<int64_t>& weight, int32_t num_phy, std::vector<int32_t>* phy2log,
                      std::vector<int32_t>* logcnt) {
  const int32_t n = static_cast<int32_t>(weight.size());
  phy2log->resize(num_phy);
  logcnt->assign(n, 1);
  std::iota(phy2log->begin(), phy2log->begin() + n, 0);
  for (int32_t p = n; p < num_phy; ++p) {
    int32_t best = 0;
    for (int32_t e = 1; e < n; ++e) {
      if (static_cast<Wide>(weight[e]) * (*logcnt)[best] > static_cast<Wide>(weight[best]) * (*logcnt)[e]) {
        best = e;
      }
    }
    (*phy2log)[p] = best;
    ++(*logcnt)[best];
  }
}

}  // namespace

absl::Status EplbRebalance(absl::Span<const int64_t> weight, int32_t num_replicas, int32_t num_groups,
                           int32_t num_nodes, int32_t num_gpus, std::vector<int32_t>* phy2log,
                           std::vector<int32_t>* logcnt) {
  const int32_t E = static_cast<int32_t>(weight.size());
  MOONEP_CHECK_ARG(E > 0, "eplb: no experts");
  MOONEP_CHECK_ARG(num_groups > 0 && num_nodes > 0 && num_gpus > 0 && num_replicas > 0,
                   "eplb: num_groups, num_nodes, num_gpus and num_replicas must be positive");
  for (int64_t w : weight) MOONEP_CHECK_ARG(w >= 0, "eplb: negative weight %d", w);
  if (num_groups % num_nodes != 0) {
    num_groups = 1;  // EPLB falls back to its global policy
    num_nodes = 1;
  }
  MOONEP_CHECK_ARG(E % num_groups == 0, "eplb: %d experts do not split into %d groups", E, num_groups);
  MOONEP_CHECK_ARG(num_gpus % num_nodes == 0, "eplb: %d GPUs do not split into %d nodes", num_gpus,
                   num_nodes);
  MOONEP_CHECK_ARG(num_replicas % num_gpus == 0, "eplb: %d replicas do not split over %d GPUs",
                   num_replicas, num_gpus);
  MOONEP_CHECK_ARG(num_replicas >= E, "eplb: %d replicas < %d experts", num_replicas, E);
  const int32_t group_size = E / num_groups, groups_per_node = num_groups / num_nodes;
  const int32_t per_node_log = E / num_nodes, per_node_phy = num_replicas / num_nodes;
  const int32_t gpus_per_node = num_gpus / num_nodes, per_gpu = num_replicas / num_gpus;
  MOONEP_CHECK_ARG(per_node_phy >= per_node_log, "eplb: fewer replicas than experts per node");

  // Step 1: pack groups onto nodes.
  std::vector<Wide> group_load(num_groups, 0);
  for (int32_t e = 0; e < E; ++e) group_load[e / group_size] += weight[e];
  std::vector<int32_t> gpack, grank;
  BalancedPacking(group_load, num_nodes, &gpack, &grank);
  std::vector<int32_t> log2mlog(E), mlog2log(E);
  for (int32_t e = 0; e < E; ++e) {
    const int32_t g = e / group_size;
    log2mlog[e] = (gpack[g] * groups_per_node + grank[g]) * group_size + e % group_size;
    mlog2log[log2mlog[e]] = e;
  }
  // Step 2: replicas inside each node; step 3: pack them onto the node's GPUs.
  phy2log->assign(num_replicas, -1);
  std::vector<int32_t> mlogcnt(E);
  std::vector<int64_t> node_w(per_node_log);
  std::vector<int32_t> phy2mlog, cnt, pack, rank_in_pack;
  std::vector<Wide> phy_w(per_node_phy);
  for (int32_t n = 0; n < num_nodes; ++n) {
    for (int32_t j = 0; j < per_node_log; ++j) node_w[j] = weight[mlog2log[n * per_node_log + j]];
    ReplicateExperts(node_w, per_node_phy, &phy2mlog, &cnt);
    for (int32_t j = 0; j < per_node_log; ++j) mlogcnt[n * per_node_log + j] = cnt[j];
    for (int32_t p = 0; p < per_node_phy; ++p) {
      phy_w[p] = static_cast<Wide>(node_w[phy2mlog[p]]) * kReplicaScale / cnt[phy2mlog[p]];
    }
    BalancedPacking(phy_w, gpus_per_node, &pack, &rank_in_pack);
    for (int32_t p = 0; p < per_node_phy; ++p) {
      const int32_t slot = pack[p] * per_gpu + rank_in_pack[p];
      (*phy2log)[n * per_node_phy + slot] = mlog2log[n * per_node_log + phy2mlog[p]];
    }
  }
  logcnt->resize(E);
  for (int32_t e = 0; e < E; ++e) (*logcnt)[e] = mlogcnt[log2mlog[e]];
  return absl::OkStatus();
}

// The `eplb` baseline: every eplb_period steps, EPLB places E + redundant physical experts from
// the summed totals of the steps since the last placement (the first step uses its own totals).
// A physical expert on its home rank is the home copy; elsewhere it takes a replica slot (a second
// copy on the same rank merges into the first; beyond the slot limit it falls back to the home).
// Each step splits an expert's tokens evenly over its physical copies.
absl::Status DecideEplb(const PolicyInput& in, PolicyScratch* sc, Decisions* dec) {
  const PlannerConfig& c = *in.config;
  const int32_t R = c.num_ranks, E = c.num_experts, S = c.slots;
  if (sc->eplb_sum.size() != static_cast<size_t>(E)) sc->eplb_sum.assign(E, 0);
  if (sc->eplb_step % c.eplb_period == 0) {
    const bool first = sc->eplb_step == 0;
    std::vector<int64_t> weight(E);
    for (int32_t e = 0; e < E; ++e) weight[e] = first ? in.totals[e] : sc->eplb_sum[e];
    const int32_t redundant = c.eplb_redundant < 0 ? R : c.eplb_redundant;
    int32_t nodes = 1, groups = 1;
    if (c.ranks_per_node > 0 && R % c.ranks_per_node == 0) {
      nodes = R / c.ranks_per_node;
      groups = c.eplb_num_groups > 0 ? c.eplb_num_groups : nodes;
      if (E % groups != 0 || groups % nodes != 0) nodes = groups = 1;
    }
    std::vector<int32_t> phy2log, logcnt;
    MOONEP_RETURN_IF_ERROR(EplbRebalance(weight, E + redundant, groups, nodes, R, &phy2log, &logcnt));
    const int32_t per_gpu = (E + redundant) / R;
    // Per expert, its copies' ranks in physical order, after merging and the slot limit.
    std::vector<std::vector<int32_t>> copies(E);
    std::vector<int32_t> used(R, 0);
    std::vector<std::vector<int32_t>> held(R);
    for (int32_t p = 0; p < E + redundant; ++p) {
      const int32_t d = p / per_gpu, e = phy2log[p];
      int32_t where = d;
      if (d != in.plan->home[e]) {
        const bool has = std::find(held[d].begin(), held[d].end(), e) != held[d].end();
        if (!has) {
          if (used[d] < S) {
            ++used[d];
            held[d].push_back(e);
          } else {
            where = in.plan->home[e];
          }
        }
      }
      copies[e].push_back(where);
    }
    sc->eplb_replica_begin.assign(E + 1, 0);
    sc->eplb_replica_rank.clear();
    for (int32_t e = 0; e < E; ++e) {
      sc->eplb_replica_begin[e] = static_cast<int32_t>(sc->eplb_replica_rank.size());
      sc->eplb_replica_rank.insert(sc->eplb_replica_rank.end(), copies[e].begin(), copies[e].end());
    }
    sc->eplb_replica_begin[E] = static_cast<int32_t>(sc->eplb_replica_rank.size());
    std::fill(sc->eplb_sum.begin(), sc->eplb_sum.end(), 0);
  }
  // Up to eplb_period steps of totals below 2^52 each: the sum saturates rather than wrap.
  for (int32_t e = 0; e < E; ++e) {
    sc->eplb_sum[e] = std::min(sc->eplb_sum[e], INT64_MAX - in.totals[e]) + in.totals[e];
  }
  ++sc->eplb_step;
  for (int32_t e = 0; e < E; ++e) {
    const int32_t b = sc->eplb_replica_begin[e], k = sc->eplb_replica_begin[e + 1] - b;
    const int64_t t = in.totals[e];
    for (int32_t j = 0; j < k; ++j) {
      const int32_t d = sc->eplb_replica_rank[b + j];
      if (d == in.plan->home[e]) continue;
      const int64_t share = t / k + (j < t % k ? 1 : 0);
      if (!dec->Move(d, e, share, S)) return Internal("eplb: rank %d ran out of slots", d);
    }
  }
  return absl::OkStatus();
}

}  // namespace moonep::planner
