#include "moonep/runtime/ep_buffer.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_format.h"
#include "moonep/core/logging.h"
#include "moonep/core/status.h"

namespace moonep::runtime {

using transport::OpKind;

namespace {
using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}
}  // namespace

struct EpBuffer::Context {
  bool busy = false;
  uint64_t generation = 0;
  transport::DispatchHandle dispatch;
  planner::Plan plan;
  DeviceMemory rows;         // [capacity, H] on the buffer's device
  DeviceMemory row_weights;  // [capacity] fp32
  std::vector<int32_t> group_expert;
  std::vector<int64_t> group_offset, group_count;
};

absl::StatusOr<std::unique_ptr<EpBuffer>> EpBuffer::Create(Communicator* comm,
                                                           const LayerConfig& config) {
  if (comm == nullptr) return InvalidArgument("comm is null");
  absl::Status local = CheckLayerConfig(config, comm->size(), /*need_executor=*/false);
  if (local.ok()) local = UseDevice(config.device, config.device_index);
  if (local.ok()) local = comm->CheckTransportDevice(TransportBackend(config));
  // Round 1: the config, and every rank's max_tokens (for the default receive capacity).
  int64_t sum_max_tokens = 0;
  MOONEP_RETURN_IF_ERROR(
      AgreeOnConfig(comm, config, local, "EP buffer creation", &sum_max_tokens));
  std::unique_ptr<EpBuffer> buf(new EpBuffer());
  const int64_t row_bytes = config.hidden * static_cast<int64_t>(DTypeSize(config.dtype));
  buf->comm_ = comm;
  buf->config_ = config;
  buf->epn_ = config.num_experts / comm->size();
  buf->slots_ = config.slots < 0 ? buf->epn_ : config.slots;
  buf->capacity_ = RecvCapacityRows(config, comm->size(), sum_max_tokens);
  buf->layer_id_ = config.layer_id >= 0 ? config.layer_id : comm->NextLayerId();
  // The transport (collective; every rank is here, since the config agreed).
  MOONEP_ASSIGN_OR_RETURN(buf->transport_,
                          comm->MakeTransport(TransportBackend(config),
                                              TransportOptionsFor(config, comm->mpi_comm())));

  // The planner, the buffers and every handle's transport staging (their size depends on
  // max_recv_rows and max_tokens, which ranks may set differently): a rank that cannot make them
  // fails creation on every rank (round 2), and the transport goes again on every rank alike.
  local = CheckRecvCapacity(config, buf->capacity_);
  MOONEP_RETURN_IF_ERROR(CheckHostBuffers(
      comm, config, buf->capacity_, /*rows_per_handle=*/1, /*shared_rows=*/0, /*extra_bytes=*/0,
      "the EP buffer's host buffers (max_inflight x (receive rows, row weights, transport row "
      "staging))",
      "EP buffer creation (host memory of the node)", &local));
  if (local.ok()) {
    auto planner = planner::Planner::Create(PlannerConfigFor(config, comm->size(), buf->slots_));
    if (planner.ok()) {
      buf->planner_ = std::move(*planner);
    } else {
      local = planner.status();
    }
  }
  for (int32_t i = 0; local.ok() && i < config.max_inflight; ++i) {
    auto ctx = std::make_unique<Context>();
    auto rows = DeviceMemory::Allocate(
        config.device, static_cast<size_t>(buf->capacity_) * static_cast<size_t>(row_bytes),
        "EP buffer rows");
    if (!rows.ok()) {
      local = rows.status();
      break;
    }
    auto weights = DeviceMemory::Allocate(config.device, static_cast<size_t>(buf->capacity_) * 4,
                                          "EP buffer row weights");
    if (!weights.ok()) {
      local = weights.status();
      break;
    }
    ctx->rows = std::move(*rows);
    ctx->row_weights = std::move(*weights);
    const size_t groups = static_cast<size_t>(buf->epn_ + buf->slots_);
    ctx->group_expert.assign(groups, -1);
    ctx->group_offset.assign(groups, 0);
    ctx->group_count.assign(groups, 0);
    // Its transport staging now, not at the first combine (transport::Transport::PrepareHandle).
    local = buf->transport_->PrepareHandle(&ctx->dispatch, buf->capacity_);
    buf->contexts_.push_back(std::move(ctx));
  }
  MOONEP_RETURN_IF_ERROR(AgreeOnVerdict(comm, local, "EP buffer creation (buffers)"));
  return buf;
}

EpBuffer::~EpBuffer() { (void)Close(); }

