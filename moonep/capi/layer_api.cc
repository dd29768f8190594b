// C API level 3: the MoE layer (forward / backward with the built-in executor).
#include "moonep/capi/runtime_objects.h"
#include "moonep/runtime/cost_probe.h"

using moonep::DType;
using moonep::TensorView;
using moonep::capi::CheckHandle;
using moonep::capi::GuardOn;
using moonep::capi::Kind;

namespace {

moonepComm* CommOf(moonepLayer_t layer) {
  return layer != nullptr && moonep::capi::IsLive(layer, Kind::kLayer) ? layer->comm : nullptr;
}

// The slot of `handle`, a live handle of `layer` that no backward or release has spent.
absl::StatusOr<moonepLayerHandle*> LiveSlot(moonepLayer_t layer, moonepLayerHandle_t handle) {
  return moonep::capi::LiveSlot(layer->handles, handle, "layer");
}

absl::Status CheckPtr(const void* p, int64_t elements, const char* name) {
  if (p == nullptr && elements > 0) return moonep::InvalidArgument("%s is NULL", name);
  return absl::OkStatus();
}

}  // namespace

extern "C" {

moonepResult_t moonepLayerCreate(moonepComm_t comm, const moonepLayerConfig_t* config,
                                 moonepLayer_t* layer) {
  return GuardOn(comm, "moonepLayerCreate", [&]() -> absl::Status {
    if (layer != nullptr) *layer = nullptr;  // on failure too
    MOONEP_RETURN_IF_ERROR(CheckHandle(comm, Kind::kComm, "comm"));
    moonep::runtime::LayerConfig c;
    // A config that cannot even be read (or nowhere to put the layer) still joins the collective
    // agreement (with an invalid local verdict) so the other ranks fail instead of waiting.
    const absl::Status read =
        layer == nullptr ? moonep::InvalidArgument("layer is NULL")
                         : moonep::capi::ReadLayerConfig(config, comm->impl->size(), &c);
    if (!read.ok()) {
      moonep::runtime::LayerConfig invalid;
      (void)moonep::runtime::AgreeOnConfig(comm->impl.get(), invalid, read, "MoE layer creation");
      return read;
    }
    MOONEP_ASSIGN_OR_RETURN(auto impl, moonep::runtime::MoeLayer::Create(comm->impl.get(), c));
    auto object = std::make_unique<moonepLayer>();
    object->comm = comm;
    object->impl = std::move(impl);
    for (int i = 0; i < c.max_inflight; ++i) {
      object->handles.push_back(std::make_unique<moonepLayerHandle>());
      object->handles.back()->owner = object.get();
    }
    // Registered once its slots are made (handles are values in the slots, not registered).
    moonep::capi::Register(object.get(), Kind::kLayer);
    ++comm->children;
    *layer = object.release();
    return absl::OkStatus();
  });
}

moonepResult_t moonepLayerDestroy(moonepLayer_t layer) {
  return GuardOn(CommOf(layer), "moonepLayerDestroy", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(layer, Kind::kLayer, "layer"));
    // Collective: a peer that does not destroy it in the same order makes this a Timeout naming
    // it; the handle is freed either way.
    const absl::Status closed = layer->impl->Close();
    moonep::capi::Unregister(layer);
    --layer->comm->children;
    delete layer;
    return closed;
  });
}

moonepResult_t moonepLayerBindParams(moonepLayer_t layer, const moonepExpertTensors_t* weights,
                                     const moonepExpertTensors_t* grads) {
  return GuardOn(CommOf(layer), "moonepLayerBindParams", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(layer, Kind::kLayer, "layer"));
    const auto& c = layer->impl->config();
    const int64_t epn = c.num_experts / layer->comm->impl->size();
    std::vector<moonep::compute::ExpertParams> w, g;
    MOONEP_RETURN_IF_ERROR(moonep::capi::ReadExpertTensors(weights, "weights", epn, c.hidden,
                                                           c.intermediate, c.dtype, c.device,
                                                           &w));
    if (grads != nullptr) {
      MOONEP_RETURN_IF_ERROR(moonep::capi::ReadExpertTensors(grads, "grads", epn, c.hidden,
                                                             c.intermediate, c.grad_dtype,
                                                             c.device, &g));
    }
    return layer->impl->BindParameters(w, g);
  });
}

