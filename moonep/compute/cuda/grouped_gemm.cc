#include "moonep/compute/cuda/grouped_gemm.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "moonep/compute/cuda/cuda_check.h"
#include "moonep/core/logging.h"
#include "moonep/core/status.h"

namespace moonep::compute::cuda {
namespace {

cudaDataType_t CudaType(DType d) { return d == DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F; }

size_t RoundUp8(size_t v) { return (v + 7) / 8 * 8; }

bool FitsInt(int64_t v) { return v >= 0 && v <= INT_MAX; }

}  // namespace

PersistentGroup ToPersistent(const GemmProblem& p) {
  PersistentGroup g;
  g.a = p.a;
  g.lda = p.lda;
  g.b = p.b;
  g.ldb = p.ldb;
  g.c = p.c;
  g.ldc = p.ldc;
  g.rows = p.m;
  return g;
}

GemmProblem ToProblem(const PersistentGroup& g, int64_t n, int64_t k) {
  GemmProblem p;
  p.m = p.rows = g.rows;
  p.n = n;
  p.k = k;
  p.a = g.a;
  p.lda = g.lda;
  p.b = g.b;
  p.ldb = g.ldb;
  p.c = g.c;
  p.ldc = g.ldc;
  return p;
}

const char* GemmStrategyName(GemmStrategy s) {
  switch (s) {
    case GemmStrategy::kAuto: return "auto";
    case GemmStrategy::kGrouped: return "grouped";
    case GemmStrategy::kStreams: return "streams";
    case GemmStrategy::kChunked: return "chunked";
    case GemmStrategy::kPersistent: return "persistent";
  }
  return "?";
}

absl::StatusOr<GemmStrategy> ParseGemmStrategy(const std::string& name) {
  if (name == "auto") return GemmStrategy::kAuto;
  if (name == "grouped") return GemmStrategy::kGrouped;
  if (name == "streams") return GemmStrategy::kStreams;
  if (name == "chunked") return GemmStrategy::kChunked;
  if (name == "persistent") return GemmStrategy::kPersistent;
  return InvalidArgument("GEMM strategy '%s' is not one of auto, grouped, streams, chunked, persistent",
                         name);
}

// ---------------------------------------------------------------------------------------------
// Staging

absl::StatusOr<std::unique_ptr<Staging>> Staging::Create(size_t capacity_bytes) {
  std::unique_ptr<Staging> s(new Staging());
  for (int i = 0; i < 2; ++i) {
    MOONEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->uploaded_[i], cudaEventDisableTiming));
  }
  MOONEP_RETURN_IF_ERROR(s->Allocate(std::max<size_t>(capacity_bytes, 4096)));
  return s;
}

Staging::~Staging() {
  Free();
  for (cudaEvent_t e : uploaded_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

void Staging::Free() {
  for (int i = 0; i < 2; ++i) {
    if (pinned_[i] != nullptr) cudaFreeHost(pinned_[i]);
    if (device_[i] != nullptr) cudaFree(device_[i]);
    pinned_[i] = device_[i] = nullptr;
  }
  capacity_ = 0;
}

absl::Status Staging::Allocate(size_t bytes) {
  for (int i = 0; i < 2; ++i) {
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMallocHost(reinterpret_cast<void**>(&pinned_[i]), bytes));
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&device_[i]), bytes));
  }
  capacity_ = bytes;
  host_.reserve(bytes);
  return absl::OkStatus();
}

absl::Status Staging::Begin() {
  slot_ ^= 1;
  // The copy that last read this slot's pinned bytes must be done before they are rewritten.
  MOONEP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(uploaded_[slot_]));
  host_.clear();
  return absl::OkStatus();
}

size_t Staging::Add(const void* data, size_t bytes) {
  const size_t offset = RoundUp8(host_.size());
  host_.resize(offset + bytes);
  if (bytes > 0) std::memcpy(host_.data() + offset, data, bytes);
  return offset;
}

absl::Status Staging::Upload(cudaStream_t stream) {
  if (host_.empty()) return absl::OkStatus();
  if (host_.size() > capacity_) {
    // A view with more groups than ever before: grow once. Work queued on `stream` may still
    // read the old device buffers.
    MOONEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    const size_t bytes = std::max(host_.size(), 2 * capacity_);
    Free();
    MOONEP_RETURN_IF_ERROR(Allocate(bytes));
  }
  std::memcpy(pinned_[slot_], host_.data(), host_.size());
  MOONEP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(device_[slot_], pinned_[slot_], host_.size(), cudaMemcpyHostToDevice, stream));
  MOONEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(uploaded_[slot_], stream));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// GroupedGemm

