#include "transport/mpi/mpi_transport.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moonep/core/env.h"
#include "moonep/core/logging.h"
#include "moonep/core/status.h"
#include "planner/plan_builder.h"
#include "transport/common/buffer_pool.h"
#include "transport/common/count_exchange.h"
#include "transport/common/host_checks.h"
#include "transport/common/host_rows.h"
#include "transport/common/replica_chain.h"
#include "transport/layout.h"
#include "transport/testing_hooks.h"

namespace moonep::transport::mpi {
namespace {

using Clock = std::chrono::steady_clock;

// Message kinds inside one operation (sub-tags). The tag is
// (((slot of the sequence number) * kKinds + operation kind) * handle tags + dispatch bits)
// * kSubTags + sub-tag: the operation's kind is part of it, so that a message of one kind is never
// taken by an operation of another when ranks call different operations, and so are the low bits
// of the dispatch whose handle a row operation uses (the number of its count exchange among the
// transport's, mod MpiTransport::handle_tags_: 16 where MPI_TAG_UB allows it), so that rows of
// one dispatch are never taken by an operation on the handle of any of the 15 before or after it
// (MpiOp::CheckCallOrder finds both cases).
constexpr int kSubTags = 4;
constexpr int kKinds = static_cast<int>(OpKind::kNumKinds);
constexpr int kSubMeta = 0, kSubData = 1, kSubScalar = 2;
// A nudge: what an operation waiting on a peer sends it once (after kNudgeAfter), on abort_comm_
// with the transport's nudge tag: {channel, sequence number, kind}. Where two ranks called
// different operations that each only wait on the other, no other message would show it. Every
// rank reads all the nudges that came (one wildcard probe) whenever it checks the call order.
struct Nudge {
  int64_t channel = 0, seq = 0, kind = 0, dispatch_bits = 0;
};
constexpr int kNudgeWords = 4;
// Dispatch bits per tag where MPI_TAG_UB allows at least kMinTagSlots slots with them (Open
// MPI's 2^31 - 1 does), else fewer (down to 1: none, at the standard's minimum of 32767).
constexpr int kMaxHandleTags = 16;
constexpr int64_t kMinTagSlots = 1024;

struct RowMeta {  // per dispatched row, sender -> receiver: its unique row and its top-k weight
  int32_t unique;
  float weight;
};
static_assert(sizeof(RowMeta) == 8, "RowMeta is sent as bytes");

// The MPI datatype of one RowMeta (8 bytes), made once per transport.
struct MetaType {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  absl::Status Make();
  ~MetaType() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (type != MPI_DATATYPE_NULL && !finalized) MPI_Type_free(&type);
  }
};

absl::Status MpiCheck(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return absl::OkStatus();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return SystemError("%s failed: %s", what, std::string(text, len));
}

using common::RankList;

absl::Status MetaType::Make() {
  MOONEP_RETURN_IF_ERROR(
      MpiCheck(MPI_Type_contiguous(sizeof(RowMeta), MPI_BYTE, &type), "MPI_Type_contiguous"));
  return MpiCheck(MPI_Type_commit(&type), "MPI_Type_commit");
}

// When an operation that waits first looks at its peers' unmatched messages (CheckCallOrder), the
// longest interval between looks (the interval doubles from the first), when it nudges the peers
// it waits on, and how many peers' queues a count exchange looks at when it completes. The checks
// cost nothing to an operation that completes within a millisecond; at scale an operation that
// waits looks at its peers about log2(its time / 1 ms) + its time / 64 ms times, and nudges them
// only past 20 ms (a straggler, or two calls that wait on each other).
constexpr auto kOrderCheckFirst = std::chrono::milliseconds(1);
constexpr auto kOrderCheckMax = std::chrono::milliseconds(64);
constexpr auto kNudgeAfter = std::chrono::milliseconds(20);
constexpr int kOrderProbePeers = 16;

// Names this backend in argument errors ("the MPI transport needs host memory").
constexpr char kBackendName[] = "MPI";

class MpiTransport;

// One operation in flight: a set of MPI requests, each tied to a peer, plus the steps that follow
// arrivals (post the next receive, expand duplicates) and the final local work (accumulate).
class MpiOp : public Request {
 public:
  // `dispatch`: the number of the count exchange of the handle a row operation uses among the
  // transport's count exchanges (-1: none, weight operations).
  MpiOp(MpiTransport* transport, OpKind kind, MPI_Comm comm, int64_t seq, int64_t dispatch = -1);
  ~MpiOp() override;
  absl::StatusOr<bool> Test() override;
  absl::Status Wait() override;

  // Runs the op's local start work; on error the op is failed (and the transport poisoned).
  absl::Status Begin(absl::Status started);
  // fn runs once, when the op ends: completed, failed, or destroyed unfinished.
  void OnEnd(std::function<void()> fn) { on_end_ = std::move(fn); }

 protected:
  // Fails an unfinished op (cancels its receives); derived destructors call it first, so that no
  // receive is left writing into members being destroyed.
  void Release();

 protected:
  struct Pending {
    int peer = 0;
    bool recv = false;
    int kind = 0;            // op-specific meaning (e.g. metadata vs data)
    int64_t expect = -1;     // bytes a receive must get (-1: any)
  };
  absl::Status PostSend(const void* buf, int count, MPI_Datatype type, int peer, int sub,
                        int kind = 0);
  absl::Status PostRecv(void* buf, int count, MPI_Datatype type, int peer, int sub,
                        int64_t expect_bytes, int kind = 0);
  // A receive of request `index` completed (its size already checked).
  virtual absl::Status OnReceived(size_t /*index*/) { return absl::OkStatus(); }
  // A send of request `index` completed.
  virtual absl::Status OnSent(size_t /*index*/) { return absl::OkStatus(); }
  // All requests completed: the local work that remains.
  virtual absl::Status Finish() { return absl::OkStatus(); }
  // Size mismatches that every rank sees in the same operation (count exchange) are reported
  // without poisoning; others are fatal.
  virtual bool OnSizeMismatch(size_t /*index*/, int64_t /*got*/) { return false; }

  // True when a send was released unfinished: MPI may still read its buffer later, so buffers
  // the op owns must then outlive it.
  bool sends_released() const { return sends_released_; }
  // True when a receive was released uncancelled: MPI may still write into its buffer later.
  bool receives_released() const { return receives_released_; }

  MpiTransport* transport_;
  OpKind kind_;
  MPI_Comm comm_;
  int channel_;  // 0: row operations, 1: weight operations (their own communicators)
  int64_t seq_;
  int dispatch_bits_;  // the dispatch's number mod the transport's handle tags
  int tag_base_;
  int me_;
  OpCounters counters_;
  std::vector<Pending> pending_;

 private:
  absl::Status Fail(absl::Status status, bool notify_peers = true);
  void Cleanup();
  absl::Status TimeoutStatus() const;
  // Whether a peer this op waits on called another operation at this point (or left a message of
  // another kind behind): probes each peer's first unmatched messages on this op's communicator
  // (MpiTransport::CheckPeerOrder), after reading the nudges that came (ReadNudges). `all_peers`:
  // up to kOrderProbePeers peers in turn, else the peers of requests still pending; those of
  // pending receives are sent a nudge once this op has waited kNudgeAfter.
  absl::Status CheckCallOrder(bool all_peers);
  void Ended();

  std::function<void()> on_end_;
 protected:
  bool chain_ = false;  // in the transport's chain ops until it ends (ChainOp)
 private:
  std::vector<MPI_Request> requests_;
  std::vector<int> indices_;
  std::vector<MPI_Status> statuses_;
  int active_ = 0;
  bool done_ = false, sends_released_ = false, receives_released_ = false;
  absl::Status status_;
  Clock::time_point deadline_;
  Clock::time_point start_;
  Clock::time_point next_order_check_;
  Clock::duration order_check_interval_ = kOrderCheckFirst;
  bool nudged_ = false;
  int64_t timeout_ms_;
};

class MpiTransport : public Transport {
 public:
  ~MpiTransport() override;
  static absl::StatusOr<std::unique_ptr<Transport>> Create(const TransportOptions& options);

  const char* backend() const override { return "mpi"; }
  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  int64_t timeout_ms() const override { return timeout_ms_; }
  // How MpiOp::Wait waits: polling without sleeps while this node has a core per rank, else
  // sleeping between polls (common::SpinWaits).
  bool spin_waits() const { return spin_waits_; }
  // Elements per chunk of an expert tensor along a replica chain (replica_chunk_bytes).
  int64_t replica_chunk_elements() const { return replica_chunk_elements_; }

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
  absl::StatusOr<RequestPtr> StartTopkWeightGrad(DispatchHandle* handle,
                                                 const TensorView& dy_rows,
                                                 const TensorView& expert_rows,
                                                 absl::Span<float> d_topk_weights) override;
  absl::StatusOr<RequestPtr> StartPrefetch(const planner::Plan& plan,
                                           const ExpertBlocks& params) override;
  absl::StatusOr<RequestPtr> StartReduce(const planner::Plan& plan,
                                         const ExpertBlocks& grads) override;

  absl::Status PrepareHandle(DispatchHandle* handle, int64_t recv_capacity_rows) override;
  absl::Status Close() override;

  OpCounters counters(OpKind kind) const override { return counters_[static_cast<int>(kind)]; }
  void ResetCounters() override { counters_.fill(OpCounters{}); }
  absl::Status health() const override { return poisoned_; }

  // Shared with ops.
  const TransportOptions& options() const { return options_; }
  // Tags: (epoch, op sequence) -> a slot of kSubTags tags. The epoch, agreed at creation and new
  // for every transport, keeps messages left over from a failed transport out of a later one:
  // MPI reuses a freed communicator's context id, and early-arriving messages for it would be
  // matched by the next communicator that gets the id.
  int TagBase(int64_t seq, OpKind kind, int dispatch_bits) const {
    const int64_t slot = (epoch_ * seqs_per_epoch_ + seq % seqs_per_epoch_) % tag_slots_;
    return static_cast<int>(
        ((slot * kKinds + static_cast<int>(kind)) * handle_tags_ + dispatch_bits) * kSubTags);
  }
  // The bits of dispatch number `dispatch` in a tag (0 for none).
  int DispatchBits(int64_t dispatch) const {
    return dispatch < 0 ? 0 : static_cast<int>(dispatch % handle_tags_);
  }
  int Channel(MPI_Comm comm) const { return comm == rows_comm_ ? 0 : 1; }
  // Records the kind and dispatch bits of this rank's operation `seq` of `channel` (for
  // CheckCallOrder) and checks the nudges that came for it before it started.
  void NoteStarted(int channel, int64_t seq, OpKind kind, int dispatch_bits);
  // Sends `peer` a nudge for this rank's operation `seq` of `channel`, of `kind`.
  void SendNudge(int peer, int channel, int64_t seq, OpKind kind, int dispatch_bits);
  // Reads every nudge that came; the call-order error found by them or at NoteStarted, if any.
  absl::Status ReadNudges();
  absl::Status call_order_error() const { return call_order_error_; }
  // Reads `peer`'s first unmatched message on `channel`'s communicator (MPI_Iprobe; only data
  // travels there): the error naming both calls when it belongs to an operation this rank started
  // as another kind.
  absl::Status CheckPeerOrder(int channel, int peer);
  // The first of the next `n` peers (counted from this rank + 1) whose queues a count exchange
  // looks at.
  int64_t TakeOrderProbeTurn(int n) { return std::exchange(order_probe_next_, order_probe_next_ + n); }
  void AddCounters(OpKind kind, const OpCounters& c);
  // The transport is unusable after a failure that ranks did not agree on.
  void Poison(const absl::Status& status);
  absl::Status Usable() const;
  // Tells every peer that this rank failed `kind` (they fail with RemoteError), then poisons.
  absl::Status AbortPeers(OpKind kind, absl::Status status);
  // Once poisoned, the peers failed or were told already: a second notice would find no
  // receiver (each peer posts one).
  absl::Status AbortOperation(OpKind kind, absl::Status status) override {
    return poisoned_.ok() ? AbortPeers(kind, std::move(status)) : status;
  }
  // Checks for a peer's abort notice: a failure notice fails at once. A notice that the peer gave up
  // waiting (timed out) is kept and fails only an operation that starts or completes after it
  // (`gave_up_too`): one still waiting keeps waiting, so that its own timeout names the rank it
  // waits for rather than the peer that gave up first.
  absl::Status PollAbort(bool gave_up_too = false);
  // Receives a peer's notice, if one came, and keeps it for PollAbort; whether a peer gave up.
  bool PeerGaveUp();
  // Reduce staging: one buffer per reduce in flight, reused.
  common::BufferPool<std::vector<char>> reduce_staging;
  MetaType meta_type;  // dispatch metadata, counted in rows
  // Prefetches and reduces in flight (chains: a holder passes a chunk on from its op's Test).
  // Every op's Test moves the others on too (ProgressChains), so chunks pass through this rank
  // while it waits on a dispatch or on another weight op, whatever order the ranks wait in.
  void AddChainOp(MpiOp* op) { chain_ops_.Add(op); }
  void RemoveChainOp(MpiOp* op) { chain_ops_.Remove(op); }
  void ProgressChains(const MpiOp* caller) { chain_ops_.Progress(caller); }

