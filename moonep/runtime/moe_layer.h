// One MoE layer step on a communicator: the only place that drives planner, transport and
// executor together.
//
//   forward:  count -> allgather counts -> plan -> prefetch (async) || dispatch
//             -> executor on the home groups -> wait prefetch -> executor on the replica groups
//             -> combine (y[t] = sum_k w[t,k] FFN_e(t,k)(x[t]), fp32 accumulation)
//   backward: dispatch dy (combine-backward) -> d topk_weights = <dy[t], FFN_e(t,k)(x[t])>
//             -> dy rows scaled by their top-k weight -> executor backward (home groups, then
//             replica groups once their weights are present) -> gradient reduction of replica
//             slots into the home experts' gradients (async) || combine dx (dispatch-backward)
//
// Every call is collective: all ranks of the communicator call the same layers' Forward /
// Backward in the same order (Release and BindParameters are local). Creation and destruction
// are collective too: every rank creates and destroys the layers of a communicator in the same
// order (see Close). The plan is made once per forward and reused by its backward through the
// handle.
//
// Memory, all allocated by Create / BindParameters, never during a step (cap = receive capacity
// rows, see LayerConfig::max_recv_rows; d = dtype bytes; a step's own bookkeeping, the plan and
// layouts O(E + R * slots + max_tokens * K + cap), grows to its size at the first steps):
//   per in-flight handle: x rows + expert output rows 2 * cap * H * d, row weights cap * 4,
//                         host transport staging (mpi, ucx; transport::Transport::PrepareHandle)
//                         max_tokens * K * (H * d + 8) + cap * 8 + max(max_tokens * K, cap) * 4
//   per layer:            dy rows + dx rows 2 * cap * H * d, executor workspace
//   per communicator and layer shape (shared by every layer of that shape):
//                         replica weights + gradients slots * 3 * H * I * (d + grad d)
// Weights and weight gradients stay the caller's and are read / accumulated in place.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moonep/compute/compute_view.h"
#include "moonep/compute/executor.h"
#include "moonep/core/tensor.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/device.h"
#include "moonep/runtime/layer_config.h"
#include "planner/planner.h"
#include "transport/transport.h"

namespace moonep::runtime {

enum class Phase : int32_t {
  kCounts = 0,       // routing check + counts allgather
  kPlan,             // planner
  kDispatch,         // x rows to their compute ranks
  kComputeHome,      // executor on the home groups
  kPrefetchWait,     // time spent waiting for replica weights after the home groups
  kComputeReplica,   // executor on the replica groups
  kCombine,          // expert outputs back, weighted sum
  kBackwardDispatch, // dy rows to the compute ranks (combine-backward)
  kTopkGrad,         // d topk_weights
  kBackwardCompute,  // executor backward, home and replica groups
  kBackwardCombine,  // dx rows back (dispatch-backward)
  kReduce,           // wait for the replica gradient reduction
  kNumPhases,
};
const char* PhaseName(Phase phase);

struct StepStats {
  int64_t step = 0;            // forwards made by this layer so far (1 for the first)
  int64_t tokens = 0;          // this rank's tokens in the last forward
  planner::PlanStats plan;     // global: loads before/after, replicas, rows, bytes (as planned)
  int64_t rows_computed = 0;   // rows this rank's executor computed (no padding)
  int64_t rank_rows = 0;       // rows of this rank's compute layout (padding included)
  // Transport counters of this rank for the last forward (counts, dispatch, combine, prefetch)
  // and the last backward (backward forms, prefetch, reduce), indexed by transport::OpKind.
  transport::OpCounters ops[static_cast<int>(transport::OpKind::kNumKinds)];
  double seconds[static_cast<int>(Phase::kNumPhases)] = {};
  double forward_seconds = 0, backward_seconds = 0;
};

// A forward's handle: which saved context, and which use of it (stale handles are refused).
struct LayerHandle {
  int32_t index = -1;
  uint64_t generation = 0;
};

class MoeLayer {
 public:
  // Collective over comm: checks the config on every rank and that all ranks agree (sharing every
  // rank's max_tokens), makes the transport, then sizes every buffer and the transport staging
  // of every handle; a rank that cannot allocate its share fails creation on every rank
  // (OutOfMemory there, RemoteError naming it elsewhere). `comm` must outlive the layer.
  static absl::StatusOr<std::unique_ptr<MoeLayer>> Create(Communicator* comm,
                                                          const LayerConfig& config);
  // Closes (see Close) when Close was not called, then frees everything.
  ~MoeLayer();

  // Ends the layer's transport: collective, every rank closes (or destroys) the layers of a
  // communicator in the same order, as it created them. The host transports agree, within the
  // transport's timeout (LayerConfig::timeout_ms, else MOONEP_TIMEOUT_MS), that every peer got
  // here; a peer that does not (it failed, hangs, or destroys its layers in another order) makes
  // Close return Timeout naming this layer, the phase and the peers not heard from, also logged as
  // a WARN. The destructor still frees every local resource (only the transport's MPI
  // communicators stay allocated, since a late peer's messages may still arrive). Later calls
  // fail with InvalidUsage; a second Close returns the first one's result.
  absl::Status Close();

  // The caller's parameters of this rank's epn home experts (plan.local_experts order, i.e.
  // experts rank*epn .. rank*epn+epn-1 with default placement), and their gradients (empty for a
  // forward-only layer). Local; may be called again to rebind between steps (InvalidUsage while a
  // forward handle is outstanding); a rebinding takes effect at the next forward.
  absl::Status BindParameters(absl::Span<const compute::ExpertParams> weights,
                              absl::Span<const compute::ExpertParams> grads);

