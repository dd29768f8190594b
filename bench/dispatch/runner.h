// One configuration of moonep-bench-dispatch: set up the workload, time every operation over the
// iterations (warm-up first), check every result, and gather the figures on every rank.
//
// Timing: before each timed operation all ranks meet at a barrier; each rank times the operation
// from there to its own completion. An iteration's figure is the maximum over ranks (the slowest
// rank, which is what a trainer waits for); median and p99 are taken over the iterations. The
// operations of the measured policy, of policy `none` and of the MPI_Alltoallv baseline run
// interleaved in every iteration, so a change of machine load hits them alike.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/dispatch/workload.h"
#include "moonep/core/dtype.h"
#include "moonep/runtime/communicator.h"
#include "planner/plan.h"

namespace moonep::bench {

struct BenchConfig {
  int32_t num_experts = 0, top_k = 0;
  int64_t hidden = 0, intermediate = 0, tokens = 0;
  DType dtype = DType::kFloat32;
  SkewSpec skew;
  planner::Policy policy = planner::Policy::kMoonEP;
  std::string backend = "mpi";
  int32_t slots = -1, pad_multiple = 1;
  int32_t warmup = 0, iters = 0;
  uint64_t seed = 1;
  bool baselines = true;  // policy none and MPI_Alltoallv (host backends) in the same run
  bool layer = true;      // whole layer forward / backward (MoeLayer; host backends only)
  int32_t check_tokens = 2;  // tokens per rank checked against the fp64 reference (layer)
  // Iterations (warm-up ones first) whose transport and all-to-all results are checked in full;
  // -1: all. The layer's sampled tokens are checked every iteration. The checks run outside the
  // timed regions; on large shapes they take seconds per iteration on the host.
  int32_t check_iters = -1;
  int32_t threads = 1;       // executor threads per rank (layer)
  // Self-test of the checks: every rank flips bytes of this operation's result after it completes
  // and before it is checked (e.g. "combine"), so the run must report #wrong > 0.
  std::string corrupt_op;
};

struct OpResult {
  std::string op;    // counts, plan, dispatch, combine, combine-bwd, topk-grad, dispatch-bwd,
                     // prefetch, reduce, layer-fwd, layer-bwd
  std::string impl;  // the policy's name, or "a2av"
  int64_t size_bytes = 0;  // see docs/benchmarks-dispatch.md for each op's size and bandwidths
  int64_t count = 0;
  std::string type;
  bool has_bandwidth = false;
  double bus_factor = 1.0;      // busbw = algbw * bus_factor (when bus_bytes is 0)
  int64_t bus_bytes = 0;        // prefetch / reduce: the busiest rank's bytes in or out
  std::vector<double> iter_us;  // per iteration, max over ranks
  double median_us = 0, p99_us = 0, mean_us = 0, min_us = 0, max_us = 0;
  double algbw_gbps = 0, busbw_gbps = 0;
  int64_t wrong = 0, checked = 0;  // summed over ranks and iterations
  int64_t sent_bytes_max = 0;      // per call, max over ranks (transport counters)
  int64_t dedup_rows_max = 0;      // per call, max over ranks

  void Finish();  // statistics from iter_us
};

struct ConfigResult {
  BenchConfig config;
  int32_t num_ranks = 0;
  double zipf_s = 0, maxvio = 0;
  planner::PlanStats plan_stats, none_stats;
  int64_t recv_capacity_rows = 0;
  int32_t slots = 0;  // replica slots per rank, resolved
  std::string note;   // printed under the configuration's header (e.g. what a backend skips)
  int64_t corrupted = 0;  // results --corrupt flipped on this rank (0 when its operation never ran)
  std::vector<OpResult> ops;
  const OpResult* Find(const std::string& op, const std::string& impl) const;
};

// Collective over comm (and rt_comm, built over the same ranks). Errors are those of setup or of
// an operation; a wrong result is not an error, it is counted in OpResult::wrong.
absl::Status RunConfig(const BenchConfig& config, MPI_Comm comm, runtime::Communicator* rt_comm,
                       ConfigResult* result);

}  // namespace moonep::bench
