#include "transport/nccl/nccl_transport.h"

#include <dlfcn.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "moonep/compute/cuda/cuda_check.h"
#include "moonep/compute/cuda/kernels.h"
#include "moonep/core/env.h"
#include "moonep/core/logging.h"
#include "moonep/core/status.h"
#include "planner/plan_builder.h"
#include "transport/common/buffer_pool.h"
#include "transport/common/count_exchange.h"
#include "transport/common/host_checks.h"
#include "transport/layout.h"
#include "transport/nccl/nccl_kernels.h"
#include "transport/nccl/nccl_tables.h"
#include "transport/testing_hooks.h"

namespace moonep::transport::nccl {
namespace {

using Clock = std::chrono::steady_clock;
namespace kernels = ::moonep::compute::cuda;

absl::Status NcclStatus(ncclResult_t r, const char* what) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  return MakeStatus(moonepCudaError, absl::StrFormat("%s: %s (%d)", what, ncclGetErrorString(r),
                                                     static_cast<int>(r)));
}
#define MOONEP_NCCL_RETURN_IF_ERROR(call) MOONEP_RETURN_IF_ERROR(NcclStatus((call), #call))

// Waits until a non-blocking communicator has no operation in progress, or the deadline.
absl::Status WaitComm(ncclComm_t comm, Clock::time_point deadline, const char* what) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    MOONEP_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclStatus(state, what);
    if (Clock::now() >= deadline) return Timeout("%s did not complete before the deadline", what);
    std::this_thread::yield();
  }
}

// Runs `call` on its own thread and waits for it at most `bound`. True when it returned in time
// (its result in *result); otherwise the thread is left to it (detached) and false: a failure
// stays an error and never becomes a hang here.
bool CallBounded(std::function<ncclResult_t()> call, std::chrono::milliseconds bound,
                 ncclResult_t* result) {
  struct Done {
    std::atomic<bool> done{false};
    ncclResult_t result = ncclSuccess;
  };
  auto d = std::make_shared<Done>();
  std::thread caller([call = std::move(call), d] {
    d->result = call();
    d->done.store(true);
  });
  const Clock::time_point until = Clock::now() + bound;
  while (!d->done.load() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!d->done.load()) {
    caller.detach();
    return false;
  }
  caller.join();
  *result = d->result;
  return true;
}

// ncclCommAbort, but never longer than `bound` (CallBounded): on two GPUs, after a peer skipped a
// collective and this rank timed out, the test run stopped making progress right after the abort
// began (issue #12's run). If it has not returned by the bound, the communicator is left to it (a
// warning says so) and the caller goes on.
void AbortBounded(ncclComm_t comm, std::chrono::milliseconds bound) {
  if (comm == nullptr) return;
  ncclResult_t r;
  if (!CallBounded([comm] { return ncclCommAbort(comm); }, bound, &r)) {
    MOONEP_WARN("transport nccl: ncclCommAbort did not return within %d ms; the communicator is "
                "left behind", static_cast<int64_t>(bound.count()));
  }
}

// ncclCommRevoke (in NCCL 2.28.9, not in 2.28.3), looked up at run time in the libnccl that
// ncclCommAbort comes from (never in another copy of NCCL), so that a libnccl without it still
// loads. Null where it has none.
using RevokeFn = ncclResult_t (*)(ncclComm_t, int);
RevokeFn FindRevoke() {
  static const RevokeFn fn = []() -> RevokeFn {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&ncclCommAbort), &info) != 0 && info.dli_fname != nullptr) {
      if (void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) {
        void* sym = dlsym(lib, "ncclCommRevoke");
        dlclose(lib);  // RTLD_NOLOAD took a reference to a library that stays loaded
        return reinterpret_cast<RevokeFn>(sym);
      }
    }
    // Not found through ncclCommAbort's library: only a symbol of that same library will do.
    void* sym = dlsym(RTLD_DEFAULT, "ncclCommRevoke");
    Dl_info abort_info{}, sym_info{};
    if (sym == nullptr || dladdr(reinterpret_cast<void*>(&ncclCommAbort), &abort_info) == 0 ||
        dladdr(sym, &sym_info) == 0 || abort_info.dli_fbase != sym_info.dli_fbase) {
      return nullptr;
    }
    return reinterpret_cast<RevokeFn>(sym);
  }();
  return fn;
}

// Stops the operations in flight on the caller's communicator (kWrap) so that no kernel stays
// blocked, and leaves the communicator to the caller: ncclCommRevoke, then its state polled until
// it is quiescent (a non-blocking communicator answers ncclInProgress at once), at most `bound`
// (as AbortBounded). ncclCommAbort would free it under the caller, whose own ncclCommDestroy
// would then touch freed memory; it is the fallback only where this libnccl has no
// ncclCommRevoke. Returns the sentence for the error message that tells the caller what became of
// its communicator.
std::string StopCallersComm(ncclComm_t comm, std::chrono::milliseconds bound) {
  const RevokeFn revoke = FindRevoke();
  if (revoke == nullptr) {
    AbortBounded(comm, bound);
    return "the caller's NCCL communicator was aborted (ncclCommAbort, as this libnccl has no "
           "ncclCommRevoke): it is freed, do not use or destroy it";
  }
  const Clock::time_point deadline = Clock::now() + bound;
  const std::string not_quiescent = absl::StrFormat(
      "the caller's NCCL communicator is being revoked (ncclCommRevoke), not quiescent after %d "
      "ms: do not destroy it before ncclCommGetAsyncError leaves ncclInProgress",
      static_cast<int64_t>(bound.count()));
  // The revoke on its own thread (a blocking communicator returns once quiescent; a thread left
  // inside it touches the communicator no more afterwards), the wait for quiescence here.
  ncclResult_t r;
  if (!CallBounded([comm, revoke] { return revoke(comm, /*NCCL_REVOKE_DEFAULT*/ 0); }, bound,
                   &r)) {
    MOONEP_WARN("transport nccl: ncclCommRevoke of the caller's communicator did not return "
                "within %d ms", static_cast<int64_t>(bound.count()));
    return not_quiescent;
  }
  if (r != ncclSuccess && r != ncclInProgress) {
    // Already revoked, or being finalized or destroyed: aborting it now could free it twice.
    return absl::StrFormat("ncclCommRevoke refused the caller's NCCL communicator (%s): it was "
                           "left as it is", ncclGetErrorString(r));
  }
  // A non-blocking communicator answers ncclInProgress at once: quiescent once its state is not
  // (an error state: nothing runs on it either).
  const absl::Status quiet = WaitComm(comm, deadline, "ncclCommRevoke");
  if (ToResult(quiet) == moonepTimeout) return not_quiescent;
  return "the caller's NCCL communicator was revoked (ncclCommRevoke: its operations in flight "
         "stopped; it takes no new ones): it stays the caller's to destroy (ncclCommDestroy) or "
         "shrink";
}

// Keeps the first error of the calls inside an NCCL group (the group must still be ended).
void Keep(absl::Status* first, ncclResult_t r, const char* what) {
  if (first->ok()) *first = NcclStatus(r, what);
}

// Makes the transport's GPU current for the host steps of an op, and restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
      cudaSetDevice(previous_);
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Where a GrowingBuffer's memory comes from: the device, or pinned host memory (for copies that
// overlap and for small D2H reads).
struct DeviceMemory {
  static constexpr const char* kName = "device";
  static cudaError_t Allocate(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
  static void Free(void* p) { cudaFree(p); }
};
struct PinnedMemory {
  static constexpr const char* kName = "pinned";
  static cudaError_t Allocate(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }
  static void Free(void* p) { cudaFreeHost(p); }
};

// An allocation that grows on demand (never in a steady state: sizes repeat step to step).
// Growing keeps the old allocation (retired) instead of freeing it: device work of an earlier
// operation may still use it, and cudaFree / cudaFreeHost wait for the whole device, forever when
// a kernel waits on a dead peer. The transport frees retired allocations (FreeRetired) only when
// no operation on its communicators is in flight.
template <typename Memory>
class GrowingBuffer {
 public:
  GrowingBuffer() = default;
  GrowingBuffer(const GrowingBuffer&) = delete;
  GrowingBuffer& operator=(const GrowingBuffer&) = delete;
  ~GrowingBuffer() {
    if (data_) Memory::Free(data_);
    FreeRetired();
  }
  absl::Status Reserve(size_t bytes, const char* what) {
    if (bytes <= bytes_) return absl::OkStatus();
    if (data_) retired_.push_back(data_);
    retired_bytes_ += bytes_;
    data_ = nullptr;
    bytes_ = 0;
    bytes = (bytes + 255) / 256 * 256;
    if (Memory::Allocate(&data_, bytes) != cudaSuccess) {
      cudaGetLastError();
      return OutOfMemory("NCCL transport: cannot allocate %d %s bytes for %s", bytes,
                         Memory::kName, what);
    }
    bytes_ = bytes;
    return absl::OkStatus();
  }
  template <typename T = char>
  T* get() const {
    return static_cast<T*>(data_);
  }
  void FreeRetired() {
    for (void* p : retired_) Memory::Free(p);
    retired_.clear();
    retired_bytes_ = 0;
  }
  // Bytes held: the current allocation and the retired ones not yet freed.
  size_t allocated() const { return bytes_ + retired_bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0, retired_bytes_ = 0;
  std::vector<void*> retired_;
};
using DeviceBuffer = GrowingBuffer<DeviceMemory>;
using PinnedBuffer = GrowingBuffer<PinnedMemory>;

// Host tables packed into one block (256-byte aligned parts) so one copy uploads them all.
class TableBlock {
 public:
  template <typename T>
  size_t Add(size_t count) {
    const size_t at = size_;
    size_ += (count * sizeof(T) + 255) / 256 * 256;
    return at;
  }
  size_t size() const { return size_; }
  void Clear() { size_ = 0; }

 private:
  size_t size_ = 0;
};

// Device state of one DispatchHandle: its tables, metadata and staging.
struct HandleState {
  // Count exchange.
  PinnedBuffer header_host, header_all_host, counts_all_host, ids_host;
  DeviceBuffer header_dev, header_all_dev, counts_dev, counts_all_dev;
  // The one-round form's message, [header, invalid, counts[W]] (every rank's land in counts_all_*).
  DeviceBuffer wire_dev;
  // Tables of the last dispatch (one upload per dispatch).
  PinnedBuffer tables_host;
  DeviceBuffer tables_dev;
  size_t off_pack_index = 0, off_meta_unique = 0, off_meta_entries = 0, off_row_source = 0,
         off_combine_index = 0, off_pos_row = 0, off_unique_send = 0;
  std::vector<int64_t> pack_begin, staging_begin, unique_from;
  PinnedBuffer unique_recv_host, staging_begin_host, bad_host;
  DeviceBuffer unique_recv_dev, staging_begin_dev, bad_dev;
  DeviceBuffer weights_dev, ones_dev, meta_send_dev, meta_recv_dev;
  DeviceBuffer send_staging, recv_staging;
  int64_t ones_count = 0;

  // Arrays, not initializer lists: a returned list's storage dies with the call.
  std::array<PinnedBuffer*, 8> pinned() {
    return {&header_host, &header_all_host, &counts_all_host, &ids_host,
            &tables_host, &unique_recv_host, &staging_begin_host, &bad_host};
  }
  std::array<DeviceBuffer*, 15> device() {
    return {&header_dev, &header_all_dev, &counts_dev, &counts_all_dev,
            &wire_dev, &tables_dev, &unique_recv_dev, &staging_begin_dev, &bad_dev,
            &weights_dev, &ones_dev, &meta_send_dev, &meta_recv_dev, &send_staging,
            &recv_staging};
  }
  // Frees the allocations every buffer above outgrew (no operation may be in flight).
  void FreeRetired() {
    for (PinnedBuffer* b : pinned()) b->FreeRetired();
    for (DeviceBuffer* b : device()) b->FreeRetired();
  }
  // Bytes every buffer above holds (device and pinned host memory).
  size_t Bytes() {
    size_t bytes = 0;
    for (PinnedBuffer* b : pinned()) bytes += b->allocated();
    for (DeviceBuffer* b : device()) bytes += b->allocated();
    return bytes;
  }

  template <typename T>
  T* table(size_t offset) const {
    return reinterpret_cast<T*>(tables_dev.get() + offset);
  }
  template <typename T>
  T* host_table(size_t offset) const {
    return reinterpret_cast<T*>(tables_host.get() + offset);
  }
};

constexpr size_t kKinds = static_cast<size_t>(OpKind::kNumKinds);
// The handle's pinned host slot (8 bytes) for the error count of its operation of `kind`.
int32_t* BadSlot(HandleState* st, OpKind kind) {
  return st->bad_host.get<int32_t>() + 2 * static_cast<size_t>(kind);
}

// One reduce's staging of incoming replica gradients and its per-home-tensor source pointer
// table (device copy and the pinned host copy it is uploaded from). Each reduce in flight holds its
// own (NcclTransportImpl::reduce_staging_), so a second reduce neither overwrites the first one's
// table nor grows the staging its receives are posted into.
struct ReduceStaging {
  DeviceBuffer staging, sources_dev;
  PinnedBuffer sources_host;
  void FreeRetired() {
    staging.FreeRetired();
    sources_dev.FreeRetired();
    sources_host.FreeRetired();
  }
};

class NcclTransportImpl;

class NcclOp;

}  // namespace

// The communicator pair (see the header): rows for counts, dispatch, combine and the backward
// forms, weights for prefetch and reduce; plus the order of operations posted on them, which
// every transport made on the pair shares (NCCL needs the same order on every rank).
class NcclComms {
 public:
  static absl::StatusOr<std::shared_ptr<NcclComms>> Create(const TransportOptions& options,
                                                           const NcclBootstrap& bootstrap);
  ~NcclComms();
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;

  // Aborts both communicators (bounded; the caller's, kWrap, is revoked instead: StopCallersComm)
  // and marks the pair unusable for every transport on it. Returns `status`, with what became of
  // the caller's communicator after it where this call stopped it: the status to report.
  absl::Status Abort(const absl::Status& status);