 private:
  MpiTransport() = default;
  // Checks that the handle is ready for an operation that needs a dispatch (local misuse aborts).
  absl::Status CheckDispatched(OpKind kind, DispatchHandle* handle);
  absl::StatusOr<RequestPtr> Skipped();

  TransportOptions options_;
  int32_t rank_ = 0, size_ = 1;
  int64_t timeout_ms_ = 0;
  bool spin_waits_ = false;
  int64_t replica_chunk_elements_ = 1;
  common::ChainOpsInFlight<MpiOp> chain_ops_;
  std::shared_ptr<WorkerPool> host_pool_;  // the dispatch's layouts (null: this thread alone)
  int64_t tag_slots_ = 1, seqs_per_epoch_ = 1, epoch_ = 0;
  int handle_tags_ = 1;  // values of the dispatch bits in a tag (kMaxHandleTags where it fits)
  int abort_tag_ = 0;
  int close_tag_ = 0;  // Close's messages (abort_comm_)
  bool closed_ = false;
  absl::Status close_status_;  // Close's result
  MPI_Comm rows_comm_ = MPI_COMM_NULL, weights_comm_ = MPI_COMM_NULL, abort_comm_ = MPI_COMM_NULL;
  int64_t rows_seq_ = 0, weights_seq_ = 0;
  int64_t exchanges_ = 0;  // count exchanges started (each dispatch's number: its tag bits)
  // seqs_per_epoch_ entries per channel: {sequence number, kind, dispatch bits} of this rank's
  // operation with that number mod seqs_per_epoch_ (seq -1: none yet).
  struct Started {
    int64_t seq = -1;
    int kind = -1;
    int dispatch_bits = 0;
  };
  std::array<std::vector<Started>, 2> started_;
  int64_t order_probe_next_ = 0;
  int nudge_tag_ = 0;  // abort_comm_
  // Nudges for operations this rank has not started yet: (from, nudge).
  std::vector<std::pair<int, Nudge>> early_nudges_;
  // Nudges sent and not yet known complete: {message, request}.
  std::vector<std::pair<std::unique_ptr<Nudge>, MPI_Request>> nudges_out_;
  absl::Status call_order_error_;
  // Sets call_order_error_ (the first one) when `from` made operation n.seq of n.channel a
  // n.kind where this rank made it another.
  void CheckNudge(int from, const Nudge& n);
  MPI_Request abort_request_ = MPI_REQUEST_NULL;
  std::array<int64_t, 2> abort_in_{};
  std::array<int64_t, 2> abort_out_{};
  absl::Status poisoned_;
  absl::Status notice_;   // a peer's failure notice, not yet acted on
  absl::Status gave_up_;  // a peer's notice that it gave up waiting, not yet acted on
  bool dirty_ = false;  // this rank failed, was told of a failure, or skipped an operation
  std::array<OpCounters, static_cast<int>(OpKind::kNumKinds)> counters_{};
};

// ---------------------------------------------------------------------------------------------
// MpiOp

MpiOp::MpiOp(MpiTransport* transport, OpKind kind, MPI_Comm comm, int64_t seq,
             int64_t dispatch)
    : transport_(transport),
      kind_(kind),
      comm_(comm),
      channel_(transport->Channel(comm)),
      seq_(seq),
      dispatch_bits_(transport->DispatchBits(dispatch)),
      tag_base_(transport->TagBase(seq, kind, dispatch_bits_)),
      me_(transport->rank()),
      deadline_(Clock::now() + std::chrono::milliseconds(transport->timeout_ms())),
      start_(Clock::now()),
      next_order_check_(start_ + kOrderCheckFirst),
      timeout_ms_(transport->timeout_ms()) {
  counters_.calls = 1;
  transport->NoteStarted(channel_, seq, kind, dispatch_bits_);
  MOONEP_TRACE("transport mpi: %s starts, sequence %d, tags %d..%d", OpName(kind), seq, tag_base_,
               tag_base_ + kSubTags - 1);
}

MpiOp::~MpiOp() { Release(); }

absl::Status MpiOp::CheckCallOrder(bool all_peers) {
  std::vector<int> peers;
  if (all_peers) {
    // Up to kOrderProbePeers peers a call, in turn (an MPI_Iprobe each: a count exchange among
    // hundreds of ranks should not pay for hundreds), so each peer's queue is looked at every
    // (R - 1) / kOrderProbePeers steps, long before a tag slot comes round again.
    const int others = transport_->size() - 1;
    const int n = std::min(others, kOrderProbePeers);
    const int64_t first = transport_->TakeOrderProbeTurn(n);
    for (int i = 0; i < n; ++i) {
      peers.push_back(static_cast<int>((me_ + 1 + (first + i) % others) % transport_->size()));
    }
  } else {
    // Receives and sends: two ranks whose different calls only send to each other (rendezvous)
    // find each other's messages in their own queues.
    for (size_t i = 0; i < requests_.size(); ++i) {
      if (requests_[i] != MPI_REQUEST_NULL &&
          std::find(peers.begin(), peers.end(), pending_[i].peer) == peers.end()) {
        peers.push_back(pending_[i].peer);
      }
    }
  }
  MOONEP_RETURN_IF_ERROR(transport_->ReadNudges());
  for (int peer : peers) {
    MOONEP_RETURN_IF_ERROR(transport_->CheckPeerOrder(channel_, peer));
    // The count exchange also finds what weight operations left behind.
    if (all_peers) MOONEP_RETURN_IF_ERROR(transport_->CheckPeerOrder(1, peer));
  }
  if (!all_peers && !nudged_ && Clock::now() - start_ >= kNudgeAfter) {
    nudged_ = true;
    std::vector<int> waited;
    for (size_t i = 0; i < requests_.size(); ++i) {
      const int peer = pending_[i].peer;
      if (requests_[i] != MPI_REQUEST_NULL && pending_[i].recv &&
          std::find(waited.begin(), waited.end(), peer) == waited.end()) {
        waited.push_back(peer);
        transport_->SendNudge(peer, channel_, seq_, kind_, dispatch_bits_);
      }
    }
  }
  return absl::OkStatus();
}

void MpiOp::Release() {
  if (!done_) {
    Fail(InvalidUsage("%s: request destroyed before it completed", OpName(kind_))).IgnoreError();
  }
}

absl::Status MpiOp::Begin(absl::Status started) {
  if (!started.ok()) return Fail(started);
  // A peer gave up before this operation began (this rank is late): fail now, with its reason. (A
  // failure notice shows at the first Test, as before.)
  if (transport_->PeerGaveUp()) {
    return Fail(transport_->PollAbort(/*gave_up_too=*/true), /*notify_peers=*/false);
  }
  // A nudge that came before this operation started, of another kind.
  if (!transport_->call_order_error().ok()) return Fail(transport_->call_order_error());
  return absl::OkStatus();
}

absl::Status MpiOp::PostSend(const void* buf, int count, MPI_Datatype type, int peer, int sub,
                             int kind) {
  MPI_Request request;
  MOONEP_RETURN_IF_ERROR(MpiCheck(
      MPI_Isend(buf, count, type, peer, tag_base_ + sub, comm_, &request), "MPI_Isend"));
  requests_.push_back(request);
  pending_.push_back(Pending{peer, false, kind, -1});
  ++active_;
  ++counters_.messages_sent;
  return absl::OkStatus();
}

absl::Status MpiOp::PostRecv(void* buf, int count, MPI_Datatype type, int peer, int sub,
                             int64_t expect_bytes, int kind) {
  MPI_Request request;
  MOONEP_RETURN_IF_ERROR(MpiCheck(
      MPI_Irecv(buf, count, type, peer, tag_base_ + sub, comm_, &request), "MPI_Irecv"));
  requests_.push_back(request);
  pending_.push_back(Pending{peer, true, kind, expect_bytes});
  ++active_;
  return absl::OkStatus();
}

absl::Status MpiOp::TimeoutStatus() const {
  std::vector<int> silent, unreceived;
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (requests_[i] == MPI_REQUEST_NULL) continue;
    std::vector<int>& list = pending_[i].recv ? silent : unreceived;
    if (std::find(list.begin(), list.end(), pending_[i].peer) == list.end()) {
      list.push_back(pending_[i].peer);
    }
  }
  std::sort(silent.begin(), silent.end());
  std::sort(unreceived.begin(), unreceived.end());
  if (!silent.empty()) {
    return Timeout("%s timed out after %d ms on rank %d: nothing heard from rank(s) %s", OpName(kind_),
                   timeout_ms_, me_, RankList(silent));
  }
  return Timeout("%s timed out after %d ms on rank %d: rank(s) %s did not take their data",
                 OpName(kind_), timeout_ms_, me_, RankList(unreceived));
}

