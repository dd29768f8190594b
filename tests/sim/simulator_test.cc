// The simulation loop end to end: determinism, trace replay against hand-computed loads,
// invariants across policies, reports, and option errors.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "moonep/core/status.h"
#include "planner/eplb.h"
#include "planner/sim/rank_speeds.h"
#include "planner/sim/report.h"
#include "planner/sim/simulator.h"
#include "planner/sim/trace.h"

namespace moonep::sim {
namespace {

using planner::Policy;

SimOptions SmallOptions() {
  SimOptions o;
  o.routing.kind = RoutingKind::kZipf;
  o.routing.num_ranks = 8;
  o.routing.num_experts = 32;
  o.routing.topk = 4;
  o.routing.tokens_per_rank = 256;
  o.routing.zipf_s = 0.8;
  o.steps = 12;
  o.policies = {Policy::kMoonEP, Policy::kMoonEPGreedy, Policy::kEplb, Policy::kFasterMoEShadow};
  o.eplb_period = 4;
  o.cost.hidden = 1024;
  o.cost.intermediate = 512;
  o.cost.ranks_per_node = 4;
  return o;
}

// SmallOptions replaying the whole trace at `path` (sizes from its header), flat.
SimOptions ReplayOptions(const std::string& path) {
  SimOptions o = SmallOptions();
  o.trace_path = path;
  o.steps = 0;  // the whole trace
  o.routing.num_ranks = 0;
  o.routing.topk = 0;
  o.cost.ranks_per_node = 0;
  return o;
}

struct Capture : StepSink {
  std::unique_ptr<Simulator> sim;  // RunCaptured's (the rows' policy pointers point into it)
  std::vector<StepRecord> rows;
  std::vector<std::string> names;
  absl::Status OnStep(const StepRecord& r) override {
    rows.push_back(r);
    names.push_back(*r.policy);
    return absl::OkStatus();
  }
};

// Creates a simulator for `o` and runs it, every row into `cap`, which keeps the simulator (its
// rows' policy names live in it).
absl::StatusOr<SimResult> RunCaptured(const SimOptions& o, Capture* cap) {
  MOONEP_ASSIGN_OR_RETURN(cap->sim, Simulator::Create(o));
  return cap->sim->Run(cap, nullptr);
}

std::string RunToCsv(const SimOptions& o, SimResult* result = nullptr) {
  auto sim = Simulator::Create(o);
  EXPECT_TRUE(sim.ok()) << sim.status();
  std::FILE* f = std::tmpfile();
  CsvSink csv(f);
  auto r = (*sim)->Run(&csv, nullptr);
  EXPECT_TRUE(r.ok()) << r.status();
  if (result && r.ok()) *result = *r;
  std::fflush(f);
  std::rewind(f);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  std::fclose(f);
  return text;
}

TEST(SimulatorTest, SameSeedSameOutput) {
  for (DetailChoice d : {DetailChoice::kTokens, DetailChoice::kCounts, DetailChoice::kTotals}) {
    SimOptions o = SmallOptions();
    o.detail = d;
    o.threads = 1;
    const std::string a = RunToCsv(o);
    o.threads = 3;  // policies planned in parallel: same rows
    const std::string b = RunToCsv(o);
    EXPECT_EQ(a, b);
    o.routing.seed = 99;
    EXPECT_NE(a, RunToCsv(o));
    // Header + (5 policies + lower bound) x 12 steps.
    EXPECT_EQ(std::count(a.begin(), a.end(), '\n'), 1 + 6 * 12);
  }
}

// moonep-weighed weighs what the planner is told a replica costs (ReplicaCosts: the reduce,
// with the prefetch under the dispatch), so in the cost model's own terms its compute + reduce is at
// most that of moonep and of none, step by step (up to the rounding of a replica's cost to a whole
// token). Large experts on one node, as mixtral-ep8, where moonep's replicas cost more than they
// save: some steps have fewer replicas.
TEST(SimulatorTest, WeighedMoonEPPaysForItsReplicas) {
  for (int32_t rpn : {8, 2}) {
    SimOptions o = SmallOptions();
    o.routing.num_ranks = 8;
    o.routing.num_experts = 16;
    o.routing.topk = 2;
    o.routing.tokens_per_rank = 2048;
    o.routing.zipf_s = 1.0;
    o.cost.hidden = 4096;
    o.cost.intermediate = 14336;
    o.cost.ranks_per_node = rpn;
    o.policies = {Policy::kMoonEP, SimPolicy(Policy::kMoonEP, true)};
    o.detail = DetailChoice::kCounts;
    o.lower_bound = false;
    o.row_cost_intra = o.row_cost_inter = 0;  // rows out of the objective: its terms are these
    Capture cap;
    auto result = RunCaptured(o, &cap);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(cap.rows.size(), 12u * 3);
    int64_t intra = 0, inter = 0;
    ReplicaCosts(o.cost, &intra, &inter);
    const double token_s = o.cost.flops_per_token() / (o.cost.tflops * 1e12);
    int fewer = 0;
    for (size_t i = 0; i < cap.rows.size(); i += 3) {
      const StepRecord &none = cap.rows[i], &moonep = cap.rows[i + 1], &weighed = cap.rows[i + 2];
      ASSERT_EQ(*weighed.policy, "moonep-weighed");
      const auto modeled = [](const StepRecord& r) { return r.time.compute + r.time.reduce; };
      // A replica's cost is rounded to a whole token: at most half a token per replica off.
      const double slack = 0.5 * token_s * (weighed.metrics.replicas + moonep.metrics.replicas);
      EXPECT_LE(modeled(weighed), modeled(moonep) + slack) << "rpn " << rpn << " step " << i / 3;
      EXPECT_LE(modeled(weighed), modeled(none) + slack) << "rpn " << rpn << " step " << i / 3;
      fewer += weighed.metrics.replicas < moonep.metrics.replicas;
    }
    EXPECT_GT(fewer, 0) << "rpn " << rpn;
    // And over the run, in the whole step time of this model, it gains on moonep.
    EXPECT_LT(result->policies[2].mean_time(), result->policies[1].mean_time()) << "rpn " << rpn;
    std::printf("[weighed] rpn %d: mean step none %.2f ms, moonep %.2f ms, moonep-weighed %.2f ms; "
                "replicas moonep %.1f, weighed %.1f a step (costs %lld / %lld tokens)\n", rpn,
                1e3 * result->policies[0].mean_time(), 1e3 * result->policies[1].mean_time(),
                1e3 * result->policies[2].mean_time(),
                static_cast<double>(result->policies[1].sum_replicas) / 12,
                static_cast<double>(result->policies[2].sum_replicas) / 12,
                static_cast<long long>(intra), static_cast<long long>(inter));
  }
  // Only moonep weighs.
  SimOptions o = SmallOptions();
  o.policies = {SimPolicy(Policy::kEplb, true)};
  auto sim = Simulator::Create(o);
  ASSERT_FALSE(sim.ok());
  EXPECT_NE(sim.status().message().find("only moonep weighs replicas, not eplb"), std::string::npos)
      << sim.status();
  SimPolicy p;
  EXPECT_TRUE(ParseSimPolicy("moonep-weighed", &p));
  EXPECT_EQ(p, SimPolicy(Policy::kMoonEP, true));
  EXPECT_EQ(p.Name(), "moonep-weighed");
  EXPECT_FALSE(ParseSimPolicy("eplb-weighed", &p));
  EXPECT_FALSE(ParseSimPolicy("test-force-replicas", &p));
}

TEST(SimulatorTest, InvariantsAcrossPolicies) {
  for (DetailChoice d : {DetailChoice::kTokens, DetailChoice::kTotals}) {
    SimOptions o = SmallOptions();
    o.detail = d;
    Capture cap;
    auto result = RunCaptured(o, &cap);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(cap.rows.size(), 12u * 6);
    for (size_t i = 0; i < cap.rows.size(); i += 6) {
      const StepRecord& none = cap.rows[i];
      const StepRecord& bound = cap.rows[i + 5];
      EXPECT_EQ(*none.policy, "none");
      EXPECT_EQ(*bound.policy, "lower-bound");
      EXPECT_EQ(none.metrics.replicas, 0);
      for (size_t j = i; j < i + 6; ++j) {
        const PlanMetrics& m = cap.rows[j].metrics;
        EXPECT_EQ(m.total_tokens, 8 * 256 * 4) << cap.names[j];
        EXPECT_GE(m.max_load, bound.metrics.max_load) << cap.names[j];
        EXPECT_GE(m.max_load, (m.total_tokens + 7) / 8) << cap.names[j];
        EXPECT_NEAR(cap.rows[j].time.total,
                    cap.rows[j].time.counts + cap.rows[j].time.prefetch + cap.rows[j].time.dispatch +
                        cap.rows[j].time.compute + cap.rows[j].time.combine + cap.rows[j].time.reduce,
                    1e-12);
      }
      // MoonEP balances perfectly whenever the lower bound is perfect balance.
      const StepRecord& moonep = cap.rows[i + 1];
      EXPECT_EQ(*moonep.policy, "moonep");
      if (bound.metrics.max_load == (bound.metrics.total_tokens + 7) / 8) {
        EXPECT_EQ(moonep.metrics.max_load, bound.metrics.max_load);
      }
    }
    const SimResult& r = *result;
    ASSERT_EQ(r.policies.size(), 6u);
    EXPECT_EQ(r.policies[0].name, "none");
    EXPECT_EQ(r.policies[0].steps, 12);
    EXPECT_EQ(r.snapshot_step, 0);
    EXPECT_EQ(r.snapshot_home_load.size(), 8u);
    int64_t sum = 0;
    for (int64_t v : r.snapshot_home_load) sum += v;
    EXPECT_EQ(sum, 8 * 256 * 4);
  }
}

// --pad_multiple: the compute time runs over each rank's rows with every expert group rounded up to
// the multiple; the loads count tokens only and do not change.
TEST(SimulatorTest, PaddingCountsInComputeNotInLoads) {
  for (DetailChoice d : {DetailChoice::kTokens, DetailChoice::kTotals}) {
    SimOptions o = SmallOptions();
    o.detail = d;
    Capture plain, padded;
    for (auto [pad, cap] : {std::pair{1, &plain}, std::pair{64, &padded}}) {
      o.pad_multiple = pad;
      auto sim = Simulator::Create(o);
      ASSERT_TRUE(sim.ok()) << sim.status();
      auto result = (*sim)->Run(cap, nullptr);
      ASSERT_TRUE(result.ok()) << result.status();
    }
    ASSERT_EQ(plain.rows.size(), padded.rows.size());
    const double per_row = o.cost.flops_per_token() / (o.cost.tflops * 1e12);
    // Groups per rank: E/R home experts + E/R replica slots (the default), each padded by < 64.
    const int64_t groups = 2 * 32 / 8;
    int64_t grew = 0;
    for (size_t j = 0; j < plain.rows.size(); ++j) {
      if (plain.names[j] == "lower-bound") continue;
      const PlanMetrics& m = plain.rows[j].metrics;
      EXPECT_EQ(padded.rows[j].metrics.max_load, m.max_load) << plain.names[j];
      EXPECT_EQ(padded.rows[j].metrics.total_tokens, m.total_tokens) << plain.names[j];
      const double rows1 = plain.rows[j].time.compute / per_row;
      const double rows64 = padded.rows[j].time.compute / per_row;
      EXPECT_NEAR(rows1, static_cast<double>(m.max_load), 1e-6) << plain.names[j];
      const int64_t r64 = std::llround(rows64);
      EXPECT_NEAR(rows64, static_cast<double>(r64), 1e-6) << plain.names[j];
      EXPECT_EQ(r64 % 64, 0) << plain.names[j] << " " << r64;
      EXPECT_GE(r64, m.max_load) << plain.names[j];
      EXPECT_LE(r64, m.max_load + groups * 63) << plain.names[j];
      EXPECT_NEAR(padded.rows[j].time.total - padded.rows[j].time.compute,
                  plain.rows[j].time.total - plain.rows[j].time.compute, 1e-12)
          << plain.names[j];
      grew += r64 > m.max_load;
    }
    EXPECT_GT(grew, 0);
  }
}

TEST(SimulatorTest, TraceReplayMatchesHandComputedLoads) {
  // R = 2, E = 4 (experts 0,1 on rank 0; 2,3 on rank 1), K = 2; layer 1 records are skipped.
  std::string text = FormatTraceHeader(2, 4, 2);
  const std::vector<std::vector<int64_t>> steps = {
      {10, 6, 2, 2, 9, 7, 2, 2},   // rank 0 home load 32, rank 1: 8
      {1, 1, 5, 5, 1, 1, 6, 4},    // rank 0: 4, rank 1: 20
      {3, 3, 3, 3, 3, 3, 3, 3},    // balanced
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    text += FormatTraceRecord(static_cast<int64_t>(i), 0, steps[i]);
    text += FormatTraceRecord(static_cast<int64_t>(i), 1, std::vector<int64_t>(8, 100));
  }
  const std::string path = ::testing::TempDir() + "/replay.trace";
  std::ofstream(path) << text;
  SimOptions o = ReplayOptions(path);
  o.trace_layer = 0;
  auto sim = Simulator::Create(o);
  ASSERT_TRUE(sim.ok()) << sim.status();
  EXPECT_EQ((*sim)->detail(), Detail::kCounts);
  Capture cap;
  auto result = (*sim)->Run(&cap, nullptr);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->steps, 3);
  ASSERT_EQ(cap.rows.size(), 3u * 6);
  const int64_t max_home[] = {32, 20, 12};
  for (int s = 0; s < 3; ++s) {
    const StepRecord& none = cap.rows[s * 6];
    EXPECT_EQ(none.layer, 0);
    EXPECT_EQ(none.step, s);
    EXPECT_EQ(none.metrics.max_load, max_home[s]) << "step " << s;
    EXPECT_EQ(none.metrics.total_tokens, s == 0 ? 40 : 24);
    // Home placement: rank 0's rows for experts 2,3 and rank 1's for 0,1 travel (flat: inter).
    const std::vector<int64_t>& c = steps[s];
    EXPECT_EQ(none.metrics.rows_local, c[0] + c[1] + c[6] + c[7]);
    EXPECT_EQ(none.metrics.rows_inter, c[2] + c[3] + c[4] + c[5]);
    EXPECT_EQ(none.metrics.rows_intra, 0);
    // Perfect balance is ceil(total / 2), and moonep reaches it.
    EXPECT_EQ(cap.rows[s * 6 + 5].metrics.max_load, (none.metrics.total_tokens + 1) / 2);
    EXPECT_EQ(cap.rows[s * 6 + 1].metrics.max_load, (none.metrics.total_tokens + 1) / 2);
  }
}

// EPLB places (E + R) / R physical experts a rank. With that many replica slots none falls back
// to its home, and the simulator's eplb row is EPLB's own placement: its replicas are the
// (rank, expert) pairs of the placement off the expert's home, and its busiest rank carries what
// EPLB's even split over the copies gives it (both worked out here from EplbRebalance). With the
// default E / R slots some copies fall back, and the run says so.
TEST(SimulatorTest, EplbGetsTheSlotsItsPlacementNeedsOrIsWarned) {
  const int32_t R = 8, E = 32, K = 4;
  std::string text = FormatTraceHeader(R, E, K);
  std::vector<int64_t> counts(R * E);
  uint64_t x = 12345;
  for (int32_t s = 0; s < R; ++s) {
    for (int32_t e = 0; e < E; ++e) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      // Skewed: expert e draws about 400 / (1 + e % 13) tokens from each source.
      counts[s * E + e] = static_cast<int64_t>((x >> 40) % (800 / (1 + e % 13)));
    }
  }
  text += FormatTraceRecord(0, 0, counts);
  const std::string path = ::testing::TempDir() + "/eplb_slots.trace";
  std::ofstream(path) << text;
  std::vector<int64_t> totals(E, 0);
  int64_t total = 0;
  for (int32_t s = 0; s < R; ++s) {
    for (int32_t e = 0; e < E; ++e) totals[e] += counts[s * E + e];
  }
  for (int64_t t : totals) total += t;