  int32_t rank = 0, size = 1;
  int device = 0;
  int64_t timeout_ms = 0;
  bool owns_rows = true;  // false: the caller's communicator (kWrap), never destroyed here
  // What an abort did to the caller's communicator (StopCallersComm's sentence; empty: nothing).
  std::string callers_comm_fate;
  ncclComm_t rows = nullptr, weights = nullptr;
  absl::Status poisoned;
  std::array<std::deque<NcclOp*>, 2> queue;  // per channel (0 rows, 1 weights), in start order
  // Operations of every transport on the pair not yet complete (their device work may run).
  int64_t ops_in_flight = 0;
  // The count exchange's form (StartExchangeCounts), kept per pair because the pair's order of
  // operations is what every rank shares (every transport on it, in the same order on every rank).
  // wire_experts: the E every rank used in the pair's last count exchange (0: none yet, or the
  // ranks disagreed), read and written only in the exchanges' host steps, which every rank runs in
  // the same order over the same headers; the next exchange sends its counts with its header,
  // sized by it. reserve_experts: the largest E of any exchange started on the pair, which bounds
  // it (buffers are reserved at the start).
  int32_t wire_experts = 0, reserve_experts = 0;

 private:
  NcclComms() = default;
  // `rows_busy`: set while the id's broadcast may still be queued on `rows` (a failure then).
  absl::Status MakeWeightsComm(ncclConfig_t config, Clock::time_point deadline, bool* rows_busy);
};

namespace {

// One operation: device work in stages. A stage enqueues work and records the op's event; when
// the event completes, Test() runs the next stage's host step (reading sizes copied to the host)
// or, after the last stage, Finish(). While waiting it polls NCCL's asynchronous errors and the
// deadline; a failure aborts the communicators so no device work stays blocked.
class NcclOp : public NcclRequest {
 public:
  using Step = std::function<absl::Status()>;
  // `caller`: the caller's stream; the work queued on it now is what the op's first stage waits
  // for (WaitCaller), however late that stage is posted.
  NcclOp(NcclTransportImpl* t, OpKind kind, cudaStream_t stream, std::vector<int> peers,
         cudaStream_t caller);
  ~NcclOp() override;
  absl::StatusOr<bool> Test() override;
  absl::Status Wait() override;
  cudaEvent_t done_event() const override { return event_; }

  // Queues the op on its channel; its steps are posted by the channel's progress (Progress).
  absl::Status Start(std::vector<Step> steps, Step finish);
  OpCounters& counters() { return counters_; }
  // The op's stream waits (on the device) for the work the caller had queued when it started the
  // op: a step posted after the caller queued more (say, a wait on this op's done_event) does not
  // wait for that too.
  absl::Status WaitCaller() const {
    return kernels::CudaStatus(cudaStreamWaitEvent(stream_, caller_ready_, 0),
                               "cudaStreamWaitEvent (the caller's stream)");
  }
  // Ends the op after the current step with `verdict`, without aborting: for errors every rank
  // reaches in the same step from the same exchanged data (the transport stays usable).
  void Stop(absl::Status verdict) {
    stop_ = true;
    verdict_ = std::move(verdict);
  }
  // Called once when the op lands (Landed), however it ends: completed, stopped, failed or
  // destroyed.
  void OnEnd(std::function<void()> f) { on_end_ = std::move(f); }

  // For the channel's progress: true when nothing remains to post (or the op ended).
  bool AllPosted() const { return done_ || stop_ || next_ >= steps_.size(); }
  // Posts the next step if the previous one's device work is complete. False: still waiting.
  bool TryPostNext();
  int channel() const { return channel_; }

 private:
  friend class NcclTransportImpl;  // its queues keep queued_
  absl::Status Fail(absl::Status status);
  // Names the phase, this rank and the peers in a step's error.
  absl::Status Context(const absl::Status& status) const;
  absl::Status Record();
  // The op no longer counts as in flight (its device work is complete, or the pair was aborted);
  // runs the OnEnd callback.
  void Landed();

  NcclTransportImpl* transport_;
  OpKind kind_;
  cudaStream_t stream_;
  int channel_;
  std::vector<int> peers_;
  cudaEvent_t event_ = nullptr;
  cudaEvent_t caller_ready_ = nullptr;  // recorded on the caller's stream at the op's start
  cudaError_t caller_error_ = cudaSuccess;  // of its creation or record
  std::vector<Step> steps_;
  Step finish_;
  size_t next_ = 0;
  bool stop_ = false;
  absl::Status verdict_;
  bool done_ = false;
  std::function<void()> on_end_;
  absl::Status status_;
  Clock::time_point deadline_;
  Clock::time_point created_ = Clock::now();  // for MOONEP_DEBUG=TRACE's stage times
  OpCounters counters_;
  bool in_flight_ = true;
  bool queued_ = false;  // in its channel's queue (NcclTransportImpl::Enqueue, Dequeue, Progress)
};

class DoneRequest : public NcclRequest {
 public:
  absl::StatusOr<bool> Test() override { return true; }
  absl::Status Wait() override { return absl::OkStatus(); }
  cudaEvent_t done_event() const override { return nullptr; }
};

class NcclTransportImpl : public NcclTransport {
 public:
  ~NcclTransportImpl() override;
  static absl::StatusOr<std::unique_ptr<Transport>> Create(const TransportOptions& options,
                                                           std::shared_ptr<NcclComms> comms);

  const char* backend() const override { return "nccl"; }
  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  int64_t timeout_ms() const override { return timeout_ms_; }
  int device() const override { return device_; }
  void set_caller_stream(cudaStream_t stream) override { caller_stream_ = stream; }
  cudaStream_t rows_stream() const override { return rows_stream_; }
  cudaStream_t weights_stream() const override { return weights_stream_; }
  ncclComm_t comm() const override { return comms_->rows; }
  size_t HandleStagingBytes(const DispatchHandle& handle) const override {
    auto it = states_.find(&handle);
    return it == states_.end() ? 0 : it->second->Bytes();
  }

  absl::StatusOr<RequestPtr> StartExchangeCounts(absl::Span<const int32_t> topk_ids,
                                                 int64_t num_tokens, int32_t top_k,
                                                 int32_t num_experts, int64_t recv_capacity_rows,
                                                 DispatchHandle* handle) override;
  absl::StatusOr<RequestPtr> StartDispatch(const planner::Plan& plan, const TensorView& x,
                                           absl::Span<const float> topk_weights,
                                           DispatchHandle* handle, const TensorView& recv_rows,
                                           absl::Span<float> recv_weights) override;
  absl::StatusOr<RequestPtr> StartCombine(DispatchHandle* handle, const TensorView& expert_rows,
                                          const TensorView& y) override;
  absl::StatusOr<RequestPtr> StartCombineBackward(DispatchHandle* handle, const TensorView& dy,
                                                  const TensorView& dy_rows) override;
  absl::StatusOr<RequestPtr> StartDispatchBackward(DispatchHandle* handle,
                                                   const TensorView& dx_rows,
                                                   const TensorView& dx) override;
  absl::StatusOr<RequestPtr> StartTopkWeightGrad(DispatchHandle* handle, const TensorView& dy_rows,
                                                 const TensorView& expert_rows,
                                                 absl::Span<float> d_topk_weights) override;
  absl::StatusOr<RequestPtr> StartPrefetch(const planner::Plan& plan,
                                           const ExpertBlocks& params) override;
  absl::StatusOr<RequestPtr> StartReduce(const planner::Plan& plan,
                                         const ExpertBlocks& grads) override;

  OpCounters counters(OpKind kind) const override { return counters_[static_cast<int>(kind)]; }
  void ResetCounters() override { counters_.fill(OpCounters{}); }
  absl::Status health() const override {
    return poisoned_.ok() ? comms_->poisoned : poisoned_;
  }

  // Shared with ops.
  absl::Status Usable() const;
  // Aborts the communicators (a stuck peer, an NCCL error, a local failure after work was
  // posted) and makes the transport unusable. Returns the status to report (NcclComms::Abort).
  absl::Status Abort(const absl::Status& status);
  absl::Status PollAsyncErrors() const;
  void AddCounters(OpKind kind, const OpCounters& c);
  // NCCL needs the same order of operations on a communicator on every rank. Ops with several
  // steps post later steps only after a host read, so each channel (rows, weights) keeps its ops
  // in start order and posts an op's steps only once every op started before it posted all of
  // its own: the order on the communicator is the start order on every rank.
  // The queues live in comms_: transports sharing the communicators share the order too.
  void Enqueue(NcclOp* op) {
    comms_->queue[op->channel()].push_back(op);
    op->queued_ = true;
  }
  void Dequeue(NcclOp* op) {
    if (!op->queued_) return;
    auto& q = comms_->queue[op->channel()];
    q.erase(std::remove(q.begin(), q.end(), op), q.end());
    op->queued_ = false;
  }
  void OpStarted() { ++comms_->ops_in_flight; }
  void OpLanded() { --comms_->ops_in_flight; }
  // The deadline of the op whose step is being posted (NcclOp::TryPostNext); max() otherwise.
  void set_step_deadline(Clock::time_point deadline) { step_deadline_ = deadline; }
  // Frees the allocations buffers outgrew, when no operation on the communicator pair is in flight
  // (cudaFree waits for the device: under a kernel blocked on a dead peer it would never return).
  void FreeRetired();
  void Progress(int channel) {
    auto& q = comms_->queue[channel];
    while (!q.empty()) {
      NcclOp* head = q.front();
      if (head->AllPosted()) {
        q.pop_front();
        head->queued_ = false;
        continue;
      }
      if (!head->TryPostNext()) break;
    }
  }

 private:
  NcclTransportImpl() = default;
  absl::Status Fatal(absl::Status status);
  HandleState* StateOf(const DispatchHandle* h);
  absl::Status CheckDevicePointer(const void* p, const char* name) const;
  // row_operand: rows that travel (bounded by max_row_bytes); outputs summed locally are not.
  absl::Status CheckRows(const TensorView& v, const char* name, int64_t min_rows, int64_t cols,
                         bool row_operand = true) const;
  absl::Status CheckDispatched(OpKind kind, DispatchHandle* h);
  absl::Status CheckBlocks(const planner::Plan& plan, const ExpertBlocks& b,
                           const char* name) const;
  // A non-blocking communicator may answer ncclInProgress while it enqueues; the next call on it
  // has to wait until it settles: within the timeout, and within the deadline of the op whose
  // step is being posted (so that an op's steps do not each get a whole timeout).
  absl::Status Settle(ncclResult_t r, ncclComm_t comm, const char* what) const {
    if (r == ncclInProgress) {
      return WaitComm(comm,
                      std::min(Clock::now() + std::chrono::milliseconds(timeout_ms_),
                               step_deadline_),
                      what);
    }
    return NcclStatus(r, what);
  }
  absl::Status GroupEnd(ncclComm_t comm, const char* what) const {
    return Settle(ncclGroupEnd(), comm, what);
  }
  std::unique_ptr<NcclOp> NewOp(OpKind kind, cudaStream_t stream, std::vector<int> peers) {
    return std::make_unique<NcclOp>(this, kind, stream, std::move(peers), caller_stream_);
  }
  absl::StatusOr<RequestPtr> Run(std::unique_ptr<NcclOp> op, std::vector<NcclOp::Step> steps,
                                 NcclOp::Step finish) {
    MOONEP_RETURN_IF_ERROR(op->Start(std::move(steps), std::move(finish)));
    return RequestPtr(std::move(op));
  }
  // Every peer this rank exchanges rows with (both directions) under the handle's layouts.
  std::vector<int> RowPeers(const DispatchHandle* h) const;
  absl::StatusOr<RequestPtr> StartRowsBack(OpKind kind, DispatchHandle* h, const TensorView& rows,
                                           const TensorView& y);
  absl::StatusOr<RequestPtr> StartRowsOut(OpKind kind, DispatchHandle* h, const TensorView& x,
                                          const TensorView& rows);

