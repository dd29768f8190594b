// A real multi-rank check of the harness: an allgather of per-rank random counts equals the
// matrix every rank computes locally from the same seeds.
#include <mpi.h>

#include <cstdint>
#include <random>
#include <vector>

#include "tests/harness/mpi_test.h"

namespace {

std::vector<int64_t> CountsOfRank(int rank, int experts) {
  std::mt19937_64 rng(1234 + static_cast<uint64_t>(rank));
  std::uniform_int_distribution<int64_t> dist(0, 1 << 20);
  std::vector<int64_t> counts(experts);
  for (auto& c : counts) c = dist(rng);
  return counts;
}

class AllgatherTest : public moonep::testing::MpiTest {};

TEST_F(AllgatherTest, CountsMatrixMatchesLocalComputation) {
  const int experts = 37;
  std::vector<int64_t> mine = CountsOfRank(rank(), experts);
  std::vector<int64_t> gathered(static_cast<size_t>(size()) * experts, -1);
  ASSERT_EQ(MPI_Allgather(mine.data(), experts, MPI_INT64_T, gathered.data(), experts, MPI_INT64_T,
                          MPI_COMM_WORLD),
            MPI_SUCCESS);
  for (int r = 0; r < size(); ++r) {
    std::vector<int64_t> expected = CountsOfRank(r, experts);
    for (int e = 0; e < experts; ++e) {
      ASSERT_EQ(gathered[static_cast<size_t>(r) * experts + e], expected[e]) << "rank " << r << " expert " << e;
    }
  }
}

TEST_F(AllgatherTest, FailureOnOneRankIsSeenByAll) {
  // RanksWhere is what MpiTest::TearDown uses to agree on failures.
  const bool pretend_failed = rank() == size() - 1;
  std::string ranks = moonep::testing::RanksWhere(pretend_failed);
  EXPECT_EQ(ranks, std::to_string(size() - 1));
}

}  // namespace
