// The distributed MoE layer against the fp64 reference, on 1..8 ranks, for every planner policy:
// forward y, backward dx, d topk_weights and weight gradients (replica gradients reduced into
// their home experts), bit-identical repeats, micro-batch accumulation, config agreement.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "moonep/core/host_memory.h"
#include "moonep/core/status.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/moe_layer.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/sim/trace.h"
#include "tests/harness/mpi_test.h"
#include "tests/runtime/layer_problem.h"

namespace moonep::testing {
namespace {

using runtime::Communicator;
using runtime::LayerConfig;
using runtime::LayerHandle;
using runtime::MoeLayer;

constexpr int32_t kTopK = 3;
constexpr int64_t kHidden = 16, kInter = 8, kBaseTokens = 24;

class MoeLayerTest : public CommunicatorTest {
 protected:

  // Experts per rank: 4 on one rank so that E >= K, else 2.
  int32_t epn() const { return size() == 1 ? 4 : 2; }

  LayerConfig Config(DType dtype, planner::Policy policy) const {
    LayerConfig c;
    c.num_experts = epn() * size();
    c.top_k = kTopK;
    c.hidden = kHidden;
    c.intermediate = kInter;
    c.dtype = dtype;
    c.policy = policy;
    c.max_tokens = kBaseTokens + 8;
    c.num_threads = 1;
    return c;
  }

  struct Errors {
    double y = 0, dx = 0, dtopk = 0, dw = 0;
  };

  // One forward + backward of `t` on `layer`, compared with the reference of the whole problem
  // (whose experts per rank are `experts_per_rank`, -1: epn()).
  void StepAndCompare(MoeLayer* layer, const GlobalProblem& g, RankTensors* t, DType dtype,
                      Errors* err, int32_t experts_per_rank = -1) {
    const int32_t epn = experts_per_rank < 0 ? this->epn() : experts_per_rank;
    auto h = RunForward(layer, t, dtype, kHidden);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(RunBackward(layer, *h, t, dtype, kHidden).ok());
    reference::ForwardResult f;
    reference::BackwardResult b;
    ASSERT_TRUE(ReferenceLayer(g, &f, &b).ok());
    const int64_t o = g.offset[rank()], T = t->tokens;
    err->y = RelError(Decode(t->y, dtype), f.y.data() + o * kHidden, T * kHidden);
    err->dx = RelError(Decode(t->dx, dtype), b.dx.data() + o * kHidden, T * kHidden);
    std::vector<double> dtopk(t->dtopk.begin(), t->dtopk.end());
    err->dtopk = RelError(dtopk, b.dtopk_weights.data() + o * kTopK, T * kTopK);
    const size_t block = kHidden * kInter, first = rank() * epn * block;
    for (auto pair : {std::make_pair(&t->gg, &b.dwg), std::make_pair(&t->gu, &b.dwu),
                      std::make_pair(&t->gd, &b.dwd)}) {
      std::vector<double> got(pair.first->begin(), pair.first->end());
      err->dw = std::max(err->dw, RelError(got, pair.second->data() + first, epn * block));
    }
  }

};

const planner::Policy kPolicies[] = {
    planner::Policy::kNone,         planner::Policy::kMoonEP,
    planner::Policy::kMoonEPGreedy, planner::Policy::kEplb,
    planner::Policy::kFasterMoEShadow, planner::Policy::kTestForceReplicas};

TEST_F(MoeLayerTest, EveryPolicyMatchesReference) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const double tol = dtype == DType::kFloat32 ? 1e-5 : 1e-2;
    for (planner::Policy policy : kPolicies) {
      SCOPED_TRACE(std::string(planner::PolicyName(policy)) + " " + DTypeName(dtype));
      GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype,
                                          100 + static_cast<int>(policy));
      LayerConfig config = Config(dtype, policy);
      if (policy == planner::Policy::kTestForceReplicas) config.pad_multiple = 4;
      auto layer = MoeLayer::Create(comm_.get(), config);
      ASSERT_TRUE(layer.ok()) << layer.status();
      RankTensors t = MakeRankTensors(g, rank(), dtype);
      ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
      Errors err;
      StepAndCompare(layer->get(), g, &t, dtype, &err);
      if (rank() == 0) std::printf("%-20s %s y %.2e dx %.2e dtopk %.2e dw %.2e replicas %d max %ld/%ld\n", planner::PolicyName(policy), DTypeName(dtype), err.y, err.dx, err.dtopk, err.dw, (*layer)->stats().plan.replicas, (long)(*layer)->stats().plan.max_load_before, (long)(*layer)->stats().plan.max_load_after);
      EXPECT_LT(err.y, tol);
      EXPECT_LT(err.dx, tol);
      EXPECT_LT(err.dtopk, tol);
      EXPECT_LT(err.dw, tol);
      const auto& stats = (*layer)->stats();
      EXPECT_EQ(stats.plan.total_tokens,
                std::count_if(g.p.topk_ids.begin(), g.p.topk_ids.end(),
                              [](int32_t e) { return e >= 0; }));
      if (policy == planner::Policy::kTestForceReplicas && size() > 1) {
        EXPECT_GT(stats.plan.replicas, 0);
      }
      if (policy == planner::Policy::kMoonEP) {
        // Perfect balance: every rank computes ceil or floor of the mean.
        EXPECT_LE(stats.plan.max_load_after,
                  static_cast<int64_t>(std::ceil(stats.plan.mean_load)));
      }
    }
  }
}

