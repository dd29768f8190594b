// C API level 2: the EP buffer (dispatch / combine / prefetch / reduce on caller tensors).
#include "moonep/capi/runtime_objects.h"

using moonep::TensorView;
using moonep::capi::CheckHandle;
using moonep::capi::GuardOn;
using moonep::capi::Kind;
using moonep::transport::OpKind;

namespace {

moonepComm* CommOf(moonepEpBuffer_t buffer) {
  return buffer != nullptr && moonep::capi::IsLive(buffer, Kind::kEpBuffer) ? buffer->comm
                                                                            : nullptr;
}

// Checks buffer and handle, and returns the handle's layout (for row counts) and, where asked
// for, its slot (the call's state).
absl::Status Resolve(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                     moonep::runtime::EpLayout* layout, moonepEpHandle** slot_out = nullptr) {
  MOONEP_RETURN_IF_ERROR(CheckHandle(buffer, Kind::kEpBuffer, "buffer"));
  MOONEP_ASSIGN_OR_RETURN(moonepEpHandle * slot,
                          moonep::capi::LiveSlot(buffer->handles, handle, "EP buffer"));
  if (slot_out != nullptr) *slot_out = slot;
  return buffer->impl->Layout(slot->handle, layout);
}

// Prefetch and reduce move experts: the buffer needs their shape (checked before the tensors, whose
// errors would otherwise hide this cause).
absl::Status CheckExpertShape(const moonep::runtime::LayerConfig& c) {
  MOONEP_CHECK_ARG(c.intermediate > 0,
                   "the EP buffer was created with intermediate = 0; prefetch and reduce need "
                   "the expert shape");
  return absl::OkStatus();
}

absl::Status CheckPtr(const void* p, int64_t elements, const char* name) {
  if (p == nullptr && elements > 0) return moonep::InvalidArgument("%s is NULL", name);
  return absl::OkStatus();
}

// Prefetch's and reduce's checks: the handle, the expert shape, then this rank's E/R home experts
// and its `slots` replica experts, both of `dtype`.
absl::Status ReadExperts(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                         const moonepExpertTensors_t* home_t, const char* home_name,
                         const moonepExpertTensors_t* slots_t, const char* slots_name,
                         moonep::DType dtype, std::vector<moonep::compute::ExpertParams>* home,
                         std::vector<moonep::compute::ExpertParams>* slots,
                         moonepEpHandle** slot) {
  moonep::runtime::EpLayout l;
  MOONEP_RETURN_IF_ERROR(Resolve(buffer, handle, &l, slot));
  const auto& c = buffer->impl->config();
  MOONEP_RETURN_IF_ERROR(CheckExpertShape(c));
  MOONEP_RETURN_IF_ERROR(moonep::capi::ReadExpertTensors(home_t, home_name,
                                                         buffer->impl->experts_per_rank(),
                                                         c.hidden, c.intermediate, dtype,
                                                         c.device, home));
  return moonep::capi::ReadExpertTensors(slots_t, slots_name, buffer->impl->slots(), c.hidden,
                                         c.intermediate, dtype, c.device, slots);
}


// A collective call: `checks` are this rank's own (handle, pointers, tensors); when they fail, the
// call fails on every peer at once too (mpi, ucx: the transport's abort notice; nccl: they time
// out naming this rank), instead of the peers waiting for this rank until the timeout and
// blaming it again at their next call. Otherwise `op` runs the transport operation, whose own
// failures are already shared.
template <typename Checks, typename Op>
absl::Status Collective(moonepEpBuffer_t buffer, OpKind kind, Checks&& checks, Op&& op) {
  MOONEP_RETURN_IF_ERROR(CheckHandle(buffer, Kind::kEpBuffer, "buffer"));
  absl::Status local = checks();
  if (!local.ok()) return buffer->impl->AbortOperation(kind, std::move(local));
  return op();
}

// [rows, H] of the buffer's dtype, on its device.
TensorView Matrix(const void* p, const moonep::runtime::LayerConfig& c, int64_t rows) {
  return TensorView::Contiguous(const_cast<void*>(p), c.dtype, {rows, c.hidden}, c.device);
}

}  // namespace

