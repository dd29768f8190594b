// The CUDA executor against the fp64 reference layer, like tests/compute's CPU executor test:
// forward per row = reference ExpertForward of the row's group; backward dx and weight gradients =
// reference Backward with every row routed (top-1, weight 1) to its group's expert. Every output
// is poisoned (NaN) before each run and every element is checked: data rows against the
// reference, every other row exactly zero. Each case runs with both GEMM strategies and with the
// gate/up weights separate and fused into one [H, 2I] tensor.
#include "moonep/compute/cuda/cuda_executor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <tuple>

#include "moonep/reference/reference_moe.h"
#include "tests/cuda/cuda_test_util.h"

namespace moonep::compute {
namespace {

using cuda::CudaExecutor;
using cuda::GemmStrategy;
using testing::Buffer;
using testing::DeviceBuffer;
using testing::DeviceProblem;
using testing::ErrorMeter;
using testing::Problem;
using testing::ProblemSpec;

constexpr DType kF32 = DType::kFloat32;
constexpr DType kBF16 = DType::kBFloat16;

double Tolerance(DType dtype) { return dtype == kF32 ? 1e-5 : 1e-2; }

std::unique_ptr<CudaExecutor> MakeExecutor(const Problem& p, GemmStrategy strategy, int64_t max_rows = -1) {
  ExecutorConfig config;
  config.hidden = p.spec.hidden;
  config.intermediate = p.spec.intermediate;
  config.dtype = p.spec.dtype;
  config.max_rows = max_rows >= 0 ? max_rows : p.view.total_rows;
  auto ex = CudaExecutor::Create(config);
  EXPECT_TRUE(ex.ok()) << ex.status();
  if (!ex.ok()) return nullptr;
  (*ex)->set_gemm_strategy(strategy);
  return std::move(ex).value();
}

std::vector<bool> DataRowMask(const Problem& p) {
  std::vector<bool> is_data(p.view.total_rows, false);
  for (int64_t r : p.data_rows) is_data[r] = true;
  return is_data;
}

// Counts elements of non-data rows that are not exactly zero.
int64_t NonZeroPadding(const Problem& p, Buffer& out) {
  const std::vector<bool> is_data = DataRowMask(p);
  int64_t bad = 0;
  for (int64_t r = 0; r < p.view.total_rows; ++r) {
    if (is_data[r]) continue;
    for (int64_t h = 0; h < out.cols(); ++h) bad += out.Get(r, h) != 0.0f;  // NaN counts too
  }
  return bad;
}

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
  EXPECT_EQ(NonZeroPadding(p, y), 0) << "y: non-data rows must be zero";
  return err.rel();
}

struct GradErrors {
  double dx = 0, dwg = 0, dwu = 0, dwd = 0;
};

// Errors of dx (in `dx`) and of the host gradients (p.grads) against `factor` x the reference.
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
  EXPECT_EQ(NonZeroPadding(p, dx), 0) << "dx: non-data rows must be zero";
  return GradErrors{mdx.rel(), mg.rel(), mu.rel(), md.rel()};
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

// A random shape: H, I in [1, 200] (often multiples of 8, for the vector paths), 1..10 groups,
// about a third of them empty, the others 1..300 rows.
ProblemSpec RandomSpec(uint64_t seed, DType dtype, DType grad_dtype) {
  std::mt19937_64 rng(seed * 7919 + 17);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  int64_t H = uni(1, 200), I = uni(1, 200);
  if (uni(0, 1) == 1) {
    H = (H + 7) / 8 * 8;
    I = (I + 7) / 8 * 8;
  }
  std::vector<int64_t> counts(static_cast<size_t>(uni(1, 10)));
  for (int64_t& c : counts) c = uni(0, 2) == 0 ? 0 : uni(1, 300);
  return Spec(H, I, dtype, grad_dtype, counts, uni(1, 16), seed, uni(0, 3));
}

struct Case {
  std::string name;
  ProblemSpec spec;
};

std::vector<Case> Cases() {
  std::vector<Case> cases = {
      {"fp32_skewed_H13_I7", Spec(13, 7, kF32, kF32, {5, 0, 17, 1, 300, 0}, 4, 1, 3)},
      {"fp32_one_group_all_rows", Spec(40, 24, kF32, kF32, {0, 0, 513, 0}, 8, 2)},
      {"fp32_single_row", Spec(9, 11, kF32, kF32, {1}, 1, 3)},
      {"fp32_zero_rows_everywhere_but_one", Spec(64, 32, kF32, kF32, {0, 0, 0, 1, 0, 0}, 16, 4, 5)},
      {"fp32_H256_I128", Spec(256, 128, kF32, kF32, {37, 3, 0, 200}, 8, 5)},
      {"bf16_skewed_H13_I7", Spec(13, 7, kBF16, kF32, {5, 0, 17, 1, 300, 0}, 4, 6, 2)},
      {"bf16_one_group_all_rows", Spec(64, 48, kBF16, kF32, {0, 700, 0}, 8, 7)},
      {"bf16_H256_I128", Spec(256, 128, kBF16, kF32, {37, 3, 0, 200}, 8, 9)},
      // every GEMM but dh (n = I) and the weight gradients fits the persistent kernel
      {"bf16_H512_I256", Spec(512, 256, kBF16, kF32, {300, 0, 1, 129, 77}, 8, 12)},
      {"bf16_bf16grads_H96_I64", Spec(96, 64, kBF16, kBF16, {29, 0, 6, 90}, 2, 10)},
      {"bf16_bf16grads_H31_I17", Spec(31, 17, kBF16, kBF16, {70, 2, 0, 1}, 4, 11)},
  };
  for (uint64_t s = 0; s < 6; ++s) {
    cases.push_back({"fp32_random" + std::to_string(s), RandomSpec(100 + s, kF32, kF32)});
    cases.push_back({"bf16_random" + std::to_string(s), RandomSpec(200 + s, kBF16, s % 2 ? kBF16 : kF32)});
  }
  return cases;
}

using Param = std::tuple<Case, GemmStrategy, bool>;

class CudaExecutorVsReference : public ::testing::TestWithParam<Param> {};

TEST_P(CudaExecutorVsReference, ForwardAndBackward) {
  MOONEP_SKIP_WITHOUT_GPU();
  const auto& [c, strategy, fused] = GetParam();
  Problem p(c.spec);
  DeviceProblem d(p, fused);
  auto ex = MakeExecutor(p, strategy);
  ASSERT_NE(ex, nullptr);
  const int64_t R = p.view.total_rows, H = p.spec.hidden, I = p.spec.intermediate;
  const DType dt = p.spec.dtype;
  const double tol = Tolerance(dt);
  // bf16 gradients are rounded at every accumulation, so they get the bf16 bar.
  const double gtol = Tolerance(p.spec.grad_dtype == kF32 && dt == kF32 ? kF32 : kBF16);

  DeviceBuffer y(static_cast<size_t>(R * H) * DTypeSize(dt));
  Buffer y_host(R, H, dt);
  y.Poison();
  absl::Status st = ex->Forward(d.view, d.x.View(R, H, dt), y.View(R, H, dt), ForwardOptions{});
  ASSERT_TRUE(st.ok()) << st;
  y.Download(y_host.data());
  const double fwd = ForwardError(p, y_host);
  EXPECT_LT(fwd, tol);

  DeviceBuffer dx(static_cast<size_t>(R * H) * DTypeSize(dt));
  Buffer dx_host(R, H, dt);
  dx.Poison();
  st = ex->Backward(d.view, d.x.View(R, H, dt), d.dy.View(R, H, dt), dx.View(R, H, dt), BackwardOptions{});
  ASSERT_TRUE(st.ok()) << st;
  dx.Download(dx_host.data());
  d.DownloadGrads(p);
  const GradErrors e1 = BackwardErrors(p, dx_host, 1.0);
  EXPECT_LT(e1.dx, tol);
  EXPECT_LT(e1.dwg, gtol);
  EXPECT_LT(e1.dwu, gtol);
  EXPECT_LT(e1.dwd, gtol);

  // Kept pre-activations, poisoned first (padding rows of it are not written and never read);
  // the second backward accumulates, so the gradients become twice the reference.
  DeviceBuffer pre(static_cast<size_t>(R * 2 * I) * sizeof(float));
  pre.Poison();
  ForwardOptions fo;
  fo.preactivations = pre.View(R, 2 * I, kF32);
  y.Poison();
  ASSERT_TRUE(ex->Forward(d.view, d.x.View(R, H, dt), y.View(R, H, dt), fo).ok());
  y.Download(y_host.data());
  const double fwd_kept = ForwardError(p, y_host);
  EXPECT_LT(fwd_kept, tol);
  BackwardOptions bo;
  bo.preactivations = fo.preactivations;
  dx.Poison();
  st = ex->Backward(d.view, d.x.View(R, H, dt), d.dy.View(R, H, dt), dx.View(R, H, dt), bo);
  ASSERT_TRUE(st.ok()) << st;
  dx.Download(dx_host.data());
  d.DownloadGrads(p);
  const GradErrors e2 = BackwardErrors(p, dx_host, 2.0);
  EXPECT_LT(e2.dx, tol);
  EXPECT_LT(e2.dwg, gtol);
  EXPECT_LT(e2.dwu, gtol);
  EXPECT_LT(e2.dwd, gtol);
  std::printf("[ CUDA EXEC ] %-34s %-7s %-5s fwd %.1e dx %.1e dWg %.1e dWu %.1e dWd %.1e | kept: fwd %.1e dx %.1e 2x: %.1e %.1e %.1e\n",
              c.name.c_str(), cuda::GemmStrategyName(strategy), fused ? "fused" : "split", fwd, e1.dx,
              e1.dwg, e1.dwu, e1.dwd, fwd_kept, e2.dx, e2.dwg, e2.dwu, e2.dwd);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaExecutorVsReference,
    ::testing::Combine(::testing::ValuesIn(Cases()),
                       ::testing::Values(GemmStrategy::kGrouped, GemmStrategy::kStreams, GemmStrategy::kChunked,
                                         GemmStrategy::kPersistent),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<Param>& info) {
      return std::get<0>(info.param).name + "_" + cuda::GemmStrategyName(std::get<1>(info.param)) +
             (std::get<2>(info.param) ? "_fused" : "_split");
    });

// Empty groups need no tensors; an all-empty view only zeroes the outputs.
TEST(CudaExecutor, EmptyGroupsNeedNoTensors) {
  MOONEP_SKIP_WITHOUT_GPU();
  Problem p(Spec(12, 10, kF32, kF32, {0, 6, 0}, 4, 41));
  DeviceProblem d(p, false);
  for (int g : {0, 2}) {
    d.view.groups[g].weights = ExpertParams{};
    d.view.groups[g].grads = ExpertParams{};
  }
  auto ex = MakeExecutor(p, GemmStrategy::kAuto);
  ASSERT_NE(ex, nullptr);
  const int64_t R = p.view.total_rows;
  DeviceBuffer y(R * 12 * 4), dx(R * 12 * 4);
  Buffer yh(R, 12, kF32);
  y.Poison();
  ASSERT_TRUE(ex->Forward(d.view, d.x.View(R, 12, kF32), y.View(R, 12, kF32), {}).ok());
  y.Download(yh.data());
  EXPECT_LT(ForwardError(p, yh), 1e-5);
  ASSERT_TRUE(ex->Backward(d.view, d.x.View(R, 12, kF32), d.dy.View(R, 12, kF32), dx.View(R, 12, kF32), {}).ok());

  Problem none(Spec(12, 10, kF32, kF32, {0, 0}, 4, 42, 2));
  DeviceProblem dn(none, false);
  const int64_t R0 = none.view.total_rows;
  DeviceBuffer y0(R0 * 12 * 4);
  Buffer y0h(R0, 12, kF32);
  y0.Poison();
  ASSERT_TRUE(ex->Forward(dn.view, dn.x.View(R0, 12, kF32), y0.View(R0, 12, kF32), {}).ok());
  y0.Download(y0h.data());
  EXPECT_EQ(NonZeroPadding(none, y0h), 0);
}

// The auto strategy: near-uniform or small groups run row-chunked, skewed large groups per group
// over streams, tiny groups grouped; the weight-gradient batches (rows are the reduction) never
// chunk.
TEST(CudaExecutor, AutoStrategyFollowsGroupSizes) {
  MOONEP_SKIP_WITHOUT_GPU();
  const int64_t big = param::CudaGemmStreamsMinRows();
  struct AutoCase {
    std::vector<int64_t> counts;
    GemmStrategy down;  // what the down-projection batch (bf16 -> bf16) runs as
  };
  const std::vector<AutoCase> cases = {
      {{1, 2, 3, 0}, GemmStrategy::kGrouped},
      {{big, big + 1, big}, GemmStrategy::kChunked},
      {{130, 0, 7, 60}, GemmStrategy::kChunked},
      // mean >= big, but 512-row chunks would leave over a third of the rows in remainders
      {{2 * big + 300, big / 2 + 200, big + 400, 3 * big / 2}, GemmStrategy::kStreams}};
  for (const AutoCase& c : cases) {
    Problem p(Spec(16, 8, kBF16, kF32, c.counts, 1, 51));
    DeviceProblem d(p, false);
    auto ex = MakeExecutor(p, GemmStrategy::kAuto);
    ASSERT_NE(ex, nullptr);
    const int64_t R = p.view.total_rows;
    DeviceBuffer y(R * 16 * 2), dx(R * 16 * 2);
    ASSERT_TRUE(ex->Forward(d.view, d.x.View(R, 16, kBF16), y.View(R, 16, kBF16), {}).ok());
    ASSERT_EQ(ex->last_strategies().size(), 2u);
    EXPECT_EQ(ex->last_strategies()[1], c.down) << cuda::GemmStrategyName(ex->last_strategies()[1]);
    ASSERT_TRUE(ex->Backward(d.view, d.x.View(R, 16, kBF16), d.dy.View(R, 16, kBF16), dx.View(R, 16, kBF16), {}).ok());
    // a|b, dh, dx = da Wg^T, dx += db Wu^T, then the fp32 weight gradients (never chunked)
    ASSERT_EQ(ex->last_strategies().size(), 5u);
    EXPECT_NE(ex->last_strategies()[4], GemmStrategy::kChunked);
  }
}

// On Hopper, auto runs skewed bf16 batches the persistent kernel takes (here the down projection,
// n = H = 256, k = I = 128) on it; elsewhere never.
TEST(CudaExecutor, AutoPicksThePersistentKernelForSkewedViews) {
  MOONEP_SKIP_WITHOUT_GPU();
  const bool hopper = cuda::PersistentGemm::Create().ok();
  Problem p(Spec(256, 128, kBF16, kF32, {300, 7, 0, 90}, 8, 52));
  DeviceProblem d(p, false);
  auto ex = MakeExecutor(p, GemmStrategy::kAuto);
  ASSERT_NE(ex, nullptr);
  const int64_t R = p.view.total_rows;
  DeviceBuffer y(R * 256 * 2);
  ASSERT_TRUE(ex->Forward(d.view, d.x.View(R, 256, kBF16), y.View(R, 256, kBF16), {}).ok());
  ASSERT_EQ(ex->last_strategies().size(), 2u);
  EXPECT_EQ(ex->last_strategies()[1] == GemmStrategy::kPersistent, hopper)
      << cuda::GemmStrategyName(ex->last_strategies()[1]);
}

// After the first call, calls allocate no device memory (one workspace, reused).
TEST(CudaExecutor, CallsAllocateNothing) {
  MOONEP_SKIP_WITHOUT_GPU();
  Problem p(Spec(64, 32, kBF16, kF32, {100, 0, 7, 300}, 8, 61));
  DeviceProblem d(p, false);
  const int64_t R = p.view.total_rows;
  DeviceBuffer y(R * 64 * 2), dx(R * 64 * 2);
  for (GemmStrategy s : {GemmStrategy::kGrouped, GemmStrategy::kStreams, GemmStrategy::kChunked,
                         GemmStrategy::kPersistent}) {
    auto ex = MakeExecutor(p, s);
    ASSERT_NE(ex, nullptr);
    auto step = [&] {
      ASSERT_TRUE(ex->Forward(d.view, d.x.View(R, 64, kBF16), y.View(R, 64, kBF16), {}).ok());
      ASSERT_TRUE(ex->Backward(d.view, d.x.View(R, 64, kBF16), d.dy.View(R, 64, kBF16), dx.View(R, 64, kBF16), {}).ok());
    };
    step();
    size_t free0 = 0, free1 = 0, total = 0;
    MOONEP_CUDA_OK(cudaMemGetInfo(&free0, &total));
    for (int i = 0; i < 3; ++i) step();
    MOONEP_CUDA_OK(cudaMemGetInfo(&free1, &total));
    EXPECT_EQ(free0, free1) << cuda::GemmStrategyName(s);
  }
}

TEST(CudaExecutor, WorkspaceFollowsTheFormula) {
  MOONEP_SKIP_WITHOUT_GPU();
  for (DType dt : {kF32, kBF16}) {
    ExecutorConfig c;
    c.hidden = 1000;
    c.intermediate = 300;
    c.dtype = dt;
    c.max_rows = 5000;
    cuda::CudaExecutorOptions o;
    o.num_streams = 3;
    auto ex = CudaExecutor::Create(c, o);
    ASSERT_TRUE(ex.ok()) << ex.status();
    auto r = [](size_t v) { return (v + 255) / 256 * 256; };
    const size_t R = 5000, I = 300, e = DTypeSize(dt);
    const size_t want = r(4 * R * 2 * I) + r(4 * R * I) + r(e * R * I) + r(e * R * 2 * I) + 3 * (size_t{32} << 20);
    EXPECT_EQ(cuda::CudaDeviceWorkspaceBytes(c, 3), want);
    EXPECT_GT((*ex)->WorkspaceBytes(), want);
  }
}

// Host memory tagged as device memory, and a view on the wrong device, are refused by name.
TEST(CudaExecutor, BadPointersAreRefusedByName) {
  MOONEP_SKIP_WITHOUT_GPU();
  Problem p(Spec(16, 8, kF32, kF32, {4, 3}, 1, 71));
  DeviceProblem d(p, false);
  auto ex = MakeExecutor(p, GemmStrategy::kAuto);
  ASSERT_NE(ex, nullptr);
  const int64_t R = p.view.total_rows;
  DeviceBuffer y(R * 16 * 4);
  std::vector<float> host_x(R * 16, 1.0f);
  TensorView x_host = TensorView::Contiguous(host_x.data(), kF32, {R, 16}, Device::kCuda);
  absl::Status st = ex->Forward(d.view, x_host, y.View(R, 16, kF32), {});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("x_rows"), std::string::npos) << st;

  ComputeView bad = d.view;
  bad.groups[1].weights.down.data = p.weights[5].data();  // host memory
  st = ex->Forward(bad, d.x.View(R, 16, kF32), y.View(R, 16, kF32), {});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("group 1: weights.down"), std::string::npos) << st;

  ComputeView cpu = d.view;
  cpu.device = Device::kCpu;
  st = ex->Forward(cpu, d.x.View(R, 16, kF32), y.View(R, 16, kF32), {});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;

  // Nothing above reached the device: a good call still works.
  ASSERT_TRUE(ex->Forward(d.view, d.x.View(R, 16, kF32), y.View(R, 16, kF32), {}).ok());
}

TEST(CudaExecutor, FactoryGivesTheCudaDevice) {
  MOONEP_SKIP_WITHOUT_GPU();
  ExecutorConfig c;
  c.hidden = 8;
  c.intermediate = 8;
  c.max_rows = 16;
  auto ex = cuda::MakeCudaExecutor(c);
  ASSERT_TRUE(ex.ok()) << ex.status();
  EXPECT_EQ((*ex)->device(), Device::kCuda);
  c.hidden = 0;
  EXPECT_EQ(cuda::MakeCudaExecutor(c).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moonep::compute