absl::StatusOr<bool> MpiOp::Test() {
  if (done_) {
    if (!status_.ok()) return status_;
    return true;
  }
  {
    absl::Status usable = transport_->Usable();
    if (usable.ok()) usable = transport_->PollAbort();
    // Peers were told (or time out) already: no second notice.
    if (!usable.ok()) return Fail(usable, /*notify_peers=*/false);
    if (!transport_->call_order_error().ok()) return Fail(transport_->call_order_error());
  }
  while (active_ > 0) {
    const int n = static_cast<int>(requests_.size());
    indices_.resize(n);
    statuses_.resize(n);
    int outcount = 0;
    const int rc = MPI_Testsome(n, requests_.data(), &outcount, indices_.data(), statuses_.data());
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) return Fail(MpiCheck(rc, "MPI_Testsome"));
    if (outcount == MPI_UNDEFINED || outcount == 0) break;
    for (int j = 0; j < outcount; ++j) {
      const size_t i = static_cast<size_t>(indices_[j]);
      --active_;
      const Pending& p = pending_[i];
      const int err = rc == MPI_ERR_IN_STATUS ? statuses_[j].MPI_ERROR : MPI_SUCCESS;
      if (p.recv) {
        int64_t got = -1;
        if (err == MPI_SUCCESS) {
          MPI_Count bytes = 0;
          MPI_Get_elements_x(&statuses_[j], MPI_BYTE, &bytes);
          got = static_cast<int64_t>(bytes);
        }
        if ((err != MPI_SUCCESS && err != MPI_ERR_TRUNCATE) ||
            (err == MPI_SUCCESS && p.expect >= 0 && got != p.expect) ||
            err == MPI_ERR_TRUNCATE) {
          if (err != MPI_SUCCESS && err != MPI_ERR_TRUNCATE) {
            return Fail(Annotate(MpiCheck(err, "receive"), OpName(kind_)));
          }
          if (OnSizeMismatch(i, got)) continue;
          return Fail(InvalidArgument(
              "%s: rank %d sent %s bytes, rank %d expected %d (sizes differ across ranks?)",
              OpName(kind_), p.peer, got < 0 ? std::string("more") : std::to_string(got), me_,
              p.expect));
        }
        counters_.bytes_received += got;
        absl::Status s = OnReceived(i);
        if (!s.ok()) return Fail(s);
      } else if (err != MPI_SUCCESS) {
        return Fail(Annotate(MpiCheck(err, "send"), OpName(kind_)));
      } else {
        absl::Status s = OnSent(i);
        if (!s.ok()) return Fail(s);
      }
    }
  }
  if (active_ == 0) {
    // A peer that gave up (timed out) may have sent its part before it did: its notice fails the
    // operation, which must not pass on data the peer abandoned.
    absl::Status s = transport_->PollAbort(/*gave_up_too=*/true);
    if (!s.ok()) return Fail(s, /*notify_peers=*/false);
    // Every step's count exchange hears from every peer: it also looks (at up to kOrderProbePeers
    // peers in turn) for a message that a peer left behind in an earlier operation of another
    // kind (where neither rank waited on the other, both calls completed; the message would be
    // taken by a later operation of its kind).
    if (kind_ == OpKind::kCounts) {
      s = CheckCallOrder(/*all_peers=*/true);
      if (!s.ok()) return Fail(s);
    }
    s = Finish();
    if (!s.ok()) return Fail(s);
    done_ = true;
    Ended();
    transport_->AddCounters(kind_, counters_);
    return true;
  }
  transport_->ProgressChains(this);
  // A weight op that failed in there poisoned the transport (and told the peers): this op fails
  // with that failure, not at its next Test as a misuse of an unusable transport.
  if (!transport_->health().ok()) return Fail(transport_->health(), /*notify_peers=*/false);
  const Clock::time_point now = Clock::now();
  if (now >= next_order_check_) {
    next_order_check_ = now + order_check_interval_;
    order_check_interval_ = std::min<Clock::duration>(2 * order_check_interval_, kOrderCheckMax);
    absl::Status s = CheckCallOrder(/*all_peers=*/false);
    if (!s.ok()) return Fail(s);
  }
  if (now >= deadline_) return Fail(TimeoutStatus());
  return false;
}

absl::Status MpiOp::Wait() {
  // A core per rank on this node: poll without sleeping (a yield every millisecond lets anything
  // else that wants the core run). MPI moves a large message only while the ranks poll: with the
  // sleeps below, a dispatch of 67 MB of rows between two ranks took 2.3-2.5x as long
  // (docs/transport.md).
  if (transport_->spin_waits()) {
    Clock::time_point next_yield = Clock::now() + std::chrono::milliseconds(1);
    while (true) {
      absl::StatusOr<bool> r = Test();
      if (!r.ok()) return r.status();
      if (*r) return absl::OkStatus();
      const Clock::time_point now = Clock::now();
      if (now >= next_yield) {
        std::this_thread::yield();
        next_yield = now + std::chrono::milliseconds(1);
      }
    }
  }
  // More ranks than cores: poll hot for 200 us without yielding (a small exchange completes within
  // it, and keeping the core keeps both sides of a multi-round exchange running; a yield on a
  // contended host gave the core away for a whole scheduler slice: 4 ms for a 128-byte count
  // exchange), then sleep between polls, 20 us doubling to 100 us, so that ranks sharing cores
  // hand them to the peer they wait for. Sleeps never pass the deadline, so a timeout fires when
  // it is due.
  constexpr auto kSpin = std::chrono::microseconds(200);
  constexpr auto kFirstSleep = std::chrono::microseconds(20);
  constexpr auto kMaxSleep = std::chrono::microseconds(100);
  const Clock::time_point spin_until = Clock::now() + kSpin;
  Clock::duration sleep = kFirstSleep;
  while (true) {
    absl::StatusOr<bool> r = Test();
    if (!r.ok()) return r.status();
    if (*r) return absl::OkStatus();
    const Clock::time_point now = Clock::now();
    if (now < spin_until) continue;  // no yield: keep the core while the peer is likely running
    std::this_thread::sleep_for(std::min<Clock::duration>(sleep, deadline_ - now));
    sleep = std::min<Clock::duration>(sleep * 2, kMaxSleep);
  }
}

absl::Status MpiOp::Fail(absl::Status status, bool notify_peers) {
  if (done_) return status_;
  // A chain op's failure is never agreed: a holder that fails (a size mismatch) leaves the ranks
  // after it waiting for what it would have passed on.
  const bool chain = chain_;
  done_ = true;
  status_ = status;
  Cleanup();
  Ended();
  // Agreed errors (all ranks failed the same way, every message was consumed) keep the transport.
  const bool remote = ToResult(status) == moonepRemoteError;
  if (active_ != 0 || chain ||
      !(absl::IsInvalidArgument(status) || absl::IsResourceExhausted(status) || remote)) {
    // Peers learn at once, also of a timeout: a late peer then fails its call with the reason
    // instead of completing it on what this rank sent before it gave up (or waiting a second
    // timeout and blaming this rank).
    if (notify_peers && !remote) transport_->AbortPeers(kind_, status).IgnoreError();
    transport_->Poison(status);
  }
  return status;
}

void MpiOp::Cleanup() {
  // Receives still posted would write into caller memory later: cancel them. Sends cannot be
  // cancelled reliably; they are released and complete (or not) in the background.
  // A receive already matched cannot be cancelled and completes when its data arrives; the
  // receives get one second for that all together (one each made a failure with many peers and
  // tensors take minutes), rather than block on a stuck peer.
  const Clock::time_point until = Clock::now() + std::chrono::seconds(1);
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (requests_[i] == MPI_REQUEST_NULL) continue;
    if (pending_[i].recv) {
      MPI_Cancel(&requests_[i]);
      int done = 0;
      do {  // at least one test: a cancelled receive completes at once
        MPI_Test(&requests_[i], &done, MPI_STATUS_IGNORE);
        if (!done) std::this_thread::yield();
      } while (!done && Clock::now() < until);
      if (!done) {
        MOONEP_WARN("%s: a receive from rank %d could not be cancelled", OpName(kind_),
                    pending_[i].peer);
        MPI_Request_free(&requests_[i]);
        receives_released_ = true;
      }
    } else {
      MPI_Request_free(&requests_[i]);
      sends_released_ = true;
    }
  }
}

class DoneRequest : public Request {
 public:
  absl::StatusOr<bool> Test() override { return true; }
  absl::Status Wait() override { return absl::OkStatus(); }
};

// ---------------------------------------------------------------------------------------------
// Count exchange: [flag, T, K, E, capacity, counts[max(E, 32)]] to every peer.


class CountsOp : public MpiOp {
 public:
  CountsOp(MpiTransport* t, MPI_Comm comm, int64_t seq, DispatchHandle* handle)
      : MpiOp(t, OpKind::kCounts, comm, seq, handle->exchange_no_),
        handle_(handle),
        mine_(*new std::vector<int64_t>) {}
  ~CountsOp() override {
    Release();
    if (!sends_released()) delete &mine_;  // else MPI may still read it: leaked on purpose
  }

  absl::Status Start(absl::Status local, absl::Span<const int32_t> ids, int64_t T, int32_t K,
                     int32_t E, int64_t capacity) {
    local_ = local;
    E_ = E;
    R_ = transport_->size();
    const int64_t width = common::CountMessageWords(E);
    common::PackCountMessage(local, ids, T, K, E, capacity, &mine_);
    all_.assign(static_cast<size_t>(R_) * width, 0);
    std::copy(mine_.begin(), mine_.end(), all_.begin() + me_ * width);
    mismatch_.assign(R_, 0);
    for (int r = 0; r < R_; ++r) {
      if (r == me_) continue;
      MOONEP_RETURN_IF_ERROR(PostRecv(all_.data() + r * width, static_cast<int>(width),
                                      MPI_INT64_T, r, kSubMeta, width * 8));
    }
    for (int r = 0; r < R_; ++r) {
      if (r == me_) continue;
      MOONEP_RETURN_IF_ERROR(
          PostSend(mine_.data(), static_cast<int>(width), MPI_INT64_T, r, kSubMeta));
      counters_.bytes_sent += width * 8;
    }
    common::KeepRouting(local, ids, T, K, handle_);
    return absl::OkStatus();
  }

 private:
  bool OnSizeMismatch(size_t index, int64_t) override {
    mismatch_[pending_[index].peer] = 1;
    return true;
  }

  absl::Status Finish() override {
    return common::FinishCountExchange(local_, mine_, all_, mismatch_, me_, R_, E_, handle_);
  }

  DispatchHandle* handle_;
  absl::Status local_;
  int32_t E_ = 0, R_ = 0;
  std::vector<int64_t>& mine_;  // what this rank sends (heap: see ~CountsOp)
  std::vector<int64_t> all_;
  std::vector<char> mismatch_;
};

// Dispatch (with per-row metadata) and combine-backward (the same movement of dy, metadata known).
class DispatchOp : public MpiOp {
 public:
  DispatchOp(MpiTransport* t, OpKind kind, MPI_Comm comm, int64_t seq, DispatchHandle* h)
      : MpiOp(t, kind, comm, seq, h->exchange_no_), h_(h) {}

  absl::Status Start(const TensorView& x, const TensorView& rows, float* weights) {
    const bool forward = kind_ == OpKind::kDispatch;
    const SendLayout& send = h_->send_;
    const ReceiveLayout& recv = h_->recv_;
    const planner::Plan& plan = h_->plan_;
    const int32_t R = h_->num_ranks_;
    rows_ = rows;
    weights_ = weights;
    row_bytes_ = static_cast<int64_t>(x.shape[1]) * DTypeSize(x.dtype);
    const int64_t x_stride = row_bytes_;
    common::ZeroUnfilledRows(plan, me_, rows, weights);

    // Metadata travels as whole RowMeta elements: a count of rows fits an int where bytes might
    // not (rows per peer are at most kMaxEntries).
    const MetaType& meta = transport_->meta_type;
    // Receives first, so that eager data finds them.
    if (forward) {
      h_->meta_recv_.resize(static_cast<size_t>(recv.rows_begin[R]) * sizeof(RowMeta));
      h_->recv_unique_.assign(static_cast<size_t>(recv.rows_begin[R]), -1);
      h_->landing_.assign(static_cast<size_t>(recv.rows_begin[R]), -1);
      h_->unique_from_.assign(R, 0);
    }
    for (int32_t s = 0; s < R; ++s) {
      const int64_t n = recv.rows_from(s);
      if (s == me_ || n == 0) continue;
      if (forward) {
        MOONEP_RETURN_IF_ERROR(PostRecv(h_->meta_recv_.data() + recv.rows_begin[s] * sizeof(RowMeta),
                                        static_cast<int>(n), meta.type, s, kSubMeta,
                                        n * static_cast<int64_t>(sizeof(RowMeta)), kSubMeta));
      } else {
        MOONEP_RETURN_IF_ERROR(PostRowsRecv(s));
      }
    }
    // Sends: metadata (forward) and one row per unique token of each destination.
    if (forward) h_->meta_send_.resize(send.entries.size() * sizeof(RowMeta));
    std::vector<MPI_Aint> displs;
    for (int32_t d = 0; d < R; ++d) {
      const int64_t n = send.rows_to(d);
      if (d == me_ || n == 0) continue;
      if (forward) {
        auto* rows_meta = reinterpret_cast<RowMeta*>(h_->meta_send_.data()) + send.entry_begin[d];
        for (int64_t i = 0; i < n; ++i) {
          const int32_t entry = send.entries[send.entry_begin[d] + i];
          rows_meta[i].unique = send.entry_unique[send.entry_begin[d] + i];
          rows_meta[i].weight = h_->topk_weights_[entry];
        }
        MOONEP_RETURN_IF_ERROR(PostSend(rows_meta, static_cast<int>(n), meta.type, d, kSubMeta));
        counters_.bytes_sent += n * static_cast<int64_t>(sizeof(RowMeta));
      }
      const int64_t u = send.unique_to(d);
      displs.resize(static_cast<size_t>(u));
      for (int64_t i = 0; i < u; ++i) {
        displs[i] = static_cast<MPI_Aint>(send.unique_tokens[send.unique_begin[d] + i]) * x_stride;
      }
      MPI_Datatype type;
      MOONEP_RETURN_IF_ERROR(MpiCheck(
          MPI_Type_create_hindexed_block(static_cast<int>(u), static_cast<int>(row_bytes_),
                                         displs.data(), MPI_BYTE, &type),
          "MPI_Type_create_hindexed_block"));
      MPI_Type_commit(&type);
      absl::Status s = PostSend(x.data, 1, type, d, kSubData);
      MPI_Type_free(&type);
      MOONEP_RETURN_IF_ERROR(s);
      counters_.rows_sent += u;
      counters_.bytes_sent += u * row_bytes_;
      counters_.rows_deduplicated += n - u;
      counters_.bytes_deduplicated += (n - u) * row_bytes_;
    }
    // This rank's own rows: copied directly.
    for (int64_t i = send.entry_begin[me_]; i < send.entry_begin[me_ + 1]; ++i) {
      const int32_t entry = send.entries[i];
      const int64_t row = send.dest_row[entry];
      std::memcpy(rows.row(row), static_cast<const char*>(x.data) + (entry / send.top_k) * x_stride,
                  static_cast<size_t>(row_bytes_));
      if (forward) weights_[row] = h_->topk_weights_[entry];
    }
    counters_.rows_local += send.rows_to(me_);
    return absl::OkStatus();
  }

