// Multi-rank test support. Tests derive their fixture from MpiTest so that a failure on any rank
// fails the test on every rank (TearDown agrees on the outcome with an allreduce).
#pragma once

#include <mpi.h>
#include <gtest/gtest.h>

#include <string>

namespace moonep::testing {

int WorldRank();
int WorldSize();

class MpiTest : public ::testing::Test {
 protected:
  void TearDown() override;
  int rank() const { return WorldRank(); }
  int size() const { return WorldSize(); }
};

// Allreduce of a failure flag: returns the list of ranks where `failed` was true ("1,3").
std::string RanksWhere(bool failed, MPI_Comm comm = MPI_COMM_WORLD);

}  // namespace moonep::testing