absl::Status EpBuffer::Close() {
  if (closed_) return close_status_;
  closed_ = true;
  close_status_ =
      CloseTransport(transport_.get(), config_, absl::StrFormat("EP buffer %d destruction", layer_id_));
  if (broken_.ok()) broken_ = InvalidUsage("the EP buffer was closed (destroyed)");
  return close_status_;
}

size_t EpBuffer::MemoryBytes() const {
  size_t bytes = StagingBytes();
  for (const auto& c : contexts_) bytes += c->rows.bytes() + c->row_weights.bytes();
  return bytes;
}

size_t EpBuffer::StagingBytes() const {
  size_t bytes = 0;
  if (transport_) {
    for (const auto& c : contexts_) bytes += transport_->HandleStagingBytes(c->dispatch);
  }
  return bytes;
}

absl::Status EpBuffer::Fail(absl::Status status) {
  if (!status.ok() && broken_.ok()) {
    broken_ = Annotate(status, "an earlier call failed and left the EP buffer unusable");
  }
  return status;
}

absl::Status EpBuffer::AbortOperation(OpKind kind, absl::Status status) {
  // Once unusable (closed, or failed: the peers failed or were told already), nothing to send.
  return Fail(broken_.ok() ? transport_->AbortOperation(kind, std::move(status)) : status);
}

absl::StatusOr<EpBuffer::Context*> EpBuffer::Lookup(LayerHandle handle) const {
  if (handle.index < 0 || handle.index >= static_cast<int32_t>(contexts_.size())) {
    return InvalidArgument("handle index %d is not a handle of this EP buffer", handle.index);
  }
  Context* ctx = contexts_[handle.index].get();
  if (!ctx->busy || ctx->generation != handle.generation) {
    return InvalidUsage("handle was already released");
  }
  return ctx;
}

void EpBuffer::Count(OpKind kind) {
  stats_.ops[static_cast<int>(kind)] = transport_->counters(kind);
}

void EpBuffer::Done(Phase phase, OpKind kind, double seconds, bool backward) {
  stats_.seconds[static_cast<int>(phase)] = seconds;
  (backward ? stats_.backward_seconds : stats_.forward_seconds) += seconds;
  Count(kind);
}

absl::StatusOr<LayerHandle> EpBuffer::Dispatch(int64_t num_tokens, const TensorView& x,
                                               absl::Span<const int32_t> topk_ids,
                                               absl::Span<const float> topk_weights,
                                               const absl::Status& caller_error) {
  MOONEP_RETURN_IF_ERROR(broken_);
  int32_t index = -1;
  for (size_t i = 0; i < contexts_.size() && index < 0; ++i) {
    if (!contexts_[i]->busy) index = static_cast<int32_t>(i);
  }
  const int64_t K = config_.top_k;
  absl::Status local = absl::OkStatus();
  if (!caller_error.ok()) {
    local = caller_error;
  } else if (index < 0) {
    local = InvalidUsage("all %d handles (max_inflight) are in use; release one first",
                         config_.max_inflight);
  } else if (num_tokens < 0 || num_tokens > config_.max_tokens) {
    local = InvalidArgument("num_tokens is %d; must be in [0, max_tokens = %d]", num_tokens,
                            config_.max_tokens);
  } else if (topk_ids.size() != static_cast<size_t>(num_tokens * K) ||
             topk_weights.size() != static_cast<size_t>(num_tokens * K)) {
    local = InvalidArgument("topk_ids / topk_weights must have num_tokens * top_k = %d entries",
                            num_tokens * K);
  } else {
    local = CheckMatrix(x, "x", num_tokens, config_.hidden, config_.dtype, config_.device);
  }
  if (!local.ok()) {
    // Join the count exchange refusing with this reason, so every rank fails now.
    transport::DispatchHandle scratch;
    scratch.RefuseNextCountExchange(local);
    (void)transport_->ExchangeCounts(absl::Span<const int32_t>(), 0, config_.top_k,
                                     config_.num_experts, capacity_, &scratch);
    return local;
  }
  Context* ctx = contexts_[index].get();
  transport_->ResetCounters();
  const auto start = Clock::now();
  auto t = Clock::now();
  // Errors of the count exchange are agreed by every rank; the buffer stays usable.
  absl::Status s = transport_->ExchangeCounts(topk_ids, num_tokens, config_.top_k,
                                              config_.num_experts, capacity_, &ctx->dispatch);
  if (!s.ok()) return s;
  stats_.seconds[static_cast<int>(Phase::kCounts)] = Since(t);
  ++stats_.step;
  if (TraceWriter* trace = comm_->trace()) {
    const absl::Status traced = trace->Append(stats_.step - 1, layer_id_, comm_->size(),
                                              config_.num_experts, config_.top_k,
                                              ctx->dispatch.counts());
    if (!traced.ok()) {
      // As the layer does: only rank 0 writes, so a write error must not fail the collective
      // dispatch, but it is said (it was silent here).
      MOONEP_WARN("routing trace disabled: %s", traced.message());
      (void)comm_->SetTracePath("");
    }
  }
  t = Clock::now();
  MOONEP_RETURN_IF_ERROR(planner_->MakePlan(ctx->dispatch.counts(), &ctx->plan));
  stats_.seconds[static_cast<int>(Phase::kPlan)] = Since(t);
  const int32_t rank = comm_->rank();
  // Every rank's rows against its own capacity (they may differ): the same verdict everywhere.
  MOONEP_RETURN_IF_ERROR(CheckPlanFitsCapacities(ctx->plan, ctx->dispatch.rank_capacity_));
  t = Clock::now();
  s = transport_->Dispatch(
      ctx->plan, x, topk_weights, &ctx->dispatch,
      TensorView::Contiguous(ctx->rows.get(), config_.dtype, {capacity_, config_.hidden},
                             config_.device),
      absl::MakeSpan(ctx->row_weights.get<float>(), static_cast<size_t>(capacity_)));
  if (!s.ok()) return Fail(s);
  stats_.seconds[static_cast<int>(Phase::kDispatch)] = Since(t);
  const int32_t G = ctx->plan.num_groups();
  stats_.rows_computed = 0;
  for (int32_t g = 0; g < G; ++g) {
    const size_t i = static_cast<size_t>(rank) * G + g;
    ctx->group_expert[g] = ctx->plan.ExpertOfGroup(rank, g);
    ctx->group_offset[g] = ctx->plan.group_offset[i];
    ctx->group_count[g] = ctx->plan.group_count[i];
    stats_.rows_computed += ctx->plan.group_count[i];
  }
  ctx->busy = true;
  ctx->generation = ++next_generation_;
  stats_.tokens = num_tokens;
  stats_.plan = ctx->plan.stats;
  stats_.rank_rows = ctx->plan.rank_rows[rank];
  Count(OpKind::kCounts);
  Count(OpKind::kDispatch);
  // A step's forward time is its dispatch, prefetch and combine calls; its backward time the
  // backward calls and reduce (each adds its own; the caller's compute between them is not in).
  stats_.forward_seconds = Since(start);
  stats_.backward_seconds = 0;
  return LayerHandle{index, ctx->generation};
}

