#include "moonep/reference/reference_moe.h"

#include <cmath>

#include "moonep/core/status.h"

namespace moonep::reference {
namespace {

double Sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
double Silu(double v) { return v * Sigmoid(v); }
// d silu(v) / dv = s + v s (1 - s)
double SiluGrad(double v) {
  double s = Sigmoid(v);
  return s + v * s * (1.0 - s);
}

// Pre-activations of expert e on one row: a = x Wg, b = x Wu (each [I]).
void PreActivations(const MoeShape& shape, const ExpertWeights& w, int64_t e, const double* x,
                    std::vector<double>& a, std::vector<double>& b) {
  const int64_t H = shape.hidden, I = shape.intermediate;
  const double* wg = w.wg.data() + e * H * I;
  const double* wu = w.wu.data() + e * H * I;
  a.assign(I, 0.0);
  b.assign(I, 0.0);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < I; ++i) {
      a[i] += x[h] * wg[h * I + i];
      b[i] += x[h] * wu[h * I + i];
    }
  }
}

}  // namespace

absl::Status CheckShape(const MoeShape& shape, int64_t tokens) {
  const int64_t E = shape.num_experts, K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  MOONEP_CHECK_ARG(E > 0 && K > 0 && H > 0 && I > 0 && tokens >= 0,
                   "shape must be positive (E=%d K=%d H=%d I=%d T=%d)", E, K, H, I, tokens);
  // Every size the layer computes (weights, x, top-k, the expert outputs) must fit in int64.
  int64_t v = 0;
  MOONEP_CHECK_ARG(!__builtin_mul_overflow(E, H, &v) && !__builtin_mul_overflow(v, I, &v),
                   "E*H*I overflows int64 (E=%d H=%d I=%d)", E, H, I);
  MOONEP_CHECK_ARG(!__builtin_mul_overflow(tokens, H, &v), "T*H overflows int64 (T=%d H=%d)",
                   tokens, H);
  MOONEP_CHECK_ARG(!__builtin_mul_overflow(tokens, K, &v) && !__builtin_mul_overflow(v, H, &v),
                   "T*K*H overflows int64 (T=%d K=%d H=%d)", tokens, K, H);
  return absl::OkStatus();
}

absl::Status CheckInputs(const MoeShape& shape, const ExpertWeights& w, int64_t tokens,
                         const std::vector<double>& x, const std::vector<int32_t>& topk_ids,
                         const std::vector<double>& topk_weights) {
  MOONEP_RETURN_IF_ERROR(CheckShape(shape, tokens));
  const int64_t E = shape.num_experts, K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  MOONEP_CHECK_ARG(static_cast<int64_t>(w.wg.size()) == E * H * I, "wg has %d values, need %d",
                   w.wg.size(), E * H * I);
  MOONEP_CHECK_ARG(static_cast<int64_t>(w.wu.size()) == E * H * I, "wu has %d values, need %d",
                   w.wu.size(), E * H * I);
  MOONEP_CHECK_ARG(static_cast<int64_t>(w.wd.size()) == E * I * H, "wd has %d values, need %d",
                   w.wd.size(), E * I * H);
  MOONEP_CHECK_ARG(static_cast<int64_t>(x.size()) == tokens * H, "x has %d values, need %d",
                   x.size(), tokens * H);
  MOONEP_CHECK_ARG(static_cast<int64_t>(topk_ids.size()) == tokens * K,
                   "topk_ids has %d values, need %d", topk_ids.size(), tokens * K);
  MOONEP_CHECK_ARG(static_cast<int64_t>(topk_weights.size()) == tokens * K,
                   "topk_weights has %d values, need %d", topk_weights.size(), tokens * K);
  for (int64_t j = 0; j < tokens * K; ++j) {
    MOONEP_CHECK_ARG(topk_ids[j] >= -1 && topk_ids[j] < E,
                     "topk_ids[%d][%d] = %d is outside [-1, %d)", j / K, j % K, topk_ids[j], E);
  }
  return absl::OkStatus();
}

void ExpertForward(const MoeShape& shape, const ExpertWeights& w, int64_t expert, const double* x,
                   double* out) {
  const int64_t H = shape.hidden, I = shape.intermediate;
  std::vector<double> a, b;
  PreActivations(shape, w, expert, x, a, b);
  const double* wd = w.wd.data() + expert * I * H;
  for (int64_t h = 0; h < H; ++h) out[h] = 0.0;
  for (int64_t i = 0; i < I; ++i) {
    double act = Silu(a[i]) * b[i];
    for (int64_t h = 0; h < H; ++h) out[h] += act * wd[i * H + h];
  }
}