TEST_F(MoeLayerTest, RepeatsAreBitIdentical) {
  const DType dtype = DType::kFloat32;
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 7);
  auto layer = MoeLayer::Create(comm_.get(), Config(dtype, planner::Policy::kTestForceReplicas));
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::vector<RankTensors> runs;
  for (int i = 0; i < 2; ++i) {
    runs.push_back(MakeRankTensors(g, rank(), dtype));
    RankTensors& t = runs.back();
    ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
    auto h = RunForward(layer->get(), &t, dtype, kHidden);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(RunBackward(layer->get(), *h, &t, dtype, kHidden).ok());
  }
  EXPECT_EQ(runs[0].y, runs[1].y);
  EXPECT_EQ(runs[0].dx, runs[1].dx);
  EXPECT_EQ(runs[0].dtopk, runs[1].dtopk);
  EXPECT_EQ(runs[0].gg, runs[1].gg);
  EXPECT_EQ(runs[0].gu, runs[1].gu);
  EXPECT_EQ(runs[0].gd, runs[1].gd);
}

TEST_F(MoeLayerTest, TwoMicroBatchesAccumulate) {
  const DType dtype = DType::kFloat32;
  LayerConfig config = Config(dtype, planner::Policy::kMoonEP);
  config.max_inflight = 2;
  auto layer = MoeLayer::Create(comm_.get(), config);
  ASSERT_TRUE(layer.ok()) << layer.status();
  GlobalProblem g1 = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 11);
  GlobalProblem g2 = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens - 5,
                                       dtype, 11);  // same weights (same seed), other tokens
  SkewedRouting(g2.total, epn() * size(), kTopK, 2.0, 0.1, 99, &g2.p.topk_ids, &g2.p.topk_weights);
  for (double& w : g2.p.topk_weights) w = static_cast<float>(w);
  RankTensors t1 = MakeRankTensors(g1, rank(), dtype);
  RankTensors t2 = MakeRankTensors(g2, rank(), dtype);
  ASSERT_TRUE((*layer)->BindParameters(t1.params, t1.grads).ok());
  // Pipeline order: both forwards, then the backwards in reverse.
  auto h1 = RunForward(layer->get(), &t1, dtype, kHidden);
  ASSERT_TRUE(h1.ok()) << h1.status();
  auto h2 = RunForward(layer->get(), &t2, dtype, kHidden);
  ASSERT_TRUE(h2.ok()) << h2.status();
  auto h3 = RunForward(layer->get(), &t2, dtype, kHidden);
  EXPECT_EQ(ToResult(h3.status()), moonepInvalidUsage) << h3.status();  // only 2 in flight
  ASSERT_TRUE(RunBackward(layer->get(), *h2, &t2, dtype, kHidden).ok());
  ASSERT_TRUE(RunBackward(layer->get(), *h1, &t1, dtype, kHidden).ok());
  // A spent handle's backward fails every rank's backward (the layer is unusable afterwards):
  // every rank is done with the backwards above first, or the first rank here fails a slower one.
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_EQ(ToResult(RunBackward(layer->get(), *h1, &t1, dtype, kHidden)), moonepInvalidUsage);

  reference::BackwardResult b1, b2;
  ASSERT_TRUE(reference::Backward(g1.shape, g1.p.weights, g1.total, g1.p.x, g1.p.topk_ids,
                                  g1.p.topk_weights, g1.p.dy, &b1).ok());
  ASSERT_TRUE(reference::Backward(g2.shape, g2.p.weights, g2.total, g2.p.x, g2.p.topk_ids,
                                  g2.p.topk_weights, g2.p.dy, &b2).ok());
  const size_t block = kHidden * kInter, first = rank() * epn() * block;
  for (auto pair : {std::make_tuple(&t1.gg, &b1.dwg, &b2.dwg), std::make_tuple(&t1.gu, &b1.dwu, &b2.dwu),
                    std::make_tuple(&t1.gd, &b1.dwd, &b2.dwd)}) {
    std::vector<double> got(std::get<0>(pair)->begin(), std::get<0>(pair)->end());
    std::vector<double> want(epn() * block);
    for (size_t i = 0; i < want.size(); ++i) {
      want[i] = (*std::get<1>(pair))[first + i] + (*std::get<2>(pair))[first + i];
    }
    EXPECT_LT(RelError(got, want.data(), want.size()), 1e-5);
  }
  const int64_t o2 = g2.offset[rank()];
  EXPECT_LT(RelError(Decode(t2.dx, dtype), b2.dx.data() + o2 * kHidden, t2.tokens * kHidden), 1e-5);
}

