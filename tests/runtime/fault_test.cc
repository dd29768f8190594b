// Ranks that drop out of a layer step must not hang the others (transport fault injection; run
// with MOONEP_TIMEOUT_MS=2000):
//  - a rank that skips the dispatch fails in combine, and its peers learn it at once; every rank's
//    layer is then unusable and says why;
//  - a rank that skips the combine leaves its peers waiting: they fail with a timeout naming the
//    phase within a few MOONEP_TIMEOUT_MS, never hang.
#include <chrono>
#include <cstdlib>
#include <thread>
#include <string>

#include "moonep/core/status.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/moe_layer.h"
#include "tests/harness/bad_env_verdict.h"
#include "tests/harness/mpi_test.h"
#include "tests/runtime/layer_problem.h"
#include "transport/testing_hooks.h"

namespace moonep::testing {
namespace {

class LayerFaultTest : public MpiTest {
 protected:
  void TearDown() override {
    transport::testing::ClearSkip();
    MpiTest::TearDown();
  }
};

runtime::LayerConfig SmallConfig(int size) {
  runtime::LayerConfig c;
  c.num_experts = 2 * size;
  c.top_k = 2;
  c.hidden = 8;
  c.intermediate = 4;
  c.max_tokens = 32;
  c.num_threads = 1;
  c.policy = planner::Policy::kTestForceReplicas;
  return c;
}

std::unique_ptr<runtime::MoeLayer> MakeLayer(runtime::Communicator* comm, int size) {
  auto layer = runtime::MoeLayer::Create(comm, SmallConfig(size));
  return layer.ok() ? std::move(*layer) : nullptr;
}

TEST_F(LayerFaultTest, SilentRankTimesOutEveryRankAndLayerBecomesUnusable) {
  if (size() < 2) GTEST_SKIP() << "needs peers";
  auto comm = runtime::Communicator::FromMpi(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  auto layer = runtime::MoeLayer::Create(comm->get(), SmallConfig(size()));
  ASSERT_TRUE(layer.ok()) << layer.status();
  GlobalProblem g = MakeGlobalProblem(size(), 2, 2, 8, 4, 24, DType::kFloat32, 21);
  RankTensors t = MakeRankTensors(g, rank(), DType::kFloat32);
  ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());

  const int32_t silent = size() - 1;
  transport::testing::SetSkipRank(silent, transport::OpKind::kDispatch);
  auto start = std::chrono::steady_clock::now();
  auto h = RunForward(layer->get(), &t, DType::kFloat32, 8);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(h.ok());
  EXPECT_LT(seconds, 3 * 2.0 + 2.0) << "took " << seconds << " s with MOONEP_TIMEOUT_MS=2000";
  EXPECT_FALSE((*layer)->usable()) << h.status();
  auto again = RunForward(layer->get(), &t, DType::kFloat32, 8);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(std::string(again.status().message()).find("unusable"), std::string::npos)
      << again.status();
  layer->reset();

  // A rank that skips the combine: the others wait for its rows and time out naming the phase.
  transport::testing::SetSkipRank(silent, transport::OpKind::kCombine);
  auto fresh = MakeLayer(comm->get(), size());
  ASSERT_NE(fresh, nullptr);
  ASSERT_TRUE(fresh->BindParameters(t.params, t.grads).ok());
  start = std::chrono::steady_clock::now();
  h = RunForward(fresh.get(), &t, DType::kFloat32, 8);
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (rank() != silent) {
    ASSERT_FALSE(h.ok());
    EXPECT_EQ(ToResult(h.status()), moonepTimeout) << h.status();
    EXPECT_NE(std::string(h.status().message()).find("combine"), std::string::npos) << h.status();
    EXPECT_LT(seconds, 3 * 2.0 + 2.0) << "took " << seconds << " s with MOONEP_TIMEOUT_MS=2000";
    EXPECT_FALSE(fresh->usable());
  }
}

// A rank that joins a layer's creation only after MOONEP_TIMEOUT_MS: the others time out naming
// it; the late rank, once it joins, learns they gave up and fails too instead of going on alone
// (the exchange's buffers outlive the timed-out call: no late write into freed memory, which the
// ASan build checks). The communicator then refuses further agreements at once.
TEST_F(LayerFaultTest, LateRankAtCreationFailsEveryRankAndNamesIt) {
  if (size() < 2) GTEST_SKIP() << "needs peers";
  auto comm = runtime::Communicator::FromMpi(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int late = size() - 1;
  if (rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(2600));
  auto start = std::chrono::steady_clock::now();
  auto layer = MakeLayer(comm->get(), size());
  EXPECT_EQ(layer, nullptr);
  auto again = runtime::MoeLayer::Create(comm->get(), SmallConfig(size()));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(ToResult(again.status()), moonepInvalidUsage) << again.status();
  EXPECT_NE(std::string(again.status().message()).find("earlier agreement"), std::string::npos)
      << again.status();
  if (rank() != late) {
    EXPECT_NE(std::string(again.status().message()).find("nothing heard from rank(s) " +
                                                         std::to_string(late)),
              std::string::npos) << again.status();
    EXPECT_LT(seconds, 2.0 + 1.5) << "took " << seconds << " s with MOONEP_TIMEOUT_MS=2000";
  } else {
    EXPECT_NE(std::string(again.status().message()).find("gave up"), std::string::npos)
        << again.status();
    EXPECT_LT(seconds, 1.0) << "the late rank waited " << seconds << " s";
  }
  // Let the late rank finish before the communicators go (its messages are in flight until then).
  MPI_Barrier(MPI_COMM_WORLD);
}

// Run by runtime_env_one_rank_np2 (skipped elsewhere): MOONEP_DEBUG is malformed on rank
// MOONEP_TEST_BAD_RANK only. That rank's creation fails naming the variable, and the others fail at
// once with RemoteError, instead of waiting in the transport's collective setup for it.
TEST_F(LayerFaultTest, BadEnvironmentOnOneRankFailsCreationEverywhere) {
  const char* bad = std::getenv("MOONEP_TEST_BAD_RANK");
  if (bad == nullptr) GTEST_SKIP() << "run by runtime_env_one_rank_np2";
  const int bad_rank = std::atoi(bad);
  auto comm = runtime::Communicator::FromMpi(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  moonep::testing::ExpectBadEnvironmentFailsEverywhere(rank(), bad_rank, [&] {
    return runtime::MoeLayer::Create(comm->get(), SmallConfig(size())).status();
  });
}

}  // namespace
}  // namespace moonep::testing
