// The CPU grouped-GEMM executor: OpenBLAS cblas_sgemm under a fixed-tile task schedule.
//
// Scheduling. Work is cut into tiles whose shapes depend on the view and, for views too small to
// give every thread kTilesPerThread tiles, on the thread count (TileLimits); every output element
// is produced by exactly one tile with a fixed summation order, so results are bitwise identical
// from run to run, for 1 and 2 threads, and for any thread count on views large enough for the
// default tiles. Phases (a barrier between each):
//   forward  F1: per (block of <= kRowBlock rows, block of <= kColTile columns of I):
//                a = x Wg, b = x Wu, h = silu(a) * b  (h kept in the workspace)
//            F2: per (row block, column block of H): y = h Wd
//   backward B1: per (row block, column block of I): a, b (kept or recomputed), dh = dy Wd^T,
//                h, da, db  (kept in the workspace)
//            B2: per (row block, column block of H): dx = da Wg^T + db Wu^T
//            B3: per block of kWeightTile rows of dWg, dWu, dWd: one GEMM over all the group's
//                rows (dWg += x^T da, dWu += x^T db, dWd += h^T dy), accumulated in place.
// Groups are visited by decreasing rows (ties: group index) and tiles are handed out dynamically:
// a large group's tiles spread over every thread (the multi-threaded GEMM for that group), the
// small groups' tiles then run side by side, one thread each, so a 100x skew between groups still
// keeps all threads busy. OpenBLAS itself runs single-threaded during a call (its thread count is
// process-global and its own split could change rounding with the thread count); the previous
// count is restored when the last call in progress, of any executor, ends. Empty groups produce
// no tile.
//
// Memory (floats, allocated once at creation; rb = min(kRowBlock, max_rows), M = max(H, I),
// tc = min(kColTile, M), Tw = min(kWeightTile, M), T = threads):
//   per thread, fp32 storage: 3 * rb * tc
//   per thread, bf16 storage: 3 * rb * tc + 2 * rb * H + kPanelK * (Tw + M) + Tw * M
//   shared: 3 * max_rows * I  (h, da, db of every row)
// WorkspaceBytes() = 4 * (T * per_thread + shared), each part rounded up to 16 floats.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "moonep/compute/executor.h"
#include "moonep/core/worker_pool.h"

namespace moonep::compute::cpu {

constexpr int64_t kRowBlock = 256;
constexpr int64_t kColTile = 1024;
constexpr int64_t kWeightTile = 256;
// The smallest tiles the row phases cut down to when a view has too few tiles for the threads.
constexpr int64_t kMinRowBlock = 64;
constexpr int64_t kMinColTile = 128;
// Tiles the row phases aim for: kTilesPerThread per thread, counting at least 2 threads. OpenBLAS
// rounds differently for different GEMM shapes, so finer tiles change the last bits: results are
// bitwise the same for 1 and 2 threads (same tiles) and from run to run at any thread count, and
// the same for every thread count when the view's default tiles already suffice (large views).
constexpr int64_t kTilesPerThread = 4;

// Rows per row block of a group of n rows: n <= max_block is one block; otherwise
// ceil(n / max_block) blocks of equal size rounded up to 16 (the last one shorter).
int64_t RowBlock(int64_t n, int64_t max_block = kRowBlock);
// Columns per column tile of an output `width` wide: at most max_tile, tiles of equal width
// rounded up to 16 (the last one narrower).
int64_t ColTile(int64_t width, int64_t max_tile = kColTile);
// The largest tile limits (row block, column tile) for the row phases of groups with these row
// counts and an output `width` wide such that there are at least kTilesPerThread * max(threads, 2)
// tiles: kRowBlock x kColTile when that already gives enough; else rows halve down to
// kMinRowBlock, then columns down to kMinColTile.
std::pair<int64_t, int64_t> TileLimits(const std::vector<int64_t>& rows, int64_t width,
                                       int threads);

// The workspace CpuExecutor allocates for `config` with `threads` threads; SIZE_MAX when it does
// not fit in size_t (Create then fails with InvalidArgument).
size_t CpuWorkspaceBytes(const ExecutorConfig& config, int threads);

class CpuExecutor final : public Executor {
 public:
  // InvalidArgument for a config CheckExecutorConfig refuses, or a MOONEP_NUM_THREADS that is
  // negative or malformed (naming it; checked even when config.num_threads is set); OutOfMemory
  // when the workspace cannot be allocated.
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
    int32_t matrix;  // weight-gradient phase: 0 gate, 1 up, 2 down
    int64_t row0;    // first row of the tile (of the group's rows, or of the gradient matrix)
    int64_t rows;
    int64_t col0;    // first column of the tile
    int64_t cols;
  };

 private:
  explicit CpuExecutor(const ExecutorConfig& config, int threads);

  void OrderGroups(const ComputeView& view);
  // Tiles of (row blocks of each group) x (column tiles of `width`), see TileLimits.
  void RowTasks(const ComputeView& view, int64_t width);
  void WeightTasks(const ComputeView& view);
  void ZeroUncoveredRows(const ComputeView& view, const TensorView& out);
  float* ThreadScratch(int worker) const { return workspace_ + worker * per_thread_floats_; }

  ExecutorConfig config_;
  std::unique_ptr<WorkerPool> pool_;  // its own: worker w uses ThreadScratch(w)
  float* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  size_t per_thread_floats_ = 0;
  float* shared_ = nullptr;  // h, da, db, each [max_rows, I]
  std::vector<int32_t> order_;  // group indices by decreasing rows, reused
  std::vector<int32_t> by_offset_;
  std::vector<int64_t> group_rows_;
  std::vector<Task> tasks_;
};

}  // namespace moonep::compute::cpu
