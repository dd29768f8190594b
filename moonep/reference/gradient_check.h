// Central finite-difference check of the reference layer's backward pass: for L = <dy, y>, every
// analytic gradient (dx, dWg, dWu, dWd, d topk_weights) is compared with (L(p+h) - L(p-h)) / 2h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moonep/reference/reference_moe.h"

namespace moonep::reference {

struct GradientCheckCase {
  MoeShape shape;
  int64_t tokens = 0;
  uint64_t seed = 0;
  double drop_probability = 0.2;  // chance that a top-k entry is -1
};

struct GradientCheckResult {
  std::string tensor;       // "dx", "dwg", "dwu", "dwd", "dtopk_weights"
  int64_t checked = 0;      // entries compared
  double max_rel_error = 0; // max |analytic - numeric| / max(|analytic|, |numeric|, floor)
};

// Builds a random problem from the case and compares every gradient entry. The relative error of
// an entry uses max(|a|, |n|, 1e-3 * scale) as denominator, scale = the tensor's max |gradient|,
// so entries that are zero up to rounding do not dominate.
absl::Status CheckGradients(const GradientCheckCase& c, std::vector<GradientCheckResult>* results);

// A random problem (used by the check and by tests elsewhere); empty when CheckShape rejects the
// shape.
struct RandomProblem {
  ExpertWeights weights;
  std::vector<double> x, topk_weights, dy;
  std::vector<int32_t> topk_ids;
};
RandomProblem MakeRandomProblem(const MoeShape& shape, int64_t tokens, uint64_t seed,
                                double drop_probability);

}  // namespace moonep::reference
