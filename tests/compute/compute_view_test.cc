// ComputeView construction from a plan, the replica buffer, and the executor's argument checks.
#include "moonep/compute/compute_view.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "moonep/compute/cpu/cpu_executor.h"
#include "moonep/core/host_memory.h"
#include "moonep/core/status.h"
#include "planner/plan_builder.h"
#include "tests/compute/problem.h"

namespace moonep::compute {
namespace {

using testing::Buffer;
using testing::ErrorMeter;
using testing::Problem;
using testing::ProblemSpec;

// Two ranks, four experts (two per rank), one replica slot per rank: expert 0 (home rank 0) is
// split with a replica on rank 1; rank 0's slot stays unused.
struct TwoRankPlan {
  planner::PlannerConfig config;
  planner::Plan plan;
  std::vector<int64_t> counts = {10, 3, 0, 2,   // source rank 0
                                 6, 1, 0, 5};   // source rank 1
  absl::Status Build() {
    planner::PlannerConfig in;
    in.num_ranks = 2;
    in.num_experts = 4;
    in.slots = 1;
    in.pad_multiple = 4;
    MOONEP_RETURN_IF_ERROR(planner::ResolveConfig(in, &config));
    planner::InitPlan(config, &plan);
    const int R = 2;
    plan.alloc[0 * R + 0] = 8;  // expert 0: 16 tokens, 8 at home, 8 on rank 1's replica
    plan.alloc[0 * R + 1] = 8;
    plan.alloc[1 * R + 0] = 4;
    plan.alloc[3 * R + 1] = 7;
    plan.slot_expert[1 * 1 + 0] = 0;
    planner::BuildScratch scratch;
    return planner::FinalizePlan(config, counts, &plan, &scratch);
  }
};

struct ExpertStore {
  std::vector<Buffer> w, g;  // per expert: gate, up, down
  ExpertParams Weights(int e) { return {w[3 * e].view(), w[3 * e + 1].view(), w[3 * e + 2].view()}; }
  ExpertParams Grads(int e) { return {g[3 * e].view(), g[3 * e + 1].view(), g[3 * e + 2].view()}; }
};

ExpertStore MakeExperts(int E, int64_t H, int64_t I, uint64_t seed) {
  ExpertStore s;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-0.5f, 0.5f);
  for (int e = 0; e < E; ++e) {
    for (int m = 0; m < 3; ++m) {
      const int64_t rows = m == 2 ? I : H, cols = m == 2 ? H : I;
      s.w.emplace_back(rows, cols, DType::kFloat32);
      s.g.emplace_back(rows, cols, DType::kFloat32);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) s.w.back().Set(r, c, uni(rng));
    }
  }
  return s;
}