 private:
  // Unique rows of source s land at their first row; the receive datatype places them there.
  absl::Status PostRowsRecv(int32_t s) {
    const int64_t u = h_->unique_from_[s];
    std::vector<MPI_Aint> displs(static_cast<size_t>(u));
    const int64_t base = h_->recv_.rows_begin[s];
    for (int64_t i = 0; i < u; ++i) displs[i] = static_cast<MPI_Aint>(h_->landing_[base + i]) * row_bytes_;
    MPI_Datatype type;
    MOONEP_RETURN_IF_ERROR(MpiCheck(
        MPI_Type_create_hindexed_block(static_cast<int>(u), static_cast<int>(row_bytes_),
                                       displs.data(), MPI_BYTE, &type),
        "MPI_Type_create_hindexed_block"));
    MPI_Type_commit(&type);
    absl::Status st = PostRecv(rows_.data, 1, type, s, kSubData, u * row_bytes_, kSubData);
    MPI_Type_free(&type);
    return st;
  }

  absl::Status OnReceived(size_t index) override {
    const int32_t s = pending_[index].peer;
    const ReceiveLayout& recv = h_->recv_;
    const int64_t base = recv.rows_begin[s];
    const int64_t n = recv.rows_from(s);
    if (pending_[index].kind == kSubMeta) {
      const auto* meta = reinterpret_cast<const RowMeta*>(h_->meta_recv_.data()) + base;
      int64_t unique = 0;
      absl::Status bad;
      common::ForEachRowFrom(recv, s, [&](int64_t i, int64_t row) {
        const int32_t u = meta[i].unique;
        if (u < 0 || u >= n) {
          bad = InvalidArgument("dispatch: rank %d sent unique index %d for %d rows", s, u, n);
          return;
        }
        h_->recv_unique_[base + i] = u;
        weights_[row] = meta[i].weight;
        if (h_->landing_[base + u] < 0) {
          h_->landing_[base + u] = row;
          ++unique;
        }
      });
      MOONEP_RETURN_IF_ERROR(bad);
      for (int64_t u = 0; u < unique; ++u) {
        if (h_->landing_[base + u] < 0) {
          return InvalidArgument("dispatch: rank %d's unique rows are not numbered densely", s);
        }
      }
      h_->unique_from_[s] = unique;
      return PostRowsRecv(s);
    }
    // Rows arrived: copy each unique row into the other rows it fills (dedup expansion).
    int64_t copies = 0;
    common::ForEachRowFrom(recv, s, [&](int64_t i, int64_t row) {
      const int64_t landing = h_->landing_[base + h_->recv_unique_[base + i]];
      if (landing != row) {
        std::memcpy(rows_.row(row), rows_.row(landing), static_cast<size_t>(row_bytes_));
        ++copies;
      }
    });
    counters_.rows_received += n - copies;
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    if (kind_ == OpKind::kDispatch) h_->dispatched_ = true;
    return absl::OkStatus();
  }

  DispatchHandle* h_;
  TensorView rows_;
  float* weights_ = nullptr;
  int64_t row_bytes_ = 0;
};

// Combine (weighted) and dispatch-backward (unweighted): rows back to their sources, summed.
class CombineOp : public MpiOp {
 public:
  CombineOp(MpiTransport* t, OpKind kind, MPI_Comm comm, int64_t seq, DispatchHandle* h)
      : MpiOp(t, kind, comm, seq, h->exchange_no_), h_(h) {}

  absl::Status Start(const TensorView& rows, const TensorView& y) {
    const SendLayout& send = h_->send_;
    const ReceiveLayout& recv = h_->recv_;
    const int32_t R = h_->num_ranks_;
    rows_ = rows;
    y_ = y;
    row_bytes_ = static_cast<int64_t>(rows.shape[1]) * DTypeSize(rows.dtype);
    char* staging = h_->rows_staging_.data();
    std::vector<MPI_Aint> displs;
    std::vector<int> lengths;
    // Receive each destination's rows straight into the staging slot of their (t, k) entry.
    for (int32_t d = 0; d < R; ++d) {
      const int64_t n = send.rows_to(d);
      if (d == me_ || n == 0) continue;
      displs.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        displs[i] = static_cast<MPI_Aint>(send.entries[send.entry_begin[d] + i]) * row_bytes_;
      }
      MPI_Datatype type;
      MOONEP_RETURN_IF_ERROR(MpiCheck(
          MPI_Type_create_hindexed_block(static_cast<int>(n), static_cast<int>(row_bytes_),
                                         displs.data(), MPI_BYTE, &type),
          "MPI_Type_create_hindexed_block"));
      MPI_Type_commit(&type);
      absl::Status st = PostRecv(staging, 1, type, d, kSubData, n * row_bytes_);
      MPI_Type_free(&type);
      MOONEP_RETURN_IF_ERROR(st);
    }
    // Send each source its rows: the runs of the receive layout, in place.
    for (int32_t s = 0; s < R; ++s) {
      const int64_t n = recv.rows_from(s);
      if (s == me_ || n == 0) continue;
      // One block per run; runs above INT_MAX bytes (MPI's int block length) in several.
      displs.clear();
      lengths.clear();
      for (int64_t r = recv.run_begin[s]; r < recv.run_begin[s + 1]; ++r) {
        common::AppendRunBlocks(recv.run_row[r], recv.run_count[r], row_bytes_, INT_MAX, &displs,
                                &lengths);
      }
      MPI_Datatype type;
      MOONEP_RETURN_IF_ERROR(MpiCheck(
          MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(),
                                   displs.data(), MPI_BYTE, &type),
          "MPI_Type_create_hindexed"));
      MPI_Type_commit(&type);
      absl::Status st = PostSend(rows.data, 1, type, s, kSubData);
      MPI_Type_free(&type);
      MOONEP_RETURN_IF_ERROR(st);
      counters_.rows_sent += n;
      counters_.bytes_sent += n * row_bytes_;
    }
    counters_.rows_local += send.rows_to(me_);
    return absl::OkStatus();
  }

 private:
  absl::Status OnReceived(size_t index) override {
    counters_.rows_received += h_->send_.rows_to(pending_[index].peer);
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    const SendLayout& send = h_->send_;
    const bool weighted = kind_ == OpKind::kCombine;
    const int64_t T = send.num_tokens, H = y_.shape[1];
    const int32_t K = send.top_k;
    acc_.resize(static_cast<size_t>(H));
    const char* staging = h_->rows_staging_.data();
    const size_t elems_per_row = static_cast<size_t>(H);
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc_.begin(), acc_.end(), 0.0f);
      for (int32_t k = 0; k < K; ++k) {
        const int64_t entry = t * K + k;
        const int32_t d = send.dest_rank[entry];
        if (d < 0) continue;
        const void* src = d == me_ ? static_cast<const void*>(rows_.row(send.dest_row[entry]))
                                   : static_cast<const void*>(staging + entry * row_bytes_);
        const float w = weighted ? h_->topk_weights_[entry] : 1.0f;
        if (rows_.dtype == DType::kFloat32) {
          const float* v = static_cast<const float*>(src);
          for (size_t h = 0; h < elems_per_row; ++h) acc_[h] += w * v[h];
        } else {
          const BFloat16* v = static_cast<const BFloat16*>(src);
          for (size_t h = 0; h < elems_per_row; ++h) acc_[h] += w * v[h].ToFloat();
        }
      }
      ConvertFromFloat(acc_.data(), y_.row(t), y_.dtype, elems_per_row);
    }
    return absl::OkStatus();
  }

  DispatchHandle* h_;
  TensorView rows_, y_;
  int64_t row_bytes_ = 0;
  std::vector<float> acc_;
};

// d topk_weights: one dot product per row where the rows are, one float back per row.
class TopkWeightGradOp : public MpiOp {
 public:
  TopkWeightGradOp(MpiTransport* t, MPI_Comm comm, int64_t seq, DispatchHandle* h)
      : MpiOp(t, OpKind::kTopkWeightGrad, comm, seq, h->exchange_no_), h_(h) {}

  absl::Status Start(const TensorView& dy_rows, const TensorView& out_rows, float* dw) {
    const SendLayout& send = h_->send_;
    const ReceiveLayout& recv = h_->recv_;
    const int32_t R = h_->num_ranks_;
    const int64_t H = dy_rows.shape[1];
    for (size_t i = 0; i < send.dest_rank.size(); ++i) {
      if (send.dest_rank[i] < 0) dw[i] = 0.0f;
    }
    std::vector<MPI_Aint> displs;
    for (int32_t d = 0; d < R; ++d) {
      const int64_t n = send.rows_to(d);
      if (d == me_ || n == 0) continue;
      displs.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        displs[i] = static_cast<MPI_Aint>(send.entries[send.entry_begin[d] + i]) * sizeof(float);
      }
      MPI_Datatype type;
      MOONEP_RETURN_IF_ERROR(MpiCheck(
          MPI_Type_create_hindexed_block(static_cast<int>(n), 1, displs.data(), MPI_FLOAT, &type),
          "MPI_Type_create_hindexed_block"));
      MPI_Type_commit(&type);
      absl::Status st = PostRecv(dw, 1, type, d, kSubScalar, n * 4);
      MPI_Type_free(&type);
      MOONEP_RETURN_IF_ERROR(st);
    }
    std::vector<float>& dots = h_->scalar_staging_;
    dots.resize(static_cast<size_t>(recv.rows_begin[R]));
    std::vector<float> a(static_cast<size_t>(H)), b(static_cast<size_t>(H));
    for (int32_t s = 0; s < R; ++s) {
      common::ForEachRowFrom(recv, s, [&](int64_t i, int64_t row) {
        ConvertToFloat(dy_rows.row(row), dy_rows.dtype, a.data(), a.size());
        ConvertToFloat(out_rows.row(row), out_rows.dtype, b.data(), b.size());
        double sum = 0.0;
        for (int64_t h = 0; h < H; ++h) sum += static_cast<double>(a[h]) * b[h];
        dots[recv.rows_begin[s] + i] = static_cast<float>(sum);
      });
      const int64_t n = recv.rows_from(s);
      if (s == me_ || n == 0) continue;
      MOONEP_RETURN_IF_ERROR(PostSend(dots.data() + recv.rows_begin[s], static_cast<int>(n),
                                      MPI_FLOAT, s, kSubScalar));
      counters_.rows_sent += n;
      counters_.bytes_sent += n * 4;
    }
    for (int64_t i = send.entry_begin[me_]; i < send.entry_begin[me_ + 1]; ++i) {
      dw[send.entries[i]] = dots[recv.rows_begin[me_] + (i - send.entry_begin[me_])];
    }
    counters_.rows_local += send.rows_to(me_);
    return absl::OkStatus();
  }

 private:
  absl::Status OnReceived(size_t index) override {
    counters_.rows_received += h_->send_.rows_to(pending_[index].peer);
    return absl::OkStatus();
  }
  DispatchHandle* h_;
};

