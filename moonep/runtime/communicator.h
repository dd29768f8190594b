// The communicator: a group of ranks that run MoE layers together, built from an MPI_Comm, from a
// unique id + rank + size (NCCL-style), or from the launcher's environment. It owns the MPI
// communicator (always a duplicate), the routing-trace writer, and the replica buffers shared by
// every layer of one shape.
//
// Every path needs an MPI launch (mpirun / srun): the unique-id and environment paths build the
// communicator out of MPI_COMM_WORLD, and the UCX and NCCL transports bootstrap over it.
//
// Creation waits at most MOONEP_TIMEOUT_MS (read once per process, like every knob) in each of its
// steps: (1) MPI_Comm_idup of the parent (the caller's communicator, or
// MPI_COMM_WORLD), nonblocking, waited for with a deadline; a timeout there says that some rank
// has not joined but not which (MPI does not tell); (2) an agreement over that private duplicate
// (Agree: point to point, two rounds), which names the ranks not heard from, carries each rank's
// own argument errors to all, and makes a rank that joins after the others gave up fail too;
// (3) for the unique-id and environment paths, MPI_Comm_create_group among the members, which
// blocks (MPI has no nonblocking form) but runs only after the agreement showed every member
// present. Residual: a member that stalls past the timeout between the agreement's two rounds
// can leave the others blocked in step 3 (as the same window in Allgather); and MPI_Init, when
// MoonEP initialises MPI, waits for every process of the job without a deadline.
// A timed-out MPI_Comm_idup cannot be cancelled: it stays open on the ranks that called it (MPI
// completes it if the late ranks call it later) and the parent communicator then has that
// collective outstanding; MoonEP keeps its request and buffers allocated for good.

#pragma once

#include <mpi.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include <tuple>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moonep/compute/compute_view.h"
#include "moonep/runtime/trace_writer.h"
#include "transport/transport.h"

namespace moonep::transport::nccl {
class NcclComms;
}  // namespace moonep::transport::nccl

namespace moonep::runtime {

constexpr int kUniqueIdBytes = 128;
struct UniqueId {
  char bytes[kUniqueIdBytes] = {};
};

// The replica weight and gradient buffer shared by the layers of one shape on a communicator,
// and which (layer, forward) last filled its weight slots, so a backward right after its own
// forward skips the second prefetch.
// The buffer is in host memory for CPU layers and in GPU memory for CUDA layers (DeviceAllocator).
struct SharedReplicas {
  std::unique_ptr<compute::ReplicaBuffer> buffer;
  uint64_t loaded_by = 0;  // 0: nothing valid; else the token of the forward that prefetched
};

// Where this process sits according to the launcher's environment variables.
struct LaunchInfo {
  int32_t rank = -1, size = -1;
  std::string source;  // "OMPI_COMM_WORLD_*", "PMI_*", "SLURM_*", "RANK/WORLD_SIZE"
  const char* rank_var = "";  // the variables read, e.g. "RANK" and "WORLD_SIZE"
  const char* size_var = "";
};
// Reads OMPI_COMM_WORLD_{RANK,SIZE}, PMI_{RANK,SIZE}, SLURM_{PROCID,NTASKS} and torchrun's
// RANK / WORLD_SIZE, in that order; the first pair with both variables set is used. Local ranks
// (LOCAL_RANK, ...) are not read: MoonEP picks no device (the layer config's device_index does).
// InvalidArgument naming the variable and its value when the pair used is malformed (not a
// base-10 integer, rank not below size), or when no pair is complete but one variable of a pair
// is set; NotFound when none is set.
absl::StatusOr<LaunchInfo> ReadLaunchInfo();

class Communicator {
 public:
  // Duplicates `comm` (collective over it). Timeout (naming the phase) when a rank of `comm`
  // has not joined within MOONEP_TIMEOUT_MS; see the top of this file.
  static absl::StatusOr<std::unique_ptr<Communicator>> FromMpi(MPI_Comm comm);
  // Every process of MPI_COMM_WORLD calls this together; the processes that pass the same id form
  // one communicator, ordered by `rank`. Fails on every member when the ranks are not 0..size-1
  // (InvalidArgument naming a duplicated rank), and on the others (RemoteError naming the process)
  // when one passed bad arguments.
  static absl::StatusOr<std::unique_ptr<Communicator>> FromUniqueId(const UniqueId& id,
                                                                    int32_t size, int32_t rank);
  // From ReadLaunchInfo(): MPI_COMM_WORLD ordered by the launcher's rank. Every process fails when
  // one's variables are malformed (it: InvalidArgument naming the variable; the others:
  // RemoteError naming it), when a rank is given twice (InvalidArgument naming it), or when the
  // launcher's size is not MPI_COMM_WORLD's (InvalidUsage: not started by an MPI launcher).
  static absl::StatusOr<std::unique_ptr<Communicator>> FromEnvironment();
  // A fresh id (random bytes and a magic); rank 0 makes it and shares it out of band.
  static UniqueId NewUniqueId();

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  MPI_Comm mpi_comm() const { return comm_; }
  int32_t rank() const { return rank_; }
  int32_t size() const { return size_; }

