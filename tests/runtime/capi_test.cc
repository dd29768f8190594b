// The runtime C API through the public header and libmoonep.so: communicator creation (MPI_Comm,
// unique id, environment), the MoE layer (level 3) and the EP buffer (level 2) against the fp64
// reference, stats, and misuse (null / destroyed / foreign handles, bad configs, wrong order):
// every misuse returns an error code and a message, nothing crashes.
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "moonep/moonep.h"
#include "moonep/moonep_runtime.h"
#include "tests/harness/mpi_test.h"
#include "tests/runtime/layer_problem.h"

namespace moonep::testing {
namespace {

constexpr int kTopK = 2;
constexpr int64_t kHidden = 8, kInter = 4, kTokens = 20;

class CApiTest : public MpiTest {
 protected:
  void SetUp() override {
    MPI_Comm world = MPI_COMM_WORLD;
    ASSERT_EQ(moonepCommInitMpi(&comm_, &world), moonepSuccess) << moonepGetLastThreadError();
  }
  void TearDown() override {
    if (comm_ != nullptr) {
      EXPECT_EQ(moonepCommDestroy(comm_), moonepSuccess);
    }
    MpiTest::TearDown();
  }
  int epn() const { return size() == 1 ? 4 : 2; }
  moonepLayerConfig_t Config(moonepPlannerPolicy_t policy) const {
    moonepLayerConfig_t c = MOONEP_LAYER_CONFIG_INITIALIZER;
    c.num_experts = epn() * size();
    c.top_k = kTopK;
    c.hidden = kHidden;
    c.intermediate = kInter;
    c.policy = policy;
    c.max_tokens = kTokens + 8;
    c.num_threads = 1;
    return c;
  }
  moonepComm_t comm_ = nullptr;
};

moonepExpertTensors_t Tensors(RankTensors& t, bool grads) {
  moonepExpertTensors_t x;
  if (grads) {
    x.gate = t.gg.data();
    x.up = t.gu.data();
    x.down = t.gd.data();
    x.dtype = moonepFloat32;
  } else {
    x.gate = t.wg.data();
    x.up = t.wu.data();
    x.down = t.wd.data();
    x.dtype = moonepFloat32;
  }
  return x;
}

TEST_F(CApiTest, CommunicatorBasics) {
  int r = -1, n = -1;
  ASSERT_EQ(moonepCommRank(comm_, &r), moonepSuccess);
  ASSERT_EQ(moonepCommSize(comm_, &n), moonepSuccess);
  EXPECT_EQ(r, rank());
  EXPECT_EQ(n, size());
  EXPECT_STREQ(moonepGetLastError(comm_), "");
  EXPECT_EQ(moonepCommRank(comm_, nullptr), moonepInvalidArgument);
  EXPECT_NE(std::string(moonepGetLastError(comm_)).find("rank is NULL"), std::string::npos);
  // A NULL NCCL communicator is refused (the GPU test passes a real one); so is a NULL handle.
  const moonepResult_t nr = moonepCommSetNcclComm(comm_, nullptr);
  EXPECT_TRUE(nr == moonepInvalidArgument || nr == moonepUnavailable) << moonepGetErrorString(nr);
  EXPECT_NE(std::string(moonepGetLastError(comm_)).find("NCCL"), std::string::npos)
      << moonepGetLastError(comm_);
  EXPECT_EQ(moonepCommSetNcclComm(nullptr, nullptr), moonepInvalidArgument);
}

TEST_F(CApiTest, UniqueIdOrdersRanksAsGiven) {
  moonepUniqueId id;
  if (rank() == 0) {
    ASSERT_EQ(moonepGetUniqueId(&id), moonepSuccess);
  }
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  moonepComm_t reversed = nullptr;
  ASSERT_EQ(moonepCommInitRank(&reversed, size(), id, size() - 1 - rank()), moonepSuccess)
      << moonepGetLastThreadError();
  int r = -1;
  ASSERT_EQ(moonepCommRank(reversed, &r), moonepSuccess);
  EXPECT_EQ(r, size() - 1 - rank());
  EXPECT_EQ(moonepCommDestroy(reversed), moonepSuccess);
  EXPECT_EQ(moonepCommDestroy(reversed), moonepInvalidUsage);  // after destroy

  // Every process passes rank 0: fails on every rank (when there are several), nothing hangs.
  moonepComm_t bad = nullptr;
  const moonepResult_t res = moonepCommInitRank(&bad, size(), id, 0);
  if (size() > 1) {
    EXPECT_EQ(res, moonepInvalidArgument);
    EXPECT_NE(std::string(moonepGetLastThreadError()).find("not 0.."), std::string::npos)
        << moonepGetLastThreadError();
  } else {
    EXPECT_EQ(res, moonepSuccess);
    moonepCommDestroy(bad);
  }
  moonepUniqueId garbage;
  std::memset(&garbage, 0, sizeof(garbage));
  EXPECT_EQ(moonepCommInitRank(&bad, size(), garbage, rank()), moonepInvalidArgument);
}

TEST_F(CApiTest, FromEnvironmentUnderMpirun) {
  moonepComm_t env = nullptr;
  ASSERT_EQ(moonepCommInitFromEnv(&env), moonepSuccess) << moonepGetLastThreadError();
  int r = -1, n = -1;
  moonepCommRank(env, &r);
  moonepCommSize(env, &n);
  EXPECT_EQ(r, rank());
  EXPECT_EQ(n, size());
  EXPECT_EQ(moonepCommDestroy(env), moonepSuccess);
}

TEST_F(CApiTest, LayerMatchesReferenceAndReportsStats) {
  const DType dt = DType::kFloat32;
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kTokens, dt, 3);
  RankTensors t = MakeRankTensors(g, rank(), dt);
  moonepLayerConfig_t config = Config(moonepPolicyTestForceReplicas);
  moonepLayer_t layer = nullptr;
  ASSERT_EQ(moonepLayerCreate(comm_, &config, &layer), moonepSuccess) << moonepGetLastError(comm_);
  moonepExpertTensors_t w = Tensors(t, false), gr = Tensors(t, true);
  ASSERT_EQ(moonepLayerBindParams(layer, &w, &gr), moonepSuccess) << moonepGetLastError(comm_);
  moonepLayerHandle_t h = nullptr;
  ASSERT_EQ(moonepLayerForward(layer, t.tokens, t.x.data(), t.ids.data(), t.weights.data(),
                               t.y.data(), &h, nullptr),
            moonepSuccess)
      << moonepGetLastError(comm_);
  ASSERT_EQ(moonepLayerBackward(layer, h, t.dy.data(), t.dx.data(), t.dtopk.data(), nullptr), moonepSuccess)
      << moonepGetLastError(comm_);
  reference::ForwardResult f;
  reference::BackwardResult b;
  ASSERT_TRUE(ReferenceLayer(g, &f, &b).ok());
  const int64_t o = g.offset[rank()];
  EXPECT_LT(RelError(Decode(t.y, dt), f.y.data() + o * kHidden, t.tokens * kHidden), 1e-5);
  EXPECT_LT(RelError(Decode(t.dx, dt), b.dx.data() + o * kHidden, t.tokens * kHidden), 1e-5);
  std::vector<double> gg(t.gg.begin(), t.gg.end());
  EXPECT_LT(RelError(gg, b.dwg.data() + rank() * epn() * kHidden * kInter, gg.size()), 1e-5);

