#include "moonep/runtime/device_kernels.h"

#include <cuda_bf16.h>

namespace moonep::runtime {
namespace {

template <typename T>
__device__ inline float Load(const T* p) { return static_cast<float>(*p); }
template <>
__device__ inline float Load<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <typename T>
__device__ inline void Store(T* p, float v) { *p = v; }
template <>
__device__ inline void Store<__nv_bfloat16>(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// One block row-strided over rows, threads over the columns.
template <typename T>
__global__ void ScaleRowsKernel(T* rows, int64_t num_rows, int64_t hidden, const float* weights) {
  for (int64_t r = blockIdx.x; r < num_rows; r += gridDim.x) {
    const float w = weights[r];
    T* row = rows + r * hidden;
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) Store(row + h, Load(row + h) * w);
  }
}

}  // namespace

cudaError_t LaunchScaleRows(void* rows, DType dtype, int64_t num_rows, int64_t hidden,
                            const float* weights, cudaStream_t stream) {
  if (num_rows <= 0 || hidden <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(num_rows < 65535 ? num_rows : 65535);
  const unsigned threads = hidden >= 256 ? 256 : 128;
  if (dtype == DType::kFloat32) {
    ScaleRowsKernel<float><<<blocks, threads, 0, stream>>>(static_cast<float*>(rows), num_rows,
                                                           hidden, weights);
  } else {
    ScaleRowsKernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(rows), num_rows, hidden, weights);
  }
  return cudaGetLastError();
}

}  // namespace moonep::runtime
