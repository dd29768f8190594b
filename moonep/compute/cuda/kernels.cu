#include "moonep/compute/cuda/kernels.h"

#include <cuda_bf16.h>

#include <algorithm>

namespace moonep::compute::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kBlock = 256;  // 8 warps, one row each at a time
constexpr int64_t kMaxBlocks = 8192;

// bf16 is handled as its 16 bits (uint16_t), so vectors are plain unions of integers.
using Bf16Bits = uint16_t;

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(Bf16Bits v) {
  return __uint_as_float(static_cast<uint32_t>(v) << 16);
}
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ Bf16Bits FromFloat<Bf16Bits>(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));  // round to nearest even, like the host
}

// V consecutive elements as one (or two) wide accesses: V * sizeof(T) is 4, 8, 16 or 32 bytes,
// or V == 1 (scalar path for unaligned shapes).
template <int V, typename T>
__device__ __forceinline__ void LoadVec(const T* __restrict__ p, float (&v)[V]) {
  constexpr int kBytes = V * static_cast<int>(sizeof(T));
  if constexpr (V == 1) {
    v[0] = ToFloat(p[0]);
  } else if constexpr (kBytes >= 16) {
    union {
      uint4 raw[kBytes / 16];
      T e[V];
    } u;
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) u.raw[i] = reinterpret_cast<const uint4*>(p)[i];
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = ToFloat(u.e[i]);
  } else {
    static_assert(kBytes == 8, "vector of 8 bytes expected");
    union {
      uint2 raw;
      T e[V];
    } u;
    u.raw = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = ToFloat(u.e[i]);
  }
}

template <int V, typename T>
__device__ __forceinline__ void StoreVec(T* __restrict__ p, const float (&v)[V]) {
  constexpr int kBytes = V * static_cast<int>(sizeof(T));
  if constexpr (V == 1) {
    p[0] = FromFloat<T>(v[0]);
  } else if constexpr (kBytes >= 16) {
    union {
      uint4 raw[kBytes / 16];
      T e[V];
    } u;
#pragma unroll
    for (int i = 0; i < V; ++i) u.e[i] = FromFloat<T>(v[i]);
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) reinterpret_cast<uint4*>(p)[i] = u.raw[i];
  } else {
    static_assert(kBytes == 8, "vector of 8 bytes expected");
    union {
      uint2 raw;
      T e[V];
    } u;
#pragma unroll
    for (int i = 0; i < V; ++i) u.e[i] = FromFloat<T>(v[i]);
    *reinterpret_cast<uint2*>(p) = u.raw;
  }
}

__device__ __forceinline__ int64_t GlobalWarp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}
__device__ __forceinline__ int64_t NumWarps() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
}

// The buffer row of compact row c: the last segment whose prefix is <= c (segments non-empty).
__device__ __forceinline__ int64_t SegmentRow(const SegmentTable& t, int64_t c) {
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t.prefix[mid] <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return t.segments[lo].begin + (c - t.prefix[lo]);
}

unsigned Blocks(int64_t rows) {
  const int64_t warps_per_block = kBlock / kWarp;
  return static_cast<unsigned>(std::max<int64_t>(
      1, std::min<int64_t>((rows + warps_per_block - 1) / warps_per_block, kMaxBlocks)));
}

// Copies one row of `units` units, four independent loads in flight per lane.
template <typename U>
__device__ __forceinline__ void CopyRow(const U* __restrict__ in, U* __restrict__ out, int64_t units,
                                        int lane) {
  int64_t u = lane;
  for (; u + 3 * kWarp < units; u += 4 * kWarp) {
    const U v0 = in[u], v1 = in[u + kWarp], v2 = in[u + 2 * kWarp], v3 = in[u + 3 * kWarp];
    out[u] = v0;
    out[u + kWarp] = v1;
    out[u + 2 * kWarp] = v2;
    out[u + 3 * kWarp] = v3;
  }
  for (; u < units; u += kWarp) out[u] = in[u];
}

