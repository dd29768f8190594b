#include "transport/common/host_checks.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>

#include <unistd.h>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moonep/core/env.h"
#include "moonep/core/host_memory.h"
#include "moonep/core/logging.h"
#include "moonep/core/status.h"
#include "transport/common/count_exchange.h"
#include "transport/common/replica_chain.h"
#include "transport/layout.h"

namespace moonep::transport::common {

std::string RankList(const std::vector<int>& ranks) { return absl::StrJoin(ranks, ","); }

bool IsRowDType(DType d) { return d == DType::kFloat32 || d == DType::kBFloat16; }

absl::Status CheckOptions(const TransportOptions& o, bool host_rows) {
  MOONEP_CHECK_ARG(o.max_tokens >= 0 && o.max_top_k >= 0 && o.max_row_bytes >= 0 &&
                       o.timeout_ms >= 0,
                   "options: max_tokens, max_top_k, max_row_bytes and timeout_ms must be >= 0");
  MOONEP_CHECK_ARG(!host_rows || o.max_row_bytes <= kMaxRowBytes,
                   "options.max_row_bytes = %d is above 1 GiB", o.max_row_bytes);
  MOONEP_CHECK_ARG(o.max_top_k == 0 || o.max_tokens <= kMaxEntries / o.max_top_k,
                   "options: max_tokens * max_top_k = %d * %d is above %d, the most entries a "
                   "rank can route", o.max_tokens, o.max_top_k, kMaxEntries);
  MOONEP_CHECK_ARG(o.host_threads >= 0 && o.host_threads <= kMaxHostThreads,
                   "options.host_threads = %d is not in [0, %d]", o.host_threads,
                   kMaxHostThreads);
  MOONEP_CHECK_ARG(ValidReplicaChunkBytes(o.replica_chunk_bytes),
                   "options.replica_chunk_bytes = %d is not 0 (the default, %d) or in [%d, %d]",
                   o.replica_chunk_bytes, kDefaultReplicaChunkBytes, kMinReplicaChunkBytes,
                   kMaxReplicaChunkBytes);
  return absl::OkStatus();
}

absl::Status CheckEnvironment() {
  MOONEP_RETURN_IF_ERROR(param::CheckedTimeoutMs().status());
  MOONEP_RETURN_IF_ERROR(param::CheckedHostThreads().status());
  MOONEP_RETURN_IF_ERROR(param::CheckedReplicaChunkBytes().status());
  const int64_t chunk = *param::CheckedReplicaChunkBytes();
  MOONEP_CHECK_ARG(ValidReplicaChunkBytes(chunk),
                   "MOONEP_REPLICA_CHUNK_BYTES=%d is not 0 (the default, %d) or in [%d, %d]", chunk,
                   kDefaultReplicaChunkBytes, kMinReplicaChunkBytes, kMaxReplicaChunkBytes);
  return log::LevelStatus();
}

int64_t ResolveReplicaChunkBytes(const TransportOptions& options) {
  if (options.replica_chunk_bytes != 0) return options.replica_chunk_bytes;
  const absl::StatusOr<int64_t>& env = param::CheckedReplicaChunkBytes();
  return env.ok() && ValidReplicaChunkBytes(*env) ? *env : 0;
}

int64_t ResolveTimeoutMs(int64_t options_timeout_ms) {
  const int64_t ms = options_timeout_ms > 0 ? options_timeout_ms : param::TimeoutMs();
  return std::min(ms, kMaxTimeoutMs);
}

bool SpinWaits(int local_ranks, long cpus) {
  return cpus > 0 && local_ranks >= 1 && local_ranks <= cpus;
}

bool SpinWaits(int local_ranks) { return SpinWaits(local_ranks, sysconf(_SC_NPROCESSORS_ONLN)); }

int LocalRanks(MPI_Comm comm) {
  MPI_Comm local = MPI_COMM_NULL;
  int local_size = 1;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local) == MPI_SUCCESS) {
    MPI_Comm_size(local, &local_size);
    MPI_Comm_free(&local);
  }
  return local_size < 1 ? 1 : local_size;
}

