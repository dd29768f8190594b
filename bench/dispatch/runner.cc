#include "bench/dispatch/runner.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "bench/dispatch/device.h"
#include "moonep/compute/compute_view.h"
#include "moonep/core/status.h"
#include "moonep/reference/reference_moe.h"
#include "moonep/runtime/moe_layer.h"
#include "planner/planner.h"
#include "transport/layout.h"
#include "transport/transport.h"

namespace moonep::bench {

void OpResult::Finish() {
  if (iter_us.empty()) return;
  std::vector<double> v = iter_us;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  median_us = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  // Nearest-rank p99.
  const size_t idx = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(n))) - 1;
  p99_us = v[std::min(idx, n - 1)];
  min_us = v.front();
  max_us = v.back();
  double sum = 0;
  for (double x : v) sum += x;
  mean_us = sum / static_cast<double>(n);
  if (has_bandwidth && median_us > 0) {
    algbw_gbps = static_cast<double>(size_bytes) / (median_us * 1e3);
    busbw_gbps = bus_bytes > 0 ? static_cast<double>(bus_bytes) / (median_us * 1e3)
                               : algbw_gbps * bus_factor;
  }
}

const OpResult* ConfigResult::Find(const std::string& op, const std::string& impl) const {
  for (const OpResult& r : ops) {
    if (r.op == op && r.impl == impl) return &r;
  }
  return nullptr;
}

namespace {

using transport::ExpertBlocks;
using transport::OpKind;

constexpr int kParams = 3;  // gate, up, down

struct Series {
  std::vector<double> us;
  int64_t wrong = 0, checked = 0;
};

// Rows of `dtype` equal to `expected` (bitwise), counted per row.
int64_t CountWrongRows(const char* got, const char* expected, int64_t rows, size_t row_bytes) {
  int64_t wrong = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (std::memcmp(got + r * row_bytes, expected + r * row_bytes, row_bytes) != 0) ++wrong;
  }
  return wrong;
}

void Poison(void* data, size_t bytes) { std::memset(data, 0xff, bytes); }  // NaN in fp32 and bf16

double RoundTo(DType dtype, double v) {
  return dtype == DType::kFloat32 ? static_cast<double>(static_cast<float>(v))
                                  : BFloat16::FromFloat(static_cast<float>(v)).ToFloat();
}

// Elements of got (dtype or fp32) whose distance to ref exceeds tol * max|ref|. With `what`, a
// check that finds any says on stderr how far off the worst one is (a diagnosis for #wrong).
// With `magnitude` (one per element), element i's bound is tol * max(max|ref|, magnitude[i])
// instead: for a dot product, magnitude is the sum of its terms' absolute values, the scale of the
// error that rounding its operands (bf16: 2^-9 each) can cause however much the terms cancel. (The
// rounding inside each operand, itself a sum, is not counted: the bound stays a proxy, not a proof.)
int64_t CountOutside(const std::vector<double>& got, const std::vector<double>& ref, double tol,
                     const char* what = nullptr, const std::vector<double>* magnitude = nullptr) {
  double scale = 0;
  for (double v : ref) scale = std::max(scale, std::abs(v));
  const double bound = tol * std::max(scale, 1e-30);
  int64_t wrong = 0;
  size_t worst = 0;
  double worst_diff = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(got[i] - ref[i]);
    const double b = magnitude != nullptr ? std::max(bound, tol * (*magnitude)[i]) : bound;
    if (!(d <= b)) ++wrong;  // NaN counts as wrong
    if (!(d <= worst_diff)) {
      worst_diff = d;
      worst = i;
    }
  }
  if (wrong > 0 && what != nullptr) {
    std::fprintf(stderr,
                 "moonep-bench-dispatch: %s: %lld of %zu values off by more than %.1e x %s "
                 "(max|ref| %.4g); the worst by %.3e x max|ref|, at %zu (got %.6g, expected %.6g",
                 what, static_cast<long long>(wrong), got.size(), tol,
                 magnitude != nullptr ? "max(max|ref|, the sum of its terms' |.|)" : "max|ref|", scale,
                 worst_diff / std::max(scale, 1e-30), worst, got[worst], ref[worst]);
    if (magnitude != nullptr) std::fprintf(stderr, ", sum of its terms' |.| %.4g", (*magnitude)[worst]);
    std::fprintf(stderr, ")\n");
  }
  return wrong;
}

class Runner {
 public:
  Runner(const BenchConfig& c, MPI_Comm comm, runtime::Communicator* rt)
      : c_(c), comm_(comm), rt_(rt) {}
  ~Runner() {
    if (row_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&row_type_);
    if (a2a_comm_ != MPI_COMM_NULL) MPI_Comm_free(&a2a_comm_);
  }

  absl::Status Run(ConfigResult* out);

 private:
  absl::Status Setup();
  absl::Status SetupBlocks();
  absl::Status SetupA2a();
  absl::Status SetupLayers();
  absl::Status SetupDevice();
  absl::Status EnsureSlots(const planner::Plan& plan);
  absl::Status Iteration(bool record);
  absl::Status TransportPipeline(bool measured, bool record);
  absl::Status A2aPipeline(bool record);
  absl::Status NcclA2aPipeline(bool record);
  absl::Status LayerStep(bool measured, bool record);
  absl::Status LayerStepDevice(bool measured, bool record);

  int64_t CheckDispatch(const planner::Plan& plan, absl::Span<const int64_t> counts,
                        const char* rows, const float* weights);
  int64_t CheckPrefetch(const planner::Plan& plan);
  int64_t CountWrongA2aRows() const;  // the all-to-all baseline's received rows (a2a_recv_)
  // dx and d topk_weights of the sampled tokens (dx_, dtopk_ on the host) against the fp64
  // reference; adds the number of values compared to *checked.
  int64_t CountWrongBackwardSample(int64_t* checked);
  int64_t CheckReduce(const planner::Plan& plan);
  // Baselines of prefetch and reduce (host backends, --baselines): every replica's weights sent
  // from its home, and every replica's gradients sent to its home and summed there in the
  // contract's order, by MPI_Isend / MPI_Irecv of the same bytes -- what the transports did before
  // the replica chains (docs/transport.md), and what the chains are measured against.
  absl::Status StarPrefetch(const planner::Plan& plan);
  absl::Status StarReduce(const planner::Plan& plan);

  absl::Status Timed(const std::string& key, bool record, const std::function<absl::Status()>& f) {
    // Device work queued before (poisoning, uploads) finishes outside the timed region.
    if (device_) MOONEP_RETURN_IF_ERROR(DeviceSynchronize());
    MPI_Barrier(comm_);
    const double t0 = MPI_Wtime();
    absl::Status s = f();
    const double dt = MPI_Wtime() - t0;
    if (record) series_[key].us.push_back(dt * 1e6);
    return s;
  }
  // Buffers the transport reads and writes: host memory, or with the nccl backend the device twin
  // (outputs are poisoned on the device before and copied back after each operation, outside the
  // timed region, so the same host-side checks apply).
  void* Data(std::vector<char>& host, DeviceBuffer& dev) { return device_ ? dev.get() : host.data(); }
  template <typename T>
  T* Data(std::vector<T>& host, DeviceBuffer& dev) {
    return device_ ? static_cast<T*>(dev.get()) : host.data();
  }
  TensorView Matrix(void* data, int64_t rows, int64_t cols) const {
    return TensorView::Contiguous(data, c_.dtype, {rows, cols}, device_ ? Device::kCuda : Device::kCpu);
  }
  template <typename T>
  absl::Status PoisonOutput(std::vector<T>& host, DeviceBuffer& dev) {
    if (!check_) return absl::OkStatus();  // nothing is checked this iteration
    if (device_) return dev.Fill(0xff);
    Poison(host.data(), host.size() * sizeof(T));
    return absl::OkStatus();
  }
  template <typename T>
  absl::Status Fetch(std::vector<T>& host, const DeviceBuffer& dev, size_t elems) {
    if (!check_) return absl::OkStatus();
    return device_ ? dev.Download(host.data(), elems * sizeof(T)) : absl::OkStatus();
  }
  void MaybeCorrupt(const char* op, void* data, size_t bytes) {
    // Four bytes from an aligned middle offset, exponent bits included: far outside any tolerance.
    if (bytes < 4 || c_.corrupt_op != op) return;
    char* at = static_cast<char*>(data) + (bytes / 2) / 4 * 4;
    for (int i = 0; i < 4; ++i) at[i] ^= 0x7f;
    ++corrupted_;
  }
  void Count(const std::string& key, int64_t wrong, int64_t checked) {
    series_[key].wrong += wrong;
    series_[key].checked += checked;
  }
  std::string Key(const char* op, bool measured) const {
    return std::string(op) + "/" + (measured ? planner::PolicyName(c_.policy) : "none");
  }

  const BenchConfig c_;
  int64_t corrupted_ = 0;  // MaybeCorrupt's flips
  MPI_Comm comm_;
  runtime::Communicator* rt_;
  int32_t R_ = 0, rank_ = 0, E_ = 0, K_ = 0, epn_ = 0, slots_ = 0;
  int64_t T_ = 0, H_ = 0, I_ = 0;
  size_t ds_ = 4, row_bytes_ = 0;
  bool run_none_ = false;  // policy none as a separate baseline
  bool device_ = false;    // nccl backend: every transport buffer in device memory
  bool a2a_ = false;       // the all-to-all baseline: MPI_Alltoallv, or with device_ grouped
                           // ncclSend/ncclRecv of the same per-destination rows (impl nccl-a2a)
  bool layer_ = false;     // the MoeLayer steps (with device_: device cuda, GPU buffers)
  std::string a2a_impl_ = "a2av";
  Routing routing_;
  std::vector<int64_t> offsets_;

  // Token lists: for source s and expert e, the (token, k) that chose e, by increasing token.
  std::vector<int64_t> tok_begin_;  // [R * (E + 1)]
  std::vector<int32_t> tok_t_, tok_k_;

