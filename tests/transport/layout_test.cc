// Single-process, exhaustive checks of transport/layout.h against a brute-force placement: every
// (source, destination) pair of many random problems and plans (random replicas, split experts,
// padding, ranks with zero tokens).
#include "transport/layout.h"

#include <gtest/gtest.h>

#include <climits>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>

#include "moonep/core/status.h"
#include "moonep/core/worker_pool.h"
#include "planner/plan_builder.h"
#include "tests/transport/transport_test_util.h"
#include "transport/common/host_checks.h"
#include "transport/common/host_rows.h"

namespace moonep::transport {
namespace {

using test::BruteForcePlacement;
using test::MakeProblem;
using test::MakeRandomPlan;
using test::Problem;

// Host backends poll without sleeping only with a core per rank on the node; unknown CPU counts
// and nonsense rank counts answer no (the sleeping waits, which are correct everywhere).
TEST(SpinWaitsTest, OnlyWithACorePerLocalRank) {
  EXPECT_TRUE(common::SpinWaits(1, 1));
  EXPECT_TRUE(common::SpinWaits(2, 2));
  EXPECT_TRUE(common::SpinWaits(8, 16));
  EXPECT_FALSE(common::SpinWaits(3, 2));
  EXPECT_FALSE(common::SpinWaits(8, 2));
  EXPECT_FALSE(common::SpinWaits(2, 0));
  EXPECT_FALSE(common::SpinWaits(2, -1));
  EXPECT_FALSE(common::SpinWaits(0, 4));
  // The one-argument form asks the node: one rank always has a core.
  EXPECT_TRUE(common::SpinWaits(1));
}

// The launcher's ranks-per-node variables, first one set wins: digits only, in [1, 2^20]; anything
// else is skipped (strtol took " 4" and "+4"), and none set is 0.
TEST(LauncherLocalRanksTest, DigitsOnlyFirstSetWins) {
  const char* kNames[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"};
  std::string saved[3];
  bool had[3];
  for (int i = 0; i < 3; ++i) {
    const char* v = std::getenv(kNames[i]);
    had[i] = v != nullptr;
    if (had[i]) saved[i] = v;
    unsetenv(kNames[i]);
  }
  EXPECT_EQ(common::LauncherLocalRanks(), 0);
  setenv("MPI_LOCALNRANKS", "6", 1);
  EXPECT_EQ(common::LauncherLocalRanks(), 6);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3", 1);
  EXPECT_EQ(common::LauncherLocalRanks(), 3);  // Open MPI's first
  for (const char* bad : {" 4", "+4", "4x", "0", "-2", "", "2000000"}) {
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", bad, 1);
    EXPECT_EQ(common::LauncherLocalRanks(), 6) << "'" << bad << "' skipped for the next one";
  }
  for (int i = 0; i < 3; ++i) {
    if (had[i]) {
      setenv(kNames[i], saved[i].c_str(), 1);
    } else {
      unsetenv(kNames[i]);
    }
  }
}

// A transport's host threads: the option, else MOONEP_HOST_THREADS, else the node's CPUs shared by
// its ranks, at most kAutoHostThreads; unknown CPU counts and crowded nodes get one (no pool).
TEST(HostThreadsTest, OptionThenEnvironmentThenTheCoresPerRank) {
  EXPECT_EQ(common::HostThreads(3, 8, 2), 3);
  EXPECT_EQ(common::HostThreads(1, 1, 64), 1);
  EXPECT_EQ(common::HostThreads(kMaxHostThreads + 5, 1, 2), kMaxHostThreads);
  if (std::getenv("MOONEP_HOST_THREADS") != nullptr) GTEST_SKIP() << "MOONEP_HOST_THREADS is set";
  EXPECT_EQ(common::HostThreads(0, 1, 16), common::kAutoHostThreads);
  EXPECT_EQ(common::HostThreads(0, 8, 16), 2);
  EXPECT_EQ(common::HostThreads(0, 2, 2), 1);
  EXPECT_EQ(common::HostThreads(0, 4, 2), 1);
  EXPECT_EQ(common::HostThreads(0, 1, 0), 1);
  EXPECT_EQ(common::HostThreads(0, 0, 16), 1);
  EXPECT_EQ(common::MakeHostPool(1, 1), nullptr);
  auto pool = common::MakeHostPool(3, 1);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->size(), 3);
  // Transports with the same count share one pool while any of them lives.
  EXPECT_EQ(common::MakeHostPool(3, 8), pool);
  EXPECT_NE(common::MakeHostPool(2, 1), pool);
}

TEST(ValidateRoutingTest, AcceptsValidAndMinusOne) {
  std::vector<int32_t> ids = {0, 3, -1, -1, 2, 1};
  EXPECT_TRUE(ValidateRouting(ids, 3, 2, 4).ok());
  EXPECT_TRUE(ValidateRouting({}, 0, 2, 4).ok());
}

TEST(ValidateRoutingTest, RejectsBadInputNamingIt) {
  std::vector<int32_t> ids = {0, 4};
  absl::Status s = ValidateRouting(ids, 1, 2, 4);
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("topk_ids[0][1] = 4"), std::string::npos) << s;
  ids = {-2, 1};
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateRouting(ids, 1, 2, 4)));
  ids = {1, 1};
  s = ValidateRouting(ids, 1, 2, 4);
  EXPECT_NE(s.message().find("twice"), std::string::npos) << s;
  ids = {1, 2, 3};
  s = ValidateRouting(ids, 1, 2, 4);
  EXPECT_NE(s.message().find("num_tokens * top_k"), std::string::npos) << s;
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateRouting({}, 0, 0, 4)));
}