absl::StatusOr<std::unique_ptr<GroupedGemm>> GroupedGemm::Create(cudaStream_t main, int num_streams,
                                                                 void* cublas_workspace) {
  MOONEP_CHECK_ARG(num_streams >= 1 && num_streams <= 16, "num_streams %d is not in [1, 16]",
                   num_streams);
  std::unique_ptr<GroupedGemm> g(new GroupedGemm());
  g->streams_.push_back(main);
  for (int s = 1; s < num_streams; ++s) {
    cudaStream_t st;
    MOONEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    g->streams_.push_back(st);
    cudaEvent_t e;
    MOONEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    g->joins_.push_back(e);
  }
  MOONEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&g->fork_, cudaEventDisableTiming));
  for (int s = 0; s < num_streams; ++s) {
    cublasHandle_t h;
    MOONEP_CUBLAS_RETURN_IF_ERROR(cublasCreate(&h));
    g->handles_.push_back(h);
    MOONEP_CUBLAS_RETURN_IF_ERROR(cublasSetStream(h, g->streams_[s]));
    // After cublasSetStream, which resets the workspace to cuBLAS's own pool: every handle gets
    // its own slice, so concurrent streams never share scratch and no call allocates.
    MOONEP_CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(
        h, static_cast<char*>(cublas_workspace) + s * kCublasWorkspaceBytes, kCublasWorkspaceBytes));
    MOONEP_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  }
  // The persistent kernel where the device has it (Hopper); elsewhere batches never choose it.
  auto persistent = PersistentGemm::Create();
  if (persistent.ok()) g->persistent_ = std::move(*persistent);
  auto strategy = ParseGemmStrategy(param::CudaGemmStrategy());
  if (!strategy.ok()) return Annotate(strategy.status(), "MOONEP_CUDA_GEMM_STRATEGY");
  g->strategy_ = *strategy;
  return g;
}

GroupedGemm::~GroupedGemm() {
  for (cublasHandle_t h : handles_) cublasDestroy(h);
  for (size_t s = 1; s < streams_.size(); ++s) cudaStreamDestroy(streams_[s]);
  for (cudaEvent_t e : joins_) cudaEventDestroy(e);
  if (fork_ != nullptr) cudaEventDestroy(fork_);
}

void GroupedGemm::StagePointers(const std::vector<GemmProblem>& problems, Staging* staging,
                                size_t* offset) {
  // cuBLAS is column-major: the row-major C = op(A) op(B) is C^T = op(B)^T op(A)^T, so cuBLAS's
  // A array holds our B pointers and its B array our A pointers.
  const size_t count = problems.size();
  ptrs_.resize(3 * count);
  for (size_t i = 0; i < count; ++i) {
    ptrs_[i] = problems[i].b;
    ptrs_[count + i] = problems[i].a;
    ptrs_[2 * count + i] = problems[i].c;
  }
  *offset = staging->Add(ptrs_.data(), ptrs_.size() * sizeof(void*));
}