absl::Status Forward(const MoeShape& shape, const ExpertWeights& w, int64_t tokens,
                     const std::vector<double>& x, const std::vector<int32_t>& topk_ids,
                     const std::vector<double>& topk_weights, ForwardResult* out) {
  MOONEP_RETURN_IF_ERROR(CheckInputs(shape, w, tokens, x, topk_ids, topk_weights));
  const int64_t K = shape.top_k, H = shape.hidden;
  out->y.assign(tokens * H, 0.0);
  out->expert_out.assign(tokens * K * H, 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      int32_t e = topk_ids[t * K + k];
      if (e < 0) continue;
      double* row = out->expert_out.data() + (t * K + k) * H;
      ExpertForward(shape, w, e, x.data() + t * H, row);
      for (int64_t h = 0; h < H; ++h) out->y[t * H + h] += topk_weights[t * K + k] * row[h];
    }
  }
  return absl::OkStatus();
}

absl::Status Backward(const MoeShape& shape, const ExpertWeights& w, int64_t tokens,
                      const std::vector<double>& x, const std::vector<int32_t>& topk_ids,
                      const std::vector<double>& topk_weights, const std::vector<double>& dy,
                      BackwardResult* out) {
  MOONEP_RETURN_IF_ERROR(CheckInputs(shape, w, tokens, x, topk_ids, topk_weights));
  const int64_t E = shape.num_experts, K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  MOONEP_CHECK_ARG(static_cast<int64_t>(dy.size()) == tokens * H, "dy has %d values, need %d",
                   dy.size(), tokens * H);
  out->dx.assign(tokens * H, 0.0);
  out->dwg.assign(E * H * I, 0.0);
  out->dwu.assign(E * H * I, 0.0);
  out->dwd.assign(E * I * H, 0.0);
  out->dtopk_weights.assign(tokens * K, 0.0);
  std::vector<double> a, b, act(I), dact(I), expert_out(H), dout(H);
  for (int64_t t = 0; t < tokens; ++t) {
    const double* xt = x.data() + t * H;
    const double* dyt = dy.data() + t * H;
    for (int64_t k = 0; k < K; ++k) {
      int32_t e = topk_ids[t * K + k];
      if (e < 0) continue;
      const double weight = topk_weights[t * K + k];
      PreActivations(shape, w, e, xt, a, b);
      const double* wg = w.wg.data() + e * H * I;
      const double* wu = w.wu.data() + e * H * I;
      const double* wd = w.wd.data() + e * I * H;
      for (int64_t i = 0; i < I; ++i) act[i] = Silu(a[i]) * b[i];
      // y contribution = weight * act Wd; d weight = <dy, act Wd>.
      for (int64_t h = 0; h < H; ++h) {
        double v = 0.0;
        for (int64_t i = 0; i < I; ++i) v += act[i] * wd[i * H + h];
        expert_out[h] = v;
        dout[h] = weight * dyt[h];
      }
      double dweight = 0.0;
      for (int64_t h = 0; h < H; ++h) dweight += dyt[h] * expert_out[h];
      out->dtopk_weights[t * K + k] = dweight;
      double* dwd = out->dwd.data() + e * I * H;
      for (int64_t i = 0; i < I; ++i) {
        double s = 0.0;
        for (int64_t h = 0; h < H; ++h) {
          dwd[i * H + h] += act[i] * dout[h];
          s += wd[i * H + h] * dout[h];
        }
        dact[i] = s;
      }
      double* dwg = out->dwg.data() + e * H * I;
      double* dwu = out->dwu.data() + e * H * I;
      double* dxt = out->dx.data() + t * H;
      for (int64_t i = 0; i < I; ++i) {
        double da = dact[i] * b[i] * SiluGrad(a[i]);
        double db = dact[i] * Silu(a[i]);
        for (int64_t h = 0; h < H; ++h) {
          dwg[h * I + i] += xt[h] * da;
          dwu[h * I + i] += xt[h] * db;
          dxt[h] += wg[h * I + i] * da + wu[h * I + i] * db;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace moonep::reference
