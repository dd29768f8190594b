// Scratch (twenty-fourth session): host cost of the NCCL dispatch's layouts and tables at the
// DeepSeek-V3 shape (T=4096, K=8, E=256, maxvio 2 routing, 16 replica slots), with a WorkerPool of
// `threads` (1: none). Usage: driver [ranks=2] [calls=200] [threads=1]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "bench/dispatch/workload.h"
#include "moonep/core/worker_pool.h"
#include "planner/plan_builder.h"
#include "planner/planner.h"
#include "transport/layout.h"
#include "transport/nccl/nccl_tables.h"

using namespace moonep;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  const int R = argc > 1 ? atoi(argv[1]) : 2, E = 256, K = 8;
  const int64_t T = 4096;
  const int N = argc > 2 ? atoi(argv[2]) : 200;
  const int threads = argc > 3 ? atoi(argv[3]) : 1;
  bench::RoutingSpec spec;
  spec.num_ranks = R;
  spec.num_experts = E;
  spec.top_k = K;
  spec.tokens = T;
  spec.skew.value = 2.0;
  auto rt = bench::MakeRouting(spec);
  if (!rt.ok()) return 1;
  planner::PlannerConfig c;
  c.num_ranks = R;
  c.num_experts = E;
  c.slots = 16;
  auto pl = planner::Planner::Create(c);
  planner::Plan plan;
  if (!(*pl)->MakePlan(rt->counts, &plan).ok()) return 2;
  std::vector<int64_t> offsets;
  planner::ComputeSourceOffsets(rt->counts, R, E, &offsets);
  std::unique_ptr<WorkerPool> pool = threads > 1 ? std::make_unique<WorkerPool>(threads) : nullptr;
  transport::SendLayout send;
  transport::ReceiveLayout recv;
  transport::nccl::DispatchTables tab;
  double t[3] = {0, 0, 0};
  for (int it = 0; it < N + 10; ++it) {
    const auto a = Clock::now();
    auto s = transport::BuildSendLayout(plan, offsets, 0, absl::MakeConstSpan(rt->ids_of(0), T * K),
                                        T, K, &send, pool.get());
    const auto b = Clock::now();
    transport::BuildReceiveLayout(plan, offsets, 0, &recv);
    const auto d = Clock::now();
    transport::nccl::BuildDispatchTables(send, recv, 0, &tab, pool.get());
    const auto e = Clock::now();
    if (!s.ok()) return 3;
    if (it >= 10) {
      t[0] += std::chrono::duration<double, std::micro>(b - a).count();
      t[1] += std::chrono::duration<double, std::micro>(d - b).count();
      t[2] += std::chrono::duration<double, std::micro>(e - d).count();
    }
  }
  printf("threads=%d R=%d: BuildSendLayout %.1f us, BuildReceiveLayout %.1f us, "
         "BuildDispatchTables %.1f us, sum %.1f us\n",
         threads, R, t[0] / N, t[1] / N, t[2] / N, (t[0] + t[1] + t[2]) / N);
}
