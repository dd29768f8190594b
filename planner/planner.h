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

// The lower bound of the maximum rank load for these counts: ceil(total / R) (speed-weighted
// when the config has speeds), raised by what the slot limit makes unavoidable where known.
int64_t LoadLowerBound(const PlannerConfig& resolved, absl::Span<const int64_t> counts);

// Canonical bytes of a plan (for determinism checks and the C API).
std::string SerializePlan(const Plan& plan);

}  // namespace moonep::planner