  // The replica buffer for layers of this shape on `device` (the current GPU for kCuda), created
  // on first use (local, not collective).
  // *created (if given): whether this call made it.
  absl::StatusOr<SharedReplicas*> Replicas(int32_t slots, int64_t hidden, int64_t intermediate,
                                           DType dtype, DType grad_dtype,
                                           Device device = Device::kCpu, bool* created = nullptr);
  // Whether Replicas(...) of these arguments would return an existing buffer (local).
  bool HasReplicas(int32_t slots, int64_t hidden, int64_t intermediate, DType dtype,
                   DType grad_dtype, Device device = Device::kCpu) const;
  // Frees a replica buffer Replicas made, when the layer it was made for failed creation before
  // any other layer could use it (local).
  void DropReplicas(const SharedReplicas* replicas);
  // Bytes held by every shared replica buffer.
  size_t ReplicaBytes() const;

  // Routing traces (rank 0 writes; see docs/trace-format.md). Opened from MOONEP_TRACE at
  // creation; SetTracePath("") turns tracing off.
  absl::Status SetTracePath(const std::string& path);
  // Null while tracing is off or paused (PauseTrace).
  TraceWriter* trace() { return trace_paused_ ? nullptr : trace_.get(); }
  // Local: while paused, layers and EP buffers record nothing (the cost probe's dispatches, which
  // have a shape of their own, must not fix or break the trace's shape).
  void PauseTrace(bool paused) { trace_paused_ = paused; }
  bool trace_paused() const { return trace_paused_; }

  // Layer ids for traces, in creation order.
  int32_t NextLayerId() { return next_layer_id_++; }
  // A process-unique token for "which forward filled the replica slots".
  uint64_t NextToken() { return ++token_; }

  // A transport of `backend` for a layer or buffer made on this communicator. "nccl": every
  // transport of this communicator shares one pair of NCCL communicators (made at the first call,
  // collective like layer creation; the rows one is the caller's when SetNcclComm was called),
  // on the current GPU, which must be the pair's. Other backends: a fresh transport.
  absl::StatusOr<std::unique_ptr<transport::Transport>> MakeTransport(
      const std::string& backend, const transport::TransportOptions& options);
  // Local. The caller's NCCL communicator (an ncclComm_t) for the rows of every NCCL transport
  // made afterwards: same size as this communicator and the same rank on every member; MoonEP
  // never destroys it (a failure revokes it, see docs/transport-nccl.md; after a failed creation
  // that did, later device layers are refused). Refused once a device layer exists, or when
  // MoonEP was built without NCCL.
  absl::Status SetNcclComm(void* nccl_comm);
  // True once the shared NCCL pair exists (tests).
  bool has_nccl_comms() const { return nccl_comms_ != nullptr; }
  // Whether SetNcclComm was called here (every rank must agree: the NCCL pair is made from the
  // caller's communicator on the ranks that did and by MoonEP on the others, which then wait in
  // different collectives forever).
  bool has_caller_nccl_comm() const { return caller_nccl_comm_ != nullptr; }
  // Local: OK unless a `backend` transport here would be on another GPU than the current one
  // (the NCCL pair exists already, on another device). For creation to report before its
  // agreement, so that every rank fails, not one after the others went on.
  absl::Status CheckTransportDevice(const std::string& backend) const;

