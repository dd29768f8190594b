#include "moonep/core/env.h"

#include <gtest/gtest.h>
#include <stdlib.h>

namespace moonep {
namespace {

TEST(EnvTest, ReadsIntegersAndStrings) {
  setenv("MOONEP_TEST_INT_KNOB", "1234", 1);
  setenv("MOONEP_TEST_BAD_KNOB", "12abc", 1);
  setenv("MOONEP_TEST_STR_KNOB", "hello", 1);
  EXPECT_EQ(env::ReadInt("TEST_INT_KNOB", 7), 1234);
  EXPECT_EQ(env::ReadInt("TEST_BAD_KNOB", 7), 7);
  EXPECT_EQ(env::ReadInt("TEST_UNSET_KNOB", 7), 7);
  EXPECT_EQ(env::ReadString("TEST_STR_KNOB", "x"), "hello");
  EXPECT_EQ(env::ReadString("TEST_UNSET_KNOB", "x"), "x");
}

MOONEP_INT_PARAM(CachedKnob, "TEST_CACHED_KNOB", 5)

TEST(EnvTest, ParamIsReadOnce) {
  setenv("MOONEP_TEST_CACHED_KNOB", "11", 1);
  EXPECT_EQ(CachedKnob(), 11);
  setenv("MOONEP_TEST_CACHED_KNOB", "12", 1);
  EXPECT_EQ(CachedKnob(), 11);
}

}  // namespace
}  // namespace moonep