bool GroupedGemm::PlanChunked(GemmBatch* batch, Staging* staging, int64_t near_uniform_min) {
  if (batch->trans_a || batch->problems.empty()) return false;
  const GemmProblem& p0 = batch->problems[0];
  int64_t total = 0;
  for (const GemmProblem& p : batch->problems) {
    if (p.m != p.rows || p.n != p0.n || p.k != p0.k || p.lda != p0.lda || p.ldb != p0.ldb ||
        p.ldc != p0.ldc || p.beta != p0.beta) {
      return false;
    }
    total += p.m;
  }
  int64_t c = 0;
  for (int64_t cand : {512, 256, 128}) {
    int64_t rest = 0;
    for (const GemmProblem& p : batch->problems) rest += p.m % cand;
    if (rest * 8 <= total) {
      c = cand;
      break;
    }
  }
  if (near_uniform_min > 0 && c < near_uniform_min) return false;
  if (c == 0) c = 128;
  int64_t chunks = 0;
  for (const GemmProblem& p : batch->problems) chunks += p.m / c;
  if (chunks == 0) return false;  // only remainders: that is kGrouped
  const size_t ea = DTypeSize(batch->ab_dtype), ec = DTypeSize(batch->c_dtype);
  ptrs_.resize(3 * static_cast<size_t>(chunks));
  batch->remainders.clear();
  size_t j = 0;
  for (const GemmProblem& p : batch->problems) {
    const int64_t full = p.m / c;
    for (int64_t i = 0; i < full; ++i, ++j) {
      ptrs_[j] = p.b;
      ptrs_[chunks + j] = static_cast<const char*>(p.a) + static_cast<size_t>(i * c * p.lda) * ea;
      ptrs_[2 * chunks + j] = static_cast<char*>(p.c) + static_cast<size_t>(i * c * p.ldc) * ec;
    }
    if (p.m % c != 0) {
      GemmProblem r = p;
      r.m = r.rows = p.m % c;
      r.a = static_cast<const char*>(p.a) + static_cast<size_t>(full * c * p.lda) * ea;
      r.c = static_cast<char*>(p.c) + static_cast<size_t>(full * c * p.ldc) * ec;
      batch->remainders.push_back(r);
    }
  }
  batch->chunk_offset = staging->Add(ptrs_.data(), ptrs_.size() * sizeof(void*));
  batch->chunk_rows = c;
  batch->chunks = chunks;
  if (batch->remainders.size() > 1 && !GroupedRefused(*batch)) {
    StagePointers(batch->remainders, staging, &batch->staged_offset);
  }
  return true;
}

absl::Status GroupedGemm::Plan(GemmBatch* batch, Staging* staging) {
  const size_t count = batch->problems.size();
  int64_t rows = 0, max_rows = 0;
  for (const GemmProblem& p : batch->problems) {
    max_rows = std::max(max_rows, p.rows);
    MOONEP_CHECK_ARG(FitsInt(p.m) && FitsInt(p.n) && FitsInt(p.k) && FitsInt(p.lda) &&
                         FitsInt(p.ldb) && FitsInt(p.ldc),
                     "GEMM %dx%dx%d (ld %d, %d, %d) exceeds cuBLAS's 32-bit sizes", p.m, p.n, p.k,
                     p.lda, p.ldb, p.ldc);
    rows += p.rows;
  }
  const int64_t mean = count == 0 ? 0 : rows / static_cast<int64_t>(count);
  const bool large = mean >= param::CudaGemmStreamsMinRows();
  GemmStrategy s = strategy_;
  if (count <= 1) s = GemmStrategy::kStreams;  // one GEMM needs no grouping
  // Near-uniform sizes (no group above twice the mean, and chunks of 512 rows for large groups, of
  // 128 to 512 for small ones, leave at most 1/8 of the rows over) run best as one batched call of
  // equal chunks (docs/cuda.md).
  const bool near_uniform = max_rows * static_cast<int64_t>(count) <= 2 * rows;
  if (s == GemmStrategy::kAuto && near_uniform && PlanChunked(batch, staging, large ? 512 : 128)) {
    batch->chosen = GemmStrategy::kChunked;
    return absl::OkStatus();
  }
  if ((s == GemmStrategy::kPersistent ||
       (s == GemmStrategy::kAuto && mean < param::CudaGemmPersistentMaxRows())) &&
      PersistentApplies(*batch)) {
    batch->chosen = GemmStrategy::kPersistent;
    return absl::OkStatus();
  }
  if (s == GemmStrategy::kPersistent) s = GemmStrategy::kAuto;  // not here: what kAuto does
  if (s == GemmStrategy::kAuto || s == GemmStrategy::kChunked) {
    // kAuto has tried near-uniform chunks above; skewed large groups run best one by one over
    // streams (docs/cuda.md).
    if (!(s == GemmStrategy::kAuto && large) && PlanChunked(batch, staging, 0)) {
      batch->chosen = GemmStrategy::kChunked;
      return absl::OkStatus();
    }
    s = large ? GemmStrategy::kStreams : GemmStrategy::kGrouped;
  }
  if (s == GemmStrategy::kGrouped && GroupedRefused(*batch)) s = GemmStrategy::kStreams;
  batch->chosen = s;
  if (s == GemmStrategy::kGrouped) StagePointers(batch->problems, staging, &batch->staged_offset);
  return absl::OkStatus();
}

