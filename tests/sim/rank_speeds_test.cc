// --rank_speeds: both forms parsed and resolved against R, bad specs refused with what is wrong,
// and the report's form read back.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/sim/rank_speeds.h"

namespace moonep::sim {
namespace {

// The speeds `spec` gives `num_ranks` ranks; fails the test when it is refused.
std::vector<double> Resolve(const std::string& spec, int32_t num_ranks) {
  absl::StatusOr<RankSpeedsSpec> parsed = ParseRankSpeeds(spec);
  EXPECT_TRUE(parsed.ok()) << spec << ": " << parsed.status();
  if (!parsed.ok()) return {};
  absl::StatusOr<std::vector<double>> speeds = ResolveRankSpeeds(*parsed, num_ranks);
  EXPECT_TRUE(speeds.ok()) << spec << ": " << speeds.status();
  return speeds.ok() ? *speeds : std::vector<double>{};
}

// The error `spec` gets (parsed, then resolved for `num_ranks`), "" when it is accepted.
std::string Error(const std::string& spec, int32_t num_ranks) {
  absl::StatusOr<RankSpeedsSpec> parsed = ParseRankSpeeds(spec);
  if (!parsed.ok()) {
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    return std::string(parsed.status().message());
  }
  absl::StatusOr<std::vector<double>> speeds = ResolveRankSpeeds(*parsed, num_ranks);
  if (speeds.ok()) return "";
  EXPECT_EQ(speeds.status().code(), absl::StatusCode::kInvalidArgument) << spec;
  return std::string(speeds.status().message());
}

TEST(RankSpeedsTest, BothFormsResolve) {
  EXPECT_EQ(Resolve("1,1,0.7,1", 4), (std::vector<double>{1, 1, 0.7, 1}));
  EXPECT_EQ(Resolve(" 1, 2 ,0.5,1 ", 4), (std::vector<double>{1, 2, 0.5, 1}));
  EXPECT_EQ(Resolve("0.7@3", 4), (std::vector<double>{1, 1, 1, 0.7}));
  std::vector<double> two(32, 1.0);
  two[3] = 0.7;
  two[17] = 0.5;
  EXPECT_EQ(Resolve("0.7@3,0.5@17", 32), two);
  EXPECT_EQ(Resolve("0.5@17, 0.7@3", 32), two);  // any order
  std::vector<double> node(24, 1.0);
  for (int r = 8; r <= 15; ++r) node[r] = 0.8;
  EXPECT_EQ(Resolve("0.8@8-15", 24), node);
  EXPECT_EQ(Resolve("1e-1@0", 2), (std::vector<double>{0.1, 1}));
  // The same spec on any R above its ranks; empty: every rank at 1.
  EXPECT_EQ(Resolve("0.7@3", 6), (std::vector<double>{1, 1, 1, 0.7, 1, 1}));
  EXPECT_EQ(Resolve("", 3), (std::vector<double>{1, 1, 1}));

  EXPECT_TRUE(ParseRankSpeeds("")->empty());
  EXPECT_TRUE(ParseRankSpeeds("")->all_one());
  EXPECT_TRUE(ParseRankSpeeds("1,1,1")->all_one());
  EXPECT_TRUE(ParseRankSpeeds("1@2")->all_one());
  EXPECT_FALSE(ParseRankSpeeds("1,1,0.99")->all_one());
  EXPECT_FALSE(ParseRankSpeeds("0.5,0.5")->all_one());  // a slower machine, not the default one
}

TEST(RankSpeedsTest, BadSpecsSayWhatIsWrong) {
  const struct {
    const char* spec;
    int32_t ranks;
    const char* error;
  } cases[] = {
      {"abc", 4, "'abc' is not a number"},
      {"0.7@x", 4, "'x' in '0.7@x' is not a rank"},
      {"0.7@-1", 4, "'-1' in '0.7@-1' is not a rank"},
      {"0.7@", 4, "'' in '0.7@' is not a rank"},
      {"0.7@1-", 4, "'1-' in '0.7@1-' is not a rank"},
      {"0.7@3-2", 4, "the ranks 3-2 run backwards"},
      {"0.7@1@2", 4, "more than one '@'"},
      {"0", 1, "speed 0 is outside [1e-6, 1e6]"},
      {"-0.5@1", 4, "speed -0.5 is outside"},
      {"nan@1", 4, "speed nan is outside"},
      {"inf,1", 2, "speed inf is outside"},
      {"1e-7@0", 4, "speed 1e-7 is outside"},
      {"2e6@0", 4, "speed 2e6 is outside"},
      {"1,,1", 3, "an empty item in '1,,1'"},
      {",", 1, "an empty item"},
      {"1,0.7@3", 4, "mixes the two forms"},
      {"0.7@3,0.5@3", 4, "rank 3 is given two speeds"},
      {"0.7@1-4,0.5@3", 8, "rank 3 is given two speeds"},
      // Resolved against R.
      {"1,1,0.7", 4, "3 speeds for 4 ranks"},
      {"1,1,0.7,1,1", 4, "5 speeds for 4 ranks"},
      {"0.7@4", 4, "rank 4 is out of range: there are 4 ranks (0 to 3)"},
      {"0.8@2-4", 4, "rank 4 is out of range"},
  };
  for (const auto& c : cases) {
    const std::string error = Error(c.spec, c.ranks);
    EXPECT_NE(error.find(c.error), std::string::npos)
        << "'" << c.spec << "' gave '" << error << "', expected '" << c.error << "'";
  }
}

TEST(RankSpeedsTest, FormatIsReadBack) {
  EXPECT_EQ(FormatRankSpeeds({1, 1, 1, 0.7}), "0.7@3");
  EXPECT_EQ(FormatRankSpeeds({0.8, 0.8, 1, 0.5, 0.5, 0.5, 1, 0.25}), "0.8@0-1,0.5@3-5,0.25@7");
  EXPECT_EQ(FormatRankSpeeds({1, 1}), "");
  EXPECT_EQ(FormatRankSpeeds({}), "");
  for (const std::vector<double>& speeds :
       {std::vector<double>{1, 2, 0.5, 0.5, 1, 1e-6}, std::vector<double>{0.75, 0.75, 0.75}}) {
    EXPECT_EQ(Resolve(FormatRankSpeeds(speeds), static_cast<int32_t>(speeds.size())), speeds);
  }
}

}  // namespace
}  // namespace moonep::sim
