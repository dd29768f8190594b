// The CPU executor against the fp64 reference layer: forward per row = reference ExpertForward of
// the row's group, backward dx and weight gradients = reference Backward with every row routed
// (top-1, weight 1) to its group's expert.
#include "moonep/compute/cpu/cpu_executor.h"
#include "moonep/compute/cpu/activation.h"
#include "moonep/compute/cpu/gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "moonep/reference/reference_moe.h"
#include "tests/compute/problem.h"

namespace moonep::compute {
namespace {

using testing::Buffer;
using testing::ErrorMeter;
using testing::Problem;
using testing::ProblemSpec;

std::unique_ptr<cpu::CpuExecutor> MakeExecutor(const Problem& p, int threads) {
  ExecutorConfig config;
  config.hidden = p.spec.hidden;
  config.intermediate = p.spec.intermediate;
  config.dtype = p.spec.dtype;
  config.max_rows = p.view.total_rows;
  config.num_threads = threads;
  auto ex = cpu::CpuExecutor::Create(config);
  EXPECT_TRUE(ex.ok()) << ex.status();
  return std::move(ex).value();
}

double Tolerance(DType dtype) { return dtype == DType::kFloat32 ? 1e-5 : 1e-2; }

// Forward error against the reference; also checks that non-data rows of y are zero.
double ForwardError(Problem& p, Buffer& y) {
  const int64_t H = p.spec.hidden;
  ErrorMeter err;
  std::vector<double> xr(H), out(H);
  for (size_t j = 0; j < p.data_rows.size(); ++j) {
    const int64_t r = p.data_rows[j];
    for (int64_t h = 0; h < H; ++h) xr[h] = p.x.Get(r, h);
    reference::ExpertForward(p.shape, p.ref, p.row_group[j], xr.data(), out.data());
    for (int64_t h = 0; h < H; ++h) err.Add(y.Get(r, h), out[h]);
  }
  std::vector<bool> is_data(p.view.total_rows, false);
  for (int64_t r : p.data_rows) is_data[r] = true;
  for (int64_t r = 0; r < p.view.total_rows; ++r) {
    if (is_data[r]) continue;
    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(y.Get(r, h), 0.0f) << "non-data row " << r;
  }
  return err.rel();
}

struct GradErrors {
  double dx = 0, dwg = 0, dwu = 0, dwd = 0;
};

// Backward errors against `factor` times the reference gradients.
GradErrors BackwardErrors(Problem& p, Buffer& dx, double factor) {
  const int64_t H = p.spec.hidden, I = p.spec.intermediate;
  const int64_t T = static_cast<int64_t>(p.data_rows.size());
  std::vector<double> x(T * H), dy(T * H), weights(T, 1.0);
  for (int64_t j = 0; j < T; ++j) {
    for (int64_t h = 0; h < H; ++h) {
      x[j * H + h] = p.x.Get(p.data_rows[j], h);
      dy[j * H + h] = p.dy.Get(p.data_rows[j], h);
    }
  }
  reference::BackwardResult ref;
  absl::Status st = reference::Backward(p.shape, p.ref, T, x, p.row_group, weights, dy, &ref);
  EXPECT_TRUE(st.ok()) << st;
  GradErrors e;
  ErrorMeter mdx, mg, mu, md;
  for (int64_t j = 0; j < T; ++j) {
    for (int64_t h = 0; h < H; ++h) mdx.Add(dx.Get(p.data_rows[j], h), ref.dx[j * H + h]);
  }
  for (size_t g = 0; g < p.view.groups.size(); ++g) {
    for (int64_t a = 0; a < H; ++a) {
      for (int64_t i = 0; i < I; ++i) {
        mg.Add(p.grads[3 * g].Get(a, i), factor * ref.dwg[(g * H + a) * I + i]);
        mu.Add(p.grads[3 * g + 1].Get(a, i), factor * ref.dwu[(g * H + a) * I + i]);
        md.Add(p.grads[3 * g + 2].Get(i, a), factor * ref.dwd[(g * I + i) * H + a]);
      }
    }
  }
  std::vector<bool> is_data(p.view.total_rows, false);
  for (int64_t r : p.data_rows) is_data[r] = true;
  for (int64_t r = 0; r < p.view.total_rows; ++r) {
    if (is_data[r]) continue;
    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(dx.Get(r, h), 0.0f) << "non-data row " << r;
  }
  return GradErrors{mdx.rel(), mg.rel(), mu.rel(), md.rel()};
}

struct Case {
  const char* name;
  ProblemSpec spec;
};

class ExecutorVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(ExecutorVsReference, ForwardAndBackward) {
  Problem p(GetParam().spec);
  auto ex = MakeExecutor(p, 2);
  const double tol = Tolerance(p.spec.dtype);
  Buffer y(p.view.total_rows, p.spec.hidden, p.spec.dtype);
  y.Fill(7.0f);  // stale data that padding rows must not keep
  ASSERT_TRUE(ex->Forward(p.view, p.x.view(), y.view(), ForwardOptions{}).ok());
  const double fwd = ForwardError(p, y);
  EXPECT_LT(fwd, tol);