  moonepStepStats_t stats = MOONEP_STEP_STATS_INITIALIZER;
  ASSERT_EQ(moonepLayerGetStats(layer, &stats), moonepSuccess);
  EXPECT_EQ(stats.step, 1);
  EXPECT_EQ(stats.tokens, t.tokens);
  EXPECT_GE(stats.max_load_before, stats.max_load_after);
  if (size() > 1) {
    EXPECT_GT(stats.replicas, 0);
  }
  EXPECT_GT(stats.forward_ms, 0.0);
  size_t layer_bytes = 0, replica_bytes = 0;
  ASSERT_EQ(moonepLayerGetMemory(layer, &layer_bytes, &replica_bytes), moonepSuccess);
  EXPECT_GT(layer_bytes, 0u);
  EXPECT_EQ(replica_bytes, static_cast<size_t>(epn()) * 3 * kHidden * kInter * (4 + 4));

  // Misuse: every call returns an error code and a message.
  EXPECT_EQ(moonepLayerBackward(layer, h, t.dy.data(), t.dx.data(), nullptr, nullptr), moonepInvalidUsage);
  EXPECT_EQ(moonepLayerRelease(layer, h), moonepInvalidUsage);
  EXPECT_EQ(moonepLayerForward(nullptr, 1, t.x.data(), t.ids.data(), t.weights.data(), t.y.data(),
                               &h, nullptr), moonepInvalidArgument);
  EXPECT_EQ(moonepLayerBindParams(layer, nullptr, nullptr), moonepInvalidArgument);
  EXPECT_NE(std::string(moonepGetLastError(comm_)).find("weights is NULL"), std::string::npos);
  moonepExpertTensors_t wrong = w;
  wrong.dtype = moonepBFloat16;
  EXPECT_EQ(moonepLayerBindParams(layer, &wrong, nullptr), moonepInvalidArgument);
  moonepStepStats_t tiny = MOONEP_STEP_STATS_INITIALIZER;
  tiny.size = 4;
  EXPECT_EQ(moonepLayerGetStats(layer, &tiny), moonepInvalidArgument);
  EXPECT_EQ(moonepCommDestroy(comm_), moonepInvalidUsage);  // the layer is still alive
  EXPECT_EQ(moonepLayerDestroy(layer), moonepSuccess);
  // After destroy: refused, not dereferenced.
  EXPECT_EQ(moonepLayerForward(layer, t.tokens, t.x.data(), t.ids.data(), t.weights.data(),
                               t.y.data(), &h, nullptr), moonepInvalidUsage);
  EXPECT_EQ(moonepLayerBackward(layer, h, t.dy.data(), t.dx.data(), nullptr, nullptr), moonepInvalidUsage);
  EXPECT_EQ(moonepLayerDestroy(layer), moonepInvalidUsage);
  EXPECT_NE(std::string(moonepGetLastThreadError()).find("not a live layer"), std::string::npos);
}

TEST_F(CApiTest, BadConfigsFailOnEveryRank) {
  moonepLayer_t layer = nullptr;
  EXPECT_EQ(moonepLayerCreate(comm_, nullptr, &layer), moonepInvalidArgument);
  moonepLayerConfig_t c = Config(moonepPolicyMoonEP);
  c.magic = 0;
  EXPECT_EQ(moonepLayerCreate(comm_, &c, &layer), moonepInvalidArgument);
  c = Config(moonepPolicyMoonEP);
  c.policy = static_cast<moonepPlannerPolicy_t>(42);
  EXPECT_EQ(moonepLayerCreate(comm_, &c, &layer), moonepInvalidArgument);
  EXPECT_NE(std::string(moonepGetLastError(comm_)).find("policy"), std::string::npos);
  c = Config(moonepPolicyMoonEP);
  if (rank() == 0) c.dtype = moonepBFloat16;
  const moonepResult_t r = moonepLayerCreate(comm_, &c, &layer);
  if (size() > 1) {
    EXPECT_EQ(r, moonepInvalidArgument);
    EXPECT_NE(std::string(moonepGetLastError(comm_)).find("dtype"), std::string::npos);
  } else {
    ASSERT_EQ(r, moonepSuccess);
    moonepLayerDestroy(layer);
  }
  // A transport backend that differs between ranks, or does not exist, fails on every rank.
  c = Config(moonepPolicyMoonEP);
  c.transport = rank() == size() - 1 ? "no-such-backend" : "mpi";
  EXPECT_EQ(moonepLayerCreate(comm_, &c, &layer), moonepInvalidArgument);
  EXPECT_NE(std::string(moonepGetLastError(comm_)).find(size() > 1 ? "transport" : "no-such-backend"),
            std::string::npos) << moonepGetLastError(comm_);
  // Forward with a NULL x on one rank fails on every rank.
  c = Config(moonepPolicyMoonEP);
  ASSERT_EQ(moonepLayerCreate(comm_, &c, &layer), moonepSuccess) << moonepGetLastError(comm_);
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kTokens,
                                      DType::kFloat32, 4);
  RankTensors t = MakeRankTensors(g, rank(), DType::kFloat32);
  moonepExpertTensors_t w = Tensors(t, false);
  ASSERT_EQ(moonepLayerBindParams(layer, &w, nullptr), moonepSuccess);
  moonepLayerHandle_t h = nullptr;
  const moonepResult_t fr = moonepLayerForward(layer, t.tokens, rank() == 0 ? nullptr : t.x.data(),
                                               t.ids.data(), t.weights.data(), t.y.data(), &h, nullptr);
  EXPECT_EQ(fr, rank() == 0 ? moonepInvalidArgument : moonepRemoteError) << moonepGetLastError(comm_);
  // Forward-only layer: backward is refused, release works.
  ASSERT_EQ(moonepLayerForward(layer, t.tokens, t.x.data(), t.ids.data(), t.weights.data(),
                               t.y.data(), &h, nullptr), moonepSuccess) << moonepGetLastError(comm_);
  EXPECT_EQ(moonepLayerBackward(layer, h, t.dy.data(), t.dx.data(), nullptr, nullptr), moonepInvalidUsage);
  EXPECT_EQ(moonepLayerRelease(layer, h), moonepSuccess);
  EXPECT_EQ(moonepLayerDestroy(layer), moonepSuccess);
}

