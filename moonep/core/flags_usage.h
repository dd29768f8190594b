// The command-line tools' --help (moonep-sim, moonep-bench-dispatch, moonep-bench-sim): their usage
// message, and the flags of their own source file (by default absl matches flag files to the
// program's name, which lists none of these). Header-only: the programs that include it link
// absl::flags_usage themselves.
#pragma once

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace moonep {

// Call before absl::ParseCommandLine; `source_suffix`: the end of the path of the file that
// defines the program's flags (e.g. "planner/sim/main.cc"). A --help or --helpshort (those flags)
// or --helpfull (every flag, Abseil's own included) before any "--" prints the usage message and
// the flags to stdout and exits 0 here: Abseil 20220623's ParseCommandLine exits 1 after help,
// which reads as a failure to scripts (and `set -e`). --help=substring prints the flags whose
// name, description or file contains the substring (Abseil's own matching) and exits 0, or 1
// when none does ("No flags matched.", as grep with no match).
inline void SetToolUsage(absl::string_view message, const std::string& source_suffix, int argc,
                         char** argv) {
  absl::SetProgramUsageMessage(message);
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [source_suffix](absl::string_view file) {
    return absl::EndsWith(file, source_suffix);
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.normalize_filename = [](absl::string_view file) { return std::string(file); };
  absl::SetFlagsUsageConfig(usage);
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    const bool full = arg == "--helpfull" || arg == "-helpfull";
    if (full || arg == "--help" || arg == "-help" || arg == "--helpshort" || arg == "-helpshort") {
      if (argc > 0) absl::flags_internal::SetProgramInvocationName(argv[0]);
      absl::flags_internal::FlagsHelp(std::cout, full ? "" : source_suffix,
                                      absl::flags_internal::HelpFormat::kHumanReadable, message);
      std::cout.flush();
      std::exit(std::cout ? 0 : 1);
    }
    for (const absl::string_view prefix : {"--help=", "-help="}) {
      if (!absl::StartsWith(arg, prefix)) continue;
      if (argc > 0) absl::flags_internal::SetProgramInvocationName(argv[0]);
      absl::flags_internal::SetFlagsHelpMatchSubstr(arg.substr(prefix.size()));
      absl::flags_internal::SetFlagsHelpMode(absl::flags_internal::HelpMode::kMatch);
      std::ostringstream text;
      absl::flags_internal::HandleUsageFlags(text, message);
      const std::string help = text.str();
      std::cout << help;
      std::cout.flush();
      std::exit(std::cout && !absl::StrContains(help, "No flags matched") ? 0 : 1);
    }
  }
}

}  // namespace moonep