  std::vector<char> x_, y_, expected_y_;
  std::vector<float> topk_w_;
  int64_t capacity_ = 0;
  std::vector<char> recv_rows_;
  std::vector<float> recv_w_;
  // Backward forms, with identity experts and dy = x: combine-backward gives the dispatched rows
  // again (bwd_rows_), topk-weight-grad <x[t], x[t]> per valid (t, k), dispatch-backward of the
  // dispatched rows K_t * x[t] (K_t: valid experts of t). Values are exact: checked bit for bit.
  std::vector<char> bwd_rows_, bwd_dx_, expected_dx_;
  std::vector<float> bwd_dtopk_, expected_dtopk_;

  // Device twins (nccl backend), allocated once in SetupDevice / EnsureSlots.
  DeviceBuffer d_ids_, d_topk_w_, d_x_, d_y_, d_rows_, d_rows_w_, d_bwd_rows_, d_bwd_dx_,
      d_bwd_dtopk_, d_home_w_, d_dummy_w_, d_dummy_g_;
  std::vector<DeviceBuffer> d_slot_w_, d_slot_g_, d_home_g_;

  struct Pipeline {
    std::unique_ptr<transport::Transport> transport;
    std::unique_ptr<planner::Planner> planner;
    transport::DispatchHandle handle;
    planner::Plan plan;
  };
  Pipeline measured_, none_;

  // Expert parameter blocks (prefetch) and gradient blocks (reduce).
  size_t param_elems_[kParams] = {};
  std::vector<char> home_weights_;   // epn * 3 tensors, dtype
  // Home gradients, per home group, stored only for groups that get a replica's gradient (the
  // others are never written by the reduction and share one block).
  std::vector<std::vector<float>> home_grads_, home_grads_init_, expected_home_g_;
  std::vector<std::vector<char>> slot_weights_;   // per slot, empty until used
  std::vector<std::vector<float>> slot_grads_;
  std::vector<int32_t> slot_filled_for_;          // expert whose grads slot s holds (-1 none)
  std::vector<char> dummy_weights_;
  std::vector<float> dummy_grads_;
  std::vector<TensorView> home_w_views_, slot_w_views_, home_g_views_, slot_g_views_;
  std::vector<int32_t> expected_map_;             // slot_expert the expected values are for
  std::vector<std::vector<char>> expected_slot_w_;
  std::vector<std::vector<float>> star_in_;  // StarReduce: the gradients a home receives
  std::vector<float> star_sum_;              // ... and their sum (the caller's home stays as is)

  // MPI_Alltoallv baseline.
  MPI_Comm a2a_comm_ = MPI_COMM_NULL;
  MPI_Datatype row_type_ = MPI_DATATYPE_NULL;
  std::vector<int> a2a_scount_, a2a_sdispl_, a2a_rcount_, a2a_rdispl_;
  std::vector<int32_t> a2a_send_entry_;  // send row i carries entry t * K + k
  std::vector<int32_t> a2a_where_;       // its inverse: the send row of entry t * K + k
  std::vector<char> a2a_send_, a2a_recv_;
  std::vector<int64_t> a2a_recv_src_, a2a_recv_token_;
  // Its NCCL form (device_): own communicator; the send rows packed once at setup (not timed).
  DeviceAlltoall nccl_a2a_;
  DeviceBuffer d_a2a_send_, d_a2a_recv_, d_a2a_back_;
  std::vector<char> a2a_back_;

  // Layers.
  std::unique_ptr<runtime::MoeLayer> layer_measured_, layer_none_;
  std::vector<compute::ExpertParams> layer_params_, grads_measured_, grads_none_;
  std::vector<float> gbuf_measured_, gbuf_none_;
  std::vector<char> dy_, dx_;
  std::vector<float> dtopk_;
  int64_t sample_ = 0;  // checked tokens 0 .. sample_-1
  bool check_ = true;   // this iteration's results are checked (--check_iters)
  std::vector<double> y_ref_, dx_ref_, dtopk_ref_;
  // Per (token, k) of the sample: sum over H of |dy[t][col] * expert output[col]|, the scale of
  // d topk_weights' rounding error (CountOutside's magnitude).
  std::vector<double> dtopk_mag_;
  // Device twins of the layer's tensors (device_): gradients, dy, dx, d topk_weights; x, ids and
  // topk weights are d_x_, d_ids_, d_topk_w_ and y is d_y_. y of the measured policy is kept to
  // compare with policy none's.
  DeviceBuffer d_gbuf_measured_, d_gbuf_none_, d_dy_, d_dx_, d_dtopk_;
  std::vector<char> y_measured_;
  bool have_y_measured_ = false;
  double tol_ = 1e-5;

  std::map<std::string, Series> series_;
};

static_assert(kMaxEntriesPerRank == transport::kMaxEntries, "the workload's bound is the transports'");

absl::Status Runner::Setup() {
  MPI_Comm_size(comm_, &R_);
  MPI_Comm_rank(comm_, &rank_);
  E_ = c_.num_experts;
  K_ = c_.top_k;
  T_ = c_.tokens;
  H_ = c_.hidden;
  I_ = c_.intermediate;
  MOONEP_CHECK_ARG(E_ >= R_ && E_ % R_ == 0,
                   "--experts=%d must be a positive multiple of the number of ranks (%d)", E_, R_);
  MOONEP_CHECK_ARG(H_ >= 1, "--hidden must be >= 1, got %d", H_);
  MOONEP_CHECK_ARG(H_ <= transport::kMaxRowBytes / static_cast<int64_t>(DTypeSize(c_.dtype)),
                   "--hidden=%d: a row of %s is above %d bytes, the transports' max_row_bytes", H_,
                   DTypeName(c_.dtype), transport::kMaxRowBytes);
  MOONEP_CHECK_ARG(I_ >= 1, "--intermediate must be >= 1, got %d", I_);
  MOONEP_CHECK_ARG(c_.iters >= 1, "--iters must be >= 1, got %d", c_.iters);
  MOONEP_CHECK_ARG(c_.warmup >= 0, "--warmup must be >= 0, got %d", c_.warmup);
  epn_ = E_ / R_;
  ds_ = DTypeSize(c_.dtype);
  row_bytes_ = static_cast<size_t>(H_) * ds_;
  run_none_ = c_.baselines && c_.policy != planner::Policy::kNone;
  device_ = c_.backend == "nccl";
  a2a_ = c_.baselines;
  layer_ = c_.layer;
  a2a_impl_ = device_ ? "nccl-a2a" : "a2av";
  tol_ = c_.dtype == DType::kFloat32 ? 1e-5 : 1e-2;

  RoutingSpec spec;
  spec.num_ranks = R_;
  spec.num_experts = E_;
  spec.top_k = K_;
  spec.tokens = T_;
  spec.skew = c_.skew;
  spec.seed = c_.seed;
  MOONEP_ASSIGN_OR_RETURN(routing_, MakeRouting(spec));
  planner::ComputeSourceOffsets(routing_.counts, R_, E_, &offsets_);

  tok_begin_.assign(static_cast<size_t>(R_) * (E_ + 1), 0);
  tok_t_.resize(static_cast<size_t>(R_) * T_ * K_);
  tok_k_.resize(tok_t_.size());
  for (int32_t s = 0; s < R_; ++s) {
    int64_t* begin = tok_begin_.data() + static_cast<size_t>(s) * (E_ + 1);
    begin[0] = static_cast<int64_t>(s) * T_ * K_;
    for (int32_t e = 0; e < E_; ++e) begin[e + 1] = begin[e] + routing_.counts[static_cast<size_t>(s) * E_ + e];
    std::vector<int64_t> fill(begin, begin + E_);
    const int32_t* ids = routing_.ids_of(s);
    for (int64_t t = 0; t < T_; ++t) {
      for (int32_t k = 0; k < K_; ++k) {
        const int32_t e = ids[t * K_ + k];
        tok_t_[fill[e]] = static_cast<int32_t>(t);
        tok_k_[fill[e]++] = k;
      }
    }
  }

  // This rank's tokens and the combine result an identity expert must give: sum_k w x, exact.
  x_.resize(static_cast<size_t>(T_) * row_bytes_);
  y_.resize(x_.size());
  expected_y_.resize(x_.size());
  topk_w_.resize(static_cast<size_t>(T_ * K_));
  for (int64_t t = 0; t < T_; ++t) {
    for (int32_t k = 0; k < K_; ++k) topk_w_[t * K_ + k] = TopkWeightValue(rank_, t, k);
    for (int64_t col = 0; col < H_; ++col) {
      const float v = TokenValue(rank_, t, col);
      StoreFromFloat(x_.data(), c_.dtype, static_cast<size_t>(t * H_ + col), v);
      float acc = 0;
      for (int32_t k = 0; k < K_; ++k) acc += topk_w_[t * K_ + k] * v;
      StoreFromFloat(expected_y_.data(), c_.dtype, static_cast<size_t>(t * H_ + col), acc);
    }
  }
  {
    const int32_t* ids = routing_.ids_of(rank_);
    expected_dx_.resize(x_.size());
    expected_dtopk_.assign(static_cast<size_t>(T_ * K_), 0.0f);
    for (int64_t t = 0; t < T_; ++t) {
      double dot = 0;
      int32_t valid = 0;
      for (int64_t col = 0; col < H_; ++col) {
        const double v = LoadAsFloat(x_.data(), c_.dtype, static_cast<size_t>(t * H_ + col));
        dot += v * v;
      }
      for (int32_t k = 0; k < K_; ++k) {
        if (ids[t * K_ + k] < 0) continue;
        ++valid;
        expected_dtopk_[t * K_ + k] = static_cast<float>(dot);
      }
      for (int64_t col = 0; col < H_; ++col) {
        const float v = LoadAsFloat(x_.data(), c_.dtype, static_cast<size_t>(t * H_ + col));
        float acc = 0;
        for (int32_t k = 0; k < valid; ++k) acc += v;
        StoreFromFloat(expected_dx_.data(), c_.dtype, static_cast<size_t>(t * H_ + col), acc);
      }
    }
    bwd_dx_.resize(x_.size());
    bwd_dtopk_.resize(expected_dtopk_.size());
  }

  // Planners and transports; the receive capacity from the plans this routing gives.
  planner::PlannerConfig pc;
  pc.num_ranks = R_;
  pc.num_experts = E_;
  pc.slots = c_.slots;
  pc.pad_multiple = c_.pad_multiple;
  pc.row_bytes = static_cast<int64_t>(row_bytes_);
  pc.expert_bytes = static_cast<int64_t>(3 * H_ * I_ * ds_);
  transport::TransportOptions to;
  to.comm = comm_;
  to.max_tokens = T_;
  to.max_top_k = K_;
  to.max_row_bytes = static_cast<int64_t>(row_bytes_);
  for (int which = 0; which < (run_none_ ? 2 : 1); ++which) {
    Pipeline& p = which == 0 ? measured_ : none_;
    pc.policy = which == 0 ? c_.policy : planner::Policy::kNone;
    MOONEP_ASSIGN_OR_RETURN(p.planner, planner::Planner::Create(pc));
    MOONEP_ASSIGN_OR_RETURN(p.transport, transport::CreateTransport(c_.backend, to));
    auto sizing = planner::Planner::Create(pc);
    if (!sizing.ok()) return sizing.status();
    planner::Plan plan;
    for (int rep = 0; rep < 2; ++rep) {  // twice: a policy with history settles on its 2nd plan
      MOONEP_RETURN_IF_ERROR((*sizing)->MakePlan(routing_.counts, &plan));
      for (int64_t rows : plan.rank_rows) capacity_ = std::max(capacity_, rows);
    }
    slots_ = plan.slots;
  }
  capacity_ = std::max<int64_t>(capacity_, 1);
  recv_rows_.resize(static_cast<size_t>(capacity_) * row_bytes_);
  recv_w_.resize(static_cast<size_t>(capacity_));
  bwd_rows_.resize(recv_rows_.size());
  MOONEP_RETURN_IF_ERROR(SetupBlocks());
  if (device_) MOONEP_RETURN_IF_ERROR(SetupDevice());
  if (a2a_) MOONEP_RETURN_IF_ERROR(SetupA2a());
  if (layer_) MOONEP_RETURN_IF_ERROR(SetupLayers());
  return absl::OkStatus();
}