  Buffer dx(p.view.total_rows, p.spec.hidden, p.spec.dtype);
  dx.Fill(7.0f);
  absl::Status st = ex->Backward(p.view, p.x.view(), p.dy.view(), dx.view(), BackwardOptions{});
  ASSERT_TRUE(st.ok()) << st;
  GradErrors e1 = BackwardErrors(p, dx, 1.0);
  // bf16 gradients are rounded at every accumulation, so they get the bf16 bar.
  const double gtol = Tolerance(p.spec.grad_dtype == DType::kFloat32 && p.spec.dtype == DType::kFloat32
                                    ? DType::kFloat32 : DType::kBFloat16);
  EXPECT_LT(e1.dx, tol);
  EXPECT_LT(e1.dwg, gtol);
  EXPECT_LT(e1.dwu, gtol);
  EXPECT_LT(e1.dwd, gtol);

  // A second backward accumulates: the gradients become twice the reference.
  ASSERT_TRUE(ex->Backward(p.view, p.x.view(), p.dy.view(), dx.view(), BackwardOptions{}).ok());
  GradErrors e2 = BackwardErrors(p, dx, 2.0);
  EXPECT_LT(e2.dwg, gtol);
  EXPECT_LT(e2.dwu, gtol);
  EXPECT_LT(e2.dwd, gtol);
  std::printf("[ EXECUTOR ] %-28s fwd %.1e  dx %.1e  dWg %.1e  dWu %.1e  dWd %.1e  (2x: %.1e %.1e %.1e)\n",
              GetParam().name, fwd, e1.dx, e1.dwg, e1.dwu, e1.dwd, e2.dwg, e2.dwu, e2.dwd);
}

ProblemSpec Spec(int64_t H, int64_t I, DType dtype, DType grad_dtype, std::vector<int64_t> counts,
                 int64_t pad, uint64_t seed, int64_t gap = 0) {
  ProblemSpec s;
  s.hidden = H;
  s.intermediate = I;
  s.dtype = dtype;
  s.grad_dtype = grad_dtype;
  s.counts = std::move(counts);
  s.pad_multiple = pad;
  s.seed = seed;
  s.gap = gap;
  return s;
}

constexpr DType kF32 = DType::kFloat32;
constexpr DType kBF16 = DType::kBFloat16;

INSTANTIATE_TEST_SUITE_P(
    Shapes, ExecutorVsReference,
    ::testing::Values(
        // H, I not multiples of 8; empty groups; a group over two row blocks; padding and gaps.
        Case{"fp32_skewed_H13_I7", Spec(13, 7, kF32, kF32, {5, 0, 17, 1, 300, 0}, 4, 1, 3)},
        Case{"fp32_one_group_all_rows", Spec(40, 24, kF32, kF32, {0, 0, 513, 0}, 8, 2)},
        Case{"fp32_single_row", Spec(9, 11, kF32, kF32, {1}, 1, 3)},
        Case{"fp32_single_row_padded", Spec(5, 3, kF32, kF32, {0, 1, 0}, 16, 4)},
        Case{"fp32_H300_I260", Spec(300, 260, kF32, kF32, {37, 3}, 1, 5)},
        Case{"bf16_skewed_H13_I7", Spec(13, 7, kBF16, kF32, {5, 0, 17, 1, 300, 0}, 4, 6, 2)},
        Case{"bf16_one_group_all_rows", Spec(40, 24, kBF16, kF32, {0, 513, 0}, 8, 7)},
        Case{"bf16_single_row", Spec(9, 11, kBF16, kF32, {1}, 1, 8)},
        // H, I above the bf16 conversion panel (256) and a weight-gradient tile (256).
        Case{"bf16_H300_I260", Spec(300, 260, kBF16, kF32, {37, 3, 0}, 1, 9)},
        Case{"bf16_bf16grads_H300_I260", Spec(300, 260, kBF16, kBF16, {29, 0, 6}, 2, 10)},
        Case{"bf16_bf16grads_H31_I17", Spec(31, 17, kBF16, kBF16, {70, 2, 0, 1}, 4, 11)}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

bool SameBytes(Buffer& a, Buffer& b) { return std::memcmp(a.data(), b.data(), a.bytes()) == 0; }

// y and dx of the last of `reps` forward+backward steps of `ex` on `p` (the weight gradients
// accumulate in p.grads over the steps).
struct StepOutputs {
  Buffer y, dx;
};
StepOutputs RunSteps(Problem& p, cpu::CpuExecutor* ex, int reps = 1) {
  const int64_t R = p.view.total_rows, H = p.view.hidden;
  StepOutputs o{Buffer(R, H, p.view.dtype), Buffer(R, H, p.view.dtype)};
  for (int rep = 0; rep < reps; ++rep) {
    EXPECT_TRUE(ex->Forward(p.view, p.x.view(), o.y.view(), {}).ok());
    EXPECT_TRUE(ex->Backward(p.view, p.x.view(), p.dy.view(), o.dx.view(), {}).ok());
  }
  return o;
}

// y, dx and every weight gradient bitwise equal.
void ExpectSameBytes(Problem& pa, StepOutputs& a, Problem& pb, StepOutputs& b,
                     const std::string& what) {
  EXPECT_TRUE(SameBytes(a.y, b.y)) << what;
  EXPECT_TRUE(SameBytes(a.dx, b.dx)) << what;
  for (size_t k = 0; k < pa.grads.size(); ++k) {
    EXPECT_TRUE(SameBytes(pa.grads[k], pb.grads[k])) << what << " grad " << k;
  }
}

// The schedule changes with the thread count, the arithmetic must not.
class ThreadInvariance : public ::testing::TestWithParam<DType> {};

TEST_P(ThreadInvariance, OneAndTwoThreadsAgreeBitwise) {
  const DType dt = GetParam();
  const ProblemSpec spec = Spec(36, 20, dt, dt, {700, 3, 0, 45, 260, 1}, 4, 21);
  Problem p1(spec), p2(spec);
  auto ex1 = MakeExecutor(p1, 1);
  auto ex2 = MakeExecutor(p2, 2);
  ASSERT_EQ(ex1->num_threads(), 1);
  ASSERT_EQ(ex2->num_threads(), 2);
  StepOutputs o1 = RunSteps(p1, ex1.get(), 2), o2 = RunSteps(p2, ex2.get(), 2);
  ExpectSameBytes(p1, o1, p2, o2, DTypeName(dt));
  EXPECT_LT(ForwardError(p1, o1.y), Tolerance(dt));
}

INSTANTIATE_TEST_SUITE_P(DTypes, ThreadInvariance, ::testing::Values(kF32, kBF16));

// H and I above kColTile (two column tiles per row block; row blocks are covered above): 1 and 2
// threads agree bitwise (the same tiles, see TileLimits), and both match the reference.
TEST(ThreadInvarianceWide, OneAndTwoThreadsAgreeBitwise) {
  const ProblemSpec spec = Spec(1100, 1030, kF32, kF32, {40, 3, 0, 17}, 4, 23);
  Problem p1(spec), p2(spec);
  auto ex1 = MakeExecutor(p1, 1);
  auto ex2 = MakeExecutor(p2, 2);
  StepOutputs o1 = RunSteps(p1, ex1.get()), o2 = RunSteps(p2, ex2.get());
  ExpectSameBytes(p1, o1, p2, o2, "wide");
  EXPECT_LT(ForwardError(p1, o1.y), 1e-5);
  const GradErrors e = BackwardErrors(p1, o1.dx, 1.0);
  EXPECT_LT(e.dx, 1e-5);
  EXPECT_LT(e.dwg, 1e-5);
  EXPECT_LT(e.dwu, 1e-5);
  EXPECT_LT(e.dwd, 1e-5);
}

// Few rows and many threads: the row phases cut finer tiles (TileLimits) so that all 16 threads
// have work. Finer tiles may change the last bits against one thread (OpenBLAS rounds by shape),
// so: both match the fp64 reference, and 16 threads repeat themselves bitwise.
TEST(ThreadInvarianceFine, SixteenThreadsMatchTheReferenceAndRepeat) {
  for (DType dt : {kF32, kBF16}) {
    const ProblemSpec spec = Spec(300, 520, dt, dt, {256, 300, 0, 129}, 4, 29);
    Problem p1(spec), p16(spec), q16(spec);
    auto ex1 = MakeExecutor(p1, 1);
    auto ex16 = MakeExecutor(p16, 16);
    auto fx16 = MakeExecutor(q16, 16);
    ASSERT_EQ(ex16->num_threads(), 16);
    StepOutputs o1 = RunSteps(p1, ex1.get()), o16 = RunSteps(p16, ex16.get()),
                r16 = RunSteps(q16, fx16.get());
    ExpectSameBytes(p16, o16, q16, r16, DTypeName(dt));
    for (auto [p, o] : {std::make_pair(&p1, &o1), std::make_pair(&p16, &o16)}) {
      EXPECT_LT(ForwardError(*p, o->y), Tolerance(dt));
      const GradErrors e = BackwardErrors(*p, o->dx, 1.0);
      EXPECT_LT(e.dx, Tolerance(dt));
      EXPECT_LT(e.dwg, Tolerance(dt));
      EXPECT_LT(e.dwu, Tolerance(dt));
      EXPECT_LT(e.dwd, Tolerance(dt));
    }
  }
}

// TileLimits: the default tiles while they give kTilesPerThread tiles per thread (counting at least
// two threads, so 1 and 2 threads cut the same tiles); finer (rows first, then columns, never
// below the minimums) otherwise.
TEST(Executor, TileLimitsFollowTheThreads) {
  auto tiles = [](const std::vector<int64_t>& rows, int64_t width, std::pair<int64_t, int64_t> l) {
    const int64_t t = cpu::ColTile(width, l.second);
    int64_t n = 0;
    for (int64_t r : rows) n += (r + cpu::RowBlock(r, l.first) - 1) / cpu::RowBlock(r, l.first);
    return n * ((width + t - 1) / t);
  };
  const std::vector<int64_t> eight(8, 256);
  EXPECT_EQ(cpu::TileLimits(eight, 512, 1), std::make_pair(cpu::kRowBlock, cpu::kColTile));
  EXPECT_EQ(cpu::TileLimits(eight, 512, 2), std::make_pair(cpu::kRowBlock, cpu::kColTile));
  EXPECT_EQ(cpu::TileLimits({300, 40}, 512, 1), cpu::TileLimits({300, 40}, 512, 2));
  const auto l16 = cpu::TileLimits(eight, 512, 16);
  EXPECT_EQ(l16, std::make_pair(cpu::kMinRowBlock, int64_t{256}));
  EXPECT_GE(tiles(eight, 512, l16), cpu::kTilesPerThread * 16);
  EXPECT_LT(tiles(eight, 512, std::make_pair(cpu::kMinRowBlock, int64_t{512})),
            cpu::kTilesPerThread * 16);
  // One tiny group: cut to the minimums and no further.
  const auto tiny = cpu::TileLimits({3}, 100, 64);
  EXPECT_EQ(tiny.first, cpu::kMinRowBlock);
  EXPECT_EQ(cpu::ColTile(100, tiny.second), 100);
  // Many rows: untouched.
  EXPECT_EQ(cpu::TileLimits(std::vector<int64_t>(64, 4096), 2048, 16),
            std::make_pair(cpu::kRowBlock, cpu::kColTile));
}

// The vectorized SwiGLU passes against fp64 (silu, its derivative), tails of every length.
TEST(Activation, SwiGluMatchesFp64) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> wide(-95.0f, 95.0f), narrow(-6.0f, 6.0f);
  for (int64_t n : {1, 3, 4, 5, 8, 13, 1000}) {
    std::vector<float> a(n), b(n), g(n), h(n), h2(n), da(n), db(n);
    for (int64_t i = 0; i < n; ++i) {
      a[i] = i % 3 == 0 ? wide(rng) : narrow(rng);
      b[i] = narrow(rng);
      g[i] = narrow(rng);
    }
    cpu::SwiGluForward(a.data(), b.data(), h.data(), n);
    cpu::SwiGluBackward(a.data(), b.data(), g.data(), h2.data(), da.data(), db.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const double av = a[i], s = 1.0 / (1.0 + std::exp(-av)), silu = av * s;
      const double want_h = silu * b[i];
      const double want_da = g[i] * b[i] * (s + silu * (1.0 - s)), want_db = g[i] * silu;
      // a few ulp relative, plus an absolute floor far below anything a GEMM output resolves
      auto close = [](double got, double want) {
        return std::abs(got - want) <= 1e-6 * std::abs(want) + 1e-30;
      };
      EXPECT_TRUE(close(h[i], want_h)) << a[i] << " " << h[i] << " vs " << want_h;
      EXPECT_EQ(h[i], h2[i]);
      // da's factor s + silu (1 - s) cancels near a = -1.28 (where silu' = 0) in any fp32
      // evaluation: bound its error by the size of the terms instead.
      const double da_scale = std::abs(g[i] * b[i]) * (s + std::abs(silu) * (1.0 - s));
      EXPECT_LE(std::abs(da[i] - want_da), 1e-6 * da_scale + 1e-30)
          << a[i] << " " << da[i] << " vs " << want_da;
      EXPECT_TRUE(close(db[i], want_db)) << a[i] << " " << db[i] << " vs " << want_db;
    }
  }
  EXPECT_TRUE(std::isnan(cpu::FastSigmoid(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(cpu::FastSigmoid(200.0f), 1.0f);
  EXPECT_LT(cpu::FastSigmoid(-200.0f), 1e-38f);
}

// Keeping the pre-activations gives the same backward as recomputing them.
TEST(Executor, KeptPreactivationsMatchRecompute) {
  for (DType dt : {kF32, kBF16}) {
    const ProblemSpec spec = Spec(21, 14, dt, DType::kFloat32, {33, 0, 290, 2}, 4, 31, 1);
    Problem keep(spec), redo(spec);
    auto ex = MakeExecutor(keep, 2);
    Buffer y(keep.view.total_rows, spec.hidden, dt), y2(keep.view.total_rows, spec.hidden, dt);
    Buffer pre(keep.view.total_rows, 2 * spec.intermediate, DType::kFloat32);
    ForwardOptions fo;
    fo.preactivations = pre.view();
    ASSERT_TRUE(ex->Forward(keep.view, keep.x.view(), y.view(), fo).ok());
    ASSERT_TRUE(ex->Forward(redo.view, redo.x.view(), y2.view(), {}).ok());
    EXPECT_TRUE(SameBytes(y, y2));
    Buffer dx(keep.view.total_rows, spec.hidden, dt), dx2(keep.view.total_rows, spec.hidden, dt);
    BackwardOptions bo;
    bo.preactivations = pre.view();
    ASSERT_TRUE(ex->Backward(keep.view, keep.x.view(), keep.dy.view(), dx.view(), bo).ok());
    ASSERT_TRUE(ex->Backward(redo.view, redo.x.view(), redo.dy.view(), dx2.view(), {}).ok());
    EXPECT_TRUE(SameBytes(dx, dx2));
    for (size_t k = 0; k < keep.grads.size(); ++k) EXPECT_TRUE(SameBytes(keep.grads[k], redo.grads[k]));
    GradErrors e = BackwardErrors(keep, dx, 1.0);
    EXPECT_LT(e.dx, Tolerance(dt));
    EXPECT_LT(e.dwd, Tolerance(dt));
  }
}

// Gate and up weights AND gradients as the halves of fused [H, 2I] tensors give the same results
// as separate tensors: forward, dx and accumulated gradients, against the fp64 reference and
// against the separate layout. Also with 1 and 2 threads bitwise.
TEST(Executor, FusedGateUpGradientsMatchSeparate) {
  struct FusedCase {
    DType dtype, grad_dtype;
  };
  for (const FusedCase fc : {FusedCase{kF32, kF32}, FusedCase{kBF16, kF32}, FusedCase{kBF16, kBF16}}) {
    const ProblemSpec spec = Spec(300, 260, fc.dtype, fc.grad_dtype, {37, 0, 290, 3}, 4, 51, 1);
    const int64_t H = spec.hidden, I = spec.intermediate;
    Problem sep(spec), fus(spec);
    const size_t G = fus.view.groups.size();
    std::vector<Buffer> fw, fg;  // per group: [H, 2I] gate|up weights, gradients
    for (size_t g = 0; g < G; ++g) {
      fw.emplace_back(H, 2 * I, fc.dtype);
      fg.emplace_back(H, 2 * I, fc.grad_dtype);
      fg.back().Fill(0.0f);
      for (int64_t r = 0; r < H; ++r)
        for (int64_t c = 0; c < 2 * I; ++c) fw.back().Set(r, c, fus.weights[3 * g + c / I].Get(r, c % I));
      ExpertParams& w = fus.view.groups[g].weights;
      ExpertParams& gr = fus.view.groups[g].grads;
      w.gate = fw.back().view();
      w.gate.shape[1] = I;
      w.up = w.gate;
      w.up.data = static_cast<char*>(w.gate.data) + I * DTypeSize(fc.dtype);
      gr.gate = fg.back().view();
      gr.gate.shape[1] = I;
      gr.up = gr.gate;
      gr.up.data = static_cast<char*>(gr.gate.data) + I * DTypeSize(fc.grad_dtype);
    }
    ASSERT_TRUE(CheckComputeView(fus.view, /*need_grads=*/true).ok());
    auto ex = MakeExecutor(sep, 2);
    Buffer ys(sep.view.total_rows, H, fc.dtype), yf(sep.view.total_rows, H, fc.dtype);
    Buffer dxs(sep.view.total_rows, H, fc.dtype), dxf(sep.view.total_rows, H, fc.dtype);
    for (int rep = 0; rep < 2; ++rep) {  // the second backward accumulates
      ASSERT_TRUE(ex->Forward(sep.view, sep.x.view(), ys.view(), {}).ok());
      ASSERT_TRUE(ex->Forward(fus.view, fus.x.view(), yf.view(), {}).ok());
      ASSERT_TRUE(ex->Backward(sep.view, sep.x.view(), sep.dy.view(), dxs.view(), {}).ok());
      absl::Status st = ex->Backward(fus.view, fus.x.view(), fus.dy.view(), dxf.view(), {});
      ASSERT_TRUE(st.ok()) << st;
    }
    {  // the fused path is thread-count invariant too
      Problem one(spec);
      for (size_t g = 0; g < G; ++g) {
        one.view.groups[g].weights = fus.view.groups[g].weights;  // read-only, shared
      }
      auto ex1 = MakeExecutor(one, 1);
      Buffer y1(one.view.total_rows, H, fc.dtype);
      ASSERT_TRUE(ex1->Forward(one.view, one.x.view(), y1.view(), {}).ok());
      EXPECT_TRUE(SameBytes(y1, yf));
    }
    // Unfuse into fus.grads so the reference comparison reads them.
    for (size_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < H; ++r)
        for (int64_t c = 0; c < 2 * I; ++c) fus.grads[3 * g + c / I].Set(r, c % I, fg[g].Get(r, c));
    const double tol = Tolerance(fc.dtype);
    const double gtol = Tolerance(fc.grad_dtype == kF32 && fc.dtype == kF32 ? kF32 : kBF16);
    EXPECT_LT(ForwardError(fus, yf), tol);
    const GradErrors e = BackwardErrors(fus, dxf, 2.0);
    EXPECT_LT(e.dx, tol);
    EXPECT_LT(e.dwg, gtol);
    EXPECT_LT(e.dwu, gtol);
    EXPECT_LT(e.dwd, gtol);
    // Fused weights run x [Wg | Wu] as one GEMM of 2I columns, whose rounding OpenBLAS does not
    // promise to equal two GEMMs of I columns: the layouts agree to the fp32 (bf16) tolerance.
    auto diff = [](Buffer& got, Buffer& want) {
      ErrorMeter m;
      for (int64_t r = 0; r < want.rows(); ++r)
        for (int64_t c = 0; c < want.cols(); ++c) m.Add(got.Get(r, c), want.Get(r, c));
      return m.rel();
    };
    EXPECT_LT(diff(yf, ys), tol);
    EXPECT_LT(diff(dxf, dxs), tol);
    for (size_t k = 0; k < sep.grads.size(); ++k) EXPECT_LT(diff(fus.grads[k], sep.grads[k]), gtol) << k;
    std::printf("[ EXECUTOR ] fused %s/%s grads: fwd %.1e dx %.1e dWg %.1e dWu %.1e dWd %.1e\n",
                DTypeName(fc.dtype), DTypeName(fc.grad_dtype), ForwardError(fus, yf), e.dx, e.dwg,
                e.dwu, e.dwd);
  }
}

// Empty groups are legal with no tensors at all, and an all-empty view only zeroes the outputs.
TEST(Executor, EmptyGroupsNeedNoTensors) {
  Problem p(Spec(12, 10, kF32, kF32, {0, 6, 0}, 4, 41));
  for (int g : {0, 2}) {
    p.view.groups[g].weights = ExpertParams{};
    p.view.groups[g].grads = ExpertParams{};
  }
  auto ex = MakeExecutor(p, 2);
  Buffer y(p.view.total_rows, 12, kF32), dx(p.view.total_rows, 12, kF32);
  ASSERT_TRUE(ex->Forward(p.view, p.x.view(), y.view(), {}).ok());
  EXPECT_LT(ForwardError(p, y), 1e-5);
  ASSERT_TRUE(ex->Backward(p.view, p.x.view(), p.dy.view(), dx.view(), {}).ok());

  Problem none(Spec(12, 10, kF32, kF32, {0, 0}, 4, 42, 2));
  Buffer y0(none.view.total_rows, 12, kF32);
  y0.Fill(3.0f);
  ASSERT_TRUE(ex->Forward(none.view, none.x.view(), y0.view(), {}).ok());
  for (int64_t r = 0; r < none.view.total_rows; ++r) EXPECT_EQ(y0.Get(r, 0), 0.0f);
}

// Row blocks and column tiles: equal parts of at most kRowBlock / kColTile, rounded up to 16,
// covering every row and column.
TEST(Executor, TileSplits) {
  for (int64_t n : {1, 7, 255, 256, 257, 300, 511, 512, 513, 879, 1498, 4793}) {
    const int64_t b = cpu::RowBlock(n);
    EXPECT_LE(b, cpu::kRowBlock) << n;
    EXPECT_TRUE(b == n || b % 16 == 0) << n;
    EXPECT_EQ((n + b - 1) / b, (n + cpu::kRowBlock - 1) / cpu::kRowBlock) << n;
  }
  EXPECT_EQ(cpu::RowBlock(879), 224);  // 224, 224, 224, 207 rather than 256, 256, 256, 111
  for (int64_t w : {5, 512, 1024, 1025, 2048, 3000, 4096}) {
    const int64_t t = cpu::ColTile(w);
    EXPECT_LE(t, cpu::kColTile) << w;
    EXPECT_EQ((w + t - 1) / t, (w + cpu::kColTile - 1) / cpu::kColTile) << w;
  }
}

TEST(Executor, WorkspaceFollowsTheFormula) {
  struct Shape {
    size_t H, I;
  };
  // I < H, and 2I > max(H, I) (the fused gate|up panel is the widest bf16 panel).
  for (const Shape sh : {Shape{1000, 300}, Shape{300, 700}, Shape{2000, 1500}}) {
    for (DType dt : {kF32, kBF16}) {
      ExecutorConfig c;
      c.hidden = static_cast<int64_t>(sh.H);
      c.intermediate = static_cast<int64_t>(sh.I);
      c.dtype = dt;
      c.max_rows = 5000;
      c.num_threads = 3;
      auto ex = cpu::CpuExecutor::Create(c);
      ASSERT_TRUE(ex.ok());
      const size_t rb = 256, H = sh.H, I = sh.I, M = std::max(H, I), tw = std::min<size_t>(256, M);
      const size_t T = 3, tc = std::min<size_t>(cpu::kColTile, M);
      const size_t widest = std::max(M, I <= static_cast<size_t>(cpu::kColTile) ? 2 * I : 0);
      size_t per_thread = 3 * rb * tc;
      if (dt == kBF16) per_thread += 2 * rb * H + cpu::kPanelK * (tw + widest) + tw * M;
      per_thread = (per_thread + 15) / 16 * 16;
      EXPECT_EQ((*ex)->WorkspaceBytes(), 4 * (T * per_thread + 3 * 5000 * I)) << H << "x" << I;
    }
  }
}


}  // namespace
}  // namespace moonep::compute

extern "C" {
int openblas_get_num_threads(void) __attribute__((weak));
void openblas_set_num_threads(int) __attribute__((weak));
}

namespace moonep::compute {
namespace {

// OpenBLAS's thread count is process-global and distinct executors may run at once: a guard that
// leaves while another is still inside a call must not restore the count under it (the first
// guard's exit once set it back to N mid-call of the second); the last one out restores it.
TEST(ScopedSingleThreadedBlas, OverlappingGuardsRestoreWhenTheLastLeaves) {
  if (openblas_get_num_threads == nullptr || openblas_set_num_threads == nullptr) {
    GTEST_SKIP() << "the BLAS is not OpenBLAS";
  }
  const int before = openblas_get_num_threads();
  openblas_set_num_threads(2);
  if (openblas_get_num_threads() != 2) {
    openblas_set_num_threads(before);
    GTEST_SKIP() << "this OpenBLAS cannot run 2 threads";
  }
  auto a = std::make_unique<cpu::ScopedSingleThreadedBlas>();
  EXPECT_EQ(openblas_get_num_threads(), 1);
  auto b = std::make_unique<cpu::ScopedSingleThreadedBlas>();
  EXPECT_EQ(openblas_get_num_threads(), 1);
  a.reset();  // the first guard leaves while the second is still in its call
  EXPECT_EQ(openblas_get_num_threads(), 1);
  auto c = std::make_unique<cpu::ScopedSingleThreadedBlas>();
  b.reset();
  EXPECT_EQ(openblas_get_num_threads(), 1);
  c.reset();
  EXPECT_EQ(openblas_get_num_threads(), 2);  // restored by the last one out
  // Guards from many threads at once, each around a GEMM: the count ends restored.
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([] {
      float x[4] = {1, 2, 3, 4}, y[4] = {0, 0, 0, 0};
      for (int i = 0; i < 200; ++i) {
        cpu::ScopedSingleThreadedBlas guard;
        cpu::Gemm(2, 2, 2, cpu::Operand{x, DType::kFloat32, 2, false},
                  cpu::Operand{x, DType::kFloat32, 2, false}, 0.0f, y, 2, nullptr);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(openblas_get_num_threads(), 2);
  openblas_set_num_threads(before);
}

}  // namespace
}  // namespace moonep::compute
