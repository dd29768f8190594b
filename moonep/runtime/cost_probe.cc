#include "moonep/runtime/cost_probe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "moonep/compute/compute_view.h"
#include "moonep/compute/executor.h"
#include "moonep/core/dtype.h"
#include "moonep/core/status.h"
#include "moonep/runtime/device.h"
#include "moonep/runtime/ep_buffer.h"
#include "planner/plan.h"

namespace moonep::runtime {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

constexpr int64_t kMaxProbeRows = int64_t{1} << 20;
constexpr int32_t kMaxRepetitions = 1000;

// The median of `v` (sorted here); the mean of the two middle values for an even count.
double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int64_t RoundClamped(double value, int64_t max) {
  if (!(value > 0)) return 0;  // NaN and negatives too
  if (value >= static_cast<double>(max)) return max;
  return std::llround(value);
}

// Who sends to whom on one link class (ProbePartners), and the most ranks sending to one rank.
struct Pairing {
  std::vector<int32_t> dest;
  int64_t max_senders = 0;  // the most ranks sending to one rank (a rank without a partner sends
                            // nothing: its rows are routed to no expert)
  bool measures(int32_t r) const { return dest[r] != r; }
  bool any() const { return max_senders > 0; }
};

int64_t MaxSenders(const Pairing (&pairings)[2]) {
  return std::max<int64_t>({pairings[0].max_senders, pairings[1].max_senders, 1});
}

Pairing MakePairing(int32_t R, int32_t rpn, bool intra) {
  Pairing p;
  p.dest = ProbePartners(R, rpn, intra);
  std::vector<int64_t> in(R, 0);
  for (int32_t r = 0; r < R; ++r) {
    if (p.measures(r)) p.max_senders = std::max(p.max_senders, ++in[p.dest[r]]);
  }
  return p;
}

// Small deterministic values (no denormals, no overflow) for the probe's inputs: in place on the
// CPU; through a host chunk of at most 1 MiB on a GPU (the probe's buffers may be large).
absl::Status Fill(Device device, DType dtype, char* dst, int64_t count, uint32_t seed) {
  constexpr int64_t kChunk = (int64_t{1} << 20) / 4;
  const size_t size = DTypeSize(dtype);
  std::vector<char> host(device == Device::kCpu ? 0 : static_cast<size_t>(kChunk) * size);
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t begin = 0; begin < count; begin += kChunk) {
    const int64_t n = std::min(kChunk, count - begin);
    char* out = device == Device::kCpu ? dst + static_cast<size_t>(begin) * size : host.data();
    for (int64_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      StoreFromFloat(out, dtype, i, (static_cast<float>(x >> 8) / 16777216.0f - 0.5f) * 0.1f);
    }
    if (device != Device::kCpu) {
      MOONEP_RETURN_IF_ERROR(CopyToDevice(device, dst + static_cast<size_t>(begin) * size,
                                          host.data(), static_cast<size_t>(n) * size));
    }
  }
  return absl::OkStatus();
}

// Bytes of the probe's buffers in each part (the compute's are freed before the links').
uint64_t ComputeBytes(const LayerConfig& c, const CostProbeOptions& o) {
  const uint64_t hi = static_cast<uint64_t>(c.hidden) * static_cast<uint64_t>(c.intermediate);
  return 3 * hi * (DTypeSize(c.dtype) + (o.training ? DTypeSize(c.grad_dtype) : 0)) +
         4 * static_cast<uint64_t>(o.compute_rows) * static_cast<uint64_t>(c.hidden) *
             DTypeSize(c.dtype);
}
int64_t LinkRowsMax(const CostProbeOptions& o) { return std::max(o.link_rows, o.transfer_rows); }

// The EP buffer that times the links: one expert a rank, top-1, policy none, receiving `rows` rows
// from each of at most `senders` ranks, on the config's transport, device and timeout.
LayerConfig ProbeEpConfig(const LayerConfig& config, int32_t R, int64_t rows, int64_t senders) {
  LayerConfig ep;
  ep.num_experts = R;
  ep.top_k = 1;
  ep.hidden = config.hidden;
  ep.dtype = config.dtype;
  ep.grad_dtype = config.grad_dtype;
  ep.slots = 1;
  ep.policy = planner::Policy::kNone;
  ep.ranks_per_node = config.ranks_per_node;
  ep.device = config.device;
  ep.device_index = config.device_index;
  ep.max_tokens = rows;
  ep.max_recv_rows = rows * senders;
  ep.layer_id = 0;  // not from the communicator's sequence: the probe is not a layer
  ep.num_threads = config.num_threads;
  ep.transport = TransportBackend(config);
  ep.timeout_ms = config.timeout_ms;
  return ep;
}