absl::Status Runner::SetupDevice() {
  // Inputs uploaded once; outputs sized like their host twins. The expert blocks' views point at
  // device memory (the dummy block stands for slots and home gradients the plan does not use).
  const int32_t* ids = routing_.ids_of(rank_);
  MOONEP_RETURN_IF_ERROR(d_ids_.Allocate(static_cast<size_t>(T_ * K_) * sizeof(int32_t)));
  MOONEP_RETURN_IF_ERROR(d_ids_.Upload(ids, d_ids_.bytes()));
  MOONEP_RETURN_IF_ERROR(d_topk_w_.Allocate(topk_w_.size() * sizeof(float)));
  MOONEP_RETURN_IF_ERROR(d_topk_w_.Upload(topk_w_.data(), d_topk_w_.bytes()));
  MOONEP_RETURN_IF_ERROR(d_x_.Allocate(x_.size()));
  MOONEP_RETURN_IF_ERROR(d_x_.Upload(x_.data(), x_.size()));
  MOONEP_RETURN_IF_ERROR(d_y_.Allocate(y_.size()));
  MOONEP_RETURN_IF_ERROR(d_rows_.Allocate(recv_rows_.size()));
  MOONEP_RETURN_IF_ERROR(d_rows_w_.Allocate(recv_w_.size() * sizeof(float)));
  MOONEP_RETURN_IF_ERROR(d_bwd_rows_.Allocate(bwd_rows_.size()));
  MOONEP_RETURN_IF_ERROR(d_bwd_dx_.Allocate(bwd_dx_.size()));
  MOONEP_RETURN_IF_ERROR(d_bwd_dtopk_.Allocate(bwd_dtopk_.size() * sizeof(float)));
  MOONEP_RETURN_IF_ERROR(d_home_w_.Allocate(home_weights_.size()));
  MOONEP_RETURN_IF_ERROR(d_home_w_.Upload(home_weights_.data(), home_weights_.size()));
  MOONEP_RETURN_IF_ERROR(d_dummy_w_.Allocate(dummy_weights_.size()));
  MOONEP_RETURN_IF_ERROR(d_dummy_g_.Allocate(dummy_grads_.size() * sizeof(float)));
  d_slot_w_.resize(static_cast<size_t>(slots_));
  d_slot_g_.resize(static_cast<size_t>(slots_));
  d_home_g_.resize(static_cast<size_t>(epn_));
  const size_t expert_elems = 3 * param_elems_[0];
  for (int32_t g = 0; g < epn_; ++g) {
    for (int m = 0; m < kParams; ++m) {
      const size_t at = (static_cast<size_t>(g) * expert_elems + m * param_elems_[0]) * ds_;
      TensorView& w = home_w_views_[g * kParams + m];
      w.data = static_cast<char*>(d_home_w_.get()) + at;
      w.device = Device::kCuda;
      home_g_views_[g * kParams + m].data = d_dummy_g_.get();
      home_g_views_[g * kParams + m].device = Device::kCuda;
    }
  }
  for (TensorView& v : slot_w_views_) {
    v.data = d_dummy_w_.get();
    v.device = Device::kCuda;
  }
  for (TensorView& v : slot_g_views_) {
    v.data = d_dummy_g_.get();
    v.device = Device::kCuda;
  }
  return DeviceSynchronize();
}

absl::Status Runner::SetupBlocks() {
  param_elems_[0] = param_elems_[1] = param_elems_[2] = static_cast<size_t>(H_ * I_);
  const size_t expert_elems = 3 * param_elems_[0];
  home_weights_.resize(static_cast<size_t>(epn_) * expert_elems * ds_);
  home_grads_.assign(static_cast<size_t>(epn_), {});
  home_grads_init_.assign(static_cast<size_t>(epn_), {});
  expected_home_g_.assign(static_cast<size_t>(epn_), {});
  for (int32_t g = 0; g < epn_; ++g) {
    const int32_t e = rank_ * epn_ + g;
    for (int m = 0; m < kParams; ++m) {
      const size_t at = (static_cast<size_t>(g) * kParams + m) * param_elems_[m];
      FillWeights(e, m, H_, I_, c_.dtype, static_cast<int64_t>(param_elems_[m]),
                  home_weights_.data() + at * ds_);
    }
  }
  dummy_weights_.resize(param_elems_[0] * ds_);
  dummy_grads_.resize(param_elems_[0]);
  slot_weights_.assign(static_cast<size_t>(slots_), {});
  slot_grads_.assign(static_cast<size_t>(slots_), {});
  slot_filled_for_.assign(static_cast<size_t>(slots_), -1);
  expected_slot_w_.assign(static_cast<size_t>(slots_), {});
  // gate and up are [H, I], down is [I, H].
  auto view = [&](void* data, DType dtype, int m) {
    return m == 2 ? TensorView::Contiguous(data, dtype, {I_, H_})
                  : TensorView::Contiguous(data, dtype, {H_, I_});
  };
  for (int32_t g = 0; g < epn_; ++g) {
    for (int m = 0; m < kParams; ++m) {
      const size_t at = (static_cast<size_t>(g) * kParams + m) * param_elems_[m];
      home_w_views_.push_back(view(home_weights_.data() + at * ds_, c_.dtype, m));
      home_g_views_.push_back(view(dummy_grads_.data(), DType::kFloat32, m));
    }
  }
  for (int32_t s = 0; s < slots_; ++s) {
    for (int m = 0; m < kParams; ++m) {
      slot_w_views_.push_back(view(dummy_weights_.data(), c_.dtype, m));
      slot_g_views_.push_back(view(dummy_grads_.data(), DType::kFloat32, m));
    }
  }
  return absl::OkStatus();
}

// Storage and expected values for the replica slots this plan uses on this rank (made outside
// the timed region; a fixed routing gives the same plan every iteration, so this runs once).
absl::Status Runner::EnsureSlots(const planner::Plan& plan) {
  if (plan.slots != slots_) return Internal("plan has %d slots, set up for %d", plan.slots, slots_);
  if (plan.slot_expert == expected_map_) return absl::OkStatus();
  const size_t expert_elems = 3 * param_elems_[0];
  for (int32_t s = 0; s < slots_; ++s) {
    const int32_t e = plan.slot_expert[static_cast<size_t>(rank_) * slots_ + s];
    if (e < 0) continue;
    if (slot_weights_[s].empty()) {
      slot_weights_[s].resize(expert_elems * ds_);
      slot_grads_[s].resize(expert_elems);
      expected_slot_w_[s].resize(expert_elems * ds_);
      char* w = slot_weights_[s].data();
      char* g = reinterpret_cast<char*>(slot_grads_[s].data());
      if (device_) {
        MOONEP_RETURN_IF_ERROR(d_slot_w_[s].Allocate(slot_weights_[s].size()));
        MOONEP_RETURN_IF_ERROR(d_slot_g_[s].Allocate(slot_grads_[s].size() * sizeof(float)));
        w = static_cast<char*>(d_slot_w_[s].get());
        g = static_cast<char*>(d_slot_g_[s].get());
      }
      for (int m = 0; m < kParams; ++m) {
        const size_t at = m * param_elems_[0];
        slot_w_views_[s * kParams + m].data = w + at * ds_;
        slot_g_views_[s * kParams + m].data = g + at * sizeof(float);
      }
    }
    if (slot_filled_for_[s] != e) {
      for (int m = 0; m < kParams; ++m) {
        const size_t at = m * param_elems_[0];
        FillWeights(e, m, H_, I_, c_.dtype, static_cast<int64_t>(param_elems_[m]),
                    expected_slot_w_[s].data() + at * ds_);
        for (size_t i = 0; i < param_elems_[m]; ++i) {
          slot_grads_[s][at + i] = SlotGradValue(rank_, e, m, static_cast<int64_t>(i));
        }
      }
      if (device_) {
        MOONEP_RETURN_IF_ERROR(
            d_slot_g_[s].Upload(slot_grads_[s].data(), slot_grads_[s].size() * sizeof(float)));
      }
      slot_filled_for_[s] = e;
    }
  }
  // Reduction: home gradient + every replica's, exact in fp32 (small dyadic values).
  for (int32_t g = 0; g < epn_; ++g) expected_home_g_[g] = home_grads_init_[g];
  for (int32_t d = 0; d < R_; ++d) {
    for (int32_t s = 0; s < slots_; ++s) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * slots_ + s];
      if (e < 0 || plan.home[e] != rank_) continue;
      const int32_t g = plan.home_group[e];
      if (home_grads_[g].empty()) {
        home_grads_[g].resize(expert_elems);
        home_grads_init_[g].resize(expert_elems);
        float* base = home_grads_[g].data();
        if (device_) {
          MOONEP_RETURN_IF_ERROR(d_home_g_[g].Allocate(expert_elems * sizeof(float)));
          base = static_cast<float*>(d_home_g_[g].get());
        }
        for (int m = 0; m < kParams; ++m) {
          const size_t at = m * param_elems_[0];
          for (size_t i = 0; i < param_elems_[m]; ++i) {
            home_grads_init_[g][at + i] = HomeGradValue(e, m, static_cast<int64_t>(i));
          }
          home_g_views_[g * kParams + m].data = base + at;
        }
        expected_home_g_[g] = home_grads_init_[g];
      }
      for (int m = 0; m < kParams; ++m) {
        const size_t at = m * param_elems_[0];
        for (size_t i = 0; i < param_elems_[m]; ++i) {
          expected_home_g_[g][at + i] += SlotGradValue(d, e, m, static_cast<int64_t>(i));
        }
      }
    }
  }
  expected_map_ = plan.slot_expert;
  return absl::OkStatus();
}