  TransportOptions options_;
  int32_t rank_ = 0, size_ = 1;
  std::shared_ptr<WorkerPool> host_pool_;  // the dispatch's layouts and tables (null: no pool)
  int device_ = 0;
  int64_t timeout_ms_ = 0;
  std::shared_ptr<NcclComms> comms_;
  cudaStream_t rows_stream_ = nullptr, weights_stream_ = nullptr;
  cudaStream_t caller_stream_ = nullptr;  // legacy default stream
  Clock::time_point step_deadline_ = Clock::time_point::max();
  absl::Status poisoned_;
  std::unordered_map<const DispatchHandle*, std::unique_ptr<HandleState>> states_;
  // Reduce: one staging per reduce in flight, reused.
  common::BufferPool<ReduceStaging> reduce_staging_;
  std::array<OpCounters, static_cast<int>(OpKind::kNumKinds)> counters_{};
};

// ---------------------------------------------------------------------------------------------
// NcclOp

NcclOp::NcclOp(NcclTransportImpl* t, OpKind kind, cudaStream_t stream, std::vector<int> peers,
               cudaStream_t caller)
    : transport_(t),
      kind_(kind),
      stream_(stream),
      channel_(stream == t->weights_stream() ? 1 : 0),
      peers_(std::move(peers)),
      deadline_(Clock::now() + std::chrono::milliseconds(t->timeout_ms())) {
  counters_.calls = 1;
  t->OpStarted();
  if (cudaEventCreateWithFlags(&event_, cudaEventDisableTiming) != cudaSuccess) {
    cudaGetLastError();
    event_ = nullptr;
  }
  caller_error_ = cudaEventCreateWithFlags(&caller_ready_, cudaEventDisableTiming);
  if (caller_error_ != cudaSuccess) {
    caller_ready_ = nullptr;
  } else {
    caller_error_ = cudaEventRecord(caller_ready_, caller);
  }
  if (caller_error_ != cudaSuccess) cudaGetLastError();
}

NcclOp::~NcclOp() {
  if (!done_ && !(stop_ && AllPosted())) {
    // Device work may still use the caller's buffers: abort it rather than leave it running.
    Fail(InvalidUsage("%s: request destroyed before it completed", OpName(kind_))).IgnoreError();
  }
  Landed();
  // An op that ended (completed, stopped or failed) has left the queue and landed: a completed
  // request may be destroyed after its transport, and nothing here touches the transport then.
  if (queued_) transport_->Dequeue(this);
  if (event_) cudaEventDestroy(event_);
  if (caller_ready_) cudaEventDestroy(caller_ready_);
}

void NcclOp::Landed() {
  if (!in_flight_) return;
  in_flight_ = false;
  transport_->OpLanded();
  if (on_end_) std::exchange(on_end_, nullptr)();
}

absl::Status NcclOp::Record() {
  return kernels::CudaStatus(cudaEventRecord(event_, stream_), "cudaEventRecord");
}

absl::Status NcclOp::Start(std::vector<Step> steps, Step finish) {
  if (event_ == nullptr) return Fail(SystemError("%s: cudaEventCreate failed", OpName(kind_)));
  if (caller_error_ != cudaSuccess) {
    return Fail(Annotate(kernels::CudaStatus(caller_error_, "cudaEventRecord"),
                         absl::StrFormat("%s: marking the work queued on the caller's stream",
                                         OpName(kind_))));
  }
  steps_ = std::move(steps);
  finish_ = std::move(finish);
  MOONEP_TRACE("transport nccl: %s starts, %d stages", OpName(kind_), steps_.size());
  if (steps_.empty()) {
    absl::Status s = Record();
    if (!s.ok()) return Fail(Context(s));
    return absl::OkStatus();
  }
  transport_->Enqueue(this);
  transport_->Progress(channel_);
  if (done_ && !status_.ok()) return status_;
  return absl::OkStatus();
}

bool NcclOp::TryPostNext() {
  if (AllPosted()) return true;
  if (next_ > 0) {
    const cudaError_t q = cudaEventQuery(event_);
    if (q == cudaErrorNotReady) return false;
    if (q != cudaSuccess) {
      cudaGetLastError();
      Fail(Context(kernels::CudaStatus(q, "device work"))).IgnoreError();
      return true;
    }
  }
  const Clock::time_point posting = Clock::now();
  transport_->set_step_deadline(deadline_);
  absl::Status s = steps_[next_++]();
  transport_->set_step_deadline(Clock::time_point::max());
  if (s.ok() && !stop_) s = Record();
  if (!s.ok()) Fail(Context(s)).IgnoreError();
  // Where an operation's time goes: when each stage's host step began (the previous stage's device
  // work seen complete) and how long the step took to enqueue, from the op's creation.
  MOONEP_TRACE("transport nccl: %s stage %d of %d posted at %.1f us, its host step %.1f us",
               OpName(kind_), next_, steps_.size(),
               std::chrono::duration<double, std::micro>(posting - created_).count(),
               std::chrono::duration<double, std::micro>(Clock::now() - posting).count());
  return true;
}

absl::Status NcclOp::Context(const absl::Status& status) const {
  return Annotate(
      status, absl::StrFormat("%s on rank %d (peers: %s)", OpName(kind_), transport_->rank(),
                              peers_.empty() ? std::string("none") : absl::StrJoin(peers_, ",")));
}

absl::StatusOr<bool> NcclOp::Test() {
  if (done_) {
    if (!status_.ok()) return status_;
    return true;
  }
  {
    absl::Status usable = transport_->Usable();
    if (!usable.ok()) return Fail(usable);
  }
  DeviceGuard guard(transport_->device());
  transport_->Progress(channel_);
  if (done_) return Test();
  if (stop_) {
    done_ = true;
    Landed();  // a stop posts no work after the step whose work was complete
    status_ = verdict_;
    return Test();
  }
  if (AllPosted()) {
    const cudaError_t q = cudaEventQuery(event_);
    if (q == cudaSuccess) {
      absl::Status s = finish_ ? finish_() : absl::OkStatus();
      done_ = true;  // finish errors are verdicts on completed work; fatal ones already aborted
      Landed();
      MOONEP_TRACE("transport nccl: %s complete at %.1f us", OpName(kind_),
                   std::chrono::duration<double, std::micro>(Clock::now() - created_).count());
      status_ = s;
      if (!s.ok()) return s;
      transport_->AddCounters(kind_, counters_);
      return true;
    }
    if (q != cudaErrorNotReady) {
      cudaGetLastError();
      return Fail(Context(kernels::CudaStatus(q, "device work")));
    }
  }
  {
    absl::Status s = transport_->PollAsyncErrors();
    if (!s.ok()) return Fail(Context(s));
  }
  if (Clock::now() >= deadline_) {
    return Fail(
        Timeout("%s timed out after %d ms on rank %d waiting for the exchange with rank(s) "
                "%s (NCCL does not tell which peer is late)",
                OpName(kind_), transport_->timeout_ms(), transport_->rank(),
                peers_.empty() ? std::string("none") : absl::StrJoin(peers_, ",")));
  }
  return false;
}

absl::Status NcclOp::Wait() {
  while (true) {
    absl::StatusOr<bool> r = Test();
    if (!r.ok()) return r.status();
    if (*r) return absl::OkStatus();
    std::this_thread::yield();
  }
}

absl::Status NcclOp::Fail(absl::Status status) {
  if (done_) return status_;
  done_ = true;
  status_ = transport_->Abort(status);
  Landed();  // the pair is aborted: no Start reaches FreeRetired again
  transport_->Dequeue(this);  // Progress re-reads the queue's head after each step
  return status_;
}

// ---------------------------------------------------------------------------------------------
// NcclTransportImpl: creation, checks.

}  // namespace

// ---------------------------------------------------------------------------------------------
// NcclComms: the communicator pair, shared by every transport made on it.

absl::StatusOr<std::shared_ptr<NcclComms>> NcclComms::Create(const TransportOptions& options,
                                                             const NcclBootstrap& bootstrap) {
  // Local checks. With the MPI bootstrap they are reported after an agreement over options.comm,
  // so that one rank's bad value fails every rank instead of leaving the others in the unique id's
  // MPI_Bcast, which has no timeout. (The other bootstraps meet first in ncclCommInitRankConfig,
  // which has the deadline: there the others time out.)
  absl::Status checked;
  if (options.timeout_ms < 0) checked = InvalidArgument("options.timeout_ms must be >= 0");
  if (checked.ok()) checked = common::CheckEnvironment();
  int devices = 0;
  if (checked.ok() && (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)) {
    cudaGetLastError();
    checked = Unavailable("NCCL transport: no CUDA device is visible");
  }
  if (checked.ok() && bootstrap.kind != NcclBootstrap::Kind::kWrap && bootstrap.device >= devices) {
    checked = InvalidArgument("bootstrap.device = %d, but %d device(s) exist", bootstrap.device,
                              devices);
  }
  if (bootstrap.kind != NcclBootstrap::Kind::kMpi) MOONEP_RETURN_IF_ERROR(checked);
  std::shared_ptr<NcclComms> c(new NcclComms());
  c->timeout_ms = common::ResolveTimeoutMs(options.timeout_ms);
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(c->timeout_ms);

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that a peer that never joins becomes a timeout, not a hang
  ncclComm_t base = nullptr;
  ncclUniqueId id{};
  int32_t rank = -1, size = 0;
  switch (bootstrap.kind) {
    case NcclBootstrap::Kind::kWrap: {
      MOONEP_CHECK_ARG(bootstrap.comm != nullptr, "bootstrap.comm is null");
      base = bootstrap.comm;
      c->owns_rows = false;
      int n = 0, r = 0, dev = 0;
      MOONEP_NCCL_RETURN_IF_ERROR(ncclCommCount(base, &n));
      MOONEP_NCCL_RETURN_IF_ERROR(ncclCommUserRank(base, &r));
      MOONEP_NCCL_RETURN_IF_ERROR(ncclCommCuDevice(base, &dev));
      rank = r;
      size = n;
      c->device = dev;
      break;
    }
    case NcclBootstrap::Kind::kMpi: {
      int initialized = 0;
      MPI_Initialized(&initialized);
      if (!initialized) return InvalidUsage("NCCL transport: MPI is not initialized");
      MOONEP_CHECK_ARG(options.comm != MPI_COMM_NULL, "options.comm is MPI_COMM_NULL");
      int r = 0, n = 0;
      MPI_Comm_rank(options.comm, &r);
      MPI_Comm_size(options.comm, &n);
      MOONEP_RETURN_IF_ERROR(common::AgreeOnCreationChecks(
          options.comm, checked,
          "NCCL transport: another rank refused its options, environment or GPU"));
      int made = 1;
      if (r == 0) made = ncclGetUniqueId(&id) == ncclSuccess ? 1 : 0;
      if (MPI_Bcast(&made, 1, MPI_INT, 0, options.comm) != MPI_SUCCESS ||
          MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, options.comm) != MPI_SUCCESS) {
        return SystemError("NCCL transport: MPI_Bcast of the unique id failed");
      }
      if (!made) return SystemError("NCCL transport: ncclGetUniqueId failed on rank 0");
      rank = r;
      size = n;
      break;
    }
    case NcclBootstrap::Kind::kUniqueId:
      id = bootstrap.unique_id;
      rank = bootstrap.rank;
      size = bootstrap.size;
      break;
  }
  MOONEP_CHECK_ARG(size >= 1 && rank >= 0 && rank < size,
                   "bootstrap: rank %d is not in [0, size = %d)", rank, size);
  if (bootstrap.kind != NcclBootstrap::Kind::kWrap) {
    if (bootstrap.device >= 0) {  // below `devices`: checked with the other local checks
      c->device = bootstrap.device;
    } else {
      MOONEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&c->device));
    }
  }
  c->rank = rank;
  c->size = size;
  MOONEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(c->device));
  if (bootstrap.kind != NcclBootstrap::Kind::kWrap) {
    ncclResult_t r = ncclCommInitRankConfig(&base, size, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      return Annotate(NcclStatus(r, "ncclCommInitRankConfig"),
                      absl::StrFormat("NCCL transport rank %d of %d on GPU %d (one rank per GPU)",
                                      rank, size, c->device));
    }
    c->rows = base;  // owned from here on (the destructor frees or aborts it)
    absl::Status s = WaitComm(base, deadline, "NCCL communicator creation");
    if (!s.ok()) {
      c->Abort(s).IgnoreError();  // MoonEP's own communicator: nothing to add
      return Annotate(
          s, absl::StrFormat("NCCL transport rank %d of %d on GPU %d", rank, size, c->device));
    }
  } else {
    c->rows = base;
  }
  // The weight class gets its own communicator: one communicator's operations run in issue
  // order, so a prefetch could not overlap a dispatch on it. It is made from a fresh unique id that
  // rank 0 broadcasts over the first communicator (ncclCommSplit of a non-blocking communicator
  // returned no communicator with NCCL 2.28 on the GPU machine), so every bootstrap, a wrapped
  // communicator included, works the same way and every step has the deadline.
  {
    bool rows_busy = false;
    absl::Status s = c->MakeWeightsComm(config, deadline, &rows_busy);
    if (!s.ok()) {
      // A wrapped communicator is left as it was, unless the broadcast may be stuck on it: then
      // it is revoked (not freed; the message says so).
      if (!c->owns_rows && !rows_busy) c->rows = nullptr;
      return c->Abort(Annotate(
          s, absl::StrFormat("NCCL transport rank %d of %d on GPU %d", rank, size, c->device)));
    }
  }
  log::SetRank(rank);
  MOONEP_INFO("transport nccl: communicators for %d ranks, GPU %d, timeout %d ms", size,
              c->device, c->timeout_ms);
  return c;
}

absl::Status NcclComms::MakeWeightsComm(ncclConfig_t config, Clock::time_point deadline,
                                        bool* rows_busy) {
  struct Wire {
    ncclUniqueId id;
    int32_t made;
  };
  Wire wire{};
  if (rank == 0) wire.made = ncclGetUniqueId(&wire.id) == ncclSuccess ? 1 : 0;
  Wire* dev = nullptr;
  cudaStream_t stream = nullptr;
  MOONEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  absl::Status s = compute::cuda::CudaStatus(cudaMalloc(&dev, sizeof(Wire)), "cudaMalloc");
  if (s.ok()) {
    s = compute::cuda::CudaStatus(cudaMemcpy(dev, &wire, sizeof(Wire), cudaMemcpyHostToDevice),
                                  "cudaMemcpy (weights id)");
  }
  if (s.ok()) {
    s = NcclStatus(ncclBroadcast(dev, dev, sizeof(Wire), ncclUint8, 0, rows, stream),
                   "ncclBroadcast (weights communicator id)");
    *rows_busy = s.ok();  // enqueued: it may be stuck on `rows` until it completes
  }
  if (s.ok()) s = WaitComm(rows, deadline, "ncclBroadcast (weights communicator id)");
  while (s.ok()) {  // the broadcast itself, bounded by the deadline
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) {
      *rows_busy = false;  // the broadcast is done: nothing of it is left on `rows`
      break;
    }
    if (q != cudaErrorNotReady) {
      s = compute::cuda::CudaStatus(q, "ncclBroadcast (weights communicator id)");
    } else if (Clock::now() >= deadline) {
      s = Timeout("NCCL transport creation: the weights communicator's id did not arrive from "
                  "rank 0 before the deadline (rank %d of %d)", rank, size);
    } else {
      std::this_thread::yield();
    }
  }
  if (s.ok()) {
    s = compute::cuda::CudaStatus(cudaMemcpy(&wire, dev, sizeof(Wire), cudaMemcpyDeviceToHost),
                                  "cudaMemcpy (weights id)");
  }
  if (!s.ok()) {
    // The broadcast may still be queued on the stream: abort before freeing what it uses.
    return s;  // the caller aborts; dev and the stream are left to the process (a failure path)
  }
  cudaFree(dev);
  cudaStreamDestroy(stream);
  if (wire.made != 1) return SystemError("NCCL transport: ncclGetUniqueId failed on rank 0");
  const ncclResult_t r = ncclCommInitRankConfig(&weights, size, wire.id, rank, &config);
  MOONEP_RETURN_IF_ERROR(NcclStatus(r, "ncclCommInitRankConfig (weights communicator)"));
  if (weights == nullptr) {
    return SystemError("ncclCommInitRankConfig returned no weights communicator");
  }
  return WaitComm(weights, deadline, "NCCL weights communicator creation");
}

