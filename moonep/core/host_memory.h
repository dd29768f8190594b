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
  // The lowest cgroup with a limit (the ranks in it share that limit), also where MemAvailable is
  // the tighter bound; "" where no cgroup limits the process.
  std::string key_dir;
};

// The smaller of MemAvailable of /proc/meminfo (what the kernel estimates can be allocated without
// swapping) and the room the process's memory cgroup leaves (CgroupMemoryRoom under
// /sys/fs/cgroup): a container's memory limit, which MemAvailable does not see.
HostMemoryRoom HostMemoryRoomNow();
// HostMemoryRoomNow().bytes.
int64_t HostMemoryAvailableBytes();

// The room a memory cgroup leaves to a process whose /proc/self/mountinfo and /proc/self/cgroup
// read `mountinfo` and `self_cgroup`: for each level from the process's cgroup up to the mount's
// that has a limit, the limit less the level's usage without file pages (the page cache, which the
// kernel reclaims before it kills), and the smallest of them. cgroup v1 (the "memory"
// controller's line and mount: memory.limit_in_bytes, usage_in_bytes, memory.stat's total_*_file,
// and hierarchical_memory_limit for ancestors above the mount) or v2 (the "0::" line and the
// cgroup2 mount: memory.max, memory.current, memory.stat's *_file). The process's cgroup is its
// path below the mount's root (mountinfo's root field: a container's mount shows its own cgroup).
// bytes = -1 where no level has a limit, the cgroup is not visible, or nothing can be read.
HostMemoryRoom CgroupMemoryRoom(const std::string& mountinfo, const std::string& self_cgroup);

// What identifies the memory ranks share: /proc/sys/kernel/random/boot_id (processes that share it
// share a kernel, hence MemAvailable), else the host name, else ""; where a memory cgroup limits
// this process (`room.key_dir`, from HostMemoryRoomNow), followed by the identity of that cgroup's
// directory (processes of two containers on one host do not share their limits).
std::string HostMemoryNodeKey(const HostMemoryRoom& room);

// OK, or ResourceExhausted ("cannot allocate <bytes> host bytes for <what>: <source>") when
// `bytes` is above HostMemoryAvailableBytes(). For allocations that are zero-filled or written in
// full right away; where nothing can be read, always OK. 0 bytes: OK without reading anything.
absl::Status CheckHostAllocation(uint64_t bytes, absl::string_view what);
// The same against a room read before (one read for several checks).
absl::Status CheckHostAllocation(uint64_t bytes, absl::string_view what,
                                 const HostMemoryRoom& room);

}  // namespace moonep
