// MoonEP's own grouped GEMM for Hopper (sm_90a): one persistent launch whose tile queue holds the
// tiles of every group, so a skewed view fills the GPU like one dense GEMM of the same rows.
//
// Why it exists (docs/cuda.md has the measurements): with K = 7168 a 128 x 256 output tile is a
// long piece of work (~80 us on one SM), and a view of a few thousand rows has only a couple of
// hundred tiles, i.e. about two waves over 132 SMs. Per-group cuBLAS calls (or cuBLAS's grouped
// call) round every group up to whole tiles and every launch up to whole waves, and a skewed view
// ends with a third, nearly empty wave (0.65-0.8 of the dense rate). Here the tiles of all groups
// form one queue: the full waves run data-parallel (tile t on CTA t % grid: consecutive tiles on
// consecutive CTAs, so the weights and rows they share are read from L2 at the same time), and the
// last partial wave's tiles are split along K into parts (at most 8 a tile, at most one per SM;
// whole or 128-column narrow tiles, whichever form a model of the tail's time, ChooseTail, finds
// cheapest), so the tail costs a fraction of a wave. (A full stream-K schedule,
// every CTA a contiguous range of K-steps across tiles, was measured at 0.48 of dense on 8 x 512
// rows: the CTAs sharing a weight block read it at different K offsets and the kernel became
// memory-bound.) Split tiles are combined through an fp32 workspace: every part writes its partial
// sum, the part that arrives last (a counter per tile) adds them in part order - deterministic -
// and writes the output. No CTA waits for another outside its cluster (whose CTAs the hardware
// schedules together), so nothing depends on the grid being co-resident.
//
// Transposed remainders (set_swap, twelfth session): a group's rows past its last whole 256 can run
// as units of D^T = op(B)^T A^T with the rows as WGMMA's N (32..256 in steps of 32), so a group pads
// its rows to 32 instead of 128; a batch with such units, which cost less than whole ones, runs a
// schedule planned on the host (PlanSchedule: each unit to the least loaded cluster, exchanges,
// a split tail where it pays), passed to the kernel as per-cluster unit lists.
//
// Tiles are 128 x 256 x 64 (two consumer warpgroups of m64n256k16 WGMMAs, one producer warpgroup
// issuing TMA loads into a 4-stage ring). Where the column tiles pair up (n % 512 == 0) CTAs run in
// clusters of two that share half of every load through TMA multicast: two row tiles of a group
// share the weight tile, and a group's odd last row tile runs as two column tiles sharing the rows;
// a stage is refilled once the consumers of both CTAs are done with it. (Cuts the L2-to-SM traffic
// by a quarter; the first version, whose cross-CTA arrive had cluster-scope release semantics, ran
// at 0.55-0.63x the plain kernel.) bf16 results leave through shared memory: stmatrix into two
// 8 KiB buffers per consumer warpgroup, written out by TMA stores while the warpgroup goes on to its
// next tile (the direct stores this replaced took 5 of a tile's ~77 us). Operands: A[rows, k] bf16 row-major (K-contiguous);
// B[k, n] bf16 row-major (trans_b = false: N-contiguous, the forward's weights) or B stored as
// [n, k] (trans_b = true: K-contiguous, the backward's W^T); C[rows, n] fp32 or bf16, beta = 0.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "moonep/core/dtype.h"

namespace moonep::compute::cuda {

struct PersistentGroup {
  const void* a = nullptr;  // [rows, k], leading dimension lda (elements)
  int64_t lda = 0;
  const void* b = nullptr;  // [k, n] (ldb), or [n, k] with trans_b
  int64_t ldb = 0;
  void* c = nullptr;        // [rows, n], leading dimension ldc
  int64_t ldc = 0;
  int64_t rows = 0;
};

class PersistentGemm {
 public:
  static constexpr int kTileM = 128, kTileN = 256, kTileK = 64;
  static constexpr int kMaxGroupsPerLaunch = 64;  // more groups run as several launches

