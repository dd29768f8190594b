#include "planner/plan.h"

namespace moonep::planner {

const char* PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kNone: return "none";
    case Policy::kMoonEP: return "moonep";
    case Policy::kMoonEPGreedy: return "moonep-greedy";
    case Policy::kEplb: return "eplb";
    case Policy::kFasterMoEShadow: return "fastermoe-shadow";
    case Policy::kTestForceReplicas: return "test-force-replicas";
  }
  return "invalid";
}

bool ParsePolicy(const std::string& name, Policy* policy) {
  for (Policy p : {Policy::kNone, Policy::kMoonEP, Policy::kMoonEPGreedy, Policy::kEplb,
                   Policy::kFasterMoEShadow, Policy::kTestForceReplicas}) {
    if (name == PolicyName(p)) {
      *policy = p;
      return true;
    }
  }
  return false;
}

int32_t Plan::GroupOf(int32_t rank, int32_t expert) const {
  if (rank < 0 || rank >= num_ranks || expert < 0 || expert >= num_experts) return -1;
  if (home[expert] == rank) return home_group[expert];
  const int32_t* slot = slot_expert.data() + static_cast<size_t>(rank) * slots;
  for (int32_t s = 0; s < slots; ++s) {
    if (slot[s] == expert) return experts_per_rank + s;
  }
  return -1;
}

int32_t Plan::ExpertOfGroup(int32_t rank, int32_t group) const {
  if (rank < 0 || rank >= num_ranks || group < 0 || group >= num_groups()) return -1;
  if (group < experts_per_rank) return local_experts[static_cast<size_t>(rank) * experts_per_rank + group];
  return slot_expert[static_cast<size_t>(rank) * slots + (group - experts_per_rank)];
}

}  // namespace moonep::planner
