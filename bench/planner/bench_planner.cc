// moonep-bench-planner: median time per plan for the shapes (Zipf 1.2 routing), for the
// policies moonep, moonep-greedy and none, full plans (MakePlan) and decisions only (Decide), and
// moonep without its cross-check against moonep-greedy (moonep-nocheck), and moonep weighing
// replicas (moonep-weighed: PlannerConfig::replica_cost_* of 1778 / 6667 tokens, what the
// simulator's default machine gives for training with fp32 gradients: 400 TFLOP/s, 150 / 40 GB/s),
// and weighing rows too (moonep-weighed-rows: PlannerConfig::row_cost_* of 593 / 2222, the same
// machine's rows of DeepSeek-V3's H = 7168 against its I = 2048).
// After the Google Benchmark table it prints one summary row per shape with the median CPU time
// (one thread; CPU time so that other processes on the machine do not count) and the ratio of
// each policy's median to moonep-greedy's, measured in the same run.
//
//   build/bin/moonep-bench-planner [--benchmark_filter=...] [--benchmark_repetitions=N]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "bench/planner/zipf_counts.h"
#include "moonep/core/env.h"
#include "planner/planner.h"

namespace moonep::planner {
namespace {

using bench::kShapes;
using bench::Shape;
using bench::ZipfCounts;

constexpr int64_t kWeighIntra = 1778, kWeighInter = 6667;
constexpr int64_t kRowIntra = 593, kRowInter = 2222;

void BM_Plan(benchmark::State& state, Shape shape, Policy policy, bool decide_only, bool check,
             int weigh) {  // 0: no costs; 1: replica costs; 2: and row costs
  PlannerConfig c;
  c.moonep_check_greedy = check;
  if (weigh >= 1) {
    c.replica_cost_intra = kWeighIntra;
    c.replica_cost_inter = kWeighInter;
  }
  if (weigh >= 2) {
    c.row_cost_intra = kRowIntra;
    c.row_cost_inter = kRowInter;
  }
  c.num_ranks = shape.R;
  c.num_experts = shape.E;
  c.ranks_per_node = 8;
  c.policy = policy;
  auto planner = Planner::Create(c).value();
  // A few distinct steps, cycled, so the planner does not see one input only.
  std::vector<std::vector<int64_t>> steps, totals;
  for (int i = 0; i < 4; ++i) {
    steps.push_back(ZipfCounts(shape, 1.2, 100 + i));
    std::vector<int64_t> t(shape.E, 0);
    for (int r = 0; r < shape.R; ++r) {
      for (int e = 0; e < shape.E; ++e) t[e] += steps.back()[static_cast<size_t>(r) * shape.E + e];
    }
    totals.push_back(std::move(t));
  }
  Plan plan;
  size_t i = 0;
  int64_t replicas = 0, plans = 0;
  double imbalance = 0;
  for (auto _ : state) {
    const absl::Status st = decide_only ? planner->Decide(totals[i % 4], &plan) : planner->MakePlan(steps[i % 4], &plan);
    if (!st.ok()) {
      state.SkipWithError(std::string(st.message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(plan.alloc.data());
    replicas += plan.stats.replicas;
    imbalance += plan.stats.imbalance_after();
    ++plans;
    ++i;
  }
  if (plans > 0) {
    state.counters["replicas"] = static_cast<double>(replicas) / plans;
    state.counters["max/mean"] = imbalance / plans;
  }
}

// The floor every full plan pays: one pass summing counts[R][E] into per-expert totals.
void BM_SumCounts(benchmark::State& state, Shape shape) {
  std::vector<std::vector<int64_t>> steps;
  for (int i = 0; i < 4; ++i) steps.push_back(ZipfCounts(shape, 1.2, 100 + i));
  std::vector<int64_t> totals(shape.E);
  size_t i = 0;
  for (auto _ : state) {
    const int64_t* c = steps[i++ % 4].data();
    std::fill(totals.begin(), totals.end(), 0);
    for (int r = 0; r < shape.R; ++r) {
      for (int e = 0; e < shape.E; ++e) totals[e] += c[static_cast<size_t>(r) * shape.E + e];
    }
    benchmark::DoNotOptimize(totals.data());
  }
}

// Collects each benchmark's median (or its only run) to print the ratio summary.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      const bool min_aggregate = run.run_type == Run::RT_Aggregate && run.aggregate_name == "min";
      if (run.run_type == Run::RT_Iteration || min_aggregate) {
        // The min over repetitions: the "min" aggregate (the benchmarks report aggregates only),
        // or the runs themselves (with one repetition there is no aggregate).
        const double t = run.GetAdjustedCPUTime() * ToMicros(run.time_unit);
        auto [it, fresh] = min_us_.emplace(run.run_name.function_name, t);
        if (!fresh) it->second = std::min(it->second, t);
      }
      if (median || run.run_type == Run::RT_Iteration) {
        const std::string name = run.run_name.function_name;  // without the aggregate suffix
        if (median || !seen_median_.count(name)) times_us_[name] = run.GetAdjustedCPUTime() *
                                                                  ToMicros(run.time_unit);
        if (median) seen_median_[name] = true;
      }
    }
  }
  void Summary() const {
    std::printf("\nmedians (min over repetitions in brackets), CPU us per plan\n");
    std::printf("%-18s %-8s %18s %18s %18s %18s %18s %18s %14s %14s %14s %18s\n", "shape", "mode",
                "moonep_us", "moonep-nocheck_us", "moonep-weighed_us", "weighed-rows_us", "greedy_us",
                "none_us", "moonep/greedy", "weighed/moonep", "rows/weighed", "sum_counts_us");
    for (const Shape& s : kShapes) {
      for (const char* mode : {"plan", "decide"}) {
        auto find = [](const std::map<std::string, double>& m, const std::string& k) {
          auto it = m.find(k);
          return it == m.end() ? NAN : it->second;
        };
        auto cell = [&](const std::string& k) {
          char buf[64];
          std::snprintf(buf, sizeof(buf), "%.2f (%.2f)", find(times_us_, k), find(min_us_, k));
          return std::string(buf);
        };
        const std::string key = std::string(mode) + "/";
        const double m = find(times_us_, key + "moonep/" + s.name);
        const double g = find(times_us_, key + "moonep-greedy/" + s.name);
        if (std::isnan(m) && std::isnan(g)) continue;
        const double w = find(times_us_, key + "moonep-weighed/" + s.name);
        const double wr = find(times_us_, key + "moonep-weighed-rows/" + s.name);
        std::printf("%-18s %-8s %18s %18s %18s %18s %18s %18s %14.3f %14.3f %14.3f %18s\n", s.name,
                    mode, cell(key + "moonep/" + s.name).c_str(),
                    cell(key + "moonep-nocheck/" + s.name).c_str(),
                    cell(key + "moonep-weighed/" + s.name).c_str(),
                    cell(key + "moonep-weighed-rows/" + s.name).c_str(),
                    cell(key + "moonep-greedy/" + s.name).c_str(),
                    cell(key + "none/" + s.name).c_str(), m / g, w / m, wr / w,
                    cell(std::string("sum_counts/") + s.name).c_str());
      }
    }
  }

 private:
  static double ToMicros(benchmark::TimeUnit unit) {
    switch (unit) {
      case benchmark::kNanosecond: return 1e-3;
      case benchmark::kMicrosecond: return 1.0;
      case benchmark::kMillisecond: return 1e3;
      default: return 1e6;
    }
  }
  std::map<std::string, double> times_us_, min_us_;
  std::map<std::string, bool> seen_median_;
};

double MinOf(const std::vector<double>& v) { return v.empty() ? NAN : *std::min_element(v.begin(), v.end()); }

}  // namespace
}  // namespace moonep::planner

