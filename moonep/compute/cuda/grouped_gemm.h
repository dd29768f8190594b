// The grouped GEMM of the CUDA backend: a batch of independent row-major GEMMs (one per expert
// group, or per group and matrix), run through cuBLAS in one of three ways:
//   kGrouped: one cublasGemmGroupedBatchedEx call for the whole batch (one launch, device-side
//             pointer arrays uploaded with the call's other host data);
//   kStreams: one cublasGemmEx per problem, spread over the executor's streams (largest first,
//             each to the least-loaded stream, so a skewed batch still fills the GPU);
//   kChunked: for batches whose varying dimension is the rows (m = the group's rows, the same n,
//             k and leading dimensions everywhere): every group is cut into chunks of c rows and
//             all full chunks run as ONE cublasGemmBatchedEx of identical [c, n, k] GEMMs - the
//             tile grid of one dense GEMM, whatever the group sizes - while the remainders
//             (< c rows each) run as one grouped call on a second stream at the same time.
//             c is the largest of 512, 256, 128 that leaves at most 1/8 of the rows in remainders
//             (else 128);
//   kPersistent: MoonEP's own kernel (persistent_gemm.h): one launch whose tile queue holds every
//             group's tiles, the last partial wave split along K. Hopper (sm_90) only, bf16 A and
//             B, beta 0, n % 256 == 0, k % 64 == 0, A not transposed, aligned operands;
//   kAuto:    per batch, from the host-known sizes (docs/cuda.md has the measurements behind it):
//             kChunked for near-uniform sizes (no group above twice the mean, and chunks of 512
//             rows when the mean is at least MOONEP_CUDA_GEMM_STREAMS_MIN_ROWS, else of 512, 256
//             or 128, leave at most 1/8 of the rows over); else kPersistent
//             where it applies and the mean is below MOONEP_CUDA_GEMM_PERSISTENT_MAX_ROWS; else
//             kStreams from a mean of MOONEP_CUDA_GEMM_STREAMS_MIN_ROWS (skewed large groups fill
//             the GPU on their own); below it kChunked where it applies, else kGrouped.
// cuBLAS 13.1 refuses cublasGemmGroupedBatchedEx for bf16 inputs with fp32 outputs; such a batch
// (or chunk remainder) runs per problem instead, and that type pair is not tried again.
// Empty problems are never added, so an empty group costs nothing. Arithmetic is fp32
// (CUBLAS_COMPUTE_32F: no TF32 for fp32 storage), inputs fp32 or bf16, outputs fp32 or bf16.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moonep/compute/cuda/persistent_gemm.h"
#include "moonep/core/dtype.h"
#include "moonep/core/env.h"

namespace moonep::param {
// The grouped-GEMM knobs (docs/environment.md), checked: a malformed or out-of-range value is an
// InvalidArgument naming it, which CudaExecutor::Create and moonep-bench-gemm-cuda return through
// CheckCudaGemmEnvironment (cuda_executor.h) before anything reads them. Before, a stream count
// outside 1..16 was clamped without a word (0 gave 1 stream, not the default 4) and negative
// thresholds were taken as they were.
// Streams of a CUDA executor.
MOONEP_CHECKED_INT_PARAM(CheckedCudaGemmStreams, "CUDA_GEMM_STREAMS", 4, 1, 16)
// kAuto: mean rows per GEMM from which skewed batches run per group over streams.
MOONEP_CHECKED_INT_PARAM(CheckedCudaGemmStreamsMinRows, "CUDA_GEMM_STREAMS_MIN_ROWS", 512, 0,
                         INT64_MAX)
// kAuto: mean rows per GEMM below which skewed batches run on the persistent kernel (sm_90).
MOONEP_CHECKED_INT_PARAM(CheckedCudaGemmPersistentMaxRows, "CUDA_GEMM_PERSISTENT_MAX_ROWS", 2048, 0,
                         INT64_MAX)
// The thresholds as GroupedGemm reads them: the value, or the default where it is bad (for the
// tools that drive GroupedGemm without CheckCudaGemmEnvironment; the executor refused it first).
inline int64_t CudaGemmStreamsMinRows() { return CheckedCudaGemmStreamsMinRows().value_or(512); }
inline int64_t CudaGemmPersistentMaxRows() {
  return CheckedCudaGemmPersistentMaxRows().value_or(2048);
}
// auto, grouped, streams, chunked or persistent.
MOONEP_STRING_PARAM(CudaGemmStrategy, "CUDA_GEMM_STRATEGY", "auto")
}  // namespace moonep::param

