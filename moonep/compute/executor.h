// The grouped expert-FFN executor interface. Backends (CPU now, CUDA later) implement it over a
// ComputeView; the runtime only sees this header.
//
// Per group g with rows X = x_rows[row_offset, row_offset + row_count):
//   forward:   a = X Wg, b = X Wu, h = silu(a) * b, Y = h Wd
//   backward:  given dY: dh = dY Wd^T, da = dh * b * silu'(a), db = dh * silu(a),
//              dX = da Wg^T + db Wu^T, and the weight gradients are ACCUMULATED:
//              dWd += h^T dY, dWg += X^T da, dWu += X^T db
// Compute and accumulation are fp32; storage is fp32 or bf16 (the view's dtype).
//
// Rows of x_rows / dy_rows outside every group's [row_offset, row_offset + row_count) (padding and
// gaps) are never read. The matching rows of y_rows / dx_rows are set to zero, so an output buffer
// never carries stale data in its padding.
//
// Thread safety: one call at a time per executor (it owns one workspace); distinct executors may
// run concurrently.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "moonep/compute/compute_view.h"
#include "moonep/core/tensor.h"

namespace moonep::compute {

struct ExecutorConfig {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  DType dtype = DType::kFloat32;
  int64_t max_rows = 0;      // the largest view.total_rows a call will pass (sizes the workspace)
  int32_t num_threads = 0;   // 0: MOONEP_NUM_THREADS, and when that is 0 too, every core
};
// The most executor threads: an explicit num_threads above it is refused; MOONEP_NUM_THREADS or
// a core count above it is capped to it.
constexpr int32_t kMaxExecutorThreads = 1024;

// Keeping the pre-activations trades memory for the two GEMMs backward would otherwise redo:
// PreactivationBytes(total_rows, I) = total_rows * 2 * I * 4 bytes per micro-batch in flight.
struct ForwardOptions {
  // Empty (data == nullptr): nothing is kept and Backward recomputes a and b from x_rows.
  // Otherwise an fp32 [total_rows, 2 * I] contiguous tensor owned by the caller: Forward writes
  // a = x Wg to columns [0, I) and b = x Wu to columns [I, 2I) of every group row.
  TensorView preactivations;
};

struct BackwardOptions {
  // The tensor Forward filled for the same view and x_rows, or empty to recompute.
  TensorView preactivations;
};

inline size_t PreactivationBytes(int64_t total_rows, int64_t intermediate) {
  return static_cast<size_t>(total_rows) * 2 * static_cast<size_t>(intermediate) * sizeof(float);
}

class Executor {
 public:
  virtual ~Executor() = default;

  virtual Device device() const = 0;
  virtual const ExecutorConfig& config() const = 0;
  // Bytes of scratch memory the executor allocated at creation; calls allocate nothing more.
  virtual size_t WorkspaceBytes() const = 0;

  // y_rows[r] = FFN_g(x_rows[r]) for every row r of every group g. x_rows, y_rows:
  // [view.total_rows, H] of the view's dtype, contiguous, not overlapping.
  virtual absl::Status Forward(const ComputeView& view, const TensorView& x_rows,
                               const TensorView& y_rows, const ForwardOptions& options) = 0;

  // dx_rows = d<dy_rows, y_rows>/dx_rows, and each group's weight gradients += their gradient.
  // x_rows, dy_rows, dx_rows: [view.total_rows, H] of the view's dtype; dx_rows overlaps none of
  // the inputs. Every non-empty group needs gradient tensors (fp32 or the view's dtype).
  virtual absl::Status Backward(const ComputeView& view, const TensorView& x_rows,
                                const TensorView& dy_rows, const TensorView& dx_rows,
                                const BackwardOptions& options) = 0;
};

// Argument checks shared by every backend (the device is the backend's): config fields, the view
// against the config, rows tensors' shape/dtype/device/alignment, and overlaps between outputs
// and inputs. Errors are InvalidArgument naming the argument.
absl::Status CheckExecutorConfig(const ExecutorConfig& config);
absl::Status CheckForwardArgs(const ExecutorConfig& config, Device device, const ComputeView& view,
                              const TensorView& x_rows, const TensorView& y_rows,
                              const ForwardOptions& options);
absl::Status CheckBackwardArgs(const ExecutorConfig& config, Device device,
                               const ComputeView& view, const TensorView& x_rows,
                               const TensorView& dy_rows, const TensorView& dx_rows,
                               const BackwardOptions& options);

}  // namespace moonep::compute