// ---------------------------------------------------------------------------------------------
// Weight ops: every expert with replicas moves along its replica chain (common/replica_chain.h),
// holders h_1 < h_2 < ... < h_n in increasing rank. Prefetch: home -> h_1 -> ... -> h_n, each
// holder receiving into its slot and passing the bytes on from there. Reduce: h_1 -> ... -> h_n ->
// home; h_1 sends its slot's gradient as an fp32 partial (ChainStart), each next holder adds its
// slot into the partial it received (ChainAdd) and passes it on, and the home stores partial +
// home (ChainFinish): ((g_1 + g_2) + ...) + home in fp32, stored once, the same bits as every
// other backend. Each rank sends one copy and receives one copy per expert it takes part in,
// whatever the replica count; partials travel as fp32 whatever the gradient's dtype.
//
// Pipelining: each tensor travels in chunks of common::ChunkElements(replica_chunk_bytes)
// elements, and a holder passes chunk c on from OnReceived, as soon as chunk c has arrived (in
// reduce: once its own slot's chunk c is added), so a chain of n hops takes about one tensor's
// transfer time plus n - 1 chunk times rather than n transfer times. A holder passes chunks on
// while its op is tested or waited for; the home's first kChainWindow chunks to each peer move in
// the background (MPI progresses them in any MPI call).
//
// Matching: all the messages of one op carry its one data tag, and order keeps them apart (MPI
// matches the messages of one source, tag and communicator in the order they were sent, against
// the receives in the order they were posted). Each rank sends a peer its chunks in one fixed
// order, (tensor, chunk, chain in increasing expert), and posts its receives from a peer in that
// same order. The order is chunk-major rather than chain by chain, so that a rank that is the home
// of one chain and a middle holder of another to the same peer does not hold the first back until
// the second has passed through in full. Ops in flight together (two reduces, a prefetch and a
// reduce) have tags of their own (their sequence numbers).
//
// Windows: per op and peer, at most kChainWindow sends are posted from the first one not complete
// on, and at most kChainWindow receives from the first one not arrived on. Open MPI's ob1
// numbers the messages between two ranks of a communicator with 16 bits: with every chunk posted
// at once (small chunks of large tensors, three ops in flight) more than 65536 were in flight and
// receives matched the wrong messages. And it looks for a message's receive along all the
// receives posted for its source: with every chunk's receive posted at once, a second op in flight
// made each match walk past the whole first op.
//
// No deadlock: a send waits for the data it passes on (the same (tensor, chunk, chain) one hop
// nearer the chain's start) and for earlier sends to the same peer (the order; the window, and a
// send completes once the peer posted its receive); a receive is posted once an earlier receive
// from the same peer arrived. Every wait is for a message earlier in (tensor, chunk, chain, hop)
// order, so following them always ends at one that waits for nothing. This needs each rank to test
// the op while its peers wait on it (passing on, and posting past the windows, happen in Test):
// every op's Test also tests the weight ops in flight (MpiTransport::ProgressChains), so chunks
// pass through a rank while it waits on a dispatch (the prefetch's later hops overlap it too) or
// on another weight op of the same transport, in whatever order the ranks wait (not on an op of
// another transport: ranks waiting on two transports' weight ops in different orders can wait on
// each other until the timeout).
//
// A plan with home replicas (Plan::home_replicas, one rank) has the home rank as the holder of such
// an expert: its hops are all local, copies (prefetch) and ChainStart, ChainAdd ..., ChainFinish
// chunk by chunk through staging (reduce), in the order of a chain across ranks.