bool GroupedGemm::PersistentApplies(const GemmBatch& batch) const {
  if (persistent_ == nullptr || batch.problems.empty()) return false;
  const GemmProblem& p0 = batch.problems[0];
  if (!PersistentGemm::Applies(batch.trans_a, batch.ab_dtype, batch.c_dtype, p0.n, p0.k, p0.beta)) {
    return false;
  }
  for (const GemmProblem& p : batch.problems) {
    if (p.n != p0.n || p.k != p0.k || p.beta != p0.beta || p.m != p.rows ||
        !PersistentGemm::Aligned(ToPersistent(p))) {
      return false;
    }
  }
  return true;
}

absl::Status GroupedGemm::RunPersistent(const GemmBatch& batch) {
  persistent_groups_.clear();
  for (const GemmProblem& p : batch.problems) persistent_groups_.push_back(ToPersistent(p));
  const GemmProblem& p0 = batch.problems[0];
  return persistent_->Run(streams_[0], batch.trans_b, batch.c_dtype, p0.n, p0.k,
                          persistent_groups_.data(), persistent_groups_.size());
}

absl::Status GroupedGemm::Run(GemmBatch* batch, const Staging& staging) {
  batch->ran = batch->chosen;
  if (batch->problems.empty()) return absl::OkStatus();
  if (batch->chosen == GemmStrategy::kChunked) return RunChunked(*batch, staging);
  if (batch->chosen == GemmStrategy::kPersistent) return RunPersistent(*batch);
  if (batch->chosen == GemmStrategy::kGrouped) {
    bool refused = false;
    MOONEP_RETURN_IF_ERROR(
        RunGrouped(0, *batch, batch->problems, batch->staged_offset, staging, &refused));
    if (!refused) return absl::OkStatus();
    batch->ran = GemmStrategy::kStreams;
  }
  return RunStreams(*batch);
}

absl::Status GroupedGemm::RunOne(int stream, bool trans_a, bool trans_b, cudaDataType_t ab,
                                 cudaDataType_t c, const GemmProblem& p) {
  const float alpha = 1.0f;
  MOONEP_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
      handles_[stream], trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(p.n), static_cast<int>(p.m), static_cast<int>(p.k), &alpha, p.b, ab,
      static_cast<int>(p.ldb), p.a, ab, static_cast<int>(p.lda), &p.beta, p.c, c,
      static_cast<int>(p.ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

void GroupedGemm::Fork(int used) {
  cudaEventRecord(fork_, streams_[0]);
  for (int s = 1; s < used; ++s) cudaStreamWaitEvent(streams_[s], fork_, 0);
}

absl::Status GroupedGemm::Join(int used) {
  for (int s = 1; s < used; ++s) {
    MOONEP_CUDA_RETURN_IF_ERROR(cudaEventRecord(joins_[s - 1], streams_[s]));
    MOONEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(streams_[0], joins_[s - 1], 0));
  }
  return CudaStatus(cudaGetLastError(), "GroupedGemm: fork/join events");
}

absl::Status GroupedGemm::RunStreams(const GemmBatch& batch) {
  const cudaDataType_t ab = CudaType(batch.ab_dtype), c = CudaType(batch.c_dtype);
  const size_t count = batch.problems.size();
  if (count == 1) return RunOne(0, batch.trans_a, batch.trans_b, ab, c, batch.problems[0]);
  const int used = static_cast<int>(std::min<size_t>(count, streams_.size()));
  // Largest first, each to the least-loaded stream (by FLOPs), so skewed groups spread evenly.
  order_.resize(count);
  for (size_t i = 0; i < count; ++i) order_[i] = static_cast<int32_t>(i);
  auto flops = [&](int32_t i) {
    const GemmProblem& p = batch.problems[i];
    return static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k);
  };
  std::stable_sort(order_.begin(), order_.end(),
                   [&](int32_t x, int32_t y) { return flops(x) > flops(y); });
  load_.assign(used, 0.0);
  Fork(used);
  for (int32_t i : order_) {
    const int s = static_cast<int>(std::min_element(load_.begin(), load_.end()) - load_.begin());
    load_[s] += flops(i);
    MOONEP_RETURN_IF_ERROR(RunOne(s, batch.trans_a, batch.trans_b, ab, c, batch.problems[i]));
  }
  return Join(used);
}