absl::Status NcclComms::Abort(const absl::Status& status) {
  // ncclCommAbort makes the communicators' kernels return, so the streams drain. A wrapped
  // communicator is revoked: left alone it would keep the caller's stream blocked forever, and
  // aborted it would be freed under the caller. Bounded: see AbortBounded.
  const std::chrono::milliseconds bound(timeout_ms);
  AbortBounded(weights, bound);
  weights = nullptr;
  if (rows != nullptr && !owns_rows) {
    callers_comm_fate = StopCallersComm(rows, bound);
  } else {
    AbortBounded(rows, bound);
  }
  rows = nullptr;
  // Every failure on the pair from here on says what became of the caller's communicator (a
  // transport that shares the pair may fail later, on its own).
  absl::Status reported = AppendNote(status, callers_comm_fate);
  if (!callers_comm_fate.empty()) reported.SetPayload(kCallersCommStopped, absl::Cord("1"));
  if (poisoned.ok()) {
    poisoned = reported;
    MOONEP_WARN("transport nccl: aborted the communicators after: %s",
                std::string(reported.message()));
  }
  return reported;
}

NcclComms::~NcclComms() {
  cudaSetDevice(device);
  // ncclCommDestroy waits for the peers on this node; a peer that failed would make it hang, so
  // finalize with a deadline first and abort what does not finalize.
  for (ncclComm_t* c : {&weights, &rows}) {
    if (*c == nullptr || (c == &rows && !owns_rows)) continue;
    absl::Status s = NcclStatus(ncclCommFinalize(*c), "ncclCommFinalize");
    if (s.ok())
      s = WaitComm(*c, Clock::now() + std::chrono::milliseconds(timeout_ms), "ncclCommFinalize");
    if (s.ok()) {
      ncclCommDestroy(*c);
    } else {
      MOONEP_WARN("transport nccl: %s; aborting the communicator", std::string(s.message()));
      AbortBounded(*c, std::chrono::milliseconds(timeout_ms));
    }
    *c = nullptr;
  }
  cudaGetLastError();
}

namespace {

// ---------------------------------------------------------------------------------------------
// NcclTransportImpl: creation, checks.

absl::StatusOr<std::unique_ptr<Transport>> NcclTransportImpl::Create(
    const TransportOptions& options, std::shared_ptr<NcclComms> comms) {
  MOONEP_CHECK_ARG(comms != nullptr, "comms is null");
  MOONEP_RETURN_IF_ERROR(common::CheckOptions(options, /*host_rows=*/false));
  MOONEP_CHECK_ARG(options.max_top_k <= 32,
                   "options.max_top_k = %d: the NCCL transport's "
                   "combine kernel supports top_k <= 32",
                   options.max_top_k);
  MOONEP_RETURN_IF_ERROR(common::CheckEnvironment());
  if (!comms->poisoned.ok()) {
    return InvalidUsage("NCCL transport: the communicators were aborted after an earlier failure "
                        "(%s)", std::string(comms->poisoned.message()));
  }
  std::unique_ptr<NcclTransportImpl> t(new NcclTransportImpl());
  t->options_ = options;
  t->timeout_ms_ =
      options.timeout_ms > 0 ? std::min(options.timeout_ms, kMaxTimeoutMs) : comms->timeout_ms;
  t->rank_ = comms->rank;
  t->size_ = comms->size;
  t->device_ = comms->device;
  t->comms_ = std::move(comms);
  MOONEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(t->device_));
  MOONEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&t->rows_stream_, cudaStreamNonBlocking));
  MOONEP_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&t->weights_stream_, cudaStreamNonBlocking));
  {
    // Ranks on this node without a collective (creation is not one): the launcher's count where
    // it sets one, else this node's GPUs (one rank per GPU; a rank that sees one GPU alone through
    // CUDA_VISIBLE_DEVICES counts 1 unless the launcher says more).
    int devices = 1;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) devices = 1;
    t->host_pool_ = common::MakeHostPool(options.host_threads,
                                         std::max(devices, common::LauncherLocalRanks()));
  }
  log::SetRank(t->rank_);
  MOONEP_INFO("transport nccl: %d ranks, GPU %d, timeout %d ms, %d host threads", t->size_,
              t->device_, t->timeout_ms_, t->host_pool_ ? t->host_pool_->size() : 1);
  return std::unique_ptr<Transport>(std::move(t));
}

NcclTransportImpl::~NcclTransportImpl() {
  cudaSetDevice(device_);
  // Let queued work finish (bounded): freeing buffers under running kernels is undefined.
  bool drained = true;
  const Clock::time_point until = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  for (cudaStream_t s : {rows_stream_, weights_stream_}) {
    if (s == nullptr) continue;
    while (true) {
      const cudaError_t q = cudaStreamQuery(s);
      if (q != cudaErrorNotReady) break;
      if (Clock::now() >= until) {
        drained = false;
        break;
      }
      std::this_thread::yield();
    }
  }
  cudaGetLastError();
  if (!drained) Abort(Timeout("NCCL transport destroyed with work still queued")).IgnoreError();
  states_.clear();
  if (rows_stream_) cudaStreamDestroy(rows_stream_);
  if (weights_stream_) cudaStreamDestroy(weights_stream_);
  // The communicators go with the last transport (or holder) of comms_.
}

absl::Status NcclTransportImpl::Usable() const {
  if (!poisoned_.ok()) {
    return InvalidUsage("transport is unusable after an earlier failure (%s); destroy it",
                        std::string(poisoned_.message()));
  }
  if (!comms_->poisoned.ok()) {
    return InvalidUsage("transport is unusable: its NCCL communicators (shared with other "
                        "transports) were aborted after an earlier failure (%s); destroy it",
                        std::string(comms_->poisoned.message()));
  }
  return absl::OkStatus();
}

absl::Status NcclTransportImpl::Abort(const absl::Status& status) {
  const absl::Status reported = comms_->Abort(status);
  if (poisoned_.ok()) poisoned_ = reported;
  return reported;
}

absl::Status NcclTransportImpl::Fatal(absl::Status status) { return Abort(status); }

absl::Status NcclTransportImpl::PollAsyncErrors() const {
  for (ncclComm_t c : {comms_->rows, comms_->weights}) {
    if (c == nullptr) continue;
    ncclResult_t state = ncclSuccess;
    MOONEP_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(c, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      return NcclStatus(state, "NCCL asynchronous error (a peer failed or the network broke)");
    }
  }
  return absl::OkStatus();
}

void NcclTransportImpl::AddCounters(OpKind kind, const OpCounters& c) {
  OpCounters& o = counters_[static_cast<int>(kind)];
  o.calls += c.calls;
  o.rows_sent += c.rows_sent;
  o.bytes_sent += c.bytes_sent;
  o.rows_received += c.rows_received;
  o.bytes_received += c.bytes_received;
  o.rows_deduplicated += c.rows_deduplicated;
  o.bytes_deduplicated += c.bytes_deduplicated;
  o.rows_local += c.rows_local;
  o.messages_sent += c.messages_sent;
}

void NcclTransportImpl::FreeRetired() {
  if (comms_->ops_in_flight != 0) return;
  for (auto& state : states_) state.second->FreeRetired();
  reduce_staging_.ForEach([](ReduceStaging* r) { r->FreeRetired(); });
}

HandleState* NcclTransportImpl::StateOf(const DispatchHandle* h) {
  std::unique_ptr<HandleState>& s = states_[h];
  if (!s) s = std::make_unique<HandleState>();
  return s.get();
}

absl::Status NcclTransportImpl::CheckDevicePointer(const void* p, const char* name) const {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return InvalidArgument("%s: not a CUDA pointer (the NCCL transport needs device memory)", name);
  }
  MOONEP_CHECK_ARG(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged,
                   "%s: host memory; the NCCL transport needs memory of GPU %d", name, device_);
  MOONEP_CHECK_ARG(attr.device == device_, "%s: memory of GPU %d, the transport runs on GPU %d",
                   name, attr.device, device_);
  return absl::OkStatus();
}

absl::Status NcclTransportImpl::CheckRows(const TensorView& v, const char* name, int64_t min_rows,
                                          int64_t cols, bool row_operand) const {
  MOONEP_RETURN_IF_ERROR(common::CheckRowTensor(v, name, min_rows, cols, "NCCL", Device::kCuda));
  // Columns are >= 1 (CheckRowTensor); compared without the product, which may overflow.
  const int64_t size = static_cast<int64_t>(DTypeSize(v.dtype));
  MOONEP_CHECK_ARG(!row_operand || v.shape[1] <= options_.max_row_bytes / size,
                   "%s: a row has %d columns of %d bytes, above the declared max_row_bytes = %d",
                   name, v.shape[1], size, options_.max_row_bytes);
  if (v.numel() == 0) return absl::OkStatus();
  return CheckDevicePointer(v.data, name);
}

std::vector<int> NcclTransportImpl::RowPeers(const DispatchHandle* h) const {
  std::vector<int> peers;
  for (int32_t r = 0; r < size_; ++r) {
    if (r != rank_ && (h->send_.rows_to(r) > 0 || h->recv_.rows_from(r) > 0)) peers.push_back(r);
  }
  return peers;
}

