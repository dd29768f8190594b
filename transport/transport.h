// The transport interface: moving rows and expert parameters between ranks as a Plan says.
// Backends (mpi/ always; ucx/, nccl/ where built) implement Transport; tests and the runtime pick
// one by name with CreateTransport, so one test suite covers every backend.
//
// One MoE layer step (every rank calls the same operations in the same order):
//
//   DispatchHandle h;                                  // reused across steps: keeps its storage
//   t->ExchangeCounts(ids, T, K, E, capacity_rows, &h);        // counts[R*E] in h.counts()
//   planner->MakePlan(h.counts(), &plan);
//   t->Prefetch(plan, weights);                                 // home -> replica slots
//   t->Dispatch(plan, x, topk_weights, &h, rows, row_weights);  // rows in the compute layout
//   ... experts compute out_rows from rows ...
//   t->Combine(&h, out_rows, y);                                // y[t] = sum_k w[t,k] out(t,k)
//   backward: CombineBackward(&h, dy, dy_rows); TopkWeightGrad(&h, dy_rows, out_rows, dw);
//             DispatchBackward(&h, dx_rows, dx); Reduce(plan, grads);
//
// Every operation has a blocking form and a Start* form that returns a Request (test / wait).
// Ops of the row class (counts, dispatch, combine, backward forms) and of the weight class
// (prefetch, reduce) run on separate channels, so a prefetch may overlap a dispatch. Buffers
// passed to a Start* call and the handle must stay valid until its request completes, or until
// the request is destroyed where it never completes.
//
// Errors: input that ExchangeCounts validates (expert ids, sizes, capacities) is agreed on by every
// rank: the offending rank gets InvalidArgument / OutOfMemory, every other rank RemoteError naming
// it, and the transport stays usable. Any other failure (a timeout, a peer's local error in another
// operation, an MPI error) leaves the transport unusable: later calls fail with InvalidUsage and
// the caller destroys it. No wait lasts longer than the timeout (MOONEP_TIMEOUT_MS).
//
// Operations on one handle overlap only where they share none of its state. A count exchange or a
// dispatch rewrites the handle (routing, counts, layouts): no other operation on the handle may be
// in flight when one starts, and none may start while one is in flight. Combine and
// dispatch-backward share the handle's row staging: one of them at a time. Operations of one kind
// go one at a time (their staging, nccl's error counter). So a combine-backward and a
// topk-weight-grad may overlap a combine or a dispatch-backward, and each other.
// Every backend refuses an overlapping start with InvalidUsage naming the operation in flight
// (DispatchHandle::CheckCanStart): a count exchange before anything reaches the peers (the
// transport stays usable), a row operation like any other misuse of its handle (a handle never
// counted): the peers are told where the backend can (AbortOperation) and the transport is
// unusable afterwards. A handle's row operations go to the transport that started its last count
// exchange; another transport refuses them the same way ("the handle has no count exchange of
// this transport").
//
// Destruction (Close, or the destructor) is collective too: every rank ends a communicator's
// transports in the same order (see Close). Host staging: see PrepareHandle.
#pragma once

#include <mpi.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "moonep/core/env.h"
#include "moonep/core/status.h"
#include "moonep/core/tensor.h"
#include "planner/plan.h"
#include "transport/layout.h"

