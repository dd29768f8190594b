// Scratch probe of the twenty-first session (not part of the product): how fast can one SM publish
// a split part's fp32 partial (128 rows x 256 columns = 128 KiB a CTA) and read the other parts'
// partials back, with the persistent kernel's plain stores and loads (LSU: 32 float4 a thread,
// 256 threads, `__stcg` / `__ldcg`) against TMA bulk copies (`cp.async.bulk`) through shared memory?
// The persistent kernel's measured costs inside a launch: 2.9-4.3 us to publish, 6.6 us (two
// partials) to 11.5 us (three) to read and store. The integer programs of the twenty-first session
// (split-sum-milp-s21.py) say 8x512_zipf's best buildable plan reaches 0.91 of dense if a part
// costs 2.0 us to publish and 1.0 us a partial to read.
//
// Each of `ctas` CTAs (all at once) runs one mode `reps` times and records its time per rep with
// %globaltimer; printed: median and max over CTAs of the median rep, us.
//   publish-lsu : registers -> global, float4 `st.global.cg`, layout [q][256 threads], then a fence
//   publish-tma : registers -> shared (same layout), then cp.async.bulk shared -> global in 4 chunks
//                 of 32 KiB, wait for completion, then a fence
//   read-lsu    : P partials (written by other CTAs, in L2), each 32 independent float4 a thread,
//                 summed into registers in part order (the kernel's fix-up)
//   read-tma    : the same partials in 32 KiB chunks by cp.async.bulk global -> shared into a ring of
//                 4 chunk buffers (mbarrier complete_tx), each thread adding its float4s from shared
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -o split-sum-probe split-sum-probe-s21.cu
// Run:   ./split-sum-probe [reps]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int kThreads = 256, kQ = 32;  // 32 float4 a thread: 128 floats = a 64 x 256 warpgroup tile
constexpr int kPartFloats = kThreads * kQ * 4;  // 32768 floats = 128 KiB
constexpr int kChunk = 32768, kChunks = kPartFloats * 4 / kChunk, kRingBufs = 4;

__device__ __forceinline__ uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t Smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarInit(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(Smem(b)), "r"(n));
}
__device__ __forceinline__ void MbarExpectTx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(Smem(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarWait(uint64_t* b, uint32_t parity) {
  uint32_t ok = 0;
  while (!ok) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(Smem(b)), "r"(parity)
        : "memory");
  }
}

enum Mode { kPublishLsu, kPublishTma, kReadLsu, kReadTma };

// parts: [ctas][P] partial slots; mine: slot of this CTA for publishing.
__global__ void __launch_bounds__(kThreads, 1)
    Probe(int mode, int P, int reps, float* slots, float* out, unsigned long long* times) {
  extern __shared__ __align__(1024) unsigned char smem[];
  float4* sbuf = reinterpret_cast<float4*>(smem);  // 128 KiB (publish) or 4 x 32 KiB ring (read)
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + kPartFloats * 4);
  const int t = threadIdx.x;
  float acc[kQ * 4];