TEST_F(MoeLayerTest, ConfigMismatchFailsOnEveryRank) {
  struct Case {
    const char* field;
    void (*mutate)(LayerConfig*);
  };
  const Case cases[] = {
      {"num_experts", [](LayerConfig* c) { c->num_experts *= 2; }},
      {"top_k", [](LayerConfig* c) { c->top_k = 1; }},
      {"hidden", [](LayerConfig* c) { c->hidden += 8; }},
      {"dtype", [](LayerConfig* c) { c->dtype = DType::kBFloat16; }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.field);
    LayerConfig config = Config(DType::kFloat32, planner::Policy::kMoonEP);
    if (rank() == size() - 1) k.mutate(&config);
    auto layer = MoeLayer::Create(comm_.get(), config);
    if (size() == 1) {
      EXPECT_TRUE(layer.ok()) << layer.status();
      continue;
    }
    ASSERT_FALSE(layer.ok());
    EXPECT_EQ(ToResult(layer.status()), moonepInvalidArgument);
    EXPECT_NE(std::string(layer.status().message()).find(k.field), std::string::npos)
        << layer.status();
  }
  // A config that is invalid on one rank fails there with the reason, and remotely elsewhere.
  LayerConfig config = Config(DType::kFloat32, planner::Policy::kMoonEP);
  if (rank() == 0) config.max_tokens = 0;
  auto layer = MoeLayer::Create(comm_.get(), config);
  ASSERT_FALSE(layer.ok());
  if (rank() == 0) {
    EXPECT_NE(std::string(layer.status().message()).find("max_tokens"), std::string::npos);
  } else {
    EXPECT_EQ(ToResult(layer.status()), moonepRemoteError) << layer.status();
  }
  // Creations that failed leave no replica buffer behind on the communicator (they are made
  // before the agreement).
  if (size() > 1) {
    EXPECT_EQ(comm_->ReplicaBytes(), 0u);
  }
}

