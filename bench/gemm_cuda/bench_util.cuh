// What the CUDA GEMM benchmarks share (moonep-bench-gemm-cuda and moonep-gemm-probe): exit-on-error
// checks, a device fill with reproducible bf16 values, event timing, and the group sizes of the
// benchmark's shapes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "absl/status/status.h"

#define CHECK_CUDA(call)                                                                  \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)
#define CHECK_OK(expr)                                                                    \
  do {                                                                                    \
    absl::Status s_ = (expr);                                                             \
    if (!s_.ok()) {                                                                       \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.ToString().c_str());     \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

namespace moonep::bench_gemm {

// p[i] = bf16 of a splitmix64 hash of (i, seed) in [-scale, scale); each including file has its own.
static __global__ void FillBf16(uint16_t* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = (static_cast<float>(z >> 40) / 16777216.0f) * 2.0f - 1.0f;  // [-1, 1)
    p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(u * scale));
  }
}

// Milliseconds on `stream` from just before fn() to just after it, however many launches (and
// synchronizations) fn makes: one pair of events around the whole call.
template <typename Fn>
inline double SpanMs(cudaStream_t stream, Fn&& fn) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  CHECK_CUDA(cudaEventRecord(a, stream));
  fn();
  CHECK_CUDA(cudaEventRecord(b, stream));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return ms;
}

// Median milliseconds of `reps` event-timed runs of fn on `stream`, after 3 warm-ups.
template <typename Fn>
inline double TimeMs(cudaStream_t stream, int reps, Fn&& fn) {
  for (int i = 0; i < 3; ++i) fn();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> ms(reps);
  for (int r = 0; r < reps; ++r) ms[r] = SpanMs(stream, fn);
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

// Median milliseconds of each of fns, timed in rounds (one run of every fn per round, `reps`
// rounds, after 3 warm-up rounds) so that clock and temperature drifts hit all of them alike.
// With flush (a device buffer of flush_bytes, larger than the L2), the buffer is overwritten before
// every timed run, outside the timing, so that no fn finds its operands in the L2 from its own
// previous run (a dense GEMM's one weight matrix would, a grouped GEMM's many would not).
inline std::vector<double> TimeInterleavedMs(cudaStream_t stream, int reps,
                                             const std::vector<std::function<void()>>& fns,
                                             void* flush = nullptr, size_t flush_bytes = 0) {
  for (int i = 0; i < 3; ++i) {
    for (const auto& fn : fns) fn();
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<std::vector<double>> ms(fns.size(), std::vector<double>(reps));
  for (int r = 0; r < reps; ++r) {
    for (size_t f = 0; f < fns.size(); ++f) {
      if (flush != nullptr) CHECK_CUDA(cudaMemsetAsync(flush, (r + static_cast<int>(f)) & 0xFF, flush_bytes, stream));
      ms[f][r] = SpanMs(stream, fns[f]);
    }
  }
  std::vector<double> med;
  for (auto& m : ms) {
    std::sort(m.begin(), m.end());
    med.push_back(m[reps / 2]);
  }
  return med;
}

// Uniform sizes, or Zipf(1.2) sizes of the same total shuffled over the groups.
inline std::vector<int64_t> GroupSizes(int groups, int64_t avg, bool zipf, uint64_t seed) {
  std::vector<int64_t> sizes(groups, avg);
  if (!zipf) return sizes;
  const int64_t total = avg * groups;
  std::vector<double> w(groups);
  for (int i = 0; i < groups; ++i) w[i] = 1.0 / std::pow(i + 1.0, 1.2);
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  int64_t assigned = 0;
  for (int i = 0; i < groups; ++i) {
    sizes[i] = static_cast<int64_t>(std::floor(total * w[i] / sum));
    assigned += sizes[i];
  }
  sizes[0] += total - assigned;  // the hottest expert takes the rounding remainder
  std::mt19937_64 rng(seed);
  std::shuffle(sizes.begin(), sizes.end(), rng);  // hot experts anywhere in the view
  return sizes;
}

}  // namespace moonep::bench_gemm