namespace moonep::transport {

enum class OpKind : int32_t {
  kCounts = 0,
  kDispatch,
  kCombine,
  kCombineBackward,
  kDispatchBackward,
  kTopkWeightGrad,
  kPrefetch,
  kReduce,
  kNumKinds,
};
const char* OpName(OpKind kind);

// Per operation kind, summed over calls since creation (or ResetCounters). Rows are token rows
// (or expert tensors for prefetch/reduce); bytes include per-row metadata. Local rows are copied
// without the network and are not counted as sent or received.
struct OpCounters {
  int64_t calls = 0;
  int64_t rows_sent = 0, bytes_sent = 0;
  int64_t rows_received = 0, bytes_received = 0;
  int64_t rows_deduplicated = 0, bytes_deduplicated = 0;  // rows/bytes dedup kept off the wire
  int64_t rows_local = 0;
  int64_t messages_sent = 0;
};

// Limits of TransportOptions, checked at creation (InvalidArgument naming the field):
// max_tokens * max_top_k <= kMaxEntries (layout.h: entries are indexed with int32), and for the
// host backends max_row_bytes <= kMaxRowBytes (MPI counts a row's bytes with an int).
constexpr int64_t kMaxRowBytes = int64_t{1} << 30;
// The most experts an ExchangeCounts describes (a count message holds one int64 per expert): the
// runtime's own bound (moonep/runtime/layer_config.h, kMaxLayerExperts). Above it the call fails
// like a bad num_experts; a count message of INT32_MAX experts overflowed its width and aborted.
constexpr int32_t kMaxExperts = int32_t{1} << 20;
// A longer timeout (options or MOONEP_TIMEOUT_MS) is taken as this one (about 31.7 years): a
// deadline of now() + timeout must stay within the clock's range.
constexpr int64_t kMaxTimeoutMs = param::kMaxTimeoutMs;

struct TransportOptions {
  MPI_Comm comm = MPI_COMM_WORLD;  // bootstrap communicator; always duplicated, never used raw
  // Declared maxima: staging buffers are sized from them once; larger calls fail with OutOfMemory.
  int64_t max_tokens = 0;     // largest num_tokens this rank passes
  int32_t max_top_k = 0;      // largest top_k
  int64_t max_row_bytes = 0;  // largest row (hidden * dtype size) passed to any row operation
  int64_t timeout_ms = 0;     // 0: MOONEP_TIMEOUT_MS; above kMaxTimeoutMs: kMaxTimeoutMs
  // Host threads for each dispatch's layouts and tables, the calling thread included (at most
  // kMaxHostThreads). 0: MOONEP_HOST_THREADS, else automatic (common::HostThreads).
  int32_t host_threads = 0;
  // Prefetch and reduce move each expert tensor along its replica chain in chunks of this many
  // bytes (reduce partials are fp32; common/replica_chain.h): smaller chunks fill a long chain
  // sooner, larger ones send fewer messages. 0: MOONEP_REPLICA_CHUNK_BYTES, else 1 MiB; else in
  // [16, 2^30]; the same on every rank (the host backends check it at creation).
  int64_t replica_chunk_bytes = 0;
};
constexpr int32_t kMaxHostThreads = 64;

// Per-expert parameter (or gradient) blocks of one rank: any number of tensors per expert (gate,
// up, down, ...). Tensor i of every expert has the same dtype and element count on every rank.
struct ExpertBlocks {
  int32_t tensors_per_expert = 0;
  // home[g * tensors_per_expert + i]: tensor i of this rank's home group g (plan.local_experts).
  absl::Span<const TensorView> home;
  // slots[s * tensors_per_expert + i]: tensor i of replica slot s (plan.slot_expert).
  absl::Span<const TensorView> slots;
};

// State of one dispatch, reused by combine and the backward forms (no re-planning). Owned by the
// caller; reusing one handle across steps reuses its storage.
class DispatchHandle {
 public:
  absl::Span<const int64_t> counts() const { return counts_; }  // [R*E], valid after counts
  int64_t num_tokens() const { return num_tokens_; }
  int32_t top_k() const { return top_k_; }
  int32_t num_experts() const { return num_experts_; }
  bool dispatched() const { return dispatched_; }
  const planner::Plan& plan() const { return plan_; }
  const SendLayout& send_layout() const { return send_; }
  const ReceiveLayout& receive_layout() const { return recv_; }
  absl::Span<const float> topk_weights() const { return topk_weights_; }
  int64_t tokens_of_rank(int32_t r) const { return rank_tokens_[r]; }
  // Makes this handle's next count exchange refuse on this rank with `reason` (its arguments are
  // then not looked at): for a caller that found its own arguments wrong and still joins the
  // exchange, so that every rank fails it at once. The peers' RemoteError carries the reason
  // over mpi and ucx. Whatever the reason's code, the exchange refuses with InvalidArgument and
  // that message, an agreed error (every rank fails it, the transport stays usable): the caller
  // returns its own status.
  void RefuseNextCountExchange(const absl::Status& reason) {
    refusal_ = reason.ok() ? absl::OkStatus() : InvalidArgument("%s", reason.message());
  }
  // The refusal set above (OK if none), cleared: the transports' count exchange takes it.
  absl::Status TakeRefusal() { return std::exchange(refusal_, absl::OkStatus()); }

