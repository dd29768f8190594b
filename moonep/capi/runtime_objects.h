// The objects behind the C API's runtime handles, a registry of live handles (so that a destroyed
// or foreign pointer is refused, never dereferenced), per-communicator last errors, and the
// conversions from C config structs and tensors. Shared by comm_api.cc, layer_api.cc and
// ep_buffer_api.cc.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moonep/capi/capi_common.h"
#include "moonep/compute/compute_view.h"
#include "moonep/moonep_runtime.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/ep_buffer.h"
#include "moonep/runtime/moe_layer.h"

struct moonepComm {
  std::unique_ptr<moonep::runtime::Communicator> impl;
  std::string last_error;
  int children = 0;  // layers and EP buffers alive on it
};

// A forward's or dispatch's handle, as the caller sees it, is an opaque value new for every call
// (moonep::capi::NextHandleValue, never an address), kept by the slot of the layer or EP buffer
// that holds the call's state (max_inflight slots, made at creation): a released handle stays
// refused after a later call took its slot, where a slot's address would have come back.
struct moonepLayerHandle {
  moonepLayer* owner = nullptr;
  bool in_use = false;
  uintptr_t value = 0;  // the handle given to the caller (0: none yet)
  moonep::runtime::LayerHandle handle;
};

struct moonepLayer {
  moonepComm* comm = nullptr;
  std::unique_ptr<moonep::runtime::MoeLayer> impl;
  std::vector<std::unique_ptr<moonepLayerHandle>> handles;  // max_inflight, made at creation
};

struct moonepEpHandle {
  moonepEpBuffer* owner = nullptr;
  bool in_use = false;
  uintptr_t value = 0;  // the handle given to the caller (0: none yet)
  moonep::runtime::LayerHandle handle;
};

struct moonepEpBuffer {
  moonepComm* comm = nullptr;
  std::unique_ptr<moonep::runtime::EpBuffer> impl;
  std::vector<std::unique_ptr<moonepEpHandle>> handles;
};

namespace moonep::capi {

// Registry of live objects, by address and kind.
enum class Kind { kComm, kLayer, kEpBuffer };
void Register(const void* object, Kind kind);
void Unregister(const void* object);
bool IsLive(const void* object, Kind kind);

// The next handle value (process-wide, odd, never 0 and never reused).
uintptr_t NextHandleValue();
// The slot among `slots` whose current handle is `handle`, or nullptr.
template <typename Slots>
auto FindSlot(const Slots& slots, const void* handle) -> decltype(slots.front().get()) {
  const uintptr_t value = reinterpret_cast<uintptr_t>(handle);
  for (const auto& s : slots) {
    if (value != 0 && s->value == value) return s.get();
  }
  return nullptr;
}
// `handle` is a handle that `owner_name`'s forward / dispatch returned and no release spent:
// InvalidArgument when NULL, InvalidUsage when not one of its slots' current handles (released
// and its slot taken by a later call, of another object, or made up) or released.
template <typename Slots>
absl::StatusOr<decltype(std::declval<Slots>().front().get())> LiveSlot(const Slots& slots,
                                                                      const void* handle,
                                                                      const char* owner_name) {
  if (handle == nullptr) return InvalidArgument("handle is NULL");
  auto* slot = FindSlot(slots, handle);
  if (slot == nullptr) {
    return InvalidUsage("handle is not a live handle of this %s (released, and its slot taken by "
                        "a later call; of another %s; or never returned by it)",
                        owner_name, owner_name);
  }
  if (!slot->in_use) return InvalidUsage("handle was already released");
  return slot;
}

// Checks a handle argument: null -> InvalidArgument, not live -> InvalidUsage.
absl::Status CheckHandle(const void* object, Kind kind, const char* name);

// Guard plus the communicator's last error.
template <typename Body>
moonepResult_t GuardOn(moonepComm* comm, const char* function, Body&& body) {
  const moonepResult_t result = Guard(function, std::forward<Body>(body));
  if (result != moonepSuccess && comm != nullptr && IsLive(comm, Kind::kComm)) {
    try {
      comm->last_error = moonepGetLastThreadError();
    } catch (const std::bad_alloc&) {
      comm->last_error.clear();  // the thread's message still says why
    }
  }
  return result;
}

// A C layer/EP config into the C++ one (fields past config->size take their defaults) for a
// communicator of num_ranks ranks (config->speeds, when set, holds that many).
absl::Status ReadLayerConfig(const moonepLayerConfig_t* config, int32_t num_ranks,
                             runtime::LayerConfig* out);

// E experts of `tensors` (gate [E][H][I], up [E][H][I], down [E][I][H]) as ExpertParams.
// Views carry `device` (the memory is not inspected; the backend checks it).
absl::Status ReadExpertTensors(const moonepExpertTensors_t* tensors, const char* name,
                               int64_t experts, int64_t hidden, int64_t intermediate,
                               DType expected, Device device,
                               std::vector<compute::ExpertParams>* out);

absl::Status ReadDType(const moonepDataType_t& dtype, const char* name, DType* out);

// Fills a C stats struct (up to stats->size) from the C++ one.
absl::Status WriteStats(const runtime::StepStats& in, moonepStepStats_t* out);

}  // namespace moonep::capi
