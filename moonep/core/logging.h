// Logging in the manner of NCCL_DEBUG: MOONEP_DEBUG=WARN|INFO|TRACE selects the level,
// MOONEP_DEBUG_FILE redirects it. Every line carries host, pid, thread and rank:
//   host:1234:1240 [rank 3] MoonEP INFO planner: 12 replicas, max/mean 1.00
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace moonep::log {

enum class Level { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

// A MOONEP_DEBUG value, any case: NONE (or OFF), WARN, INFO, TRACE; InvalidArgument naming
// MOONEP_DEBUG otherwise.
absl::StatusOr<Level> ParseLevel(absl::string_view value);
// The level of MOONEP_DEBUG (WARN when unset). A malformed value logs at WARN, says so once on
// stderr, and LevelStatus() returns its error (transport creation fails with it).
Level CurrentLevel();
absl::Status LevelStatus();
// The rank written into each line (-1 until a communicator sets it).
void SetRank(int rank);
void Write(Level level, const std::string& message);

}  // namespace moonep::log

#define MOONEP_LOG_AT_(lvl, ...)                                                   \
  do {                                                                             \
    if (::moonep::log::CurrentLevel() >= (lvl))                                    \
      ::moonep::log::Write((lvl), ::absl::StrFormat(__VA_ARGS__));                 \
  } while (0)
#define MOONEP_WARN(...) MOONEP_LOG_AT_(::moonep::log::Level::kWarn, __VA_ARGS__)
#define MOONEP_INFO(...) MOONEP_LOG_AT_(::moonep::log::Level::kInfo, __VA_ARGS__)
#define MOONEP_TRACE(...) MOONEP_LOG_AT_(::moonep::log::Level::kTrace, __VA_ARGS__)