  // Fields below are written by backends.
  int32_t rank_ = 0, num_ranks_ = 0;
  int64_t num_tokens_ = 0;
  int32_t top_k_ = 0, num_experts_ = 0;
  bool counted_ = false, dispatched_ = false;
  // Operations on this handle that have started and not ended, per kind (every backend marks
  // them with Track). A copy of the handle starts with none: operations write only the original.
  struct InFlight {
    std::array<int32_t, static_cast<size_t>(OpKind::kNumKinds)> ops{};
    InFlight() = default;
    InFlight(const InFlight&) {}
    InFlight& operator=(const InFlight&) { return *this; }
  } in_flight_;
  // Whether an operation of `kind` may start on this handle now (Transport: "Operations on one
  // handle"): InvalidUsage "<kind>: the handle's <other> has not ended; ..." naming an operation
  // in flight on it that `kind` would overlap, else OK.
  absl::Status CheckCanStart(OpKind kind) const;
  // InvalidUsage "<what>: the handle's <kind> has not ended; ..." while any operation is in flight
  // on the handle (PrepareHandle, which may reallocate its staging), else OK.
  absl::Status CheckIdle(const char* what) const;
  // For backends: marks `kind` in flight on this handle until `op` ends (its OnEnd callback runs
  // once, when the request completes, fails or is destroyed). Call before anything can end `op`.
  template <typename Op>
  void Track(Op* op, OpKind kind) {
    ++in_flight_.ops[static_cast<size_t>(kind)];
    op->OnEnd([this, kind] { --in_flight_.ops[static_cast<size_t>(kind)]; });
  }
  // The number of this handle's count exchange among its transport's count exchanges, so that a
  // call on another dispatch's handle is found (mpi: the low bits go into the tags of the row
  // operations on this handle; ucx: their control messages carry it).
  int64_t exchange_no_ = -1;
  // Transport::serial() of the transport that started the handle's last count exchange: the row
  // operations on the handle go to it (another transport refuses them with InvalidUsage, as for a
  // handle never counted).
  uint64_t counted_by_ = 0;
  absl::Status refusal_;  // RefuseNextCountExchange
  std::vector<int32_t> topk_ids_;
  std::vector<float> topk_weights_;
  std::vector<int64_t> counts_, offsets_, rank_tokens_, rank_capacity_;
  planner::Plan plan_;
  SendLayout send_;
  ReceiveLayout recv_;
  // Receiver side of dedup, from the senders' per-row metadata, per source s (receive order):
  // recv_unique_[rows_begin[s] + i] is the unique row index (within s's unique rows) of the i-th
  // row from s; landing_[rows_begin[s] + u] (u < unique_from_[s]) is the row where unique row u
  // lands; the other rows of u are copies of it.
  std::vector<int32_t> recv_unique_;
  std::vector<int64_t> landing_, unique_from_;
  // Host staging of the host backends: allocated by Transport::PrepareHandle, else at first use
  // (see there); reused while the handle lives, never shrunk.
  std::vector<char> meta_send_, meta_recv_, rows_staging_;
  std::vector<float> scalar_staging_;
  // The host backends' PrepareHandle: reserves the staging it lists for `max_entries` routing
  // entries (max_tokens * max_top_k), rows of `max_row_bytes` and `recv_capacity_rows`.
  // OutOfMemory when an allocation fails.
  absl::Status ReserveHostStaging(int64_t max_entries, int64_t max_row_bytes,
                                  int64_t recv_capacity_rows);
  // Bytes the host staging holds now (what PrepareHandle allocated, or first uses grew).
  size_t HostStagingBytes() const {
    return meta_send_.capacity() + meta_recv_.capacity() + rows_staging_.capacity() +
           scalar_staging_.capacity() * sizeof(float);
  }
};

class Request {
 public:
  virtual ~Request() = default;
  // Makes progress without blocking. True when complete; an error when the operation failed
  // (including its deadline passing).
  virtual absl::StatusOr<bool> Test() = 0;
  // Blocks until complete, failed, or the deadline passed (Timeout naming phase and peers).
  virtual absl::Status Wait() = 0;
};
using RequestPtr = std::unique_ptr<Request>;

class Transport {
 public:
  virtual ~Transport() = default;
  // A number no other transport of this process had (1, 2, ...; DispatchHandle::counted_by_): an
  // address could be a destroyed transport's.
  uint64_t serial() const { return serial_; }
  virtual const char* backend() const = 0;
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  virtual int64_t timeout_ms() const = 0;

