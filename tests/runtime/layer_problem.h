// A distributed MoE problem for the runtime tests: one global fp64 problem (weights, tokens,
// skewed routing, dy) cut into ranks' shares, the fp64 reference on the whole of it, and
// helpers that run a MoeLayer step and compare with the reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "moonep/core/dtype.h"
#include "moonep/core/status.h"
#include "moonep/reference/gradient_check.h"
#include "moonep/reference/reference_moe.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/moe_layer.h"
#include "tests/harness/mpi_test.h"

namespace moonep::testing {

// A multi-rank test with a communicator over MPI_COMM_WORLD in comm_, made for each test.
class CommunicatorTest : public MpiTest {
 protected:
  void SetUp() override {
    auto comm = runtime::Communicator::FromMpi(MPI_COMM_WORLD);
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm_ = std::move(*comm);
  }
  void TearDown() override {
    comm_.reset();
    MpiTest::TearDown();
  }
  std::unique_ptr<runtime::Communicator> comm_;
};

// Zipf-skewed top-k routing (distinct experts per token, `drop` chance of -1 per entry).
inline void SkewedRouting(int64_t tokens, int32_t experts, int32_t top_k, double zipf, double drop,
                          uint64_t seed, std::vector<int32_t>* ids, std::vector<double>* weights) {
  std::mt19937_64 rng(seed);
  std::vector<double> p(experts);
  // A seed-dependent permutation makes the hot experts differ between problems.
  std::vector<int32_t> perm(experts);
  for (int32_t e = 0; e < experts; ++e) perm[e] = e;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int32_t e = 0; e < experts; ++e) p[perm[e]] = 1.0 / std::pow(e + 1.0, zipf);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  ids->assign(static_cast<size_t>(tokens * top_k), -1);
  weights->assign(static_cast<size_t>(tokens * top_k), 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> q = p;
    for (int32_t k = 0; k < top_k; ++k) {
      std::discrete_distribution<int32_t> pick(q.begin(), q.end());
      const int32_t e = pick(rng);
      q[e] = 0.0;
      const double w = 0.1 + uniform(rng);
      if (uniform(rng) < drop) continue;
      (*ids)[t * top_k + k] = e;
      (*weights)[t * top_k + k] = w;
    }
  }
}

struct GlobalProblem {
  reference::MoeShape shape;
  int32_t num_ranks = 0;
  std::vector<int64_t> tokens;  // per rank
  std::vector<int64_t> offset;  // first global token of each rank
  int64_t total = 0;
  reference::RandomProblem p;   // rounded to `dtype` where the layer stores that dtype
};

inline double RoundTo(DType dtype, double v) {
  return dtype == DType::kFloat32 ? static_cast<double>(static_cast<float>(v))
                                  : BFloat16::FromFloat(static_cast<float>(v)).ToFloat();
}

// Ragged token counts (rank r gets base + (r * 7) % 5), skewed routing. Inputs are rounded to
// `dtype` (and top-k weights to fp32) so the reference sees exactly what the layer sees.
inline GlobalProblem MakeGlobalProblem(int32_t num_ranks, int32_t experts_per_rank, int32_t top_k,
                                       int64_t hidden, int64_t intermediate, int64_t base_tokens,
                                       DType dtype, uint64_t seed, double zipf = 1.2) {
  GlobalProblem g;
  g.num_ranks = num_ranks;
  g.shape.num_experts = static_cast<int64_t>(num_ranks) * experts_per_rank;
  g.shape.top_k = top_k;
  g.shape.hidden = hidden;
  g.shape.intermediate = intermediate;
  for (int32_t r = 0; r < num_ranks; ++r) {
    g.offset.push_back(g.total);
    g.tokens.push_back(base_tokens + (r * 7) % 5);
    g.total += g.tokens.back();
  }
  g.p = reference::MakeRandomProblem(g.shape, g.total, seed, 0.0);
  SkewedRouting(g.total, static_cast<int32_t>(g.shape.num_experts), top_k, zipf, 0.1, seed + 1,
                &g.p.topk_ids, &g.p.topk_weights);
  for (auto* v : {&g.p.weights.wg, &g.p.weights.wu, &g.p.weights.wd, &g.p.x, &g.p.dy}) {
    for (double& x : *v) x = RoundTo(dtype, x);
  }
  for (double& w : g.p.topk_weights) w = static_cast<float>(w);
  return g;
}

template <typename T>
std::vector<char> Encode(const T* v, size_t n, DType dtype) {
  std::vector<char> out(n * DTypeSize(dtype));
  for (size_t i = 0; i < n; ++i) StoreFromFloat(out.data(), dtype, i, static_cast<float>(v[i]));
  return out;
}

inline std::vector<double> Decode(const std::vector<char>& bytes, DType dtype) {
  std::vector<double> out(bytes.size() / DTypeSize(dtype));
  for (size_t i = 0; i < out.size(); ++i) out[i] = LoadAsFloat(bytes.data(), dtype, i);
  return out;
}

// max |a - b| / max |b| (0 when both are zero).
inline double RelError(const std::vector<double>& a, const double* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den > 0 ? num / den : num;
}