  // EPLB's own placement (global policy: the run is flat) and the loads of its even split.
  const int32_t per_rank = (E + R) / R;
  std::vector<int32_t> phy2log, logcnt;
  ASSERT_TRUE(planner::EplbRebalance(totals, E + R, 1, 1, R, &phy2log, &logcnt).ok());
  std::vector<int64_t> load(R, 0);
  std::vector<int32_t> seen(E, 0);
  std::set<std::pair<int32_t, int32_t>> off_home;
  for (int32_t p = 0; p < E + R; ++p) {
    const int32_t d = p / per_rank, e = phy2log[p], j = seen[e]++;
    load[d] += totals[e] / logcnt[e] + (j < totals[e] % logcnt[e] ? 1 : 0);
    if (d != e / (E / R)) off_home.insert({d, e});
  }
  const int64_t eplb_max = *std::max_element(load.begin(), load.end());

  for (int32_t slots : {-1, per_rank}) {
    SimOptions o = ReplayOptions(path);
    o.policies = {Policy::kEplb};
    o.slots = slots;
    Capture cap;
    auto result = RunCaptured(o, &cap);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(cap.rows.size(), 3u);  // none, eplb, lower-bound
    const PlanMetrics& m = cap.rows[1].metrics;
    EXPECT_EQ(m.total_tokens, total);
    if (slots == per_rank) {
      EXPECT_TRUE(result->warnings.empty());
      EXPECT_EQ(m.replicas, static_cast<int32_t>(off_home.size()));
      EXPECT_EQ(m.max_load, eplb_max);
    } else {
      ASSERT_EQ(result->warnings.size(), 1u);
      EXPECT_NE(result->warnings[0].find("eplb places 5 physical experts on each rank, and with 4 "
                                         "replica slots"),
                std::string::npos)
          << result->warnings[0];
      EXPECT_NE(result->warnings[0].find("--slots=5"), std::string::npos) << result->warnings[0];
      EXPECT_LE(m.replicas, R * (E / R));
      // Here some rank holds 5 experts homed elsewhere: one falls back, and EPLB is worse.
      EXPECT_LT(m.replicas, static_cast<int32_t>(off_home.size()));
      EXPECT_GT(m.max_load, eplb_max);
    }
  }
}