// The link part's host bytes: the rows sent and combined, the routing, and the EP buffer's own
// (its received rows, which the combine reads back, and the transport's staging).
uint64_t LinkBytes(const LayerConfig& ep) {
  const uint64_t n = static_cast<uint64_t>(ep.max_tokens);
  const uint64_t row = static_cast<uint64_t>(ep.hidden) * DTypeSize(ep.dtype);
  return 2 * n * row + 3 * n * 4 +
         HostBufferBytes(ep, ep.max_recv_rows, /*rows_per_handle=*/1, /*shared_rows=*/0);
}

// This rank's median time of one token through one expert (forward, and backward if training).
absl::StatusOr<double> TimeCompute(const LayerConfig& config, const CostProbeOptions& options) {
  const int64_t H = config.hidden, I = config.intermediate, N = options.compute_rows;
  compute::ExecutorConfig ec;
  ec.hidden = H;
  ec.intermediate = I;
  ec.dtype = config.dtype;
  ec.max_rows = N;
  ec.num_threads = config.num_threads;
  MOONEP_ASSIGN_OR_RETURN(DeviceBackend backend, MakeDeviceBackend(config.device, ec));
  const size_t d = DTypeSize(config.dtype), gd = DTypeSize(config.grad_dtype);
  const size_t hi = static_cast<size_t>(H) * static_cast<size_t>(I);
  const size_t rows_bytes = static_cast<size_t>(N) * static_cast<size_t>(H) * d;
  MOONEP_ASSIGN_OR_RETURN(DeviceMemory weights,
                          DeviceMemory::Allocate(config.device, 3 * hi * d, "cost probe weights"));
  DeviceMemory grads;
  if (options.training) {
    MOONEP_ASSIGN_OR_RETURN(
        grads, DeviceMemory::Allocate(config.device, 3 * hi * gd, "cost probe gradients"));
  }
  MOONEP_ASSIGN_OR_RETURN(DeviceMemory rows,
                          DeviceMemory::Allocate(config.device, 4 * rows_bytes, "cost probe rows"));
  MOONEP_RETURN_IF_ERROR(Fill(config.device, config.dtype, weights.get(), 3 * hi, 1));
  MOONEP_RETURN_IF_ERROR(Fill(config.device, config.dtype, rows.get(), 2 * N * H, 2));

  auto tensor = [&](const DeviceMemory& m, size_t offset, DType dtype, int64_t r, int64_t c) {
    return TensorView::Contiguous(m.get() + offset, dtype, {r, c}, config.device);
  };
  compute::GroupView g;
  g.expert = 0;
  g.row_count = g.padded_count = N;
  g.weights = {tensor(weights, 0, config.dtype, H, I), tensor(weights, hi * d, config.dtype, H, I),
               tensor(weights, 2 * hi * d, config.dtype, I, H)};
  if (options.training) {
    g.grads = {tensor(grads, 0, config.grad_dtype, H, I),
               tensor(grads, hi * gd, config.grad_dtype, H, I),
               tensor(grads, 2 * hi * gd, config.grad_dtype, I, H)};
  }
  compute::ComputeView view;
  view.hidden = H;
  view.intermediate = I;
  view.dtype = config.dtype;
  view.device = config.device;
  view.groups.push_back(g);
  view.total_rows = N;
  const TensorView x = tensor(rows, 0, config.dtype, N, H);
  const TensorView dy = tensor(rows, rows_bytes, config.dtype, N, H);
  const TensorView y = tensor(rows, 2 * rows_bytes, config.dtype, N, H);
  const TensorView dx = tensor(rows, 3 * rows_bytes, config.dtype, N, H);
  std::vector<double> samples;
  for (int32_t rep = 0; rep <= options.repetitions; ++rep) {
    const auto t = Clock::now();
    MOONEP_RETURN_IF_ERROR(backend.executor->Forward(view, x, y, {}));
    if (options.training) MOONEP_RETURN_IF_ERROR(backend.executor->Backward(view, x, dy, dx, {}));
    MOONEP_RETURN_IF_ERROR(SynchronizeDevice(config.device));
    if (rep > 0) samples.push_back(Since(t) / static_cast<double>(N));
  }
  return Median(std::move(samples));
}

