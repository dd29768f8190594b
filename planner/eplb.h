// DeepSeek EPLB's static placement (github.com/deepseek-ai/EPLB, eplb.py), in integer arithmetic.
// Used by the `eplb` baseline policy and tested against the EPLB README example.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace moonep::planner {

// rebalance_experts for one layer: weight[E] (a load per logical expert), num_replicas physical
// experts over num_gpus GPUs (num_replicas / num_gpus each). Uses the hierarchical policy when
// num_groups % num_nodes == 0 (pack expert groups onto nodes, replicate inside nodes, pack
// replicas onto GPUs), else the global one. Outputs phy2log[num_replicas] (GPU g holds physical
// experts [g * per_gpu, (g + 1) * per_gpu)) and logcnt[E] (replicas per logical expert).
// Ties: sorts are stable and argmax/argmin take the lowest index.
absl::Status EplbRebalance(absl::Span<const int64_t> weight, int32_t num_replicas,
                           int32_t num_groups, int32_t num_nodes, int32_t num_gpus,
                           std::vector<int32_t>* phy2log, std::vector<int32_t>* logcnt);

}  // namespace moonep::planner
