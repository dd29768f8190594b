// The simulation loop: one step of routing at a time (a routing model or a trace), every policy
// planned on it, per-rank traffic counted, the cost model applied, and per-policy summaries kept
// in memory that does not grow with the number of steps.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/plan.h"
#include "planner/sim/cost_model.h"
#include "planner/sim/rank_speeds.h"
#include "planner/sim/routing.h"
#include "planner/sim/stats.h"
#include "planner/sim/trace.h"
#include "planner/sim/traffic.h"

namespace moonep::sim {

enum class DetailChoice : int32_t { kAuto = -1, kTokens = 0, kCounts = 1, kTotals = 2 };
bool ParseDetailChoice(const std::string& name, DetailChoice* detail);

// A policy the simulator runs: a planner policy and, for moonep, whether it weighs replicas with
// costs from the cost model (named "moonep-weighed"; ReplicaCosts), or plans without the ranks'
// speeds on a machine that has them ("moonep-nospeeds": what a layer configured without `speeds`
// does there).
struct SimPolicy {
  planner::Policy policy = planner::Policy::kNone;
  bool weighed = false;
  bool without_speeds = false;
  SimPolicy() = default;
  SimPolicy(planner::Policy p, bool w = false, bool no_speeds = false)  // NOLINT: implicit
      : policy(p), weighed(w), without_speeds(no_speeds) {}
  static SimPolicy MoonEPWithoutSpeeds() { return SimPolicy(planner::Policy::kMoonEP, false, true); }
  bool operator==(const SimPolicy& o) const {
    return policy == o.policy && weighed == o.weighed && without_speeds == o.without_speeds;
  }
  std::string Name() const;
  // The moonep family (moonep, moonep-weighed, moonep-greedy) is given the machine's speeds in its
  // PlannerConfig, as a layer configured with them would be; the others balance tokens.
  bool plans_with_speeds() const;
};
// Parses a planner policy name (not test-force-replicas), "moonep-weighed" or "moonep-nospeeds".
bool ParseSimPolicy(const std::string& name, SimPolicy* policy);
// What --policies=all runs besides none: moonep-nospeeds only on a machine with speeds.
std::vector<SimPolicy> AllPolicies(bool with_speeds);

struct SimOptions {
  RoutingParams routing;           // sizes (R, E, K, T) and the routing model
  std::string trace_path;          // non-empty: replay this trace instead of a model
  TraceFormat trace_format = TraceFormat::kAuto;
  int32_t trace_layer = -1;        // replay only this layer's records (-1: every record)
  int64_t steps = 100;             // steps to run (a trace may end sooner; 0: the whole trace)
  std::vector<SimPolicy> policies;  // `none` is always run (it is the baseline)
  bool lower_bound = true;         // also report the load lower bound
  int32_t slots = -1;              // planner replica slots per rank (-1: E/R)
  int32_t pad_multiple = 1;
  int32_t eplb_period = 10;
  CostConfig cost;                 // cost.ranks_per_node is also the planner's topology
  // --rank_speeds. When not empty, Create resolves it against R into cost.speeds, replacing them
  // (left empty when every speed is 1: the same run as without it).
  RankSpeedsSpec rank_speeds;
  DetailChoice detail = DetailChoice::kAuto;
  int64_t snapshot_step = 0;       // step whose per-rank loads are kept for the load plot
  // moonep-weighed's replica costs in tokens; -1: ReplicaCosts of `cost` (each in [0, 2^52]).
  int64_t replica_cost_intra = -1, replica_cost_inter = -1;
  // moonep-weighed's row costs in 1/planner::kRowCostScale tokens; -1: RowCosts of `cost` (each
  // in [0, 2^40]; 0 and 0 leave rows out of its objective).
  int64_t row_cost_intra = -1, row_cost_inter = -1;
  bool shadow_from_cost_model = false;  // fastermoe-shadow: rates from `cost`, not the planner's
                                        // defaults (which the runtime uses)
  int32_t threads = 0;             // policies planned in parallel (0: one per core); each thread
                                   // holds its own Plan, so memory grows with it
};

// Largest R*T*K that the auto detail samples token by token, and largest R*E planned with full
// counts; beyond them the simulator runs on per-expert totals.
constexpr int64_t kMaxAutoTokenChoices = int64_t{1} << 24;
constexpr int64_t kMaxAutoCounts = int64_t{1} << 22;
constexpr int32_t kMaxCountsRanks = 2048;
// Largest R*T*K that detail=tokens holds at all (int32 ids: 8 GiB), whichever detail was asked for.
constexpr int64_t kMaxTokenChoices = int64_t{1} << 31;

// One row of --csv / --json: one step of one policy ("lower-bound" included).
struct StepRecord {
  int64_t step = 0;
  int32_t layer = 0;
  const std::string* policy = nullptr;
  PlanMetrics metrics;
  StepTime time;
  int64_t row_bytes = 0;           // bytes of one token row (H * act_bytes)
  int64_t expert_bytes = 0;        // bytes of one expert's weights (prefetch)
  int64_t grad_bytes = 0;          // bytes of one expert's gradient (reduce)
};

class StepSink {
 public:
  virtual ~StepSink() = default;
  virtual absl::Status OnStep(const StepRecord& record) = 0;
};

// Per-policy results over the whole run.
struct PolicySummary {
  std::string name;
  int64_t steps = 0;
  Distribution imbalance;          // max/mean rank load per step
  Distribution step_time;          // estimated seconds per step
  double sum_replicas = 0;
  double sum_dispatch_rows = 0;    // after dedup, intra + inter
  double sum_dispatch_inter = 0;
  double sum_bytes = 0;            // all bytes moved per step: dispatch, combine, prefetch, reduce
  StepTime sum_time;               // summed per part
  DownsampledSeries imbalance_series;
  std::vector<int64_t> snapshot_load;  // per-rank load at the snapshot step
  double mean_imbalance() const { return imbalance.mean(); }
  double mean_time() const { return step_time.mean(); }
  double mean(double sum) const { return steps > 0 ? sum / steps : 0; }
};

struct SimResult {
  int32_t num_ranks = 0, num_experts = 0, topk = 0, tokens_per_rank = 0;
  Detail detail = Detail::kTokens;
  int64_t steps = 0;                // records replayed (each layer's record of a step counts once)
  int32_t layers = 1;               // distinct layers among them (a trace may hold several)
  bool stopped_by_steps = false;    // a replay ended by SimOptions::steps with records left
  std::vector<std::string> warnings;  // what a run skipped (a trace's cut last record)
  int64_t snapshot_step = -1;      // -1 when the run ended before it
  std::vector<int64_t> snapshot_home_load;  // per-rank load with home placement at the snapshot
  std::vector<PolicySummary> policies;      // none first, then the others, then lower-bound
  double wall_seconds = 0;
};

// A lower bound of the slowest rank's level (its load * max speed / its speed: CostConfig) for
// any plan of these per-expert totals on ranks of these speeds: every rank's time balanced (the
// total over the sum of the speeds), and no expert split over more than `holders` ranks, at best
// the fastest. The lower-bound row's compute time with speeds comes from it.
double SpeedLevelLowerBound(absl::Span<const double> speeds, absl::Span<const int64_t> totals,
                            int64_t holders);

// The error of a run that ran out of memory (std::bad_alloc on any thread, or the host's free
// memory checked ahead): what to lower, which for a trace is the trace itself (its R and E), and
// --detail=totals unless the run used it already (`totals`: the detail it ran at, auto resolved).
absl::Status OutOfMemoryError(const SimOptions& options, bool totals);

class Simulator {
 public:
  // Validates options (errors name the option) and opens the trace or builds the model.
  static absl::StatusOr<std::unique_ptr<Simulator>> Create(const SimOptions& options);
  ~Simulator();

  // Runs every step. `sink` (may be null) sees every row; `progress` (may be null) is called
  // after each step with (done, total; total is -1 when a trace's length is unknown).
  absl::StatusOr<SimResult> Run(StepSink* sink,
                                const std::function<void(int64_t, int64_t)>& progress);

  Detail detail() const;
  const SimOptions& options() const;
  int32_t num_ranks() const;    // R and E: the options' or the trace's
  int32_t num_experts() const;

 private:
  Simulator();
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace moonep::sim