// One rank's tensors for a layer: its token share and its home experts' parameters.
// The fp64 reference layer's forward and backward on the whole problem.
inline absl::Status ReferenceLayer(const GlobalProblem& g, reference::ForwardResult* f,
                                   reference::BackwardResult* b) {
  MOONEP_RETURN_IF_ERROR(reference::Forward(g.shape, g.p.weights, g.total, g.p.x, g.p.topk_ids,
                                            g.p.topk_weights, f));
  return reference::Backward(g.shape, g.p.weights, g.total, g.p.x, g.p.topk_ids, g.p.topk_weights,
                             g.p.dy, b);
}

// What an EP-buffer caller's experts compute on the buffer's layout: the fp64 reference FFN of each
// group's expert on each of its rows (fp32 rows, `rows` [num_rows][H] on the host), as fp32.
inline std::vector<float> ReferenceExpertRows(const GlobalProblem& g, const float* rows,
                                              int64_t num_rows, int32_t num_groups,
                                              const int32_t* group_expert,
                                              const int64_t* group_offset,
                                              const int64_t* group_count) {
  const int64_t H = g.shape.hidden;
  std::vector<float> out(static_cast<size_t>(num_rows * H), 0.0f);
  std::vector<double> xr(static_cast<size_t>(H)), yr(static_cast<size_t>(H));
  for (int32_t gi = 0; gi < num_groups; ++gi) {
    for (int64_t r = group_offset[gi]; r < group_offset[gi] + group_count[gi]; ++r) {
      xr.assign(rows + r * H, rows + (r + 1) * H);
      reference::ExpertForward(g.shape, g.p.weights, group_expert[gi], xr.data(), yr.data());
      for (int64_t j = 0; j < H; ++j) out[r * H + j] = static_cast<float>(yr[j]);
    }
  }
  return out;
}

struct RankTensors {
  int64_t tokens = 0;
  std::vector<char> x, y, dy, dx;
  std::vector<int32_t> ids;
  std::vector<float> weights, dtopk;
  std::vector<char> wg, wu, wd;         // [epn][H][I], [epn][H][I], [epn][I][H]
  std::vector<float> gg, gu, gd;        // fp32 gradients, same shapes
  std::vector<compute::ExpertParams> params, grads;
};

inline RankTensors MakeRankTensors(const GlobalProblem& g, int32_t rank, DType dtype) {
  RankTensors t;
  const int64_t H = g.shape.hidden, I = g.shape.intermediate, K = g.shape.top_k;
  const int64_t epn = g.shape.num_experts / g.num_ranks;
  t.tokens = g.tokens[rank];
  const int64_t o = g.offset[rank];
  t.x = Encode(g.p.x.data() + o * H, static_cast<size_t>(t.tokens * H), dtype);
  t.dy = Encode(g.p.dy.data() + o * H, static_cast<size_t>(t.tokens * H), dtype);
  t.y.assign(t.x.size(), 0);
  t.dx.assign(t.x.size(), 0);
  t.ids.assign(g.p.topk_ids.begin() + o * K, g.p.topk_ids.begin() + (o + t.tokens) * K);
  for (int64_t i = o * K; i < (o + t.tokens) * K; ++i) t.weights.push_back(g.p.topk_weights[i]);
  t.dtopk.assign(t.weights.size(), -7.0f);
  const size_t block = static_cast<size_t>(H * I);
  t.wg = Encode(g.p.weights.wg.data() + rank * epn * block, epn * block, dtype);
  t.wu = Encode(g.p.weights.wu.data() + rank * epn * block, epn * block, dtype);
  t.wd = Encode(g.p.weights.wd.data() + rank * epn * block, epn * block, dtype);
  t.gg.assign(epn * block, 0.0f);
  t.gu.assign(epn * block, 0.0f);
  t.gd.assign(epn * block, 0.0f);
  const size_t ds = DTypeSize(dtype);
  for (int64_t e = 0; e < epn; ++e) {
    compute::ExpertParams w, gr;
    w.gate = TensorView::Contiguous(t.wg.data() + e * block * ds, dtype, {H, I});
    w.up = TensorView::Contiguous(t.wu.data() + e * block * ds, dtype, {H, I});
    w.down = TensorView::Contiguous(t.wd.data() + e * block * ds, dtype, {I, H});
    gr.gate = TensorView::Contiguous(t.gg.data() + e * block, DType::kFloat32, {H, I});
    gr.up = TensorView::Contiguous(t.gu.data() + e * block, DType::kFloat32, {H, I});
    gr.down = TensorView::Contiguous(t.gd.data() + e * block, DType::kFloat32, {I, H});
    t.params.push_back(w);
    t.grads.push_back(gr);
  }
  return t;
}

inline absl::StatusOr<runtime::LayerHandle> RunForward(runtime::MoeLayer* layer, RankTensors* t,
                                                       DType dtype, int64_t hidden) {
  return layer->Forward(t->tokens, TensorView::Contiguous(t->x.data(), dtype, {t->tokens, hidden}),
                        t->ids, t->weights,
                        TensorView::Contiguous(t->y.data(), dtype, {t->tokens, hidden}));
}

inline absl::Status RunBackward(runtime::MoeLayer* layer, runtime::LayerHandle h, RankTensors* t,
                                DType dtype, int64_t hidden) {
  return layer->Backward(h, TensorView::Contiguous(t->dy.data(), dtype, {t->tokens, hidden}),
                         TensorView::Contiguous(t->dx.data(), dtype, {t->tokens, hidden}),
                         absl::MakeSpan(t->dtopk));
}

}  // namespace moonep::testing
