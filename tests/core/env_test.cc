#include "moonep/core/env.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "moonep/core/logging.h"

namespace moonep {
namespace {

TEST(EnvTest, ReadsIntegersAndStrings) {
  setenv("MOONEP_TEST_INT_KNOB", "1234", 1);
  setenv("MOONEP_TEST_STR_KNOB", "hello", 1);
  EXPECT_EQ(env::ReadInt("TEST_INT_KNOB", 7), 1234);
  EXPECT_EQ(env::ReadInt("TEST_UNSET_KNOB", 7), 7);
  EXPECT_EQ(env::ReadString("TEST_STR_KNOB", "x"), "hello");
  EXPECT_EQ(env::ReadString("TEST_UNSET_KNOB", "x"), "x");
  // Base 10 only: "010" is ten, not eight; hex is malformed (warned, fallback).
  setenv("MOONEP_TEST_OCTAL_KNOB", "010", 1);
  EXPECT_EQ(env::ReadInt("TEST_OCTAL_KNOB", 7), 10);
  setenv("MOONEP_TEST_HEX_KNOB", "0x10", 1);
  EXPECT_EQ(env::ReadInt("TEST_HEX_KNOB", 7), 7);
}

// Checked knobs: garbage is an error naming the variable, never a silent default.
TEST(EnvTest, ParseIntRejectsMalformedAndOutOfRangeValuesNamingTheVariable) {
  const auto parse = [](const char* value) {
    setenv("MOONEP_TEST_CHECKED_KNOB", value, 1);
    return env::ParseInt("TEST_CHECKED_KNOB", 60000, 1, 1000000);
  };
  EXPECT_EQ(*parse("2000"), 2000);
  EXPECT_EQ(*parse("010"), 10);
  EXPECT_EQ(*parse("+5"), 5);
  for (const char* bad : {"12abc", "0x10", " 5", "5 ", "-", "1e3", "99999999999999999999x",
                          "+-5"}) {
    const absl::StatusOr<int64_t> v = parse(bad);
    ASSERT_FALSE(v.ok()) << "'" << bad << "' was accepted as " << *v;
    EXPECT_TRUE(absl::IsInvalidArgument(v.status())) << v.status();
    EXPECT_NE(v.status().message().find(std::string("MOONEP_TEST_CHECKED_KNOB=") + bad),
              std::string::npos) << v.status();
  }
  for (const char* out : {"0", "-5", "1000001"}) {
    const absl::StatusOr<int64_t> v = parse(out);
    ASSERT_FALSE(v.ok()) << out << " was accepted";
    EXPECT_NE(v.status().message().find("out of range [1, 1000000]"), std::string::npos)
        << v.status();
  }
  // Digits beyond int64 are a number above (below) the range, not garbage: out of range, and the
  // message says so (it said "not a base-10 integer").
  for (const char* out : {"99999999999999999999", "9223372036854775808", "-9223372036854775809",
                          "-99999999999999999999"}) {
    const absl::StatusOr<int64_t> v = parse(out);
    ASSERT_FALSE(v.ok()) << out << " was accepted";
    EXPECT_TRUE(absl::IsInvalidArgument(v.status())) << v.status();
    EXPECT_NE(v.status().message().find(std::string("MOONEP_TEST_CHECKED_KNOB=") + out +
                                        ": out of range [1, 1000000]"),
              std::string::npos) << v.status();
  }
  // Empty counts as unset: the fallback.
  setenv("MOONEP_TEST_CHECKED_KNOB", "", 1);
  EXPECT_EQ(*env::ParseInt("TEST_CHECKED_KNOB", 60000, 1, 1000000), 60000);
  unsetenv("MOONEP_TEST_CHECKED_KNOB");
  EXPECT_EQ(*env::ParseInt("TEST_CHECKED_KNOB", 60000, 1, 1000000), 60000);
}

// A knob whose range ends at INT64_MAX (as MOONEP_TIMEOUT_MS and MOONEP_NUM_THREADS do, their
// readers capping large values) takes digits beyond int64 as INT64_MAX: capped like any large
// value, instead of refused as malformed. Below INT64_MIN is still out of range for it.
TEST(EnvTest, DigitsBeyondInt64AreTheLargestValueOfAnUnboundedKnob) {
  const auto parse = [](const char* value) {
    setenv("MOONEP_TEST_UNBOUNDED_KNOB", value, 1);
    return env::ParseInt("TEST_UNBOUNDED_KNOB", 60000, 1, INT64_MAX);
  };
  EXPECT_EQ(*parse("9223372036854775807"), INT64_MAX);
  EXPECT_EQ(*parse("9223372036854775808"), INT64_MAX);
  EXPECT_EQ(*parse("99999999999999999999"), INT64_MAX);
  EXPECT_EQ(*parse("+99999999999999999999"), INT64_MAX);
  EXPECT_EQ(*parse("000000000000000000000000000000042"), 42);  // long, but within int64
  for (const char* out : {"-99999999999999999999", "0"}) {
    const absl::StatusOr<int64_t> v = parse(out);
    ASSERT_FALSE(v.ok()) << out << " was accepted";
    EXPECT_NE(v.status().message().find(std::string("MOONEP_TEST_UNBOUNDED_KNOB=") + out +
                                        ": out of range [1, 9223372036854775807]"),
              std::string::npos) << v.status();
  }
  // A malformed value past int64 is still malformed.
  const absl::StatusOr<int64_t> junk = parse("99999999999999999999ms");
  ASSERT_FALSE(junk.ok());
  EXPECT_NE(junk.status().message().find("not a base-10 integer"), std::string::npos)
      << junk.status();
  // The timeout's reader caps what this gives: the largest value is kMaxTimeoutMs.
  EXPECT_EQ(std::min(*parse("99999999999999999999"), param::kMaxTimeoutMs), param::kMaxTimeoutMs);
  unsetenv("MOONEP_TEST_UNBOUNDED_KNOB");
}

// Unchecked knobs read digits beyond int64 the same way (their readers bound them); garbage still
// gives the fallback.
TEST(EnvTest, ReadIntSaturatesBeyondInt64) {
  setenv("MOONEP_TEST_BIG_KNOB", "99999999999999999999", 1);
  EXPECT_EQ(env::ReadInt("TEST_BIG_KNOB", 7), INT64_MAX);
  setenv("MOONEP_TEST_BIG_KNOB", "-99999999999999999999", 1);
  EXPECT_EQ(env::ReadInt("TEST_BIG_KNOB", 7), INT64_MIN);
  setenv("MOONEP_TEST_BIG_KNOB", "-5", 1);
  EXPECT_EQ(env::ReadInt("TEST_BIG_KNOB", 7), -5);
  setenv("MOONEP_TEST_BIG_KNOB", "", 1);
  EXPECT_EQ(env::ReadInt("TEST_BIG_KNOB", 7), 7);
  unsetenv("MOONEP_TEST_BIG_KNOB");
}

// The tools' flag parsers keep refusing what does not fit int64 (their ranges are small).
TEST(EnvTest, ParseBase10RefusesValuesBeyondInt64) {
  int64_t v = 3;
  EXPECT_FALSE(env::ParseBase10("99999999999999999999", &v));
  EXPECT_FALSE(env::ParseBase10("-99999999999999999999", &v));
  EXPECT_EQ(v, 3);
  EXPECT_TRUE(env::ParseBase10("-9223372036854775808", &v));
  EXPECT_EQ(v, INT64_MIN);
  EXPECT_FALSE(env::ParseBase10InRange("99999999999999999999", 1, INT64_MAX, &v));
}

MOONEP_INT_PARAM(CachedKnob, "TEST_CACHED_KNOB", 5)

TEST(EnvTest, ParamIsReadOnce) {
  setenv("MOONEP_TEST_CACHED_KNOB", "11", 1);
  EXPECT_EQ(CachedKnob(), 11);
  setenv("MOONEP_TEST_CACHED_KNOB", "12", 1);
  EXPECT_EQ(CachedKnob(), 11);
}

MOONEP_CHECKED_INT_PARAM(CheckedCachedKnob, "TEST_CHECKED_CACHED_KNOB", 5, 0, 100)

TEST(EnvTest, CheckedParamKeepsItsError) {
  setenv("MOONEP_TEST_CHECKED_CACHED_KNOB", "-5", 1);
  ASSERT_FALSE(CheckedCachedKnob().ok());
  EXPECT_NE(CheckedCachedKnob().status().message().find("MOONEP_TEST_CHECKED_CACHED_KNOB=-5"),
            std::string::npos) << CheckedCachedKnob().status();
  setenv("MOONEP_TEST_CHECKED_CACHED_KNOB", "7", 1);
  EXPECT_FALSE(CheckedCachedKnob().ok());  // read once
}

TEST(EnvTest, TimeoutIsAtMostTheMaximum) {
  // param::TimeoutMs() is read once per process; here it is whatever the test runs with, always
  // within [1, kMaxTimeoutMs].
  EXPECT_GE(param::TimeoutMs(), 1);
  EXPECT_LE(param::TimeoutMs(), param::kMaxTimeoutMs);
}

TEST(LogLevelTest, ParsesTheLevelsAndRejectsAnythingElse) {
  EXPECT_EQ(*log::ParseLevel("NONE"), log::Level::kNone);
  EXPECT_EQ(*log::ParseLevel("off"), log::Level::kNone);
  EXPECT_EQ(*log::ParseLevel("Warn"), log::Level::kWarn);
  EXPECT_EQ(*log::ParseLevel("info"), log::Level::kInfo);
  EXPECT_EQ(*log::ParseLevel("TRACE"), log::Level::kTrace);
  for (const char* bad : {"garbage", "WARNING", "2", " INFO"}) {
    const auto level = log::ParseLevel(bad);
    ASSERT_FALSE(level.ok()) << bad << " was accepted";
    EXPECT_TRUE(absl::IsInvalidArgument(level.status()));
    EXPECT_NE(level.status().message().find(std::string("MOONEP_DEBUG=") + bad),
              std::string::npos) << level.status();
  }
}

}  // namespace
}  // namespace moonep