// Reduce staging blocks start at multiples of 16 bytes.
int64_t AlignUp(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Chunks per op and peer in flight each way (see above): 256 MiB of reduce partials at the default
// chunk size (128 MiB of a bf16 prefetch), so
// that the home's first hop mostly moves in the background while its rank waits on another
// operation; a few ops in flight stay far below ob1's 65536 message numbers, and a match walks
// past at most this many receives of each other op.
constexpr size_t kChainWindow = 256;

// Every holder is the home rank (home replicas): every hop is on that rank.
bool IsLocal(const common::ReplicaChain& c) {
  return c.holders.front().rank == c.home && c.holders.back().rank == c.home;
}

// The plan's replica chains, each either local or across ranks with the home no holder (no rank
// holds an expert twice: CheckSlotPlan). An expert in slots on its home rank and on another rank
// is refused with InvalidArgument: the plan alone decides, so every rank refuses it alike.
absl::StatusOr<std::vector<common::ReplicaChain>> ChainsOf(const planner::Plan& plan) {
  std::vector<common::ReplicaChain> chains = common::ReplicaChains(plan);
  for (const common::ReplicaChain& c : chains) {
    if (IsLocal(c)) continue;
    for (const common::ChainHolder& h : c.holders) {
      MOONEP_CHECK_ARG(h.rank != c.home,
                       "plan: expert %d has replicas on its home rank %d and on other ranks "
                       "(home-rank replicas are for one-rank plans)", c.expert, c.home);
    }
  }
  return chains;
}

// What prefetch and reduce share: per peer, the chunks to send and to receive in the order of the
// peer's, posted through the windows as they become ready, and what follows each receive.
class ChainOp : public MpiOp {
 public:
  ChainOp(MpiTransport* t, OpKind kind, MPI_Comm comm, int64_t seq);

 protected:
  // One chain of this op that this rank takes part in across ranks.
  struct Hop {
    int32_t group = -1;  // the expert's home group (on its home rank)
    common::ChainPeers peers;
    int64_t chunk = 1;   // elements per chunk along this chain (ChainChunkElements)
  };
  // The most chunks of a tensor of `numel` elements on any of `hops`.
  static int64_t MostChunks(const std::vector<Hop>& hops, int64_t numel) {
    int64_t most = 0;
    for (const Hop& h : hops) most = std::max(most, common::NumChunks(numel, h.chunk));
    return most;
  }
  // A chunk for a peer. Its data may arrive (or be added to) later: it goes once ready.
  struct Out {
    const void* data = nullptr;
    int64_t bytes = 0;
    bool ready = false;
    bool done = false;  // its send completed
    // Reduce, at a chain's first holder of a tensor that is not fp32: ChainStart of the slot's
    // elements [begin, begin + n) into `partial` (= data) right before the chunk goes, so that
    // converting one chunk overlaps sending the one before.
    const TensorView* start = nullptr;
    int64_t begin = 0, n = 0;
    float* partial = nullptr;
  };
  // A chunk from a peer: where it lands, and what follows its arrival.
  struct In {
    void* buf = nullptr;
    int64_t bytes = 0;
    const TensorView* view = nullptr;  // reduce: the slot to add, or the home to store into
    int64_t begin = 0, n = 0;          // reduce: the chunk's elements
    bool home = false;                 // reduce: the chain ends here (ChainFinish)
    int32_t link = -1, out = -1;       // where it goes on (link -1: nowhere)
    bool done = false;                 // arrived
  };
  // The chunks to and from one peer, each way in the order of the peer's.
  struct Link {
    int peer = -1;
    std::vector<Out> out;
    size_t sent = 0;       // out[0, sent) are posted
    size_t sent_done = 0;  // out[0, sent_done) completed
    std::vector<In> in;
    size_t posted = 0;   // in[0, posted) are posted
    size_t arrived = 0;  // in[0, arrived) arrived
  };

  // Copies the caller's tensor views (Out and In point at the copies).
  void Keep(const ExpertBlocks& b) {
    home_.assign(b.home.begin(), b.home.end());
    slots_.assign(b.slots.begin(), b.slots.end());
  }
  // Queues a chunk for `peer`: its link and its place there.
  std::pair<int32_t, int32_t> Send(int peer, const Out& out);
  // Queues the receive of a chunk from `peer`.
  void Recv(int peer, const In& in);
  // Marks chunk `index` of `link` ready to go.
  void Ready(int32_t link, int32_t index) {
    links_[static_cast<size_t>(link)].out[static_cast<size_t>(index)].ready = true;
  }
  // Posts what the windows of `link` let go: receives, and ready chunks at the head of its sends.
  absl::Status Pump(int32_t link);
  absl::Status PumpAll();
  // What follows the arrival of a chunk (ops: pass it on, add, finish).
  virtual void Arrived(const In& in) = 0;

  const int64_t chunk_;  // elements
  std::vector<TensorView> home_, slots_;

 private:
  int32_t LinkOf(int peer);
  // The windows move on.
  absl::Status OnReceived(size_t index) override;
  absl::Status OnSent(size_t index) override;
  // Every queued chunk was sent and received (a check: each is posted once the ones before it
  // completed, and ready once its data arrived).
  absl::Status Finish() override;

  std::vector<Link> links_;
  std::vector<int32_t> link_of_;  // per peer rank, its link (-1: none)
  // Per posted request (its Pending::kind): its link and its place there.
  std::vector<std::pair<int32_t, int32_t>> posted_;
};

ChainOp::ChainOp(MpiTransport* t, OpKind kind, MPI_Comm comm, int64_t seq)
    : MpiOp(t, kind, comm, seq), chunk_(t->replica_chunk_elements()) {
  t->AddChainOp(this);
  chain_ = true;
}

void MpiOp::Ended() {
  if (chain_) transport_->RemoveChainOp(this);
  chain_ = false;
  if (on_end_) std::exchange(on_end_, nullptr)();
}

int32_t ChainOp::LinkOf(int peer) {
  if (link_of_.empty()) link_of_.assign(static_cast<size_t>(transport_->size()), -1);
  int32_t& link = link_of_[static_cast<size_t>(peer)];
  if (link < 0) {
    link = static_cast<int32_t>(links_.size());
    links_.emplace_back();
    links_.back().peer = peer;
  }
  return link;
}

std::pair<int32_t, int32_t> ChainOp::Send(int peer, const Out& out) {
  const int32_t link = LinkOf(peer);
  std::vector<Out>& queue = links_[static_cast<size_t>(link)].out;
  queue.push_back(out);
  return {link, static_cast<int32_t>(queue.size() - 1)};
}

void ChainOp::Recv(int peer, const In& in) {
  links_[static_cast<size_t>(LinkOf(peer))].in.push_back(in);
}

absl::Status ChainOp::Pump(int32_t link) {
  Link& l = links_[static_cast<size_t>(link)];
  while (l.posted < l.in.size() && l.posted < l.arrived + kChainWindow) {
    const In& in = l.in[l.posted];
    posted_.emplace_back(link, static_cast<int32_t>(l.posted));
    MOONEP_RETURN_IF_ERROR(PostRecv(in.buf, static_cast<int>(in.bytes), MPI_BYTE, l.peer, kSubData,
                                    in.bytes, static_cast<int>(posted_.size() - 1)));
    ++l.posted;
  }
  while (l.sent < l.out.size() && l.out[l.sent].ready && l.sent < l.sent_done + kChainWindow) {
    const Out& o = l.out[l.sent];
    if (o.start != nullptr) common::ChainStart(*o.start, o.begin, o.n, o.partial);
    posted_.emplace_back(link, static_cast<int32_t>(l.sent));
    MOONEP_RETURN_IF_ERROR(PostSend(o.data, static_cast<int>(o.bytes), MPI_BYTE, l.peer, kSubData,
                                    static_cast<int>(posted_.size() - 1)));
    counters_.bytes_sent += o.bytes;
    ++l.sent;
  }
  return absl::OkStatus();
}

absl::Status ChainOp::PumpAll() {
  for (size_t i = 0; i < links_.size(); ++i) MOONEP_RETURN_IF_ERROR(Pump(static_cast<int32_t>(i)));
  return absl::OkStatus();
}

absl::Status ChainOp::OnReceived(size_t index) {
  const auto [link, i] = posted_[static_cast<size_t>(pending_[index].kind)];
  Link& l = links_[static_cast<size_t>(link)];
  In& in = l.in[static_cast<size_t>(i)];
  in.done = true;
  Arrived(in);
  while (l.arrived < l.posted && l.in[l.arrived].done) ++l.arrived;
  MOONEP_RETURN_IF_ERROR(Pump(link));
  // The chunk goes on to another peer (the next in its chain): that link may send now.
  return in.link < 0 || in.link == link ? absl::OkStatus() : Pump(in.link);
}

absl::Status ChainOp::OnSent(size_t index) {
  const auto [link, i] = posted_[static_cast<size_t>(pending_[index].kind)];
  Link& l = links_[static_cast<size_t>(link)];
  l.out[static_cast<size_t>(i)].done = true;
  while (l.sent_done < l.sent && l.out[l.sent_done].done) ++l.sent_done;
  return Pump(link);
}

absl::Status ChainOp::Finish() {
  for (const Link& l : links_) {
    if (l.sent != l.out.size() || l.posted != l.in.size()) {
      return Internal("%s: %d chunks for rank %d were never sent and %d from it never received",
                      OpName(kind_), l.out.size() - l.sent, l.peer, l.in.size() - l.posted);
    }
  }
  return absl::OkStatus();
}

class PrefetchOp : public ChainOp {
 public:
  PrefetchOp(MpiTransport* t, MPI_Comm comm, int64_t seq)
      : ChainOp(t, OpKind::kPrefetch, comm, seq) {}

  absl::Status Start(const std::vector<common::ReplicaChain>& chains, const ExpertBlocks& b) {
    Keep(b);
    const int32_t nt = b.tensors_per_expert;
    std::vector<Hop> hops;
    for (const common::ReplicaChain& c : chains) {
      if (IsLocal(c)) {
        if (c.home != me_) continue;
        for (const common::ChainHolder& h : c.holders) {
          for (int32_t i = 0; i < nt; ++i) {
            const TensorView& src = home_[static_cast<size_t>(c.group) * nt + i];
            const TensorView& dst = slots_[static_cast<size_t>(h.slot) * nt + i];
            if (src.nbytes() > 0) std::memcpy(dst.data, src.data, src.nbytes());
          }
          counters_.rows_local += nt;
        }
        continue;
      }
      const common::ChainPeers p = common::PrefetchPeers(c, me_);
      if (p.prev < 0 && p.next < 0) continue;
      hops.push_back(Hop{c.group, p, common::ChainChunkElements(c, chunk_)});
      if (p.prev >= 0) counters_.rows_received += nt;
      if (p.next >= 0) counters_.rows_sent += nt;
    }
    // Every chunk is queued here, in (tensor, chunk, chain) order (the order each peer mirrors);
    // then the windows' first receives and what is ready (the home's chunks) go.
    for (int32_t i = 0; i < nt; ++i) {
      const int64_t numel = home_[static_cast<size_t>(i)].numel();
      const int64_t es = static_cast<int64_t>(DTypeSize(home_[static_cast<size_t>(i)].dtype));
      const int64_t chunks = MostChunks(hops, numel);
      for (int64_t k = 0; k < chunks; ++k) {
        for (const Hop& h : hops) {
          if (k >= common::NumChunks(numel, h.chunk)) continue;
          const int64_t begin = k * h.chunk, bytes = std::min(h.chunk, numel - begin) * es;
          if (h.peers.home) {
            const TensorView& src = home_[static_cast<size_t>(h.group) * nt + i];
            Out out;
            out.data = static_cast<const char*>(src.data) + begin * es;
            out.bytes = bytes;
            out.ready = true;
            Send(h.peers.next, out);
            continue;
          }
          // A holder receives straight into its slot and passes the chunk on from there.
          const TensorView& slot = slots_[static_cast<size_t>(h.peers.slot) * nt + i];
          char* dst = static_cast<char*>(slot.data) + begin * es;
          In in;
          in.buf = dst;
          in.bytes = bytes;
          if (h.peers.next >= 0) {
            Out out;
            out.data = dst;
            out.bytes = bytes;
            std::tie(in.link, in.out) = Send(h.peers.next, out);
          }
          Recv(h.peers.prev, in);
        }
      }
    }
    return PumpAll();
  }

 private:
  void Arrived(const In& in) override {
    if (in.link >= 0) Ready(in.link, in.out);
  }
};

// Each reduce stages its partials in its own buffer of the transport's pool, so reduces in flight
// together keep their gradients apart, and a reduce at a time reuses one buffer from step to step.
class ReduceOp : public ChainOp {
 public:
  ReduceOp(MpiTransport* t, MPI_Comm comm, int64_t seq) : ChainOp(t, OpKind::kReduce, comm, seq) {}
  // The staging goes back when the op ends (OnEnd below), so that a completed request destroyed
  // after its transport touches nothing of it.
  ~ReduceOp() override { Release(); }

  absl::Status Start(const std::vector<common::ReplicaChain>& chains, const ExpertBlocks& b) {
    Keep(b);
    const int32_t nt = b.tensors_per_expert;
    std::vector<Hop> hops;
    std::vector<const common::ReplicaChain*> local;
    for (const common::ReplicaChain& c : chains) {
      if (IsLocal(c)) {
        if (c.home == me_) local.push_back(&c);
        continue;
      }
      const common::ChainPeers p = common::ReducePeers(c, me_);
      if (p.prev < 0 && p.next < 0) continue;
      hops.push_back(Hop{c.group, p, common::ChainChunkElements(c, chunk_)});
      if (p.prev >= 0) counters_.rows_received += nt;
      if (p.next >= 0) counters_.rows_sent += nt;
    }
    // Staging, fp32: a whole tensor per chain and tensor where this rank receives a partial (it
    // is added to and passed on, or finished, from there) or starts one from a slot that is not
    // fp32 (an fp32 slot is its own partial and goes as it is); one chunk for the local chains.
    const auto staged = [&](const Hop& h, int32_t i) {
      return h.peers.prev >= 0 ||
             (h.peers.first && home_[static_cast<size_t>(i)].dtype != DType::kFloat32);
    };
    std::vector<int64_t> at(hops.size() * static_cast<size_t>(nt), -1);  // offsets in staging
    int64_t need = 0, scratch = 0;
    for (size_t k = 0; k < hops.size(); ++k) {
      for (int32_t i = 0; i < nt; ++i) {
        if (!staged(hops[k], i)) continue;
        at[k * static_cast<size_t>(nt) + static_cast<size_t>(i)] = need;
        need += AlignUp(home_[static_cast<size_t>(i)].numel() * 4);
      }
    }
    if (!local.empty()) {
      for (int32_t i = 0; i < nt; ++i) {
        scratch = std::max(scratch, std::min(home_[static_cast<size_t>(i)].numel(), chunk_));
      }
    }
    const int64_t scratch_at = need;
    need += AlignUp(scratch * 4);
    staging_ = transport_->reduce_staging.Acquire();
    // At the op's end its receives are complete or cancelled (Cleanup runs first), and the
    // staging goes back to the pool; a receive that could not be cancelled, or a send released
    // unfinished (partials go from the staging), leaves it allocated: MPI may still use it.
    OnEnd([this] {
      if (receives_released() || sends_released()) {
        transport_->reduce_staging.Abandon(staging_);
      } else {
        transport_->reduce_staging.Release(staging_);
      }
    });
    if (static_cast<int64_t>(staging_->size()) < need) {
      try {
        staging_->resize(static_cast<size_t>(need));
      } catch (const std::bad_alloc&) {
        return OutOfMemory("reduce: cannot allocate %d bytes of staging for the partials", need);
      }
    }
    char* staging = staging_->data();
    // Local chains (home replicas): the slots in increasing slot, then the home, chunk by chunk,
    // as along a chain.
    float* partial = reinterpret_cast<float*>(staging + scratch_at);
    for (const common::ReplicaChain* c : local) {
      for (int32_t i = 0; i < nt; ++i) {
        const TensorView& home = home_[static_cast<size_t>(c->group) * nt + i];
        const int64_t numel = home.numel();
        for (int64_t begin = 0; begin < numel; begin += chunk_) {
          const int64_t n = std::min(chunk_, numel - begin);
          for (size_t h = 0; h < c->holders.size(); ++h) {
            const TensorView& slot = slots_[static_cast<size_t>(c->holders[h].slot) * nt + i];
            (h == 0 ? common::ChainStart : common::ChainAdd)(slot, begin, n, partial);
          }
          common::ChainFinish(home, begin, n, partial);
        }
      }
      counters_.rows_local += static_cast<int64_t>(c->holders.size()) * nt;
    }
    // Every chunk is queued here, in (tensor, chunk, chain) order (the order each peer mirrors);
    // then the windows' first receives and what is ready (the first holders' chunks) go.
    for (int32_t i = 0; i < nt; ++i) {
      const int64_t numel = home_[static_cast<size_t>(i)].numel();
      const int64_t chunks = MostChunks(hops, numel);
      for (int64_t k = 0; k < chunks; ++k) {
        for (size_t j = 0; j < hops.size(); ++j) {
          const Hop& h = hops[j];
          if (k >= common::NumChunks(numel, h.chunk)) continue;
          const int64_t begin = k * h.chunk, n = std::min(h.chunk, numel - begin);
          const int64_t offset = at[j * static_cast<size_t>(nt) + static_cast<size_t>(i)];
          float* part = offset < 0 ? nullptr : reinterpret_cast<float*>(staging + offset) + begin;
          In in;
          in.buf = part;
          in.bytes = n * 4;
          in.begin = begin;
          in.n = n;
          if (h.peers.home) {
            in.view = &home_[static_cast<size_t>(h.group) * nt + i];
            in.home = true;
            Recv(h.peers.prev, in);
            continue;
          }
          const TensorView* slot = &slots_[static_cast<size_t>(h.peers.slot) * nt + i];
          Out out;
          out.bytes = n * 4;
          if (h.peers.first) {
            out.ready = true;
            if (part == nullptr) {
              out.data = static_cast<const float*>(slot->data) + begin;
            } else {
              out.data = part;
              out.start = slot;
              out.begin = begin;
              out.n = n;
              out.partial = part;
            }
            Send(h.peers.next, out);
            continue;
          }
          // A later holder: the partial arrives, gets this slot's chunk added, and goes on.
          out.data = part;
          in.view = slot;
          std::tie(in.link, in.out) = Send(h.peers.next, out);
          Recv(h.peers.prev, in);
        }
      }
    }
    return PumpAll();
  }

 private:
  void Arrived(const In& in) override {
    if (in.home) {
      common::ChainFinish(*in.view, in.begin, in.n, static_cast<const float*>(in.buf));
      return;
    }
    common::ChainAdd(*in.view, in.begin, in.n, static_cast<float*>(in.buf));
    Ready(in.link, in.out);
  }

  std::vector<char>* staging_ = nullptr;  // this op's, from transport_->reduce_staging
};

// ---------------------------------------------------------------------------------------------
// MpiTransport

absl::StatusOr<std::unique_ptr<Transport>> MpiTransport::Create(const TransportOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return InvalidUsage("MPI transport: MPI is not initialized");
  MOONEP_CHECK_ARG(options.comm != MPI_COMM_NULL, "options.comm is MPI_COMM_NULL");
  // Options and environment are checked locally but reported after an agreement (below, once
  // every rank has made the communicators), so that a value wrong on one rank only fails every
  // rank instead of leaving the others in MPI_Comm_dup.
  absl::Status checked = common::CheckOptions(options);
  if (checked.ok()) checked = CheckTransportEnvironment("mpi");
  std::unique_ptr<MpiTransport> t(new MpiTransport());
  t->options_ = options;
  t->timeout_ms_ = common::ResolveTimeoutMs(options.timeout_ms);
  t->replica_chunk_elements_ = common::ChunkElements(common::ResolveReplicaChunkBytes(options));
  for (MPI_Comm* c : {&t->rows_comm_, &t->weights_comm_, &t->abort_comm_}) {
    MOONEP_RETURN_IF_ERROR(MpiCheck(MPI_Comm_dup(options.comm, c), "MPI_Comm_dup"));
    MPI_Comm_set_errhandler(*c, MPI_ERRORS_RETURN);
  }
  MPI_Comm_rank(t->rows_comm_, &t->rank_);
  MPI_Comm_size(t->rows_comm_, &t->size_);
  {
    // Ranks sharing this node (collective, at the same point on every rank).
    const int local_size = common::LocalRanks(t->rows_comm_);
    t->spin_waits_ = common::SpinWaits(local_size);
    if (checked.ok()) t->host_pool_ = common::MakeHostPool(options.host_threads, local_size);
  }
  {
    const absl::Status same = common::CheckSharedOptions(t->rows_comm_, options);
    if (checked.ok()) checked = same;
  }
  MOONEP_RETURN_IF_ERROR(common::AgreeOnCreationChecks(
      t->rows_comm_, checked, "MPI transport: another rank refused its options or environment"));
  void* attr = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(t->rows_comm_, MPI_TAG_UB, &attr, &flag);
  const int64_t tag_ub = flag ? *static_cast<int*>(attr) : 32767;
  t->handle_tags_ = kMaxHandleTags;
  while (t->handle_tags_ > 1 &&
         (tag_ub + 1) / (int64_t{kSubTags} * kKinds * t->handle_tags_) < kMinTagSlots) {
    t->handle_tags_ /= 2;
  }
  t->tag_slots_ =
      std::max<int64_t>(1, (tag_ub + 1) / (int64_t{kSubTags} * kKinds * t->handle_tags_));
  t->seqs_per_epoch_ = std::max<int64_t>(1, std::min<int64_t>(4096, t->tag_slots_ / 2));
  for (auto& started : t->started_) started.assign(static_cast<size_t>(t->seqs_per_epoch_), {});
  // Every rank proposes its next epoch; all take the largest, so epochs only grow per process.
  static std::atomic<int64_t> next_epoch{0};
  int64_t proposed = next_epoch.load();
  MOONEP_RETURN_IF_ERROR(MpiCheck(
      MPI_Allreduce(&proposed, &t->epoch_, 1, MPI_INT64_T, MPI_MAX, t->rows_comm_),
      "MPI_Allreduce"));
  next_epoch = t->epoch_ + 3;  // three tags on abort_comm_ per transport
  t->abort_tag_ = static_cast<int>(t->epoch_ % (tag_ub + 1));
  t->close_tag_ = static_cast<int>((t->epoch_ + 1) % (tag_ub + 1));
  t->nudge_tag_ = static_cast<int>((t->epoch_ + 2) % (tag_ub + 1));
  MOONEP_RETURN_IF_ERROR(t->meta_type.Make());
  MOONEP_RETURN_IF_ERROR(MpiCheck(MPI_Irecv(t->abort_in_.data(), 2, MPI_INT64_T, MPI_ANY_SOURCE,
                                            t->abort_tag_, t->abort_comm_, &t->abort_request_),
                                  "MPI_Irecv"));
  log::SetRank(t->rank_);
  MOONEP_INFO("transport mpi: %d ranks, timeout %d ms, waits %s", t->size_, t->timeout_ms_,
              t->spin_waits_ ? "polling (a core per rank)" : "sleeping between polls");
  return std::unique_ptr<Transport>(std::move(t));
}

MpiTransport::~MpiTransport() {
  if (closed_) return;
  const absl::Status closed = Close();
  if (!closed.ok()) MOONEP_WARN("%s", std::string(closed.message()));
}

absl::Status MpiTransport::Close() {
  if (closed_) return close_status_;
  closed_ = true;
  close_status_ = common::CheckMpiNotFinalized("transport mpi destruction");
  if (!close_status_.ok()) return close_status_;  // no MPI call may be made: leave it all
  if (abort_request_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&abort_request_);
    MPI_Wait(&abort_request_, MPI_STATUS_IGNORE);
  }
  // After a failure anywhere, messages may still be in flight towards these communicators. Open
  // MPI hands messages for a freed context id to the next communicator that reuses the id, where
  // they break its matching; so communicators are freed only when every rank agrees that none of
  // them failed (a bounded, collective check), and are otherwise left allocated.
  // Every rank sends every peer whether it failed, and waits (bounded) for every peer's word: the
  // peers not heard from are named. The check's buffers outlive this object when a peer keeps it
  // from completing (MPI may still write into them), and so do the communicators.
  struct Check {
    int mine = 0;
    std::vector<int> theirs;
    std::vector<MPI_Request> recvs, sends;
  };
  auto* check = new Check;
  const size_t R = static_cast<size_t>(size_);
  check->mine = dirty_ ? 1 : 0;
  check->theirs.assign(R, 0);
  check->recvs.assign(R, MPI_REQUEST_NULL);
  check->sends.assign(R, MPI_REQUEST_NULL);
  bool posted = true;
  for (int r = 0; r < size_ && posted; ++r) {
    if (r == rank_) continue;
    posted = MPI_Irecv(&check->theirs[r], 1, MPI_INT, r, close_tag_, abort_comm_,
                       &check->recvs[r]) == MPI_SUCCESS &&
             MPI_Isend(&check->mine, 1, MPI_INT, r, close_tag_, abort_comm_, &check->sends[r]) ==
                 MPI_SUCCESS;
  }
  auto open = [](const std::vector<MPI_Request>& requests) {
    std::vector<int> ranks;
    for (size_t r = 0; r < requests.size(); ++r) {
      if (requests[r] != MPI_REQUEST_NULL) ranks.push_back(static_cast<int>(r));
    }
    return ranks;
  };
  const Clock::time_point until = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  while (posted) {
    // One by one (MPI_Testall completes none until all are done): the open ones name the peers.
    bool all = true;
    for (MPI_Request* requests : {check->recvs.data(), check->sends.data()}) {
      for (size_t r = 0; r < R; ++r) {
        int done = 0;
        if (requests[r] != MPI_REQUEST_NULL) MPI_Test(&requests[r], &done, MPI_STATUS_IGNORE);
        all = all && requests[r] == MPI_REQUEST_NULL;
      }
    }
    if (all || Clock::now() >= until) break;
    if (spin_waits_) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  const std::vector<int> silent = open(check->recvs), unreceived = open(check->sends);
  const bool done = posted && silent.empty() && unreceived.empty();
  bool clean = done && check->mine == 0;
  for (int theirs : check->theirs) clean = clean && theirs == 0;
  if (done) delete check;  // else left to the pending requests, with the communicators
  if (!posted) {
    close_status_ = SystemError("transport mpi destruction: could not post the check with the "
                                "peers on rank %d; its MPI communicators stay allocated", rank_);
  } else if (!silent.empty()) {
    close_status_ = Timeout(
        "transport mpi destruction timed out after %d ms on rank %d: nothing heard from rank(s) "
        "%s (they failed, hang, or destroy their layers in another order); its MPI communicators "
        "stay allocated", timeout_ms_, rank_, RankList(silent));
  } else if (!unreceived.empty()) {
    close_status_ = Timeout(
        "transport mpi destruction timed out after %d ms on rank %d: rank(s) %s did not take "
        "their data; its MPI communicators stay allocated", timeout_ms_, rank_,
        RankList(unreceived));
  }
  // Nudges: the ones that came are read (a freed context id's messages would reach the next
  // communicator that gets it), and the ones sent and not known complete are let go, their
  // messages left to MPI (it may still read them).
  if (done) (void)ReadNudges();
  for (auto& out : nudges_out_) {
    int complete = 0;
    MPI_Test(&out.second, &complete, MPI_STATUS_IGNORE);
    if (!complete) {
      MPI_Request_free(&out.second);
      (void)out.first.release();
    }
  }
  nudges_out_.clear();
  if (!clean) {
    if (close_status_.ok()) {
      MOONEP_INFO("transport mpi: a rank failed; keeping its communicators allocated");
    }
    return close_status_;
  }
  for (MPI_Comm* c : {&rows_comm_, &weights_comm_, &abort_comm_}) {
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }
  return close_status_;
}

absl::Status MpiTransport::PrepareHandle(DispatchHandle* handle, int64_t recv_capacity_rows) {
  MOONEP_RETURN_IF_ERROR(Usable());
  return common::PrepareHostHandle(options_, handle, recv_capacity_rows);
}

void MpiTransport::AddCounters(OpKind kind, const OpCounters& c) {
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

void MpiTransport::Poison(const absl::Status& status) {
  dirty_ = true;
  if (poisoned_.ok()) {
    poisoned_ = status;
    MOONEP_WARN("transport mpi: unusable after: %s", std::string(status.message()));
  }
}

absl::Status MpiTransport::Usable() const {
  if (closed_) return InvalidUsage("transport was closed (Close); destroy it");
  MOONEP_RETURN_IF_ERROR(common::CheckMpiNotFinalized("transport mpi"));
  if (poisoned_.ok()) return absl::OkStatus();
  return InvalidUsage("transport is unusable after an earlier failure (%s); destroy it",
                      std::string(poisoned_.message()));
}

absl::Status MpiTransport::AbortPeers(OpKind kind, absl::Status status) {
  abort_out_ = {rank_, common::AbortCode(kind, status)};
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request request;
    if (MPI_Isend(abort_out_.data(), 2, MPI_INT64_T, r, abort_tag_, abort_comm_, &request) ==
        MPI_SUCCESS) {
      MPI_Request_free(&request);
    }
  }
  Poison(status);
  return status;
}

bool MpiTransport::PeerGaveUp() {
  if (abort_request_ != MPI_REQUEST_NULL) {
    int done = 0;
    MPI_Test(&abort_request_, &done, MPI_STATUS_IGNORE);
    if (done) {
      abort_request_ = MPI_REQUEST_NULL;
      absl::Status s = common::AbortNoticeError(static_cast<int>(abort_in_[0]), abort_in_[1]);
      (common::IsGaveUpNotice(abort_in_[1]) ? gave_up_ : notice_) = s;
    }
  }
  return !gave_up_.ok();
}

absl::Status MpiTransport::PollAbort(bool gave_up_too) {
  const bool gave_up = PeerGaveUp();
  absl::Status s = !notice_.ok() ? notice_ : (gave_up && gave_up_too ? gave_up_ : absl::OkStatus());
  if (!s.ok()) Poison(s);
  return s;
}

absl::Status MpiTransport::CheckPeerOrder(int channel, int peer) {
  const MPI_Comm comm = channel == 0 ? rows_comm_ : weights_comm_;
  int flag = 0;
  MPI_Status status;
  if (MPI_Iprobe(peer, MPI_ANY_TAG, comm, &flag, &status) != MPI_SUCCESS || !flag) {
    return absl::OkStatus();
  }
  const int64_t spe = seqs_per_epoch_;
  const int64_t next = channel == 0 ? rows_seq_ : weights_seq_;
  const int tag = status.MPI_TAG;
  const int64_t slot = tag / (int64_t{kKinds} * handle_tags_ * kSubTags);
  const int theirs = static_cast<int>((tag / (int64_t{kSubTags} * handle_tags_)) % kKinds);
  const int their_bits = static_cast<int>((tag / kSubTags) % handle_tags_);
  // slot = (epoch_ * spe + seq mod spe) mod tag_slots_, with spe <= tag_slots_ / 2.
  const int64_t seq_mod =
      ((slot - (epoch_ * spe) % tag_slots_) % tag_slots_ + tag_slots_) % tag_slots_;
  if (seq_mod >= spe) return absl::OkStatus();  // not of this transport's epoch
  const int64_t ahead = ((seq_mod - next % spe) % spe + spe) % spe;
  if (ahead < spe / 2) return absl::OkStatus();  // an operation this rank has not started yet
  const Started& mine = started_[channel][static_cast<size_t>(seq_mod)];
  if (mine.seq < 0) return absl::OkStatus();
  if (mine.kind != theirs) {
    return common::CallOrderError(channel == 0 ? "row" : "weight", mine.seq, rank_,
                                  static_cast<OpKind>(mine.kind), peer,
                                  static_cast<OpKind>(theirs));
  }
  if (mine.dispatch_bits != their_bits) {
    return common::DispatchOrderError(mine.seq, rank_, static_cast<OpKind>(mine.kind), peer,
                                      mine.dispatch_bits, their_bits, handle_tags_);
  }
  return absl::OkStatus();  // data of an op in flight
}

void MpiTransport::NoteStarted(int channel, int64_t seq, OpKind kind, int dispatch_bits) {
  started_[channel][static_cast<size_t>(seq % seqs_per_epoch_)] =
      Started{seq, static_cast<int>(kind), dispatch_bits};
  if (early_nudges_.empty()) return;
  std::vector<std::pair<int, Nudge>> later;
  for (const auto& [from, n] : early_nudges_) {
    if (n.channel != channel || n.seq > seq) {
      later.push_back({from, n});
    } else if (n.seq == seq) {
      CheckNudge(from, n);
    }
  }
  early_nudges_.swap(later);
}

void MpiTransport::CheckNudge(int from, const Nudge& n) {
  if (!call_order_error_.ok() || n.channel < 0 || n.channel > 1 || n.seq < 0 || n.kind < 0 ||
      n.kind >= kKinds || n.dispatch_bits < 0 || n.dispatch_bits >= handle_tags_) {
    return;
  }
  const int channel = static_cast<int>(n.channel);
  const int64_t next = channel == 0 ? rows_seq_ : weights_seq_;
  if (n.seq >= next) {  // not started here yet: checked when it starts
    early_nudges_.push_back({from, n});
    return;
  }
  const Started& mine = started_[channel][static_cast<size_t>(n.seq % seqs_per_epoch_)];
  if (mine.seq != n.seq) return;  // too old to tell
  if (mine.kind != n.kind) {
    call_order_error_ = common::CallOrderError(channel == 0 ? "row" : "weight", n.seq, rank_,
                                               static_cast<OpKind>(mine.kind), from,
                                               static_cast<OpKind>(n.kind));
  } else if (mine.dispatch_bits != n.dispatch_bits) {
    call_order_error_ =
        common::DispatchOrderError(n.seq, rank_, static_cast<OpKind>(mine.kind), from,
                                   mine.dispatch_bits, static_cast<int>(n.dispatch_bits),
                                   handle_tags_);
  }
}

void MpiTransport::SendNudge(int peer, int channel, int64_t seq, OpKind kind, int dispatch_bits) {
  // Forget the nudges already sent (small, eager: they complete at once).
  size_t kept = 0;
  for (auto& out : nudges_out_) {
    int done = 0;
    MPI_Test(&out.second, &done, MPI_STATUS_IGNORE);
    if (!done) nudges_out_[kept++] = std::move(out);
  }
  nudges_out_.resize(kept);
  auto n = std::make_unique<Nudge>(
      Nudge{channel, seq, static_cast<int64_t>(kind), static_cast<int64_t>(dispatch_bits)});
  MPI_Request request;
  if (MPI_Isend(n.get(), kNudgeWords, MPI_INT64_T, peer, nudge_tag_, abort_comm_, &request) ==
      MPI_SUCCESS) {
    nudges_out_.emplace_back(std::move(n), request);
  }
}

absl::Status MpiTransport::ReadNudges() {
  while (true) {
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, nudge_tag_, abort_comm_, &flag, &status) != MPI_SUCCESS ||
        !flag) {
      break;
    }
    Nudge n;
    if (MPI_Recv(&n, kNudgeWords, MPI_INT64_T, status.MPI_SOURCE, nudge_tag_, abort_comm_,
                 MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      break;
    }
    CheckNudge(status.MPI_SOURCE, n);
  }
  return call_order_error_;
}