absl::Status Runner::SetupA2a() {
  MPI_Comm_dup(comm_, &a2a_comm_);
  if (row_bytes_ > static_cast<size_t>(INT32_MAX)) return InvalidArgument("--hidden: row too large");
  MPI_Type_contiguous(static_cast<int>(row_bytes_), MPI_BYTE, &row_type_);
  MPI_Type_commit(&row_type_);
  a2a_scount_.assign(R_, 0);
  a2a_rcount_.assign(R_, 0);
  a2a_sdispl_.assign(R_, 0);
  a2a_rdispl_.assign(R_, 0);
  // Send: every (token, k) entry to its expert's home rank, by destination, then token and k.
  const int32_t* ids = routing_.ids_of(rank_);
  for (int64_t i = 0; i < T_ * K_; ++i) ++a2a_scount_[ids[i] / epn_];
  for (int32_t d = 1; d < R_; ++d) a2a_sdispl_[d] = a2a_sdispl_[d - 1] + a2a_scount_[d - 1];
  std::vector<int> at(a2a_sdispl_);
  a2a_send_entry_.resize(static_cast<size_t>(T_ * K_));
  a2a_where_.resize(a2a_send_entry_.size());
  for (int64_t i = 0; i < T_ * K_; ++i) {
    a2a_where_[i] = at[ids[i] / epn_];
    a2a_send_entry_[at[ids[i] / epn_]++] = static_cast<int32_t>(i);
  }
  a2a_send_.resize(static_cast<size_t>(T_ * K_) * row_bytes_);
  // Receive: from each source, its entries whose expert lives here, in the source's order.
  for (int32_t s = 0; s < R_; ++s) {
    const int32_t* sid = routing_.ids_of(s);
    for (int64_t i = 0; i < T_ * K_; ++i) {
      if (sid[i] / epn_ == rank_) {
        ++a2a_rcount_[s];
        a2a_recv_src_.push_back(s);
        a2a_recv_token_.push_back(i / K_);
      }
    }
  }
  for (int32_t s = 1; s < R_; ++s) a2a_rdispl_[s] = a2a_rdispl_[s - 1] + a2a_rcount_[s - 1];
  a2a_recv_.resize(std::max<size_t>(a2a_recv_src_.size(), 1) * row_bytes_);
  if (device_) {
    // The NCCL form sends the same rows, packed by destination once here (as nccl-tests'
    // alltoall, the timed region is the exchange alone), over its own NCCL communicator.
    for (size_t i = 0; i < a2a_send_entry_.size(); ++i) {
      std::memcpy(a2a_send_.data() + i * row_bytes_,
                  x_.data() + static_cast<size_t>(a2a_send_entry_[i] / K_) * row_bytes_, row_bytes_);
    }
    a2a_back_.resize(a2a_send_.size());
    MOONEP_RETURN_IF_ERROR(d_a2a_send_.Allocate(a2a_send_.size()));
    MOONEP_RETURN_IF_ERROR(d_a2a_send_.Upload(a2a_send_.data(), a2a_send_.size()));
    MOONEP_RETURN_IF_ERROR(d_a2a_recv_.Allocate(a2a_recv_.size()));
    MOONEP_RETURN_IF_ERROR(d_a2a_back_.Allocate(a2a_send_.size()));
    MOONEP_RETURN_IF_ERROR(nccl_a2a_.Init(comm_));
  }
  return absl::OkStatus();
}

absl::Status Runner::SetupLayers() {
  runtime::LayerConfig lc;
  lc.num_experts = E_;
  lc.top_k = K_;
  lc.hidden = H_;
  lc.intermediate = I_;
  lc.dtype = c_.dtype;
  lc.grad_dtype = DType::kFloat32;
  lc.slots = c_.slots;
  lc.pad_multiple = c_.pad_multiple;
  lc.max_tokens = T_;
  lc.max_recv_rows = capacity_;
  lc.num_threads = c_.threads;
  // The layer rows measure the configuration's backend (not MOONEP_TRANSPORT or the default).
  lc.transport = c_.backend;
  const size_t expert_elems = 3 * param_elems_[0];
  const size_t gbuf_elems = static_cast<size_t>(epn_) * expert_elems;
  if (device_) {
    // Device cuda: the CUDA executor and the NCCL transport on this rank's GPU; every tensor the
    // layer sees is device memory, allocated (and uploaded) here once. The weights are the home
    // blocks SetupDevice uploaded (home_w_views_ point there).
    lc.device = Device::kCuda;
    lc.device_index = CurrentDevice();
    MOONEP_RETURN_IF_ERROR(d_gbuf_measured_.Allocate(gbuf_elems * sizeof(float)));
    if (run_none_) MOONEP_RETURN_IF_ERROR(d_gbuf_none_.Allocate(gbuf_elems * sizeof(float)));
  } else {
    gbuf_measured_.assign(gbuf_elems, 0.0f);
    if (run_none_) gbuf_none_.assign(gbuf_elems, 0.0f);
  }
  const Device where = device_ ? Device::kCuda : Device::kCpu;
  for (int32_t g = 0; g < epn_; ++g) {
    compute::ExpertParams w, gm, gn;
    w.gate = home_w_views_[g * kParams + 0];
    w.up = home_w_views_[g * kParams + 1];
    w.down = home_w_views_[g * kParams + 2];
    layer_params_.push_back(w);
    auto grads = [&](std::vector<float>& buf, DeviceBuffer& dev) {
      compute::ExpertParams p;
      float* base = (device_ ? static_cast<float*>(dev.get()) : buf.data()) +
                    static_cast<size_t>(g) * expert_elems;
      p.gate = TensorView::Contiguous(base, DType::kFloat32, {H_, I_}, where);
      p.up = TensorView::Contiguous(base + param_elems_[0], DType::kFloat32, {H_, I_}, where);
      p.down = TensorView::Contiguous(base + 2 * param_elems_[0], DType::kFloat32, {I_, H_}, where);
      return p;
    };
    grads_measured_.push_back(grads(gbuf_measured_, d_gbuf_measured_));
    if (run_none_) grads_none_.push_back(grads(gbuf_none_, d_gbuf_none_));
  }
  lc.policy = c_.policy;
  MOONEP_ASSIGN_OR_RETURN(layer_measured_, runtime::MoeLayer::Create(rt_, lc));
  MOONEP_RETURN_IF_ERROR(layer_measured_->BindParameters(layer_params_, grads_measured_));
  if (run_none_) {
    lc.policy = planner::Policy::kNone;
    MOONEP_ASSIGN_OR_RETURN(layer_none_, runtime::MoeLayer::Create(rt_, lc));
    MOONEP_RETURN_IF_ERROR(layer_none_->BindParameters(layer_params_, grads_none_));
  }
  dy_.resize(x_.size());
  dx_.resize(x_.size());
  dtopk_.resize(static_cast<size_t>(T_ * K_));
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t col = 0; col < H_; ++col) {
      StoreFromFloat(dy_.data(), c_.dtype, static_cast<size_t>(t * H_ + col),
                     GradValue(rank_, t, col));
    }
  }
  if (device_) {
    MOONEP_RETURN_IF_ERROR(d_dy_.Allocate(dy_.size()));
    MOONEP_RETURN_IF_ERROR(d_dy_.Upload(dy_.data(), dy_.size()));
    MOONEP_RETURN_IF_ERROR(d_dx_.Allocate(dx_.size()));
    MOONEP_RETURN_IF_ERROR(d_dtopk_.Allocate(dtopk_.size() * sizeof(float)));
    y_measured_.resize(y_.size());
  }

  // The fp64 reference on the first check_tokens tokens: one single-expert problem per (t, k).
  sample_ = std::min<int64_t>(T_, std::max(0, c_.check_tokens));
  y_ref_.assign(static_cast<size_t>(sample_ * H_), 0.0);
  dx_ref_.assign(y_ref_.size(), 0.0);
  dtopk_ref_.assign(static_cast<size_t>(sample_ * K_), 0.0);
  dtopk_mag_.assign(static_cast<size_t>(sample_ * K_), 0.0);
  const int32_t* ids = routing_.ids_of(rank_);
  std::vector<std::pair<int32_t, int64_t>> pairs;  // (expert, t * K + k), grouped by expert
  for (int64_t i = 0; i < sample_ * K_; ++i) pairs.push_back({ids[i], i});
  std::sort(pairs.begin(), pairs.end());
  reference::MoeShape shape{1, 1, H_, I_};
  reference::ExpertWeights w;
  int32_t loaded = -1;
  for (const auto& [e, i] : pairs) {
    if (e != loaded) {
      std::vector<double>* parts[kParams] = {&w.wg, &w.wu, &w.wd};
      for (int m = 0; m < kParams; ++m) {
        parts[m]->resize(param_elems_[m]);
        for (size_t j = 0; j < param_elems_[m]; ++j) {
          (*parts[m])[j] = RoundTo(c_.dtype, WeightValue(e, m, static_cast<int64_t>(j), H_, I_));
        }
      }
      loaded = e;
    }
    const int64_t t = i / K_;
    std::vector<double> xt(H_), dyt(H_), wt{topk_w_[i]};
    for (int64_t col = 0; col < H_; ++col) {
      xt[col] = TokenValue(rank_, t, col);
      dyt[col] = GradValue(rank_, t, col);
    }
    // The expert's output with weight 1: y is topk_weight times it, and d topk_weights is its dot
    // product with dy.
    reference::ForwardResult fr;
    reference::BackwardResult br;
    MOONEP_RETURN_IF_ERROR(reference::Forward(shape, w, 1, xt, {0}, {1.0}, &fr));
    MOONEP_RETURN_IF_ERROR(reference::Backward(shape, w, 1, xt, {0}, wt, dyt, &br));
    double mag = 0;
    for (int64_t col = 0; col < H_; ++col) {
      y_ref_[t * H_ + col] += wt[0] * fr.y[col];
      dx_ref_[t * H_ + col] += br.dx[col];
      mag += std::abs(dyt[col] * fr.y[col]);
    }
    dtopk_ref_[i] = br.dtopk_weights[0];
    dtopk_mag_[i] = mag;
  }
  return absl::OkStatus();
}

