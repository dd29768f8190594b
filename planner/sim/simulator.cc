#include "planner/sim/simulator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <new>
#include <set>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "moonep/core/status.h"
#include "planner/planner.h"

namespace moonep::sim {

using planner::Plan;
using planner::Planner;
using planner::PlannerConfig;
using planner::Policy;

bool ParseDetailChoice(const std::string& name, DetailChoice* detail) {
  if (name == "auto") *detail = DetailChoice::kAuto;
  else if (name == "tokens") *detail = DetailChoice::kTokens;
  else if (name == "counts") *detail = DetailChoice::kCounts;
  else if (name == "totals") *detail = DetailChoice::kTotals;
  else return false;
  return true;
}

std::string SimPolicy::Name() const {
  std::string name = planner::PolicyName(policy);
  if (weighed) name += "-weighed";
  if (without_speeds) name += "-nospeeds";
  return name;
}

bool SimPolicy::plans_with_speeds() const {
  return !without_speeds && (policy == Policy::kMoonEP || policy == Policy::kMoonEPGreedy);
}

bool ParseSimPolicy(const std::string& name, SimPolicy* policy) {
  if (name == "moonep-weighed") {
    *policy = SimPolicy(Policy::kMoonEP, true);
    return true;
  }
  if (name == "moonep-nospeeds") {
    *policy = SimPolicy::MoonEPWithoutSpeeds();
    return true;
  }
  Policy p;
  if (!planner::ParsePolicy(name, &p) || p == Policy::kTestForceReplicas) return false;
  *policy = SimPolicy(p);
  return true;
}

std::vector<SimPolicy> AllPolicies(bool with_speeds) {
  std::vector<SimPolicy> all = {Policy::kMoonEP, SimPolicy(Policy::kMoonEP, true),
                                Policy::kMoonEPGreedy, Policy::kEplb, Policy::kFasterMoEShadow};
  // Next to moonep, which it is moonep without the speeds of.
  if (with_speeds) all.insert(all.begin() + 1, SimPolicy::MoonEPWithoutSpeeds());
  return all;
}

double SpeedLevelLowerBound(absl::Span<const double> speeds, absl::Span<const int64_t> totals,
                            int64_t holders) {
  // In time at speed 1 (tokens / speed), scaled to the fastest rank's tokens at the end. In time L
  // a rank of speed s computes at most s * L tokens: all ranks together L * sum(speeds), an
  // expert's holders L times the sum of their speeds, at most that of the `holders` fastest.
  if (speeds.empty() || holders < 1) return 0;
  std::vector<double> fastest(speeds.begin(), speeds.end());
  std::sort(fastest.begin(), fastest.end(), std::greater<double>());
  double all = 0, top = 0;
  for (size_t i = 0; i < fastest.size(); ++i) {
    all += fastest[i];
    if (static_cast<int64_t>(i) < holders) top += fastest[i];
  }
  double total = 0, largest = 0;
  for (int64_t v : totals) {
    total += static_cast<double>(v);
    largest = std::max(largest, static_cast<double>(v));
  }
  return std::max(total / all, largest / top) * fastest[0];
}

absl::Status OutOfMemoryError(const SimOptions& o, bool totals) {
  if (!o.trace_path.empty()) {
    return OutOfMemory("out of memory: this replay needs more memory than the process could get; "
                       "its size is the trace's R*E ('%s': its header, or --ranks times a CSV "
                       "row's counts): lower --threads%s, or replay a smaller trace", o.trace_path,
                       totals ? "" : ", use --detail=totals");
  }
  return OutOfMemory("out of memory: this run needs more memory than the process could get; lower "
                     "--ranks, --experts, --tokens or --threads%s", totals ? "" : ", or use --detail=totals");
}

struct Simulator::State {
  SimOptions options;
  int32_t R = 0, E = 0, K = 0, T = 0;
  Detail detail = Detail::kTokens;
  std::unique_ptr<RoutingModel> model;
  std::unique_ptr<TraceReader> trace;
  // One planner per policy and layer: a planner keeps history (EPLB's window and re-plan period,
  // the plan cache), and the runtime keeps one per layer, so a trace's layers never share one.
  // Layer 0's set is made by Create; a trace's other layers get theirs when first seen.
  std::vector<PlannerConfig> configs;  // per policy
  std::map<int32_t, std::vector<std::unique_ptr<Planner>>> planners;
  std::vector<std::string> names;  // per policy, then "lower-bound"
  // Per worker thread: a plan shared by the policies that worker runs (the planner clears it
  // sparsely, so reuse is cheap), and traffic scratch.
  struct Worker {
    Plan plan;
    TrafficCounter counter;
    RankTraffic traffic;
  };
  std::vector<Worker> workers;
  StepRouting routing;
  TraceRecord record;
  std::vector<int32_t> node_domain;  // [nodes * D] ranks of each domain in each node (model)
  std::vector<int64_t> node_counts;  // [nodes * E] tokens of each expert from each node (trace)
  int32_t rpn = 1;                   // ranks per node for locality (1 when flat)
  std::vector<std::string> warnings;  // found by Create, reported with every run's result
};

Simulator::Simulator() : state_(new State) {}
Simulator::~Simulator() = default;
Detail Simulator::detail() const { return state_->detail; }
int32_t Simulator::num_ranks() const { return state_->R; }
int32_t Simulator::num_experts() const { return state_->E; }
const SimOptions& Simulator::options() const { return state_->options; }

absl::StatusOr<std::unique_ptr<Simulator>> Simulator::Create(const SimOptions& options) {
  std::unique_ptr<Simulator> sim(new Simulator());
  State& st = *sim->state_;
  st.options = options;
  SimOptions& o = st.options;
  MOONEP_CHECK_ARG(o.steps >= 0, "steps must be >= 0, got %d", o.steps);
  MOONEP_CHECK_ARG(o.steps > 0 || !o.trace_path.empty(), "steps must be positive without a trace");
  MOONEP_CHECK_ARG(o.eplb_period >= 1, "eplb_period must be >= 1, got %d", o.eplb_period);
  MOONEP_CHECK_ARG(o.pad_multiple >= 1, "pad_multiple must be >= 1, got %d", o.pad_multiple);
  MOONEP_CHECK_ARG(o.slots == -1 || o.slots >= 1, "slots must be >= 1 (or -1 for E/R), got %d",
                   o.slots);
  MOONEP_CHECK_ARG(o.snapshot_step >= 0, "svg_step must be >= 0, got %d", o.snapshot_step);
  MOONEP_CHECK_ARG(o.trace_layer >= -1, "trace_layer must be >= -1, got %d", o.trace_layer);
  MOONEP_RETURN_IF_ERROR(Annotate(ValidateCostConfig(o.cost), "cost model"));

  if (!o.trace_path.empty()) {
    MOONEP_CHECK_ARG(o.detail != DetailChoice::kTokens,
                     "detail=tokens needs a routing model: a trace holds counts, not tokens");
    MOONEP_ASSIGN_OR_RETURN(st.trace, TraceReader::Open(o.trace_path, o.trace_format,
                                                        o.routing.num_ranks, o.routing.topk));
    st.R = st.trace->num_ranks();
    st.E = st.trace->num_experts();
    st.K = st.trace->topk();

  } else {
    MOONEP_RETURN_IF_ERROR(ValidateRoutingParams(o.routing));
    st.R = o.routing.num_ranks;
    st.E = o.routing.num_experts;
    st.K = o.routing.topk;
    st.T = o.routing.tokens_per_rank;
    MOONEP_ASSIGN_OR_RETURN(st.model, RoutingModel::Create(o.routing));
  }
  MOONEP_CHECK_ARG(st.E % st.R == 0, "experts (%d) must be divisible by ranks (%d)", st.E, st.R);
  if (!o.rank_speeds.empty()) {
    // Known only now for a trace: R. Every speed 1 is the machine without speeds (the same run).
    absl::StatusOr<std::vector<double>> speeds = ResolveRankSpeeds(o.rank_speeds, st.R);
    if (!speeds.ok()) return Annotate(speeds.status(), "--rank_speeds");
    o.cost.speeds.clear();
    if (!o.rank_speeds.all_one()) o.cost.speeds = *std::move(speeds);
  }
  MOONEP_CHECK_ARG(o.cost.speeds.empty() || o.cost.speeds.size() == static_cast<size_t>(st.R),
                   "cost model: %d speeds for %d ranks", o.cost.speeds.size(), st.R);

  const int64_t counts_size = static_cast<int64_t>(st.R) * st.E;
  switch (o.detail) {
    case DetailChoice::kTokens: st.detail = Detail::kTokens; break;
    case DetailChoice::kCounts: st.detail = Detail::kCounts; break;
    case DetailChoice::kTotals: st.detail = Detail::kTotals; break;
    case DetailChoice::kAuto: {
      const bool counts_ok = counts_size <= kMaxAutoCounts && st.R <= kMaxCountsRanks;
      if (st.trace) {
        st.detail = counts_ok ? Detail::kCounts : Detail::kTotals;
      } else {
        const int64_t choices = static_cast<int64_t>(st.R) * st.T * st.K;
        st.detail = counts_ok && choices <= kMaxAutoTokenChoices ? Detail::kTokens : Detail::kTotals;
      }
      break;
    }
  }
  MOONEP_CHECK_ARG(st.detail != Detail::kCounts || st.R <= kMaxCountsRanks,
                   "detail=counts keeps an R x R matrix: ranks must be <= %d, got %d",
                   kMaxCountsRanks, st.R);
  if (st.detail == Detail::kTokens) {
    const int64_t choices = static_cast<int64_t>(st.R) * st.T * st.K;
    MOONEP_CHECK_ARG(choices <= kMaxTokenChoices,
                     "detail=tokens holds every token's choices: ranks * tokens * topk = %d is "
                     "above %d (%d GiB); use --detail=counts or totals",
                     choices, kMaxTokenChoices, kMaxTokenChoices * 4 >> 30);
  }

  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"replica_cost_intra", o.replica_cost_intra},
                                 {"replica_cost_inter", o.replica_cost_inter}}) {
    MOONEP_CHECK_ARG(v >= -1 && v <= planner::kMaxReplicaCost,
                     "%s must be -1 (from the cost model) or in [0, 2^52], got %d", name, v);
  }
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"row_cost_intra", o.row_cost_intra},
                                 {"row_cost_inter", o.row_cost_inter}}) {
    MOONEP_CHECK_ARG(v >= -1 && v <= planner::kMaxRowCost,
                     "%s must be -1 (from the cost model) or in [0, 2^40], got %d", name, v);
  }
  std::vector<SimPolicy> policies = {Policy::kNone};
  for (const SimPolicy& p : o.policies) {
    MOONEP_CHECK_ARG(p.policy != Policy::kTestForceReplicas, "policy test-force-replicas is for tests only");
    MOONEP_CHECK_ARG(!p.weighed || p.policy == Policy::kMoonEP, "only moonep weighs replicas, not %s",
                     planner::PolicyName(p.policy));
    MOONEP_CHECK_ARG(!p.without_speeds || (p.policy == Policy::kMoonEP && !p.weighed),
                     "only moonep runs as moonep-nospeeds, not %s", SimPolicy(p.policy, p.weighed).Name());
    if (std::find(policies.begin(), policies.end(), p) == policies.end()) policies.push_back(p);
  }
  for (const SimPolicy& sp : policies) {
    const Policy p = sp.policy;
    PlannerConfig c;
    c.num_ranks = st.R;
    c.num_experts = st.E;
    c.slots = o.slots;
    c.pad_multiple = o.pad_multiple;
    c.ranks_per_node = o.cost.ranks_per_node;
    c.policy = p;
    c.row_bytes = o.cost.row_bytes();
    c.expert_bytes = o.cost.expert_weight_bytes();
    c.eplb_period = o.eplb_period;
    if (sp.plans_with_speeds()) c.speeds = o.cost.speeds;
    // FasterMoE's shadowing rule: the planner's defaults, as the runtime uses them (so counts
    // agree with it), or the machine the cost model describes.
    if (o.shadow_from_cost_model) {
      c.shadow_compute_s_per_token = o.cost.flops_per_token() / (o.cost.tflops * 1e12);
      c.shadow_broadcast_s_per_byte = 1.0 / (o.cost.inter_gbps * 1e9);
    }
    if (sp.weighed) {
      ReplicaCosts(o.cost, &c.replica_cost_intra, &c.replica_cost_inter);
      if (o.replica_cost_intra >= 0) c.replica_cost_intra = o.replica_cost_intra;
      if (o.replica_cost_inter >= 0) c.replica_cost_inter = o.replica_cost_inter;
      RowCosts(o.cost, &c.row_cost_intra, &c.row_cost_inter);
      if (o.row_cost_intra >= 0) c.row_cost_intra = o.row_cost_intra;
      if (o.row_cost_inter >= 0) c.row_cost_inter = o.row_cost_inter;
    }
    MOONEP_ASSIGN_OR_RETURN(std::unique_ptr<Planner> planner, Planner::Create(c));
    // EPLB puts (E + R) / R physical experts on every rank (one redundant expert a rank). Each one
    // not homed there takes a replica slot; beyond the slots a copy falls back to its home, which
    // is how it must run inside the runtime, but is not EPLB as published.
    const int32_t eplb_per_rank = (st.E + st.R) / st.R;
    if (p == Policy::kEplb && planner->config().slots < eplb_per_rank) {
      st.warnings.push_back(absl::StrFormat(
          "eplb places %d physical experts on each rank, and with %d replica slots a rank "
          "holding more than %d experts homed elsewhere sends the rest back to their homes, "
          "which balances worse than EPLB as published; pass --slots=%d to compare with it",
          eplb_per_rank, planner->config().slots, planner->config().slots, eplb_per_rank));
    }
    st.planners[0].push_back(std::move(planner));
    st.configs.push_back(c);
    st.names.push_back(sp.Name());
  }
  st.names.push_back("lower-bound");

  MOONEP_CHECK_ARG(o.threads >= 0, "threads must be >= 0, got %d", o.threads);
  int32_t threads = o.threads > 0 ? o.threads : static_cast<int32_t>(std::thread::hardware_concurrency());
  threads = std::max(1, std::min<int32_t>(threads, static_cast<int32_t>(st.configs.size())));
  st.workers.resize(threads);

  // A node larger than R is one node of all R ranks (the planner reads it the same way).
  st.rpn = o.cost.ranks_per_node > 0 ? std::min(o.cost.ranks_per_node, st.R) : 1;
  if (st.model) {
    const int32_t nodes = (st.R - 1) / st.rpn + 1, D = st.model->num_domains();
    st.node_domain.assign(static_cast<size_t>(nodes) * D, 0);
    for (int32_t r = 0; r < st.R; ++r) ++st.node_domain[static_cast<size_t>(r / st.rpn) * D + st.model->DomainOf(r)];
  }
  return sim;
}