// A trace of two layers replayed whole: each layer has its own planners (EPLB's window and
// re-plan period are per layer, as in the runtime), so every record's row equals the row of the
// same record replayed with only its layer; an empty selection is an error, not a zero table.
TEST(SimulatorTest, LayersArePlannedApart) {
  // R = 4, E = 8; layer 0 hot on expert 0, layer 1 on expert 7, for 10 steps.
  std::string text = FormatTraceHeader(4, 8, 2);
  for (int s = 0; s < 10; ++s) {
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<int64_t> c(32, 2 + s % 3);
      for (int r = 0; r < 4; ++r) c[r * 8 + (layer == 0 ? 0 : 7)] = 40 + s;
      text += FormatTraceRecord(s, layer, c);
    }
  }
  const std::string path = ::testing::TempDir() + "/layers.trace";
  std::ofstream(path) << text;
  SimOptions o = ReplayOptions(path);
  o.eplb_period = 3;
  auto run = [&](int32_t layer, Capture* cap, SimResult* result) {
    o.trace_layer = layer;
    auto sim = Simulator::Create(o);
    ASSERT_TRUE(sim.ok()) << sim.status();
    auto r = (*sim)->Run(cap, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    *result = *r;
  };
  Capture all, only[2];
  SimResult r_all, r_only[2];
  run(-1, &all, &r_all);
  run(0, &only[0], &r_only[0]);
  run(1, &only[1], &r_only[1]);
  EXPECT_EQ(r_all.steps, 20);
  EXPECT_EQ(r_all.layers, 2);
  EXPECT_EQ(r_only[0].layers, 1);
  const size_t per = all.rows.size() / 20;  // rows per record: policies + lower bound
  ASSERT_EQ(only[0].rows.size(), 10 * per);
  for (size_t i = 0; i < all.rows.size(); ++i) {
    const size_t record = i / per, layer = record % 2, j = (record / 2) * per + i % per;
    const StepRecord& a = all.rows[i];
    const StepRecord& b = only[layer].rows[j];
    const std::string& name = all.names[i];  // (the records' policy pointers died with the runs)
    EXPECT_EQ(a.layer, static_cast<int32_t>(layer));
    EXPECT_EQ(name, only[layer].names[j]);
    EXPECT_EQ(a.metrics.max_load, b.metrics.max_load) << name << " record " << record;
    EXPECT_EQ(a.metrics.replicas, b.metrics.replicas) << name << " record " << record;
  }
  // No record of the layer asked for, and a trace of no records.
  o.trace_layer = 5;
  auto none = Simulator::Create(o);
  ASSERT_TRUE(none.ok());
  auto r = (*none)->Run(nullptr, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no record of layer 5"), std::string::npos) << r.status();
  std::ofstream(path, std::ios::trunc) << FormatTraceHeader(4, 8, 2);
  o.trace_layer = -1;
  auto empty = Simulator::Create(o);
  ASSERT_TRUE(empty.ok());
  r = (*empty)->Run(nullptr, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("has no records"), std::string::npos) << r.status();
}

// A replay runs to the end of the trace (steps = 0, moonep-sim's default with --trace), or stops
// at `steps` and says so when records are left; a cut last record is skipped with a warning.
TEST(SimulatorTest, ReplaySaysWhenStepsStopsItAndWhatItSkipped) {
  std::string text = FormatTraceHeader(2, 4, 2);
  for (int64_t s = 0; s < 5; ++s) text += FormatTraceRecord(s, 0, {1, 2, 3, 4, 5, 6, 7, 8});
  const std::string path = ::testing::TempDir() + "/stops.trace";
  SimOptions o = SmallOptions();
  o.trace_path = path;
  o.routing.num_ranks = 0;
  o.routing.topk = 0;
  o.policies = {Policy::kMoonEP};
  auto run = [&o](int64_t steps) {
    o.steps = steps;
    auto sim = Simulator::Create(o);
    EXPECT_TRUE(sim.ok()) << sim.status();
    auto result = (*sim)->Run(nullptr, nullptr);
    EXPECT_TRUE(result.ok()) << result.status();
    return *result;
  };
  std::ofstream(path) << text + "# the end\n";
  for (int64_t steps : {0, 5, 9}) {
    const SimResult r = run(steps);
    EXPECT_EQ(r.steps, 5) << steps;
    EXPECT_FALSE(r.stopped_by_steps) << steps;
    EXPECT_TRUE(r.warnings.empty()) << steps;
    EXPECT_EQ(FormatSummary(r, o).find("stopped"), std::string::npos);
  }
  const SimResult stopped = run(3);
  EXPECT_EQ(stopped.steps, 3);
  EXPECT_TRUE(stopped.stopped_by_steps);
  EXPECT_NE(FormatSummary(stopped, o).find("3 steps (stopped by --steps=3 before the end of the trace)"),
            std::string::npos) << FormatSummary(stopped, o);
  // The sixth record cut in its last count: five replayed, the cut one named.
  std::ofstream(path, std::ios::trunc) << text + "5 0 1 2 3 4 5 6 7 8";
  const SimResult cut = run(0);
  EXPECT_EQ(cut.steps, 5);
  ASSERT_EQ(cut.warnings.size(), 1u);
  EXPECT_NE(cut.warnings[0].find("stops.trace:7: the last line has no newline"), std::string::npos)
      << cut.warnings[0];
  // Stopped before it, the cut record is neither replayed nor "more of the trace".
  const SimResult before = run(5);
  EXPECT_FALSE(before.stopped_by_steps);
  EXPECT_TRUE(before.warnings.empty());
}

TEST(SimulatorTest, MemoryDoesNotGrowWithSteps) {
  SimOptions o = SmallOptions();
  o.steps = 3000;
  o.detail = DetailChoice::kTotals;
  o.policies = {Policy::kMoonEP};
  auto sim = Simulator::Create(o);
  ASSERT_TRUE(sim.ok());
  auto r = (*sim)->Run(nullptr, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const PolicySummary& p : r->policies) {
    EXPECT_EQ(p.steps, 3000);
    EXPECT_LE(p.imbalance_series.Points().size(), 512u);
  }
}

TEST(SimulatorTest, ReportsAreWellFormed) {
  SimOptions o = SmallOptions();
  o.snapshot_step = 3;
  auto sim = Simulator::Create(o);
  ASSERT_TRUE(sim.ok());
  std::FILE* f = std::tmpfile();
  JsonSink json(f);
  auto r = (*sim)->Run(&json, nullptr);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(json.Finish().ok());
  std::rewind(f);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  std::fclose(f);
  EXPECT_EQ(text.front(), '[');
  EXPECT_EQ(text.substr(text.size() - 2), "]\n");
  EXPECT_EQ(std::count(text.begin(), text.end(), '{'), 12 * 6);
  EXPECT_EQ(std::count(text.begin(), text.end(), '{'), std::count(text.begin(), text.end(), '}'));
  EXPECT_NE(text.find("\"policy\": \"moonep-greedy\""), std::string::npos);

  const std::string summary = FormatSummary(*r, o);
  for (const char* name : {"none", "moonep", "moonep-greedy", "eplb", "fastermoe-shadow", "lower-bound"}) {
    EXPECT_NE(summary.find(name), std::string::npos) << name;
  }
  EXPECT_NE(summary.find("1.00x"), std::string::npos);  // none's speedup over itself

  const std::string dir = ::testing::TempDir() + "/svg";
  ASSERT_TRUE(WriteSvgs(*r, dir).ok());
  for (const char* file : {"imbalance.svg", "rank_load.svg", "step_time.svg"}) {
    std::ifstream in(dir + "/" + file);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string svg = ss.str();
    EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u) << file;
    EXPECT_NE(svg.find("</svg>"), std::string::npos) << file;
    EXPECT_NE(svg.find("moonep"), std::string::npos) << file;
    EXPECT_EQ(svg.find("nan"), std::string::npos) << file;
  }
  EXPECT_NE(RankLoadSvg(*r).find("step 3"), std::string::npos);
}

