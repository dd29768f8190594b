// Shared by the transport tests: deterministic multi-rank problems (every rank can regenerate every
// other rank's input from the seed), plans (random replicas and splits through FinalizePlan, or a
// planner policy), and a brute-force placement that does not use transport/layout.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "planner/plan.h"
#include "planner/plan_builder.h"

namespace moonep::transport::test {

struct Problem {
  int32_t R = 1, E = 1, K = 1;
  int64_t H = 1;
  std::vector<int64_t> T;                   // [R] tokens per rank
  std::vector<std::vector<int32_t>> ids;    // [R][T*K]
  std::vector<std::vector<float>> weights;  // [R][T*K]
  std::vector<std::vector<float>> x, dy;    // [R][T*H]
  std::vector<int64_t> counts;              // [R*E]
  int64_t max_tokens() const { return *std::max_element(T.begin(), T.end()); }
};

// Skewed random routing with -1 entries; `zero_rank` (if >= 0) has no tokens; token counts differ
// per rank.
inline Problem MakeProblem(int32_t R, int32_t E, int32_t K, int64_t H, int64_t base_tokens,
                           uint64_t seed, int32_t zero_rank = -1, double drop = 0.2) {
  Problem p;
  p.R = R;
  p.E = E;
  p.K = K;
  p.H = H;
  p.T.resize(R);
  p.ids.resize(R);
  p.weights.resize(R);
  p.x.resize(R);
  p.dy.resize(R);
  p.counts.assign(static_cast<size_t>(R) * E, 0);
  for (int32_t r = 0; r < R; ++r) {
    std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(r) * 7919 + 17);
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t T = r == zero_rank ? 0 : base_tokens + static_cast<int64_t>(rng() % (base_tokens + 1));
    p.T[r] = T;
    p.ids[r].assign(static_cast<size_t>(T * K), -1);
    p.weights[r].assign(static_cast<size_t>(T * K), 0.0f);
    // Zipf-like popularity: a few hot experts.
    std::vector<double> pop(E);
    for (int32_t e = 0; e < E; ++e) pop[e] = 1.0 / (1.0 + ((e * 5 + static_cast<int32_t>(seed)) % E));
    std::discrete_distribution<int32_t> pick(pop.begin(), pop.end());
    for (int64_t t = 0; t < T; ++t) {
      for (int32_t k = 0; k < K && k < E; ++k) {
        if (uni(rng) < drop) continue;
        int32_t e;
        bool dup;
        do {
          e = pick(rng);
          dup = false;
          for (int32_t j = 0; j < k; ++j) dup |= p.ids[r][t * K + j] == e;
        } while (dup);
        p.ids[r][t * K + k] = e;
        p.weights[r][t * K + k] = uni(rng);
        ++p.counts[static_cast<size_t>(r) * E + e];
      }
    }
    p.x[r].resize(static_cast<size_t>(T * H));
    p.dy[r].resize(static_cast<size_t>(T * H));
    for (auto& v : p.x[r]) v = normal(rng);
    for (auto& v : p.dy[r]) v = normal(rng);
  }
  return p;
}

// A plan from InitPlan + random placement decisions + FinalizePlan. kind: "home" (no replicas),
// "random" (random replicas and random splits of each expert over its holders).
inline absl::Status MakeRandomPlan(const std::string& kind, const Problem& p, uint64_t seed,
                                   int32_t slots, int32_t pad, planner::Plan* plan) {
  planner::PlannerConfig in;
  in.num_ranks = p.R;
  in.num_experts = p.E;
  in.slots = slots;
  in.pad_multiple = pad;
  in.policy = planner::Policy::kNone;
  planner::PlannerConfig c;
  absl::Status s = planner::ResolveConfig(in, &c);
  if (!s.ok()) return s;
  planner::InitPlan(c, plan);
  std::mt19937_64 rng(seed * 31 + 5);
  std::vector<int64_t> total(p.E, 0);
  for (int32_t r = 0; r < p.R; ++r) {
    for (int32_t e = 0; e < p.E; ++e) total[e] += p.counts[static_cast<size_t>(r) * p.E + e];
  }
  if (kind == "random") {
    for (int32_t d = 0; d < p.R; ++d) {
      for (int32_t sl = 0; sl < c.slots; ++sl) {
        if (rng() % 10 < 3) continue;
        const int32_t e = static_cast<int32_t>(rng() % p.E);
        if (c.home[e] == d) continue;
        bool dup = false;
        for (int32_t j = 0; j < sl; ++j) dup |= plan->slot_expert[d * c.slots + j] == e;
        if (!dup) plan->slot_expert[d * c.slots + sl] = e;
      }
    }
  }
  for (int32_t e = 0; e < p.E; ++e) {
    std::vector<int32_t> holders = {c.home[e]};
    for (int32_t d = 0; d < p.R; ++d) {
      for (int32_t sl = 0; sl < c.slots; ++sl) {
        if (plan->slot_expert[d * c.slots + sl] == e) holders.push_back(d);
      }
    }
    int64_t left = total[e];
    for (size_t i = 1; i < holders.size(); ++i) {
      const int64_t a = left == 0 ? 0 : static_cast<int64_t>(rng() % (left + 1));
      plan->alloc[static_cast<size_t>(e) * p.R + holders[i]] = a;
      left -= a;
    }
    plan->alloc[static_cast<size_t>(e) * p.R + holders[0]] = left;
  }
  planner::BuildScratch scratch;
  return planner::FinalizePlan(c, p.counts, plan, &scratch);
}

// Brute force: the rank and row of entry (t, k) of source s, by a linear scan of e's pieces.
struct Placement {
  int32_t rank = -1;
  int64_t row = -1;
};
inline std::vector<std::vector<Placement>> BruteForcePlacement(const Problem& p,
                                                               const planner::Plan& plan) {
  std::vector<std::vector<Placement>> out(p.R);
  for (int32_t s = 0; s < p.R; ++s) {
    out[s].resize(p.ids[s].size());
    std::vector<int64_t> seen(p.E, 0);
    for (int64_t t = 0; t < p.T[s]; ++t) {
      for (int32_t k = 0; k < p.K; ++k) {
        const int32_t e = p.ids[s][t * p.K + k];
        if (e < 0) continue;
        int64_t pos = seen[e]++;
        for (int32_t r = 0; r < s; ++r) pos += p.counts[static_cast<size_t>(r) * p.E + e];
        for (int32_t q = plan.piece_begin[e]; q < plan.piece_begin[e + 1]; ++q) {
          if (pos >= plan.piece_start[q] && pos < plan.piece_start[q] + plan.piece_count[q]) {
            out[s][t * p.K + k] = {plan.piece_dest[q], plan.piece_row[q] + pos - plan.piece_start[q]};
          }
        }
      }
    }
  }
  return out;
}

// Expert of row `row` of rank d's compute layout (-1 for padding).
inline int32_t ExpertOfRow(const planner::Plan& plan, int32_t d, int64_t row) {
  const int32_t G = plan.num_groups();
  for (int32_t g = 0; g < G; ++g) {
    const size_t i = static_cast<size_t>(d) * G + g;
    if (row >= plan.group_offset[i] && row < plan.group_offset[i] + plan.group_count[i]) {
      return plan.ExpertOfGroup(d, g);
    }
  }
  return -1;
}

}  // namespace moonep::transport::test
