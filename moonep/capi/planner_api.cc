// The planner-only C API over moonep::planner::Planner.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

#include "moonep/capi/capi_common.h"
#include "planner/planner.h"

struct moonepPlanner {
  std::unique_ptr<moonep::planner::Planner> planner;
  moonep::planner::Plan plan;
  bool has_plan = false;
  bool plan_failed = false;  // the latest moonepPlannerPlan failed (it dropped the plan)
  std::string last_error;
};

// The first version of each struct ends where its MIN_SIZE says; fields are only ever appended.
static_assert(MOONEP_PLANNER_CONFIG_MIN_SIZE <= sizeof(moonepPlannerConfig_t), "config min size");
static_assert(MOONEP_PLAN_STATS_MIN_SIZE <= sizeof(moonepPlanStats_t), "stats min size");

namespace moonep::capi {
namespace {

// Live planners, by address: a destroyed, never-created or other-kind pointer is refused without
// being dereferenced. (The runtime handles' registry in runtime_objects.h has no planner kind and
// drags in the runtime headers, so the planner keeps its own, with the same contract.)
std::mutex& PlannerRegistryMutex() {
  static auto* mutex = new std::mutex();  // never destroyed: usable from static destructors
  return *mutex;
}
std::unordered_set<const moonepPlanner*>& PlannerRegistry() {
  static auto* registry = new std::unordered_set<const moonepPlanner*>();
  return *registry;
}

void RegisterPlanner(const moonepPlanner* p) {
  std::lock_guard<std::mutex> lock(PlannerRegistryMutex());
  PlannerRegistry().insert(p);
}

// True when `p` was live (and is not any more): exactly one of two racing destroys gets true.
bool UnregisterPlanner(const moonepPlanner* p) {
  std::lock_guard<std::mutex> lock(PlannerRegistryMutex());
  return PlannerRegistry().erase(p) == 1;
}

bool IsLivePlanner(const moonepPlanner* p) {
  std::lock_guard<std::mutex> lock(PlannerRegistryMutex());
  return PlannerRegistry().count(p) == 1;
}

constexpr const char kNotLive[] =
    "planner is not a live planner (destroyed already, never created, or another kind of handle)";

absl::Status CheckPlanner(const moonepPlanner* p) {
  if (p == nullptr) return InvalidArgument("planner is NULL");
  if (!IsLivePlanner(p)) return InvalidUsage("%s", kNotLive);
  return absl::OkStatus();
}

// Guard() after checking that `handle` is a live planner, plus the per-handle copy of the error
// message (written only to a live handle).
template <typename Body>
moonepResult_t GuardPlanner(moonepPlanner_t handle, const char* function, Body&& body) {
  bool live = false;
  const moonepResult_t result = Guard(function, [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(CheckPlanner(handle));
    live = true;
    return body();
  });
  if (live) {
    try {
      handle->last_error = result == moonepSuccess ? "" : moonepGetLastThreadError();
    } catch (const std::bad_alloc&) {  // no exception leaves the C API
      handle->last_error.clear();
    }
  }
  return result;
}

absl::Status NeedPlan(moonepPlanner_t p) {
  if (!p->has_plan && p->plan_failed) {
    return InvalidUsage("no plan: the last moonepPlannerPlan failed (it drops the plan before it "
                        "was made); call moonepPlannerPlan again with valid counts");
  }
  if (!p->has_plan) return InvalidUsage("no plan yet: call moonepPlannerPlan first");
  return absl::OkStatus();
}

// The caller's config, `config->size` bytes of it (fields past it keep the initializer's defaults;
// fields of a newer header past ours are not read).
absl::Status ReadPlannerConfig(const moonepPlannerConfig_t* config, moonepPlannerConfig_t* out) {
  if (config == nullptr) return InvalidArgument("config is NULL");
  const size_t size = config->size;
  if (size < MOONEP_PLANNER_CONFIG_MIN_SIZE) {
    return InvalidArgument(
        "moonepPlannerConfig_t: config->size is %d, below the minimum %d: initialize with "
        "MOONEP_PLANNER_CONFIG_INITIALIZER",
        size, MOONEP_PLANNER_CONFIG_MIN_SIZE);
  }
  moonepPlannerConfig_t c = MOONEP_PLANNER_CONFIG_INITIALIZER;
  std::memcpy(&c, config, std::min(size, sizeof(c)));
  if (c.version < MOONEP_VERSION_CODE(0, 1, 0) || c.version / 10000 != MOONEP_MAJOR) {
    return InvalidArgument(
        "moonepPlannerConfig_t: config->version is %d, not a MOONEP_VERSION of major version %d "
        "(this library is %d): initialize with MOONEP_PLANNER_CONFIG_INITIALIZER",
        c.version, MOONEP_MAJOR, MOONEP_VERSION);
  }
  *out = c;
  return absl::OkStatus();
}

}  // namespace
}  // namespace moonep::capi

