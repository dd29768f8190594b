#include "moonep/runtime/layer_config.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "moonep/compute/executor.h"
#include "moonep/core/env.h"
#include "moonep/core/host_memory.h"
#include "moonep/core/logging.h"
#include "moonep/core/status.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/device.h"
#include "transport/transport.h"

namespace moonep::runtime {

absl::Status CheckLayerConfig(const LayerConfig& c, int32_t num_ranks, bool need_executor) {
  // Per-rank state and every dispatch's count message grow with E (about 300 bytes per expert
  // and rank): 2^20 experts is 300 MB per rank, far beyond any model's layer.
  MOONEP_CHECK_ARG(c.num_experts > 0 && c.num_experts <= kMaxLayerExperts,
                   "num_experts is %d; must be in [1, %d]", c.num_experts, kMaxLayerExperts);
  MOONEP_CHECK_ARG(c.num_experts % num_ranks == 0,
                   "num_experts = %d is not a multiple of the number of ranks (%d)",
                   c.num_experts, num_ranks);
  MOONEP_CHECK_ARG(c.top_k > 0 && c.top_k <= c.num_experts,
                   "top_k is %d; must be in [1, num_experts = %d]", c.top_k, c.num_experts);
  MOONEP_CHECK_ARG(c.hidden > 0, "hidden is %d; must be positive", c.hidden);
  if (need_executor) {
    MOONEP_CHECK_ARG(c.intermediate > 0, "intermediate is %d; must be positive", c.intermediate);
  } else {
    MOONEP_CHECK_ARG(c.intermediate >= 0, "intermediate is %d; must not be negative",
                     c.intermediate);
  }
  MOONEP_CHECK_ARG(IsValidDType(static_cast<int32_t>(c.dtype)), "dtype %d is not a MoonEP dtype",
                   static_cast<int32_t>(c.dtype));
  MOONEP_CHECK_ARG(IsValidDType(static_cast<int32_t>(c.grad_dtype)),
                   "grad_dtype %d is not a MoonEP dtype", static_cast<int32_t>(c.grad_dtype));
  MOONEP_CHECK_ARG(c.grad_dtype == DType::kFloat32 || c.grad_dtype == c.dtype,
                   "grad_dtype must be fp32 or the layer dtype");
  MOONEP_CHECK_ARG(c.slots == -1 || c.slots >= 1,
                   "slots is %d; must be -1 (E/R) or >= 1 (every policy needs a slot; policy none "
                   "never fills one)", c.slots);
  MOONEP_CHECK_ARG(c.pad_multiple >= 1, "pad_multiple is %d; must be >= 1", c.pad_multiple);
  MOONEP_CHECK_ARG(c.ranks_per_node >= 0, "ranks_per_node is %d; must be >= 0", c.ranks_per_node);
  MOONEP_CHECK_ARG(c.eplb_period >= 1, "eplb_period is %d; must be >= 1", c.eplb_period);
  MOONEP_CHECK_ARG(c.replica_cost_intra >= 0 && c.replica_cost_intra <= planner::kMaxReplicaCost,
                   "replica_cost_intra is %d; must be in [0, 2^52] (tokens)", c.replica_cost_intra);
  MOONEP_CHECK_ARG(c.replica_cost_inter >= 0 && c.replica_cost_inter <= planner::kMaxReplicaCost,
                   "replica_cost_inter is %d; must be in [0, 2^52] (tokens)", c.replica_cost_inter);
  MOONEP_CHECK_ARG(c.row_cost_intra >= 0 && c.row_cost_intra <= planner::kMaxRowCost,
                   "row_cost_intra is %d; must be in [0, 2^40] (1/1024 tokens)", c.row_cost_intra);
  MOONEP_CHECK_ARG(c.row_cost_inter >= 0 && c.row_cost_inter <= planner::kMaxRowCost,
                   "row_cost_inter is %d; must be in [0, 2^40] (1/1024 tokens)", c.row_cost_inter);
  if (!c.speeds.empty()) {
    // The other policies plan as if every rank were alike: speeds there would be silently ignored.
    MOONEP_CHECK_ARG(c.policy == planner::Policy::kMoonEP ||
                         c.policy == planner::Policy::kMoonEPGreedy,
                     "speeds are for policies moonep and moonep-greedy; policy %s plans as if "
                     "every rank were alike (pass no speeds)",
                     planner::PolicyName(c.policy));
    MOONEP_CHECK_ARG(c.speeds.size() == static_cast<size_t>(num_ranks),
                     "speeds has %d entries; must be empty (all ranks alike) or one per rank (%d)",
                     c.speeds.size(), num_ranks);
    for (size_t r = 0; r < c.speeds.size(); ++r) {
      MOONEP_CHECK_ARG(std::isfinite(c.speeds[r]) && c.speeds[r] > 0,
                       "speeds[%d] is %g; must be finite and positive", r, c.speeds[r]);
    }
  }
  MOONEP_CHECK_ARG(c.device == Device::kCpu || c.device == Device::kCuda,
                   "device %d is not a MoonEP device", static_cast<int32_t>(c.device));
  if (c.device == Device::kCuda && !CudaBuilt()) {
    return Unavailable("device cuda: this MoonEP was built without CUDA (configure with "
                       "-DMOONEP_WITH_CUDA=ON -DMOONEP_WITH_NCCL=ON)");
  }
  MOONEP_CHECK_ARG(c.device_index >= 0, "device_index is %d; must be >= 0", c.device_index);
  {
    const std::string backend = TransportBackend(c);
    // A name no backend has: said here, naming where it came from (it was "transport backend
    // 'UCX' is not built" at the transport's creation, with no word of MOONEP_TRANSPORT).
    std::vector<std::string> built = transport::AvailableBackends();
#ifdef MOONEP_HAVE_NCCL
    built.push_back("nccl");
#endif
    MOONEP_CHECK_ARG(std::find(built.begin(), built.end(), backend) != built.end(),
                     "transport '%s' (from %s) is not a backend of this build (built: %s)", backend,
                     c.transport.empty() ? "MOONEP_TRANSPORT" : "config transport",
                     absl::StrJoin(built, ", "));
    const bool device_backend = backend == "nccl";
    MOONEP_CHECK_ARG(device_backend == (c.device == Device::kCuda),
                     "transport '%s' does not move %s memory: device cuda needs transport 'nccl', "
                     "device cpu 'mpi' or 'ucx'", backend,
                     c.device == Device::kCuda ? "GPU" : "host");
  }
  MOONEP_CHECK_ARG(c.max_tokens > 0, "max_tokens is %d; must be positive (it sizes every buffer)",
                   c.max_tokens);
  MOONEP_CHECK_ARG(c.max_recv_rows >= 0, "max_recv_rows is %d; must be >= 0", c.max_recv_rows);
  // Each in-flight slot holds a handle's routing state and staging: bounded so that a wild value
  // is an error here, not an allocation that runs the machine out of memory.
  MOONEP_CHECK_ARG(c.max_inflight >= 1 && c.max_inflight <= kMaxInflight,
                   "max_inflight is %d; must be in [1, %d]", c.max_inflight, kMaxInflight);
  MOONEP_CHECK_ARG(c.num_threads >= 0 && c.num_threads <= compute::kMaxExecutorThreads,
                   "num_threads is %d; must be in [0, %d] (0: MOONEP_NUM_THREADS or every core)",
                   c.num_threads, compute::kMaxExecutorThreads);
  MOONEP_CHECK_ARG(c.timeout_ms >= 0, "timeout_ms is %d; must be >= 0 (0: MOONEP_TIMEOUT_MS)",
                   c.timeout_ms);
  // A malformed MOONEP_TIMEOUT_MS, MOONEP_DEBUG or (UCX) MOONEP_UCX_EAGER_BYTES on this rank:
  // refused here, before the agreement (the transport's creation, after it, is collective).
  MOONEP_RETURN_IF_ERROR(transport::CheckTransportEnvironment(TransportBackend(c)));
  // Sizes whose buffers would not fit (their byte counts would wrap): refused here, before the
  // agreement, so that every rank fails alike.
  MOONEP_CHECK_ARG(c.hidden <= transport::kMaxRowBytes / static_cast<int64_t>(DTypeSize(c.dtype)),
                   "hidden is %d; a row of %s is then above 1 GiB", c.hidden, DTypeName(c.dtype));
  MOONEP_CHECK_ARG(c.intermediate <= (int64_t{1} << 30), "intermediate is %d; must be <= 2^30",
                   c.intermediate);
  // An expert's three matrices, 3 * H * I elements, are what prefetch moves (the planner bounds
  // their bytes by 2^40); both factors are bounded above, so the product does not wrap.
  MOONEP_CHECK_ARG(3 * c.hidden * c.intermediate * static_cast<int64_t>(DTypeSize(c.dtype)) <=
                       (int64_t{1} << 40),
                   "hidden x intermediate is %d x %d; an expert's three %s matrices are then above "
                   "2^40 bytes", c.hidden, c.intermediate, DTypeName(c.dtype));
  MOONEP_CHECK_ARG(c.max_tokens <= transport::kMaxEntries / c.top_k,
                   "max_tokens x top_k = %d x %d routing entries; at most 2^31 - 1", c.max_tokens,
                   c.top_k);
  MOONEP_CHECK_ARG(c.pad_multiple <= (1 << 16), "pad_multiple is %d; must be <= 65536",
                   c.pad_multiple);
  // This rank's share of the worst case, as if every rank passed its max_tokens (the capacity
  // itself needs every rank's max_tokens: checked again once creation has them).
  return CheckRecvCapacity(c, RecvCapacityRows(c, num_ranks, num_ranks * c.max_tokens));
}

absl::Status CheckRecvCapacity(const LayerConfig& c, int64_t capacity) {
  int64_t rows_bytes = 0;
  MOONEP_CHECK_ARG(c.max_recv_rows <= (int64_t{1} << 40) && capacity >= 0 &&
                       !__builtin_mul_overflow(capacity,
                                               c.hidden * static_cast<int64_t>(DTypeSize(c.dtype)),
                                               &rows_bytes),
                   "a receive buffer of %d rows (max_recv_rows %d, max_tokens %d on this rank) of "
                   "%d %s values does not fit", capacity, c.max_recv_rows, c.max_tokens, c.hidden,
                   DTypeName(c.dtype));
  return absl::OkStatus();
}

uint64_t HostBufferBytes(const LayerConfig& c, int64_t capacity, int rows_per_handle,
                         int shared_rows) {
  using Wide = unsigned __int128;  // no overflow for any checked config (each factor < 2^63)
  const Wide row_bytes = static_cast<Wide>(c.hidden) * DTypeSize(c.dtype);
  const Wide cap = static_cast<Wide>(std::max<int64_t>(capacity, 0));
  const Wide staging = static_cast<Wide>(std::max<int64_t>(c.max_tokens, 0)) *
                       static_cast<Wide>(std::max(c.top_k, 0)) * row_bytes;
  const Wide per_handle = rows_per_handle * cap * row_bytes + cap * 4 + staging;
  const Wide total = static_cast<Wide>(std::max(c.max_inflight, 1)) * per_handle +
                     shared_rows * cap * row_bytes;
  return total > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(total);
}

absl::Status CheckHostBuffers(Communicator* comm, const LayerConfig& c, int64_t capacity,
                              int rows_per_handle, int shared_rows, uint64_t extra_bytes,
                              const char* what, const char* phase, absl::Status* local) {
  if (c.device != Device::kCpu) return absl::OkStatus();
  const uint64_t rows = HostBufferBytes(c, capacity, rows_per_handle, shared_rows);
  const uint64_t bytes = rows > UINT64_MAX - extra_bytes ? UINT64_MAX : rows + extra_bytes;
  // One read of the room (MemAvailable, the memory cgroup) for this rank's check and the node's.
  const HostMemoryRoom room = HostMemoryRoomNow();
  if (local->ok()) *local = CheckHostAllocation(bytes, what, room);
  if (comm->size() == 1) return absl::OkStatus();
  // [node key (64 bytes), bytes, room] of every rank, read before anyone allocates.
  struct Entry {
    char key[64];
    uint64_t bytes;
    int64_t available;
  };
  Entry mine{};
  // No key (neither boot_id nor a host name): a node of its own, not every such rank together.
  std::string key = HostMemoryNodeKey(room);
  if (key.empty()) key = "rank " + std::to_string(comm->rank());
  std::memcpy(mine.key, key.data(), std::min(key.size(), sizeof(mine.key)));
  mine.bytes = local->ok() ? bytes : 0;
  mine.available = room.bytes;
  std::string gathered;
  const absl::Status agreed = comm->Allgather(
      absl::Span<const char>(reinterpret_cast<const char*>(&mine), sizeof(mine)), &gathered,
      phase);
  // This rank's own error first, as AgreeOnVerdict gives it (the creation stops either way).
  if (!local->ok()) return agreed.ok() ? absl::OkStatus() : *local;
  MOONEP_RETURN_IF_ERROR(agreed);
  std::vector<int> node;
  unsigned __int128 total = 0;
  int64_t available = -1;
  for (int r = 0; r < comm->size(); ++r) {
    Entry e;
    std::memcpy(&e, gathered.data() + static_cast<size_t>(r) * sizeof(Entry), sizeof(Entry));
    if (std::memcmp(e.key, mine.key, sizeof(mine.key)) != 0) continue;
    node.push_back(r);
    total += e.bytes;
    available = std::max(available, e.available);
  }
  if (node.size() < 2 || available < 0 || total <= static_cast<uint64_t>(available)) {
    return absl::OkStatus();
  }
  const uint64_t sum = total > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(total);
  *local = OutOfMemory("cannot allocate %s: the %d ranks on this node (ranks %s) need %d host "
                       "bytes together (this rank %d), and they have %d bytes available (the "
                       "most any of them read: MemAvailable of /proc/meminfo, or their memory "
                       "cgroup's room where smaller)", what, node.size(),
                       absl::StrJoin(node, ","), sum, bytes, available);
  return absl::OkStatus();
}

namespace {
// Empty: by device ("nccl" for device cuda, "mpi" for the CPU).
MOONEP_STRING_PARAM(TransportParam, "TRANSPORT", "")
}  // namespace

std::string TransportBackend(const LayerConfig& config) {
  if (!config.transport.empty()) return config.transport;
  if (!TransportParam().empty()) return TransportParam();
  return config.device == Device::kCuda ? "nccl" : "mpi";
}

int64_t RecvCapacityRows(const LayerConfig& c, int32_t num_ranks, int64_t sum_max_tokens) {
  if (c.max_recv_rows > 0) return c.max_recv_rows;
  const int64_t epn = c.num_experts / std::max(num_ranks, 1);
  const int64_t slots = c.slots < 0 ? epn : c.slots;
  const int64_t groups = epn + slots;
  // A token sends at most one row per expert that this rank computes, and there are G of them;
  // every token of every rank may pick this rank's experts (e.g. policy none, all routed here).
  // Within CheckLayerConfig's bounds (max_tokens * K < 2^31 a rank) this fits int64 for any
  // number of ranks MPI can have; -1 otherwise (CheckRecvCapacity then refuses it).
  int64_t rows = 0;
  if (__builtin_mul_overflow(sum_max_tokens, std::min<int64_t>(c.top_k, groups), &rows) ||
      __builtin_add_overflow(rows, groups * (c.pad_multiple - 1), &rows)) {
    return -1;
  }
  return rows;
}

transport::TransportOptions TransportOptionsFor(const LayerConfig& config, MPI_Comm comm) {
  transport::TransportOptions to;
  to.comm = comm;
  to.max_tokens = config.max_tokens;
  to.max_top_k = config.top_k;
  to.max_row_bytes = config.hidden * static_cast<int64_t>(DTypeSize(config.dtype));
  to.timeout_ms = config.timeout_ms;
  return to;
}

planner::PlannerConfig PlannerConfigFor(const LayerConfig& config, int32_t num_ranks,
                                        int32_t slots) {
  planner::PlannerConfig pc;
  pc.num_ranks = num_ranks;
  pc.num_experts = config.num_experts;
  pc.slots = slots;
  pc.pad_multiple = config.pad_multiple;
  pc.ranks_per_node = config.ranks_per_node;
  pc.policy = config.policy;
  pc.eplb_period = config.eplb_period;
  pc.replica_cost_intra = config.replica_cost_intra;
  pc.replica_cost_inter = config.replica_cost_inter;
  pc.row_cost_intra = config.row_cost_intra;
  pc.row_cost_inter = config.row_cost_inter;
  pc.speeds = config.speeds;
  // One rank has no peer to replicate onto: the test policy then routes through the rank's own
  // slots, so prefetch, replica compute and reduce still run (tests, single-GPU checks).
  pc.test_home_replicas = true;
  const int64_t dtype_bytes = static_cast<int64_t>(DTypeSize(config.dtype));
  pc.row_bytes = config.hidden * dtype_bytes;
  pc.expert_bytes = 3 * config.hidden * config.intermediate * dtype_bytes;
  return pc;
}

absl::Status CheckPlanFitsCapacities(const planner::Plan& plan,
                                     absl::Span<const int64_t> capacity) {
  if (capacity.size() != plan.rank_rows.size()) {
    return Internal("plan for %d ranks, receive capacities of %d", plan.rank_rows.size(),
                    capacity.size());
  }
  int32_t worst = -1;
  int64_t worst_over = 0;
  for (size_t r = 0; r < capacity.size(); ++r) {
    const int64_t over = plan.rank_rows[r] - capacity[r];
    if (over > worst_over) {
      worst_over = over;
      worst = static_cast<int32_t>(r);
    }
  }
  if (worst < 0) return absl::OkStatus();
  return OutOfMemory("the plan puts %d rows on rank %d; its receive capacity is %d "
                     "(max_recv_rows)", plan.rank_rows[worst], worst, capacity[worst]);
}

namespace {

// FNV-1a over the bits of `speeds` (the same values give the same hash on every rank; -0.0 and
// 0.0 never reach it: speeds are checked positive first, or the rank's verdict is invalid).
uint64_t SpeedsHash(const std::vector<double>& speeds) {
  if (speeds.empty()) return 0;
  uint64_t h = 1469598103934665603ull;
  for (double s : speeds) {
    uint64_t bits = 0;
    std::memcpy(&bits, &s, sizeof(bits));
    for (int i = 0; i < 8; ++i) {
      h ^= (bits >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h;
}

// The fields every rank must agree on, as plain integers (fixed layout on the wire).
struct Fingerprint {
  int32_t valid;
  int64_t max_tokens;  // not compared: summed for the receive capacity
  int32_t num_experts, top_k;
  int64_t hidden, intermediate;
  int32_t dtype, grad_dtype, slots, pad_multiple, policy, ranks_per_node, eplb_period, device,
      max_inflight;
  int32_t caller_nccl;  // moonepCommSetNcclComm was called (nccl transport only)
  int64_t replica_cost_intra, replica_cost_inter, row_cost_intra, row_cost_inter;
  int64_t speeds_count;   // 0: none
  uint64_t speeds_hash;   // FNV-1a of the speeds' bits (0 without speeds)
  char transport[16];
  char what[32];  // what is being created ("MoE layer creation", "EP buffer creation")
  char reason[128];  // why this rank's config is invalid (the start of its message)
};

}  // namespace

absl::Status AgreeOnConfig(Communicator* comm, const LayerConfig& c,
                           const absl::Status& local_verdict, const char* what,
                           int64_t* sum_max_tokens) {
  Fingerprint mine;
  std::memset(&mine, 0, sizeof(mine));
  mine.valid = local_verdict.ok() ? 1 : 0;
  mine.max_tokens = c.max_tokens;
  mine.num_experts = c.num_experts;
  mine.top_k = c.top_k;
  mine.hidden = c.hidden;
  mine.intermediate = c.intermediate;
  mine.dtype = static_cast<int32_t>(c.dtype);
  mine.grad_dtype = static_cast<int32_t>(c.grad_dtype);
  mine.slots = c.slots;
  mine.pad_multiple = c.pad_multiple;
  mine.policy = static_cast<int32_t>(c.policy);
  mine.ranks_per_node = c.ranks_per_node;
  mine.eplb_period = c.eplb_period;
  mine.device = static_cast<int32_t>(c.device);
  mine.max_inflight = c.max_inflight;
  mine.replica_cost_intra = c.replica_cost_intra;
  mine.replica_cost_inter = c.replica_cost_inter;
  mine.row_cost_intra = c.row_cost_intra;
  mine.row_cost_inter = c.row_cost_inter;
  mine.speeds_count = static_cast<int64_t>(c.speeds.size());
  mine.speeds_hash = SpeedsHash(c.speeds);
  const std::string backend = TransportBackend(c);
  mine.caller_nccl = backend == "nccl" && comm->has_caller_nccl_comm() ? 1 : 0;
  std::strncpy(mine.transport, backend.c_str(), sizeof(mine.transport) - 1);
  std::strncpy(mine.what, what, sizeof(mine.what) - 1);
  if (!local_verdict.ok()) {
    const absl::string_view reason = local_verdict.message();
    std::memcpy(mine.reason, reason.data(), std::min(reason.size(), sizeof(mine.reason) - 1));
  }
  std::string gathered;
  MOONEP_RETURN_IF_ERROR(comm->Allgather(
      absl::Span<const char>(reinterpret_cast<const char*>(&mine), sizeof(mine)), &gathered,
      what));
  std::vector<Fingerprint> all(static_cast<size_t>(comm->size()));
  std::memcpy(all.data(), gathered.data(), gathered.size());

  std::vector<int> bad;
  for (int r = 0; r < comm->size(); ++r) {
    if (!all[r].valid) bad.push_back(r);
  }
  if (!bad.empty()) {
    if (!local_verdict.ok()) return local_verdict;
    // The first one's reason (a peer's log may sit on another node), as far as it fits.
    const Fingerprint& first = all[bad[0]];
    const std::string reason(first.reason, strnlen(first.reason, sizeof(first.reason)));
    return RemoteError("%s: the config is invalid on rank(s) %s (rank %d: %s%s)", what,
                       absl::StrJoin(bad, ","), bad[0], reason,
                       reason.size() == sizeof(first.reason) - 1 ? "..." : "");
  }
  struct Field {
    const char* name;
    int64_t (*get)(const Fingerprint&);
  };
  static const Field kFields[] = {
      {"num_experts", [](const Fingerprint& f) -> int64_t { return f.num_experts; }},
      {"top_k", [](const Fingerprint& f) -> int64_t { return f.top_k; }},
      {"hidden", [](const Fingerprint& f) -> int64_t { return f.hidden; }},
      {"intermediate", [](const Fingerprint& f) -> int64_t { return f.intermediate; }},
      {"dtype", [](const Fingerprint& f) -> int64_t { return f.dtype; }},
      {"grad_dtype", [](const Fingerprint& f) -> int64_t { return f.grad_dtype; }},
      {"slots", [](const Fingerprint& f) -> int64_t { return f.slots; }},
      {"pad_multiple", [](const Fingerprint& f) -> int64_t { return f.pad_multiple; }},
      {"policy", [](const Fingerprint& f) -> int64_t { return f.policy; }},
      {"ranks_per_node", [](const Fingerprint& f) -> int64_t { return f.ranks_per_node; }},
      {"eplb_period", [](const Fingerprint& f) -> int64_t { return f.eplb_period; }},
      {"device", [](const Fingerprint& f) -> int64_t { return f.device; }},
      {"max_inflight", [](const Fingerprint& f) -> int64_t { return f.max_inflight; }},
      {"replica_cost_intra", [](const Fingerprint& f) -> int64_t { return f.replica_cost_intra; }},
      {"replica_cost_inter", [](const Fingerprint& f) -> int64_t { return f.replica_cost_inter; }},
      {"row_cost_intra", [](const Fingerprint& f) -> int64_t { return f.row_cost_intra; }},
      {"row_cost_inter", [](const Fingerprint& f) -> int64_t { return f.row_cost_inter; }},
      {"the number of speeds (0: none)",
       [](const Fingerprint& f) -> int64_t { return f.speeds_count; }},
  };
  for (int r = 1; r < comm->size(); ++r) {
    // A layer on one rank and an EP buffer on another would pair up their transports and fail
    // later, or not at all, with no word of why.
    if (std::strncmp(all[r].what, all[0].what, sizeof(all[0].what)) != 0) {
      return InvalidArgument(
          "%s: ranks create different objects: %s on rank 0 but %s on rank %d (every rank must "
          "create the same layers and EP buffers of a communicator in the same order)",
          what, all[0].what, all[r].what, r);
    }
  }
  for (int r = 1; r < comm->size(); ++r) {
    if (std::strncmp(all[r].transport, all[0].transport, sizeof(all[0].transport)) != 0) {
      return InvalidArgument(
          "%s: config differs between ranks: transport is '%s' on rank 0 but '%s' on rank %d "
          "(set MOONEP_TRANSPORT alike everywhere)", what, all[0].transport, all[r].transport, r);
    }
  }
  for (int r = 1; r < comm->size(); ++r) {
    if (all[r].caller_nccl != all[0].caller_nccl) {
      return InvalidArgument(
          "%s: moonepCommSetNcclComm was called on rank %d but not on rank %d (call it on every "
          "rank of the communicator, or on none)", what, all[0].caller_nccl ? 0 : r,
          all[0].caller_nccl ? r : 0);
    }
  }
  for (const Field& field : kFields) {
    const int64_t first = field.get(all[0]);
    for (int r = 1; r < comm->size(); ++r) {
      const int64_t value = field.get(all[r]);
      if (value != first) {
        // Everyone builds the same message from the same gathered data.
        return InvalidArgument(
            "%s: config differs between ranks: %s is %d on rank 0 but %d on rank %d "
            "(every rank must pass the same layer config)",
            what, field.name, first, value, r);
      }
    }
  }
  for (int r = 1; r < comm->size(); ++r) {
    if (all[r].speeds_hash != all[0].speeds_hash) {
      return InvalidArgument(
          "%s: config differs between ranks: speeds (%d values) differ between rank 0 and rank "
          "%d (every rank must pass the same speeds)", what, all[0].speeds_count, r);
    }
  }
  if (sum_max_tokens != nullptr) {
    // Every rank's max_tokens passed its local check (<= 2^31 - 1): the sum fits.
    *sum_max_tokens = 0;
    for (const Fingerprint& f : all) *sum_max_tokens += f.max_tokens;
  }
  return absl::OkStatus();
}

absl::Status CloseTransport(transport::Transport* transport, const LayerConfig& config,
                            const std::string& what) {
  if (transport == nullptr) return absl::OkStatus();
  ScopedDevice device(config.device, config.device_index);
  absl::Status closed = transport->Close();
  if (!closed.ok()) {
    closed = Annotate(closed, what);
    MOONEP_WARN("%s", std::string(closed.message()));
  }
  return closed;
}

absl::Status AgreeOnVerdict(Communicator* comm, const absl::Status& local_verdict,
                            const char* what) {
  const char mine = local_verdict.ok() ? 1 : 0;
  std::string gathered;
  const absl::Status agreed = comm->Allgather(absl::Span<const char>(&mine, 1), &gathered, what);
  if (!local_verdict.ok()) return local_verdict;
  MOONEP_RETURN_IF_ERROR(agreed);
  std::vector<int> bad;
  for (int r = 0; r < comm->size(); ++r) {
    if (gathered[static_cast<size_t>(r)] != 1) bad.push_back(r);
  }
  if (bad.empty()) return absl::OkStatus();
  return RemoteError("%s: failed on rank(s) %s (see their error)", what, absl::StrJoin(bad, ","));
}

}  // namespace moonep::runtime