// The probe's link buffers: rows to send and combined, and the routing of each class (every row
// to the rank's partner, weight 1). The combine reads back the rows the dispatch received.
struct LinkBuffers {
  int64_t rows = 0;            // N: the most rows a dispatch sends
  DeviceMemory x, y, routing;  // routing: [2][N] ids, then [N] weights
};

// Collective: this rank's median time of a row one way on link class `c` (0 when it has no partner
// there), from dispatches and combines of `N` rows of `buf`. Only the collective calls can fail
// here on the CPU; on a GPU a failed synchronisation is a device error, after which this rank fails
// the next call of the peers where the transport can (nccl cannot: they time out naming it).
absl::StatusOr<double> TimeLinks(Communicator* comm, EpBuffer* buf, const Pairing& pairing, int c,
                                 int64_t N, const LayerConfig& config,
                                 const CostProbeOptions& options, const LinkBuffers& b) {
  const int64_t H = config.hidden;
  const int32_t* ids = b.routing.get<int32_t>() + c * b.rows;
  const float* weights = reinterpret_cast<const float*>(b.routing.get<int32_t>() + 2 * b.rows);
  const TensorView xv = TensorView::Contiguous(b.x.get(), config.dtype, {N, H}, config.device);
  const TensorView yv = TensorView::Contiguous(b.y.get(), config.dtype, {N, H}, config.device);
  std::vector<double> samples;
  for (int32_t rep = 0; rep <= options.repetitions; ++rep) {
    auto t = Clock::now();
    MOONEP_ASSIGN_OR_RETURN(
        LayerHandle h, buf->Dispatch(N, xv, absl::MakeConstSpan(ids, static_cast<size_t>(N)),
                                     absl::MakeConstSpan(weights, static_cast<size_t>(N))));
    absl::Status synced = SynchronizeDevice(config.device);
    if (!synced.ok()) return buf->AbortOperation(transport::OpKind::kCombine, synced);
    const StepStats& st = buf->stats();
    const double dispatch = Since(t) - st.seconds[static_cast<int>(Phase::kCounts)] -
                            st.seconds[static_cast<int>(Phase::kPlan)];
    EpLayout layout;
    MOONEP_RETURN_IF_ERROR(buf->Layout(h, &layout));
    // The received rows stand for the experts' outputs (the combine only reads them).
    const TensorView outv = TensorView::Contiguous(const_cast<void*>(layout.rows), config.dtype,
                                                   {buf->recv_capacity_rows(), H}, config.device);
    t = Clock::now();
    MOONEP_RETURN_IF_ERROR(buf->Combine(h, outv, yv));
    synced = SynchronizeDevice(config.device);
    if (!synced.ok()) return buf->AbortOperation(transport::OpKind::kCounts, synced);
    const double combine = Since(t);
    MOONEP_RETURN_IF_ERROR(buf->Release(h));
    if (rep > 0) samples.push_back(std::max(0.0, dispatch + combine) / (2.0 * N));
  }
  return pairing.measures(comm->rank()) ? Median(std::move(samples)) : 0.0;
}

// What every rank shares at the end.
struct RankFigures {
  double token_seconds = 0;
  double row_seconds[2] = {0, 0}, transfer_row_seconds[2] = {0, 0};  // [intra, inter]; 0: none
};

// The probe's options, as every rank shares them (their equality is checked).
struct OptionsRecord {
  int64_t compute_rows, link_rows, transfer_rows;
  int32_t repetitions, training;
};

}  // namespace

std::vector<int32_t> ProbePartners(int32_t R, int32_t ranks_per_node, bool intra) {
  std::vector<int32_t> dest(static_cast<size_t>(std::max(R, 0)));
  const bool flat = ranks_per_node <= 0;
  const int32_t node = flat || ranks_per_node >= R ? R : ranks_per_node;
  for (int32_t r = 0; r < R; ++r) {
    int32_t d = r;
    if (intra && !flat) {
      const int32_t base = r / node * node, size = std::min(node, R - base);
      d = base + (r - base + 1) % size;
    } else if (!intra && flat) {
      d = (r + 1) % R;
    } else if (!intra && node < R) {
      const int32_t nodes = (R + node - 1) / node;
      const int32_t next = (r / node + 1) % nodes * node;
      // The same place in the next node; none where that node is shorter, so that no rank
      // receives from two (which would time a shared link, not one).
      if (r % node < std::min(node, R - next)) d = next + r % node;
    }
    dest[r] = d;
  }
  return dest;
}