TEST(SimulatorTest, InvalidOptionsNameTheOption) {
  struct Case {
    std::function<void(SimOptions*)> change;
    const char* fragment;
  } cases[] = {
      {[](SimOptions* o) { o->routing.num_experts = 30; }, "divisible"},
      {[](SimOptions* o) { o->steps = -1; }, "steps"},
      {[](SimOptions* o) { o->eplb_period = 0; }, "eplb_period"},
      {[](SimOptions* o) { o->slots = -2; }, "slots"},
      {[](SimOptions* o) { o->cost.tflops = -1; }, "tflops"},
      {[](SimOptions* o) { o->routing.zipf_s = 11; }, "zipf_s"},
      {[](SimOptions* o) { o->policies = {Policy::kTestForceReplicas}; }, "test-force-replicas"},
      {[](SimOptions* o) {
         o->trace_path = ::testing::TempDir() + "/any.trace";
         o->detail = DetailChoice::kTokens;
       }, "tokens"},
  };
  for (const Case& c : cases) {
    SimOptions o = SmallOptions();
    c.change(&o);
    auto sim = Simulator::Create(o);
    ASSERT_FALSE(sim.ok()) << c.fragment;
    EXPECT_NE(sim.status().message().find(c.fragment), std::string::npos) << sim.status();
  }
}