TEST(BuildComputeView, FollowsThePlanLayoutWithoutCopies) {
  TwoRankPlan tp;
  ASSERT_TRUE(tp.Build().ok());
  const planner::Plan& plan = tp.plan;
  const int64_t H = 11, I = 6;
  ExpertStore experts = MakeExperts(4, H, I, 5);
  auto replicas = ReplicaBuffer::Create(plan.slots, H, I, DType::kFloat32);
  ASSERT_TRUE(replicas.ok());
  // "Prefetch": rank 1's slot 0 receives expert 0's weights.
  for (int m = 0; m < 3; ++m) {
    const ExpertParams& slot = (*replicas)->weights()[0];
    const TensorView& dst = m == 0 ? slot.gate : (m == 1 ? slot.up : slot.down);
    std::memcpy(dst.data, experts.w[m].data(), experts.w[m].bytes());
  }

  for (int32_t rank = 0; rank < 2; ++rank) {
    std::vector<ExpertParams> lw, lg;
    for (int g = 0; g < plan.experts_per_rank; ++g) {
      lw.push_back(experts.Weights(plan.local_experts[rank * 2 + g]));
      lg.push_back(experts.Grads(plan.local_experts[rank * 2 + g]));
    }
    ComputeView view;
    absl::Status st = BuildComputeView(plan, rank, lw, lg, (*replicas)->weights(),
                                       (*replicas)->grads(), &view);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(view.groups.size(), 3u);
    EXPECT_EQ(view.hidden, H);
    EXPECT_EQ(view.intermediate, I);
    EXPECT_EQ(view.total_rows, plan.rank_rows[rank]);
    for (int g = 0; g < 3; ++g) {
      const GroupView& gv = view.groups[g];
      EXPECT_EQ(gv.row_offset, plan.group_offset[rank * 3 + g]);
      EXPECT_EQ(gv.row_count, plan.group_count[rank * 3 + g]);
      EXPECT_EQ(gv.padded_count, plan.group_padded[rank * 3 + g]);
      EXPECT_EQ(gv.expert, plan.ExpertOfGroup(rank, g));
      EXPECT_EQ(gv.replica, g >= 2);
    }
    EXPECT_EQ(view.groups[0].weights.gate.data, lw[0].gate.data);  // no copy
    EXPECT_EQ(view.groups[1].grads.down.data, lg[1].down.data);
    if (rank == 0) {
      EXPECT_EQ(view.groups[2].expert, -1);
      EXPECT_EQ(view.groups[2].row_count, 0);
      EXPECT_EQ(view.groups[2].weights.gate.data, nullptr);
    } else {
      EXPECT_EQ(view.groups[2].expert, 0);
      EXPECT_EQ(view.groups[2].row_count, 8);
      EXPECT_EQ(view.groups[2].weights.gate.data, (*replicas)->slot_weights(0));
      EXPECT_EQ(view.groups[2].grads.gate.data, (*replicas)->slot_grads(0));
    }

    // Rebuilding reuses the group storage.
    const GroupView* before = view.groups.data();
    ASSERT_TRUE(BuildComputeView(plan, rank, lw, lg, (*replicas)->weights(), (*replicas)->grads(),
                                 &view).ok());
    EXPECT_EQ(view.groups.data(), before);

    // Run the view: every group's rows equal the reference FFN of the group's expert.
    ExecutorConfig config{H, I, DType::kFloat32, view.total_rows, 2};
    auto ex = cpu::CpuExecutor::Create(config);
    ASSERT_TRUE(ex.ok());
    Buffer x(view.total_rows, H, DType::kFloat32), y(view.total_rows, H, DType::kFloat32);
    x.Fill(std::numeric_limits<float>::quiet_NaN());
    std::mt19937_64 rng(rank);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    for (const GroupView& gv : view.groups)
      for (int64_t r = 0; r < gv.row_count; ++r)
        for (int64_t h = 0; h < H; ++h) x.Set(gv.row_offset + r, h, uni(rng));
    ASSERT_TRUE((*ex)->Forward(view, x.view(), y.view(), {}).ok());
    reference::MoeShape shape{4, 1, H, I};
    reference::ExpertWeights ref;
    for (int e = 0; e < 4; ++e) {
      for (int m = 0; m < 3; ++m) {
        std::vector<double>& dst = m == 0 ? ref.wg : (m == 1 ? ref.wu : ref.wd);
        Buffer& b = experts.w[3 * e + m];
        for (int64_t r = 0; r < b.rows(); ++r)
          for (int64_t c = 0; c < b.cols(); ++c) dst.push_back(b.Get(r, c));
      }
    }
    ErrorMeter err;
    std::vector<double> xr(H), out(H);
    int64_t rows_checked = 0;
    for (const GroupView& gv : view.groups) {
      for (int64_t r = 0; r < gv.row_count; ++r, ++rows_checked) {
        for (int64_t h = 0; h < H; ++h) xr[h] = x.Get(gv.row_offset + r, h);
        reference::ExpertForward(shape, ref, gv.expert, xr.data(), out.data());
        for (int64_t h = 0; h < H; ++h) err.Add(y.Get(gv.row_offset + r, h), out[h]);
      }
    }
    EXPECT_EQ(rows_checked, rank == 0 ? 12 : 15);
    EXPECT_LT(err.rel(), 1e-5);
  }
}

