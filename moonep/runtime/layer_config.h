// The configuration of a MoE layer (and of an EP buffer, which uses the routing part of it), its
// local checks, and the check that every rank of a communicator passed the same values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "moonep/core/dtype.h"
#include "moonep/core/tensor.h"
#include "planner/plan.h"
#include "transport/transport.h"

namespace moonep::runtime {

class Communicator;

// Bounds of a layer or EP buffer config (CheckLayerConfig): experts per layer, and forwards (EP
// dispatches) alive at once.
constexpr int32_t kMaxLayerExperts = transport::kMaxExperts;
constexpr int32_t kMaxInflight = 1024;

struct LayerConfig {
  int32_t num_experts = 0;    // E, a multiple of the number of ranks
  int32_t top_k = 0;          // K
  int64_t hidden = 0;         // H
  int64_t intermediate = 0;   // I (0 for an EP buffer, which has no executor)
  DType dtype = DType::kFloat32;       // x, y, weights, dispatched rows
  DType grad_dtype = DType::kFloat32;  // weight gradients the caller binds
  int32_t slots = -1;         // replica slots per rank (-1: E / R)
  int32_t pad_multiple = 1;   // rows of each expert group padded to a multiple of this
  planner::Policy policy = planner::Policy::kMoonEP;
  int32_t ranks_per_node = 0; // 0: flat topology
  int32_t eplb_period = 1;
  // moonep: the cost of one replica transfer on a rank, in tokens of compute, within a node and
  // across nodes (planner::PlannerConfig::replica_cost_*; both 0: perfect balance).
  int64_t replica_cost_intra = 0;
  int64_t replica_cost_inter = 0;
  // moonep, with replica costs set: the cost of one token row sent or received, in 1/1024 tokens
  // of compute (planner::PlannerConfig::row_cost_*; both 0: rows left out of the weighing).
  int64_t row_cost_intra = 0;
  int64_t row_cost_inter = 0;
  // Each rank's relative compute speed ([R], finite, > 0), or empty: all ranks alike. The planner
  // then balances time, not tokens: rank d's share of the load is proportional to speeds[d]
  // (planner::PlannerConfig::speeds), and replica / row costs are in tokens of the fastest rank.
  // For a slow GPU (throttled, another model) or a rank that does other work; MeasureCosts
  // measures them (MeasuredCosts::speeds, ApplyCostsAndSpeeds). Policies moonep and
  // moonep-greedy only (the others plan as if every rank were alike: refused). Must agree on
  // every rank.
  std::vector<double> speeds;
  // Where x, y, dy, dx, topk_ids, topk_weights, d_topk_weights, weights and gradients live.
  // kCuda: GPU `device_index` of this node (one rank per GPU), the CUDA executor and the NCCL
  // transport; Forward / Backward take the caller's CUDA stream.
  Device device = Device::kCpu;
  int32_t device_index = 0;
  // Static memory: the largest token count this rank will pass (may differ between ranks).
  int64_t max_tokens = 0;
  // Rows this rank's dispatch buffer holds; 0: the worst case (sum of every rank's max_tokens)
  // * min(K, G) plus padding G * (pad_multiple - 1), G = E/R + slots, which no routing can exceed
  // (creation shares every rank's max_tokens). A smaller value (e.g. the balanced bound, see
  // docs/runtime.md) saves memory; a step that needs more fails with OutOfMemory on every rank.
  int64_t max_recv_rows = 0;
  int32_t max_inflight = 1;   // forward handles alive at once (micro-batches before backward)
  int32_t layer_id = -1;      // id in routing traces; -1: creation order on the communicator
  int32_t num_threads = 0;    // executor threads; 0: MOONEP_NUM_THREADS, else every core
  // Transport backend ("mpi", "ucx" where built, "nccl" for device cuda); empty:
  // MOONEP_TRANSPORT, else "nccl" for device cuda and "mpi" for the CPU.
  std::string transport;
  // The transport's timeout in ms (every wait of a step, and the agreement at destruction); 0:
  // MOONEP_TIMEOUT_MS. C++ only (the C config has no such field); may differ between ranks.
  int64_t timeout_ms = 0;
};

// The backend a config selects: its transport field, else MOONEP_TRANSPORT, else "nccl" for a CUDA
// device and "mpi" for the CPU.
std::string TransportBackend(const LayerConfig& config);

// Local checks; `need_executor` requires I > 0. Errors name the field.
absl::Status CheckLayerConfig(const LayerConfig& config, int32_t num_ranks, bool need_executor);

// Collective: every rank sends its local verdict and the fields that must agree (all but
// max_tokens, max_recv_rows, layer_id, num_threads, device_index, timeout_ms; speeds by their
// count and a hash of their bits). On disagreement
// every rank fails with the same message naming the field and the ranks (InvalidArgument on a
// rank whose own config is bad, RemoteError naming it on the others). On success
// *sum_max_tokens (if given) gets the sum of every rank's max_tokens (the same on every rank).
absl::Status AgreeOnConfig(Communicator* comm, const LayerConfig& config,
                           const absl::Status& local_verdict, const char* what,
                           int64_t* sum_max_tokens = nullptr);

// Collective (Transport::Close), on the config's device: ends a layer's or EP buffer's transport
// (null: nothing to end). A failure is annotated with `what` (e.g. "MoE layer 3 destruction") and
// logged as a WARN.
absl::Status CloseTransport(transport::Transport* transport, const LayerConfig& config,
                            const std::string& what);

// Collective: every rank's verdict on a local part of creation (allocations after the config
// agreement). OK when every rank succeeded; else `local_verdict` on a rank that failed and
// RemoteError naming the failed rank(s) on the others (or the agreement's own Timeout).
absl::Status AgreeOnVerdict(Communicator* comm, const absl::Status& local_verdict,
                            const char* what);

// The planner's config for a layer or EP buffer of `config` on `num_ranks` ranks with `slots`
// replica slots a rank (resolved).
planner::PlannerConfig PlannerConfigFor(const LayerConfig& config, int32_t num_ranks, int32_t slots);
// The transport options of a layer or EP buffer on communicator `comm` (its MPI communicator):
// maxima from the config, rows of `hidden` values of its dtype, its timeout.
transport::TransportOptions TransportOptionsFor(const LayerConfig& config, MPI_Comm comm);

// The resolved receive capacity (rows) of this rank: max_recv_rows, else the worst case for
// `sum_max_tokens` tokens over all ranks (AgreeOnConfig's sum; a rank receives at most one row per
// token and group it computes, and there are G = E/R + slots groups):
//   sum_max_tokens * min(K, G) + G * (pad_multiple - 1).
int64_t RecvCapacityRows(const LayerConfig& config, int32_t num_ranks, int64_t sum_max_tokens);
// That capacity's buffers fit (rows of H values: their byte count within int64); InvalidArgument
// naming max_recv_rows / max_tokens otherwise.
absl::Status CheckRecvCapacity(const LayerConfig& config, int64_t capacity_rows);
// [collective, device cpu only: a no-op that every rank skips alike for device cuda] The host
// buffers creation is about to allocate and zero-fill, checked before any of them against the
// node's available memory: per handle (max_inflight) `rows_per_handle` buffers of capacity rows,
// the row weights and the transport's row staging (max_tokens x top_k rows), plus `shared_rows`
// buffers of capacity rows, plus `extra_bytes` (a layer's new replica buffer).
// - This rank's, all together (CheckHostAllocation; each buffer is also checked alone when it is
//   made). Without this, with overcommit, the ones that fit were zero-filled before a later one
//   was refused (a config of 2^34 receive rows took 50 s to fail on a 128 GiB node).
// - Then every rank's on this node: ranks sharing a kernel (the same
//   /proc/sys/kernel/random/boot_id, else host name) and, where one limits them, a memory cgroup
//   add up their bytes (an allgather) against the most room any of them read before the exchange
//   (HostMemoryAvailableBytes: MemAvailable, or the cgroup's room where smaller), before any of
//   them allocated. Each
//   may fit alone where all do not: without this, each zero-filled its share until the kernel's
//   out-of-memory killer ended one, and its peers waited out their timeouts.
// Over either, *local becomes OutOfMemory naming `what` (a rank with a local error already keeps
// it and counts 0 bytes). Where the exchange fails (Timeout naming `phase`, RemoteError), returns
// this rank's own error if it had one, else the exchange's: then the creation stops there.
// The host bytes CheckHostBuffers counts for these buffers (without its extra_bytes), saturating.
uint64_t HostBufferBytes(const LayerConfig& config, int64_t capacity_rows, int rows_per_handle,
                         int shared_rows);
absl::Status CheckHostBuffers(Communicator* comm, const LayerConfig& config,
                              int64_t capacity_rows, int rows_per_handle, int shared_rows,
                              uint64_t extra_bytes, const char* what, const char* phase,
                              absl::Status* local);

// Every rank's rows in `plan` against its receive capacity (`capacity`, [R], as the count exchange
// shared them). The plan and the capacities are the same on every rank, so every rank reaches the
// same verdict: OutOfMemory naming the rank with the largest overflow, before anything moves.
absl::Status CheckPlanFitsCapacities(const planner::Plan& plan, absl::Span<const int64_t> capacity);

}  // namespace moonep::runtime
