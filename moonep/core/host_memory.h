// How much host memory a new allocation may still use, for refusing what cannot fit with an error
// instead of letting the kernel's overcommit hand out pages that the zero-fill then cannot back
// (the out-of-memory killer ends the process, and its MPI peers wait out their timeouts).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace moonep {

// What this process may still allocate, and what says so.
struct HostMemoryRoom {
  int64_t bytes = -1;  // -1: unknown (nothing could be read), or no limit (a cgroup without one)
  // For messages: "the node has 123 bytes available (MemAvailable, /proc/meminfo)", or the memory
  // cgroup's room with its limit file, limit and usage.
  std::string source;
  std::string cgroup_dir;  // the directory of the cgroup whose limit bounds it ("": MemAvailable)
};

// The smaller of MemAvailable of /proc/meminfo (what the kernel estimates can be allocated without
// swapping) and the room the process's memory cgroup leaves (CgroupMemoryRoom under
// /sys/fs/cgroup): a container's memory limit, which MemAvailable does not see.
HostMemoryRoom HostMemoryRoomNow();
// HostMemoryRoomNow().bytes.
int64_t HostMemoryAvailableBytes();

// The room a memory cgroup leaves, read under `cgroup_root` (where the cgroup file systems are
// mounted) for a process whose /proc/self/cgroup reads `self_cgroup`: for each level from the
// process's cgroup up to the root that has a limit, the limit less the usage without inactive file
// pages (which the kernel reclaims before it kills), and the smallest of them. cgroup v1 (the
// "memory" controller's line; its memory.limit_in_bytes and hierarchical_memory_limit) or v2 (the
// "0::" line; memory.max, memory.current, memory.stat). The process's cgroup is looked for at its
// path, else at the mount's root (a cgroup namespace shows the container's own cgroup there).
// bytes = -1 where no level has a limit or nothing can be read.
HostMemoryRoom CgroupMemoryRoom(const std::string& cgroup_root, const std::string& self_cgroup);

// What identifies the memory ranks share: /proc/sys/kernel/random/boot_id (processes that share it
// share a kernel, hence MemAvailable), else the host name, else ""; where a memory cgroup limits
// this process, followed by the identity of that cgroup's directory (processes of two containers
// on one host do not share their limits).
std::string HostMemoryNodeKey();

// OK, or ResourceExhausted ("cannot allocate <bytes> host bytes for <what>: <source>") when
// `bytes` is above HostMemoryAvailableBytes(). For allocations that are zero-filled or written in
// full right away; where nothing can be read, always OK. 0 bytes: OK without reading anything.
absl::Status CheckHostAllocation(uint64_t bytes, absl::string_view what);

}  // namespace moonep
