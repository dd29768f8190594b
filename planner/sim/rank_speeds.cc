#include "planner/sim/rank_speeds.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "moonep/core/status.h"
#include "planner/sim/cost_model.h"

namespace moonep::sim {

bool RankSpeedsSpec::all_one() const {
  return std::all_of(items.begin(), items.end(), [](const Item& i) { return i.speed == 1.0; });
}

namespace {

absl::StatusOr<double> ParseSpeed(absl::string_view text) {
  double v = 0;
  MOONEP_CHECK_ARG(absl::SimpleAtod(text, &v), "'%s' is not a number", text);
  // Also refuses NaN and infinities.
  MOONEP_CHECK_ARG(v >= kMinRankSpeed && v <= kMaxRankSpeed,
                   "speed %s is outside [1e-6, 1e6] (a rank's rate is --tflops x its speed)", text);
  return v;
}

// One end of `ranks` (the part of `item` after its '@').
absl::StatusOr<int32_t> ParseRank(absl::string_view text, absl::string_view ranks,
                                  absl::string_view item) {
  int32_t v = 0;
  MOONEP_CHECK_ARG(absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v) && v >= 0,
                   "'%s' in '%s' is not a rank or a range of ranks (first-last, integers >= 0)",
                   ranks, item);
  return v;
}

}  // namespace

absl::StatusOr<RankSpeedsSpec> ParseRankSpeeds(absl::string_view text) {
  RankSpeedsSpec spec;
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return spec;
  bool any_at = false, any_plain = false;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    const absl::string_view item = absl::StripAsciiWhitespace(raw);
    MOONEP_CHECK_ARG(!item.empty(), "an empty item in '%s'", text);
    const std::vector<absl::string_view> parts = absl::StrSplit(item, '@');
    MOONEP_CHECK_ARG(parts.size() <= 2, "'%s' has more than one '@' (the form is speed@rank)", item);
    MOONEP_ASSIGN_OR_RETURN(const double speed, ParseSpeed(absl::StripAsciiWhitespace(parts[0])));
    if (parts.size() == 1) {
      // The list form: the next rank's speed.
      any_plain = true;
      const int32_t rank = static_cast<int32_t>(spec.items.size());
      spec.items.push_back({speed, rank, rank});
      continue;
    }
    any_at = true;
    const absl::string_view ranks = absl::StripAsciiWhitespace(parts[1]);
    const size_t dash = ranks.find('-');
    MOONEP_ASSIGN_OR_RETURN(const int32_t lo, ParseRank(ranks.substr(0, dash), ranks, item));
    int32_t hi = lo;
    if (dash != absl::string_view::npos) {
      MOONEP_ASSIGN_OR_RETURN(hi, ParseRank(ranks.substr(dash + 1), ranks, item));
      MOONEP_CHECK_ARG(hi >= lo, "'%s': the ranks %d-%d run backwards", item, lo, hi);
    }
    spec.items.push_back({speed, lo, hi});
  }
  MOONEP_CHECK_ARG(!(any_at && any_plain),
                   "'%s' mixes the two forms: give every rank's speed (1,1,0.7,1) or only the "
                   "ranks not at 1 (0.7@2)", text);
  if (any_plain) {
    spec.list_size = static_cast<int32_t>(spec.items.size());
    return spec;
  }
  std::vector<RankSpeedsSpec::Item> sorted = spec.items;
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    MOONEP_CHECK_ARG(sorted[i].first > sorted[i - 1].last, "rank %d is given two speeds",
                     sorted[i].first);
  }
  return spec;
}

absl::StatusOr<std::vector<double>> ResolveRankSpeeds(const RankSpeedsSpec& spec,
                                                      int32_t num_ranks) {
  MOONEP_CHECK_ARG(spec.list_size == 0 || spec.list_size == num_ranks,
                   "%d speeds for %d ranks (a list gives every rank's speed; speed@rank gives "
                   "only the ranks not at 1)", spec.list_size, num_ranks);
  std::vector<double> speeds(num_ranks, 1.0);
  for (const RankSpeedsSpec::Item& item : spec.items) {
    MOONEP_CHECK_ARG(item.last < num_ranks, "rank %d is out of range: there are %d ranks (0 to %d)",
                     item.last, num_ranks, num_ranks - 1);
    std::fill(speeds.begin() + item.first, speeds.begin() + item.last + 1, item.speed);
  }
  return speeds;
}

std::string FormatRankSpeeds(absl::Span<const double> speeds) {
  std::string out;
  const size_t n = speeds.size();
  for (size_t r = 0; r < n;) {
    size_t end = r + 1;
    while (end < n && speeds[end] == speeds[r]) ++end;
    if (speeds[r] != 1.0) {
      absl::StrAppendFormat(&out, "%s%g@%d", out.empty() ? "" : ",", speeds[r], r);
      if (end - r > 1) absl::StrAppend(&out, "-", end - 1);
    }
    r = end;
  }
  return out;
}

}  // namespace moonep::sim
