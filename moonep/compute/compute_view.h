// The compute view: what one rank's grouped-GEMM executor runs over for one layer step.
//
// A rank computes G = epn + slots groups (planner/plan.h): its epn home experts, then its replica
// slots. Each group is a contiguous segment of the dispatched-rows buffer [total_rows, H] plus the
// expert's weights and the tensors its weight gradients accumulate into. The view only points at
// memory: home weights/gradients are the caller's parameters, replica weights/gradients live in a
// ReplicaBuffer. Building a view copies no weights.
//
// Shapes (row-major, unit column stride; a row stride larger than the row is allowed, e.g. for a
// fused [H, 2I] gate|up parameter): gate [H, I], up [H, I], down [I, H].
// Dtypes: weights have the view's dtype (fp32 or bf16). Gradients are fp32 or the view's dtype;
// fp32 gradients with bf16 weights (the usual mixed-precision master-gradient setup) accumulate
// without any rounding to bf16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moonep/core/dtype.h"
#include "moonep/core/tensor.h"
#include "planner/plan.h"

namespace moonep::compute {

// One expert's FFN parameters (or their gradients): y = (silu(x gate) * (x up)) down.
struct ExpertParams {
  TensorView gate;  // [H, I]
  TensorView up;    // [H, I]
  TensorView down;  // [I, H]
};

struct GroupView {
  int32_t expert = -1;       // global expert id; -1 for an unused replica slot
  bool replica = false;      // true for replica slots (groups g >= epn)
  int64_t row_offset = 0;    // first row of the group in the dispatched-rows buffer
  int64_t row_count = 0;     // rows holding tokens; 0 = the group costs nothing
  int64_t padded_count = 0;  // row_count rounded up to the plan's pad multiple; padding rows
                             // [row_offset + row_count, row_offset + padded_count) hold no data
  ExpertParams weights;      // read
  ExpertParams grads;        // accumulated by Backward (may be empty for forward-only views)
};

struct ComputeView {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  DType dtype = DType::kFloat32;
  Device device = Device::kCpu;
  std::vector<GroupView> groups;  // epn home groups, then `slots` replica groups
  int64_t total_rows = 0;         // rows of the dispatched-rows buffer (padding included)
};

// Builds rank `rank`'s view from a finalized plan:
//   local_weights[g], g < epn: the weights of home expert plan.local_experts[rank * epn + g];
//   local_grads: same order, or empty for a forward-only view;
//   replica_weights[s], s < slots: replica slot s (group epn + s), e.g. ReplicaBuffer::weights();
//   replica_grads: same, or empty for a forward-only view.
// Entries for unused slots (plan.slot_expert == -1) are not read and may be empty views.
// H, I, dtype and device are taken from local_weights[0] (or the first used replica slot) and every
// other tensor must agree. view->groups keeps its capacity, so rebuilding a view every step does
// not allocate once it has held G groups.
absl::Status BuildComputeView(const planner::Plan& plan, int32_t rank,
                              absl::Span<const ExpertParams> local_weights,
                              absl::Span<const ExpertParams> local_grads,
                              absl::Span<const ExpertParams> replica_weights,
                              absl::Span<const ExpertParams> replica_grads, ComputeView* view);

// Checks a view (however it was built): H, I > 0, groups lie inside [0, total_rows) without
// overlapping, row_count <= padded_count, and every non-empty group has weights of the right shape,
// dtype and device (and gradients of the right shape, fp32 or view dtype, when `need_grads`), with
// no two gradient tensors (of one group or of two) sharing an element and no gradient sharing an
// element with its group's weights (TensorsOverlap: the gate and up halves of one fused [H, 2I]
// gradient are fine). Errors name the group and the tensor.
absl::Status CheckComputeView(const ComputeView& view, bool need_grads);

// Row stride check for one parameter tensor: 2-D, shape [rows, cols], unit column stride, row
// stride >= cols, element-aligned, non-null, on `device`. Exposed for executors and tests.
absl::Status CheckParamMatrix(const TensorView& t, const char* what, int32_t group, int64_t rows,
                              int64_t cols, DType dtype, Device device);

// Bytes spanned by a 2-D strided view, from its first to one past its last element.
size_t SpanBytes(const TensorView& t);

// True when two views share at least one byte of an element. Exact for 2-D views with unit column
// stride (each is the set of byte ranges [data + r * row_stride, + cols * elem) for r < rows): the
// gate and up halves of one fused [H, 2I] tensor interleave row by row without overlapping and
// are reported disjoint, while views sharing any element are not. Views of any other layout
// (not 2-D, or a column stride other than 1) are compared by their whole span, conservatively.
// Views with no elements or a null pointer overlap nothing. Cost O(1) when the row strides are
// equal (or one view has a single row), else O(min(rows)) when the spans intersect.
bool TensorsOverlap(const TensorView& a, const TensorView& b);

// Owns the weights and gradients of `slots` replica experts in one host allocation made at
// creation. Each slot's parameters form one contiguous block [gate | up | down] of
// 3 * H * I elements, so prefetch and gradient reduction move one block per expert.
//   weights: slots * 3 * H * I * sizeof(dtype) bytes
//   grads:   slots * 3 * H * I * sizeof(grad_dtype) bytes (grad_dtype fp32 by default, so replica
//            gradients lose nothing before they are reduced into the home expert's gradient)
// Total = the sum of both, each rounded up to 64 bytes.
// Where a ReplicaBuffer's storage comes from: host memory (64-byte aligned) by default; a device
// backend passes its own (e.g. cudaMalloc), and the views then carry its device.
struct BufferAllocator {
  Device device = Device::kCpu;
  void* (*allocate)(size_t bytes) = nullptr;  // zeroed memory, or null on failure
  void (*release)(void* data) = nullptr;
  void (*zero)(void* data, size_t bytes) = nullptr;
};

class ReplicaBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<ReplicaBuffer>> Create(
      int32_t slots, int64_t hidden, int64_t intermediate, DType dtype,
      DType grad_dtype = DType::kFloat32, const BufferAllocator* allocator = nullptr);
  ReplicaBuffer(const ReplicaBuffer&) = delete;
  ReplicaBuffer& operator=(const ReplicaBuffer&) = delete;