namespace moonep::compute::cuda {

enum class GemmStrategy : int32_t {
  kAuto = 0,
  kGrouped = 1,
  kStreams = 2,
  kChunked = 3,
  kPersistent = 4
};
const char* GemmStrategyName(GemmStrategy s);
// "auto", "grouped", "streams", "chunked" or "persistent"; anything else is InvalidArgument.
absl::StatusOr<GemmStrategy> ParseGemmStrategy(const std::string& name);

// C[m, n] = op(A)[m, k] op(B)[k, n] + beta C, all row-major with the given leading dimensions.
struct GemmProblem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  float beta = 0.0f;
  int64_t rows = 0;  // the group's rows (what kAuto looks at)
};

struct GemmBatch {
  bool trans_a = false, trans_b = false;
  DType ab_dtype = DType::kFloat32;  // A and B
  DType c_dtype = DType::kFloat32;
  std::vector<GemmProblem> problems;

  // Filled by GroupedGemm::Plan (chosen) and Run (ran: chosen, or kStreams where cuBLAS refused
  // a grouped call).
  GemmStrategy chosen = GemmStrategy::kAuto;
  GemmStrategy ran = GemmStrategy::kAuto;
  size_t staged_offset = 0;  // byte offset of the A, B, C pointer arrays in the staging buffer
  // kChunked: `chunks` full chunks of `chunk_rows` rows (pointer arrays at chunk_offset), and the
  // remainders as problems of their own (pointer arrays at staged_offset when more than one).
  int64_t chunk_rows = 0;
  int64_t chunks = 0;
  size_t chunk_offset = 0;
  std::vector<GemmProblem> remainders;

  void Clear(bool ta, bool tb, DType ab, DType c) {
    trans_a = ta;
    trans_b = tb;
    ab_dtype = ab;
    c_dtype = c;
    problems.clear();
  }
};

// The same GEMM as the persistent kernel's group and as a GemmProblem (row-major, beta 0).
PersistentGroup ToPersistent(const GemmProblem& p);
GemmProblem ToProblem(const PersistentGroup& g, int64_t n, int64_t k);

// Host data one call uploads to the device in a single copy: two slots used in turn, so the host
// can prepare call n+1 while the copy of call n is still queued.
class Staging {
 public:
  static absl::StatusOr<std::unique_ptr<Staging>> Create(size_t capacity_bytes);
  ~Staging();

  // Starts a call: waits until the slot's previous upload has been read, then empties it.
  absl::Status Begin();
  // Appends bytes (8-byte aligned); returns their offset.
  size_t Add(const void* data, size_t bytes);
  // Copies what was added to the device on `stream` (growing both sides first if needed, which
  // synchronizes `stream`); afterwards DevicePtr(offset) is valid for this call's work.
  absl::Status Upload(cudaStream_t stream);
  const void* DevicePtr(size_t offset) const { return device_[slot_] + offset; }
  size_t capacity() const { return capacity_; }

 private:
  Staging() = default;
  absl::Status Allocate(size_t bytes);
  void Free();

  std::vector<char> host_;  // the call's bytes (reserved at capacity)
  size_t capacity_ = 0;
  int slot_ = 1;
  char* pinned_[2] = {nullptr, nullptr};
  char* device_[2] = {nullptr, nullptr};
  cudaEvent_t uploaded_[2] = {nullptr, nullptr};
};