// One rank's receive capacity too small for a step: every rank fails with OutOfMemory naming that
// rank, before anything moves, and the layer and the EP buffer stay usable (a step that fits runs).
TEST_F(CApiTest, CapacityOverflowOnOneRankFailsEveryRankAndStaysUsable) {
  const int small = size() - 1;
  moonepLayerConfig_t c = Config(moonepPolicyNone);
  if (rank() == small) c.max_recv_rows = 1;  // capacities may differ between ranks
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kTokens,
                                      DType::kFloat32, 11);
  RankTensors t = MakeRankTensors(g, rank(), DType::kFloat32);
  // The routing sends more than one row to rank `small` (its experts appear in it).
  int64_t to_small = 0;
  for (int r = 0; r < size(); ++r) {
    for (int32_t id : MakeRankTensors(g, r, DType::kFloat32).ids) to_small += id / epn() == small;
  }
  ASSERT_GT(to_small, 1);
  const std::string rank_name = "on rank " + std::to_string(small);

  moonepLayer_t layer = nullptr;
  ASSERT_EQ(moonepLayerCreate(comm_, &c, &layer), moonepSuccess) << moonepGetLastError(comm_);
  moonepExpertTensors_t w = Tensors(t, false);
  ASSERT_EQ(moonepLayerBindParams(layer, &w, nullptr), moonepSuccess);
  moonepLayerHandle_t h = nullptr;
  EXPECT_EQ(moonepLayerForward(layer, t.tokens, t.x.data(), t.ids.data(), t.weights.data(),
                               t.y.data(), &h, nullptr), moonepOutOfMemory);
  EXPECT_NE(std::string(moonepGetLastError(comm_)).find(rank_name), std::string::npos)
      << moonepGetLastError(comm_);
  // No tokens anywhere: the plan fits, the layer still works.
  ASSERT_EQ(moonepLayerForward(layer, 0, t.x.data(), t.ids.data(), t.weights.data(), t.y.data(),
                               &h, nullptr), moonepSuccess) << moonepGetLastError(comm_);
  EXPECT_EQ(moonepLayerRelease(layer, h), moonepSuccess);
  EXPECT_EQ(moonepLayerDestroy(layer), moonepSuccess);

  moonepEpBuffer_t buf = nullptr;
  ASSERT_EQ(moonepEpBufferCreate(comm_, &c, &buf), moonepSuccess) << moonepGetLastError(comm_);
  moonepEpHandle_t eh = nullptr;
  EXPECT_EQ(moonepEpDispatch(buf, t.tokens, t.x.data(), t.ids.data(), t.weights.data(), &eh),
            moonepOutOfMemory);
  EXPECT_NE(std::string(moonepGetLastError(comm_)).find(rank_name), std::string::npos)
      << moonepGetLastError(comm_);
  ASSERT_EQ(moonepEpDispatch(buf, 0, t.x.data(), t.ids.data(), t.weights.data(), &eh),
            moonepSuccess) << moonepGetLastError(comm_);
  EXPECT_EQ(moonepEpRelease(buf, eh), moonepSuccess);
  EXPECT_EQ(moonepEpBufferDestroy(buf), moonepSuccess);
}

