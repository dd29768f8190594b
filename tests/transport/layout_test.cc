// Single-process, exhaustive checks of transport/layout.h against a brute-force placement: every
// (source, destination) pair of many random problems and plans (random replicas, split experts,
// padding, ranks with zero tokens).
#include "transport/layout.h"

#include <gtest/gtest.h>

#include <set>

#include "planner/plan_builder.h"
#include "tests/transport/transport_test_util.h"

namespace moonep::transport {
namespace {

using test::BruteForcePlacement;
using test::MakeProblem;
using test::MakeRandomPlan;
using test::Problem;

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

class LayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(LayoutTest, SenderAndReceiverAgreeWithBruteForce) {
  const LayoutCase c = GetParam();
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    const Problem p = MakeProblem(c.R, c.E, c.K, 1, 9, seed, c.R > 1 ? static_cast<int32_t>(seed % c.R) : -1);
    planner::Plan plan;
    ASSERT_TRUE(MakeRandomPlan(c.plan, p, seed, c.slots, c.pad, &plan).ok());
    ASSERT_TRUE(CheckPlanForTransport(plan, p.counts).ok());
    std::vector<int64_t> offsets;
    planner::ComputeSourceOffsets(p.counts, p.R, p.E, &offsets);
    const auto truth = BruteForcePlacement(p, plan);

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

TEST(SendLayoutTest, RejectsRoutingThatDoesNotMatchCounts) {
  const Problem p = MakeProblem(2, 4, 2, 1, 10, 5);
  planner::Plan plan;
  ASSERT_TRUE(MakeRandomPlan("home", p, 5, 0, 1, &plan).ok());
  std::vector<int64_t> offsets;
  planner::ComputeSourceOffsets(p.counts, p.R, p.E, &offsets);
  std::vector<int32_t> ids = p.ids[0];
  for (auto& e : ids) {
    if (e >= 0) {
      e = (e + 1) % p.E;
      break;
    }
  }
  SendLayout send;
  EXPECT_TRUE(absl::IsInvalidArgument(BuildSendLayout(plan, offsets, 0, ids, p.T[0], p.K, &send)));
}

}  // namespace
}  // namespace moonep::transport
