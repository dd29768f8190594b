// Argument and plan checks shared by the host-memory backends (mpi/, ucx/): each returns the error
// to report and has no side effect, so the backend decides how the peers learn of it (an agreed
// error is returned as is; a local one goes through the backend's abort channel).
//
// `backend` is the name used in messages ("MPI", "UCX": "the MPI transport needs host memory").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "moonep/core/tensor.h"
#include "planner/plan.h"
#include "transport/transport.h"

namespace moonep::transport::common {

// "1,3,4": ranks for messages.
std::string RankList(const std::vector<int>& ranks);

bool IsRowDType(DType d);

// TransportOptions at creation, before anything collective: maxima and timeout_ms >= 0,
// max_tokens * max_top_k <= kMaxEntries, and where rows move through the host backends
// (host_rows: MPI counts a row's bytes with an int) max_row_bytes <= kMaxRowBytes.
absl::Status CheckOptions(const TransportOptions& options, bool host_rows = true);
// The MOONEP_* variables every transport reads (MOONEP_TIMEOUT_MS, MOONEP_DEBUG): a malformed one is
// InvalidArgument naming it, for creation to return.
absl::Status CheckEnvironment();
// options.timeout_ms, else MOONEP_TIMEOUT_MS (checked by CheckEnvironment), at most kMaxTimeoutMs.
int64_t ResolveTimeoutMs(int64_t options_timeout_ms);
// The replica chunk size a transport uses: options.replica_chunk_bytes when set, else
// MOONEP_REPLICA_CHUNK_BYTES (0 where unset or refused: CheckEnvironment reports it), 0 meaning
// the default (common::ChunkElements).
int64_t ResolveReplicaChunkBytes(const TransportOptions& options);
// Whether a host backend's waits may poll without sleeping: at most one rank per online CPU of
// this node (`cpus`: sysconf(_SC_NPROCESSORS_ONLN) in the one-argument form; <= 0 when unknown,
// which answers no). With more ranks than cores a polling rank would hold the core its peer needs.
bool SpinWaits(int local_ranks, long cpus);
bool SpinWaits(int local_ranks);
// Ranks of `comm` on this node (collective over `comm`; 1 where MPI cannot tell).
int LocalRanks(MPI_Comm comm);
// Ranks on this node as the launcher tells its processes (OMPI_COMM_WORLD_LOCAL_SIZE,
// MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE), without communication; 0 where none is set.
int LauncherLocalRanks();
// The threads of a transport's host pool: options_threads when > 0, else MOONEP_HOST_THREADS when
// > 0, else automatic: this node's CPUs (`cpus`; <= 0 when unknown) shared by its `local_ranks`,
// at most kAutoHostThreads and at least 1. Four measured fastest on the GPU machine's 16-core host
// at the DeepSeek-V3 shape (docs/transport.md); with fewer CPUs than ranks, 1 (no pool).
constexpr int kAutoHostThreads = 4;
int HostThreads(int32_t options_threads, int local_ranks, long cpus);
// A pool of that many threads, or null for one (the calling thread alone). Transports of one
// process that resolve to the same count share one pool (a model's layers each have a transport):
// its threads live while any of them does.
std::shared_ptr<WorkerPool> MakeHostPool(int32_t options_threads, int local_ranks);
// Agrees on every rank's local creation checks (MPI_Allreduce over `comm`, collective), so that a
// value wrong on one rank fails every rank instead of leaving the others in a later collective:
// this rank's own error; else RemoteError(`refused`) when another rank failed; else OK.
absl::Status AgreeOnCreationChecks(MPI_Comm comm, const absl::Status& local, const char* refused);
// The options every rank must give alike -- the replica chunk size (ResolveReplicaChunkBytes): the
// chunks of a replica chain are cut alike on both sides of each hop -- compared over `comm`
// (collective): InvalidArgument naming it on every rank where they differ, else OK.
absl::Status CheckSharedOptions(MPI_Comm comm, const TransportOptions& options);
// InvalidUsage when MPI was finalized (the caller's MPI_Finalize came before MoonEP's objects were
// destroyed): no MPI call may be made then, and Open MPI aborts the whole job on one. `what`
// names the call ("transport mpi destruction", "dispatch").
absl::Status CheckMpiNotFinalized(const char* what);
// The abort notice a host backend sends its peers when an operation fails on this rank: the
// operation's kind, and whether this rank gave up waiting (a timeout) rather than failed.
int64_t AbortCode(OpKind kind, const absl::Status& status);
// What a peer's notice makes of the operation in flight: RemoteError naming the rank, the
// operation and (for a timeout) that it gave up waiting.
absl::Status AbortNoticeError(int rank, int64_t code);
// Whether the notice says the peer gave up waiting (a timeout) rather than failed.
bool IsGaveUpNotice(int64_t code);
// Ranks that called different operations at one point of a channel ("row" or "weight"): rank
// `peer` made operation `seq` a `theirs` where this rank `me` made it a `mine`. InvalidUsage,
// marked so that the abort notice tells the peers it was the call order (AbortCode).
absl::Status CallOrderError(const char* channel, int64_t seq, int me, OpKind mine, int peer,
                            OpKind theirs);
// Ranks that made row operation `seq` the same call on the handles of different dispatches: this
// rank `me` on the dispatch whose count exchange is the transport's `mine_bits`-th mod `modulus`
// (modulus 0: the whole number), rank `peer` on the `theirs_bits`-th. InvalidUsage, marked as
// CallOrderError's.
absl::Status DispatchOrderError(int64_t seq, int me, OpKind kind, int peer, int64_t mine_bits,
                                int64_t theirs_bits, int64_t modulus);

// A 2-D contiguous matrix of fp32 or bf16 in memory of `device` (as its TensorView says; a device
// backend also checks the pointer itself) with at least max(min_rows, 0) rows and `cols` columns
// (cols < 0: any count >= 1), non-null when it has elements, aligned to its element size.
absl::Status CheckRowTensor(const TensorView& v, const char* name, int64_t min_rows, int64_t cols,
                            const char* backend, Device device = Device::kCpu);

// This rank's count-exchange input: the routing (ValidateRouting) and the declared maxima. The
// result is this rank's local verdict; the count exchange sends it to the peers (in place of the
// counts) so that every rank agrees, and FinishCountExchange returns it named with the rank. (A
// null handle or num_experts < 1 is checked before.)
absl::Status CheckCountsInput(absl::Span<const int32_t> topk_ids, int64_t num_tokens,
                              int32_t top_k, int32_t num_experts, int64_t recv_capacity_rows,
                              const TransportOptions& options);

// The handle has a count exchange of this transport (rank, size) and, for every operation but
// dispatch, a dispatch. A local misuse: the caller aborts its peers with it.
// The host backends' PrepareHandle after their usability check: the handle's staging for the
// declared maxima of `options` and `recv_capacity_rows` (DispatchHandle::ReserveHostStaging).
absl::Status PrepareHostHandle(const TransportOptions& options, DispatchHandle* handle,
                               int64_t recv_capacity_rows);
// The handle's row staging (max_tokens * max_top_k rows of max_row_bytes; with `scalars`, also
// max_tokens * max_top_k floats) at their full size, before a combine or dispatch-backward: within
// what PrepareHostHandle reserved, nothing is allocated; else OutOfMemory when they cannot be.
absl::Status EnsureRowStaging(const TransportOptions& options, DispatchHandle* handle,
                              bool scalars);
// `transport`: the one the operation was called on (the handle's count exchange must be its).
absl::Status CheckHandleReady(OpKind kind, const DispatchHandle* handle, const Transport* transport,
                              int32_t rank, int32_t size);

// Dispatch checks that every rank makes alike (functions of plan, counts and capacities): plan
// shape, CheckPlanForTransport, and every rank's rows within its receive capacity (OutOfMemory on
// the rank at fault, RemoteError elsewhere). Returned as is: the transport stays usable.
absl::Status CheckDispatchAgreed(const planner::Plan& plan, const DispatchHandle& h,
                                 int32_t rank, int32_t size);

// This rank's dispatch buffers (local checks); x's rows at most max_row_bytes (OutOfMemory).
absl::Status CheckDispatchBuffers(const planner::Plan& plan, const TensorView& x,
                                  absl::Span<const float> topk_weights, const DispatchHandle& h,
                                  const TensorView& recv_rows, absl::Span<float> recv_weights,
                                  int32_t rank, int64_t max_row_bytes, const char* backend);

// Stores the plan and the top-k weights in the handle and builds its send and receive layouts
// (on the pool's threads where there is one). An error (a routing the plan does not cover) is
// local.
absl::Status PrepareDispatch(const planner::Plan& plan, absl::Span<const float> topk_weights,
                             int32_t rank, DispatchHandle* h, WorkerPool* pool);

// Local checks of the operations that reuse a dispatched handle. Rows that travel or are staged
// are at most max_row_bytes wide (OutOfMemory naming the tensor).
absl::Status CheckCombineBackwardBuffers(const DispatchHandle& h, const TensorView& dy,
                                         const TensorView& dy_rows, int64_t max_row_bytes,
                                         const char* backend);
absl::Status CheckCombineBuffers(const DispatchHandle& h, const TensorView& expert_rows,
                                 const TensorView& y, int64_t max_row_bytes, const char* backend);
absl::Status CheckDispatchBackwardBuffers(const DispatchHandle& h, const TensorView& dx_rows,
                                          const TensorView& dx, int64_t max_row_bytes,
                                          const char* backend);
absl::Status CheckTopkWeightGradBuffers(const DispatchHandle& h, const TensorView& dy_rows,
                                        const TensorView& expert_rows,
                                        absl::Span<float> d_topk_weights, const char* backend);

// Per-expert blocks (prefetch params, reduce grads) of this rank against the plan (local): counts,
// dtypes, shapes, contiguity, null pointers, and that every tensor is memory of `device` (as its
// TensorView says; a device backend also checks the pointers themselves).
absl::Status CheckBlocks(const planner::Plan& plan, const ExpertBlocks& blocks, const char* name,
                         const char* backend, Device device = Device::kCpu);

// The plan's replica slots (agreed: the plan is identical on every rank): sizes, experts in range,
// no rank holding one expert in two slots (InvalidArgument naming them).
// home_replicas_supported: the backend prefetches and reduces a slot on its expert's own home
// rank (plan.home_replicas, the one-rank test policy) by a local copy and add; otherwise such a
// plan is refused.
absl::Status CheckSlotPlan(const planner::Plan& plan, int32_t num_ranks,
                           bool home_replicas_supported = false);

}  // namespace moonep::transport::common