absl::Status EpBuffer::Layout(LayerHandle handle, EpLayout* layout) const {
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  layout->num_rows = ctx->plan.rank_rows[comm_->rank()];
  layout->rows = ctx->rows.get();
  layout->row_weights = ctx->row_weights.get<float>();
  layout->num_groups = ctx->plan.num_groups();
  layout->group_expert = ctx->group_expert.data();
  layout->group_offset = ctx->group_offset.data();
  layout->group_count = ctx->group_count.data();
  return absl::OkStatus();
}

absl::Status EpBuffer::Combine(LayerHandle handle, const TensorView& out_rows,
                               const TensorView& y) {
  MOONEP_RETURN_IF_ERROR(broken_);
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  const auto t = Clock::now();
  MOONEP_RETURN_IF_ERROR(Fail(transport_->Combine(&ctx->dispatch, out_rows, y)));
  Done(Phase::kCombine, OpKind::kCombine, Since(t), /*backward=*/false);
  return absl::OkStatus();
}

absl::Status EpBuffer::CombineBackward(LayerHandle handle, const TensorView& dy,
                                       const TensorView& dy_rows) {
  MOONEP_RETURN_IF_ERROR(broken_);
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  const auto t = Clock::now();
  MOONEP_RETURN_IF_ERROR(Fail(transport_->CombineBackward(&ctx->dispatch, dy, dy_rows)));
  Done(Phase::kBackwardDispatch, OpKind::kCombineBackward, Since(t), /*backward=*/true);
  return absl::OkStatus();
}

absl::Status EpBuffer::TopkWeightGrad(LayerHandle handle, const TensorView& dy_rows,
                                      const TensorView& out_rows,
                                      absl::Span<float> d_topk_weights) {
  MOONEP_RETURN_IF_ERROR(broken_);
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  const auto t = Clock::now();
  MOONEP_RETURN_IF_ERROR(
      Fail(transport_->TopkWeightGrad(&ctx->dispatch, dy_rows, out_rows, d_topk_weights)));
  Done(Phase::kTopkGrad, OpKind::kTopkWeightGrad, Since(t), /*backward=*/true);
  return absl::OkStatus();
}