// A NULL output pointer on one rank of a collective call fails that rank with InvalidArgument and
// the others at once with RemoteError (well within MOONEP_TIMEOUT_MS), instead of leaving them to
// time out; the objects stay usable.
TEST_F(CApiTest, NullOutputPointerOnOneRankFailsEveryRankAtOnce) {
  const moonepLayerConfig_t c = Config(moonepPolicyMoonEP);
  const bool odd = rank() == 0;
  const auto start = std::chrono::steady_clock::now();
  moonepLayer_t layer = nullptr;
  EXPECT_EQ(moonepLayerCreate(comm_, &c, odd ? nullptr : &layer),
            odd ? moonepInvalidArgument : moonepRemoteError) << moonepGetLastError(comm_);
  moonepEpBuffer_t buf = nullptr;
  EXPECT_EQ(moonepEpBufferCreate(comm_, &c, odd ? nullptr : &buf),
            odd ? moonepInvalidArgument : moonepRemoteError) << moonepGetLastError(comm_);
  ASSERT_EQ(moonepLayerCreate(comm_, &c, &layer), moonepSuccess) << moonepGetLastError(comm_);
  ASSERT_EQ(moonepEpBufferCreate(comm_, &c, &buf), moonepSuccess) << moonepGetLastError(comm_);
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kTokens,
                                      DType::kFloat32, 12);
  RankTensors t = MakeRankTensors(g, rank(), DType::kFloat32);
  moonepExpertTensors_t w = Tensors(t, false);
  ASSERT_EQ(moonepLayerBindParams(layer, &w, nullptr), moonepSuccess);
  moonepLayerHandle_t h = nullptr;
  EXPECT_EQ(moonepLayerForward(layer, t.tokens, t.x.data(), t.ids.data(), t.weights.data(),
                               t.y.data(), odd ? nullptr : &h, nullptr),
            odd ? moonepInvalidArgument : moonepRemoteError) << moonepGetLastError(comm_);
  moonepEpHandle_t eh = nullptr;
  EXPECT_EQ(moonepEpDispatch(buf, t.tokens, t.x.data(), t.ids.data(), t.weights.data(),
                             odd ? nullptr : &eh),
            odd ? moonepInvalidArgument : moonepRemoteError) << moonepGetLastError(comm_);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const char* timeout_ms = std::getenv("MOONEP_TIMEOUT_MS");
  EXPECT_LT(seconds, 0.5 * (timeout_ms != nullptr ? std::atof(timeout_ms) : 60000.0) / 1000.0)
      << "the peers waited for the rank that failed";

  ASSERT_EQ(moonepLayerForward(layer, t.tokens, t.x.data(), t.ids.data(), t.weights.data(),
                               t.y.data(), &h, nullptr), moonepSuccess) << moonepGetLastError(comm_);
  EXPECT_EQ(moonepLayerRelease(layer, h), moonepSuccess);
  ASSERT_EQ(moonepEpDispatch(buf, t.tokens, t.x.data(), t.ids.data(), t.weights.data(), &eh),
            moonepSuccess) << moonepGetLastError(comm_);
  EXPECT_EQ(moonepEpRelease(buf, eh), moonepSuccess);
  EXPECT_EQ(moonepEpBufferDestroy(buf), moonepSuccess);
  EXPECT_EQ(moonepLayerDestroy(layer), moonepSuccess);
}

