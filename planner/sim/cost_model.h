// Cost model of one MoE layer step, per phase, from the per-rank work and traffic of a plan.
// Pure arithmetic: no I/O. The model and what it leaves out are described in docs/simulator.md.
//
//   counts    allgather of counts[R][E] (int32): each rank receives (R-1)*E*4 bytes over the
//             slowest link the ranks span (inter-node when R > ranks_per_node).
//   prefetch  replica weights home -> replica rank: 3*H*I*weight_bytes per replica.
//   dispatch  token rows after dedup (one row per token and destination rank), H*act_bytes each.
//   compute   the slowest rank: its rows, each expert group padded to the plan's pad_multiple,
//             * flops_per_token / its rate (tflops * its speed); flops_per_token = 6*H*I
//             forward (three H x I matmuls, 2 flops per multiply-add), x3 for forward+backward.
//   combine   the same rows back (a destination sums a token's experts it computed before
//             sending, so combine moves as many rows as dispatch).
//   reduce    training only: replica weight gradients back home, 3*H*I*grad_bytes per replica.
// Per rank, a phase's time is max(intra bytes / intra bandwidth, inter bytes / inter bandwidth),
// bytes being the larger of what the rank sends and receives on that link (links are
// full-duplex, intra- and inter-node links run in parallel); the phase takes the slowest rank.
// Training adds the backward pass: combine-backward moves dispatch's rows, dispatch-backward
// moves combine's rows. With overlap_prefetch the forward prefetch hides under the forward
// dispatch, and only max(0, prefetch - dispatch) shows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace moonep::sim {

// A rank's speed (CostConfig::speeds) is in [1e-6, 1e6]: with the rates' bounds every compute time
// stays finite.
inline constexpr double kMinRankSpeed = 1e-6;
inline constexpr double kMaxRankSpeed = 1e6;

struct CostConfig {
  int32_t hidden = 0;              // H
  int32_t intermediate = 0;        // I (expert FFN width)
  double tflops = 400.0;           // achieved expert-GEMM rate per rank, TFLOP/s
  int32_t ranks_per_node = 8;      // 0: flat (every rank its own node)
  double intra_gbps = 150.0;       // per-rank intra-node bandwidth, GB/s each direction
  double inter_gbps = 40.0;        // per-rank inter-node bandwidth, GB/s each direction
  int32_t act_bytes = 2;           // bytes per activation element (bf16)
  int32_t weight_bytes = 2;        // bytes per weight element
  int32_t grad_bytes = 4;          // bytes per weight-gradient element (fp32)
  bool training = true;            // forward + backward; false: forward only
  bool overlap_prefetch = true;    // prefetch runs under the forward dispatch
  // [R] each rank's compute speed relative to `tflops` (rank r runs its GEMMs at tflops *
  // speeds[r]); empty: all 1. Links are not scaled: a slow rank is a throttled GPU.
  std::vector<double> speeds;

  int64_t row_bytes() const { return static_cast<int64_t>(hidden) * act_bytes; }
  int64_t expert_weight_bytes() const { return 3LL * hidden * intermediate * weight_bytes; }
  int64_t expert_grad_bytes() const { return 3LL * hidden * intermediate * grad_bytes; }
  double flops_per_token() const {
    return 6.0 * hidden * intermediate * (training ? 3.0 : 1.0);
  }
  double speed(int32_t rank) const { return speeds.empty() ? 1.0 : speeds[rank]; }
  double max_speed() const;  // the fastest rank's (1 without speeds)
  // Rank r's rate in FLOP/s, and the fastest rank's: the planner's levels and its replica and row
  // costs are in tokens of the fastest rank (PlannerConfig).
  double flop_rate(int32_t rank) const { return tflops * 1e12 * speed(rank); }
  double max_flop_rate() const { return tflops * 1e12 * max_speed(); }
};

absl::Status ValidateCostConfig(const CostConfig& config);

// Per-rank work and traffic of one plan on one step's routing.
struct RankTraffic {
  std::vector<int64_t> load;                     // tokens computed (rows, before padding)
  std::vector<int64_t> padded;                   // rows computed with the plan's group padding
                                                 // (>= load; 0 where not known: load is used)
  std::vector<int64_t> send_intra, send_inter;   // dispatched token rows after dedup, as source
  std::vector<int64_t> recv_intra, recv_inter;   // ... as destination
  // Expert transfers along the replica chains (transport/common/replica_chain.h): prefetch hops
  // home -> lowest holder rank -> next ..., reduce hops lowest holder -> next ... -> home; each
  // counted as sent by its source and received by its destination, intra when both are on a node.
  std::vector<int32_t> prefetch_out_intra, prefetch_out_inter;  // prefetch hops sent
  std::vector<int32_t> prefetch_in_intra, prefetch_in_inter;    // prefetch hops received
  std::vector<int32_t> reduce_out_intra, reduce_out_inter;      // reduce hops sent
  std::vector<int32_t> reduce_in_intra, reduce_in_inter;        // reduce hops received
  void Reset(int32_t num_ranks);
};

struct StepTime {
  double counts = 0;     // count allgather
  double prefetch = 0;   // exposed prefetch (all of it without overlap)
  double dispatch = 0;   // forward dispatch (+ backward dispatch of dx when training)
  double compute = 0;    // expert FFN on the slowest rank
  double combine = 0;    // forward combine (+ backward combine of dy when training)
  double reduce = 0;     // replica gradient reduction (training)
  double total = 0;
};

// Phase names in the order of StepTime's fields (for reports).
const std::vector<std::string>& StepTimePartNames();
double StepTimePart(const StepTime& t, size_t part);

// moonep-weighed's PlannerConfig::replica_cost_intra / _inter: what one replica transfer on a
// rank costs, in tokens of compute of the fastest rank (max_flop_rate(), as the planner counts a
// rank's level; at tflops when no rank is faster than 1). Training: its gradients (the reduce),
// plus its weights when the prefetch does not overlap the dispatch; forward only: its weights.
// Rounded to the nearest token, at least 1, at most planner::kMaxReplicaCost.
void ReplicaCosts(const CostConfig& config, int64_t* intra, int64_t* inter);

// moonep-weighed's PlannerConfig::row_cost_intra / _inter: what one token row costs on a link, in
// 1/planner::kRowCostScale tokens of the fastest rank's compute: its dispatch and combine, forward
// and (training) backward. Rounded, at least 1, at most planner::kMaxRowCost.
void RowCosts(const CostConfig& config, int64_t* intra, int64_t* inter);

// config.speeds, when given, has one speed per rank of `traffic`.
StepTime EstimateStepTime(const CostConfig& config, int32_t num_experts, const RankTraffic& traffic);

// Step time when the slowest rank computes for as long as the fastest takes over `max_level`
// tokens (a rank's level is its load * max_speed() / its speed: its load without speeds) and
// nothing but counts moves: the lower bound's row in the report.
StepTime EstimateComputeOnly(const CostConfig& config, int32_t num_ranks, int32_t num_experts,
                             double max_level);

// A named model and machine: the --preset flag.
struct Preset {
  std::string name;
  int32_t ranks, experts, topk, tokens, hidden, intermediate;
  std::string note;
};
const std::vector<Preset>& Presets();
const Preset* FindPreset(const std::string& name);

}  // namespace moonep::sim