struct LayoutCase {
  int32_t R, E, K;
  const char* plan;
  int32_t slots, pad;
};

// A random plan of kind c.plan for p (checked for the transport), its source offsets and the
// brute-force placement of every entry.
struct PlacedProblem {
  planner::Plan plan;
  std::vector<int64_t> offsets;
  std::vector<std::vector<test::Placement>> truth;
};
absl::Status Place(const LayoutCase& c, const Problem& p, uint64_t seed, PlacedProblem* out) {
  MOONEP_RETURN_IF_ERROR(MakeRandomPlan(c.plan, p, seed, c.slots, c.pad, &out->plan));
  MOONEP_RETURN_IF_ERROR(CheckPlanForTransport(out->plan, p.counts));
  planner::ComputeSourceOffsets(p.counts, p.R, p.E, &out->offsets);
  out->truth = BruteForcePlacement(p, out->plan);
  return absl::OkStatus();
}

class LayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(LayoutTest, SenderAndReceiverAgreeWithBruteForce) {
  const LayoutCase c = GetParam();
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    const Problem p = MakeProblem(c.R, c.E, c.K, 1, 9, seed, c.R > 1 ? static_cast<int32_t>(seed % c.R) : -1);
    PlacedProblem q;
    ASSERT_TRUE(Place(c, p, seed, &q).ok());
    const planner::Plan& plan = q.plan;
    const std::vector<int64_t>& offsets = q.offsets;
    const auto& truth = q.truth;