TEST(BuildComputeView, RejectsBadArguments) {
  TwoRankPlan tp;
  ASSERT_TRUE(tp.Build().ok());
  ExpertStore experts = MakeExperts(4, 8, 4, 6);
  auto replicas = ReplicaBuffer::Create(1, 8, 4, DType::kFloat32);
  ASSERT_TRUE(replicas.ok());
  std::vector<ExpertParams> lw = {experts.Weights(0), experts.Weights(1)};
  ComputeView view;
  auto msg = [&](absl::Status st) { return std::string(st.message()); };

  absl::Status st = BuildComputeView(tp.plan, 2, lw, {}, (*replicas)->weights(), {}, &view);
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_NE(msg(st).find("rank"), std::string::npos) << st;

  st = BuildComputeView(tp.plan, 0, absl::MakeSpan(lw).subspan(0, 1), {}, (*replicas)->weights(),
                        {}, &view);
  EXPECT_NE(msg(st).find("local_weights"), std::string::npos) << st;

  st = BuildComputeView(tp.plan, 1, lw, {}, {}, {}, &view);
  EXPECT_NE(msg(st).find("replica_weights"), std::string::npos) << st;

  std::vector<ExpertParams> bad = lw;
  bad[1].up = experts.w[2].view();  // down [4, 8] where up [8, 4] belongs
  st = BuildComputeView(tp.plan, 0, bad, {}, (*replicas)->weights(), {}, &view);
  EXPECT_NE(msg(st).find("group 1 up"), std::string::npos) << st;

  // Replica slot with a wrong shape in the buffer (H mismatch).
  auto wrong = ReplicaBuffer::Create(1, 9, 4, DType::kFloat32);
  ASSERT_TRUE(wrong.ok());
  st = BuildComputeView(tp.plan, 1, lw, {}, (*wrong)->weights(), {}, &view);
  EXPECT_NE(msg(st).find("replica_weights"), std::string::npos) << st;
  // ... but rank 0's slot is unused, so it is not read.
  EXPECT_TRUE(BuildComputeView(tp.plan, 0, lw, {}, (*wrong)->weights(), {}, &view).ok());
}

// Host replica slots beyond the node's available memory: refused before the zero-fill (which
// would run the process into the out-of-memory killer under overcommit), naming the buffer.
TEST(ReplicaBuffer, HostSlotsAboveTheNodesMemoryAreRefused) {
  const int64_t available = HostMemoryAvailableBytes();
  if (available < 0) GTEST_SKIP() << "MemAvailable cannot be read here";
  const int64_t H = 1024, I = 1024;
  const int32_t slots = static_cast<int32_t>(2 * available / (3 * H * I * 8) + 1);
  auto buf = ReplicaBuffer::Create(slots, H, I, DType::kFloat32);
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().code(), absl::StatusCode::kResourceExhausted) << buf.status();
  EXPECT_NE(buf.status().message().find("the replica buffer"), std::string::npos) << buf.status();
}

TEST(ReplicaBuffer, LayoutAndSize) {
  const int64_t H = 5, I = 7;
  auto buf = ReplicaBuffer::Create(3, H, I, DType::kBFloat16);
  ASSERT_TRUE(buf.ok());
  ReplicaBuffer& b = **buf;
  const size_t w = 3 * 3 * H * I * 2, g = 3 * 3 * H * I * 4;
  EXPECT_EQ(b.total_bytes(), (w + 63) / 64 * 64 + (g + 63) / 64 * 64);
  EXPECT_EQ(b.total_bytes(), ReplicaBuffer::BytesFor(3, H, I, DType::kBFloat16, DType::kFloat32));
  EXPECT_EQ(b.slot_weight_bytes(), 3u * H * I * 2);
  EXPECT_EQ(b.slot_grad_bytes(), 3u * H * I * 4);
  for (int s = 0; s < 3; ++s) {
    const ExpertParams& p = b.weights()[s];
    char* block = static_cast<char*>(b.slot_weights(s));
    EXPECT_EQ(p.gate.data, block);
    EXPECT_EQ(p.up.data, block + H * I * 2);
    EXPECT_EQ(p.down.data, block + 2 * H * I * 2);
    EXPECT_EQ(p.down.shape[0], I);
    EXPECT_EQ(p.gate.dtype, DType::kBFloat16);
    EXPECT_EQ(b.grads()[s].up.dtype, DType::kFloat32);
    EXPECT_EQ(b.grads()[s].up.data, static_cast<char*>(b.slot_grads(s)) + H * I * 4);
    if (s > 0) {
      EXPECT_EQ(block, static_cast<char*>(b.slot_weights(s - 1)) + b.slot_weight_bytes());
    }
  }
  std::memset(b.slot_grads(0), 0xff, 3 * b.slot_grad_bytes());
  b.ZeroGrads();
  const char* gp = static_cast<const char*>(b.slot_grads(0));
  EXPECT_TRUE(std::all_of(gp, gp + 3 * b.slot_grad_bytes(), [](char c) { return c == 0; }));

  EXPECT_FALSE(ReplicaBuffer::Create(2, H, I, DType::kFloat32, DType::kBFloat16).ok());
  EXPECT_FALSE(ReplicaBuffer::Create(-1, H, I, DType::kFloat32).ok());
  EXPECT_FALSE(ReplicaBuffer::Create(2, 0, I, DType::kFloat32).ok());
  auto bf = ReplicaBuffer::Create(2, H, I, DType::kBFloat16, DType::kBFloat16);
  ASSERT_TRUE(bf.ok());
  EXPECT_EQ((*bf)->grads()[1].gate.dtype, DType::kBFloat16);
  auto empty = ReplicaBuffer::Create(0, H, I, DType::kFloat32);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE((*empty)->weights().empty());
}