moonepResult_t moonepLayerForward(moonepLayer_t layer, int64_t num_tokens, const void* x,
                                  const int32_t* topk_ids, const float* topk_weights, void* y,
                                  moonepLayerHandle_t* handle, void* stream) {
  return GuardOn(CommOf(layer), "moonepLayerForward", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(layer, Kind::kLayer, "layer"));
    const auto& c = layer->impl->config();
    // A failing local check still enters Forward (with num_tokens = -1), whose agreed checks make
    // every rank fail at once instead of waiting for this one.
    absl::Status local = absl::OkStatus();
    if (handle == nullptr) {
      local = moonep::InvalidArgument("handle is NULL");
    } else if (num_tokens < 0 || num_tokens > c.max_tokens) {
      local = moonep::InvalidArgument("num_tokens is %d; must be in [0, max_tokens = %d]",
                                      num_tokens, c.max_tokens);
    }
    const int64_t entries = local.ok() ? num_tokens * c.top_k : 0;
    if (local.ok()) local = CheckPtr(x, num_tokens, "x");
    if (local.ok()) local = CheckPtr(y, num_tokens, "y");
    if (local.ok()) local = CheckPtr(topk_ids, entries, "topk_ids");
    if (local.ok()) local = CheckPtr(topk_weights, entries, "topk_weights");
    const int64_t T = local.ok() ? num_tokens : 0;
    auto h = layer->impl->Forward(
        local.ok() ? num_tokens : -1,
        TensorView::Contiguous(const_cast<void*>(x), c.dtype, {T, c.hidden}, c.device),
        absl::Span<const int32_t>(topk_ids, static_cast<size_t>(local.ok() ? entries : 0)),
        absl::Span<const float>(topk_weights, static_cast<size_t>(local.ok() ? entries : 0)),
        TensorView::Contiguous(y, c.dtype, {T, c.hidden}, c.device), stream, local);
    if (!local.ok()) return local;  // Forward failed everywhere, the peers giving this reason
    if (!h.ok()) return h.status();
    moonepLayerHandle* slot = layer->handles[static_cast<size_t>(h->index)].get();
    slot->in_use = true;
    slot->handle = *h;
    slot->value = moonep::capi::NextHandleValue();
    *handle = reinterpret_cast<moonepLayerHandle_t>(slot->value);
    return absl::OkStatus();
  });
}

moonepResult_t moonepLayerRefuseForward(moonepLayer_t layer, const char* reason, void* stream) {
  return GuardOn(CommOf(layer), "moonepLayerRefuseForward", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(layer, Kind::kLayer, "layer"));
    const auto& c = layer->impl->config();
    const absl::Status refusal = moonep::capi::CallerRefusal(reason);
    // As a forward whose arguments failed their local checks: every rank fails it at once.
    auto h = layer->impl->Forward(
        -1, TensorView::Contiguous(nullptr, c.dtype, {0, c.hidden}, c.device), {}, {},
        TensorView::Contiguous(nullptr, c.dtype, {0, c.hidden}, c.device), stream, refusal);
    if (h.ok()) return moonep::Internal("a refused forward succeeded");
    return h.status();
  });
}

moonepResult_t moonepLayerBackward(moonepLayer_t layer, moonepLayerHandle_t handle,
                                   const void* dy, void* dx, float* d_topk_weights,
                                   void* stream) {
  return GuardOn(CommOf(layer), "moonepLayerBackward", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(layer, Kind::kLayer, "layer"));
    // A bad handle on a live layer is this rank's error in a collective call: the peers fail
    // their backward at once too (they waited for this rank until the timeout).
    absl::StatusOr<moonepLayerHandle*> slot = LiveSlot(layer, handle);
    absl::Status bad_handle = slot.status();
    if (bad_handle.ok()) bad_handle = layer->impl->PlanOf((*slot)->handle).status();
    if (!bad_handle.ok()) {
      return layer->impl->AbortOperation(moonep::transport::OpKind::kCombineBackward,
                                         std::move(bad_handle));
    }
    const auto& c = layer->impl->config();
    // T of this handle: the tokens the forward saw, from its dispatch handle's counts.
    const int64_t T = layer->impl->TokensOf((*slot)->handle);
    // NULL dy / dx are the layer's to refuse: it fails the peers' backward at once too.
    const absl::Status status = layer->impl->Backward(
        (*slot)->handle,
        TensorView::Contiguous(const_cast<void*>(dy), c.dtype, {T, c.hidden}, c.device),
        TensorView::Contiguous(dx, c.dtype, {T, c.hidden}, c.device),
        d_topk_weights == nullptr
            ? absl::Span<float>()
            : absl::Span<float>(d_topk_weights, static_cast<size_t>(T * c.top_k)),
        stream);
    // A backward that ran or failed midway spends the handle; one that refused this rank's
    // arguments leaves it live for moonepLayerRelease (CApiTest.BadConfigsFailOnEveryRank). The
    // latter two leave the layer unusable on every rank.
    (*slot)->in_use = layer->impl->PlanOf((*slot)->handle).ok();
    return status;
  });
}

moonepResult_t moonepLayerRelease(moonepLayer_t layer, moonepLayerHandle_t handle) {
  return GuardOn(CommOf(layer), "moonepLayerRelease", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(layer, Kind::kLayer, "layer"));
    MOONEP_ASSIGN_OR_RETURN(moonepLayerHandle * slot, LiveSlot(layer, handle));
    slot->in_use = false;
    return layer->impl->Release(slot->handle);
  });
}