    // Receiver view: rows from each source, in receive order.
    std::vector<ReceiveLayout> recv(p.R);
    for (int32_t d = 0; d < p.R; ++d) {
      BuildReceiveLayout(plan, offsets, d, &recv[d]);
      EXPECT_EQ(recv[d].rank_rows, plan.rank_rows[d]);
    }
    SendLayout send;
    for (int32_t s = 0; s < p.R; ++s) {
      ASSERT_TRUE(BuildSendLayout(plan, offsets, s, p.ids[s], p.T[s], p.K, &send).ok());
      for (size_t i = 0; i < p.ids[s].size(); ++i) {
        ASSERT_EQ(send.dest_rank[i], truth[s][i].rank) << "source " << s << " entry " << i;
        ASSERT_EQ(send.dest_row[i], truth[s][i].row) << "source " << s << " entry " << i;
      }
      for (int32_t d = 0; d < p.R; ++d) {
        // Sender's order of rows for d == receiver's order of rows from s.
        std::vector<int64_t> sender_rows;
        for (int64_t i = send.entry_begin[d]; i < send.entry_begin[d + 1]; ++i) {
          sender_rows.push_back(send.dest_row[send.entries[i]]);
        }
        std::vector<int64_t> receiver_rows;
        const ReceiveLayout& rl = recv[d];
        for (int64_t r = rl.run_begin[s]; r < rl.run_begin[s + 1]; ++r) {
          for (int64_t j = 0; j < rl.run_count[r]; ++j) receiver_rows.push_back(rl.run_row[r] + j);
        }
        ASSERT_EQ(sender_rows, receiver_rows) << "source " << s << " dest " << d;
        ASSERT_TRUE(std::is_sorted(sender_rows.begin(), sender_rows.end()));
        ASSERT_EQ(rl.rows_from(s), static_cast<int64_t>(sender_rows.size()));
        // Dedup: distinct tokens to d, increasing, and each entry points at its token.
        std::set<int32_t> tokens;
        for (int64_t i = send.entry_begin[d]; i < send.entry_begin[d + 1]; ++i) {
          tokens.insert(send.entries[i] / p.K);
          const int32_t u = send.entry_unique[i];
          ASSERT_GE(u, 0);
          ASSERT_LT(u, send.unique_to(d));
          ASSERT_EQ(send.unique_tokens[send.unique_begin[d] + u], send.entries[i] / p.K);
        }
        std::vector<int32_t> expect(tokens.begin(), tokens.end());
        std::vector<int32_t> got(send.unique_tokens.begin() + send.unique_begin[d],
                                 send.unique_tokens.begin() + send.unique_begin[d + 1]);
        ASSERT_EQ(got, expect);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LayoutTest,
    ::testing::Values(LayoutCase{1, 4, 2, "home", 0, 1}, LayoutCase{2, 4, 2, "random", 2, 1},
                      LayoutCase{3, 6, 3, "random", 2, 4}, LayoutCase{4, 8, 4, "random", -1, 1},
                      LayoutCase{4, 4, 3, "random", 3, 2}, LayoutCase{8, 16, 4, "random", 2, 8},
                      LayoutCase{8, 8, 8, "random", 7, 1}, LayoutCase{5, 10, 2, "home", 2, 3}));

// The passes on a pool's threads: chunks of whole tokens, per-chunk counts joined by prefixes.
// The layout must be the one-thread layout bit for bit (and match the brute force), for pools
// that split the entries into 1 to 7 chunks, with tokens without any expert, replicas and split
// experts, and ranks without tokens.
TEST(SendLayoutTest, PoolsOfAnySizeGiveTheSameLayout) {
  std::vector<std::unique_ptr<WorkerPool>> pools;
  for (int threads : {2, 3, 7}) pools.push_back(std::make_unique<WorkerPool>(threads));
  for (const LayoutCase c : {LayoutCase{4, 16, 8, "random", 4, 2}, LayoutCase{3, 12, 6, "home", 0, 1},
                             LayoutCase{8, 32, 8, "random", 3, 4}}) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      SCOPED_TRACE(::testing::Message() << "R " << c.R << " seed " << seed);
      // 1500-3000 tokens a rank: 3 to 7 chunks of kMinEntriesPerChunk entries.
      const Problem p = MakeProblem(c.R, c.E, c.K, 1, 1500, seed, static_cast<int32_t>(seed % c.R));
      PlacedProblem q;
      ASSERT_TRUE(Place(c, p, seed, &q).ok());
      const planner::Plan& plan = q.plan;
      const std::vector<int64_t>& offsets = q.offsets;
      const auto& truth = q.truth;
      for (int32_t s = 0; s < p.R; ++s) {
        SendLayout one, many;
        ASSERT_TRUE(BuildSendLayout(plan, offsets, s, p.ids[s], p.T[s], p.K, &one).ok());
        for (size_t i = 0; i < p.ids[s].size(); ++i) {
          ASSERT_EQ(one.dest_rank[i], truth[s][i].rank) << "source " << s << " entry " << i;
          ASSERT_EQ(one.dest_row[i], truth[s][i].row) << "source " << s << " entry " << i;
        }
        for (const auto& pool : pools) {
          SCOPED_TRACE(::testing::Message() << "source " << s << " threads " << pool->size());
          // Reused across pools, as a transport's handle is: stale scratch must not leak in.
          ASSERT_TRUE(BuildSendLayout(plan, offsets, s, p.ids[s], p.T[s], p.K, &many, pool.get()).ok());
          EXPECT_EQ(many.dest_rank, one.dest_rank);
          EXPECT_EQ(many.dest_row, one.dest_row);
          EXPECT_EQ(many.entry_begin, one.entry_begin);
          EXPECT_EQ(many.entries, one.entries);
          EXPECT_EQ(many.entry_unique, one.entry_unique);
          EXPECT_EQ(many.unique_begin, one.unique_begin);
          EXPECT_EQ(many.unique_tokens, one.unique_tokens);
        }
      }
    }
  }
}

