// The simulator's scale run: R=4096, E=8192, K=8, T=4096, 1000 steps, every policy (issue 7: under
// 2 minutes on a 2-core machine, memory flat in the number of steps). Baseline in the same run:
// the same steps with only `none` (routing sampling + traffic + cost model, no balancing policy).
// Prints wall and CPU seconds, steps/s, and resident memory at 10% and at 100% of the steps.
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>
#include <algorithm>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "moonep/core/flags_usage.h"
#include "planner/sim/simulator.h"

ABSL_FLAG(int64_t, steps, 1000, "steps per run");
ABSL_FLAG(int32_t, ranks, 4096, "R");
ABSL_FLAG(int32_t, experts, 8192, "E");
ABSL_FLAG(int32_t, threads, 0, "policy threads (0: one per core)");

namespace {

using namespace moonep::sim;

double ResidentMiB() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

struct Timing {
  double wall = 0, cpu = 0, rss_early = 0, rss_end = 0;
  double mean_imbalance_none = 0;
};

Timing Run(bool all_policies) {
  SimOptions o;
  o.routing.kind = RoutingKind::kZipf;
  o.routing.num_ranks = absl::GetFlag(FLAGS_ranks);
  o.routing.num_experts = absl::GetFlag(FLAGS_experts);
  o.routing.topk = 8;
  o.routing.tokens_per_rank = 4096;
  o.steps = absl::GetFlag(FLAGS_steps);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.cost.hidden = 7168;
  o.cost.intermediate = 2048;
  if (all_policies) {
    o.policies = {moonep::planner::Policy::kMoonEP, moonep::planner::Policy::kMoonEPGreedy,
                  moonep::planner::Policy::kEplb, moonep::planner::Policy::kFasterMoEShadow};
  }
  Timing t;
  const double cpu0 = CpuSeconds();
  const auto start = std::chrono::steady_clock::now();
  auto sim = Simulator::Create(o);
  if (!sim.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(sim.status().message()).c_str());
    std::exit(1);
  }
  const int64_t early = std::max<int64_t>(1, o.steps / 10);
  auto result = (*sim)->Run(nullptr, [&](int64_t done, int64_t) {
    if (done == early) t.rss_early = ResidentMiB();
  });
  if (!result.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(result.status().message()).c_str());
    std::exit(1);
  }
  t.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  t.cpu = CpuSeconds() - cpu0;
  t.rss_end = ResidentMiB();
  t.mean_imbalance_none = result->policies[0].mean_imbalance();
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  moonep::SetToolUsage(
      "the simulator at scale: the same run with policy none only (the baseline) and with every "
      "policy, wall and CPU time, steps/s and resident memory.\n"
      "  moonep-bench-sim [--steps=1000] [--ranks=4096] [--experts=8192] [--threads=0]\n"
      "See docs/simulator.md.",
      "bench/sim/sim_scale_bench.cc", argc, argv);
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {  // "moonep-bench-sim 20" ran the full 1000-step case
    std::fprintf(stderr, "moonep-bench-sim: error: unexpected argument '%s' (flags take the form "
                 "--name=value)\n", rest[1]);
    return 2;
  }
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  std::printf("# moonep-sim scale run: R=%d E=%d K=8 T=4096, %lld steps, %u cores\n",
              absl::GetFlag(FLAGS_ranks), absl::GetFlag(FLAGS_experts),
              static_cast<long long>(steps), std::thread::hardware_concurrency());
  std::printf("%-22s %10s %10s %10s %14s %14s\n", "run", "wall s", "cpu s", "steps/s",
              "RSS@10% MiB", "RSS@100% MiB");
  const Timing base = Run(false);
  std::printf("%-22s %10.2f %10.2f %10.1f %14.1f %14.1f\n", "none only (baseline)", base.wall,
              base.cpu, steps / base.wall, base.rss_early, base.rss_end);
  const Timing all = Run(true);
  std::printf("%-22s %10.2f %10.2f %10.1f %14.1f %14.1f\n", "all policies", all.wall, all.cpu,
              steps / all.wall, all.rss_early, all.rss_end);
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  std::printf("all/baseline wall ratio: %.2fx; peak RSS of the process: %.1f MiB; "
              "RSS growth from 10%% to 100%% of the steps: %+.1f MiB\n",
              all.wall / base.wall, u.ru_maxrss / 1024.0, all.rss_end - all.rss_early);
  std::printf("target (issue 7): all policies under 120 s -> %s (wall %.1f s)\n",
              all.wall < 120 ? "met" : "NOT met", all.wall);
  return 0;
}