namespace {

void Accumulate(const PlanMetrics& m, const StepTime& t, const CostConfig& cost, PolicySummary* s) {
  ++s->steps;
  s->imbalance.Add(m.imbalance());
  s->step_time.Add(t.total);
  s->imbalance_series.Add(m.imbalance());
  s->sum_replicas += m.replicas;
  const double rows = static_cast<double>(m.dispatch_intra + m.dispatch_inter);
  s->sum_dispatch_rows += rows;
  s->sum_dispatch_inter += m.dispatch_inter;
  const double passes = cost.training ? 2.0 : 1.0;
  s->sum_bytes += rows * cost.row_bytes() * 2 * passes +
                  static_cast<double>(m.replicas) * cost.expert_weight_bytes() +
                  (cost.training ? static_cast<double>(m.replicas) * cost.expert_grad_bytes() : 0.0);
  s->sum_time.counts += t.counts;
  s->sum_time.prefetch += t.prefetch;
  s->sum_time.dispatch += t.dispatch;
  s->sum_time.compute += t.compute;
  s->sum_time.combine += t.combine;
  s->sum_time.reduce += t.reduce;
  s->sum_time.total += t.total;
}

}  // namespace

absl::StatusOr<SimResult> Simulator::Run(StepSink* sink,
                                         const std::function<void(int64_t, int64_t)>& progress) {
  State& st = *state_;
  const SimOptions& o = st.options;
  const auto start = std::chrono::steady_clock::now();
  const int32_t R = st.R, E = st.E;
  SimResult result;
  result.num_ranks = R;
  result.num_experts = E;
  result.topk = st.K;
  result.tokens_per_rank = st.T;
  result.detail = st.detail;
  result.warnings = st.warnings;
  result.policies.resize(st.names.size());
  for (size_t i = 0; i < st.names.size(); ++i) result.policies[i].name = st.names[i];

  StepRecord rec;
  rec.row_bytes = o.cost.row_bytes();
  rec.expert_bytes = o.cost.expert_weight_bytes();
  rec.grad_bytes = o.cost.training ? o.cost.expert_grad_bytes() : 0;

  const LocalityFn model_locality = [&st, R](int32_t rank, int32_t e, double* own, double* node) {
    const double n = static_cast<double>(st.routing.totals[e]);
    const int32_t D = st.model->num_domains();
    *own = st.model->ExpectedShare(rank, e) * n;
    double share = 0;
    const int32_t* cnt = st.node_domain.data() + static_cast<size_t>(rank / st.rpn) * D;
    for (int32_t d = 0; d < D; ++d) {
      if (cnt[d] == 0) continue;
      // Any rank of domain d: its first rank.
      const int32_t r = static_cast<int32_t>((static_cast<int64_t>(d) * R + D - 1) / D);
      share += cnt[d] * st.model->ExpectedShare(r, e);
    }
    *node = share * n;
  };
  const LocalityFn trace_locality = [&st](int32_t rank, int32_t e, double* own, double* node) {
    *own = static_cast<double>(st.routing.counts[static_cast<size_t>(rank) * st.E + e]);
    *node = static_cast<double>(st.node_counts[static_cast<size_t>(rank / st.rpn) * st.E + e]);
  };

  // Made ahead: a worker that ran out of memory takes a copy, which allocates nothing.
  const absl::Status out_of_memory = OutOfMemoryError(o, st.detail == Detail::kTotals);
  const int64_t total_steps = o.steps > 0 ? o.steps : -1;
  std::set<int32_t> layers_seen;
  int64_t step = 0;
  for (; o.steps == 0 || step < o.steps; ++step) {
    // Routing of this step.
    if (st.trace) {
      bool got = false;
      do {
        MOONEP_ASSIGN_OR_RETURN(got, st.trace->Next(&st.record));
      } while (got && o.trace_layer >= 0 && st.record.layer != o.trace_layer);
      if (!got) break;
      if (st.planners.find(st.record.layer) == st.planners.end()) {
        std::vector<std::unique_ptr<Planner>>& set = st.planners[st.record.layer];
        for (const PlannerConfig& c : st.configs) {
          MOONEP_ASSIGN_OR_RETURN(std::unique_ptr<Planner> planner, Planner::Create(c));
          set.push_back(std::move(planner));
        }
      }
      StepRouting& r = st.routing;
      r.num_ranks = R;
      r.num_experts = E;
      r.topk = st.K;
      r.counts.swap(st.record.counts);
      r.topk_ids.clear();
      r.totals.assign(E, 0);
      r.tokens.assign(R, 0);
      for (int32_t s = 0; s < R; ++s) {
        int64_t row = 0;
        const int64_t* c = r.counts.data() + static_cast<size_t>(s) * E;
        for (int32_t e = 0; e < E; ++e) {
          r.totals[e] += c[e];
          row += c[e];
        }
        // Each token makes K choices (fewer when some are -1: then this undercounts tokens). The
        // reader bounds a record's sum by 2^52, so neither sum overflows.
        r.tokens[s] = st.K > 0 ? (row + st.K - 1) / st.K : row;
      }
      if (st.detail == Detail::kTotals) {
        const int32_t nodes = (R - 1) / st.rpn + 1;
        st.node_counts.assign(static_cast<size_t>(nodes) * E, 0);
        for (int32_t s = 0; s < R; ++s) {
          int64_t* dst = st.node_counts.data() + static_cast<size_t>(s / st.rpn) * E;
          const int64_t* c = r.counts.data() + static_cast<size_t>(s) * E;
          for (int32_t e = 0; e < E; ++e) dst[e] += c[e];
        }
      }
      rec.step = st.record.step;
      rec.layer = st.record.layer;
    } else {
      if (st.detail == Detail::kTotals) {
        st.model->NextTotals(&st.routing);
      } else {
        st.model->NextTokens(&st.routing);
        if (st.detail == Detail::kCounts) st.routing.topk_ids.clear();
      }
      rec.step = step;
      rec.layer = 0;
    }
    const bool snapshot = step == o.snapshot_step;
    if (snapshot) result.snapshot_step = step;

    // Policies are independent: workers take them in turn; rows are emitted in policy order.
    layers_seen.insert(rec.layer);
    std::vector<std::unique_ptr<Planner>>& planners = st.planners[rec.layer];
    const size_t P = planners.size();
    std::vector<PlanMetrics> metrics(P);
    std::vector<StepTime> times(P);
    std::vector<absl::Status> status(P);
    std::atomic<size_t> next{0};
    auto plan_one = [&](size_t i, State::Worker& w) -> absl::Status {
      Planner& planner = *planners[i];
      PlanMetrics& m = metrics[i];
      if (st.detail == Detail::kTotals) {
        MOONEP_RETURN_IF_ERROR(planner.Decide(st.routing.totals, &w.plan));
        w.counter.FromTotals(w.plan, st.routing, st.trace ? trace_locality : model_locality,
                             &w.traffic, &m);
      } else {
        MOONEP_RETURN_IF_ERROR(planner.MakePlan(st.routing.counts, &w.plan));
        if (st.detail == Detail::kTokens) {
          w.counter.FromTokens(w.plan, st.routing, &w.traffic, &m);
        } else {
          w.counter.FromCounts(w.plan, st.routing, &w.traffic, &m);
        }
      }
      times[i] = EstimateStepTime(o.cost, E, w.traffic);
      if (snapshot) result.policies[i].snapshot_load = w.traffic.load;
      return absl::OkStatus();
    };
    auto work = [&](State::Worker& w) {
      for (size_t i = next++; i < P; i = next++) {
        // An exception leaving a thread is std::terminate: running out of memory on a worker is
        // this policy's error instead, the one the main thread reports.
        try {
          status[i] = plan_one(i, w);
        } catch (const std::bad_alloc&) {
          status[i] = out_of_memory;
        }
      }
    };
    std::vector<std::thread> threads;
    threads.reserve(st.workers.size());
    for (size_t k = 1; k < st.workers.size(); ++k) {
      // A thread that cannot be started leaves its policies to the others (results do not depend
      // on the number of threads); nothing may throw past threads already running.
      try {
        threads.emplace_back(work, std::ref(st.workers[k]));
      } catch (const std::system_error&) {
        break;
      } catch (const std::bad_alloc&) {
        break;
      }
    }
    work(st.workers[0]);
    for (std::thread& t : threads) t.join();
    for (size_t i = 0; i < P; ++i) {
      MOONEP_RETURN_IF_ERROR(
          Annotate(status[i], absl::StrFormat("step %d, policy %s", rec.step, st.names[i])));
      Accumulate(metrics[i], times[i], o.cost, &result.policies[i]);
      if (sink) {
        rec.policy = &st.names[i];
        rec.metrics = metrics[i];
        rec.time = times[i];
        MOONEP_RETURN_IF_ERROR(sink->OnStep(rec));
      }
    }
    if (snapshot) result.snapshot_home_load = result.policies[0].snapshot_load;  // none: home

    if (o.lower_bound) {
      PlanMetrics m;
      m.detail = st.detail;
      for (int64_t v : st.routing.totals) m.total_tokens += v;
      m.mean_load = static_cast<double>(m.total_tokens) / R;
      // none's config: it has no speeds, and the least load in tokens does not depend on them
      // (LoadLowerBound given speeds would leave out the slot limit).
      const PlannerConfig& c = planners[0]->config();
      // No expert split over more than its home plus R*slots replicas. (The planner refuses
      // slots < 1, so every rank has a slot.)
      const int64_t holders = 1 + std::min<int64_t>(R - 1, static_cast<int64_t>(R) * c.slots);
      if (st.routing.has_counts()) {
        m.max_load = planner::LoadLowerBound(c, st.routing.counts);
      } else {
        // LoadLowerBound needs counts[R][E]; with totals only, the same bound for equal speeds:
        // perfect balance, and each expert over at most `holders` ranks.
        m.max_load = (m.total_tokens + R - 1) / R;
        for (int64_t v : st.routing.totals) m.max_load = std::max(m.max_load, (v + holders - 1) / holders);
      }
      // The time does depend on speeds: then the compute is the bound of the slowest rank's level,
      // which is also at least the busiest rank's load.
      double max_level = static_cast<double>(m.max_load);
      if (!o.cost.speeds.empty()) {
        max_level = std::max(max_level,
                             SpeedLevelLowerBound(o.cost.speeds, st.routing.totals, holders));
      }
      const StepTime t = EstimateComputeOnly(o.cost, R, E, max_level);
      Accumulate(m, t, o.cost, &result.policies.back());
      if (sink) {
        rec.policy = &st.names.back();
        rec.metrics = m;
        rec.time = t;
        MOONEP_RETURN_IF_ERROR(sink->OnStep(rec));
      }
    }
    if (progress) progress(step + 1, total_steps);
  }
  if (st.trace && step == 0) {
    // A record skipped as cut short is why there are none: say so (warnings print only on success).
    const std::string why =
        st.trace->warning().empty() ? "" : absl::StrCat(" (", st.trace->warning(), ")");
    if (o.trace_layer >= 0) {
      return InvalidArgument("trace '%s' has no record of layer %d%s", o.trace_path, o.trace_layer,
                             why);
    }
    return InvalidArgument("trace '%s' has no records%s", o.trace_path, why);
  }
  if (st.trace) {
    if (o.steps > 0 && step == o.steps) {
      MOONEP_ASSIGN_OR_RETURN(const bool at_end, st.trace->AtEnd());
      result.stopped_by_steps = !at_end;
    }
    if (!st.trace->warning().empty()) result.warnings.push_back(st.trace->warning());
  }
  if (!o.lower_bound) result.policies.pop_back();
  result.steps = step;
  result.layers = static_cast<int32_t>(layers_seen.size());
  result.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace moonep::sim
