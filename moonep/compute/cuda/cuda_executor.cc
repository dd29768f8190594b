#include "moonep/compute/cuda/cuda_executor.h"

#include <algorithm>
#include <utility>

#include "moonep/compute/cuda/cuda_check.h"
#include "moonep/core/status.h"

namespace moonep::compute::cuda {
namespace {

constexpr size_t kAlign = 256;
// Staging sized at creation for views of up to this many groups (grown once beyond).
constexpr size_t kStagingGroups = 1024;
// Per group: two segment tables (16 + 8 bytes per entry, about two entries each) and up to eight
// GEMMs a call with three 8-byte pointers each, twice (remainders of chunked batches).
constexpr size_t kStagingBytesPerGroup = 2 * 2 * 24 + 2 * 8 * 3 * 8;
constexpr int kMaxBatches = 6;

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

struct DeviceParts {
  size_t ab = 0, dh = 0, h = 0, dab = 0, cublas = 0, total = 0;
};

DeviceParts Parts(const ExecutorConfig& c, int streams) {
  const size_t R = static_cast<size_t>(c.max_rows), I = static_cast<size_t>(c.intermediate);
  const size_t e = DTypeSize(c.dtype);
  DeviceParts p;
  p.ab = RoundUp(4 * R * 2 * I, kAlign);
  p.dh = RoundUp(4 * R * I, kAlign);
  p.h = RoundUp(e * R * I, kAlign);
  p.dab = RoundUp(e * R * 2 * I, kAlign);
  p.cublas = static_cast<size_t>(streams) * GroupedGemm::kCublasWorkspaceBytes;
  p.total = p.ab + p.dh + p.h + p.dab + p.cublas;
  return p;
}

// options.num_streams, else MOONEP_CUDA_GEMM_STREAMS (both checked by Create: in 1..16).
int ResolveStreams(const CudaExecutorOptions& o) {
  return static_cast<int>(o.num_streams > 0 ? o.num_streams : *param::CheckedCudaGemmStreams());
}

// Makes `device` current for the scope of a call and restores the caller's device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      cudaSetDevice(device);
    } else {
      previous_ = -1;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

// Element `elems` of a buffer of `dtype`.
char* At(const void* base, int64_t elems, DType dtype) {
  return static_cast<char*>(const_cast<void*>(base)) + static_cast<size_t>(elems) * DTypeSize(dtype);
}

// Wg and Wu as the two halves of one [H, 2I] tensor: one GEMM of N = 2I does both.
bool Fused(const TensorView& gate, const TensorView& up, int64_t intermediate) {
  return gate.dtype == up.dtype && gate.strides[0] == up.strides[0] &&
         up.data == At(gate.data, intermediate, gate.dtype);
}

}  // namespace

absl::Status CheckCudaGemmEnvironment() {
  MOONEP_RETURN_IF_ERROR(param::CheckedCudaGemmStreams().status());
  MOONEP_RETURN_IF_ERROR(param::CheckedCudaGemmStreamsMinRows().status());
  MOONEP_RETURN_IF_ERROR(param::CheckedCudaGemmPersistentMaxRows().status());
  const absl::StatusOr<GemmStrategy> strategy = ParseGemmStrategy(param::CudaGemmStrategy());
  return strategy.ok() ? absl::OkStatus()
                       : Annotate(strategy.status(), "MOONEP_CUDA_GEMM_STRATEGY");
}

size_t CudaDeviceWorkspaceBytes(const ExecutorConfig& config, int num_streams) {
  return Parts(config, num_streams).total;
}

absl::StatusOr<std::unique_ptr<CudaExecutor>> CudaExecutor::Create(const ExecutorConfig& config,
                                                                   const CudaExecutorOptions& options) {
  MOONEP_RETURN_IF_ERROR(CheckExecutorConfig(config));
  MOONEP_CHECK_ARG(options.num_streams >= 0 && options.num_streams <= 16,
                   "options.num_streams %d is outside [0, 16] (0: MOONEP_CUDA_GEMM_STREAMS)",
                   options.num_streams);
  // Before any CUDA call: a bad variable is the same InvalidArgument with or without a GPU.
  MOONEP_RETURN_IF_ERROR(CheckCudaGemmEnvironment());
  int count = 0;
  MOONEP_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  int device = options.device;
  if (device < 0) MOONEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MOONEP_CHECK_ARG(device < count, "options.device %d: only %d CUDA devices", device, count);
  std::unique_ptr<CudaExecutor> ex(new CudaExecutor(config));
  ex->device_ = device;
  ex->synchronous_ = options.synchronous;
  DeviceGuard guard(device);
  const int streams = ResolveStreams(options);
  // A blocking stream: ordered after work the caller queued on the legacy default stream.
  MOONEP_CUDA_RETURN_IF_ERROR(cudaStreamCreate(&ex->stream_));
  const DeviceParts parts = Parts(config, streams);
  ex->device_bytes_ = parts.total;
  const absl::Status alloc = CudaStatus(cudaMalloc(reinterpret_cast<void**>(&ex->workspace_), parts.total),
                                        "cudaMalloc(workspace)");
  if (!alloc.ok()) {
    return OutOfMemory("CudaExecutor: cannot allocate a %d-byte device workspace: %s", parts.total,
                       alloc.message());
  }
  char* p = ex->workspace_;
  ex->ab_ = reinterpret_cast<float*>(p);
  p += parts.ab;
  ex->dh_ = reinterpret_cast<float*>(p);
  p += parts.dh;
  ex->h_ = p;
  p += parts.h;
  ex->dab_ = p;
  p += parts.dab;
  // Chunked GEMMs stage 24 bytes per chunk of 128 rows, in up to kMaxBatches batches.
  const size_t chunk_bytes = kMaxBatches * 24 * static_cast<size_t>(config.max_rows / 128 + 1);
  MOONEP_ASSIGN_OR_RETURN(ex->staging_, Staging::Create(kStagingGroups * kStagingBytesPerGroup +
                                                        chunk_bytes + 4096));
  MOONEP_ASSIGN_OR_RETURN(ex->gemm_, GroupedGemm::Create(ex->stream_, streams, p));
  ex->batches_.resize(kMaxBatches);
  for (GemmBatch& b : ex->batches_) b.problems.reserve(3 * 256);
  for (auto* v : {&ex->data_segs_, &ex->gap_segs_}) v->reserve(kStagingGroups + 1);
  for (auto* v : {&ex->data_prefix_, &ex->gap_prefix_}) v->reserve(kStagingGroups + 2);
  ex->by_offset_.reserve(kStagingGroups);
  ex->last_strategies_.reserve(kMaxBatches);
  return ex;
}

CudaExecutor::~CudaExecutor() {
  DeviceGuard guard(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  gemm_.reset();
  staging_.reset();
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

size_t CudaExecutor::WorkspaceBytes() const {
  return device_bytes_ + 2 * 2 * staging_->capacity();
}

absl::Status CudaExecutor::Synchronize() {
  DeviceGuard guard(device_);
  return CudaStatus(cudaStreamSynchronize(stream_), "CudaExecutor: the queued work failed");
}

absl::Status CudaExecutor::CheckPointers(
    const ComputeView& view, bool grads,
    std::initializer_list<std::pair<const TensorView*, const char*>> rows) const {
  auto check = [&](const void* ptr, const char* name, int group) -> absl::Status {
    cudaPointerAttributes attr{};
    const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
    if (err != cudaSuccess) cudaGetLastError();  // not a sticky error; clear it
    const bool on_device =
        err == cudaSuccess && (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged);
    if (on_device && attr.device == device_) return absl::OkStatus();
    if (group < 0) {
      return InvalidArgument("%s is not memory of CUDA device %d (the executor's)", name, device_);
    }
    return InvalidArgument("group %d: %s is not memory of CUDA device %d (the executor's)", group,
                           name, device_);
  };
  for (const auto& [t, name] : rows) {
    if (t->data != nullptr && t->numel() > 0) MOONEP_RETURN_IF_ERROR(check(t->data, name, -1));
  }
  for (size_t g = 0; g < view.groups.size(); ++g) {
    const GroupView& gv = view.groups[g];
    if (gv.row_count == 0) continue;
    const int gi = static_cast<int>(g);
    MOONEP_RETURN_IF_ERROR(check(gv.weights.gate.data, "weights.gate", gi));
    MOONEP_RETURN_IF_ERROR(check(gv.weights.up.data, "weights.up", gi));
    MOONEP_RETURN_IF_ERROR(check(gv.weights.down.data, "weights.down", gi));
    if (grads) {
      MOONEP_RETURN_IF_ERROR(check(gv.grads.gate.data, "grads.gate", gi));
      MOONEP_RETURN_IF_ERROR(check(gv.grads.up.data, "grads.up", gi));
      MOONEP_RETURN_IF_ERROR(check(gv.grads.down.data, "grads.down", gi));
    }
  }
  return absl::OkStatus();
}

void CudaExecutor::StageSegments(const ComputeView& view) {
  by_offset_.clear();
  for (int32_t g = 0; g < static_cast<int32_t>(view.groups.size()); ++g) {
    if (view.groups[g].row_count > 0) by_offset_.push_back(g);
  }
  std::sort(by_offset_.begin(), by_offset_.end(), [&](int32_t a, int32_t b) {
    return view.groups[a].row_offset < view.groups[b].row_offset;
  });
  data_segs_.clear();
  gap_segs_.clear();
  int64_t next = 0;
  for (int32_t g : by_offset_) {
    const GroupView& gv = view.groups[g];
    if (gv.row_offset > next) gap_segs_.push_back(RowSegment{next, gv.row_offset - next});
    data_segs_.push_back(RowSegment{gv.row_offset, gv.row_count});
    next = gv.row_offset + gv.row_count;
  }
  if (view.total_rows > next) gap_segs_.push_back(RowSegment{next, view.total_rows - next});
  auto prefix = [](const std::vector<RowSegment>& segs, std::vector<int64_t>* out) {
    out->assign(1, 0);
    for (const RowSegment& s : segs) out->push_back(out->back() + s.count);
  };
  prefix(data_segs_, &data_prefix_);
  prefix(gap_segs_, &gap_prefix_);
  data_off_ = staging_->Add(data_segs_.data(), data_segs_.size() * sizeof(RowSegment));
  data_prefix_off_ = staging_->Add(data_prefix_.data(), data_prefix_.size() * sizeof(int64_t));
  gap_off_ = staging_->Add(gap_segs_.data(), gap_segs_.size() * sizeof(RowSegment));
  gap_prefix_off_ = staging_->Add(gap_prefix_.data(), gap_prefix_.size() * sizeof(int64_t));
}

SegmentTable CudaExecutor::Table(size_t offset, const std::vector<RowSegment>& segs,
                                 const std::vector<int64_t>& prefix, size_t prefix_offset) const {
  SegmentTable t;
  t.segments = static_cast<const RowSegment*>(staging_->DevicePtr(offset));
  t.prefix = static_cast<const int64_t*>(staging_->DevicePtr(prefix_offset));
  t.count = static_cast<int32_t>(segs.size());
  t.total_rows = prefix.back();
  return t;
}

void CudaExecutor::AddPreactivationGemms(const ComputeView& view, const TensorView& x_rows,
                                         float* ab, GemmBatch* batch) {
  const int64_t H = view.hidden, I = view.intermediate;
  batch->Clear(false, false, view.dtype, DType::kFloat32);
  for (const GroupView& gv : view.groups) {
    const int64_t n = gv.row_count, off = gv.row_offset;
    if (n == 0) continue;
    const ExpertParams& w = gv.weights;
    float* c = ab + off * 2 * I;
    if (Fused(w.gate, w.up, I)) {
      batch->problems.push_back({n, 2 * I, H, x_rows.row(off), H, w.gate.data, w.gate.strides[0], c,
                                 2 * I, 0.0f, n});
    } else {
      batch->problems.push_back({n, I, H, x_rows.row(off), H, w.gate.data, w.gate.strides[0], c,
                                 2 * I, 0.0f, n});
      batch->problems.push_back({n, I, H, x_rows.row(off), H, w.up.data, w.up.strides[0], c + I,
                                 2 * I, 0.0f, n});
    }
  }
}

absl::Status CudaExecutor::PlanAndUpload(int batches) {
  last_strategies_.clear();
  for (int i = 0; i < batches; ++i) {
    batches_[i].ran = GemmStrategy::kAuto;
    MOONEP_RETURN_IF_ERROR(gemm_->Plan(&batches_[i], staging_.get()));
  }
  return staging_->Upload(stream_);
}

absl::Status CudaExecutor::RunBatch(int i) {
  if (i < 0 || batches_[i].problems.empty()) return absl::OkStatus();
  MOONEP_RETURN_IF_ERROR(gemm_->Run(&batches_[i], *staging_));
  last_strategies_.push_back(batches_[i].ran);
  return absl::OkStatus();
}

absl::Status CudaExecutor::Finish() {
  MOONEP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (!synchronous_) return absl::OkStatus();
  return CudaStatus(cudaStreamSynchronize(stream_), "CudaExecutor: the call's device work failed");
}

absl::Status CudaExecutor::Forward(const ComputeView& view, const TensorView& x_rows,
                                   const TensorView& y_rows, const ForwardOptions& options) {
  MOONEP_RETURN_IF_ERROR(CheckForwardArgs(config_, Device::kCuda, view, x_rows, y_rows, options));
  DeviceGuard guard(device_);
  MOONEP_RETURN_IF_ERROR(CheckPointers(view, false,
                                       {{&x_rows, "x_rows"},
                                        {&y_rows, "y_rows"},
                                        {&options.preactivations, "options.preactivations"}}));
  const int64_t H = view.hidden, I = view.intermediate;
  const DType dt = view.dtype;
  MOONEP_RETURN_IF_ERROR(staging_->Begin());
  StageSegments(view);
  float* ab = options.preactivations.data != nullptr ? static_cast<float*>(options.preactivations.data)
                                                     : ab_;
  AddPreactivationGemms(view, x_rows, ab, &batches_[0]);
  GemmBatch& down = batches_[1];
  down.Clear(false, false, dt, dt);
  for (const GroupView& gv : view.groups) {
    const int64_t n = gv.row_count, off = gv.row_offset;
    if (n == 0) continue;
    down.problems.push_back({n, H, I, At(h_, off * I, dt), I, gv.weights.down.data,
                             gv.weights.down.strides[0], y_rows.row(off), H, 0.0f, n});
  }
  MOONEP_RETURN_IF_ERROR(PlanAndUpload(2));
  const SegmentTable data = Table(data_off_, data_segs_, data_prefix_, data_prefix_off_);
  const SegmentTable gaps = Table(gap_off_, gap_segs_, gap_prefix_, gap_prefix_off_);
  MOONEP_RETURN_IF_ERROR(RunBatch(0));
  MOONEP_CUDA_RETURN_IF_ERROR(LaunchSwiGluForward(data, ab, 2 * I, I, I, h_, dt, I, stream_));
  MOONEP_RETURN_IF_ERROR(RunBatch(1));
  MOONEP_CUDA_RETURN_IF_ERROR(
      LaunchZeroRows(gaps, y_rows.data, static_cast<size_t>(H) * DTypeSize(dt), stream_));
  return Finish();
}

absl::Status CudaExecutor::Backward(const ComputeView& view, const TensorView& x_rows,
                                    const TensorView& dy_rows, const TensorView& dx_rows,
                                    const BackwardOptions& options) {
  MOONEP_RETURN_IF_ERROR(
      CheckBackwardArgs(config_, Device::kCuda, view, x_rows, dy_rows, dx_rows, options));
  DeviceGuard guard(device_);
  MOONEP_RETURN_IF_ERROR(CheckPointers(view, true,
                                       {{&x_rows, "x_rows"},
                                        {&dy_rows, "dy_rows"},
                                        {&dx_rows, "dx_rows"},
                                        {&options.preactivations, "options.preactivations"}}));
  const int64_t H = view.hidden, I = view.intermediate;
  const DType dt = view.dtype;
  MOONEP_RETURN_IF_ERROR(staging_->Begin());
  StageSegments(view);
  const bool kept = options.preactivations.data != nullptr;
  const float* ab = kept ? static_cast<const float*>(options.preactivations.data) : ab_;
  int nb = 0;
  int b_ab = -1;
  if (!kept) {
    AddPreactivationGemms(view, x_rows, ab_, &batches_[nb]);
    b_ab = nb++;
  }
  GemmBatch& dh = batches_[nb];
  const int b_dh = nb++;
  GemmBatch& dx1 = batches_[nb];
  const int b_dx1 = nb++;
  GemmBatch& dx2 = batches_[nb];
  const int b_dx2 = nb++;
  GemmBatch& w32 = batches_[nb];
  const int b_w32 = nb++;
  GemmBatch& w16 = batches_[nb];
  const int b_w16 = nb++;
  dh.Clear(false, true, dt, DType::kFloat32);
  dx1.Clear(false, true, dt, dt);
  dx2.Clear(false, true, dt, dt);
  w32.Clear(true, false, dt, DType::kFloat32);
  w16.Clear(true, false, dt, DType::kBFloat16);
  for (const GroupView& gv : view.groups) {
    const int64_t n = gv.row_count, off = gv.row_offset;
    if (n == 0) continue;
    const ExpertParams& w = gv.weights;
    const ExpertParams& g = gv.grads;
    char* x = x_rows.row(off);
    char* dy = dy_rows.row(off);
    char* da = At(dab_, off * 2 * I, dt);
    char* db = At(dab_, off * 2 * I + I, dt);
    char* h = At(h_, off * I, dt);
    dh.problems.push_back({n, I, H, dy, H, w.down.data, w.down.strides[0], dh_ + off * I, I, 0.0f, n});
    if (Fused(w.gate, w.up, I)) {  // dX = [da | db] [Wg | Wu]^T in one GEMM of K = 2I
      dx1.problems.push_back({n, H, 2 * I, da, 2 * I, w.gate.data, w.gate.strides[0],
                              dx_rows.row(off), H, 0.0f, n});
    } else {
      dx1.problems.push_back({n, H, I, da, 2 * I, w.gate.data, w.gate.strides[0], dx_rows.row(off),
                              H, 0.0f, n});
      dx2.problems.push_back({n, H, I, db, 2 * I, w.up.data, w.up.strides[0], dx_rows.row(off), H,
                              1.0f, n});
    }
    auto grad_batch = [&](const TensorView& t) -> GemmBatch& {
      return t.dtype == DType::kFloat32 ? w32 : w16;
    };
    // Gradients are never fused: CheckComputeView keeps each gradient's span apart.
    grad_batch(g.gate).problems.push_back(
        {H, I, n, x, H, da, 2 * I, g.gate.data, g.gate.strides[0], 1.0f, n});
    grad_batch(g.up).problems.push_back(
        {H, I, n, x, H, db, 2 * I, g.up.data, g.up.strides[0], 1.0f, n});
    grad_batch(g.down).problems.push_back(
        {I, H, n, h, I, dy, H, g.down.data, g.down.strides[0], 1.0f, n});
  }
  MOONEP_RETURN_IF_ERROR(PlanAndUpload(nb));
  const SegmentTable data = Table(data_off_, data_segs_, data_prefix_, data_prefix_off_);
  const SegmentTable gaps = Table(gap_off_, gap_segs_, gap_prefix_, gap_prefix_off_);
  MOONEP_RETURN_IF_ERROR(RunBatch(b_ab));
  MOONEP_RETURN_IF_ERROR(RunBatch(b_dh));
  MOONEP_CUDA_RETURN_IF_ERROR(LaunchSwiGluBackward(data, ab, 2 * I, I, dh_, I, I, dt, h_, I, dab_,
                                                   2 * I, I, stream_));
  MOONEP_RETURN_IF_ERROR(RunBatch(b_dx1));
  MOONEP_RETURN_IF_ERROR(RunBatch(b_dx2));
  MOONEP_RETURN_IF_ERROR(RunBatch(b_w32));
  MOONEP_RETURN_IF_ERROR(RunBatch(b_w16));
  MOONEP_CUDA_RETURN_IF_ERROR(
      LaunchZeroRows(gaps, dx_rows.data, static_cast<size_t>(H) * DTypeSize(dt), stream_));
  return Finish();
}

absl::StatusOr<std::unique_ptr<Executor>> MakeCudaExecutor(const ExecutorConfig& config) {
  MOONEP_ASSIGN_OR_RETURN(std::unique_ptr<CudaExecutor> ex, CudaExecutor::Create(config));
  return std::unique_ptr<Executor>(std::move(ex));
}

}  // namespace moonep::compute::cuda
