// moonep-bench-gemm-cuda: the CUDA backend on the GPU, each figure against a baseline measured in
// the same run.
//   copy:      cudaMemcpyAsync device-to-device (the bandwidth ceiling; bytes read + written)
//   pack / combine / swiglu kernels: bytes read + written over time, and that over the copy rate
//   grouped GEMM, bf16, H=7168 -> I=2048 (X[rows, H] x W_g[H, I] per group, bf16 out), uniform
//   and Zipf(1.2) group sizes: per-group cublasGemmEx over streams ("streams"), one
//   cublasGemmGroupedBatchedEx ("grouped"), row chunks as one cublasGemmBatchedEx plus grouped
//   remainders ("chunked"), MoonEP's persistent kernel ("persistent", sm_90 only; 0 elsewhere),
//   what kAuto picks, and one dense cublasGemmEx of the
//   same FLOPs ([sum rows, H] x [H, I]) as the baseline; bench/torch_grouped_mm.py times
//   torch._grouped_mm on the same sizes (written to --shapes-out).
//   executor:  CudaExecutor forward and forward+backward (bf16, fp32 gradients) on a few shapes,
//              FLOPs over time against the dense rate.
// Times are medians of --reps CUDA-event-timed runs after warm-up; inputs are random (never zeros).
//
//   moonep-bench-gemm-cuda [--reps N] [--out results.csv] [--shapes-out shapes.txt] [--quick]
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "moonep/compute/cuda/cuda_executor.h"
#include "moonep/compute/cuda/grouped_gemm.h"
#include "moonep/compute/cuda/kernels.h"
#include "moonep/core/env.h"
#include "bench/gemm_cuda/bench_util.cuh"

namespace {

using moonep::DType;
using moonep::TensorView;
using namespace moonep::bench_gemm;
using namespace moonep::compute;
using namespace moonep::compute::cuda;

constexpr int64_t kH = 7168, kI = 2048;

void Fill(void* p, size_t bf16_elems, uint64_t seed, float scale = 1.0f) {
  FillBf16<<<2048, 256>>>(static_cast<uint16_t*>(p), bf16_elems, seed, scale);
  CHECK_CUDA(cudaGetLastError());
}

void* Alloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  return p;
}

struct Options {
  int reps = 20;
  bool quick = false;
  std::string out, shapes_out;
};

struct Row {
  std::string name;
  int groups;
  int64_t total, min_rows, max_rows;
  double dense_ms, streams_ms, grouped_ms, chunked_ms, persistent_ms;
  double dense_il_ms, auto_il_ms;  // the dense GEMM and auto's pick, interleaved, L2 flushed
  int64_t chunk_rows;
  std::string pick;
};

void PrintCard(FILE* f) {
  int dev = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  CHECK_CUDA(cudaGetDeviceProperties(&p, dev));
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  std::fprintf(f, "# card: %s, %d SMs, %.0f MiB, L2 %d MiB, CUDA runtime %d, driver %d\n", p.name,
               p.multiProcessorCount, p.totalGlobalMem / 1048576.0, p.l2CacheSize >> 20, rt, drv);
}

}  // namespace