// ranks_per_node above the ranks is one node holding them all: INT32_MAX once sized the model's
// node table to zero nodes (then wrote past it) and the trace's node counts likewise.
TEST(SimulatorTest, RanksPerNodeAboveRanksIsOneNode) {
  for (DetailChoice d : {DetailChoice::kTokens, DetailChoice::kCounts, DetailChoice::kTotals}) {
    SimOptions o = SmallOptions();
    o.detail = d;
    o.steps = 3;
    o.cost.ranks_per_node = INT32_MAX;
    SimResult huge;
    RunToCsv(o, &huge);
    o.cost.ranks_per_node = 8;  // = R
    SimResult node;
    RunToCsv(o, &node);
    ASSERT_EQ(huge.policies.size(), node.policies.size());
    for (size_t i = 0; i < huge.policies.size(); ++i) {
      EXPECT_EQ(huge.policies[i].steps, 3) << huge.policies[i].name;
      EXPECT_EQ(huge.policies[i].sum_dispatch_inter, 0) << huge.policies[i].name;
      EXPECT_EQ(huge.policies[i].sum_dispatch_rows, node.policies[i].sum_dispatch_rows)
          << huge.policies[i].name;
    }
  }
  // A trace replayed with totals only (node counts from the trace).
  const std::string path = ::testing::TempDir() + "/rpn.trace";
  std::ofstream(path) << FormatTraceHeader(2, 4, 2) << FormatTraceRecord(0, 0, {10, 6, 2, 2, 9, 7, 2, 2});
  SimOptions o = ReplayOptions(path);
  o.detail = DetailChoice::kTotals;
  o.cost.ranks_per_node = INT32_MAX;
  SimResult r;
  RunToCsv(o, &r);
  EXPECT_EQ(r.steps, 1);
}

