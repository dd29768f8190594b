// How much host memory a new allocation may still use, for refusing what cannot fit with an error
// instead of letting the kernel's overcommit hand out pages that the zero-fill then cannot back
// (the out-of-memory killer ends the process, and its MPI peers wait out their timeouts).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace moonep {

// MemAvailable of /proc/meminfo in bytes (what the kernel estimates can be allocated without
// swapping), or -1 where it cannot be read.
int64_t HostMemoryAvailableBytes();

// What identifies this node's memory: /proc/sys/kernel/random/boot_id (processes that share it
// share a kernel, hence MemAvailable), else the host name, else "".
std::string HostMemoryNodeKey();

// OK, or ResourceExhausted ("cannot allocate <bytes> host bytes for <what>: the node has <n> bytes
// available ...") when `bytes` is above HostMemoryAvailableBytes(). For allocations that are
// zero-filled or written in full right away; where MemAvailable cannot be read, always OK.
absl::Status CheckHostAllocation(uint64_t bytes, absl::string_view what);

}  // namespace moonep