TEST(CheckPlanTest, RejectsCorruptPlans) {
  const Problem p = MakeProblem(4, 8, 3, 1, 20, 3);
  planner::Plan good;
  ASSERT_TRUE(MakeRandomPlan("random", p, 3, 2, 4, &good).ok());
  ASSERT_TRUE(CheckPlanForTransport(good, p.counts).ok());
  ASSERT_GT(good.piece_dest.size(), 0u);
  {
    planner::Plan bad = good;
    bad.piece_row[0] += 1;
    EXPECT_TRUE(absl::IsInvalidArgument(CheckPlanForTransport(bad, p.counts)));
  }
  {
    planner::Plan bad = good;
    bad.piece_dest[0] = 9;
    EXPECT_TRUE(absl::IsInvalidArgument(CheckPlanForTransport(bad, p.counts)));
  }
  {
    planner::Plan bad = good;
    bad.rank_rows[1] = 0;
    bool any = false;
    for (int g = 0; g < bad.num_groups(); ++g) any |= bad.group_padded[1 * bad.num_groups() + g] > 0;
    if (any) {
      EXPECT_TRUE(absl::IsInvalidArgument(CheckPlanForTransport(bad, p.counts)));
    }
  }
  {
    std::vector<int64_t> counts = p.counts;
    counts[0] += 1;
    EXPECT_TRUE(absl::IsInvalidArgument(CheckPlanForTransport(good, counts)));
  }
  {
    planner::Plan bad = good;
    bad.piece_count.pop_back();
    EXPECT_TRUE(absl::IsInvalidArgument(CheckPlanForTransport(bad, p.counts)));
  }
}

// A plan whose home groups (home_group, read by the check through GroupOf) disagree with the
// groups' experts (local_experts, read by ForEachRun through ExpertOfGroup) would pass the piece
// checks on one group and land its rows in another: R=2, E=2, epn=1, local_experts=[0,1],
// home_group=[1,0]. Both pieces fill rank 1's only group, so rank 0 has rank_rows 0, yet
// ForEachRun sends expert 0's rows to rank 0's group 0, past its receive buffer.
TEST(CheckPlanTest, RejectsHomeGroupThatDisagreesWithLocalExperts) {
  const Problem p = MakeProblem(2, 2, 1, 1, 10, 7, -1, /*drop=*/0.0);
  planner::Plan good;
  ASSERT_TRUE(MakeRandomPlan("home", p, 7, 0, 1, &good).ok());
  ASSERT_TRUE(CheckPlanForTransport(good, p.counts).ok());
  ASSERT_EQ(good.experts_per_rank, 1);
  ASSERT_EQ(good.local_experts, (std::vector<int32_t>{0, 1}));
  const int64_t c0 = p.counts[0] + p.counts[2], c1 = p.counts[1] + p.counts[3];
  ASSERT_GT(c0, 0);
  ASSERT_GT(c1, 0);
  planner::Plan bad = good;
  bad.home_group = {1, 0};
  bad.group_offset = {0, 0};
  bad.group_count = {0, c0 + c1};
  bad.group_padded = {0, c0 + c1};
  bad.rank_rows = {0, c0 + c1};
  bad.piece_begin = {0, 1, 2};
  bad.piece_dest = {0, 1};
  bad.piece_start = {0, 0};
  bad.piece_count = {c0, c1};
  bad.piece_row = {0, c0};
  const absl::Status s = CheckPlanForTransport(bad, p.counts);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("home_group[0] = 1"), std::string::npos) << s;

  // In range but naming another expert's group: home_group[0] = 0 is group 0 of rank 0, which
  // local_experts says computes expert 0, so that one is right; swapping local_experts is not.
  planner::Plan swapped = good;
  swapped.local_experts = {1, 0};
  const absl::Status s2 = CheckPlanForTransport(swapped, p.counts);
  EXPECT_TRUE(absl::IsInvalidArgument(s2)) << s2;
  EXPECT_NE(s2.message().find("local_experts"), std::string::npos) << s2;
}

