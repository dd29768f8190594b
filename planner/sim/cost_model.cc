#include "planner/sim/cost_model.h"

#include <algorithm>
#include <cmath>

#include "moonep/core/status.h"
#include "planner/plan.h"

namespace moonep::sim {

absl::Status ValidateCostConfig(const CostConfig& c) {
  MOONEP_CHECK_ARG(c.hidden > 0, "hidden must be positive, got %d", c.hidden);
  MOONEP_CHECK_ARG(c.intermediate > 0, "intermediate must be positive, got %d", c.intermediate);
  // Rates in [1e-6, 1e9]: every time the model makes is then finite (bytes and flops are below
  // 2^63 and 2^127), and a rate of 1e-300 is a typo, not a machine.
  const auto rate_ok = [](double v) { return v >= 1e-6 && v <= 1e9; };  // false for NaN
  MOONEP_CHECK_ARG(rate_ok(c.tflops), "tflops must be in [1e-6, 1e9], got %g", c.tflops);
  for (size_t r = 0; r < c.speeds.size(); ++r) {
    MOONEP_CHECK_ARG(c.speeds[r] >= kMinRankSpeed && c.speeds[r] <= kMaxRankSpeed,
                     "the speed of rank %d must be in [1e-6, 1e6], got %g", r, c.speeds[r]);
  }
  MOONEP_CHECK_ARG(c.ranks_per_node >= 0, "ranks_per_node must be >= 0, got %d", c.ranks_per_node);
  MOONEP_CHECK_ARG(rate_ok(c.intra_gbps), "intra_gbps must be in [1e-6, 1e9], got %g", c.intra_gbps);
  MOONEP_CHECK_ARG(rate_ok(c.inter_gbps), "inter_gbps must be in [1e-6, 1e9], got %g", c.inter_gbps);
  MOONEP_CHECK_ARG(c.act_bytes > 0 && c.act_bytes <= 8, "act_bytes must be in [1, 8], got %d", c.act_bytes);
  MOONEP_CHECK_ARG(c.weight_bytes > 0 && c.weight_bytes <= 8, "weight_bytes must be in [1, 8], got %d",
                   c.weight_bytes);
  MOONEP_CHECK_ARG(c.grad_bytes > 0 && c.grad_bytes <= 8, "grad_bytes must be in [1, 8], got %d",
                   c.grad_bytes);
  // One expert's weights (or gradients) at most 2^40 bytes, the planner's bound on expert_bytes:
  // expert_weight_bytes() and the byte counts made from it then fit in int64.
  const int64_t per_element = 3LL * std::max(c.weight_bytes, c.grad_bytes);
  MOONEP_CHECK_ARG(static_cast<int64_t>(c.hidden) * c.intermediate <= (int64_t{1} << 40) / per_element,
                   "3 x hidden (%d) x intermediate (%d) x %d bytes: an expert above 2^40 bytes",
                   c.hidden, c.intermediate, std::max(c.weight_bytes, c.grad_bytes));
  return absl::OkStatus();
}

double CostConfig::max_speed() const {
  return speeds.empty() ? 1.0 : *std::max_element(speeds.begin(), speeds.end());
}

void RankTraffic::Reset(int32_t num_ranks) {
  for (std::vector<int64_t>* v : {&load, &padded, &send_intra, &send_inter, &recv_intra, &recv_inter}) {
    v->assign(num_ranks, 0);
  }
  for (std::vector<int32_t>* v :
       {&prefetch_out_intra, &prefetch_out_inter, &prefetch_in_intra, &prefetch_in_inter,
        &reduce_out_intra, &reduce_out_inter, &reduce_in_intra, &reduce_in_inter}) {
    v->assign(num_ranks, 0);
  }
}

const std::vector<std::string>& StepTimePartNames() {
  static const std::vector<std::string> names = {"counts", "prefetch", "dispatch",
                                                 "compute", "combine", "reduce"};
  return names;
}

double StepTimePart(const StepTime& t, size_t part) {
  switch (part) {
    case 0: return t.counts;
    case 1: return t.prefetch;
    case 2: return t.dispatch;
    case 3: return t.compute;
    case 4: return t.combine;
    case 5: return t.reduce;
  }
  return 0;
}

namespace {

double CountsTime(const CostConfig& c, int32_t R, int32_t E) {
  const double bytes = static_cast<double>(R - 1) * E * 4;
  const bool multi_node = c.ranks_per_node == 0 ? R > 1 : R > c.ranks_per_node;
  return bytes / ((multi_node ? c.inter_gbps : c.intra_gbps) * 1e9);
}

// What moving `bytes` over each link class costs in tokens of the fastest rank's compute, times
// `scale`: rounded, at least 1, at most `max`.
void LinkCosts(const CostConfig& c, double bytes, double scale, int64_t max, int64_t* intra,
               int64_t* inter) {
  const double token_s = c.flops_per_token() / c.max_flop_rate();
  const auto cost = [&](double gbps) {
    const double t = std::round(bytes / (gbps * 1e9) / token_s * scale);
    return static_cast<int64_t>(std::clamp(t, 1.0, static_cast<double>(max)));
  };
  *intra = cost(c.intra_gbps);
  *inter = cost(c.inter_gbps);
}

}  // namespace

void ReplicaCosts(const CostConfig& c, int64_t* intra, int64_t* inter) {
  double bytes = 0;
  if (c.training) bytes += static_cast<double>(c.expert_grad_bytes());
  if (!c.training || !c.overlap_prefetch) bytes += static_cast<double>(c.expert_weight_bytes());
  LinkCosts(c, bytes, 1.0, planner::kMaxReplicaCost, intra, inter);
}

void RowCosts(const CostConfig& c, int64_t* intra, int64_t* inter) {
  // A row crosses the link in the dispatch and the combine, forward and (training) backward.
  const double bytes = (c.training ? 4.0 : 2.0) * static_cast<double>(c.row_bytes());
  LinkCosts(c, bytes, planner::kRowCostScale, planner::kMaxRowCost, intra, inter);
}

StepTime EstimateStepTime(const CostConfig& c, int32_t E, const RankTraffic& tr) {
  const int32_t R = static_cast<int32_t>(tr.load.size());
  const double intra = c.intra_gbps * 1e9, inter = c.inter_gbps * 1e9;
  const double row = static_cast<double>(c.row_bytes());
  const double wbytes = static_cast<double>(c.expert_weight_bytes());
  const double gbytes = static_cast<double>(c.expert_grad_bytes());
  double rows_time = 0, prefetch_time = 0, reduce_time = 0, compute_time = 0;
  for (int32_t r = 0; r < R; ++r) {
    // The GEMMs run over the padded rows, at the rank's own rate.
    const int64_t rows = std::max(tr.load[r], tr.padded[r]);
    compute_time = std::max(compute_time, rows * c.flops_per_token() / c.flop_rate(r));
    const double a = std::max(tr.send_intra[r], tr.recv_intra[r]) * row / intra;
    const double b = std::max(tr.send_inter[r], tr.recv_inter[r]) * row / inter;
    rows_time = std::max(rows_time, std::max(a, b));
    const double pi = std::max(tr.prefetch_out_intra[r], tr.prefetch_in_intra[r]);
    const double pe = std::max(tr.prefetch_out_inter[r], tr.prefetch_in_inter[r]);
    prefetch_time = std::max(prefetch_time, std::max(pi * wbytes / intra, pe * wbytes / inter));
    const double ri = std::max(tr.reduce_out_intra[r], tr.reduce_in_intra[r]);
    const double re = std::max(tr.reduce_out_inter[r], tr.reduce_in_inter[r]);
    reduce_time = std::max(reduce_time, std::max(ri * gbytes / intra, re * gbytes / inter));
  }
  const double passes = c.training ? 2.0 : 1.0;
  StepTime t;
  t.counts = CountsTime(c, R, E);
  t.prefetch = c.overlap_prefetch ? std::max(0.0, prefetch_time - rows_time) : prefetch_time;
  t.dispatch = passes * rows_time;
  t.compute = compute_time;
  t.combine = passes * rows_time;
  t.reduce = c.training ? reduce_time : 0.0;
  t.total = t.counts + t.prefetch + t.dispatch + t.compute + t.combine + t.reduce;
  return t;
}

StepTime EstimateComputeOnly(const CostConfig& c, int32_t R, int32_t E, double max_level) {
  StepTime t;
  t.counts = CountsTime(c, R, E);
  t.compute = max_level * c.flops_per_token() / c.max_flop_rate();
  t.total = t.counts + t.compute;
  return t;
}

const std::vector<Preset>& Presets() {
  static const std::vector<Preset> presets = {
      {"deepseek-v3-ep64", 64, 256, 8, 4096, 7168, 2048,
       "DeepSeek-V3 routed experts on 64 ranks (8 nodes of 8)"},
      {"kimi-k3.1-like-ep128", 128, 896, 16, 4096, 7168, 1024,
       "assumed shape: H=7168 as Kimi K2, I=1024 (finer experts than K2's 2048, so that K=16 "
       "costs about what K2's K=8 does); 128 ranks (16 nodes of 8)"},
      {"mixtral-ep8", 8, 8, 2, 4096, 4096, 14336, "Mixtral 8x7B on one node of 8"},
  };
  return presets;
}

const Preset* FindPreset(const std::string& name) {
  for (const Preset& p : Presets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

}  // namespace moonep::sim
