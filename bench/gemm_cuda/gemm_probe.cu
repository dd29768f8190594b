// moonep-gemm-probe: measures candidate ways of running a skewed grouped GEMM through cuBLASLt
// against the same run's dense GEMM and MoonEP's current strategies, to decide what the executor
// should do with skewed views (docs/cuda.md, "The persistent grouped GEMM"). Not part of the
// product: a measurement tool whose results are recorded in the docs.
//
// Candidates (bf16 H=7168 -> I=2048, bf16 out, per-group X_g[rows, H] x W_g[H, I]):
//   lt-S:        one cublasLtMatmul per group over S streams (largest first, least-loaded stream)
//   lt-part-S:   the same, each GEMM told CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET = its stream's
//                share of the SMs (proportional to that stream's FLOPs), so the concurrent GEMMs
//                partition the GPU instead of each planning for all of it
//   lt-part-S-xF: SM shares scaled by F (oversubscribed)
//
//   moonep-gemm-probe [--reps N] [--only SHAPE_INDEX] [--quick] [--trace] [--flush] [--variants A,B]
//   (--quick: no checks, only the dense GEMM and the default persistent kernel: for profilers;
//    --trace: a timeline of the persistent kernel's units per shape, from globaltimer records;
//    --flush: 256 MiB overwritten before every interleaved run, as in moonep-bench-gemm-cuda;
//    --variants: only these persistent variants besides the default "pers"; the forced split
//    tails pers-tUxP run only when named here;
//    with --trace: --force-swap every group's remainder transposed (set_force_swap),
//    --sorted-waves W the schedule's list order (set_schedule_sorted_waves), --trace-default-only
//    the default launch's timeline alone;
//    --sustain MS: the dense GEMM, then the default persistent kernel, each called back to back
//    for MS ms (twice, 1 s apart), printing the time per call and the wall-clock window of each
//    phase, to read against `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw -lms 20`;
//    --shared-weights: every group multiplies by the same weight matrix, so that the grouped GEMM
//    reads no more weight bytes from HBM than the dense GEMM; --k-major: the weights stored [I][H],
//    the persistent kernel's K-major B and the dense GEMM's transposed operand (no lt-S);
//    --weight-pad BYTES: each group's weight matrix BYTES further from the previous one)
//   After the rounds, every persistent variant timed is run once more on a poisoned output and
//   checked against the reference ("[NAME rel ...]"), then the default ("[check rel ...]").
//   Every call in the interleaved rounds runs inside an NVTX range named after it ("dense", the
//   strategy's name, the persistent variant's name), so that a profiler can pick one variant's
//   launches: ncu --nvtx --nvtx-include "pers-noswap/" ... (header-only NVTX v3: nothing is
//   recorded unless a tool is attached).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "moonep/compute/cuda/grouped_gemm.h"
#include "moonep/core/env.h"
#include "moonep/compute/cuda/persistent_gemm.h"
#include "bench/gemm_cuda/bench_util.cuh"

namespace {

using moonep::DType;
using namespace moonep::compute::cuda;
using namespace moonep::bench_gemm;

#define CHECK_BLAS(call)                                                          \
  do {                                                                             \
    cublasStatus_t s_ = (call);                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                             \
      std::fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #call, \
                   static_cast<int>(s_));                                          \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)
constexpr int kH = 7168, kI = 2048;
constexpr int kMaxStreams = 16;
constexpr size_t kWs = size_t{32} << 20;

// cuBLASLt GEMMs, one plan (descriptor, layouts, heuristic algo) per (rows, SM target), made
// before timing.
class Lt {
 public:
  explicit Lt(cudaStream_t main) {
    CHECK_BLAS(cublasLtCreate(&lt_));
    streams_.push_back(main);
    for (int s = 1; s < kMaxStreams; ++s) {
      cudaStream_t st;
      CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      streams_.push_back(st);
    }
    for (int s = 0; s < kMaxStreams; ++s) {
      void* w;
      CHECK_CUDA(cudaMalloc(&w, kWs));
      ws_.push_back(w);
      cudaEvent_t e;
      CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      ev_.push_back(e);
    }
  }

  struct Entry {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
  };

