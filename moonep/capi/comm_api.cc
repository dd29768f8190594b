// C API: communicators, the live-handle registry, per-communicator last errors, and the
// conversions shared by the layer and EP buffer APIs.
#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "moonep/capi/runtime_objects.h"
#include "planner/plan.h"

namespace moonep::capi {
namespace {

std::mutex& RegistryMutex() {
  static std::mutex mutex;
  return mutex;
}
std::unordered_map<const void*, Kind>& Registry() {
  static auto* registry = new std::unordered_map<const void*, Kind>();
  return *registry;
}

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kComm: return "communicator";
    case Kind::kLayer: return "layer";
    case Kind::kEpBuffer: return "EP buffer";
  }
  return "object";
}

}  // namespace

void Register(const void* object, Kind kind) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[object] = kind;
}

void Unregister(const void* object) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry().erase(object);
}

uintptr_t NextHandleValue() {
  static std::atomic<uintptr_t> next{0};
  return (next.fetch_add(1, std::memory_order_relaxed) << 1) | 1;
}

bool IsLive(const void* object, Kind kind) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(object);
  return it != Registry().end() && it->second == kind;
}

absl::Status CheckHandle(const void* object, Kind kind, const char* name) {
  if (object == nullptr) return InvalidArgument("%s is NULL", name);
  if (!IsLive(object, kind)) {
    return InvalidUsage("%s is not a live %s (destroyed already, or never created)", name,
                        KindName(kind));
  }
  return absl::OkStatus();
}

absl::Status ReadDType(const moonepDataType_t& dtype, const char* name, DType* out) {
  const int value = RawEnum(dtype);
  if (!IsValidDType(value)) {
    return InvalidArgument("%s = %d is not a moonepDataType_t", name, value);
  }
  *out = static_cast<DType>(value);
  return absl::OkStatus();
}