// Rows (and, unless null, row weights) of this rank's compute layout against what every source's
// tokens must have put there.
int64_t Runner::CheckDispatch(const planner::Plan& plan, absl::Span<const int64_t> counts,
                              const char* got_rows, const float* got_weights) {
  std::vector<int64_t> offsets;
  planner::ComputeSourceOffsets(counts, R_, E_, &offsets);
  const int64_t rows = plan.rank_rows[rank_];
  std::vector<char> covered(static_cast<size_t>(rows), 0);
  int64_t wrong = 0;
  std::vector<char> expect(row_bytes_);
  for (int32_t src = 0; src < R_; ++src) {
    const int64_t* begin = tok_begin_.data() + static_cast<size_t>(src) * (E_ + 1);
    transport::ForEachRun(plan, offsets.data(), src, rank_,
                          [&](int32_t, int32_t e, int64_t j0, int64_t row, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = begin[e] + j0 + i, r = row + i;
        const int64_t t = tok_t_[at];
        if (r < 0 || r >= rows || at >= begin[e + 1]) {
          ++wrong;
          continue;
        }
        covered[r] = 1;
        const uint64_t key = TokenKey(src, t);
        for (int64_t col = 0; col < H_; ++col) {
          StoreFromFloat(expect.data(), c_.dtype, static_cast<size_t>(col), TokenValueOfKey(key, col));
        }
        if (std::memcmp(expect.data(), got_rows + r * row_bytes_, row_bytes_) != 0 ||
            (got_weights != nullptr && got_weights[r] != TopkWeightValue(src, t, tok_k_[at]))) {
          ++wrong;
        }
      }
    });
  }
  std::fill(expect.begin(), expect.end(), 0);
  for (int64_t r = 0; r < rows; ++r) {  // padding: zero rows, zero weights
    if (covered[r]) continue;
    if (std::memcmp(expect.data(), got_rows + r * row_bytes_, row_bytes_) != 0 ||
        (got_weights != nullptr && got_weights[r] != 0.0f)) {
      ++wrong;
    }
  }
  return wrong;
}

int64_t Runner::CountWrongA2aRows() const {
  int64_t wrong = 0;
  std::vector<char> expect(row_bytes_);
  for (size_t i = 0; i < a2a_recv_src_.size(); ++i) {
    const uint64_t key = TokenKey(static_cast<int32_t>(a2a_recv_src_[i]), a2a_recv_token_[i]);
    for (int64_t col = 0; col < H_; ++col) {
      StoreFromFloat(expect.data(), c_.dtype, static_cast<size_t>(col), TokenValueOfKey(key, col));
    }
    if (std::memcmp(expect.data(), a2a_recv_.data() + i * row_bytes_, row_bytes_) != 0) ++wrong;
  }
  return wrong;
}

int64_t Runner::CountWrongBackwardSample(int64_t* checked) {
  std::vector<double> got(static_cast<size_t>(sample_ * H_));
  for (size_t i = 0; i < got.size(); ++i) got[i] = LoadAsFloat(dx_.data(), c_.dtype, i);
  int64_t wrong = CountOutside(got, dx_ref_, tol_, "layer-bwd dx");
  std::vector<double> gotw(dtopk_.begin(), dtopk_.begin() + sample_ * K_);
  wrong += CountOutside(gotw, dtopk_ref_, tol_, "layer-bwd d topk_weights", &dtopk_mag_);
  *checked += static_cast<int64_t>(got.size() + gotw.size());
  return wrong;
}

int64_t Runner::CheckPrefetch(const planner::Plan& plan) {
  int64_t wrong = 0;
  for (int32_t s = 0; s < slots_; ++s) {
    if (plan.slot_expert[static_cast<size_t>(rank_) * slots_ + s] < 0) continue;
    for (int m = 0; m < kParams; ++m) {
      const size_t at = m * param_elems_[0] * ds_, bytes = param_elems_[m] * ds_;
      if (std::memcmp(slot_weights_[s].data() + at, expected_slot_w_[s].data() + at, bytes) != 0) {
        ++wrong;
      }
    }
  }
  return wrong;
}

int64_t Runner::CheckReduce(const planner::Plan& plan) {
  (void)plan;
  int64_t wrong = 0;
  const size_t n = param_elems_[0];
  for (int32_t g = 0; g < epn_; ++g) {
    if (home_grads_[g].empty()) continue;
    for (int m = 0; m < kParams; ++m) {
      if (std::memcmp(home_grads_[g].data() + m * n, expected_home_g_[g].data() + m * n,
                      n * sizeof(float)) != 0) {
        ++wrong;
      }
    }
  }
  return wrong;
}

