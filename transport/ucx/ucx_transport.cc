#include "transport/ucx/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <new>
#include <mutex>
#include <set>
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

namespace moonep::transport::ucx {
namespace {

using Clock = std::chrono::steady_clock;

// Row operations and weight operations are separate channels (own sequence numbers and signal
// slots), so a prefetch may overlap a dispatch.
constexpr int kRowsChannel = 0, kWeightsChannel = 1, kChannels = 2;
// Signal slots per (channel, peer): operation `seq` uses slot seq % kSignalDepth. A slot is reused
// only when the operation kSignalDepth earlier completed: an operation starts only while the
// oldest one of its channel still in flight is less than kSignalDepth sequence numbers back
// (CheckChannel), so fewer than kSignalDepth of a channel are in flight on a rank.
constexpr int64_t kSignalDepth = 32;
// Registered regions kept per transport; the least recently used unpinned one goes first.
constexpr size_t kMaxRegions = 256;
constexpr uint16_t kAmId = 7;

enum MsgType : int32_t {
  kMsgCounts = 1,
  kMsgReady = 2,
  kMsgAbort = 3,
  kMsgDropKey = 4,
  // Chunks of a prefetch or reduce hop (ChainOp): their bytes, or (after puts) which ones landed.
  kMsgChunks = 5,
  // Sent once by an operation that has waited kNudgeAfter for a peer's control message: its kind
  // (aux) lets the peer find that the two ranks called different operations where both only
  // wait on each other (no other message would show it). Read on arrival, never taken.
  kMsgWaiting = 6,
};
constexpr auto kNudgeAfter = std::chrono::milliseconds(20);
// The reduce contribution one rank passes to one peer (every fp32 partial of every expert tensor
// of that hop of the replica chains) travels eagerly inside control messages when it is at most
// this size (UCX buffers it at the receiver): no round trip for the receiver's ready, and the
// sender does not wait for the receiver. Larger ones are puts into the receiver's fp32 staging.
// MOONEP_UCX_EAGER_BYTES (default 8192; 0: always puts; at most 1 GiB; anything else fails
// transport creation naming it).
MOONEP_CHECKED_INT_PARAM(EagerReduceBytes, "UCX_EAGER_BYTES", 8192, 0, int64_t{1} << 30)

// Every control message (an active message) starts with this header.
struct MsgHeader {
  int32_t type;
  int32_t channel;
  int32_t from;
  int32_t aux;  // abort: AbortCode; an operation's message: its OpKind + 1 (call-order check)
  int64_t seq;  // op sequence; drop-key: the region id
  // An operation on a dispatch's handle: the number of that dispatch's count exchange among the
  // transport's (DispatchHandle::exchange_no_), so that a call on another dispatch's handle is
  // found (call-order check); -1 otherwise.
  int64_t dispatch;
  // Several messages of one type from one peer in one operation (a hop's kMsgChunks) are numbered
  // 0, 1, ...: part of the key a message is taken by. 0 for every other message.
  int64_t part;
};
static_assert(sizeof(MsgHeader) == 40, "MsgHeader is sent as bytes, without padding");

// A receiver's "ready" message: where a sender may write in this operation.
struct ReadyHeader {
  int64_t row_bytes;  // bytes per row (or -1 where rows do not apply)
  int64_t count;      // rows (or blocks) the receiver expects from this sender
  int32_t num_targets;
  int32_t pad;
};
struct TargetRef {
  uint64_t region_id;  // 0: an empty target (no bytes)
  uint64_t address;
  uint64_t length;
  uint32_t rkey_bytes;  // packed key follows when the sender has not seen this region yet
  uint32_t pad;
};

struct RowMeta {  // per dispatched row, sender -> receiver: its unique row and its top-k weight
  int32_t unique;
  float weight;
};
static_assert(sizeof(RowMeta) == 8, "RowMeta is sent as bytes");

absl::Status UcsCheck(ucs_status_t s, const char* what) {
  if (s == UCS_OK) return absl::OkStatus();
  return SystemError("%s failed: %s", what, ucs_status_string(s));
}

using common::RankList;

// Names this backend in argument errors ("the UCX transport needs host memory").
constexpr char kBackendName[] = "UCX";

// One UCP context per process, shared by every transport (each has its own worker): reading the
// configuration and opening the transports is the slow part of setup. UCX_* variables are read
// when the first transport is made.
struct SharedContext {
  std::mutex mu;
  ucp_context_h context = nullptr;
  int users = 0;
};
SharedContext& Shared() {
  static SharedContext* shared = new SharedContext();
  return *shared;
}

absl::StatusOr<ucp_context_h> AcquireContext() {
  SharedContext& s = Shared();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.context == nullptr) {
    ucp_config_t* config = nullptr;
    MOONEP_RETURN_IF_ERROR(UcsCheck(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read"));
    ucp_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
    // Transports (one worker each) may be used from different threads; they share the context.
    params.mt_workers_shared = 1;
    const ucs_status_t st = ucp_init(&params, config, &s.context);
    ucp_config_release(config);
    if (st != UCS_OK) {
      s.context = nullptr;
      return UcsCheck(st, "ucp_init");
    }
  }
  ++s.users;
  return s.context;
}

// The context stays for the life of the process once made: transports come and go (one per
// test, per layer configuration), and opening UCX again each time costs 100+ ms.
void ReleaseContext() {
  SharedContext& s = Shared();
  std::lock_guard<std::mutex> lock(s.mu);
  --s.users;
}

// A remote buffer a sender may write: bounds and key, from a ready message.
struct Target {
  uint64_t address = 0;
  uint64_t length = 0;
  ucp_rkey_h rkey = nullptr;
};

class UcxTransport;

// One operation in flight. A rank plays up to three parts in it: it waits for control messages
// (counts, or a receiver's "ready"), it waits for completion signals of senders writing into its
// buffers, and it waits for its own puts to complete (a flush per destination).
class UcxOp : public Request {
 public:
  // `dispatch`: the handle's DispatchHandle::exchange_no_ for an operation on a dispatch's handle
  // (its messages carry it), -1 otherwise.
  UcxOp(UcxTransport* transport, OpKind kind, int channel, int64_t seq, int64_t dispatch = -1);
  ~UcxOp() override;
  absl::StatusOr<bool> Test() override;
  absl::Status Wait() override;
  absl::Status Begin(absl::Status started);
  // fn runs once, when the op ends: completed, failed, or destroyed unfinished.
  void OnEnd(std::function<void()> fn) { on_end_ = std::move(fn); }

 protected:
  // Expect a message of `type` (and `part`, MsgHeader) from `peer` in this op; OnMessage runs
  // when it arrives. OnMessage may expect further messages.
  void ExpectMessage(int peer, int32_t type, int64_t part = 0) {
    awaiting_message_.push_back({peer, type, part});
  }
  // Expect the completion signal of `peer` (it wrote everything it had for this rank).
  void ExpectSignal(int peer) { awaiting_signal_.push_back(peer); }
  virtual absl::Status OnMessage(int /*peer*/, int32_t /*type*/, const std::vector<char>& /*m*/) {
    return absl::OkStatus();
  }
  virtual absl::Status OnSignal(int /*peer*/) { return absl::OkStatus(); }
  // A flush of FlushFor(peer, token) completed: the puts to `peer` before it are remotely complete.
  virtual absl::Status OnFlushed(int /*peer*/, int64_t /*token*/) { return absl::OkStatus(); }
  // Runs in every Test after the messages, signals and flushes that arrived or completed were
  // handled, before the op checks whether it is complete: for work they queued (ChainOp sends its
  // chunks messages here, one per peer and test rather than one per chunk).
  virtual absl::Status AfterProgress() { return absl::OkStatus(); }
  virtual absl::Status Finish() { return absl::OkStatus(); }
  // Count-exchange style errors that every rank sees alike keep the transport usable.
  virtual bool Agreed(const absl::Status& /*s*/) const { return false; }

  // Registers (cached) and pins a whole buffer, so targets inside it (per-peer ranges that move
  // with the routing) reuse one registration and one key.
  absl::Status PinBuffer(const void* data, uint64_t bytes);
  // Registers [data, data + bytes) (cached) and pins it for this op; fills the ready entry.
  absl::Status AddTarget(int peer, const void* data, uint64_t bytes, std::vector<char>* msg);
  // A control message of this op; the op completes only after it left this rank (a peer may
  // depend on it while this rank is outside MoonEP and makes no progress).
  absl::Status SendTracked(int peer, int32_t type, std::vector<char> payload, int64_t part = 0);
  // Sends a ready message: header then the targets added by AddTarget.
  absl::Status SendReady(int peer, int64_t row_bytes, int64_t count, int32_t num_targets,
                         std::vector<char> targets);
  // Parses a ready message into targets (keys resolved); checks the expected target count.
  absl::Status ParseReady(int peer, const std::vector<char>& m, int32_t want_targets,
                          ReadyHeader* header, std::vector<Target>* targets);
  // A bounds-checked put of bytes into target + offset.
  absl::Status Put(int peer, const void* src, uint64_t bytes, const Target& target,
                   uint64_t offset);
  // Flush (remote completion of the data), completion signal, then a flush of the signal whose
  // completion ends this rank's part for `peer`.
  absl::Status SignalAndFlush(int peer);
  // A flush of every put to `peer` so far; OnFlushed(peer, token) runs when it completed (at once
  // if it completes at once). The op is not complete while it is pending.
  absl::Status FlushFor(int peer, int64_t token);

  UcxTransport* transport_;
  OpKind kind_;
  int channel_;
  int64_t seq_;
  int64_t dispatch_;
  int me_;
  OpCounters counters_;

 private:
  absl::Status Fail(absl::Status status);
  void Cleanup();
  absl::Status TimeoutStatus() const;
  absl::Status Flush(int peer, bool signal_next, int64_t token = -1);
  absl::Status PutSignal(int peer);

  struct Awaited {
    int peer;
    int32_t type;
    int64_t part;
  };
  struct PendingFlush {
    int peer;
    void* request;
    bool signal_next;  // the data is flushed: the signal goes next
    int64_t token;     // >= 0: OnFlushed(peer, token) next (FlushFor)
  };
  std::vector<Awaited> awaiting_message_;
  std::vector<int> awaiting_signal_;
  std::vector<PendingFlush> flushes_;
  struct Sent {
    int peer;
    uint64_t id;
  };
  std::vector<Sent> sent_;
  std::vector<uint64_t> pinned_;
  uint64_t signal_value_ = 0;
  std::function<void()> on_end_;
 protected:
  bool chain_ = false;  // in the transport's chain ops until it ends (ChainOp)
 private:
  bool done_ = false;
  absl::Status status_;
  Clock::time_point deadline_;
  Clock::time_point nudge_at_;  // when to send kMsgWaiting to the peers still awaited
  bool nudged_ = false;
  int64_t timeout_ms_;
};

class UcxTransport : public Transport {
 public:
  ~UcxTransport() override;
  static absl::StatusOr<std::unique_ptr<Transport>> Create(const TransportOptions& options);

  const char* backend() const override { return "ucx"; }
  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  int64_t timeout_ms() const override { return timeout_ms_; }

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
  ucp_ep_h ep(int peer) const { return eps_[peer]; }
  void AddCounters(OpKind kind, const OpCounters& c);
  void Poison(const absl::Status& status);
  absl::Status Usable() const;
  absl::Status AbortPeers(OpKind kind, absl::Status status);
  // Once poisoned, the peers failed or were told already: a second notice would find no
  // receiver (each peer posts one).
  absl::Status AbortOperation(OpKind kind, absl::Status status) override {
    return poisoned_.ok() ? AbortPeers(kind, std::move(status)) : status;
  }
  // A peer's abort notice; one that says the peer gave up waiting fails only an operation that
  // starts or completes after it (`gave_up_too`), as in the mpi backend.
  absl::Status PollAbort(bool gave_up_too = false);
  bool PeerGaveUp() const { return abort_seen_ && common::IsGaveUpNotice(abort_kind_); }
  // One ucp_worker_progress for every operation and peer, then completed sends are reaped.
  void Progress();
  // Sends a control message; *id (if given) names it for MessagePending (0: already complete).
  // `dispatch`: see MsgHeader (-1 where no dispatch's handle is involved).
  // `part`: see MsgHeader.
  absl::Status SendMessage(int peer, int32_t type, int channel, int64_t seq, int32_t aux,
                           int64_t dispatch, std::vector<char> payload, uint64_t* id = nullptr,
                           int64_t part = 0);
  bool MessagePending(uint64_t id) const {
    for (const Outgoing& o : outbox_) {
      if (o.id == id) return true;
    }
    return false;
  }
  // Takes the message (channel, seq, from, type, part) if it arrived.
  bool TakeMessage(int channel, int64_t seq, int from, int32_t type, int64_t part,
                   std::vector<char>* out);
  void DropMessages(int channel, int64_t seq);
  bool SignalArrived(int channel, int64_t seq, int from) const {
    const volatile uint64_t* slot = SignalSlot(channel, from, seq);
    return *slot == static_cast<uint64_t>(seq + 1);
  }
  // Remote address of the signal slot this rank writes on `peer`.
  uint64_t RemoteSignalAddress(int peer, int channel, int64_t seq) const {
    const uint64_t index = (static_cast<uint64_t>(channel) * size_ + rank_) * kSignalDepth +
                           static_cast<uint64_t>(seq % kSignalDepth);
    return signal_remote_address_[peer] + index * sizeof(uint64_t);
  }
  ucp_rkey_h signal_rkey(int peer) const { return signal_rkeys_[peer]; }
  ucp_worker_h worker() const { return worker_; }

  // Registration cache: the region holding [data, data + bytes), mapped on first use.
  absl::StatusOr<uint64_t> Register(const void* data, uint64_t bytes);
  void Pin(uint64_t id, int delta);
  // The packed key of region `id` if `peer` has not been sent it yet (and marks it sent).
  const std::vector<char>* KeyFor(uint64_t id, int peer);
  // The unpacked key of `peer`'s region `id`, nullptr if not known yet.
  ucp_rkey_h RemoteKey(int peer, uint64_t id) const {
    auto it = remote_keys_.find({peer, id});
    return it == remote_keys_.end() ? nullptr : it->second;
  }
  bool closed() const { return closed_; }
  // Drops the registration of every region that overlaps [data, data + bytes) and no op pins,
  // telling the peers that hold its key: for a transport-owned buffer about to move, whose old
  // pages may be reused by anything (a registration kept for them would let a later buffer at
  // the same addresses reuse it, and RDMA would write into the freed pages).
  void ForgetRange(const void* data, uint64_t bytes);
  // Resizes a transport-owned staging buffer to `size` elements; when that moves it, its old
  // registration goes first (ForgetRange).
  template <typename T>
  void GrowOwnBuffer(std::vector<T>* buffer, size_t size) {
    if (size > buffer->capacity() && buffer->capacity() > 0) {
      ForgetRange(buffer->data(), buffer->capacity() * sizeof(T));
    }
    buffer->resize(size);
  }
  void OpStarted() { ++ops_in_flight_[0]; }
  void OpEnded() { --ops_in_flight_[0]; }
  void ChannelEnter(int channel, int64_t seq) { channel_seqs_[channel].insert(seq); }
  // Records this rank's operation `seq` of `channel` as a `kind` on dispatch `dispatch` (-1:
  // none), and checks the messages of that operation that arrived before it started
  // (CheckCallOrder).
  void NoteStarted(int channel, int64_t seq, OpKind kind, int64_t dispatch);
  // Numbers a count exchange among this transport's (DispatchHandle::exchange_no_).
  int64_t NextExchange() { return exchanges_++; }
  // A peer's message of operation `seq` whose kind or dispatch differs from this rank's operation
  // `seq`: the ranks called different operations, or one on the handles of different dispatches.
  // Kept until an operation fails with it.
  absl::Status call_order_error() const { return call_order_error_; }
  // Whether this rank started operation `seq` of `channel` (recently: kKindHistory back).
  bool Started(int channel, int64_t seq) const {
    return seq >= 0 && started_[channel][static_cast<size_t>(seq % kKindHistory)].seq == seq;
  }
  void ChannelLeave(int channel, int64_t seq) { channel_seqs_[channel].erase(seq); }

  // Reduce staging (fp32 partials): one buffer per reduce in flight, reused (and its registration
  // with it).
  common::BufferPool<std::vector<char>> reduce_staging;
  int64_t eager_bytes() const { return eager_bytes_; }
  // The replica chunk size (common::ResolveReplicaChunkBytes; 0: the default, common::ChunkElements).
  int64_t replica_chunk_bytes() const { return replica_chunk_bytes_; }
  RegistrationStats stats() const {
    RegistrationStats s = stats_;
    s.regions_cached = static_cast<int64_t>(regions_.size());
    return s;
  }

 private:
  UcxTransport() = default;
  static ucs_status_t OnActiveMessage(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param);
  const volatile uint64_t* SignalSlot(int channel, int from, int64_t seq) const {
    const uint64_t index = (static_cast<uint64_t>(channel) * size_ + from) * kSignalDepth +
                           static_cast<uint64_t>(seq % kSignalDepth);
    return signals_ + index;
  }
  absl::Status CheckDispatched(OpKind kind, DispatchHandle* handle);
  absl::StatusOr<RequestPtr> Skipped();
  absl::Status CheckChannel(OpKind kind, int channel);
  // StartPrefetch and StartReduce: `kind` along the replica chains (ChainOp); `name` names the
  // blocks in argument errors.
  absl::StatusOr<RequestPtr> StartChains(OpKind kind, const planner::Plan& plan,
                                         const ExpertBlocks& blocks, const char* name);
  // Close's exchange with every peer over comm_ (MPI tags kCloseArrive / kCloseDone), bounded by
  // 2 * timeout + 2 s, with this worker's progress; fills the peers not heard from. A peer whose
  // "gave up" message (kCloseGaveUp) arrives instead counts as heard from when `gave_up` is given
  // (it is added there).
  bool CloseExchange(int tag, std::vector<int>* silent, std::vector<int>* gave_up);
  void EvictRegions();
  // Unregisters regions_[i] and tells the peers holding its key to destroy theirs.
  void DropRegion(size_t i);
  void DestroyDroppedKeys();

  struct Region {
    uint64_t id = 0;
    uintptr_t base = 0;
    uint64_t length = 0;
    ucp_mem_h memh = nullptr;
    std::vector<char> packed_key;
    std::vector<char> peer_has_key;
    int pins = 0;
    uint64_t last_use = 0;
  };
  struct Outgoing {
    void* request;
    std::unique_ptr<std::vector<char>> bytes;
    uint64_t id;
  };

  TransportOptions options_;
  int32_t rank_ = 0, size_ = 1;
  int64_t timeout_ms_ = 0;
  int64_t eager_bytes_ = 0;  // MOONEP_UCX_EAGER_BYTES
  int64_t replica_chunk_bytes_ = 0;  // ResolveReplicaChunkBytes (checked at creation)
  std::shared_ptr<WorkerPool> host_pool_;  // the dispatch's layouts (null: this thread alone)
  MPI_Comm comm_ = MPI_COMM_NULL;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> eps_;
  // Signals: [channel][from][slot], UCX-allocated and registered once; peers' keys unpacked once.
  ucp_mem_h signal_memh_ = nullptr;
  volatile uint64_t* signals_ = nullptr;
  std::vector<uint64_t> signal_remote_address_;
  std::vector<ucp_rkey_h> signal_rkeys_;
  // Control messages that arrived, by (channel, seq, from, type, part).
  using MessageKey = std::tuple<int, int64_t, int, int32_t, int64_t>;
  std::map<MessageKey, std::vector<char>> inbox_;
  // The call each of those messages came from: its kind (OpKind + 1) and dispatch (MsgHeader).
  struct Call {
    int32_t kind = -1;
    int64_t dispatch = -1;
  };
  std::map<MessageKey, Call> inbox_calls_;
  // This rank's recent operations per channel, by sequence number mod kKindHistory. Operations
  // in flight together are fewer than kSignalDepth apart.
  static constexpr int64_t kKindHistory = 2 * kSignalDepth;
  struct StartedOp {
    int64_t seq = -1;
    Call call;
  };
  std::array<std::array<StartedOp, kKindHistory>, kChannels> started_{};
  int64_t exchanges_ = 0;  // count exchanges started (NextExchange)
  absl::Status call_order_error_;
  // Sets call_order_error_ (the first one) when a message of `theirs` from `from` belongs to this
  // rank's operation `seq` of another kind, or of the same kind on another dispatch's handle.
  void CheckCallOrder(int channel, int64_t seq, int from, const Call& theirs);
  std::vector<Outgoing> outbox_;
  uint64_t next_message_id_ = 1;
  std::vector<Region> regions_;
  uint64_t next_region_id_ = 1, use_clock_ = 0;
  std::map<std::pair<int, uint64_t>, ucp_rkey_h> remote_keys_;
  std::vector<ucp_rkey_h> dropped_keys_;  // destroyed once no op is in flight
  std::array<int64_t, 1> ops_in_flight_{};
  std::array<std::set<int64_t>, kChannels> channel_seqs_;  // sequence numbers in flight
  int64_t seq_[kChannels] = {0, 0};
  bool closed_ = false;
  absl::Status close_status_;  // Close's result
  bool abort_seen_ = false;
  int32_t abort_rank_ = -1, abort_kind_ = 0;
  absl::Status poisoned_;
  std::array<OpCounters, static_cast<int>(OpKind::kNumKinds)> counters_{};
  RegistrationStats stats_;

 public:
  // Prefetches and reduces in flight (chains: a holder passes a chunk on from its op's Test).
  // Every op's Test moves the others on too (ProgressChains), so chunks pass through this rank
  // while it waits on a dispatch or on another weight op, whatever order the ranks wait in.
  void AddChainOp(UcxOp* op) { chain_ops_.Add(op); }
  void RemoveChainOp(UcxOp* op) { chain_ops_.Remove(op); }
  void ProgressChains(const UcxOp* caller) { chain_ops_.Progress(caller); }

 private:
  common::ChainOpsInFlight<UcxOp> chain_ops_;

  friend class UcxOp;
};

// ---------------------------------------------------------------------------------------------
// UcxOp

UcxOp::UcxOp(UcxTransport* transport, OpKind kind, int channel, int64_t seq, int64_t dispatch)
    : transport_(transport),
      kind_(kind),
      channel_(channel),
      seq_(seq),
      dispatch_(dispatch),
      me_(transport->rank()),
      deadline_(Clock::now() + std::chrono::milliseconds(transport->timeout_ms())),
      nudge_at_(Clock::now() + kNudgeAfter),
      timeout_ms_(transport->timeout_ms()) {
  counters_.calls = 1;
  signal_value_ = static_cast<uint64_t>(seq + 1);
  transport_->OpStarted();
  transport_->ChannelEnter(channel_, seq_);
  transport_->NoteStarted(channel_, seq_, kind_, dispatch_);
}

UcxOp::~UcxOp() {
  if (!done_) {
    Fail(InvalidUsage("%s: request destroyed before it completed", OpName(kind_))).IgnoreError();
  }
}

absl::Status UcxOp::Begin(absl::Status started) {
  if (!started.ok()) return Fail(started);
  // A peer gave up before this operation began (this rank is late): fail now, with its reason. (A
  // failure notice shows at the first Test, as before.)
  transport_->Progress();  // notices arrive through the worker's progress
  if (transport_->PeerGaveUp()) return Fail(transport_->PollAbort(/*gave_up_too=*/true));
  if (!transport_->call_order_error().ok()) return Fail(transport_->call_order_error());
  return absl::OkStatus();
}

absl::Status UcxOp::PinBuffer(const void* data, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  MOONEP_ASSIGN_OR_RETURN(const uint64_t id, transport_->Register(data, bytes));
  transport_->Pin(id, 1);
  pinned_.push_back(id);
  return absl::OkStatus();
}

absl::Status UcxOp::AddTarget(int peer, const void* data, uint64_t bytes, std::vector<char>* msg) {
  TargetRef ref;
  std::memset(&ref, 0, sizeof(ref));
  const std::vector<char>* key = nullptr;
  if (bytes > 0) {
    MOONEP_ASSIGN_OR_RETURN(const uint64_t id, transport_->Register(data, bytes));
    transport_->Pin(id, 1);
    pinned_.push_back(id);
    ref.region_id = id;
    ref.address = reinterpret_cast<uintptr_t>(data);
    ref.length = bytes;
    key = transport_->KeyFor(id, peer);
    if (key) ref.rkey_bytes = static_cast<uint32_t>(key->size());
  }
  const size_t at = msg->size();
  msg->resize(at + sizeof(ref) + ref.rkey_bytes);
  std::memcpy(msg->data() + at, &ref, sizeof(ref));
  if (key) std::memcpy(msg->data() + at + sizeof(ref), key->data(), key->size());
  return absl::OkStatus();
}

absl::Status UcxOp::SendReady(int peer, int64_t row_bytes, int64_t count, int32_t num_targets,
                              std::vector<char> targets) {
  ReadyHeader h;
  std::memset(&h, 0, sizeof(h));
  h.row_bytes = row_bytes;
  h.count = count;
  h.num_targets = num_targets;
  std::vector<char> msg(sizeof(h) + targets.size());
  std::memcpy(msg.data(), &h, sizeof(h));
  if (!targets.empty()) std::memcpy(msg.data() + sizeof(h), targets.data(), targets.size());
  return SendTracked(peer, kMsgReady, std::move(msg));
}

absl::Status UcxOp::SendTracked(int peer, int32_t type, std::vector<char> payload,
                                int64_t part) {
  uint64_t id = 0;
  MOONEP_RETURN_IF_ERROR(
      transport_->SendMessage(peer, type, channel_, seq_, static_cast<int32_t>(kind_) + 1,
                              dispatch_, std::move(payload), &id, part));
  if (id != 0) sent_.push_back(Sent{peer, id});
  return absl::OkStatus();
}

absl::Status UcxOp::ParseReady(int peer, const std::vector<char>& m, int32_t want_targets,
                               ReadyHeader* header, std::vector<Target>* targets) {
  if (m.size() < sizeof(ReadyHeader)) {
    return InvalidArgument("%s: malformed ready message from rank %d", OpName(kind_), peer);
  }
  std::memcpy(header, m.data(), sizeof(ReadyHeader));
  if (header->num_targets != want_targets) {
    return InvalidArgument("%s: rank %d offers %d buffers, rank %d has %d to write there "
                           "(sizes differ across ranks?)",
                           OpName(kind_), peer, header->num_targets, me_, want_targets);
  }
  targets->assign(static_cast<size_t>(want_targets), Target{});
  size_t at = sizeof(ReadyHeader);
  for (int32_t i = 0; i < want_targets; ++i) {
    TargetRef ref;
    if (at + sizeof(ref) > m.size()) {
      return InvalidArgument("%s: malformed ready message from rank %d", OpName(kind_), peer);
    }
    std::memcpy(&ref, m.data() + at, sizeof(ref));
    at += sizeof(ref) + ref.rkey_bytes;
    Target& t = (*targets)[i];
    t.address = ref.address;
    t.length = ref.length;
    if (ref.region_id != 0) {
      t.rkey = transport_->RemoteKey(peer, ref.region_id);
      if (t.rkey == nullptr) {
        return SystemError("%s: no memory key for rank %d's region %d", OpName(kind_), peer,
                           ref.region_id);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status UcxOp::Put(int peer, const void* src, uint64_t bytes, const Target& target,
                        uint64_t offset) {
  if (bytes == 0) return absl::OkStatus();
  // The receiver's buffer bounds come with its ready message: no layout disagreement can make a
  // put land outside the buffer the receiver named.
  if (offset > target.length || bytes > target.length - offset || target.rkey == nullptr) {
    return InvalidArgument("%s: %d bytes at offset %d do not fit rank %d's %d-byte buffer "
                           "(sizes differ across ranks?)",
                           OpName(kind_), bytes, offset, peer, target.length);
  }
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  ucs_status_ptr_t r = ucp_put_nbx(transport_->ep(peer), src, bytes, target.address + offset,
                                   target.rkey, &param);
  if (UCS_PTR_IS_ERR(r)) {
    return Annotate(UcsCheck(UCS_PTR_STATUS(r), "ucp_put_nbx"), OpName(kind_));
  }
  // Completion is tracked by the flush that follows the signal; the request is released now.
  if (r != nullptr) ucp_request_free(r);
  ++counters_.messages_sent;
  return absl::OkStatus();
}

absl::Status UcxOp::SignalAndFlush(int peer) {
  // ucp_worker_fence orders operations per lane only (UCX 1.13): rows that travel as emulated RMA
  // over a shared-memory queue can arrive after a signal stored directly into the mapped signal
  // area. A flush (remote completion of every put to this peer) before the signal holds on every
  // transport; the signal follows when the flush completes (see Test).
  return Flush(peer, /*signal_next=*/true);
}

absl::Status UcxOp::FlushFor(int peer, int64_t token) {
  return Flush(peer, /*signal_next=*/false, token);
}

absl::Status UcxOp::Flush(int peer, bool signal_next, int64_t token) {
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  ucs_status_ptr_t r = ucp_ep_flush_nbx(transport_->ep(peer), &param);
  if (UCS_PTR_IS_ERR(r)) return Annotate(UcsCheck(UCS_PTR_STATUS(r), "ucp_ep_flush_nbx"), OpName(kind_));
  if (r != nullptr) {
    flushes_.push_back(PendingFlush{peer, r, signal_next, token});
    return absl::OkStatus();
  }
  if (signal_next) return PutSignal(peer);
  return token >= 0 ? OnFlushed(peer, token) : absl::OkStatus();
}

absl::Status UcxOp::PutSignal(int peer) {
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  ucs_status_ptr_t r =
      ucp_put_nbx(transport_->ep(peer), &signal_value_, sizeof(signal_value_),
                  transport_->RemoteSignalAddress(peer, channel_, seq_),
                  transport_->signal_rkey(peer), &param);
  if (UCS_PTR_IS_ERR(r)) return Annotate(UcsCheck(UCS_PTR_STATUS(r), "signal put"), OpName(kind_));
  // This rank's part for `peer` ends when the signal put completed locally. Not a flush: that
  // would need the receiver's progress after it already saw the signal and may have left
  // MoonEP (emulated RMA over tcp acknowledges in the target's progress).
  if (r != nullptr) flushes_.push_back(PendingFlush{peer, r, false, -1});
  return absl::OkStatus();
}

absl::Status UcxOp::TimeoutStatus() const {
  std::vector<int> silent, unreceived;
  auto add = [](std::vector<int>* list, int peer) {
    if (std::find(list->begin(), list->end(), peer) == list->end()) list->push_back(peer);
  };
  for (const Awaited& a : awaiting_message_) add(&silent, a.peer);
  for (int p : awaiting_signal_) add(&silent, p);
  for (const PendingFlush& f : flushes_) add(&unreceived, f.peer);
  for (const Sent& m : sent_) add(&unreceived, m.peer);
  std::sort(silent.begin(), silent.end());
  std::sort(unreceived.begin(), unreceived.end());
  if (!silent.empty()) {
    return Timeout("%s timed out after %d ms on rank %d: nothing heard from rank(s) %s",
                   OpName(kind_), timeout_ms_, me_, RankList(silent));
  }
  return Timeout("%s timed out after %d ms on rank %d: rank(s) %s did not take their data",
                 OpName(kind_), timeout_ms_, me_, RankList(unreceived));
}

absl::StatusOr<bool> UcxOp::Test() {
  if (done_) {
    if (!status_.ok()) return status_;
    return true;
  }
  transport_->Progress();
  {
    absl::Status usable = transport_->Usable();
    if (usable.ok()) usable = transport_->PollAbort();
    if (usable.ok()) usable = transport_->call_order_error();
    if (!usable.ok()) return Fail(usable);
  }
  // Control messages (counts, ready): each may start puts.
  for (size_t i = 0; i < awaiting_message_.size();) {
    std::vector<char> m;
    const Awaited a = awaiting_message_[i];
    if (!transport_->TakeMessage(channel_, seq_, a.peer, a.type, a.part, &m)) {
      ++i;
      continue;
    }
    awaiting_message_.erase(awaiting_message_.begin() + static_cast<ptrdiff_t>(i));
    absl::Status s = OnMessage(a.peer, a.type, m);
    if (!s.ok()) return Fail(s);
  }
  for (size_t i = 0; i < awaiting_signal_.size();) {
    const int peer = awaiting_signal_[i];
    if (!transport_->SignalArrived(channel_, seq_, peer)) {
      ++i;
      continue;
    }
    awaiting_signal_.erase(awaiting_signal_.begin() + static_cast<ptrdiff_t>(i));
    absl::Status s = OnSignal(peer);
    if (!s.ok()) return Fail(s);
  }
  for (size_t i = 0; i < flushes_.size();) {
    const ucs_status_t st = ucp_request_check_status(flushes_[i].request);
    if (st == UCS_INPROGRESS) {
      ++i;
      continue;
    }
    ucp_request_free(flushes_[i].request);
    const int peer = flushes_[i].peer;
    const bool signal_next = flushes_[i].signal_next;
    const int64_t token = flushes_[i].token;
    flushes_.erase(flushes_.begin() + static_cast<ptrdiff_t>(i));
    if (st != UCS_OK) {
      return Fail(Annotate(UcsCheck(st, "flush"), absl::StrCat(OpName(kind_), " to rank ", peer)));
    }
    if (signal_next) {
      absl::Status s = PutSignal(peer);
      if (!s.ok()) return Fail(s);
    } else if (token >= 0) {
      absl::Status s = OnFlushed(peer, token);
      if (!s.ok()) return Fail(s);
    }
  }
  {
    absl::Status s = AfterProgress();
    if (!s.ok()) return Fail(s);
  }
  for (size_t i = 0; i < sent_.size();) {
    if (transport_->MessagePending(sent_[i].id)) {
      ++i;
    } else {
      sent_.erase(sent_.begin() + static_cast<ptrdiff_t>(i));
    }
  }
  if (awaiting_message_.empty() && awaiting_signal_.empty() && flushes_.empty() && sent_.empty()) {
    // A peer that gave up (timed out) may have sent its part before it did: see the mpi backend.
    absl::Status s = transport_->PollAbort(/*gave_up_too=*/true);
    if (!s.ok()) return Fail(s);
    s = Finish();
    if (!s.ok()) return Fail(s);
    done_ = true;
    Cleanup();
    transport_->AddCounters(kind_, counters_);
    return true;
  }
  transport_->ProgressChains(this);
  // A weight op that failed in there poisoned the transport (and told the peers): this op fails
  // with that failure, not at its next Test as a misuse of an unusable transport.
  if (!transport_->health().ok()) return Fail(transport_->health());
  const Clock::time_point now = Clock::now();
  if (!nudged_ && now >= nudge_at_) {
    nudged_ = true;
    std::vector<int> told;
    for (const Awaited& a : awaiting_message_) {
      if (std::find(told.begin(), told.end(), a.peer) != told.end()) continue;
      told.push_back(a.peer);
      absl::Status s = transport_->SendMessage(a.peer, kMsgWaiting, channel_, seq_,
                                               static_cast<int32_t>(kind_) + 1, dispatch_, {});
      if (!s.ok()) return Fail(s);
    }
  }
  if (now >= deadline_) return Fail(TimeoutStatus());
  return false;
}

absl::Status UcxOp::Wait() {
  int idle = 0;
  while (true) {
    absl::StatusOr<bool> r = Test();
    if (!r.ok()) return r.status();
    if (*r) return absl::OkStatus();
    // Oversubscribed hosts: let the peers we wait for run.
    if (++idle < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

absl::Status UcxOp::Fail(absl::Status status) {
  if (done_) return status_;
  done_ = true;
  status_ = status;
  const bool pending = !flushes_.empty();
  Cleanup();
  const bool remote = ToResult(status) == moonepRemoteError;
  if (pending || !Agreed(status)) {
    // Also on a timeout: a late peer fails its call with the reason (see the mpi backend).
    if (!remote) transport_->AbortPeers(kind_, status).IgnoreError();
    transport_->Poison(status);
  }
  return status;
}

void UcxOp::Cleanup() {
  if (chain_) transport_->RemoveChainOp(this);
  chain_ = false;
  if (on_end_) std::exchange(on_end_, nullptr)();
  // Flushes still pending complete in the background; their requests are released now. Puts
  // already issued cannot be recalled: a failed transport is destroyed, not reused.
  // After Close the worker that owned them is gone (the caller broke Close's contract): leave them.
  if (!transport_->closed()) {
    for (const PendingFlush& f : flushes_) ucp_request_free(f.request);
  }
  flushes_.clear();
  for (uint64_t id : pinned_) transport_->Pin(id, -1);
  pinned_.clear();
  transport_->DropMessages(channel_, seq_);
  transport_->ChannelLeave(channel_, seq_);
  transport_->OpEnded();
}

class DoneRequest : public Request {
 public:
  absl::StatusOr<bool> Test() override { return true; }
  absl::Status Wait() override { return absl::OkStatus(); }
};

// ---------------------------------------------------------------------------------------------
// Count exchange: [flag, T, K, E, capacity, counts[max(E, 32)]] to every peer as a control
// message.


class CountsOp : public UcxOp {
 public:
  CountsOp(UcxTransport* t, int channel, int64_t seq, DispatchHandle* handle)
      : UcxOp(t, OpKind::kCounts, channel, seq, handle->exchange_no_), handle_(handle) {}

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
      ExpectMessage(r, kMsgCounts);
      std::vector<char> payload(static_cast<size_t>(width) * 8);
      std::memcpy(payload.data(), mine_.data(), payload.size());
      MOONEP_RETURN_IF_ERROR(
          SendTracked(r, kMsgCounts, std::move(payload)));
      counters_.bytes_sent += width * 8;
      ++counters_.messages_sent;
    }
    common::KeepRouting(local, ids, T, K, handle_);
    return absl::OkStatus();
  }

 private:
  bool Agreed(const absl::Status& s) const override {
    return absl::IsInvalidArgument(s) || absl::IsResourceExhausted(s) ||
           ToResult(s) == moonepRemoteError;
  }

  absl::Status OnMessage(int peer, int32_t, const std::vector<char>& m) override {
    const int64_t width = common::CountMessageWords(E_);
    counters_.bytes_received += static_cast<int64_t>(m.size());
    // A different width means a different num_experts: every rank sees it in this exchange.
    if (static_cast<int64_t>(m.size()) != width * 8) {
      mismatch_[peer] = 1;
      if (m.size() >= 8) std::memcpy(all_.data() + peer * width, m.data(), 8);
      return absl::OkStatus();
    }
    std::memcpy(all_.data() + peer * width, m.data(), m.size());
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    return common::FinishCountExchange(local_, mine_, all_, mismatch_, me_, R_, E_, handle_);
  }

  DispatchHandle* handle_;
  absl::Status local_;
  int32_t E_ = 0, R_ = 0;
  std::vector<int64_t> mine_, all_;
  std::vector<char> mismatch_;
};

// Dispatch (rows + per-row metadata) and combine-backward (the same movement of dy, metadata
// known). A sender puts each unique token once, at the first row it fills on the destination
// (its landing row: the same function of the layout on both sides); the receiver copies it into
// the token's other rows after the signal.
class DispatchOp : public UcxOp {
 public:
  DispatchOp(UcxTransport* t, OpKind kind, int channel, int64_t seq, DispatchHandle* h)
      : UcxOp(t, kind, channel, seq, h->exchange_no_), h_(h) {}

  absl::Status Start(const TensorView& x, const TensorView& rows, float* weights) {
    forward_ = kind_ == OpKind::kDispatch;
    const SendLayout& send = h_->send_;
    const ReceiveLayout& recv = h_->recv_;
    const int32_t R = h_->num_ranks_;
    x_ = x;
    rows_ = rows;
    weights_ = weights;
    row_bytes_ = static_cast<int64_t>(x.shape[1]) * DTypeSize(x.dtype);
    common::ZeroUnfilledRows(h_->plan_, me_, rows, weights);
    if (forward_) {
      // Sized for the receive capacity, so its address (and registration) survives routing changes.
      const size_t meta_capacity =
          static_cast<size_t>(std::max<int64_t>(h_->rank_capacity_[me_], recv.rows_begin[R])) *
          sizeof(RowMeta);
      if (h_->meta_recv_.capacity() < meta_capacity) h_->meta_recv_.reserve(meta_capacity);
      h_->meta_recv_.resize(static_cast<size_t>(recv.rows_begin[R]) * sizeof(RowMeta));
      if (recv.rows_begin[R] > recv.rows_from(me_)) {
        MOONEP_RETURN_IF_ERROR(PinBuffer(h_->meta_recv_.data(), h_->meta_recv_.capacity()));
      }
      h_->recv_unique_.assign(static_cast<size_t>(recv.rows_begin[R]), -1);
      h_->landing_.assign(static_cast<size_t>(recv.rows_begin[R]), -1);
      h_->unique_from_.assign(R, 0);
    }
    // Receiver part: tell each source where its rows (and metadata) go.
    for (int32_t s = 0; s < R; ++s) {
      const int64_t n = recv.rows_from(s);
      if (s == me_ || n == 0) continue;
      std::vector<char> targets;
      MOONEP_RETURN_IF_ERROR(AddTarget(s, rows.data, rows.nbytes(), &targets));
      if (forward_) {
        MOONEP_RETURN_IF_ERROR(AddTarget(
            s, h_->meta_recv_.data() + recv.rows_begin[s] * sizeof(RowMeta),
            static_cast<uint64_t>(n) * sizeof(RowMeta), &targets));
      }
      MOONEP_RETURN_IF_ERROR(SendReady(s, row_bytes_, n, forward_ ? 2 : 1, std::move(targets)));
      ExpectSignal(s);
    }
    // Sender part: wait for each destination's ready.
    for (int32_t d = 0; d < R; ++d) {
      if (d != me_ && send.rows_to(d) > 0) ExpectMessage(d, kMsgReady);
    }
    if (forward_) h_->meta_send_.resize(send.entries.size() * sizeof(RowMeta));
    // This rank's own rows: copied directly.
    for (int64_t i = send.entry_begin[me_]; i < send.entry_begin[me_ + 1]; ++i) {
      const int32_t entry = send.entries[i];
      const int64_t row = send.dest_row[entry];
      std::memcpy(rows.row(row), x.row(entry / send.top_k), static_cast<size_t>(row_bytes_));
      if (forward_) weights_[row] = h_->topk_weights_[entry];
    }
    counters_.rows_local += send.rows_to(me_);
    return absl::OkStatus();
  }

 private:
  absl::Status OnMessage(int d, int32_t, const std::vector<char>& m) override {
    const SendLayout& send = h_->send_;
    const int64_t n = send.rows_to(d), u = send.unique_to(d);
    ReadyHeader header;
    std::vector<Target> targets;
    MOONEP_RETURN_IF_ERROR(ParseReady(d, m, forward_ ? 2 : 1, &header, &targets));
    if (header.row_bytes != row_bytes_ || header.count != n) {
      return InvalidArgument("%s: rank %d expects %d rows of %d bytes from rank %d, which has %d "
                             "rows of %d bytes (sizes differ across ranks?)",
                             OpName(kind_), d, header.count, header.row_bytes, me_, n, row_bytes_);
    }
    if (forward_) {
      auto* meta = reinterpret_cast<RowMeta*>(h_->meta_send_.data()) + send.entry_begin[d];
      for (int64_t i = 0; i < n; ++i) {
        const int32_t entry = send.entries[send.entry_begin[d] + i];
        meta[i].unique = send.entry_unique[send.entry_begin[d] + i];
        meta[i].weight = h_->topk_weights_[entry];
      }
      MOONEP_RETURN_IF_ERROR(Put(d, meta, static_cast<uint64_t>(n) * sizeof(RowMeta), targets[1], 0));
      counters_.bytes_sent += n * static_cast<int64_t>(sizeof(RowMeta));
    }
    // Landing row of each unique token: the first (lowest) row of its entries on d.
    landing_.assign(static_cast<size_t>(u), -1);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t entry = send.entries[send.entry_begin[d] + i];
      const int32_t uq = send.entry_unique[send.entry_begin[d] + i];
      if (uq >= 0 && uq < u && landing_[uq] < 0) landing_[uq] = send.dest_row[entry];
    }
    // One put per run of consecutive tokens landing on consecutive rows.
    for (int64_t i = 0; i < u;) {
      const int32_t token = send.unique_tokens[send.unique_begin[d] + i];
      int64_t j = i + 1;
      while (j < u && send.unique_tokens[send.unique_begin[d] + j] == token + (j - i) &&
             landing_[j] == landing_[i] + (j - i)) {
        ++j;
      }
      if (landing_[i] < 0) return InvalidArgument("%s: unique row %d has no landing row", OpName(kind_), i);
      MOONEP_RETURN_IF_ERROR(Put(d, x_.row(token), static_cast<uint64_t>((j - i) * row_bytes_),
                                 targets[0], static_cast<uint64_t>(landing_[i] * row_bytes_)));
      i = j;
    }
    counters_.rows_sent += u;
    counters_.bytes_sent += u * row_bytes_;
    counters_.rows_deduplicated += n - u;
    counters_.bytes_deduplicated += (n - u) * row_bytes_;
    return SignalAndFlush(d);
  }

  absl::Status OnSignal(int s) override {
    const ReceiveLayout& recv = h_->recv_;
    const int64_t base = recv.rows_begin[s];
    const int64_t n = recv.rows_from(s);
    if (forward_) {
      const auto* meta = reinterpret_cast<const RowMeta*>(h_->meta_recv_.data()) + base;
      int64_t unique = 0;
      absl::Status bad;
      common::ForEachRowFrom(recv, s, [&](int64_t i, int64_t row) {
        const int32_t u = meta[i].unique;
        if (u < 0 || u >= n) {
          if (bad.ok()) bad = InvalidArgument("dispatch: rank %d sent unique index %d for %d rows", s, u, n);
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
      counters_.bytes_received += n * static_cast<int64_t>(sizeof(RowMeta));
    }
    // Rows are in place at their landing rows: copy each into the other rows of its token.
    int64_t copies = 0;
    common::ForEachRowFrom(recv, s, [&](int64_t i, int64_t row) {
      const int64_t landing = h_->landing_[base + h_->recv_unique_[base + i]];
      if (landing != row) {
        std::memcpy(rows_.row(row), rows_.row(landing), static_cast<size_t>(row_bytes_));
        ++copies;
      }
    });
    counters_.rows_received += n - copies;
    counters_.bytes_received += (n - copies) * row_bytes_;
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    if (forward_) h_->dispatched_ = true;
    return absl::OkStatus();
  }

  DispatchHandle* h_;
  bool forward_ = true;
  TensorView x_, rows_;
  float* weights_ = nullptr;
  int64_t row_bytes_ = 0;
  std::vector<int64_t> landing_;
};

// Combine (weighted) and dispatch-backward (unweighted): rows back to their sources, summed. A
// source's staging holds the rows from destination d at [entry_begin[d], entry_begin[d+1]) in
// d's row order, so each run of d's layout is one put.
class CombineOp : public UcxOp {
 public:
  CombineOp(UcxTransport* t, OpKind kind, int channel, int64_t seq, DispatchHandle* h)
      : UcxOp(t, kind, channel, seq, h->exchange_no_), h_(h) {}

  absl::Status Start(const TensorView& rows, const TensorView& y) {
    const SendLayout& send = h_->send_;
    const ReceiveLayout& recv = h_->recv_;
    const int32_t R = h_->num_ranks_;
    rows_ = rows;
    y_ = y;
    row_bytes_ = static_cast<int64_t>(rows.shape[1]) * DTypeSize(rows.dtype);
    char* staging = h_->rows_staging_.data();
    if (send.entries.size() > static_cast<size_t>(send.rows_to(me_))) {
      MOONEP_RETURN_IF_ERROR(PinBuffer(staging, h_->rows_staging_.size()));
    }
    for (int32_t d = 0; d < R; ++d) {
      const int64_t n = send.rows_to(d);
      if (d == me_ || n == 0) continue;
      std::vector<char> targets;
      MOONEP_RETURN_IF_ERROR(AddTarget(d, staging + send.entry_begin[d] * row_bytes_,
                                       static_cast<uint64_t>(n * row_bytes_), &targets));
      MOONEP_RETURN_IF_ERROR(SendReady(d, row_bytes_, n, 1, std::move(targets)));
      ExpectSignal(d);
    }
    for (int32_t s = 0; s < R; ++s) {
      if (s != me_ && recv.rows_from(s) > 0) ExpectMessage(s, kMsgReady);
    }
    counters_.rows_local += send.rows_to(me_);
    return absl::OkStatus();
  }

 private:
  absl::Status OnMessage(int s, int32_t, const std::vector<char>& m) override {
    const ReceiveLayout& recv = h_->recv_;
    const int64_t n = recv.rows_from(s);
    ReadyHeader header;
    std::vector<Target> targets;
    MOONEP_RETURN_IF_ERROR(ParseReady(s, m, 1, &header, &targets));
    if (header.row_bytes != row_bytes_ || header.count != n) {
      return InvalidArgument("%s: rank %d expects %d rows of %d bytes from rank %d, which has %d "
                             "rows of %d bytes (sizes differ across ranks?)",
                             OpName(kind_), s, header.count, header.row_bytes, me_, n, row_bytes_);
    }
    int64_t at = 0;
    for (int64_t r = recv.run_begin[s]; r < recv.run_begin[s + 1]; ++r) {
      MOONEP_RETURN_IF_ERROR(Put(s, rows_.row(recv.run_row[r]),
                                 static_cast<uint64_t>(recv.run_count[r] * row_bytes_), targets[0],
                                 static_cast<uint64_t>(at * row_bytes_)));
      at += recv.run_count[r];
    }
    counters_.rows_sent += n;
    counters_.bytes_sent += n * row_bytes_;
    return SignalAndFlush(s);
  }

  absl::Status OnSignal(int d) override {
    counters_.rows_received += h_->send_.rows_to(d);
    counters_.bytes_received += h_->send_.rows_to(d) * row_bytes_;
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    const SendLayout& send = h_->send_;
    const bool weighted = kind_ == OpKind::kCombine;
    const int64_t T = send.num_tokens, H = y_.shape[1];
    const int32_t K = send.top_k;
    // Staging position of every remote entry.
    position_.assign(static_cast<size_t>(T) * K, -1);
    for (int64_t i = 0; i < static_cast<int64_t>(send.entries.size()); ++i) {
      position_[send.entries[i]] = i;
    }
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
                                   : static_cast<const void*>(staging + position_[entry] * row_bytes_);
        const float w = weighted ? h_->topk_weights_[entry] : 1.0f;
        if (rows_.dtype == DType::kFloat32) {
          const float* v = static_cast<const float*>(src);
          for (size_t j = 0; j < elems_per_row; ++j) acc_[j] += w * v[j];
        } else {
          const BFloat16* v = static_cast<const BFloat16*>(src);
          for (size_t j = 0; j < elems_per_row; ++j) acc_[j] += w * v[j].ToFloat();
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
  std::vector<int64_t> position_;
};

// d topk_weights: one dot product per row where the rows are, one float back per row, into the
// source's scalar staging in its send order (one put per destination).
class TopkWeightGradOp : public UcxOp {
 public:
  TopkWeightGradOp(UcxTransport* t, int channel, int64_t seq, DispatchHandle* h)
      : UcxOp(t, OpKind::kTopkWeightGrad, channel, seq, h->exchange_no_), h_(h) {}

  absl::Status Start(const TensorView& dy_rows, const TensorView& out_rows, float* dw) {
    const SendLayout& send = h_->send_;
    const ReceiveLayout& recv = h_->recv_;
    const int32_t R = h_->num_ranks_;
    const int64_t H = dy_rows.shape[1];
    dw_ = dw;
    for (size_t i = 0; i < send.dest_rank.size(); ++i) {
      if (send.dest_rank[i] < 0) dw[i] = 0.0f;
    }
    std::vector<float>& incoming = h_->scalar_staging_;
    if (incoming.size() < send.entries.size()) {
      transport_->GrowOwnBuffer(&incoming, send.entries.size());
    }
    if (send.entries.size() > static_cast<size_t>(send.rows_to(me_))) {
      MOONEP_RETURN_IF_ERROR(PinBuffer(incoming.data(), incoming.size() * sizeof(float)));
    }
    for (int32_t d = 0; d < R; ++d) {
      const int64_t n = send.rows_to(d);
      if (d == me_ || n == 0) continue;
      std::vector<char> targets;
      MOONEP_RETURN_IF_ERROR(AddTarget(d, incoming.data() + send.entry_begin[d],
                                       static_cast<uint64_t>(n) * 4, &targets));
      MOONEP_RETURN_IF_ERROR(SendReady(d, 4, n, 1, std::move(targets)));
      ExpectSignal(d);
    }
    dots_.resize(static_cast<size_t>(recv.rows_begin[R]));
    std::vector<float> a(static_cast<size_t>(H)), b(static_cast<size_t>(H));
    for (int32_t s = 0; s < R; ++s) {
      common::ForEachRowFrom(recv, s, [&](int64_t i, int64_t row) {
        ConvertToFloat(dy_rows.row(row), dy_rows.dtype, a.data(), a.size());
        ConvertToFloat(out_rows.row(row), out_rows.dtype, b.data(), b.size());
        double sum = 0.0;
        for (int64_t j = 0; j < H; ++j) sum += static_cast<double>(a[j]) * b[j];
        dots_[recv.rows_begin[s] + i] = static_cast<float>(sum);
      });
      if (s != me_ && recv.rows_from(s) > 0) ExpectMessage(s, kMsgReady);
    }
    for (int64_t i = send.entry_begin[me_]; i < send.entry_begin[me_ + 1]; ++i) {
      dw[send.entries[i]] = dots_[recv.rows_begin[me_] + (i - send.entry_begin[me_])];
    }
    counters_.rows_local += send.rows_to(me_);
    return absl::OkStatus();
  }

 private:
  absl::Status OnMessage(int s, int32_t, const std::vector<char>& m) override {
    const ReceiveLayout& recv = h_->recv_;
    const int64_t n = recv.rows_from(s);
    ReadyHeader header;
    std::vector<Target> targets;
    MOONEP_RETURN_IF_ERROR(ParseReady(s, m, 1, &header, &targets));
    if (header.count != n) {
      return InvalidArgument("%s: rank %d expects %d rows from rank %d, which has %d",
                             OpName(kind_), s, header.count, me_, n);
    }
    MOONEP_RETURN_IF_ERROR(Put(s, dots_.data() + recv.rows_begin[s], static_cast<uint64_t>(n) * 4,
                               targets[0], 0));
    counters_.rows_sent += n;
    counters_.bytes_sent += n * 4;
    return SignalAndFlush(s);
  }

  absl::Status OnSignal(int d) override {
    const SendLayout& send = h_->send_;
    const std::vector<float>& incoming = h_->scalar_staging_;
    for (int64_t i = send.entry_begin[d]; i < send.entry_begin[d + 1]; ++i) {
      dw_[send.entries[i]] = incoming[i];
    }
    counters_.rows_received += send.rows_to(d);
    counters_.bytes_received += send.rows_to(d) * 4;
    return absl::OkStatus();
  }

  DispatchHandle* h_;
  float* dw_ = nullptr;
  std::vector<float> dots_;
};

// ---------------------------------------------------------------------------------------------
// Weight ops: prefetch and reduce along replica chains (common/replica_chain.h).
//
// Every expert with replicas moves along its chain: home -> h1 -> ... -> hn for the prefetch (each
// holder keeps the bytes in its slot and passes them on), h1 -> ... -> hn -> home for the reduce
// (fp32 partials: p1 = g1, p(i) = p(i-1) + g(i), home = store(pn + home)). A rank's part in a
// chain is one stream per expert tensor, cut into chunks of common::ChunkElements(
// replica_chunk_bytes) elements that come in from its prev and go out to its next. A holder passes
// chunk c on as soon as it has it (reduce: with its own slot's chunk c added), not after the whole
// tensor, so a chain of n hops takes about one transfer plus n - 1 chunk times.
//
// A hop pair (sender, receiver) of one operation carries the streams of every chain in which the
// receiver follows the sender, listed alike on both sides (increasing expert, then tensor). Its
// chunks go in kMsgChunks messages numbered 0, 1, ... (MsgHeader::part) that the receiver awaits
// in turn, each entry naming its stream and chunk: however the sender's chunks become ready (a
// middle holder gets them from several prevs, in any order), each lands where it belongs, and two
// weight operations in flight never mix (the sequence number is in every key). The pair's bytes
// (every chunk of every stream), computed alike on both sides, choose how:
//   eager  a reduce pair of at most MOONEP_UCX_EAGER_BYTES of fp32 partials: the chunk bytes ride
//          inside the messages (UCX buffers them at the receiver): no ready to wait for, and a
//          sender never waits for its receiver;
//   puts   every other pair: the receiver sends one ready naming a buffer per stream (prefetch:
//          its slot tensor; reduce: its fp32 staging), the sender puts each chunk there and
//          flushes it (remote completion, as before a signal: SignalAndFlush), and the messages
//          name the chunks that landed. A flush per chunk, not per pair: the receiver may pass
//          chunk c on while c + 1 is still on its way.
// The prefetch keeps to puts: a holder's prefetch then completes only once its prev took part,
// as before the chains (an eager prefetch let a rank that skipped its dispatch run on to a local
// error in its combine where its peers had not heard of it: runtime_fault_test over ucx).
// Messages go out at the end of each test (AfterProgress), one per pair with chunks to name (an
// eager one holds up to a chunk's worth of bytes), so chunks that become ready together share one;
// on a put pair also before each put (a put over shared memory may be a copy made right there).
//
// Home-rank replicas (plan.home_replicas, one rank) make chains whose every hop is local: done in
// Start, by copies (prefetch) and ChainStart / ChainAdd / ChainFinish in chain order (reduce).

// One chunk in a kMsgChunks message; on an eager pair its bytes follow it.
struct ChunkEntry {
  int32_t stream;    // index among the pair's streams
  int32_t expert;    // the stream's expert and tensor, and the sender's element count: checked
  int32_t tensor;    // by the receiver (sizes that differ across ranks fail at once)
  int32_t has_data;  // 1: `bytes` bytes follow (eager pair); 0: they were put
  int64_t numel;
  int64_t chunk;
  int64_t bytes;
};
static_assert(sizeof(ChunkEntry) == 40, "ChunkEntry is sent as bytes, without padding");

// Streams sit in the reduce staging at 16-byte aligned offsets.
int64_t StagedBytes(int64_t bytes) { return (bytes + 15) & ~int64_t{15}; }

// A chain whose home is among its holders (plan.home_replicas, one rank) is done locally; with
// another rank among its holders too, its hops would cross ranks in an order the chain does not
// define. Refused alike on every rank (a function of the plan).
absl::Status CheckLocalChains(const std::vector<common::ReplicaChain>& chains) {
  for (const common::ReplicaChain& c : chains) {
    bool home_holds = false;
    int32_t other = -1;
    for (const common::ChainHolder& h : c.holders) {
      if (h.rank == c.home) {
        home_holds = true;
      } else {
        other = h.rank;
      }
    }
    MOONEP_CHECK_ARG(!home_holds || other < 0,
                     "plan: expert %d has replicas on its home rank %d and on rank %d; home-rank "
                     "replicas (plan.home_replicas) are for one-rank plans",
                     c.expert, c.home, other);
  }
  return absl::OkStatus();
}

bool HomeHolds(const common::ReplicaChain& c) {
  return std::any_of(c.holders.begin(), c.holders.end(),
                     [&](const common::ChainHolder& h) { return h.rank == c.home; });
}

// Prefetch (kind kPrefetch) or reduce (kReduce) along the replica chains. A reduce's staging comes
// from the transport's pool, so reduces in flight together keep their partials apart.
class ChainOp : public UcxOp {
 public:
  ChainOp(UcxTransport* t, OpKind kind, int channel, int64_t seq)
      : UcxOp(t, kind, channel, seq), reduce_(kind == OpKind::kReduce) {
    t->AddChainOp(this);
    chain_ = true;
  }

  absl::Status Start(const std::vector<common::ReplicaChain>& chains, const ExpertBlocks& b) {
    const int32_t R = transport_->size(), nt = b.tensors_per_expert;
    chunk_elements_ = common::ChunkElements(transport_->replica_chunk_bytes());
    in_of_.assign(static_cast<size_t>(R), -1);
    out_of_.assign(static_cast<size_t>(R), -1);
    std::vector<int64_t> staged;  // per stream: its offset in the reduce staging, -1: none
    int64_t staging_bytes = 0;
    for (const common::ReplicaChain& c : chains) {
      if (HomeHolds(c)) {
        if (c.home == me_) Local(c, b);
        continue;
      }
      const common::ChainPeers p =
          reduce_ ? common::ReducePeers(c, me_) : common::PrefetchPeers(c, me_);
      if (!p.home && p.slot < 0) continue;
      for (int32_t i = 0; i < nt; ++i) {
        Stream s;
        s.expert = c.expert;
        s.tensor = i;
        s.mine = p.home ? b.home[static_cast<size_t>(c.group) * nt + i]
                        : b.slots[static_cast<size_t>(p.slot) * nt + i];
        s.numel = s.mine.numel();
        s.chunk = common::ChainChunkElements(c, chunk_elements_);
        s.chunks = common::NumChunks(s.numel, s.chunk);
        const int32_t k = static_cast<int32_t>(streams_.size());
        const int64_t wire = s.numel * ElementBytes(s);
        if (p.prev >= 0) {
          s.in = PairOf(&ins_, &in_of_, p.prev);
          Pair& in = ins_[static_cast<size_t>(s.in)];
          in.streams.push_back(k);
          in.bytes += wire;
          in.chunks += s.chunks;
        }
        if (p.next >= 0) {
          s.out = PairOf(&outs_, &out_of_, p.next);
          Pair& out = outs_[static_cast<size_t>(s.out)];
          s.out_index = static_cast<int32_t>(out.streams.size());
          out.streams.push_back(k);
          out.bytes += wire;
        }
        // Reduce staging: the partials this rank receives (it adds its slot to them in place and
        // passes them on from there), and a first holder's fp32 copy of a slot of another dtype.
        int64_t at = -1;
        if (reduce_ && (p.prev >= 0 || s.mine.dtype != DType::kFloat32)) {
          at = staging_bytes;
          staging_bytes += StagedBytes(s.numel * 4);
        }
        staged.push_back(at);
        streams_.push_back(s);
      }
    }
    bool puts_in = false;
    for (Pair& in : ins_) {
      in.eager = reduce_ && in.bytes <= transport_->eager_bytes();
      puts_in |= !in.eager;
    }
    for (Pair& out : outs_) {
      out.eager = out.ready = reduce_ && out.bytes <= transport_->eager_bytes();
    }
    if (staging_bytes > 0) {
      staging_ = transport_->reduce_staging.Acquire();
      // Back to the pool when the op ends (Cleanup), so that a completed request destroyed after
      // its transport touches nothing of it. By value: the end may come from ~UcxOp.
      OnEnd([pool = &transport_->reduce_staging, staging = staging_] { pool->Release(staging); });
      if (static_cast<int64_t>(staging_->size()) < staging_bytes) {
        try {
          transport_->GrowOwnBuffer(staging_, static_cast<size_t>(staging_bytes));
        } catch (const std::bad_alloc&) {
          return OutOfMemory("reduce: cannot allocate %d bytes of staging for the partials",
                             staging_bytes);
        }
      }
      for (size_t k = 0; k < streams_.size(); ++k) {
        if (staged[k] >= 0) streams_[k].partial = staging_->data() + staged[k];
      }
      // Registered whole, once: the streams' ranges inside it move with the plan.
      if (puts_in) MOONEP_RETURN_IF_ERROR(PinBuffer(staging_->data(), staging_->size()));
    }
    // Receiver part: on a put pair, where each stream's chunks go; then its first message.
    for (Pair& in : ins_) {
      if (!in.eager) {
        std::vector<char> targets;
        for (int32_t k : in.streams) {
          const Stream& s = streams_[static_cast<size_t>(k)];
          if (reduce_) {
            MOONEP_RETURN_IF_ERROR(
                AddTarget(in.peer, s.partial, static_cast<uint64_t>(s.numel) * 4, &targets));
          } else {
            MOONEP_RETURN_IF_ERROR(AddTarget(in.peer, s.mine.data, s.mine.nbytes(), &targets));
          }
        }
        const int32_t n = static_cast<int32_t>(in.streams.size());
        MOONEP_RETURN_IF_ERROR(SendReady(in.peer, -1, n, n, std::move(targets)));
      }
      ExpectMessage(in.peer, kMsgChunks, 0);
    }
    // Sender part: a put pair waits for its receiver's ready.
    for (const Pair& out : outs_) {
      if (!out.eager) ExpectMessage(out.peer, kMsgReady);
    }
    // The chains' first hops have every chunk now (a put pair's go when its ready arrives).
    for (Pair& out : outs_) {
      if (out.ready) MOONEP_RETURN_IF_ERROR(SendFirstHops(out));
    }
    return AfterProgress();
  }

 private:
  // This rank's part in one chain, for one tensor.
  struct Stream {
    int32_t expert = -1, tensor = 0;
    int32_t in = -1, out = -1;       // the pairs it arrives by (ins_) and leaves by (outs_)
    int32_t out_index = 0;           // its place among the out pair's streams (ChunkEntry::stream)
    TensorView mine;                 // this rank's tensor: its slot, or the home tensor
    int64_t numel = 0, chunks = 0;
    int64_t chunk = 1;               // elements per chunk along its chain (ChainChunkElements)
    char* partial = nullptr;         // reduce: fp32 staging of numel elements, or none
    int64_t received = 0, sent = 0;  // chunks
  };
  // The chunks between this rank and one peer, one way.
  struct Pair {
    int peer = -1;
    bool eager = false;
    std::vector<int32_t> streams;  // indices into streams_, in the order both sides list them
    int64_t bytes = 0;             // over its streams
    int64_t part = 0;              // in: the message awaited next; out: the next one to send
    // In pairs only: chunks expected (over its streams) and received.
    int64_t chunks = 0, received = 0;
    // Out pairs only.
    bool ready = false;            // may send: eager, or the receiver's ready arrived
    std::vector<Target> targets;   // put pair: the receiver's buffer per stream
    // (stream, chunk) that reached this middle holder before the receiver's ready (a first hop's
    // chunks are not listed: SendFirstHops sends them all).
    std::vector<std::pair<int32_t, int64_t>> waiting;
    std::vector<std::vector<char>> messages;  // to send in AfterProgress
    int64_t last_data = 0;                    // bytes of chunk data in messages.back()
  };

  static int32_t PairOf(std::vector<Pair>* pairs, std::vector<int32_t>* of, int peer) {
    int32_t& i = (*of)[static_cast<size_t>(peer)];
    if (i < 0) {
      i = static_cast<int32_t>(pairs->size());
      pairs->emplace_back();
      pairs->back().peer = peer;
    }
    return i;
  }
  // Reduce: the chain's first holder (nothing comes in; it starts the partial).
  bool First(const Stream& s) const { return reduce_ && s.in < 0; }
  // Bytes of one element on the wire: the tensor's dtype (prefetch) or fp32 (reduce partials).
  int64_t ElementBytes(const Stream& s) const {
    return reduce_ ? 4 : static_cast<int64_t>(DTypeSize(s.mine.dtype));
  }
  int64_t ChunkBegin(const Stream& s, int64_t c) const { return c * s.chunk; }
  int64_t ChunkCount(const Stream& s, int64_t c) const {
    return std::min(s.chunk, s.numel - ChunkBegin(s, c));
  }

  // A chain whose hops are all on this rank (its home holds its only replica).
  void Local(const common::ReplicaChain& c, const ExpertBlocks& b) {
    const int32_t nt = b.tensors_per_expert;
    for (int32_t i = 0; i < nt; ++i) {
      const TensorView& home = b.home[static_cast<size_t>(c.group) * nt + i];
      auto slot = [&](const common::ChainHolder& h) -> const TensorView& {
        return b.slots[static_cast<size_t>(h.slot) * nt + i];
      };
      if (!reduce_) {
        for (const common::ChainHolder& h : c.holders) {
          if (home.nbytes() > 0) std::memcpy(slot(h).data, home.data, home.nbytes());
        }
      } else {
        // Chunk by chunk, so that the partial needs no tensor-sized buffer.
        const int64_t numel = home.numel();
        local_partial_.resize(static_cast<size_t>(std::min(chunk_elements_, numel)));
        for (int64_t begin = 0; begin < numel; begin += chunk_elements_) {
          const int64_t n = std::min(chunk_elements_, numel - begin);
          common::ChainStart(slot(c.holders.front()), begin, n, local_partial_.data());
          for (size_t j = 1; j < c.holders.size(); ++j) {
            common::ChainAdd(slot(c.holders[j]), begin, n, local_partial_.data());
          }
          common::ChainFinish(home, begin, n, local_partial_.data());
        }
      }
      counters_.rows_local += static_cast<int64_t>(c.holders.size());
    }
  }

  // Chunk c of stream k arrived at a middle holder: pass it on.
  absl::Status Forward(int32_t k, int64_t c) {
    Pair& out = outs_[static_cast<size_t>(streams_[static_cast<size_t>(k)].out)];
    if (!out.ready) {
      out.waiting.emplace_back(k, c);
      return absl::OkStatus();
    }
    return SendChunk(k, c);
  }

  absl::Status SendChunk(int32_t k, int64_t c) {
    Stream& s = streams_[static_cast<size_t>(k)];
    Pair& out = outs_[static_cast<size_t>(s.out)];
    const int64_t begin = ChunkBegin(s, c), n = ChunkCount(s, c), eb = ElementBytes(s);
    const int64_t bytes = n * eb;
    const char* src;
    if (!reduce_ || (First(s) && s.partial == nullptr)) {
      src = static_cast<const char*>(s.mine.data) + begin * eb;  // an fp32 slot is its own partial
    } else {
      if (First(s)) {
        common::ChainStart(s.mine, begin, n, reinterpret_cast<float*>(s.partial) + begin);
      }
      src = s.partial + begin * 4;
    }
    if (out.eager) {
      AppendEntry(&out, k, c, src, bytes);
    } else if (bytes > 0) {
      // The chunks that landed so far are named before this put starts: over shared memory a put
      // may be a copy made right here (cma), and a first hop puts every chunk in one test.
      MOONEP_RETURN_IF_ERROR(SendMessages(&out));
      MOONEP_RETURN_IF_ERROR(Put(out.peer, src, static_cast<uint64_t>(bytes),
                                 out.targets[static_cast<size_t>(s.out_index)],
                                 static_cast<uint64_t>(begin * eb)));
      flushed_.emplace_back(k, c);
      MOONEP_RETURN_IF_ERROR(FlushFor(out.peer, static_cast<int64_t>(flushed_.size()) - 1));
    } else {
      AppendEntry(&out, k, c, nullptr, 0);  // an empty tensor's one chunk: nothing to put
    }
    counters_.bytes_sent += bytes;
    if (++s.sent == s.chunks) ++counters_.rows_sent;
    return absl::OkStatus();
  }

  // Names chunk c of stream k in the pair's next message, with its bytes (`data`) on an eager
  // pair. An eager message takes chunks up to a chunk's worth of bytes (at least one chunk).
  void AppendEntry(Pair* out, int32_t k, int64_t c, const char* data, int64_t bytes) {
    const Stream& s = streams_[static_cast<size_t>(k)];
    if (out->messages.empty() ||
        (out->eager && out->last_data > 0 && out->last_data + bytes > chunk_elements_ * 4)) {
      out->messages.emplace_back();
      out->last_data = 0;
    }
    std::vector<char>& m = out->messages.back();
    ChunkEntry e;
    e.stream = s.out_index;
    e.expert = s.expert;
    e.tensor = s.tensor;
    e.has_data = out->eager ? 1 : 0;
    e.numel = s.numel;
    e.chunk = c;
    e.bytes = bytes;
    const size_t at = m.size();
    m.resize(at + sizeof(e) + (out->eager ? static_cast<size_t>(bytes) : 0));
    std::memcpy(m.data() + at, &e, sizeof(e));
    if (out->eager && bytes > 0 && data != nullptr) {
      std::memcpy(m.data() + at + sizeof(e), data, static_cast<size_t>(bytes));
      out->last_data += bytes;
    }
  }

  absl::Status OnMessage(int peer, int32_t type, const std::vector<char>& m) override {
    return type == kMsgReady ? OnReady(peer, m) : OnChunks(peer, m);
  }

  // Sender part of a put pair: the receiver's buffers; the chunks had so far go now.
  absl::Status OnReady(int peer, const std::vector<char>& m) {
    Pair& out = outs_[static_cast<size_t>(out_of_[static_cast<size_t>(peer)])];
    const int32_t n = static_cast<int32_t>(out.streams.size());
    ReadyHeader header;
    MOONEP_RETURN_IF_ERROR(ParseReady(peer, m, n, &header, &out.targets));
    for (int32_t j = 0; j < n; ++j) {
      const Stream& s = streams_[static_cast<size_t>(out.streams[static_cast<size_t>(j)])];
      const uint64_t want = static_cast<uint64_t>(s.numel * ElementBytes(s));
      if (header.count != n || out.targets[static_cast<size_t>(j)].length != want) {
        return InvalidArgument("%s: rank %d offers %d bytes for tensor %d of expert %d, rank %d "
                               "has %d to write there (sizes differ across ranks?)",
                               OpName(kind_), peer, out.targets[static_cast<size_t>(j)].length,
                               s.tensor, s.expert, me_, want);
      }
    }
    out.ready = true;
    MOONEP_RETURN_IF_ERROR(SendFirstHops(out));
    const std::vector<std::pair<int32_t, int64_t>> waiting = std::move(out.waiting);
    out.waiting.clear();
    for (const auto& [k, c] : waiting) MOONEP_RETURN_IF_ERROR(SendChunk(k, c));
    return absl::OkStatus();
  }

  // Every chunk of the pair's streams that start their chain here.
  absl::Status SendFirstHops(const Pair& out) {
    for (int32_t k : out.streams) {
      const Stream& s = streams_[static_cast<size_t>(k)];
      if (s.in >= 0) continue;
      for (int64_t c = 0; c < s.chunks; ++c) MOONEP_RETURN_IF_ERROR(SendChunk(k, c));
    }
    return absl::OkStatus();
  }

  // Receiver part: message `in.part` of the pair from `peer`; the next one is awaited after it.
  absl::Status OnChunks(int peer, const std::vector<char>& m) {
    Pair& in = ins_[static_cast<size_t>(in_of_[static_cast<size_t>(peer)])];
    size_t at = 0;
    while (at < m.size()) {
      ChunkEntry e;
      if (m.size() - at < sizeof(e)) {
        return InvalidArgument("%s: malformed chunks message from rank %d", OpName(kind_), peer);
      }
      std::memcpy(&e, m.data() + at, sizeof(e));
      at += sizeof(e);
      if (e.stream < 0 || e.stream >= static_cast<int32_t>(in.streams.size())) {
        return InvalidArgument("%s: rank %d sent a chunk of its tensor %d of expert %d, which "
                               "rank %d does not receive from it (plans differ across ranks?)",
                               OpName(kind_), peer, e.tensor, e.expert, me_);
      }
      const int32_t k = in.streams[static_cast<size_t>(e.stream)];
      Stream& s = streams_[static_cast<size_t>(k)];
      const int64_t eb = ElementBytes(s);
      if (e.expert != s.expert || e.tensor != s.tensor || e.numel != s.numel || e.chunk < 0 ||
          e.chunk >= s.chunks || e.bytes != ChunkCount(s, e.chunk) * eb ||
          (e.has_data != 0) != in.eager) {
        return InvalidArgument("%s: rank %d sent chunk %d (%d bytes) of tensor %d of expert %d "
                               "with %d elements; rank %d has %d elements there, tensor %d of "
                               "expert %d (sizes differ across ranks?)",
                               OpName(kind_), peer, e.chunk, e.bytes, e.tensor, e.expert, e.numel,
                               me_, s.numel, s.tensor, s.expert);
      }
      const int64_t begin = ChunkBegin(s, e.chunk);
      if (e.has_data != 0) {
        if (m.size() - at < static_cast<size_t>(e.bytes)) {
          return InvalidArgument("%s: malformed chunks message from rank %d", OpName(kind_), peer);
        }
        char* dst = reduce_ ? s.partial + begin * 4 : static_cast<char*>(s.mine.data) + begin * eb;
        if (e.bytes > 0) std::memcpy(dst, m.data() + at, static_cast<size_t>(e.bytes));
        at += static_cast<size_t>(e.bytes);
      }
      if (++s.received > s.chunks) {
        return InvalidArgument("%s: rank %d sent tensor %d of expert %d in more than its %d "
                               "chunks", OpName(kind_), peer, s.tensor, s.expert, s.chunks);
      }
      counters_.bytes_received += e.bytes;
      if (s.received == s.chunks) ++counters_.rows_received;
      ++in.received;
      MOONEP_RETURN_IF_ERROR(Arrived(k, e.chunk));
    }
    if (in.received < in.chunks) ExpectMessage(peer, kMsgChunks, ++in.part);
    return absl::OkStatus();
  }

  // Chunk c of stream k is in place (the slot, or the partial's staging).
  absl::Status Arrived(int32_t k, int64_t c) {
    Stream& s = streams_[static_cast<size_t>(k)];
    if (reduce_) {
      const int64_t begin = ChunkBegin(s, c), n = ChunkCount(s, c);
      float* partial = reinterpret_cast<float*>(s.partial) + begin;
      if (s.out < 0) {  // the home: stored once
        common::ChainFinish(s.mine, begin, n, partial);
        return absl::OkStatus();
      }
      common::ChainAdd(s.mine, begin, n, partial);
    }
    return s.out >= 0 ? Forward(k, c) : absl::OkStatus();
  }

  // A put chunk is remotely complete: the pair's next message names it.
  absl::Status OnFlushed(int /*peer*/, int64_t token) override {
    const auto [k, c] = flushed_[static_cast<size_t>(token)];
    const Stream& s = streams_[static_cast<size_t>(k)];
    AppendEntry(&outs_[static_cast<size_t>(s.out)], k, c, nullptr,
                ChunkCount(s, c) * ElementBytes(s));
    return absl::OkStatus();
  }

  absl::Status AfterProgress() override {
    for (Pair& out : outs_) MOONEP_RETURN_IF_ERROR(SendMessages(&out));
    return absl::OkStatus();
  }

  // messages_sent counts puts (Put) and eager messages, the messages that carry bytes; a put
  // pair's messages only name chunks that landed, like a signal.
  absl::Status SendMessages(Pair* out) {
    for (std::vector<char>& m : out->messages) {
      if (out->eager) ++counters_.messages_sent;
      MOONEP_RETURN_IF_ERROR(SendTracked(out->peer, kMsgChunks, std::move(m), out->part++));
    }
    out->messages.clear();
    out->last_data = 0;
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    for (const Stream& s : streams_) {
      if ((s.in >= 0 && s.received != s.chunks) || (s.out >= 0 && s.sent != s.chunks)) {
        return Internal("%s: tensor %d of expert %d ended with %d of its %d chunks received and "
                        "%d sent", OpName(kind_), s.tensor, s.expert, s.received, s.chunks,
                        s.sent);
      }
    }
    return absl::OkStatus();
  }

  const bool reduce_;
  int64_t chunk_elements_ = 1;
  std::vector<Stream> streams_;
  std::vector<Pair> ins_, outs_;
  std::vector<int32_t> in_of_, out_of_;  // per rank: its pair in ins_ / outs_, -1: none
  std::vector<std::pair<int32_t, int64_t>> flushed_;  // FlushFor's tokens: (stream, chunk)
  std::vector<float> local_partial_;
  std::vector<char>* staging_ = nullptr;  // this op's, from transport_->reduce_staging
};

// ---------------------------------------------------------------------------------------------
// UcxTransport

ucs_status_t UcxTransport::OnActiveMessage(void* arg, const void* header, size_t header_length,
                                           void* data, size_t length,
                                           const ucp_am_recv_param_t* param) {
  auto* t = static_cast<UcxTransport*>(arg);
  if (header_length != sizeof(MsgHeader) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    MOONEP_WARN("transport ucx: dropped a malformed control message");
    return UCS_OK;
  }
  MsgHeader h;
  std::memcpy(&h, header, sizeof(h));
  if (h.from < 0 || h.from >= t->size_ || h.from == t->rank_) return UCS_OK;
  // Closing: no operation will read a message any more, and the endpoints (which unpack keys)
  // may already be closed.
  if (t->closed_) return UCS_OK;
  const char* bytes = static_cast<const char*>(data);
  switch (h.type) {
    case kMsgAbort:
      if (!t->abort_seen_) {
        t->abort_seen_ = true;
        t->abort_rank_ = h.from;
        t->abort_kind_ = h.aux;
      }
      return UCS_OK;
    case kMsgDropKey: {
      auto it = t->remote_keys_.find({h.from, static_cast<uint64_t>(h.seq)});
      if (it != t->remote_keys_.end()) {
        t->dropped_keys_.push_back(it->second);
        t->remote_keys_.erase(it);
      }
      return UCS_OK;
    }
    case kMsgReady: {
      // Keys that come with the message are unpacked on arrival, so a later message that refers
      // to the same region finds them whatever order the operations are tested in.
      size_t at = sizeof(ReadyHeader);
      if (length < at) break;
      ReadyHeader rh;
      std::memcpy(&rh, bytes, sizeof(rh));
      for (int32_t i = 0; i < rh.num_targets && at + sizeof(TargetRef) <= length; ++i) {
        TargetRef ref;
        std::memcpy(&ref, bytes + at, sizeof(ref));
        at += sizeof(ref);
        if (ref.rkey_bytes > 0 && at + ref.rkey_bytes <= length) {
          ucp_rkey_h rkey = nullptr;
          if (ucp_ep_rkey_unpack(t->eps_[h.from], bytes + at, &rkey) == UCS_OK) {
            auto key = std::make_pair(static_cast<int>(h.from), ref.region_id);
            auto it = t->remote_keys_.find(key);
            if (it != t->remote_keys_.end()) t->dropped_keys_.push_back(it->second);
            t->remote_keys_[key] = rkey;
            ++t->stats_.keys_unpacked;
          }
        }
        at += ref.rkey_bytes;
      }
      break;
    }
    default:
      break;
  }
  if (h.channel < 0 || h.channel >= kChannels) return UCS_OK;
  const Call call{h.aux, h.dispatch};
  if (h.type == kMsgWaiting && t->Started(h.channel, h.seq)) {
    t->CheckCallOrder(h.channel, h.seq, h.from, call);
    return UCS_OK;  // kept (below) only for an operation not started here yet
  }
  const MessageKey key(static_cast<int>(h.channel), h.seq, static_cast<int>(h.from), h.type,
                       h.part);
  t->inbox_[key] = std::vector<char>(bytes, bytes + length);
  t->inbox_calls_[key] = call;
  t->CheckCallOrder(h.channel, h.seq, h.from, call);
  return UCS_OK;
}

absl::StatusOr<std::unique_ptr<Transport>> UcxTransport::Create(const TransportOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return InvalidUsage("UCX transport: MPI is not initialized (bootstrap)");
  MOONEP_CHECK_ARG(options.comm != MPI_COMM_NULL, "options.comm is MPI_COMM_NULL");
  // Options and environment are checked locally but reported through the agreement below (after
  // the communicator's duplication, which every rank makes), so that a value wrong on one rank
  // only fails every rank instead of leaving the others in a collective.
  absl::Status checked = common::CheckOptions(options);
  if (checked.ok()) checked = CheckTransportEnvironment("ucx");
  std::unique_ptr<UcxTransport> t(new UcxTransport());
  t->options_ = options;
  t->timeout_ms_ = common::ResolveTimeoutMs(options.timeout_ms);
  t->eager_bytes_ = checked.ok() ? *EagerReduceBytes() : 0;
  t->replica_chunk_bytes_ = common::ResolveReplicaChunkBytes(options);
  auto mpi = [](int rc, const char* what) -> absl::Status {
    if (rc == MPI_SUCCESS) return absl::OkStatus();
    return SystemError("%s failed (MPI error %d)", what, rc);
  };
  MOONEP_RETURN_IF_ERROR(mpi(MPI_Comm_dup(options.comm, &t->comm_), "MPI_Comm_dup"));
  MPI_Comm_set_errhandler(t->comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(t->comm_, &t->rank_);
  MPI_Comm_size(t->comm_, &t->size_);
  const int R = t->size_;
  {
    const int local_size = common::LocalRanks(t->comm_);  // collective: every rank, here
    if (checked.ok()) t->host_pool_ = common::MakeHostPool(options.host_threads, local_size);
  }
  {
    // Sender and receiver of a reduce contribution pick eager or put by the same threshold: a
    // MOONEP_UCX_EAGER_BYTES set differently on one rank left both waiting for the other kind of
    // message until the timeout. The largest and smallest value over the ranks that read one.
    const int64_t none = std::numeric_limits<int64_t>::min();
    const int64_t mine[2] = {checked.ok() ? t->eager_bytes_ : none,
                             checked.ok() ? -t->eager_bytes_ : none};
    int64_t agreed[2] = {none, none};
    MOONEP_RETURN_IF_ERROR(mpi(MPI_Allreduce(mine, agreed, 2, MPI_INT64_T, MPI_MAX, t->comm_),
                               "MPI_Allreduce"));
    if (checked.ok() && agreed[0] != -agreed[1]) {
      checked = InvalidArgument("MOONEP_UCX_EAGER_BYTES differs between ranks (%d to %d bytes); "
                                "set it alike on every rank", -agreed[1], agreed[0]);
    }
    const absl::Status same = common::CheckSharedOptions(t->comm_, options);
    if (checked.ok()) checked = same;
  }

  // Every rank sets up locally, then all agree that every rank succeeded before exchanging.
  absl::Status local = [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(checked);
    MOONEP_ASSIGN_OR_RETURN(t->context_, AcquireContext());
    ucp_worker_params_t wp;
    std::memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    MOONEP_RETURN_IF_ERROR(
        UcsCheck(ucp_worker_create(t->context_, &wp, &t->worker_), "ucp_worker_create"));
    ucp_am_handler_param_t ap;
    std::memset(&ap, 0, sizeof(ap));
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    ap.id = kAmId;
    ap.cb = &UcxTransport::OnActiveMessage;
    ap.arg = t.get();
    MOONEP_RETURN_IF_ERROR(UcsCheck(ucp_worker_set_am_recv_handler(t->worker_, &ap),
                                    "ucp_worker_set_am_recv_handler"));
    // The signal area: UCX-allocated so shared-memory transports can map it directly.
    ucp_mem_map_params_t mp;
    std::memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = nullptr;
    mp.length = static_cast<size_t>(kChannels) * R * kSignalDepth * sizeof(uint64_t);
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    MOONEP_RETURN_IF_ERROR(UcsCheck(ucp_mem_map(t->context_, &mp, &t->signal_memh_), "ucp_mem_map"));
    ucp_mem_attr_t attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    MOONEP_RETURN_IF_ERROR(UcsCheck(ucp_mem_query(t->signal_memh_, &attr), "ucp_mem_query"));
    t->signals_ = static_cast<volatile uint64_t*>(attr.address);
    std::memset(attr.address, 0, mp.length);
    return absl::OkStatus();
  }();
  MOONEP_RETURN_IF_ERROR(common::AgreeOnCreationChecks(
      t->comm_, local,
      "UCX transport: another rank failed to set up UCX (or refused its options or environment)"));

  // Bootstrap over MPI: worker addresses, then the signal area's address and key (once).
  auto allgather_bytes = [&](const void* mine, int len,
                             std::vector<char>* all, std::vector<int>* displs) -> absl::Status {
    std::vector<int> lens(R);
    MOONEP_RETURN_IF_ERROR(
        mpi(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, t->comm_), "MPI_Allgather"));
    displs->assign(R + 1, 0);
    for (int r = 0; r < R; ++r) (*displs)[r + 1] = (*displs)[r] + lens[r];
    all->resize(static_cast<size_t>((*displs)[R]));
    return mpi(MPI_Allgatherv(mine, len, MPI_BYTE, all->data(), lens.data(), displs->data(),
                              MPI_BYTE, t->comm_),
               "MPI_Allgatherv");
  };
  // Every rank makes both exchanges and the agreement after them whatever fails on it (a rank
  // that returned early left its peers in MPI_Allgather with no deadline: different UCX_TLS on
  // one rank made ucp_ep_create fail there and hung the others). A rank that has nothing to send
  // sends zero bytes; its peers see that and fail too.
  absl::Status setup;
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  setup = UcsCheck(ucp_worker_get_address(t->worker_, &address, &address_length),
                   "ucp_worker_get_address");
  std::vector<char> addresses;
  std::vector<int> address_at;
  MOONEP_RETURN_IF_ERROR(allgather_bytes(address, setup.ok() ? static_cast<int>(address_length) : 0,
                                         &addresses, &address_at));
  if (setup.ok()) ucp_worker_release_address(t->worker_, address);
  t->eps_.assign(R, nullptr);
  for (int r = 0; r < R && setup.ok(); ++r) {
    if (r == t->rank_) continue;
    if (address_at[r + 1] == address_at[r]) {
      setup = SystemError("rank %d has no UCX worker address (its UCX set-up failed)", r);
      break;
    }
    ucp_ep_params_t ep;
    std::memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(addresses.data() + address_at[r]);
    setup = Annotate(UcsCheck(ucp_ep_create(t->worker_, &ep, &t->eps_[r]), "ucp_ep_create"),
                     absl::StrCat("endpoint to rank ", r));
  }
  void* packed = nullptr;
  size_t packed_size = 0;
  std::vector<char> mine;
  if (setup.ok()) {
    setup = UcsCheck(ucp_rkey_pack(t->context_, t->signal_memh_, &packed, &packed_size),
                     "ucp_rkey_pack");
  }
  if (setup.ok()) {
    mine.resize(sizeof(uint64_t) + packed_size);
    const uint64_t signal_address = reinterpret_cast<uintptr_t>(t->signals_);
    std::memcpy(mine.data(), &signal_address, sizeof(signal_address));
    std::memcpy(mine.data() + sizeof(signal_address), packed, packed_size);
    ucp_rkey_buffer_release(packed);
  }
  std::vector<char> keys;
  std::vector<int> key_at;
  MOONEP_RETURN_IF_ERROR(allgather_bytes(mine.data(), static_cast<int>(mine.size()), &keys, &key_at));
  t->signal_remote_address_.assign(R, 0);
  t->signal_rkeys_.assign(R, nullptr);
  for (int r = 0; r < R && setup.ok(); ++r) {
    if (r == t->rank_) continue;
    if (key_at[r + 1] - key_at[r] <= static_cast<int>(sizeof(uint64_t))) {
      setup = SystemError("rank %d sent no signal key (its UCX set-up failed)", r);
      break;
    }
    std::memcpy(&t->signal_remote_address_[r], keys.data() + key_at[r], sizeof(uint64_t));
    setup = UcsCheck(ucp_ep_rkey_unpack(t->eps_[r], keys.data() + key_at[r] + sizeof(uint64_t),
                                        &t->signal_rkeys_[r]),
                     "ucp_ep_rkey_unpack");
  }
  MOONEP_RETURN_IF_ERROR(common::AgreeOnCreationChecks(
      t->comm_, Annotate(setup, "UCX transport: connecting the ranks"),
      "UCX transport: another rank could not connect to its peers (see its error; ranks with "
      "different UCX_TLS or networks?)"));
  log::SetRank(t->rank_);
  MOONEP_INFO("transport ucx: %d ranks, timeout %d ms", t->size_, t->timeout_ms_);
  return std::unique_ptr<Transport>(std::move(t));
}

UcxTransport::~UcxTransport() {
  if (closed_) return;
  const absl::Status closed = Close();
  if (!closed.ok()) MOONEP_WARN("%s", std::string(closed.message()));
}

namespace {
// Close's MPI tags on the transport's own communicator (used for nothing else after creation).
constexpr int kCloseArrive = 1, kCloseGaveUp = 2, kCloseDone = 3;
}  // namespace

bool UcxTransport::CloseExchange(int tag, std::vector<int>* silent, std::vector<int>* gave_up) {
  // The buffers outlive this call when a peer never answers (MPI may still use them).
  struct Exchange {
    int mine = 1;
    std::vector<int> theirs;
    std::vector<MPI_Request> recvs, sends;
  };
  auto* x = new Exchange;
  x->theirs.assign(static_cast<size_t>(size_), 0);
  x->recvs.assign(static_cast<size_t>(size_), MPI_REQUEST_NULL);
  x->sends.assign(static_cast<size_t>(size_), MPI_REQUEST_NULL);
  bool posted = true;
  for (int r = 0; r < size_ && posted; ++r) {
    if (r == rank_) continue;
    posted = MPI_Irecv(&x->theirs[r], 1, MPI_INT, r, tag, comm_, &x->recvs[r]) == MPI_SUCCESS &&
             MPI_Isend(&x->mine, 1, MPI_INT, r, tag, comm_, &x->sends[r]) == MPI_SUCCESS;
  }
  std::vector<bool> quit(static_cast<size_t>(size_), false);
  const Clock::time_point until = Clock::now() + std::chrono::milliseconds(2 * timeout_ms_ + 2000);
  while (posted) {
    if (worker_ != nullptr) Progress();
    bool all = true;
    for (int r = 0; r < size_; ++r) {
      for (MPI_Request* q : {&x->recvs[r], &x->sends[r]}) {
        int done = 0;
        if (*q != MPI_REQUEST_NULL) MPI_Test(q, &done, MPI_STATUS_IGNORE);
      }
      if (gave_up != nullptr && !quit[r] && x->recvs[r] != MPI_REQUEST_NULL) {
        int flag = 0;
        MPI_Iprobe(r, kCloseGaveUp, comm_, &flag, MPI_STATUS_IGNORE);
        quit[r] = flag != 0;
      }
      all = all && (quit[r] || (x->recvs[r] == MPI_REQUEST_NULL &&
                                x->sends[r] == MPI_REQUEST_NULL));
    }
    if (all || Clock::now() >= until) break;
    std::this_thread::yield();
  }
  bool complete = posted;
  silent->clear();
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    if (quit[r]) {
      gave_up->push_back(r);
      complete = false;
    } else if (x->recvs[r] != MPI_REQUEST_NULL || x->sends[r] != MPI_REQUEST_NULL) {
      silent->push_back(r);
      complete = false;
    }
  }
  if (complete) delete x;  // else left to the pending requests, with the communicator
  return complete;
}

absl::Status UcxTransport::Close() {
  if (closed_) return close_status_;
  closed_ = true;
  // MPI finalized first: no MPI call may be made. The UCX resources go (endpoints closed by force:
  // the peers may be gone), the communicator is left as it is.
  close_status_ = common::CheckMpiNotFinalized("transport ucx destruction");
  const bool mpi_finalized = !close_status_.ok();
  if (mpi_finalized) comm_ = MPI_COMM_NULL;
  // Peers may still be finishing (or timing out) an operation and need this worker's progress to
  // complete their puts: progress until every rank got here (every peer's word, so the ones that
  // do not come can be named), then close. A peer that never comes (it died, hangs, or closes its
  // transports in another order) bounds the wait; the communicator is then left allocated rather
  // than freed under pending messages, and the peers hear that this rank gave up, so that their
  // own close does not wait for it again.
  bool arrived = true;
  std::vector<int> silent, gave_up;
  // Tells every peer that this rank will not take part in the second exchange (kCloseDone), so
  // that theirs does not wait for it.
  auto tell_gave_up = [this] {
    static const int kGaveUp = 1;  // read by MPI after this returns
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Request request;
      if (MPI_Isend(&kGaveUp, 1, MPI_INT, r, kCloseGaveUp, comm_, &request) == MPI_SUCCESS) {
        MPI_Request_free(&request);
      }
    }
  };
  if (comm_ != MPI_COMM_NULL) {
    arrived = CloseExchange(kCloseArrive, &silent, nullptr);
    if (!arrived) {
      tell_gave_up();
      if (silent.empty()) {
        close_status_ = SystemError("transport ucx destruction: could not post the check with the "
                                    "peers on rank %d; its communicator stays allocated", rank_);
      } else {
        close_status_ = Timeout(
            "transport ucx destruction timed out after %d ms on rank %d: nothing heard from "
            "rank(s) %s (they failed, hang, or destroy their layers in another order); its "
            "communicator stays allocated", 2 * timeout_ms_ + 2000, rank_, RankList(silent));
      }
    }
  }
  // A peer that gave up on this transport before this rank arrived (best effort: its word may
  // still be on the way) will not flush or close its endpoints.
  bool peer_gave_up = false;
  if (arrived && comm_ != MPI_COMM_NULL) {
    for (int r = 0; r < size_ && !peer_gave_up; ++r) {
      int flag = 0;
      if (r != rank_) MPI_Iprobe(r, kCloseGaveUp, comm_, &flag, MPI_STATUS_IGNORE);
      peer_gave_up = flag != 0;
    }
  }
  bool barrier_done = arrived && !peer_gave_up && !mpi_finalized;
  // Arrived, but a peer gave up: this rank skips the second exchange too, and says so to the
  // peers that did arrive (they may have missed the word that this rank saw).
  if (arrived && peer_gave_up) tell_gave_up();
  const Clock::time_point until = Clock::now() + std::chrono::milliseconds(2000);
  // Freed requests may still be sent by the progress below (wire-up replays them): their payloads
  // are kept until the worker is gone.
  std::vector<std::unique_ptr<std::vector<char>>> payloads;
  for (Outgoing& o : outbox_) {
    ucp_request_free(o.request);
    payloads.push_back(std::move(o.bytes));
  }
  outbox_.clear();
  for (auto& kv : remote_keys_) ucp_rkey_destroy(kv.second);
  remote_keys_.clear();
  for (ucp_rkey_h k : dropped_keys_) ucp_rkey_destroy(k);
  dropped_keys_.clear();
  for (ucp_rkey_h& k : signal_rkeys_) {
    if (k) ucp_rkey_destroy(k);
    k = nullptr;
  }
  // Flush first, then close in flush mode (a force close purges pending wire-up messages, which
  // UCX 1.13 asserts on over tcp: "got REQ message" in ucp_ep_purge_lanes). Only when every rank
  // reached destruction; otherwise (a dead peer) a flush could not complete, so force.
  if (barrier_done && worker_ != nullptr) {
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    ucs_status_ptr_t r = ucp_worker_flush_nbx(worker_, &param);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until) {
        ucp_worker_progress(worker_);
      }
      if (ucp_request_check_status(r) == UCS_INPROGRESS) {
        MOONEP_WARN("transport ucx destruction on rank %d: the worker's flush did not complete "
                    "within 2 s; closing the endpoints anyway", rank_);
      }
      ucp_request_free(r);
    }
  }
  std::vector<void*> closing;
  for (ucp_ep_h& ep : eps_) {
    if (ep == nullptr) continue;
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = barrier_done ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &param);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
    ep = nullptr;
  }
  int unclosed = 0;
  for (void* r : closing) {
    while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until) {
      ucp_worker_progress(worker_);
    }
    unclosed += ucp_request_check_status(r) == UCS_INPROGRESS;
    ucp_request_free(r);
  }
  if (unclosed > 0) {
    MOONEP_WARN("transport ucx destruction on rank %d: %d endpoint(s) did not close within 2 s; "
                "the worker goes anyway", rank_, unclosed);
  }
  // Every rank closed its endpoints before any worker goes away; a peer that gave up on the first
  // exchange ends this one too.
  if (barrier_done && comm_ != MPI_COMM_NULL) {
    barrier_done = CloseExchange(kCloseDone, &silent, &gave_up);
  }
  for (Region& r : regions_) ucp_mem_unmap(context_, r.memh);
  regions_.clear();
  if (signal_memh_) ucp_mem_unmap(context_, signal_memh_);
  signal_memh_ = nullptr;
  if (worker_) ucp_worker_destroy(worker_);
  worker_ = nullptr;
  payloads.clear();
  if (context_) ReleaseContext();
  context_ = nullptr;
  if (close_status_.ok() && !silent.empty()) {
    close_status_ = Timeout(
        "transport ucx destruction timed out after %d ms on rank %d: rank(s) %s did not close "
        "their endpoints; its communicator stays allocated", 2 * timeout_ms_ + 2000, rank_,
        RankList(silent));
  }
  if (!gave_up.empty() || (arrived && peer_gave_up)) {
    MOONEP_WARN("transport ucx destruction on rank %d: a peer gave up waiting for this rank "
                "(transports destroyed in another order?); its communicator stays allocated",
                rank_);
  }
  if (comm_ != MPI_COMM_NULL && barrier_done) MPI_Comm_free(&comm_);
  return close_status_;
}

absl::Status UcxTransport::PrepareHandle(DispatchHandle* handle, int64_t recv_capacity_rows) {
  MOONEP_RETURN_IF_ERROR(Usable());
  return common::PrepareHostHandle(options_, handle, recv_capacity_rows);
}

void UcxTransport::Progress() {
  if (worker_ == nullptr) return;  // closed: requests still used after Close fail in Usable()
  while (ucp_worker_progress(worker_) != 0) {
  }
  for (size_t i = 0; i < outbox_.size();) {
    const ucs_status_t st = ucp_request_check_status(outbox_[i].request);
    if (st == UCS_INPROGRESS) {
      ++i;
      continue;
    }
    ucp_request_free(outbox_[i].request);
    outbox_.erase(outbox_.begin() + static_cast<ptrdiff_t>(i));
    if (st != UCS_OK) Poison(UcsCheck(st, "control message"));
  }
  if (ops_in_flight_[0] == 0) DestroyDroppedKeys();
}

void UcxTransport::DestroyDroppedKeys() {
  for (ucp_rkey_h k : dropped_keys_) ucp_rkey_destroy(k);
  dropped_keys_.clear();
}

absl::Status UcxTransport::SendMessage(int peer, int32_t type, int channel, int64_t seq,
                                       int32_t aux, int64_t dispatch, std::vector<char> payload,
                                       uint64_t* id, int64_t part) {
  if (id) *id = 0;
  auto bytes = std::make_unique<std::vector<char>>(sizeof(MsgHeader) + payload.size());
  MsgHeader h;
  std::memset(&h, 0, sizeof(h));
  h.type = type;
  h.channel = channel;
  h.from = rank_;
  h.aux = aux;
  h.seq = seq;
  h.dispatch = dispatch;
  h.part = part;
  std::memcpy(bytes->data(), &h, sizeof(h));
  if (!payload.empty()) std::memcpy(bytes->data() + sizeof(h), payload.data(), payload.size());
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Eager only: the handler gets the whole message at once, never a rendezvous descriptor.
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t r = ucp_am_send_nbx(eps_[peer], kAmId, bytes->data(), sizeof(MsgHeader),
                                       bytes->data() + sizeof(MsgHeader), payload.size(), &param);
  if (UCS_PTR_IS_ERR(r)) return UcsCheck(UCS_PTR_STATUS(r), "ucp_am_send_nbx");
  if (r != nullptr) {
    outbox_.push_back(Outgoing{r, std::move(bytes), next_message_id_});
    if (id) *id = next_message_id_;
    ++next_message_id_;
  }
  return absl::OkStatus();
}

bool UcxTransport::TakeMessage(int channel, int64_t seq, int from, int32_t type, int64_t part,
                               std::vector<char>* out) {
  const MessageKey key(channel, seq, from, type, part);
  auto it = inbox_.find(key);
  if (it == inbox_.end()) return false;
  *out = std::move(it->second);
  inbox_.erase(it);
  inbox_calls_.erase(key);
  return true;
}

void UcxTransport::NoteStarted(int channel, int64_t seq, OpKind kind, int64_t dispatch) {
  started_[channel][static_cast<size_t>(seq % kKindHistory)] =
      StartedOp{seq, Call{static_cast<int32_t>(kind) + 1, dispatch}};
  for (auto it = inbox_calls_.lower_bound(MessageKey(channel, seq, -1, 0, 0));
       it != inbox_calls_.end() && std::get<0>(it->first) == channel &&
       std::get<1>(it->first) == seq;
       ++it) {
    CheckCallOrder(channel, seq, std::get<2>(it->first), it->second);
  }
}

void UcxTransport::CheckCallOrder(int channel, int64_t seq, int from, const Call& theirs) {
  if (!call_order_error_.ok() || theirs.kind <= 0 ||
      theirs.kind > static_cast<int32_t>(OpKind::kNumKinds) || seq < 0) {
    return;
  }
  const StartedOp& mine = started_[channel][static_cast<size_t>(seq % kKindHistory)];
  if (mine.seq != seq) return;  // not started here yet
  const OpKind kind = static_cast<OpKind>(mine.call.kind - 1);
  if (mine.call.kind != theirs.kind) {
    call_order_error_ =
        common::CallOrderError(channel == kRowsChannel ? "row" : "weight", seq, rank_, kind, from,
                               static_cast<OpKind>(theirs.kind - 1));
  } else if (mine.call.dispatch != theirs.dispatch) {
    call_order_error_ = common::DispatchOrderError(seq, rank_, kind, from, mine.call.dispatch,
                                                   theirs.dispatch, /*modulus=*/0);
  }
}

void UcxTransport::DropMessages(int channel, int64_t seq) {
  auto it = inbox_.lower_bound(MessageKey(channel, seq, -1, 0, 0));
  while (it != inbox_.end() && std::get<0>(it->first) == channel && std::get<1>(it->first) == seq) {
    inbox_calls_.erase(it->first);
    it = inbox_.erase(it);
  }
}

absl::StatusOr<uint64_t> UcxTransport::Register(const void* data, uint64_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(data);
  for (Region& r : regions_) {
    if (a >= r.base && a + bytes <= r.base + r.length) {
      r.last_use = ++use_clock_;
      return r.id;
    }
  }
  EvictRegions();
  Region r;
  r.id = next_region_id_++;
  r.base = a;
  r.length = bytes;
  ucp_mem_map_params_t mp;
  std::memset(&mp, 0, sizeof(mp));
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = const_cast<void*>(data);
  mp.length = bytes;
  MOONEP_RETURN_IF_ERROR(UcsCheck(ucp_mem_map(context_, &mp, &r.memh), "ucp_mem_map"));
  void* packed = nullptr;
  size_t packed_size = 0;
  const ucs_status_t st = ucp_rkey_pack(context_, r.memh, &packed, &packed_size);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_, r.memh);
    return UcsCheck(st, "ucp_rkey_pack");
  }
  r.packed_key.assign(static_cast<char*>(packed), static_cast<char*>(packed) + packed_size);
  ucp_rkey_buffer_release(packed);
  r.peer_has_key.assign(size_, 0);
  r.last_use = ++use_clock_;
  ++stats_.regions_registered;
  regions_.push_back(std::move(r));
  return regions_.back().id;
}

void UcxTransport::ForgetRange(const void* data, uint64_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(data);
  for (size_t i = 0; i < regions_.size();) {
    const Region& r = regions_[i];
    if (r.pins != 0 || r.base >= a + bytes || a >= r.base + r.length) {
      ++i;
      continue;
    }
    DropRegion(i);
  }
}

void UcxTransport::DropRegion(size_t i) {
  Region& r = regions_[i];
  for (int p = 0; p < size_; ++p) {
    if (r.peer_has_key[p]) {
      SendMessage(p, kMsgDropKey, 0, static_cast<int64_t>(r.id), 0, -1, {}).IgnoreError();
    }
  }
  ucp_mem_unmap(context_, r.memh);
  regions_.erase(regions_.begin() + static_cast<ptrdiff_t>(i));
  ++stats_.regions_evicted;
}

void UcxTransport::EvictRegions() {
  // Keep the cache bounded: drop regions no op uses, least recently used first, and tell the
  // peers holding their keys to destroy them. A region contained in a newer one is dropped too.
  while (regions_.size() >= kMaxRegions) {
    size_t victim = regions_.size();
    for (size_t i = 0; i < regions_.size(); ++i) {
      if (regions_[i].pins == 0 &&
          (victim == regions_.size() || regions_[i].last_use < regions_[victim].last_use)) {
        victim = i;
      }
    }
    if (victim == regions_.size()) return;  // all pinned: grow past the bound
    DropRegion(victim);
  }
}

void UcxTransport::Pin(uint64_t id, int delta) {
  for (Region& r : regions_) {
    if (r.id == id) {
      r.pins += delta;
      return;
    }
  }
}

const std::vector<char>* UcxTransport::KeyFor(uint64_t id, int peer) {
  for (Region& r : regions_) {
    if (r.id != id) continue;
    if (r.peer_has_key[peer]) return nullptr;
    r.peer_has_key[peer] = 1;
    ++stats_.keys_sent;
    return &r.packed_key;
  }
  return nullptr;
}

void UcxTransport::AddCounters(OpKind kind, const OpCounters& c) {
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

void UcxTransport::Poison(const absl::Status& status) {
  if (poisoned_.ok()) {
    poisoned_ = status;
    MOONEP_WARN("transport ucx: unusable after: %s", std::string(status.message()));
  }
}

absl::Status UcxTransport::Usable() const {
  if (closed_) return InvalidUsage("transport was closed (Close); destroy it");
  MOONEP_RETURN_IF_ERROR(common::CheckMpiNotFinalized("transport ucx"));
  if (poisoned_.ok()) return absl::OkStatus();
  return InvalidUsage("transport is unusable after an earlier failure (%s); destroy it",
                      std::string(poisoned_.message()));
}

absl::Status UcxTransport::AbortPeers(OpKind kind, absl::Status status) {
  if (closed_) return status;  // no endpoints left to tell the peers through
  // Once poisoned, the peers were told (or failed) already: one notice per failure.
  if (!poisoned_.ok()) return status;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    SendMessage(r, kMsgAbort, 0, 0, static_cast<int32_t>(common::AbortCode(kind, status)),
                /*dispatch=*/-1, {})
        .IgnoreError();
  }
  // Push the notices out now: the caller may not call into the transport again until Close (a
  // notice still queued then reaches the peers only after they timed out). Until the queue is
  // empty, for at most a second.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (!outbox_.empty() && std::chrono::steady_clock::now() < until) Progress();
  if (!outbox_.empty()) {
    MOONEP_WARN("transport ucx: rank %d still had %d message(s) queued, its abort notices among "
                "them, after 1 s; the peers they miss learn of the failure at their timeout",
                rank_, outbox_.size());
  }
  Poison(status);
  return status;
}

absl::Status UcxTransport::PollAbort(bool gave_up_too) {
  if (!abort_seen_) return absl::OkStatus();
  if (common::IsGaveUpNotice(abort_kind_) && !gave_up_too) return absl::OkStatus();
  absl::Status s = common::AbortNoticeError(abort_rank_, abort_kind_);
  Poison(s);
  return s;
}

absl::StatusOr<RequestPtr> UcxTransport::Skipped() {
  MOONEP_WARN("transport ucx: test hook: rank %d skips this operation", rank_);
  return RequestPtr(new DoneRequest());
}

absl::Status UcxTransport::CheckChannel(OpKind kind, int channel) {
  const std::set<int64_t>& seqs = channel_seqs_[channel];
  if (!seqs.empty() && seq_[channel] - *seqs.begin() >= kSignalDepth - 1) {
    // Operation seq_ would share its signal slot with one still in flight (a slot holds one
    // operation's signal): the older one would never see its peers' signals and time out.
    return InvalidUsage("%s: an operation of this class started %d operations earlier is still "
                        "in flight (%d in flight); complete it first: operations more than %d "
                        "apart cannot be in flight together", OpName(kind),
                        seq_[channel] - *seqs.begin(), seqs.size(), kSignalDepth - 2);
  }
  return absl::OkStatus();
}


absl::StatusOr<RequestPtr> UcxTransport::StartExchangeCounts(absl::Span<const int32_t> topk_ids,
                                                             int64_t num_tokens, int32_t top_k,
                                                             int32_t num_experts,
                                                             int64_t recv_capacity_rows,
                                                             DispatchHandle* handle) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kCounts)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckChannel(OpKind::kCounts, kRowsChannel));
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
  handle->exchange_no_ = NextExchange();
  handle->counted_by_ = serial();
  auto op = std::make_unique<CountsOp>(this, kRowsChannel, seq_[kRowsChannel]++, handle);
  handle->Track(op.get(), OpKind::kCounts);
  MOONEP_RETURN_IF_ERROR(op->Begin(
      op->Start(local, topk_ids, num_tokens, top_k, num_experts, recv_capacity_rows)));
  return RequestPtr(std::move(op));
}

absl::Status UcxTransport::CheckDispatched(OpKind kind, DispatchHandle* h) {
  absl::Status s = common::CheckHandleReady(kind, h, this, rank_, size_);
  return s.ok() ? s : AbortPeers(kind, s);
}

absl::StatusOr<RequestPtr> UcxTransport::StartDispatch(const planner::Plan& plan,
                                                       const TensorView& x,
                                                       absl::Span<const float> topk_weights,
                                                       DispatchHandle* h,
                                                       const TensorView& recv_rows,
                                                       absl::Span<float> recv_weights) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kDispatch)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckChannel(OpKind::kDispatch, kRowsChannel));
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kDispatch, h));
  // Agreed checks (identical on every rank) are returned as they are; local ones abort the peers.
  MOONEP_RETURN_IF_ERROR(common::CheckDispatchAgreed(plan, *h, rank_, size_));
  absl::Status s = common::CheckDispatchBuffers(plan, x, topk_weights, *h, recv_rows,
                                                recv_weights, rank_, options_.max_row_bytes,
                                                kBackendName);
  if (s.ok()) s = common::PrepareDispatch(plan, topk_weights, rank_, h, host_pool_.get());
  if (!s.ok()) return AbortPeers(OpKind::kDispatch, s);
  auto op = std::make_unique<DispatchOp>(this, OpKind::kDispatch, kRowsChannel, seq_[kRowsChannel]++, h);
  h->Track(op.get(), OpKind::kDispatch);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(x, recv_rows, recv_weights.data())));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> UcxTransport::StartCombineBackward(DispatchHandle* h,
                                                              const TensorView& dy,
                                                              const TensorView& dy_rows) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kCombineBackward)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckChannel(OpKind::kCombineBackward, kRowsChannel));
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kCombineBackward, h));
  absl::Status s =
      common::CheckCombineBackwardBuffers(*h, dy, dy_rows, options_.max_row_bytes, kBackendName);
  if (!s.ok()) return AbortPeers(OpKind::kCombineBackward, s);
  auto op = std::make_unique<DispatchOp>(this, OpKind::kCombineBackward, kRowsChannel, seq_[kRowsChannel]++, h);
  h->Track(op.get(), OpKind::kCombineBackward);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(dy, dy_rows, nullptr)));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> UcxTransport::StartCombine(DispatchHandle* h,
                                                      const TensorView& expert_rows,
                                                      const TensorView& y) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kCombine)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckChannel(OpKind::kCombine, kRowsChannel));
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kCombine, h));
  absl::Status s =
      common::CheckCombineBuffers(*h, expert_rows, y, options_.max_row_bytes, kBackendName);
  if (s.ok()) s = common::EnsureRowStaging(options_, h, /*scalars=*/true);
  if (!s.ok()) return AbortPeers(OpKind::kCombine, s);
  auto op = std::make_unique<CombineOp>(this, OpKind::kCombine, kRowsChannel, seq_[kRowsChannel]++, h);
  h->Track(op.get(), OpKind::kCombine);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(expert_rows, y)));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> UcxTransport::StartDispatchBackward(DispatchHandle* h,
                                                               const TensorView& dx_rows,
                                                               const TensorView& dx) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kDispatchBackward)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckChannel(OpKind::kDispatchBackward, kRowsChannel));
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kDispatchBackward, h));
  absl::Status s =
      common::CheckDispatchBackwardBuffers(*h, dx_rows, dx, options_.max_row_bytes, kBackendName);
  if (s.ok()) s = common::EnsureRowStaging(options_, h, /*scalars=*/true);
  if (!s.ok()) return AbortPeers(OpKind::kDispatchBackward, s);
  auto op = std::make_unique<CombineOp>(this, OpKind::kDispatchBackward, kRowsChannel, seq_[kRowsChannel]++, h);
  h->Track(op.get(), OpKind::kDispatchBackward);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(dx_rows, dx)));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> UcxTransport::StartTopkWeightGrad(DispatchHandle* h,
                                                             const TensorView& dy_rows,
                                                             const TensorView& expert_rows,
                                                             absl::Span<float> d_topk_weights) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, OpKind::kTopkWeightGrad)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckChannel(OpKind::kTopkWeightGrad, kRowsChannel));
  MOONEP_RETURN_IF_ERROR(CheckDispatched(OpKind::kTopkWeightGrad, h));
  absl::Status s =
      common::CheckTopkWeightGradBuffers(*h, dy_rows, expert_rows, d_topk_weights, kBackendName);
  if (s.ok()) s = common::EnsureRowStaging(options_, h, /*scalars=*/true);
  if (!s.ok()) return AbortPeers(OpKind::kTopkWeightGrad, s);
  auto op = std::make_unique<TopkWeightGradOp>(this, kRowsChannel, seq_[kRowsChannel]++, h);
  h->Track(op.get(), OpKind::kTopkWeightGrad);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(dy_rows, expert_rows, d_topk_weights.data())));
  return RequestPtr(std::move(op));
}

