// One planner build behind a C interface, loaded twice (old and new build) by ab_main.cc so that
// both run in one process on the same inputs. Built by ab.sh; not part of the CMake build.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/planner/zipf_counts.h"
#include "planner/planner.h"

using namespace moonep::planner;

namespace {

using moonep::planner::bench::kShapes;
using moonep::planner::bench::Shape;
using moonep::planner::bench::ZipfCounts;

struct Harness {
  std::unique_ptr<Planner> planner;
  std::vector<std::vector<int64_t>> steps, totals;
  Plan plan;
  size_t i = 0;
  bool decide = false;
};

}  // namespace

// shape: 0 EP64, 1 R=128 E=896, 2 R=1024; policy: Policy value; check: moonep_check_greedy;
// decide: Decide on totals instead of MakePlan. Four steps, cycled.
extern "C" __attribute__((visibility("default"))) void* ab_setup(int shape, int policy, int check,
                                                                 int decide) {
  if (shape < 0 || shape >= static_cast<int>(sizeof(kShapes) / sizeof(kShapes[0]))) {
    std::fprintf(stderr, "ab_setup: shape %d is not one of the %zu shapes\n", shape,
                 sizeof(kShapes) / sizeof(kShapes[0]));
    return nullptr;
  }
  const Shape s = kShapes[shape];
  PlannerConfig c;
  c.num_ranks = s.R;
  c.num_experts = s.E;
  c.ranks_per_node = 8;
  c.policy = static_cast<Policy>(policy);
  c.moonep_check_greedy = check != 0;
  auto planner = Planner::Create(c);
  if (!planner.ok()) {
    std::fprintf(stderr, "ab_setup: %s\n", std::string(planner.status().message()).c_str());
    return nullptr;
  }
  Harness* h = new Harness;
  h->planner = std::move(*planner);
  h->decide = decide != 0;
  for (int i = 0; i < 4; ++i) {
    h->steps.push_back(ZipfCounts(s, 1.2, 100 + i));
    std::vector<int64_t> t(s.E, 0);
    for (int r = 0; r < s.R; ++r) {
      for (int e = 0; e < s.E; ++e) t[e] += h->steps.back()[static_cast<size_t>(r) * s.E + e];
    }
    h->totals.push_back(t);
  }
  return h;
}

// Runs `iters` plans; returns the wall time per plan in us.
extern "C" __attribute__((visibility("default"))) double ab_block(void* hv, int iters) {
  Harness* h = static_cast<Harness*>(hv);
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < iters; ++k, ++h->i) {
    if (h->decide) {
      (void)h->planner->Decide(h->totals[h->i % 4], &h->plan);
    } else {
      (void)h->planner->MakePlan(h->steps[h->i % 4], &h->plan);
    }
  }
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
         iters;
}