absl::Status GroupedGemm::RunGrouped(int stream, const GemmBatch& batch,
                                     const std::vector<GemmProblem>& problems, size_t staged_offset,
                                     const Staging& staging, bool* refused) {
  *refused = false;
  const size_t count = problems.size();
  op_a_.assign(count, batch.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  op_b_.assign(count, batch.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  m_.resize(count);
  n_.resize(count);
  k_.resize(count);
  lda_.resize(count);
  ldb_.resize(count);
  ldc_.resize(count);
  beta_.resize(count);
  alpha_.assign(count, 1.0f);
  group_size_.assign(count, 1);
  for (size_t i = 0; i < count; ++i) {
    const GemmProblem& p = problems[i];
    m_[i] = static_cast<int>(p.n);
    n_[i] = static_cast<int>(p.m);
    k_[i] = static_cast<int>(p.k);
    lda_[i] = static_cast<int>(p.ldb);
    ldb_[i] = static_cast<int>(p.lda);
    ldc_[i] = static_cast<int>(p.ldc);
    beta_[i] = p.beta;
  }
  const auto* ptrs = static_cast<const void* const*>(staging.DevicePtr(staged_offset));
  void* const* c_ptrs = const_cast<void* const*>(ptrs + 2 * count);
  const cublasStatus_t st = cublasGemmGroupedBatchedEx(
      handles_[stream], op_a_.data(), op_b_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(),
      ptrs, CudaType(batch.ab_dtype), lda_.data(), ptrs + count, CudaType(batch.ab_dtype),
      ldb_.data(), beta_.data(), c_ptrs, CudaType(batch.c_dtype), ldc_.data(),
      static_cast<int>(count), group_size_.data(), CUBLAS_COMPUTE_32F);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
    MOONEP_INFO("cublasGemmGroupedBatchedEx does not support %s x %s -> %s here; using per-group "
                "GEMMs for those types",
                DTypeName(batch.ab_dtype), DTypeName(batch.ab_dtype), DTypeName(batch.c_dtype));
    grouped_refused_ |= 1u << TypePair(batch);
    *refused = true;
    return absl::OkStatus();
  }
  MOONEP_CUBLAS_RETURN_IF_ERROR(st);
  return absl::OkStatus();
}

absl::Status GroupedGemm::RunChunked(const GemmBatch& batch, const Staging& staging) {
  const cudaDataType_t ab = CudaType(batch.ab_dtype), ct = CudaType(batch.c_dtype);
  const GemmProblem& p0 = batch.problems[0];
  const bool rest = !batch.remainders.empty();
  // The remainders run beside the chunks, on a second stream when there is one.
  const int rs = rest && streams_.size() > 1 ? 1 : 0;
  if (rs == 1) Fork(2);
  const float alpha = 1.0f;
  const auto* ptrs = static_cast<const void* const*>(staging.DevicePtr(batch.chunk_offset));
  void* const* c_ptrs = const_cast<void* const*>(ptrs + 2 * batch.chunks);
  MOONEP_CUBLAS_RETURN_IF_ERROR(cublasGemmBatchedEx(
      handles_[0], batch.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(p0.n),
      static_cast<int>(batch.chunk_rows), static_cast<int>(p0.k), &alpha, ptrs, ab,
      static_cast<int>(p0.ldb), ptrs + batch.chunks, ab, static_cast<int>(p0.lda), &p0.beta, c_ptrs,
      ct, static_cast<int>(p0.ldc), static_cast<int>(batch.chunks), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT));
  if (rest) {
    bool refused = batch.remainders.size() == 1 || GroupedRefused(batch);
    if (!refused) {
      MOONEP_RETURN_IF_ERROR(
          RunGrouped(rs, batch, batch.remainders, batch.staged_offset, staging, &refused));
    }
    if (refused) {
      for (const GemmProblem& r : batch.remainders) {
        MOONEP_RETURN_IF_ERROR(RunOne(rs, batch.trans_a, batch.trans_b, ab, ct, r));
      }
    }
  }
  if (rs == 1) return Join(2);
  return absl::OkStatus();
}

}  // namespace moonep::compute::cuda