  // For the current device; Unavailable when it is not compute capability 9.0 or the
  // driver lacks cuTensorMapEncodeTiled. Allocates the split-tail workspace (one fp32 partial tile
  // per SM and round, 17 MiB on 132 SMs) and the per-tile counters once.
  static absl::StatusOr<std::unique_ptr<PersistentGemm>> Create();
  ~PersistentGemm();

  // Whether this kernel can run a batch of this form: bf16 A and B, fp32 or bf16 C, beta 0, no
  // transposed A, n % 256 == 0, k % 64 == 0, 16-byte aligned pointers and leading dimensions
  // that are multiples of 8 elements.
  static bool Applies(bool trans_a, DType ab, DType c, int64_t n, int64_t k, float beta);
  static bool Aligned(const PersistentGroup& g);

  // Enqueues C_g = A_g op(B_g) for every group on `stream`. Groups with rows == 0 cost nothing.
  absl::Status Run(cudaStream_t stream, bool trans_b, DType c_dtype, int64_t n, int64_t k,
                   const PersistentGroup* groups, size_t count);

  // How the last, partial wave runs (see ChooseTail).
  struct TailOptions {
    bool split = true;     // K-parts at all (off = every tile whole, for comparisons)
    bool narrow = true;    // narrow units (128-column halves of the tiles) allowed
    int max_split = 8;     // at most this many K-parts per tail unit
    int force_split = 0;   // > 0: exactly this many parts (tests, probes), narrow as force_narrow
    bool force_narrow = false;
  };
  struct TailChoice {
    bool narrow = false;
    int split = 1;      // K-parts per tail unit (1: whole)
    double cost = 0.0;  // the model's microseconds
  };
  // Tail parts: at most this many rounds of one part per cluster (the workspace holds one partial
  // tile per part and CTA). One: a second round measured slower than the model says (32x512_zipf:
  // 3 whole parts in two rounds 825-836 us, the last wave unsplit 799-814; docs/cuda-history.md).
  static constexpr int kWorkspaceRounds = 1;
  // The tail's modeled time (us) for `rest` units left over a whole number of waves of `slots`
  // units, K-steps k_iters, in narrow or whole units of `split` K-parts each.
  static double TailCost(int rest, int slots, int k_iters, bool narrow, int split);
  // The cheapest form of the tail under TailCost, among those o allows that leave >= 4 K-steps a
  // part and at most kWorkspaceRounds * slots parts; o.force_split overrides (an error when that
  // form does not fit).
  static absl::StatusOr<TailChoice> ChooseTail(int rest, int slots, int k_iters, const TailOptions& o);

  // Transposed units (set_swap, default on; clusters only). A group's rows past its last whole
  // 256 can run as units of D^T = op(B)^T A^T: each CTA of a cluster 128 output columns x N rows,
  // the rows as WGMMA's N (32..256 in steps of 32), so a group pads its rows to 32, not to 128.
  // Such a unit's time is modeled, relative to a whole 128 x 256 tile's, as
  // kSwapFixed + (1 - kSwapFixed) N / 256: fitted to the H200 (33 groups of N rows, four waves of
  // transposed units against as many whole ones: N = 32, 160, 192, 224 took 0.51, 0.82, 0.81-0.86,
  // 0.90 of the time; docs/cuda-history.md, "Twelfth session"). A group's remainder runs transposed
  // where that model makes it cheaper than its one or two 128-row tiles; a batch with any
  // transposed unit runs the cost-balanced schedule (PlanSchedule).
  static constexpr double kSwapFixed = 0.45;
  static constexpr int kSwapStep = 32;
  static int SwapRows(int64_t rest) {  // the N of a remainder of `rest` rows (1..255)
    return static_cast<int>((rest + kSwapStep - 1) / kSwapStep * kSwapStep);
  }
  static double SwapCost(int n) { return kSwapFixed + (1.0 - kSwapFixed) * n / kTileN; }
  // Whether a group of `rows` rows runs its remainder (rows % 256) transposed, with n_tiles
  // 256-column tiles: n_tiles units at SwapCost against n_tiles / 2 (<= 128 rows) or n_tiles
  // (more) whole units.
  static bool PrefersSwap(int64_t rows, int n_tiles);