absl::StatusOr<RequestPtr> UcxTransport::StartPrefetch(const planner::Plan& plan,
                                                       const ExpertBlocks& params) {
  return StartChains(OpKind::kPrefetch, plan, params, "params");
}

absl::StatusOr<RequestPtr> UcxTransport::StartReduce(const planner::Plan& plan,
                                                     const ExpertBlocks& grads) {
  return StartChains(OpKind::kReduce, plan, grads, "grads");
}

absl::StatusOr<RequestPtr> UcxTransport::StartChains(OpKind kind, const planner::Plan& plan,
                                                     const ExpertBlocks& blocks,
                                                     const char* name) {
  MOONEP_RETURN_IF_ERROR(Usable());
  if (testing::ShouldSkip(rank_, kind)) return Skipped();
  MOONEP_RETURN_IF_ERROR(CheckChannel(kind, kWeightsChannel));
  // Agreed checks (a function of the plan, identical on every rank) are returned as they are.
  MOONEP_RETURN_IF_ERROR(
      Annotate(common::CheckSlotPlan(plan, size_, /*home_replicas_supported=*/true), OpName(kind)));
  const std::vector<common::ReplicaChain> chains = common::ReplicaChains(plan);
  MOONEP_RETURN_IF_ERROR(Annotate(CheckLocalChains(chains), OpName(kind)));
  absl::Status s = common::CheckBlocks(plan, blocks, name, kBackendName);
  if (!s.ok()) return AbortPeers(kind, Annotate(s, OpName(kind)));
  auto op = std::make_unique<ChainOp>(this, kind, kWeightsChannel, seq_[kWeightsChannel]++);
  MOONEP_RETURN_IF_ERROR(op->Begin(op->Start(chains, blocks)));
  return RequestPtr(std::move(op));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options) {
  return UcxTransport::Create(options);
}

absl::Status CheckUcxEnvironment() { return EagerReduceBytes().status(); }

absl::StatusOr<RegistrationStats> GetRegistrationStats(const Transport& transport) {
  const auto* t = dynamic_cast<const UcxTransport*>(&transport);
  if (t == nullptr) {
    return InvalidArgument("transport: backend '%s' is not ucx", transport.backend());
  }
  return t->stats();
}

}  // namespace moonep::transport::ucx