  // Agreement helper: allgathers `bytes` from every rank with a deadline of MOONEP_TIMEOUT_MS
  // (per round: the data, then every peer's confirmation). out gets size() * bytes.size() bytes.
  // A rank that does not join in time: Timeout naming the phase and the ranks not heard from,
  // and this rank tells its peers it gave up, so a rank that joins late fails too (RemoteError
  // naming the rank that gave up) instead of going on alone. (Not in every case: a rank that
  // stalls past the timeout between the two rounds can still leave the others going on.)
  // After either, the communicator's agreements are refused (its collectives are out of step):
  // destroy it. The buffers of an exchange that failed, and the MPI communicator, are then left
  // allocated for good (a late peer's messages may still land in them).
  absl::Status Allgather(absl::Span<const char> bytes, std::string* out, const char* phase);

 private:
  Communicator() = default;
  static absl::StatusOr<std::unique_ptr<Communicator>> Adopt(MPI_Comm owned);
  // The agreed `verdict` on the members of a creation out of `world` (a private duplicate of
  // MPI_COMM_WORLD, freed here): its error, or the communicator of the world ranks `by_rank`
  // (MPI_Comm_create_group), adopted.
  static absl::StatusOr<std::unique_ptr<Communicator>> AdoptGroup(MPI_Comm world,
                                                                  const absl::Status& verdict,
                                                                  const std::vector<int>& by_rank);
  struct Exchange;
  // Allgather's exchange over `comm` (rank `rank` of `size`) with a deadline of `timeout_ms` per
  // round; an exchange MPI may still use is moved to `parked`.
  static absl::Status Agree(MPI_Comm comm, int rank, int size, absl::Span<const char> bytes,
                            std::string* out, const char* phase, int64_t timeout_ms,
                            std::vector<std::unique_ptr<Exchange>>* parked);
  // A private duplicate of `parent` (MPI_Comm_idup, waited for with a deadline), then Agree over
  // it: the duplicate, or the first failure. After a failure the duplicate and the buffers MPI
  // may still use stay allocated for good (late peers may still send to them).
  static absl::StatusOr<MPI_Comm> CreationAgreement(MPI_Comm parent, const char* parent_name,
                                                    absl::Span<const char> bytes, std::string* out,
                                                    const char* phase, int64_t timeout_ms);
  // CreationAgreement of every rank's `mine` (a trivially copyable record): `all[r]` is rank r's.
  template <typename T>
  static absl::StatusOr<MPI_Comm> AgreeOnRecords(MPI_Comm parent, const char* parent_name,
                                                 const T& mine, std::vector<T>* all,
                                                 const char* phase, int64_t timeout_ms);

  // An agreement's messages, kept alive after a timeout while MPI may still use them.
  struct Exchange {
    std::vector<char> send, recv, confirm;
    std::vector<int> confirm_tag;  // tag each peer's confirmation round arrived with
    std::vector<MPI_Request> requests;
    std::vector<MPI_Request> open_sends;  // of an earlier round, still open
  };

  MPI_Comm comm_ = MPI_COMM_NULL;
  int32_t rank_ = 0, size_ = 0;
  absl::Status broken_;  // why agreements are refused (an earlier one failed)
  std::vector<std::unique_ptr<Exchange>> parked_;
  int32_t next_layer_id_ = 0;
  uint64_t token_ = 0;
  std::unique_ptr<TraceWriter> trace_;
  bool trace_paused_ = false;
  void* caller_nccl_comm_ = nullptr;
  // Why device layers are refused: the caller's NCCL communicator was revoked or aborted by a
  // failed creation of the NCCL pair (OK: not).
  absl::Status caller_nccl_stopped_;
  std::shared_ptr<transport::nccl::NcclComms> nccl_comms_;
  std::map<std::tuple<int32_t, int64_t, int64_t, int32_t, int32_t, int32_t>,
           std::unique_ptr<SharedReplicas>>
      replicas_;
};

// Initialises MPI (MPI_THREAD_SERIALIZED) when the caller has not; MoonEP then finalizes
// it when its last communicator is destroyed.
absl::Status EnsureMpi();

}  // namespace moonep::runtime