// Every malformed call is an InvalidArgument naming what is wrong, and writes nothing.
class ExecutorArgs : public ::testing::Test {
 protected:
  ExecutorArgs() : p(Spec()) {
    auto made = cpu::CpuExecutor::Create(ExecutorConfig{10, 6, DType::kFloat32, 64, 2});
    ex = std::move(made).value();
    y = Buffer(p.view.total_rows, 10, DType::kFloat32);
    dx = Buffer(p.view.total_rows, 10, DType::kFloat32);
  }
  static ProblemSpec Spec() {
    ProblemSpec s;
    s.hidden = 10;
    s.intermediate = 6;
    s.counts = {3, 0, 9};
    s.pad_multiple = 4;
    return s;
  }
  void ExpectForwardError(const ComputeView& view, const TensorView& x, const TensorView& yv,
                          const std::string& needle, const ForwardOptions& o = {}) {
    absl::Status st = ex->Forward(view, x, yv, o);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_NE(std::string(st.message()).find(needle), std::string::npos)
        << "'" << st.message() << "' lacks '" << needle << "'";
  }
  void ExpectBackwardError(const ComputeView& view, const TensorView& dxv,
                           const std::string& needle, const BackwardOptions& o = {}) {
    absl::Status st = ex->Backward(view, p.x.view(), p.dy.view(), dxv, o);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_NE(std::string(st.message()).find(needle), std::string::npos)
        << "'" << st.message() << "' lacks '" << needle << "'";
  }
  Problem p;
  std::unique_ptr<cpu::CpuExecutor> ex;
  Buffer y, dx;
};

TEST_F(ExecutorArgs, RowsTensors) {
  const int64_t R = p.view.total_rows;
  ASSERT_TRUE(ex->Forward(p.view, p.x.view(), y.view(), {}).ok());
  ExpectForwardError(p.view, TensorView::Contiguous(p.x.data(), DType::kFloat32, {R - 1, 10}),
                     y.view(), "x_rows: expected shape");
  ExpectForwardError(p.view, p.x.view(), TensorView::Contiguous(y.data(), DType::kFloat32, {R, 9}),
                     "y_rows: expected shape");
  ExpectForwardError(p.view, TensorView::Contiguous(p.x.data(), DType::kBFloat16, {R, 10}),
                     y.view(), "x_rows: expected dtype");
  ExpectForwardError(p.view, TensorView::Contiguous(nullptr, DType::kFloat32, {R, 10}), y.view(),
                     "x_rows: null");
  ExpectForwardError(p.view,
                     TensorView::Contiguous(static_cast<char*>(p.x.data()) + 2, DType::kFloat32,
                                            {R, 10}),
                     y.view(), "x_rows: data pointer");
  // y shifted by one row over x: overlap.
  ExpectForwardError(p.view, p.x.view(),
                     TensorView::Contiguous(static_cast<float*>(p.x.data()) + 10, DType::kFloat32,
                                            {R, 10}),
                     "y_rows overlaps x_rows");
  ExpectForwardError(p.view, p.x.view(), TensorView::Contiguous(p.view.groups[0].weights.gate.data,
                                                                DType::kFloat32, {R, 10}),
                     "y_rows overlaps");
  Buffer small(3, 12, DType::kFloat32);
  ForwardOptions fo;
  fo.preactivations = small.view();
  ExpectForwardError(p.view, p.x.view(), y.view(), "options.preactivations", fo);
  ExpectBackwardError(p.view, p.dy.view(), "dx_rows overlaps dy_rows");
  ExpectBackwardError(p.view, p.x.view(), "dx_rows overlaps x_rows");
}