// Speeds reach the planner: the layer's plan is the planner's own for the same counts and speeds;
// balancing time, it leaves no rank slower (rows over speed) than the plan made without the
// speeds would; and the step still matches the reference.
TEST_F(MoeLayerTest, SpeedsBalanceTimeNotTokens) {
  const DType dtype = DType::kFloat32;
  LayerConfig config = Config(dtype, planner::Policy::kMoonEP);
  config.speeds.assign(static_cast<size_t>(size()), 1.0);
  config.speeds.back() = 3.0;
  GlobalProblem g =
      MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 21);
  auto layer = MoeLayer::Create(comm_.get(), config);
  ASSERT_TRUE(layer.ok()) << layer.status();
  RankTensors t = MakeRankTensors(g, rank(), dtype);
  ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
  auto h = RunForward(layer->get(), &t, dtype, kHidden);
  ASSERT_TRUE(h.ok()) << h.status();
  auto plan = (*layer)->PlanOf(*h);
  ASSERT_TRUE(plan.ok()) << plan.status();

  const int32_t E = config.num_experts;
  std::vector<int64_t> counts(static_cast<size_t>(size()) * E, 0);
  for (int32_t r = 0; r < size(); ++r) {
    for (int64_t tok = g.offset[r]; tok < g.offset[r] + g.tokens[r]; ++tok) {
      for (int32_t k = 0; k < kTopK; ++k) {
        const int32_t e = g.p.topk_ids[tok * kTopK + k];
        if (e >= 0) ++counts[static_cast<size_t>(r) * E + e];
      }
    }
  }
  // The reference planner gets the speeds here, not from PlannerConfigFor (which must pass them).
  LayerConfig unaware = config;
  unaware.speeds.clear();
  EXPECT_EQ(runtime::PlannerConfigFor(config, size(), epn()).speeds, config.speeds);
  auto plan_for = [&](const std::vector<double>& speeds) {
    planner::PlannerConfig pc = runtime::PlannerConfigFor(unaware, size(), epn());
    pc.speeds = speeds;
    auto p = planner::Planner::Create(pc);
    EXPECT_TRUE(p.ok()) << p.status();
    planner::Plan out;
    EXPECT_TRUE((*p)->MakePlan(counts, &out).ok());
    return out;
  };
  const planner::Plan want = plan_for(config.speeds);
  EXPECT_EQ(planner::SerializePlan(**plan), planner::SerializePlan(want));
  const planner::Plan tokens_balanced = plan_for({});
  auto slowest = [&](const planner::Plan& p) {
    double worst = 0;
    for (int32_t d = 0; d < size(); ++d) {
      worst = std::max(worst, static_cast<double>(p.rank_rows[d]) / config.speeds[d]);
    }
    return worst;
  };
  if (size() > 1) {
    EXPECT_LT(slowest(want), slowest(tokens_balanced));
  } else {
    EXPECT_EQ(slowest(want), slowest(tokens_balanced));
  }
  for (int32_t d = 0; d + 1 < size(); ++d) EXPECT_GE(want.rank_rows.back(), want.rank_rows[d]);
  if (rank() == 0) {
    std::printf("speeds: rows %s (over speed %.1f) vs %s without speeds (%.1f)\n",
                absl::StrJoin(want.rank_rows, ",").c_str(), slowest(want),
                absl::StrJoin(tokens_balanced.rank_rows, ",").c_str(), slowest(tokens_balanced));
  }
  ASSERT_TRUE((*layer)->Release(*h).ok());

  Errors err;
  StepAndCompare(layer->get(), g, &t, dtype, &err);
  EXPECT_LT(err.y, 1e-5);
  EXPECT_LT(err.dx, 1e-5);
  EXPECT_LT(err.dtopk, 1e-5);
  EXPECT_LT(err.dw, 1e-5);
}