// Sizes whose buffers cannot exist fail creation on every rank with a message naming the field:
// byte counts that would wrap (refused before anything is allocated), and an allocation that
// fails on one rank only (made before the agreement, so the other ranks do not go on into the
// transport's collective setup without it).
TEST_F(CApiTest, OversizedConfigsFailOnEveryRank) {
  struct Case {
    const char* field;
    void (*set)(moonepLayerConfig_t*);
  };
  const Case cases[] = {
      {"max_tokens", [](moonepLayerConfig_t* c) { c->max_tokens = INT64_MAX; }},
      {"hidden", [](moonepLayerConfig_t* c) { c->hidden = int64_t{1} << 40; }},
      {"intermediate", [](moonepLayerConfig_t* c) { c->intermediate = int64_t{1} << 40; }},
      {"max_recv_rows", [](moonepLayerConfig_t* c) { c->max_recv_rows = (int64_t{1} << 62) + 8; }},
      {"pad_multiple", [](moonepLayerConfig_t* c) { c->pad_multiple = INT32_MAX; }},
  };
  for (const Case& k : cases) {
    moonepLayerConfig_t c = Config(moonepPolicyMoonEP);
    k.set(&c);  // on every rank: every rank's own verdict names the field
    moonepLayer_t layer = nullptr;
    EXPECT_EQ(moonepLayerCreate(comm_, &c, &layer), moonepInvalidArgument) << k.field;
    EXPECT_NE(std::string(moonepGetLastError(comm_)).find(k.field), std::string::npos)
        << moonepGetLastError(comm_);
    moonepEpBuffer_t buf = nullptr;
    if (std::string(k.field) != "intermediate") {  // an EP buffer has no intermediate size
      EXPECT_EQ(moonepEpBufferCreate(comm_, &c, &buf), moonepInvalidArgument) << k.field;
    }
  }
  // 2^34 receive rows of 32 bytes (512 GiB, and an executor workspace larger still) on the last
  // rank only: it cannot allocate them; every rank fails, at once.
  const auto start = std::chrono::steady_clock::now();
  moonepLayerConfig_t c = Config(moonepPolicyMoonEP);
  const bool big = rank() == size() - 1;
  if (big) c.max_recv_rows = int64_t{1} << 34;
  moonepLayer_t layer = nullptr;
  EXPECT_EQ(moonepLayerCreate(comm_, &c, &layer), big ? moonepOutOfMemory : moonepRemoteError)
      << moonepGetLastError(comm_);
  moonepEpBuffer_t buf = nullptr;
  EXPECT_EQ(moonepEpBufferCreate(comm_, &c, &buf), big ? moonepOutOfMemory : moonepRemoteError)
      << moonepGetLastError(comm_);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0) << "creation took " << seconds << " s";
  // The communicator is still good for a layer that fits.
  c = Config(moonepPolicyMoonEP);
  ASSERT_EQ(moonepLayerCreate(comm_, &c, &layer), moonepSuccess) << moonepGetLastError(comm_);
  EXPECT_EQ(moonepLayerDestroy(layer), moonepSuccess);
}

