// The objects behind the C API's runtime handles, a registry of live handles (so that a destroyed
// or foreign pointer is refused, never dereferenced), per-communicator last errors, and the
// conversions from C config structs and tensors. Shared by comm_api.cc, layer_api.cc and
// ep_buffer_api.cc.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
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

struct moonepLayerHandle {
  moonepLayer* owner = nullptr;
  bool in_use = false;
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
  moonep::runtime::LayerHandle handle;
};

struct moonepEpBuffer {
  moonepComm* comm = nullptr;
  std::unique_ptr<moonep::runtime::EpBuffer> impl;
  std::vector<std::unique_ptr<moonepEpHandle>> handles;
};

namespace moonep::capi {

// Registry of live objects, by address and kind.
enum class Kind { kComm, kLayer, kLayerHandle, kEpBuffer, kEpHandle };
void Register(const void* object, Kind kind);
void Unregister(const void* object);
bool IsLive(const void* object, Kind kind);

// Registers `handles` (kind `handle_kind`) and then `object`; if one cannot be (out of memory),
// unregisters the ones that were and rethrows.
template <typename Handles>
void RegisterAll(const void* object, Kind kind, const Handles& handles, Kind handle_kind) {
  try {
    for (const auto& h : handles) Register(h.get(), handle_kind);
    Register(object, kind);
  } catch (...) {
    for (const auto& h : handles) Unregister(h.get());
    Unregister(object);
    throw;
  }
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

// A C layer/EP config into the C++ one (fields past config->size take their defaults).
absl::Status ReadLayerConfig(const moonepLayerConfig_t* config, runtime::LayerConfig* out);

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