absl::Status ReadLayerConfig(const moonepLayerConfig_t* c, int32_t num_ranks,
                             runtime::LayerConfig* out) {
  if (c == nullptr) return InvalidArgument("config is NULL");
  if (c->magic != MOONEP_CONFIG_MAGIC) {
    return InvalidArgument("config was not initialised with MOONEP_LAYER_CONFIG_INITIALIZER "
                           "(bad magic 0x%x)", c->magic);
  }
  if (c->size < offsetof(moonepLayerConfig_t, num_experts)) {
    return InvalidArgument("config->size = %d is too small", c->size);
  }
  // The header the caller compiled against: any 0.x from 0.1.0 (fields are only appended).
  if (c->version < MOONEP_VERSION_CODE(0, 1, 0) || c->version / 10000 != MOONEP_MAJOR) {
    return InvalidArgument("config->version is %d, not a MOONEP_VERSION of major version %d (this "
                           "library is %d): initialise with MOONEP_LAYER_CONFIG_INITIALIZER",
                           c->version, MOONEP_MAJOR, MOONEP_VERSION);
  }
  // Fields past the caller's `size` (an older header) keep the defaults of `out`.
#define MOONEP_HAS_FIELD(f) (offsetof(moonepLayerConfig_t, f) + sizeof(c->f) <= c->size)
  runtime::LayerConfig d;
  if (MOONEP_HAS_FIELD(num_experts)) d.num_experts = c->num_experts;
  if (MOONEP_HAS_FIELD(top_k)) d.top_k = c->top_k;
  if (MOONEP_HAS_FIELD(hidden)) d.hidden = c->hidden;
  if (MOONEP_HAS_FIELD(intermediate)) d.intermediate = c->intermediate;
  if (MOONEP_HAS_FIELD(dtype)) MOONEP_RETURN_IF_ERROR(ReadDType(c->dtype, "config->dtype", &d.dtype));
  if (MOONEP_HAS_FIELD(grad_dtype)) {
    MOONEP_RETURN_IF_ERROR(ReadDType(c->grad_dtype, "config->grad_dtype", &d.grad_dtype));
  }
  if (MOONEP_HAS_FIELD(slots)) d.slots = c->slots;
  if (MOONEP_HAS_FIELD(pad_multiple)) d.pad_multiple = c->pad_multiple;
  if (MOONEP_HAS_FIELD(policy)) {
    const int policy = RawEnum(c->policy);
    if (policy < moonepPolicyNone || policy > moonepPolicyTestForceReplicas) {
      return InvalidArgument("config->policy = %d is not a moonepPlannerPolicy_t", policy);
    }
    d.policy = static_cast<planner::Policy>(policy);
  }
  if (MOONEP_HAS_FIELD(device)) {
    const int device = RawEnum(c->device);
    if (device != moonepDeviceCpu && device != moonepDeviceCuda) {
      return InvalidArgument("config->device = %d is not a moonepDevice_t", device);
    }
    d.device = static_cast<Device>(device);
  }
  if (MOONEP_HAS_FIELD(device_index)) d.device_index = c->device_index;
  if (MOONEP_HAS_FIELD(max_tokens)) d.max_tokens = c->max_tokens;
  if (MOONEP_HAS_FIELD(max_recv_rows)) d.max_recv_rows = c->max_recv_rows;
  if (MOONEP_HAS_FIELD(max_inflight)) d.max_inflight = c->max_inflight;
  if (MOONEP_HAS_FIELD(layer_id)) d.layer_id = c->layer_id;
  if (MOONEP_HAS_FIELD(num_threads)) d.num_threads = c->num_threads;
  if (MOONEP_HAS_FIELD(ranks_per_node)) d.ranks_per_node = c->ranks_per_node;
  if (MOONEP_HAS_FIELD(eplb_period)) d.eplb_period = c->eplb_period;
  if (MOONEP_HAS_FIELD(replica_cost_intra)) d.replica_cost_intra = c->replica_cost_intra;
  if (MOONEP_HAS_FIELD(replica_cost_inter)) d.replica_cost_inter = c->replica_cost_inter;
  if (MOONEP_HAS_FIELD(row_cost_intra)) d.row_cost_intra = c->row_cost_intra;
  if (MOONEP_HAS_FIELD(row_cost_inter)) d.row_cost_inter = c->row_cost_inter;
  if (MOONEP_HAS_FIELD(speeds) && c->speeds != nullptr) {
    // One per rank of the communicator (CheckLayerConfig checks the values).
    d.speeds.assign(c->speeds, c->speeds + num_ranks);
  }
  if (MOONEP_HAS_FIELD(transport) && c->transport != nullptr) {
    // Read at most 16 bytes: no backend name is longer than 15, and a string without its NUL
    // must not be read past.
    d.transport.assign(c->transport, strnlen(c->transport, 16));
    if (d.transport.size() > 15) {
      return InvalidArgument("config->transport '%s...' is not a transport backend",
                             absl::CHexEscape(d.transport));
    }
  }
#undef MOONEP_HAS_FIELD
  *out = d;
  return absl::OkStatus();
}

absl::Status ReadExpertTensors(const moonepExpertTensors_t* t, const char* name, int64_t experts,
                               int64_t hidden, int64_t intermediate, DType expected, Device device,
                               std::vector<compute::ExpertParams>* out) {
  if (t == nullptr) return InvalidArgument("%s is NULL", name);
  DType dtype;
  MOONEP_RETURN_IF_ERROR(ReadDType(t->dtype, absl::StrCat(name, "->dtype").c_str(), &dtype));
  if (dtype != expected) {
    return InvalidArgument("%s->dtype is %s; expected %s", name, DTypeName(dtype),
                           DTypeName(expected));
  }
  if (experts > 0 && (t->gate == nullptr || t->up == nullptr || t->down == nullptr)) {
    return InvalidArgument("%s: gate, up and down must all be non-NULL", name);
  }
  const size_t block = static_cast<size_t>(hidden * intermediate) * DTypeSize(dtype);
  out->clear();
  for (int64_t e = 0; e < experts; ++e) {
    compute::ExpertParams p;
    p.gate = TensorView::Contiguous(static_cast<char*>(t->gate) + e * block, dtype,
                                    {hidden, intermediate}, device);
    p.up = TensorView::Contiguous(static_cast<char*>(t->up) + e * block, dtype,
                                  {hidden, intermediate}, device);
    p.down = TensorView::Contiguous(static_cast<char*>(t->down) + e * block, dtype,
                                    {intermediate, hidden}, device);
    out->push_back(p);
  }
  return absl::OkStatus();
}

