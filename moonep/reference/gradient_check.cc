#include "moonep/reference/gradient_check.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "moonep/core/status.h"

namespace moonep::reference {

RandomProblem MakeRandomProblem(const MoeShape& shape, int64_t tokens, uint64_t seed,
                                double drop_probability) {
  if (!CheckShape(shape, tokens).ok()) return RandomProblem{};
  const int64_t E = shape.num_experts, K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  RandomProblem p;
  auto fill = [&](std::vector<double>& v, int64_t n, double scale) {
    v.resize(n);
    for (auto& value : v) value = normal(rng) * scale;
  };
  fill(p.weights.wg, E * H * I, 1.0 / std::sqrt(static_cast<double>(H)));
  fill(p.weights.wu, E * H * I, 1.0 / std::sqrt(static_cast<double>(H)));
  fill(p.weights.wd, E * I * H, 1.0 / std::sqrt(static_cast<double>(I)));
  fill(p.x, tokens * H, 1.0);
  fill(p.dy, tokens * H, 1.0);
  p.topk_ids.assign(tokens * K, -1);
  p.topk_weights.assign(tokens * K, 0.0);
  std::vector<int32_t> experts(E);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t k = 0; k < K; ++k) {
      if (uniform(rng) < drop_probability) continue;
      p.topk_ids[t * K + k] = experts[k % E];
      p.topk_weights[t * K + k] = uniform(rng);
    }
  }
  return p;
}

namespace {

double Loss(const MoeShape& shape, const RandomProblem& p, int64_t tokens) {
  ForwardResult fwd;
  absl::Status s = Forward(shape, p.weights, tokens, p.x, p.topk_ids, p.topk_weights, &fwd);
  if (!s.ok()) return std::nan("");
  double loss = 0.0;
  for (size_t i = 0; i < fwd.y.size(); ++i) loss += p.dy[i] * fwd.y[i];
  return loss;
}

GradientCheckResult Compare(const char* name, RandomProblem& p, const MoeShape& shape,
                            int64_t tokens, std::vector<double>& param,
                            const std::vector<double>& analytic) {
  GradientCheckResult r;
  r.tensor = name;
  double scale = 0.0;
  for (double a : analytic) scale = std::max(scale, std::fabs(a));
  const double floor = std::max(1e-3 * scale, 1e-12);
  for (size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    const double h = 1e-5 * std::max(1.0, std::fabs(saved));
    param[i] = saved + h;
    const double plus = Loss(shape, p, tokens);
    param[i] = saved - h;
    const double minus = Loss(shape, p, tokens);
    param[i] = saved;
    const double numeric = (plus - minus) / (2 * h);
    const double denom = std::max({std::fabs(analytic[i]), std::fabs(numeric), floor});
    r.max_rel_error = std::max(r.max_rel_error, std::fabs(analytic[i] - numeric) / denom);
    ++r.checked;
  }
  return r;
}

}  // namespace

absl::Status CheckGradients(const GradientCheckCase& c, std::vector<GradientCheckResult>* results) {
  results->clear();
  MOONEP_RETURN_IF_ERROR(CheckShape(c.shape, c.tokens));  // before building the problem from it
  RandomProblem p = MakeRandomProblem(c.shape, c.tokens, c.seed, c.drop_probability);
  BackwardResult grads;
  MOONEP_RETURN_IF_ERROR(Backward(c.shape, p.weights, c.tokens, p.x, p.topk_ids, p.topk_weights,
                                  p.dy, &grads));
  results->clear();
  results->push_back(Compare("dx", p, c.shape, c.tokens, p.x, grads.dx));
  results->push_back(Compare("dwg", p, c.shape, c.tokens, p.weights.wg, grads.dwg));
  results->push_back(Compare("dwu", p, c.shape, c.tokens, p.weights.wu, grads.dwu));
  results->push_back(Compare("dwd", p, c.shape, c.tokens, p.weights.wd, grads.dwd));
  // Entries with expert -1 have no gradient path: their derivative must be exactly zero, which
  // the finite difference confirms as well.
  results->push_back(
      Compare("dtopk_weights", p, c.shape, c.tokens, p.topk_weights, grads.dtopk_weights));
  return absl::OkStatus();
}

}  // namespace moonep::reference