  // Validates this rank's routing (ids in [-1, E), no expert twice per token, T <= max_tokens,
  // K <= max_top_k), then allgathers counts[E] with a validity flag, T and the rank's receive
  // capacity (rows its dispatch buffer holds). Fills handle->counts() = [R*E]. A handle's previous
  // count exchange must have ended (its Wait, or a Test that returned true or an error) before the
  // next starts on it, and so must every other operation on the handle (see "Operations on one
  // handle" above): every backend refuses otherwise with InvalidUsage, before anything reaches
  // the peers, and stays usable.
  virtual absl::StatusOr<RequestPtr> StartExchangeCounts(absl::Span<const int32_t> topk_ids,
                                                         int64_t num_tokens, int32_t top_k,
                                                         int32_t num_experts,
                                                         int64_t recv_capacity_rows,
                                                         DispatchHandle* handle) = 0;
  // Sends x[T, H] rows (one per token and destination rank) to the compute layout of `plan`
  // (made from handle->counts()). recv_rows[capacity, H] (x's dtype) receives this rank's
  // plan.rank_rows rows, duplicates expanded, padding zeroed; recv_weights[capacity] the top-k
  // weight of each row (0 on padding). topk_weights: [T*K] fp32.
  virtual absl::StatusOr<RequestPtr> StartDispatch(const planner::Plan& plan, const TensorView& x,
                                                   absl::Span<const float> topk_weights,
                                                   DispatchHandle* handle,
                                                   const TensorView& recv_rows,
                                                   absl::Span<float> recv_weights) = 0;
  // y[t] = sum_k w[t,k] * expert_rows[row(t,k)], accumulated in fp32, y fp32 or bf16 [T, H].
  virtual absl::StatusOr<RequestPtr> StartCombine(DispatchHandle* handle,
                                                  const TensorView& expert_rows,
                                                  const TensorView& y) = 0;
  // The dispatch of dy[T, H] with the saved layout: dy_rows[capacity, H] like recv_rows.
  virtual absl::StatusOr<RequestPtr> StartCombineBackward(DispatchHandle* handle,
                                                          const TensorView& dy,
                                                          const TensorView& dy_rows) = 0;
  // dx[t] = sum_k dx_rows[row(t,k)] (unweighted), fp32 accumulation.
  virtual absl::StatusOr<RequestPtr> StartDispatchBackward(DispatchHandle* handle,
                                                           const TensorView& dx_rows,
                                                           const TensorView& dx) = 0;
  // d_topk_weights[t*K+k] = <dy[t], expert_out(t,k)>, computed where the rows are (dy_rows from
  // CombineBackward, expert_rows as given to Combine) and sent back as one float per row; 0 where
  // the id is -1.
  virtual absl::StatusOr<RequestPtr> StartTopkWeightGrad(DispatchHandle* handle,
                                                         const TensorView& dy_rows,
                                                         const TensorView& expert_rows,
                                                         absl::Span<float> d_topk_weights) = 0;
  // For every replica slot of the plan, the home rank's blocks of that expert into the slot: along
  // the expert's chain home -> lowest holder rank -> next ... (common/replica_chain.h), so the home
  // sends one copy whatever the replica count. A holder passes chunks on (and a home posts past
  // the first ones) only while its rank tests or waits an operation of the same transport (every
  // operation's Test moves the transport's prefetches and reduces in flight): ranks that wait on
  // weight operations of two transports in different orders may wait on each other until the
  // timeout.
  virtual absl::StatusOr<RequestPtr> StartPrefetch(const planner::Plan& plan,
                                                   const ExpertBlocks& params) = 0;
  // Every replica slot's gradients added into its home expert's gradients:
  // ((replica of the lowest rank + the next) + ...) + home, in fp32, stored once (the same bits on
  // every backend and run to run); the host backends sum along the chain lowest holder -> next
  // ... -> home, so the home receives one sum whatever the replica count. The home stores each
  // chunk's sum as it arrives: after a failed reduce its gradients are partly summed (undefined).
  virtual absl::StatusOr<RequestPtr> StartReduce(const planner::Plan& plan,
                                                 const ExpertBlocks& grads) = 0;

  // Allocates `handle`'s staging for this transport's declared maxima (TransportOptions) and a
  // receive capacity of `recv_capacity_rows` rows, so that no later operation on the handle
  // allocates a buffer of that size. The host backends (mpi, ucx) reserve, in host memory:
  //   rows      max_tokens * max_top_k * max_row_bytes                (combine, dispatch-backward)
  //   metadata  (max_tokens * max_top_k + recv_capacity_rows) * 8      (dispatch, both ways)
  //   scalars   max(max_tokens * max_top_k, recv_capacity_rows) * 4   (topk-weight-grad)
  // (DispatchHandle::HostStagingBytes() reports them). Local; OutOfMemory when they cannot be
  // allocated (the transport stays usable, the handle may keep part of them); InvalidUsage while
  // an operation is in flight on the handle (reserving may move its staging). A handle that was
  // not prepared allocates each part at its first use instead, in the middle of a collective
  // operation: the metadata at its first dispatch, the rows at its first combine or
  // dispatch-backward (a failure to allocate them fails that operation on this rank with
  // OutOfMemory and its peers with RemoteError, and leaves the transport unusable), the scalars at
  // its first topk-weight-grad. The runtime prepares every handle of a layer or EP buffer at
  // creation, where a failure is agreed by every rank instead.
  // The default does nothing and returns OK: right for backends that keep no host staging in the
  // handle (nccl keeps its device staging in its own per-handle state).
  virtual absl::Status PrepareHandle(DispatchHandle* handle, int64_t recv_capacity_rows);
  // Bytes of staging this transport holds for `handle` now. The host backends: the handle's host
  // staging (DispatchHandle::HostStagingBytes). nccl: the handle's device and pinned tables and
  // row staging, as allocated so far (they grow to a step's sizes in its first steps, and an
  // outgrown allocation stays held until no operation is in flight). Local; the transport must
  // not be running an operation on the handle from another thread.
  virtual size_t HandleStagingBytes(const DispatchHandle& handle) const {
    return handle.HostStagingBytes();
  }

