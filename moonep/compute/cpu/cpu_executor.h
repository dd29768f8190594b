// The CPU grouped-GEMM executor: OpenBLAS cblas_sgemm under a fixed-tile task schedule.
//
// Scheduling. Work is cut into tasks whose shapes depend only on the view (never on the thread
// count): forward and the first backward pass run per block of kRowBlock rows of a group (each
// block does its whole FFN chain, rows being independent); the weight-gradient pass runs per
// block of kWeightTile output rows of dWg, dWu, dWd, each a GEMM over all of the group's rows, so
// no two tasks write the same gradient element and nothing is reduced in a thread-dependent
// order. Groups are visited by decreasing rows (ties: group index), and tasks are handed out
// dynamically: a large group's blocks spread over every thread first (the "multi-threaded GEMM"
// for that group), then the small groups run side by side, one thread each. OpenBLAS itself is
// kept single-threaded during a call (its thread count is process-global and its own split could
// change rounding with the thread count); it is restored afterwards. Results are bitwise identical
// for any num_threads. Empty groups produce no task.
//
// Memory (floats, allocated once at creation; rb = min(kRowBlock, max_rows), M = max(H, I),
// Tw = min(kWeightTile, M), T = threads):
//   per thread, fp32: 3 * rb * I
//   per thread, bf16: 3 * rb * I + 2 * rb * H + kPanelK * (Tw + M) + Tw * M
//   shared (backward h, da, db of every row): 3 * max_rows * I
// WorkspaceBytes() = 4 * (T * per_thread + shared), each part rounded up to 64 bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "moonep/compute/cpu/thread_pool.h"
#include "moonep/compute/executor.h"

namespace moonep::compute::cpu {

constexpr int64_t kRowBlock = 256;
constexpr int64_t kWeightTile = 256;

// The workspace CpuExecutor allocates for `config` with `threads` threads.
size_t CpuWorkspaceBytes(const ExecutorConfig& config, int threads);

class CpuExecutor final : public Executor {
 public:
  static absl::StatusOr<std::unique_ptr<CpuExecutor>> Create(const ExecutorConfig& config);
  ~CpuExecutor() override;

  Device device() const override { return Device::kCpu; }
  const ExecutorConfig& config() const override { return config_; }
  size_t WorkspaceBytes() const override { return workspace_bytes_; }
  int num_threads() const { return pool_->size(); }

  absl::Status Forward(const ComputeView& view, const TensorView& x_rows, const TensorView& y_rows,
                       const ForwardOptions& options) override;
  absl::Status Backward(const ComputeView& view, const TensorView& x_rows,
                        const TensorView& dy_rows, const TensorView& dx_rows,
                        const BackwardOptions& options) override;

  struct Task {
    int32_t group;
    int32_t matrix;  // weight-gradient pass: 0 gate, 1 up, 2 down
    int64_t begin;   // first row (of the group, or of the gradient matrix)
    int64_t count;
  };

 private:
  explicit CpuExecutor(const ExecutorConfig& config, int threads);

  void OrderGroups(const ComputeView& view);
  void RowTasks(const ComputeView& view);
  void WeightTasks(const ComputeView& view);
  void ZeroUncoveredRows(const ComputeView& view, const TensorView& out);
  float* ThreadScratch(int worker) const { return workspace_ + worker * per_thread_floats_; }

  ExecutorConfig config_;
  std::unique_ptr<ThreadPool> pool_;
  float* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  size_t per_thread_floats_ = 0;
  float* shared_ = nullptr;  // backward: h, da, db, each [max_rows, I]
  std::vector<int32_t> order_;  // group indices by decreasing rows, reused
  std::vector<int32_t> by_offset_;
  std::vector<Task> tasks_;
};

}  // namespace moonep::compute::cpu
