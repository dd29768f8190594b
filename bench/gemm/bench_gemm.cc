// moonep-bench-gemm: the CPU grouped-GEMM executor against two baselines measured in the same
// process on the same FLOPs:
//   single: one cblas_sgemm (OpenBLAS with the same thread count) of the same total FLOPs
//           (forward: [rows, H] x [H, 3I]; forward+backward: [rows, H] x [H, 9I]);
//   naive:  the per-group loop one writes first: for each group, one multi-threaded cblas_sgemm
//           per GEMM of the FFN, one group after another.
// Forward counts 6 * rows * H * I FLOPs; forward+backward (pre-activations kept, so backward
// does not recompute them) counts 18 * rows * H * I. Each result row also reports the largest
// relative difference between executor and naive outputs; above the tests' bar (fp32 1e-5, bf16
// 1e-2) the benchmark stops with exit 1 instead of printing a figure (--corrupt tests that).
//
// The three are timed in interleaved rounds; ratios are medians of per-round ratios.
//
//   moonep-bench-gemm [--threads N] [--dtype fp32|bf16] [--reps N] [--rows-per-group N]
//                     [--min-rows N] [--quick] [--shapes HxI,...] [--groups G,...] [--fused] [-J]
//                     [--corrupt]
// --fused: each group's gate and up weights (and gradients) are the halves of one [H, 2I] tensor,
// so the executor computes x [Wg | Wu] as one GEMM (the naive loop still runs two).
#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moonep/compute/cpu/cpu_executor.h"
#include "moonep/core/env.h"
#include "moonep/core/host_memory.h"

extern "C" {
#pragma weak openblas_set_num_threads
}