// Trace counts far past int32 (the planner takes up to 2^52 tokens in all): each source's tokens
// (its counts over K) are kept in 64 bits, so the dedup estimate scales with the counts (they were
// cast to int32: 10 * 2^38 tokens became 0, and nothing was deduplicated).
TEST(SimulatorTest, TraceTokensPastInt32) {
  const std::vector<int64_t> small = {10, 6, 2, 2, 9, 7, 2, 2};
  const int64_t scale = int64_t{1} << 38;
  std::vector<int64_t> big;
  for (int64_t c : small) big.push_back(c * scale);
  auto run = [](const std::string& name, const std::vector<int64_t>& counts) {
    const std::string path = ::testing::TempDir() + "/" + name;
    std::ofstream(path) << FormatTraceHeader(2, 4, 2) << FormatTraceRecord(0, 0, counts);
    SimOptions o = ReplayOptions(path);
    // (fastermoe-shadow's decisions weigh tokens against bytes: they change with the scale.)
    o.policies = {Policy::kMoonEP, Policy::kMoonEPGreedy, Policy::kEplb};
    auto sim = Simulator::Create(o);
    EXPECT_TRUE(sim.ok()) << sim.status();
    Capture cap;  // (its rows' policy pointers die with the simulator: names keeps them)
    if (sim.ok()) {
      auto result = (*sim)->Run(&cap, nullptr);
      EXPECT_TRUE(result.ok()) << result.status();
    }
    return cap;
  };
  const Capture a = run("small.trace", small), b = run("big.trace", big);
  ASSERT_EQ(a.rows.size(), b.rows.size());
  ASSERT_FALSE(a.rows.empty());
  for (size_t i = 0; i < a.rows.size(); ++i) {
    const PlanMetrics &ma = a.rows[i].metrics, &mb = b.rows[i].metrics;
    EXPECT_EQ(mb.total_tokens, ma.total_tokens * scale) << a.names[i];
    EXPECT_EQ(mb.rows_inter, ma.rows_inter * scale) << a.names[i];
    EXPECT_NEAR(static_cast<double>(mb.dispatch_inter), static_cast<double>(ma.dispatch_inter) * scale,
                scale) << a.names[i];
  }
  // Dedup did something at this size (else the comparison above says little).
  bool deduped = false;
  for (const StepRecord& r : a.rows) deduped = deduped || r.metrics.dispatch_inter < r.metrics.rows_inter;
  EXPECT_TRUE(deduped);
}

// ---- Ranks of different speeds (--rank_speeds) -------------------------------------------------

RankSpeedsSpec Speeds(const std::string& spec) {
  absl::StatusOr<RankSpeedsSpec> parsed = ParseRankSpeeds(spec);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  return parsed.ok() ? *parsed : RankSpeedsSpec{};
}

