// A test adapter: the Transport interface over host buffers, implemented by copying every buffer
// to the GPU, running the NCCL transport's blocking operation and copying the results back. It
// lets the host-memory suite (tests/transport/transport_test.cc) check the NCCL backend unchanged.
// Start* runs to completion (every rank issues operations in the same order, so this cannot
// deadlock). A global environment skips every test, visibly, without one GPU per rank.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "moonep/core/status.h"
#include "tests/nccl/host_staged_suite.h"
#include "transport/nccl/nccl_transport.h"

namespace moonep::transport {
namespace {

// Device copies of host buffers for one call; Finish() copies the outputs back.
class Staging {
 public:
  ~Staging() {
    for (void* p : allocations_) cudaFree(p);
  }
  // A device copy of [data, data + bytes); copied back by Finish() when `output`.
  void* Mirror(void* data, size_t bytes, bool output) {
    if (data == nullptr || bytes == 0) return data;
    void* d = nullptr;
    if (cudaMalloc(&d, bytes) != cudaSuccess) {
      ok_ = false;
      return data;
    }
    allocations_.push_back(d);
    if (cudaMemcpy(d, data, bytes, cudaMemcpyHostToDevice) != cudaSuccess) ok_ = false;
    if (output) outputs_.push_back({data, d, bytes});
    return d;
  }
  TensorView View(const TensorView& v, bool output) {
    TensorView d = v;
    if (v.device != Device::kCpu) return d;
    d.data = Mirror(v.data, v.nbytes(), output);
    d.device = Device::kCuda;
    return d;
  }
  template <typename T>
  absl::Span<T> Span(absl::Span<T> s, bool output) {
    using U = std::remove_const_t<T>;
    return absl::Span<T>(
        static_cast<T*>(Mirror(const_cast<U*>(s.data()), s.size() * sizeof(T), output)), s.size());
  }
  ExpertBlocks Blocks(const ExpertBlocks& b, bool home_out, bool slots_out) {
    home_.clear();
    slots_.clear();
    for (const TensorView& v : b.home) home_.push_back(View(v, home_out));
    for (const TensorView& v : b.slots) slots_.push_back(View(v, slots_out));
    return ExpertBlocks{b.tensors_per_expert, home_, slots_};
  }
  absl::StatusOr<RequestPtr> Finish(absl::Status status);

 private:
  struct Output {
    void* host;
    void* device;
    size_t bytes;
  };
  bool ok_ = true;
  std::vector<void*> allocations_;
  std::vector<Output> outputs_;
  std::vector<TensorView> home_, slots_;
};

class DoneRequest : public Request {
 public:
  absl::StatusOr<bool> Test() override { return true; }
  absl::Status Wait() override { return absl::OkStatus(); }
};

absl::StatusOr<RequestPtr> Staging::Finish(absl::Status status) {
  if (!ok_) return SystemError("host staging: a device allocation or copy failed");
  if (!status.ok()) return status;
  for (const Output& o : outputs_) {
    if (cudaMemcpy(o.host, o.device, o.bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
      return SystemError("host staging: copying results back failed");
    }
  }
  return RequestPtr(new DoneRequest());
}

class HostStagedTransport : public Transport {
 public:
  explicit HostStagedTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}
  const char* backend() const override { return inner_->backend(); }
  int32_t rank() const override { return inner_->rank(); }
  int32_t size() const override { return inner_->size(); }
  int64_t timeout_ms() const override { return inner_->timeout_ms(); }

  absl::StatusOr<RequestPtr> StartExchangeCounts(absl::Span<const int32_t> ids, int64_t T,
                                                 int32_t K, int32_t E, int64_t cap,
                                                 DispatchHandle* h) override {
    Staging s;
    return s.Finish(inner_->ExchangeCounts(s.Span(ids, false), T, K, E, cap, h));
  }
  absl::StatusOr<RequestPtr> StartDispatch(const planner::Plan& plan, const TensorView& x,
                                           absl::Span<const float> w, DispatchHandle* h,
                                           const TensorView& rows,
                                           absl::Span<float> row_w) override {
    Staging s;
    return s.Finish(inner_->Dispatch(plan, s.View(x, false), s.Span(w, false), h,
                                     s.View(rows, true), s.Span(row_w, true)));
  }
  absl::StatusOr<RequestPtr> StartCombine(DispatchHandle* h, const TensorView& rows,
                                          const TensorView& y) override {
    Staging s;
    return s.Finish(inner_->Combine(h, s.View(rows, false), s.View(y, true)));
  }
  absl::StatusOr<RequestPtr> StartCombineBackward(DispatchHandle* h, const TensorView& dy,
                                                  const TensorView& dy_rows) override {
    Staging s;
    return s.Finish(inner_->CombineBackward(h, s.View(dy, false), s.View(dy_rows, true)));
  }
  absl::StatusOr<RequestPtr> StartDispatchBackward(DispatchHandle* h, const TensorView& dx_rows,
                                                   const TensorView& dx) override {
    Staging s;
    return s.Finish(inner_->DispatchBackward(h, s.View(dx_rows, false), s.View(dx, true)));
  }
  absl::StatusOr<RequestPtr> StartTopkWeightGrad(DispatchHandle* h, const TensorView& dy_rows,
                                                 const TensorView& rows,
                                                 absl::Span<float> dw) override {
    Staging s;
    return s.Finish(
        inner_->TopkWeightGrad(h, s.View(dy_rows, false), s.View(rows, false), s.Span(dw, true)));
  }
  absl::StatusOr<RequestPtr> StartPrefetch(const planner::Plan& plan,
                                           const ExpertBlocks& params) override {
    Staging s;
    return s.Finish(inner_->Prefetch(plan, s.Blocks(params, false, true)));
  }
  absl::StatusOr<RequestPtr> StartReduce(const planner::Plan& plan,
                                         const ExpertBlocks& grads) override {
    Staging s;
    return s.Finish(inner_->Reduce(plan, s.Blocks(grads, true, false)));
  }
  OpCounters counters(OpKind kind) const override { return inner_->counters(kind); }
  void ResetCounters() override { inner_->ResetCounters(); }

 private:
  std::unique_ptr<Transport> inner_;
};

// Skips every test (visibly) unless this node has one GPU per rank, and gives each rank its GPU.
class OneGpuPerRank : public ::testing::Environment {
 public:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) {
      cudaGetLastError();
      devices = 0;
    }
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local_rank = 0, local_size = 1;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    if (devices < local_size) {
      GTEST_SKIP() << "the NCCL transport suite needs one GPU per rank: " << local_size
                   << " rank(s) on this node, " << devices << " GPU(s) visible";
    }
    cudaSetDevice(local_rank);
  }
};
const ::testing::Environment* const kEnvironment =
    ::testing::AddGlobalTestEnvironment(new OneGpuPerRank);

}  // namespace

std::vector<std::string> NcclSuiteBackends() { return {"nccl"}; }

absl::StatusOr<std::unique_ptr<Transport>> NcclSuiteCreateTransport(
    absl::string_view backend, const TransportOptions& options) {
  auto inner = ::moonep::transport::nccl::CreateNcclTransport(options);
  if (!inner.ok()) return inner.status();
  if (backend != "nccl") return InvalidArgument("unknown backend '%s'", backend);
  return std::unique_ptr<Transport>(new HostStagedTransport(std::move(*inner)));
}

}  // namespace moonep::transport