namespace {

using moonep::DType;
using moonep::TensorView;
using namespace moonep::compute;

struct Options {
  int threads = 0;
  DType dtype = DType::kFloat32;
  int reps = 5;
  int64_t rows_per_group = 256;
  int64_t min_rows = 0;
  bool json = false;
  bool fused = false;  // gate|up weights and gradients as one [H, 2I] tensor per group
  bool corrupt = false;  // self-test: perturb one output element; the run must exit 1
  std::vector<std::pair<int64_t, int64_t>> shapes = {{1024, 512}, {2048, 1024}, {4096, 2048}};
  std::vector<int> groups = {8, 16, 64};
};

void SetBlasThreads(int n) {
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(n);
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times the executor and both baselines in interleaved rounds (after one warm-up each), so that
// load from other processes hits all three alike. Returns the executor's median seconds and the
// medians of the per-round ratios baseline_time / executor_time.
struct Timing {
  double seconds = 0, vs_single = 0, vs_naive = 0;
};
template <typename Exec, typename Single, typename Naive>
Timing TimeRounds(int reps, Exec&& exec, Single&& single, Naive&& naive) {
  exec();
  single();
  naive();
  std::vector<double> te, r1, rn;
  for (int r = 0; r < reps; ++r) {
    double t0 = Now();
    exec();
    const double e = Now() - t0;
    t0 = Now();
    single();
    const double s1 = Now() - t0;
    t0 = Now();
    naive();
    const double n1 = Now() - t0;
    te.push_back(e);
    r1.push_back(s1 / e);
    rn.push_back(n1 / e);
  }
  return Timing{Median(te), Median(r1), Median(rn)};
}

// Group sizes: uniform, or Zipf(1.2) shares of the same total (at least min_rows each), shuffled.
std::vector<int64_t> GroupRows(int G, int64_t per_group, bool zipf, int64_t min_rows) {
  std::vector<int64_t> rows(G, per_group);
  if (!zipf) return rows;
  const int64_t total = per_group * G;
  double norm = 0;
  for (int k = 1; k <= G; ++k) norm += std::pow(k, -1.2);
  int64_t used = 0;
  for (int k = 1; k <= G; ++k) {
    rows[k - 1] = std::max<int64_t>(min_rows, std::llround(total * std::pow(k, -1.2) / norm));
    used += rows[k - 1];
  }
  rows[0] += std::max<int64_t>(0, total - used);
  std::mt19937 rng(G);
  std::shuffle(rows.begin(), rows.end(), rng);
  return rows;
}

struct Fixture {
  int64_t H, I, total = 0;
  int64_t ldw = 0;  // row stride of gate and up: I, or 2I when fused
  DType dtype;
  std::vector<int64_t> rows;
  std::vector<std::vector<float>> w32;   // per group: gate|up|down fp32 (naive baseline)
  std::vector<std::vector<char>> w, g;   // executor storage (dtype), grads fp32
  std::vector<char> x, y, dy, dx;
  std::vector<float> x32, dy32, pre;
  ComputeView view;
};

void Fill(std::vector<float>& v, std::mt19937& rng, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  for (float& f : v) f = u(rng);
}

void Store(const std::vector<float>& src, DType dtype, std::vector<char>* dst) {
  dst->resize(src.size() * moonep::DTypeSize(dtype));
  moonep::ConvertFromFloat(src.data(), dst->data(), dtype, src.size());
}

// Per group, one block of 3 H I elements: gate [H, I], up [H, I], down [I, H] one after the
// other, or with `fused` a [H, 2I] gate|up tensor (gate columns [0, I), up [I, 2I)) then down.
Fixture Make(int64_t H, int64_t I, DType dtype, const std::vector<int64_t>& rows, bool fused) {
  Fixture f{H, I, 0, fused ? 2 * I : I, dtype, rows, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  std::mt19937 rng(7);
  const int G = static_cast<int>(rows.size());
  f.view.hidden = H;
  f.view.intermediate = I;
  f.view.dtype = dtype;
  f.view.groups.resize(G);
  for (int g = 0; g < G; ++g) {
    std::vector<float> w(3 * H * I);
    Fill(w, rng, 1.0f / std::sqrt(static_cast<float>(H)));
    if (dtype == DType::kBFloat16) {  // the baseline sees the same rounded weights
      for (float& v : w) v = moonep::BFloat16::FromFloat(v).ToFloat();
    }
    f.w32.push_back(std::move(w));
    f.w.emplace_back();
    // fp32: the executor reads the baseline's copy (no duplicate of the largest buffers).
    if (dtype != DType::kFloat32) Store(f.w32.back(), dtype, &f.w.back());
    f.g.emplace_back(3 * H * I * sizeof(float), 0);
    char* wb = dtype == DType::kFloat32 ? reinterpret_cast<char*>(f.w32.back().data())
                                        : f.w.back().data();
    char* gb = f.g.back().data();
    const size_t part = H * I * moonep::DTypeSize(dtype), gpart = H * I * sizeof(float);
    GroupView& gv = f.view.groups[g];
    gv.expert = g;
    gv.row_offset = f.total;
    gv.row_count = gv.padded_count = rows[g];
    // Where up starts and the row stride of gate and up.
    const size_t up_off = fused ? I * moonep::DTypeSize(dtype) : part;
    const size_t gup_off = fused ? I * sizeof(float) : gpart;
    auto strided = [&](char* p, DType dt, size_t off) {
      TensorView t = TensorView::Contiguous(p + off, dt, {H, I});
      t.strides[0] = f.ldw;
      return t;
    };
    gv.weights = {strided(wb, dtype, 0), strided(wb, dtype, up_off),
                  TensorView::Contiguous(wb + 2 * part, dtype, {I, H})};
    gv.grads = {strided(gb, DType::kFloat32, 0), strided(gb, DType::kFloat32, gup_off),
                TensorView::Contiguous(gb + 2 * gpart, DType::kFloat32, {I, H})};
    f.total += rows[g];
  }
  f.view.total_rows = f.total;
  f.x32.resize(f.total * H);
  f.dy32.resize(f.total * H);
  Fill(f.x32, rng, 1.0f);
  Fill(f.dy32, rng, 1.0f);
  if (dtype == DType::kBFloat16) {
    for (float& v : f.x32) v = moonep::BFloat16::FromFloat(v).ToFloat();
    for (float& v : f.dy32) v = moonep::BFloat16::FromFloat(v).ToFloat();
  }
  Store(f.x32, dtype, &f.x);
  Store(f.dy32, dtype, &f.dy);
  f.y.resize(f.x.size());
  f.dx.resize(f.x.size());
  f.pre.resize(f.total * 2 * I);
  return f;
}

// The naive per-group loop (fp32, multi-threaded BLAS per call). Writes y; with backward, dx
// and weight gradients into the given buffers.
struct Naive {
  std::vector<float> a, b, h, dh, y, dx, dw;
  void Run(Fixture& f, bool backward) {
    const int64_t H = f.H, I = f.I;
    a.resize(f.total * I);
    b.resize(f.total * I);
    h.resize(f.total * I);
    y.resize(f.total * H);
    if (backward) {
      dh.resize(f.total * I);
      dx.resize(f.total * H);
      dw.resize(3 * H * I);
    }
    for (size_t g = 0; g < f.rows.size(); ++g) {
      const int64_t n = f.rows[g], off = f.view.groups[g].row_offset;
      if (n == 0) continue;
      const float* wg = f.w32[g].data();
      const float* wu = f.ldw == I ? wg + H * I : wg + I;
      const float* wd = wg + 2 * H * I;
      const int64_t lw = f.ldw;
      const float* x = f.x32.data() + off * H;
      float *A = a.data() + off * I, *B = b.data() + off * I, *Hh = h.data() + off * I;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, I, H, 1, x, H, wg, lw, 0, A, I);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, I, H, 1, x, H, wu, lw, 0, B, I);
      for (int64_t k = 0; k < n * I; ++k) Hh[k] = A[k] / (1.0f + std::exp(-A[k])) * B[k];
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, H, I, 1, Hh, I, wd, H, 0,
                  y.data() + off * H, H);
      if (!backward) continue;
      const float* dy = f.dy32.data() + off * H;
      float* DH = dh.data() + off * I;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, I, H, 1, dy, H, wd, H, 0, DH, I);
      for (int64_t k = 0; k < n * I; ++k) {
        const float s = 1.0f / (1.0f + std::exp(-A[k])), silu = A[k] * s;
        const float da = DH[k] * B[k] * (s + silu * (1 - s)), db = DH[k] * silu;
        A[k] = da;
        B[k] = db;
      }
      float* DX = dx.data() + off * H;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, H, I, 1, A, I, wg, lw, 0, DX, H);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, H, I, 1, B, I, wu, lw, 1, DX, H);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, I, n, 1, x, H, A, I, 1, dw.data(), I);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, I, n, 1, x, H, B, I, 1,
                  dw.data() + H * I, I);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, I, H, n, 1, Hh, I, dy, H, 1,
                  dw.data() + 2 * H * I, H);
    }
  }
};

