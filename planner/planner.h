// The planner: counts in, Plan out. Pure logic: no communication, no device, no I/O.
//
//   auto planner = Planner::Create(config);          // validates and resolves the config
//   Plan plan;
//   MOONEP_RETURN_IF_ERROR((*planner)->MakePlan(counts, &plan));   // counts: [R * E]
//
// A Planner is stateful only where a policy needs history (eplb averages past counts and
// re-plans every eplb_period steps); MakePlan reuses the storage of `plan` and of its scratch, so
// steady-state planning does not allocate. Identical inputs give identical plan bytes on every
// rank and every run: decisions use integer arithmetic only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "planner/plan.h"
#include "planner/plan_builder.h"

namespace moonep::planner {

class Planner {
 public:
  static absl::StatusOr<std::unique_ptr<Planner>> Create(const PlannerConfig& config);
  ~Planner();

  // Plans one step from counts[R * E]. On error `plan` is unspecified.
  absl::Status MakePlan(absl::Span<const int64_t> counts, Plan* plan);

  // Decisions only, from each expert's total tokens (row R of ComputeSourceOffsets): fills
  // plan->alloc, slot_expert, slot_alloc and the load/replica stats (total_tokens, mean_load,
  // max_load_before/after, replicas), and none of the pieces, layouts or row stats. Cost is
  // O(E log E + R * slots) per call after the first for a given Plan (alloc is cleared sparsely,
  // so pass the same Plan again, as filled by this library); moonep weighing replicas balances
  // 10-40 times per call. Policies that look at per-source
  // counts (fastermoe-shadow; moonep where it breaks a tie with moonep-greedy's decisions by
  // travelling rows) assume each expert's tokens come evenly from all sources here.
  // Advances the eplb step counter exactly like MakePlan. On error `plan` is unspecified.
  absl::Status Decide(absl::Span<const int64_t> expert_totals, Plan* plan);

  const PlannerConfig& config() const;  // resolved (defaults filled in)

 private:
  Planner();
  struct State;
  std::unique_ptr<State> state_;
};

// Checks every invariant of a plan against the counts it was made from (conservation per expert
// and per (source, expert), capacity, slot limit, no duplicate expert on a rank, no replica on
// the home rank, layouts in bounds and non-overlapping, padding) and names the one that broke.
absl::Status ValidatePlan(const Plan& plan, absl::Span<const int64_t> counts);

// A lower bound of the maximum rank load (tokens) for these counts: ceil(total / R), raised by
// what the slot limit makes unavoidable where known (no slots: the home placement; each expert
// split over at most 1 + min(R - 1, R * slots) ranks). With speeds only ceil(total / R).
int64_t LoadLowerBound(const PlannerConfig& resolved, absl::Span<const int64_t> counts);

// Canonical bytes of a plan (for determinism checks and the C API).
std::string SerializePlan(const Plan& plan);

// Integer rank capacities for perfect balance of `total` tokens: cap[d] is floor or ceil of
// total * w_d / sum(w), where w are integer weights derived from config speeds (all 1 when none),
// and sum(cap) == total. The ranks that get the ceiling are chosen to need the fewest moves:
// first ranks whose home load is at least their ceiling, then ranks below their floor, then
// ranks exactly at their floor; ties by rank. home_load has R entries.
void BalancedCapacities(const PlannerConfig& resolved, absl::Span<const int64_t> home_load,
                        int64_t total, std::vector<int64_t>* cap);

}  // namespace moonep::planner
