// The CUDA grouped-GEMM executor: the Executor interface (executor.h) on one GPU.
//
// Per call, on the executor's stream (a blocking stream, so it is ordered after work the caller
// queued on the legacy default stream):
//   forward:  [a | b] = X [Wg | Wu]            grouped GEMM, fp32 out (options.preactivations or
//                                              the workspace), one GEMM of N = 2I per group when
//                                              Wg and Wu are the two halves of one [H, 2I] tensor
//             h = silu(a) * b                  kernel, stored in the view's dtype
//             Y = h Wd                         grouped GEMM, view dtype out
//   backward: [a | b] as above unless kept, dh = dY Wd^T (fp32), then one kernel writes h, da, db
//             (view dtype), dX = [da | db] [Wg | Wu]^T (one GEMM when fused, else two, the second
//             accumulating), dWg += X^T da, dWu += X^T db, dWd += h^T dY (one grouped batch per
//             gradient dtype, beta = 1 into the caller's gradients).
// Rows outside every group are zeroed by one kernel. GEMMs run through GroupedGemm (cuBLAS,
// grouped, chunked or per-group over streams, see grouped_gemm.h); arithmetic is fp32 throughout.
// bf16 views round h, da and db to bf16 before the GEMMs that read them (as bf16 training does);
// fp32 views keep everything fp32.
//
// Memory, allocated once at creation (max_rows = R, I, H, element size e of the dtype,
// S streams):
//   device: 4*R*2I (a|b) + 4*R*I (dh) + e*R*I (h) + e*R*2I (da|db) + S * 32 MiB (cuBLAS),
//           each part rounded up to 256 bytes
//   staging: 2 slots of pinned host + device memory for the per-call tables (segments, grouped and
//           chunked pointer arrays), sized for 1024 groups and R rows, grown once if a view has
//           more groups
// WorkspaceBytes() is the device part plus the staging (both sides).
//
// Synchronous by default: a call returns when its work is done, and any device error is returned
// by that call. set_synchronous(false) leaves the work queued on stream() (the next call's staging
// still waits for the previous-but-one call's upload only).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "moonep/compute/cuda/grouped_gemm.h"
#include "moonep/compute/cuda/kernels.h"
#include "moonep/compute/executor.h"

namespace moonep::compute::cuda {

// MOONEP_CUDA_GEMM_STREAMS (1..16), MOONEP_CUDA_GEMM_STREAMS_MIN_ROWS and
// MOONEP_CUDA_GEMM_PERSISTENT_MAX_ROWS (>= 0) and MOONEP_CUDA_GEMM_STRATEGY (a strategy name):
// InvalidArgument naming the first one that is malformed or out of range. Reads the environment
// only (no device needed).
absl::Status CheckCudaGemmEnvironment();

struct CudaExecutorOptions {
  int device = -1;       // -1: the current device
  int num_streams = 0;   // 0: MOONEP_CUDA_GEMM_STREAMS (4); at most 16
  bool synchronous = true;
};

// Device bytes CudaExecutor allocates for `config` with `num_streams` streams (staging excluded).
size_t CudaDeviceWorkspaceBytes(const ExecutorConfig& config, int num_streams);

class CudaExecutor final : public Executor {
 public:
  // InvalidArgument for a config CheckExecutorConfig refuses, options.num_streams outside [0, 16],
  // or a bad MOONEP_CUDA_GEMM_* variable (CheckCudaGemmEnvironment; all before any CUDA call);
  // then CUDA errors, OutOfMemory for the workspace.
  static absl::StatusOr<std::unique_ptr<CudaExecutor>> Create(const ExecutorConfig& config,
                                                              const CudaExecutorOptions& options = {});
  ~CudaExecutor() override;

  Device device() const override { return Device::kCuda; }
  const ExecutorConfig& config() const override { return config_; }
  size_t WorkspaceBytes() const override;

  absl::Status Forward(const ComputeView& view, const TensorView& x_rows, const TensorView& y_rows,
                       const ForwardOptions& options) override;
  absl::Status Backward(const ComputeView& view, const TensorView& x_rows,
                        const TensorView& dy_rows, const TensorView& dx_rows,
                        const BackwardOptions& options) override;

  cudaStream_t stream() const { return stream_; }
  int device_index() const { return device_; }
  void set_synchronous(bool s) { synchronous_ = s; }
  void set_gemm_strategy(GemmStrategy s) { gemm_->set_strategy(s); }
  GemmStrategy gemm_strategy() const { return gemm_->strategy(); }
  // The strategy each non-empty GEMM batch of the last call ran with, in issue order (for tests
  // and benchmarks).
  const std::vector<GemmStrategy>& last_strategies() const { return last_strategies_; }
  // Waits for the work queued on stream() and returns its first error.
  absl::Status Synchronize();

 private:
  explicit CudaExecutor(const ExecutorConfig& config) : config_(config) {}
  absl::Status CheckPointers(const ComputeView& view, bool grads,
                             std::initializer_list<std::pair<const TensorView*, const char*>> rows) const;
  // Fills the data and gap segment tables of the view and stages them.
  void StageSegments(const ComputeView& view);
  SegmentTable Table(size_t offset, const std::vector<RowSegment>& segs,
                     const std::vector<int64_t>& prefix, size_t prefix_offset) const;
  // [a | b] = X [Wg | Wu] for every group into ab (ld 2I).
  void AddPreactivationGemms(const ComputeView& view, const TensorView& x_rows, float* ab,
                             GemmBatch* batch);
  absl::Status PlanAndUpload(int batches);
  absl::Status RunBatch(int i);
  absl::Status Finish();

  ExecutorConfig config_;
  int device_ = 0;
  bool synchronous_ = true;
  cudaStream_t stream_ = nullptr;
  char* workspace_ = nullptr;  // device
  size_t device_bytes_ = 0;
  float* ab_ = nullptr;        // [R, 2I] fp32
  float* dh_ = nullptr;        // [R, I] fp32
  void* h_ = nullptr;          // [R, I] dtype
  void* dab_ = nullptr;        // [R, 2I] dtype
  std::unique_ptr<Staging> staging_;
  std::unique_ptr<GroupedGemm> gemm_;

  // Per-call host state, reused.
  std::vector<int32_t> by_offset_;
  std::vector<RowSegment> data_segs_, gap_segs_;
  std::vector<int64_t> data_prefix_, gap_prefix_;
  size_t data_off_ = 0, data_prefix_off_ = 0, gap_off_ = 0, gap_prefix_off_ = 0;
  std::vector<GemmBatch> batches_;
  std::vector<GemmStrategy> last_strategies_;
};

// The CUDA executor behind the Executor interface (what the runtime picks for Device::kCuda).
absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(const ExecutorConfig& config);

}  // namespace moonep::compute::cuda