double MaxRelDiff(const std::vector<char>& got, DType dtype, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    const double v = moonep::LoadAsFloat(got.data(), dtype, k);
    diff = std::max(diff, std::abs(v - want[k]));
    scale = std::max(scale, static_cast<double>(std::abs(want[k])));
  }
  return scale > 0 ? diff / scale : diff;
}

// "a,b,c": each a whole number in [lo, hi].
bool ParseList(const char* s, int64_t lo, int64_t hi, std::vector<int>* out) {
  out->clear();
  std::string all(s);
  if (all.empty() || all.back() == ',') return false;
  for (size_t start = 0; start <= all.size();) {
    const size_t comma = std::min(all.find(',', start), all.size());
    int64_t v = 0;
    if (!moonep::env::ParseBase10InRange(all.substr(start, comma - start).c_str(), lo, hi, &v)) {
      return false;
    }
    out->push_back(static_cast<int>(v));
    start = comma + 1;
  }
  return true;
}

// "HxI,HxI": each side a whole number in [1, kMaxDim].
constexpr int64_t kMaxDim = 1 << 16;
bool ParseShapes(const char* s, std::vector<std::pair<int64_t, int64_t>>* out) {
  out->clear();
  std::string all(s);
  if (all.empty() || all.back() == ',') return false;
  for (size_t start = 0; start <= all.size();) {
    const size_t comma = std::min(all.find(',', start), all.size());
    const std::string one = all.substr(start, comma - start);
    const size_t x = one.find('x');
    int64_t h = 0, i = 0;
    if (x == std::string::npos ||
        !moonep::env::ParseBase10InRange(one.substr(0, x).c_str(), 1, kMaxDim, &h) ||
        !moonep::env::ParseBase10InRange(one.substr(x + 1).c_str(), 1, kMaxDim, &i)) {
      return false;
    }
    out->push_back({h, i});
    start = comma + 1;
  }
  return true;
}