// Four flat ranks, rank 3 at half speed. moonep told the speeds balances time: the slow rank gets
// half the tokens of each other one (capacities floor or ceil of 1/7 and 2/7 of the total), and
// its compute is within the planner's rounding of the lower bound, the total over 3.5 ranks of
// speed 1. moonep-nospeeds balances tokens, which leaves the slow rank twice the others' time.
// moonep-weighed with nothing to weigh (costs 0) is moonep: it is told the speeds too.
TEST(SimulatorSpeedsTest, MoonEPGivesASlowRankHalfTheLoad) {
  for (DetailChoice d : {DetailChoice::kTokens, DetailChoice::kCounts, DetailChoice::kTotals}) {
    SimOptions o = SmallOptions();
    o.routing.num_ranks = 4;
    o.routing.num_experts = 16;
    o.routing.topk = 2;
    o.routing.tokens_per_rank = 512;
    o.cost.ranks_per_node = 0;
    o.detail = d;
    o.steps = 6;
    o.rank_speeds = Speeds("0.5@3");
    o.policies = {Policy::kMoonEP, SimPolicy::MoonEPWithoutSpeeds(), SimPolicy(Policy::kMoonEP, true)};
    o.replica_cost_intra = o.replica_cost_inter = o.row_cost_intra = o.row_cost_inter = 0;
    const double token_s = o.cost.flops_per_token() / (o.cost.tflops * 1e12);  // at speed 1
    for (int64_t snapshot : {0, 5}) {  // a run keeps one step's per-rank loads
      o.snapshot_step = snapshot;
      Capture cap;
      auto result = RunCaptured(o, &cap);
      ASSERT_TRUE(result.ok()) << result.status();
      ASSERT_EQ(result->policies[1].name, "moonep");
      ASSERT_EQ(result->policies[2].name, "moonep-nospeeds");
      const std::vector<int64_t>& with = result->policies[1].snapshot_load;
      const std::vector<int64_t>& without = result->policies[2].snapshot_load;
      ASSERT_EQ(with.size(), 4u);
      for (int r = 0; r < 3; ++r) {
        EXPECT_LE(std::abs(2 * with[3] - with[r]), 2) << "rank " << r << " step " << snapshot;
      }
      EXPECT_LE(*std::max_element(without.begin(), without.end()) -
                    *std::min_element(without.begin(), without.end()), 1);
      ASSERT_EQ(cap.rows.size(), 6u * 5);
      for (size_t i = 0; i < cap.rows.size(); i += 5) {
        const StepRecord &moonep = cap.rows[i + 1], &nospeeds = cap.rows[i + 2],
                         &weighed = cap.rows[i + 3], &bound = cap.rows[i + 4];
        ASSERT_EQ(*bound.policy, "lower-bound");
        const double total = static_cast<double>(bound.metrics.total_tokens);
        EXPECT_GE(bound.time.compute, total / 3.5 * token_s * (1 - 1e-12));
        EXPECT_GE(moonep.time.compute, bound.time.compute * (1 - 1e-12));
        EXPECT_LE(moonep.time.compute, (total / 3.5 + 2) * token_s) << "step " << i / 5;
        EXPECT_GE(nospeeds.time.compute, (total / 2 - 2) * token_s) << "step " << i / 5;
        EXPECT_LT(moonep.time.compute, nospeeds.time.compute) << "step " << i / 5;
        EXPECT_EQ(weighed.metrics.max_load, moonep.metrics.max_load);
        EXPECT_EQ(weighed.metrics.replicas, moonep.metrics.replicas);
        EXPECT_EQ(weighed.time.total, moonep.time.total);
      }
    }
  }
}

// A machine whose every speed is 1 is the machine without speeds: the same rows to the bit, whether
// the spec says so (and the report then says nothing of speeds) or the cost model is given speeds
// of 1 directly (then the planners get them too).
TEST(SimulatorSpeedsTest, EverySpeedOneIsTheRunWithout) {
  for (DetailChoice d : {DetailChoice::kTokens, DetailChoice::kCounts, DetailChoice::kTotals}) {
    SimOptions o = SmallOptions();
    o.detail = d;
    o.steps = 4;
    o.policies = AllPolicies(/*with_speeds=*/false);
    const std::string without = RunToCsv(o);
    for (const char* spec : {"1,1,1,1,1,1,1,1", "1@3"}) {
      o.rank_speeds = Speeds(spec);
      EXPECT_EQ(RunToCsv(o), without) << spec;
      auto sim = Simulator::Create(o);
      ASSERT_TRUE(sim.ok()) << sim.status();
      EXPECT_TRUE((*sim)->options().cost.speeds.empty());
    }
    o.rank_speeds = {};
    o.cost.speeds.assign(8, 1.0);
    EXPECT_EQ(RunToCsv(o), without);
  }
}

// With speeds: the same rows on any number of threads; none, eplb and fastermoe-shadow plan as
// without them (only their compute time changes), and so does moonep-nospeeds as moonep; the
// report names the speeds and what the lower bound is.
TEST(SimulatorSpeedsTest, SpeedUnawarePoliciesPlanAsBefore) {
  SimOptions o = SmallOptions();
  o.policies = AllPolicies(/*with_speeds=*/false);
  Capture plain;
  ASSERT_TRUE(RunCaptured(o, &plain).ok());
  o.rank_speeds = Speeds("0.6@2,0.8@5-6");
  o.policies = AllPolicies(/*with_speeds=*/true);
  o.threads = 1;
  const std::string one = RunToCsv(o);
  o.threads = 4;
  EXPECT_EQ(RunToCsv(o), one);
  EXPECT_EQ(std::count(one.begin(), one.end(), '\n'), 1 + 8 * 12);  // 6 policies, none, bound
  Capture fast_and_slow;
  auto result = RunCaptured(o, &fast_and_slow);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(plain.rows.size(), 12u * 7);
  ASSERT_EQ(fast_and_slow.rows.size(), 12u * 8);
  for (size_t step = 0; step < 12; ++step) {
    for (size_t j = 0; j < 7; ++j) {
      const std::string& name = plain.names[step * 7 + j];
      const std::string same = name == "moonep" ? "moonep-nospeeds" : name;
      if (name != "none" && name != "eplb" && name != "fastermoe-shadow" && name != "moonep") continue;
      const StepRecord* twin = nullptr;
      for (size_t k = step * 8; k < step * 8 + 8; ++k) {
        if (fast_and_slow.names[k] == same) twin = &fast_and_slow.rows[k];
      }
      ASSERT_NE(twin, nullptr) << same;
      const PlanMetrics &a = plain.rows[step * 7 + j].metrics, &b = twin->metrics;
      EXPECT_EQ(a.max_load, b.max_load) << name;
      EXPECT_EQ(a.replicas, b.replicas) << name;
      EXPECT_EQ(a.rows_local, b.rows_local) << name;
      EXPECT_EQ(a.dispatch_inter, b.dispatch_inter) << name;
      EXPECT_EQ(plain.rows[step * 7 + j].time.dispatch, twin->time.dispatch) << name;
      EXPECT_GE(twin->time.compute, plain.rows[step * 7 + j].time.compute) << name;  // slower ranks
    }
  }
  const std::string summary = FormatSummary(*result, fast_and_slow.sim->options());
  EXPECT_NE(summary.find("rank speeds 0.6@2,0.8@5-6 (the others 1)"), std::string::npos) << summary;
  EXPECT_NE(summary.find("moonep-nospeeds"), std::string::npos);
  EXPECT_NE(summary.find("With rank speeds, its imb. is the least load in tokens"), std::string::npos);
  EXPECT_EQ(FormatSummary(*result, o).find("rank speeds"), std::string::npos);  // unresolved options
}

