// The NCCL transport: the Transport interface (transport.h) on device memory, one rank per GPU.
//
// Every TensorView and every span passed to it (topk_ids, topk_weights, recv_weights,
// d_topk_weights) must point to memory of the transport's GPU; counts() and the plan stay on the
// host. Each operation first waits (on the device, not the host) for the work the caller queued on
// its stream (set_caller_stream, default: the legacy default stream), runs on the transport's own
// streams (rows: counts, dispatch, combine, backward forms; weights: prefetch, reduce), so a
// prefetch overlaps a dispatch, and records an event at its end (NcclRequest::done_event) that a
// caller's stream can wait on. docs/transport-nccl.md describes phases, memory and costs.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace moonep::transport::nccl {

// How the NCCL communicator is made.
struct NcclBootstrap {
  enum class Kind { kMpi, kUniqueId, kWrap };
  // kMpi: rank 0 of TransportOptions::comm makes a unique id and broadcasts it; rank and size are
  //   those of the MPI communicator.
  // kUniqueId: `unique_id` (from GetUniqueId on one rank, passed over the trainer's own process
  //   group), `rank`, `size`.
  // kWrap: the caller's communicator `comm`; the transport never destroys it. A failure that
  //   aborts the pair revokes it (ncclCommRevoke, so that nothing stays blocked on it; the error
  //   says so, with the payload kCallersCommStopped) and leaves it to the caller to destroy; a
  //   libnccl without ncclCommRevoke gets ncclCommAbort instead (which frees it; the error says
  //   that). Waits on it are bounded only if the caller made it non-blocking
  //   (ncclConfig_t::blocking = 0): see docs/transport-nccl.md.
  Kind kind = Kind::kMpi;
  ncclUniqueId unique_id{};
  int32_t rank = -1, size = 0;
  ncclComm_t comm = nullptr;
  int device = -1;  // the GPU; -1: the current device
};

absl::StatusOr<ncclUniqueId> GetUniqueId();

// The payload (value "1") of a failure after which the caller's communicator (kWrap) was revoked
// or aborted: it must not be wrapped again (runtime::Communicator refuses later device layers).
inline constexpr char kCallersCommStopped[] = "moonep.nccl.callers_comm_stopped";

// The communicators a transport runs on: one for rows (counts, dispatch, combine, the backward
// forms) and one for weights (prefetch, reduce), so a prefetch overlaps a dispatch. Several
// transports may share one pair (one pair for all the layers of a model instead of two NCCL
// communicators per layer); they then also share one order of operations, so their operations
// must be started in the same order on every rank (one layer after another, as a trainer runs
// them). A failure that aborts the pair (a timeout, a dead peer) makes every transport on it
// unusable. The pair is destroyed with its last holder; a wrapped communicator (kWrap) is never
// destroyed, only revoked on a failure.
class NcclComms;

// [collective over the bootstrap's ranks] Makes the pair; options.comm (kMpi) and
// options.timeout_ms are read.
absl::StatusOr<std::shared_ptr<NcclComms>> CreateNcclComms(const TransportOptions& options,
                                                           const NcclBootstrap& bootstrap);
// The GPU of the pair.
int DeviceOf(const NcclComms& comms);

// The NCCL-specific face of the transport (the runtime uses it for streams and events).
class NcclTransport : public Transport {
 public:
  virtual int device() const = 0;
  // Operations started after this call wait for the work queued on `stream` before they start.
  virtual void set_caller_stream(cudaStream_t stream) = 0;
  virtual cudaStream_t rows_stream() const = 0;
  virtual cudaStream_t weights_stream() const = 0;
  virtual ncclComm_t comm() const = 0;
};

// Every Request of this backend is an NcclRequest.
class NcclRequest : public Request {
 public:
  // Recorded on the operation's stream after its last device work; valid once Test() returned
  // true or Wait() returned OK. Ops with a host step in the middle (count exchange, dispatch:
  // sizes are read on the host) record it only after that step, i.e. after Test()/Wait() ran it.
  virtual cudaEvent_t done_event() const = 0;
};

// A transport on a pair of its own.
absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options,
                                                               const NcclBootstrap& bootstrap);
// A transport on a shared pair (local: no communication).
absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options,
                                                               std::shared_ptr<NcclComms> comms);
// CreateTransport("nccl", options): the kMpi bootstrap over options.comm.
absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options);

}  // namespace moonep::transport::nccl
