#include "moonep/core/logging.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_replace.h"
#include "moonep/core/env.h"
#include "moonep/core/status.h"

namespace moonep::log {
namespace {

std::atomic<int> g_rank{-1};

std::string HostName() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) return "unknown";
  std::string name(host);
  return name.substr(0, name.find('.'));
}

struct Sink {
  std::mutex mutex;
  FILE* file = stderr;
  std::string host = HostName();
  Sink() {
    const std::string& path = param::DebugFile();
    if (path.empty()) return;
    std::string resolved = absl::StrReplaceAll(
        path, {{"%h", host}, {"%p", std::to_string(static_cast<long>(getpid()))}});
    FILE* opened = std::fopen(resolved.c_str(), "a");
    if (opened != nullptr) {
      file = opened;
    } else {
      std::fprintf(stderr, "MoonEP WARN cannot open MOONEP_DEBUG_FILE=%s; logging to stderr\n",
                   resolved.c_str());
    }
  }
};

Sink& GetSink() {
  static Sink* sink = new Sink();  // never destroyed: logging may happen during exit
  return *sink;
}

// MOONEP_DEBUG, parsed once.
const absl::StatusOr<Level>& ConfiguredLevel() {
  static const absl::StatusOr<Level>* level = [] {
    auto* parsed = new absl::StatusOr<Level>(ParseLevel(param::DebugLevel()));
    if (!parsed->ok()) {
      std::fprintf(stderr, "MoonEP WARN %s; logging at WARN\n",
                   std::string(parsed->status().message()).c_str());
    }
    return parsed;
  }();
  return *level;
}

const char* LevelName(Level level) {
  switch (level) {
    case Level::kWarn: return "WARN";
    case Level::kInfo: return "INFO";
    case Level::kTrace: return "TRACE";
    default: return "";
  }
}

}  // namespace

absl::StatusOr<Level> ParseLevel(absl::string_view value) {
  const std::string upper = absl::AsciiStrToUpper(value);
  if (upper == "NONE" || upper == "OFF") return Level::kNone;
  if (upper == "WARN") return Level::kWarn;
  if (upper == "INFO") return Level::kInfo;
  if (upper == "TRACE") return Level::kTrace;
  return InvalidArgument("MOONEP_DEBUG=%s: not a log level (NONE, WARN, INFO or TRACE)", value);
}

Level CurrentLevel() {
  static const Level level = ConfiguredLevel().ok() ? *ConfiguredLevel() : Level::kWarn;
  return level;
}

absl::Status LevelStatus() { return ConfiguredLevel().status(); }

void SetRank(int rank) { g_rank.store(rank); }

void Write(Level level, const std::string& message) {
  Sink& sink = GetSink();
  std::lock_guard<std::mutex> lock(sink.mutex);
  std::fprintf(sink.file, "%s:%ld:%ld [rank %d] MoonEP %s %s\n", sink.host.c_str(),
               static_cast<long>(getpid()), static_cast<long>(syscall(SYS_gettid)), g_rank.load(),
               LevelName(level), message.c_str());
  std::fflush(sink.file);
}

}  // namespace moonep::log
