#include "transport/nccl/nccl_kernels.h"

namespace moonep::transport::nccl {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

__device__ __forceinline__ float Bf16ToFloat(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float Load(const void* p, bool bf16, int64_t j) {
  return bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(p)[j]) : static_cast<const float*>(p)[j];
}

int Blocks(int64_t items, int per_block) {
  const int64_t b = (items + per_block - 1) / per_block;
  return static_cast<int>(b < 65535 ? (b < 1 ? 1 : b) : 65535);
}

__global__ void CountRoutingKernel(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t E,
                                   unsigned long long* counts, unsigned long long* invalid) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t* row = ids + t * top_k;
    bool bad = false;
    for (int32_t k = 0; k < top_k; ++k) {
      const int32_t e = row[k];
      if (e < -1 || e >= E) {
        bad = true;
        continue;
      }
      if (e < 0) continue;
      for (int32_t j = 0; j < k; ++j) bad |= row[j] == e;
      atomicAdd(counts + e, 1ull);
    }
    if (bad) atomicExch(invalid, 1ull);
  }
}

__global__ void FillRowMetaKernel(const int32_t* unique, const int32_t* entries,
                                  const float* weights, int64_t num_entries, int64_t n,
                                  RowMeta* meta, int32_t* bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = entries[i];
    float w = 0.0f;
    if (e >= 0 && e < num_entries) {
      w = weights[e];
    } else if (bad) {
      atomicAdd(bad, 1);
    }
    meta[i] = RowMeta{unique[i], w};
  }
}

// One warp per row; V is the copy unit (uint4, uint32_t or uint16_t).
template <typename V>
__global__ void ExpandRowsKernel(const RowSource* source, int64_t num_rows, const RowMeta* meta,
                                 int64_t num_meta, const int64_t* staging_begin, int32_t R,
                                 const char* staging, const char* x, int64_t num_entries,
                                 int32_t top_k, const float* topk_weights, size_t row_bytes,
                                 char* rows, float* weights_out, int32_t* bad) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t units = static_cast<int64_t>(row_bytes / sizeof(V));
  for (int64_t r = warp; r < num_rows; r += warps) {
    const RowSource s = source[r];
    const char* from = nullptr;
    float w = 0.0f;
    if (s.src >= 0 && s.src < R && s.pos >= 0 && s.pos < num_meta) {
      const RowMeta m = meta[s.pos];
      const int64_t row = staging_begin[s.src] + m.unique;
      if (m.unique >= 0 && row < staging_begin[s.src + 1]) {
        from = staging + row * row_bytes;
        w = m.weight;
      }
    } else if (s.src == -2 && s.pos >= 0 && s.pos < num_entries) {
      from = x + (s.pos / top_k) * row_bytes;
      w = topk_weights[s.pos];
    }
    if (from == nullptr && s.src != -1 && lane == 0 && bad) atomicAdd(bad, 1);
    V* to = reinterpret_cast<V*>(rows + r * row_bytes);
    const V* src = reinterpret_cast<const V*>(from);
    for (int64_t u = lane; u < units; u += 32) to[u] = from ? src[u] : V{};
    if (weights_out && lane == 0) weights_out[r] = w;
  }
}

__global__ void RowDotsKernel(const void* a, const void* b, bool bf16, int64_t cols,
                              const int32_t* row, int64_t num_rows, int64_t n, float* dots,
                              int32_t* bad) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t p = warp; p < n; p += warps) {
    const int32_t r = row[p];
    double sum = 0.0;
    if (r >= 0 && r < num_rows) {
      for (int64_t j = lane; j < cols; j += 32) {
        sum += static_cast<double>(Load(a, bf16, r * cols + j)) * Load(b, bf16, r * cols + j);
      }
    } else if (lane == 0 && bad) {
      atomicAdd(bad, 1);
    }
    for (int offset = 16; offset > 0; offset >>= 1)
      sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (lane == 0) dots[p] = static_cast<float>(sum);
  }
}

__global__ void ScatterValuesKernel(const float* values, int64_t num_values, const int32_t* index,
                                    int64_t n, float* out, int32_t* bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t v = index[i];
    float value = 0.0f;
    if (v >= 0 && v < num_values) {
      value = values[v];
    } else if (v != -1 && bad) {
      atomicAdd(bad, 1);
    }
    out[i] = value;
  }
}