TEST_F(ExecutorArgs, ViewAgainstExecutorAndGroups) {
  ComputeView v = p.view;
  v.hidden = 11;
  ExpectForwardError(v, p.x.view(), y.view(), "view: shape");
  v = p.view;
  v.dtype = DType::kBFloat16;
  ExpectForwardError(v, p.x.view(), y.view(), "view: dtype");
  v = p.view;
  v.total_rows = 65;
  ExpectForwardError(v, p.x.view(), y.view(), "max_rows");
  v = p.view;
  v.groups[2].padded_count = 40;
  ExpectForwardError(v, p.x.view(), y.view(), "group 2: rows");
  v = p.view;
  v.groups[2].row_offset = 2;
  ExpectForwardError(v, p.x.view(), y.view(), "overlap");
  v = p.view;
  v.groups[0].row_count = 5;
  ExpectForwardError(v, p.x.view(), y.view(), "group 0: bad row segment");
  v = p.view;
  v.groups[2].weights.down.data = nullptr;
  ExpectForwardError(v, p.x.view(), y.view(), "group 2 down: null");
  v = p.view;
  v.groups[0].weights.up = v.groups[0].weights.down;
  ExpectForwardError(v, p.x.view(), y.view(), "group 0 up: expected shape");
  v = p.view;
  v.groups[0].weights.gate.data = static_cast<char*>(v.groups[0].weights.gate.data) + 1;
  ExpectForwardError(v, p.x.view(), y.view(), "group 0 gate: data pointer");
  // Backward needs gradients for non-empty groups, not sharing memory.
  v = p.view;
  v.groups[2].grads = ExpertParams{};
  ExpectBackwardError(v, dx.view(), "group 2 grad gate");
  v = p.view;
  v.groups[2].grads.up = v.groups[0].grads.up;
  ExpectBackwardError(v, dx.view(), "overlaps group 2 grad up");
  v = p.view;
  v.groups[0].grads.gate = v.groups[0].weights.gate;
  ExpectBackwardError(v, dx.view(), "grad gate overlaps");
  v = p.view;
  v.groups[0].grads.gate = TensorView::Contiguous(p.x.data(), DType::kFloat32, {10, 6});
  ExpectBackwardError(v, dx.view(), "overlap x_rows");
  // Nothing was written by the rejected calls.
  for (testing::Buffer& g : p.grads)
    for (int64_t r = 0; r < g.rows(); ++r)
      for (int64_t c = 0; c < g.cols(); ++c) ASSERT_EQ(g.Get(r, c), 0.0f);
}

// A strided view into a [rows, stride] block starting at element `offset` of `base`.
TensorView Strided(void* base, DType dt, int64_t offset, int64_t rows, int64_t cols, int64_t stride) {
  TensorView t = TensorView::Contiguous(static_cast<char*>(base) + offset * DTypeSize(dt), dt,
                                        {rows, cols});
  t.strides[0] = stride;
  return t;
}

