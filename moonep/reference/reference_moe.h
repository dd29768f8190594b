// The fp64 reference MoE layer: single process, plain loops, deliberately simple. It is the oracle
// every distributed test compares against, and is itself checked against finite differences.
//
// Layouts (row-major, all double):
//   x[T][H], topk_ids[T][K] (-1: no expert), topk_weights[T][K]
//   wg[E][H][I], wu[E][H][I], wd[E][I][H]       (expert e's blocks are contiguous)
//   y[T][H] = sum_k w[t,k] * FFN_{e(t,k)}(x[t]),  FFN(x) = (silu(x Wg) * (x Wu)) Wd
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace moonep::reference {

struct MoeShape {
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // K
  int64_t hidden = 0;       // H
  int64_t intermediate = 0; // I
};

struct ExpertWeights {
  std::vector<double> wg, wu, wd;  // [E*H*I], [E*H*I], [E*I*H]
};

struct ForwardResult {
  std::vector<double> y;            // [T*H]
  std::vector<double> expert_out;   // [T*K*H] FFN_{e(t,k)}(x[t]); zeros where e = -1
};

struct BackwardResult {
  std::vector<double> dx;             // [T*H]
  std::vector<double> dwg, dwu, dwd;  // like the weights
  std::vector<double> dtopk_weights;  // [T*K]; 0 where e = -1
};

// Checks a shape and token count: all positive (tokens >= 0), and every size the layer computes
// from them (E*H*I, T*H, T*K*H) within int64.
absl::Status CheckShape(const MoeShape& shape, int64_t tokens);

// Checks shapes (CheckShape, then every vector's size) and expert ids (-1 allowed; any other id
// outside [0, E) is an error).
absl::Status CheckInputs(const MoeShape& shape, const ExpertWeights& w, int64_t tokens,
                         const std::vector<double>& x, const std::vector<int32_t>& topk_ids,
                         const std::vector<double>& topk_weights);

// The expert FFN on one row: out[H] = FFN_e(x[H]).
void ExpertForward(const MoeShape& shape, const ExpertWeights& w, int64_t expert, const double* x,
                   double* out);

absl::Status Forward(const MoeShape& shape, const ExpertWeights& w, int64_t tokens,
                     const std::vector<double>& x, const std::vector<int32_t>& topk_ids,
                     const std::vector<double>& topk_weights, ForwardResult* out);

// Gradients of L = <dy, y> with respect to x, the weights and the top-k weights.
absl::Status Backward(const MoeShape& shape, const ExpertWeights& w, int64_t tokens,
                      const std::vector<double>& x, const std::vector<int32_t>& topk_ids,
                      const std::vector<double>& topk_weights, const std::vector<double>& dy,
                      BackwardResult* out);

}  // namespace moonep::reference