absl::Status NcclTransportImpl::CheckDispatched(OpKind kind, DispatchHandle* h) {
  if (h == nullptr) return Fatal(InvalidArgument("%s: handle is null", OpName(kind)));
  if (absl::Status busy = h->CheckCanStart(kind); !busy.ok()) return Fatal(busy);
  const auto state = states_.find(h);
  if (!h->counted_ || h->counted_by_ != serial() || h->num_ranks_ != size_ || h->rank_ != rank_ ||
      state == states_.end()) {
    return Fatal(
        InvalidUsage("%s: the handle has no count exchange of this transport", OpName(kind)));
  }
  if (kind != OpKind::kDispatch && !h->dispatched_) {
    return Fatal(InvalidUsage("%s: the handle has not been dispatched", OpName(kind)));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Count exchange. A rank's message is its header [flag, T, K, E, capacity] and [invalid,
// counts[E]], counted on the device from the device ids. It takes one of two forms, the same on
// every rank:
// - one round: header and counts in one allgather of kHeader + 1 + W values, where W is the E
//   every rank used in the last count exchange on this communicator pair. If every rank still
//   uses W, the counts have arrived with the headers; if every rank moved to another E, a second
//   round sized by it follows (the first then carried zeros in the counts' places); if the ranks
//   disagree, the headers say so.
// - two rounds (the pair's first exchange, and the one after the ranks disagreed on E): the
//   headers first, so that every rank knows E before the counts' allgather is sized by it.
// The form is chosen in the exchange's first host step, not when it starts. A channel's steps run
// in issue order on every rank (Progress), so the previous exchange's second step, which sets W
// from the headers every rank received alike, has run by then on every rank, whether or not its
// caller has waited for it yet. W is the pair's, not the transport's or the handle's: the pair's
// order of operations is what the ranks share (transports on a shared pair are started in the same
// order everywhere, but one rank may have made a layer's transport again), and a rank that joins
// with a fresh handle (the runtime does, after a local input error) takes its peers' form.

constexpr int kHeader = 5;

absl::StatusOr<RequestPtr> NcclTransportImpl::StartExchangeCounts(
    absl::Span<const int32_t> topk_ids, int64_t num_tokens, int32_t top_k, int32_t num_experts,
    int64_t recv_capacity_rows, DispatchHandle* h) {
  MOONEP_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(device_);
  FreeRetired();
  if (testing::ShouldSkip(rank_, OpKind::kCounts)) {
    MOONEP_WARN("transport nccl: test hook: rank %d skips this operation", rank_);
    return RequestPtr(new DoneRequest());
  }
  // Nothing can be described to the peers without a handle and E: they time out on this rank.
  if (h == nullptr) return Fatal(InvalidArgument("handle is null"));
  if (num_experts < 1 || num_experts > kMaxExperts) {
    return Fatal(InvalidArgument("num_experts must be in [1, %d], got %d", kMaxExperts,
                                 num_experts));
  }
  // The handle's buffers belong to its exchange until that ends (its Wait, or a Test that
  // returned true or an error), and its layouts to any operation on it in flight. Refused before
  // anything is described to the peers: a rank that makes this call alone leaves them to time out
  // in this exchange, as any rank that does not join.
  MOONEP_RETURN_IF_ERROR(h->CheckCanStart(OpKind::kCounts));
  absl::Status local;
  // The maxima first: within them num_tokens * top_k <= kMaxEntries cannot overflow.
  if (num_tokens < 0 || top_k < 0) {
    local = InvalidArgument("num_tokens = %d and top_k = %d must be >= 0", num_tokens, top_k);
  } else if (num_tokens > options_.max_tokens) {
    local = OutOfMemory("num_tokens = %d exceeds the declared max_tokens = %d", num_tokens,
                        options_.max_tokens);
  } else if (top_k > options_.max_top_k) {
    local =
        OutOfMemory("top_k = %d exceeds the declared max_top_k = %d", top_k, options_.max_top_k);
  } else if (static_cast<int64_t>(topk_ids.size()) != num_tokens * top_k) {
    local = InvalidArgument("topk_ids: has %d entries, need num_tokens * top_k = %d",
                            topk_ids.size(), num_tokens * top_k);
  } else if (recv_capacity_rows < 0) {
    local = InvalidArgument("recv_capacity_rows must be >= 0, got %d", recv_capacity_rows);
  } else if (!topk_ids.empty()) {
    local = CheckDevicePointer(topk_ids.data(), "topk_ids");
  }
  if (absl::Status refused = h->TakeRefusal(); !refused.ok()) local = refused;
  if (!local.ok()) local = Annotate(local, absl::StrFormat("count exchange on rank %d", rank_));

  HandleState* st = StateOf(h);
  const int32_t R = size_, E = num_experts;
  const int64_t width = 1 + E;
  const int64_t entries = local.ok() ? num_tokens * top_k : 0;
  // The wire's E when this exchange's first step runs is that of an exchange started before this
  // one, so at most the pair's reserve_experts. counts_all_* also receive the one-round rows.
  comms_->reserve_experts = std::max(comms_->reserve_experts, E);
  const int64_t max_wire = kHeader + 1 + static_cast<int64_t>(comms_->reserve_experts);
  const size_t all_bytes = static_cast<size_t>(R * std::max(width, max_wire)) * 8;
  {
    absl::Status s = st->header_host.Reserve(kHeader * 8, "the count header");
    if (s.ok())
      s = st->header_all_host.Reserve(static_cast<size_t>(R) * kHeader * 8, "count headers");
    if (s.ok()) s = st->counts_all_host.Reserve(all_bytes, "counts");
    if (s.ok())
      s = st->ids_host.Reserve(static_cast<size_t>(std::max<int64_t>(entries, 1)) * 4, "ids");
    if (s.ok()) s = st->header_dev.Reserve(kHeader * 8, "the count header");
    if (s.ok())
      s = st->header_all_dev.Reserve(static_cast<size_t>(R) * kHeader * 8, "count headers");
    if (s.ok()) s = st->counts_dev.Reserve(static_cast<size_t>(width) * 8, "counts");
    if (s.ok()) s = st->counts_all_dev.Reserve(all_bytes, "counts");
    if (s.ok()) s = st->wire_dev.Reserve(static_cast<size_t>(max_wire) * 8, "header and counts");
    if (!s.ok()) return Fatal(s);
  }
  h->counted_ = false;
  h->counted_by_ = serial();
  h->dispatched_ = false;
  int64_t* header = st->header_host.get<int64_t>();
  header[0] = local.ok() ? 0 : 1;
  header[1] = num_tokens;
  header[2] = top_k;
  header[3] = E;
  header[4] = recv_capacity_rows;
  std::vector<int> peers;
  for (int32_t r = 0; r < R; ++r) {
    if (r != rank_) peers.push_back(r);
  }
  auto op = NewOp(OpKind::kCounts, rows_stream_, peers);
  NcclOp* raw = op.get();
  const int32_t* ids = topk_ids.data();
  const int64_t T = num_tokens;
  const int32_t K = top_k, me = rank_;
  const cudaStream_t stream = rows_stream_;
  // The wire's E this exchange took (0: two rounds), set by its first step for its second.
  auto wire_experts = std::make_shared<int32_t>(0);
  // Rounds are counted as messages (one per peer and round), bytes as what this rank sent.
  auto round = [raw, R](int64_t values) {
    raw->counters().bytes_sent += values * 8 * (R - 1);
    raw->counters().messages_sent += R - 1;
  };
  auto exchange_header = [=]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(raw->WaitCaller());
    const int32_t W = comms_->wire_experts;
    *wire_experts = W;
    int64_t* counts = st->counts_dev.get<int64_t>();
    int64_t* send = st->header_dev.get<int64_t>();
    int64_t sent = kHeader;
    if (W > 0) {
      send = st->wire_dev.get<int64_t>();
      sent = kHeader + 1 + W;
      MOONEP_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(send + kHeader, 0, static_cast<size_t>(1 + W) * 8, stream));
      // With another E than the wire's, the counts are made for the second round.
      if (E == W) counts = send + kHeader;
    }
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(send, st->header_host.get(), kHeader * 8,
                                                cudaMemcpyHostToDevice, stream));
    if (counts != send + kHeader) {
      MOONEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(counts, 0, width * 8, stream));
    }
    if (entries > 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(LaunchCountRouting(ids, T, K, E, counts + 1, counts, stream));
      MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st->ids_host.get(), ids,
                                                  static_cast<size_t>(entries) * 4,
                                                  cudaMemcpyDeviceToHost, stream));
    }
    void* recv = W > 0 ? st->counts_all_dev.get() : st->header_all_dev.get();
    void* host = W > 0 ? st->counts_all_host.get() : st->header_all_host.get();
    MOONEP_RETURN_IF_ERROR(Settle(
        ncclAllGather(send, recv, static_cast<size_t>(sent), ncclInt64, comms_->rows, stream),
        comms_->rows,
        W > 0 ? "count exchange (ncclAllGather of headers and counts)"
              : "count exchange (ncclAllGather of headers)"));
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, recv, static_cast<size_t>(R * sent) * 8,
                                                cudaMemcpyDeviceToHost, stream));
    round(sent);
    return absl::OkStatus();
  };
  auto exchange_counts = [=]() -> absl::Status {
    const int32_t W = *wire_experts;
    const int64_t wire_width = kHeader + 1 + static_cast<int64_t>(W);
    int64_t* all = st->header_all_host.get<int64_t>();
    int64_t* rows = st->counts_all_host.get<int64_t>();
    if (W > 0) {  // the headers out of the one-round rows
      for (int32_t r = 0; r < R; ++r) {
        std::copy(rows + r * wire_width, rows + r * wire_width + kHeader, all + r * kHeader);
      }
    }
    // Every rank reads the same headers, so every rank reaches the same verdict here, and sets the
    // same wire for the next exchange: the common E, or none when the ranks disagree.
    bool same = true;
    for (int32_t r = 1; r < R; ++r) same = same && all[r * kHeader + 3] == all[3];
    comms_->wire_experts = same ? static_cast<int32_t>(all[3]) : 0;
    std::vector<int> bad;
    for (int32_t r = 0; r < R; ++r) {
      if (all[r * kHeader + 3] != E) {
        raw->Stop(InvalidArgument("count exchange: rank %d uses num_experts = %d, rank %d uses %d",
                                  r, all[r * kHeader + 3], me, E));
        return absl::OkStatus();
      }
      if (all[r * kHeader] != 0) bad.push_back(r);
    }
    if (!local.ok()) {
      raw->Stop(local);
      return absl::OkStatus();
    }
    if (!bad.empty()) {
      raw->Stop(RemoteError("count exchange: rank(s) %s refused their dispatch input (their "
                            "own error says why)", absl::StrJoin(bad, ",")));
      return absl::OkStatus();
    }
    if (W == E) {  // every rank used the wire's E: the counts came with the headers
      for (int32_t r = 0; r < R; ++r) {  // rows of kHeader + 1 + E into rows of 1 + E, in place
        std::copy(rows + r * wire_width + kHeader, rows + (r + 1) * wire_width, rows + r * width);
      }
      return absl::OkStatus();
    }
    MOONEP_RETURN_IF_ERROR(
        Settle(ncclAllGather(st->counts_dev.get(), st->counts_all_dev.get(),
                             static_cast<size_t>(width), ncclInt64, comms_->rows, stream),
               comms_->rows, "count exchange (ncclAllGather of counts)"));
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st->counts_all_host.get(), st->counts_all_dev.get(),
                                                static_cast<size_t>(R * width) * 8,
                                                cudaMemcpyDeviceToHost, stream));
    round(width);
    return absl::OkStatus();
  };
  auto finish = [=]() -> absl::Status {
    const int64_t* all = st->header_all_host.get<int64_t>();
    const int64_t* counts = st->counts_all_host.get<int64_t>();
    const int32_t* ids_copy = st->ids_host.get<int32_t>();
    std::vector<int> bad;
    for (int32_t r = 0; r < R; ++r) {
      if (counts[r * width] != 0) bad.push_back(r);
    }
    if (counts[me * width] != 0) {
      // The device found a bad id; the host copy names it.
      absl::Status why =
          ValidateRouting(absl::MakeConstSpan(ids_copy, static_cast<size_t>(entries)), T, K, E);
      if (why.ok()) why = Internal("the device rejected routing that the host accepts");
      return Annotate(why, absl::StrFormat("count exchange on rank %d", me));
    }
    if (!bad.empty()) {
      return RemoteError("count exchange: rank(s) %s refused their dispatch input (their "
                         "own error says why)", absl::StrJoin(bad, ","));
    }
    h->rank_ = me;
    h->num_ranks_ = R;
    h->num_experts_ = E;
    h->num_tokens_ = T;
    h->top_k_ = K;
    h->topk_ids_.assign(ids_copy, ids_copy + entries);
    h->counts_.resize(static_cast<size_t>(R) * E);
    h->rank_tokens_.resize(R);
    h->rank_capacity_.resize(R);
    for (int32_t r = 0; r < R; ++r) {
      h->rank_tokens_[r] = all[r * kHeader + 1];
      h->rank_capacity_[r] = all[r * kHeader + 4];
      std::copy(counts + r * width + 1, counts + (r + 1) * width, h->counts_.begin() + r * E);
    }
    planner::ComputeSourceOffsets(h->counts_, R, E, &h->offsets_);
    h->counted_ = true;
    return absl::OkStatus();
  };
  h->Track(raw, OpKind::kCounts);
  return Run(std::move(op), {exchange_header, exchange_counts}, finish);
}

// ---------------------------------------------------------------------------------------------
// Dispatch: (1) per-row metadata and the unique-row count of every pair (the receiver needs the
// count to post its receive; it reads it on the host); (2) the pack kernel writes this rank's
// unique rows in destination order, grouped sends/receives move them into a receive staging, and
// one expansion kernel writes every row of the compute layout (duplicates expanded, local rows
// from x, padding zeroed) with its top-k weight.