#pragma unroll
  for (int i = 0; i < kQ * 4; ++i) acc[i] = (blockIdx.x * 7 + t * 3 + i) * 1e-3f;
  if (t == 0) {
    for (int i = 0; i < kRingBufs; ++i) MbarInit(&bar[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t phase_bits = 0;
  for (int rep = 0; rep < reps; ++rep) {
    __syncthreads();
    const uint64_t t0 = Now();
    if (mode == kPublishLsu) {
      float4* mine = reinterpret_cast<float4*>(slots) + static_cast<size_t>(blockIdx.x) * P * (kPartFloats / 4);
#pragma unroll
      for (int q = 0; q < kQ; ++q) __stcg(&mine[q * kThreads + t], make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]));
      __threadfence();
      __syncthreads();
    } else if (mode == kPublishTma) {
#pragma unroll
      for (int q = 0; q < kQ; ++q) sbuf[q * kThreads + t] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
      if (t == 0) {
        char* dst = reinterpret_cast<char*>(slots) + static_cast<size_t>(blockIdx.x) * P * kPartFloats * 4;
        for (int c = 0; c < kChunks; ++c) {
          asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * kChunk),
                       "r"(Smem(smem + c * kChunk)), "r"(kChunk)
                       : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        asm volatile("fence.proxy.async.global;" ::: "memory");
        __threadfence();
      }
      __syncthreads();
    } else if (mode == kReadLsu) {
      // The other CTAs' slots: CTA (blockIdx + 1 + b) % gridDim, slot 0.
      for (int b = 0; b < P; ++b) {
        const float4* part = reinterpret_cast<const float4*>(slots) +
                             static_cast<size_t>((blockIdx.x + 1 + b) % gridDim.x) * P * (kPartFloats / 4);
#pragma unroll
        for (int q = 0; q < kQ; ++q) {
          const float4 v = __ldcg(&part[q * kThreads + t]);
          acc[4 * q] += v.x;
          acc[4 * q + 1] += v.y;
          acc[4 * q + 2] += v.z;
          acc[4 * q + 3] += v.w;
        }
      }
    } else {
      // Chunk i of the P * kChunks: buffer i % 4. Thread 0 keeps 3 chunks ahead; a buffer is
      // refilled after a __syncthreads that follows every thread's use of it.
      const int total = P * kChunks;
      auto issue = [&](int i) {
        const int b = i / kChunks, c = i % kChunks;
        const char* src = reinterpret_cast<const char*>(slots) +
                          static_cast<size_t>((blockIdx.x + 1 + b) % gridDim.x) * P * kPartFloats * 4 + c * kChunk;
        uint64_t* br = &bar[i % kRingBufs];
        MbarExpectTx(br, kChunk);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                Smem(smem + (i % kRingBufs) * kChunk)),
            "l"(src), "r"(kChunk), "r"(Smem(br))
            : "memory");
      };
      if (t == 0) {
        for (int i = 0; i < kRingBufs && i < total; ++i) issue(i);
      }
      for (int i = 0; i < total; ++i) {
        const int buf = i % kRingBufs;
        MbarWait(&bar[buf], (phase_bits >> buf) & 1);
        phase_bits ^= 1u << buf;
        const float4* s = reinterpret_cast<const float4*>(smem + buf * kChunk);
        // Chunk c of a part holds float4 [c * 2048, + 2048) of the [q][256] layout: q in [8c, 8c + 8).
        const int c = i % kChunks;
#pragma unroll
        for (int qq = 0; qq < 8; ++qq) {
          const float4 v = s[qq * kThreads + t];
          const int q = 8 * c + qq;
          // q is not a compile-time index here; accumulate through a small switch-free trick:
          // add into acc via a register array indexed with the unrolled c (c is uniform).
#pragma unroll
          for (int cc = 0; cc < kChunks; ++cc) {
            if (cc == c) {
              acc[4 * (8 * cc + qq)] += v.x;
              acc[4 * (8 * cc + qq) + 1] += v.y;
              acc[4 * (8 * cc + qq) + 2] += v.z;
              acc[4 * (8 * cc + qq) + 3] += v.w;
            }
          }
          (void)q;
        }
        __syncthreads();
        if (t == 0 && i + kRingBufs < total) issue(i + kRingBufs);
      }
    }
    __syncthreads();
    if (t == 0) times[static_cast<size_t>(blockIdx.x) * reps + rep] = Now() - t0;
  }
  float s = 0;
#pragma unroll
  for (int i = 0; i < kQ * 4; ++i) s += acc[i];
  out[blockIdx.x * kThreads + t] = s;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  const int max_ctas = 132, maxP = 3;
  float *slots, *out;
  unsigned long long* times;
  CK(cudaMalloc(&slots, static_cast<size_t>(max_ctas) * maxP * kPartFloats * 4));
  CK(cudaMemset(slots, 0, static_cast<size_t>(max_ctas) * maxP * kPartFloats * 4));
  CK(cudaMalloc(&out, max_ctas * kThreads * 4));
  CK(cudaMalloc(&times, static_cast<size_t>(max_ctas) * reps * 8));
  const int smem = kPartFloats * 4 + 1024;
  CK(cudaFuncSetAttribute(Probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const char* names[] = {"publish-lsu", "publish-tma", "read-lsu", "read-tma"};
  std::vector<unsigned long long> h(static_cast<size_t>(max_ctas) * reps);
  for (int ctas : {24, 32, 66, 132}) {
    for (int P : {1, 2, 3}) {
      for (int mode = 0; mode < 4; ++mode) {
        if (mode < 2 && P != 1) continue;  // publishing is one partial
        // Fill the slots the read modes use (in L2: at most 132 x 3 x 128 KiB = 50 MiB, so write
        // them right before; every CTA's slot 0 is what the readers read).
        Probe<<<ctas, kThreads, smem>>>(kPublishLsu, P, 1, slots, out, times);
        CK(cudaGetLastError());
        Probe<<<ctas, kThreads, smem>>>(mode, P, reps, slots, out, times);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(h.data(), times, static_cast<size_t>(ctas) * reps * 8, cudaMemcpyDeviceToHost));
        std::vector<double> med(ctas);
        for (int b = 0; b < ctas; ++b) {
          std::vector<unsigned long long> v(h.begin() + static_cast<size_t>(b) * reps, h.begin() + static_cast<size_t>(b + 1) * reps);
          std::sort(v.begin() + 1, v.end());  // rep 0 warms up
          med[b] = v[1 + (reps - 1) / 2] / 1000.0;
        }
        std::sort(med.begin(), med.end());
        const double bytes = (mode < 2 ? 1 : P) * kPartFloats * 4.0;
        std::printf("%-12s ctas %3d partials %d: median %6.2f us  max %6.2f us  (%5.1f GB/s a CTA at the median)\n",
                    names[mode], ctas, mode < 2 ? 1 : P, med[ctas / 2], med[ctas - 1], bytes / med[ctas / 2] / 1e3);
      }
    }
  }
  return 0;
}