TEST(CheckPlanTest, RejectsPieceBeginOutsideThePieceArrays) {
  const Problem p = MakeProblem(1, 2, 1, 1, 10, 9, -1, /*drop=*/0.0);
  planner::Plan good;
  ASSERT_TRUE(MakeRandomPlan("home", p, 9, 0, 1, &good).ok());
  ASSERT_TRUE(CheckPlanForTransport(good, p.counts).ok());
  ASSERT_EQ(good.piece_dest.size(), 2u);
  // piece_begin = [0, 5, 2]: ends at P = 2, but expert 0's range [0, 5) reads past the arrays.
  planner::Plan bad = good;
  bad.piece_begin = {0, 5, 2};
  const absl::Status s = CheckPlanForTransport(bad, p.counts);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("piece_begin[1] = 5"), std::string::npos) << s;
}

TEST(CheckPlanTest, RejectsASlotThatRepeatsAnExpertOnItsRank) {
  // Two slots of one rank holding the same expert: ForEachRun would report that expert's rows
  // once per slot group.
  const Problem p = MakeProblem(2, 2, 1, 1, 10, 11, -1, /*drop=*/0.0);
  planner::Plan good;
  ASSERT_TRUE(MakeRandomPlan("home", p, 11, 2, 1, &good).ok());
  ASSERT_TRUE(CheckPlanForTransport(good, p.counts).ok());
  planner::Plan bad = good;
  bad.slot_expert = {1, 1, -1, -1};  // rank 0's two slots both hold expert 1 (no rows in them)
  const absl::Status s = CheckPlanForTransport(bad, p.counts);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("slot"), std::string::npos) << s;
  bad.slot_expert = {0, -1, -1, -1};  // a replica of rank 0's own expert (no home_replicas)
  EXPECT_TRUE(absl::IsInvalidArgument(CheckPlanForTransport(bad, p.counts)));
}

TEST(ValidateRoutingTest, BoundsEntriesPerRankBelowInt32) {
  // Entry indices (t * K + k) are int32 in the layouts: num_tokens * top_k must stay below 2^31.
  const absl::Status s = ValidateRouting({}, int64_t{1} << 30, 2, 8);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("2147483647"), std::string::npos) << s;
  // No overflow of num_tokens * top_k either.
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateRouting({}, int64_t{1} << 61, 8, 8)));
}