  int32_t slots() const { return slots_; }
  int64_t hidden() const { return hidden_; }
  int64_t intermediate() const { return intermediate_; }
  DType dtype() const { return dtype_; }
  DType grad_dtype() const { return grad_dtype_; }

  // Views of every slot, in slot order (pass to BuildComputeView).
  absl::Span<const ExpertParams> weights() const { return weights_; }
  absl::Span<const ExpertParams> grads() const { return grads_; }

  // The contiguous block of slot s: 3 * H * I elements, gate then up then down.
  void* slot_weights(int32_t s) const;
  void* slot_grads(int32_t s) const;
  size_t slot_weight_bytes() const { return 3 * static_cast<size_t>(hidden_ * intermediate_) * DTypeSize(dtype_); }
  size_t slot_grad_bytes() const { return 3 * static_cast<size_t>(hidden_ * intermediate_) * DTypeSize(grad_dtype_); }
  size_t total_bytes() const { return bytes_; }

  // Sets every replica gradient to zero (before a step's first backward).
  void ZeroGrads();

  // The bytes Create allocates for these arguments; SIZE_MAX when they do not fit in size_t (or
  // an argument is negative), which Create rejects with InvalidArgument.
  static size_t BytesFor(int32_t slots, int64_t hidden, int64_t intermediate, DType dtype,
                         DType grad_dtype);

 private:
  ReplicaBuffer() = default;

  int32_t slots_ = 0;
  int64_t hidden_ = 0, intermediate_ = 0;
  DType dtype_ = DType::kFloat32, grad_dtype_ = DType::kFloat32;
  size_t bytes_ = 0;
  size_t grad_base_ = 0;  // byte offset of the gradients in storage_
  const BufferAllocator* allocator_ = nullptr;  // null: host memory
  std::unique_ptr<char, void (*)(void*)> storage_{nullptr, nullptr};
  std::vector<ExpertParams> weights_, grads_;
};

}  // namespace moonep::compute