// TensorsOverlap against brute force: mark every byte of one view, look for any in the other.
TEST(TensorsOverlap, MatchesBruteForce) {
  constexpr int64_t kArena = 1024;  // bytes
  alignas(64) static char arena[kArena];
  std::mt19937_64 rng(99);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  auto random_view = [&]() {
    const DType dt = pick(0, 1) ? DType::kFloat32 : DType::kBFloat16;
    const int64_t e = static_cast<int64_t>(DTypeSize(dt));
    const int64_t rows = pick(1, 6), cols = pick(1, 9), stride = cols + pick(0, 12) * pick(0, 1);
    const int64_t span = ((rows - 1) * stride + cols) * e;
    const int64_t offset = pick(0, (kArena - span) / e);
    return Strided(arena, dt, offset, rows, cols, stride);
  };
  auto bytes_of = [&](const TensorView& t) {
    std::vector<bool> m(kArena, false);
    const int64_t e = static_cast<int64_t>(DTypeSize(t.dtype));
    const int64_t base = static_cast<char*>(t.data) - arena;
    for (int64_t r = 0; r < t.shape[0]; ++r)
      for (int64_t b = 0; b < t.shape[1] * e; ++b) m[base + r * t.strides[0] * e + b] = true;
    return m;
  };
  int overlapping = 0, disjoint_interleaved = 0;
  for (int trial = 0; trial < 40000; ++trial) {
    const TensorView a = random_view();
    TensorView b = random_view();
    if (trial % 2 == 0) {  // same stride, near a: the interleaved (fused) cases
      b = Strided(arena, a.dtype, 0, a.shape[0], pick(1, a.strides[0]), a.strides[0]);
      const int64_t e = static_cast<int64_t>(DTypeSize(a.dtype));
      const int64_t span = ((b.shape[0] - 1) * b.strides[0] + b.shape[1]) * e;
      const int64_t a_off = (static_cast<char*>(a.data) - arena) / e;
      const int64_t off = std::clamp<int64_t>(a_off + pick(-3 * a.strides[0], 3 * a.strides[0]),
                                              0, (kArena - span) / e);
      b.data = arena + off * e;
    }
    const std::vector<bool> ma = bytes_of(a), mb = bytes_of(b);
    bool want = false;
    for (int64_t k = 0; k < kArena && !want; ++k) want = ma[k] && mb[k];
    ASSERT_EQ(TensorsOverlap(a, b), want) << a.DebugString() << " vs " << b.DebugString();
    ASSERT_EQ(TensorsOverlap(b, a), want);
    if (want) ++overlapping;
    else if (RangesOverlap(a.data, SpanBytes(a), b.data, SpanBytes(b))) ++disjoint_interleaved;
  }
  // Both outcomes, and disjoint views whose spans meet, are well represented.
  EXPECT_GT(overlapping, 5000);
  EXPECT_GT(disjoint_interleaved, 1000);
  // Empty views overlap nothing.
  TensorView a = Strided(arena, DType::kFloat32, 0, 4, 4, 4);
  EXPECT_FALSE(TensorsOverlap(a, Strided(arena, DType::kFloat32, 0, 0, 4, 4)));
  EXPECT_FALSE(TensorsOverlap(a, TensorView{}));
}

