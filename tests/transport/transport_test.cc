// Multi-rank transport suite, parameterised by backend (every entry of AvailableBackends()) and by
// plan source (random replicas/splits through FinalizePlan, and every planner policy). Every rank
// regenerates every rank's input from the seed, so each checks its received rows against a
// brute-force placement and its combined outputs against an fp64 computation.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "moonep/core/dtype.h"
#include "moonep/reference/gradient_check.h"
#include "moonep/reference/reference_moe.h"
#include "planner/planner.h"
#include "tests/harness/mpi_test.h"
#include "tests/transport/plan_kinds.h"
#include "tests/transport/transport_test_util.h"
#include "transport/transport.h"

namespace moonep::transport {
namespace {

using test::BruteForcePlacement;
using test::ExpertOfRow;
using test::MakeProblem;
using test::Problem;

// Plan sources: "home"/"random" build decisions here; the others are planner policies.
const std::vector<std::string> kPlanKinds = {"home",          "random", "none",
                                             "moonep",        "moonep-greedy",
                                             "eplb",          "fastermoe-shadow",
                                             "test-force-replicas"};

using test::CapacityRows;
using test::MakePlanOfKind;
using test::Scale;

std::unique_ptr<Transport> MakeTransport(const std::string& backend, const Problem& p,
                                         int64_t max_row_bytes, int32_t host_threads = 0) {
  TransportOptions o;
  o.max_tokens = std::max<int64_t>(1, p.max_tokens());
  o.max_top_k = p.K;
  o.max_row_bytes = max_row_bytes;
  o.host_threads = host_threads;
  auto t = CreateTransport(backend, o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

// Dispatch -> scaled-identity experts -> combine, then the backward forms, on transport `t` whose
// rank is `me`; every result is checked against the brute-force placement or an fp64 sum.
void CheckForwardBackward(Transport* t, const Problem& p, const planner::Plan& plan, int32_t me) {
  const int32_t R = p.R, E = p.E, K = p.K;
  const int64_t H = p.H;
  const int64_t cap = CapacityRows(p, plan.num_groups(), plan.pad_multiple);
  const int64_t T = p.T[me];
  {
    DispatchHandle h;
    ASSERT_TRUE(t->ExchangeCounts(p.ids[me], T, K, E, cap, &h).ok());
    ASSERT_EQ(std::vector<int64_t>(h.counts().begin(), h.counts().end()), p.counts);

    std::vector<float> rows(cap * H, -1.0f), row_w(cap, -1.0f);
    TensorView x = TensorView::Contiguous(const_cast<float*>(p.x[me].data()), DType::kFloat32, {T, H});
    TensorView rows_v = TensorView::Contiguous(rows.data(), DType::kFloat32, {cap, H});
    t->ResetCounters();
    absl::Status st = t->Dispatch(plan, x, p.weights[me], &h, rows_v, absl::MakeSpan(row_w));
    ASSERT_TRUE(st.ok()) << st;

    // Every row of this rank's layout: the right token's x and top-k weight; the rest zero.
    const auto truth = BruteForcePlacement(p, plan);
    std::vector<char> filled(cap, 0);
    int64_t remote_rows = 0, remote_unique = 0, local_rows = 0;
    for (int32_t s = 0; s < R; ++s) {
      for (int64_t tok = 0; tok < p.T[s]; ++tok) {
        std::vector<int32_t> dests;
        for (int32_t k = 0; k < K; ++k) {
          const auto& pl = truth[s][tok * K + k];
          if (pl.rank < 0) continue;
          if (s == me) {
            if (pl.rank == me) {
              ++local_rows;
            } else {
              ++remote_rows;
              if (std::find(dests.begin(), dests.end(), pl.rank) == dests.end()) ++remote_unique;
            }
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
    // Dedup counters: one row per (token, remote destination).
    const OpCounters c = t->counters(OpKind::kDispatch);
    EXPECT_EQ(c.rows_sent, remote_unique);
    EXPECT_EQ(c.rows_deduplicated, remote_rows - remote_unique);
    EXPECT_EQ(c.bytes_deduplicated, (remote_rows - remote_unique) * H * 4);
    EXPECT_EQ(c.bytes_sent, remote_unique * H * 4 + remote_rows * 8);
    EXPECT_EQ(c.rows_local, local_rows);

    // "Experts": out = scale(e) * row.
    std::vector<float> out(cap * H, 0.0f);
    for (int64_t r = 0; r < plan.rank_rows[me]; ++r) {
      const int32_t e = ExpertOfRow(plan, me, r);
      if (e < 0) continue;
      for (int64_t j = 0; j < H; ++j) out[r * H + j] = Scale(e) * rows[r * H + j];
    }
    TensorView out_v = TensorView::Contiguous(out.data(), DType::kFloat32, {cap, H});
    std::vector<float> y(T * H, 99.0f);
    st = t->Combine(&h, out_v, TensorView::Contiguous(y.data(), DType::kFloat32, {T, H}));
    ASSERT_TRUE(st.ok()) << st;
    for (int64_t tok = 0; tok < T; ++tok) {
      for (int64_t j = 0; j < H; ++j) {
        double want = 0, mag = 0;
        for (int32_t k = 0; k < K; ++k) {
          const int32_t e = p.ids[me][tok * K + k];
          if (e < 0) continue;
          const double term = static_cast<double>(p.weights[me][tok * K + k]) * Scale(e) *
                              p.x[me][tok * H + j];
          want += term;
          mag += std::fabs(term);
        }
        ASSERT_NEAR(y[tok * H + j], want, 1e-5 * mag + 1e-7) << "token " << tok;
      }
    }

    // Backward: dy travels like x; d topk weight = <dy, out>; dx = sum_k scale(e_k) dy.
    std::vector<float> dy_rows(cap * H, -3.0f);
    TensorView dy = TensorView::Contiguous(const_cast<float*>(p.dy[me].data()), DType::kFloat32, {T, H});
    TensorView dy_rows_v = TensorView::Contiguous(dy_rows.data(), DType::kFloat32, {cap, H});
    st = t->CombineBackward(&h, dy, dy_rows_v);
    ASSERT_TRUE(st.ok()) << st;
    for (int32_t s = 0; s < R; ++s) {
      for (int64_t tok = 0; tok < p.T[s]; ++tok) {
        for (int32_t k = 0; k < K; ++k) {
          const auto& pl = truth[s][tok * K + k];
          if (pl.rank != me) continue;
          ASSERT_EQ(0, std::memcmp(&dy_rows[pl.row * H], &p.dy[s][tok * H], H * 4));
        }
      }
    }
    std::vector<float> dw(T * K, 7.0f);
    st = t->TopkWeightGrad(&h, dy_rows_v, out_v, absl::MakeSpan(dw));
    ASSERT_TRUE(st.ok()) << st;
    std::vector<float> dx_rows(cap * H, 0.0f);
    for (int64_t r = 0; r < plan.rank_rows[me]; ++r) {
      const int32_t e = ExpertOfRow(plan, me, r);
      if (e < 0) continue;
      for (int64_t j = 0; j < H; ++j) dx_rows[r * H + j] = Scale(e) * dy_rows[r * H + j];
    }
    std::vector<float> dx(T * H, 5.0f);
    st = t->DispatchBackward(&h, TensorView::Contiguous(dx_rows.data(), DType::kFloat32, {cap, H}),
                             TensorView::Contiguous(dx.data(), DType::kFloat32, {T, H}));
    ASSERT_TRUE(st.ok()) << st;
    for (int64_t tok = 0; tok < T; ++tok) {
      double scale_sum = 0;
      for (int32_t k = 0; k < K; ++k) {
        const int32_t e = p.ids[me][tok * K + k];
        double dot = 0, mag = 0;
        if (e >= 0) {
          scale_sum += Scale(e);
          for (int64_t j = 0; j < H; ++j) {
            dot += static_cast<double>(p.dy[me][tok * H + j]) * Scale(e) * p.x[me][tok * H + j];
            mag += std::fabs(static_cast<double>(p.dy[me][tok * H + j]) * Scale(e) * p.x[me][tok * H + j]);
          }
        }
        ASSERT_NEAR(dw[tok * K + k], dot, 1e-5 * mag + 1e-7) << "token " << tok << " k " << k;
      }
      for (int64_t j = 0; j < H; ++j) {
        const double want = scale_sum * p.dy[me][tok * H + j];
        ASSERT_NEAR(dx[tok * H + j], want, 1e-5 * std::fabs(want) + 1e-7);
      }
    }
    // Counters were kept per operation.
    EXPECT_EQ(t->counters(OpKind::kCombine).calls, 1);
    EXPECT_EQ(t->counters(OpKind::kCombineBackward).calls, 1);
    EXPECT_EQ(t->counters(OpKind::kCombineBackward).rows_sent, remote_unique);
  }
}

class RowsTest : public moonep::testing::MpiTest,
                 public ::testing::WithParamInterface<std::tuple<std::string, std::string>> {};

TEST_P(RowsTest, ForwardAndBackwardMatchBruteForceAndFp64) {
  const std::string backend = std::get<0>(GetParam()), kind = std::get<1>(GetParam());
  const int32_t R = size();
  const int32_t E = 2 * R + (R == 1 ? 2 : 0), K = std::min(4, E);
  for (uint64_t seed : {1u, 2u}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " plan " << kind);
    const Problem p = MakeProblem(R, E, K, 6, 10, seed, R > 1 ? 1 : -1);
    planner::Plan plan;
    ASSERT_TRUE(MakePlanOfKind(kind, p, seed, &plan).ok());
    auto t = MakeTransport(backend, p, p.H * 4);
    ASSERT_NE(t, nullptr);
    CheckForwardBackward(t.get(), p, plan, rank());
    if (HasFatalFailure()) return;
  }
}

// A dispatch large enough for the layouts to run in several chunks on the transport's host pool
// (3 threads, whatever the node has; 1200-2400 tokens of 8 entries a rank): every operation's
// result checked as above.
TEST_P(RowsTest, LargeRoutingOnAHostPool) {
  const std::string backend = std::get<0>(GetParam()), kind = std::get<1>(GetParam());
  if (kind != "random" && kind != "moonep") return;  // two plan sources are enough here
  const int32_t R = size();
  const Problem p = MakeProblem(R, 4 * R, std::min(8, 4 * R), 2, 1200, 61, -1);
  planner::Plan plan;
  ASSERT_TRUE(MakePlanOfKind(kind, p, 61, &plan).ok());
  auto t = MakeTransport(backend, p, p.H * 4, /*host_threads=*/3);
  ASSERT_NE(t, nullptr);
  CheckForwardBackward(t.get(), p, plan, rank());
}

// Bootstrap from a caller's communicator: two halves of the world run independent problems.
TEST_P(RowsTest, RunsOnACallersSubCommunicator) {
  const std::string backend = std::get<0>(GetParam()), kind = std::get<1>(GetParam());
  if (kind != "random") return;  // one plan source is enough here
  MPI_Comm half;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, rank() % 2, rank(), &half), MPI_SUCCESS);
  int sub_rank = 0, sub_size = 1;
  MPI_Comm_rank(half, &sub_rank);
  MPI_Comm_size(half, &sub_size);
  const Problem p = MakeProblem(sub_size, 2 * sub_size, 2, 5, 7, 40 + rank() % 2, -1);
  planner::Plan plan;
  ASSERT_TRUE(MakePlanOfKind(kind, p, 3, &plan).ok());
  TransportOptions o;
  o.comm = half;
  o.max_tokens = p.max_tokens();
  o.max_top_k = p.K;
  o.max_row_bytes = p.H * 4;
  auto t = CreateTransport(backend, o);
  ASSERT_TRUE(t.ok()) << t.status();
  MPI_Comm_free(&half);  // the transport holds its own duplicates
  EXPECT_EQ((*t)->size(), sub_size);
  EXPECT_EQ((*t)->rank(), sub_rank);
  CheckForwardBackward(t->get(), p, plan, sub_rank);
}

class Bf16Test : public RowsTest {};
TEST_P(Bf16Test, Bf16RowsAndOutputs) {
  const std::string backend = std::get<0>(GetParam()), kind = std::get<1>(GetParam());
  const int32_t R = size(), me = rank();
  const int32_t E = 2 * R, K = std::min(3, E);
  const int64_t H = 8;
  const Problem p = MakeProblem(R, E, K, H, 12, 7, -1);
  planner::Plan plan;
  ASSERT_TRUE(MakePlanOfKind(kind, p, 7, &plan).ok());
  auto t = MakeTransport(backend, p, H * 4);
  ASSERT_NE(t, nullptr);
  const int64_t cap = CapacityRows(p, plan.num_groups(), plan.pad_multiple);
  const int64_t T = p.T[me];
  std::vector<BFloat16> xb(T * H);
  ConvertFromFloat(p.x[me].data(), xb.data(), DType::kBFloat16, xb.size());
  DispatchHandle h;
  ASSERT_TRUE(t->ExchangeCounts(p.ids[me], T, K, E, cap, &h).ok());
  std::vector<BFloat16> rows(cap * H);
  std::vector<float> row_w(cap);
  TensorView rows_v = TensorView::Contiguous(rows.data(), DType::kBFloat16, {cap, H});
  absl::Status st = t->Dispatch(plan, TensorView::Contiguous(xb.data(), DType::kBFloat16, {T, H}),
                                p.weights[me], &h, rows_v, absl::MakeSpan(row_w));
  ASSERT_TRUE(st.ok()) << st;
  const auto truth = BruteForcePlacement(p, plan);
  for (int32_t s = 0; s < R; ++s) {
    for (int64_t tok = 0; tok < p.T[s]; ++tok) {
      for (int32_t k = 0; k < K; ++k) {
        const auto& pl = truth[s][tok * K + k];
        if (pl.rank != me) continue;
        for (int64_t j = 0; j < H; ++j) {
          ASSERT_EQ(rows[pl.row * H + j].bits, BFloat16::FromFloat(p.x[s][tok * H + j]).bits);
        }
      }
    }
  }
  // Identity experts, outputs in fp32 and in bf16.
  std::vector<float> y32(T * H);
  std::vector<BFloat16> y16(T * H);
  ASSERT_TRUE(t->Combine(&h, rows_v, TensorView::Contiguous(y32.data(), DType::kFloat32, {T, H})).ok());
  ASSERT_TRUE(t->Combine(&h, rows_v, TensorView::Contiguous(y16.data(), DType::kBFloat16, {T, H})).ok());
  for (int64_t tok = 0; tok < T; ++tok) {
    for (int64_t j = 0; j < H; ++j) {
      double want = 0, mag = 0;
      for (int32_t k = 0; k < K; ++k) {
        if (p.ids[me][tok * K + k] < 0) continue;
        const double term = static_cast<double>(p.weights[me][tok * K + k]) * xb[tok * H + j].ToFloat();
        want += term;
        mag += std::fabs(term);
      }
      ASSERT_NEAR(y32[tok * H + j], want, 1e-5 * mag + 1e-7);
      ASSERT_NEAR(y16[tok * H + j].ToFloat(), want, 1e-2 * mag + 1e-6);
    }
  }
}

// Prefetch while a dispatch is in flight: both through their asynchronous forms.
class OverlapTest : public RowsTest {};
TEST_P(OverlapTest, PrefetchOverlapsDispatch) {
  const std::string backend = std::get<0>(GetParam()), kind = std::get<1>(GetParam());
  const int32_t R = size(), me = rank();
  const int32_t E = 2 * R, K = std::min(2, E);
  const int64_t H = 4, W = 33;
  const Problem p = MakeProblem(R, E, K, H, 8, 11, -1);
  planner::Plan plan;
  ASSERT_TRUE(MakePlanOfKind(kind, p, 11, &plan).ok());
  auto t = MakeTransport(backend, p, H * 4);
  ASSERT_NE(t, nullptr);
  const int64_t cap = CapacityRows(p, plan.num_groups(), plan.pad_multiple);
  const int64_t T = p.T[me];
  const int32_t epn = plan.experts_per_rank, S = plan.slots;
  std::vector<std::vector<float>> home(epn, std::vector<float>(W)), slot(S, std::vector<float>(W, -1));
  std::vector<TensorView> home_v, slot_v;
  for (int32_t g = 0; g < epn; ++g) {
    const int32_t e = plan.local_experts[me * epn + g];
    for (int64_t j = 0; j < W; ++j) home[g][j] = static_cast<float>(e * 1000 + j) * 0.5f;
    home_v.push_back(TensorView::Contiguous(home[g].data(), DType::kFloat32, {W}));
  }
  for (int32_t s = 0; s < S; ++s) slot_v.push_back(TensorView::Contiguous(slot[s].data(), DType::kFloat32, {W}));
  ExpertBlocks blocks{1, home_v, slot_v};

  DispatchHandle h;
  ASSERT_TRUE(t->ExchangeCounts(p.ids[me], T, K, E, cap, &h).ok());
  auto prefetch = t->StartPrefetch(plan, blocks);
  ASSERT_TRUE(prefetch.ok()) << prefetch.status();
  std::vector<float> rows(cap * H), row_w(cap);
  auto dispatch = t->StartDispatch(plan, TensorView::Contiguous(const_cast<float*>(p.x[me].data()), DType::kFloat32, {T, H}),
                                   p.weights[me], &h,
                                   TensorView::Contiguous(rows.data(), DType::kFloat32, {cap, H}),
                                   absl::MakeSpan(row_w));
  ASSERT_TRUE(dispatch.ok()) << dispatch.status();
  bool pf_done = false, dp_done = false;
  while (!pf_done || !dp_done) {
    if (!pf_done) {
      auto r = (*prefetch)->Test();
      ASSERT_TRUE(r.ok()) << r.status();
      pf_done = *r;
    }
    if (!dp_done) {
      auto r = (*dispatch)->Test();
      ASSERT_TRUE(r.ok()) << r.status();
      dp_done = *r;
    }
  }
  ASSERT_TRUE((*prefetch)->Wait().ok());
  for (int32_t s = 0; s < S; ++s) {
    const int32_t e = plan.slot_expert[me * S + s];
    for (int64_t j = 0; j < W; ++j) {
      ASSERT_EQ(slot[s][j], e < 0 ? -1.0f : static_cast<float>(e * 1000 + j) * 0.5f);
    }
  }
  const auto truth = BruteForcePlacement(p, plan);
  for (int32_t s = 0; s < R; ++s) {
    for (int64_t i = 0; i < static_cast<int64_t>(truth[s].size()); ++i) {
      if (truth[s][i].rank != me) continue;
      ASSERT_EQ(0, std::memcmp(&rows[truth[s][i].row * H], &p.x[s][(i / K) * H], H * 4));
    }
  }
}

std::string ParamName(const ::testing::TestParamInfo<RowsTest::ParamType>& info) {
  std::string name = std::get<0>(info.param) + "_" + std::get<1>(info.param);
  for (char& ch : name) {
    if (ch == '-') ch = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Backends, RowsTest,
                         ::testing::Combine(::testing::ValuesIn(AvailableBackends()),
                                            ::testing::ValuesIn(kPlanKinds)),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Backends, Bf16Test,
                         ::testing::Combine(::testing::ValuesIn(AvailableBackends()),
                                            ::testing::Values(std::string("random"),
                                                              std::string("moonep"))),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Backends, OverlapTest,
                         ::testing::Combine(::testing::ValuesIn(AvailableBackends()),
                                            ::testing::Values(std::string("random"),
                                                              std::string("test-force-replicas"))),
                         ParamName);

// Two dispatches in flight at once on one transport (e.g. two layers), with the combine of the first
// overlapping the dispatch of the second: distinct handles, distinct operations, both correct.
TEST_P(OverlapTest, TwoDispatchesInFlight) {
  const std::string backend = std::get<0>(GetParam()), kind = std::get<1>(GetParam());
  const int32_t R = size(), me = rank();
  const Problem a = MakeProblem(R, 2 * R, std::min(2, 2 * R), 4, 6, 51, -1);
  const Problem b = MakeProblem(R, 2 * R, std::min(2, 2 * R), 4, 9, 52, R > 1 ? 0 : -1);
  planner::Plan plan_a, plan_b;
  ASSERT_TRUE(MakePlanOfKind(kind, a, 51, &plan_a).ok());
  ASSERT_TRUE(MakePlanOfKind(kind, b, 52, &plan_b).ok());
  TransportOptions o;
  o.max_tokens = std::max(a.max_tokens(), b.max_tokens());
  o.max_top_k = a.K;
  o.max_row_bytes = a.H * 4;
  auto made = CreateTransport(backend, o);
  ASSERT_TRUE(made.ok()) << made.status();
  Transport* t = made->get();
  const Problem* probs[2] = {&a, &b};
  const planner::Plan* plans[2] = {&plan_a, &plan_b};
  DispatchHandle h[2];
  std::vector<float> rows[2], w[2], y[2];
  int64_t cap[2];
  std::vector<RequestPtr> counts;
  for (int i = 0; i < 2; ++i) {
    const Problem& p = *probs[i];
    cap[i] = CapacityRows(p, plans[i]->num_groups(), plans[i]->pad_multiple);
    rows[i].assign(cap[i] * p.H, 0.0f);
    w[i].assign(cap[i], 0.0f);
    y[i].assign(p.T[me] * p.H, 0.0f);
    auto r = t->StartExchangeCounts(p.ids[me], p.T[me], p.K, p.E, cap[i], &h[i]);
    ASSERT_TRUE(r.ok()) << r.status();
    counts.push_back(std::move(*r));
  }
  for (auto& r : counts) ASSERT_TRUE(r->Wait().ok());
  std::vector<RequestPtr> dispatches;
  for (int i = 0; i < 2; ++i) {
    const Problem& p = *probs[i];
    auto r = t->StartDispatch(*plans[i],
                              TensorView::Contiguous(const_cast<float*>(p.x[me].data()), DType::kFloat32, {p.T[me], p.H}),
                              p.weights[me], &h[i],
                              TensorView::Contiguous(rows[i].data(), DType::kFloat32, {cap[i], p.H}),
                              absl::MakeSpan(w[i]));
    ASSERT_TRUE(r.ok()) << r.status();
    dispatches.push_back(std::move(*r));
  }
  ASSERT_TRUE(dispatches[0]->Wait().ok());
  // Combine of the first (identity experts) while the second dispatch may still be in flight.
  auto combine = t->StartCombine(&h[0], TensorView::Contiguous(rows[0].data(), DType::kFloat32, {cap[0], a.H}),
                                 TensorView::Contiguous(y[0].data(), DType::kFloat32, {a.T[me], a.H}));
  ASSERT_TRUE(combine.ok()) << combine.status();
  ASSERT_TRUE(dispatches[1]->Wait().ok());
  ASSERT_TRUE((*combine)->Wait().ok());
  ASSERT_TRUE(t->Combine(&h[1], TensorView::Contiguous(rows[1].data(), DType::kFloat32, {cap[1], b.H}),
                         TensorView::Contiguous(y[1].data(), DType::kFloat32, {b.T[me], b.H})).ok());
  for (int i = 0; i < 2; ++i) {
    const Problem& p = *probs[i];
    for (int64_t tok = 0; tok < p.T[me]; ++tok) {
      for (int64_t j = 0; j < p.H; ++j) {
        double want = 0, mag = 0;
        for (int32_t k = 0; k < p.K; ++k) {
          if (p.ids[me][tok * p.K + k] < 0) continue;
          want += static_cast<double>(p.weights[me][tok * p.K + k]) * p.x[me][tok * p.H + j];
          mag += std::fabs(static_cast<double>(p.weights[me][tok * p.K + k]) * p.x[me][tok * p.H + j]);
        }
        ASSERT_NEAR(y[i][tok * p.H + j], want, 1e-5 * mag + 1e-7) << "problem " << i;
      }
    }
  }
}

// End to end against the fp64 reference layer: expert weights prefetched into replica slots, the
// SwiGLU FFN applied per row where the plan puts it (home weights or slot weights), combine, and
// d topk_weights from the backward forms.
class ReferenceTest : public RowsTest {};
TEST_P(ReferenceTest, ForwardAndTopkWeightGradMatchReferenceLayer) {
  const std::string backend = std::get<0>(GetParam()), kind = std::get<1>(GetParam());
  const int32_t R = size(), me = rank();
  reference::MoeShape shape{2 * R, std::min(2, 2 * R), 8, 6};
  const int64_t E = shape.num_experts, K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  // Weights (same seed everywhere) rounded to fp32, so reference and transport see equal values.
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
    const int64_t T = (R > 2 && r == 1) ? 0 : 5 + r % 3;
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
  ASSERT_TRUE(MakePlanOfKind(kind, p, 9, &plan).ok());
  TransportOptions o;
  o.max_tokens = std::max<int64_t>(1, p.max_tokens());
  o.max_top_k = p.K;
  o.max_row_bytes = H * 4;
  auto made = CreateTransport(backend, o);
  ASSERT_TRUE(made.ok()) << made.status();
  Transport* t = made->get();

  // Parameter blocks: gate, up, down per expert (fp32).
  const int32_t epn = plan.experts_per_rank, S = plan.slots;
  const int64_t sizes[3] = {H * I, H * I, I * H};
  std::vector<std::vector<float>> store((epn + S) * 3);
  std::vector<TensorView> home_v, slot_v;
  for (int32_t b = 0; b < epn + S; ++b) {
    const int32_t e = b < epn ? plan.local_experts[me * epn + b] : -1;
    const std::vector<double>* src[3] = {&w.wg, &w.wu, &w.wd};
    for (int i = 0; i < 3; ++i) {
      std::vector<float>& v = store[b * 3 + i];
      v.assign(sizes[i], 0.0f);
      if (e >= 0) {
        for (int64_t j = 0; j < sizes[i]; ++j) v[j] = static_cast<float>((*src[i])[e * sizes[i] + j]);
      }
      (b < epn ? home_v : slot_v).push_back(TensorView::Contiguous(v.data(), DType::kFloat32, {sizes[i]}));
    }
  }
  ASSERT_TRUE(t->Prefetch(plan, ExpertBlocks{3, home_v, slot_v}).ok());

  const int64_t T = p.T[me];
  std::vector<float> x(T * H), dy(T * H), tw(T * K);
  for (int64_t i = 0; i < T * H; ++i) {
    x[i] = static_cast<float>(data[me].x[i]);
    dy[i] = static_cast<float>(data[me].dy[i]);
  }
  for (int64_t i = 0; i < T * K; ++i) tw[i] = static_cast<float>(data[me].topk_weights[i]);
  const int64_t cap = CapacityRows(p, plan.num_groups(), plan.pad_multiple);
  DispatchHandle h;
  ASSERT_TRUE(t->ExchangeCounts(p.ids[me], T, p.K, p.E, cap, &h).ok());
  std::vector<float> rows(cap * H), row_w(cap), out(cap * H, 0.0f);
  ASSERT_TRUE(t->Dispatch(plan, TensorView::Contiguous(x.data(), DType::kFloat32, {T, H}), tw, &h,
                          TensorView::Contiguous(rows.data(), DType::kFloat32, {cap, H}),
                          absl::MakeSpan(row_w)).ok());
  // The "executor": per group, the FFN with the weights this rank holds for it (home or slot).
  reference::MoeShape one{1, 1, H, I};
  for (int32_t g = 0; g < plan.num_groups(); ++g) {
    const int64_t off = plan.group_offset[me * plan.num_groups() + g];
    const int64_t n = plan.group_count[me * plan.num_groups() + g];
    if (n == 0) continue;
    reference::ExpertWeights ew;
    ew.wg.assign(store[g * 3 + 0].begin(), store[g * 3 + 0].end());
    ew.wu.assign(store[g * 3 + 1].begin(), store[g * 3 + 1].end());
    ew.wd.assign(store[g * 3 + 2].begin(), store[g * 3 + 2].end());
    std::vector<double> in(H), res(H);
    for (int64_t r = off; r < off + n; ++r) {
      for (int64_t j = 0; j < H; ++j) in[j] = rows[r * H + j];
      reference::ExpertForward(one, ew, 0, in.data(), res.data());
      for (int64_t j = 0; j < H; ++j) out[r * H + j] = static_cast<float>(res[j]);
    }
  }
  std::vector<float> y(T * H);
  TensorView out_v = TensorView::Contiguous(out.data(), DType::kFloat32, {cap, H});
  ASSERT_TRUE(t->Combine(&h, out_v, TensorView::Contiguous(y.data(), DType::kFloat32, {T, H})).ok());
  std::vector<float> dy_rows(cap * H), dw(T * K);
  TensorView dy_rows_v = TensorView::Contiguous(dy_rows.data(), DType::kFloat32, {cap, H});
  ASSERT_TRUE(t->CombineBackward(&h, TensorView::Contiguous(dy.data(), DType::kFloat32, {T, H}), dy_rows_v).ok());
  ASSERT_TRUE(t->TopkWeightGrad(&h, dy_rows_v, out_v, absl::MakeSpan(dw)).ok());

  reference::ForwardResult ref;
  ASSERT_TRUE(reference::Forward(shape, w, T, data[me].x, data[me].topk_ids, data[me].topk_weights, &ref).ok());
  reference::BackwardResult grad;
  ASSERT_TRUE(reference::Backward(shape, w, T, data[me].x, data[me].topk_ids, data[me].topk_weights,
                                  data[me].dy, &grad).ok());
  double scale = 1e-30, dscale = 1e-30;
  for (double v : ref.y) scale = std::max(scale, std::fabs(v));
  for (double v : grad.dtopk_weights) dscale = std::max(dscale, std::fabs(v));
  for (int64_t i = 0; i < T * H; ++i) ASSERT_LT(std::fabs(y[i] - ref.y[i]) / scale, 1e-5) << i;
  for (int64_t i = 0; i < T * K; ++i) {
    ASSERT_LT(std::fabs(dw[i] - grad.dtopk_weights[i]) / dscale, 1e-5) << i;
  }
}
INSTANTIATE_TEST_SUITE_P(Backends, ReferenceTest,
                         ::testing::Combine(::testing::ValuesIn(AvailableBackends()),
                                            ::testing::Values(std::string("random"),
                                                              std::string("moonep"),
                                                              std::string("test-force-replicas"))),
                         ParamName);

// ---------------------------------------------------------------------------------------------
// Expert parameter blocks: prefetch (home -> slots) and gradient reduction (slots -> home).

struct Blocks {
  // [group or slot][tensor] storage; tensor 0: fp32 [4, 6], 1: fp32 [6, 4], 2: bf16 [5].
  std::vector<std::vector<std::vector<float>>> f32;
  std::vector<std::vector<BFloat16>> b16;
  std::vector<TensorView> views;
  static constexpr int kTensors = 3;
  void Init(int32_t n) {
    f32.assign(n, std::vector<std::vector<float>>(2, std::vector<float>(24)));
    b16.assign(n, std::vector<BFloat16>(5));
    views.clear();
    for (int32_t i = 0; i < n; ++i) {
      views.push_back(TensorView::Contiguous(f32[i][0].data(), DType::kFloat32, {4, 6}));
      views.push_back(TensorView::Contiguous(f32[i][1].data(), DType::kFloat32, {6, 4}));
      views.push_back(TensorView::Contiguous(b16[i].data(), DType::kBFloat16, {5}));
    }
  }
  // Sets every element from f(block, tensor, j).
  template <typename F>
  void Fill(F f) {
    for (size_t i = 0; i < f32.size(); ++i) {
      for (int k = 0; k < 2; ++k) {
        for (size_t j = 0; j < 24; ++j) f32[i][k][j] = f(static_cast<int32_t>(i), k, static_cast<int32_t>(j));
      }
      for (size_t j = 0; j < 5; ++j) b16[i][j] = BFloat16::FromFloat(f(static_cast<int32_t>(i), 2, static_cast<int32_t>(j)));
    }
  }
  float Get(int32_t i, int k, int32_t j) const { return k < 2 ? f32[i][k][j] : b16[i][j].ToFloat(); }
  int32_t Size(int k) const { return k < 2 ? 24 : 5; }
};

// Values whose sum depends on the order of summation (magnitudes 2^-12 .. 2^12), a function of
// (rank, expert, tensor, element) so that every rank knows every other rank's.
float OrderSensitive(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = (a * 0x9E3779B97F4A7C15ULL) ^ (b * 0xC2B2AE3D27D4EB4FULL) ^ (c * 0x165667B19E3779F9ULL) ^
               (d * 0xD6E8FEB86659FD93ULL);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 32;
  const float unit = static_cast<float>(x & 0xFFFFFF) / static_cast<float>(0x1000000) - 0.5f;
  return std::ldexp(unit, static_cast<int>((x >> 24) % 25) - 12);
}

// The expected sum of expert e's tensor k element j: ((replica of the lowest holder rank + the next)
// + ...) + home, each value as stored in the tensor's dtype, accumulated in fp32 and stored once
// (the contract of StartReduce), worked out from the plan's slots directly.
float ExpectedChainSum(const planner::Plan& plan, int32_t e, int k, int32_t j, float home_value,
                       const std::function<float(int32_t, int32_t, int, int32_t)>& slot_value) {
  const auto stored = [&](float v) { return k < 2 ? v : BFloat16::FromFloat(v).ToFloat(); };
  bool any = false;
  float acc = 0.0f;
  for (int32_t d = 0; d < plan.num_ranks; ++d) {
    for (int32_t s = 0; s < plan.slots; ++s) {
      if (plan.slot_expert[d * plan.slots + s] != e) continue;
      const float v = stored(slot_value(d, e, k, j));
      acc = any ? acc + v : v;
      any = true;
    }
  }
  return stored(any ? acc + stored(home_value) : home_value);
}

class WeightsTest : public moonep::testing::MpiTest,
                    public ::testing::WithParamInterface<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    const int32_t R = size();
    p_ = MakeProblem(R, 2 * R, std::min(2, 2 * R), 1, 20, 23, -1);
    ASSERT_TRUE(MakePlanOfKind(std::get<1>(GetParam()), p_, 23, &plan_).ok());
    auto t = CreateTransport(std::get<0>(GetParam()), Options());
    ASSERT_TRUE(t.ok()) << t.status();
    t_ = std::move(*t);
    home_.Init(plan_.experts_per_rank);
    slots_.Init(plan_.slots);
  }
  // The transport's options, with replica chunks of `chunk_bytes` (0: the default).
  TransportOptions Options(int64_t chunk_bytes = 0) const {
    TransportOptions o;
    o.max_tokens = p_.max_tokens();
    o.max_top_k = p_.K;
    o.max_row_bytes = 4;
    o.replica_chunk_bytes = chunk_bytes;
    return o;
  }
  ExpertBlocks View() {
    return ExpertBlocks{Blocks::kTensors,
                        absl::MakeConstSpan(home_.views.data(), home_.views.size()),
                        absl::MakeConstSpan(slots_.views.data(), slots_.views.size())};
  }
  int32_t HomeExpert(int32_t g) const { return plan_.local_experts[rank() * plan_.experts_per_rank + g]; }
  int32_t SlotExpert(int32_t s) const { return plan_.slot_expert[rank() * plan_.slots + s]; }

  Problem p_;
  planner::Plan plan_;
  std::unique_ptr<Transport> t_;
  Blocks home_, slots_;
};

TEST_P(WeightsTest, PrefetchMakesEverySlotBitwiseEqualToItsHome) {
  const auto value = [](int32_t e, int k, int32_t j) { return static_cast<float>(e * 64 + k * 8 + j) * 0.375f; };
  home_.Fill([&](int32_t g, int k, int32_t j) { return value(HomeExpert(g), k, j); });
  slots_.Fill([](int32_t, int, int32_t) { return -2.0f; });
  absl::Status st = t_->Prefetch(plan_, View());
  ASSERT_TRUE(st.ok()) << st;
  int replicas = 0;
  for (int32_t s = 0; s < plan_.slots; ++s) {
    const int32_t e = SlotExpert(s);
    replicas += e >= 0;
    for (int k = 0; k < Blocks::kTensors; ++k) {
      for (int32_t j = 0; j < slots_.Size(k); ++j) {
        const float want = e < 0 ? -2.0f : (k < 2 ? value(e, k, j) : BFloat16::FromFloat(value(e, k, j)).ToFloat());
        ASSERT_EQ(slots_.Get(s, k, j), want) << "slot " << s << " expert " << e;
      }
    }
  }
  EXPECT_EQ(t_->counters(OpKind::kPrefetch).rows_received, replicas * Blocks::kTensors);
}

TEST_P(WeightsTest, ReduceSumsContributionsExactly) {
  // Small integers: every order of summation gives the exact sum, so this checks what is summed.
  const auto home_grad = [](int32_t e, int k, int32_t j) { return static_cast<float>((e + k + j) % 7); };
  const auto slot_grad = [](int32_t d, int32_t e, int k, int32_t j) {
    return static_cast<float>((d * 3 + e + k + j) % 5 + 1);
  };
  home_.Fill([&](int32_t g, int k, int32_t j) { return home_grad(HomeExpert(g), k, j); });
  slots_.Fill([&](int32_t s, int k, int32_t j) {
    return SlotExpert(s) < 0 ? 0.0f : slot_grad(rank(), SlotExpert(s), k, j);
  });
  absl::Status st = t_->Reduce(plan_, View());
  ASSERT_TRUE(st.ok()) << st;
  for (int32_t g = 0; g < plan_.experts_per_rank; ++g) {
    const int32_t e = HomeExpert(g);
    for (int k = 0; k < Blocks::kTensors; ++k) {
      for (int32_t j = 0; j < home_.Size(k); ++j) {
        float want = home_grad(e, k, j);
        for (int32_t d = 0; d < plan_.num_ranks; ++d) {
          for (int32_t s = 0; s < plan_.slots; ++s) {
            if (plan_.slot_expert[d * plan_.slots + s] == e) want += slot_grad(d, e, k, j);
          }
        }
        ASSERT_EQ(home_.Get(g, k, j), want) << "expert " << e << " tensor " << k << " j " << j;
      }
    }
  }
}

TEST_P(WeightsTest, TwoReducesInFlightKeepTheirOwnGradients) {
  // Two reductions started before either is waited for, then waited for in reverse order: each
  // must sum its own replica gradients (a staging shared by both hands one the other's, or frees
  // the first one's buffer under its pending receives when the second grows it).
  const auto home_grad = [](int op, int32_t e, int k, int32_t j) {
    return static_cast<float>((e + k + j) % 7 + 16 * op);
  };
  const auto slot_grad = [](int op, int32_t d, int32_t e, int k, int32_t j) {
    return static_cast<float>((d * 3 + e + k + j + op) % 5 + 1 + 8 * op);
  };
  Blocks home[2], slots[2];
  for (int op = 0; op < 2; ++op) {
    home[op].Init(plan_.experts_per_rank);
    slots[op].Init(plan_.slots);
    home[op].Fill([&](int32_t g, int k, int32_t j) { return home_grad(op, HomeExpert(g), k, j); });
    slots[op].Fill([&](int32_t s, int k, int32_t j) {
      return SlotExpert(s) < 0 ? 0.0f : slot_grad(op, rank(), SlotExpert(s), k, j);
    });
  }
  auto view = [&](int op) {
    return ExpertBlocks{Blocks::kTensors,
                        absl::MakeConstSpan(home[op].views.data(), home[op].views.size()),
                        absl::MakeConstSpan(slots[op].views.data(), slots[op].views.size())};
  };
  auto first = t_->StartReduce(plan_, view(0));
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = t_->StartReduce(plan_, view(1));
  ASSERT_TRUE(second.ok()) << second.status();
  absl::Status st = (*second)->Wait();
  ASSERT_TRUE(st.ok()) << st;
  st = (*first)->Wait();
  ASSERT_TRUE(st.ok()) << st;
  for (int op = 0; op < 2; ++op) {
    for (int32_t g = 0; g < plan_.experts_per_rank; ++g) {
      const int32_t e = HomeExpert(g);
      for (int k = 0; k < Blocks::kTensors; ++k) {
        for (int32_t j = 0; j < home[op].Size(k); ++j) {
          float want = home_grad(op, e, k, j);
          for (int32_t d = 0; d < plan_.num_ranks; ++d) {
            for (int32_t s = 0; s < plan_.slots; ++s) {
              if (plan_.slot_expert[d * plan_.slots + s] == e) want += slot_grad(op, d, e, k, j);
            }
          }
          ASSERT_EQ(home[op].Get(g, k, j), want)
              << "reduce " << op << " expert " << e << " tensor " << k << " j " << j;
        }
      }
    }
  }
}

// A reduce and a prefetch in flight, waited for in opposite orders on alternate ranks, with
// chunks of 16 bytes: a holder passes chunks of one on while its rank waits on the other, so
// neither waits for the other rank's wait to end (both used to pass chunks on only inside their
// own Test: each rank waited on the op its neighbour was not moving, until the timeout).
TEST_P(WeightsTest, WeightOpsWaitedInOppositeOrdersOnAlternateRanksComplete) {
  TransportOptions o = Options(16);
  o.timeout_ms = 10000;
  auto made = CreateTransport(std::get<0>(GetParam()), o);
  ASSERT_TRUE(made.ok()) << made.status();
  Transport* t = made->get();
  const auto home_value = [](int32_t e, int k, int32_t j) { return OrderSensitive(7, e, k, j); };
  const auto slot_value = [](int32_t d, int32_t e, int k, int32_t j) {
    return OrderSensitive(static_cast<uint64_t>(d) + 11, e, k, j);
  };
  Blocks params_home, params_slots;  // the prefetch's
  params_home.Init(plan_.experts_per_rank);
  params_slots.Init(plan_.slots);
  params_home.Fill([&](int32_t g, int k, int32_t j) { return home_value(HomeExpert(g) + 100, k, j); });
  params_slots.Fill([](int32_t, int, int32_t) { return -1.0f; });
  home_.Fill([&](int32_t g, int k, int32_t j) { return home_value(HomeExpert(g), k, j); });
  slots_.Fill([&](int32_t s, int k, int32_t j) {
    return SlotExpert(s) < 0 ? 0.0f : slot_value(rank(), SlotExpert(s), k, j);
  });
  const ExpertBlocks params{Blocks::kTensors,
                            absl::MakeConstSpan(params_home.views.data(), params_home.views.size()),
                            absl::MakeConstSpan(params_slots.views.data(), params_slots.views.size())};
  auto reduce = t->StartReduce(plan_, View());
  ASSERT_TRUE(reduce.ok()) << reduce.status();
  auto prefetch = t->StartPrefetch(plan_, params);
  ASSERT_TRUE(prefetch.ok()) << prefetch.status();
  RequestPtr* order[2] = {&*reduce, &*prefetch};
  if (rank() % 2 == 1) std::swap(order[0], order[1]);
  for (RequestPtr* r : order) {
    absl::Status st = (*r)->Wait();
    ASSERT_TRUE(st.ok()) << st;
  }
  for (int32_t g = 0; g < plan_.experts_per_rank; ++g) {
    const int32_t e = HomeExpert(g);
    for (int k = 0; k < Blocks::kTensors; ++k) {
      for (int32_t j = 0; j < home_.Size(k); ++j) {
        ASSERT_EQ(home_.Get(g, k, j), ExpectedChainSum(plan_, e, k, j, home_value(e, k, j), slot_value))
            << "expert " << e << " tensor " << k << " j " << j;
      }
    }
  }
  for (int32_t s = 0; s < plan_.slots; ++s) {
    const int32_t e = SlotExpert(s);
    for (int k = 0; k < Blocks::kTensors; ++k) {
      for (int32_t j = 0; j < params_slots.Size(k); ++j) {
        const float v = e < 0 ? -1.0f : home_value(e + 100, k, j);
        ASSERT_EQ(params_slots.Get(s, k, j), k < 2 ? v : BFloat16::FromFloat(v).ToFloat()) << s;
      }
    }
  }
}

TEST_P(WeightsTest, ReduceIsBitIdenticalAcrossRuns) {
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 3; ++run) {
    std::mt19937 rng(99 + rank());
    std::normal_distribution<float> normal(0.0f, 1.0f);
    home_.Fill([&](int32_t, int, int32_t) { return normal(rng); });
    slots_.Fill([&](int32_t, int, int32_t) { return normal(rng) * 1e-3f; });
    ASSERT_TRUE(t_->Reduce(plan_, View()).ok());
    std::vector<std::vector<float>> got;
    for (int32_t g = 0; g < plan_.experts_per_rank; ++g) {
      for (int k = 0; k < Blocks::kTensors; ++k) {
        std::vector<float> v;
        for (int32_t j = 0; j < home_.Size(k); ++j) v.push_back(home_.Get(g, k, j));
        got.push_back(v);
      }
    }
    if (run == 0) {
      first = got;
    } else {
      ASSERT_EQ(first.size(), got.size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(0, std::memcmp(first[i].data(), got[i].data(), got[i].size() * 4)) << "run " << run;
      }
    }
  }
}

// Along the replica chains, in every chunk size: prefetch copies bit for bit, and reduce sums in
// the contract's order, checked bit for bit on values whose sum depends on the order.
TEST_P(WeightsTest, ChainsPrefetchAndReduceInOrderInEveryChunkSize) {
  const auto home_value = [](int32_t e, int k, int32_t j) { return OrderSensitive(1000, e, k, j); };
  const auto slot_value = [](int32_t d, int32_t e, int k, int32_t j) {
    return OrderSensitive(static_cast<uint64_t>(d), e, k, j + 7);
  };
  // 16 bytes: 4 elements a chunk, so the 24-element tensors go in 6 chunks and the bf16 one in 2;
  // 40: a last chunk shorter than the others; 0: the default (one chunk each here).
  for (const int64_t chunk : {int64_t{0}, int64_t{16}, int64_t{40}}) {
    auto made = CreateTransport(std::get<0>(GetParam()), Options(chunk));
    ASSERT_TRUE(made.ok()) << made.status();
    Transport* t = made->get();
    home_.Fill([&](int32_t g, int k, int32_t j) { return home_value(HomeExpert(g), k, j); });
    slots_.Fill([](int32_t, int, int32_t) { return -3.0f; });
    absl::Status st = t->Prefetch(plan_, View());
    ASSERT_TRUE(st.ok()) << st;
    for (int32_t s = 0; s < plan_.slots; ++s) {
      const int32_t e = SlotExpert(s);
      for (int k = 0; k < Blocks::kTensors; ++k) {
        for (int32_t j = 0; j < slots_.Size(k); ++j) {
          const float v = e < 0 ? -3.0f : home_value(e, k, j);
          const float want = k < 2 ? v : BFloat16::FromFloat(v).ToFloat();
          ASSERT_EQ(slots_.Get(s, k, j), want) << "chunk " << chunk << " slot " << s << " j " << j;
        }
      }
    }
    home_.Fill([&](int32_t g, int k, int32_t j) { return home_value(HomeExpert(g), k, j); });
    slots_.Fill([&](int32_t s, int k, int32_t j) {
      return SlotExpert(s) < 0 ? 0.0f : slot_value(rank(), SlotExpert(s), k, j);
    });
    st = t->Reduce(plan_, View());
    ASSERT_TRUE(st.ok()) << st;
    for (int32_t g = 0; g < plan_.experts_per_rank; ++g) {
      const int32_t e = HomeExpert(g);
      for (int k = 0; k < Blocks::kTensors; ++k) {
        for (int32_t j = 0; j < home_.Size(k); ++j) {
          const float want = ExpectedChainSum(plan_, e, k, j, home_value(e, k, j), slot_value);
          ASSERT_EQ(home_.Get(g, k, j), want)
              << "chunk " << chunk << " expert " << e << " tensor " << k << " j " << j;
        }
      }
    }
  }
}

// The chain's shape, from the counters: per expert with replicas, the home sends one copy of each
// tensor (prefetch) and receives one sum (reduce) whatever the replica count; a holder receives one
// copy and passes it on unless it is the highest holder rank, and passes one partial on.
TEST_P(WeightsTest, ChainsSendEachRankOneCopyPerExpert) {
  const int32_t R = plan_.num_ranks, S = plan_.slots, me = rank();
  int64_t prefetch_sent = 0, prefetch_received = 0, reduce_sent = 0, reduce_received = 0;
  for (int32_t e = 0; e < plan_.num_experts; ++e) {
    std::vector<int32_t> holders;  // increasing rank
    for (int32_t d = 0; d < R; ++d) {
      for (int32_t s = 0; s < S; ++s) {
        if (plan_.slot_expert[d * S + s] == e) holders.push_back(d);
      }
    }
    if (holders.empty()) continue;
    if (plan_.home[e] == me) {
      ++prefetch_sent;
      ++reduce_received;
    }
    for (size_t i = 0; i < holders.size(); ++i) {
      if (holders[i] != me) continue;
      ++prefetch_received;
      ++reduce_sent;
      if (i + 1 < holders.size()) ++prefetch_sent;
      if (i > 0) ++reduce_received;
    }
  }
  home_.Fill([](int32_t, int, int32_t) { return 1.0f; });
  slots_.Fill([](int32_t, int, int32_t) { return 1.0f; });
  t_->ResetCounters();
  ASSERT_TRUE(t_->Prefetch(plan_, View()).ok());
  ASSERT_TRUE(t_->Reduce(plan_, View()).ok());
  const int64_t nt = Blocks::kTensors;
  EXPECT_EQ(t_->counters(OpKind::kPrefetch).rows_sent, prefetch_sent * nt);
  EXPECT_EQ(t_->counters(OpKind::kPrefetch).rows_received, prefetch_received * nt);
  EXPECT_EQ(t_->counters(OpKind::kReduce).rows_sent, reduce_sent * nt);
  EXPECT_EQ(t_->counters(OpKind::kReduce).rows_received, reduce_received * nt);
}

// A plan (hand-made: the planner never makes one) with one expert in two slots of a rank: prefetch
// and reduce refuse it on every rank alike, naming it (a chain to itself crashed the ucx backend),
// and the transport stays usable.
TEST_P(WeightsTest, ExpertTwiceOnARankIsRefusedOnEveryRank) {
  const int32_t R = plan_.num_ranks, S = plan_.slots;
  if (R < 2 || S < 2) GTEST_SKIP() << "needs two ranks and two slots";
  planner::Plan bad = plan_;
  const int32_t e = plan_.local_experts[1 * plan_.experts_per_rank];  // homed on rank 1
  bad.slot_expert[0] = bad.slot_expert[1] = e;                         // rank 0, slots 0 and 1
  for (int op = 0; op < 2; ++op) {
    absl::Status st = op == 0 ? t_->Prefetch(bad, View()) : t_->Reduce(bad, View());
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find("rank 0 holds expert " + std::to_string(e) +
                                             " in two slots (0 and 1)"),
              std::string::npos)
        << st;
  }
  EXPECT_TRUE(t_->health().ok()) << t_->health();
  EXPECT_TRUE(t_->Reduce(plan_, View()).ok());
}

// Chunk sizes that differ across ranks would cut a hop's chunks differently on its two sides:
// creation fails on every rank, naming the option.
TEST_P(WeightsTest, ReplicaChunkBytesDifferingAcrossRanksFailsCreationEverywhere) {
  if (size() < 2) GTEST_SKIP() << "needs two ranks";
  auto made = CreateTransport(std::get<0>(GetParam()), Options(rank() == 0 ? 16 : 32));
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
  EXPECT_NE(std::string(made.status().message()).find("replica_chunk_bytes, else "
                                                      "MOONEP_REPLICA_CHUNK_BYTES) differs across ranks"),
            std::string::npos)
      << made.status();
}

// Tensors of 4099 fp32 elements in chunks of 16 bytes: 1025 chunks a hop, past the mpi backend's
// 256 chunks a peer in flight each way and the ucx backend's one chunk's worth per eager message,
// with a short last chunk; prefetch bitwise, reduce in the contract's order bitwise.
TEST_P(WeightsTest, ManyChunksPerHopKeepTheirOrder) {
  constexpr int64_t kN = 4099;
  auto made = CreateTransport(std::get<0>(GetParam()), Options(16));
  ASSERT_TRUE(made.ok()) << made.status();
  Transport* t = made->get();
  const int32_t epn = plan_.experts_per_rank, S = plan_.slots;
  std::vector<std::vector<float>> home(epn, std::vector<float>(kN)), slot(S, std::vector<float>(kN));
  std::vector<TensorView> hv, sv;
  for (auto& v : home) hv.push_back(TensorView::Contiguous(v.data(), DType::kFloat32, {kN}));
  for (auto& v : slot) sv.push_back(TensorView::Contiguous(v.data(), DType::kFloat32, {kN}));
  const ExpertBlocks blocks{1, hv, sv};
  for (int32_t g = 0; g < epn; ++g) {
    for (int64_t j = 0; j < kN; ++j) home[g][j] = OrderSensitive(3, HomeExpert(g), 0, j);
  }
  for (auto& v : slot) std::fill(v.begin(), v.end(), -5.0f);
  ASSERT_TRUE(t->Prefetch(plan_, blocks).ok());
  for (int32_t s = 0; s < S; ++s) {
    for (int64_t j = 0; j < kN; ++j) {
      const float want = SlotExpert(s) < 0 ? -5.0f : OrderSensitive(3, SlotExpert(s), 0, j);
      ASSERT_EQ(slot[s][j], want) << "slot " << s << " j " << j;
    }
  }
  const auto slot_value = [](int32_t d, int32_t e, int k, int32_t j) {
    return OrderSensitive(static_cast<uint64_t>(d) + 40, e, k, j);
  };
  for (int32_t s = 0; s < S; ++s) {
    for (int64_t j = 0; j < kN; ++j) {
      slot[s][j] = SlotExpert(s) < 0 ? 0.0f : slot_value(rank(), SlotExpert(s), 0, static_cast<int32_t>(j));
    }
  }
  ASSERT_TRUE(t->Reduce(plan_, blocks).ok());
  for (int32_t g = 0; g < epn; ++g) {
    const int32_t e = HomeExpert(g);
    for (int64_t j = 0; j < kN; ++j) {
      const int32_t jj = static_cast<int32_t>(j);
      ASSERT_EQ(home[g][j], ExpectedChainSum(plan_, e, 0, jj, OrderSensitive(3, e, 0, j), slot_value))
          << "expert " << e << " j " << j;
    }
  }
}

TEST_P(WeightsTest, BadReplicaChunkBytesFailsCreationNamingIt) {
  for (const int64_t chunk : {int64_t{-1}, int64_t{8}, (int64_t{1} << 30) + 1}) {
    auto made = CreateTransport(std::get<0>(GetParam()), Options(chunk));
    ASSERT_FALSE(made.ok()) << chunk;
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(made.status().message()).find("replica_chunk_bytes"), std::string::npos)
        << made.status();
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, WeightsTest,
                         ::testing::Combine(::testing::ValuesIn(AvailableBackends()),
                                            ::testing::Values(std::string("random"),
                                                              std::string("moonep"),
                                                              std::string("test-force-replicas"))),
                         ParamName);

}  // namespace
}  // namespace moonep::transport