absl::Status EpBuffer::DispatchBackward(LayerHandle handle, const TensorView& dx_rows,
                                        const TensorView& dx) {
  MOONEP_RETURN_IF_ERROR(broken_);
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  const auto t = Clock::now();
  MOONEP_RETURN_IF_ERROR(Fail(transport_->DispatchBackward(&ctx->dispatch, dx_rows, dx)));
  Done(Phase::kBackwardCombine, OpKind::kDispatchBackward, Since(t), /*backward=*/true);
  return absl::OkStatus();
}

absl::Status EpBuffer::Blocks(Context* ctx, absl::Span<const compute::ExpertParams> home,
                              absl::Span<const compute::ExpertParams> slots, bool grads,
                              transport::ExpertBlocks* blocks) {
  (void)ctx;
  MOONEP_CHECK_ARG(config_.intermediate > 0,
                   "the EP buffer was created with intermediate = 0; prefetch and reduce need "
                   "the expert shape");
  MOONEP_CHECK_ARG(home.size() == static_cast<size_t>(epn_), "%s has %d experts; expected E/R = %d",
                   grads ? "home_grads" : "home_weights", home.size(), epn_);
  MOONEP_CHECK_ARG(slots.size() == static_cast<size_t>(slots_), "%s has %d experts; expected slots = %d",
                   grads ? "replica_grads" : "replica_weights", slots.size(), slots_);
  const DType dtype = grads ? config_.grad_dtype : config_.dtype;
  const int64_t H = config_.hidden, I = config_.intermediate;
  home_blocks_.clear();
  slot_blocks_.clear();
  for (int pass = 0; pass < 2; ++pass) {
    auto params = pass == 0 ? home : slots;
    auto* out = pass == 0 ? &home_blocks_ : &slot_blocks_;
    const char* what = pass == 0 ? (grads ? "home_grads" : "home_weights")
                                 : (grads ? "replica_grads" : "replica_weights");
    for (size_t g = 0; g < params.size(); ++g) {
      const int32_t group = static_cast<int32_t>(g);
      MOONEP_RETURN_IF_ERROR(compute::CheckParamMatrix(params[g].gate, what, group, H, I, dtype, config_.device));
      MOONEP_RETURN_IF_ERROR(compute::CheckParamMatrix(params[g].up, what, group, H, I, dtype, config_.device));
      MOONEP_RETURN_IF_ERROR(compute::CheckParamMatrix(params[g].down, what, group, I, H, dtype, config_.device));
      out->insert(out->end(), {params[g].gate, params[g].up, params[g].down});
    }
  }
  blocks->tensors_per_expert = 3;
  blocks->home = home_blocks_;
  blocks->slots = slot_blocks_;
  return absl::OkStatus();
}

absl::Status EpBuffer::Prefetch(LayerHandle handle, absl::Span<const compute::ExpertParams> home,
                                absl::Span<const compute::ExpertParams> slots) {
  MOONEP_RETURN_IF_ERROR(broken_);
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  transport::ExpertBlocks blocks;
  absl::Status local = Blocks(ctx, home, slots, /*grads=*/false, &blocks);
  if (!local.ok()) return AbortOperation(OpKind::kPrefetch, std::move(local));
  const auto t = Clock::now();
  MOONEP_RETURN_IF_ERROR(Fail(transport_->Prefetch(ctx->plan, blocks)));
  Done(Phase::kPrefetchWait, OpKind::kPrefetch, Since(t), /*backward=*/false);
  return absl::OkStatus();
}

absl::Status EpBuffer::Reduce(LayerHandle handle, absl::Span<const compute::ExpertParams> home,
                              absl::Span<const compute::ExpertParams> slots) {
  MOONEP_RETURN_IF_ERROR(broken_);
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  transport::ExpertBlocks blocks;
  absl::Status local = Blocks(ctx, home, slots, /*grads=*/true, &blocks);
  if (!local.ok()) return AbortOperation(OpKind::kReduce, std::move(local));
  const auto t = Clock::now();
  MOONEP_RETURN_IF_ERROR(Fail(transport_->Reduce(ctx->plan, blocks)));
  Done(Phase::kReduce, OpKind::kReduce, Since(t), /*backward=*/true);
  return absl::OkStatus();
}

int64_t EpBuffer::TokensOf(LayerHandle handle) const {
  auto ctx = Lookup(handle);
  return ctx.ok() ? (*ctx)->dispatch.num_tokens() : 0;
}

absl::Status EpBuffer::Release(LayerHandle handle) {
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  ctx->busy = false;
  return absl::OkStatus();
}

}  // namespace moonep::runtime
