#include "moonep/core/env.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "moonep/core/status.h"

namespace moonep::env {

static const char* Lookup(const char* suffix) {
  std::string name = std::string("MOONEP_") + suffix;
  const char* value = std::getenv(name.c_str());
  return (value != nullptr && value[0] != '\0') ? value : nullptr;
}

namespace {

enum class Parsed { kOk, kMalformed, kBeyondInt64 };

// A base-10 integer: an optional sign, then at least one digit, nothing else. kBeyondInt64: well
// formed but outside int64, *out is INT64_MAX or INT64_MIN (strtoll's saturated value), the side
// it lies on.
Parsed ParseSaturating(const char* value, int64_t* out) {
  const char* p = value;
  if (*p == '+' || *p == '-') ++p;
  if (*p < '0' || *p > '9') return Parsed::kMalformed;  // no leading spaces, no empty digits
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  if (end == value || *end != '\0') return Parsed::kMalformed;
  *out = parsed;
  if (errno == ERANGE) return Parsed::kBeyondInt64;
  return errno == 0 ? Parsed::kOk : Parsed::kMalformed;
}

}  // namespace

bool ParseBase10(const char* value, int64_t* out) {
  int64_t parsed = 0;
  if (ParseSaturating(value, &parsed) != Parsed::kOk) return false;
  *out = parsed;
  return true;
}

bool ParseBase10InRange(const char* value, int64_t lo, int64_t hi, int64_t* out) {
  int64_t parsed = 0;
  if (value == nullptr || !ParseBase10(value, &parsed) || parsed < lo || parsed > hi) return false;
  *out = parsed;
  return true;
}

absl::StatusOr<int64_t> ParseInt(const char* suffix, int64_t fallback, int64_t min, int64_t max) {
  const char* value = Lookup(suffix);
  if (value == nullptr) return fallback;
  int64_t parsed = 0;
  // Digits beyond int64 are a number too large (or too small), not garbage: saturated, they are
  // checked like any other value, so a knob without an upper bound (MOONEP_TIMEOUT_MS) caps them
  // as it caps every large value, and any other says "out of range" (they were refused as "not a
  // base-10 integer").
  if (ParseSaturating(value, &parsed) == Parsed::kMalformed) {
    return InvalidArgument("MOONEP_%s=%s: not a base-10 integer (expected one in [%d, %d])",
                           suffix, value, min, max);
  }
  if (parsed < min || parsed > max) {
    return InvalidArgument("MOONEP_%s=%s: out of range [%d, %d]", suffix, value, min, max);
  }
  return parsed;
}

int64_t ReadInt(const char* suffix, int64_t fallback) {
  const char* value = Lookup(suffix);
  if (value == nullptr) return fallback;
  int64_t parsed = 0;
  if (ParseSaturating(value, &parsed) == Parsed::kMalformed) {
    std::fprintf(stderr, "MoonEP WARN ignoring MOONEP_%s=%s: not a base-10 integer; using %lld\n",
                 suffix, value, static_cast<long long>(fallback));
    return fallback;
  }
  return parsed;
}

std::string ReadString(const char* suffix, const std::string& fallback) {
  const char* value = Lookup(suffix);
  return value == nullptr ? fallback : std::string(value);
}

}  // namespace moonep::env