// Memory available for the run: MemAvailable of /proc/meminfo (or the memory cgroup's room where
// smaller), else half the physical memory.
double AvailableBytes() {
  const int64_t available = moonep::HostMemoryAvailableBytes();
  if (available > 0) return static_cast<double>(available);
  return 0.5 * static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}

// Bytes one configuration holds, counted from what Make, Naive and main allocate: per group the
// fp32 weights (the baselines'), a dtype copy when not fp32, fp32 gradients; per row x, y, dy, dx
// in dtype, x and dy in fp32, the pre-activations [2I], the naive loop's a, b, h, dh [I] and y, dx
// [H], the one-GEMM baseline's output [9I]; once the naive dw [3HI] and the baseline's weights
// [9HI]; and the executor's shared workspace (3 I per row). For refusing what cannot fit.
double FixtureBytes(int64_t H, int64_t I, DType dtype, const std::vector<int64_t>& rows) {
  double total = 0;
  for (int64_t r : rows) total += static_cast<double>(r);
  const double G = static_cast<double>(rows.size()), hi = static_cast<double>(H) * I;
  const double ds = static_cast<double>(moonep::DTypeSize(dtype));
  const double copy = dtype == DType::kFloat32 ? 0 : ds;
  const double weights = G * 3 * hi * (4 + copy + 4);
  const double per_row = H * (4 * ds + 2 * 4 + 2 * 4) + I * 4.0 * (2 + 4 + 9 + 3);
  return weights + total * per_row + 3 * hi * 4 + 9 * hi * 4;
}

// The usage text, on stderr after a bad flag (exit 2) or on stdout for --help (exit 0).
int Usage(const char* argv0, bool asked = false) {
  std::fprintf(asked ? stdout : stderr,
               "usage: %s [--help] [--threads N] [--dtype fp32|bf16] [--reps N]\n"
               "          [--rows-per-group N] [--min-rows N] [--shapes HxI,...] [--groups G,...]\n"
               "          [--fused] [--quick] [-J] [--corrupt]\n"
               "  --threads 0..1024 (0: every core), --reps 1..1000, --rows-per-group 1..2^20,\n"
               "  --min-rows 0..2^20, --shapes H and I in 1..65536, --groups G in 1..4096;\n"
               "  --quick: one small shape, 8 groups, 3 reps, where those flags are not given;\n"
               "  --corrupt: self-test of the check against the naive loop (must exit 1)\n"
               "       %s --device cuda [--reps N] [--out results.csv] [--shapes-out shapes.txt]\n"
               "          [--quick]     (the CUDA grouped GEMM; see docs/cuda.md)\n",
               argv0, argv0);
  return asked ? 0 : 2;
}

}  // namespace

#ifdef MOONEP_BENCH_GEMM_CUDA
int RunCudaGemmBench(int argc, char** argv);  // bench/gemm_cuda/bench_gemm_cuda.cu
#endif