int LauncherLocalRanks() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    // Digits only, as the other launcher variables are read (strtol took " 4" and "+4"); a value
    // that is not one is said and skipped (the launcher's, not the user's: no error).
    int64_t n = 0;
    const bool digits =
        std::all_of(v, v + std::strlen(v), [](char ch) { return ch >= '0' && ch <= '9'; });
    if (digits && env::ParseBase10InRange(v, 1, int64_t{1} << 20, &n)) return static_cast<int>(n);
    MOONEP_WARN("%s=%s is not a count of ranks in [1, 2^20]; ignored", name, v);
  }
  return 0;
}

int HostThreads(int32_t options_threads, int local_ranks, long cpus) {
  if (options_threads > 0) return std::min<int32_t>(options_threads, kMaxHostThreads);
  const absl::StatusOr<int64_t>& env = param::CheckedHostThreads();
  if (env.ok() && *env > 0) return static_cast<int>(*env);
  if (cpus <= 0 || local_ranks < 1) return 1;
  return static_cast<int>(std::clamp<long>(cpus / local_ranks, 1, kAutoHostThreads));
}

std::shared_ptr<WorkerPool> MakeHostPool(int32_t options_threads, int local_ranks) {
  const int threads = HostThreads(options_threads, local_ranks, sysconf(_SC_NPROCESSORS_ONLN));
  if (threads <= 1) return nullptr;
  static std::mutex mu;
  static std::map<int, std::weak_ptr<WorkerPool>>* pools =
      new std::map<int, std::weak_ptr<WorkerPool>>;  // never destroyed: transports may outlive it
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<WorkerPool>& slot = (*pools)[threads];
  std::shared_ptr<WorkerPool> pool = slot.lock();
  if (pool == nullptr) {
    pool = std::make_shared<WorkerPool>(threads);
    slot = pool;
  }
  return pool;
}

absl::Status CheckMpiNotFinalized(const char* what) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) return absl::OkStatus();
  return InvalidUsage("%s: MPI was finalized; destroy MoonEP's layers, EP buffers and communicators "
                      "before MPI_Finalize (their MPI resources are left as they are)", what);
}

namespace {
constexpr int64_t kGaveUpBit = 1 << 8;  // above every OpKind
constexpr int64_t kCallOrderBit = 1 << 9;
constexpr char kCallOrderPayload[] = "moonep/call-order";
}  // namespace

absl::Status CallOrderError(const char* channel, int64_t seq, int me, OpKind mine, int peer,
                            OpKind theirs) {
  absl::Status s = InvalidUsage(
      "%s: rank %d called %s where rank %d called %s (%s operation %d of this transport): every "
      "rank must make the same calls in the same order; the transport is unusable",
      OpName(mine), peer, OpName(theirs), me, OpName(mine), channel, seq);
  s.SetPayload(kCallOrderPayload, absl::Cord("1"));
  return s;
}

absl::Status DispatchOrderError(int64_t seq, int me, OpKind kind, int peer, int64_t mine_bits,
                                int64_t theirs_bits, int64_t modulus) {
  const std::string mod = modulus > 0 ? absl::StrCat(" mod ", modulus) : std::string();
  absl::Status s = InvalidUsage(
      "%s: rank %d called %s on the handle of another dispatch than rank %d (row operation %d of "
      "this transport: rank %d's dispatch is count exchange %d%s of the transport, rank %d's "
      "%d): every rank must make the same calls on the same dispatch's handles in the same order; "
      "the transport is unusable",
      OpName(kind), peer, OpName(kind), me, seq, me, mine_bits, mod, peer, theirs_bits);
  s.SetPayload(kCallOrderPayload, absl::Cord("1"));
  return s;
}

int64_t AbortCode(OpKind kind, const absl::Status& status) {
  if (status.GetPayload(kCallOrderPayload).has_value()) return static_cast<int64_t>(kind) | kCallOrderBit;
  return static_cast<int64_t>(kind) | (absl::IsDeadlineExceeded(status) ? kGaveUpBit : 0);
}

bool IsGaveUpNotice(int64_t code) { return (code & kGaveUpBit) != 0; }

