// The cost probe: measures, on the ranks and links a layer will run on, what the moonep planner's
// weighing needs (PlannerConfig::replica_cost_* and row_cost_*, docs/planner.md "Weighing
// replicas" and "Rows in the objective"), so that a caller need not work the formulas out from
// data sheets. Collective over the communicator (docs/runtime.md "Measured costs"):
//
//   compute  every rank times its executor (the layer's device and dtype) on one expert of the
//            layer's shape: `compute_rows` rows forward, and backward too when `training`; a
//            token's time is the median of `repetitions` runs over the rows.
//   links    every rank sends rows of H values of the layer's dtype to one partner and takes
//            them back (a dispatch and a combine of an EP buffer on the layer's transport backend
//            and device, with the layer's timeout), all ranks at once: inside its node (the next
//            rank of its node) and across nodes (the rank of the same place in the next node;
//            ProbePartners); with a flat topology every link is one class, taken as inter-node.
//            Twice a class: `link_rows` rows, for a row's time, the median over repetitions of
//            (dispatch + combine) / 2 / rows; and `transfer_rows` rows (by default the bytes of
//            one expert's transfer, below), for a transfer's time, that per-row time scaled to
//            transfer_bytes.
//
// Every figure is then the median over the ranks that measured it (the same on every rank; an
// even count takes the mean of the two middle values), and the planner's costs follow:
//
//   replica_cost_c = transfer_seconds_c / token_seconds
//   row_cost_c     = 1024 * crossings * row_seconds_c / token_seconds
//
// with transfer_bytes = 3 * H * I * (grad_dtype bytes when training, else dtype bytes): one
// expert's gradients (training: the reduce is on the critical path) or weights, and crossings = 4
// when training (dispatch and combine, forward and backward), else 2. Rounded to the nearest
// integer and clamped to the planner's ranges. A class no rank could measure (flat: intra; one
// node: inter) takes the other class's figures; with one rank there is no link and the link
// costs are 0.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/layer_config.h"

namespace moonep::runtime {

// The rows the probe times when its options leave them 0: 512 on the CPU, 4096 on a GPU (where a
// rank's expert groups in a step hold thousands of rows, and fewer run the GEMMs below their rate:
// docs/runtime.md "Measured costs").
int64_t DefaultProbeRows(Device device);

struct CostProbeOptions {
  int64_t compute_rows = 0;    // rows of the timed expert, in [0, 2^20]; 0: DefaultProbeRows
  int64_t link_rows = 0;       // rows each rank sends to its partner, in [0, 2^20]; 0: the same
  // Rows sent to time one expert's transfer, in [0, 2^20]; 0: TransferRows (its own bytes).
  int64_t transfer_rows = 0;
  int32_t repetitions = 5;     // timed runs of each measurement (after one untimed), in [1, 1000]
  bool training = true;        // forward and backward (else forward only)
};

// Rows of H values of the dtype that hold one expert's transfer (training: its gradients, else its
// weights), at most 2^20 (beyond, the time of 2^20 rows is scaled up: TransferSeconds).
int64_t TransferRows(const LayerConfig& config, bool training);
// One expert's transfer time from a row's time at transfer_rows: 3 I values of the transfer's
// dtype per H-value row of the layer's dtype.
double TransferSeconds(double row_seconds, const LayerConfig& config, bool training);

// What the probe timed: the medians over ranks, per link class ([0] intra-node, [1] inter-node),
// and each rank's own token time.
struct ProbeFigures {
  double token_seconds = 0;
  std::vector<double> rank_token_seconds;  // [R] each rank's own (token_seconds is their median)
  double row_seconds[2] = {0, 0};       // one row one way, link_rows rows to a partner
  double transfer_seconds[2] = {0, 0};  // one expert's transfer one way
  bool measured[2] = {false, false};
};

struct MeasuredCosts {
  // The medians over ranks (seconds). row_seconds_*: one row one way; transfer_seconds_*: one
  // expert's transfer one way; 0 where not measured.
  double token_seconds = 0;
  double row_seconds_intra = 0, row_seconds_inter = 0;
  double transfer_seconds_intra = 0, transfer_seconds_inter = 0;
  bool intra_measured = false, inter_measured = false;
  int32_t ranks = 0;  // ranks that took part
  // The rows timed (the options', defaults resolved).
  int64_t compute_rows = 0, link_rows = 0, transfer_rows = 0;
  // The planner's costs (LayerConfig / PlannerConfig units).
  int64_t replica_cost_intra = 0, replica_cost_inter = 0;
  int64_t row_cost_intra = 0, row_cost_inter = 0;
  // Each rank's own token time, the fastest and the slowest of them, and each rank's speed
  // relative to the median of those times (token_seconds / its time: 0.5 for a rank half as fast;
  // for an even count the median is the mean of the two middle times), for LayerConfig::speeds
  // where ranks differ in more than noise (ApplyCostsAndSpeeds). Empty, and fastest and slowest
  // 0, where a rank timed 0 or a value that is not finite (never on success: every rank timed).
  std::vector<double> rank_token_seconds;
  double token_seconds_fastest = 0, token_seconds_slowest = 0;
  std::vector<double> speeds;
};

// The partner of every rank on one link class: inside its node (the next rank of the node, a
// ring), or across nodes (the rank at the same place in the next node, the last node wrapping to
// the first; flat: the next rank); a rank with no partner of that class (alone in its node, or its
// place past the next node's size) is its own and measures nothing there. No rank has two
// senders other than itself.
std::vector<int32_t> ProbePartners(int32_t num_ranks, int32_t ranks_per_node, bool intra);

// Local checks of the options (InvalidArgument naming the field).
absl::Status CheckCostProbeOptions(const CostProbeOptions& options);

// The planner's costs from measured seconds (the formulas above; unmeasured classes copied from
// the other class). Pure: every rank derives the same costs from the same medians.
MeasuredCosts DeriveCosts(bool training, const ProbeFigures& figures, int32_t ranks);

// Collective: measures and derives as above. The config must pass CheckLayerConfig with an
// executor (I > 0) and agree on every rank (AgreeOnConfig), and so must the options; a rank whose
// config or options are bad, or that cannot allocate the probe's buffers, fails the probe on every
// rank (its own error there, RemoteError naming it on the others). A peer that does not join
// within the timeout fails it with Timeout naming the phase and the peers. The probe allocates its
// own buffers (one expert's weights and gradients, 4 x compute_rows rows, and an EP buffer of
// max(link_rows, transfer_rows) rows; host buffers checked against the rank's and the node's
// memory first) and frees them before returning; it touches no layer and adds nothing to routing
// traces.
absl::StatusOr<MeasuredCosts> MeasureCosts(Communicator* comm, const LayerConfig& config,
                                           const CostProbeOptions& options = {});

// The config with the measured costs set (replica_cost_* and row_cost_*), in tokens of the median
// rank, for a layer without speeds.
void ApplyCosts(const MeasuredCosts& costs, LayerConfig* config);
// The config with the measured speeds too, and the costs in the unit the planner then counts
// them in, tokens of the fastest rank: each ApplyCosts' times the largest speed. Whether a rank
// that measured 3 % faster is faster, or only noise, is the caller's call (docs/runtime.md,
// "Ranks of different speeds"): this applies them as measured.
void ApplyCostsAndSpeeds(const MeasuredCosts& costs, LayerConfig* config);

}  // namespace moonep::runtime
