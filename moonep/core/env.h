// Configuration through the environment: one declaration per knob, read once and cached.
//
//   MOONEP_INT_PARAM(Knob, "KNOB", 0)                 // defines int64_t moonep::param::Knob()
//   MOONEP_CHECKED_INT_PARAM(CheckedKnob, "KNOB", 8, 0, 64)
//       // defines const absl::StatusOr<int64_t>& moonep::param::CheckedKnob()
//
// read MOONEP_<suffix> the first time they are called; an empty value counts as unset. Values are
// base-10 integers (an optional sign, then digits: no spaces, no hex, "010" is ten). Digits beyond
// int64 are well formed: they count as INT64_MAX (or INT64_MIN with '-'), so a knob whose range
// ends at INT64_MAX takes them as its largest value (MOONEP_TIMEOUT_MS: then capped at
// kMaxTimeoutMs, like any value above it) and any other reports them out of range. A checked knob
// is an InvalidArgument naming the variable when the value is malformed or outside [min, max],
// for its reader to return; an unchecked one warns and uses its fallback when the value is
// malformed. Every knob is listed in docs/environment.md.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace moonep::env {

// A base-10 integer: an optional sign, then at least one digit, nothing else (no spaces, no
// trailing text); false when malformed or outside int64. Shared with the tools' flag parsers.
bool ParseBase10(const char* value, int64_t* out);
// ParseBase10 and lo <= value <= hi (a NULL value is false): the tools' bounded flags.
bool ParseBase10InRange(const char* value, int64_t lo, int64_t hi, int64_t* out);
// MOONEP_<suffix> as a base-10 integer in [min, max]; `fallback` when unset or empty; otherwise
// InvalidArgument: "MOONEP_<suffix>=<value>: ..." with the accepted range. Digits beyond int64 are
// taken as INT64_MAX / INT64_MIN, then checked against [min, max] like any other value.
absl::StatusOr<int64_t> ParseInt(const char* suffix, int64_t fallback, int64_t min, int64_t max);
// MOONEP_<suffix> as a base-10 integer (digits beyond int64: INT64_MAX / INT64_MIN), or `fallback`
// when unset or empty; a malformed value warns on stderr and gives `fallback` (for readers that
// cannot return an error).
int64_t ReadInt(const char* suffix, int64_t fallback);
std::string ReadString(const char* suffix, const std::string& fallback);

}  // namespace moonep::env

#define MOONEP_INT_PARAM(Name, suffix, fallback)                          \
  inline int64_t Name() {                                                 \
    static const int64_t value = ::moonep::env::ReadInt(suffix, fallback); \
    return value;                                                         \
  }

#define MOONEP_CHECKED_INT_PARAM(Name, suffix, fallback, min, max)                  \
  inline const ::absl::StatusOr<int64_t>& Name() {                                  \
    static const ::absl::StatusOr<int64_t> value =                                  \
        ::moonep::env::ParseInt(suffix, fallback, min, max);                        \
    return value;                                                                   \
  }

#define MOONEP_STRING_PARAM(Name, suffix, fallback)                                 \
  inline const std::string& Name() {                                                \
    static const std::string value = ::moonep::env::ReadString(suffix, fallback);   \
    return value;                                                                   \
  }

namespace moonep::param {
// The longest wait (about 31.7 years): a longer timeout is taken as this one, so that a deadline
// now() + timeout stays within the clock's range (it overflowed above ~9.2e12 ms).
constexpr int64_t kMaxTimeoutMs = int64_t{1000000000000};
// MOONEP_TIMEOUT_MS as given: >= 1, else an InvalidArgument naming it (transports refuse it).
// No upper bound here: TimeoutMs() caps it, digits beyond int64 included (they are INT64_MAX).
MOONEP_CHECKED_INT_PARAM(CheckedTimeoutMs, "TIMEOUT_MS", 60000, 1, INT64_MAX)
// Every wait in MoonEP ends after this many milliseconds with moonepTimeout: MOONEP_TIMEOUT_MS, at
// most kMaxTimeoutMs; 60000 where it is malformed (CheckedTimeoutMs says why).
inline int64_t TimeoutMs() {
  const absl::StatusOr<int64_t>& ms = CheckedTimeoutMs();
  return ms.ok() ? (*ms < kMaxTimeoutMs ? *ms : kMaxTimeoutMs) : 60000;
}
// Host threads a transport uses for its per-dispatch layouts and tables (0: automatic;
// docs/environment.md). Checked: a malformed value fails transport creation naming it.
MOONEP_CHECKED_INT_PARAM(CheckedHostThreads, "HOST_THREADS", 0, 0, 64)
// Bytes per chunk of the host transports' replica chains (0: the default, 1 MiB; else [16, 2^30],
// which common::CheckEnvironment checks; TransportOptions::replica_chunk_bytes, when set, wins).
MOONEP_CHECKED_INT_PARAM(CheckedReplicaChunkBytes, "REPLICA_CHUNK_BYTES", 0, 0, int64_t{1} << 30)
// Threads for the CPU executor (0: all cores; above compute::kMaxExecutorThreads, that many).
// Checked: a negative or malformed value fails CPU executor creation naming it (a negative value
// used to mean every core, silently).
MOONEP_CHECKED_INT_PARAM(CheckedNumThreads, "NUM_THREADS", 0, 0, INT64_MAX)
// WARN (default), INFO or TRACE; also NONE.
MOONEP_STRING_PARAM(DebugLevel, "DEBUG", "WARN")
// Log to this file instead of stderr; %h is replaced by the host name, %p by the pid.
MOONEP_STRING_PARAM(DebugFile, "DEBUG_FILE", "")
// Routing trace file written by rank 0 (see docs/trace-format.md); empty: off.
MOONEP_STRING_PARAM(TracePath, "TRACE", "")
}  // namespace moonep::param
