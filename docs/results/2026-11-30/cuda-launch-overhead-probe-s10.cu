// Launch overhead probe: empty kernels with small / 24 KiB params, with/without clusters and 225 KiB smem.
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>
struct Big { char b[24 * 1024]; };
struct Small { int x; };
__global__ void KSmall(const __grid_constant__ Small p) { if (p.x == 12345 && threadIdx.x == 999) printf("x"); }
__global__ void KBig(const __grid_constant__ Big p) { if (p.b[threadIdx.x % 64] == 77 && threadIdx.x == 999) printf("x"); }
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
template <typename K, typename P>
cudaError_t Launch(K k, const P& p, int cluster, size_t smem, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(132); cfg.blockDim = dim3(384); cfg.dynamicSmemBytes = smem; cfg.stream = s;
  cudaLaunchAttribute a; a.id = cudaLaunchAttributeClusterDimension; a.val.clusterDim.x = cluster; a.val.clusterDim.y = 1; a.val.clusterDim.z = 1;
  cfg.attrs = &a; cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, k, p);
}
int main() {
  cudaStream_t s; CK(cudaStreamCreate(&s));
  CK(cudaFuncSetAttribute(KSmall, cudaFuncAttributeMaxDynamicSharedMemorySize, 225 * 1024 + 1280));
  CK(cudaFuncSetAttribute(KBig, cudaFuncAttributeMaxDynamicSharedMemorySize, 225 * 1024 + 1280));
  void* flush; size_t fb = size_t{256} << 20; CK(cudaMalloc(&flush, fb));
  static Big big; Small small{1};
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int cluster : {1, 2}) for (size_t smem : {size_t{0}, size_t{225 * 1024 + 1280}}) for (int which = 0; which < 2; ++which) {
    for (int mode = 0; mode < 2; ++mode) {  // 0: after a memset (host hidden), 1: idle stream
      std::vector<float> ms;
      for (int r = 0; r < 60; ++r) {
        if (mode == 0) CK(cudaMemsetAsync(flush, r, fb, s)); else CK(cudaStreamSynchronize(s));
        cudaEventRecord(a, s);
        if (which == 0) CK(Launch(KSmall, small, cluster, smem, s)); else CK(Launch(KBig, big, cluster, smem, s));
        cudaEventRecord(b, s); cudaEventSynchronize(b);
        float t; cudaEventElapsedTime(&t, a, b); if (r >= 10) ms.push_back(t * 1000);
      }
      std::sort(ms.begin(), ms.end());
      printf("cluster %d smem %6zu params %-5s %-12s: event-timed %.2f us (min %.2f)\n", cluster, smem, which ? "24KiB" : "4B",
             mode == 0 ? "after memset" : "idle stream", ms[ms.size() / 2], ms[0]);
    }
    // back to back: 200 launches
    cudaEventRecord(a, s);
    for (int i = 0; i < 200; ++i) { if (which == 0) CK(Launch(KSmall, small, cluster, smem, s)); else CK(Launch(KBig, big, cluster, smem, s)); }
    cudaEventRecord(b, s); cudaEventSynchronize(b);
    float t; cudaEventElapsedTime(&t, a, b);
    printf("cluster %d smem %6zu params %-5s back to back: %.2f us per launch\n", cluster, smem, which ? "24KiB" : "4B", t * 1000 / 200);
  }
  return 0;
}
