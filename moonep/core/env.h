// Configuration through the environment: one declaration per knob, read once and cached.
//
//   MOONEP_INT_PARAM(TimeoutMs, "TIMEOUT_MS", 60000)   // defines int64_t moonep::param::TimeoutMs()
//
// reads MOONEP_TIMEOUT_MS the first time it is called. Every knob is listed in docs/environment.md.
#pragma once

#include <cstdint>
#include <string>

namespace moonep::env {

// The raw value of MOONEP_<suffix>, or `fallback` when unset or empty.
int64_t ReadInt(const char* suffix, int64_t fallback);
std::string ReadString(const char* suffix, const std::string& fallback);

}  // namespace moonep::env

#define MOONEP_INT_PARAM(Name, suffix, fallback)                          \
  inline int64_t Name() {                                                 \
    static const int64_t value = ::moonep::env::ReadInt(suffix, fallback); \
    return value;                                                         \
  }

#define MOONEP_STRING_PARAM(Name, suffix, fallback)                                 \
  inline const std::string& Name() {                                                \
    static const std::string value = ::moonep::env::ReadString(suffix, fallback);   \
    return value;                                                                   \
  }

namespace moonep::param {
// Every wait in MoonEP ends after this many milliseconds with moonepTimeout.
MOONEP_INT_PARAM(TimeoutMs, "TIMEOUT_MS", 60000)
// Threads for the CPU executor (0: all cores).
MOONEP_INT_PARAM(NumThreads, "NUM_THREADS", 0)
// WARN (default), INFO or TRACE; also NONE.
MOONEP_STRING_PARAM(DebugLevel, "DEBUG", "WARN")
// Log to this file instead of stderr; %h is replaced by the host name, %p by the pid.
MOONEP_STRING_PARAM(DebugFile, "DEBUG_FILE", "")
// Routing trace file written by rank 0 (see docs/trace-format.md); empty: off.
MOONEP_STRING_PARAM(TracePath, "TRACE", "")
}  // namespace moonep::param