  // The cost-balanced schedule of one launch. Units are assigned in their order, the last
  // sorted_last of them (all: longest processing time first) sorted by cost, each to the least
  // loaded cluster, ties to the lowest index (equal costs fill the clusters round-robin, as the
  // plain schedule does). Then the most loaded cluster trades units with less loaded ones while that
  // lowers it (bounded), and up to kMaxTailUnits of the clusters' last units may be taken out and
  // split into `split` K-parts, part v on the v-th least loaded cluster, if that lowers the modeled
  // makespan. Costs are in whole-tile times.
  static constexpr int kMaxScheduleClusters = 160;
  static constexpr int kMaxTailUnits = 64;
  struct Schedule {
    std::vector<int> start;         // cluster c's whole units: units[start[c] .. start[c + 1])
    std::vector<int> units;
    std::vector<int> tail_units;    // split units
    std::vector<int> tail_cluster;  // part v (of tail_units[v / split], K-part v % split): its cluster
    int split = 1;
    double makespan = 0.0;          // the model's, in whole-tile times
  };
  // force_split > 0: exactly force_tail units in force_split parts (an error where they do not fit:
  // more parts than clusters, fewer than 4 K-steps a part, more than kMaxTailUnits units).
  // sorted_last >= 0: only the last sorted_last units (in unit order) are sorted by cost; the units
  // before them are assigned in their order (list scheduling: each to the least loaded cluster).
  static absl::StatusOr<Schedule> PlanSchedule(const std::vector<double>& costs, int clusters, int k_iters,
                                               int max_split, int force_tail = 0, int force_split = 0,
                                               int sorted_last = -1);
  void set_swap(bool on) { swap_ = on; }
  // How many waves' worth of units at the end of the unit order are sorted by cost before the
  // assignment (-1, the default: all of them, longest processing time first; in the H200 probe
  // 0.6-2 % faster on 64x512_zipf than the last two waves sorted, the same on 32x512_zipf).
  void set_schedule_sorted_waves(int waves) { sched_sorted_waves_ = waves; }
  // Tests: every group's remainder transposed, whatever the model prefers (needs set_swap).
  void set_force_swap(bool on) { force_swap_ = on; }
  // Tests: the cost-balanced schedule's tail forced (see PlanSchedule; 0 = the model's choice).
  void set_schedule_tail_override(int units, int split) {
    sched_force_tail_ = units;
    sched_force_split_ = split;
  }
  // Whether the last launch ran the cost-balanced schedule, and how many of its groups had
  // transposed units.
  bool last_scheduled() const { return last_scheduled_; }
  int last_swap_groups() const { return last_swap_groups_; }
  // The last cost-balanced launch's schedule (empty before any).
  const Schedule& last_schedule() const {
    static const Schedule kNone;
    return last_plan_ < 0 ? kNone : plans_[static_cast<size_t>(last_plan_)].schedule;
  }
  // The last kPlanCacheEntries plans are reused while a batch's unit costs and the options repeat
  // (default on; off: every launch plans, for measuring the planning's host time).
  // last_planned(): whether the last launch planned.
  void set_plan_cache(bool on) { plan_cache_ = on; }
  bool last_planned() const { return last_planned_; }