absl::Status Runner::TransportPipeline(bool measured, bool record) {
  Pipeline& p = measured ? measured_ : none_;
  transport::Transport* tr = p.transport.get();
  const int32_t* ids = device_ ? static_cast<const int32_t*>(d_ids_.get()) : routing_.ids_of(rank_);
  const absl::Span<const float> topk_w(Data(topk_w_, d_topk_w_), topk_w_.size());
  const TensorView x = Matrix(Data(x_, d_x_), T_, H_);
  const TensorView y = Matrix(Data(y_, d_y_), T_, H_);
  const TensorView rows = Matrix(Data(recv_rows_, d_rows_), capacity_, H_);
  const TensorView bwd_rows = Matrix(Data(bwd_rows_, d_bwd_rows_), capacity_, H_);
  const TensorView bwd_dx = Matrix(Data(bwd_dx_, d_bwd_dx_), T_, H_);

  // Count exchange: with nccl it includes the transport's device-to-host copies of the counts.
  MOONEP_RETURN_IF_ERROR(Timed(Key("counts", measured), record, [&] {
    return tr->ExchangeCounts(absl::MakeConstSpan(ids, static_cast<size_t>(T_ * K_)), T_, K_, E_,
                              capacity_, &p.handle);
  }));
  {
    int64_t wrong = 0;
    for (size_t i = 0; i < routing_.counts.size(); ++i) {
      wrong += p.handle.counts()[i] != routing_.counts[i];
    }
    Count(Key("counts", measured), wrong, static_cast<int64_t>(routing_.counts.size()));
  }

  // Planning runs on the host whatever the backend.
  MOONEP_RETURN_IF_ERROR(Timed(Key("plan", measured), record,
                               [&] { return p.planner->MakePlan(p.handle.counts(), &p.plan); }));
  {
    // A plan is right when it keeps every invariant and every rank made the same bytes.
    int64_t wrong = planner::ValidatePlan(p.plan, p.handle.counts()).ok() ? 0 : 1;
    const std::string bytes = planner::SerializePlan(p.plan);
    uint64_t h = 1469598103934665603ull;
    for (char ch : bytes) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
    uint64_t lo = h, hi = h;
    MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, comm_);
    MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, comm_);
    if (lo != hi) ++wrong;
    Count(Key("plan", measured), wrong, 1);
  }

  if (measured) {
    MOONEP_RETURN_IF_ERROR(EnsureSlots(p.plan));
    for (size_t s = 0; s < slot_weights_.size(); ++s) {
      if (!slot_weights_[s].empty()) MOONEP_RETURN_IF_ERROR(PoisonOutput(slot_weights_[s], d_slot_w_[s]));
    }
    const ExpertBlocks params{kParams, home_w_views_, slot_w_views_};
    MOONEP_RETURN_IF_ERROR(
        Timed(Key("prefetch", true), record, [&] { return tr->Prefetch(p.plan, params); }));
    bool corrupted = false;
    for (size_t s = 0; s < slot_weights_.size(); ++s) {
      if (slot_weights_[s].empty()) continue;
      MOONEP_RETURN_IF_ERROR(Fetch(slot_weights_[s], d_slot_w_[s], slot_weights_[s].size()));
      if (!corrupted) MaybeCorrupt("prefetch", slot_weights_[s].data(), slot_weights_[s].size());
      corrupted = true;
    }
    if (check_) Count(Key("prefetch", true), CheckPrefetch(p.plan), p.plan.stats.replicas * kParams);
    if (a2a_ && !device_) {  // the same bytes into the same slots: what the check saw stays
      MOONEP_RETURN_IF_ERROR(Timed("prefetch/" + a2a_impl_, record, [&] { return StarPrefetch(p.plan); }));
    }
  }

  const int64_t my_rows = p.plan.rank_rows[rank_];
  MOONEP_RETURN_IF_ERROR(PoisonOutput(recv_rows_, d_rows_));
  MOONEP_RETURN_IF_ERROR(PoisonOutput(recv_w_, d_rows_w_));
  MOONEP_RETURN_IF_ERROR(Timed(Key("dispatch", measured), record, [&] {
    return tr->Dispatch(p.plan, x, topk_w, &p.handle, rows,
                        absl::MakeSpan(Data(recv_w_, d_rows_w_), recv_w_.size()));
  }));
  MOONEP_RETURN_IF_ERROR(Fetch(recv_rows_, d_rows_, static_cast<size_t>(my_rows) * row_bytes_));
  MOONEP_RETURN_IF_ERROR(Fetch(recv_w_, d_rows_w_, static_cast<size_t>(my_rows)));
  MaybeCorrupt("dispatch", recv_rows_.data(), static_cast<size_t>(my_rows) * row_bytes_);
  if (check_) {
    Count(Key("dispatch", measured),
          CheckDispatch(p.plan, p.handle.counts(), recv_rows_.data(), recv_w_.data()), my_rows);
  }

  // Identity experts: combine must give sum_k w[t,k] x[t] (exact, so bit for bit).
  MOONEP_RETURN_IF_ERROR(PoisonOutput(y_, d_y_));
  MOONEP_RETURN_IF_ERROR(
      Timed(Key("combine", measured), record, [&] { return tr->Combine(&p.handle, rows, y); }));
  MOONEP_RETURN_IF_ERROR(Fetch(y_, d_y_, y_.size()));
  MaybeCorrupt("combine", y_.data(), y_.size());
  if (check_) {
    Count(Key("combine", measured),
          CountWrongRows(y_.data(), expected_y_.data(), T_, row_bytes_), T_);
  }

  // Backward forms with dy = x: combine-backward dispatches it again with the saved layout.
  MOONEP_RETURN_IF_ERROR(PoisonOutput(bwd_rows_, d_bwd_rows_));
  MOONEP_RETURN_IF_ERROR(Timed(Key("combine-bwd", measured), record, [&] {
    return tr->CombineBackward(&p.handle, x, bwd_rows);
  }));
  MOONEP_RETURN_IF_ERROR(Fetch(bwd_rows_, d_bwd_rows_, static_cast<size_t>(my_rows) * row_bytes_));
  if (check_) {
    Count(Key("combine-bwd", measured),
          CheckDispatch(p.plan, p.handle.counts(), bwd_rows_.data(), nullptr), my_rows);
  }

  // d topk_weights[t, k] = <dy[t], out(t, k)> = <x[t], x[t]> with identity experts.
  MOONEP_RETURN_IF_ERROR(PoisonOutput(bwd_dtopk_, d_bwd_dtopk_));
  MOONEP_RETURN_IF_ERROR(Timed(Key("topk-grad", measured), record, [&] {
    return tr->TopkWeightGrad(&p.handle, bwd_rows, rows,
                              absl::MakeSpan(Data(bwd_dtopk_, d_bwd_dtopk_), bwd_dtopk_.size()));
  }));
  MOONEP_RETURN_IF_ERROR(Fetch(bwd_dtopk_, d_bwd_dtopk_, bwd_dtopk_.size()));
  {
    int64_t wrong = 0;
    for (size_t i = 0; i < bwd_dtopk_.size(); ++i) {
      if (std::memcmp(&bwd_dtopk_[i], &expected_dtopk_[i], sizeof(float)) != 0) ++wrong;
    }
    Count(Key("topk-grad", measured), wrong, static_cast<int64_t>(bwd_dtopk_.size()));
  }

  // dispatch-backward of the dispatched rows: dx[t] = sum over t's valid k of x[t].
  MOONEP_RETURN_IF_ERROR(PoisonOutput(bwd_dx_, d_bwd_dx_));
  MOONEP_RETURN_IF_ERROR(Timed(Key("dispatch-bwd", measured), record, [&] {
    return tr->DispatchBackward(&p.handle, rows, bwd_dx);
  }));
  MOONEP_RETURN_IF_ERROR(Fetch(bwd_dx_, d_bwd_dx_, bwd_dx_.size()));
  if (check_) {
    Count(Key("dispatch-bwd", measured),
          CountWrongRows(bwd_dx_.data(), expected_dx_.data(), T_, row_bytes_), T_);
  }

  if (measured) {
    if (check_) {  // known home gradients to check the sums against (unchecked: they accumulate)
      for (int32_t g = 0; g < epn_; ++g) {
        if (home_grads_[g].empty()) continue;
        home_grads_[g] = home_grads_init_[g];  // same size: no allocation
        if (device_) {
          MOONEP_RETURN_IF_ERROR(
              d_home_g_[g].Upload(home_grads_[g].data(), home_grads_[g].size() * sizeof(float)));
        }
      }
    }
    const ExpertBlocks grads{kParams, home_g_views_, slot_g_views_};
    MOONEP_RETURN_IF_ERROR(
        Timed(Key("reduce", true), record, [&] { return tr->Reduce(p.plan, grads); }));
    bool corrupted = false;
    for (int32_t g = 0; g < epn_; ++g) {
      if (home_grads_[g].empty()) continue;
      MOONEP_RETURN_IF_ERROR(Fetch(home_grads_[g], d_home_g_[g], home_grads_[g].size()));
      if (!corrupted) {
        MaybeCorrupt("reduce", home_grads_[g].data(), home_grads_[g].size() * sizeof(float));
      }
      corrupted = true;
    }
    int64_t blocks = 0;
    for (const auto& g : home_grads_) blocks += g.empty() ? 0 : kParams;
    if (check_) Count(Key("reduce", true), CheckReduce(p.plan), blocks);
    if (a2a_ && !device_) {
      MOONEP_RETURN_IF_ERROR(Timed("reduce/" + a2a_impl_, record, [&] { return StarReduce(p.plan); }));
    }
  }
  return absl::OkStatus();
}

absl::Status Runner::StarPrefetch(const planner::Plan& plan) {
  const size_t bytes = 3 * param_elems_[0] * ds_;
  MOONEP_CHECK_ARG(bytes <= static_cast<size_t>(INT_MAX), "prefetch baseline: an expert of %d bytes",
                   bytes);
  std::vector<MPI_Request> requests;
  for (int32_t d = 0; d < R_; ++d) {
    for (int32_t s = 0; s < plan.slots; ++s) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * plan.slots + s];
      if (e < 0) continue;
      const int32_t h = plan.home[e];
      MPI_Request r;
      if (h == rank_) {
        const char* src = home_weights_.data() + static_cast<size_t>(plan.home_group[e]) * bytes;
        MPI_Isend(src, static_cast<int>(bytes), MPI_BYTE, d, 7, a2a_comm_, &r);
        requests.push_back(r);
      } else if (d == rank_) {
        MPI_Irecv(slot_weights_[static_cast<size_t>(s)].data(), static_cast<int>(bytes), MPI_BYTE, h, 7,
                  a2a_comm_, &r);
        requests.push_back(r);
      }
    }
  }
  const int rc = MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
  return rc == MPI_SUCCESS ? absl::OkStatus() : Internal("prefetch baseline: MPI_Waitall failed (%d)", rc);
}

absl::Status Runner::StarReduce(const planner::Plan& plan) {
  const size_t elems = 3 * param_elems_[0];
  MOONEP_CHECK_ARG(elems <= static_cast<size_t>(INT_MAX), "reduce baseline: an expert of %d elements",
                   elems);
  std::vector<MPI_Request> requests;
  std::vector<std::pair<int32_t, size_t>> sums;  // (home group, first received buffer), per sum
  size_t used = 0;
  for (int32_t e = 0; e < E_; ++e) {
    if (plan.home[e] != rank_) continue;
    const size_t first = used;
    for (int32_t d = 0; d < R_; ++d) {
      for (int32_t s = 0; s < plan.slots; ++s) {
        if (plan.slot_expert[static_cast<size_t>(d) * plan.slots + s] != e) continue;
        if (star_in_.size() <= used) star_in_.emplace_back(elems);
        MPI_Request r;
        MPI_Irecv(star_in_[used++].data(), static_cast<int>(elems), MPI_FLOAT, d, 8, a2a_comm_, &r);
        requests.push_back(r);
      }
    }
    if (used > first) sums.push_back({plan.home_group[e], first});
  }
  for (int32_t s = 0; s < plan.slots; ++s) {
    const int32_t e = plan.slot_expert[static_cast<size_t>(rank_) * plan.slots + s];
    if (e < 0) continue;
    MPI_Request r;
    MPI_Isend(slot_grads_[static_cast<size_t>(s)].data(), static_cast<int>(elems), MPI_FLOAT,
              plan.home[e], 8, a2a_comm_, &r);
    requests.push_back(r);
  }
  const int rc = MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
  if (rc != MPI_SUCCESS) return Internal("reduce baseline: MPI_Waitall failed (%d)", rc);
  // ((g1 + g2) + ...) + home in fp32, as the transports sum, into a scratch copy.
  star_sum_.resize(elems);
  for (size_t k = 0; k < sums.size(); ++k) {
    const size_t end = k + 1 < sums.size() ? sums[k + 1].second : used;
    const std::vector<float>& home = home_grads_[static_cast<size_t>(sums[k].first)];
    std::copy(star_in_[sums[k].second].begin(), star_in_[sums[k].second].end(), star_sum_.begin());
    for (size_t i = sums[k].second + 1; i < end; ++i) {
      const float* g = star_in_[i].data();
      for (size_t j = 0; j < elems; ++j) star_sum_[j] += g[j];
    }
    if (home.size() == elems) {
      for (size_t j = 0; j < elems; ++j) star_sum_[j] += home[j];
    }
  }
  return absl::OkStatus();
}

