// NCCL transport on device memory, one rank per GPU (NCCL refuses two ranks on one GPU). Every
// test skips visibly (GTEST_SKIP) when the node has fewer GPUs than ranks, e.g. in CI.
//
// The checks mirror the host-memory suite (tests/transport/transport_test.cc), with every buffer
// on the device: rows land where a brute-force placement says, combined outputs and the backward
// forms match fp64 sums, the layer forward and top-k weight gradient match the fp64 reference
// layer with replica slots filled by prefetch, prefetch is bitwise, reduce sums exactly, and a
// silent peer becomes a Timeout naming the phase.
#include "transport/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "moonep/core/dtype.h"
#include "moonep/core/status.h"
#include "moonep/reference/gradient_check.h"
#include "moonep/reference/reference_moe.h"
#include "planner/planner.h"
#include "tests/harness/bad_env_verdict.h"
#include "tests/harness/mpi_test.h"
#include "tests/transport/plan_kinds.h"
#include "tests/transport/transport_test_util.h"
#include "transport/testing_hooks.h"
#include "transport/transport.h"

namespace moonep::transport {
namespace {

using test::BruteForcePlacement;
using test::ExpertOfRow;
using test::MakeProblem;
using test::Problem;

// A device array that frees itself; copies are blocking (tests only).
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p_ = nullptr;
  }
  explicit DeviceVector(const std::vector<T>& v) : DeviceVector(v.size()) { Upload(v); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  ~DeviceVector() { cudaFree(p_); }
  void Upload(const std::vector<T>& v) {
    cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() const {
    std::vector<T> v(n_);
    cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  T* get() const { return p_; }
  absl::Span<T> span() const { return absl::Span<T>(p_, n_); }
  TensorView Matrix(int64_t rows, int64_t cols, DType dtype = DType::kFloat32) const {
    return TensorView::Contiguous(p_, dtype, {rows, cols}, Device::kCuda);
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// Ranks on this node (one GPU each).
int LocalRankAndSize(int* local_size) {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int r = 0;
  MPI_Comm_rank(node, &r);
  MPI_Comm_size(node, local_size);
  MPI_Comm_free(&node);
  return r;
}

class NcclTest : public moonep::testing::MpiTest {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) {
      cudaGetLastError();
      devices = 0;
    }
    int local_size = 1;
    const int local_rank = LocalRankAndSize(&local_size);
    if (devices < local_size) {
      GTEST_SKIP() << "the NCCL transport needs one GPU per rank: " << local_size
                   << " rank(s) on this node, " << devices << " GPU(s) visible";
    }
    ASSERT_EQ(cudaSetDevice(local_rank), cudaSuccess);
  }

  std::unique_ptr<Transport> MakeTransport(int64_t max_tokens, int32_t max_top_k,
                                           int64_t max_row_bytes, int64_t timeout_ms = 0) {
    TransportOptions o;
    o.max_tokens = std::max<int64_t>(1, max_tokens);
    o.max_top_k = max_top_k;
    o.max_row_bytes = max_row_bytes;
    o.timeout_ms = timeout_ms;
    auto t = CreateTransport("nccl", o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }
};

// One GPU has no peer: test-force-replicas then replicates the rank's own experts into its slots
// (home-rank replicas), so prefetch and reduce run with one rank too.
absl::Status PlanOfKind(const std::string& kind, const Problem& p, uint64_t seed,
                        planner::Plan* plan) {
  return test::MakePlanOfKind(kind, p, seed, plan, /*home_replicas=*/true);
}
using test::CapacityRows;
using test::Scale;

std::string ParamName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& ch : name) {
    if (ch == '-') ch = '_';
  }
  return name;
}

const std::vector<std::string> kPlanKinds = {"home", "random", "moonep", "test-force-replicas"};

// ---------------------------------------------------------------------------------------------
// Rows: dispatch -> scaled-identity experts (on the host) -> combine, then the backward forms.

class NcclRowsTest : public NcclTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(NcclRowsTest, ForwardAndBackwardMatchBruteForceAndFp64) {
  const int32_t R = size(), me = rank();
  const Problem p = MakeProblem(R, 2 * R, std::min(3, 2 * R), 8, 12, 31, R > 2 ? 1 : -1);
  planner::Plan plan;
  ASSERT_TRUE(PlanOfKind(GetParam(), p, 31, &plan).ok());
  const int32_t E = p.E, K = p.K;
  const int64_t H = p.H, T = p.T[me];
  const int64_t cap = CapacityRows(p, plan.num_groups(), plan.pad_multiple);
  auto t = MakeTransport(p.max_tokens(), K, H * 4);
  ASSERT_NE(t, nullptr);

  DeviceVector<int32_t> ids(p.ids[me]);
  DeviceVector<float> x(p.x[me]), weights(p.weights[me]), dy(p.dy[me]);
  DispatchHandle h;
  absl::Status st = t->ExchangeCounts(ids.span(), T, K, E, cap, &h);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(std::vector<int64_t>(h.counts().begin(), h.counts().end()), p.counts);

  DeviceVector<float> rows_d(std::vector<float>(cap * H, -1.0f)),
      row_w_d(std::vector<float>(cap, -1.0f));
  st = t->Dispatch(plan, x.Matrix(T, H), weights.span(), &h, rows_d.Matrix(cap, H), row_w_d.span());
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<float> rows = rows_d.Download(), row_w = row_w_d.Download();

  const auto truth = BruteForcePlacement(p, plan);
  std::vector<char> filled(cap, 0);
  int64_t remote_rows = 0, remote_unique = 0;
  for (int32_t s = 0; s < R; ++s) {
    for (int64_t tok = 0; tok < p.T[s]; ++tok) {
      std::vector<int32_t> dests;
      for (int32_t k = 0; k < K; ++k) {
        const auto& pl = truth[s][tok * K + k];
        if (pl.rank < 0) continue;
        if (s == me && pl.rank != me) {
          ++remote_rows;
          if (std::find(dests.begin(), dests.end(), pl.rank) == dests.end()) ++remote_unique;
          dests.push_back(pl.rank);
        }
        if (pl.rank != me) continue;
        filled[pl.row] = 1;
        ASSERT_EQ(0, std::memcmp(&rows[pl.row * H], &p.x[s][tok * H], H * 4))
            << "row " << pl.row << " should hold token " << tok << " of rank " << s;
        ASSERT_EQ(row_w[pl.row], p.weights[s][tok * K + k]);
      }
    }
  }
  for (int64_t r = 0; r < plan.rank_rows[me]; ++r) {
    if (filled[r]) continue;
    for (int64_t j = 0; j < H; ++j) ASSERT_EQ(rows[r * H + j], 0.0f) << "padding row " << r;
    ASSERT_EQ(row_w[r], 0.0f);
  }
  for (int64_t r = plan.rank_rows[me]; r < cap; ++r)
    ASSERT_EQ(row_w[r], -1.0f) << "beyond the layout";
  EXPECT_EQ(t->counters(OpKind::kDispatch).rows_sent, remote_unique);
  EXPECT_EQ(t->counters(OpKind::kDispatch).rows_deduplicated, remote_rows - remote_unique);

  std::vector<float> out(cap * H, 0.0f);
  for (int64_t r = 0; r < plan.rank_rows[me]; ++r) {
    const int32_t e = ExpertOfRow(plan, me, r);
    if (e < 0) continue;
    for (int64_t j = 0; j < H; ++j) out[r * H + j] = Scale(e) * rows[r * H + j];
  }
  DeviceVector<float> out_d(out), y_d(std::vector<float>(T * H, 99.0f));
  st = t->Combine(&h, out_d.Matrix(cap, H), y_d.Matrix(T, H));
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<float> y = y_d.Download();
  for (int64_t tok = 0; tok < T; ++tok) {
    for (int64_t j = 0; j < H; ++j) {
      double want = 0, mag = 0;
      for (int32_t k = 0; k < K; ++k) {
        const int32_t e = p.ids[me][tok * K + k];
        if (e < 0) continue;
        const double term =
            static_cast<double>(p.weights[me][tok * K + k]) * Scale(e) * p.x[me][tok * H + j];
        want += term;
        mag += std::fabs(term);
      }
      ASSERT_NEAR(y[tok * H + j], want, 1e-5 * mag + 1e-7) << "token " << tok;
    }
  }

  DeviceVector<float> dy_rows_d(std::vector<float>(cap * H, -3.0f));
  st = t->CombineBackward(&h, dy.Matrix(T, H), dy_rows_d.Matrix(cap, H));
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<float> dy_rows = dy_rows_d.Download();
  for (int32_t s = 0; s < R; ++s) {
    for (int64_t tok = 0; tok < p.T[s]; ++tok) {
      for (int32_t k = 0; k < K; ++k) {
        const auto& pl = truth[s][tok * K + k];
        if (pl.rank != me) continue;
        ASSERT_EQ(0, std::memcmp(&dy_rows[pl.row * H], &p.dy[s][tok * H], H * 4));
      }
    }
  }
  DeviceVector<float> dw_d(std::vector<float>(T * K, 7.0f));
  st = t->TopkWeightGrad(&h, dy_rows_d.Matrix(cap, H), out_d.Matrix(cap, H), dw_d.span());
  ASSERT_TRUE(st.ok()) << st;
  std::vector<float> dx_rows(cap * H, 0.0f);
  for (int64_t r = 0; r < plan.rank_rows[me]; ++r) {
    const int32_t e = ExpertOfRow(plan, me, r);
    if (e < 0) continue;
    for (int64_t j = 0; j < H; ++j) dx_rows[r * H + j] = Scale(e) * dy_rows[r * H + j];
  }
  DeviceVector<float> dx_rows_d(dx_rows), dx_d(std::vector<float>(T * H, 5.0f));
  st = t->DispatchBackward(&h, dx_rows_d.Matrix(cap, H), dx_d.Matrix(T, H));
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<float> dw = dw_d.Download(), dx = dx_d.Download();
  for (int64_t tok = 0; tok < T; ++tok) {
    double scale_sum = 0;
    for (int32_t k = 0; k < K; ++k) {
      const int32_t e = p.ids[me][tok * K + k];
      double dot = 0, mag = 0;
      if (e >= 0) {
        scale_sum += Scale(e);
        for (int64_t j = 0; j < H; ++j) {
          const double term =
              static_cast<double>(p.dy[me][tok * H + j]) * Scale(e) * p.x[me][tok * H + j];
          dot += term;
          mag += std::fabs(term);
        }
      }
      ASSERT_NEAR(dw[tok * K + k], dot, 1e-5 * mag + 1e-7) << "token " << tok << " k " << k;
    }
    for (int64_t j = 0; j < H; ++j) {
      const double want = scale_sum * p.dy[me][tok * H + j];
      ASSERT_NEAR(dx[tok * H + j], want, 1e-5 * std::fabs(want) + 1e-7);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Plans, NcclRowsTest, ::testing::ValuesIn(kPlanKinds), ParamName);

// ---------------------------------------------------------------------------------------------
// The layer against the fp64 reference: prefetch fills the replica slots, the "executor" runs each
// group's FFN with the weights this rank holds for it (home or slot, read back from the device).

class NcclReferenceTest : public NcclTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(NcclReferenceTest, ForwardAndTopkWeightGradMatchReferenceLayer) {
  const int32_t R = size(), me = rank();
  reference::MoeShape shape{2 * R, std::min(2, 2 * R), 8, 6};
  const int64_t E = shape.num_experts, K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  reference::ExpertWeights w = reference::MakeRandomProblem(shape, 0, 777, 0.0).weights;
  for (auto* v : {&w.wg, &w.wu, &w.wd}) {
    for (double& d : *v) d = static_cast<float>(d);
  }
  Problem p;
  p.R = R;
  p.E = static_cast<int32_t>(E);
  p.K = static_cast<int32_t>(K);
  p.H = H;
  p.counts.assign(R * E, 0);
  std::vector<reference::RandomProblem> data(R);
  for (int32_t r = 0; r < R; ++r) {
    const int64_t T = 9 + r % 3;
    data[r] = reference::MakeRandomProblem(shape, T, 100 + r, 0.2);
    for (double& d : data[r].x) d = static_cast<float>(d);
    for (double& d : data[r].dy) d = static_cast<float>(d);
    for (double& d : data[r].topk_weights) d = static_cast<float>(d);
    p.T.push_back(T);
    p.ids.push_back(data[r].topk_ids);
    for (int32_t e : data[r].topk_ids) {
      if (e >= 0) ++p.counts[r * E + e];
    }
  }
  planner::Plan plan;
  ASSERT_TRUE(PlanOfKind(GetParam(), p, 9, &plan).ok());
  auto t = MakeTransport(p.max_tokens(), p.K, H * 4);
  ASSERT_NE(t, nullptr);

  // Parameter blocks on the device: gate, up, down per expert; slots start as garbage.
  const int32_t epn = plan.experts_per_rank, S = plan.slots;
  const int64_t sizes[3] = {H * I, H * I, I * H};
  const std::vector<double>* src[3] = {&w.wg, &w.wu, &w.wd};
  std::vector<std::unique_ptr<DeviceVector<float>>> store;
  std::vector<TensorView> home_v, slot_v;
  for (int32_t b = 0; b < epn + S; ++b) {
    const int32_t e = b < epn ? plan.local_experts[me * epn + b] : -1;
    for (int i = 0; i < 3; ++i) {
      std::vector<float> v(sizes[i], -9.0f);
      if (e >= 0) {
        for (int64_t j = 0; j < sizes[i]; ++j)
          v[j] = static_cast<float>((*src[i])[e * sizes[i] + j]);
      }
      store.push_back(std::make_unique<DeviceVector<float>>(v));
      (b < epn ? home_v : slot_v)
          .push_back(TensorView::Contiguous(store.back()->get(), DType::kFloat32, {sizes[i]},
                                            Device::kCuda));
    }
  }
  absl::Status st = t->Prefetch(plan, ExpertBlocks{3, home_v, slot_v});
  ASSERT_TRUE(st.ok()) << st;

  const int64_t T = p.T[me];
  std::vector<float> x(T * H), dy(T * H), tw(T * K);
  for (int64_t i = 0; i < T * H; ++i) {
    x[i] = static_cast<float>(data[me].x[i]);
    dy[i] = static_cast<float>(data[me].dy[i]);
  }
  for (int64_t i = 0; i < T * K; ++i) tw[i] = static_cast<float>(data[me].topk_weights[i]);
  const int64_t cap = CapacityRows(p, plan.num_groups(), plan.pad_multiple);
  DeviceVector<int32_t> ids_d(p.ids[me]);
  DeviceVector<float> x_d(x), dy_d(dy), tw_d(tw), rows_d(cap * H), row_w_d(cap);
  DispatchHandle h;
  st = t->ExchangeCounts(ids_d.span(), T, p.K, p.E, cap, &h);
  ASSERT_TRUE(st.ok()) << st;
  st = t->Dispatch(plan, x_d.Matrix(T, H), tw_d.span(), &h, rows_d.Matrix(cap, H), row_w_d.span());
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<float> rows = rows_d.Download();
  std::vector<float> out(cap * H, 0.0f);
  reference::MoeShape one{1, 1, H, I};
  for (int32_t g = 0; g < plan.num_groups(); ++g) {
    const int64_t off = plan.group_offset[me * plan.num_groups() + g];
    const int64_t n = plan.group_count[me * plan.num_groups() + g];
    if (n == 0) continue;
    reference::ExpertWeights ew;
    std::vector<float> parts[3];
    for (int i = 0; i < 3; ++i) parts[i] = store[g * 3 + i]->Download();
    ew.wg.assign(parts[0].begin(), parts[0].end());
    ew.wu.assign(parts[1].begin(), parts[1].end());
    ew.wd.assign(parts[2].begin(), parts[2].end());
    std::vector<double> in(H), res(H);
    for (int64_t r = off; r < off + n; ++r) {
      for (int64_t j = 0; j < H; ++j) in[j] = rows[r * H + j];
      reference::ExpertForward(one, ew, 0, in.data(), res.data());
      for (int64_t j = 0; j < H; ++j) out[r * H + j] = static_cast<float>(res[j]);
    }
  }
  DeviceVector<float> out_d(out), y_d(T * H), dy_rows_d(cap * H), dw_d(T * K);
  st = t->Combine(&h, out_d.Matrix(cap, H), y_d.Matrix(T, H));
  ASSERT_TRUE(st.ok()) << st;
  st = t->CombineBackward(&h, dy_d.Matrix(T, H), dy_rows_d.Matrix(cap, H));
  ASSERT_TRUE(st.ok()) << st;
  st = t->TopkWeightGrad(&h, dy_rows_d.Matrix(cap, H), out_d.Matrix(cap, H), dw_d.span());
  ASSERT_TRUE(st.ok()) << st;

  reference::ForwardResult ref;
  ASSERT_TRUE(
      reference::Forward(shape, w, T, data[me].x, data[me].topk_ids, data[me].topk_weights, &ref)
          .ok());
  reference::BackwardResult grad;
  ASSERT_TRUE(reference::Backward(shape, w, T, data[me].x, data[me].topk_ids, data[me].topk_weights,
                                  data[me].dy, &grad)
                  .ok());
  const std::vector<float> y = y_d.Download(), dw = dw_d.Download();
  double scale = 1e-30, dscale = 1e-30;
  for (double v : ref.y) scale = std::max(scale, std::fabs(v));
  for (double v : grad.dtopk_weights) dscale = std::max(dscale, std::fabs(v));
  for (int64_t i = 0; i < T * H; ++i) ASSERT_LT(std::fabs(y[i] - ref.y[i]) / scale, 1e-5) << i;
  for (int64_t i = 0; i < T * K; ++i) {
    ASSERT_LT(std::fabs(dw[i] - grad.dtopk_weights[i]) / dscale, 1e-5) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Plans, NcclReferenceTest,
                         ::testing::Values(std::string("random"), std::string("moonep"),
                                           std::string("test-force-replicas")),
                         ParamName);

// ---------------------------------------------------------------------------------------------
// Prefetch (home -> slots, bitwise) and reduce (slots -> home, exact small-integer sums, fixed
// order so bit-identical across runs). Tensors: fp32 [24] and bf16 [5] per expert.

class NcclWeightsTest : public NcclTest, public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    NcclTest::SetUp();
    if (IsSkipped()) return;
    const int32_t R = size();
    p_ = MakeProblem(R, 2 * R, std::min(2, 2 * R), 1, 20, 23, -1);
    ASSERT_TRUE(PlanOfKind(GetParam(), p_, 23, &plan_).ok());
    t_ = MakeTransport(p_.max_tokens(), p_.K, 4);
    ASSERT_NE(t_, nullptr);
    const int32_t blocks = plan_.experts_per_rank + plan_.slots;
    for (int32_t b = 0; b < blocks; ++b) {
      f32_.push_back(std::make_unique<DeviceVector<float>>(24));
      b16_.push_back(std::make_unique<DeviceVector<BFloat16>>(5));
    }
  }
  // Block b: home group b (b < epn) or slot b - epn.
  void Fill(const std::function<float(int32_t, int, int32_t)>& f) {
    for (size_t b = 0; b < f32_.size(); ++b) {
      std::vector<float> a(24);
      std::vector<BFloat16> c(5);
      for (int32_t j = 0; j < 24; ++j) a[j] = f(static_cast<int32_t>(b), 0, j);
      for (int32_t j = 0; j < 5; ++j) c[j] = BFloat16::FromFloat(f(static_cast<int32_t>(b), 1, j));
      f32_[b]->Upload(a);
      b16_[b]->Upload(c);
    }
  }
  float Get(int32_t b, int k, int32_t j) const {
    return k == 0 ? f32_[b]->Download()[j] : b16_[b]->Download()[j].ToFloat();
  }
  ExpertBlocks View() {
    views_.clear();
    for (size_t b = 0; b < f32_.size(); ++b) {
      views_.push_back(
          TensorView::Contiguous(f32_[b]->get(), DType::kFloat32, {24}, Device::kCuda));
      views_.push_back(
          TensorView::Contiguous(b16_[b]->get(), DType::kBFloat16, {5}, Device::kCuda));
    }
    const size_t home = static_cast<size_t>(plan_.experts_per_rank) * 2;
    return ExpertBlocks{2, absl::MakeConstSpan(views_.data(), home),
                        absl::MakeConstSpan(views_.data() + home, views_.size() - home)};
  }
  int32_t BlockExpert(int32_t b) const {
    const int32_t epn = plan_.experts_per_rank;
    return b < epn ? plan_.local_experts[rank() * epn + b]
                   : plan_.slot_expert[rank() * plan_.slots + (b - epn)];
  }

  Problem p_;
  planner::Plan plan_;
  std::unique_ptr<Transport> t_;
  std::vector<std::unique_ptr<DeviceVector<float>>> f32_;
  std::vector<std::unique_ptr<DeviceVector<BFloat16>>> b16_;
  std::vector<TensorView> views_;
};

TEST_P(NcclWeightsTest, PrefetchMakesEverySlotBitwiseEqualToItsHome) {
  const int32_t epn = plan_.experts_per_rank;
  const auto value = [](int32_t e, int k, int32_t j) {
    return static_cast<float>(e * 64 + k * 8 + j) * 0.375f;
  };
  Fill([&](int32_t b, int k, int32_t j) { return b < epn ? value(BlockExpert(b), k, j) : -2.0f; });
  absl::Status st = t_->Prefetch(plan_, View());
  ASSERT_TRUE(st.ok()) << st;
  int replicas = 0, local = 0;  // local: home-rank replicas (one-rank test plans), copied here
  for (int32_t s = 0; s < plan_.slots; ++s) {
    const int32_t e = BlockExpert(epn + s);
    replicas += e >= 0 && plan_.home[e] != rank();
    local += e >= 0 && plan_.home[e] == rank();
    for (int k = 0; k < 2; ++k) {
      for (int32_t j = 0; j < (k == 0 ? 24 : 5); ++j) {
        const float want =
            e < 0 ? -2.0f
                  : (k == 0 ? value(e, k, j) : BFloat16::FromFloat(value(e, k, j)).ToFloat());
        ASSERT_EQ(Get(epn + s, k, j), want) << "slot " << s << " expert " << e;
      }
    }
  }
  EXPECT_EQ(t_->counters(OpKind::kPrefetch).rows_received, replicas * 2);
  EXPECT_EQ(t_->counters(OpKind::kPrefetch).rows_local, local * 2);
  if (size() == 1 && GetParam() == "test-force-replicas") {
    EXPECT_GT(local, 0) << "the one-rank test plan should fill this rank's slots";
  }
}

TEST_P(NcclWeightsTest, ReduceSumsContributionsExactlyAndReproducibly) {
  const int32_t epn = plan_.experts_per_rank;
  const auto home_grad = [](int32_t e, int k, int32_t j) {
    return static_cast<float>((e + k + j) % 7);
  };
  const auto slot_grad = [](int32_t d, int32_t e, int k, int32_t j) {
    return static_cast<float>((d * 3 + e + k + j) % 5 + 1);
  };
  for (int run = 0; run < 2; ++run) {
    Fill([&](int32_t b, int k, int32_t j) {
      const int32_t e = BlockExpert(b);
      if (b < epn) return home_grad(e, k, j);
      return e < 0 ? 0.0f : slot_grad(rank(), e, k, j);
    });
    absl::Status st = t_->Reduce(plan_, View());
    ASSERT_TRUE(st.ok()) << st;
    for (int32_t g = 0; g < epn; ++g) {
      const int32_t e = BlockExpert(g);
      for (int k = 0; k < 2; ++k) {
        for (int32_t j = 0; j < (k == 0 ? 24 : 5); ++j) {
          float want = home_grad(e, k, j);
          for (int32_t d = 0; d < plan_.num_ranks; ++d) {
            for (int32_t s = 0; s < plan_.slots; ++s) {
              if (plan_.slot_expert[d * plan_.slots + s] == e) want += slot_grad(d, e, k, j);
            }
          }
          ASSERT_EQ(Get(g, k, j), want) << "run " << run << " expert " << e << " tensor " << k;
        }
      }
    }
  }
}

TEST_P(NcclWeightsTest, TwoReducesInFlightKeepTheirOwnGradients) {
  // Two reduces started before either is waited for (waited in reverse order): each has its own
  // staging and source-pointer tables. With one transport-wide staging, the second overwrote the
  // pinned table the first one's upload reads, and grew (freed) the staging under it.
  const int32_t epn = plan_.experts_per_rank;
  const auto home_grad = [](int op, int32_t e, int k, int32_t j) {
    return static_cast<float>((e + k + j) % 7 + 16 * op);
  };
  const auto slot_grad = [](int op, int32_t d, int32_t e, int k, int32_t j) {
    return static_cast<float>((d * 3 + e + k + j + op) % 5 + 1 + 8 * op);
  };
  // The second reduce's blocks: copies of the fixture's layout with their own memory.
  std::vector<std::unique_ptr<DeviceVector<float>>> f32b;
  std::vector<std::unique_ptr<DeviceVector<BFloat16>>> b16b;
  std::vector<TensorView> views_b;
  for (size_t b = 0; b < f32_.size(); ++b) {
    const int32_t e = BlockExpert(static_cast<int32_t>(b));
    std::vector<float> a(24);
    std::vector<BFloat16> c(5);
    for (int32_t j = 0; j < 24; ++j) {
      a[j] = static_cast<int32_t>(b) < epn ? home_grad(1, e, 0, j)
                                           : (e < 0 ? 0.0f : slot_grad(1, rank(), e, 0, j));
    }
    for (int32_t j = 0; j < 5; ++j) {
      c[j] = BFloat16::FromFloat(static_cast<int32_t>(b) < epn
                                     ? home_grad(1, e, 1, j)
                                     : (e < 0 ? 0.0f : slot_grad(1, rank(), e, 1, j)));
    }
    f32b.push_back(std::make_unique<DeviceVector<float>>(a));
    b16b.push_back(std::make_unique<DeviceVector<BFloat16>>(c));
    views_b.push_back(
        TensorView::Contiguous(f32b.back()->get(), DType::kFloat32, {24}, Device::kCuda));
    views_b.push_back(
        TensorView::Contiguous(b16b.back()->get(), DType::kBFloat16, {5}, Device::kCuda));
  }
  const size_t home = static_cast<size_t>(epn) * 2;
  const ExpertBlocks second{2, absl::MakeConstSpan(views_b.data(), home),
                            absl::MakeConstSpan(views_b.data() + home, views_b.size() - home)};
  Fill([&](int32_t b, int k, int32_t j) {
    const int32_t e = BlockExpert(b);
    if (b < epn) return home_grad(0, e, k, j);
    return e < 0 ? 0.0f : slot_grad(0, rank(), e, k, j);
  });
  auto first = t_->StartReduce(plan_, View());
  ASSERT_TRUE(first.ok()) << first.status();
  auto later = t_->StartReduce(plan_, second);
  ASSERT_TRUE(later.ok()) << later.status();
  absl::Status st = (*later)->Wait();
  ASSERT_TRUE(st.ok()) << st;
  st = (*first)->Wait();
  ASSERT_TRUE(st.ok()) << st;
  for (int op = 0; op < 2; ++op) {
    for (int32_t g = 0; g < epn; ++g) {
      const int32_t e = BlockExpert(g);
      const std::vector<float> got32 = op == 0 ? f32_[g]->Download() : f32b[g]->Download();
      const std::vector<BFloat16> got16 = op == 0 ? b16_[g]->Download() : b16b[g]->Download();
      for (int k = 0; k < 2; ++k) {
        for (int32_t j = 0; j < (k == 0 ? 24 : 5); ++j) {
          float want = home_grad(op, e, k, j);
          for (int32_t d = 0; d < plan_.num_ranks; ++d) {
            for (int32_t s = 0; s < plan_.slots; ++s) {
              if (plan_.slot_expert[d * plan_.slots + s] == e) want += slot_grad(op, d, e, k, j);
            }
          }
          const float got = k == 0 ? got32[j] : got16[j].ToFloat();
          ASSERT_EQ(got, want) << "reduce " << op << " expert " << e << " tensor " << k;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Plans, NcclWeightsTest,
                         ::testing::Values(std::string("random"), std::string("moonep"),
                                           std::string("test-force-replicas")),
                         ParamName);

// ---------------------------------------------------------------------------------------------
// Asynchronous use: two dispatches (two layers) and a prefetch in flight at once, waited for in
// reverse order. The dispatches post their second step only after a host read, so this checks
// that every rank still issues the NCCL operations in the same order.

TEST_F(NcclTest, TwoDispatchesAndAPrefetchInFlightWaitedInReverseOrder) {
  const int32_t R = size(), me = rank();
  const Problem a = MakeProblem(R, 2 * R, std::min(2, 2 * R), 4, 9, 51, -1);
  const Problem b = MakeProblem(R, 2 * R, std::min(2, 2 * R), 4, 7, 52, -1);
  planner::Plan plan_a, plan_b;
  ASSERT_TRUE(PlanOfKind("random", a, 3, &plan_a).ok());
  ASSERT_TRUE(PlanOfKind("random", b, 4, &plan_b).ok());
  auto t = MakeTransport(std::max(a.max_tokens(), b.max_tokens()), a.K, a.H * 4);
  ASSERT_NE(t, nullptr);
  const int64_t H = a.H;
  const int64_t cap_a = CapacityRows(a, plan_a.num_groups(), plan_a.pad_multiple);
  const int64_t cap_b = CapacityRows(b, plan_b.num_groups(), plan_b.pad_multiple);
  DeviceVector<int32_t> ids_a(a.ids[me]), ids_b(b.ids[me]);
  DeviceVector<float> x_a(a.x[me]), x_b(b.x[me]), w_a(a.weights[me]), w_b(b.weights[me]);
  DeviceVector<float> rows_a(cap_a * H), rows_b(cap_b * H), rw_a(cap_a), rw_b(cap_b);
  DispatchHandle h_a, h_b;
  ASSERT_TRUE(t->ExchangeCounts(ids_a.span(), a.T[me], a.K, a.E, cap_a, &h_a).ok());
  ASSERT_TRUE(t->ExchangeCounts(ids_b.span(), b.T[me], b.K, b.E, cap_b, &h_b).ok());
  // Prefetch of one fp32 tensor per expert, on the weights channel.
  const int32_t epn = plan_a.experts_per_rank, S = plan_a.slots;
  std::vector<std::unique_ptr<DeviceVector<float>>> blocks;
  std::vector<TensorView> home_v, slot_v;
  for (int32_t blk = 0; blk < epn + S; ++blk) {
    const int32_t e = blk < epn ? plan_a.local_experts[me * epn + blk] : -1;
    blocks.push_back(
        std::make_unique<DeviceVector<float>>(std::vector<float>(16, e < 0 ? -1.0f : e * 1.5f)));
    (blk < epn ? home_v : slot_v)
        .push_back(
            TensorView::Contiguous(blocks.back()->get(), DType::kFloat32, {16}, Device::kCuda));
  }
  auto da = t->StartDispatch(plan_a, x_a.Matrix(a.T[me], H), w_a.span(), &h_a,
                             rows_a.Matrix(cap_a, H), rw_a.span());
  ASSERT_TRUE(da.ok()) << da.status();
  auto pf = t->StartPrefetch(plan_a, ExpertBlocks{1, home_v, slot_v});
  ASSERT_TRUE(pf.ok()) << pf.status();
  auto db = t->StartDispatch(plan_b, x_b.Matrix(b.T[me], H), w_b.span(), &h_b,
                             rows_b.Matrix(cap_b, H), rw_b.span());
  ASSERT_TRUE(db.ok()) << db.status();
  absl::Status st = (*db)->Wait();
  ASSERT_TRUE(st.ok()) << st;
  st = (*pf)->Wait();
  ASSERT_TRUE(st.ok()) << st;
  st = (*da)->Wait();
  ASSERT_TRUE(st.ok()) << st;
  for (int32_t sl = 0; sl < S; ++sl) {
    const int32_t e = plan_a.slot_expert[me * S + sl];
    const std::vector<float> got = blocks[epn + sl]->Download();
    for (float v : got) ASSERT_EQ(v, e < 0 ? -1.0f : e * 1.5f) << "slot " << sl;
  }
  for (int pass = 0; pass < 2; ++pass) {
    const Problem& p = pass == 0 ? a : b;
    const planner::Plan& plan = pass == 0 ? plan_a : plan_b;
    const std::vector<float> rows = (pass == 0 ? rows_a : rows_b).Download();
    const auto truth = BruteForcePlacement(p, plan);
    for (int32_t s = 0; s < R; ++s) {
      for (int64_t i = 0; i < p.T[s] * p.K; ++i) {
        if (truth[s][i].rank != me) continue;
        ASSERT_EQ(0, std::memcmp(&rows[truth[s][i].row * H], &p.x[s][(i / p.K) * H], H * 4))
            << "dispatch " << pass << " row " << truth[s][i].row;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Misuse and faults.

TEST_F(NcclTest, HostMemoryIsRefusedWithTheArgumentNamed) {
  const Problem p = MakeProblem(size(), 2 * size(), 2, 4, 6, 5, -1);
  auto t = MakeTransport(p.max_tokens(), p.K, 16);
  ASSERT_NE(t, nullptr);
  EXPECT_STREQ(t->backend(), "nccl");
  // Host ids: refused before anything is sent; every rank passes host ids, so all agree.
  DispatchHandle h;
  absl::Status st = t->ExchangeCounts(p.ids[rank()], p.T[rank()], p.K, p.E, 1000, &h);
  if (p.T[rank()] > 0) {
    EXPECT_FALSE(st.ok());
    EXPECT_NE(std::string(st.message()).find("topk_ids"), std::string::npos) << st;
  }
}

TEST_F(NcclTest, SilentPeerBecomesATimeoutNamingThePhase) {
  if (size() < 2) GTEST_SKIP() << "needs two ranks";
  const Problem p = MakeProblem(size(), 2 * size(), 2, 4, 6, 7, -1);
  auto t = MakeTransport(p.max_tokens(), p.K, 16, /*timeout_ms=*/2000);
  ASSERT_NE(t, nullptr);
  DeviceVector<int32_t> ids(p.ids[rank()]);
  testing::SetSkipRank(size() - 1, OpKind::kCounts);
  DispatchHandle h;
  absl::Status st = t->ExchangeCounts(ids.span(), p.T[rank()], p.K, p.E, 1000, &h);
  testing::ClearSkip();
  if (rank() != size() - 1) {
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(ToResult(st), moonepTimeout) << st;
    EXPECT_NE(std::string(st.message()).find("count exchange"), std::string::npos) << st;
    // Unusable afterwards, with a clear message.
    EXPECT_EQ(ToResult(t->ExchangeCounts(ids.span(), p.T[rank()], p.K, p.E, 1000, &h)),
              moonepInvalidUsage);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// The count exchange takes two rounds on a communicator pair's first exchange (and after the
// ranks disagreed on E), one afterwards: the headers travel with the counts, sized by the E of the
// pair's last exchange. Rounds are counted as messages_sent / peers (at one rank there are no
// messages: there only the counts are checked). The form depends on the pair's exchanges only,
// never on the handle: a fresh handle takes one round too, and a rank that joins with a fresh
// handle after a local input error (as the runtime does) takes the same form as its peers. Every
// exchange's counts are checked against the problem's.
TEST_F(NcclTest, CountExchangeTakesOneRoundAfterTheTransportsFirst) {
  const int32_t R = size(), me = rank();
  const Problem p = MakeProblem(R, 2 * R, 2, 4, 6, 41, -1);
  const int32_t E = p.E;
  auto t = MakeTransport(p.max_tokens(), p.K, 16);
  ASSERT_NE(t, nullptr);
  DeviceVector<int32_t> ids(p.ids[me]);
  DispatchHandle h;
  auto messages = [&] { return t->counters(OpKind::kCounts).messages_sent; };
  // Rounds of the exchanges since `before` (-1 with one rank: no peers, no messages).
  auto rounds_since = [&](int64_t before) { return R > 1 ? (messages() - before) / (R - 1) : -1; };
  auto exchange = [&](int32_t experts, DispatchHandle* handle, int64_t* rounds) {
    const int64_t before = messages();
    absl::Status st = t->ExchangeCounts(ids.span(), p.T[me], p.K, experts, 100, handle);
    *rounds = rounds_since(before);
    return st;
  };
  auto expect_counts = [&](const DispatchHandle& handle, int32_t experts) {
    std::vector<int64_t> want(static_cast<size_t>(R) * experts, 0);
    for (int32_t r = 0; r < R; ++r) {
      for (int32_t e = 0; e < E; ++e) want[r * experts + e] = p.counts[r * E + e];
    }
    EXPECT_EQ(std::vector<int64_t>(handle.counts().begin(), handle.counts().end()), want)
        << experts;
    EXPECT_EQ(handle.num_experts(), experts);
    for (int32_t r = 0; r < R; ++r) EXPECT_EQ(handle.tokens_of_rank(r), p.T[r]);
  };
  const int64_t two = R > 1 ? 2 : -1, one = R > 1 ? 1 : -1;
  int64_t rounds = 0;
  ASSERT_TRUE(exchange(E, &h, &rounds).ok());  // the transport's first exchange
  EXPECT_EQ(rounds, two);
  expect_counts(h, E);
  ASSERT_TRUE(exchange(E, &h, &rounds).ok());
  EXPECT_EQ(rounds, one);
  expect_counts(h, E);
  {
    DispatchHandle fresh;  // the form is the transport's, not the handle's
    ASSERT_TRUE(exchange(E, &fresh, &rounds).ok());
    EXPECT_EQ(rounds, one);
    expect_counts(fresh, E);
  }
  ASSERT_TRUE(exchange(2 * E, &h, &rounds).ok());  // every rank moves to 2E: a second round
  EXPECT_EQ(rounds, two);
  expect_counts(h, 2 * E);
  ASSERT_TRUE(exchange(2 * E, &h, &rounds).ok());
  EXPECT_EQ(rounds, one);
  expect_counts(h, 2 * E);
  {
    // A fresh handle with an E below the wire's: its buffers are sized for the wire (2E), the
    // first round carries zeros in the counts' places, a second brings the counts of E.
    DispatchHandle fresh;
    ASSERT_TRUE(exchange(E, &fresh, &rounds).ok());
    EXPECT_EQ(rounds, two);
    expect_counts(fresh, E);
    ASSERT_TRUE(exchange(2 * E, &h, &rounds).ok());
    EXPECT_EQ(rounds, two);
    expect_counts(h, 2 * E);
  }
  if (R > 1) {
    // Rank 0 uses E, below the wire's 2E, the others 2E: refused on every rank from the headers,
    // transport usable.
    absl::Status st = exchange(me == 0 ? E : 2 * E, &h, &rounds);
    EXPECT_EQ(ToResult(st), moonepInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find("num_experts"), std::string::npos) << st;
    EXPECT_EQ(rounds, 0) << "a refused exchange is not counted";
    ASSERT_TRUE(exchange(E, &h, &rounds).ok());  // no common E after the disagreement
    EXPECT_EQ(rounds, two);
    EXPECT_TRUE(t->health().ok()) << t->health();
    expect_counts(h, E);
  }
  ASSERT_TRUE(exchange(E, &h, &rounds).ok());
  EXPECT_EQ(rounds, one);
  expect_counts(h, E);
  {
    // The runtime's pattern: the last rank's input fails its local checks (num_tokens above
    // max_tokens) and it joins with a fresh handle; the others pass their counted handle.
    DispatchHandle scratch;
    const bool bad = me == R - 1;
    absl::Status st =
        bad ? t->ExchangeCounts(ids.span(), p.max_tokens() + 1, p.K, E, 100, &scratch)
            : t->ExchangeCounts(ids.span(), p.T[me], p.K, E, 100, &h);
    EXPECT_EQ(ToResult(st), bad ? moonepOutOfMemory : moonepRemoteError) << st;
    EXPECT_NE(std::string(st.message()).find(bad ? "max_tokens" : "rejected"), std::string::npos)
        << st;
    EXPECT_TRUE(t->health().ok()) << t->health();
  }
  ASSERT_TRUE(exchange(E, &h, &rounds).ok());  // the ranks still agreed on E: one round
  EXPECT_EQ(rounds, one);
  expect_counts(h, E);
  {
    // An id out of range on the last rank, in a one-round exchange: that rank names it, the others
    // report RemoteError, and the transport stays usable.
    std::vector<int32_t> bad_ids = p.ids[me];
    if (me == R - 1 && !bad_ids.empty()) bad_ids[0] = E;
    DeviceVector<int32_t> bad(bad_ids);
    absl::Status st = t->ExchangeCounts(bad.span(), p.T[me], p.K, E, 100, &h);
    if (!p.ids[R - 1].empty()) {
      EXPECT_EQ(ToResult(st), me == R - 1 ? moonepInvalidArgument : moonepRemoteError) << st;
    }
    ASSERT_TRUE(exchange(E, &h, &rounds).ok());
    expect_counts(h, E);
  }
  {
    // Three exchanges in flight at once, waited for in reverse order: the second (2E) starts before
    // the first (E, one round) is waited for, usually before its second step has run, and still
    // takes the form every rank takes (one round sized by E, then a second by 2E); the third (2E)
    // then takes one round.
    DispatchHandle h2, h3;
    const int64_t before = messages();
    auto first = t->StartExchangeCounts(ids.span(), p.T[me], p.K, E, 100, &h);
    ASSERT_TRUE(first.ok()) << first.status();
    auto second = t->StartExchangeCounts(ids.span(), p.T[me], p.K, 2 * E, 100, &h2);
    ASSERT_TRUE(second.ok()) << second.status();
    auto third = t->StartExchangeCounts(ids.span(), p.T[me], p.K, 2 * E, 100, &h3);
    ASSERT_TRUE(third.ok()) << third.status();
    ASSERT_TRUE((*third)->Wait().ok());
    ASSERT_TRUE((*second)->Wait().ok());
    ASSERT_TRUE((*first)->Wait().ok());
    EXPECT_EQ(rounds_since(before), R > 1 ? 4 : -1);
    expect_counts(h, E);
    expect_counts(h2, 2 * E);
    expect_counts(h3, 2 * E);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A handle's buffers belong to its count exchange until that ends: a second exchange started on
// it before then is refused with InvalidUsage, before anything reaches the peers. Every rank makes
// the same call here, so the first exchange completes and the transport stays usable.
TEST_F(NcclTest, SecondCountExchangeOnAHandleInFlightIsRefused) {
  const int32_t R = size(), me = rank();
  const Problem p = MakeProblem(R, 2 * R, 2, 4, 6, 43, -1);
  auto t = MakeTransport(p.max_tokens(), p.K, 16, /*timeout_ms=*/5000);
  ASSERT_NE(t, nullptr);
  DeviceVector<int32_t> ids(p.ids[me]);
  DispatchHandle h;
  auto first = t->StartExchangeCounts(ids.span(), p.T[me], p.K, p.E, 100, &h);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = t->StartExchangeCounts(ids.span(), p.T[me], p.K, p.E, 100, &h);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(ToResult(second.status()), moonepInvalidUsage) << second.status();
  EXPECT_NE(std::string(second.status().message()).find("has not ended"), std::string::npos)
      << second.status();
  ASSERT_TRUE((*first)->Wait().ok());
  EXPECT_TRUE(t->health().ok()) << t->health();
  EXPECT_EQ(std::vector<int64_t>(h.counts().begin(), h.counts().end()), p.counts);
  ASSERT_TRUE(t->ExchangeCounts(ids.span(), p.T[me], p.K, p.E, 100, &h).ok());  // ended: accepted
  EXPECT_EQ(std::vector<int64_t>(h.counts().begin(), h.counts().end()), p.counts);
  MPI_Barrier(MPI_COMM_WORLD);
}

// One rank's part of a small dispatch, for the tests of one handle's operations: 2R experts, top-2,
// 4 fp32 columns, about 8 tokens a rank, a random plan; its inputs and receive buffers on the device.
struct SmallDispatch {
  SmallDispatch(int32_t R, int32_t me, uint64_t seed)
      : p(MakeProblem(R, 2 * R, std::min(2, 2 * R), 4, 8, seed, -1)),
        planned(PlanOfKind("random", p, seed, &plan)),
        H(p.H),
        T(p.T[me]),
        cap(CapacityRows(p, plan.num_groups(), plan.pad_multiple)),
        ids(p.ids[me]),
        x(p.x[me]),
        w(p.weights[me]),
        rows(cap * H),
        rw(cap) {}
  absl::Status Count(Transport* t, DispatchHandle* h) const {
    return t->ExchangeCounts(ids.span(), T, p.K, p.E, cap, h);
  }
  absl::StatusOr<RequestPtr> StartCount(Transport* t, DispatchHandle* h) const {
    return t->StartExchangeCounts(ids.span(), T, p.K, p.E, cap, h);
  }
  absl::StatusOr<RequestPtr> StartDispatch(Transport* t, DispatchHandle* h) const {
    return t->StartDispatch(plan, x.Matrix(T, H), w.span(), h, rows.Matrix(cap, H), rw.span());
  }
  absl::Status Dispatch(Transport* t, DispatchHandle* h) const {
    auto r = StartDispatch(t, h);
    return r.ok() ? (*r)->Wait() : r.status();
  }

  Problem p;
  planner::Plan plan;
  absl::Status planned;
  int64_t H, T, cap;
  DeviceVector<int32_t> ids;
  DeviceVector<float> x, w, rows, rw;
};

// Operations on one handle overlap only where they share none of its state (transport.h). With a
// combine in flight on the handle (not waited for, so it stays in flight whatever the device did):
// a count exchange on it is refused before anything reaches the peers, the transport usable;
// combine-backward and topk-weight-grad overlap the combine, and every result equals the same
// operation run alone. Then a dispatch-backward while a combine is in flight: refused with
// InvalidUsage naming the combine, like any misuse of a handle (the pair is aborted).
TEST_F(NcclTest, OperationsOnOneHandleOverlapOnlyWhereTheyShareNoState) {
  const int32_t me = rank();
  SmallDispatch d(size(), me, 57);
  ASSERT_TRUE(d.planned.ok()) << d.planned;
  const Problem& p = d.p;
  const int64_t H = d.H, T = d.T, cap = d.cap, KT = T * p.K;
  const DeviceVector<float>& rows = d.rows;
  auto t = MakeTransport(p.max_tokens(), p.K, H * 4);  // MOONEP_TIMEOUT_MS (memcheck: long)
  ASSERT_NE(t, nullptr);
  DeviceVector<float> dy(p.dy[me]), half(std::vector<float>(cap * H, 0.5f));
  DispatchHandle h;
  ASSERT_TRUE(d.Count(t.get(), &h).ok());
  ASSERT_TRUE(d.Dispatch(t.get(), &h).ok());
  // Rows past the layout are not written: both results start from the same fill.
  const std::vector<float> fill(cap * H, -1.0f);
  DeviceVector<float> y(T * H), dy_rows(fill), d_w(KT);
  auto combine = t->StartCombine(&h, rows.Matrix(cap, H), y.Matrix(T, H));
  ASSERT_TRUE(combine.ok()) << combine.status();
  auto counts = d.StartCount(t.get(), &h);
  ASSERT_FALSE(counts.ok());
  EXPECT_EQ(ToResult(counts.status()), moonepInvalidUsage) << counts.status();
  EXPECT_NE(std::string(counts.status().message())
                .find("count exchange: the handle's combine has not ended"),
            std::string::npos) << counts.status();
  EXPECT_TRUE(t->health().ok()) << t->health();
  auto backward = t->StartCombineBackward(&h, dy.Matrix(T, H), dy_rows.Matrix(cap, H));
  ASSERT_TRUE(backward.ok()) << backward.status();
  auto grad = t->StartTopkWeightGrad(&h, half.Matrix(cap, H), rows.Matrix(cap, H), d_w.span());
  ASSERT_TRUE(grad.ok()) << grad.status();
  for (RequestPtr* r : {&*grad, &*combine, &*backward}) {
    const absl::Status st = (*r)->Wait();
    ASSERT_TRUE(st.ok()) << st;
  }
  DeviceVector<float> y1(T * H), dy_rows1(fill), d_w1(KT);
  ASSERT_TRUE(t->Combine(&h, rows.Matrix(cap, H), y1.Matrix(T, H)).ok());
  ASSERT_TRUE(t->CombineBackward(&h, dy.Matrix(T, H), dy_rows1.Matrix(cap, H)).ok());
  ASSERT_TRUE(t->TopkWeightGrad(&h, half.Matrix(cap, H), rows.Matrix(cap, H), d_w1.span()).ok());
  EXPECT_EQ(y.Download(), y1.Download());
  EXPECT_EQ(dy_rows.Download(), dy_rows1.Download());
  const std::vector<float> grads = d_w.Download();
  EXPECT_EQ(grads, d_w1.Download());
  for (int64_t e = 0; e < KT; ++e) {  // rows hold x: d_w[t,k] = 0.5 sum_j x[t,j] where routed
    double want = 0;
    if (p.ids[me][e] >= 0) {
      for (int64_t j = 0; j < H; ++j) want += 0.5 * p.x[me][(e / p.K) * H + j];
    }
    ASSERT_NEAR(grads[e], want, 1e-5 * (std::fabs(want) + 1)) << "entry " << e;
  }
  ASSERT_TRUE(d.Count(t.get(), &h).ok());  // ended: accepted
  ASSERT_TRUE(d.Dispatch(t.get(), &h).ok());

  auto again = t->StartCombine(&h, rows.Matrix(cap, H), y.Matrix(T, H));
  ASSERT_TRUE(again.ok()) << again.status();
  auto refused = t->StartDispatchBackward(&h, rows.Matrix(cap, H), y1.Matrix(T, H));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(ToResult(refused.status()), moonepInvalidUsage) << refused.status();
  EXPECT_NE(std::string(refused.status().message())
                .find("dispatch-backward: the handle's combine has not ended"),
            std::string::npos) << refused.status();
  (*again)->Wait().IgnoreError();  // aborted with the pair, or complete
  EXPECT_FALSE(t->health().ok());
  t.reset();
  MPI_Barrier(MPI_COMM_WORLD);
}

// An operation waits for the work its caller had queued on the caller's stream when it started the
// operation, not for what the caller queued later, however late the operation's first stage is
// posted (it is queued behind another operation on its channel). The caller's stream is held by
// a host function (gate 1) when a dispatch starts, so the dispatch's first stage waits; a count
// exchange starts behind it; the caller then queues a second gate, which stays closed. Once gate
// 1 opens, both complete. (Before, the count exchange recorded its wait on the caller's stream
// when its stage was posted, behind gate 2, and stayed stuck until its timeout: a dispatch of the
// next micro-batch would wait for the expert GEMMs queued after it.)
TEST_F(NcclTest, AnOperationWaitsOnlyForTheCallersWorkQueuedBeforeItStarted) {
  SmallDispatch d(size(), rank(), 59);
  ASSERT_TRUE(d.planned.ok()) << d.planned;
  auto t = MakeTransport(d.p.max_tokens(), d.p.K, d.H * 4, /*timeout_ms=*/30000);
  ASSERT_NE(t, nullptr);
  auto* nccl_t = dynamic_cast<nccl::NcclTransport*>(t.get());
  ASSERT_NE(nccl_t, nullptr);
  cudaStream_t caller = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking), cudaSuccess);
  nccl_t->set_caller_stream(caller);
  DispatchHandle h, h2;
  ASSERT_TRUE(d.Count(t.get(), &h).ok());
  std::atomic<bool> gate1{false}, gate2{false};
  struct OpenOnExit {  // a failed assertion must not leave the stream held (everything would wait)
    std::atomic<bool>* a;
    std::atomic<bool>* b;
    ~OpenOnExit() { *a = *b = true; }
  } open_on_exit{&gate1, &gate2};
  auto hold = [](void* flag) {
    while (!static_cast<std::atomic<bool>*>(flag)->load()) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  };
  ASSERT_EQ(cudaLaunchHostFunc(caller, hold, &gate1), cudaSuccess);
  auto dispatch = d.StartDispatch(t.get(), &h);
  ASSERT_TRUE(dispatch.ok()) << dispatch.status();
  auto counts = d.StartCount(t.get(), &h2);
  ASSERT_TRUE(counts.ok()) << counts.status();
  ASSERT_EQ(cudaLaunchHostFunc(caller, hold, &gate2), cudaSuccess);
  gate1 = true;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  absl::StatusOr<bool> done = false;
  while (done.ok() && !*done && std::chrono::steady_clock::now() < until) {
    done = (*counts)->Test();
    std::this_thread::yield();
  }
  const bool completed = done.ok() && *done;
  gate2 = true;  // whatever happened, so that nothing stays held
  EXPECT_TRUE(completed) << (done.ok() ? "the count exchange waited for gate 2"
                                       : done.status().ToString());
  EXPECT_TRUE((*counts)->Wait().ok());
  EXPECT_TRUE((*dispatch)->Wait().ok());
  EXPECT_EQ(std::vector<int64_t>(h2.counts().begin(), h2.counts().end()), d.p.counts);
  ASSERT_EQ(cudaStreamSynchronize(caller), cudaSuccess);
  t.reset();
  cudaStreamDestroy(caller);
  MPI_Barrier(MPI_COMM_WORLD);
}

// A handle's row operations go to the transport that made its last count exchange. Counted on
// two transports (each keeps device state for it), the handle is refused by the first: before, a
// dispatch there was accepted, and a combine on the second then read tables that transport had
// never built.
TEST_F(NcclTest, RowOperationsOnAHandleCountedByAnotherTransportAreRefused) {
  SmallDispatch d(size(), rank(), 61);
  ASSERT_TRUE(d.planned.ok()) << d.planned;
  auto a = MakeTransport(d.p.max_tokens(), d.p.K, d.H * 4);
  auto b = MakeTransport(d.p.max_tokens(), d.p.K, d.H * 4);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  DispatchHandle h;
  ASSERT_TRUE(d.Count(a.get(), &h).ok());
  ASSERT_TRUE(d.Count(b.get(), &h).ok());
  absl::Status st = d.Dispatch(a.get(), &h);
  EXPECT_EQ(ToResult(st), moonepInvalidUsage) << st;
  EXPECT_NE(std::string(st.message()).find("the handle has no count exchange of this transport"),
            std::string::npos) << st;
  st = d.Dispatch(b.get(), &h);
  EXPECT_TRUE(st.ok()) << st;
  a.reset();
  b.reset();
  MPI_Barrier(MPI_COMM_WORLD);
}

// Transports on one communicator pair share its count exchange's form, which follows the pair's
// order of operations: a transport made again on one rank only (a layer rebuilt there) still
// takes the form its peers take on their older transport.
TEST_F(NcclTest, CountExchangeFormFollowsTheSharedPair) {
  const int32_t R = size(), me = rank();
  const Problem p = MakeProblem(R, 2 * R, 2, 4, 6, 47, -1);
  TransportOptions o;
  o.max_tokens = std::max<int64_t>(1, p.max_tokens());
  o.max_top_k = p.K;
  o.max_row_bytes = 16;
  auto comms = nccl::CreateNcclComms(o, nccl::NcclBootstrap{});
  ASSERT_TRUE(comms.ok()) << comms.status();
  auto make = [&] {
    auto t = nccl::CreateNcclTransport(o, *comms);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  };
  auto a = make(), b = make();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  DeviceVector<int32_t> ids(p.ids[me]);
  auto exchange = [&](Transport* t, int32_t experts, int64_t* rounds) {
    DispatchHandle h;
    const int64_t before = t->counters(OpKind::kCounts).messages_sent;
    absl::Status st = t->ExchangeCounts(ids.span(), p.T[me], p.K, experts, 100, &h);
    *rounds = R > 1 ? (t->counters(OpKind::kCounts).messages_sent - before) / (R - 1) : -1;
    if (st.ok() && experts == p.E) {
      EXPECT_EQ(std::vector<int64_t>(h.counts().begin(), h.counts().end()), p.counts);
    }
    return st;
  };
  const int64_t two = R > 1 ? 2 : -1, one = R > 1 ? 1 : -1;
  int64_t rounds = 0;
  ASSERT_TRUE(exchange(a.get(), p.E, &rounds).ok());  // the pair's first exchange
  EXPECT_EQ(rounds, two);
  ASSERT_TRUE(exchange(b.get(), p.E, &rounds).ok());  // b's first, the pair's second
  EXPECT_EQ(rounds, one);
  if (me == 0) {  // rank 0 makes b again
    b.reset();
    b = make();
    ASSERT_NE(b, nullptr);
  }
  ASSERT_TRUE(exchange(b.get(), p.E, &rounds).ok());
  EXPECT_EQ(rounds, one);
  ASSERT_TRUE(exchange(a.get(), 2 * p.E, &rounds).ok());
  EXPECT_EQ(rounds, two);
  ASSERT_TRUE(exchange(b.get(), 2 * p.E, &rounds).ok());
  EXPECT_EQ(rounds, one);
  MPI_Barrier(MPI_COMM_WORLD);
}

// A buffer that grows while an earlier operation's kernel waits on a silent peer: growing used to
// cudaFree the old allocation from inside Start*, and cudaFree waits for the whole device, so the
// call never returned (past every timeout). Now the old allocation is kept until nothing is in
// flight, the start returns, and the wait ends in the Timeout.
TEST_F(NcclTest, GrowingABufferWhileAKernelWaitsOnASilentPeerDoesNotHang) {
  if (size() < 2) GTEST_SKIP() << "needs two ranks";
  const int32_t me = rank(), silent = size() - 1;
  const Problem p = MakeProblem(size(), 2 * size(), 2, 4, 6, 9, -1);
  planner::Plan plan;
  ASSERT_TRUE(PlanOfKind("random", p, 9, &plan).ok());
  auto t = MakeTransport(p.max_tokens(), p.K, p.H * 4, /*timeout_ms=*/2000);
  ASSERT_NE(t, nullptr);
  const int64_t cap = CapacityRows(p, plan.num_groups(), plan.pad_multiple);
  DeviceVector<int32_t> ids(p.ids[me]);
  DeviceVector<float> x(p.x[me]), w(p.weights[me]), rows(cap * p.H), rw(cap);
  // A first dispatch with every rank: NCCL connects a pair of ranks at its first send/receive,
  // inside ncclGroupEnd, which a silent peer would hold up. Connected, the silent dispatch's start
  // only enqueues its kernels and returns, and those kernels are what wait on the silent rank.
  {
    DispatchHandle warm;
    ASSERT_TRUE(t->ExchangeCounts(ids.span(), p.T[me], p.K, p.E, cap, &warm).ok());
    auto d = t->StartDispatch(plan, x.Matrix(p.T[me], p.H), w.span(), &warm, rows.Matrix(cap, p.H),
                              rw.span());
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_TRUE((*d)->Wait().ok());
  }
  DispatchHandle h, h2;
  ASSERT_TRUE(t->ExchangeCounts(ids.span(), p.T[me], p.K, p.E, cap, &h).ok());
  ASSERT_TRUE(t->ExchangeCounts(ids.span(), p.T[me], p.K, p.E, cap, &h2).ok());
  MPI_Barrier(MPI_COMM_WORLD);
  testing::SetSkipRank(silent, OpKind::kDispatch);
  const auto start = std::chrono::steady_clock::now();
  auto dispatch = t->StartDispatch(plan, x.Matrix(p.T[me], p.H), w.span(), &h,
                                   rows.Matrix(cap, p.H), rw.span());
  testing::ClearSkip();
  ASSERT_TRUE(dispatch.ok()) << dispatch.status();
  // Another handle, counted before, with 64 times the experts: its count buffers (device and
  // pinned) grow while the dispatch's kernels wait for the silent rank. (Not the dispatch's own
  // handle: a count exchange on it is refused while the dispatch is in flight.)
  // (The ids stay valid: below E < 64 E.)
  auto counts = t->StartExchangeCounts(ids.span(), p.T[me], p.K, 64 * p.E, cap, &h2);
  const double start_ms = std::chrono::duration<double, std::milli>(
                              std::chrono::steady_clock::now() - start).count();
  if (me != silent) {
    EXPECT_LT(start_ms, 2000.0) << "the start blocked on the device";
    ASSERT_TRUE(counts.ok()) << counts.status();
    // Queued behind the stuck dispatch: its deadline passes, the pair is aborted.
    absl::Status st = (*counts)->Wait();
    EXPECT_EQ(ToResult(st), moonepTimeout) << st;
    EXPECT_FALSE((*dispatch)->Wait().ok());
  } else if (counts.ok()) {
    (*counts)->Wait().IgnoreError();  // times out: rank 0's count exchange never posts
  }
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(ms, 2 * 2000 + 3000) << "a wait outlived the timeout";
  t.reset();
  MPI_Barrier(MPI_COMM_WORLD);
}

// Options for a transport that moves one 4-byte row per rank (creation and count-exchange tests).
TransportOptions OneRowOptions() {
  TransportOptions o;
  o.max_tokens = 4;
  o.max_top_k = 1;
  o.max_row_bytes = 4;
  return o;
}

// A communicator of two ranks whose second rank never joins (one GPU is enough: only rank 0 of
// the declared two exists). Creation must end in a Timeout close to the deadline, the abort of the
// half-made communicator must not hang, and the process must go on to make a working transport.
TEST_F(NcclTest, PeerThatNeverJoinsMakesCreationTimeOut) {
  if (size() != 1) GTEST_SKIP() << "runs with one process (it declares a second rank that never joins)";
  auto id = nccl::GetUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  nccl::NcclBootstrap b;
  b.kind = nccl::NcclBootstrap::Kind::kUniqueId;
  b.unique_id = *id;
  b.rank = 0;
  b.size = 2;
  TransportOptions o = OneRowOptions();
  o.timeout_ms = 2000;
  const auto start = std::chrono::steady_clock::now();
  auto t = nccl::CreateNcclTransport(o, b);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(ToResult(t.status()), moonepTimeout) << t.status();
  EXPECT_NE(std::string(t.status().message()).find("communicator creation"), std::string::npos)
      << t.status();
  // The deadline, plus at most one bounded abort per communicator.
  EXPECT_LT(seconds, 2.0 * 3 + 1.0) << t.status();
  std::printf("[ NCCL     ] creation with a missing peer: %s after %.1f s\n",
              std::string(t.status().message()).c_str(), seconds);
  // Nothing is left stuck: a one-rank transport works afterwards.
  auto ok = MakeTransport(4, 1, 4, 2000);
  ASSERT_NE(ok, nullptr);
  DeviceVector<int32_t> ids(std::vector<int32_t>{0});
  DispatchHandle h;
  absl::Status st = ok->ExchangeCounts(ids.span(), 1, 1, 1, 4, &h);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(h.counts()[0], 1);
}

// Run by nccl_env_one_rank_np2 (skipped elsewhere): MOONEP_DEBUG is malformed on rank
// MOONEP_TEST_BAD_RANK only. Created with the MPI bootstrap, that rank's transport fails naming the
// variable and the others fail at once with RemoteError; before, the bad rank returned before the
// unique id's MPI_Bcast and left the others in it with no timeout.
TEST_F(NcclTest, BadEnvironmentOnOneRankFailsCreationEverywhere) {
  const char* bad = std::getenv("MOONEP_TEST_BAD_RANK");
  if (bad == nullptr) GTEST_SKIP() << "run by nccl_env_one_rank_np2 (tests/nccl/run_multi_gpu.sh)";
  if (size() < 2) GTEST_SKIP() << "needs two ranks";
  const int bad_rank = std::atoi(bad);
  const TransportOptions o = OneRowOptions();
  moonep::testing::ExpectBadEnvironmentFailsEverywhere(
      rank(), bad_rank, [&] { return CreateTransport("nccl", o).status(); });
  MPI_Barrier(MPI_COMM_WORLD);
}

// The caller's own communicator (kWrap, what moonepCommSetNcclComm passes) carries the rows. A
// failure that aborts the pair revokes it (ncclCommRevoke: nothing of MoonEP's stays blocked on
// it) instead of aborting it: the error and every later call say what became of it, and it stays
// the caller's to destroy. Before, ncclCommAbort freed it, and the caller's own ncclCommDestroy
// touched freed memory. Round 0: a blocking communicator (ncclCommInitRank); round 1: a
// non-blocking one, whose revoke answers ncclInProgress and is waited for; round 2: no failure, the
// communicator stays usable after the transport. A libnccl without ncclCommRevoke (2.28.9 has it;
// the GPU machine's system 2.28.3 does not) gets the abort, and the message must say that the
// communicator is freed; it is then not touched again.
TEST_F(NcclTest, CallersCommunicatorIsRevokedNotFreedByAFailure) {
  const bool has_revoke = dlsym(RTLD_DEFAULT, "ncclCommRevoke") != nullptr;
  int version = 0;
  ncclGetVersion(&version);
  std::printf("libnccl %d, ncclCommRevoke %s\n", version, has_revoke ? "found" : "absent");
  const std::string fate = has_revoke
                               ? "caller's NCCL communicator was revoked (ncclCommRevoke"
                               : "caller's NCCL communicator was aborted (ncclCommAbort, as this "
                                 "libnccl has no ncclCommRevoke): it is freed";
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    ncclUniqueId id{};
    if (rank() == 0) {
      ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    }
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t mine = nullptr;
    const bool blocking = round != 1;
    if (blocking) {
      ASSERT_EQ(ncclCommInitRank(&mine, size(), id, rank()), ncclSuccess);
    } else {
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      const ncclResult_t r = ncclCommInitRankConfig(&mine, size(), id, rank(), &config);
      ASSERT_TRUE(r == ncclSuccess || r == ncclInProgress) << ncclGetErrorString(r);
      ncclResult_t state = ncclInProgress;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (ncclCommGetAsyncError(mine, &state) == ncclSuccess && state == ncclInProgress &&
             std::chrono::steady_clock::now() < until) {
      }
      ASSERT_EQ(state, ncclSuccess) << ncclGetErrorString(state);
    }
    const bool fail = round < 2;
    {
      nccl::NcclBootstrap b;
      b.kind = nccl::NcclBootstrap::Kind::kWrap;
      b.comm = mine;
      auto t = nccl::CreateNcclTransport(OneRowOptions(), b);
      ASSERT_TRUE(t.ok()) << t.status();
      const int32_t E = size();
      DeviceVector<int32_t> ids(std::vector<int32_t>{rank()});
      DispatchHandle h;
      absl::Status st = (*t)->ExchangeCounts(ids.span(), 1, 1, E, 4, &h);
      ASSERT_TRUE(st.ok()) << st;
      for (int32_t r = 0; r < size(); ++r) EXPECT_EQ(h.counts()[r * E + r], 1);
      if (fail) {  // a local error once the transport has worked aborts the pair (on every rank)
        DeviceVector<float> rows(4), y(1);
        st = (*t)->Combine(nullptr, rows.Matrix(4, 1), y.Matrix(1, 1));
        EXPECT_EQ(ToResult(st), moonepInvalidArgument) << st;
        EXPECT_NE(std::string(st.message()).find("handle is null"), std::string::npos) << st;
        EXPECT_NE(std::string(st.message()).find(fate), std::string::npos) << st;
        EXPECT_TRUE(st.GetPayload(nccl::kCallersCommStopped).has_value()) << st;
        absl::Status later = (*t)->ExchangeCounts(ids.span(), 1, 1, E, 4, &h);
        EXPECT_EQ(ToResult(later), moonepInvalidUsage) << later;
        EXPECT_NE(std::string(later.message()).find(fate), std::string::npos) << later;
      }
    }
    if (fail && !has_revoke) {  // freed by the abort: not the caller's to destroy any more
      MPI_Barrier(MPI_COMM_WORLD);
      continue;
    }
    // Still the caller's object: quiescent, its state and size can be read, and the caller
    // destroys it.
    ncclResult_t state = ncclInternalError;
    EXPECT_EQ(ncclCommGetAsyncError(mine, &state), ncclSuccess);
    EXPECT_NE(state, ncclInProgress);
    int count = 0;
    EXPECT_EQ(ncclCommCount(mine, &count), ncclSuccess);
    EXPECT_EQ(count, size());
    const ncclResult_t destroyed = ncclCommDestroy(mine);
    EXPECT_TRUE(destroyed == ncclSuccess || (!blocking && destroyed == ncclInProgress))
        << ncclGetErrorString(destroyed);
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST_F(NcclTest, CommunicatorFromAUniqueId) {
  ncclUniqueId id{};
  if (rank() == 0) {
    auto made = nccl::GetUniqueId();
    ASSERT_TRUE(made.ok()) << made.status();
    id = *made;
  }
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  nccl::NcclBootstrap b;
  b.kind = nccl::NcclBootstrap::Kind::kUniqueId;
  b.unique_id = id;
  b.rank = rank();
  b.size = size();
  const TransportOptions o = OneRowOptions();
  auto t = nccl::CreateNcclTransport(o, b);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->rank(), rank());
  EXPECT_EQ((*t)->size(), size());
  // One count exchange over the new communicator: token r of rank r picks expert r.
  const int32_t E = size();
  DeviceVector<int32_t> ids(std::vector<int32_t>{rank()});
  DispatchHandle h;
  absl::Status st = (*t)->ExchangeCounts(ids.span(), 1, 1, E, 4, &h);
  ASSERT_TRUE(st.ok()) << st;
  for (int32_t r = 0; r < size(); ++r) {
    for (int32_t e = 0; e < E; ++e) EXPECT_EQ(h.counts()[r * E + e], r == e ? 1 : 0);
  }
}

}  // namespace
}  // namespace moonep::transport