// Gate and up gradients as the two halves of one fused [H, 2I] tensor (like fused weights) pass
// the view check; any pair of gradient views sharing an element is rejected, naming both.
TEST_F(ExecutorArgs, FusedGradientsAcceptedOverlapsRejected) {
  const int64_t H = 10, I = 6;
  Buffer fused0(H, 2 * I, DType::kFloat32), fused2(H, 2 * I, DType::kFloat32);
  fused0.Fill(0.0f);
  fused2.Fill(0.0f);
  ComputeView v = p.view;
  v.groups[0].grads.gate = Strided(fused0.data(), DType::kFloat32, 0, H, I, 2 * I);
  v.groups[0].grads.up = Strided(fused0.data(), DType::kFloat32, I, H, I, 2 * I);
  v.groups[2].grads.gate = Strided(fused2.data(), DType::kFloat32, 0, H, I, 2 * I);
  v.groups[2].grads.up = Strided(fused2.data(), DType::kFloat32, I, H, I, 2 * I);
  EXPECT_TRUE(CheckComputeView(v, /*need_grads=*/true).ok());
  EXPECT_TRUE(ex->Backward(v, p.x.view(), p.dy.view(), dx.view(), {}).ok());
  p.ZeroGrads();  // that call added into the down gradients

  // Two groups' gate|up pairs interleaved in one [H, 4I] tensor: disjoint, accepted.
  Buffer wide(H, 4 * I, DType::kFloat32);
  wide.Fill(0.0f);
  ComputeView w = p.view;
  for (int k = 0; k < 2; ++k) {
    const int g = k == 0 ? 0 : 2;
    w.groups[g].grads.gate = Strided(wide.data(), DType::kFloat32, 2 * k * I, H, I, 4 * I);
    w.groups[g].grads.up = Strided(wide.data(), DType::kFloat32, (2 * k + 1) * I, H, I, 4 * I);
  }
  EXPECT_TRUE(CheckComputeView(w, true).ok());

  // up shifted one column left: shares column I-1 of every row with gate.
  ComputeView bad = v;
  bad.groups[0].grads.up = Strided(fused0.data(), DType::kFloat32, I - 1, H, I, 2 * I);
  ExpectBackwardError(bad, dx.view(), "group 0 grad gate overlaps group 0 grad up");
  bad = v;
  // A contiguous [H, I] up gradient laid over the gaps of gate's rows: row 0 fits the gap, row 1
  // lands on gate's row 1 (different row strides).
  bad.groups[2].grads.up = Strided(fused0.data(), DType::kFloat32, I, H, I, I);
  ExpectBackwardError(bad, dx.view(), "group 0 grad gate overlaps group 2 grad up");
  // A gradient sharing elements with its own fused weights.
  Buffer fw(H, 2 * I, DType::kFloat32);
  bad = v;
  bad.groups[2].weights.gate = Strided(fw.data(), DType::kFloat32, 0, H, I, 2 * I);
  bad.groups[2].weights.up = Strided(fw.data(), DType::kFloat32, I, H, I, 2 * I);
  for (int64_t r = 0; r < H; ++r)
    for (int64_t c = 0; c < 2 * I; ++c) fw.Set(r, c, p.weights[6 + c / I].Get(r, c % I));
  EXPECT_TRUE(CheckComputeView(bad, true).ok());
  bad.groups[2].grads.up = Strided(fw.data(), DType::kFloat32, I, H, I, 2 * I);
  ExpectBackwardError(bad, dx.view(), "group 2 grad up overlaps its weight up");
  // ... and with another group's weights (read by that group while this gradient is written).
  bad.groups[2].grads.up = v.groups[2].grads.up;
  EXPECT_TRUE(CheckComputeView(bad, true).ok());
  bad.groups[0].grads.up = Strided(fw.data(), DType::kFloat32, I, H, I, 2 * I);
  ExpectBackwardError(bad, dx.view(), "group 0 grad up overlaps group 2 weight up");
  // Nothing was written by the rejected calls.
  for (testing::Buffer& g : p.grads)
    for (int64_t r = 0; r < g.rows(); ++r)
      for (int64_t c = 0; c < g.cols(); ++c) ASSERT_EQ(g.Get(r, c), 0.0f);
}

TEST(ExecutorConfigCheck, RejectsBadConfig) {
  EXPECT_FALSE(cpu::CpuExecutor::Create(ExecutorConfig{0, 4, DType::kFloat32, 8, 1}).ok());
  EXPECT_FALSE(cpu::CpuExecutor::Create(ExecutorConfig{4, 4, DType::kFloat32, -1, 1}).ok());
  EXPECT_FALSE(cpu::CpuExecutor::Create(ExecutorConfig{4, 4, static_cast<DType>(7), 8, 1}).ok());
  EXPECT_FALSE(cpu::CpuExecutor::Create(ExecutorConfig{4, 4, DType::kFloat32, 8, -2}).ok());
  const auto too_many = cpu::CpuExecutor::Create(ExecutorConfig{4, 4, DType::kFloat32, 8, 1025});
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.status().message().find("num_threads 1025 is outside [0, 1024]"),
            std::string::npos) << too_many.status();
  auto ok = cpu::CpuExecutor::Create(ExecutorConfig{4, 4, DType::kFloat32, 0, 0});
  ASSERT_TRUE(ok.ok());
  EXPECT_GE((*ok)->num_threads(), 1);
}