using moonep::capi::GuardPlanner;
using moonep::capi::NeedPlan;
using moonep::planner::Plan;

extern "C" {

moonepResult_t moonepPlannerCreate(const moonepPlannerConfig_t* config_in, moonepPlanner_t* out) {
  return moonep::capi::Guard("moonepPlannerCreate", [&]() -> absl::Status {
    MOONEP_CHECK_ARG(out != nullptr, "planner (output) is NULL");
    *out = nullptr;
    moonepPlannerConfig_t read;
    MOONEP_RETURN_IF_ERROR(moonep::capi::ReadPlannerConfig(config_in, &read));
    const moonepPlannerConfig_t* config = &read;
    MOONEP_CHECK_ARG(config->num_ranks > 0, "config->num_ranks must be positive, got %d", config->num_ranks);
    MOONEP_CHECK_ARG(config->num_experts > 0, "config->num_experts must be positive, got %d",
                     config->num_experts);
    moonep::planner::PlannerConfig c;
    c.num_ranks = config->num_ranks;
    c.num_experts = config->num_experts;
    c.slots = config->slots;
    c.pad_multiple = config->pad_multiple;
    c.ranks_per_node = config->ranks_per_node;
    const int policy = moonep::capi::RawEnum(config->policy);
    MOONEP_CHECK_ARG(policy >= moonepPolicyNone && policy <= moonepPolicyTestForceReplicas,
                     "config->policy = %d is not a moonepPlannerPolicy_t", policy);
    c.policy = static_cast<moonep::planner::Policy>(policy);
    if (config->home != nullptr) c.home.assign(config->home, config->home + config->num_experts);
    if (config->speeds != nullptr) c.speeds.assign(config->speeds, config->speeds + config->num_ranks);
    c.row_bytes = config->row_bytes;
    c.expert_bytes = config->expert_bytes;
    c.eplb_period = config->eplb_period;
    c.replica_cost_intra = config->replica_cost_intra;
    c.replica_cost_inter = config->replica_cost_inter;
    c.row_cost_intra = config->row_cost_intra;
    c.row_cost_inter = config->row_cost_inter;
    MOONEP_ASSIGN_OR_RETURN(auto planner, moonep::planner::Planner::Create(c));
    auto handle = std::make_unique<moonepPlanner>();
    handle->planner = std::move(planner);
    moonep::capi::RegisterPlanner(handle.get());
    *out = handle.release();
    return absl::OkStatus();
  });
}

moonepResult_t moonepPlannerDestroy(moonepPlanner_t planner) {
  return moonep::capi::Guard("moonepPlannerDestroy", [&]() -> absl::Status {
    if (planner == nullptr) return absl::OkStatus();  // documented no-op, like free(NULL)
    if (!moonep::capi::UnregisterPlanner(planner)) {
      return moonep::InvalidUsage("%s", moonep::capi::kNotLive);
    }
    delete planner;
    return absl::OkStatus();
  });
}

moonepResult_t moonepPlannerPlan(moonepPlanner_t p, const int64_t* counts, size_t num_counts) {
  return GuardPlanner(p, "moonepPlannerPlan", [&]() -> absl::Status {
    p->has_plan = false;
    p->plan_failed = true;  // until this call succeeds
    MOONEP_CHECK_ARG(counts != nullptr, "counts is NULL");
    MOONEP_RETURN_IF_ERROR(p->planner->MakePlan(absl::MakeConstSpan(counts, num_counts), &p->plan));
    p->has_plan = true;
    p->plan_failed = false;
    return absl::OkStatus();
  });
}

moonepResult_t moonepPlannerGetShape(moonepPlanner_t p, int* num_ranks, int* num_experts, int* slots,
                                     int* num_groups) {
  return GuardPlanner(p, "moonepPlannerGetShape", [&]() -> absl::Status {
    const auto& c = p->planner->config();
    if (num_ranks) *num_ranks = c.num_ranks;
    if (num_experts) *num_experts = c.num_experts;
    if (slots) *slots = c.slots;
    if (num_groups) *num_groups = c.num_experts / c.num_ranks + c.slots;
    return absl::OkStatus();
  });
}

moonepResult_t moonepPlannerGetStats(moonepPlanner_t p, moonepPlanStats_t* stats) {
  return GuardPlanner(p, "moonepPlannerGetStats", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(NeedPlan(p));
    MOONEP_CHECK_ARG(stats != nullptr, "stats is NULL");
    MOONEP_CHECK_ARG(stats->size >= MOONEP_PLAN_STATS_MIN_SIZE,
                     "moonepPlanStats_t: stats->size is %d, below the minimum %d: set it to "
                     "sizeof(moonepPlanStats_t) (MOONEP_PLAN_STATS_INITIALIZER)",
                     stats->size, MOONEP_PLAN_STATS_MIN_SIZE);
    const auto& s = p->plan.stats;
    moonepPlanStats_t out;
    std::memset(&out, 0, sizeof(out));
    out.size = std::min(stats->size, sizeof(out));  // the bytes written, told back to the caller
    out.total_tokens = s.total_tokens;
    out.max_load_before = s.max_load_before;
    out.max_load_after = s.max_load_after;
    out.mean_load = s.mean_load;
    out.replicas = s.replicas;
    out.prefetch_intra = s.prefetch_intra;
    out.prefetch_inter = s.prefetch_inter;
    out.rows_local = s.rows_local;
    out.rows_travel_intra = s.rows_travel_intra;
    out.rows_travel_inter = s.rows_travel_inter;
    out.dispatch_bytes_intra = s.dispatch_bytes_intra;
    out.dispatch_bytes_inter = s.dispatch_bytes_inter;
    out.prefetch_bytes_intra = s.prefetch_bytes_intra;
    out.prefetch_bytes_inter = s.prefetch_bytes_inter;
    out.reduce_bytes_intra = s.reduce_bytes_intra;
    out.reduce_bytes_inter = s.reduce_bytes_inter;
    std::memcpy(stats, &out, out.size);  // an older caller gets the fields it knows, no more
    return absl::OkStatus();
  });
}

