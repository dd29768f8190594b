// UCX backend specifics the shared suite cannot see: memory is registered once per buffer and its
// key sent once per peer (steady-state steps register nothing and send no keys, also when the
// routing changes between steps), a new buffer is
// registered on first use, and the bounded registration cache evicts old regions (peers drop their
// keys) while results stay correct, also for a buffer used again after its eviction.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moonep/core/status.h"
#include "tests/harness/mpi_test.h"
#include "tests/transport/transport_test_util.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_transport.h"

namespace moonep::transport {
namespace {

using test::BruteForcePlacement;
using test::MakeProblem;
using test::Problem;

class UcxRegistrationTest : public moonep::testing::MpiTest {
 protected:
  void SetUp() override {
    // Routings (different token counts, experts and plans) used in turn with the same buffers:
    // what moves between steps is where rows go, not the buffers.
    for (int i = 0; i < kRoutings; ++i) {
      problems_[i] = MakeProblem(size(), 2 * size(), 2, 4, 8 + i, 77 + i, -1);
      ASSERT_TRUE(test::MakeRandomPlan("random", problems_[i], 77 + i, 2, 1, &plans_[i]).ok());
      truths_[i] = BruteForcePlacement(problems_[i], plans_[i]);
      int64_t cap = plans_[i].num_groups();
      for (int32_t r = 0; r < size(); ++r) cap += problems_[i].T[r] * problems_[i].K;
      cap_ = std::max(cap_, cap);
    }
    TransportOptions o;
    for (const Problem& p : problems_) o.max_tokens = std::max(o.max_tokens, p.max_tokens());
    o.max_top_k = 2;
    o.max_row_bytes = 4 * 4;
    auto t = CreateTransport("ucx", o);
    ASSERT_TRUE(t.ok()) << t.status();
    t_ = std::move(*t);
    Use(0);
  }
  void Use(int i) {
    p_ = problems_[i];
    plan_ = plans_[i];
    truth_ = truths_[i];
  }
  void TearDown() override {
    t_.reset();
    moonep::testing::MpiTest::TearDown();
  }
  ucx::RegistrationStats Stats() {
    auto s = ucx::GetRegistrationStats(*t_);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : ucx::RegistrationStats{};
  }
  // One step into `rows`; checks every row this rank receives against the brute-force placement.
  void Step(std::vector<float>* rows) {
    const int32_t me = rank();
    const int64_t T = p_.T[me], H = p_.H;
    rows->resize(cap_ * H);
    std::fill(rows->begin(), rows->end(), -1.0f);
    std::vector<float> w(cap_), y(T * H);
    ASSERT_TRUE(t_->ExchangeCounts(p_.ids[me], T, p_.K, p_.E, cap_, &h_).ok());
    TensorView rows_v = TensorView::Contiguous(rows->data(), DType::kFloat32, {cap_, H});
    ASSERT_TRUE(t_->Dispatch(plan_, TensorView::Contiguous(p_.x[me].data(), DType::kFloat32, {T, H}),
                             p_.weights[me], &h_, rows_v, absl::MakeSpan(w)).ok());
    for (int32_t s = 0; s < p_.R; ++s) {
      for (size_t i = 0; i < truth_[s].size(); ++i) {
        if (truth_[s][i].rank != me) continue;
        ASSERT_EQ(0, std::memcmp(&(*rows)[truth_[s][i].row * H], &p_.x[s][(i / p_.K) * H], H * 4))
            << "row " << truth_[s][i].row << " from rank " << s;
      }
    }
    ASSERT_TRUE(t_->Combine(&h_, rows_v, TensorView::Contiguous(y.data(), DType::kFloat32, {T, H})).ok());
  }
  bool ReceivesRemoteRows() const {
    for (int32_t s = 0; s < p_.R; ++s) {
      if (s != rank() && h_.receive_layout().rows_from(s) > 0) return true;
    }
    return false;
  }