class GroupedGemm {
 public:
  // num_streams streams: stream 0 is `main` (not owned), the others are created here; each has
  // its own cuBLAS handle and a cuBLAS workspace of kCublasWorkspaceBytes carved from
  // `cublas_workspace` (num_streams * kCublasWorkspaceBytes bytes of device memory, not owned).
  static constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
  static absl::StatusOr<std::unique_ptr<GroupedGemm>> Create(cudaStream_t main, int num_streams,
                                                             void* cublas_workspace);
  ~GroupedGemm();

  int num_streams() const { return static_cast<int>(streams_.size()); }
  void set_strategy(GemmStrategy s) { strategy_ = s; }
  GemmStrategy strategy() const { return strategy_; }

  // Decides the batch's strategy and stages its pointer arrays when it runs grouped.
  absl::Status Plan(GemmBatch* batch, Staging* staging);
  // Enqueues the batch on the main stream (forking to and joining the side streams for kStreams).
  // For kGrouped the staging must have been uploaded.
  absl::Status Run(GemmBatch* batch, const Staging& staging);

 private:
  GroupedGemm() = default;
  absl::Status RunOne(int stream, bool trans_a, bool trans_b, cudaDataType_t ab, cudaDataType_t c,
                      const GemmProblem& p);
  absl::Status RunStreams(const GemmBatch& batch);
  // One grouped call over `problems` on stream `stream`; false in *refused when cuBLAS does not
  // support the types (then nothing was enqueued).
  absl::Status RunGrouped(int stream, const GemmBatch& batch, const std::vector<GemmProblem>& problems,
                          size_t staged_offset, const Staging& staging, bool* refused);
  absl::Status RunChunked(const GemmBatch& batch, const Staging& staging);
  // Whether the persistent kernel exists here and takes this batch.
  bool PersistentApplies(const GemmBatch& batch) const;
  absl::Status RunPersistent(const GemmBatch& batch);
  // Plans kChunked for the batch if it applies; with near_uniform_min > 0 only if chunks of at
  // least that many rows (512, 256 or 128) leave at most 1/8 of the rows in remainders (returns
  // false otherwise, staging nothing).
  bool PlanChunked(GemmBatch* batch, Staging* staging, int64_t near_uniform_min);
  bool GroupedRefused(const GemmBatch& b) const { return (grouped_refused_ >> TypePair(b)) & 1u; }
  static int TypePair(const GemmBatch& b) {
    return (b.ab_dtype == DType::kBFloat16 ? 2 : 0) + (b.c_dtype == DType::kBFloat16 ? 1 : 0);
  }
  void StagePointers(const std::vector<GemmProblem>& problems, Staging* staging, size_t* offset);
  void Fork(int used);
  absl::Status Join(int used);

  GemmStrategy strategy_ = GemmStrategy::kAuto;
  std::vector<cudaStream_t> streams_;   // [0] = main
  std::vector<cublasHandle_t> handles_;
  std::vector<cudaEvent_t> joins_;      // one per side stream
  cudaEvent_t fork_ = nullptr;
  uint32_t grouped_refused_ = 0;        // bit TypePair: cuBLAS refused a grouped call of those types
  std::unique_ptr<PersistentGemm> persistent_;  // null where the device is not sm_90
  std::vector<PersistentGroup> persistent_groups_;
  // Host scratch reused by every call (grown once for larger batches).
  std::vector<int32_t> order_;
  std::vector<double> load_;
  std::vector<cublasOperation_t> op_a_, op_b_;
  std::vector<int> m_, n_, k_, lda_, ldb_, ldc_, group_size_;
  std::vector<float> alpha_, beta_;
  std::vector<const void*> ptrs_;
};

}  // namespace moonep::compute::cuda