// Speeds must agree: given on one rank only, or other values on one rank, fails every rank naming
// them; a wrong count or value fails where it was passed, the peers remotely.
TEST_F(MoeLayerTest, SpeedsMustAgreeAndBeValid) {
  const LayerConfig base = Config(DType::kFloat32, planner::Policy::kMoonEP);
  auto expect_failure = [&](const LayerConfig& config, bool mine, const char* words) {
    auto layer = MoeLayer::Create(comm_.get(), config);
    ASSERT_FALSE(layer.ok());
    if (mine) {
      EXPECT_EQ(ToResult(layer.status()), moonepInvalidArgument) << layer.status();
      EXPECT_NE(std::string(layer.status().message()).find(words), std::string::npos)
          << layer.status();
    } else {
      EXPECT_EQ(ToResult(layer.status()), moonepRemoteError) << layer.status();
    }
  };
  if (size() > 1) {
    LayerConfig one = base;
    if (rank() == 1) one.speeds.assign(static_cast<size_t>(size()), 1.0);
    expect_failure(one, true, "the number of speeds");
    LayerConfig other = base;
    other.speeds.assign(static_cast<size_t>(size()), 1.0);
    if (rank() == size() - 1) other.speeds[0] = 1.5;
    expect_failure(other, true, "speeds (");
  }
  LayerConfig count = base;
  count.speeds.assign(static_cast<size_t>(size()), 1.0);
  if (rank() == 0) count.speeds.push_back(1.0);
  expect_failure(count, rank() == 0, "speeds has");
  LayerConfig value = base;
  value.speeds.assign(static_cast<size_t>(size()), 1.0);
  if (rank() == 0) value.speeds[0] = 0.0;
  expect_failure(value, rank() == 0, "speeds[0] is 0");
  if (rank() == 0) value.speeds[0] = std::nan("");
  expect_failure(value, rank() == 0, "speeds[0] is nan");
  // Speeds with a policy that plans as if every rank were alike: refused naming it.
  LayerConfig eplb = Config(DType::kFloat32, planner::Policy::kEplb);
  eplb.speeds.assign(static_cast<size_t>(size()), 1.0);
  expect_failure(eplb, true, "speeds are for policies moonep and moonep-greedy; policy eplb");
  // Equal speeds on every rank plan as none: the same plan as a layer without them.
  LayerConfig same = base;
  same.speeds.assign(static_cast<size_t>(size()), 2.0);
  GlobalProblem g =
      MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, DType::kFloat32, 5);
  std::string plans[2];
  for (int i = 0; i < 2; ++i) {
    auto layer = MoeLayer::Create(comm_.get(), i == 0 ? same : base);
    ASSERT_TRUE(layer.ok()) << layer.status();
    RankTensors t = MakeRankTensors(g, rank(), DType::kFloat32);
    ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
    auto h = RunForward(layer->get(), &t, DType::kFloat32, kHidden);
    ASSERT_TRUE(h.ok()) << h.status();
    auto plan = (*layer)->PlanOf(*h);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plans[i] = planner::SerializePlan(**plan);
    ASSERT_TRUE((*layer)->Release(*h).ok());
  }
  EXPECT_EQ(plans[0], plans[1]);
}

TEST_F(MoeLayerTest, BadRoutingFailsEverywhereAndLayerStaysUsable) {
  const DType dtype = DType::kFloat32;
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 5);
  auto layer = MoeLayer::Create(comm_.get(), Config(dtype, planner::Policy::kMoonEP));
  ASSERT_TRUE(layer.ok()) << layer.status();
  RankTensors t = MakeRankTensors(g, rank(), dtype);
  ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
  RankTensors bad = t;
  if (rank() == size() - 1) bad.ids[1] = epn() * size();  // out of range
  auto h = RunForward(layer->get(), &bad, dtype, kHidden);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(ToResult(h.status()), rank() == size() - 1 ? moonepInvalidArgument : moonepRemoteError)
      << h.status();
  // A local argument error (y of the wrong size) also fails every rank at once.
  if (rank() == 0) {
    auto h2 = (*layer)->Forward(t.tokens, TensorView::Contiguous(t.x.data(), dtype, {t.tokens, kHidden}),
                                t.ids, t.weights,
                                TensorView::Contiguous(t.y.data(), dtype, {t.tokens, kHidden - 1}));
    ASSERT_FALSE(h2.ok());
    EXPECT_NE(std::string(h2.status().message()).find("y"), std::string::npos) << h2.status();
  } else {
    auto h2 = RunForward(layer->get(), &t, dtype, kHidden);
    ASSERT_FALSE(h2.ok());
    EXPECT_EQ(ToResult(h2.status()), moonepRemoteError) << h2.status();
  }
  Errors err;
  StepAndCompare(layer->get(), g, &t, dtype, &err);
  EXPECT_LT(err.y, 1e-5);
  EXPECT_LT(err.dw, 1e-5);
}