__global__ void SumInOrderKernel(void* home, bool bf16, int64_t n, const void* const* sources,
                                 int32_t num_sources) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = Load(sources[0], bf16, j);
    for (int32_t s = 1; s < num_sources; ++s) acc += Load(sources[s], bf16, j);
    acc += Load(home, bf16, j);
    if (bf16) {
      static_cast<uint16_t*>(home)[j] = FloatToBf16(acc);
    } else {
      static_cast<float*>(home)[j] = acc;
    }
  }
}

bool Aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

cudaError_t LaunchCountRouting(const int32_t* topk_ids, int64_t num_tokens, int32_t top_k,
                               int32_t num_experts, int64_t* counts, int64_t* invalid,
                               cudaStream_t stream) {
  if (num_tokens <= 0 || top_k <= 0) return cudaSuccess;
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "64-bit counters");
  CountRoutingKernel<<<Blocks(num_tokens, kThreads), kThreads, 0, stream>>>(
      topk_ids, num_tokens, top_k, num_experts, reinterpret_cast<unsigned long long*>(counts),
      reinterpret_cast<unsigned long long*>(invalid));
  return cudaGetLastError();
}

cudaError_t LaunchFillRowMeta(const int32_t* unique, const int32_t* entries, const float* weights,
                              int64_t num_entries, int64_t n, RowMeta* meta, int32_t* bad,
                              cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FillRowMetaKernel<<<Blocks(n, kThreads), kThreads, 0, stream>>>(unique, entries, weights,
                                                                  num_entries, n, meta, bad);
  return cudaGetLastError();
}

cudaError_t LaunchExpandRows(const RowSource* source, int64_t num_rows, const RowMeta* meta,
                             int64_t num_meta, const int64_t* staging_begin, int32_t num_ranks,
                             const void* staging, const void* x, int64_t num_entries, int32_t top_k,
                             const float* topk_weights, size_t row_bytes, void* rows,
                             float* weights_out, int32_t* bad, cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  const int blocks = Blocks(num_rows, kWarpsPerBlock);
  const auto* s = static_cast<const char*>(staging);
  const auto* xs = static_cast<const char*>(x);
  auto* out = static_cast<char*>(rows);
  const bool a16 =
      row_bytes % 16 == 0 && Aligned(staging, 16) && Aligned(x, 16) && Aligned(rows, 16);
  const bool a4 = row_bytes % 4 == 0 && Aligned(staging, 4) && Aligned(x, 4) && Aligned(rows, 4);
  if (a16) {
    ExpandRowsKernel<uint4><<<blocks, kThreads, 0, stream>>>(
        source, num_rows, meta, num_meta, staging_begin, num_ranks, s, xs, num_entries, top_k,
        topk_weights, row_bytes, out, weights_out, bad);
  } else if (a4) {
    ExpandRowsKernel<uint32_t><<<blocks, kThreads, 0, stream>>>(
        source, num_rows, meta, num_meta, staging_begin, num_ranks, s, xs, num_entries, top_k,
        topk_weights, row_bytes, out, weights_out, bad);
  } else {
    ExpandRowsKernel<uint16_t><<<blocks, kThreads, 0, stream>>>(
        source, num_rows, meta, num_meta, staging_begin, num_ranks, s, xs, num_entries, top_k,
        topk_weights, row_bytes, out, weights_out, bad);
  }
  return cudaGetLastError();
}

cudaError_t LaunchRowDots(const void* a, const void* b, DType dtype, int64_t cols,
                          const int32_t* row, int64_t num_rows, int64_t n, float* dots,
                          int32_t* bad, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  RowDotsKernel<<<Blocks(n, kWarpsPerBlock), kThreads, 0, stream>>>(
      a, b, dtype == DType::kBFloat16, cols, row, num_rows, n, dots, bad);
  return cudaGetLastError();
}

cudaError_t LaunchScatterValues(const float* values, int64_t num_values, const int32_t* index,
                                int64_t n, float* out, int32_t* bad, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ScatterValuesKernel<<<Blocks(n, kThreads), kThreads, 0, stream>>>(values, num_values, index, n,
                                                                    out, bad);
  return cudaGetLastError();
}

cudaError_t LaunchSumInOrder(void* home, DType dtype, int64_t n, const void* const* sources,
                             int32_t num_sources, cudaStream_t stream) {
  if (n <= 0 || num_sources <= 0) return cudaSuccess;
  SumInOrderKernel<<<Blocks(n, kThreads), kThreads, 0, stream>>>(home, dtype == DType::kBFloat16, n,
                                                                 sources, num_sources);
  return cudaGetLastError();
}

}  // namespace moonep::transport::nccl
