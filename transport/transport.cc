#include "transport/transport.h"

#include <algorithm>
#include <atomic>
#include <new>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "moonep/core/host_memory.h"
#include "moonep/core/status.h"
#include "transport/common/host_checks.h"
#include "transport/mpi/mpi_transport.h"
#include "transport/testing_hooks.h"
#ifdef MOONEP_HAVE_UCX
#include "transport/ucx/ucx_transport.h"
#endif
#ifdef MOONEP_HAVE_NCCL
#include "transport/nccl/nccl_transport.h"
#endif

namespace moonep::transport {

const char* OpName(OpKind kind) {
  switch (kind) {
    case OpKind::kCounts: return "count exchange";
    case OpKind::kDispatch: return "dispatch";
    case OpKind::kCombine: return "combine";
    case OpKind::kCombineBackward: return "combine-backward";
    case OpKind::kDispatchBackward: return "dispatch-backward";
    case OpKind::kTopkWeightGrad: return "topk-weight-grad";
    case OpKind::kPrefetch: return "prefetch";
    case OpKind::kReduce: return "reduce";
    case OpKind::kNumKinds: break;
  }
  return "invalid";
}

namespace {
// Why operations `a` and `b` may not overlap on one handle (nullptr: they may).
const char* HandleConflict(OpKind a, OpKind b) {
  auto exclusive = [](OpKind k) { return k == OpKind::kCounts || k == OpKind::kDispatch; };
  auto row_staging = [](OpKind k) {
    return k == OpKind::kCombine || k == OpKind::kDispatchBackward;
  };
  if (exclusive(a) || exclusive(b)) {
    return "a count exchange or a dispatch rewrites the handle and needs it to itself";
  }
  if (row_staging(a) && row_staging(b)) {
    return "combine and dispatch-backward share the handle's row staging";
  }
  if (a == b) {
    return "operations of one kind go one at a time on a handle (their staging, nccl's error "
           "count)";
  }
  return nullptr;
}
}  // namespace

uint64_t Transport::NextSerial() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

absl::Status DispatchHandle::CheckIdle(const char* what) const {
  for (size_t k = 0; k < in_flight_.ops.size(); ++k) {
    if (in_flight_.ops[k] == 0) continue;
    return InvalidUsage("%s: the handle's %s has not ended; wait for it first", what,
                        OpName(static_cast<OpKind>(k)));
  }
  return absl::OkStatus();
}

absl::Status DispatchHandle::CheckCanStart(OpKind kind) const {
  // The exclusive kinds first, so that a row operation on a handle whose count exchange is in
  // flight names the count exchange.
  for (const OpKind other : {OpKind::kCounts, OpKind::kDispatch, OpKind::kCombine,
                             OpKind::kDispatchBackward, OpKind::kTopkWeightGrad,
                             OpKind::kCombineBackward}) {
    if (in_flight_.ops[static_cast<size_t>(other)] == 0) continue;
    if (const char* why = HandleConflict(kind, other)) {
      return InvalidUsage("%s: the handle's %s%s has not ended; wait for it first (its Wait, or a "
                          "Test that returned true or an error): %s", OpName(kind),
                          other == kind ? "previous " : "", OpName(other), why);
    }
  }
  return absl::OkStatus();
}

namespace {
absl::Status RunToCompletion(absl::StatusOr<RequestPtr> request) {
  if (!request.ok()) return request.status();
  return (*request)->Wait();
}
}  // namespace

absl::Status Transport::ExchangeCounts(absl::Span<const int32_t> topk_ids, int64_t num_tokens,
                                       int32_t top_k, int32_t num_experts,
                                       int64_t recv_capacity_rows, DispatchHandle* handle) {
  return RunToCompletion(
      StartExchangeCounts(topk_ids, num_tokens, top_k, num_experts, recv_capacity_rows, handle));
}
absl::Status Transport::Dispatch(const planner::Plan& plan, const TensorView& x,
                                 absl::Span<const float> topk_weights, DispatchHandle* handle,
                                 const TensorView& recv_rows, absl::Span<float> recv_weights) {
  return RunToCompletion(StartDispatch(plan, x, topk_weights, handle, recv_rows, recv_weights));
}
absl::Status Transport::Combine(DispatchHandle* handle, const TensorView& expert_rows,
                                const TensorView& y) {
  return RunToCompletion(StartCombine(handle, expert_rows, y));
}
absl::Status Transport::CombineBackward(DispatchHandle* handle, const TensorView& dy,
                                        const TensorView& dy_rows) {
  return RunToCompletion(StartCombineBackward(handle, dy, dy_rows));
}
absl::Status Transport::DispatchBackward(DispatchHandle* handle, const TensorView& dx_rows,
                                         const TensorView& dx) {
  return RunToCompletion(StartDispatchBackward(handle, dx_rows, dx));
}
absl::Status Transport::TopkWeightGrad(DispatchHandle* handle, const TensorView& dy_rows,
                                       const TensorView& expert_rows,
                                       absl::Span<float> d_topk_weights) {
  return RunToCompletion(StartTopkWeightGrad(handle, dy_rows, expert_rows, d_topk_weights));
}
absl::Status Transport::Prefetch(const planner::Plan& plan, const ExpertBlocks& params) {
  return RunToCompletion(StartPrefetch(plan, params));
}
absl::Status Transport::Reduce(const planner::Plan& plan, const ExpertBlocks& grads) {
  return RunToCompletion(StartReduce(plan, grads));
}

absl::Status DispatchHandle::ReserveHostStaging(int64_t max_entries, int64_t max_row_bytes,
                                                int64_t recv_capacity_rows) {
  if (max_entries < 0 || max_row_bytes < 0 || recv_capacity_rows < 0) {
    return InvalidArgument("staging for %d entries, rows of %d bytes, %d receive rows",
                           max_entries, max_row_bytes, recv_capacity_rows);
  }
  const size_t entries = static_cast<size_t>(max_entries);
  const size_t cap = static_cast<size_t>(recv_capacity_rows);
  size_t rows_bytes = 0;
  if (__builtin_mul_overflow(entries, static_cast<size_t>(max_row_bytes), &rows_bytes)) {
    return OutOfMemory("transport staging of %d rows of %d bytes does not fit", max_entries,
                       max_row_bytes);
  }
  // Zero-filled at once (resize): refused when the node has not the memory, rather than let the
  // fill run the process into the out-of-memory killer.
  MOONEP_RETURN_IF_ERROR(CheckHostAllocation(
      rows_bytes > rows_staging_.size() ? rows_bytes - rows_staging_.size() : 0,
      "the transport's row staging"));
  try {
    // The rows are used at their full size (resize); the others grow within what is reserved.
    if (rows_staging_.size() < rows_bytes) rows_staging_.resize(rows_bytes);
    meta_send_.reserve(entries * 8);
    meta_recv_.reserve(cap * 8);
    scalar_staging_.reserve(std::max(entries, cap));
  } catch (const std::bad_alloc&) {
    return OutOfMemory("transport staging: cannot allocate %d bytes of host memory (rows %d x "
                       "%d bytes, metadata and scalars for %d receive rows)",
                       rows_bytes + (entries + cap) * 8 + std::max(entries, cap) * 4,
                       max_entries, max_row_bytes, recv_capacity_rows);
  } catch (const std::length_error&) {
    return OutOfMemory("transport staging: %d rows of %d bytes, %d receive rows are too large",
                       max_entries, max_row_bytes, recv_capacity_rows);
  }
  return absl::OkStatus();
}

absl::Status Transport::PrepareHandle(DispatchHandle* handle, int64_t recv_capacity_rows) {
  (void)handle;
  (void)recv_capacity_rows;
  return absl::OkStatus();
}

absl::Status Transport::Close() { return absl::OkStatus(); }

std::vector<std::string> AvailableBackends() {
  std::vector<std::string> backends = {"mpi"};
#ifdef MOONEP_HAVE_UCX
  backends.push_back("ucx");
#endif
  return backends;
}

absl::Status CheckTransportEnvironment(absl::string_view backend) {
  MOONEP_RETURN_IF_ERROR(common::CheckEnvironment());
#ifdef MOONEP_HAVE_UCX
  if (backend == "ucx") return ucx::CheckUcxEnvironment();
#endif
  (void)backend;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(absl::string_view backend,
                                                           const TransportOptions& options) {
  if (backend == "mpi") return mpi::CreateMpiTransport(options);
#ifdef MOONEP_HAVE_UCX
  if (backend == "ucx") return ucx::CreateUcxTransport(options);
#endif
#ifdef MOONEP_HAVE_NCCL
  // Device memory only, so not in AvailableBackends() (whose suites pass host buffers).
  if (backend == "nccl") return nccl::CreateNcclTransport(options);
#endif
  std::string available;
  for (const std::string& b : AvailableBackends()) absl::StrAppend(&available, available.empty() ? "" : ", ", b);
  return InvalidArgument("transport backend '%s' is not built (available: %s)", backend, available);
}

namespace testing {
namespace {
std::atomic<int64_t> skip_rule{-1};  // rank * kNumKinds + kind, or -1
}
void SetSkipRank(int32_t rank, OpKind kind) {
  skip_rule = static_cast<int64_t>(rank) * static_cast<int64_t>(OpKind::kNumKinds) +
              static_cast<int64_t>(kind);
}
void ClearSkip() { skip_rule = -1; }
bool ShouldSkip(int32_t rank, OpKind kind) {
  const int64_t rule = skip_rule.load();
  return rule >= 0 && rule == static_cast<int64_t>(rank) * static_cast<int64_t>(OpKind::kNumKinds) +
                                  static_cast<int64_t>(kind);
}
}  // namespace testing

}  // namespace moonep::transport