// Rebinding is local, so it must not change what a step does collectively: refused while a
// forward handle is outstanding (on one rank only here; the step then completes on every rank),
// and between steps (on one rank only, the same tensors) the next steps still match the reference.
TEST_F(MoeLayerTest, RebindOnOneRankKeepsTheStepsInStep) {
  const DType dtype = DType::kFloat32;
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 8);
  auto layer = MoeLayer::Create(comm_.get(), Config(dtype, planner::Policy::kTestForceReplicas));
  ASSERT_TRUE(layer.ok()) << layer.status();
  RankTensors t = MakeRankTensors(g, rank(), dtype);
  ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
  auto h = RunForward(layer->get(), &t, dtype, kHidden);
  ASSERT_TRUE(h.ok()) << h.status();
  if (rank() == 0) {
    const absl::Status rebind = (*layer)->BindParameters(t.params, t.grads);
    EXPECT_EQ(ToResult(rebind), moonepInvalidUsage) << rebind;
  }
  ASSERT_TRUE(RunBackward(layer->get(), *h, &t, dtype, kHidden).ok());
  if (rank() == 0) {
    ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
  }
  RankTensors fresh = MakeRankTensors(g, rank(), dtype);  // gradients start from zero again
  ASSERT_TRUE((*layer)->BindParameters(fresh.params, fresh.grads).ok());
  Errors err;
  StepAndCompare(layer->get(), g, &fresh, dtype, &err);
  EXPECT_LT(err.y, 1e-5);
  EXPECT_LT(err.dx, 1e-5);
  EXPECT_LT(err.dw, 1e-5);
}

TEST_F(MoeLayerTest, TraceRecordsCountsOfEveryStep) {
  const std::string path = "moonep_runtime_trace_test_" + std::to_string(size()) + ".txt";
  if (rank() == 0) std::remove(path.c_str());
  ASSERT_TRUE(comm_->SetTracePath(path).ok());
  const DType dtype = DType::kFloat32;
  LayerConfig config = Config(dtype, planner::Policy::kMoonEP);
  config.layer_id = 3;
  auto layer = MoeLayer::Create(comm_.get(), config);
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::vector<GlobalProblem> problems;
  for (int step = 0; step < 2; ++step) {
    problems.push_back(MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype,
                                         40 + step));
    RankTensors t = MakeRankTensors(problems.back(), rank(), dtype);
    ASSERT_TRUE((*layer)->BindParameters(t.params, {}).ok());
    auto h = RunForward(layer->get(), &t, dtype, kHidden);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE((*layer)->Release(*h).ok());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() != 0) return;
  comm_->SetTracePath("").IgnoreError();  // flush and close
  std::ifstream in(path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const int32_t E = epn() * size();
  EXPECT_EQ(line, "# moonep-trace v1 R=" + std::to_string(size()) + " E=" + std::to_string(E) +
                      " K=" + std::to_string(kTopK));
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(std::getline(in, line));
    std::istringstream fields(line);
    int64_t s = -1, l = -1;
    fields >> s >> l;
    EXPECT_EQ(s, step);
    EXPECT_EQ(l, 3);
    // Brute-force counts from the global routing.
    const GlobalProblem& g = problems[step];
    for (int32_t src = 0; src < size(); ++src) {
      for (int32_t e = 0; e < E; ++e) {
        int64_t want = 0;
        for (int64_t i = g.offset[src] * kTopK; i < (g.offset[src] + g.tokens[src]) * kTopK; ++i) {
          want += g.p.topk_ids[i] == e;
        }
        int64_t got = -1;
        fields >> got;
        EXPECT_EQ(got, want) << "src " << src << " expert " << e;
      }
    }
  }
  EXPECT_FALSE(std::getline(in, line));
  // The simulator's reader replays the same records.
  auto reader = sim::TraceReader::Open(path, sim::TraceFormat::kAuto, 0, 0);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->num_ranks(), size());
  EXPECT_EQ((*reader)->num_experts(), E);
  EXPECT_EQ((*reader)->topk(), kTopK);
  sim::TraceRecord record;
  for (int step = 0; step < 2; ++step) {
    auto more = (*reader)->Next(&record);
    ASSERT_TRUE(more.ok() && *more) << more.status();
    EXPECT_EQ(record.step, step);
    EXPECT_EQ(record.layer, 3);
    EXPECT_EQ(record.counts.size(), static_cast<size_t>(size()) * E);
  }
  auto end = (*reader)->Next(&record);
  ASSERT_TRUE(end.ok());
  EXPECT_FALSE(*end);
  std::remove(path.c_str());
}

