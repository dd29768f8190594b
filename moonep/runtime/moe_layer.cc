#include "moonep/runtime/moe_layer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "moonep/core/logging.h"
#include "moonep/core/status.h"

#ifdef MOONEP_HAVE_NCCL
#include "transport/nccl/nccl_transport.h"
#endif

namespace moonep::runtime {

using transport::OpKind;

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kCounts: return "counts";
    case Phase::kPlan: return "plan";
    case Phase::kDispatch: return "dispatch";
    case Phase::kComputeHome: return "compute-home";
    case Phase::kPrefetchWait: return "prefetch-wait";
    case Phase::kComputeReplica: return "compute-replica";
    case Phase::kCombine: return "combine";
    case Phase::kBackwardDispatch: return "bwd-dispatch";
    case Phase::kTopkGrad: return "topk-grad";
    case Phase::kBackwardCompute: return "bwd-compute";
    case Phase::kBackwardCombine: return "bwd-combine";
    case Phase::kReduce: return "reduce";
    case Phase::kNumPhases: break;
  }
  return "invalid";
}

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TensorView Rows(void* data, DType dtype, int64_t rows, int64_t hidden, Device device) {
  return TensorView::Contiguous(data, dtype, {rows, hidden}, device);
}

}  // namespace

// The state one forward saves for its backward.
struct MoeLayer::Context {
  bool busy = false;
  uint64_t generation = 0;
  uint64_t token = 0;  // identifies this forward's replica prefetch
  int64_t num_tokens = 0;
  transport::DispatchHandle dispatch;
  planner::Plan plan;
  DeviceMemory x_rows, y_rows;  // [cap, H] each, on the layer's device
  DeviceMemory row_weights;     // [cap] fp32
  compute::ComputeView full, home, replica;
  int64_t split = 0;       // rows [0, split) hold home groups, [split, rank_rows) replica groups
  bool splittable = true;  // false: one pass after the prefetch
};

