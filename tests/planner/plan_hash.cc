// planner_plan_hash: one FNV-1a hash of SerializePlan over a fixed corpus of inputs x policies, to
// check that a change of the planner's code leaves every plan byte-identical (run it before and
// after; the hashes must match). Not a test: a legitimate change of the plans changes the hash.
//
//   build/bin/planner_plan_hash          # 400 small and mid configs x 6 policies (~3 s)
//   build/bin/planner_plan_hash --big    # 30 configs with R = 96..1024 (~15 s)
//   build/bin/planner_plan_hash --home   # 120 configs with a shuffled home map
//
// Small corpus: R in {1..128}, E/R in 1..7, topologies, slot limits, pads, speeds, ragged and
// one-expert counts, every policy (moonep with and without its cross-check), two steps each, and
// Decide on the totals. Big corpus: R in {96, 200, 256, 512, 1024}, E/R in {1, 2, 4, 8}, Zipf
// 0.3-2.0 on a random expert permutation, moonep (both ways) and moonep-greedy.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "planner/planner.h"

namespace moonep::planner {
namespace {

struct Hash {
  uint64_t h = 1469598103934665603ull;
  void Mix(const std::string& s) {
    for (unsigned char ch : s) {
      h ^= ch;
      h *= 1099511628211ull;
    }
  }
};

std::vector<int64_t> Totals(const std::vector<int64_t>& counts, int R, int E) {
  std::vector<int64_t> t(E, 0);
  for (int r = 0; r < R; ++r) {
    for (int e = 0; e < E; ++e) t[e] += counts[static_cast<size_t>(r) * E + e];
  }
  return t;
}

// A corpus config; `speeds` gives the ranks speeds 1, 2, 3, 1, 2, ...
PlannerConfig Config(int R, int E, int rpn, int slots, int pad, Policy policy, bool check,
                     bool speeds) {
  PlannerConfig c;
  c.num_ranks = R;
  c.num_experts = E;
  c.ranks_per_node = rpn;
  c.slots = slots;
  c.pad_multiple = pad;
  c.policy = policy;
  c.moonep_check_greedy = check;
  c.row_bytes = 7;
  c.expert_bytes = 1000;
  if (speeds) {
    c.speeds.resize(R);
    for (int r = 0; r < R; ++r) c.speeds[r] = 1 + r % 3;
  }
  return c;
}

// Two steps of MakePlan (the second on slightly changed counts) and Decide, into the hash.
void PlanSteps(const PlannerConfig& c, std::vector<int64_t> counts, std::mt19937_64* rng,
               bool shuffle_first_row, Hash* hash, int* plans, int* invalid) {
  auto planner = Planner::Create(c);
  if (!planner.ok()) {
    hash->Mix("E" + std::string(planner.status().message()));
    return;
  }
  Plan plan;
  for (int step = 0; step < 2; ++step) {
    const absl::Status st = (*planner)->MakePlan(counts, &plan);
    if (!st.ok()) {
      hash->Mix("F" + std::string(st.message()));
      return;
    }
    if (!ValidatePlan(plan, counts).ok()) ++*invalid;
    hash->Mix(SerializePlan(plan));
    ++*plans;
    Plan decided;
    if ((*planner)->Decide(Totals(counts, c.num_ranks, c.num_experts), &decided).ok()) {
      hash->Mix(SerializePlan(decided));
    }
    if (shuffle_first_row) {
      std::shuffle(counts.begin(), counts.begin() + c.num_experts, *rng);
    } else {
      std::swap(counts.front(), counts.back());
    }
  }
}

void SmallCorpus(Hash* hash, int* plans, int* invalid) {
  std::mt19937_64 rng(7);
  const int Rs[] = {1, 2, 3, 4, 5, 8, 12, 16, 64, 128};
  for (int it = 0; it < 400; ++it) {
    const int R = Rs[it % 10];
    const int epn = 1 + static_cast<int>(rng() % 7);
    const int E = R * epn;
    const int rpn = std::vector<int>{0, 1, 2, 3, 4, 6, 8}[rng() % 7];
    const int slots = rng() % 3 == 0 ? 1 + static_cast<int>(rng() % 3) : -1;
    const int kind = static_cast<int>(rng() % 5);
    const double zexp = 0.5 + static_cast<double>(rng() % 4) * 0.5;
    std::vector<double> p(E);
    for (int e = 0; e < E; ++e) p[e] = 1.0 / std::pow(1.0 + (e * 7919 + it) % E, zexp);
    std::vector<int64_t> counts(static_cast<size_t>(R) * E);
    for (int r = 0; r < R; ++r) {
      for (int e = 0; e < E; ++e) {
        int64_t v = static_cast<int64_t>(p[e] * (kind == 3 ? 10 : 5000) *
                                         (0.5 + static_cast<double>(rng() % 100) / 100.0));
        if (kind == 1 && e != 0) v = 0;
        if (kind == 2 && r == 0) v = 0;
        if (kind == 4) v = static_cast<int64_t>(rng() % 50);
        counts[static_cast<size_t>(r) * E + e] = v;
      }
    }
    for (int pol = 0; pol <= 5; ++pol) {
      for (int nocheck = 0; nocheck < 2; ++nocheck) {
        if (nocheck && pol != static_cast<int>(Policy::kMoonEP)) continue;
        const PlannerConfig c = Config(R, E, rpn > R ? 0 : rpn, slots, 1 + (it % 3) * 7,
                                       static_cast<Policy>(pol), !nocheck, it % 11 == 5);
        PlanSteps(c, counts, &rng, false, hash, plans, invalid);
      }
    }
  }
}

void BigCorpus(Hash* hash, int* plans, int* invalid) {
  std::mt19937_64 rng(11);
  const int Rs[] = {256, 512, 1024, 96, 200};
  for (int it = 0; it < 30; ++it) {
    const int R = Rs[it % 5];
    int epn = std::vector<int>{1, 2, 4, 8}[rng() % 4];
    if (R == 1024 && epn > 4) epn = 4;
    const int E = R * epn;
    const int rpn = std::vector<int>{0, 8, 4, 6}[rng() % 4];
    const int slots = rng() % 3 == 0 ? 1 + static_cast<int>(rng() % 2) : -1;
    const double zexp = std::vector<double>{0.3, 0.8, 1.2, 2.0}[rng() % 4];
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<double> p(E);
    for (int e = 0; e < E; ++e) p[perm[e]] = 1.0 / std::pow(1.0 + e, zexp);
    const double sum = std::accumulate(p.begin(), p.end(), 0.0);
    std::vector<int64_t> counts(static_cast<size_t>(R) * E);
    for (int r = 0; r < R; ++r) {
      for (int e = 0; e < E; ++e) {
        counts[static_cast<size_t>(r) * E + e] = static_cast<int64_t>(
            4096.0 * 8 * p[e] / sum * (0.6 + static_cast<double>(rng() % 80) / 100.0));
      }
    }
    for (Policy pol : {Policy::kMoonEP, Policy::kMoonEPGreedy}) {
      for (int nocheck = 0; nocheck < 2; ++nocheck) {
        if (nocheck && pol != Policy::kMoonEP) continue;
        const PlannerConfig c = Config(R, E, rpn, slots, 1 + (it % 2) * 15, pol, !nocheck, it % 7 == 3);
        PlanSteps(c, counts, &rng, true, hash, plans, invalid);
      }
    }
  }
}

// Home-map corpus: the small corpus's shapes with a shuffled home map (each rank still homes E/R
// experts), so the planner's paths for a non-contiguous map are covered too.
void HomeCorpus(Hash* hash, int* plans, int* invalid) {
  std::mt19937_64 rng(13);
  const int Rs[] = {2, 3, 4, 8, 12, 16, 64, 128};
  for (int it = 0; it < 120; ++it) {
    const int R = Rs[it % 8];
    const int epn = 1 + static_cast<int>(rng() % 7);
    const int E = R * epn;
    const int rpn = std::vector<int>{0, 2, 3, 4, 8}[rng() % 5];
    const int slots = rng() % 3 == 0 ? 1 + static_cast<int>(rng() % 3) : -1;
    std::vector<int32_t> home(E);
    for (int e = 0; e < E; ++e) home[e] = e % R;
    std::shuffle(home.begin(), home.end(), rng);
    std::vector<int64_t> counts(static_cast<size_t>(R) * E);
    for (int r = 0; r < R; ++r) {
      for (int e = 0; e < E; ++e) {
        counts[static_cast<size_t>(r) * E + e] = static_cast<int64_t>(
            3000.0 / (1.0 + (e * 7919 + it) % E) * (0.5 + static_cast<double>(rng() % 100) / 100.0));
      }
    }
    for (int pol = 0; pol <= 5; ++pol) {
      PlannerConfig c = Config(R, E, rpn > R ? 0 : rpn, slots, 1 + (it % 3) * 7,
                               static_cast<Policy>(pol), it % 2 == 0, it % 11 == 5);
      c.home = home;
      PlanSteps(c, counts, &rng, false, hash, plans, invalid);
    }
  }
}

}  // namespace
}  // namespace moonep::planner

int main(int argc, char** argv) {
  using namespace moonep::planner;
  const bool big = argc > 1 && std::strcmp(argv[1], "--big") == 0;
  const bool home = argc > 1 && std::strcmp(argv[1], "--home") == 0;
  if (argc > 2 || (argc == 2 && !big && !home)) {
    std::fprintf(stderr, "usage: %s [--big | --home]   (no argument: the small corpus)\n",
                 argv[0]);
    return 2;
  }
  Hash hash;
  int plans = 0, invalid = 0;
  if (big) {
    BigCorpus(&hash, &plans, &invalid);
  } else if (home) {
    HomeCorpus(&hash, &plans, &invalid);
  } else {
    SmallCorpus(&hash, &plans, &invalid);
  }
  std::printf("%s corpus: plans %d invalid %d hash %016llx\n", big ? "big" : home ? "home-map" : "small",
              plans, invalid, static_cast<unsigned long long>(hash.h));
  return invalid == 0 ? 0 : 1;
}