// The default receive capacity is the worst case over every rank's max_tokens, which may differ:
// the last rank may pass 100 tokens, the others 4, and every token of every rank goes to rank 0's
// first K experts (policy none: nothing is moved off rank 0). Rank 0 then receives
// sum(max_tokens) * K rows although its own max_tokens is 4; the step fits and matches the fp64
// reference.
TEST_F(MoeLayerTest, DefaultCapacityIsTheWorstCaseOverEveryRanksMaxTokens) {
  if (size() < 2) GTEST_SKIP() << "needs ranks with different max_tokens";
  const DType dtype = DType::kFloat32;
  constexpr int32_t kEpn = 4;  // >= K: all K experts of a token can be rank 0's
  GlobalProblem g;
  g.num_ranks = size();
  g.shape.num_experts = static_cast<int64_t>(kEpn) * size();
  g.shape.top_k = kTopK;
  g.shape.hidden = kHidden;
  g.shape.intermediate = kInter;
  for (int32_t r = 0; r < size(); ++r) {
    g.offset.push_back(g.total);
    g.tokens.push_back(r == size() - 1 ? 100 : 4);
    g.total += g.tokens.back();
  }
  g.p = reference::MakeRandomProblem(g.shape, g.total, 31, 0.0);
  ASSERT_EQ(g.p.topk_ids.size(), static_cast<size_t>(g.total * kTopK));
  for (int64_t i = 0; i < g.total * kTopK; ++i) g.p.topk_ids[i] = static_cast<int32_t>(i % kTopK);
  for (auto* v : {&g.p.weights.wg, &g.p.weights.wu, &g.p.weights.wd, &g.p.x, &g.p.dy,
                  &g.p.topk_weights}) {
    for (double& x : *v) x = RoundTo(dtype, x);
  }

  LayerConfig config = Config(dtype, planner::Policy::kNone);
  config.num_experts = kEpn * size();
  config.max_tokens = g.tokens[rank()];  // differs between ranks
  auto layer = MoeLayer::Create(comm_.get(), config);
  ASSERT_TRUE(layer.ok()) << layer.status();
  // sum of max_tokens * min(K, G = E/R + slots), no padding.
  EXPECT_EQ((*layer)->recv_capacity_rows(), g.total * std::min<int64_t>(kTopK, 2 * kEpn));
  RankTensors t = MakeRankTensors(g, rank(), dtype);
  ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
  Errors err;
  StepAndCompare(layer->get(), g, &t, dtype, &err, kEpn);
  EXPECT_LT(err.y, 1e-5);
  EXPECT_LT(err.dx, 1e-5);
  EXPECT_LT(err.dtopk, 1e-5);
  EXPECT_LT(err.dw, 1e-5);
  EXPECT_EQ((*layer)->stats().rank_rows, rank() == 0 ? g.total * kTopK : 0);
}

// The host transports' staging of every handle is allocated at creation and reported: the layer's
// memory includes it at the size of the formula (transport::Transport::PrepareHandle), and a
// forward + backward allocates none of it (it is already at its final size).
TEST_F(MoeLayerTest, MemoryIncludesTransportStagingMadeAtCreation) {
  const DType dtype = DType::kFloat32;
  LayerConfig config = Config(dtype, planner::Policy::kTestForceReplicas);
  config.max_inflight = 2;
  auto layer = MoeLayer::Create(comm_.get(), config);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ASSERT_NE(std::string((*layer)->transport()->backend()), "nccl");
  const size_t cap = static_cast<size_t>((*layer)->recv_capacity_rows());
  const size_t entries = static_cast<size_t>(config.max_tokens) * kTopK;
  const size_t row = kHidden * DTypeSize(dtype);
  const size_t staging = entries * (row + 8) + cap * 8 + std::max(entries, cap) * 4;
  EXPECT_EQ((*layer)->StagingBytes(), 2 * staging);
  // The rest of the layer's buffers (docs/runtime.md, "Memory"), the executor workspace on top.
  const size_t buffers = 2 * cap * (2 * row + 4) + 2 * cap * row + entries * 4;
  const size_t before = (*layer)->MemoryBytes();
  EXPECT_GE(before, buffers + 2 * staging);

  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 3);
  RankTensors t = MakeRankTensors(g, rank(), dtype);
  ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
  for (int step = 0; step < 2; ++step) {  // both handles (pipeline order), then one again
    auto h1 = RunForward(layer->get(), &t, dtype, kHidden);
    ASSERT_TRUE(h1.ok()) << h1.status();
    auto h2 = RunForward(layer->get(), &t, dtype, kHidden);
    ASSERT_TRUE(h2.ok()) << h2.status();
    ASSERT_TRUE(RunBackward(layer->get(), *h2, &t, dtype, kHidden).ok());
    ASSERT_TRUE(RunBackward(layer->get(), *h1, &t, dtype, kHidden).ok());
  }
  EXPECT_EQ((*layer)->StagingBytes(), 2 * staging);
  EXPECT_EQ((*layer)->MemoryBytes(), before);
}