  static constexpr int kRoutings = 6;
  Problem problems_[kRoutings];
  planner::Plan plans_[kRoutings];
  std::vector<std::vector<test::Placement>> truths_[kRoutings];
  Problem p_;
  planner::Plan plan_;
  std::unique_ptr<Transport> t_;
  DispatchHandle h_;
  int64_t cap_ = 0;
  std::vector<std::vector<test::Placement>> truth_;
};

TEST_F(UcxRegistrationTest, SteadyStateRegistersNothingAndSendsNoKeys) {
  if (size() < 2) GTEST_SKIP() << "needs peers";
  std::vector<float> rows;
  Step(&rows);
  const ucx::RegistrationStats first = Stats();
  // New routings: rows land at other offsets of the same buffers, so nothing is registered (a
  // peer that writes here for the first time gets the key once).
  for (int i = 1; i < kRoutings; ++i) {
    Use(i);
    Step(&rows);
    if (HasFatalFailure()) return;
  }
  const ucx::RegistrationStats mid = Stats();
  EXPECT_EQ(mid.regions_registered, first.regions_registered);
  // Every routing again: no registration and no key moves at all.
  for (int i = 0; i < kRoutings; ++i) {
    Use(i);
    Step(&rows);
    if (HasFatalFailure()) return;
  }
  const ucx::RegistrationStats later = Stats();
  EXPECT_EQ(later.regions_registered, first.regions_registered);
  EXPECT_EQ(later.keys_sent, mid.keys_sent);
  EXPECT_EQ(later.keys_unpacked, mid.keys_unpacked);
  // A receive buffer at new addresses is registered on first use, once.
  std::vector<float> other;
  other.reserve(rows.size() + 1024);  // alive beside `rows`: distinct addresses
  Step(&other);
  const ucx::RegistrationStats moved = Stats();
  EXPECT_EQ(moved.regions_registered, later.regions_registered + (ReceivesRemoteRows() ? 1 : 0));
  Step(&other);
  EXPECT_EQ(Stats().regions_registered, moved.regions_registered);
}

TEST_F(UcxRegistrationTest, CacheStaysBoundedAndEvictedBuffersWorkAgain) {
  if (size() < 2) GTEST_SKIP() << "needs peers";
  // More live receive buffers than the cache holds (256 regions), each used once, then the first
  // (long evicted) again: its peers destroyed the old key and get a new one.
  std::vector<std::vector<float>> buffers(300);
  for (auto& b : buffers) {
    Step(&b);
    if (HasFatalFailure()) return;
  }
  const ucx::RegistrationStats s = Stats();
  EXPECT_LE(s.regions_cached, 256);
  if (ReceivesRemoteRows()) {
    EXPECT_GT(s.regions_evicted, 0);
  }
  Step(&buffers[0]);
}

// A transport-owned staging buffer that grows moves: its old registration is dropped then (peers
// told), so no later buffer at the recycled addresses can reuse a registration of freed pages.
// Two reductions through the put path (contributions above MOONEP_UCX_EAGER_BYTES), the second
// with blocks twice as large: every home rank that received into its staging drops the old
// region, and both sums are exact.
TEST_F(UcxRegistrationTest, ReduceStagingThatGrowsDropsItsOldRegistration) {
  const int32_t S = plan_.slots, epn = plan_.experts_per_rank;
  int replicas = 0;
  for (int32_t e : plan_.slot_expert) replicas += e >= 0;
  if (replicas == 0) GTEST_SKIP() << "the plan has no replica";
  int64_t evicted_before = Stats().regions_evicted;
  for (const int64_t n : {int64_t{4096}, int64_t{8192}}) {  // 16 and 32 KiB a block (> 8192 bytes)
    std::vector<std::vector<float>> home(epn, std::vector<float>(n, 0.0f));
    std::vector<std::vector<float>> slot(S, std::vector<float>(n, 0.0f));
    std::vector<TensorView> hv, sv;
    for (auto& v : home) hv.push_back(TensorView::Contiguous(v.data(), DType::kFloat32, {n}));
    for (int32_t i = 0; i < S; ++i) {
      if (plan_.slot_expert[rank() * S + i] >= 0) std::fill(slot[i].begin(), slot[i].end(), 1.0f);
      sv.push_back(TensorView::Contiguous(slot[i].data(), DType::kFloat32, {n}));
    }
    ASSERT_TRUE(t_->Reduce(plan_, ExpertBlocks{1, hv, sv}).ok());
    for (int32_t g = 0; g < epn; ++g) {
      const int32_t e = plan_.local_experts[rank() * epn + g];
      float want = 0.0f;
      for (int32_t x : plan_.slot_expert) want += x == e ? 1.0f : 0.0f;
      for (int64_t j = 0; j < n; ++j) ASSERT_EQ(home[g][j], want) << "expert " << e << " j " << j;
    }
  }
  int64_t evicted = Stats().regions_evicted - evicted_before, total = 0;
  MPI_Allreduce(&evicted, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_GE(total, 1) << "no rank dropped the registration of its moved staging";
}

// Signal slots are reused every 32 operations of a channel: a row operation that would reuse the
// slot of one still in flight (31 operations back) is refused, on every rank alike, and the
// transport stays usable: once the old one completes (with the right rows) the refused one runs.
// Before, it started, overwrote the old operation's slot, and the old one timed out.
TEST_F(UcxRegistrationTest, OperationReusingTheSlotOfOneInFlightIsRefused) {
  const int32_t me = rank();
  const int64_t T = p_.T[me], H = p_.H;
  std::vector<float> rows0(cap_ * H, -1.0f), w0(cap_), rows1(cap_ * H), w1(cap_);
  const TensorView x = TensorView::Contiguous(p_.x[me].data(), DType::kFloat32, {T, H});
  const TensorView rows0_v = TensorView::Contiguous(rows0.data(), DType::kFloat32, {cap_, H});
  const TensorView rows1_v = TensorView::Contiguous(rows1.data(), DType::kFloat32, {cap_, H});
  DispatchHandle h0, h1;
  ASSERT_TRUE(t_->ExchangeCounts(p_.ids[me], T, p_.K, p_.E, cap_, &h0).ok());  // sequence 0
  auto d0 = t_->StartDispatch(plan_, x, p_.weights[me], &h0, rows0_v, absl::MakeSpan(w0));  // 1
  ASSERT_TRUE(d0.ok()) << d0.status();
  // Sequences 2..31 run to completion while the dispatch of sequence 1 stays in flight.
  for (int i = 0; i < 15; ++i) {
    ASSERT_TRUE(t_->ExchangeCounts(p_.ids[me], T, p_.K, p_.E, cap_, &h1).ok()) << i;
    ASSERT_TRUE(t_->Dispatch(plan_, x, p_.weights[me], &h1, rows1_v, absl::MakeSpan(w1)).ok()) << i;
  }
  // Sequence 32 would share sequence 1's slot.
  const absl::Status refused = t_->ExchangeCounts(p_.ids[me], T, p_.K, p_.E, cap_, &h1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(ToResult(refused), moonepInvalidUsage) << refused;
  EXPECT_NE(refused.message().find("31 operations earlier is still in flight"), std::string::npos)
      << refused;
  ASSERT_TRUE((*d0)->Wait().ok());
  for (int32_t s = 0; s < p_.R; ++s) {
    for (size_t i = 0; i < truth_[s].size(); ++i) {
      if (truth_[s][i].rank != me) continue;
      ASSERT_EQ(0, std::memcmp(&rows0[truth_[s][i].row * H], &p_.x[s][(i / p_.K) * H], H * 4))
          << "row " << truth_[s][i].row << " from rank " << s;
    }
  }
  ASSERT_TRUE(t_->ExchangeCounts(p_.ids[me], T, p_.K, p_.E, cap_, &h1).ok());
  ASSERT_TRUE(t_->Dispatch(plan_, x, p_.weights[me], &h1, rows1_v, absl::MakeSpan(w1)).ok());
}

// Options of a transport that is only created (the creation tests below).
TransportOptions SmallOptions() {
  TransportOptions o;
  o.max_tokens = 4;
  o.max_top_k = 2;
  o.max_row_bytes = 16;
  return o;
}

// MOONEP_UCX_EAGER_BYTES set on one rank only (tests/runtime/bad_env_on_one_rank.sh, registered
// as transport_ucx_eager_bytes_differ_np2): creation fails on every rank naming the variable.
// Before, each rank picked eager or put on its own and a reduce timed out on both sides.
TEST(UcxEnvironment, EagerBytesDifferingBetweenRanksFailsCreation) {
  if (std::getenv("MOONEP_TEST_BAD_RANK") == nullptr) {
    GTEST_SKIP() << "run through bad_env_on_one_rank.sh (transport_ucx_eager_bytes_differ_np2)";
  }
  auto t = CreateTransport("ucx", SmallOptions());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(ToResult(t.status()), moonepInvalidArgument) << t.status();
  EXPECT_NE(t.status().message().find("MOONEP_UCX_EAGER_BYTES differs between ranks"),
            std::string::npos) << t.status();
}

// Ranks that cannot all reach each other (tests/transport/ucx_tls_per_rank.sh: UCX_TLS by rank,
// registered as transport_ucx_unreachable_np3): creation fails on every rank within the test's
// time, rank 1 (which reached both peers) names the peer whose set-up failed. Before, the
// ranks whose endpoint failed returned while rank 1 waited in MPI_Allgather forever.
TEST(UcxEnvironment, RanksThatCannotConnectFailCreationEverywhere) {
  if (std::getenv("MOONEP_TEST_UCX_TLS_PER_RANK") == nullptr) {
    GTEST_SKIP() << "run through ucx_tls_per_rank.sh (transport_ucx_unreachable_np3)";
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  auto t = CreateTransport("ucx", SmallOptions());
  ASSERT_FALSE(t.ok());
  if (rank == 1) {  // its own endpoints were made: it names a peer whose set-up failed
    const std::string m(t.status().message());
    EXPECT_TRUE(m.find("its UCX set-up failed") != std::string::npos ||
                m.find("another rank could not connect") != std::string::npos) << m;
  } else {
    EXPECT_NE(t.status().message().find("endpoint to rank"), std::string::npos) << t.status();
  }
}

TEST(UcxStats, OtherBackendsAreRejected) {
  TransportOptions o;
  o.max_tokens = 1;
  o.max_top_k = 1;
  o.max_row_bytes = 4;
  auto t = CreateTransport("mpi", o);
  ASSERT_TRUE(t.ok()) << t.status();
  auto s = ucx::GetRegistrationStats(**t);
  EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
}

}  // namespace
}  // namespace moonep::transport
