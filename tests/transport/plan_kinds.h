// Plans and fake experts shared by the transport suites that run every plan source over a
// backend (transport_test.cc over host memory; the NCCL suite can use the same). Separate from
// transport_test_util.h so a file that still has its own copies does not see two candidates.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "tests/transport/transport_test_util.h"

namespace moonep::transport::test {

// A plan of one kind for the problem: "home" (no replicas) or "random" (random replicas and
// splits), else a planner policy by name (pad multiple 2). home_replicas: the one-rank mode of
// test-force-replicas (replica slots on the experts' own home rank), for backends that support it.
inline absl::Status MakePlanOfKind(const std::string& kind, const Problem& p, uint64_t seed,
                                   planner::Plan* plan, bool home_replicas = false) {
  if (kind == "home" || kind == "random") {
    return MakeRandomPlan(kind, p, seed, kind == "home" ? 0 : 2, 2, plan);
  }
  planner::PlannerConfig c;
  c.num_ranks = p.R;
  c.num_experts = p.E;
  c.pad_multiple = 2;
  c.test_home_replicas = home_replicas;
  if (!planner::ParsePolicy(kind, &c.policy)) return absl::InvalidArgumentError(kind);
  auto made = planner::Planner::Create(c);
  if (!made.ok()) return made.status();
  return (*made)->MakePlan(p.counts, plan);
}

// A fixed, distinct "expert" per id: out = scale(e) * in, so rows mixed up between groups show.
inline float Scale(int32_t e) { return 1.0f + 0.25f * static_cast<float>(e % 5); }

// Receive rows that hold any plan of the problem: every routed row plus padding of each group.
inline int64_t CapacityRows(const Problem& p, int32_t groups, int32_t pad) {
  int64_t total = 0;
  for (int32_t r = 0; r < p.R; ++r) total += p.T[r] * p.K;
  return total + static_cast<int64_t>(groups) * pad;
}

}  // namespace moonep::transport::test