moonepResult_t moonepPlannerGetAlloc(moonepPlanner_t p, int64_t* alloc, size_t capacity) {
  return GuardPlanner(p, "moonepPlannerGetAlloc", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(NeedPlan(p));
    MOONEP_CHECK_ARG(alloc != nullptr, "alloc is NULL");
    MOONEP_CHECK_ARG(capacity >= p->plan.alloc.size(), "alloc capacity %d < R*E = %d", capacity,
                     p->plan.alloc.size());
    std::copy(p->plan.alloc.begin(), p->plan.alloc.end(), alloc);
    return absl::OkStatus();
  });
}

moonepResult_t moonepPlannerGetSlots(moonepPlanner_t p, int32_t* slot_expert, int64_t* slot_tokens,
                                     size_t capacity) {
  return GuardPlanner(p, "moonepPlannerGetSlots", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(NeedPlan(p));
    MOONEP_CHECK_ARG(capacity >= p->plan.slot_expert.size(), "slot capacity %d < R*slots = %d", capacity,
                     p->plan.slot_expert.size());
    if (slot_expert) std::copy(p->plan.slot_expert.begin(), p->plan.slot_expert.end(), slot_expert);
    if (slot_tokens) std::copy(p->plan.slot_alloc.begin(), p->plan.slot_alloc.end(), slot_tokens);
    return absl::OkStatus();
  });
}