int main(int argc, char** argv) {
  // --device cpu (default) or cuda: the CUDA benchmark takes the remaining flags.
  {
    std::vector<char*> rest{argv[0]};
    std::string device = "cpu";
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--device" && i + 1 < argc) {
        device = argv[++i];
      } else if (a.rfind("--device=", 0) == 0) {
        device = a.substr(9);
      } else {
        rest.push_back(argv[i]);
      }
    }
    if (device == "cuda") {
#ifdef MOONEP_BENCH_GEMM_CUDA
      return RunCudaGemmBench(static_cast<int>(rest.size()), rest.data());
#else
      std::fprintf(stderr, "%s: --device cuda: this build has no CUDA (MOONEP_WITH_CUDA=OFF)\n",
                   argv[0]);
      return 2;
#endif
    }
    if (device != "cpu") {
      std::fprintf(stderr, "%s: --device %s: expected cpu or cuda\n", argv[0], device.c_str());
      return 2;
    }
    argc = static_cast<int>(rest.size());
    rest.push_back(nullptr);
    std::copy(rest.begin(), rest.end(), argv);
  }
  Options o;
  bool quick = false, reps_set = false, shapes_set = false, groups_set = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    // A whole number in [lo, hi] after flag a, else an error naming both.
    auto number = [&](int64_t lo, int64_t hi, int64_t* out) {
      const char* v = next();
      if (moonep::env::ParseBase10InRange(v, lo, hi, out)) return true;
      std::fprintf(stderr, "%s: %s %s: expected a whole number in [%ld, %ld]\n", argv[0],
                   a.c_str(), v == nullptr ? "(missing)" : v, static_cast<long>(lo),
                   static_cast<long>(hi));
      return false;
    };
    const char* v = nullptr;
    int64_t n = 0;
    if (a == "--help" || a == "-h") {
      return Usage(argv[0], /*asked=*/true);
    } else if (a == "-J") {
      o.json = true;
    } else if (a == "--fused") {
      o.fused = true;
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--corrupt") {
      o.corrupt = true;
    } else if (a == "--threads") {
      if (!number(0, 1024, &n)) return 2;
      o.threads = static_cast<int>(n);
    } else if (a == "--dtype" && (v = next())) {
      if (std::string(v) == "fp32") o.dtype = DType::kFloat32;
      else if (std::string(v) == "bf16") o.dtype = DType::kBFloat16;
      else return Usage(argv[0]);
    } else if (a == "--reps") {
      if (!number(1, 1000, &n)) return 2;
      o.reps = static_cast<int>(n);
      reps_set = true;
    } else if (a == "--rows-per-group") {
      if (!number(1, 1 << 20, &o.rows_per_group)) return 2;
    } else if (a == "--min-rows") {
      if (!number(0, 1 << 20, &o.min_rows)) return 2;
    } else if (a == "--shapes" && (v = next())) {
      if (!ParseShapes(v, &o.shapes)) {
        std::fprintf(stderr, "%s: --shapes %s: expected HxI[,HxI...], H and I in [1, %ld]\n",
                     argv[0], v, static_cast<long>(kMaxDim));
        return 2;
      }
      shapes_set = true;
    } else if (a == "--groups" && (v = next())) {
      if (!ParseList(v, 1, 4096, &o.groups)) {
        std::fprintf(stderr, "%s: --groups %s: expected G[,G...], each in [1, 4096]\n", argv[0], v);
        return 2;
      }
      groups_set = true;
    } else {
      return Usage(argv[0]);
    }
  }
  // --quick shrinks what was not given explicitly, wherever it stands on the line.
  if (quick) {
    if (!shapes_set) o.shapes = {{1024, 512}};
    if (!groups_set) o.groups = {8};
    if (!reps_set) o.reps = 3;
  }
  // Every configuration must fit: its rows in the executor's int32 row space, its buffers in
  // this machine's memory (half of it: the benchmark is not the only process). Checked before
  // the first table row, so a bad size costs nothing.
  const double memory = AvailableBytes();
  for (auto [H, I] : o.shapes) {
    for (int G : o.groups) {
      for (bool zipf : {false, true}) {
        if (static_cast<double>(G) * (o.rows_per_group + o.min_rows) > INT32_MAX) {
          std::fprintf(stderr, "%s: --groups %d x (--rows-per-group %ld + --min-rows %ld) rows "
                       "exceed 2^31 - 1\n", argv[0], G, static_cast<long>(o.rows_per_group),
                       static_cast<long>(o.min_rows));
          return 2;
        }
        const double need =
            FixtureBytes(H, I, o.dtype, GroupRows(G, o.rows_per_group, zipf, o.min_rows));
        if (memory > 0 && need > memory) {
          std::fprintf(stderr, "%s: %d groups of H=%ld x I=%ld (%s sizes) need %.1f GiB, above "
                       "the %.1f GiB available here: lower --groups, --shapes or "
                       "--rows-per-group\n", argv[0], G, static_cast<long>(H),
                       static_cast<long>(I), zipf ? "Zipf" : "uniform", need / (1 << 30),
                       memory / (1 << 30));
          return 2;
        }
      }
    }
  }
  const int threads = o.threads > 0 ? o.threads
                                    : std::min<int>(1024, std::thread::hardware_concurrency());
  if (!o.json) {
    std::printf("# moonep-bench-gemm: dtype %s, %d threads, medians of %d interleaved rounds, %ld rows "
                "per group (Zipf: the same total, each group at least %ld), gate|up %s\n",
                moonep::DTypeName(o.dtype), threads, o.reps, static_cast<long>(o.rows_per_group),
                static_cast<long>(o.min_rows), o.fused ? "fused [H, 2I]" : "separate [H, I]");
    std::printf("# GF/s of the executor; x1 = executor / one cblas_sgemm of the same FLOPs; "
                "xN = executor / naive per-group loop\n");
    std::printf("%6s %7s %5s %5s %6s %6s %6s | %8s %6s %6s | %8s %6s %6s | %8s\n", "groups", "sizes",
                "H", "I", "rows", "min", "max", "fwd GF/s", "x1", "xN", "f+b GF/s", "x1", "xN",
                "max err");
  } else {
    std::printf("[\n");
  }
  bool first = true;
  for (auto [H, I] : o.shapes) {
    for (int G : o.groups) {
      for (bool zipf : {false, true}) {
        const std::vector<int64_t> rows = GroupRows(G, o.rows_per_group, zipf, o.min_rows);
        Fixture f = Make(H, I, o.dtype, rows, o.fused);
        ExecutorConfig config{H, I, o.dtype, f.total, threads};
        auto made = cpu::CpuExecutor::Create(config);
        if (!made.ok()) {
          std::fprintf(stderr, "executor: %s\n", made.status().ToString().c_str());
          return 1;
        }
        Executor& ex = **made;
        const TensorView x = TensorView::Contiguous(f.x.data(), o.dtype, {f.total, H});
        const TensorView y = TensorView::Contiguous(f.y.data(), o.dtype, {f.total, H});
        const TensorView dy = TensorView::Contiguous(f.dy.data(), o.dtype, {f.total, H});
        const TensorView dx = TensorView::Contiguous(f.dx.data(), o.dtype, {f.total, H});
        ForwardOptions fo;
        fo.preactivations = TensorView::Contiguous(f.pre.data(), DType::kFloat32, {f.total, 2 * I});
        BackwardOptions bo;
        bo.preactivations = fo.preactivations;
        bool failed = false;
        SetBlasThreads(threads);
        // One GEMM of the same FLOPs: [rows, H] x [H, c*I], c = 3 (forward) or 9 (f+b).
        std::vector<float> wide(H * 9 * I), out(f.total * 9 * I);
        std::mt19937 rng(3);
        Fill(wide, rng, 0.01f);
        auto single = [&](int c) {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, f.total, c * I, H, 1,
                      f.x32.data(), H, wide.data(), c * I, 0, out.data(), c * I);
        };
        Naive naive;
        const Timing fwd = TimeRounds(
            o.reps, [&] { failed |= !ex.Forward(f.view, x, y, fo).ok(); }, [&] { single(3); },
            [&] { naive.Run(f, false); });
        const Timing fb = TimeRounds(
            o.reps,
            [&] {
              failed |= !ex.Forward(f.view, x, y, fo).ok();
              failed |= !ex.Backward(f.view, x, dy, dx, bo).ok();
            },
            [&] { single(9); }, [&] { naive.Run(f, true); });
        if (failed) {
          std::fprintf(stderr, "executor call failed\n");
          return 1;
        }
        // Correctness: a fresh forward + backward compared with the naive loop's outputs.
        ex.Forward(f.view, x, y, fo).IgnoreError();
        ex.Backward(f.view, x, dy, dx, bo).IgnoreError();
        naive.Run(f, true);
        if (o.corrupt) {  // one element of y off by its scale: the check below must catch it
          const float v = moonep::LoadAsFloat(f.y.data(), o.dtype, 0);
          moonep::StoreFromFloat(f.y.data(), o.dtype, 0, v + 1.0f + 2 * std::abs(v));
        }
        const double err = std::max(MaxRelDiff(f.y, o.dtype, naive.y), MaxRelDiff(f.dx, o.dtype, naive.dx));
        // The bars of the executor's tests against the fp64 reference (docs/executor.md): a
        // figure from wrong results is no figure.
        const double bar = o.dtype == DType::kFloat32 ? 1e-5 : 1e-2;
        if (!(err < bar)) {
          std::fprintf(stderr,
                       "moonep-bench-gemm: %d groups (%s) H=%ld I=%ld: the executor's y/dx differ "
                       "from the naive loop's by %.1e (bar %.0e): wrong results, no figure\n",
                       G, zipf ? "zipf1.2" : "uniform", static_cast<long>(H),
                       static_cast<long>(I), err, bar);
          return 1;
        }

        const double flops = 2.0 * f.total * H * I;
        const double fwd_gf = 3 * flops / fwd.seconds / 1e9, fb_gf = 9 * flops / fb.seconds / 1e9;
        const double r1f = fwd.vs_single, rnf = fwd.vs_naive, r1b = fb.vs_single, rnb = fb.vs_naive;
        const int64_t mn = *std::min_element(rows.begin(), rows.end());
        const int64_t mx = *std::max_element(rows.begin(), rows.end());
        if (o.json) {
          std::printf("%s  {\"groups\": %d, \"sizes\": \"%s\", \"H\": %ld, \"I\": %ld, \"rows\": %ld, "
                      "\"min_rows\": %ld, \"max_rows\": %ld, \"fwd_gflops\": %.2f, "
                      "\"fwd_vs_single\": %.3f, \"fwd_vs_naive\": %.3f, \"fb_gflops\": %.2f, "
                      "\"fb_vs_single\": %.3f, \"fb_vs_naive\": %.3f, \"max_rel_err\": %.2e}",
                      first ? "" : ",\n", G, zipf ? "zipf1.2" : "uniform", static_cast<long>(H),
                      static_cast<long>(I), static_cast<long>(f.total), static_cast<long>(mn),
                      static_cast<long>(mx), fwd_gf, r1f, rnf, fb_gf, r1b, rnb, err);
        } else {
          std::printf("%6d %7s %5ld %5ld %6ld %6ld %6ld | %8.1f %6.2f %6.2f | %8.1f %6.2f %6.2f | %8.1e\n",
                      G, zipf ? "zipf1.2" : "uniform", static_cast<long>(H), static_cast<long>(I),
                      static_cast<long>(f.total), static_cast<long>(mn), static_cast<long>(mx),
                      fwd_gf, r1f, rnf, fb_gf, r1b, rnb, err);
        }
        std::fflush(stdout);
        first = false;
      }
    }
  }
  if (o.json) std::printf("\n]\n");
  return 0;
}