  const Entry& Get(int rows, int sms) {
    auto key = std::make_pair(rows, sms);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    Entry e{};
    CHECK_BLAS(cublasLtMatmulDescCreate(&e.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (sms > 0) {
      int32_t v = sms;
      CHECK_BLAS(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &v,
                                                 sizeof(v)));
    }
    // Row-major Y[rows, I] = X[rows, H] W[H, I] is column-major Y^T = W^T X^T.
    CHECK_BLAS(cublasLtMatrixLayoutCreate(&e.la, CUDA_R_16BF, kI, kH, kI));
    CHECK_BLAS(cublasLtMatrixLayoutCreate(&e.lb, CUDA_R_16BF, kH, rows, kH));
    CHECK_BLAS(cublasLtMatrixLayoutCreate(&e.lc, CUDA_R_16BF, kI, rows, kI));
    cublasLtMatmulPreference_t pref;
    CHECK_BLAS(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = kWs;
    CHECK_BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t res{};
    int n = 0;
    CHECK_BLAS(cublasLtMatmulAlgoGetHeuristic(lt_, e.desc, e.la, e.lb, e.lc, e.lc, pref, 1, &res, &n));
    cublasLtMatmulPreferenceDestroy(pref);
    if (n < 1) {
      std::fprintf(stderr, "no cuBLASLt algo for rows %d sms %d\n", rows, sms);
      std::exit(1);
    }
    e.algo = res.algo;
    return cache_[key] = e;
  }

  void Run(int s, const Entry& e, const void* w, const void* x, void* y) {
    const float alpha = 1.0f, beta = 0.0f;
    CHECK_BLAS(cublasLtMatmul(lt_, e.desc, &alpha, w, e.la, x, e.lb, &beta, y, e.lc, y, e.lc,
                               &e.algo, ws_[s], kWs, streams_[s]));
  }
  void Fork(int used) {
    CHECK_CUDA(cudaEventRecord(ev_[0], streams_[0]));
    for (int s = 1; s < used; ++s) CHECK_CUDA(cudaStreamWaitEvent(streams_[s], ev_[0], 0));
  }
  void Join(int used) {
    for (int s = 1; s < used; ++s) {
      CHECK_CUDA(cudaEventRecord(ev_[s], streams_[s]));
      CHECK_CUDA(cudaStreamWaitEvent(streams_[0], ev_[s], 0));
    }
  }

 private:
  cublasLtHandle_t lt_;
  std::vector<cudaStream_t> streams_;
  std::vector<void*> ws_;
  std::vector<cudaEvent_t> ev_;
  std::map<std::pair<int, int>, Entry> cache_;
};

// Which stream each group runs on (largest first to the least-loaded), and each stream's SM
// share (proportional to its rows, scaled by `over`, at least 1); sms = 0 without partitioning.
struct Assignment {
  std::vector<int> order, stream;
  std::vector<int> sms;  // per stream
  int used = 0;
};

Assignment Assign(const std::vector<int64_t>& sizes, int streams, bool partition, double over,
                  int num_sms) {
  Assignment a;
  const int g = static_cast<int>(sizes.size());
  a.used = std::min(g, streams);
  a.order.resize(g);
  std::iota(a.order.begin(), a.order.end(), 0);
  std::stable_sort(a.order.begin(), a.order.end(), [&](int x, int y) { return sizes[x] > sizes[y]; });
  std::vector<int64_t> load(a.used, 0);
  a.stream.assign(g, 0);
  for (int i : a.order) {
    const int s = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[s] += sizes[i];
    a.stream[i] = s;
  }
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  a.sms.assign(a.used, 0);
  if (partition) {
    for (int s = 0; s < a.used; ++s) {
      a.sms[s] = std::max(1, static_cast<int>(std::lround(over * num_sms * load[s] / static_cast<double>(total))));
      a.sms[s] = std::min(a.sms[s], num_sms);
    }
  }
  return a;
}

__global__ void Compare(const void* got, const void* want, size_t n, int f32, float* out) {
  // out[0] = max |got - want|, out[1] = max |want|, out[2] = count of non-finite got
  float md = 0.0f, mw = 0.0f, bad = 0.0f;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float g = f32 ? static_cast<const float*>(got)[i]
                        : __bfloat162float(static_cast<const __nv_bfloat16*>(got)[i]);
    const float w = f32 ? static_cast<const float*>(want)[i]
                        : __bfloat162float(static_cast<const __nv_bfloat16*>(want)[i]);
    if (!isfinite(g)) bad += 1.0f;
    md = fmaxf(md, fabsf(g - w));
    mw = fmaxf(mw, fabsf(w));
  }
  atomicMax(reinterpret_cast<int*>(&out[0]), __float_as_int(md));
  atomicMax(reinterpret_cast<int*>(&out[1]), __float_as_int(mw));
  atomicAdd(&out[2], bad);
}

// Prints where the persistent kernel's time goes on one launch: whole units (data-parallel waves)
// and the split tail's parts, from the kernel's per-unit globaltimer records.
void PrintTrace(const char* label, const std::vector<unsigned long long>& rec, int ctas, int cap,
                int k_iters, double launch_us, int split_unit) {
  struct Stat {
    std::vector<double> v;
    void add(double x) { v.push_back(x); }
    std::string str() {
      if (v.empty()) return "-";
      std::sort(v.begin(), v.end());
      char b[96];
      std::snprintf(b, sizeof(b), "n %zu min %.1f med %.1f max %.1f", v.size(), v.front(), v[v.size() / 2], v.back());
      return b;
    }
  };
  unsigned long long t0 = ~0ull, tend = 0;
  for (int c = 0; c < ctas; ++c) {
    for (int i = 0; i < cap; ++i) {
      const unsigned long long* r = &rec[(static_cast<size_t>(c) * cap + i) * 6];
      if (r[1] == 0) break;
      t0 = std::min(t0, r[1]);
      tend = std::max(tend, r[3]);
    }
  }
  Stat whole_lo, whole_hi;
  Stat whole, whole_epilogue, whole_convert, whole_end, first_start, part_main, part_wait, fix, part_start, part_end, cta_end;
  for (int c = 0; c < ctas; ++c) {
    double last_end = 0;
    for (int i = 0; i < cap; ++i) {
      const unsigned long long* r = &rec[(static_cast<size_t>(c) * cap + i) * 6];
      if (r[1] == 0) break;
      const double s = (r[1] - t0) * 1e-3, m = (r[2] - t0) * 1e-3, e = (r[3] - t0) * 1e-3;
      const int k0 = static_cast<int>((r[0] >> 32) & 0xFFFF), k1 = static_cast<int>((r[0] >> 48) & 0xFFF);
      const bool fixed = (r[0] >> 63) != 0;
      const bool split = k0 != 0 || k1 != k_iters || (r[0] >> 60 & 7) != 0;
      if (i == 0) first_start.add(s);
      if (!split) {
        whole.add(e - s);
        if (split_unit >= 0) (static_cast<int>(r[0] & 0xFFFFFFFF) < split_unit ? whole_lo : whole_hi).add(e - s);
        whole_epilogue.add(e - m);
        whole_convert.add((r[4] - t0) * 1e-3 - m);
        whole_end.add(e);
      } else {
        part_start.add(s);
        part_main.add(m - s);
        part_end.add(e);
        if (fixed) fix.add(e - m); else part_wait.add(e - m);
      }
      last_end = e;
    }
    cta_end.add(last_end);
  }
  std::printf("trace %s: launch %.1f us (events), kernel span %.1f us\n", label, launch_us, (tend - t0) * 1e-3);
  std::printf("  first unit start   %s\n", first_start.str().c_str());
  std::printf("  whole unit time    %s\n", whole.str().c_str());
  if (split_unit >= 0) {
    std::printf("  whole, unit < %-4d %s\n", split_unit, whole_lo.str().c_str());
    std::printf("  whole, unit >= %-3d %s\n", split_unit, whole_hi.str().c_str());
  }
  std::printf("  whole epilogue     %s\n", whole_epilogue.str().c_str());
  std::printf("  first half staged  %s\n", whole_convert.str().c_str());
  std::printf("  whole unit end     %s\n", whole_end.str().c_str());
  std::printf("  tail part start    %s\n", part_start.str().c_str());
  std::printf("  tail part mainloop %s\n", part_main.str().c_str());
  std::printf("  tail part publish  %s\n", part_wait.str().c_str());
  std::printf("  tail fix-up+store  %s\n", fix.str().c_str());
  std::printf("  tail part end      %s\n", part_end.str().c_str());
  std::printf("  CTA end            %s\n", cta_end.str().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  int only = -1;       // --only I: shape I of the list below only
  bool quick = false;  // --quick: no checks, only the dense GEMM and the default persistent kernel
  bool trace = false;  // --trace: timelines of the persistent kernel instead of the timings
  bool overhead = false;  // --overhead: host and launch costs of one call, synced and pipelined
  std::vector<int64_t> custom;  // --sizes a,b,c: one shape with these group sizes instead of the list
  int split_unit = -1;          // --split-unit U: the trace's unit times for units < U and >= U apart
  bool f32 = false;             // --f32 (with --trace): fp32 outputs
  bool flush = false;           // --flush: the interleaved rounds overwrite 256 MiB before every run
  bool force_swap = false;      // --force-swap (with --trace): every remainder transposed
  int sorted_waves = -2;        // --sorted-waves W (with --trace): set_schedule_sorted_waves(W)
  bool trace_default_only = false;  // --trace-default-only: no other launch forms in the trace
  int sustain_ms = 0;           // --sustain MS: each of dense and persistent back to back for MS ms
  bool shared_weights = false;  // --shared-weights: one weight matrix for every group
  bool k_major = false;         // --k-major: weights stored [I][H] (the persistent kernel's K-major B)
  int64_t weight_pad = 0;       // --weight-pad BYTES: the groups' weight matrices that much further apart
  std::vector<std::string> only_variants;  // --variants a,b: only these persistent variants (and "pers")
  constexpr int kNumShapes = 11;  // the list below (static_assert there)
  const int64_t max_rows = 65536, max_groups = 64;  // the buffers below
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    // The value after flag a as a whole number in [lo, hi], else a message naming both.
    auto number = [&](int64_t lo, int64_t hi, int64_t* out) {
      const char* v = i + 1 < argc ? argv[++i] : nullptr;
      if (moonep::env::ParseBase10InRange(v, lo, hi, out)) return true;
      std::fprintf(stderr, "%s %s: expected a whole number in [%lld, %lld]\n", a.c_str(),
                   v != nullptr ? v : "(missing)", static_cast<long long>(lo),
                   static_cast<long long>(hi));
      return false;
    };
    int64_t n = 0;
    if (a == "--help" || a == "-h") {
      std::printf("usage: moonep-gemm-probe [--reps N] [--only SHAPE_INDEX] [--quick] [--trace] "
                  "[--overhead] [--flush]\n  [--variants A,B] [--sizes a,b,...] [--shared-weights] "
                  "[--k-major] [--weight-pad BYTES]\n  [--sustain MS] [--f32] [--force-swap] "
                  "[--sorted-waves W] [--trace-default-only] [--split-unit U]\n"
                  "(see the comment at the top of bench/gemm_cuda/gemm_probe.cu)\n");
      return 0;
    } else if (a == "--variants" && i + 1 < argc) {
      std::string list = argv[++i];
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        only_variants.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    } else if (a == "--reps") {
      if (!number(1, 1000, &n)) return 2;
      reps = static_cast<int>(n);
    } else if (a == "--only") {
      if (!number(0, kNumShapes - 1, &n)) return 2;
      only = static_cast<int>(n);
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--trace") {
      trace = quick = true;
    } else if (a == "--overhead") {
      overhead = quick = true;
    } else if (a == "--shared-weights") {
      shared_weights = true;
    } else if (a == "--k-major") {
      k_major = true;
    } else if (a == "--weight-pad") {
      if (!number(0, int64_t{64} << 20, &weight_pad)) return 2;
      if (weight_pad % 256 != 0) {
        std::fprintf(stderr, "--weight-pad wants a multiple of 256 bytes from 0 to 64 MiB, got "
                     "%lld\n", static_cast<long long>(weight_pad));
        return 2;
      }
    } else if (a == "--f32") {
      f32 = true;
    } else if (a == "--flush") {
      flush = true;
    } else if (a == "--force-swap") {
      force_swap = true;
    } else if (a == "--sustain") {
      if (!number(1, 600000, &n)) return 2;
      sustain_ms = static_cast<int>(n);
      quick = true;
    } else if (a == "--trace-default-only") {
      trace_default_only = true;
    } else if (a == "--sorted-waves") {
      if (!number(-1, 1 << 20, &n)) return 2;
      sorted_waves = static_cast<int>(n);
    } else if (a == "--split-unit") {
      if (!number(0, 1 << 20, &n)) return 2;
      split_unit = static_cast<int>(n);
    } else if (a == "--sizes" && i + 1 < argc) {
      const char* c = argv[++i];
      for (;;) {
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(c, &end, 10);
        // Each size bounded before any sum: a sum of huge sizes wrapped past the check below.
        if (end == c || v < 0 || v > max_rows || errno != 0 || (*end != ',' && *end != '\0')) {
          std::fprintf(stderr, "--sizes wants integers in [0, %lld] separated by commas, got "
                       "'%s'\n", static_cast<long long>(max_rows), argv[i]);
          return 2;
        }
        custom.push_back(v);
        if (*end == '\0') break;
        c = end + 1;
      }
    } else {
      std::fprintf(stderr, "moonep-gemm-probe: unknown flag or missing value: '%s' (--help)\n",
                   argv[i]);
      return 2;
    }
  }
  if ((f32 || force_swap || trace_default_only || sorted_waves != -2) && !trace) {
    std::fprintf(stderr, "--f32, --force-swap, --sorted-waves and --trace-default-only go with --trace only\n");
    return 2;
  }
  const int64_t custom_rows = std::accumulate(custom.begin(), custom.end(), int64_t{0});
  if (!custom.empty() && (custom.size() > static_cast<size_t>(max_groups) || custom_rows > max_rows ||
                          custom_rows == 0)) {
    std::fprintf(stderr, "--sizes: at most %lld groups and 1 to %lld rows in all\n", static_cast<long long>(max_groups),
                 static_cast<long long>(max_rows));
    return 2;
  }
  const int64_t out_bytes = f32 ? 4 : 2;
  int dev = 0, num_sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cublasHandle_t blas;
  CHECK_BLAS(cublasCreate(&blas));
  CHECK_BLAS(cublasSetStream(blas, stream));
  void* gemm_ws;
  CHECK_CUDA(cudaMalloc(&gemm_ws, 4 * GroupedGemm::kCublasWorkspaceBytes));
  auto gg = GroupedGemm::Create(stream, 4, gemm_ws);
  CHECK_OK(gg.status());
  auto staging = Staging::Create(1 << 20);
  CHECK_OK(staging.status());
  Lt lt(stream);
  auto pg = PersistentGemm::Create();
  CHECK_OK(pg.status());
  float* cmp;
  CHECK_CUDA(cudaMalloc(&cmp, 3 * sizeof(float)));

  void *x, *w, *y, *y_ref;
  CHECK_CUDA(cudaMalloc(&x, max_rows * kH * 2));
  const int64_t w_stride = int64_t{kH} * kI * 2 + weight_pad;  // bytes from one group's weights to the next
  CHECK_CUDA(cudaMalloc(&w, max_groups * w_stride));
  CHECK_CUDA(cudaMalloc(&y, max_rows * kI * 4));
  CHECK_CUDA(cudaMalloc(&y_ref, max_rows * kI * 2));
  FillBf16<<<2048, 256, 0, stream>>>(static_cast<uint16_t*>(x), max_rows * kH, 1, 1.0f);
  FillBf16<<<2048, 256, 0, stream>>>(static_cast<uint16_t*>(w), max_groups * w_stride / 2, 2, 1.0f);
  CHECK_CUDA(cudaStreamSynchronize(stream));

  // Correctness of the persistent kernel against per-group cuBLAS: forward (N-major B, bf16 and
  // fp32 out) and backward-like (K-major B, n = H, k = 2I), skewed sizes with a zero-row group and
  // sizes that are not multiples of 128.
  struct Check {
    const char* name;
    bool trans_b;
    DType c;
    int n, k;
  };
  const Check checks[] = {{"fwd bf16 n2048 k7168", false, DType::kBFloat16, kI, kH},
                          {"fwd fp32 n4096 k7168", false, DType::kFloat32, 2 * kI, kH},
                          {"bwd bf16 n7168 k4096 (B^T)", true, DType::kBFloat16, kH, 2 * kI},
                          {"bwd fp32 n7168 k2048 (B^T)", true, DType::kFloat32, kH, kI}};
  for (const Check& ch : checks) {
    if (quick) break;
    std::vector<int64_t> sizes = GroupSizes(8, 300, true, 11);
    sizes[3] = 0;
    sizes[5] = 1;
    const size_t ec = ch.c == DType::kFloat32 ? 4 : 2;
    std::vector<PersistentGroup> groups;
    GemmBatch batch;
    batch.Clear(false, ch.trans_b, DType::kBFloat16, ch.c);
    int64_t off = 0;
    for (size_t g = 0; g < sizes.size(); ++g) {
      PersistentGroup pgr;
      pgr.a = static_cast<const char*>(x) + off * ch.k * 2;
      pgr.lda = ch.k;
      pgr.b = static_cast<const char*>(w) + g * size_t{kH} * 2 * kI * 2;
      pgr.ldb = ch.trans_b ? ch.k : ch.n;
      pgr.c = static_cast<char*>(y_ref) + off * ch.n * ec;
      pgr.ldc = ch.n;
      pgr.rows = sizes[g];
      groups.push_back(pgr);
      if (sizes[g] > 0) batch.problems.push_back(ToProblem(pgr, ch.n, ch.k));
      off += sizes[g];
    }
    (*gg)->set_strategy(GemmStrategy::kStreams);
    CHECK_OK((*staging)->Begin());
    CHECK_OK((*gg)->Plan(&batch, staging->get()));
    CHECK_OK((*staging)->Upload(stream));
    CHECK_OK((*gg)->Run(&batch, **staging));
    for (PersistentGroup& gr : groups) {
      gr.c = static_cast<char*>(y) + (static_cast<char*>(gr.c) - static_cast<char*>(y_ref));
    }
    for (int variant = 0; variant < 7; ++variant) {
      (*pg)->set_stream_k(variant != 1);
      (*pg)->set_interleave(variant == 2);
      (*pg)->set_cluster(variant != 3 && variant != 6);
      (*pg)->set_wide_store(variant != 4);
      (*pg)->set_tma_store(variant != 4);
      (*pg)->set_narrow_tail(variant != 5 && variant != 6);
      CHECK_CUDA(cudaMemsetAsync(y, 0xFF, off * ch.n * ec, stream));  // NaN poison
      CHECK_CUDA(cudaMemsetAsync(cmp, 0, 3 * sizeof(float), stream));
      CHECK_OK((*pg)->Run(stream, ch.trans_b, ch.c, ch.n, ch.k, groups.data(), groups.size()));
      Compare<<<256, 256, 0, stream>>>(y, y_ref, off * ch.n, ch.c == DType::kFloat32, cmp);
      float h[3];
      CHECK_CUDA(cudaMemcpyAsync(h, cmp, sizeof(h), cudaMemcpyDeviceToHost, stream));
      const cudaError_t e = cudaStreamSynchronize(stream);
      if (e != cudaSuccess) {
        std::printf("check %s variant %d: CUDA error %s\n", ch.name, variant, cudaGetErrorString(e));
        return 1;
      }
      std::printf("check %-28s %s: max|diff| %.3g, max|ref| %.3g, rel %.2e, non-finite %.0f -> %s\n",
                  ch.name,
                  variant == 0   ? "split-K tail"
                  : variant == 1 ? "data-par"
                  : variant == 2 ? "split-K interleaved"
                  : variant == 3 ? "no clusters"
                  : variant == 4 ? "4-byte stores"
                  : variant == 5 ? "whole-tile tail"
                                 : "no clusters, whole-tile tail",
                  h[0],
                  h[1], h[0] / h[1], h[2], (h[2] == 0 && h[0] / h[1] < 1e-2) ? "OK" : "WRONG");
    }
    (*pg)->set_interleave(false);
    (*pg)->set_stream_k(true);
    (*pg)->set_cluster(true);
    (*pg)->set_wide_store(true);
    (*pg)->set_tma_store(true);
    (*pg)->set_narrow_tail(true);
  }
  std::fflush(stdout);

  struct Shape {
    int groups;
    int64_t avg;
    bool zipf;
  };
  // The last two: one group whose 16 tiles are only a tail (split), and 64 units (one wave).
  const Shape shapes[] = {{8, 512, false}, {8, 512, true},   {32, 512, false}, {32, 512, true},
                          {64, 512, true}, {8, 2048, true},  {64, 1024, true}, {32, 128, true},
                          {64, 128, true}, {1, 256, false},  {1, 2048, false}};
  static_assert(sizeof(shapes) / sizeof(shapes[0]) == kNumShapes, "--only's bound");
  std::printf("# %d SMs; TFLOP/s, (x) = over the dense GEMM of the same FLOPs in the same run\n", num_sms);
  for (const Shape& sh_listed : shapes) {
    if (!custom.empty() && &sh_listed != shapes) break;
    if (custom.empty() && only >= 0 && &sh_listed - shapes != only) continue;
    const Shape sh = custom.empty() ? sh_listed
                                    : Shape{static_cast<int>(custom.size()),
                                            custom_rows / static_cast<int64_t>(custom.size()), false};
    const auto sizes = custom.empty() ? GroupSizes(sh.groups, sh.avg, sh.zipf, 7) : custom;
    const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    const double flops = 2.0 * total * kH * kI;
    auto tf = [&](double ms) { return flops / (ms * 1e-3) / 1e12; };
    std::vector<int64_t> offset(sizes.size() + 1, 0);
    for (size_t g = 0; g < sizes.size(); ++g) offset[g + 1] = offset[g] + sizes[g];
    auto wg = [&](int g) {
      return static_cast<const char*>(w) + (shared_weights ? 0 : static_cast<size_t>(g) * w_stride);
    };
    auto xg = [&](int g) { return static_cast<const char*>(x) + static_cast<size_t>(offset[g]) * kH * 2; };
    auto yg = [&](int g) { return static_cast<char*>(y) + static_cast<size_t>(offset[g]) * kI * out_bytes; };
    std::vector<PersistentGroup> pgroups;
    for (size_t g = 0; g < sizes.size(); ++g) {
      PersistentGroup pgr;
      pgr.a = xg(static_cast<int>(g));
      pgr.lda = kH;
      pgr.b = wg(static_cast<int>(g));
      pgr.ldb = k_major ? kH : kI;
      pgr.c = yg(static_cast<int>(g));
      pgr.ldc = kI;
      pgr.rows = sizes[g];
      pgroups.push_back(pgr);
    }

    const float one = 1.0f, zero = 0.0f;
    // The dense GEMM of the same FLOPs: every comparison's baseline.
    auto dense_call = [&] {
      CHECK_BLAS(cublasGemmEx(blas, k_major ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, kI, static_cast<int>(total),
                               kH, &one, w, CUDA_R_16BF, k_major ? kH : kI, x, CUDA_R_16BF, kH, &zero, y,
                               CUDA_R_16BF, kI, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    const double dense = TimeMs(stream, reps, dense_call);
    // One persistent GEMM over this shape's groups, on instance g as it is set up at the time.
    auto run_pers = [&](PersistentGemm* g, DType out = DType::kBFloat16) {
      CHECK_OK(g->Run(stream, k_major, out, kI, kH, pgroups.data(), pgroups.size()));
    };
    // The default instance (*pg).
    auto pers_call = [&] { run_pers(pg->get()); };
    if (sustain_ms > 0) {
      // Back-to-back calls for sustain_ms (a sync every 10 calls), then 1 s idle. The wall-clock
      // window (local time, as nvidia-smi's timestamps) places each phase in a clock/power log.
      auto now_ms = [] {
        return std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch()).count();
      };
      auto stamp = [](double ms) {
        const std::time_t t = static_cast<std::time_t>(ms / 1e3);
        char b[64];
        std::strftime(b, sizeof(b), "%H:%M:%S", std::localtime(&t));
        char out[80];
        std::snprintf(out, sizeof(out), "%s.%03d", b, static_cast<int>(std::fmod(ms, 1e3)));
        return std::string(out);
      };
      auto sustain = [&](const char* name, const std::function<void()>& fn) {
        for (int i = 0; i < 3; ++i) fn();
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const double t0 = now_ms();
        int calls = 0;
        const double ms = SpanMs(stream, [&] {
          while (now_ms() - t0 < sustain_ms) {
            for (int i = 0; i < 10; ++i) fn();
            calls += 10;
            CHECK_CUDA(cudaStreamSynchronize(stream));
          }
        });
        const double t1 = now_ms();
        std::printf("sustain %dx%lld_%s %-10s %d calls, %.1f us per call (%.0f TFLOP/s), from %s to %s\n", sh.groups,
                    static_cast<long long>(sh.avg), sh.zipf ? "zipf1.2" : "uniform", name, calls,
                    1e3 * ms / calls, tf(ms / calls), stamp(t0).c_str(), stamp(t1).c_str());
        std::fflush(stdout);
        std::this_thread::sleep_for(std::chrono::seconds(1));
      };
      for (int round = 0; round < 2; ++round) {
        sustain("dense", dense_call);
        sustain("persistent", pers_call);
      }
      continue;
    }
    if (overhead) {
      // Host microseconds per call (no sync), GPU microseconds per call with a sync after every
      // call (as TimeMs) and with 20 calls queued back to back (host work hidden behind the GPU).
      auto measure = [&](const char* name, const std::function<void()>& fn) {
        for (int i = 0; i < 5; ++i) fn();
        CHECK_CUDA(cudaStreamSynchronize(stream));
        constexpr int kCalls = 20;
        const double synced = 1e3 * TimeMs(stream, kCalls, fn);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const auto h0 = std::chrono::steady_clock::now();
        for (int i = 0; i < kCalls; ++i) fn();
        const auto h1 = std::chrono::steady_clock::now();
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const double host = std::chrono::duration<double, std::micro>(h1 - h0).count() / kCalls;
        const double ms = SpanMs(stream, [&] {
          for (int i = 0; i < kCalls; ++i) fn();
        });
        std::printf("overhead %dx%lld_%s %-10s host %.1f us/call, synced %.1f us, pipelined %.1f us\n",
                    sh.groups, static_cast<long long>(sh.avg), sh.zipf ? "zipf1.2" : "uniform", name,
                    host, synced, 1e3 * ms / kCalls);
      };
      measure("dense", dense_call);
      measure("persistent", pers_call);
      // Planning every call (the plan cache off: a new routing each call), and the plain schedule.
      (*pg)->set_plan_cache(false);
      measure("pers-plan", pers_call);
      (*pg)->set_plan_cache(true);
      (*pg)->set_swap(false);
      measure("pers-noswap", pers_call);
      (*pg)->set_swap(true);
      if (&sh == shapes) {  // once: the cost of one tensor-map encoding
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult q{};
        CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
        CUtensorMap map;
        const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kH), 512};
        const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kH) * 2};
        const cuuint32_t box[2] = {64, 64}, elem[2] = {1, 1};
        const auto e0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 1000; ++i) {
          reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)(
              &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x, dims, strides, box, elem,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        }
        const auto e1 = std::chrono::steady_clock::now();
        std::printf("overhead cuTensorMapEncodeTiled: %.3f us per call\n",
                    std::chrono::duration<double, std::micro>(e1 - e0).count() / 1000);
      }
      std::fflush(stdout);
      continue;
    }
    if (trace) {
      constexpr int kCap = 256;
      unsigned long long* dev_trace;
      CHECK_CUDA(cudaMalloc(&dev_trace, size_t{6} * kCap * num_sms * sizeof(unsigned long long)));
      const auto mm = std::minmax_element(sizes.begin(), sizes.end());
      // MOONEP_TRACE_DUMP=prefix: the raw records of the default and the no-swap launches go to
      // prefix<shape>-<variant>.bin (6 words a unit, kCap units a CTA, num_sms CTAs).
      const char* dump = std::getenv("MOONEP_TRACE_DUMP");
      (*pg)->set_force_swap(force_swap);
      if (sorted_waves != -2) (*pg)->set_schedule_sorted_waves(sorted_waves);
      for (int v = 0; v < (trace_default_only ? 1 : 5); ++v) {
        (*pg)->set_cluster(v != 1);
        (*pg)->set_narrow_tail(v != 2);
        (*pg)->set_tma_store(v != 3);
        (*pg)->set_swap(v != 4);
        for (int rep = 0; rep < 3; ++rep) {  // warm; the last launch is the one recorded
          CHECK_CUDA(cudaMemsetAsync(dev_trace, 0, size_t{6} * kCap * num_sms * sizeof(unsigned long long), stream));
          (*pg)->set_trace(rep == 2 ? dev_trace : nullptr, kCap);
          const double ms = TimeMs(stream, 1, [&] {
            run_pers(pg->get(), f32 ? DType::kFloat32 : DType::kBFloat16);
          });
          if (rep < 2) continue;
          std::vector<unsigned long long> rec(size_t{6} * kCap * num_sms);
          CHECK_CUDA(cudaMemcpy(rec.data(), dev_trace, rec.size() * 8, cudaMemcpyDeviceToHost));
          char label[160];
          std::snprintf(label, sizeof(label), "%dx%lld_%s%s (rows %lld-%lld) %s, dense %.1f us", sh.groups,
                        static_cast<long long>(sh.avg), sh.zipf ? "zipf1.2" : "uniform", f32 ? " fp32 out" : "",
                        static_cast<long long>(*mm.first), static_cast<long long>(*mm.second),
                        v == 0 ? "default" : v == 1 ? "no clusters" : v == 2 ? "whole-tile tail" : "16-byte stores", 1e3 * dense);
          if (v == 4) std::strncat(label, ", no swap", sizeof(label) - std::strlen(label) - 1);
          PrintTrace(label, rec, num_sms, kCap, kH / 64, 1e3 * ms, split_unit);
          if (dump != nullptr && (v == 0 || v == 4)) {
            char path[512];
            std::snprintf(path, sizeof(path), "%s%dx%lld%s-%s.bin", dump, sh.groups, static_cast<long long>(sh.avg),
                          sh.zipf ? "z" : "u", v == 0 ? "swap" : "noswap");
            if (FILE* f = std::fopen(path, "wb")) {
              std::fwrite(rec.data(), 8, rec.size(), f);
              std::fclose(f);
            }
            std::strncat(path, ".sizes", sizeof(path) - std::strlen(path) - 1);
            if (FILE* f = std::fopen(path, "w")) {
              for (int64_t r : sizes) std::fprintf(f, "%lld\n", static_cast<long long>(r));
              std::fclose(f);
            }
          }
        }
      }
      (*pg)->set_trace(nullptr, 0);
      (*pg)->set_swap(true);
      (*pg)->set_cluster(true);
      (*pg)->set_narrow_tail(true);
      // bf16: the two epilogues against each other, alternating launches (no trace). (fp32 outputs
      // have one epilogue, float2 stores from the registers: a TMA-store one measured no faster,
      // see docs/cuda-history.md, "Seventh session".)
      if (!f32) {
        std::vector<std::function<void()>> epilogues;
        for (bool tma : {true, false}) {
          epilogues.push_back([&, tma] {
            (*pg)->set_tma_store(tma);
            pers_call();
          });
        }
        const std::vector<double> ems = TimeInterleavedMs(stream, reps, epilogues);
        std::printf("  alternating, %d reps: TMA-store epilogue %.1f us, 16-byte stores %.1f us (%.3f)\n", reps,
                    1e3 * ems[0], 1e3 * ems[1], ems[1] / ems[0]);
      }
      (*pg)->set_tma_store(true);
      CHECK_CUDA(cudaFree(dev_trace));
      std::fflush(stdout);
      continue;
    }
    std::string line;
    char buf[128];
    auto add = [&](const char* name, double ms) {
      std::snprintf(buf, sizeof(buf), "  %s %.0f (%.2f, %.0f us)", name, tf(ms), dense / ms, 1e3 * ms);
      line += buf;
    };
    // MoonEP's current strategies.
    for (GemmStrategy s : {GemmStrategy::kStreams, GemmStrategy::kChunked, GemmStrategy::kAuto}) {
      if (quick) break;
      (*gg)->set_strategy(s);
      GemmBatch batch;
      batch.Clear(false, k_major, DType::kBFloat16, DType::kBFloat16);
      for (const PersistentGroup& pgr : pgroups) {
        if (pgr.rows > 0) batch.problems.push_back(ToProblem(pgr, kI, kH));
      }
      const double ms = TimeMs(stream, reps, [&] {
        CHECK_OK((*staging)->Begin());
        CHECK_OK((*gg)->Plan(&batch, staging->get()));
        CHECK_OK((*staging)->Upload(stream));
        CHECK_OK((*gg)->Run(&batch, **staging));
      });
      add(GemmStrategyName(s), ms);
    }
    struct Variant {
      const char* name;
      int streams;
      bool partition;
      double over;
    };
    const Variant variants[] = {{"lt-4", 4, false, 1.0}};
    for (const Variant& v : variants) {
      if (quick || k_major) break;
      const Assignment a = Assign(sizes, v.streams, v.partition, v.over, num_sms);
      std::vector<const Lt::Entry*> plan(sizes.size(), nullptr);
      for (int g : a.order) {
        if (sizes[g] > 0) plan[g] = &lt.Get(static_cast<int>(sizes[g]), a.sms[a.stream[g]]);
      }
      const double ms = TimeMs(stream, reps, [&] {
        lt.Fork(a.used);
        for (int g : a.order) {
          if (plan[g] != nullptr) lt.Run(a.stream[g], *plan[g], wg(g), xg(g), yg(g));
        }
        lt.Join(a.used);
      });
      add(v.name, ms);
    }
    CHECK_CUDA(cudaMemcpyAsync(y_ref, y, total * kI * 2, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaMemsetAsync(y, 0xFF, total * kI * 2, stream));
    struct PVariant {
      const char* name;
      bool split, cluster, wide, interleave;
      int max_split;
      bool narrow = true;
      bool tma = true;
      int force_split = 0;  // set_tail_override
      bool force_narrow = false;
      bool big_params = false;  // set_small_params(false): the 64-group parameter block
      bool swap = true;         // set_swap: transposed remainders and the cost-balanced schedule
      int sorted_waves = -1;    // set_schedule_sorted_waves (-1: every unit, longest first)
      int sched_tail = 0, sched_split = 0;  // set_schedule_tail_override (0: the model's tail)
    };
    const PVariant pvariants[] = {{"pers", true, true, true, false, 8},
                                  {"pers-nocluster", true, false, true, false, 8},
                                  {"pers-narrow", true, true, false, false, 8, true, false},
                                  {"pers-wide", true, true, true, false, 8, true, false},
                                  {"pers-dp", false, true, true, false, 8},
                                  {"pers-wholetail", true, true, true, false, 8, false},
                                  {"pers-nocluster-wholetail", true, false, true, false, 8, false},
                                  {"pers-split4", true, true, true, false, 4},
                                  {"pers-il", true, true, true, true, 8},
                                  // The tail as the fifth session's rule formed it where the model
                                  // now differs: narrow units whole (64x512_zipf) or none (pers-dp).
                                  {"pers-narrow1", true, true, true, false, 8, true, true, 1, true},
                                  {"pers-bigparams", true, true, true, false, 8, true, true, 0, false, true},
                                  // The plain schedule (no transposed units), as before the 12th session.
                                  {"pers-noswap", true, true, true, false, 8, true, true, 0, false, false, false},
                                  {"pers-noswap-il", true, true, true, true, 8, true, true, 0, false, false, false},
                                  {"pers-nosplit", false, true, true, false, 8},
                                  {"pers-sorted2", true, true, true, false, 8, true, true, 0, false, false, true, 2},
                                  {"pers-list", true, true, true, false, 8, true, true, 0, false, false, true, 0},
                                  {"pers-sorted1", true, true, true, false, 8, true, true, 0, false, false, true, 1},
                                  {"pers-sorted2-il", true, true, true, true, 8, true, true, 0, false, false, true, 2},
                                  // The cost-balanced schedule's split tail forced: units x parts (only
                                  // when named by --variants; 8x512_zipf fits all of these).
                                  {"pers-t8x2", true, true, true, false, 8, true, true, 0, false, false, true, -1, 8, 2},
                                  {"pers-t8x4", true, true, true, false, 8, true, true, 0, false, false, true, -1, 8, 4},
                                  {"pers-t8x6", true, true, true, false, 8, true, true, 0, false, false, true, -1, 8, 6},
                                  {"pers-t16x2", true, true, true, false, 8, true, true, 0, false, false, true, -1, 16, 2},
                                  {"pers-t16x3", true, true, true, false, 8, true, true, 0, false, false, true, -1, 16, 3},
                                  {"pers-t24x2", true, true, true, false, 8, true, true, 0, false, false, true, -1, 24, 2}};
    // The dense GEMM and every variant timed in interleaved rounds (ratios to this dense figure).
    std::vector<std::function<void()>> fns;
    auto named = [](const char* name, std::function<void()> f) {
      return [name, f = std::move(f)] {
        nvtxRangePushA(name);
        f();
        nvtxRangePop();
      };
    };
    fns.push_back(named("dense", dense_call));
    const GemmStrategy il_strategies[] = {GemmStrategy::kStreams, GemmStrategy::kChunked, GemmStrategy::kAuto};
    std::vector<GemmBatch> il_batches(3);
    for (int i = 0; i < 3 && !quick; ++i) {
      il_batches[i].Clear(false, k_major, DType::kBFloat16, DType::kBFloat16);
      for (const PersistentGroup& pgr : pgroups) {
        if (pgr.rows > 0) il_batches[i].problems.push_back(ToProblem(pgr, kI, kH));
      }
      fns.push_back(named(GemmStrategyName(il_strategies[i]), [&, i] {
        (*gg)->set_strategy(il_strategies[i]);
        CHECK_OK((*staging)->Begin());
        CHECK_OK((*gg)->Plan(&il_batches[i], staging->get()));
        CHECK_OK((*staging)->Upload(stream));
        CHECK_OK((*gg)->Run(&il_batches[i], **staging));
      }));
    }
    const size_t first_pers = fns.size();
    // One instance per variant, set up once: each keeps its own plan (its cache hits from the
    // second round on, as a repeated batch's does), so no variant's timing includes planning.
    static std::vector<std::unique_ptr<PersistentGemm>> instances;
    std::vector<const PVariant*> timed;  // the variants timed: --variants' (the default first), or all
    for (const PVariant& v : pvariants) {
      if (quick && &v != pvariants) break;
      // The forced split tails fit some shapes only (a form that does not fit is an error), so
      // they run only when --variants names them.
      bool wanted = (only_variants.empty() && v.sched_split == 0) || &v == pvariants;
      for (const std::string& name : only_variants) wanted = wanted || name == v.name;
      if (wanted) timed.push_back(&v);
    }
    for (const std::string& name : only_variants) {
      bool known = false;
      for (const PVariant& v : pvariants) known = known || name == v.name;
      if (!known) {
        std::fprintf(stderr, "--variants: no persistent variant named '%s'\n", name.c_str());
        return 2;
      }
    }
    for (const PVariant* vp : timed) {
      const PVariant& v = *vp;
      const size_t idx = static_cast<size_t>(&v - pvariants);
      if (instances.size() <= idx) instances.resize(idx + 1);
      if (instances[idx] == nullptr) {
        auto created = PersistentGemm::Create();
        CHECK_OK(created.status());
        instances[idx] = std::move(*created);
      }
      PersistentGemm* inst = instances[idx].get();
      inst->set_stream_k(v.split);
      inst->set_cluster(v.cluster);
      inst->set_wide_store(v.wide);
      inst->set_interleave(v.interleave);
      inst->set_max_split(v.max_split);
      inst->set_narrow_tail(v.narrow);
      inst->set_tma_store(v.tma);
      inst->set_tail_override(v.force_split, v.force_narrow);
      inst->set_small_params(!v.big_params);
      inst->set_swap(v.swap);
      inst->set_schedule_sorted_waves(v.sorted_waves);
      inst->set_schedule_tail_override(v.sched_tail, v.sched_split);
      fns.push_back(named(v.name, [&, inst] { run_pers(inst); }));
    }
    // With --flush, as moonep-bench-gemm-cuda's interleaved figures: no run finds its operands in
    // the L2, and the card recovers its clock between runs.
    const size_t flush_bytes = flush ? size_t{256} << 20 : 0;
    void* flush_buf = nullptr;
    if (flush) CHECK_CUDA(cudaMalloc(&flush_buf, flush_bytes));
    const std::vector<double> ims = TimeInterleavedMs(stream, reps, fns, flush_buf, flush_bytes);
    if (flush) CHECK_CUDA(cudaFree(flush_buf));
    std::snprintf(buf, sizeof(buf), "  | interleaved: dense %.0f", tf(ims[0]));
    line += buf;
    for (size_t f = 1; f < ims.size(); ++f) {
      const char* name = f < first_pers ? GemmStrategyName(il_strategies[f - 1]) : timed[f - first_pers]->name;
      std::snprintf(buf, sizeof(buf), "  %s %.0f (%.2f, %.0f us)", name, tf(ims[f]), ims[0] / ims[f],
                    1e3 * ims[f]);
      line += buf;
    }
    (*pg)->set_stream_k(true);
    (*pg)->set_cluster(true);
    (*pg)->set_wide_store(true);
    (*pg)->set_interleave(false);
    (*pg)->set_max_split(8);
    (*pg)->set_narrow_tail(true);
    (*pg)->set_tma_store(true);
    (*pg)->set_tail_override(0, false);
    (*pg)->set_small_params(true);
    (*pg)->set_swap(true);
    (*pg)->set_schedule_sorted_waves(-1);
    pers_call();
    if ((*pg)->last_scheduled()) {
      std::snprintf(buf, sizeof(buf), "  [scheduled: %d groups transposed, tail %zu units in %d parts, model %.3f tiles]",
                    (*pg)->last_swap_groups(), (*pg)->last_schedule().tail_units.size(),
                    (*pg)->last_schedule().split, (*pg)->last_schedule().makespan);
    } else {
      std::snprintf(buf, sizeof(buf), "  [tail: %d %s parts, model %.1f us]", (*pg)->last_tail().split,
                    (*pg)->last_tail().narrow ? "narrow" : "whole", (*pg)->last_tail().cost);
    }
    line += buf;
    // (--quick runs no reference: the strategies above fill y_ref.) Every persistent variant timed
    // above is checked, its output poisoned first ("[NAME rel ...]"), then the default ("[check rel ...]").
    auto check = [&](const std::string& label, const std::function<void()>& run) {
      CHECK_CUDA(cudaMemsetAsync(y, 0xff, total * kI * 2, stream));
      run();
      CHECK_CUDA(cudaMemsetAsync(cmp, 0, 3 * sizeof(float), stream));
      Compare<<<256, 256, 0, stream>>>(y, y_ref, total * kI, 0, cmp);
      float h[3];
      CHECK_CUDA(cudaMemcpyAsync(h, cmp, sizeof(h), cudaMemcpyDeviceToHost, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      std::snprintf(buf, sizeof(buf), "  [%s rel %.1e%s]", label.c_str(), h[0] / h[1],
                    (h[2] == 0 && h[0] / h[1] < 1e-2) ? "" : " WRONG");
      line += buf;
    };
    if (!quick) {
      for (size_t f = first_pers + 1; f < fns.size(); ++f) check(timed[f - first_pers]->name, fns[f]);
      check("check", pers_call);
    }
    const auto mm = std::minmax_element(sizes.begin(), sizes.end());
    std::printf("%dx%lld_%s (rows %lld-%lld): dense %.0f |%s\n", sh.groups, static_cast<long long>(sh.avg),
                sh.zipf ? "zipf1.2" : "uniform", static_cast<long long>(*mm.first),
                static_cast<long long>(*mm.second), tf(dense), line.c_str());
    std::fflush(stdout);
  }
  return 0;
}