template <typename U>
__device__ __forceinline__ void ZeroRow(U* __restrict__ out, int64_t units, int lane) {
  const U zero = U();
  for (int64_t u = lane; u < units; u += kWarp) out[u] = zero;
}

template <typename U>
__global__ void __launch_bounds__(kBlock) PackRowsKernel(const U* __restrict__ src, int64_t src_rows,
                                                         const int32_t* __restrict__ index,
                                                         int64_t dst_rows, U* __restrict__ dst,
                                                         int64_t units, int32_t* bad_index) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = GlobalWarp(); r < dst_rows; r += NumWarps()) {
    const int32_t s = index[r];
    U* out = dst + r * units;
    if (s >= 0 && s < src_rows) {
      CopyRow(src + static_cast<int64_t>(s) * units, out, units, lane);
    } else {
      if (s != -1 && lane == 0 && bad_index != nullptr) atomicAdd(bad_index, 1);
      ZeroRow(out, units, lane);
    }
  }
}

template <typename U>
__global__ void __launch_bounds__(kBlock) ZeroRowsKernel(SegmentTable rows, U* __restrict__ data,
                                                         int64_t units) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t c = GlobalWarp(); c < rows.total_rows; c += NumWarps()) {
    ZeroRow(data + SegmentRow(rows, c) * units, units, lane);
  }
}

template <int V, typename TIn, typename TOut>
__global__ void __launch_bounds__(kBlock) CombineKernel(const TIn* __restrict__ rows, int64_t num_rows,
                                                        const int32_t* __restrict__ index,
                                                        const float* __restrict__ weights,
                                                        int64_t tokens, int32_t top_k, int64_t cols,
                                                        TOut* __restrict__ out, int32_t* bad_index) {
  // Each warp keeps its token's (row, weight) pairs in shared memory: lanes that run out of
  // columns early leave the column loop, so the pairs cannot be shuffled inside it.
  __shared__ int32_t s_row[kBlock / kWarp][kWarp];
  __shared__ float s_w[kBlock / kWarp][kWarp];
  const int lane = threadIdx.x % kWarp, wib = threadIdx.x / kWarp;
  for (int64_t t = GlobalWarp(); t < tokens; t += NumWarps()) {
    // Rows outside the buffer are dropped (and counted).
    if (lane < top_k) {
      int32_t row = index[t * top_k + lane];
      if (row < -1 || row >= num_rows) {
        if (bad_index != nullptr) atomicAdd(bad_index, 1);
        row = -1;
      }
      s_row[wib][lane] = row;
      s_w[wib][lane] = weights[t * top_k + lane];
    }
    __syncwarp();
    for (int64_t c = static_cast<int64_t>(lane) * V; c < cols; c += kWarp * V) {
      float acc[V];
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = 0.0f;
#pragma unroll 4
      for (int k = 0; k < top_k; ++k) {
        const int32_t row = s_row[wib][k];
        const float w = s_w[wib][k];
        if (row < 0) continue;
        float v[V];
        LoadVec<V>(rows + static_cast<int64_t>(row) * cols + c, v);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = fmaf(w, v[i], acc[i]);
      }
      StoreVec<V>(out + t * cols + c, acc);
    }
    __syncwarp();
  }
}

__device__ __forceinline__ float Sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

template <int V, typename TH>
__global__ void __launch_bounds__(kBlock) SwiGluForwardKernel(SegmentTable rows, const float* __restrict__ ab,
                                                              int64_t ld_ab, int64_t b_offset,
                                                              int64_t inter, TH* __restrict__ h,
                                                              int64_t ld_h) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t c = GlobalWarp(); c < rows.total_rows; c += NumWarps()) {
    const int64_t r = SegmentRow(rows, c);
    const float* a_row = ab + r * ld_ab;
    const float* b_row = a_row + b_offset;
    TH* h_row = h + r * ld_h;
    for (int64_t i = static_cast<int64_t>(lane) * V; i < inter; i += kWarp * V) {
      float a[V], b[V], out[V];
      LoadVec<V>(a_row + i, a);
      LoadVec<V>(b_row + i, b);
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = a[j] * Sigmoid(a[j]) * b[j];
      StoreVec<V>(h_row + i, out);
    }
  }
}