TEST(CheckRowTensorTest, RejectsNegativeAndEmptyShapes) {
  std::vector<float> data(16);
  TensorView v = TensorView::Contiguous(data.data(), DType::kFloat32, {4, 4});
  EXPECT_TRUE(common::CheckRowTensor(v, "y", 0, -1, "MPI").ok());
  // Any column count allowed (cols = -1) must still be a count: a contiguous [4, -3] view passed
  // every check, and its row bytes went negative (huge as size_t) into memset and memcpy.
  TensorView neg = TensorView::Contiguous(data.data(), DType::kFloat32, {4, -3});
  absl::Status s = common::CheckRowTensor(neg, "y", 0, -1, "MPI");
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("y: has -3 columns"), std::string::npos) << s;
  TensorView no_cols = TensorView::Contiguous(data.data(), DType::kFloat32, {4, 0});
  EXPECT_TRUE(absl::IsInvalidArgument(common::CheckRowTensor(no_cols, "y", 0, -1, "MPI")));
  TensorView neg_rows = TensorView::Contiguous(data.data(), DType::kFloat32, {-1, 4});
  s = common::CheckRowTensor(neg_rows, "x", -5, -1, "MPI");
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("x: has -1 rows"), std::string::npos) << s;
}

TEST(RunBlocksTest, SplitsRunsAboveTheBlockLimit) {
  // MPI's block lengths are int: a combine run of 2 GiB or more went out as a negative length.
  // Here with a 100-byte limit and 16-byte rows: 6 rows per block.
  std::vector<int64_t> displs;
  std::vector<int> lengths;
  common::AppendRunBlocks(3, 14, 16, 100, &displs, &lengths);
  EXPECT_EQ(displs, (std::vector<int64_t>{48, 48 + 96, 48 + 192}));
  EXPECT_EQ(lengths, (std::vector<int>{96, 96, 32}));
  common::AppendRunBlocks(40, 2, 16, 100, &displs, &lengths);  // appends, short runs whole
  EXPECT_EQ(displs.back(), 640);
  EXPECT_EQ(lengths.back(), 32);
  // The MPI limit: 3 rows of 1 GiB (the largest row allowed) become 3 blocks, each an int.
  displs.clear();
  lengths.clear();
  const int64_t gib = int64_t{1} << 30;
  common::AppendRunBlocks(0, 3, gib, INT_MAX, &displs, &lengths);
  EXPECT_EQ(displs, (std::vector<int64_t>{0, gib, 2 * gib}));
  EXPECT_EQ(lengths, (std::vector<int>{1 << 30, 1 << 30, 1 << 30}));
  // A 2 GiB run of 1 MiB rows: two blocks below INT_MAX.
  displs.clear();
  lengths.clear();
  common::AppendRunBlocks(0, 2048, 1 << 20, INT_MAX, &displs, &lengths);
  ASSERT_EQ(lengths.size(), 2u);
  EXPECT_EQ(int64_t{lengths[0]} + lengths[1], 2 * gib);
  EXPECT_GT(lengths[0], 0);
  EXPECT_GT(lengths[1], 0);
}

// A routing that does not match the counts is refused, by one thread and by a pool whose later
// chunk holds the changed entry.
TEST(SendLayoutTest, RejectsRoutingThatDoesNotMatchCounts) {
  const Problem p = MakeProblem(2, 8, 4, 1, 4000, 9);
  planner::Plan plan;
  ASSERT_TRUE(MakeRandomPlan("home", p, 9, 0, 1, &plan).ok());
  std::vector<int64_t> offsets;
  planner::ComputeSourceOffsets(p.counts, p.R, p.E, &offsets);
  std::vector<int32_t> ids = p.ids[0];
  for (size_t i = ids.size() / 2; i < ids.size(); ++i) {  // in a later chunk
    if (ids[i] >= 0 && ids[i] + 1 < p.E) {
      bool clash = false;
      for (size_t j = i / p.K * p.K; j < i / p.K * p.K + p.K; ++j) clash |= ids[j] == ids[i] + 1;
      if (clash) continue;
      ++ids[i];
      break;
    }
  }
  WorkerPool pool(3);
  for (WorkerPool* with : {static_cast<WorkerPool*>(nullptr), &pool}) {
    SendLayout send;
    absl::Status st = BuildSendLayout(plan, offsets, 0, ids, p.T[0], p.K, &send, with);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_NE(st.message().find("the counts say"), std::string::npos) << st;
  }
}

}  // namespace
}  // namespace moonep::transport