int64_t DefaultProbeRows(Device device) { return device == Device::kCpu ? 512 : 4096; }

absl::Status CheckCostProbeOptions(const CostProbeOptions& o) {
  const std::pair<const char*, int64_t> rows[] = {{"compute_rows", o.compute_rows},
                                                  {"link_rows", o.link_rows},
                                                  {"transfer_rows", o.transfer_rows}};
  for (const auto& [name, value] : rows) {
    MOONEP_CHECK_ARG(value >= 0 && value <= kMaxProbeRows,
                     "cost probe: %s is %d; must be in [0, %d] (0: the default)", name, value,
                     kMaxProbeRows);
  }
  MOONEP_CHECK_ARG(o.repetitions >= 1 && o.repetitions <= kMaxRepetitions,
                   "cost probe: repetitions is %d; must be in [1, %d]", o.repetitions,
                   kMaxRepetitions);
  return absl::OkStatus();
}

double TransferSeconds(double row_seconds, const LayerConfig& config, bool training) {
  // 3 H I values of the transfer's dtype, as rows of H values of the row dtype.
  return row_seconds * 3.0 * static_cast<double>(config.intermediate) *
         static_cast<double>(DTypeSize(training ? config.grad_dtype : config.dtype)) /
         static_cast<double>(DTypeSize(config.dtype));
}

int64_t TransferRows(const LayerConfig& config, bool training) {
  const int64_t size = static_cast<int64_t>(DTypeSize(training ? config.grad_dtype : config.dtype));
  const int64_t bytes = 3 * config.hidden * config.intermediate * size;
  const int64_t row_bytes = config.hidden * static_cast<int64_t>(DTypeSize(config.dtype));
  return std::min((bytes + row_bytes - 1) / row_bytes, kMaxProbeRows);
}

MeasuredCosts DeriveCosts(bool training, const ProbeFigures& f, int32_t ranks) {
  MeasuredCosts m;
  m.token_seconds = f.token_seconds;
  m.row_seconds_intra = f.measured[0] ? f.row_seconds[0] : 0;
  m.row_seconds_inter = f.measured[1] ? f.row_seconds[1] : 0;
  m.transfer_seconds_intra = f.measured[0] ? f.transfer_seconds[0] : 0;
  m.transfer_seconds_inter = f.measured[1] ? f.transfer_seconds[1] : 0;
  m.intra_measured = f.measured[0];
  m.inter_measured = f.measured[1];
  m.ranks = ranks;
  m.rank_token_seconds = f.rank_token_seconds;
  const bool all_timed =
      !f.rank_token_seconds.empty() && f.token_seconds > 0 &&
      std::all_of(f.rank_token_seconds.begin(), f.rank_token_seconds.end(),
                  [](double t) { return std::isfinite(t) && t > 0; });
  if (all_timed) {
    const auto [fastest, slowest] =
        std::minmax_element(f.rank_token_seconds.begin(), f.rank_token_seconds.end());
    m.token_seconds_fastest = *fastest;
    m.token_seconds_slowest = *slowest;
    for (double t : f.rank_token_seconds) m.speeds.push_back(f.token_seconds / t);
  }
  if (!(f.token_seconds > 0) || (!f.measured[0] && !f.measured[1])) return m;
  // A class not measured takes the other's figures.
  const int intra = f.measured[0] ? 0 : 1, inter = f.measured[1] ? 1 : 0;
  const double crossings = training ? 4 : 2;
  auto replica = [&](int c) {
    return RoundClamped(f.transfer_seconds[c] / f.token_seconds, planner::kMaxReplicaCost);
  };
  auto row = [&](int c) {
    return RoundClamped(planner::kRowCostScale * crossings * f.row_seconds[c] / f.token_seconds,
                        planner::kMaxRowCost);
  };
  m.replica_cost_intra = replica(intra);
  m.replica_cost_inter = replica(inter);
  m.row_cost_intra = row(intra);
  m.row_cost_inter = row(inter);
  return m;
}

void ApplyCosts(const MeasuredCosts& costs, LayerConfig* config) {
  config->replica_cost_intra = costs.replica_cost_intra;
  config->replica_cost_inter = costs.replica_cost_inter;
  config->row_cost_intra = costs.row_cost_intra;
  config->row_cost_inter = costs.row_cost_inter;
}

