// Scratch probe of the nineteenth session (not part of the product).
// Build: nvcc -O2 -arch=sm_90a -o lt_tiles_rand cublaslt-tiles-random-probe-s19.cu -lcublasLt
// Run:   ./lt_tiles_rand REPS [rand|const] [once]
// The fourteenth session's cublaslt-tiles-probe-s14.cu filled X and W with one constant byte (0x3c),
// and found cuBLAS's 128 x 128 tiles as fast as its 128 x 256 ones on the dense same-FLOPs GEMM
// (Y[4096,2048] = X[4096,7168] W[7168,2048], bf16). This one asks the same with random bf16 in
// [-1, 1) (the benchmark's data), flushed (256 MiB memset before each run), interleaved over the
// configs: the heuristic's, and algo 66 forced to the 128x128 / 128x256 / 256x128 tiles under each
// cluster shape. `once` runs each config one time only (for a profiler) and prints their order.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>
#define CK(x)                                                                       \
  do {                                                                              \
    auto e_ = (x);                                                                  \
    if (e_ != 0) {                                                                  \
      std::fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)e_); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)
constexpr int kH = 7168, kI = 2048, kRows = 4096;
struct Cfg {
  cublasLtMatmulAlgo_t algo;
  std::string name;
  std::vector<float> t;
};
__global__ void Fill(uint16_t* p, size_t n, uint64_t seed, bool constant) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    if (constant) {
      p[i] = 0x3c3c;
      continue;
    }
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = (static_cast<float>(z >> 40) / 16777216.0f) * 2.0f - 1.0f;
    p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(u));
  }
}
static std::string Describe(const cublasLtMatmulAlgo_t& a) {
  int id = 0, tile = 0, stages = 0, cluster = 0;
  size_t w;
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
  const char* t = tile == 20 ? "128x128" : tile == 23 ? "128x256" : tile == 24 ? "256x128" : "other";
  char b[160];
  std::snprintf(b, sizeof b, "algo %d tile %d (%s) stages %d cluster %d", id, tile, t, stages, cluster);
  return b;
}
int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  const bool constant = argc > 2 && std::strcmp(argv[2], "const") == 0;
  const bool once = argc > 3 && std::strcmp(argv[3], "once") == 0;
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  size_t ws_bytes = size_t{32} << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  const size_t flush_bytes = size_t{256} << 20;
  void* flush;
  CK(cudaMalloc(&flush, flush_bytes));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  uint16_t *w, *x, *y;
  CK(cudaMalloc(&w, size_t{kH} * kI * 2));
  CK(cudaMalloc(&x, size_t{kRows} * kH * 2));
  CK(cudaMalloc(&y, size_t{kRows} * kI * 2));
  Fill<<<1024, 256, 0, st>>>(w, size_t{kH} * kI, 1, constant);
  Fill<<<1024, 256, 0, st>>>(x, size_t{kRows} * kH, 2, constant);
  CK(cudaStreamSynchronize(st));
  cublasLtMatmulDesc_t desc;
  CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasLtMatrixLayout_t la, lb, lc;  // column-major: Y^T[2048, rows] = W^T[2048, 7168] X^T[7168, rows]
  CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, kI, kH, kI));
  CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, kH, kRows, kH));
  CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, kI, kRows, kI));
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
  std::vector<cublasLtMatmulHeuristicResult_t> res(16);
  int n = 0;
  CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 16, res.data(), &n));
  std::vector<Cfg> cfgs;
  std::set<std::string> seen;
  for (int i = 0; i < n && i < 4; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    auto d = Describe(res[i].algo);
    if (seen.insert(d).second) cfgs.push_back({res[i].algo, "heur" + std::to_string(i) + " " + d, {}});
  }
  cublasLtMatmulAlgo_t a;
  CK(cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                            CUDA_R_16BF, 66, &a));
  for (int t : {20, 23, 24}) {
    for (int c : {-1, (int)CUBLASLT_CLUSTER_SHAPE_1x1x1, (int)CUBLASLT_CLUSTER_SHAPE_2x1x1,
                  (int)CUBLASLT_CLUSTER_SHAPE_1x2x1, (int)CUBLASLT_CLUSTER_SHAPE_2x2x1}) {
      cublasLtMatmulAlgo_t b = a;
      cublasLtMatmulAlgoConfigSetAttribute(&b, CUBLASLT_ALGO_CONFIG_TILE_ID, &t, sizeof(t));
      if (c >= 0) cublasLtMatmulAlgoConfigSetAttribute(&b, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c, sizeof(c));
      cublasLtMatmulHeuristicResult_t r{};
      if (cublasLtMatmulAlgoCheck(lt, desc, la, lb, lc, lc, &b, &r) != CUBLAS_STATUS_SUCCESS) continue;
      if (r.workspaceSize > ws_bytes) continue;
      auto d = Describe(b);
      if (seen.insert(d).second) cfgs.push_back({b, "forced " + d, {}});
    }
  }
  const float alpha = 1, beta = 0;
  std::vector<bool> ok(cfgs.size(), true);
  std::printf("data %s, rows %d, %zu configs\n", constant ? "constant 0x3c3c" : "random [-1,1)", kRows, cfgs.size());
  for (size_t c = 0; c < cfgs.size(); ++c) {  // warm-up (one launch each, in this order), drop failures
    if (once) std::printf("  launch %zu: %s\n", c, cfgs[c].name.c_str());
    if (cublasLtMatmul(lt, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &cfgs[c].algo, ws, ws_bytes, st) !=
        CUBLAS_STATUS_SUCCESS)
      ok[c] = false;
    CK(cudaStreamSynchronize(st));
  }
  if (once) return 0;
  for (int r = 0; r < reps; ++r) {
    for (size_t c = 0; c < cfgs.size(); ++c) {
      if (!ok[c]) continue;
      CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes, st));
      CK(cudaEventRecord(e0, st));
      cublasLtMatmul(lt, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &cfgs[c].algo, ws, ws_bytes, st);
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      cfgs[c].t.push_back(ms * 1000);
    }
  }
  const double flops = 2.0 * kRows * kH * kI;
  float base = 0;
  for (size_t c = 0; c < cfgs.size(); ++c) {
    if (!ok[c]) {
      std::printf("  failed: %s\n", cfgs[c].name.c_str());
      continue;
    }
    auto v = cfgs[c].t;
    std::sort(v.begin(), v.end());
    const float med = v[v.size() / 2];
    if (c == 0) base = med;
    std::printf("  %7.1f us %6.1f TFLOP/s x%.3f of heur0  %s\n", med, flops / med * 1e-6, base / med,
                cfgs[c].name.c_str());
  }
  return 0;
}