// MemAvailable as the smallest any rank reads (-1 where one cannot read it), so that a config
// derived from it is the same on every rank: read separately, the ranks' values differ by what
// other processes allocated in between (the layer then refused the configs for differing, seen
// once under ctest -j2).
int64_t AgreedMemAvailable() {
  int64_t available = HostMemoryAvailableBytes(), least = 0;
  MPI_Allreduce(&available, &least, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
  return least;
}

// A receive capacity whose buffers the node cannot hold is refused at creation on every rank, with
// an error naming host memory, rather than allocated (the zero-fill would run the process into
// the out-of-memory killer, and its peers would wait out their timeouts).
TEST_F(MoeLayerTest, BuffersAboveTheNodesMemoryAreRefusedAtCreation) {
  const int64_t available = AgreedMemAvailable();
  if (available < 0) GTEST_SKIP() << "MemAvailable cannot be read here";
  LayerConfig config = Config(DType::kFloat32, planner::Policy::kMoonEP);
  // Each receive row holds at least one x row (kHidden fp32): twice the node's memory in rows.
  config.max_recv_rows = 2 * available / (kHidden * 4) + 1;
  auto layer = MoeLayer::Create(comm_.get(), config);
  ASSERT_FALSE(layer.ok());
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kResourceExhausted) << layer.status();
  EXPECT_NE(layer.status().message().find("host bytes"), std::string::npos) << layer.status();
  // The node's MemAvailable, or the memory cgroup's room where that is smaller.
  EXPECT_TRUE(layer.status().message().find("MemAvailable") != std::string::npos ||
              layer.status().message().find("memory cgroup") != std::string::npos)
      << layer.status();
  // Nothing is left half made: a layer of the usual size is created on the same communicator.
  auto next = MoeLayer::Create(comm_.get(), Config(DType::kFloat32, planner::Policy::kMoonEP));
  EXPECT_TRUE(next.ok()) << next.status();
}

// The replica buffer the first layer of a shape makes (slots x 3 x H x I weights and gradients,
// zero-filled) is counted with the layer's other buffers: above the node's memory it is refused
// at once, on every rank, before anything is filled (it was allocated and zero-filled unchecked).
TEST_F(MoeLayerTest, ReplicaBufferAboveTheNodesMemoryIsRefusedAtCreation) {
  const int64_t available = AgreedMemAvailable();
  if (available < 0) GTEST_SKIP() << "MemAvailable cannot be read here";
  LayerConfig config = Config(DType::kFloat32, planner::Policy::kMoonEP);
  config.slots = 2;
  // 2 slots x 3 x kHidden x I x (4 + 4) bytes: twice the node's memory.
  config.intermediate = 2 * available / (2 * 3 * kHidden * 8) + 1;
  const auto start = std::chrono::steady_clock::now();
  auto layer = MoeLayer::Create(comm_.get(), config);
  ASSERT_FALSE(layer.ok());
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kResourceExhausted) << layer.status();
  EXPECT_NE(layer.status().message().find("replica buffer"), std::string::npos) << layer.status();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0)
      << "the refusal waited for a zero-fill";
  auto next = MoeLayer::Create(comm_.get(), Config(DType::kFloat32, planner::Policy::kMoonEP));
  EXPECT_TRUE(next.ok()) << next.status();
}

}  // namespace
}  // namespace moonep::testing