extern "C" {

moonepResult_t moonepEpBufferCreate(moonepComm_t comm, const moonepEpBufferConfig_t* config,
                                    moonepEpBuffer_t* buffer) {
  return GuardOn(comm, "moonepEpBufferCreate", [&]() -> absl::Status {
    if (buffer != nullptr) *buffer = nullptr;  // on failure too
    MOONEP_RETURN_IF_ERROR(CheckHandle(comm, Kind::kComm, "comm"));
    moonep::runtime::LayerConfig c;
    // Like moonepLayerCreate: a local error still joins the agreement, so the peers fail at once.
    const absl::Status read =
        buffer == nullptr ? moonep::InvalidArgument("buffer is NULL")
                          : moonep::capi::ReadLayerConfig(config, comm->impl->size(), &c);
    if (!read.ok()) {
      moonep::runtime::LayerConfig invalid;
      (void)moonep::runtime::AgreeOnConfig(comm->impl.get(), invalid, read, "EP buffer creation");
      return read;
    }
    MOONEP_ASSIGN_OR_RETURN(auto impl, moonep::runtime::EpBuffer::Create(comm->impl.get(), c));
    auto object = std::make_unique<moonepEpBuffer>();
    object->comm = comm;
    object->impl = std::move(impl);
    for (int i = 0; i < c.max_inflight; ++i) {
      object->handles.push_back(std::make_unique<moonepEpHandle>());
      object->handles.back()->owner = object.get();
    }
    // Registered once its slots are made (handles are values in the slots, not registered).
    moonep::capi::Register(object.get(), Kind::kEpBuffer);
    ++comm->children;
    *buffer = object.release();
    return absl::OkStatus();
  });
}

moonepResult_t moonepEpBufferDestroy(moonepEpBuffer_t buffer) {
  return GuardOn(CommOf(buffer), "moonepEpBufferDestroy", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(buffer, Kind::kEpBuffer, "buffer"));
    // Collective: a peer that does not destroy it in the same order makes this a Timeout naming
    // it; the handle is freed either way.
    const absl::Status closed = buffer->impl->Close();
    moonep::capi::Unregister(buffer);
    --buffer->comm->children;
    delete buffer;
    return closed;
  });
}

moonepResult_t moonepEpDispatch(moonepEpBuffer_t buffer, int64_t num_tokens, const void* x,
                                const int32_t* topk_ids, const float* topk_weights,
                                moonepEpHandle_t* handle) {
  return GuardOn(CommOf(buffer), "moonepEpDispatch", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(buffer, Kind::kEpBuffer, "buffer"));
    const auto& c = buffer->impl->config();
    absl::Status local = absl::OkStatus();
    if (handle == nullptr) {
      local = moonep::InvalidArgument("handle is NULL");
    } else if (num_tokens < 0 || num_tokens > c.max_tokens) {
      local = moonep::InvalidArgument("num_tokens is %d; must be in [0, max_tokens = %d]",
                                      num_tokens, c.max_tokens);
    }
    const int64_t entries = local.ok() ? num_tokens * c.top_k : 0;
    if (local.ok()) local = CheckPtr(x, num_tokens, "x");
    if (local.ok()) local = CheckPtr(topk_ids, entries, "topk_ids");
    if (local.ok()) local = CheckPtr(topk_weights, entries, "topk_weights");
    const int64_t T = local.ok() ? num_tokens : 0;
    auto h = buffer->impl->Dispatch(
        local.ok() ? num_tokens : -1, Matrix(x, c, T),
        absl::Span<const int32_t>(topk_ids, static_cast<size_t>(local.ok() ? entries : 0)),
        absl::Span<const float>(topk_weights, static_cast<size_t>(local.ok() ? entries : 0)),
        local);
    if (!local.ok()) return local;  // every rank failed, the peers giving this reason
    if (!h.ok()) return h.status();
    moonepEpHandle* slot = buffer->handles[static_cast<size_t>(h->index)].get();
    slot->in_use = true;
    slot->handle = *h;
    slot->value = moonep::capi::NextHandleValue();
    *handle = reinterpret_cast<moonepEpHandle_t>(slot->value);
    return absl::OkStatus();
  });
}