// Row segments near INT64_MAX: offset + padded count once wrapped negative and passed the bounds.
TEST(CheckComputeView, SegmentsPastInt64AreOutOfBounds) {
  float w[3] = {0.5f, 0.25f, 0.125f};
  ComputeView v;
  v.hidden = 1;
  v.intermediate = 1;
  v.total_rows = 4;
  GroupView g;
  g.expert = 0;
  g.row_offset = INT64_MAX - 1;
  g.row_count = 2;
  g.padded_count = 2;
  g.weights = {TensorView::Contiguous(&w[0], DType::kFloat32, {1, 1}),
               TensorView::Contiguous(&w[1], DType::kFloat32, {1, 1}),
               TensorView::Contiguous(&w[2], DType::kFloat32, {1, 1})};
  v.groups = {g};
  absl::Status s = CheckComputeView(v, /*need_grads=*/false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("group 0: rows"), std::string::npos) << s;
  EXPECT_NE(s.message().find("run past total_rows 4"), std::string::npos) << s;
  v.groups[0].row_count = 0;  // padding only: no tensors read, the bounds still hold
  s = CheckComputeView(v, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  v.groups[0].row_offset = INT64_MAX;
  v.groups[0].padded_count = INT64_MAX;
  EXPECT_EQ(CheckComputeView(v, false).code(), absl::StatusCode::kInvalidArgument);
  // In bounds and overlapping, and in bounds side by side.
  v.total_rows = INT64_MAX;
  v.groups = {g, g};
  v.groups[0].row_offset = INT64_MAX - 4;
  v.groups[1].row_offset = INT64_MAX - 3;
  s = CheckComputeView(v, false);
  EXPECT_NE(s.message().find("overlap"), std::string::npos) << s;
  v.groups[1].row_offset = INT64_MAX - 2;
  EXPECT_TRUE(CheckComputeView(v, false).ok());
}

// Sizes past size_t: slots x 3 x H x I x 4 bytes once wrapped to 0 and made a buffer of no bytes.
TEST(ReplicaBuffer, SizesPastSizeTAreRejected) {
  EXPECT_EQ(ReplicaBuffer::BytesFor(1 << 22, int64_t{1} << 20, int64_t{1} << 20, DType::kFloat32,
                                    DType::kFloat32),
            SIZE_MAX);
  EXPECT_EQ(ReplicaBuffer::BytesFor(4, int64_t{1} << 31, int64_t{1} << 31, DType::kBFloat16,
                                    DType::kFloat32),
            SIZE_MAX);
  for (int32_t slots : {4, 0}) {  // no slots: still no slot size past size_t
    auto buf = ReplicaBuffer::Create(slots, int64_t{1} << 31, int64_t{1} << 31, DType::kFloat32);
    ASSERT_FALSE(buf.ok()) << slots;
    EXPECT_EQ(buf.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(buf.status().message().find("hidden (2147483648)"), std::string::npos) << buf.status();
  }
  auto buf = ReplicaBuffer::Create(1 << 22, int64_t{1} << 20, int64_t{1} << 20, DType::kFloat32);
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(buf.status().message().find("4194304 slots"), std::string::npos) << buf.status();
  // Representable sizes keep the formula.
  EXPECT_EQ(ReplicaBuffer::BytesFor(3, 5, 7, DType::kBFloat16, DType::kFloat32),
            (3u * 3 * 5 * 7 * 2 + 63) / 64 * 64 + (3u * 3 * 5 * 7 * 4 + 63) / 64 * 64);
}

// A workspace past size_t (3 * max_rows * I floats = 3 * 2^62, times 4 bytes) once wrapped to a few
// bytes, and Create succeeded with a workspace far smaller than the calls would write.
TEST(ExecutorConfigCheck, WorkspacePastSizeTIsRejected) {
  const ExecutorConfig configs[] = {
      {1, int64_t{1} << 28, DType::kFloat32, int64_t{1} << 34, 1},
      {int64_t{1} << 60, 1, DType::kBFloat16, 1, 1},  // per-thread bf16 panels of 2^60 floats
      {1, int64_t{1} << 60, DType::kBFloat16, 1, 1},
      {INT64_MAX, INT64_MAX, DType::kFloat32, INT64_MAX, 64},
  };
  for (const ExecutorConfig& c : configs) {
    auto ex = cpu::CpuExecutor::Create(c);
    ASSERT_FALSE(ex.ok()) << c.hidden << " " << c.intermediate << " " << c.max_rows;
    EXPECT_EQ(ex.status().code(), absl::StatusCode::kInvalidArgument) << ex.status();
    EXPECT_NE(ex.status().message().find("workspace"), std::string::npos) << ex.status();
    EXPECT_EQ(cpu::CpuWorkspaceBytes(c, c.num_threads), SIZE_MAX);
  }
}

}  // namespace
}  // namespace moonep::compute