absl::StatusOr<RequestPtr> MpiTransport::Skipped() {
  dirty_ = true;  // peers will time out on this rank's silence
  MOONEP_WARN("transport mpi: test hook: rank %d skips this operation", rank_);
  return RequestPtr(new DoneRequest());
}


absl::StatusOr<RequestPtr> MpiTransport::StartExchangeCounts(absl::Span<const int32_t> topk_ids,
                                                             int64_t num_tokens, int32_t top_k,
                                                             int32_t num_experts,
                                                             int64_t recv_capacity_rows,
                                                             DispatchHandle* handle) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kCounts)) return Skipped();
  // A handle or E this rank cannot even describe to peers: nothing can be sent, so this is a
  // local error that the peers learn about through the abort channel.
  if (handle == nullptr) return AbortPeers(OpKind::kCounts, InvalidArgument("handle is null"));
  if (num_experts < 1 || num_experts > kMaxExperts) {
    return AbortPeers(OpKind::kCounts, InvalidArgument("num_experts must be in [1, %d], got %d",
                                                       kMaxExperts, num_experts));
  }
  // Refused before anything reaches the peers; the transport stays usable.
  MOONEP_RETURN_IF_ERROR(handle->CheckCanStart(OpKind::kCounts));
  absl::Status local = handle->TakeRefusal();
  if (local.ok()) {
    local = common::CheckCountsInput(topk_ids, num_tokens, top_k, num_experts, recv_capacity_rows,
                                     options_);
  }
  handle->exchange_no_ = exchanges_++;
  handle->counted_by_ = serial();
  auto op = std::make_unique<CountsOp>(this, rows_comm_, rows_seq_++, handle);
  handle->Track(op.get(), OpKind::kCounts);
  MOONEP_RETURN_IF_ERROR(op->Begin(
      op->Start(local, topk_ids, num_tokens, top_k, num_experts, recv_capacity_rows)));
  return RequestPtr(std::move(op));
}