absl::Status WriteStats(const runtime::StepStats& in, moonepStepStats_t* out) {
  if (out == nullptr) return InvalidArgument("stats is NULL");
  if (out->size < offsetof(moonepStepStats_t, step)) {
    return InvalidArgument("stats->size = %d is too small (use MOONEP_STEP_STATS_INITIALIZER)",
                           out->size);
  }
  moonepStepStats_t s;
  std::memset(&s, 0, sizeof(s));
  s.size = out->size < sizeof(s) ? out->size : sizeof(s);
  s.magic = MOONEP_CONFIG_MAGIC;
  s.version = MOONEP_VERSION;
  s.step = in.step;
  s.tokens = in.tokens;
  s.total_tokens = in.plan.total_tokens;
  s.max_load_before = in.plan.max_load_before;
  s.max_load_after = in.plan.max_load_after;
  s.mean_load = in.plan.mean_load;
  s.replicas = in.plan.replicas;
  s.rows_computed = in.rows_computed;
  for (int op = 0; op < moonepNumOps; ++op) {
    s.rows_sent[op] = in.ops[op].rows_sent;
    s.bytes_sent[op] = in.ops[op].bytes_sent;
    s.bytes_received[op] = in.ops[op].bytes_received;
  }
  for (int p = 0; p < moonepNumPhases; ++p) s.time_ms[p] = in.seconds[p] * 1e3;
  s.forward_ms = in.forward_seconds * 1e3;
  s.backward_ms = in.backward_seconds * 1e3;
  std::memcpy(out, &s, s.size);  // an older caller gets the fields it knows
  return absl::OkStatus();
}

namespace {

moonepResult_t Adopt(absl::StatusOr<std::unique_ptr<runtime::Communicator>> made,
                     moonepComm_t* comm) {
  if (!made.ok()) return Report(made.status());
  // No exception may leave the C API: an allocation failure here (the handle, the registry's
  // entry) is moonepOutOfMemory, and the communicator made is destroyed again.
  std::unique_ptr<moonepComm> object;
  try {
    object = std::make_unique<moonepComm>();
    object->impl = std::move(*made);
    Register(object.get(), Kind::kComm);
  } catch (const std::bad_alloc&) {
    return Report(OutOfMemory("communicator creation: out of host memory for its handle"));
  }
  *comm = object.release();
  return moonepSuccess;
}

}  // namespace
}  // namespace moonep::capi

using moonep::capi::CheckHandle;
using moonep::capi::Guard;
using moonep::capi::Kind;

static_assert(sizeof(moonepUniqueId) == moonep::runtime::kUniqueIdBytes, "unique id size");
static_assert(static_cast<int>(moonepNumPhases) ==
                  static_cast<int>(moonep::runtime::Phase::kNumPhases), "phase enums");
static_assert(static_cast<int>(moonepNumOps) ==
                  static_cast<int>(moonep::transport::OpKind::kNumKinds), "op enums");

