#include "moonep/core/status.h"

#include <gtest/gtest.h>

#include <cstring>

namespace moonep {
namespace {

TEST(StatusTest, MapsAbslCodesToResults) {
  EXPECT_EQ(ToResult(absl::OkStatus()), moonepSuccess);
  EXPECT_EQ(ToResult(InvalidArgument("x=%d", 3)), moonepInvalidArgument);
  EXPECT_EQ(ToResult(InvalidUsage("late")), moonepInvalidUsage);
  EXPECT_EQ(ToResult(Timeout("dispatch: rank %d", 2)), moonepTimeout);
  EXPECT_EQ(ToResult(OutOfMemory("full")), moonepOutOfMemory);
  EXPECT_EQ(ToResult(Unavailable("no cuda")), moonepUnavailable);
  EXPECT_EQ(ToResult(Internal("bug")), moonepInternalError);
}

TEST(StatusTest, PayloadCarriesExactResult) {
  EXPECT_EQ(ToResult(RemoteError("peer failed")), moonepRemoteError);
  EXPECT_EQ(ToResult(SystemError("MPI failed")), moonepSystemError);
  EXPECT_EQ(ToResult(MakeStatus(moonepCudaError, "cuda")), moonepCudaError);
}

TEST(StatusTest, AnnotateKeepsCodeAndPayload) {
  absl::Status s = Annotate(RemoteError("peer 3"), "dispatch");
  EXPECT_EQ(ToResult(s), moonepRemoteError);
  EXPECT_EQ(s.message(), "dispatch: peer 3");
}

absl::StatusOr<int> Half(int v) {
  if (v % 2 != 0) return InvalidArgument("odd: %d", v);
  return v / 2;
}

absl::Status UseMacros(int v, int* out) {
  MOONEP_ASSIGN_OR_RETURN(int h, Half(v));
  MOONEP_CHECK_ARG(h < 100, "too large: %d", h);
  *out = h;
  return absl::OkStatus();
}

TEST(StatusTest, Macros) {
  int out = 0;
  EXPECT_TRUE(UseMacros(10, &out).ok());
  EXPECT_EQ(out, 5);
  EXPECT_EQ(UseMacros(3, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UseMacros(400, &out).message(), "too large: 200");
}

TEST(CApiTest, VersionAndErrorStrings) {
  int version = 0;
  ASSERT_EQ(moonepGetVersion(&version), moonepSuccess);
  EXPECT_EQ(version, MOONEP_VERSION);
  EXPECT_EQ(moonepGetVersion(nullptr), moonepInvalidArgument);
  EXPECT_NE(std::strstr(moonepGetLastThreadError(), "version is NULL"), nullptr);
  // The thread's message is that of its latest call: empty again after a success.
  ASSERT_EQ(moonepGetVersion(&version), moonepSuccess);
  EXPECT_STREQ(moonepGetLastThreadError(), "");
  for (int r = 0; r <= moonepNumResults; ++r) {
    const char* s = moonepGetErrorString(static_cast<moonepResult_t>(r));
    ASSERT_NE(s, nullptr);
    EXPECT_GT(std::strlen(s), 0u);
  }
  EXPECT_STREQ(moonepGetErrorString(moonepTimeout),
               "timeout (a peer did not answer within MOONEP_TIMEOUT_MS)");
}

}  // namespace
}  // namespace moonep