absl::StatusOr<RequestPtr> NcclTransportImpl::StartDispatch(
    const planner::Plan& plan, const TensorView& x, absl::Span<const float> topk_weights,
    DispatchHandle* h, const TensorView& recv_rows, absl::Span<float> recv_weights) {
  const Clock::time_point entered = Clock::now();
  MOONEP_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(device_);
  FreeRetired();
  if (testing::ShouldSkip(rank_, OpKind::kDispatch)) return RequestPtr(new DoneRequest());
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kDispatch, h));
  // Agreed checks: functions of (plan, counts, capacities), identical on every rank.
  {
    absl::Status s;
    if (plan.num_ranks != size_ || plan.num_experts != h->num_experts_) {
      s = InvalidArgument("dispatch: plan is for %d ranks and %d experts, the counts for %d and %d",
                          plan.num_ranks, plan.num_experts, size_, h->num_experts_);
    }
    if (s.ok()) s = Annotate(CheckPlanForTransport(plan, h->counts_), "dispatch");
    if (!s.ok()) return s;
    for (int32_t r = 0; r < size_; ++r) {
      if (plan.rank_rows[r] <= h->rank_capacity_[r]) continue;
      if (r == rank_) {
        return OutOfMemory("dispatch: the plan gives rank %d %d rows, its receive buffer holds %d",
                           r, plan.rank_rows[r], h->rank_capacity_[r]);
      }
      return RemoteError("dispatch: the plan gives rank %d %d rows, its receive buffer holds %d", r,
                         plan.rank_rows[r], h->rank_capacity_[r]);
    }
  }
  const int64_t T = h->num_tokens_;
  const int32_t K = h->top_k_, R = size_, me = rank_;
  // Local checks: a failure here leaves the peers waiting, so it is fatal (they time out).
  {
    absl::Status s = CheckRows(x, "x", T, -1);
    if (s.ok() && x.shape[0] != T) {
      s = InvalidArgument("x: has %d rows, the count exchange had num_tokens = %d", x.shape[0], T);
    }
    if (s.ok()) s = CheckRows(recv_rows, "recv_rows", plan.rank_rows[me], x.shape[1]);
    if (s.ok() && recv_rows.dtype != x.dtype) {
      s = InvalidArgument("recv_rows: dtype %s differs from x's %s", DTypeName(recv_rows.dtype),
                          DTypeName(x.dtype));
    }
    if (s.ok() && static_cast<int64_t>(topk_weights.size()) != T * K) {
      s = InvalidArgument("topk_weights: has %d entries, need num_tokens * top_k = %d",
                          topk_weights.size(), T * K);
    }
    if (s.ok() && !topk_weights.empty())
      s = CheckDevicePointer(topk_weights.data(), "topk_weights");
    if (s.ok() && static_cast<int64_t>(recv_weights.size()) < plan.rank_rows[me]) {
      s = InvalidArgument("recv_weights: has %d entries, the plan needs %d", recv_weights.size(),
                          plan.rank_rows[me]);
    }
    if (s.ok() && !recv_weights.empty())
      s = CheckDevicePointer(recv_weights.data(), "recv_weights");
    if (s.ok() && RangesOverlap(x.data, x.nbytes(), recv_rows.data, recv_rows.nbytes())) {
      s = InvalidArgument("x and recv_rows overlap");
    }
    if (!s.ok()) return Fatal(Annotate(s, "dispatch"));
  }
  h->plan_ = plan;
  h->dispatched_ = false;
  {
    absl::Status s =
        BuildSendLayout(h->plan_, h->offsets_, me, h->topk_ids_, T, K, &h->send_, host_pool_.get());
    if (!s.ok()) return Fatal(Annotate(s, "dispatch"));
  }
  BuildReceiveLayout(h->plan_, h->offsets_, me, &h->recv_);
  const SendLayout& send = h->send_;
  const ReceiveLayout& recv = h->recv_;
  HandleState* st = StateOf(h);
  const int64_t n_entries = T * K;
  const int64_t sent_entries = send.entry_begin[R];  // entries with a destination
  const int64_t recv_total = recv.rows_begin[R];     // rows arriving, this rank's own included
  const int64_t rank_rows = plan.rank_rows[me];
  const size_t row_bytes = static_cast<size_t>(x.shape[1]) * DTypeSize(x.dtype);

  // Tables: written on the host from the layouts straight into the pinned block that one copy
  // uploads.
  const DispatchTableSizes sizes = TableSizes(send, recv, me);
  const int64_t pack_rows = sizes.pack_index;
  TableBlock block;
  st->off_pack_index = block.Add<int32_t>(sizes.pack_index);
  st->off_meta_unique = block.Add<int32_t>(sizes.meta);
  st->off_meta_entries = block.Add<int32_t>(sizes.meta);
  st->off_row_source = block.Add<RowSource>(sizes.row_source);
  st->off_combine_index = block.Add<int32_t>(sizes.combine_index);
  st->off_pos_row = block.Add<int32_t>(sizes.pos_row);
  st->off_unique_send = block.Add<int64_t>(R);
  {
    absl::Status s = st->tables_host.Reserve(block.size(), "dispatch tables");
    if (s.ok()) s = st->tables_dev.Reserve(block.size(), "dispatch tables");
    if (s.ok()) s = st->unique_recv_host.Reserve(static_cast<size_t>(R) * 8, "unique counts");
    if (s.ok()) s = st->unique_recv_dev.Reserve(static_cast<size_t>(R) * 8, "unique counts");
    if (s.ok())
      s = st->staging_begin_host.Reserve(static_cast<size_t>(R + 1) * 8, "staging offsets");
    if (s.ok())
      s = st->staging_begin_dev.Reserve(static_cast<size_t>(R + 1) * 8, "staging offsets");
    // One host slot per kind of operation: ops of different kinds may be in flight on the handle
    // together, and each reads its own count back when it completes.
    if (s.ok()) s = st->bad_host.Reserve(8 * kKinds, "error counters");
    if (s.ok()) s = st->bad_dev.Reserve(8, "error counter");
    if (s.ok())
      s = st->weights_dev.Reserve(static_cast<size_t>(std::max<int64_t>(n_entries, 1)) * 4,
                                  "top-k weights");
    if (s.ok())
      s = st->meta_send_dev.Reserve(
          static_cast<size_t>(std::max<int64_t>(sent_entries, 1)) * sizeof(RowMeta),
          "row metadata");
    if (s.ok())
      s = st->meta_recv_dev.Reserve(
          static_cast<size_t>(std::max<int64_t>(recv_total, 1)) * sizeof(RowMeta), "row metadata");
    if (s.ok())
      s = st->send_staging.Reserve(static_cast<size_t>(std::max<int64_t>(pack_rows, 1)) * row_bytes,
                                   "send staging");
    if (s.ok())
      s = st->recv_staging.Reserve(
          static_cast<size_t>(std::max<int64_t>(recv_total, 1)) * row_bytes, "receive staging");
    if (!s.ok()) return Fatal(s);
  }
  st->pack_begin.resize(static_cast<size_t>(R) + 1);
  WriteDispatchTables(send, recv, me,
                      DispatchTableViews{st->pack_begin.data(),
                                         st->host_table<int64_t>(st->off_unique_send),
                                         st->host_table<int32_t>(st->off_pack_index),
                                         st->host_table<int32_t>(st->off_meta_unique),
                                         st->host_table<int32_t>(st->off_meta_entries),
                                         st->host_table<RowSource>(st->off_row_source),
                                         st->host_table<int32_t>(st->off_pos_row),
                                         st->host_table<int32_t>(st->off_combine_index)},
                      host_pool_.get());
  st->unique_from.assign(R, 0);
  st->staging_begin.assign(R + 1, 0);

  MOONEP_TRACE("transport nccl: dispatch: checks, layouts and tables on the host %.1f us",
               std::chrono::duration<double, std::micro>(Clock::now() - entered).count());
  auto op = NewOp(OpKind::kDispatch, rows_stream_, RowPeers(h));
  h->Track(op.get(), OpKind::kDispatch);
  NcclOp* raw = op.get();
  const cudaStream_t stream = rows_stream_;
  const size_t table_bytes = block.size();
  const float* weights_in = topk_weights.data();
  float* weights_out = recv_weights.data();
  const TensorView x_view = x, rows_view = recv_rows;
  {
    OpCounters& c = raw->counters();
    for (int32_t d = 0; d < R; ++d) {
      if (d == me || send.rows_to(d) == 0) continue;
      c.rows_sent += send.unique_to(d);
      c.bytes_sent += send.unique_to(d) * static_cast<int64_t>(row_bytes) +
                      send.rows_to(d) * static_cast<int64_t>(sizeof(RowMeta));
      c.rows_deduplicated += send.rows_to(d) - send.unique_to(d);
      c.bytes_deduplicated +=
          (send.rows_to(d) - send.unique_to(d)) * static_cast<int64_t>(row_bytes);
      c.messages_sent += 3;
    }
    c.rows_local = send.rows_to(me);
  }
  auto exchange_meta = [=]() -> absl::Status {
    const SendLayout& send = h->send_;
    const ReceiveLayout& recv = h->recv_;
    MOONEP_RETURN_IF_ERROR(raw->WaitCaller());
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st->tables_dev.get(), st->tables_host.get(),
                                                table_bytes, cudaMemcpyHostToDevice, stream));
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st->bad_dev.get(), 0, 8, stream));
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st->unique_recv_dev.get(), 0, R * 8, stream));
    if (n_entries > 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st->weights_dev.get(), weights_in,
                                                  static_cast<size_t>(n_entries) * 4,
                                                  cudaMemcpyDeviceToDevice, stream));
    }
    RowMeta* meta_send = st->meta_send_dev.get<RowMeta>();
    MOONEP_CUDA_RETURN_IF_ERROR(
        LaunchFillRowMeta(st->table<int32_t>(st->off_meta_unique),
                          st->table<int32_t>(st->off_meta_entries), st->weights_dev.get<float>(),
                          n_entries, sent_entries, meta_send, st->bad_dev.get<int32_t>(), stream));
    RowMeta* meta_recv = st->meta_recv_dev.get<RowMeta>();
    const int64_t* unique_send = st->table<int64_t>(st->off_unique_send);
    int64_t* unique_recv = st->unique_recv_dev.get<int64_t>();
    absl::Status group;  // first enqueue error; the group is closed either way
    MOONEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (int32_t d = 0; d < R; ++d) {
      const int64_t n = send.rows_to(d);
      if (d == me || n == 0) continue;
      Keep(&group,
           ncclSend(meta_send + send.entry_begin[d], static_cast<size_t>(n) * sizeof(RowMeta),
                    ncclUint8, d, comms_->rows, stream),
           "ncclSend");
      Keep(&group, ncclSend(unique_send + d, 1, ncclInt64, d, comms_->rows, stream), "ncclSend");
    }
    for (int32_t s = 0; s < R; ++s) {
      const int64_t n = recv.rows_from(s);
      if (s == me || n == 0) continue;
      Keep(&group,
           ncclRecv(meta_recv + recv.rows_begin[s], static_cast<size_t>(n) * sizeof(RowMeta),
                    ncclUint8, s, comms_->rows, stream),
           "ncclRecv");
      Keep(&group, ncclRecv(unique_recv + s, 1, ncclInt64, s, comms_->rows, stream), "ncclRecv");
    }
    MOONEP_RETURN_IF_ERROR(GroupEnd(comms_->rows, "dispatch metadata (ncclGroupEnd)"));
    MOONEP_RETURN_IF_ERROR(group);
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st->unique_recv_host.get(), unique_recv, R * 8,
                                                cudaMemcpyDeviceToHost, stream));
    return absl::OkStatus();
  };
  auto exchange_rows = [=]() -> absl::Status {
    const ReceiveLayout& recv = h->recv_;
    const int64_t* unique_recv = st->unique_recv_host.get<int64_t>();
    int64_t* staging_begin = st->staging_begin_host.get<int64_t>();
    staging_begin[0] = 0;
    for (int32_t s = 0; s < R; ++s) {
      const int64_t n = s == me ? 0 : recv.rows_from(s);
      const int64_t u = n == 0 ? 0 : unique_recv[s];
      if (u < 1 && n > 0) {
        return Internal("dispatch: rank %d announced %d unique rows for %d rows", s, u, n);
      }
      if (u > n) return Internal("dispatch: rank %d announced %d unique rows for %d rows", s, u, n);
      st->unique_from[s] = u;
      staging_begin[s + 1] = staging_begin[s] + u;
    }
    std::copy(staging_begin, staging_begin + R + 1, st->staging_begin.begin());
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st->staging_begin_dev.get(), staging_begin,
                                                static_cast<size_t>(R + 1) * 8,
                                                cudaMemcpyHostToDevice, stream));
    char* send_staging = st->send_staging.get();
    char* recv_staging = st->recv_staging.get();
    if (pack_rows > 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(
          kernels::LaunchPackRows(x_view.data, T, st->table<int32_t>(st->off_pack_index), pack_rows,
                                  send_staging, row_bytes, st->bad_dev.get<int32_t>(), stream));
    }
    absl::Status group;  // first enqueue error; the group is closed either way
    MOONEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (int32_t d = 0; d < R; ++d) {
      const int64_t u = st->pack_begin[d + 1] - st->pack_begin[d];
      if (d == me || u == 0) continue;
      Keep(&group,
           ncclSend(send_staging + st->pack_begin[d] * row_bytes,
                    static_cast<size_t>(u) * row_bytes, ncclUint8, d, comms_->rows, stream),
           "ncclSend");
    }
    for (int32_t s = 0; s < R; ++s) {
      const int64_t u = st->unique_from[s];
      if (s == me || u == 0) continue;
      Keep(&group,
           ncclRecv(recv_staging + staging_begin[s] * row_bytes, static_cast<size_t>(u) * row_bytes,
                    ncclUint8, s, comms_->rows, stream),
           "ncclRecv");
    }
    MOONEP_RETURN_IF_ERROR(GroupEnd(comms_->rows, "dispatch rows (ncclGroupEnd)"));
    MOONEP_RETURN_IF_ERROR(group);
    MOONEP_CUDA_RETURN_IF_ERROR(LaunchExpandRows(
        st->table<RowSource>(st->off_row_source), rank_rows, st->meta_recv_dev.get<RowMeta>(),
        recv_total, st->staging_begin_dev.get<int64_t>(), R, recv_staging, x_view.data, n_entries,
        K, st->weights_dev.get<float>(), row_bytes, rows_view.data, weights_out,
        st->bad_dev.get<int32_t>(), stream));
    MOONEP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(BadSlot(st, OpKind::kDispatch), st->bad_dev.get(), 4,
                        cudaMemcpyDeviceToHost, stream));
    raw->counters().rows_received = staging_begin[R];
    raw->counters().bytes_received = staging_begin[R] * static_cast<int64_t>(row_bytes);
    return absl::OkStatus();
  };
  auto finish = [=]() -> absl::Status {
    const int32_t bad = *BadSlot(st, OpKind::kDispatch);
    if (bad != 0) {
      return Fatal(
          Internal("dispatch: %d rows had an out-of-range index (a peer sent metadata "
                   "that does not match the plan)",
                   bad));
    }
    h->dispatched_ = true;
    return absl::OkStatus();
  };
  return Run(std::move(op), {exchange_meta, exchange_rows}, finish);
}

// Combine-backward: the movement of dispatch with the saved metadata, one stage.
absl::StatusOr<RequestPtr> NcclTransportImpl::StartRowsOut(OpKind kind, DispatchHandle* h,
                                                           const TensorView& x,
                                                           const TensorView& rows) {
  const int32_t R = size_, me = rank_, K = h->top_k_;
  const int64_t T = h->num_tokens_, n_entries = T * K;
  HandleState* st = StateOf(h);
  const SendLayout& send = h->send_;
  const ReceiveLayout& recv = h->recv_;
  const int64_t rank_rows = recv.rank_rows, recv_total = recv.rows_begin[R];
  const int64_t pack_rows = st->pack_begin[R];
  const size_t row_bytes = static_cast<size_t>(x.shape[1]) * DTypeSize(x.dtype);
  {
    absl::Status s = st->send_staging.Reserve(
        static_cast<size_t>(std::max<int64_t>(pack_rows, 1)) * row_bytes, "send staging");
    if (s.ok())
      s = st->recv_staging.Reserve(
          static_cast<size_t>(std::max<int64_t>(st->staging_begin[R], 1)) * row_bytes,
          "receive staging");
    if (!s.ok()) return Fatal(s);
  }
  auto op = NewOp(kind, rows_stream_, RowPeers(h));
  h->Track(op.get(), kind);
  NcclOp* raw = op.get();
  const cudaStream_t stream = rows_stream_;
  {
    OpCounters& c = raw->counters();
    c.rows_sent = pack_rows;
    c.bytes_sent = pack_rows * static_cast<int64_t>(row_bytes);
    c.rows_received = st->staging_begin[R];
    c.bytes_received = st->staging_begin[R] * static_cast<int64_t>(row_bytes);
    for (int32_t d = 0; d < R; ++d) {
      if (d != me) c.rows_deduplicated += send.rows_to(d) - send.unique_to(d);
    }
    c.bytes_deduplicated = c.rows_deduplicated * static_cast<int64_t>(row_bytes);
    c.rows_local = send.rows_to(me);
  }
  const TensorView x_view = x, rows_view = rows;
  auto move = [=]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(raw->WaitCaller());
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st->bad_dev.get(), 0, 8, stream));
    char* send_staging = st->send_staging.get();
    char* recv_staging = st->recv_staging.get();
    if (pack_rows > 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(
          kernels::LaunchPackRows(x_view.data, T, st->table<int32_t>(st->off_pack_index), pack_rows,
                                  send_staging, row_bytes, st->bad_dev.get<int32_t>(), stream));
    }
    absl::Status group;  // first enqueue error; the group is closed either way
    MOONEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (int32_t d = 0; d < R; ++d) {
      const int64_t u = st->pack_begin[d + 1] - st->pack_begin[d];
      if (d == me || u == 0) continue;
      Keep(&group,
           ncclSend(send_staging + st->pack_begin[d] * row_bytes,
                    static_cast<size_t>(u) * row_bytes, ncclUint8, d, comms_->rows, stream),
           "ncclSend");
    }
    for (int32_t s = 0; s < R; ++s) {
      const int64_t u = st->unique_from[s];
      if (s == me || u == 0) continue;
      Keep(&group,
           ncclRecv(recv_staging + st->staging_begin[s] * row_bytes,
                    static_cast<size_t>(u) * row_bytes, ncclUint8, s, comms_->rows, stream),
           "ncclRecv");
    }
    MOONEP_RETURN_IF_ERROR(GroupEnd(comms_->rows, "combine-backward rows (ncclGroupEnd)"));
    MOONEP_RETURN_IF_ERROR(group);
    MOONEP_CUDA_RETURN_IF_ERROR(LaunchExpandRows(
        st->table<RowSource>(st->off_row_source), rank_rows, st->meta_recv_dev.get<RowMeta>(),
        recv_total, st->staging_begin_dev.get<int64_t>(), R, recv_staging, x_view.data, n_entries,
        K, st->weights_dev.get<float>(), row_bytes, rows_view.data, nullptr,
        st->bad_dev.get<int32_t>(), stream));
    MOONEP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(BadSlot(st, kind), st->bad_dev.get(), 4,
                        cudaMemcpyDeviceToHost, stream));
    return absl::OkStatus();
  };
  const char* name = OpName(kind);
  auto finish = [=]() -> absl::Status {
    const int32_t bad = *BadSlot(st, kind);
    if (bad != 0) return Fatal(Internal("%s: %d rows had an out-of-range index", name, bad));
    return absl::OkStatus();
  };
  return Run(std::move(op), {move}, finish);
}

