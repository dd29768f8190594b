// Scratch probe of the nineteenth session (not part of the product): can this project's own
// pipeline feed 128 x 128 tiles at cuBLAS's rate if the two consumer warpgroups each own a tile
// ("ping-pong", as cuBLAS's nvjet_sm90_tst_128x128_64x6 kernel probably does), instead of both
// working on one tile (the persistent kernel's narrow units, 0.72-0.79 of its whole ones)?
//
// The dense same-FLOPs GEMM C[4096][2048] = X[4096][7168] W[7168][2048], bf16, fp32 accumulation:
// 512 tiles of 128 x 128 on 132 persistent CTAs, each CTA's j-th tile to consumer warpgroup j % 2,
// whose main loops take turns; one producer thread fills a ring of six 32 KiB stages (A: 128 rows x
// 64 k; W: 64 k x 128 n as two 64-column panels) in the order the tiles run, each stage consumed by
// one warpgroup. Three variants: no clusters; clusters of two sharing the weights (one panel loaded
// by each CTA, multicast); and the tile computed transposed (weights as WGMMA's MN-major A). The
// transposed variant's output is wrong (not debugged): it is there for its timing only.
// Epilogue: bf16 stored straight from the accumulators. Checked against cublasGemmEx; timed against
// it in flushed, interleaved rounds (median of REPS). Results: pingpong-128x128-probe-s19.log.
//
// It reuses the persistent kernel's device helpers (mbarriers, TMA loads, WGMMA wrappers, tensor map
// encoders) by including its source; the library's archive then supplies the rest.
// Build (here, from the repository root, after building build-cuda):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -I. -Imoonep/include \
//     -o pingpong docs/results/2026-11-30/pingpong-128x128-probe-s19.cu build-cuda/lib/libmoonep_compute_cuda.a \
//     build-cuda/lib/libmoonep_core.a -lcublas -lcuda $(ls /usr/lib/x86_64-linux-gnu/libabsl_*.so)
// Run: ./pingpong [REPS]
#include "moonep/compute/cuda/persistent_gemm.cu"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace pp {
using namespace moonep::compute::cuda;

constexpr int kM = 4096, kN = 2048, kK = 7168;
constexpr int kTileM = 128, kTileN = 128, kStepK = 64, kRing = 6;
constexpr int kStageA = kTileM * kStepK * 2, kStageB = kStepK * kTileN * 2;  // 16 KiB each
constexpr int kSmem = kRing * (kStageA + kStageB) + 1024 + (2 * kRing + 2) * 8;

struct Args {
  CUtensorMap a, b, b1;  // b1: the weights in boxes of one 64-column panel (clusters)
  __nv_bfloat16* c;
};

