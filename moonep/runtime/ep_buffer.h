// The EP buffer: MoonEP's planning and data movement without its executor (C API level 2, the
// DeepEP-style level). Dispatch counts, plans and moves x rows into this rank's compute layout
// held by the buffer; the caller computes the experts on those rows; combine, the backward forms,
// prefetch and reduce reuse the plan saved in the handle. Every call but Layout and Release is
// collective, in the same order on every rank; so are creation and destruction (Close).
//
// Memory (allocated at creation): per in-flight handle, cap * (H * d + 4) bytes for the rows and
// their weights (cap = the receive capacity, LayerConfig::max_recv_rows), plus the host transport
// staging (mpi, ucx) max_tokens * K * (H * d + 8) + cap * 8 + max(max_tokens * K, cap) * 4.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moonep/compute/compute_view.h"
#include "moonep/core/tensor.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/layer_config.h"
#include "moonep/runtime/moe_layer.h"
#include "planner/planner.h"
#include "transport/transport.h"

namespace moonep::runtime {

struct EpLayout {
  int64_t num_rows = 0;
  const void* rows = nullptr;
  const float* row_weights = nullptr;
  int32_t num_groups = 0;
  const int32_t* group_expert = nullptr;
  const int64_t* group_offset = nullptr;
  const int64_t* group_count = nullptr;
};

class EpBuffer {
 public:
  // Collective, like MoeLayer::Create.
  static absl::StatusOr<std::unique_ptr<EpBuffer>> Create(Communicator* comm,
                                                          const LayerConfig& config);
  // Closes (see Close) when Close was not called, then frees everything.
  ~EpBuffer();
  // Collective, like MoeLayer::Close: Timeout naming this buffer, the phase and the peers not
  // heard from when a peer does not get there in time (logged as a WARN too).
  absl::Status Close();

  // `caller_error` as for MoeLayer::Forward.
  absl::StatusOr<LayerHandle> Dispatch(int64_t num_tokens, const TensorView& x,
                                       absl::Span<const int32_t> topk_ids,
                                       absl::Span<const float> topk_weights,
                                       const absl::Status& caller_error = absl::OkStatus());
  absl::Status Layout(LayerHandle handle, EpLayout* layout) const;
  absl::Status Combine(LayerHandle handle, const TensorView& out_rows, const TensorView& y);
  absl::Status CombineBackward(LayerHandle handle, const TensorView& dy, const TensorView& dy_rows);
  absl::Status TopkWeightGrad(LayerHandle handle, const TensorView& dy_rows,
                              const TensorView& out_rows, absl::Span<float> d_topk_weights);
  absl::Status DispatchBackward(LayerHandle handle, const TensorView& dx_rows,
                                const TensorView& dx);
  // home: this rank's epn experts; slots: the caller's `slots` replica experts.
  absl::Status Prefetch(LayerHandle handle, absl::Span<const compute::ExpertParams> home,
                        absl::Span<const compute::ExpertParams> slots);
  absl::Status Reduce(LayerHandle handle, absl::Span<const compute::ExpertParams> home_grads,
                      absl::Span<const compute::ExpertParams> slot_grads);
  absl::Status Release(LayerHandle handle);
  // Tokens of a live handle's dispatch (0 for a stale handle).
  int64_t TokensOf(LayerHandle handle) const;
  // A local error in collective operation `kind` (an argument the caller passed wrongly on this
  // rank): fails `kind` on every peer at once too (Transport::AbortOperation) and leaves the
  // buffer unusable, as any failed collective operation does. Returns `status`.
  absl::Status AbortOperation(transport::OpKind kind, absl::Status status);

  const LayerConfig& config() const { return config_; }
  int32_t experts_per_rank() const { return epn_; }
  int32_t slots() const { return slots_; }
  int64_t recv_capacity_rows() const { return capacity_; }
  const StepStats& stats() const { return stats_; }
  // Bytes this buffer allocated, the transport staging included.
  size_t MemoryBytes() const;
  // The transport staging of every handle (part of MemoryBytes): host memory for mpi and ucx;
  // for nccl the device and pinned staging allocated so far (it grows in the first steps).
  size_t StagingBytes() const;

 private:
  struct Context;
  EpBuffer() = default;
  absl::StatusOr<Context*> Lookup(LayerHandle handle) const;
  absl::Status Fail(absl::Status status);
  absl::Status Blocks(Context* ctx, absl::Span<const compute::ExpertParams> home,
                      absl::Span<const compute::ExpertParams> slots, bool grads,
                      transport::ExpertBlocks* blocks);
  void Count(transport::OpKind kind);
  // A collective call's end: its phase time, added to the step's forward or backward time (the
  // step's dispatch, prefetch and combine; its backward calls and reduce), and its counters.
  void Done(Phase phase, transport::OpKind kind, double seconds, bool backward);

  Communicator* comm_ = nullptr;
  LayerConfig config_;
  int32_t epn_ = 0, slots_ = 0, layer_id_ = 0;
  int64_t capacity_ = 0;
  absl::Status broken_;
  bool closed_ = false;
  absl::Status close_status_;  // Close's result
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<planner::Planner> planner_;
  std::vector<std::unique_ptr<Context>> contexts_;
  uint64_t next_generation_ = 0;
  std::vector<TensorView> home_blocks_, slot_blocks_;  // reused by Prefetch / Reduce
  StepStats stats_;
};

}  // namespace moonep::runtime