template <int V, typename T>
__global__ void __launch_bounds__(kBlock) SwiGluBackwardKernel(
    SegmentTable rows, const float* __restrict__ ab, int64_t ld_ab, int64_t b_offset,
    const float* __restrict__ dh, int64_t ld_dh, int64_t inter, T* __restrict__ h, int64_t ld_h,
    T* __restrict__ dab, int64_t ld_dab, int64_t db_offset) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t c = GlobalWarp(); c < rows.total_rows; c += NumWarps()) {
    const int64_t r = SegmentRow(rows, c);
    const float* a_row = ab + r * ld_ab;
    const float* b_row = a_row + b_offset;
    const float* dh_row = dh + r * ld_dh;
    T* h_row = h + r * ld_h;
    T* da_row = dab + r * ld_dab;
    T* db_row = da_row + db_offset;
    for (int64_t i = static_cast<int64_t>(lane) * V; i < inter; i += kWarp * V) {
      float a[V], b[V], g[V], hv[V], da[V], db[V];
      LoadVec<V>(a_row + i, a);
      LoadVec<V>(b_row + i, b);
      LoadVec<V>(dh_row + i, g);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float sg = Sigmoid(a[j]), silu = a[j] * sg;
        hv[j] = silu * b[j];
        da[j] = g[j] * b[j] * (sg + silu * (1.0f - sg));
        db[j] = g[j] * silu;
      }
      StoreVec<V>(h_row + i, hv);
      StoreVec<V>(da_row + i, da);
      StoreVec<V>(db_row + i, db);
    }
  }
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The widest unit (16, 8, 4, 2 or 1 bytes) dividing the row length and every address.
size_t UnitBytes(size_t row_bytes, const void* a, const void* b) {
  for (size_t u : {16, 8, 4, 2}) {
    if (row_bytes % u == 0 && Aligned(a, u) && Aligned(b, u)) return u;
  }
  return 1;
}

template <typename U>
cudaError_t PackAs(const void* src, int64_t src_rows, const int32_t* index, int64_t dst_rows,
                   void* dst, size_t row_bytes, int32_t* bad_index, cudaStream_t stream) {
  PackRowsKernel<U><<<Blocks(dst_rows), kBlock, 0, stream>>>(
      static_cast<const U*>(src), src_rows, index, dst_rows, static_cast<U*>(dst),
      static_cast<int64_t>(row_bytes / sizeof(U)), bad_index);
  return cudaGetLastError();
}

template <typename U>
cudaError_t ZeroAs(const SegmentTable& rows, void* data, size_t row_bytes, cudaStream_t stream) {
  ZeroRowsKernel<U><<<Blocks(rows.total_rows), kBlock, 0, stream>>>(
      rows, static_cast<U*>(data), static_cast<int64_t>(row_bytes / sizeof(U)));
  return cudaGetLastError();
}

template <int V, typename TIn, typename TOut>
cudaError_t CombineAs(const void* rows, int64_t num_rows, const int32_t* index, const float* weights,
                      int64_t tokens, int32_t top_k, int64_t cols, void* out, int32_t* bad_index,
                      cudaStream_t stream) {
  CombineKernel<V, TIn, TOut><<<Blocks(tokens), kBlock, 0, stream>>>(
      static_cast<const TIn*>(rows), num_rows, index, weights, tokens, top_k, cols,
      static_cast<TOut*>(out), bad_index);
  return cudaGetLastError();
}

