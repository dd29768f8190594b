#include "tests/harness/mpi_test.h"

#include <vector>

namespace moonep::testing {

int WorldRank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int WorldSize() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

std::string RanksWhere(bool failed, MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  std::vector<int> flags(size, 0);
  int mine = failed ? 1 : 0;
  MPI_Allgather(&mine, 1, MPI_INT, flags.data(), 1, MPI_INT, comm);
  std::string ranks;
  for (int r = 0; r < size; ++r) {
    if (flags[r] == 0) continue;
    if (!ranks.empty()) ranks += ",";
    ranks += std::to_string(r);
  }
  return ranks;
}

void MpiTest::TearDown() {
  const bool failed = HasFailure();
  std::string ranks = RanksWhere(failed);
  if (!ranks.empty() && !failed) {
    ADD_FAILURE() << "this test failed on rank(s) " << ranks;
  }
}

}  // namespace moonep::testing