moonepResult_t moonepEpRefuseDispatch(moonepEpBuffer_t buffer, const char* reason) {
  return GuardOn(CommOf(buffer), "moonepEpRefuseDispatch", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(buffer, Kind::kEpBuffer, "buffer"));
    const auto& c = buffer->impl->config();
    const absl::Status refusal = moonep::capi::CallerRefusal(reason);
    // As a dispatch whose arguments failed their local checks: every rank fails it at once.
    auto h = buffer->impl->Dispatch(-1, Matrix(nullptr, c, 0), {}, {}, refusal);
    if (h.ok()) return moonep::Internal("a refused dispatch succeeded");
    return h.status();
  });
}

moonepResult_t moonepEpGetLayout(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                                 moonepEpLayout_t* layout) {
  return GuardOn(CommOf(buffer), "moonepEpGetLayout", [&]() -> absl::Status {
    moonep::runtime::EpLayout l;
    MOONEP_RETURN_IF_ERROR(Resolve(buffer, handle, &l));
    MOONEP_CHECK_ARG(layout != nullptr, "layout is NULL");
    layout->num_rows = l.num_rows;
    layout->rows = l.rows;
    layout->row_weights = l.row_weights;
    layout->num_groups = l.num_groups;
    layout->group_expert = l.group_expert;
    layout->group_offset = l.group_offset;
    layout->group_count = l.group_count;
    return absl::OkStatus();
  });
}

moonepResult_t moonepEpCombine(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                               const void* out_rows, void* y) {
  return GuardOn(CommOf(buffer), "moonepEpCombine", [&]() -> absl::Status {
    moonep::runtime::EpLayout l;
    moonepEpHandle* slot = nullptr;
    int64_t T = 0;
    return Collective(
        buffer, OpKind::kCombine,
        [&]() -> absl::Status {
          MOONEP_RETURN_IF_ERROR(Resolve(buffer, handle, &l, &slot));
          T = buffer->impl->TokensOf(slot->handle);
          MOONEP_RETURN_IF_ERROR(CheckPtr(out_rows, l.num_rows, "out_rows"));
          return CheckPtr(y, T, "y");
        },
        [&]() {
          const auto& c = buffer->impl->config();
          return buffer->impl->Combine(slot->handle, Matrix(out_rows, c, l.num_rows),
                                       Matrix(y, c, T));
        });
  });
}

moonepResult_t moonepEpCombineBackward(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                                       const void* dy, void* dy_rows) {
  return GuardOn(CommOf(buffer), "moonepEpCombineBackward", [&]() -> absl::Status {
    moonep::runtime::EpLayout l;
    moonepEpHandle* slot = nullptr;
    int64_t T = 0;
    return Collective(
        buffer, OpKind::kCombineBackward,
        [&]() -> absl::Status {
          MOONEP_RETURN_IF_ERROR(Resolve(buffer, handle, &l, &slot));
          T = buffer->impl->TokensOf(slot->handle);
          MOONEP_RETURN_IF_ERROR(CheckPtr(dy, T, "dy"));
          return CheckPtr(dy_rows, l.num_rows, "dy_rows");
        },
        [&]() {
          const auto& c = buffer->impl->config();
          return buffer->impl->CombineBackward(slot->handle, Matrix(dy, c, T),
                                               Matrix(dy_rows, c, l.num_rows));
        });
  });
}