// The rows, weights and scratch buffers of every context, and the shared replica buffer.
absl::Status MoeLayer::AllocateBuffers() {
  MOONEP_ASSIGN_OR_RETURN(replicas_,
                          comm_->Replicas(slots_, config_.hidden, config_.intermediate,
                                          config_.dtype, config_.grad_dtype, config_.device,
                                          &made_replicas_));
  const Device dev = config_.device;
  const size_t rows_bytes = static_cast<size_t>(capacity_) * row_bytes_;
  const size_t cap = static_cast<size_t>(capacity_);
  for (int32_t i = 0; i < config_.max_inflight; ++i) {
    auto ctx = std::make_unique<Context>();
    MOONEP_ASSIGN_OR_RETURN(ctx->x_rows, DeviceMemory::Allocate(dev, rows_bytes, "x rows"));
    MOONEP_ASSIGN_OR_RETURN(ctx->y_rows, DeviceMemory::Allocate(dev, rows_bytes, "y rows"));
    MOONEP_ASSIGN_OR_RETURN(ctx->row_weights,
                            DeviceMemory::Allocate(dev, cap * sizeof(float), "row weights"));
    // Its transport staging now, not at the first combine (transport::Transport::PrepareHandle).
    MOONEP_RETURN_IF_ERROR(transport_->PrepareHandle(&ctx->dispatch, capacity_));
    contexts_.push_back(std::move(ctx));
  }
  MOONEP_ASSIGN_OR_RETURN(dy_rows_, DeviceMemory::Allocate(dev, rows_bytes, "dy rows"));
  MOONEP_ASSIGN_OR_RETURN(dx_rows_, DeviceMemory::Allocate(dev, rows_bytes, "dx rows"));
  MOONEP_ASSIGN_OR_RETURN(
      dtopk_scratch_,
      DeviceMemory::Allocate(dev, static_cast<size_t>(config_.max_tokens * config_.top_k) * 4,
                             "d topk_weights scratch"));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MoeLayer>> MoeLayer::Create(Communicator* comm,
                                                           const LayerConfig& config) {
  if (comm == nullptr) return InvalidArgument("comm is null");
  absl::Status local = CheckLayerConfig(config, comm->size(), /*need_executor=*/true);
  // A rank without its GPU fails creation on every rank (not a hang in the transport's setup).
  if (local.ok()) local = UseDevice(config.device, config.device_index);
  if (local.ok()) local = comm->CheckTransportDevice(TransportBackend(config));
  // Round 1: the config, and every rank's max_tokens (the default receive capacity is the worst
  // case over every rank's tokens).
  int64_t sum_max_tokens = 0;
  MOONEP_RETURN_IF_ERROR(
      AgreeOnConfig(comm, config, local, "MoE layer creation", &sum_max_tokens));

  std::unique_ptr<MoeLayer> layer(new MoeLayer());
  layer->comm_ = comm;
  layer->config_ = config;
  layer->epn_ = config.num_experts / comm->size();
  layer->slots_ = config.slots < 0 ? layer->epn_ : config.slots;
  layer->capacity_ = RecvCapacityRows(config, comm->size(), sum_max_tokens);
  layer->row_bytes_ = static_cast<size_t>(config.hidden) * DTypeSize(config.dtype);
  layer->layer_id_ = config.layer_id >= 0 ? config.layer_id : comm->NextLayerId();

  // The transport (collective; every rank is here, since the config agreed).
  MOONEP_ASSIGN_OR_RETURN(layer->transport_,
                          comm->MakeTransport(TransportBackend(config),
                                              TransportOptionsFor(config, comm->mpi_comm())));

  // The planner, the executor, the buffers and every handle's transport staging (their sizes
  // depend on max_recv_rows and max_tokens, which ranks may set differently, and they need free
  // memory): a rank that cannot make them fails creation on every rank (round 2), and the
  // transport goes again on every rank alike.
  local = CheckRecvCapacity(config, layer->capacity_);
  // The communicator's replica buffer for this shape, when this layer is the first to need it.
  const uint64_t new_replicas =
      comm->HasReplicas(layer->slots_, config.hidden, config.intermediate, config.dtype,
                        config.grad_dtype, config.device)
          ? 0
          : compute::ReplicaBuffer::BytesFor(layer->slots_, config.hidden, config.intermediate,
                                             config.dtype, config.grad_dtype);
  MOONEP_RETURN_IF_ERROR(CheckHostBuffers(
      comm, config, layer->capacity_, /*rows_per_handle=*/2, /*shared_rows=*/2, new_replicas,
      "the layer's host buffers (max_inflight x (x and y rows, row weights, transport row "
      "staging), dy and dx rows, a new replica buffer)",
      "MoE layer creation (host memory of the node)", &local));
  if (local.ok()) {
    auto planner = planner::Planner::Create(PlannerConfigFor(config, comm->size(), layer->slots_));
    if (planner.ok()) {
      layer->planner_ = std::move(*planner);
    } else {
      local = planner.status();
    }
  }
  if (local.ok()) {
    compute::ExecutorConfig ec;
    ec.hidden = config.hidden;
    ec.intermediate = config.intermediate;
    ec.dtype = config.dtype;
    ec.max_rows = layer->capacity_;
    ec.num_threads = config.num_threads;
    auto backend = MakeDeviceBackend(config.device, ec);
    if (backend.ok()) {
      layer->executor_ = std::move(backend->executor);
      layer->ops_ = std::move(backend->ops);
    } else {
      local = backend.status();
    }
  }
  if (local.ok()) local = layer->AllocateBuffers();
  // A replica buffer this creation made goes again if the creation fails (the communicator would
  // otherwise keep it, unused, until it is destroyed).
  struct DropReplicasOnFailure {
    MoeLayer* layer;
    ~DropReplicasOnFailure() {
      if (layer != nullptr && layer->made_replicas_) layer->comm_->DropReplicas(layer->replicas_);
    }
  } drop{layer.get()};
  MOONEP_RETURN_IF_ERROR(AgreeOnVerdict(comm, local, "MoE layer creation (buffers)"));

  for (int32_t s = 0; s < layer->slots_; ++s) {
    const compute::ExpertParams& w = layer->replicas_->buffer->weights()[s];
    const compute::ExpertParams& g = layer->replicas_->buffer->grads()[s];
    layer->slot_weight_blocks_.insert(layer->slot_weight_blocks_.end(), {w.gate, w.up, w.down});
    layer->slot_grad_blocks_.insert(layer->slot_grad_blocks_.end(), {g.gate, g.up, g.down});
  }
  MOONEP_INFO("MoE layer %d: E=%d K=%d H=%d I=%d %s slots=%d policy=%s device=%s transport=%s "
              "capacity=%d rows, %d bytes (transport staging %d)", layer->layer_id_,
              config.num_experts, config.top_k, config.hidden, config.intermediate,
              DTypeName(config.dtype), layer->slots_, planner::PolicyName(config.policy),
              config.device == Device::kCuda ? "cuda" : "cpu", layer->transport_->backend(),
              layer->capacity_, layer->MemoryBytes(), layer->StagingBytes());
  drop.layer = nullptr;  // created: the buffer is the communicator's to keep
  return layer;
}

MoeLayer::~MoeLayer() { (void)Close(); }

absl::Status MoeLayer::Close() {
  if (closed_) return close_status_;
  closed_ = true;
  close_status_ =
      CloseTransport(transport_.get(), config_, absl::StrFormat("MoE layer %d destruction", layer_id_));
  if (broken_.ok()) broken_ = InvalidUsage("the layer was closed (destroyed)");
  return close_status_;
}

size_t MoeLayer::MemoryBytes() const {
  size_t bytes = dy_rows_.bytes() + dx_rows_.bytes() + dtopk_scratch_.bytes();
  for (const auto& ctx : contexts_) {
    bytes += ctx->x_rows.bytes() + ctx->y_rows.bytes() + ctx->row_weights.bytes();
  }
  if (executor_) bytes += executor_->WorkspaceBytes();
  return bytes + StagingBytes();
}

size_t MoeLayer::StagingBytes() const {
  size_t bytes = 0;
  if (transport_) {
    for (const auto& ctx : contexts_) bytes += transport_->HandleStagingBytes(ctx->dispatch);
  }
  return bytes;
}

absl::Status MoeLayer::BindParameters(absl::Span<const compute::ExpertParams> weights,
                                      absl::Span<const compute::ExpertParams> grads) {
  // A step's weights stay as its forward saw them: its backward (on every rank alike) reuses the
  // replica slots that forward filled. A rebinding takes effect at the next forward, which
  // always copies the replicas anew.
  for (const auto& ctx : contexts_) {
    if (ctx->busy) {
      return InvalidUsage("BindParameters: a forward handle is still outstanding; rebind between "
                          "steps (after every handle's backward or release)");
    }
  }
  MOONEP_CHECK_ARG(weights.size() == static_cast<size_t>(epn_),
                   "weights has %d experts; this rank holds epn = %d", weights.size(), epn_);
  MOONEP_CHECK_ARG(grads.empty() || grads.size() == static_cast<size_t>(epn_),
                   "grads has %d experts; expected 0 (forward only) or epn = %d", grads.size(),
                   epn_);
  const int64_t H = config_.hidden, I = config_.intermediate;
  for (size_t g = 0; g < weights.size(); ++g) {
    const int32_t group = static_cast<int32_t>(g);
    MOONEP_RETURN_IF_ERROR(compute::CheckParamMatrix(weights[g].gate, "weights.gate", group, H, I,
                                                     config_.dtype, config_.device));
    MOONEP_RETURN_IF_ERROR(compute::CheckParamMatrix(weights[g].up, "weights.up", group, H, I,
                                                     config_.dtype, config_.device));
    MOONEP_RETURN_IF_ERROR(compute::CheckParamMatrix(weights[g].down, "weights.down", group, I, H,
                                                     config_.dtype, config_.device));
    if (!grads.empty()) {
      MOONEP_RETURN_IF_ERROR(compute::CheckParamMatrix(grads[g].gate, "grads.gate", group, H, I,
                                                       config_.grad_dtype, config_.device));
      MOONEP_RETURN_IF_ERROR(compute::CheckParamMatrix(grads[g].up, "grads.up", group, H, I,
                                                       config_.grad_dtype, config_.device));
      MOONEP_RETURN_IF_ERROR(compute::CheckParamMatrix(grads[g].down, "grads.down", group, I, H,
                                                       config_.grad_dtype, config_.device));
    }
  }
  weights_.assign(weights.begin(), weights.end());
  grads_.assign(grads.begin(), grads.end());
  home_weight_blocks_.clear();
  home_grad_blocks_.clear();
  for (const auto& w : weights_) home_weight_blocks_.insert(home_weight_blocks_.end(), {w.gate, w.up, w.down});
  for (const auto& g : grads_) home_grad_blocks_.insert(home_grad_blocks_.end(), {g.gate, g.up, g.down});
  bound_ = true;
  grads_bound_ = !grads_.empty();
  // (The replica slots' loaded_by is left alone: it is state every rank must agree on, and this
  // call is local. No handle is outstanding, and a new forward never matches it.)
  return absl::OkStatus();
}

absl::Status MoeLayer::AbortOperation(transport::OpKind kind, absl::Status status) {
  // Once unusable (closed, or failed: the peers failed or were told already), nothing to send.
  return Fail(broken_.ok() ? transport_->AbortOperation(kind, std::move(status)) : status);
}

absl::Status MoeLayer::Fail(absl::Status status) {
  if (!status.ok() && broken_.ok()) {
    broken_ = Annotate(status, "an earlier step failed and left the layer unusable");
  }
  return status;
}

absl::StatusOr<MoeLayer::Context*> MoeLayer::Lookup(LayerHandle handle) const {
  if (handle.index < 0 || handle.index >= static_cast<int32_t>(contexts_.size())) {
    return InvalidArgument("handle index %d is not a handle of this layer", handle.index);
  }
  Context* ctx = contexts_[handle.index].get();
  if (!ctx->busy || ctx->generation != handle.generation) {
    return InvalidUsage("handle was already released (backward or release called twice?)");
  }
  return ctx;
}

absl::StatusOr<const planner::Plan*> MoeLayer::PlanOf(LayerHandle handle) const {
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  return &ctx->plan;
}

int64_t MoeLayer::TokensOf(LayerHandle handle) const {
  auto ctx = Lookup(handle);
  return ctx.ok() ? (*ctx)->num_tokens : 0;
}

absl::Status MoeLayer::Release(LayerHandle handle) {
  MOONEP_ASSIGN_OR_RETURN(Context * ctx, Lookup(handle));
  ctx->busy = false;
  return absl::OkStatus();
}

void MoeLayer::UseCallerStream(void* stream) {
#ifdef MOONEP_HAVE_NCCL
  if (auto* nccl = dynamic_cast<transport::nccl::NcclTransport*>(transport_.get())) {
    nccl->set_caller_stream(static_cast<cudaStream_t>(stream));
  }
#else
  (void)stream;
#endif
}

absl::StatusOr<LayerHandle> MoeLayer::Forward(int64_t num_tokens, const TensorView& x,
                                              absl::Span<const int32_t> topk_ids,
                                              absl::Span<const float> topk_weights,
                                              const TensorView& y, void* stream,
                                              const absl::Status& caller_error) {
  MOONEP_RETURN_IF_ERROR(broken_);
  ScopedDevice device(config_.device, config_.device_index);
  UseCallerStream(stream);
  // Local argument checks. A failing rank still joins the count exchange, with routing that the
  // transport rejects, so that every other rank fails at once (RemoteError) instead of waiting.
  absl::Status local = absl::OkStatus();
  Context* ctx = nullptr;
  int32_t index = -1;
  for (size_t i = 0; i < contexts_.size() && ctx == nullptr; ++i) {
    if (!contexts_[i]->busy) {
      ctx = contexts_[i].get();
      index = static_cast<int32_t>(i);
    }
  }
  const int64_t K = config_.top_k;
  if (!caller_error.ok()) {
    local = caller_error;
  } else if (!bound_) {
    local = InvalidUsage("BindParameters was not called before Forward");
  } else if (ctx == nullptr) {
    local = InvalidUsage("all %d handles (max_inflight) are in use; call Backward or Release",
                         config_.max_inflight);
  } else if (num_tokens < 0 || num_tokens > config_.max_tokens) {
    local = InvalidArgument("num_tokens is %d; must be in [0, max_tokens = %d]", num_tokens,
                            config_.max_tokens);
  } else if (topk_ids.size() != static_cast<size_t>(num_tokens * K)) {
    local = InvalidArgument("topk_ids has %d entries; expected num_tokens * top_k = %d",
                            topk_ids.size(), num_tokens * K);
  } else if (topk_weights.size() != static_cast<size_t>(num_tokens * K)) {
    local = InvalidArgument("topk_weights has %d entries; expected num_tokens * top_k = %d",
                            topk_weights.size(), num_tokens * K);
  } else {
    local = CheckMatrix(x, "x", num_tokens, config_.hidden, config_.dtype, config_.device);
    if (local.ok()) {
      local = CheckMatrix(y, "y", num_tokens, config_.hidden, config_.dtype, config_.device);
    }
    if (local.ok() && RangesOverlap(x.data, x.nbytes(), y.data, y.nbytes())) {
      local = InvalidArgument("y overlaps x");
    }
  }
  if (!local.ok()) {
    transport::DispatchHandle scratch;
    // Refused with this reason in the count exchange: the transport's agreed validation fails
    // every rank at once, the peers giving the reason.
    scratch.RefuseNextCountExchange(local);
    (void)transport_->ExchangeCounts(absl::Span<const int32_t>(), 0, config_.top_k,
                                     config_.num_experts, capacity_, &scratch);
    return local;
  }
  ctx->busy = true;
  ctx->generation = ++next_generation_;
  ctx->num_tokens = num_tokens;
  moving_ = false;
  const absl::Status status = RunForward(ctx, x, topk_ids, topk_weights, y);
  if (!status.ok()) {
    ctx->busy = false;
    // Errors of the count exchange and of planning are agreed by every rank (same counts, same
    // plan): the layer stays usable. Anything later may leave a peer mid-operation, and so does
    // a peer's abort notice that reaches this rank while it still finishes the count exchange.
    return (moving_ || !transport_->health().ok()) ? Fail(status) : status;
  }
  return LayerHandle{index, ctx->generation};
}

absl::Status MoeLayer::BuildViews(Context* ctx, bool need_grads) {
  absl::Span<const compute::ExpertParams> no_params;
  MOONEP_RETURN_IF_ERROR(compute::BuildComputeView(
      ctx->plan, comm_->rank(), weights_, need_grads ? absl::MakeConstSpan(grads_) : no_params,
      replicas_->buffer->weights(), need_grads ? replicas_->buffer->grads() : no_params,
      &ctx->full));
  // Home groups first, replica groups once their weights are here: two views over disjoint row
  // ranges, so computing one never touches the rows of the other.
  const int32_t rank = comm_->rank();
  const int32_t G = ctx->plan.num_groups();
  const int64_t rank_rows = ctx->plan.rank_rows[rank];
  int64_t home_end = 0, replica_begin = rank_rows;
  for (int32_t g = 0; g < G; ++g) {
    const size_t i = static_cast<size_t>(rank) * G + g;
    const int64_t begin = ctx->plan.group_offset[i];
    const int64_t end = begin + ctx->plan.group_padded[i];
    if (g < epn_) {
      home_end = std::max(home_end, end);
    } else if (ctx->plan.group_padded[i] > 0) {
      replica_begin = std::min(replica_begin, begin);
    }
  }
  ctx->splittable = home_end <= replica_begin;
  ctx->split = home_end;
  auto fill = [&](compute::ComputeView* part, int32_t g_begin, int32_t g_end, int64_t shift,
                  int64_t total) {
    part->hidden = ctx->full.hidden;
    part->intermediate = ctx->full.intermediate;
    part->dtype = ctx->full.dtype;
    part->device = ctx->full.device;
    part->groups.clear();
    for (int32_t g = g_begin; g < g_end; ++g) {
      compute::GroupView group = ctx->full.groups[g];
      if (group.padded_count == 0) group.row_offset = shift;  // empty group: anywhere in range
      group.row_offset -= shift;
      part->groups.push_back(group);
    }
    part->total_rows = total;
  };
  if (ctx->splittable) {
    fill(&ctx->home, 0, epn_, 0, home_end);
    fill(&ctx->replica, epn_, G, home_end, rank_rows - home_end);
  }
  return absl::OkStatus();
}

absl::StatusOr<transport::RequestPtr> MoeLayer::StartPrefetchIfNeeded(Context* ctx) {
  // Every rank sees the same plan and the same sequence of calls, so all skip alike.
  if (ctx->plan.stats.replicas == 0 || replicas_->loaded_by == ctx->token) {
    return transport::RequestPtr();
  }
  transport::ExpertBlocks blocks;
  blocks.tensors_per_expert = 3;
  blocks.home = home_weight_blocks_;
  blocks.slots = slot_weight_blocks_;
  replicas_->loaded_by = 0;
  MOONEP_ASSIGN_OR_RETURN(transport::RequestPtr request,
                          transport_->StartPrefetch(ctx->plan, blocks));
  replicas_->loaded_by = ctx->token;
  return request;
}

absl::Status MoeLayer::Compute(Context* ctx, bool backward, transport::Request* prefetch,
                               const TensorView& in_rows, const TensorView& grad_rows,
                               const TensorView& out_rows) {
  const int64_t H = config_.hidden;
  const size_t rb = row_bytes_;
  auto slice = [&](const TensorView& rows, int64_t begin, int64_t count) {
    return Rows(static_cast<char*>(rows.data) + static_cast<size_t>(begin) * rb, config_.dtype,
                count, H, config_.device);
  };
  auto run = [&](const compute::ComputeView& view, int64_t begin) -> absl::Status {
    bool any = false;
    for (const auto& g : view.groups) any = any || g.row_count > 0;
    if (!any) return absl::OkStatus();
    if (!backward) {
      return executor_->Forward(view, slice(in_rows, begin, view.total_rows),
                                slice(out_rows, begin, view.total_rows), {});
    }
    return executor_->Backward(view, slice(in_rows, begin, view.total_rows),
                               slice(grad_rows, begin, view.total_rows),
                               slice(out_rows, begin, view.total_rows), {});
  };
  const Phase compute_phase = backward ? Phase::kBackwardCompute : Phase::kComputeHome;
  auto t = Clock::now();
  if (ctx->splittable) {
    MOONEP_RETURN_IF_ERROR(run(ctx->home, 0));
    stats_.seconds[static_cast<int>(compute_phase)] += Since(t);
  }
  t = Clock::now();
  if (prefetch != nullptr) MOONEP_RETURN_IF_ERROR(prefetch->Wait());
  stats_.seconds[static_cast<int>(Phase::kPrefetchWait)] += backward ? 0.0 : Since(t);
  t = Clock::now();
  if (ctx->splittable) {
    MOONEP_RETURN_IF_ERROR(run(ctx->replica, ctx->split));
  } else {
    MOONEP_RETURN_IF_ERROR(run(ctx->full, 0));
  }
  stats_.seconds[static_cast<int>(backward ? Phase::kBackwardCompute : Phase::kComputeReplica)] +=
      Since(t);
  return absl::OkStatus();
}

absl::Status MoeLayer::RunForward(Context* ctx, const TensorView& x, absl::Span<const int32_t> ids,
                                  absl::Span<const float> weights, const TensorView& y) {
  const auto start = Clock::now();
  for (int p = 0; p < static_cast<int>(Phase::kBackwardDispatch); ++p) stats_.seconds[p] = 0;
  transport_->ResetCounters();
  const int32_t rank = comm_->rank();

  auto t = Clock::now();
  MOONEP_RETURN_IF_ERROR(transport_->ExchangeCounts(ids, ctx->num_tokens, config_.top_k,
                                                    config_.num_experts, capacity_,
                                                    &ctx->dispatch));
  stats_.seconds[static_cast<int>(Phase::kCounts)] = Since(t);
  ++stats_.step;
  if (TraceWriter* trace = comm_->trace()) {
    const absl::Status traced = trace->Append(stats_.step - 1, layer_id_, comm_->size(),
                                              config_.num_experts, config_.top_k,
                                              ctx->dispatch.counts());
    if (!traced.ok()) {
      // Only rank 0 writes, so a write error must not fail the (collective) step.
      MOONEP_WARN("routing trace disabled: %s", traced.message());
      (void)comm_->SetTracePath("");
    }
  }

  t = Clock::now();
  MOONEP_RETURN_IF_ERROR(planner_->MakePlan(ctx->dispatch.counts(), &ctx->plan));
  stats_.seconds[static_cast<int>(Phase::kPlan)] = Since(t);
  // Every rank's rows against its own capacity (they may differ): the same verdict everywhere.
  MOONEP_RETURN_IF_ERROR(CheckPlanFitsCapacities(ctx->plan, ctx->dispatch.rank_capacity_));
  ctx->token = comm_->NextToken();
  MOONEP_RETURN_IF_ERROR(BuildViews(ctx, /*need_grads=*/false));

  moving_ = true;
  MOONEP_ASSIGN_OR_RETURN(transport::RequestPtr prefetch, StartPrefetchIfNeeded(ctx));
  const TensorView x_rows = Rows(ctx->x_rows.get(), config_.dtype, capacity_, config_.hidden,
                                 config_.device);
  const TensorView y_rows = Rows(ctx->y_rows.get(), config_.dtype, capacity_, config_.hidden,
                                 config_.device);
  t = Clock::now();
  absl::Status dispatched = transport_->Dispatch(
      ctx->plan, x, weights, &ctx->dispatch, x_rows,
      absl::MakeSpan(ctx->row_weights.get<float>(), static_cast<size_t>(capacity_)));
  stats_.seconds[static_cast<int>(Phase::kDispatch)] = Since(t);
  if (!dispatched.ok()) {
    if (prefetch) (void)prefetch->Wait();
    return dispatched;
  }
  MOONEP_RETURN_IF_ERROR(Compute(ctx, /*backward=*/false, prefetch.get(), x_rows, TensorView(),
                                 y_rows));
  t = Clock::now();
  MOONEP_RETURN_IF_ERROR(transport_->Combine(&ctx->dispatch, y_rows, y));
  stats_.seconds[static_cast<int>(Phase::kCombine)] = Since(t);

  stats_.tokens = ctx->num_tokens;
  stats_.plan = ctx->plan.stats;
  stats_.rank_rows = ctx->plan.rank_rows[rank];
  stats_.rows_computed = 0;
  for (int32_t g = 0; g < ctx->plan.num_groups(); ++g) {
    stats_.rows_computed += ctx->plan.group_count[static_cast<size_t>(rank) * ctx->plan.num_groups() + g];
  }
  for (OpKind kind : {OpKind::kCounts, OpKind::kDispatch, OpKind::kCombine, OpKind::kPrefetch}) {
    stats_.ops[static_cast<int>(kind)] = transport_->counters(kind);
  }
  stats_.forward_seconds = Since(start);
  return absl::OkStatus();
}

absl::Status MoeLayer::Backward(LayerHandle handle, const TensorView& dy, const TensorView& dx,
                                absl::Span<float> d_topk_weights, void* stream) {
  MOONEP_RETURN_IF_ERROR(broken_);
  ScopedDevice device(config_.device, config_.device_index);
  UseCallerStream(stream);
  auto looked_up = Lookup(handle);
  if (!looked_up.ok()) {
    return AbortOperation(transport::OpKind::kCombineBackward, looked_up.status());
  }
  Context* ctx = *looked_up;
  const int64_t T = ctx->num_tokens;
  if (!grads_bound_) {  // BindParameters is local: one rank may have bound none
    // The handle stays live (Release still frees it); the layer is unusable on every rank.
    return AbortOperation(
        transport::OpKind::kCombineBackward,
        InvalidUsage("no gradients bound: BindParameters was given none (forward-only layer)"));
  }
  if (d_topk_weights.data() == nullptr) {
    d_topk_weights = absl::MakeSpan(dtopk_scratch_.get<float>(),
                                    static_cast<size_t>(T * config_.top_k));
  }
  // This rank's arguments: when one is wrong, every peer fails its backward at once too (mpi,
  // ucx) instead of waiting for this rank until the timeout; the layer is unusable afterwards.
  absl::Status local = CheckMatrix(dy, "dy", T, config_.hidden, config_.dtype, config_.device);
  if (local.ok()) {
    local = CheckMatrix(dx, "dx", T, config_.hidden, config_.dtype, config_.device);
  }
  if (local.ok() && RangesOverlap(dy.data, dy.nbytes(), dx.data, dx.nbytes())) {
    local = InvalidArgument("dx overlaps dy");
  }
  if (local.ok() && d_topk_weights.size() != static_cast<size_t>(T * config_.top_k)) {
    local = InvalidArgument("d_topk_weights has %d entries; expected num_tokens * top_k = %d",
                            d_topk_weights.size(), T * config_.top_k);
  }
  if (!local.ok()) {
    ctx->busy = false;
    return AbortOperation(transport::OpKind::kCombineBackward, std::move(local));
  }
  const absl::Status status = RunBackward(ctx, dy, dx, d_topk_weights);
  ctx->busy = false;  // the handle is spent either way
  return Fail(status);
}

absl::Status MoeLayer::RunBackward(Context* ctx, const TensorView& dy, const TensorView& dx,
                                   absl::Span<float> d_topk_weights) {
  const auto start = Clock::now();
  for (int p = static_cast<int>(Phase::kBackwardDispatch); p < static_cast<int>(Phase::kNumPhases);
       ++p) {
    stats_.seconds[p] = 0;
  }
  transport_->ResetCounters();
  const int64_t H = config_.hidden;
  const Device dev = config_.device;
  const TensorView x_rows = Rows(ctx->x_rows.get(), config_.dtype, capacity_, H, dev);
  const TensorView y_rows = Rows(ctx->y_rows.get(), config_.dtype, capacity_, H, dev);
  const TensorView dy_rows = Rows(dy_rows_.get(), config_.dtype, capacity_, H, dev);
  const TensorView dx_rows = Rows(dx_rows_.get(), config_.dtype, capacity_, H, dev);

  auto t = Clock::now();
  MOONEP_RETURN_IF_ERROR(transport_->CombineBackward(&ctx->dispatch, dy, dy_rows));
  stats_.seconds[static_cast<int>(Phase::kBackwardDispatch)] = Since(t);
  t = Clock::now();
  MOONEP_RETURN_IF_ERROR(transport_->TopkWeightGrad(&ctx->dispatch, dy_rows, y_rows,
                                                    d_topk_weights));
  stats_.seconds[static_cast<int>(Phase::kTopkGrad)] = Since(t);

  // y = sum_k w_k FFN_k(x): each row's expert sees dy scaled by its token's top-k weight.
  // (Padding rows carry weight 0; rows outside the groups are never read by the executor.)
  MOONEP_RETURN_IF_ERROR(BuildViews(ctx, /*need_grads=*/true));
  MOONEP_RETURN_IF_ERROR(ops_->ScaleRows(dy_rows.data, config_.dtype,
                                         ctx->plan.rank_rows[comm_->rank()], H,
                                         ctx->row_weights.get<float>()));
  // Replica weights: still in the slots when this backward follows its own forward directly.
  MOONEP_ASSIGN_OR_RETURN(transport::RequestPtr prefetch, StartPrefetchIfNeeded(ctx));
  for (int32_t s = 0; s < slots_; ++s) {
    if (ctx->plan.slot_expert[static_cast<size_t>(comm_->rank()) * slots_ + s] >= 0) {
      MOONEP_RETURN_IF_ERROR(
          ops_->Zero(replicas_->buffer->slot_grads(s), replicas_->buffer->slot_grad_bytes()));
    }
  }
  MOONEP_RETURN_IF_ERROR(Compute(ctx, /*backward=*/true, prefetch.get(), x_rows, dy_rows, dx_rows));

  transport::RequestPtr reduce;
  if (ctx->plan.stats.replicas > 0) {
    transport::ExpertBlocks blocks;
    blocks.tensors_per_expert = 3;
    blocks.home = home_grad_blocks_;
    blocks.slots = slot_grad_blocks_;
    MOONEP_ASSIGN_OR_RETURN(reduce, transport_->StartReduce(ctx->plan, blocks));
  }
  t = Clock::now();
  absl::Status combined = transport_->DispatchBackward(&ctx->dispatch, dx_rows, dx);
  stats_.seconds[static_cast<int>(Phase::kBackwardCombine)] = Since(t);
  t = Clock::now();
  if (reduce) {
    const absl::Status reduced = reduce->Wait();
    if (combined.ok()) combined = reduced;
  }
  stats_.seconds[static_cast<int>(Phase::kReduce)] = Since(t);
  MOONEP_RETURN_IF_ERROR(combined);
  for (OpKind kind : {OpKind::kCombineBackward, OpKind::kTopkWeightGrad, OpKind::kDispatchBackward,
                      OpKind::kReduce}) {
    stats_.ops[static_cast<int>(kind)] = transport_->counters(kind);
  }
  stats_.backward_seconds = Since(start);
  return absl::OkStatus();
}

}  // namespace moonep::runtime
