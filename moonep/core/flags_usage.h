// The command-line tools' --help (moonep-sim, moonep-bench-dispatch, moonep-bench-sim): their usage
// message, and the flags of their own source file (by default absl matches flag files to the
// program's name, which lists none of these). Header-only: the programs that include it link
// absl::flags_usage themselves.
#pragma once

#include <string>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace moonep {

// Call before absl::ParseCommandLine; `source_suffix`: the end of the path of the file that
// defines the program's flags (e.g. "planner/sim/main.cc").
inline void SetToolUsage(absl::string_view message, const std::string& source_suffix) {
  absl::SetProgramUsageMessage(message);
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [source_suffix](absl::string_view file) {
    return absl::EndsWith(file, source_suffix);
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.normalize_filename = [](absl::string_view file) { return std::string(file); };
  absl::SetFlagsUsageConfig(usage);
}

}  // namespace moonep
