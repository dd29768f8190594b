#include "moonep/core/env.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace moonep::env {

static const char* Lookup(const char* suffix) {
  std::string name = std::string("MOONEP_") + suffix;
  const char* value = std::getenv(name.c_str());
  return (value != nullptr && value[0] != '\0') ? value : nullptr;
}

int64_t ReadInt(const char* suffix, int64_t fallback) {
  const char* value = Lookup(suffix);
  if (value == nullptr) return fallback;
  errno = 0;
  char* end = nullptr;
  long long parsed = std::strtoll(value, &end, 0);
  if (errno != 0 || end == value || *end != '\0') {
    std::fprintf(stderr, "MoonEP WARN ignoring MOONEP_%s=%s: not an integer; using %lld\n", suffix,
                 value, static_cast<long long>(fallback));
    return fallback;
  }
  return parsed;
}

std::string ReadString(const char* suffix, const std::string& fallback) {
  const char* value = Lookup(suffix);
  return value == nullptr ? fallback : std::string(value);
}

}  // namespace moonep::env