absl::Status AbortNoticeError(int rank, int64_t code) {
  const OpKind kind = static_cast<OpKind>(code & (kGaveUpBit - 1));
  if (code & kCallOrderBit) {
    return RemoteError("rank %d found that the ranks called different operations, or one on the "
                       "handles of different dispatches (it was in %s): every rank must make the "
                       "same calls in the same order; the transport is unusable", rank,
                       OpName(kind));
  }
  if (code & kGaveUpBit) {
    return RemoteError("rank %d gave up waiting in %s (MOONEP_TIMEOUT_MS: it heard nothing from a "
                       "peer); the transport is unusable", rank, OpName(kind));
  }
  return RemoteError("rank %d failed in %s; the transport is unusable", rank, OpName(kind));
}

absl::Status AgreeOnCreationChecks(MPI_Comm comm, const absl::Status& local, const char* refused) {
  int ok = local.ok() ? 1 : 0, all_ok = 0;
  const int rc = MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm);
  if (rc != MPI_SUCCESS) return SystemError("MPI_Allreduce of the creation checks failed (%d)", rc);
  if (!local.ok()) return local;
  if (!all_ok) return RemoteError("%s", refused);
  return absl::OkStatus();
}

absl::Status CheckSharedOptions(MPI_Comm comm, const TransportOptions& options) {
  const int64_t chunk = ResolveReplicaChunkBytes(options);
  int64_t v[2] = {chunk, -chunk};  // max, -min
  const int rc = MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_INT64_T, MPI_MAX, comm);
  if (rc != MPI_SUCCESS) return SystemError("MPI_Allreduce of the shared options failed (%d)", rc);
  MOONEP_CHECK_ARG(v[0] == -v[1],
                   "the replica chunk size (options.replica_chunk_bytes, else "
                   "MOONEP_REPLICA_CHUNK_BYTES) differs across ranks (%d here, from %d to %d): "
                   "every rank must give the same", chunk, -v[1], v[0]);
  return absl::OkStatus();
}

absl::Status CheckRowTensor(const TensorView& v, const char* name, int64_t min_rows, int64_t cols,
                            const char* backend, Device device) {
  MOONEP_CHECK_ARG(v.ndim == 2, "%s: expected a 2-D tensor, got %s", name, v.DebugString());
  MOONEP_CHECK_ARG(v.device == device, "%s: the %s transport needs %s memory, got %s", name,
                   backend, device == Device::kCpu ? "host" : "device", v.DebugString());
  MOONEP_CHECK_ARG(IsRowDType(v.dtype), "%s: dtype must be fp32 or bf16", name);
  MOONEP_CHECK_ARG(v.shape[0] >= 0 && v.shape[0] >= min_rows, "%s: has %d rows, needs at least %d",
                   name, v.shape[0], std::max<int64_t>(min_rows, 0));
  MOONEP_CHECK_ARG(v.shape[1] >= 1, "%s: has %d columns, needs at least 1", name, v.shape[1]);
  MOONEP_CHECK_ARG(cols < 0 || v.shape[1] == cols, "%s: has %d columns, expected %d", name,
                   v.shape[1], cols);
  MOONEP_CHECK_ARG(v.is_contiguous(), "%s: tensor must be contiguous", name);
  MOONEP_CHECK_ARG(v.numel() == 0 || v.data != nullptr, "%s: null data pointer", name);
  MOONEP_CHECK_ARG(reinterpret_cast<uintptr_t>(v.data) % DTypeSize(v.dtype) == 0,
                   "%s: data pointer is not aligned to its element size", name);
  return absl::OkStatus();
}

absl::Status CheckCountsInput(absl::Span<const int32_t> topk_ids, int64_t num_tokens,
                              int32_t top_k, int32_t num_experts, int64_t recv_capacity_rows,
                              const TransportOptions& options) {
  absl::Status local = ValidateRouting(topk_ids, num_tokens, top_k, num_experts);
  if (local.ok() && num_tokens > options.max_tokens) {
    local = OutOfMemory("num_tokens = %d exceeds the declared max_tokens = %d", num_tokens,
                        options.max_tokens);
  }
  if (local.ok() && top_k > options.max_top_k) {
    local = OutOfMemory("top_k = %d exceeds the declared max_top_k = %d", top_k,
                        options.max_top_k);
  }
  if (local.ok() && recv_capacity_rows < 0) {
    local = InvalidArgument("recv_capacity_rows must be >= 0, got %d", recv_capacity_rows);
  }
  return local;
}