moonepResult_t moonepPlannerGetLayout(moonepPlanner_t p, int rank, int64_t* offset, int64_t* count,
                                      int64_t* padded, size_t capacity, int64_t* rank_rows) {
  return GuardPlanner(p, "moonepPlannerGetLayout", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(NeedPlan(p));
    const Plan& plan = p->plan;
    MOONEP_CHECK_ARG(rank >= 0 && rank < plan.num_ranks, "rank %d not in [0, %d)", rank, plan.num_ranks);
    const size_t G = plan.num_groups(), b = static_cast<size_t>(rank) * G;
    MOONEP_CHECK_ARG(capacity >= G || (!offset && !count && !padded), "layout capacity %d < groups %d",
                     capacity, G);
    if (offset) std::copy(plan.group_offset.begin() + b, plan.group_offset.begin() + b + G, offset);
    if (count) std::copy(plan.group_count.begin() + b, plan.group_count.begin() + b + G, count);
    if (padded) std::copy(plan.group_padded.begin() + b, plan.group_padded.begin() + b + G, padded);
    if (rank_rows) *rank_rows = plan.rank_rows[rank];
    return absl::OkStatus();
  });
}

moonepResult_t moonepPlannerGetPieces(moonepPlanner_t p, int expert, int* num_pieces, int* dest,
                                      int64_t* start, int64_t* count, int64_t* row, size_t capacity) {
  return GuardPlanner(p, "moonepPlannerGetPieces", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(NeedPlan(p));
    const Plan& plan = p->plan;
    MOONEP_CHECK_ARG(expert >= 0 && expert < plan.num_experts, "expert %d not in [0, %d)", expert,
                     plan.num_experts);
    MOONEP_CHECK_ARG(num_pieces != nullptr, "num_pieces is NULL");
    const int32_t b = plan.piece_begin[expert], n = plan.piece_begin[expert + 1] - b;
    *num_pieces = n;
    if (!dest && !start && !count && !row) return absl::OkStatus();
    MOONEP_CHECK_ARG(capacity >= static_cast<size_t>(n), "pieces capacity %d < %d pieces of expert %d",
                     capacity, n, expert);
    for (int32_t i = 0; i < n; ++i) {
      if (dest) dest[i] = plan.piece_dest[b + i];
      if (start) start[i] = plan.piece_start[b + i];
      if (count) count[i] = plan.piece_count[b + i];
      if (row) row[i] = plan.piece_row[b + i];
    }
    return absl::OkStatus();
  });
}

moonepResult_t moonepPlannerSerialize(moonepPlanner_t p, void* buffer, size_t capacity, size_t* size) {
  return GuardPlanner(p, "moonepPlannerSerialize", [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(NeedPlan(p));
    MOONEP_CHECK_ARG(size != nullptr, "size is NULL");
    const std::string bytes = moonep::planner::SerializePlan(p->plan);
    *size = bytes.size();
    if (buffer == nullptr) return absl::OkStatus();
    MOONEP_CHECK_ARG(capacity >= bytes.size(), "buffer capacity %d < plan size %d", capacity, bytes.size());
    std::memcpy(buffer, bytes.data(), bytes.size());
    return absl::OkStatus();
  });
}

const char* moonepPlannerGetLastError(moonepPlanner_t p) {
  if (p == nullptr) return "planner is NULL";
  if (!moonep::capi::IsLivePlanner(p)) return moonep::capi::kNotLive;
  return p->last_error.c_str();
}

}  // extern "C"