void ApplyCostsAndSpeeds(const MeasuredCosts& costs, LayerConfig* config) {
  ApplyCosts(costs, config);
  config->speeds = costs.speeds;
  if (costs.speeds.empty()) return;
  const double fastest = *std::max_element(costs.speeds.begin(), costs.speeds.end());
  for (int64_t* cost : {&config->replica_cost_intra, &config->replica_cost_inter}) {
    *cost = RoundClamped(static_cast<double>(*cost) * fastest, planner::kMaxReplicaCost);
  }
  for (int64_t* cost : {&config->row_cost_intra, &config->row_cost_inter}) {
    *cost = RoundClamped(static_cast<double>(*cost) * fastest, planner::kMaxRowCost);
  }
}

absl::StatusOr<MeasuredCosts> MeasureCosts(Communicator* comm, const LayerConfig& config,
                                           const CostProbeOptions& given) {
  if (comm == nullptr) return InvalidArgument("cost probe: comm is null");
  // The config's GPU while the probe runs; the caller's again afterwards.
  ScopedDevice scoped(config.device, config.device_index);
  const int32_t R = comm->size();
  absl::Status local = CheckLayerConfig(config, R, /*need_executor=*/true);
  if (local.ok()) local = CheckCostProbeOptions(given);
  // The defaults by device (the device is agreed below, so every rank resolves them alike).
  CostProbeOptions options = given;
  if (options.compute_rows == 0) options.compute_rows = DefaultProbeRows(config.device);
  if (options.link_rows == 0) options.link_rows = DefaultProbeRows(config.device);
  if (options.transfer_rows == 0 && local.ok()) {
    options.transfer_rows = TransferRows(config, options.training);
  }
  if (local.ok()) local = UseDevice(config.device, config.device_index);
  MOONEP_RETURN_IF_ERROR(AgreeOnConfig(comm, config, local, "cost probe"));
  // The options decide how many collective steps follow: they must be the same on every rank.
  {
    const OptionsRecord mine{options.compute_rows, options.link_rows, options.transfer_rows,
                             options.repetitions, options.training ? 1 : 0};
    std::string all;
    MOONEP_RETURN_IF_ERROR(comm->Allgather(
        absl::MakeConstSpan(reinterpret_cast<const char*>(&mine), sizeof(mine)), &all,
        "cost probe (options)"));
    // Every rank reads the same records, so every rank names the same rank.
    for (int32_t q = 1; q < R; ++q) {
      if (std::memcmp(all.data() + static_cast<size_t>(q) * sizeof(mine), all.data(),
                      sizeof(mine)) != 0) {
        return InvalidArgument("cost probe: ranks 0 and %d passed different options (every rank "
                               "must pass the same compute_rows, link_rows, transfer_rows, "
                               "repetitions and training)",
                               q);
      }
    }
  }
  // The probe's host buffers against this rank's room and, with every rank's, the node's (as a
  // layer's creation checks its own), before any of them is allocated.
  const Pairing pairings[2] = {MakePairing(R, config.ranks_per_node, /*intra=*/true),
                               MakePairing(R, config.ranks_per_node, /*intra=*/false)};
  const bool links = pairings[0].any() || pairings[1].any();
  const LayerConfig ep = ProbeEpConfig(config, R, LinkRowsMax(options), MaxSenders(pairings));
  const uint64_t probe_bytes =
      std::max(ComputeBytes(config, options), links ? LinkBytes(ep) : uint64_t{0});
  LayerConfig none = config;  // no layer buffers: only the probe's bytes
  none.max_tokens = 0;
  none.max_inflight = 1;
  MOONEP_RETURN_IF_ERROR(CheckHostBuffers(comm, none, /*capacity=*/0, /*rows_per_handle=*/0,
                                          /*shared_rows=*/0, probe_bytes,
                                          "the cost probe's host buffers",
                                          "cost probe (host memory of the node)", &local));
  RankFigures mine;
  if (local.ok()) {
    absl::StatusOr<double> token = TimeCompute(config, options);
    if (token.ok()) mine.token_seconds = *token;
    local = token.status();
  }
  MOONEP_RETURN_IF_ERROR(AgreeOnVerdict(comm, local, "cost probe (compute)"));

  if (links) {
    const int64_t N = ep.max_tokens;
    // Its dispatches have a shape of their own: kept out of the routing trace.
    struct Pause {
      Communicator* comm;
      bool was;
      explicit Pause(Communicator* c) : comm(c), was(c->trace_paused()) { comm->PauseTrace(true); }
      ~Pause() { comm->PauseTrace(was); }
    } pause(comm);
    MOONEP_ASSIGN_OR_RETURN(std::unique_ptr<EpBuffer> buf, EpBuffer::Create(comm, ep));
    const size_t row_bytes = static_cast<size_t>(config.hidden) * DTypeSize(config.dtype);
    absl::Status alloc;
    LinkBuffers b;
    b.rows = N;
    auto allocate = [&](DeviceMemory* m, size_t bytes, const char* what) {
      if (!alloc.ok()) return;
      auto made = DeviceMemory::Allocate(config.device, bytes, what);
      if (made.ok()) {
        *m = std::move(*made);
      } else {
        alloc = made.status();
      }
    };
    allocate(&b.x, static_cast<size_t>(N) * row_bytes, "cost probe link rows");
    allocate(&b.routing, static_cast<size_t>(N) * 12, "cost probe routing");
    allocate(&b.y, static_cast<size_t>(N) * row_bytes, "cost probe combined rows");
    if (alloc.ok()) alloc = Fill(config.device, config.dtype, b.x.get(), N * config.hidden, 3);
    if (alloc.ok()) {
      std::vector<int32_t> routing(static_cast<size_t>(N) * 3);
      const int32_t rank = comm->rank();
      for (int64_t i = 0; i < N; ++i) {
        // -1: a dropped entry (no partner of that class: this rank sends nothing there).
        routing[i] = pairings[0].measures(rank) ? pairings[0].dest[rank] : -1;
        routing[N + i] = pairings[1].measures(rank) ? pairings[1].dest[rank] : -1;
        const float one = 1.0f;
        std::memcpy(&routing[2 * N + i], &one, 4);
      }
      alloc = CopyToDevice(config.device, b.routing.get(), routing.data(), routing.size() * 4);
    }
    MOONEP_RETURN_IF_ERROR(AgreeOnVerdict(comm, alloc, "cost probe (link buffers)"));
    for (int c = 0; c < 2; ++c) {
      if (!pairings[c].any()) continue;
      MOONEP_ASSIGN_OR_RETURN(mine.row_seconds[c],
                              TimeLinks(comm, buf.get(), pairings[c], c, options.link_rows,
                                        config, options, b));
      MOONEP_ASSIGN_OR_RETURN(mine.transfer_row_seconds[c],
                              TimeLinks(comm, buf.get(), pairings[c], c, options.transfer_rows,
                                        config, options, b));
    }
    MOONEP_RETURN_IF_ERROR(buf->Close());
  }

  std::string all;
  MOONEP_RETURN_IF_ERROR(comm->Allgather(
      absl::MakeConstSpan(reinterpret_cast<const char*>(&mine), sizeof(mine)), &all,
      "cost probe (results)"));
  std::vector<double> tokens, rows[2], transfers[2];
  for (int32_t r = 0; r < R; ++r) {
    RankFigures f;
    std::memcpy(&f, all.data() + static_cast<size_t>(r) * sizeof(f), sizeof(f));
    tokens.push_back(f.token_seconds);
    for (int c = 0; c < 2; ++c) {
      if (!pairings[c].measures(r)) continue;
      rows[c].push_back(f.row_seconds[c]);
      transfers[c].push_back(f.transfer_row_seconds[c]);
    }
  }
  // A transfer's time: its rows' time scaled to its bytes (the same when transfer_rows holds
  // exactly the transfer, below it when rounded up to whole rows).
  ProbeFigures figures;
  figures.rank_token_seconds = tokens;
  figures.token_seconds = Median(tokens);
  for (int c = 0; c < 2; ++c) {
    figures.measured[c] = !rows[c].empty();
    figures.row_seconds[c] = Median(rows[c]);
    figures.transfer_seconds[c] = TransferSeconds(Median(transfers[c]), config, options.training);
  }
  MeasuredCosts m = DeriveCosts(options.training, figures, R);
  m.compute_rows = options.compute_rows;
  m.link_rows = options.link_rows;
  m.transfer_rows = options.transfer_rows;
  return m;
}

}  // namespace moonep::runtime