TEST_F(CApiTest, EpBufferMovesRowsWeightsAndGradients) {
  const DType dt = DType::kFloat32;
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kTokens, dt, 9);
  RankTensors t = MakeRankTensors(g, rank(), dt);
  moonepEpBufferConfig_t c = Config(moonepPolicyTestForceReplicas);
  moonepEpBuffer_t buf = nullptr;
  ASSERT_EQ(moonepEpBufferCreate(comm_, &c, &buf), moonepSuccess) << moonepGetLastError(comm_);
  moonepEpHandle_t h = nullptr;
  ASSERT_EQ(moonepEpDispatch(buf, t.tokens, t.x.data(), t.ids.data(), t.weights.data(), &h),
            moonepSuccess) << moonepGetLastError(comm_);
  moonepEpLayout_t layout;
  ASSERT_EQ(moonepEpGetLayout(buf, h, &layout), moonepSuccess);
  ASSERT_EQ(layout.num_groups, epn() + epn());

  // Prefetch into caller-owned replica slots; each used slot must equal its expert's weights.
  const size_t block = kHidden * kInter;
  std::vector<float> rg(epn() * block, -1), ru(epn() * block, -1), rd(epn() * block, -1);
  moonepExpertTensors_t home = Tensors(t, false);
  moonepExpertTensors_t slots{rg.data(), ru.data(), rd.data(), moonepFloat32};
  ASSERT_EQ(moonepEpPrefetch(buf, h, &home, &slots), moonepSuccess) << moonepGetLastError(comm_);
  for (int s = 0; s < epn(); ++s) {
    const int e = layout.group_expert[epn() + s];
    if (e < 0) continue;
    for (size_t i = 0; i < block; ++i) {
      ASSERT_EQ(rg[s * block + i], static_cast<float>(g.p.weights.wg[e * block + i]));
      ASSERT_EQ(rd[s * block + i], static_cast<float>(g.p.weights.wd[e * block + i]));
    }
  }
  // Experts computed by the caller with the reference FFN, on home and replica groups alike.
  std::vector<float> out = ReferenceExpertRows(g, static_cast<const float*>(layout.rows),
                                                layout.num_rows, layout.num_groups,
                                                layout.group_expert, layout.group_offset,
                                                layout.group_count);
  ASSERT_EQ(moonepEpCombine(buf, h, out.data(), t.y.data()), moonepSuccess) << moonepGetLastError(comm_);
  reference::ForwardResult f;
  reference::BackwardResult b;
  ASSERT_TRUE(ReferenceLayer(g, &f, &b).ok());
  const int64_t o = g.offset[rank()];
  EXPECT_LT(RelError(Decode(t.y, dt), f.y.data() + o * kHidden, t.tokens * kHidden), 1e-5);

  // Backward forms: dy rows, d topk_weights, and an identity "expert" for dx.
  std::vector<float> dy_rows(out.size(), 0.0f);
  ASSERT_EQ(moonepEpCombineBackward(buf, h, t.dy.data(), dy_rows.data()), moonepSuccess);
  ASSERT_EQ(moonepEpTopkWeightGrad(buf, h, dy_rows.data(), out.data(), t.dtopk.data()), moonepSuccess);
  std::vector<double> dtopk(t.dtopk.begin(), t.dtopk.end());
  EXPECT_LT(RelError(dtopk, b.dtopk_weights.data() + o * kTopK, t.tokens * kTopK), 1e-5);
  ASSERT_EQ(moonepEpDispatchBackward(buf, h, dy_rows.data(), t.dx.data()), moonepSuccess);
  std::vector<double> dx = Decode(t.dx, dt);
  for (int64_t tok = 0; tok < t.tokens; ++tok) {
    int valid = 0;
    for (int k = 0; k < kTopK; ++k) valid += t.ids[tok * kTopK + k] >= 0;
    for (int64_t j = 0; j < kHidden; ++j) {
      ASSERT_NEAR(dx[tok * kHidden + j], valid * g.p.dy[(o + tok) * kHidden + j], 1e-5);
    }
  }
  // Reduce: replica gradient slots filled with 1 add (replicas of the expert) to its home grads.
  std::fill(rg.begin(), rg.end(), 1.0f);
  std::fill(ru.begin(), ru.end(), 1.0f);
  std::fill(rd.begin(), rd.end(), 1.0f);
  moonepExpertTensors_t home_grads = Tensors(t, true);
  ASSERT_EQ(moonepEpReduce(buf, h, &home_grads, &slots), moonepSuccess) << moonepGetLastError(comm_);
  std::vector<int32_t> all_slots(static_cast<size_t>(size()) * epn());
  std::vector<int32_t> mine(layout.group_expert + epn(), layout.group_expert + 2 * epn());
  MPI_Allgather(mine.data(), epn(), MPI_INT32_T, all_slots.data(), epn(), MPI_INT32_T,
                MPI_COMM_WORLD);
  for (int ge = 0; ge < epn(); ++ge) {
    const int e = rank() * epn() + ge;
    const float replicas = static_cast<float>(std::count(all_slots.begin(), all_slots.end(), e));
    EXPECT_EQ(t.gg[ge * block], replicas) << "expert " << e;
    EXPECT_EQ(t.gd[ge * block + block - 1], replicas) << "expert " << e;
  }
  moonepStepStats_t stats = MOONEP_STEP_STATS_INITIALIZER;
  ASSERT_EQ(moonepEpGetStats(buf, &stats), moonepSuccess);
  EXPECT_EQ(stats.step, 1);
  ASSERT_EQ(moonepEpRelease(buf, h), moonepSuccess);
  EXPECT_EQ(moonepEpGetLayout(buf, h, &layout), moonepInvalidUsage);
  EXPECT_EQ(moonepEpBufferDestroy(buf), moonepSuccess);
  EXPECT_EQ(moonepEpBufferDestroy(buf), moonepInvalidUsage);
  EXPECT_EQ(moonepEpDispatch(buf, 0, nullptr, nullptr, nullptr, &h), moonepInvalidUsage);
}

}  // namespace
}  // namespace moonep::testing