#define CK(x)                                                                                  \
  do {                                                                                         \
    auto e_ = (x);                                                                             \
    if (e_ != 0) {                                                                             \
      std::fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, static_cast<int>(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// kCluster 2: CTAs 2i and 2i + 1 take row tiles 2r and 2r + 1 of the same column tile at the same
// time; each loads one of the two weight panels and multicasts it to both.
// kTrans: the tile computed as C^T = W^T X^T (the weights as WGMMA's MN-major A, the rows as its
// K-major B, as cuBLAS's column-major view and this kernel's transposed units have them) instead of
// C = X W (rows K-major A, weights MN-major B).
template <int kCluster, bool kTrans = false>
__global__ void __launch_bounds__(384, 1) PingPong(const __grid_constant__ Args p) {
#ifdef MOONEP_SM90A
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  unsigned char* sa = smem;
  unsigned char* sb = smem + kRing * kStageA;
  uint64_t* full = reinterpret_cast<uint64_t*>(sb + kRing * kStageB);
  uint64_t* empty = full + kRing;
  // turn[c]: warpgroup c may start its next tile's main loop. The other one arrives once it has
  // waited for the last stage of its own tile, so that no warpgroup waits on a stage's barrier
  // more than one phase ahead (the mbarrier parity wait cannot tell further phases apart).
  uint64_t* turn = empty + kRing;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  constexpr int kTilesN = kN / kTileN, kTiles = (kM / kTileM) * kTilesN, kSteps = kK / kStepK;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRing; ++s) {
      MbarInit(&full[s], 1);
      MbarInit(&empty[s], kCluster);  // one consumer warpgroup of each CTA that the loads reach
    }
    MbarInit(&turn[0], 1);
    MbarInit(&turn[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (kCluster > 1) {
    ClusterSync();
  } else {
    __syncthreads();
  }
  const int rank = kCluster > 1 ? static_cast<int>(ClusterRank()) : 0;
  const int first = blockIdx.x / kCluster, step = gridDim.x / kCluster;
  constexpr int kUnits = kTiles / kCluster;
  // Unit u: row tiles [kCluster * (u / kTilesN), + kCluster) of column tile u % kTilesN.
  auto tile_m0 = [&](int u) { return (kCluster * (u / kTilesN) + rank) * kTileM; };
  auto tile_n0 = [&](int u) { return (u % kTilesN) * kTileN; };
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 0) {
      int n = 0;  // stages filled so far
      for (int u = first; u < kUnits; u += step) {
        const int m0 = tile_m0(u), n0 = tile_n0(u);
        for (int k = 0; k < kSteps; ++k, ++n) {
          const int s = n % kRing;
          MbarWait(&empty[s], ((n / kRing) & 1) ^ 1);
          MbarExpectTx(&full[s], kStageA + kStageB);
          TmaLoad2d(sa + s * kStageA, &p.a, k * kStepK, m0, &full[s]);
          if (kCluster > 1) {
            TmaLoad3dMulticast(sb + s * kStageB + rank * (kStageB / 2), &p.b1, 0, k * kStepK, n0 / 64 + rank,
                               &full[s], 0x3);
          } else {
            TmaLoad3d(sb + s * kStageB, &p.b, 0, k * kStepK, n0 / 64, &full[s]);
          }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1, warp = tid / 32, lane = tid % 32;
    int j = 0, waits = 0;
    const uint32_t peer = static_cast<uint32_t>(rank ^ 1);
    auto release = [&](int s) {
      if (tid == 0) MbarArrive(&empty[s]);
      if (kCluster > 1 && tid == 32) MbarArriveCluster(&empty[s], peer);
    };
    for (int u = first; u < kUnits; u += step, ++j) {
      if (j % 2 != c) continue;
      if (j > 0) MbarWait(&turn[c], (waits++) & 1);
      const int m0 = tile_m0(u), n0 = tile_n0(u);
      float acc0[64], acc1[64];  // rows [0, 64) and [64, 128) of the tile
#pragma unroll
      for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.0f;
      int prev = -1;
      for (int k = 0; k < kSteps; ++k) {
        const int n = j * kSteps + k, s = n % kRing;
        MbarWait(&full[s], (n / kRing) & 1);
        WgmmaFence();
        const uint32_t a = SmemAddr(sa + s * kStageA), b = SmemAddr(sb + s * kStageB);
#pragma unroll
        for (int kk = 0; kk < kStepK / 16; ++kk) {
          if constexpr (kTrans) {  // M = the weight panel h, N = the 128 rows
            const uint64_t dx = Desc(a + kk * 32, 16, 1024);
            WgmmaMN<128, 1, 0>(acc0, Desc(b + kk * 16 * 128, 64 * kStepK * 2, 1024), dx);
            WgmmaMN<128, 1, 0>(acc1, Desc(b + 8192 + kk * 16 * 128, 64 * kStepK * 2, 1024), dx);
          } else {
            const uint64_t db = Desc(b + kk * 16 * 128, 64 * kStepK * 2, 1024);
            WgmmaMN<128, 0, 1>(acc0, Desc(a + kk * 32, 16, 1024), db);
            WgmmaMN<128, 0, 1>(acc1, Desc(a + 64 * 128 + kk * 32, 16, 1024), db);
          }
        }
        WgmmaCommit();
        WgmmaWait<1>();
        if (prev >= 0) release(prev);
        prev = s;
      }
      if (tid == 0) MbarArrive(&turn[1 - c]);
      WgmmaWait<0>();
      release(prev);
      // acc[4q + {0,1}]: row warp * 16 + lane / 4, columns 8q + 2 (lane % 4) + {0,1}; 4q + {2,3}: 8 rows down.
      auto store_t = [&](const float* acc, int col_base) {  // acc: (weight column, row) pairs
#pragma unroll
        for (int q = 0; q < 16; ++q) {
          const int col = n0 + col_base + warp * 16 + lane / 4;
          const int r = m0 + 8 * q + 2 * (lane % 4);
          p.c[static_cast<size_t>(r) * kN + col] = __float2bfloat16_rn(acc[4 * q]);
          p.c[static_cast<size_t>(r + 1) * kN + col] = __float2bfloat16_rn(acc[4 * q + 1]);
          p.c[static_cast<size_t>(r) * kN + col + 8] = __float2bfloat16_rn(acc[4 * q + 2]);
          p.c[static_cast<size_t>(r + 1) * kN + col + 8] = __float2bfloat16_rn(acc[4 * q + 3]);
        }
      };
      if constexpr (kTrans) {
        store_t(acc0, 0);
        store_t(acc1, 64);
        continue;
      }
      auto store = [&](const float* acc, int row_base) {
#pragma unroll
        for (int q = 0; q < 16; ++q) {
          const int col = n0 + 8 * q + 2 * (lane % 4);
          const int r = m0 + row_base + warp * 16 + lane / 4;
          *reinterpret_cast<__nv_bfloat162*>(p.c + static_cast<size_t>(r) * kN + col) =
              __floats2bfloat162_rn(acc[4 * q], acc[4 * q + 1]);
          *reinterpret_cast<__nv_bfloat162*>(p.c + static_cast<size_t>(r + 8) * kN + col) =
              __floats2bfloat162_rn(acc[4 * q + 2], acc[4 * q + 3]);
        }
      };
      store(acc0, 0);
      store(acc1, 64);
    }
  }
  if (kCluster > 1) ClusterSync();  // no CTA leaves while its peer may still arrive on its barriers
#endif
}

__global__ void Fill(uint16_t* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    x[i] = __bfloat16_as_ushort(__float2bfloat16_rn((static_cast<float>(z >> 40) / 16777216.0f) * 2.0f - 1.0f));
  }
}
__global__ void Diff(const __nv_bfloat16* x, const __nv_bfloat16* y, size_t n, float* out) {
  float d = 0, r = 0;
  int bad = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float a = __bfloat162float(x[i]), b = __bfloat162float(y[i]);
    if (!isfinite(a)) bad = 1;
    d = fmaxf(d, fabsf(a - b));
    r = fmaxf(r, fabsf(b));
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(d));
  atomicMax(reinterpret_cast<int*>(out + 1), __float_as_int(r));
  if (bad) atomicAdd(out + 2, 1.0f);
}

int Main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  void* encode = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &encode, 12000, cudaEnableDefault, &q));
  uint16_t *x, *w;
  __nv_bfloat16 *c, *ref;
  CK(cudaMalloc(&x, size_t{kM} * kK * 2));
  CK(cudaMalloc(&w, size_t{kK} * kN * 2));
  CK(cudaMalloc(&c, size_t{kM} * kN * 2));
  CK(cudaMalloc(&ref, size_t{kM} * kN * 2));
  Fill<<<1024, 256>>>(x, size_t{kM} * kK, 1);
  Fill<<<1024, 256>>>(w, size_t{kK} * kN, 2);
  Args args{};
  args.c = c;
  const cuuint64_t dims[3] = {64, kK, kN / 64};
  const cuuint64_t strides[2] = {uint64_t{kN} * 2, 128};
  const cuuint32_t box1[3] = {64, kStepK, 1};
  if (!Encode(encode, &args.a, x, kK, kM, kK, kStepK, kTileM) || !EncodePanels(encode, &args.b, w, kN, kK, kN, kStepK) ||
      !EncodeTiled(encode, &args.b1, w, 3, dims, strides, box1)) {
    std::fprintf(stderr, "tensor map encoding failed\n");
    return 1;
  }
  CK(cudaFuncSetAttribute(PingPong<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CK(cudaFuncSetAttribute(PingPong<1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CK(cudaFuncSetAttribute(PingPong<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CK(cudaFuncSetAttribute(PingPong<2>, cudaFuncAttributeNonPortableClusterSizeAllowed, 0));
  cublasHandle_t h;
  CK(cublasCreate(&h));
  const float one = 1, zero = 0;
  auto dense = [&] {
    CK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, kN, kM, kK, &one, w, CUDA_R_16BF, kN, x, CUDA_R_16BF, kK, &zero,
                    ref, CUDA_R_16BF, kN, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  auto ours1 = [&] { PingPong<1><<<132, 384, kSmem>>>(args); };
  auto ours3 = [&] { PingPong<1, true><<<132, 384, kSmem>>>(args); };
  auto ours2 = [&] {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(132);
    cfg.blockDim = dim3(384);
    cfg.dynamicSmemBytes = kSmem;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 2;
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, PingPong<2>, args));
  };
  dense();
  float* cmp;
  CK(cudaMalloc(&cmp, 12));
  for (int v = 1; v <= 3; ++v) {
    CK(cudaMemset(c, 0xff, size_t{kM} * kN * 2));
    v == 1 ? ours1() : v == 2 ? ours2() : ours3();
    CK(cudaDeviceSynchronize());
    CK(cudaMemset(cmp, 0, 12));
    Diff<<<256, 256>>>(c, ref, size_t{kM} * kN, cmp);
    float hc[3];
    CK(cudaMemcpy(hc, cmp, 12, cudaMemcpyDeviceToHost));
    std::printf("check (%s): max|diff| %.3g, max|ref| %.3g, rel %.2e, non-finite %g -> %s\n",
                v == 1 ? "no clusters" : v == 2 ? "clusters of 2" : "transposed, no clusters", hc[0], hc[1], hc[0] / hc[1], hc[2],
                hc[2] == 0 && hc[0] / hc[1] < 1e-2 ? "OK" : "WRONG");
  }
  void* flush;
  const size_t flush_bytes = size_t{256} << 20;
  CK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t[4];
  for (int r = 0; r < reps; ++r) {
    for (int v = 0; v < 4; ++v) {
      CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
      CK(cudaEventRecord(e0));
      v == 0 ? dense() : v == 1 ? ours1() : v == 2 ? ours2() : ours3();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t[v].push_back(ms * 1000);
    }
  }
  for (auto& v : t) std::sort(v.begin(), v.end());
  const double flops = 2.0 * kM * kN * kK;
  const float d = t[0][reps / 2], o1 = t[1][reps / 2], o2 = t[2][reps / 2], o3 = t[3][reps / 2];
  std::printf("dense cublasGemmEx %.1f us (%.0f TFLOP/s); ping-pong 128x128, no clusters %.1f us (%.3f of dense), "
              "clusters of 2 %.1f us (%.3f), transposed %.1f us (%.3f)\n", d, flops / d * 1e-6, o1, d / o1, o2, d / o2,
              o3, d / o3);
  return 0;
}
}  // namespace pp

int main(int argc, char** argv) { return pp::Main(argc, argv); }