template <typename TIn, typename TOut>
cudaError_t CombineTyped(const void* rows, int64_t num_rows, const int32_t* index,
                         const float* weights, int64_t tokens, int32_t top_k, int64_t cols,
                         void* out, int32_t* bad_index, cudaStream_t stream) {
  // 16-byte loads of the input rows; the output vector is as wide as V elements of TOut.
  constexpr int V = 16 / sizeof(TIn);
  const bool vec = cols % V == 0 && Aligned(rows, 16) && Aligned(out, V * sizeof(TOut) >= 16 ? 16 : V * sizeof(TOut));
  if (vec) {
    return CombineAs<V, TIn, TOut>(rows, num_rows, index, weights, tokens, top_k, cols, out,
                                   bad_index, stream);
  }
  return CombineAs<1, TIn, TOut>(rows, num_rows, index, weights, tokens, top_k, cols, out,
                                 bad_index, stream);
}

}  // namespace

cudaError_t LaunchPackRows(const void* src, int64_t src_rows, const int32_t* index, int64_t dst_rows,
                           void* dst, size_t row_bytes, int32_t* bad_index, cudaStream_t stream) {
  if (dst_rows <= 0 || row_bytes == 0) return cudaSuccess;
  switch (UnitBytes(row_bytes, src, dst)) {
    case 16: return PackAs<uint4>(src, src_rows, index, dst_rows, dst, row_bytes, bad_index, stream);
    case 8: return PackAs<uint2>(src, src_rows, index, dst_rows, dst, row_bytes, bad_index, stream);
    case 4: return PackAs<uint32_t>(src, src_rows, index, dst_rows, dst, row_bytes, bad_index, stream);
    case 2: return PackAs<uint16_t>(src, src_rows, index, dst_rows, dst, row_bytes, bad_index, stream);
    default: return PackAs<uint8_t>(src, src_rows, index, dst_rows, dst, row_bytes, bad_index, stream);
  }
}

cudaError_t LaunchZeroRows(const SegmentTable& rows, void* data, size_t row_bytes,
                           cudaStream_t stream) {
  if (rows.total_rows <= 0 || rows.count <= 0 || row_bytes == 0) return cudaSuccess;
  switch (UnitBytes(row_bytes, data, data)) {
    case 16: return ZeroAs<uint4>(rows, data, row_bytes, stream);
    case 8: return ZeroAs<uint2>(rows, data, row_bytes, stream);
    case 4: return ZeroAs<uint32_t>(rows, data, row_bytes, stream);
    case 2: return ZeroAs<uint16_t>(rows, data, row_bytes, stream);
    default: return ZeroAs<uint8_t>(rows, data, row_bytes, stream);
  }
}

cudaError_t LaunchCombineRows(const void* rows, DType rows_dtype, int64_t num_rows,
                              const int32_t* index, const float* weights, int64_t tokens,
                              int32_t top_k, int64_t cols, void* out, DType out_dtype,
                              int32_t* bad_index, cudaStream_t stream) {
  if (top_k < 1 || top_k > kWarp || cols < 0) return cudaErrorInvalidValue;
  if (tokens <= 0 || cols == 0) return cudaSuccess;
  const bool in_bf16 = rows_dtype == DType::kBFloat16, out_bf16 = out_dtype == DType::kBFloat16;
  if (in_bf16 && out_bf16) {
    return CombineTyped<Bf16Bits, Bf16Bits>(rows, num_rows, index, weights, tokens, top_k, cols,
                                            out, bad_index, stream);
  }
  if (in_bf16) {
    return CombineTyped<Bf16Bits, float>(rows, num_rows, index, weights, tokens, top_k, cols, out,
                                         bad_index, stream);
  }
  if (out_bf16) {
    return CombineTyped<float, Bf16Bits>(rows, num_rows, index, weights, tokens, top_k, cols, out,
                                         bad_index, stream);
  }
  return CombineTyped<float, float>(rows, num_rows, index, weights, tokens, top_k, cols, out,
                                    bad_index, stream);
}

