// Scratch: host cost of the NCCL dispatch's per-call tables at the DeepSeek-V3 shape.
#include <chrono>
#include <cstdio>
#include <vector>
#include "bench/dispatch/workload.h"
#include "planner/planner.h"
#include "planner/plan_builder.h"
#include "transport/layout.h"
#include "transport/nccl/nccl_tables.h"
using namespace moonep;
using Clock = std::chrono::steady_clock;
int main(int argc, char** argv) {
  int R = argc > 1 ? atoi(argv[1]) : 2, E = 256, K = 8; int64_t T = 4096;
  bench::RoutingSpec spec; spec.num_ranks = R; spec.num_experts = E; spec.top_k = K; spec.tokens = T;
  spec.skew.value = 2.0;
  auto rt = bench::MakeRouting(spec);
  if (!rt.ok()) { printf("%s\n", rt.status().ToString().c_str()); return 1; }
  planner::PlannerConfig c; c.num_ranks = R; c.num_experts = E; c.slots = 16;
  auto pl = planner::Planner::Create(c);
  planner::Plan plan;
  if (!(*pl)->MakePlan(rt->counts, &plan).ok()) return 2;
  std::vector<int64_t> offsets;
  planner::ComputeSourceOffsets(rt->counts, R, E, &offsets);
  transport::SendLayout send; transport::ReceiveLayout recv; transport::nccl::DispatchTables tab;
  double t[5] = {0};
  const int N = argc > 2 ? atoi(argv[2]) : 200;
  for (int it = 0; it < N + 10; ++it) {
    auto a = Clock::now();
    auto s0 = transport::CheckPlanForTransport(plan, rt->counts);
    auto b = Clock::now();
    auto s = transport::BuildSendLayout(plan, offsets, 0, absl::MakeConstSpan(rt->ids_of(0), T * K), T, K, &send);
    auto c2 = Clock::now();
    transport::BuildReceiveLayout(plan, offsets, 0, &recv);
    auto d = Clock::now();
    transport::nccl::BuildDispatchTables(send, recv, 0, &tab);
    auto e = Clock::now();
    if (!s.ok() || !s0.ok()) { printf("err\n"); return 3; }
    if (it >= 10) {
      t[0] += std::chrono::duration<double, std::micro>(b - a).count();
      t[1] += std::chrono::duration<double, std::micro>(c2 - b).count();
      t[2] += std::chrono::duration<double, std::micro>(d - c2).count();
      t[3] += std::chrono::duration<double, std::micro>(e - d).count();
    }
  }
  printf("R=%d: CheckPlanForTransport %.1f us, BuildSendLayout %.1f us, BuildReceiveLayout %.1f us, BuildDispatchTables %.1f us\n",
         R, t[0] / N, t[1] / N, t[2] / N, t[3] / N);
}