absl::StatusOr<RequestPtr> NcclTransportImpl::StartCombineBackward(DispatchHandle* h,
                                                                   const TensorView& dy,
                                                                   const TensorView& dy_rows) {
  MOONEP_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(device_);
  FreeRetired();
  if (testing::ShouldSkip(rank_, OpKind::kCombineBackward)) return RequestPtr(new DoneRequest());
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kCombineBackward, h));
  absl::Status s = CheckRows(dy, "dy", h->num_tokens_, -1);
  if (s.ok() && dy.shape[0] != h->num_tokens_) {
    s = InvalidArgument("dy: has %d rows, need num_tokens = %d", dy.shape[0], h->num_tokens_);
  }
  if (s.ok()) s = CheckRows(dy_rows, "dy_rows", h->recv_.rank_rows, dy.shape[1]);
  if (s.ok() && dy_rows.dtype != dy.dtype) s = InvalidArgument("dy_rows: dtype differs from dy's");
  if (s.ok() && RangesOverlap(dy.data, dy.nbytes(), dy_rows.data, dy_rows.nbytes())) {
    s = InvalidArgument("dy and dy_rows overlap");
  }
  if (!s.ok()) return Fatal(Annotate(s, "combine-backward"));
  return StartRowsOut(OpKind::kCombineBackward, h, dy, dy_rows);
}

// Combine (weighted) and dispatch-backward (unweighted): the pack kernel lays this rank's rows out
// in receive order (one contiguous slice per source), grouped sends return them, the source
// receives them in its send order, and the combine kernel sums each token's entries in k order.
absl::StatusOr<RequestPtr> NcclTransportImpl::StartRowsBack(OpKind kind, DispatchHandle* h,
                                                            const TensorView& rows,
                                                            const TensorView& y) {
  const char* name = OpName(kind);
  absl::Status s =
      CheckRows(rows, kind == OpKind::kCombine ? "expert_rows" : "dx_rows", h->recv_.rank_rows, -1);
  if (s.ok()) {
    s = CheckRows(y, kind == OpKind::kCombine ? "y" : "dx", h->num_tokens_, rows.shape[1],
                  /*row_operand=*/false);
  }
  if (s.ok() && y.shape[0] != h->num_tokens_) {
    s = InvalidArgument("%s: has %d rows, need num_tokens = %d",
                        kind == OpKind::kCombine ? "y" : "dx", y.shape[0], h->num_tokens_);
  }
  if (s.ok() && RangesOverlap(rows.data, rows.nbytes(), y.data, y.nbytes())) {
    s = InvalidArgument("the rows and the output overlap");
  }
  if (!s.ok()) return Fatal(Annotate(s, name));
  const int32_t R = size_, me = rank_, K = h->top_k_;
  const int64_t T = h->num_tokens_, n_entries = T * K, H = rows.shape[1];
  HandleState* st = StateOf(h);
  const SendLayout& send = h->send_;
  const ReceiveLayout& recv = h->recv_;
  const int64_t recv_total = recv.rows_begin[R], sent_entries = send.entry_begin[R];
  const size_t row_bytes = static_cast<size_t>(H) * DTypeSize(rows.dtype);
  {
    absl::Status r = st->send_staging.Reserve(
        static_cast<size_t>(std::max<int64_t>(recv_total, 1)) * row_bytes, "send staging");
    if (r.ok())
      r = st->recv_staging.Reserve(
          static_cast<size_t>(std::max<int64_t>(sent_entries, 1)) * row_bytes, "receive staging");
    if (r.ok() && kind == OpKind::kDispatchBackward && st->ones_count < n_entries) {
      r = st->ones_dev.Reserve(static_cast<size_t>(n_entries) * 4, "unit weights");
      if (r.ok()) {
        std::vector<float> ones(static_cast<size_t>(n_entries), 1.0f);
        r = kernels::CudaStatus(
            cudaMemcpy(st->ones_dev.get(), ones.data(), ones.size() * 4, cudaMemcpyHostToDevice),
            "cudaMemcpy");
        if (r.ok()) st->ones_count = n_entries;
      }
    }
    if (!r.ok()) return Fatal(r);
  }
  auto op = NewOp(kind, rows_stream_, RowPeers(h));
  h->Track(op.get(), kind);
  NcclOp* raw = op.get();
  const cudaStream_t stream = rows_stream_;
  {
    OpCounters& c = raw->counters();
    c.rows_sent = recv_total - recv.rows_from(me);
    c.bytes_sent = c.rows_sent * static_cast<int64_t>(row_bytes);
    c.rows_received = sent_entries - send.rows_to(me);
    c.bytes_received = c.rows_received * static_cast<int64_t>(row_bytes);
    c.rows_local = send.rows_to(me);
  }
  const TensorView rows_view = rows, y_view = y;
  const float* weights =
      kind == OpKind::kCombine ? st->weights_dev.get<float>() : st->ones_dev.get<float>();
  auto move = [=]() -> absl::Status {
    const SendLayout& send = h->send_;
    const ReceiveLayout& recv = h->recv_;
    MOONEP_RETURN_IF_ERROR(raw->WaitCaller());
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st->bad_dev.get(), 0, 8, stream));
    char* send_staging = st->send_staging.get();
    char* recv_staging = st->recv_staging.get();
    if (recv_total > 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(kernels::LaunchPackRows(
          rows_view.data, rows_view.shape[0], st->table<int32_t>(st->off_pos_row), recv_total,
          send_staging, row_bytes, st->bad_dev.get<int32_t>(), stream));
    }
    absl::Status group;  // first enqueue error; the group is closed either way
    MOONEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (int32_t src = 0; src < R; ++src) {
      const int64_t n = recv.rows_from(src);
      if (src == me || n == 0) continue;
      Keep(&group,
           ncclSend(send_staging + recv.rows_begin[src] * row_bytes,
                    static_cast<size_t>(n) * row_bytes, ncclUint8, src, comms_->rows, stream),
           "ncclSend");
    }
    for (int32_t d = 0; d < R; ++d) {
      const int64_t n = send.rows_to(d);
      if (d == me || n == 0) continue;
      Keep(&group,
           ncclRecv(recv_staging + send.entry_begin[d] * row_bytes,
                    static_cast<size_t>(n) * row_bytes, ncclUint8, d, comms_->rows, stream),
           "ncclRecv");
    }
    MOONEP_RETURN_IF_ERROR(GroupEnd(comms_->rows, "rows back (ncclGroupEnd)"));
    MOONEP_RETURN_IF_ERROR(group);
    if (send.rows_to(me) > 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(recv_staging + send.entry_begin[me] * row_bytes,
                                                  send_staging + recv.rows_begin[me] * row_bytes,
                                                  static_cast<size_t>(send.rows_to(me)) * row_bytes,
                                                  cudaMemcpyDeviceToDevice, stream));
    }
    if (T > 0 && K == 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(y_view.data, 0, y_view.nbytes(), stream));
    } else if (T > 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(kernels::LaunchCombineRows(
          recv_staging, rows_view.dtype, sent_entries, st->table<int32_t>(st->off_combine_index),
          weights, T, K, H, y_view.data, y_view.dtype, st->bad_dev.get<int32_t>(), stream));
    }
    MOONEP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(BadSlot(st, kind), st->bad_dev.get(), 4,
                        cudaMemcpyDeviceToHost, stream));
    return absl::OkStatus();
  };
  auto finish = [=]() -> absl::Status {
    const int32_t bad = *BadSlot(st, kind);
    if (bad != 0) return Fatal(Internal("%s: %d rows had an out-of-range index", name, bad));
    return absl::OkStatus();
  };
  return Run(std::move(op), {move}, finish);
}

absl::StatusOr<RequestPtr> NcclTransportImpl::StartCombine(DispatchHandle* h,
                                                           const TensorView& expert_rows,
                                                           const TensorView& y) {
  MOONEP_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(device_);
  FreeRetired();
  if (testing::ShouldSkip(rank_, OpKind::kCombine)) return RequestPtr(new DoneRequest());
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kCombine, h));
  return StartRowsBack(OpKind::kCombine, h, expert_rows, y);
}

absl::StatusOr<RequestPtr> NcclTransportImpl::StartDispatchBackward(DispatchHandle* h,
                                                                    const TensorView& dx_rows,
                                                                    const TensorView& dx) {
  MOONEP_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(device_);
  FreeRetired();
  if (testing::ShouldSkip(rank_, OpKind::kDispatchBackward)) return RequestPtr(new DoneRequest());
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kDispatchBackward, h));
  return StartRowsBack(OpKind::kDispatchBackward, h, dx_rows, dx);
}

// d topk weights: one dot product per row where the rows are, one float back per row, scattered
// to (t, k) by the combine index (0 where the id is -1).
absl::StatusOr<RequestPtr> NcclTransportImpl::StartTopkWeightGrad(
    DispatchHandle* h, const TensorView& dy_rows, const TensorView& expert_rows,
    absl::Span<float> d_topk_weights) {
  MOONEP_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(device_);
  FreeRetired();
  if (testing::ShouldSkip(rank_, OpKind::kTopkWeightGrad)) return RequestPtr(new DoneRequest());
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kTopkWeightGrad, h));
  const int32_t R = size_, me = rank_, K = h->top_k_;
  const int64_t T = h->num_tokens_, n_entries = T * K;
  absl::Status s = CheckRows(dy_rows, "dy_rows", h->recv_.rank_rows, -1);
  if (s.ok()) s = CheckRows(expert_rows, "expert_rows", h->recv_.rank_rows, dy_rows.shape[1]);
  if (s.ok() && expert_rows.dtype != dy_rows.dtype) {
    s = InvalidArgument("expert_rows: dtype %s differs from dy_rows' %s",
                        DTypeName(expert_rows.dtype), DTypeName(dy_rows.dtype));
  }
  if (s.ok() && static_cast<int64_t>(d_topk_weights.size()) != n_entries) {
    s = InvalidArgument("d_topk_weights: has %d entries, need num_tokens * top_k = %d",
                        d_topk_weights.size(), n_entries);
  }
  if (s.ok() && n_entries > 0) s = CheckDevicePointer(d_topk_weights.data(), "d_topk_weights");
  if (!s.ok()) return Fatal(Annotate(s, "topk-weight-grad"));
  HandleState* st = StateOf(h);
  const SendLayout& send = h->send_;
  const ReceiveLayout& recv = h->recv_;
  const int64_t recv_total = recv.rows_begin[R], sent_entries = send.entry_begin[R];
  {
    absl::Status r = st->send_staging.Reserve(
        static_cast<size_t>(std::max<int64_t>(recv_total, 1)) * 4, "send staging");
    if (r.ok())
      r = st->recv_staging.Reserve(static_cast<size_t>(std::max<int64_t>(sent_entries, 1)) * 4,
                                   "receive staging");
    if (!r.ok()) return Fatal(r);
  }
  auto op = NewOp(OpKind::kTopkWeightGrad, rows_stream_, RowPeers(h));
  h->Track(op.get(), OpKind::kTopkWeightGrad);
  NcclOp* raw = op.get();
  const cudaStream_t stream = rows_stream_;
  {
    OpCounters& c = raw->counters();
    c.rows_sent = recv_total - recv.rows_from(me);
    c.bytes_sent = c.rows_sent * 4;
    c.rows_received = sent_entries - send.rows_to(me);
    c.bytes_received = c.rows_received * 4;
    c.rows_local = send.rows_to(me);
  }
  const TensorView a = dy_rows, b = expert_rows;
  float* dw = d_topk_weights.data();
  auto move = [=]() -> absl::Status {
    const SendLayout& send = h->send_;
    const ReceiveLayout& recv = h->recv_;
    MOONEP_RETURN_IF_ERROR(raw->WaitCaller());
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st->bad_dev.get(), 0, 8, stream));
    float* dots_send = st->send_staging.get<float>();
    float* dots_recv = st->recv_staging.get<float>();
    MOONEP_CUDA_RETURN_IF_ERROR(LaunchRowDots(a.data, b.data, a.dtype, a.shape[1],
                                              st->table<int32_t>(st->off_pos_row),
                                              std::min(a.shape[0], b.shape[0]), recv_total,
                                              dots_send, st->bad_dev.get<int32_t>(), stream));
    absl::Status group;  // first enqueue error; the group is closed either way
    MOONEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (int32_t src = 0; src < R; ++src) {
      const int64_t n = recv.rows_from(src);
      if (src == me || n == 0) continue;
      Keep(&group,
           ncclSend(dots_send + recv.rows_begin[src], static_cast<size_t>(n), ncclFloat32, src,
                    comms_->rows, stream),
           "ncclSend");
    }
    for (int32_t d = 0; d < R; ++d) {
      const int64_t n = send.rows_to(d);
      if (d == me || n == 0) continue;
      Keep(&group,
           ncclRecv(dots_recv + send.entry_begin[d], static_cast<size_t>(n), ncclFloat32, d,
                    comms_->rows, stream),
           "ncclRecv");
    }
    MOONEP_RETURN_IF_ERROR(GroupEnd(comms_->rows, "topk-weight-grad (ncclGroupEnd)"));
    MOONEP_RETURN_IF_ERROR(group);
    if (send.rows_to(me) > 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          dots_recv + send.entry_begin[me], dots_send + recv.rows_begin[me],
          static_cast<size_t>(send.rows_to(me)) * 4, cudaMemcpyDeviceToDevice, stream));
    }
    MOONEP_CUDA_RETURN_IF_ERROR(
        LaunchScatterValues(dots_recv, sent_entries, st->table<int32_t>(st->off_combine_index),
                            n_entries, dw, st->bad_dev.get<int32_t>(), stream));
    MOONEP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(BadSlot(st, OpKind::kTopkWeightGrad), st->bad_dev.get(), 4,
                        cudaMemcpyDeviceToHost, stream));
    return absl::OkStatus();
  };
  auto finish = [=]() -> absl::Status {
    const int32_t bad = *BadSlot(st, OpKind::kTopkWeightGrad);
    if (bad != 0)
      return Fatal(Internal("topk-weight-grad: %d rows had an out-of-range index", bad));
    return absl::OkStatus();
  };
  return Run(std::move(op), {move}, finish);
}

