#include <cstdint>
#include <cuda_bf16.h>
namespace x {
#include "moonep/compute/cuda/wgmma_ops.inc"
}
// The least per-thread register target ptxas accepts for a loop of m64nNk16 WGMMAs (N = NCOLS),
// fp32 accumulators in registers.
__global__ void __maxnreg__(NREG) k(float* out, int iters, uint64_t d0, uint64_t d1) {
  float acc[NCOLS / 2];
#pragma unroll
  for (int i = 0; i < NCOLS / 2; ++i) acc[i] = 0;
  for (int k = 0; k < iters; ++k) {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    x::WgmmaMN<NCOLS, 0, 1>(acc, d0, d1);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
#pragma unroll
  for (int i = 0; i < NCOLS / 2; ++i) out[threadIdx.x * (NCOLS / 2) + i] = acc[i];
}