  // Ends the transport. Collective, like creation: every rank closes (or destroys) the transports
  // of a communicator in the same order. The host backends agree, within the timeout, that every
  // peer got here too before they free their communicators, and return OK, or Timeout naming the
  // peers not heard from (a peer that failed, hangs, or closes its transports in another order);
  // their communicators then stay allocated (a late peer's messages may still arrive), everything
  // else is freed as usual (by Close or the destructor). Every request of the transport must have
  // completed or been destroyed before. Operations after Close fail with InvalidUsage; a second
  // Close returns the first one's result. The destructor closes a transport that was not
  // closed (logging a WARN when that timed out). The default returns OK (nccl: its destructor
  // drains its streams, bounded by the timeout; nothing collective).
  virtual absl::Status Close();

  virtual OpCounters counters(OpKind kind) const = 0;
  virtual void ResetCounters() = 0;
  // OK while the transport is usable; after a failure the ranks did not agree on (a timeout, a
  // peer's abort notice, an MPI error), the status of that failure. Callers use it to tell an
  // agreed, recoverable error from one that leaves the transport unusable.
  virtual absl::Status health() const { return absl::OkStatus(); }
  // Fails operation `kind` on this rank with `status`, a local error found before the operation
  // reached the transport (a caller's argument the runtime checks), and returns it. The host
  // backends tell every peer, which fail their `kind` (the one in flight, or their next
  // operation) at once with RemoteError naming this rank; the transport is unusable afterwards,
  // as after any failure the ranks did not agree on. A transport already unusable sends nothing
  // more. The default (nccl) only returns `status`: its peers time out naming this rank.
  virtual absl::Status AbortOperation(OpKind /*kind*/, absl::Status status) { return status; }

  // Blocking forms.
  absl::Status ExchangeCounts(absl::Span<const int32_t> topk_ids, int64_t num_tokens,
                              int32_t top_k, int32_t num_experts, int64_t recv_capacity_rows,
                              DispatchHandle* handle);
  absl::Status Dispatch(const planner::Plan& plan, const TensorView& x,
                        absl::Span<const float> topk_weights, DispatchHandle* handle,
                        const TensorView& recv_rows, absl::Span<float> recv_weights);
  absl::Status Combine(DispatchHandle* handle, const TensorView& expert_rows, const TensorView& y);
  absl::Status CombineBackward(DispatchHandle* handle, const TensorView& dy,
                               const TensorView& dy_rows);
  absl::Status DispatchBackward(DispatchHandle* handle, const TensorView& dx_rows,
                                const TensorView& dx);
  absl::Status TopkWeightGrad(DispatchHandle* handle, const TensorView& dy_rows,
                              const TensorView& expert_rows, absl::Span<float> d_topk_weights);
  absl::Status Prefetch(const planner::Plan& plan, const ExpertBlocks& params);
  absl::Status Reduce(const planner::Plan& plan, const ExpertBlocks& grads);

 private:
  static uint64_t NextSerial();
  const uint64_t serial_ = NextSerial();
};

// Backends built into this library ("mpi" always).
std::vector<std::string> AvailableBackends();

// The MOONEP_* variables `backend` reads (MOONEP_TIMEOUT_MS, MOONEP_DEBUG, MOONEP_HOST_THREADS; for
// "ucx" also MOONEP_UCX_EAGER_BYTES), parsed strictly: InvalidArgument naming a malformed one.
// Local: a caller that creates transports on several ranks checks it before anything collective, so
// that a value wrong on one rank only fails every rank (the runtime folds it into its creation
// agreement).
absl::Status CheckTransportEnvironment(absl::string_view backend);

// Creates a transport of the named backend; collective over options.comm.
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(absl::string_view backend,
                                                           const TransportOptions& options);

}  // namespace moonep::transport
