// --rank_speeds: how fast each rank computes, relative to --tflops (CostConfig::speeds). Two forms:
//
//   a list of R speeds, one per rank in order:    1,1,0.7,1
//   speed@ranks items, every other rank at 1:     0.7@3   0.7@3,0.5@17   0.8@8-15 (a node of 8)
//
// A spec is parsed before R is known (a trace's R comes from its header), then resolved against R.
// Pure logic: no I/O.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace moonep::sim {

struct RankSpeedsSpec {
  struct Item {
    double speed;
    int32_t first, last;  // ranks [first, last]
  };
  std::vector<Item> items;  // no rank twice; ranks not named compute at speed 1
  int32_t list_size = 0;    // the list form: speeds given (one item per rank), which R must equal;
                            // 0: the speed@ranks form, for any R above its ranks
  bool empty() const { return items.empty(); }
  // Every speed it gives is 1: the machine without --rank_speeds.
  bool all_one() const;
};

// Parses either form; "" is the empty spec. InvalidArgument (not naming the flag: callers add it)
// on a malformed number or rank, a speed outside [1e-6, 1e6], a rank given
// twice, the two forms mixed.
absl::StatusOr<RankSpeedsSpec> ParseRankSpeeds(absl::string_view spec);

// Each of `num_ranks` ranks' speed. InvalidArgument when a list does not have num_ranks speeds or
// an item names a rank at or above num_ranks.
absl::StatusOr<std::vector<double>> ResolveRankSpeeds(const RankSpeedsSpec& spec,
                                                      int32_t num_ranks);

// The speed@ranks form of `speeds` (runs of equal speed other than 1 as first-last): what the
// report prints, and ParseRankSpeeds reads back. "" when every speed is 1.
std::string FormatRankSpeeds(absl::Span<const double> speeds);

}  // namespace moonep::sim