  // x [T, H] and y [T, H] of the layer dtype, topk_ids / topk_weights [T * K]. T may differ
  // between ranks and steps (<= max_tokens). Returns the handle Backward or Release takes.
  //
  // Device cuda: every tensor and span is memory of the layer's GPU, and `stream` is the
  // caller's cudaStream_t (null: the legacy default stream): the layer's work starts after the
  // work queued on it, and the call returns once y is complete in GPU memory, so work queued on
  // any stream afterwards may read it. The CPU ignores `stream`.
  //
  // `caller_error`: an error the caller found in its own arguments (the C API's NULL pointers):
  // Forward then refuses with it on this rank, still joining the count exchange, so that the
  // peers fail at once with RemoteError giving it (mpi, ucx).
  absl::StatusOr<LayerHandle> Forward(int64_t num_tokens, const TensorView& x,
                                      absl::Span<const int32_t> topk_ids,
                                      absl::Span<const float> topk_weights, const TensorView& y,
                                      void* stream = nullptr,
                                      const absl::Status& caller_error = absl::OkStatus());
  // Accumulates weight gradients into the bound gradients, writes dx [T, H] and
  // d_topk_weights [T * K] (0 where the id is -1), and releases the handle. `stream` as for
  // Forward: the call returns once dx, d_topk_weights and the gradients are complete.
  absl::Status Backward(LayerHandle handle, const TensorView& dy, const TensorView& dx,
                        absl::Span<float> d_topk_weights, void* stream = nullptr);
  // Releases a forward's handle without backward (inference). Local.
  absl::Status Release(LayerHandle handle);

  const LayerConfig& config() const { return config_; }
  const StepStats& stats() const { return stats_; }
  // The layer's transport (its backend, counters and health; tests compare NCCL communicators).
  const transport::Transport* transport() const { return transport_.get(); }
  // The plan of a live handle (for tests and tools).
  absl::StatusOr<const planner::Plan*> PlanOf(LayerHandle handle) const;
  // Tokens of a live handle's forward (0 for a stale handle).
  int64_t TokensOf(LayerHandle handle) const;
  int64_t recv_capacity_rows() const { return capacity_; }
  // Bytes this layer allocated (not the shared replica buffer: Communicator::ReplicaBytes()),
  // the transport staging included.
  size_t MemoryBytes() const;
  // The transport staging of every handle (part of MemoryBytes): host memory for mpi and ucx;
  // for nccl the device and pinned staging allocated so far (it grows in the first steps).
  size_t StagingBytes() const;
  // False once a failure left the transport unusable; every later call then fails.
  bool usable() const { return broken_.ok(); }
  // A local error in a collective call on this rank (an argument or handle the caller passed
  // wrongly, no gradients bound): fails `kind` on every peer at once too
  // (Transport::AbortOperation) and leaves the layer unusable. Returns `status`.
  absl::Status AbortOperation(transport::OpKind kind, absl::Status status);

 private:
  struct Context;
  MoeLayer() = default;
  // At creation, before the agreement (local).
  absl::Status AllocateBuffers();
  absl::StatusOr<Context*> Lookup(LayerHandle handle) const;
  // Marks the layer unusable: any failure once rows or weights are moving (the transport only
  // agrees on errors of the count exchange; after that a peer may be left mid-operation).
  absl::Status Fail(absl::Status status);
  // Orders the transport's next operations after the work queued on the caller's stream.
  void UseCallerStream(void* stream);
  absl::Status RunForward(Context* ctx, const TensorView& x, absl::Span<const int32_t> ids,
                          absl::Span<const float> weights, const TensorView& y);
  absl::Status RunBackward(Context* ctx, const TensorView& dy, const TensorView& dx,
                           absl::Span<float> d_topk_weights);
  absl::Status BuildViews(Context* ctx, bool need_grads);
  absl::StatusOr<transport::RequestPtr> StartPrefetchIfNeeded(Context* ctx);
  absl::Status Compute(Context* ctx, bool backward, transport::Request* prefetch,
                       const TensorView& in_rows, const TensorView& grad_rows,
                       const TensorView& out_rows);

  Communicator* comm_ = nullptr;
  LayerConfig config_;
  int32_t epn_ = 0, slots_ = 0, layer_id_ = 0;
  int64_t capacity_ = 0;
  size_t row_bytes_ = 0;
  absl::Status broken_;
  bool closed_ = false;
  absl::Status close_status_;  // Close's result
  bool moving_ = false;  // the current forward got past the count exchange and planning

  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<planner::Planner> planner_;
  std::unique_ptr<compute::Executor> executor_;
  std::unique_ptr<DeviceOps> ops_;  // row scaling and zeroing, ordered before the executor
  SharedReplicas* replicas_ = nullptr;
  bool made_replicas_ = false;  // Create's AllocateBuffers made replicas_ (dropped if Create fails)

  bool bound_ = false, grads_bound_ = false;
  std::vector<compute::ExpertParams> weights_, grads_;
  std::vector<TensorView> home_weight_blocks_, home_grad_blocks_;
  std::vector<TensorView> slot_weight_blocks_, slot_grad_blocks_;

  std::vector<std::unique_ptr<Context>> contexts_;
  uint64_t next_generation_ = 0;
  DeviceMemory dy_rows_, dx_rows_;  // [cap, H] each, on the layer's device
  DeviceMemory dtopk_scratch_;      // fp32 d topk_weights when the caller passes none
  StepStats stats_;
};

}  // namespace moonep::runtime