// A replay resolves the spec against the trace's R: none computes its home loads, the slowest rank
// (here the slow one with the lighter load) setting the time; a rank past the trace's is an error
// naming the flag.
TEST(SimulatorSpeedsTest, ReplayResolvesTheSpecAgainstTheTrace) {
  const std::string path = ::testing::TempDir() + "/speeds.trace";
  // R = 2, E = 4: home loads 10 + 6 + 9 + 7 = 32 on rank 0, 8 on rank 1.
  std::ofstream(path) << FormatTraceHeader(2, 4, 2) << FormatTraceRecord(0, 0, {10, 6, 2, 2, 9, 7, 2, 2});
  SimOptions o = ReplayOptions(path);
  o.rank_speeds = Speeds("0.2@1");
  Capture cap;
  auto result = RunCaptured(o, &cap);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(cap.names[0], "none");
  EXPECT_DOUBLE_EQ(cap.rows[0].time.compute, 8 / 0.2 * o.cost.flops_per_token() / (o.cost.tflops * 1e12));
  o.rank_speeds = Speeds("0.5@2");
  auto sim = Simulator::Create(o);
  ASSERT_FALSE(sim.ok());
  EXPECT_EQ(sim.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(sim.status().message().find("--rank_speeds: rank 2 is out of range: there are 2 ranks"),
            std::string::npos) << sim.status();
  o.rank_speeds = Speeds("1,0.5,1");
  sim = Simulator::Create(o);
  ASSERT_FALSE(sim.ok());
  EXPECT_NE(sim.status().message().find("--rank_speeds: 3 speeds for 2 ranks"), std::string::npos)
      << sim.status();
}

TEST(SimulatorSpeedsTest, NoSpeedsIsMoonEPOnly) {
  SimPolicy p;
  ASSERT_TRUE(ParseSimPolicy("moonep-nospeeds", &p));
  EXPECT_EQ(p, SimPolicy::MoonEPWithoutSpeeds());
  EXPECT_EQ(p.Name(), "moonep-nospeeds");
  EXPECT_FALSE(p.plans_with_speeds());
  for (SimPolicy with : {SimPolicy(Policy::kMoonEP), SimPolicy(Policy::kMoonEP, true),
                         SimPolicy(Policy::kMoonEPGreedy)}) {
    EXPECT_TRUE(with.plans_with_speeds()) << with.Name();
  }
  for (SimPolicy without : {Policy::kNone, Policy::kEplb, Policy::kFasterMoEShadow}) {
    EXPECT_FALSE(without.plans_with_speeds()) << without.Name();
  }
  // --policies=all: moonep-nospeeds beside moonep, only on a machine with speeds.
  const std::vector<SimPolicy> plain = AllPolicies(false), with = AllPolicies(true);
  EXPECT_EQ(plain.size(), 5u);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), SimPolicy::MoonEPWithoutSpeeds()), 0);
  ASSERT_EQ(with.size(), 6u);
  EXPECT_EQ(with[1], SimPolicy::MoonEPWithoutSpeeds());
  for (SimPolicy bad : {SimPolicy(Policy::kMoonEPGreedy, false, true), SimPolicy(Policy::kMoonEP, true, true)}) {
    SimOptions o = SmallOptions();
    o.policies = {bad};
    auto sim = Simulator::Create(o);
    ASSERT_FALSE(sim.ok());
    EXPECT_NE(sim.status().message().find("only moonep runs as moonep-nospeeds, not moonep-"),
              std::string::npos) << sim.status();
  }
}

// The lower bound of the slowest rank's level, by hand: 700 tokens on speeds summing to 3.5 need
// 200 of a speed-1 rank's time; an expert of 300 on one holder needs 300; levels are in tokens of
// the fastest rank (at speed 2, twice the speed-1 time).
TEST(SimulatorSpeedsTest, LevelLowerBoundByHand) {
  const std::vector<int64_t> totals = {300, 200, 100, 100};
  EXPECT_DOUBLE_EQ(SpeedLevelLowerBound({1, 1, 1, 0.5}, totals, 4), 200);
  EXPECT_DOUBLE_EQ(SpeedLevelLowerBound({1, 1, 1, 0.5}, totals, 2), 200);   // 300 / 2 = 150
  EXPECT_DOUBLE_EQ(SpeedLevelLowerBound({1, 1, 1, 0.5}, totals, 1), 300);
  EXPECT_DOUBLE_EQ(SpeedLevelLowerBound({0.5, 2, 1, 0.5}, totals, 4), 700 / 4.0 * 2);
  EXPECT_DOUBLE_EQ(SpeedLevelLowerBound({0.5, 2, 1, 0.5}, totals, 1), 700 / 4.0 * 2);  // > 300 / 2
  EXPECT_DOUBLE_EQ(SpeedLevelLowerBound({0.5, 2, 1, 0.5}, {600, 100}, 1), 600 / 2.0 * 2);
  EXPECT_DOUBLE_EQ(SpeedLevelLowerBound({0.5, 0.5}, {100}, 2), 50);  // 50 tokens each, at speed 0.5
}

}  // namespace
}  // namespace moonep::sim