absl::Status CheckHandleReady(OpKind kind, const DispatchHandle* h, const Transport* transport,
                              int32_t rank, int32_t size) {
  if (h == nullptr) return InvalidArgument("%s: handle is null", OpName(kind));
  MOONEP_RETURN_IF_ERROR(h->CheckCanStart(kind));
  if (!h->counted_ || h->counted_by_ != transport->serial() || h->num_ranks_ != size ||
      h->rank_ != rank) {
    return InvalidUsage("%s: the handle has no count exchange of this transport", OpName(kind));
  }
  if (kind != OpKind::kDispatch && !h->dispatched_) {
    return InvalidUsage("%s: the handle has not been dispatched", OpName(kind));
  }
  return absl::OkStatus();
}

absl::Status CheckDispatchAgreed(const planner::Plan& plan, const DispatchHandle& h,
                                 int32_t rank, int32_t size) {
  absl::Status s;
  if (plan.num_ranks != size || plan.num_experts != h.num_experts_) {
    s = InvalidArgument("dispatch: plan is for %d ranks and %d experts, the counts for %d and %d",
                        plan.num_ranks, plan.num_experts, size, h.num_experts_);
  }
  if (s.ok()) s = Annotate(CheckPlanForTransport(plan, h.counts_), "dispatch");
  if (!s.ok()) return s;
  for (int32_t r = 0; r < size; ++r) {
    if (plan.rank_rows[r] <= h.rank_capacity_[r]) continue;
    if (r == rank) {
      return OutOfMemory("dispatch: the plan gives rank %d %d rows, its receive buffer holds %d",
                         r, plan.rank_rows[r], h.rank_capacity_[r]);
    }
    return RemoteError("dispatch: the plan gives rank %d %d rows, its receive buffer holds %d", r,
                       plan.rank_rows[r], h.rank_capacity_[r]);
  }
  return absl::OkStatus();
}