moonepResult_t moonepLayerGetStats(moonepLayer_t layer, moonepStepStats_t* stats) {
  return GuardOn(CommOf(layer), "moonepLayerGetStats", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(layer, Kind::kLayer, "layer"));
    return moonep::capi::WriteStats(layer->impl->stats(), stats);
  });
}

moonepResult_t moonepLayerGetMemory(moonepLayer_t layer, size_t* layer_bytes,
                                    size_t* shared_replica_bytes) {
  return GuardOn(CommOf(layer), "moonepLayerGetMemory", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(layer, Kind::kLayer, "layer"));
    if (layer_bytes != nullptr) *layer_bytes = layer->impl->MemoryBytes();
    if (shared_replica_bytes != nullptr) {
      *shared_replica_bytes = layer->comm->impl->ReplicaBytes();
    }
    return absl::OkStatus();
  });
}

moonepResult_t moonepMeasureCosts(moonepComm_t comm, const moonepLayerConfig_t* config,
                                  const moonepCostProbeOptions_t* options,
                                  moonepMeasuredCosts_t* costs) {
  return GuardOn(comm, "moonepMeasureCosts", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(comm, Kind::kComm, "comm"));
    moonep::runtime::LayerConfig c;
    moonep::runtime::CostProbeOptions o;
    double* speeds_out = nullptr;  // options->speeds (0.5.0)
    // Arguments that cannot be read still join the probe's first agreement (with an invalid
    // local verdict) so the other ranks fail instead of waiting.
    absl::Status read = moonep::capi::ReadLayerConfig(config, comm->impl->size(), &c);
    if (read.ok() && costs == nullptr) read = moonep::InvalidArgument("costs is NULL");
    if (read.ok() && costs->size < MOONEP_MEASURED_COSTS_MIN_SIZE) {
      read = moonep::InvalidArgument(
          "costs->size = %d is smaller than moonepMeasuredCosts_t's minimum (%d bytes): set it to "
          "sizeof(moonepMeasuredCosts_t)",
          costs->size, MOONEP_MEASURED_COSTS_MIN_SIZE);
    }
    if (read.ok() && options != nullptr) {
      if (options->size < MOONEP_COST_PROBE_OPTIONS_MIN_SIZE) {
        read = moonep::InvalidArgument(
            "options->size = %d is smaller than moonepCostProbeOptions_t's minimum (%d bytes): "
            "set it to sizeof(moonepCostProbeOptions_t)",
            options->size, MOONEP_COST_PROBE_OPTIONS_MIN_SIZE);
      } else {
        o.compute_rows = options->compute_rows;  // 0: the device's default, as in C++
        o.link_rows = options->link_rows;
        o.transfer_rows = options->transfer_rows;
        if (options->repetitions != 0) o.repetitions = options->repetitions;
        o.training = options->forward_only == 0;
        if (options->size >= offsetof(moonepCostProbeOptions_t, speeds) + sizeof(double*)) {
          speeds_out = options->speeds;
        }
      }
    }
    if (!read.ok()) {
      moonep::runtime::LayerConfig invalid;
      (void)moonep::runtime::AgreeOnConfig(comm->impl.get(), invalid, read, "cost probe");
      return read;
    }
    MOONEP_ASSIGN_OR_RETURN(moonep::runtime::MeasuredCosts m,
                            moonep::runtime::MeasureCosts(comm->impl.get(), c, o));
    moonepMeasuredCosts_t out;
    std::memset(&out, 0, sizeof(out));
    out.size = costs->size < sizeof(out) ? costs->size : sizeof(out);
    out.token_seconds = m.token_seconds;
    out.row_seconds_intra = m.row_seconds_intra;
    out.row_seconds_inter = m.row_seconds_inter;
    out.intra_measured = m.intra_measured ? 1 : 0;
    out.inter_measured = m.inter_measured ? 1 : 0;
    out.ranks = m.ranks;
    out.replica_cost_intra = m.replica_cost_intra;
    out.replica_cost_inter = m.replica_cost_inter;
    out.row_cost_intra = m.row_cost_intra;
    out.row_cost_inter = m.row_cost_inter;
    out.compute_rows = m.compute_rows;
    out.link_rows = m.link_rows;
    out.transfer_seconds_intra = m.transfer_seconds_intra;
    out.transfer_seconds_inter = m.transfer_seconds_inter;
    out.transfer_rows = m.transfer_rows;
    out.token_seconds_fastest = m.token_seconds_fastest;
    out.token_seconds_slowest = m.token_seconds_slowest;
    std::memcpy(costs, &out, out.size);
    if (speeds_out != nullptr) {
      // One per rank (MeasureCosts succeeded: every rank timed its token).
      for (size_t r = 0; r < m.speeds.size(); ++r) speeds_out[r] = m.speeds[r];
    }
    return absl::OkStatus();
  });
}

}  // extern "C"