// ---------------------------------------------------------------------------------------------
// Weight ops: every (rank, slot, tensor) in increasing order on both sides, so the grouped sends
// and receives of one pair match in order.

absl::Status NcclTransportImpl::CheckBlocks(const planner::Plan& plan, const ExpertBlocks& b,
                                            const char* name) const {
  MOONEP_RETURN_IF_ERROR(common::CheckBlocks(plan, b, name, "NCCL", Device::kCuda));
  // The views say device memory; the pointers must be memory of this transport's GPU.
  auto check = [&](const TensorView& v, const char* part, size_t index) -> absl::Status {
    if (v.numel() == 0) return absl::OkStatus();
    return CheckDevicePointer(v.data, absl::StrFormat("%s.%s[%d]", name, part, index).c_str());
  };
  for (size_t i = 0; i < b.home.size(); ++i) MOONEP_RETURN_IF_ERROR(check(b.home[i], "home", i));
  for (size_t i = 0; i < b.slots.size(); ++i) MOONEP_RETURN_IF_ERROR(check(b.slots[i], "slots", i));
  return absl::OkStatus();
}

absl::StatusOr<RequestPtr> NcclTransportImpl::StartPrefetch(const planner::Plan& plan,
                                                            const ExpertBlocks& params) {
  MOONEP_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(device_);
  FreeRetired();
  if (testing::ShouldSkip(rank_, OpKind::kPrefetch)) return RequestPtr(new DoneRequest());
  MOONEP_RETURN_IF_ERROR(
      Annotate(common::CheckSlotPlan(plan, size_, /*home_replicas_supported=*/true), "prefetch"));
  {
    absl::Status s = CheckBlocks(plan, params, "params");
    if (!s.ok()) return Fatal(Annotate(s, "prefetch"));
  }
  const int32_t R = plan.num_ranks, S = plan.slots, nt = params.tensors_per_expert, me = rank_;
  // The transfers, listed once on the host (pointers stay valid: the caller keeps the blocks).
  struct Transfer {
    bool send;
    int peer;  // -1: a local copy from `from` (a home-rank replica, plan.home_replicas)
    void* data;
    size_t bytes;
    const void* from = nullptr;
  };
  std::vector<Transfer> transfers;
  std::vector<int> peers;
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t sl = 0; sl < S; ++sl) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * S + sl];
      if (e < 0) continue;
      const int32_t home = plan.home[e], g = plan.home_group[e];
      if (home != me && d != me) continue;
      if (home == me && d == me) {
        for (int32_t i = 0; i < nt; ++i) {
          const TensorView& src = params.home[static_cast<size_t>(g) * nt + i];
          const TensorView& dst = params.slots[static_cast<size_t>(sl) * nt + i];
          transfers.push_back({false, -1, dst.data, src.nbytes(), src.data});
        }
        continue;
      }
      for (int32_t i = 0; i < nt; ++i) {
        if (home == me) {
          const TensorView& src = params.home[static_cast<size_t>(g) * nt + i];
          transfers.push_back({true, d, src.data, src.nbytes()});
        } else {
          const TensorView& dst = params.slots[static_cast<size_t>(sl) * nt + i];
          transfers.push_back({false, home, dst.data, dst.nbytes()});
        }
      }
      const int peer = home == me ? d : home;
      if (std::find(peers.begin(), peers.end(), peer) == peers.end()) peers.push_back(peer);
    }
  }
  std::sort(peers.begin(), peers.end());
  auto op = NewOp(OpKind::kPrefetch, weights_stream_, peers);
  NcclOp* raw = op.get();
  for (const Transfer& t : transfers) {
    if (t.peer < 0) {
      ++raw->counters().rows_local;
    } else if (t.send) {
      ++raw->counters().rows_sent;
      raw->counters().bytes_sent += static_cast<int64_t>(t.bytes);
      ++raw->counters().messages_sent;
    } else {
      ++raw->counters().rows_received;
      raw->counters().bytes_received += static_cast<int64_t>(t.bytes);
    }
  }
  const cudaStream_t stream = weights_stream_;
  auto move = [=]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(raw->WaitCaller());
    if (transfers.empty()) return absl::OkStatus();
    for (const Transfer& t : transfers) {
      if (t.peer < 0 && t.bytes > 0) {
        MOONEP_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(t.data, t.from, t.bytes, cudaMemcpyDeviceToDevice, stream));
      }
    }
    absl::Status group;  // first enqueue error; the group is closed either way
    MOONEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (const Transfer& t : transfers) {
      if (t.bytes == 0 || t.peer < 0) continue;
      if (t.send) {
        Keep(&group, ncclSend(t.data, t.bytes, ncclUint8, t.peer, comms_->weights, stream),
             "ncclSend");
      } else {
        Keep(&group, ncclRecv(t.data, t.bytes, ncclUint8, t.peer, comms_->weights, stream),
             "ncclRecv");
      }
    }
    MOONEP_RETURN_IF_ERROR(GroupEnd(comms_->weights, "prefetch (ncclGroupEnd)"));
    return group;
  };
  return Run(std::move(op), {move}, nullptr);
}

absl::StatusOr<RequestPtr> NcclTransportImpl::StartReduce(const planner::Plan& plan,
                                                          const ExpertBlocks& grads) {
  MOONEP_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(device_);
  FreeRetired();
  if (testing::ShouldSkip(rank_, OpKind::kReduce)) return RequestPtr(new DoneRequest());
  MOONEP_RETURN_IF_ERROR(
      Annotate(common::CheckSlotPlan(plan, size_, /*home_replicas_supported=*/true), "reduce"));
  {
    absl::Status s = CheckBlocks(plan, grads, "grads");
    if (!s.ok()) return Fatal(Annotate(s, "reduce"));
  }
  const int32_t R = plan.num_ranks, S = plan.slots, nt = grads.tensors_per_expert, me = rank_;
  const int32_t epn = plan.experts_per_rank;
  struct Transfer {
    bool send;
    int peer;
    void* data;     // send: the slot's gradient; receive: unused (staging offset below)
    size_t offset;  // receive: offset in the staging
    size_t bytes;
  };
  std::vector<Transfer> transfers;
  std::vector<int> peers;
  // Incoming blocks per (home group, tensor), in increasing rank: the order of the sum. A source
  // is an offset in the staging, or (home-rank replicas, plan.home_replicas) the slot itself.
  struct Source {
    size_t offset;
    const void* direct;
  };
  std::vector<std::vector<Source>> sources(static_cast<size_t>(epn) * nt);
  size_t staging_bytes = 0;
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t sl = 0; sl < S; ++sl) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * S + sl];
      if (e < 0) continue;
      const int32_t home = plan.home[e], g = plan.home_group[e];
      if (home == d && d == me) {
        for (int32_t i = 0; i < nt; ++i) {
          sources[static_cast<size_t>(g) * nt + i].push_back(
              {0, grads.slots[static_cast<size_t>(sl) * nt + i].data});
        }
        continue;
      }
      if (home == d || (home != me && d != me)) continue;
      for (int32_t i = 0; i < nt; ++i) {
        if (d == me) {
          const TensorView& src = grads.slots[static_cast<size_t>(sl) * nt + i];
          transfers.push_back({true, home, src.data, 0, src.nbytes()});
        } else {
          const TensorView& dst = grads.home[static_cast<size_t>(g) * nt + i];
          transfers.push_back({false, d, nullptr, staging_bytes, dst.nbytes()});
          sources[static_cast<size_t>(g) * nt + i].push_back({staging_bytes, nullptr});
          staging_bytes += (dst.nbytes() + 255) / 256 * 256;
        }
      }
      const int peer = d == me ? home : d;
      if (std::find(peers.begin(), peers.end(), peer) == peers.end()) peers.push_back(peer);
    }
  }
  std::sort(peers.begin(), peers.end());
  size_t num_pointers = 0;
  for (const auto& list : sources) num_pointers += list.size();
  // This reduce's own staging and tables (another reduce may be in flight with its own); given
  // back to the pool when the reduce completes.
  ReduceStaging* mine = reduce_staging_.Acquire();
  {
    absl::Status s = mine->staging.Reserve(std::max<size_t>(staging_bytes, 256), "reduce staging");
    if (s.ok())
      s = mine->sources_dev.Reserve(std::max<size_t>(num_pointers, 1) * sizeof(void*),
                                    "reduce table");
    if (s.ok())
      s = mine->sources_host.Reserve(std::max<size_t>(num_pointers, 1) * sizeof(void*),
                                     "reduce table");
    if (!s.ok()) return Fatal(s);
  }
  // Source pointer table (device addresses of the staged blocks), uploaded with the op.
  struct Sum {
    void* home;
    DType dtype;
    int64_t n;
    size_t first;  // index in the pointer table
    int32_t count;
  };
  std::vector<Sum> sums;
  {
    const void** table = mine->sources_host.get<const void*>();
    size_t at = 0;
    for (size_t gi = 0; gi < sources.size(); ++gi) {
      if (sources[gi].empty()) continue;
      const TensorView& home = grads.home[gi];
      sums.push_back(
          {home.data, home.dtype, home.numel(), at, static_cast<int32_t>(sources[gi].size())});
      for (const Source& src : sources[gi]) {
        table[at++] = src.direct != nullptr ? src.direct : mine->staging.get() + src.offset;
      }
    }
  }
  auto op = NewOp(OpKind::kReduce, weights_stream_, peers);
  NcclOp* raw = op.get();
  for (const Transfer& t : transfers) {
    if (t.send) {
      ++raw->counters().rows_sent;
      raw->counters().bytes_sent += static_cast<int64_t>(t.bytes);
      ++raw->counters().messages_sent;
    } else {
      ++raw->counters().rows_received;
      raw->counters().bytes_received += static_cast<int64_t>(t.bytes);
    }
  }
  const cudaStream_t stream = weights_stream_;
  char* staging = mine->staging.get();
  const void* const* table_dev = mine->sources_dev.get<const void*>();
  const void* table_host = mine->sources_host.get();
  auto move = [=]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(raw->WaitCaller());
    if (transfers.empty() && sums.empty()) return absl::OkStatus();
    if (num_pointers > 0) {
      MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(const_cast<const void**>(table_dev), table_host,
                                                  num_pointers * sizeof(void*),
                                                  cudaMemcpyHostToDevice, stream));
    }
    absl::Status group;  // first enqueue error; the group is closed either way
    MOONEP_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (const Transfer& t : transfers) {
      if (t.bytes == 0) continue;
      if (t.send) {
        Keep(&group, ncclSend(t.data, t.bytes, ncclUint8, t.peer, comms_->weights, stream),
             "ncclSend");
      } else {
        Keep(&group,
             ncclRecv(staging + t.offset, t.bytes, ncclUint8, t.peer, comms_->weights, stream),
             "ncclRecv");
      }
    }
    MOONEP_RETURN_IF_ERROR(GroupEnd(comms_->weights, "reduce (ncclGroupEnd)"));
    MOONEP_RETURN_IF_ERROR(group);
    // ((replica of the lowest rank + the next) + ...) + home, in fp32, stored once: the order of
    // the host backends' chains. nccl still gathers every replica's gradient at the home (its
    // transfers are not chained: docs/transport-nccl.md).
    for (const Sum& sum : sums) {
      MOONEP_CUDA_RETURN_IF_ERROR(
          LaunchSumInOrder(sum.home, sum.dtype, sum.n, table_dev + sum.first, sum.count, stream));
    }
    return absl::OkStatus();
  };
  // The staging goes back to the pool once the reduce's device work completed (a failed reduce
  // keeps it: the transport is unusable then).
  auto finish = [this, mine]() -> absl::Status {
    reduce_staging_.Release(mine);
    return absl::OkStatus();
  };
  return Run(std::move(op), {move}, finish);
}

}  // namespace

absl::StatusOr<ncclUniqueId> GetUniqueId() {
  ncclUniqueId id{};
  MOONEP_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  return id;
}

absl::StatusOr<std::shared_ptr<NcclComms>> CreateNcclComms(const TransportOptions& options,
                                                           const NcclBootstrap& bootstrap) {
  return NcclComms::Create(options, bootstrap);
}

int DeviceOf(const NcclComms& comms) { return comms.device; }

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options,
                                                               std::shared_ptr<NcclComms> comms) {
  return NcclTransportImpl::Create(options, std::move(comms));
}

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options,
                                                               const NcclBootstrap& bootstrap) {
  MOONEP_ASSIGN_OR_RETURN(std::shared_ptr<NcclComms> comms, NcclComms::Create(options, bootstrap));
  return NcclTransportImpl::Create(options, std::move(comms));
}

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options) {
  return CreateNcclTransport(options, NcclBootstrap{});
}

}  // namespace moonep::transport::nccl