absl::Status Runner::A2aPipeline(bool record) {
  // Dispatch as a trainer without MoonEP does it: pack rows by home rank, one MPI_Alltoallv.
  MOONEP_RETURN_IF_ERROR(Timed("dispatch/a2av", record, [&] {
    for (size_t i = 0; i < a2a_send_entry_.size(); ++i) {
      std::memcpy(a2a_send_.data() + i * row_bytes_,
                  x_.data() + static_cast<size_t>(a2a_send_entry_[i] / K_) * row_bytes_, row_bytes_);
    }
    const int rc = MPI_Alltoallv(a2a_send_.data(), a2a_scount_.data(), a2a_sdispl_.data(), row_type_,
                                 a2a_recv_.data(), a2a_rcount_.data(), a2a_rdispl_.data(), row_type_,
                                 a2a_comm_);
    return rc == MPI_SUCCESS ? absl::OkStatus() : Internal("MPI_Alltoallv failed (%d)", rc);
  }));
  if (check_) Count("dispatch/a2av", CountWrongA2aRows(), static_cast<int64_t>(a2a_recv_src_.size()));
  // Combine: identity experts' rows back by the reverse MPI_Alltoallv, then the weighted sum.
  if (check_) {
    Poison(a2a_send_.data(), a2a_send_.size());
    Poison(y_.data(), y_.size());
  }
  std::vector<float> acc(static_cast<size_t>(H_));
  MOONEP_RETURN_IF_ERROR(Timed("combine/a2av", record, [&] {
    const int rc = MPI_Alltoallv(a2a_recv_.data(), a2a_rcount_.data(), a2a_rdispl_.data(), row_type_,
                                 a2a_send_.data(), a2a_scount_.data(), a2a_sdispl_.data(), row_type_,
                                 a2a_comm_);
    if (rc != MPI_SUCCESS) return Internal("MPI_Alltoallv failed (%d)", rc);
    // The K rows of a token are spread over the send order; sum them in token order.
    const std::vector<int32_t>& where = a2a_where_;
    for (int64_t t = 0; t < T_; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int32_t k = 0; k < K_; ++k) {
        const char* row = a2a_send_.data() + static_cast<size_t>(where[t * K_ + k]) * row_bytes_;
        const float w = topk_w_[t * K_ + k];
        for (int64_t col = 0; col < H_; ++col) {
          acc[col] += w * LoadAsFloat(row, c_.dtype, static_cast<size_t>(col));
        }
      }
      ConvertFromFloat(acc.data(), y_.data() + t * row_bytes_, c_.dtype, static_cast<size_t>(H_));
    }
    return absl::OkStatus();
  }));
  if (check_) Count("combine/a2av", CountWrongRows(y_.data(), expected_y_.data(), T_, row_bytes_), T_);
  return absl::OkStatus();
}

absl::Status Runner::NcclA2aPipeline(bool record) {
  // The same rows as the MPI_Alltoallv baseline (per-destination counts of SetupA2a), moved by
  // one grouped ncclSend/ncclRecv round on device buffers, no planning, no dedup.
  if (check_) MOONEP_RETURN_IF_ERROR(d_a2a_recv_.Fill(0xff));
  MOONEP_RETURN_IF_ERROR(Timed("dispatch/" + a2a_impl_, record, [&] {
    return nccl_a2a_.Exchange(d_a2a_send_.get(), a2a_scount_.data(), a2a_sdispl_.data(),
                              d_a2a_recv_.get(), a2a_rcount_.data(), a2a_rdispl_.data(),
                              row_bytes_);
  }));
  if (check_) {
    MOONEP_RETURN_IF_ERROR(
        d_a2a_recv_.Download(a2a_recv_.data(), a2a_recv_src_.size() * row_bytes_));
  }
  if (check_) {
    Count("dispatch/" + a2a_impl_, CountWrongA2aRows(), static_cast<int64_t>(a2a_recv_src_.size()));
  }
  // Combine: the rows back by the reverse exchange (the weighted sum is not part of this
  // baseline); every row must come back to its send position unchanged.
  if (check_) MOONEP_RETURN_IF_ERROR(d_a2a_back_.Fill(0xff));
  MOONEP_RETURN_IF_ERROR(Timed("combine/" + a2a_impl_, record, [&] {
    return nccl_a2a_.Exchange(d_a2a_recv_.get(), a2a_rcount_.data(), a2a_rdispl_.data(),
                              d_a2a_back_.get(), a2a_scount_.data(), a2a_sdispl_.data(),
                              row_bytes_);
  }));
  if (!check_) return absl::OkStatus();
  MOONEP_RETURN_IF_ERROR(d_a2a_back_.Download(a2a_back_.data(), a2a_back_.size()));
  MaybeCorrupt("combine", a2a_back_.data(), a2a_back_.size());
  Count("combine/" + a2a_impl_,
        CountWrongRows(a2a_back_.data(), a2a_send_.data(), T_ * K_, row_bytes_), T_ * K_);
  return absl::OkStatus();
}

absl::Status Runner::LayerStepDevice(bool measured, bool record) {
  // The layer on device memory (device cuda): inputs uploaded once, outputs poisoned on the
  // device before each step and copied back after it (outside the timed region). The legacy
  // default stream is the caller's stream; the device is synchronised inside the timed region.
  runtime::MoeLayer* layer = measured ? layer_measured_.get() : layer_none_.get();
  DeviceBuffer& gbuf = measured ? d_gbuf_measured_ : d_gbuf_none_;
  const TensorView x = Matrix(d_x_.get(), T_, H_);
  const TensorView y = Matrix(d_y_.get(), T_, H_);
  const size_t entries = static_cast<size_t>(T_ * K_);
  const absl::Span<const int32_t> ids(static_cast<const int32_t*>(d_ids_.get()), entries);
  const absl::Span<const float> topk_w(static_cast<const float*>(d_topk_w_.get()), entries);
  MOONEP_RETURN_IF_ERROR(d_y_.Fill(0xff));
  runtime::LayerHandle handle;
  MOONEP_RETURN_IF_ERROR(Timed(Key("layer-fwd", measured), record, [&]() -> absl::Status {
    auto h = layer->Forward(T_, x, ids, topk_w, y, nullptr);
    if (!h.ok()) return h.status();
    handle = *h;
    return DeviceSynchronize();
  }));
  // y: the first sample_ tokens against the fp64 reference; with policy none in the run, the
  // whole y of the measured policy against none's (same inputs and weights: equal to tolerance).
  MOONEP_RETURN_IF_ERROR(d_y_.Download(y_.data(), y_.size()));
  MaybeCorrupt("layer-fwd", y_.data(), static_cast<size_t>(sample_) * row_bytes_);
  std::vector<double> got(static_cast<size_t>(sample_ * H_));
  for (size_t i = 0; i < got.size(); ++i) got[i] = LoadAsFloat(y_.data(), c_.dtype, i);
  int64_t fwd_wrong = CountOutside(got, y_ref_, tol_, "layer-fwd y");
  int64_t fwd_checked = static_cast<int64_t>(got.size());
  if (measured) {
    std::memcpy(y_measured_.data(), y_.data(), y_.size());
    have_y_measured_ = true;
  } else if (have_y_measured_) {
    // As CountOutside(measured, none, tol), without two T*H vectors of doubles per step.
    const size_t n = static_cast<size_t>(T_ * H_);
    double scale = 0;
    for (size_t i = 0; i < n; ++i) {
      scale = std::max(scale, std::abs(static_cast<double>(LoadAsFloat(y_.data(), c_.dtype, i))));
    }
    const double bound = tol_ * std::max(scale, 1e-30);
    for (size_t i = 0; i < n; ++i) {
      const double d = static_cast<double>(LoadAsFloat(y_measured_.data(), c_.dtype, i)) -
                       static_cast<double>(LoadAsFloat(y_.data(), c_.dtype, i));
      if (!(std::abs(d) <= bound)) ++fwd_wrong;  // NaN counts as wrong
    }
    fwd_checked += static_cast<int64_t>(n);
  }
  Count(Key("layer-fwd", measured), fwd_wrong, fwd_checked);

  MOONEP_RETURN_IF_ERROR(gbuf.Fill(0));
  MOONEP_RETURN_IF_ERROR(d_dx_.Fill(0xff));
  MOONEP_RETURN_IF_ERROR(d_dtopk_.Fill(0xff));
  const TensorView dy = Matrix(d_dy_.get(), T_, H_);
  const TensorView dx = Matrix(d_dx_.get(), T_, H_);
  MOONEP_RETURN_IF_ERROR(Timed(Key("layer-bwd", measured), record, [&]() -> absl::Status {
    MOONEP_RETURN_IF_ERROR(layer->Backward(
        handle, dy, dx, absl::MakeSpan(static_cast<float*>(d_dtopk_.get()), entries), nullptr));
    return DeviceSynchronize();
  }));
  MOONEP_RETURN_IF_ERROR(d_dx_.Download(dx_.data(), static_cast<size_t>(sample_) * row_bytes_));
  MOONEP_RETURN_IF_ERROR(
      d_dtopk_.Download(dtopk_.data(), static_cast<size_t>(sample_ * K_) * sizeof(float)));
  int64_t checked = 0;
  int64_t wrong = CountWrongBackwardSample(&checked);
  if (!measured) {
    // Weight gradients do not depend on the plan: the head of each of home expert 0's three
    // gradient blocks (at most 64K floats each; all of it would be gigabytes per step), measured
    // policy against none.
    const size_t n = std::min<size_t>(param_elems_[0], 65536);
    std::vector<float> ga(n), gb(n);
    std::vector<double> a, b;
    for (int m = 0; m < kParams; ++m) {
      const size_t off = m * param_elems_[0] * sizeof(float);
      MOONEP_RETURN_IF_ERROR(d_gbuf_measured_.DownloadRange(off, ga.data(), n * sizeof(float)));
      MOONEP_RETURN_IF_ERROR(d_gbuf_none_.DownloadRange(off, gb.data(), n * sizeof(float)));
      a.insert(a.end(), ga.begin(), ga.end());
      b.insert(b.end(), gb.begin(), gb.end());
    }
    wrong += CountOutside(a, b, tol_, "layer-bwd weight gradients against policy none's");
    checked += static_cast<int64_t>(a.size());
  }
  Count(Key("layer-bwd", measured), wrong, checked);
  return absl::OkStatus();
}