cudaError_t LaunchSwiGluForward(const SegmentTable& rows, const float* ab, int64_t ld_ab,
                                int64_t b_offset, int64_t intermediate, void* h, DType h_dtype,
                                int64_t ld_h, cudaStream_t stream) {
  if (rows.total_rows <= 0 || rows.count <= 0) return cudaSuccess;
  const bool bf16 = h_dtype == DType::kBFloat16;
  const size_t hsize = bf16 ? 2 : 4;
  // Vector path: every row start of a, b and h must be aligned for 4 elements.
  const bool vec = intermediate % 4 == 0 && ld_ab % 4 == 0 && b_offset % 4 == 0 && ld_h % 4 == 0 &&
                   Aligned(ab, 16) && Aligned(h, 4 * hsize);
  const unsigned blocks = Blocks(rows.total_rows);
  if (bf16) {
    auto* hp = static_cast<Bf16Bits*>(h);
    if (vec) {
      SwiGluForwardKernel<4, Bf16Bits><<<blocks, kBlock, 0, stream>>>(rows, ab, ld_ab, b_offset, intermediate, hp, ld_h);
    } else {
      SwiGluForwardKernel<1, Bf16Bits><<<blocks, kBlock, 0, stream>>>(rows, ab, ld_ab, b_offset, intermediate, hp, ld_h);
    }
  } else {
    auto* hp = static_cast<float*>(h);
    if (vec) {
      SwiGluForwardKernel<4, float><<<blocks, kBlock, 0, stream>>>(rows, ab, ld_ab, b_offset, intermediate, hp, ld_h);
    } else {
      SwiGluForwardKernel<1, float><<<blocks, kBlock, 0, stream>>>(rows, ab, ld_ab, b_offset, intermediate, hp, ld_h);
    }
  }
  return cudaGetLastError();
}

cudaError_t LaunchSwiGluBackward(const SegmentTable& rows, const float* ab, int64_t ld_ab,
                                 int64_t b_offset, const float* dh, int64_t ld_dh,
                                 int64_t intermediate, DType dtype, void* h, int64_t ld_h,
                                 void* dab, int64_t ld_dab, int64_t db_offset, cudaStream_t stream) {
  if (rows.total_rows <= 0 || rows.count <= 0) return cudaSuccess;
  const bool bf16 = dtype == DType::kBFloat16;
  const size_t esize = bf16 ? 2 : 4;
  const bool vec = intermediate % 4 == 0 && ld_ab % 4 == 0 && b_offset % 4 == 0 && ld_dh % 4 == 0 &&
                   ld_h % 4 == 0 && ld_dab % 4 == 0 && db_offset % 4 == 0 && Aligned(ab, 16) &&
                   Aligned(dh, 16) && Aligned(h, 4 * esize) && Aligned(dab, 4 * esize);
  const unsigned blocks = Blocks(rows.total_rows);
  if (bf16) {
    auto* hp = static_cast<Bf16Bits*>(h);
    auto* dp = static_cast<Bf16Bits*>(dab);
    if (vec) {
      SwiGluBackwardKernel<4, Bf16Bits><<<blocks, kBlock, 0, stream>>>(
          rows, ab, ld_ab, b_offset, dh, ld_dh, intermediate, hp, ld_h, dp, ld_dab, db_offset);
    } else {
      SwiGluBackwardKernel<1, Bf16Bits><<<blocks, kBlock, 0, stream>>>(
          rows, ab, ld_ab, b_offset, dh, ld_dh, intermediate, hp, ld_h, dp, ld_dab, db_offset);
    }
  } else {
    auto* hp = static_cast<float*>(h);
    auto* dp = static_cast<float*>(dab);
    if (vec) {
      SwiGluBackwardKernel<4, float><<<blocks, kBlock, 0, stream>>>(
          rows, ab, ld_ab, b_offset, dh, ld_dh, intermediate, hp, ld_h, dp, ld_dab, db_offset);
    } else {
      SwiGluBackwardKernel<1, float><<<blocks, kBlock, 0, stream>>>(
          rows, ab, ld_ab, b_offset, dh, ld_dh, intermediate, hp, ld_h, dp, ld_dab, db_offset);
    }
  }
  return cudaGetLastError();
}

}  // namespace moonep::compute::cuda