absl::Status MpiTransport::CheckDispatched(OpKind kind, DispatchHandle* h) {
  absl::Status s = common::CheckHandleReady(kind, h, this, rank_, size_);
  return s.ok() ? s : AbortPeers(kind, s);
}

absl::StatusOr<RequestPtr> MpiTransport::StartDispatch(const planner::Plan& plan,
                                                       const TensorView& x,
                                                       absl::Span<const float> topk_weights,
                                                       DispatchHandle* h,
                                                       const TensorView& recv_rows,
                                                       absl::Span<float> recv_weights) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kDispatch)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kDispatch, h));
  // Agreed checks (identical on every rank) are returned as they are; local ones abort the peers.
  MOONEP_RETURN_IF_ERROR(common::CheckDispatchAgreed(plan, *h, rank_, size_));
  absl::Status s = common::CheckDispatchBuffers(plan, x, topk_weights, *h, recv_rows,
                                                recv_weights, rank_, options_.max_row_bytes,
                                                kBackendName);
  if (s.ok()) s = common::PrepareDispatch(plan, topk_weights, rank_, h, host_pool_.get());
  if (!s.ok()) return AbortPeers(OpKind::kDispatch, s);
  auto op = std::make_unique<DispatchOp>(this, OpKind::kDispatch, rows_comm_, rows_seq_++, h);
  h->Track(op.get(), OpKind::kDispatch);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(x, recv_rows, recv_weights.data())));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> MpiTransport::StartCombineBackward(DispatchHandle* h,
                                                              const TensorView& dy,
                                                              const TensorView& dy_rows) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kCombineBackward)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kCombineBackward, h));
  absl::Status s =
      common::CheckCombineBackwardBuffers(*h, dy, dy_rows, options_.max_row_bytes, kBackendName);
  if (!s.ok()) return AbortPeers(OpKind::kCombineBackward, s);
  auto op = std::make_unique<DispatchOp>(this, OpKind::kCombineBackward, rows_comm_, rows_seq_++, h);
  h->Track(op.get(), OpKind::kCombineBackward);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(dy, dy_rows, nullptr)));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> MpiTransport::StartCombine(DispatchHandle* h,
                                                      const TensorView& expert_rows,
                                                      const TensorView& y) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kCombine)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kCombine, h));
  absl::Status s =
      common::CheckCombineBuffers(*h, expert_rows, y, options_.max_row_bytes, kBackendName);
  if (s.ok()) s = common::EnsureRowStaging(options_, h, /*scalars=*/false);
  if (!s.ok()) return AbortPeers(OpKind::kCombine, s);
  auto op = std::make_unique<CombineOp>(this, OpKind::kCombine, rows_comm_, rows_seq_++, h);
  h->Track(op.get(), OpKind::kCombine);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(expert_rows, y)));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> MpiTransport::StartDispatchBackward(DispatchHandle* h,
                                                               const TensorView& dx_rows,
                                                               const TensorView& dx) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kDispatchBackward)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kDispatchBackward, h));
  absl::Status s =
      common::CheckDispatchBackwardBuffers(*h, dx_rows, dx, options_.max_row_bytes, kBackendName);
  if (s.ok()) s = common::EnsureRowStaging(options_, h, /*scalars=*/false);
  if (!s.ok()) return AbortPeers(OpKind::kDispatchBackward, s);
  auto op = std::make_unique<CombineOp>(this, OpKind::kDispatchBackward, rows_comm_, rows_seq_++, h);
  h->Track(op.get(), OpKind::kDispatchBackward);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(dx_rows, dx)));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> MpiTransport::StartTopkWeightGrad(DispatchHandle* h,
                                                             const TensorView& dy_rows,
                                                             const TensorView& expert_rows,
                                                             absl::Span<float> d_topk_weights) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kTopkWeightGrad)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kTopkWeightGrad, h));
  absl::Status s =
      common::CheckTopkWeightGradBuffers(*h, dy_rows, expert_rows, d_topk_weights, kBackendName);
  if (!s.ok()) return AbortPeers(OpKind::kTopkWeightGrad, s);
  auto op = std::make_unique<TopkWeightGradOp>(this, rows_comm_, rows_seq_++, h);
  h->Track(op.get(), OpKind::kTopkWeightGrad);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(dy_rows, expert_rows, d_topk_weights.data())));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> MpiTransport::StartPrefetch(const planner::Plan& plan,
                                                       const ExpertBlocks& params) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kPrefetch)) return Skipped();
  MOONEP_RETURN_IF_ERROR(Annotate(common::CheckSlotPlan(plan, size_, true), "prefetch"));
  absl::StatusOr<std::vector<common::ReplicaChain>> chains = ChainsOf(plan);
  MOONEP_RETURN_IF_ERROR(Annotate(chains.status(), "prefetch"));
  absl::Status s = common::CheckBlocks(plan, params, "params", kBackendName);
  if (!s.ok()) return AbortPeers(OpKind::kPrefetch, Annotate(s, "prefetch"));
  auto op = std::make_unique<PrefetchOp>(this, weights_comm_, weights_seq_++);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(*chains, params)));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> MpiTransport::StartReduce(const planner::Plan& plan,
                                                     const ExpertBlocks& grads) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kReduce)) return Skipped();
  MOONEP_RETURN_IF_ERROR(Annotate(common::CheckSlotPlan(plan, size_, true), "reduce"));
  absl::StatusOr<std::vector<common::ReplicaChain>> chains = ChainsOf(plan);
  MOONEP_RETURN_IF_ERROR(Annotate(chains.status(), "reduce"));
  absl::Status s = common::CheckBlocks(plan, grads, "grads", kBackendName);
  if (!s.ok()) return AbortPeers(OpKind::kReduce, Annotate(s, "reduce"));
  auto op = std::make_unique<ReduceOp>(this, weights_comm_, weights_seq_++);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(*chains, grads)));
  return RequestPtr(std::move(op));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateMpiTransport(const TransportOptions& options) {
  return MpiTransport::Create(options);
}

}  // namespace moonep::transport::mpi