// The whole benchmark; moonep-bench-gemm --device cuda and moonep-bench-gemm-cuda both call it.
int RunCudaGemmBench(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::printf("usage: moonep-bench-gemm --device cuda (or moonep-bench-gemm-cuda) [--reps N] "
                  "[--out results.csv] [--shapes-out shapes.txt] [--quick]\n"
                  "  --reps 1..1000 (default %d); see docs/cuda.md\n", opt.reps);
      return 0;
    } else if (a == "--device") {
      // moonep-bench-gemm-cuda takes moonep-bench-gemm's --device cuda too (the same flags).
      const std::string device = next();
      if (device != "cuda") {
        std::fprintf(stderr, "--device %s: this is the CUDA benchmark (--device cuda)\n",
                     device.c_str());
        return 2;
      }
    } else if (a == "--reps") {
      const std::string v = next();
      int64_t n = 0;
      if (!moonep::env::ParseBase10InRange(v.c_str(), 1, 1000, &n)) {
        std::fprintf(stderr, "--reps %s: expected a whole number in [1, 1000]\n", v.c_str());
        return 2;
      }
      opt.reps = static_cast<int>(n);
    } else if (a == "--out") {
      opt.out = next();
    } else if (a == "--shapes-out") {
      opt.shapes_out = next();
    } else if (a == "--quick") {
      opt.quick = true;
    } else {
      std::fprintf(stderr, "unknown flag '%s'\n", a.c_str());
      std::fprintf(stderr,
                   "usage: moonep-bench-gemm --device cuda (or moonep-bench-gemm-cuda) [--reps N] "
                   "[--out results.csv] "
                   "[--shapes-out shapes.txt] [--quick]\n");
      return 2;
    }
  }
  // The output files checked before anything is measured (an unwritable one is an error now, not
  // a run of minutes that ends without it), without truncating them: a run that cannot start
  // (no GPU) leaves an earlier results file as it was. They are written at the end.
  for (auto [path, flag] : {std::make_pair(&opt.shapes_out, "--shapes-out"),
                            std::make_pair(&opt.out, "--out")}) {
    if (path->empty()) continue;
    const int fd = ::open(path->c_str(), O_WRONLY | O_CREAT, 0644);
    if (fd < 0) {
      std::fprintf(stderr, "%s: cannot write '%s': %s\n", flag, path->c_str(), std::strerror(errno));
      return 2;
    }
    ::close(fd);
  }
  // The executor's MOONEP_CUDA_GEMM_* variables, checked as CudaExecutor::Create checks them: the
  // grouped GEMMs below size their cuBLAS workspaces from MOONEP_CUDA_GEMM_STREAMS (0 or a
  // negative value gave an empty or negative size). A bad one is an input error, like a bad flag.
  if (const absl::Status env = CheckCudaGemmEnvironment(); !env.ok()) {
    std::fprintf(stderr, "moonep-bench-gemm-cuda: %s\n", std::string(env.message()).c_str());
    return 2;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "moonep-bench-gemm-cuda: no CUDA device\n");
    return 1;
  }
  PrintCard(stdout);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));

  // ---- bandwidth: copy, pack, combine, swiglu ---------------------------------------------
  const int64_t T = opt.quick ? 4096 : 16384;  // tokens
  const int64_t K = 8;
  const size_t row_bytes = kH * 2;
  void* tokens = Alloc(T * row_bytes);
  void* expert_rows = Alloc(T * K * row_bytes);
  void* combined = Alloc(T * kH * 4);
  Fill(tokens, T * kH, 1);
  Fill(expert_rows, T * K * kH, 2);
  const size_t copy_bytes = T * K * row_bytes;
  const double copy_ms = TimeMs(stream, opt.reps, [&] {
    CHECK_CUDA(cudaMemcpyAsync(expert_rows, tokens, T * row_bytes, cudaMemcpyDeviceToDevice, stream));
  });
  const double copy_ms_big = TimeMs(stream, opt.reps, [&] {
    CHECK_CUDA(cudaMemcpyAsync(combined, expert_rows, T * kH * 4, cudaMemcpyDeviceToDevice, stream));
  });
  (void)copy_bytes;
  const double copy_tbs = std::max(2.0 * T * row_bytes / (copy_ms * 1e9), 2.0 * T * kH * 4 / (copy_ms_big * 1e9));
  std::printf("# %-28s %10s %10s %8s\n", "kernel", "time(us)", "TB/s", "vs_copy");
  std::printf("  %-28s %10.1f %10.3f %8.2f\n", "memcpy D2D (ceiling)", copy_ms_big * 1e3, copy_tbs, 1.0);

  // pack: 2 dispatch rows per token (dedup'd tokens to two destinations), 1% padding rows.
  const int64_t dst_rows = 2 * T;
  std::vector<int32_t> index(dst_rows);
  std::mt19937_64 rng(7);
  for (int64_t r = 0; r < dst_rows; ++r) index[r] = rng() % 100 == 0 ? -1 : static_cast<int32_t>(rng() % T);
  int32_t* d_index = static_cast<int32_t*>(Alloc(dst_rows * 4));
  CHECK_CUDA(cudaMemcpy(d_index, index.data(), dst_rows * 4, cudaMemcpyHostToDevice));
  int64_t valid = 0;
  for (int32_t v : index) valid += v >= 0;
  const double pack_ms = TimeMs(stream, opt.reps, [&] {
    CHECK_CUDA(LaunchPackRows(tokens, T, d_index, dst_rows, expert_rows, row_bytes, nullptr, stream));
  });
  const double pack_bytes = static_cast<double>(valid + dst_rows) * row_bytes + dst_rows * 4.0;
  std::printf("  %-28s %10.1f %10.3f %8.2f\n", "pack bf16 H=7168", pack_ms * 1e3,
              pack_bytes / (pack_ms * 1e9), pack_bytes / (pack_ms * 1e9) / copy_tbs);

  // combine: top-8 rows per token, 1/16 of the entries dropped (-1).
  std::vector<int32_t> cidx(T * K);
  std::vector<float> cw(T * K);
  int64_t used = 0;
  for (int64_t i = 0; i < T * K; ++i) {
    cidx[i] = rng() % 16 == 0 ? -1 : static_cast<int32_t>(i);
    cw[i] = 0.125f;
    used += cidx[i] >= 0;
  }
  int32_t* d_cidx = static_cast<int32_t*>(Alloc(T * K * 4));
  float* d_cw = static_cast<float*>(Alloc(T * K * 4));
  CHECK_CUDA(cudaMemcpy(d_cidx, cidx.data(), T * K * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_cw, cw.data(), T * K * 4, cudaMemcpyHostToDevice));
  for (DType out_dt : {DType::kBFloat16, DType::kFloat32}) {
    const double ms = TimeMs(stream, opt.reps, [&] {
      CHECK_CUDA(LaunchCombineRows(expert_rows, DType::kBFloat16, T * K, d_cidx, d_cw, T, K, kH,
                                   combined, out_dt, nullptr, stream));
    });
    const double bytes = used * static_cast<double>(row_bytes) + T * kH * moonep::DTypeSize(out_dt) + T * K * 8.0;
    std::printf("  %-28s %10.1f %10.3f %8.2f\n",
                out_dt == DType::kBFloat16 ? "combine top-8 bf16->bf16" : "combine top-8 bf16->fp32",
                ms * 1e3, bytes / (ms * 1e9), bytes / (ms * 1e9) / copy_tbs);
  }
  // swiglu over T*2 rows of I: a|b fp32 in, h bf16 out (forward); a, b, dh in, h, da, db out.
  {
    const int64_t R = 2 * T;
    float* ab = static_cast<float*>(Alloc(R * 2 * kI * 4));
    float* dh = static_cast<float*>(Alloc(R * kI * 4));
    void* h = Alloc(R * kI * 2);
    void* dab = Alloc(R * 2 * kI * 2);
    Fill(ab, R * 2 * kI * 2, 3);  // random bits as bf16 pairs: finite values in fp32 too
    Fill(dh, R * kI * 2, 4);
    RowSegment seg{0, R};
    int64_t prefix[2] = {0, R};
    RowSegment* d_seg = static_cast<RowSegment*>(Alloc(sizeof(seg)));
    int64_t* d_prefix = static_cast<int64_t*>(Alloc(sizeof(prefix)));
    CHECK_CUDA(cudaMemcpy(d_seg, &seg, sizeof(seg), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_prefix, prefix, sizeof(prefix), cudaMemcpyHostToDevice));
    SegmentTable table{d_seg, d_prefix, 1, R};
    const double fwd = TimeMs(stream, opt.reps, [&] {
      CHECK_CUDA(LaunchSwiGluForward(table, ab, 2 * kI, kI, kI, h, DType::kBFloat16, kI, stream));
    });
    const double fwd_bytes = R * kI * (8.0 + 2.0);
    std::printf("  %-28s %10.1f %10.3f %8.2f\n", "swiglu fwd fp32->bf16 I=2048", fwd * 1e3,
                fwd_bytes / (fwd * 1e9), fwd_bytes / (fwd * 1e9) / copy_tbs);
    const double bwd = TimeMs(stream, opt.reps, [&] {
      CHECK_CUDA(LaunchSwiGluBackward(table, ab, 2 * kI, kI, dh, kI, kI, DType::kBFloat16, h, kI,
                                      dab, 2 * kI, kI, stream));
    });
    const double bwd_bytes = R * kI * (12.0 + 6.0);
    std::printf("  %-28s %10.1f %10.3f %8.2f\n", "swiglu bwd fp32->bf16 I=2048", bwd * 1e3,
                bwd_bytes / (bwd * 1e9), bwd_bytes / (bwd * 1e9) / copy_tbs);
    for (void* p : {static_cast<void*>(ab), static_cast<void*>(dh), h, dab, static_cast<void*>(d_seg), static_cast<void*>(d_prefix)}) cudaFree(p);
  }
  cudaFree(tokens);
  cudaFree(expert_rows);
  cudaFree(combined);
  cudaFree(d_index);
  cudaFree(d_cidx);
  cudaFree(d_cw);

  // ---- grouped GEMM -----------------------------------------------------------------------
  struct ShapeSpec {
    int groups;
    int64_t avg;
  };
  std::vector<ShapeSpec> shapes = {{8, 512}, {8, 2048}, {8, 8192}, {32, 128}, {32, 512},
                                   {32, 2048}, {64, 128}, {64, 512}, {64, 1024}};
  if (opt.quick) shapes = {{8, 512}, {32, 128}};
  int64_t max_total = 0;
  int max_groups = 0;
  for (const ShapeSpec& s : shapes) {
    max_total = std::max(max_total, s.groups * s.avg);
    max_groups = std::max(max_groups, s.groups);
  }
  void* X = Alloc(max_total * kH * 2);
  void* W = Alloc(static_cast<size_t>(max_groups) * kH * kI * 2);
  void* Y = Alloc(max_total * kI * 2);
  const size_t flush_bytes = size_t{256} << 20;  // > the L2 (50-60 MiB on Hopper)
  void* flush = Alloc(flush_bytes);
  Fill(X, max_total * kH, 11);
  Fill(W, static_cast<size_t>(max_groups) * kH * kI, 12, 0.02f);
  const int streams = static_cast<int>(*moonep::param::CheckedCudaGemmStreams());  // 1..16
  void* cublas_ws = Alloc(streams * GroupedGemm::kCublasWorkspaceBytes);
  auto gemm = GroupedGemm::Create(stream, streams, cublas_ws);
  CHECK_OK(gemm.status());
  auto staging = Staging::Create(1 << 20);
  CHECK_OK(staging.status());
  FILE* shapes_file = opt.shapes_out.empty() ? nullptr : std::fopen(opt.shapes_out.c_str(), "w");
  std::vector<Row> rows;
  GemmBatch batch, dense;
  batch.problems.reserve(64);
  auto run_batch = [&](GemmBatch* b, GemmStrategy s) {
    (*gemm)->set_strategy(s);
    CHECK_OK((*staging)->Begin());
    CHECK_OK((*gemm)->Plan(b, staging->get()));
    CHECK_OK((*staging)->Upload(stream));
    CHECK_OK((*gemm)->Run(b, **staging));
  };
  auto run = [&](GemmStrategy s) { run_batch(&batch, s); };
  for (const ShapeSpec& s : shapes) {
    for (bool zipf : {false, true}) {
      const std::vector<int64_t> sizes = GroupSizes(s.groups, s.avg, zipf, 100 + s.groups);
      const int64_t total = s.groups * s.avg;
      Row row;
      row.name = std::to_string(s.groups) + "x" + std::to_string(s.avg) + (zipf ? "_zipf1.2" : "_uniform");
      row.groups = s.groups;
      row.total = total;
      row.min_rows = *std::min_element(sizes.begin(), sizes.end());
      row.max_rows = *std::max_element(sizes.begin(), sizes.end());
      // Dense: [total, H] x [H, I] as one GEMM.
      dense.Clear(false, false, DType::kBFloat16, DType::kBFloat16);
      dense.problems.push_back({total, kI, kH, X, kH, W, kI, Y, kI, 0.0f, total});
      row.dense_ms = TimeMs(stream, opt.reps, [&] { run_batch(&dense, GemmStrategy::kStreams); });
      batch.Clear(false, false, DType::kBFloat16, DType::kBFloat16);
      int64_t off = 0;
      for (int g = 0; g < s.groups; ++g) {
        if (sizes[g] > 0) {
          batch.problems.push_back({sizes[g], kI, kH, static_cast<char*>(X) + off * kH * 2, kH,
                                    static_cast<char*>(W) + static_cast<size_t>(g) * kH * kI * 2, kI,
                                    static_cast<char*>(Y) + off * kI * 2, kI, 0.0f, sizes[g]});
        }
        off += sizes[g];
      }
      row.streams_ms = TimeMs(stream, opt.reps, [&] { run(GemmStrategy::kStreams); });
      row.grouped_ms = TimeMs(stream, opt.reps, [&] { run(GemmStrategy::kGrouped); });
      row.chunked_ms = TimeMs(stream, opt.reps, [&] { run(GemmStrategy::kChunked); });
      row.chunk_rows = batch.chunk_rows;
      row.persistent_ms = 0;
      run(GemmStrategy::kPersistent);
      if (batch.ran == GemmStrategy::kPersistent) {
        row.persistent_ms = TimeMs(stream, opt.reps, [&] { run(GemmStrategy::kPersistent); });
      }
      run(GemmStrategy::kAuto);
      row.pick = GemmStrategyName(batch.ran);
      {
        // The dense GEMM and auto's pick again, alternating run by run with the L2 overwritten
        // before each (TimeInterleavedMs): the same clocks and temperature for both, and neither
        // finds its operands in the L2 from its previous run. Back-to-back (block) timing lets the
        // dense GEMM keep its one weight matrix in the L2 and measures it in whatever clock state
        // the card is in at that moment; on the H200 it drifts by up to ~25 % between shapes.
        const std::vector<double> il = TimeInterleavedMs(
            stream, opt.reps,
            {[&] { run_batch(&dense, GemmStrategy::kStreams); }, [&] { run(GemmStrategy::kAuto); }},
            flush, flush_bytes);
        row.dense_il_ms = il[0];
        row.auto_il_ms = il[1];
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
      rows.push_back(row);
      if (shapes_file != nullptr) {
        std::fprintf(shapes_file, "%s", row.name.c_str());
        for (int64_t v : sizes) std::fprintf(shapes_file, " %ld", static_cast<long>(v));
        std::fprintf(shapes_file, "\n");
      }
    }
  }
  if (shapes_file != nullptr) std::fclose(shapes_file);
  auto tflops = [](int64_t total, double ms) { return 2.0 * total * kH * kI / (ms * 1e9); };
  std::printf("\n# grouped GEMM bf16 H=%ld -> I=%ld, TFLOP/s (ratio to the dense GEMM of the same FLOPs)\n",
              static_cast<long>(kH), static_cast<long>(kI));
  std::printf("# %-20s %6s %8s %6s %6s %8s %8s %6s %8s %6s %8s %6s %5s %10s %6s %10s\n", "shape", "groups",
              "rows", "min", "max", "dense", "streams", "ratio", "grouped", "ratio", "chunked", "ratio",
              "chunk", "persistent", "ratio", "auto");
  FILE* csv = opt.out.empty() ? nullptr : std::fopen(opt.out.c_str(), "w");
  if (csv != nullptr) {
    std::fprintf(csv, "shape,groups,rows,min_rows,max_rows,dense_tflops,streams_tflops,grouped_tflops,chunked_tflops,chunk_rows,persistent_tflops,auto,dense_il_tflops,auto_il_tflops\n");
  }
  for (const Row& r : rows) {
    const double d = tflops(r.total, r.dense_ms), st = tflops(r.total, r.streams_ms),
                 gr = tflops(r.total, r.grouped_ms), ch = tflops(r.total, r.chunked_ms),
                 pe = r.persistent_ms > 0 ? tflops(r.total, r.persistent_ms) : 0.0;
    std::printf("  %-20s %6d %8ld %6ld %6ld %8.1f %8.1f %6.2f %8.1f %6.2f %8.1f %6.2f %5ld %10.1f %6.2f %10s\n",
                r.name.c_str(), r.groups, static_cast<long>(r.total), static_cast<long>(r.min_rows),
                static_cast<long>(r.max_rows), d, st, st / d, gr, gr / d, ch, ch / d,
                static_cast<long>(r.chunk_rows), pe, pe / d, r.pick.c_str());
    if (csv != nullptr) {
      std::fprintf(csv, "%s,%d,%ld,%ld,%ld,%.2f,%.2f,%.2f,%.2f,%ld,%.2f,%s,%.2f,%.2f\n", r.name.c_str(), r.groups,
                   static_cast<long>(r.total), static_cast<long>(r.min_rows),
                   static_cast<long>(r.max_rows), d, st, gr, ch, static_cast<long>(r.chunk_rows), pe,
                   r.pick.c_str(), tflops(r.total, r.dense_il_ms), tflops(r.total, r.auto_il_ms));
    }
  }
  if (csv != nullptr) std::fclose(csv);
  std::printf("\n# the dense GEMM and auto's pick timed alternately, L2 overwritten before every run\n");
  std::printf("# %-20s %8s %8s %6s %10s\n", "shape", "dense", "auto", "ratio", "auto");
  for (const Row& r : rows) {
    const double d = tflops(r.total, r.dense_il_ms), a = tflops(r.total, r.auto_il_ms);
    std::printf("  %-20s %8.1f %8.1f %6.2f %10s\n", r.name.c_str(), d, a, a / d, r.pick.c_str());
  }
  gemm->reset();
  staging->reset();
  cudaFree(X);
  cudaFree(W);
  cudaFree(flush);
  cudaFree(Y);
  cudaFree(cublas_ws);

  // ---- executor end to end ----------------------------------------------------------------
  std::printf("\n# CudaExecutor bf16 (fp32 gradients), H=%ld I=%ld: TFLOP/s and ratio to the dense rate\n",
              static_cast<long>(kH), static_cast<long>(kI));
  std::printf("# %-20s %10s %8s %12s %8s\n", "shape", "fwd", "ratio", "fwd+bwd", "ratio");
  const std::vector<ShapeSpec> exec_shapes = opt.quick ? std::vector<ShapeSpec>{{8, 512}}
                                                       : std::vector<ShapeSpec>{{8, 2048}, {32, 512}};
  for (const ShapeSpec& s : exec_shapes) {
    const std::vector<int64_t> sizes = GroupSizes(s.groups, s.avg, true, 100 + s.groups);
    const int64_t R = s.groups * s.avg;
    const size_t wbytes = static_cast<size_t>(s.groups) * kH * kI * 2;
    void* wg = Alloc(3 * wbytes);  // gate | up | down blocks
    void* grads = Alloc(3 * wbytes * 2);
    void* x = Alloc(R * kH * 2);
    void* dy = Alloc(R * kH * 2);
    void* y = Alloc(R * kH * 2);
    void* dx = Alloc(R * kH * 2);
    float* pre = static_cast<float*>(Alloc(R * 2 * kI * 4));
    Fill(wg, 3 * wbytes / 2, 21, 0.02f);
    Fill(x, R * kH, 22);
    Fill(dy, R * kH, 23);
    CHECK_CUDA(cudaMemset(grads, 0, 3 * wbytes * 2));
    ComputeView view;
    view.hidden = kH;
    view.intermediate = kI;
    view.dtype = DType::kBFloat16;
    view.device = moonep::Device::kCuda;
    view.total_rows = R;
    int64_t off = 0;
    auto mat = [&](void* base, int which, int g, DType dt, int64_t r, int64_t c) {
      const size_t e = moonep::DTypeSize(dt);
      char* p = static_cast<char*>(base) + (static_cast<size_t>(which) * s.groups + g) * kH * kI * e;
      return TensorView::Contiguous(p, dt, {r, c}, moonep::Device::kCuda);
    };
    for (int g = 0; g < s.groups; ++g) {
      GroupView gv;
      gv.expert = g;
      gv.row_offset = off;
      gv.row_count = gv.padded_count = sizes[g];
      gv.weights = {mat(wg, 0, g, DType::kBFloat16, kH, kI), mat(wg, 1, g, DType::kBFloat16, kH, kI),
                    mat(wg, 2, g, DType::kBFloat16, kI, kH)};
      gv.grads = {mat(grads, 0, g, DType::kFloat32, kH, kI), mat(grads, 1, g, DType::kFloat32, kH, kI),
                  mat(grads, 2, g, DType::kFloat32, kI, kH)};
      view.groups.push_back(gv);
      off += sizes[g];
    }
    ExecutorConfig config;
    config.hidden = kH;
    config.intermediate = kI;
    config.dtype = DType::kBFloat16;
    config.max_rows = R;
    auto ex = CudaExecutor::Create(config);
    CHECK_OK(ex.status());
    (*ex)->set_synchronous(false);
    cudaStream_t es = (*ex)->stream();
    auto tv = [&](void* p) { return TensorView::Contiguous(p, DType::kBFloat16, {R, kH}, moonep::Device::kCuda); };
    ForwardOptions fo;
    fo.preactivations = TensorView::Contiguous(pre, DType::kFloat32, {R, 2 * kI}, moonep::Device::kCuda);
    BackwardOptions bo;
    bo.preactivations = fo.preactivations;
    const double fwd_ms = TimeMs(es, opt.reps, [&] { CHECK_OK((*ex)->Forward(view, tv(x), tv(y), fo)); });
    const double step_ms = TimeMs(es, opt.reps, [&] {
      CHECK_OK((*ex)->Forward(view, tv(x), tv(y), fo));
      CHECK_OK((*ex)->Backward(view, tv(x), tv(dy), tv(dx), bo));
    });
    CHECK_OK((*ex)->Synchronize());
    // Dense rate of this shape's first GEMM, from the table above.
    double dense = 0;
    const std::string name = std::to_string(s.groups) + "x" + std::to_string(s.avg) + "_zipf1.2";
    for (const Row& r : rows) {
      if (r.name == name) dense = tflops(r.total, r.dense_ms);
    }
    const double f_fwd = 6.0 * R * kH * kI, f_step = 18.0 * R * kH * kI;  // kept pre-activations
    const double t_fwd = f_fwd / (fwd_ms * 1e9), t_step = f_step / (step_ms * 1e9);
    std::printf("  %-20s %10.1f %8.2f %12.1f %8.2f\n", name.c_str(), t_fwd, dense > 0 ? t_fwd / dense : 0.0,
                t_step, dense > 0 ? t_step / dense : 0.0);
    ex->reset();
    for (void* p : {wg, grads, x, dy, y, dx, static_cast<void*>(pre)}) cudaFree(p);
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