int main(int argc, char** argv) {
  using namespace moonep::planner;
  // Each benchmark's own Repetitions() would override --benchmark_repetitions: take the flag here.
  int repetitions = 5;
  bool listing = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--benchmark_repetitions=", 24) == 0) {
      const char* v = argv[i] + 24;
      int64_t n = 0;
      if (!moonep::env::ParseBase10InRange(v, 1, 100000, &n)) {
        std::fprintf(stderr, "moonep-bench-planner: --benchmark_repetitions=%s: expected a whole "
                     "number in [1, 100000]\n", v);
        return 1;
      }
      repetitions = static_cast<int>(n);
    }
    listing = listing || std::strcmp(argv[i], "--benchmark_list_tests") == 0 ||
              std::strcmp(argv[i], "--benchmark_list_tests=true") == 0;
  }
  for (const Shape& s : kShapes) {
    for (Policy p : {Policy::kMoonEP, Policy::kMoonEPGreedy, Policy::kNone}) {
      for (bool decide : {false, true}) {
        const std::string name = std::string(decide ? "decide/" : "plan/") + PolicyName(p) + "/" + s.name;
        benchmark::RegisterBenchmark(name.c_str(), BM_Plan, s, p, decide, true, 0)
            ->Unit(benchmark::kMicrosecond)
            ->Repetitions(repetitions)
            ->ComputeStatistics("min", MinOf)
            ->ReportAggregatesOnly(true);
      }
    }
  }
  // moonep without its cross-check against moonep-greedy (PlannerConfig::moonep_check_greedy).
  for (const Shape& s : kShapes) {
    for (bool decide : {false, true}) {
      const std::string name = std::string(decide ? "decide/" : "plan/") + "moonep-nocheck/" + s.name;
      benchmark::RegisterBenchmark(name.c_str(), BM_Plan, s, Policy::kMoonEP, decide, false, 0)
          ->Unit(benchmark::kMicrosecond)
          ->Repetitions(repetitions)
          ->ComputeStatistics("min", MinOf)
          ->ReportAggregatesOnly(true);
      const std::string weighed = std::string(decide ? "decide/" : "plan/") + "moonep-weighed/" + s.name;
      benchmark::RegisterBenchmark(weighed.c_str(), BM_Plan, s, Policy::kMoonEP, decide, true, 1)
          ->Unit(benchmark::kMicrosecond)
          ->Repetitions(repetitions)
          ->ComputeStatistics("min", MinOf)
          ->ReportAggregatesOnly(true);
      const std::string rows = std::string(decide ? "decide/" : "plan/") + "moonep-weighed-rows/" + s.name;
      benchmark::RegisterBenchmark(rows.c_str(), BM_Plan, s, Policy::kMoonEP, decide, true, 2)
          ->Unit(benchmark::kMicrosecond)
          ->Repetitions(repetitions)
          ->ComputeStatistics("min", MinOf)
          ->ReportAggregatesOnly(true);
    }
  }
  for (const Shape& s : kShapes) {
    benchmark::RegisterBenchmark((std::string("sum_counts/") + s.name).c_str(), BM_SumCounts, s)
        ->Unit(benchmark::kMicrosecond)
        ->Repetitions(repetitions)
        ->ComputeStatistics("min", MinOf)
        ->ReportAggregatesOnly(true);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  const size_t ran = benchmark::RunSpecifiedBenchmarks(&reporter);
  if (!listing && ran > 0) reporter.Summary();
  benchmark::Shutdown();
  if (!listing && ran == 0) {  // a filter that matches nothing (or a bad one, reported above)
    std::fprintf(stderr, "moonep-bench-planner: no benchmark ran (see --benchmark_filter; "
                 "--benchmark_list_tests lists them)\n");
    return 1;
  }
  return 0;
}