extern "C" {

moonepResult_t moonepGetUniqueId(moonepUniqueId* unique_id) {
  return Guard("moonepGetUniqueId", [&]() -> absl::Status {
    MOONEP_CHECK_ARG(unique_id != nullptr, "unique_id is NULL");
    const moonep::runtime::UniqueId id = moonep::runtime::Communicator::NewUniqueId();
    std::memcpy(unique_id->internal, id.bytes, sizeof(id.bytes));
    return absl::OkStatus();
  });
}

moonepResult_t moonepCommInitRank(moonepComm_t* comm, int nranks, moonepUniqueId unique_id,
                                  int rank) {
  std::unique_ptr<moonep::runtime::Communicator> made;
  moonepResult_t r = Guard("moonepCommInitRank", [&]() -> absl::Status {
    MOONEP_CHECK_ARG(comm != nullptr, "comm is NULL");
    *comm = nullptr;  // on failure too, as moonepPlannerCreate does
    moonep::runtime::UniqueId id;
    std::memcpy(id.bytes, unique_id.internal, sizeof(id.bytes));
    MOONEP_ASSIGN_OR_RETURN(made, moonep::runtime::Communicator::FromUniqueId(id, nranks, rank));
    return absl::OkStatus();
  });
  if (r != moonepSuccess) return r;
  return moonep::capi::Adopt(std::move(made), comm);
}

moonepResult_t moonepCommInitMpi(moonepComm_t* comm, const void* mpi_comm) {
  std::unique_ptr<moonep::runtime::Communicator> made;
  moonepResult_t r = Guard("moonepCommInitMpi", [&]() -> absl::Status {
    MOONEP_CHECK_ARG(comm != nullptr, "comm is NULL");
    *comm = nullptr;  // on failure too, as moonepPlannerCreate does
    MOONEP_CHECK_ARG(mpi_comm != nullptr, "mpi_comm is NULL (pass the address of an MPI_Comm)");
    MOONEP_ASSIGN_OR_RETURN(made, moonep::runtime::Communicator::FromMpi(
                                      *static_cast<const MPI_Comm*>(mpi_comm)));
    return absl::OkStatus();
  });
  if (r != moonepSuccess) return r;
  return moonep::capi::Adopt(std::move(made), comm);
}

moonepResult_t moonepCommInitFromEnv(moonepComm_t* comm) {
  std::unique_ptr<moonep::runtime::Communicator> made;
  moonepResult_t r = Guard("moonepCommInitFromEnv", [&]() -> absl::Status {
    MOONEP_CHECK_ARG(comm != nullptr, "comm is NULL");
    *comm = nullptr;  // on failure too, as moonepPlannerCreate does
    MOONEP_ASSIGN_OR_RETURN(made, moonep::runtime::Communicator::FromEnvironment());
    return absl::OkStatus();
  });
  if (r != moonepSuccess) return r;
  return moonep::capi::Adopt(std::move(made), comm);
}

moonepResult_t moonepCommDestroy(moonepComm_t comm) {
  // GuardOn: a refusal (live children) is also the communicator's last error; after a successful
  // destroy the communicator is no longer live and nothing is recorded on it.
  return moonep::capi::GuardOn(comm, "moonepCommDestroy", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(comm, Kind::kComm, "comm"));
    if (comm->children > 0) {
      return moonep::InvalidUsage("comm still has %d layers / EP buffers; destroy them first",
                                  comm->children);
    }
    moonep::capi::Unregister(comm);
    delete comm;
    return absl::OkStatus();
  });
}

moonepResult_t moonepCommRank(moonepComm_t comm, int* rank) {
  return moonep::capi::GuardOn(comm, "moonepCommRank", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(comm, Kind::kComm, "comm"));
    MOONEP_CHECK_ARG(rank != nullptr, "rank is NULL");
    *rank = comm->impl->rank();
    return absl::OkStatus();
  });
}

moonepResult_t moonepCommSize(moonepComm_t comm, int* size) {
  return moonep::capi::GuardOn(comm, "moonepCommSize", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(comm, Kind::kComm, "comm"));
    MOONEP_CHECK_ARG(size != nullptr, "size is NULL");
    *size = comm->impl->size();
    return absl::OkStatus();
  });
}

const char* moonepGetLastError(moonepComm_t comm) {
  if (comm == nullptr) return "moonepGetLastError: comm is NULL";
  if (!moonep::capi::IsLive(comm, Kind::kComm)) {
    return "moonepGetLastError: comm is not a live communicator";
  }
  return comm->last_error.c_str();
}

moonepResult_t moonepCommSetTrace(moonepComm_t comm, const char* path) {
  return moonep::capi::GuardOn(comm, "moonepCommSetTrace", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(comm, Kind::kComm, "comm"));
    return comm->impl->SetTracePath(path == nullptr ? "" : path);
  });
}

moonepResult_t moonepCommSetNcclComm(moonepComm_t comm, void* nccl_comm) {
  return moonep::capi::GuardOn(comm, "moonepCommSetNcclComm", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckHandle(comm, Kind::kComm, "comm"));
    return comm->impl->SetNcclComm(nccl_comm);
  });
}

}  // extern "C"
