// Scratch probe of the fourteenth session (not part of the product). Build: nvcc -O2 -arch=sm_90a -o lt_tiles cublaslt-tiles-probe-s14.cu -lcublasLt; run: ./lt_tiles 10.
// The first run (first half of cublaslt-tiles-s14.log) had no forced-stage loop; the second (second half) skipped the per-id tile loop.
// Scratch: which cuBLASLt tile shapes run the dense same-FLOPs GEMM (Y[rows,2048] = X[rows,7168] W[7168,2048], bf16)
// fastest on this card, flushed (256 MiB memset before each run), interleaved over configs.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>
#define CK(x) do { auto e_ = (x); if (e_ != 0) { std::fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)e_); std::exit(1);} } while (0)
constexpr int kH = 7168, kI = 2048;
struct Cfg { cublasLtMatmulAlgo_t algo; std::string name; std::vector<float> t; };
static std::string Describe(const cublasLtMatmulAlgo_t& a) {
  int id = 0, tile = 0, stages = 0, splitk = 0, cluster = 0, inner = 0; size_t w;
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, sizeof(inner), &w);
  char b[160];
  std::snprintf(b, sizeof b, "algo %d tile %d stages %d splitk %d cluster %d inner %d", id, tile, stages, splitk, cluster, inner);
  return b;
}
int main(int argc, char** argv) {
  int reps = argc > 1 ? std::atoi(argv[1]) : 10;
  cublasLtHandle_t lt; CK(cublasLtCreate(&lt));
  size_t ws_bytes = size_t{32} << 20; void* ws; CK(cudaMalloc(&ws, ws_bytes));
  size_t flush_bytes = size_t{256} << 20; void* flush; CK(cudaMalloc(&flush, flush_bytes));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int rows : {4096, 16384}) {
    void *w, *x, *y;
    CK(cudaMalloc(&w, size_t{kH} * kI * 2)); CK(cudaMalloc(&x, size_t{rows} * kH * 2)); CK(cudaMalloc(&y, size_t{rows} * kI * 2));
    CK(cudaMemset(w, 0x3c, size_t{kH} * kI * 2)); CK(cudaMemset(x, 0x3c, size_t{rows} * kH * 2));
    cublasLtMatmulDesc_t desc; CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasLtMatrixLayout_t la, lb, lc;
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, kI, kH, kI));
    CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, kH, rows, kH));
    CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, kI, rows, kI));
    cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    std::vector<cublasLtMatmulHeuristicResult_t> res(128); int n = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 128, res.data(), &n));
    std::vector<Cfg> cfgs; std::set<std::string> seen;
    for (int i = 0; i < n; ++i) if (res[i].state == CUBLAS_STATUS_SUCCESS) {
      auto d = Describe(res[i].algo);
      if (seen.insert(d).second) cfgs.push_back({res[i].algo, "heur" + std::to_string(i) + " " + d, {}});
    }
    // Forced stage counts for the heuristic's own algos (by tile).
    {
      size_t nh = cfgs.size();
      for (size_t h = 0; h < nh; ++h) {
        for (int stg : {CUBLASLT_MATMUL_STAGES_64x2, CUBLASLT_MATMUL_STAGES_64x3, CUBLASLT_MATMUL_STAGES_64x4,
                        CUBLASLT_MATMUL_STAGES_64x5, CUBLASLT_MATMUL_STAGES_64x6,
                        CUBLASLT_MATMUL_STAGES_128x2, CUBLASLT_MATMUL_STAGES_128x3, CUBLASLT_MATMUL_STAGES_128x4}) {
          cublasLtMatmulAlgo_t b = cfgs[h].algo;
          cublasLtMatmulAlgoConfigSetAttribute(&b, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stg, sizeof(stg));
          cublasLtMatmulHeuristicResult_t r{};
          if (cublasLtMatmulAlgoCheck(lt, desc, la, lb, lc, lc, &b, &r) != CUBLAS_STATUS_SUCCESS) continue;
          auto d = Describe(b);
          if (seen.insert(d).second) cfgs.push_back({b, "stages " + d, {}});
        }
      }
    }
    // Every algo id x every tile it reports, stages left to the library.
    int ids[256]; int nid = 0;
    CK(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, 256, ids, &nid));
    std::printf("rows %d: %d heuristic results, %d algo ids\n", rows, n, nid);
    for (int k = 0; k < nid && cfgs.size() < 220; ++k) {
      cublasLtMatmulAlgo_t a; if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, ids[k], &a) != CUBLAS_STATUS_SUCCESS) continue;
      size_t sz = 0; cublasLtMatmulAlgoCapGetAttribute(&a, CUBLASLT_ALGO_CAP_TILE_IDS, nullptr, 0, &sz);
      std::vector<int> tiles(sz / sizeof(int)); if (sz) cublasLtMatmulAlgoCapGetAttribute(&a, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(), sz, &sz);
      std::vector<int> clusters = {-1, CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1, CUBLASLT_CLUSTER_SHAPE_2x2x1};
      std::printf("  id %d: %zu tiles, %zu cluster shapes\n", ids[k], tiles.size(), clusters.size());
      for (int t : tiles) for (int c : clusters) {
        cublasLtMatmulAlgo_t b = a;
        cublasLtMatmulAlgoConfigSetAttribute(&b, CUBLASLT_ALGO_CONFIG_TILE_ID, &t, sizeof(t));
        if (c >= 0) cublasLtMatmulAlgoConfigSetAttribute(&b, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c, sizeof(c));
        cublasLtMatmulHeuristicResult_t r{};
        if (cublasLtMatmulAlgoCheck(lt, desc, la, lb, lc, lc, &b, &r) != CUBLAS_STATUS_SUCCESS) continue;
        if (r.workspaceSize > ws_bytes) continue;
        auto d = Describe(b);
        if (seen.insert(d).second && cfgs.size() < 220) cfgs.push_back({b, "forced " + d, {}});
      }
    }
    const float alpha = 1, beta = 0;
    std::vector<bool> ok(cfgs.size(), true);
    for (size_t c = 0; c < cfgs.size(); ++c) {  // warm-up, drop failures
      if (cublasLtMatmul(lt, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &cfgs[c].algo, ws, ws_bytes, st) != CUBLAS_STATUS_SUCCESS) ok[c] = false;
      if (cudaStreamSynchronize(st) != cudaSuccess) { std::printf("sync error on %s\n", cfgs[c].name.c_str()); return 1; }
    }
    for (int r = 0; r < reps; ++r)
      for (size_t c = 0; c < cfgs.size(); ++c) {
        if (!ok[c]) continue;
        CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes, st));
        CK(cudaEventRecord(e0, st));
        cublasLtMatmul(lt, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &cfgs[c].algo, ws, ws_bytes, st);
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); cfgs[c].t.push_back(ms * 1000);
      }
    double flops = 2.0 * rows * kH * kI;
    float base = 0;
    std::vector<std::pair<float, int>> order;
    for (size_t c = 0; c < cfgs.size(); ++c) {
      if (!ok[c]) continue;
      auto v = cfgs[c].t; std::sort(v.begin(), v.end());
      float med = v[v.size() / 2];
      if (c == 0) base = med;
      order.push_back({med, (int)c});
    }
    std::sort(order.begin(), order.end());
    std::printf("rows %d: %zu configs timed, reps %d, heuristic #0 %.1f us\n", rows, order.size(), reps, base);
    for (auto& [med, c] : order)
      std::printf("  %8.1f us %6.1f TFLOP/s x%.3f  %s\n", med, flops / med * 1e-6, base / med, cfgs[c].name.c_str());
    cudaFree(w); cudaFree(x); cudaFree(y);
  }
  return 0;
}