namespace {
// Rows that travel (and rows summed per token, staged) are at most max_row_bytes wide (at most
// kMaxRowBytes: MPI passes a row's bytes as an int). Columns are >= 1 (CheckRowTensor).
absl::Status CheckRowBytes(const TensorView& rows, const char* name, int64_t max_row_bytes) {
  const int64_t size = static_cast<int64_t>(DTypeSize(rows.dtype));
  if (rows.shape[1] > max_row_bytes / size) {
    // rows.shape[1] * size may overflow: say "above" without the product when it would.
    if (rows.shape[1] > INT64_MAX / size) {
      return OutOfMemory("%s: a row has %d columns of %d bytes, above the declared max_row_bytes "
                         "= %d", name, rows.shape[1], size, max_row_bytes);
    }
    return OutOfMemory("%s: a row has %d bytes, above the declared max_row_bytes = %d", name,
                       rows.shape[1] * size, max_row_bytes);
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status CheckDispatchBuffers(const planner::Plan& plan, const TensorView& x,
                                  absl::Span<const float> topk_weights, const DispatchHandle& h,
                                  const TensorView& recv_rows, absl::Span<float> recv_weights,
                                  int32_t rank, int64_t max_row_bytes, const char* backend) {
  MOONEP_RETURN_IF_ERROR(CheckRowTensor(x, "x", h.num_tokens_, -1, backend));
  MOONEP_RETURN_IF_ERROR(CheckRowBytes(x, "x", max_row_bytes));
  MOONEP_RETURN_IF_ERROR(
      CheckRowTensor(recv_rows, "recv_rows", plan.rank_rows[rank], x.shape[1], backend));
  if (recv_rows.dtype != x.dtype) {
    return InvalidArgument("recv_rows: dtype %s differs from x's %s", DTypeName(recv_rows.dtype),
                           DTypeName(x.dtype));
  }
  if (x.shape[0] != h.num_tokens_) {
    return InvalidArgument("x: has %d rows, the count exchange had num_tokens = %d", x.shape[0],
                           h.num_tokens_);
  }
  if (static_cast<int64_t>(topk_weights.size()) != h.num_tokens_ * h.top_k_) {
    return InvalidArgument("topk_weights: has %d entries, need num_tokens * top_k = %d",
                           topk_weights.size(), h.num_tokens_ * h.top_k_);
  }
  if (static_cast<int64_t>(recv_weights.size()) < plan.rank_rows[rank]) {
    return InvalidArgument("recv_weights: has %d entries, the plan needs %d", recv_weights.size(),
                           plan.rank_rows[rank]);
  }
  if (RangesOverlap(x.data, x.nbytes(), recv_rows.data, recv_rows.nbytes())) {
    return InvalidArgument("x and recv_rows overlap");
  }
  return absl::OkStatus();
}

absl::Status PrepareDispatch(const planner::Plan& plan, absl::Span<const float> topk_weights,
                             int32_t rank, DispatchHandle* h, WorkerPool* pool) {
  h->plan_ = plan;
  h->topk_weights_.assign(topk_weights.begin(), topk_weights.end());
  h->dispatched_ = false;
  absl::Status s = BuildSendLayout(h->plan_, h->offsets_, rank, h->topk_ids_, h->num_tokens_,
                                   h->top_k_, &h->send_, pool);
  if (!s.ok()) return Annotate(s, "dispatch");
  BuildReceiveLayout(h->plan_, h->offsets_, rank, &h->recv_);
  return absl::OkStatus();
}

absl::Status CheckCombineBackwardBuffers(const DispatchHandle& h, const TensorView& dy,
                                         const TensorView& dy_rows, int64_t max_row_bytes,
                                         const char* backend) {
  MOONEP_RETURN_IF_ERROR(CheckRowTensor(dy, "dy", h.num_tokens_, -1, backend));
  MOONEP_RETURN_IF_ERROR(CheckRowBytes(dy, "dy", max_row_bytes));
  if (dy.shape[0] != h.num_tokens_) {
    return InvalidArgument("dy: has %d rows, need num_tokens = %d", dy.shape[0], h.num_tokens_);
  }
  MOONEP_RETURN_IF_ERROR(CheckRowTensor(dy_rows, "dy_rows", h.recv_.rank_rows, dy.shape[1], backend));
  if (dy_rows.dtype != dy.dtype) return InvalidArgument("dy_rows: dtype differs from dy's");
  if (RangesOverlap(dy.data, dy.nbytes(), dy_rows.data, dy_rows.nbytes())) {
    return InvalidArgument("dy and dy_rows overlap");
  }
  return absl::OkStatus();
}

absl::Status CheckCombineBuffers(const DispatchHandle& h, const TensorView& expert_rows,
                                 const TensorView& y, int64_t max_row_bytes, const char* backend) {
  MOONEP_RETURN_IF_ERROR(CheckRowTensor(expert_rows, "expert_rows", h.recv_.rank_rows, -1, backend));
  MOONEP_RETURN_IF_ERROR(CheckRowTensor(y, "y", h.num_tokens_, expert_rows.shape[1], backend));
  if (y.shape[0] != h.num_tokens_) {
    return InvalidArgument("y: has %d rows, need num_tokens = %d", y.shape[0], h.num_tokens_);
  }
  MOONEP_RETURN_IF_ERROR(CheckRowBytes(expert_rows, "expert_rows", max_row_bytes));
  if (RangesOverlap(expert_rows.data, expert_rows.nbytes(), y.data, y.nbytes())) {
    return InvalidArgument("expert_rows and y overlap");
  }
  return absl::OkStatus();
}

absl::Status CheckDispatchBackwardBuffers(const DispatchHandle& h, const TensorView& dx_rows,
                                          const TensorView& dx, int64_t max_row_bytes,
                                          const char* backend) {
  MOONEP_RETURN_IF_ERROR(CheckRowTensor(dx_rows, "dx_rows", h.recv_.rank_rows, -1, backend));
  MOONEP_RETURN_IF_ERROR(CheckRowTensor(dx, "dx", h.num_tokens_, dx_rows.shape[1], backend));
  if (dx.shape[0] != h.num_tokens_) {
    return InvalidArgument("dx: has %d rows, need num_tokens = %d", dx.shape[0], h.num_tokens_);
  }
  MOONEP_RETURN_IF_ERROR(CheckRowBytes(dx_rows, "dx_rows", max_row_bytes));
  if (RangesOverlap(dx_rows.data, dx_rows.nbytes(), dx.data, dx.nbytes())) {
    return InvalidArgument("dx_rows and dx overlap");
  }
  return absl::OkStatus();
}

absl::Status CheckTopkWeightGradBuffers(const DispatchHandle& h, const TensorView& dy_rows,
                                        const TensorView& expert_rows,
                                        absl::Span<float> d_topk_weights, const char* backend) {
  MOONEP_RETURN_IF_ERROR(CheckRowTensor(dy_rows, "dy_rows", h.recv_.rank_rows, -1, backend));
  MOONEP_RETURN_IF_ERROR(
      CheckRowTensor(expert_rows, "expert_rows", h.recv_.rank_rows, dy_rows.shape[1], backend));
  if (static_cast<int64_t>(d_topk_weights.size()) != h.num_tokens_ * h.top_k_) {
    return InvalidArgument("d_topk_weights: has %d entries, need num_tokens * top_k = %d",
                           d_topk_weights.size(), h.num_tokens_ * h.top_k_);
  }
  return absl::OkStatus();
}

absl::Status CheckBlocks(const planner::Plan& plan, const ExpertBlocks& b, const char* name,
                         const char* backend, Device device) {
  const int32_t nt = b.tensors_per_expert;
  MOONEP_CHECK_ARG(nt >= 1, "%s.tensors_per_expert must be >= 1, got %d", name, nt);
  MOONEP_CHECK_ARG(b.home.size() == static_cast<size_t>(plan.experts_per_rank) * nt,
                   "%s.home has %d tensors, need experts_per_rank * tensors_per_expert = %d", name,
                   b.home.size(), static_cast<int64_t>(plan.experts_per_rank) * nt);
  MOONEP_CHECK_ARG(b.slots.size() == static_cast<size_t>(plan.slots) * nt,
                   "%s.slots has %d tensors, need slots * tensors_per_expert = %d", name,
                   b.slots.size(), static_cast<int64_t>(plan.slots) * nt);
  auto check = [&](const TensorView& v, const char* part, size_t index) -> absl::Status {
    const TensorView& ref = b.home.empty() ? b.slots[index % nt] : b.home[index % nt];
    MOONEP_CHECK_ARG(v.device == device, "%s.%s[%d]: the %s transport needs %s memory", name,
                     part, index, backend, device == Device::kCpu ? "host" : "device");
    MOONEP_CHECK_ARG(IsRowDType(v.dtype), "%s.%s[%d]: dtype must be fp32 or bf16", name, part,
                     index);
    MOONEP_CHECK_ARG(v.is_contiguous(), "%s.%s[%d]: must be contiguous", name, part, index);
    MOONEP_CHECK_ARG(v.numel() == 0 || v.data != nullptr, "%s.%s[%d]: null data pointer", name,
                     part, index);
    MOONEP_CHECK_ARG(v.dtype == ref.dtype && v.numel() == ref.numel(),
                     "%s.%s[%d]: %s does not match tensor %d of the first expert (%s)", name, part,
                     index, v.DebugString(), index % nt, ref.DebugString());
    return absl::OkStatus();
  };
  for (size_t i = 0; i < b.home.size(); ++i) MOONEP_RETURN_IF_ERROR(check(b.home[i], "home", i));
  for (size_t i = 0; i < b.slots.size(); ++i) MOONEP_RETURN_IF_ERROR(check(b.slots[i], "slots", i));
  return absl::OkStatus();
}

absl::Status CheckSlotPlan(const planner::Plan& plan, int32_t R, bool home_replicas_supported) {
  MOONEP_CHECK_ARG(plan.num_ranks == R, "plan is for %d ranks, the transport has %d",
                   plan.num_ranks, R);
  const int32_t E = plan.num_experts;
  MOONEP_CHECK_ARG(E >= 1 && plan.slots >= 0 && plan.experts_per_rank * R == E &&
                       plan.home.size() == static_cast<size_t>(E) &&
                       plan.home_group.size() == static_cast<size_t>(E) &&
                       plan.slot_expert.size() == static_cast<size_t>(R) * plan.slots,
                   "plan: array sizes do not match its ranks, experts and slots");
  for (int32_t e = 0; e < E; ++e) {
    MOONEP_CHECK_ARG(plan.home[e] >= 0 && plan.home[e] < R && plan.home_group[e] >= 0 &&
                         plan.home_group[e] < plan.experts_per_rank,
                     "plan: home of expert %d is invalid", e);
  }
  for (int32_t i = 0; i < R * plan.slots; ++i) {
    const int32_t e = plan.slot_expert[i];
    MOONEP_CHECK_ARG(e >= -1 && e < E, "plan: slot_expert[%d] = %d is not an expert", i, e);
    // Home-rank replicas exist only in plans that say so (the one-rank test policy).
    const bool allowed = plan.home_replicas && home_replicas_supported;
    MOONEP_CHECK_ARG(e < 0 || allowed || plan.home[e] != i / plan.slots,
                     "plan: rank %d holds a replica of its own expert %d%s", i / plan.slots, e,
                     plan.home_replicas ? " (home-rank replicas: not supported by this backend)"
                                        : "");
  }
  // No expert in two slots of one rank: a replica chain visits each holder rank once (a chain
  // to itself would wait on itself). Slots are rank-major, so a repeat is the expert's last rank.
  std::vector<int32_t> last(static_cast<size_t>(E), -1), last_slot(static_cast<size_t>(E), -1);
  for (int32_t i = 0; i < R * plan.slots; ++i) {
    const int32_t e = plan.slot_expert[i], d = i / plan.slots;
    if (e < 0) continue;
    MOONEP_CHECK_ARG(last[e] != d, "plan: rank %d holds expert %d in two slots (%d and %d)", d, e,
                     last_slot[e], i % plan.slots);
    last[e] = d;
    last_slot[e] = i % plan.slots;
  }
  return absl::OkStatus();
}

absl::Status PrepareHostHandle(const TransportOptions& options, DispatchHandle* handle,
                               int64_t recv_capacity_rows) {
  MOONEP_CHECK_ARG(handle != nullptr, "handle is null");
  MOONEP_CHECK_ARG(recv_capacity_rows >= 0, "recv_capacity_rows is %d; must be >= 0",
                   recv_capacity_rows);
  // Reserving may move the staging that an operation in flight on the handle uses.
  MOONEP_RETURN_IF_ERROR(handle->CheckIdle("PrepareHandle"));
  return handle->ReserveHostStaging(options.max_tokens * options.max_top_k, options.max_row_bytes,
                                    recv_capacity_rows);
}

absl::Status EnsureRowStaging(const TransportOptions& options, DispatchHandle* handle,
                              bool scalars) {
  const size_t entries = static_cast<size_t>(options.max_tokens) * options.max_top_k;
  const size_t need = entries * static_cast<size_t>(options.max_row_bytes);
  MOONEP_RETURN_IF_ERROR(CheckHostAllocation(
      need > handle->rows_staging_.size() ? need - handle->rows_staging_.size() : 0,
      "the transport's row staging (max_tokens x max_top_k x max_row_bytes)"));
  try {
    if (handle->rows_staging_.size() < need) handle->rows_staging_.resize(need);
    if (scalars && handle->scalar_staging_.size() < entries) handle->scalar_staging_.resize(entries);
  } catch (const std::bad_alloc&) {
    return OutOfMemory("row staging of %d bytes (max_tokens x max_top_k x max_row_bytes): out of "
                       "host memory (PrepareHandle allocates it up front)", need);
  }
  return absl::OkStatus();
}

}  // namespace moonep::transport::common