  // The K-split tail (default on); off = every tile whole, for comparisons.
  void set_stream_k(bool on) { tail_.split = on; }
  // At most this many K-parts per tail tile (default 8).
  void set_max_split(int parts) { tail_.max_split = parts < 1 ? 1 : parts; }
  // Exactly this form of the tail instead of the model's choice (0: the model's choice).
  void set_tail_override(int split, bool narrow) {
    tail_.force_split = split < 0 ? 0 : split;
    tail_.force_narrow = narrow;
  }
  // The form the last launch's tail took.
  const TailChoice& last_tail() const { return last_tail_; }
  int num_sms() const { return num_sms_; }
  // Tile order: groups largest, smallest, second largest, ... (true) or as given (false).
  void set_interleave(bool on) { interleave_ = on; }
  // Clusters of two CTAs that share half of every load through TMA multicast (default on; used
  // where the column tiles pair up, n % 512 == 0).
  void set_cluster(bool on) { cluster_ = on; }
  // The split tail may run in narrow tiles of 128 columns where the model prefers them (default
  // on; off = whole tiles only).
  void set_narrow_tail(bool on) { tail_.narrow = on; }
  // bf16 epilogue: 16-byte stores after a transpose within each quad of lanes (default) or 4-byte
  // stores straight from the accumulators (false).
  void set_wide_store(bool on) { wide_store_ = on; }
  // bf16 epilogue through shared memory and TMA stores, which drain while the next unit's main
  // loop runs (default on; off = the stores above, straight from the registers).
  void set_tma_store(bool on) { tma_store_ = on; }
  // Batches of at most 8 groups launch with a parameter block sized for 8 (default on; off = the
  // 64-group block always, for comparisons). The block is copied at every launch.
  void set_small_params(bool on) { small_params_ = on; }
  // Groups the last call's parameter block held (8 or kMaxGroupsPerLaunch).
  int last_param_groups() const { return last_param_groups_; }
  // Units of work per wave of the last launch (CTAs, or clusters of two).
  int last_slots() const { return last_slots_; }
  // Diagnostics: a device buffer of num_sms * cap * 6 words that every launch fills with one
  // record per unit and CTA (unit, K range, globaltimer at start, after the main loop, at the end;
  // layout in persistent_gemm.cu's Params). nullptr (the default) records nothing.
  void set_trace(unsigned long long* device_buffer, int cap) {
    trace_ = device_buffer;
    trace_cap_ = device_buffer == nullptr ? 0 : cap;
  }

 private:
  PersistentGemm() = default;
  // Run's launches, with a parameter block for up to kG groups (persistent_gemm.cu).
  template <int kG>
  absl::Status Launch(cudaStream_t stream, bool trans_b, bool f32, bool cluster, int64_t n, int64_t k,
                      const PersistentGroup* groups);
  int num_sms_ = 0;
  TailOptions tail_;
  TailChoice last_tail_;
  bool interleave_ = false;
  bool cluster_ = true;
  bool wide_store_ = true;
  bool tma_store_ = true;
  bool small_params_ = true;
  bool swap_ = true;
  bool force_swap_ = false;
  int sched_force_tail_ = 0, sched_force_split_ = 0;
  int sched_sorted_waves_ = -1;
  bool last_scheduled_ = false;
  int last_swap_groups_ = 0;
  std::vector<double> costs_;
  bool plan_cache_ = true, last_planned_ = false;
  // The last few plans (the executor's GEMMs of one routing differ in n and k).
  static constexpr size_t kPlanCacheEntries = 8;
  struct PlanEntry {
    std::array<int, 6> key{};
    std::vector<double> costs;
    Schedule schedule;
    uint64_t used = 0;
  };
  std::vector<PlanEntry> plans_;
  int last_plan_ = -1;  // the plan the last cost-balanced launch ran
  uint64_t plan_clock_ = 0;
  int last_param_groups_ = 0;
  int last_slots_ = 0;
  unsigned long long* trace_ = nullptr;
  int trace_cap_ = 0;
  std::vector<int32_t> order_, scratch_;
  void* encode_ = nullptr;      // cuTensorMapEncodeTiled
  float* partials_ = nullptr;   // [kWorkspaceRounds * num_sms][kTileM * kTileN]
  int32_t* counters_ = nullptr;  // [kWorkspaceRounds * num_sms]
  std::vector<unsigned char> params_;  // host copy of the kernel parameters (reused)
};

}  // namespace moonep::compute::cuda