absl::Status Runner::LayerStep(bool measured, bool record) {
  if (device_) return LayerStepDevice(measured, record);
  runtime::MoeLayer* layer = measured ? layer_measured_.get() : layer_none_.get();
  std::vector<float>& gbuf = measured ? gbuf_measured_ : gbuf_none_;
  const TensorView x = TensorView::Contiguous(x_.data(), c_.dtype, {T_, H_});
  const TensorView y = TensorView::Contiguous(y_.data(), c_.dtype, {T_, H_});
  const int32_t* ids = routing_.ids_of(rank_);
  Poison(y_.data(), y_.size());
  runtime::LayerHandle handle;
  MOONEP_RETURN_IF_ERROR(Timed(Key("layer-fwd", measured), record, [&]() -> absl::Status {
    auto h = layer->Forward(T_, x, absl::MakeConstSpan(ids, static_cast<size_t>(T_ * K_)), topk_w_, y);
    if (!h.ok()) return h.status();
    handle = *h;
    return absl::OkStatus();
  }));
  MaybeCorrupt("layer-fwd", y_.data(), static_cast<size_t>(sample_) * row_bytes_);
  std::vector<double> got(static_cast<size_t>(sample_ * H_));
  for (size_t i = 0; i < got.size(); ++i) got[i] = LoadAsFloat(y_.data(), c_.dtype, i);
  Count(Key("layer-fwd", measured), CountOutside(got, y_ref_, tol_, "layer-fwd y"),
        static_cast<int64_t>(got.size()));

  std::fill(gbuf.begin(), gbuf.end(), 0.0f);
  Poison(dx_.data(), dx_.size());
  Poison(dtopk_.data(), dtopk_.size() * sizeof(float));
  const TensorView dy = TensorView::Contiguous(dy_.data(), c_.dtype, {T_, H_});
  const TensorView dx = TensorView::Contiguous(dx_.data(), c_.dtype, {T_, H_});
  MOONEP_RETURN_IF_ERROR(Timed(Key("layer-bwd", measured), record, [&] {
    return layer->Backward(handle, dy, dx, absl::MakeSpan(dtopk_));
  }));
  int64_t checked = 0;
  int64_t wrong = CountWrongBackwardSample(&checked);
  if (!measured) {
    // Weight gradients after the reduction do not depend on the plan: compare with policy none.
    std::vector<double> a(gbuf_measured_.begin(), gbuf_measured_.end());
    std::vector<double> b(gbuf_none_.begin(), gbuf_none_.end());
    wrong += CountOutside(a, b, tol_, "layer-bwd weight gradients against policy none's");
    checked += static_cast<int64_t>(a.size());
  }
  Count(Key("layer-bwd", measured), wrong, checked);
  return absl::OkStatus();
}

absl::Status Runner::Iteration(bool record) {
  MOONEP_RETURN_IF_ERROR(TransportPipeline(true, record));
  if (run_none_) MOONEP_RETURN_IF_ERROR(TransportPipeline(false, record));
  if (a2a_) MOONEP_RETURN_IF_ERROR(device_ ? NcclA2aPipeline(record) : A2aPipeline(record));
  if (layer_) {
    MOONEP_RETURN_IF_ERROR(LayerStep(true, record));
    if (run_none_) MOONEP_RETURN_IF_ERROR(LayerStep(false, record));
  }
  return absl::OkStatus();
}

absl::Status Runner::Run(ConfigResult* out) {
  MOONEP_RETURN_IF_ERROR(Setup());
  for (int32_t it = 0; it < c_.warmup + c_.iters; ++it) {
    const bool record = it >= c_.warmup;
    check_ = c_.check_iters < 0 || it < c_.check_iters;
    if (it == c_.warmup) {
      measured_.transport->ResetCounters();
      if (run_none_) none_.transport->ResetCounters();
    }
    MOONEP_RETURN_IF_ERROR(Iteration(record));
  }

  out->config = c_;
  out->num_ranks = R_;
  out->zipf_s = routing_.zipf_s;
  out->maxvio = routing_.maxvio;
  out->plan_stats = measured_.plan.stats;
  out->none_stats = run_none_ ? none_.plan.stats : measured_.plan.stats;
  out->recv_capacity_rows = capacity_;
  out->slots = slots_;
  if (device_) {
    out->note = absl::StrFormat(
        "device memory (rank 0: %s); baseline nccl-a2a: the same rows as MPI_Alltoallv's by "
        "grouped ncclSend/ncclRecv (exchange only: packed once, no weighted sum); t/a2av "
        "compares with it", DeviceName());
  }
  MPI_Allreduce(MPI_IN_PLACE, &out->recv_capacity_rows, 1, MPI_INT64_T, MPI_MAX, comm_);

  const std::string type = DTypeName(c_.dtype);
  const int64_t routed = T_ * K_;
  const double a2a_factor = static_cast<double>(R_ - 1) / R_;
  const int64_t expert_bytes = static_cast<int64_t>(3 * H_ * I_ * ds_);
  auto busiest = [&](const planner::Plan& plan, int64_t bytes_per_expert) {
    // Bytes in or out of the busiest rank: replicas it sends (as home) or receives (as slot).
    std::vector<int64_t> io(R_, 0), in(R_, 0);
    for (int32_t d = 0; d < R_; ++d) {
      for (int32_t s = 0; s < plan.slots; ++s) {
        const int32_t e = plan.slot_expert[static_cast<size_t>(d) * plan.slots + s];
        if (e < 0) continue;
        io[plan.home[e]] += bytes_per_expert;
        in[d] += bytes_per_expert;
      }
    }
    int64_t m = 0;
    for (int32_t r = 0; r < R_; ++r) m = std::max({m, io[r], in[r]});
    return m;
  };
  std::vector<std::pair<std::string, std::string>> order;  // (op, impl) in print order
  const std::string pol = planner::PolicyName(c_.policy);
  auto add = [&](const char* op, const std::string& impl) { order.push_back({op, impl}); };
  add("counts", pol);
  if (run_none_) add("counts", "none");
  add("plan", pol);
  if (run_none_) add("plan", "none");
  add("dispatch", pol);
  if (run_none_) add("dispatch", "none");
  if (a2a_) add("dispatch", a2a_impl_);
  add("combine", pol);
  if (run_none_) add("combine", "none");
  if (a2a_) add("combine", a2a_impl_);
  for (const char* op : {"combine-bwd", "topk-grad", "dispatch-bwd"}) {
    add(op, pol);
    if (run_none_) add(op, "none");
  }
  add("prefetch", pol);
  if (a2a_ && !device_) add("prefetch", a2a_impl_);
  add("reduce", pol);
  if (a2a_ && !device_) add("reduce", a2a_impl_);
  if (layer_) {
    add("layer-fwd", pol);
    if (run_none_) add("layer-fwd", "none");
    add("layer-bwd", pol);
    if (run_none_) add("layer-bwd", "none");
  }
  for (const auto& [op, impl] : order) {
    Series& s = series_[op + "/" + impl];
    OpResult r;
    r.op = op;
    r.impl = impl;
    r.type = type;
    r.iter_us = s.us;
    r.iter_us.resize(static_cast<size_t>(c_.iters), 0.0);
    MPI_Allreduce(MPI_IN_PLACE, r.iter_us.data(), c_.iters, MPI_DOUBLE, MPI_MAX, comm_);
    int64_t wc[2] = {s.wrong, s.checked};
    MPI_Allreduce(MPI_IN_PLACE, wc, 2, MPI_INT64_T, MPI_SUM, comm_);
    r.wrong = wc[0];
    r.checked = wc[1];
    const planner::Plan& plan = impl == "none" ? none_.plan : measured_.plan;
    transport::Transport* tr =
        impl == "none" ? none_.transport.get() : impl == a2a_impl_ ? nullptr : measured_.transport.get();
    OpKind kind = OpKind::kNumKinds;
    if (op == "counts") {
      r.size_bytes = static_cast<int64_t>(R_) * E_ * 8;
      r.count = static_cast<int64_t>(R_) * E_;
      r.type = "int64";
      r.has_bandwidth = true;
      r.bus_factor = a2a_factor;
      kind = OpKind::kCounts;
    } else if (op == "plan") {
      r.count = E_;
      r.type = "-";
    } else if (op == "dispatch" || op == "combine" || op == "combine-bwd" || op == "dispatch-bwd") {
      r.size_bytes = routed * static_cast<int64_t>(row_bytes_);
      r.count = routed * H_;
      r.has_bandwidth = true;
      r.bus_factor = a2a_factor;
      kind = op == "dispatch"      ? OpKind::kDispatch
             : op == "combine"     ? OpKind::kCombine
             : op == "combine-bwd" ? OpKind::kCombineBackward
                                   : OpKind::kDispatchBackward;
    } else if (op == "topk-grad") {
      // One fp32 per routed (token, k) travels back; the row dots are computed where rows are.
      r.size_bytes = routed * 4;
      r.count = routed;
      r.type = "fp32";
      r.has_bandwidth = true;
      r.bus_factor = a2a_factor;
      kind = OpKind::kTopkWeightGrad;
    } else if (op == "prefetch" || op == "reduce") {
      const int64_t per = op == "prefetch" ? expert_bytes : static_cast<int64_t>(3 * H_ * I_ * 4);
      r.size_bytes = static_cast<int64_t>(plan.stats.replicas) * per;
      r.count = static_cast<int64_t>(plan.stats.replicas) * 3 * H_ * I_;
      if (op == "reduce") r.type = "fp32";  // gradients are fp32
      r.has_bandwidth = r.size_bytes > 0;
      r.bus_bytes = busiest(plan, per);
      kind = op == "prefetch" ? OpKind::kPrefetch : OpKind::kReduce;
    } else {  // layer steps: the dispatched payload, time only
      r.size_bytes = routed * static_cast<int64_t>(row_bytes_);
      r.count = routed * H_;
    }
    if (tr != nullptr && kind != OpKind::kNumKinds) {
      const transport::OpCounters oc = tr->counters(kind);
      int64_t v[2] = {oc.calls > 0 ? oc.bytes_sent / oc.calls : 0,
                      oc.calls > 0 ? oc.rows_deduplicated / oc.calls : 0};
      MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_INT64_T, MPI_MAX, comm_);
      r.sent_bytes_max = v[0];
      r.dedup_rows_max = v[1];
    } else if (impl == a2a_impl_) {
      int64_t v = 0;
      for (int32_t d = 0; d < R_; ++d) {
        if (d != rank_) v += static_cast<int64_t>(op == "dispatch" ? a2a_scount_[d] : a2a_rcount_[d]);
      }
      v *= static_cast<int64_t>(row_bytes_);
      MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT64_T, MPI_MAX, comm_);
      r.sent_bytes_max = v;
    }
    r.Finish();
    out->ops.push_back(std::move(r));
  }
  out->corrupted = corrupted_;
  return absl::OkStatus();
}

}  // namespace

absl::Status RunConfig(const BenchConfig& config, MPI_Comm comm, runtime::Communicator* rt_comm,
                       ConfigResult* result) {
  Runner runner(config, comm, rt_comm);
  return runner.Run(result);
}

}  // namespace moonep::bench