moonepResult_t moonepEpTopkWeightGrad(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                                      const void* dy_rows, const void* out_rows,
                                      float* d_topk_weights) {
  return GuardOn(CommOf(buffer), "moonepEpTopkWeightGrad", [&]() -> absl::Status {
    moonep::runtime::EpLayout l;
    moonepEpHandle* slot = nullptr;
    int64_t T = 0;
    return Collective(
        buffer, OpKind::kTopkWeightGrad,
        [&]() -> absl::Status {
          MOONEP_RETURN_IF_ERROR(Resolve(buffer, handle, &l, &slot));
          T = buffer->impl->TokensOf(slot->handle);
          MOONEP_RETURN_IF_ERROR(CheckPtr(dy_rows, l.num_rows, "dy_rows"));
          MOONEP_RETURN_IF_ERROR(CheckPtr(out_rows, l.num_rows, "out_rows"));
          return CheckPtr(d_topk_weights, T * buffer->impl->config().top_k, "d_topk_weights");
        },
        [&]() {
          const auto& c = buffer->impl->config();
          return buffer->impl->TopkWeightGrad(
              slot->handle, Matrix(dy_rows, c, l.num_rows), Matrix(out_rows, c, l.num_rows),
              absl::Span<float>(d_topk_weights, static_cast<size_t>(T * c.top_k)));
        });
  });
}

moonepResult_t moonepEpDispatchBackward(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                                        const void* dx_rows, void* dx) {
  return GuardOn(CommOf(buffer), "moonepEpDispatchBackward", [&]() -> absl::Status {
    moonep::runtime::EpLayout l;
    moonepEpHandle* slot = nullptr;
    int64_t T = 0;
    return Collective(
        buffer, OpKind::kDispatchBackward,
        [&]() -> absl::Status {
          MOONEP_RETURN_IF_ERROR(Resolve(buffer, handle, &l, &slot));
          T = buffer->impl->TokensOf(slot->handle);
          MOONEP_RETURN_IF_ERROR(CheckPtr(dx_rows, l.num_rows, "dx_rows"));
          return CheckPtr(dx, T, "dx");
        },
        [&]() {
          const auto& c = buffer->impl->config();
          return buffer->impl->DispatchBackward(slot->handle, Matrix(dx_rows, c, l.num_rows),
                                                Matrix(dx, c, T));
        });
  });
}

moonepResult_t moonepEpPrefetch(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                                const moonepExpertTensors_t* home_weights,
                                const moonepExpertTensors_t* replica_weights) {
  return GuardOn(CommOf(buffer), "moonepEpPrefetch", [&]() -> absl::Status {
    std::vector<moonep::compute::ExpertParams> home, slots;
    moonepEpHandle* slot = nullptr;
    return Collective(
        buffer, OpKind::kPrefetch,
        [&]() {
          return ReadExperts(buffer, handle, home_weights, "home_weights", replica_weights,
                             "replica_weights", buffer->impl->config().dtype, &home, &slots,
                             &slot);
        },
        [&]() { return buffer->impl->Prefetch(slot->handle, home, slots); });
  });
}

moonepResult_t moonepEpReduce(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                              const moonepExpertTensors_t* home_grads,
                              const moonepExpertTensors_t* replica_grads) {
  return GuardOn(CommOf(buffer), "moonepEpReduce", [&]() -> absl::Status {
    std::vector<moonep::compute::ExpertParams> home, slots;
    moonepEpHandle* slot = nullptr;
    return Collective(
        buffer, OpKind::kReduce,
        [&]() {
          return ReadExperts(buffer, handle, home_grads, "home_grads", replica_grads,
                             "replica_grads", buffer->impl->config().grad_dtype, &home, &slots,
                             &slot);
        },
        [&]() { return buffer->impl->Reduce(slot->handle, home, slots); });
  });
}

moonepResult_t moonepEpRelease(moonepEpBuffer_t buffer, moonepEpHandle_t handle) {
  return GuardOn(CommOf(buffer), "moonepEpRelease", [&]() -> absl::Status {
    moonep::runtime::EpLayout l;
    moonepEpHandle* slot = nullptr;
    MOONEP_RETURN_IF_ERROR(Resolve(buffer, handle, &l, &slot));
    slot->in_use = false;
    return buffer->impl->Release(slot->handle);
  });
}

moonepResult_t moonepEpGetStats(moonepEpBuffer_t buffer, moonepStepStats_t* stats) {
  return GuardOn(CommOf(buffer), "moonepEpGetStats", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(buffer, Kind::kEpBuffer, "buffer"));
    return moonep::capi::WriteStats(buffer->impl->stats(), stats);
  });
}

}  // extern "C"
