// The verdict of a collective creation when one rank's variable is malformed
// (tests/runtime/bad_env_on_one_rank.sh sets MOONEP_TEST_BAD_VAR, default MOONEP_DEBUG, on rank
// MOONEP_TEST_BAD_RANK only).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "moonep/core/status.h"

namespace moonep::testing {

// Times create() (a creation returning its status) and checks the verdict: InvalidArgument naming
// the variable (MOONEP_TEST_BAD_VAR, default MOONEP_DEBUG) on `bad_rank`, RemoteError on every other rank, and within 1.5 s on each (no rank is
// left to wait for a timeout).
template <typename Create>
void ExpectBadEnvironmentFailsEverywhere(int rank, int bad_rank, Create&& create) {
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = create();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(status.ok());
  if (rank == bad_rank) {
    EXPECT_EQ(ToResult(status), moonepInvalidArgument) << status;
    const char* var = std::getenv("MOONEP_TEST_BAD_VAR");
    EXPECT_NE(std::string(status.message()).find(var != nullptr ? var : "MOONEP_DEBUG"),
              std::string::npos) << status;
  } else {
    EXPECT_EQ(ToResult(status), moonepRemoteError) << status;
  }
  EXPECT_LT(seconds, 1.5) << "creation took " << seconds << " s";
}

}  // namespace moonep::testing
