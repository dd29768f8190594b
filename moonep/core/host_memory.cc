#include "moonep/core/host_memory.h"

#include <unistd.h>

#include <cstdio>

#include "moonep/core/status.h"

namespace moonep {

int64_t HostMemoryAvailableBytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return -1;
  char line[256];
  long long kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib >= 0 && kib <= INT64_MAX / 1024 ? static_cast<int64_t>(kib) * 1024 : -1;
}

std::string HostMemoryNodeKey() {
  char text[128] = {};
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    const bool read = std::fgets(text, sizeof(text), f) != nullptr;
    std::fclose(f);
    std::string key = read ? std::string(text) : std::string();
    while (!key.empty() && (key.back() == '\n' || key.back() == ' ')) key.pop_back();
    if (!key.empty()) return "boot " + key;
  }
  if (gethostname(text, sizeof(text) - 1) == 0) return "host " + std::string(text);
  return "";
}

absl::Status CheckHostAllocation(uint64_t bytes, absl::string_view what) {
  const int64_t available = HostMemoryAvailableBytes();
  if (available < 0 || bytes <= static_cast<uint64_t>(available)) return absl::OkStatus();
  return OutOfMemory("cannot allocate %d host bytes for %s: the node has %d bytes available "
                     "(MemAvailable, /proc/meminfo)", bytes, what, available);
}

}  // namespace moonep
