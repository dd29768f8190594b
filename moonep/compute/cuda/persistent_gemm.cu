// The persistent grouped GEMM (see persistent_gemm.h). Built for sm_90a only (WGMMA, TMA).
#include "moonep/compute/cuda/persistent_gemm.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "moonep/compute/cuda/cuda_check.h"
#include "moonep/core/status.h"

namespace moonep::compute::cuda {
namespace {

constexpr int kBM = PersistentGemm::kTileM, kBN = PersistentGemm::kTileN,
              kBK = PersistentGemm::kTileK;
constexpr int kMaxG = PersistentGemm::kMaxGroupsPerLaunch;
constexpr int kStages = 4;
constexpr int kABytes = kBM * kBK * 2;  // 16 KiB
constexpr int kBBytes = kBK * kBN * 2;  // 32 KiB
constexpr int kThreads = 384;           // producer warpgroup + two consumer warpgroups
constexpr int kTileFloats = kBM * kBN;
// bf16 epilogue staging: two 8 KiB buffers per consumer warpgroup, each a box of 64 rows x 64
// columns in the 128-byte swizzle, written out by TMA stores that drain while the warpgroup fills
// the other buffer and goes on to its next unit.
constexpr int kCColumns = 64;
constexpr int kCBytes = 2 * 2 * 64 * kCColumns * 2;  // 32 KiB
constexpr size_t kSmemBytes = kStages * (kABytes + kBBytes) + kCBytes + 1024 /* alignment */ + 256;

// The cost-balanced schedule's limits (PersistentGemm::PlanSchedule): clusters, split tail units,
// and whole units listed in the parameter block (more fall back to the round-robin schedule).
constexpr int kMaxClusters = PersistentGemm::kMaxScheduleClusters;
constexpr int kMaxTailUnits = PersistentGemm::kMaxTailUnits;
constexpr int SchedCap(int groups) { return groups <= 8 ? 768 : 2176; }

// The kernel's parameters for up to kG groups. A launch copies the whole block whatever the batch
// holds, ~2.4 us more on the GPU for the 26 KiB of 64 groups than for a few bytes (measured on the
// H200, docs/cuda-history.md, "Tenth session"), so batches of at most kSmallG groups use a block
// sized for them.
template <int kG>
struct Params {
  CUtensorMap a_map[kG];
  CUtensorMap b_map[kG];
  void* c[kG];
  int64_t ldc[kG];
  int32_t rows[kG];
  int32_t m_tiles[kG];          // row tiles of each group
  int32_t unit_start[kG + 1];   // prefix of the groups' units (a unit = one tile per cluster CTA)
  int32_t num_groups, n_tiles, k_iters, total_units;
  int32_t dp_units;    // units [0, dp_units) run whole, unit u on cluster u % clusters
  int32_t tail_split;  // the remaining units run in tail_split K-parts each, part v on cluster
                       // v % clusters (in round v / clusters)
  int32_t narrow_tail; // the tail's units run as two units of 128 columns each (halves of the tiles)
  // Transposed tiles (PersistentGemm::set_swap): > 0 where a group's rows past its first
  // m_tiles * 128 run as n_tiles units of D^T = op(B)^T A^T, each CTA 128 output columns x
  // swap_n[g] rows (the rows as WGMMA's N, in steps of 32), instead of 128-row tiles.
  int32_t swap_n[kG];
  // The cost-balanced schedule (sched_mode 1, clusters only): cluster c runs units
  // sched[sched_start[c] .. sched_start[c + 1]) whole, then the K-parts of the tail units: part v of
  // tail_count * tail_split (unit tail_units[v / tail_split], K-part v % tail_split) on cluster
  // tail_cluster[v].
  int32_t sched_mode, sched_clusters, tail_count;
  int16_t sched_start[kMaxClusters + 1];
  int16_t tail_units[kMaxTailUnits];
  uint8_t tail_cluster[kMaxClusters];
  int16_t sched[SchedCap(kG)];
  float* partials;
  int32_t* counters;
  int32_t wide_store;  // bf16 epilogue: 16-byte stores after a transpose inside each quad of lanes
  int32_t tma_store;   // bf16 epilogue: through shared memory and TMA stores (c_map)
  CUtensorMap c_map[kG];  // C as [rows][n], boxes of 64 rows x kCColumns (bf16 only)
  // Diagnostics (PersistentGemm::set_trace): when non-null, consumer thread 0 of every CTA writes
  // one record per unit: [unit | k0 << 32 | k1 << 48 | half + 1 << 60 | fixed-up << 63,
  // globaltimer at the unit's start, after its main loop, at its end, after the epilogue's first
  // half is in registers/shared memory, 0]; at most trace_cap records per CTA.
  unsigned long long* trace;
  int32_t trace_cap;
};
constexpr int kSmallG = 8;
static_assert(sizeof(Params<kMaxG>) <= 32000, "kernel parameters exceed CUDA's 32 KiB");

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOONEP_SM90A 1
#endif

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#ifdef MOONEP_SM90A
__device__ __forceinline__ void MbarInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count));
}
__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar)) : "memory");
}
__device__ __forceinline__ bool MbarTryWait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
// Waits for the barrier phase; traps (a launch error, not a hang) after ~10 s.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = SmemAddr(bar);
  if (MbarTryWait(a, parity)) return;
  const long long start = clock64();
  while (!MbarTryWait(a, parity)) {
    if (clock64() - start > 20000000000ll) asm volatile("trap;");
  }
}
__device__ __forceinline__ void TmaLoad2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(SmemAddr(bar))
      : "memory");
}
// The same, delivered to the same shared-memory offset (and barrier) of every CTA in `mask`.
__device__ __forceinline__ void TmaLoad2dMulticast(void* dst, const CUtensorMap* map, int c0, int c1,
                                                   uint64_t* bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(SmemAddr(bar)), "h"(mask)
      : "memory");
}
// 3-D boxes: the N-major weights as [n / 64][k][64] (TmaLoad3d's c0 = 0, c1 = k, c2 = n / 64), so
// that one load brings 128 columns as two 64-column panels, the layout of two 2-D boxes.
__device__ __forceinline__ void TmaLoad3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(SmemAddr(bar))
      : "memory");
}
__device__ __forceinline__ void TmaLoad3dMulticast(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                   uint64_t* bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(SmemAddr(bar)), "h"(mask)
      : "memory");
}
// Arrives on the barrier at the same offset in cluster CTA `rank`.
__device__ __forceinline__ void MbarArriveCluster(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(SmemAddr(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
// Not .aligned: the producer warp's lanes reach it at different times.
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// TMA store of a box from shared memory; completion tracked per thread in bulk groups.
__device__ __forceinline__ void TmaStore2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(SmemAddr(src)), "r"(c0), "r"(c1)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Four 8 x 8 bf16 matrices from the accumulator fragment layout (register i: row lane/4, columns
// 2(lane%4), +1 of matrix i) into shared memory; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void StMatrix4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}
// Waits until all but the newest kPending of this thread's bulk stores have read their
// shared-memory source (kRead) or completed.
template <int kPending, bool kRead>
__device__ __forceinline__ void BulkWait() {
  if (kRead) {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
  }
}
// Makes this thread's shared-memory writes visible to the TMA (async proxy).
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Barrier of one consumer warpgroup (ids 2 and 3).
__device__ __forceinline__ void WarpgroupBarrier(int c) {
  asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");
}
__device__ __forceinline__ void ConsumerBarrier() {
  asm volatile("bar.sync 1, 256;" ::: "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t Desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = (addr & 0x3FFFF) >> 4;
  d |= static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32;
  d |= 1ull << 62;
  return d;
}

// Four 8 x 8 bf16 matrices as StMatrix4 takes them, each stored transposed (register i of lane l:
// row 2(l % 4) and + 1, column l / 4 of matrix i; lanes 8i..8i+7 give the row addresses of matrix i).
__device__ __forceinline__ void StMatrix4Trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
#include "moonep/compute/cuda/wgmma_ops.inc"
#endif  // MOONEP_SM90A

// Calls f(unit, k_begin, k_end, half, part) for every unit of work of this CTA's cluster, in
// order: its whole units (unit u on cluster u % clusters), then the K-parts of tail units that fall
// to it (part v of all items * tail_split on cluster v % clusters, in rounds of one part per
// cluster: ChooseTail allows one round of split parts; unsplit narrow units may need more). The
// clusters reach each round together and part j of every
// tail unit covers the same K-steps, so the parts that share rows or weights read them at the same
// time (from L2).
// half: -1 for whole 256-column tiles, 0 or 1 for the narrow tail's column halves; part: the tail
// part's index (its fp32 partial's slot), -1 for a whole unit.
template <int kCluster, typename P, typename F>
__device__ __forceinline__ void ForEachUnit(const P& p, F&& f) {
  const int cluster = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  if (p.sched_mode) {  // the host's cost-balanced lists (PersistentGemm::PlanSchedule)
    for (int i = p.sched_start[cluster]; i < p.sched_start[cluster + 1]; ++i) f(p.sched[i], 0, p.k_iters, -1, -1);
    const int parts = p.tail_count * p.tail_split;
    for (int v = 0; v < parts; ++v) {
      if (p.tail_cluster[v] != cluster) continue;
      const int j = v % p.tail_split;
      f(p.tail_units[v / p.tail_split], j * p.k_iters / p.tail_split, (j + 1) * p.k_iters / p.tail_split, -1, v);
    }
    return;
  }
  for (int u = cluster; u < p.dp_units; u += clusters) f(u, 0, p.k_iters, -1, -1);
  const int items = (p.total_units - p.dp_units) * (p.narrow_tail ? 2 : 1);
  for (int v = cluster; v < items * p.tail_split; v += clusters) {
    const int i = v / p.tail_split, j = v % p.tail_split;
    f(p.dp_units + (p.narrow_tail ? i / 2 : i), j * p.k_iters / p.tail_split,
      (j + 1) * p.k_iters / p.tail_split, p.narrow_tail ? i % 2 : -1, p.tail_split > 1 ? v : -1);
  }
}

// This CTA's tile of a unit. Without clusters a unit is one tile (row tiles, column tiles
// fastest). With clusters of two, a unit is two tiles: rows [mt, mt + 1) x one column tile, the two
// CTAs sharing the B tile (each loads half and multicasts it), or, for a group's odd last row
// tile, one row tile x two column tiles, sharing the A tile.
// A transposed unit (swap_n > 0, clusters only): the group's rows [row0, row0 + swap_n) (past its
// last row tile, zeros beyond the group) x output columns [256 nt + 128 rank, + 128) of each CTA,
// the two CTAs sharing the rows.
struct Tile {
  int g, mt, nt;
  bool share_b;
  int swap_n, row0;
};
template <int kCluster, typename P>
__device__ __forceinline__ Tile DecodeUnit(const P& p, int u, int rank) {
  int g = 0;
  while (g + 1 < p.num_groups && p.unit_start[g + 1] <= u) ++g;
  const int local = u - p.unit_start[g];
  Tile t;
  t.g = g;
  t.share_b = true;
  t.swap_n = t.row0 = 0;
  if (kCluster == 1) {
    t.mt = local / p.n_tiles;
    t.nt = local % p.n_tiles;
    return t;
  }
  const int row_pairs = (p.m_tiles[g] / 2) * p.n_tiles;
  if (local < row_pairs) {
    t.mt = 2 * (local / p.n_tiles) + rank;
    t.nt = local % p.n_tiles;
  } else if (p.swap_n[g] > 0) {
    t.swap_n = p.swap_n[g];
    t.mt = p.m_tiles[g];
    t.row0 = p.m_tiles[g] * kBM;
    t.nt = local - row_pairs;
  } else {
    t.share_b = false;
    t.mt = p.m_tiles[g] - 1;
    t.nt = 2 * (local - row_pairs) + rank;
  }
  return t;
}

template <bool kTransB, bool kOutF32, int kCluster, int kG>
__global__ void __launch_bounds__(kThreads, 1) PersistentGemmKernel(const __grid_constant__ Params<kG> p) {
#ifdef MOONEP_SM90A
  extern __shared__ unsigned char smem_raw[];
  // The same offsets in every CTA of a cluster (multicast writes to the same addresses).
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  unsigned char* sa = smem;                      // [kStages][kBM][kBK]: two 64-row boxes
  unsigned char* sb = smem + kStages * kABytes;  // [kStages][kBBytes]
  unsigned char* sc = sb + kStages * kBBytes;    // [2 warpgroups][2 buffers][64 rows][kCColumns] bf16
  uint64_t* full = reinterpret_cast<uint64_t*>(sc + kCBytes);
  uint64_t* empty = full + kStages;
  int* last_flag = reinterpret_cast<int*>(empty + kStages);
  // The trace's timestamps of the current unit (in shared memory: no registers held across the
  // main loop for a diagnostic).
  auto* trace_times = reinterpret_cast<unsigned long long*>(empty + kStages + 2);
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int rank = kCluster == 1 ? 0 : static_cast<int>(ClusterRank());
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&full[s], 1);
      // A stage is free once both consumer warpgroups of every CTA that receives its loads are
      // done with it.
      MbarInit(&empty[s], 2 * kCluster);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (kCluster > 1) {
    ClusterSync();  // peers' barriers exist before anything is multicast or arrived on
  } else {
    __syncthreads();
  }

  if (wg == 0) {
    // Producer: one thread issues every TMA load. Per stage this CTA receives A [128 x 64] and
    // B [64 x 256] (48 KiB): its own loads plus, in a cluster, the half its peer multicasts.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 0) {
      constexpr uint16_t kBoth = 0x3;
      int stage = 0;
      uint32_t phase = 0;
      ForEachUnit<kCluster>(p, [&](int u, int k0, int k1, int h, int) __attribute__((always_inline)) {
        const Tile t = DecodeUnit<kCluster>(p, u, rank);
        const bool mc_a = kCluster > 1 && !t.share_b, mc_b = kCluster > 1 && t.share_b;
        for (int k = k0; k < k1; ++k) {
          MbarWait(&empty[stage], phase ^ 1);
          unsigned char* a = sa + stage * kABytes;
          unsigned char* b = sb + stage * kBBytes;
          const int kc = k * kBK;
          if (kCluster > 1 && t.swap_n > 0) {
            // Transposed: the A stage holds op(B)^T, this CTA's 128 output columns x 64 k; the B
            // stage the group's rows [row0, + swap_n) x 64 k in boxes of 128 rows, box j loaded by
            // CTA j % 2 for both (rows past the group's end arrive as zeros and are not read).
            const int nb = (t.swap_n + 127) / 128;
            MbarExpectTx(&full[stage], kABytes + nb * 16384);
            const int i0 = t.nt * kBN + 128 * rank;
            if (kTransB) {  // B as [n][k]: one box of 128 rows, K-major
              TmaLoad2d(a, &p.b_map[t.g], kc, i0, &full[stage]);
            } else {  // B as [k][n]: 128 columns as two 64-column panels, MN-major
              TmaLoad3d(a, &p.b_map[t.g], 0, kc, i0 / 64, &full[stage]);
            }
            for (int j = rank; j < nb; j += 2) {
              TmaLoad2dMulticast(b + j * 16384, &p.a_map[t.g], kc, t.row0 + 128 * j, &full[stage], kBoth);
            }
            if (++stage == kStages) {
              stage = 0;
              phase ^= 1;
            }
            continue;
          }
          MbarExpectTx(&full[stage], kABytes + (h < 0 ? kBBytes : kBBytes / 2));
          if (mc_a) {  // the two CTAs share the row tile: rank 0 loads it for both
            if (rank == 0) TmaLoad2dMulticast(a, &p.a_map[t.g], kc, t.mt * kBM, &full[stage], kBoth);
          } else {
            TmaLoad2d(a, &p.a_map[t.g], kc, t.mt * kBM, &full[stage]);
          }
          if (h >= 0) {  // a narrow tile: columns [128h, 128h + 128) of the column tile
            if (kTransB) {  // one box of 128 columns; in a pair, rank 0 loads it for both
              if (!mc_b) {
                TmaLoad2d(b, &p.b_map[t.g], kc, t.nt * kBN + 128 * h, &full[stage]);
              } else if (rank == 0) {
                TmaLoad2dMulticast(b, &p.b_map[t.g], kc, t.nt * kBN + 128 * h, &full[stage], kBoth);
              }
            } else {  // two panels of 64 columns; in a pair, rank 0 loads them for both
              const int c2 = (t.nt * kBN + 128 * h) / 64;
              if (!mc_b) {
                TmaLoad3d(b, &p.b_map[t.g], 0, kc, c2, &full[stage]);
              } else if (rank == 0) {
                TmaLoad3dMulticast(b, &p.b_map[t.g], 0, kc, c2, &full[stage], kBoth);
              }
            }
          } else if (kTransB) {  // B as [n][k]: two boxes of 128 columns
            if (mc_b) {
              TmaLoad2dMulticast(b + rank * 16384, &p.b_map[t.g], kc, t.nt * kBN + 128 * rank, &full[stage], kBoth);
            } else {
              TmaLoad2d(b, &p.b_map[t.g], kc, t.nt * kBN, &full[stage]);
              TmaLoad2d(b + 16384, &p.b_map[t.g], kc, t.nt * kBN + 128, &full[stage]);
            }
          } else {  // B as [k][n]: four panels of 64 columns, two per load
            for (int j = 0; j < 2; ++j) {
              const int c2 = (t.nt * kBN + 128 * j) / 64;
              if (!mc_b) {
                TmaLoad3d(b + j * 16384, &p.b_map[t.g], 0, kc, c2, &full[stage]);
              } else if (j == rank) {
                TmaLoad3dMulticast(b + j * 16384, &p.b_map[t.g], 0, kc, c2, &full[stage], kBoth);
              }
            }
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      });
    }
  } else {
    // Consumers: warpgroup c computes rows [64c, 64c + 64) of each tile.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1;
    const int ct = threadIdx.x - 128;  // 0..255
    const int warp = tid / 32, lane = tid % 32;
    const uint32_t peer = static_cast<uint32_t>(rank ^ 1);
    auto release = [&](int s) {
      if (tid == 0) MbarArrive(&empty[s]);
      if (kCluster > 1 && tid == 32) MbarArriveCluster(&empty[s], peer);
    };
    int stage = 0;
    uint32_t phase = 0;
    int records = 0;
    // The epilogue's two staging buffers are used in turn across units: a transposed unit can
    // store an odd number of chunks, and the next unit's first chunk must not take the buffer
    // whose store may still be reading it (BulkWait<1> leaves the newest store pending).
    int cbuf = 0;
    ForEachUnit<kCluster>(p, [&](int u, int k0, int k1, int half, int part_index) __attribute__((always_inline)) {
      const Tile t = DecodeUnit<kCluster>(p, u, rank);
      const bool tracing = p.trace != nullptr && ct == 0 && records < p.trace_cap;
      if (tracing) trace_times[0] = trace_times[2] = GlobalTimer();
      auto trace = [&](bool fixed_up) {
        if (!tracing) return;
        unsigned long long* r = p.trace + (static_cast<size_t>(blockIdx.x) * p.trace_cap + records++) * 6;
        r[0] = static_cast<unsigned long long>(u) | static_cast<unsigned long long>(k0 & 0xFFFF) << 32 |
               static_cast<unsigned long long>(k1 & 0xFFF) << 48 |
               static_cast<unsigned long long>(half + 1) << 60 |
               static_cast<unsigned long long>(fixed_up) << 63;
        r[1] = trace_times[0];
        r[2] = trace_times[1];
        r[3] = GlobalTimer();
        r[4] = trace_times[2];
        r[5] = 0;
      };
      // kN: 256 columns, or 128 for the narrow tail's halves (columns [128 half, + 128)).
      // kSwap: a transposed unit, D^T[128 output columns][kN rows]; warpgroup c computes output
      // columns [64c, 64c + 64) of the CTA's 128. (always_inline, here and on the unit lambdas: with
      // ten instantiations the compiler outlined this one, and ptxas then serializes every WGMMA
      // across the call, warning C7510.)
      auto tile = [&](auto n_tag, auto swap_tag) __attribute__((always_inline)) {
      constexpr int kN = decltype(n_tag)::value;
      constexpr bool kSwap = decltype(swap_tag)::value;
      const int col_base = t.nt * kBN + (kN == 256 ? 0 : 128 * half);
      float acc[kN / 2];
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) acc[i] = 0.0f;
      int prev = -1;
      for (int k = k0; k < k1; ++k) {
        MbarWait(&full[stage], phase);
        WgmmaFence();
        const uint32_t a_base = SmemAddr(sa + stage * kABytes) + c * 64 * 128;
        const uint32_t b_base = SmemAddr(sb + stage * kBBytes);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          if constexpr (kSwap) {
            // A: op(B)^T, K-major ([128 n][64 k], like the plain A) or MN-major (two [64 k][64 n]
            // blocks, this warpgroup's the c-th); B: the rows, K-major ([kN rows][64 k]).
            const uint32_t a_stage = SmemAddr(sa + stage * kABytes);
            const uint64_t da = kTransB ? Desc(a_stage + c * 64 * 128 + kk * 32, 16, 1024)
                                        : Desc(a_stage + c * 8192 + kk * 16 * 128, 64 * kBK * 2, 1024);
            WgmmaMN<kN, kTransB ? 0 : 1, 0>(acc, da, Desc(b_base + kk * 32, 16, 1024));
          } else {
            const uint64_t da = Desc(a_base + kk * 32, 16, 1024);
            // K-major B ([n][64 k] rows of 128 bytes): like A. N-major B: four 64-column blocks of
            // [64 k][64 n] (8 KiB apart: the leading offset), 8-row groups 1 KiB apart (the stride
            // offset; the probe measured the two swapped as wrong).
            const uint64_t db = kTransB ? Desc(b_base + kk * 32, 16, 1024)
                                        : Desc(b_base + kk * 16 * 128, 64 * kBK * 2, 1024);
            WgmmaMN<kN, 0, kTransB ? 0 : 1>(acc, da, db);
          }
        }
        WgmmaCommit();
        WgmmaWait<1>();
        if (prev >= 0) release(prev);
        prev = stage;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      WgmmaWait<0>();
      if (prev >= 0) release(prev);
      if (tracing) trace_times[1] = GlobalTimer();

      // Output: accumulator j*4 + {0,1} is (row lane/4, columns 8j + 2(lane%4) + {0,1}) of this
      // warp's 16 rows, j*4 + {2,3} the same 8 rows further down.
      const int rows = p.rows[t.g];
      const int r0 = t.mt * kBM + c * 64 + warp * 16 + lane / 4;
      const int col0 = col_base + 2 * (lane % 4);
      const int64_t ldc = p.ldc[t.g];
      // One 64-row box of the bf16 epilogue through this warpgroup's staging buffers, used in turn:
      // once the store before the newest has read the buffer, `fill` writes it, and a TMA store
      // writes it out at {c0, c1}, clipped to the group's rows, while the warpgroup goes on.
      auto stage_and_store = [&](int part, int c0, int c1, auto&& fill) __attribute__((always_inline)) {
        unsigned char* buf = sc + c * (kCBytes / 2) + (cbuf++ % 2) * (kCBytes / 4);
        if (tid == 0) BulkWait<1, true>();
        WarpgroupBarrier(c);
        fill(buf);
        if (tracing && part == 0) trace_times[2] = GlobalTimer();
        FenceProxyAsync();
        WarpgroupBarrier(c);
        if (tid == 0) TmaStore2d(&p.c_map[t.g], buf, c0, c1);
      };
      auto store_pair = [&](int r, int col, float x, float y) {  // columns col, col + 1 of row r
        if (kOutF32) {
          *reinterpret_cast<float2*>(static_cast<float*>(p.c[t.g]) + r * ldc + col) = make_float2(x, y);
        } else {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.c[t.g]) + r * ldc + col) =
              __floats2bfloat162_rn(x, y);
        }
      };

      if (part_index >= 0) {
        // A split tile: publish this part; the part that arrives last sums all parts in order.
        // Its parts are first..last; each CTA rank has its own slots and counter.
        const int first = (part_index / p.tail_split) * p.tail_split;
        const int last = first + p.tail_split - 1;
        auto slot = [&](int b) {
          return reinterpret_cast<float4*>(p.partials) +
                 static_cast<size_t>(b * kCluster + rank) * (kTileFloats / 4);
        };
        float4* mine = slot(part_index);
#pragma unroll
        for (int q = 0; q < kN / 8; ++q) {
          __stcg(&mine[q * 256 + ct], make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]));
        }
        __threadfence();
        ConsumerBarrier();
        if (ct == 0) {
          int32_t* counter = &p.counters[first * kCluster + rank];
          const int old = atomicAdd(counter, 1);
          const int is_last = old == last - first;
          if (is_last) *counter = 0;  // every part has counted: ready for the next launch
          *last_flag = is_last;
        }
        ConsumerBarrier();
        if (*last_flag == 0) {
          trace(false);
          return;
        }
        __threadfence();
        // Sum in part order (the same bits whichever part arrives last), part by part: kN / 8
        // independent loads per part in flight. (Element-major summing, every part's float4s in
        // flight at once and stored straight from the sums, measured slower: 9.7 against ~5 us for
        // a 4-part narrow tile.) The sums then leave through the epilogue below.
        const float4* part = slot(first);
#pragma unroll
        for (int q = 0; q < kN / 8; ++q) {
          const float4 v = __ldcg(&part[q * 256 + ct]);
          acc[4 * q] = v.x;
          acc[4 * q + 1] = v.y;
          acc[4 * q + 2] = v.z;
          acc[4 * q + 3] = v.w;
        }
        for (int b = first + 1; b <= last; ++b) {
          part = slot(b);
#pragma unroll
          for (int q = 0; q < kN / 8; ++q) {
            const float4 v = __ldcg(&part[q * 256 + ct]);
            acc[4 * q] += v.x;
            acc[4 * q + 1] += v.y;
            acc[4 * q + 2] += v.z;
            acc[4 * q + 3] += v.w;
          }
        }
      }
      if constexpr (kSwap) {
        // Accumulator 4j + {0,1} is (output column lane/4 of this warp's 16, rows 8j + 2(lane%4)
        // + {0,1}), 4j + {2,3} the same rows 8 columns further.
        const int col = t.nt * kBN + 128 * rank + c * 64 + warp * 16 + lane / 4;
        if (kOutF32 || !p.tma_store) {
#pragma unroll
          for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int r = t.row0 + 8 * j + 2 * (lane % 4) + e;
              if (r >= rows) continue;
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                if (kOutF32) {
                  static_cast<float*>(p.c[t.g])[r * ldc + col + 8 * h] = acc[4 * j + 2 * h + e];
                } else {
                  static_cast<__nv_bfloat16*>(p.c[t.g])[r * ldc + col + 8 * h] =
                      __float2bfloat16_rn(acc[4 * j + 2 * h + e]);
                }
              }
            }
          }
        } else {
          // 64 rows at a time through the staging buffers, as below, each 8 x 8 block transposed by
          // stmatrix: buffer row = output row, 16-byte chunk = 8 output columns; a TMA store clipped
          // to the group's rows (a unit's rows end with the group's).
          const int mat = lane / 8;
#pragma unroll
          for (int part = 0; part < (kN + 63) / 64; ++part) {
            stage_and_store(part, t.nt * kBN + 128 * rank + c * 64, t.row0 + part * 64, [&](unsigned char* buf) __attribute__((always_inline)) {
#pragma unroll
              for (int jj = 0; jj < 8 && part * 8 + jj < kN / 8; jj += 2) {
                const int j = part * 8 + jj;  // row blocks j (matrices 0, 1) and j + 1 (2, 3)
                const int row = 8 * (jj + (mat >> 1)) + lane % 8;
                const int chunk = 2 * warp + (mat & 1);
                const uint32_t addr = SmemAddr(buf) + row * 128 + ((chunk ^ (row % 8)) << 4);
                StMatrix4Trans(addr, PackBf16(acc[4 * j], acc[4 * j + 1]), PackBf16(acc[4 * j + 2], acc[4 * j + 3]),
                               PackBf16(acc[4 * j + 4], acc[4 * j + 5]), PackBf16(acc[4 * j + 6], acc[4 * j + 7]));
              }
            });
          }
        }
      } else if (kOutF32 || (!p.wide_store && !p.tma_store)) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (r0 + 8 * h >= rows) continue;
#pragma unroll
          for (int j = 0; j < kN / 8; ++j) {
            store_pair(r0 + 8 * h, col0 + 8 * j, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
          }
        }
      } else if (p.tma_store) {
        // bf16 through this warpgroup's two staging buffers, 64 columns of the tile at a time:
        // stmatrix writes the accumulators as 8 x 8 blocks into a box laid out as the TMA's
        // 128-byte swizzle wants it (16-byte chunk ^ row % 8: the 8 rows of a block hit 8
        // different banks), then a TMA store writes it out, clipped to the group's rows, while the
        // warpgroup fills the other buffer and goes on to its next unit.
        const int mat = lane / 8;
        const int row = warp * 16 + lane % 8 + 8 * (mat & 1);  // this lane's row address
#pragma unroll
        for (int part = 0; part < kN / kCColumns; ++part) {
          stage_and_store(part, col_base + part * kCColumns, t.mt * kBM + c * 64, [&](unsigned char* buf) __attribute__((always_inline)) {
#pragma unroll
            for (int jj = 0; jj < kCColumns / 8; jj += 2) {
              const int j = part * (kCColumns / 8) + jj;  // blocks j (matrices 0, 1) and j + 1 (2, 3)
              const int chunk = jj + (mat >> 1);
              const uint32_t addr = SmemAddr(buf) + row * 128 + ((chunk ^ (row % 8)) << 4);
              StMatrix4(addr, PackBf16(acc[4 * j], acc[4 * j + 1]), PackBf16(acc[4 * j + 2], acc[4 * j + 3]),
                        PackBf16(acc[4 * j + 4], acc[4 * j + 5]), PackBf16(acc[4 * j + 6], acc[4 * j + 7]));
            }
          });
        }
      } else {
        // bf16, 16 bytes per lane: lane q of a quad holds columns 8j + 2q, +1 of every block j;
        // after a transpose of each 4 x 4 (lanes x blocks 4m..4m+3), lane q holds all 8 columns
        // of block 4m + q, the quad's four covering 64 contiguous bytes.
        const int q = lane % 4;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r0 + 8 * h;
          __nv_bfloat16* row_out = static_cast<__nv_bfloat16*>(p.c[t.g]) + r * ldc + col_base;
#pragma unroll
          for (int m = 0; m < kN / 32; ++m) {
            uint32_t v[4], got[4] = {0, 0, 0, 0};
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
              const int j = 4 * m + jj;
              v[jj] = PackBf16(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            }
#pragma unroll
            for (int round = 0; round < 4; ++round) {
              // Send block (q + round) % 4 to lane q + round; receive from lane q - round its
              // columns of block 4m + q.
              const int send_i = (q + round) & 3, src = (q - round) & 3;
              const uint32_t send = send_i == 0 ? v[0] : send_i == 1 ? v[1] : send_i == 2 ? v[2] : v[3];
              const uint32_t recv = __shfl_sync(0xffffffffu, send, (lane & ~3) | src);
              got[0] = src == 0 ? recv : got[0];
              got[1] = src == 1 ? recv : got[1];
              got[2] = src == 2 ? recv : got[2];
              got[3] = src == 3 ? recv : got[3];
            }
            if (r < rows) {
              *reinterpret_cast<uint4*>(row_out + 8 * (4 * m + q)) = make_uint4(got[0], got[1], got[2], got[3]);
            }
          }
          if (tracing && h == 0) trace_times[2] = GlobalTimer();
        }
      }
      trace(part_index >= 0);
      };
      using Plain = std::false_type;
      if constexpr (kCluster > 1) {
        if (t.swap_n > 0) {
          using Swap = std::true_type;
          switch (t.swap_n) {
            case 32: tile(std::integral_constant<int, 32>{}, Swap{}); break;
            case 64: tile(std::integral_constant<int, 64>{}, Swap{}); break;
            case 96: tile(std::integral_constant<int, 96>{}, Swap{}); break;
            case 128: tile(std::integral_constant<int, 128>{}, Swap{}); break;
            case 160: tile(std::integral_constant<int, 160>{}, Swap{}); break;
            case 192: tile(std::integral_constant<int, 192>{}, Swap{}); break;
            case 224: tile(std::integral_constant<int, 224>{}, Swap{}); break;
            default: tile(std::integral_constant<int, 256>{}, Swap{}); break;
          }
          return;
        }
      }
      if (half < 0) {
        tile(std::integral_constant<int, 256>{}, Plain{});
      } else {
        tile(std::integral_constant<int, 128>{}, Plain{});
      }
    });
  }
  // The epilogue's TMA stores complete before the CTA exits.
  if (!kOutF32 && wg > 0 && threadIdx.x % 128 == 0) BulkWait<0, false>();
  // No CTA leaves while its peer may still arrive on its barriers.
  if (kCluster > 1) ClusterSync();
#endif  // MOONEP_SM90A
}

using EncodeFn = PFN_cuTensorMapEncodeTiled_v12000;

// A bf16 tensor map of `rank` dimensions (dims innermost first, byte strides of the outer ones),
// 128-byte swizzled boxes; rows or columns past the tensor's end load as zeros.
bool EncodeTiled(void* fn, CUtensorMap* map, const void* base, uint32_t rank, const cuuint64_t* dims,
                 const cuuint64_t* strides, const cuuint32_t* box) {
  const cuuint32_t elem[3] = {1, 1, 1};
  return reinterpret_cast<EncodeFn>(fn)(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank,
                                        const_cast<void*>(base), dims, strides, box, elem,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// N-major weights [k][n] (row stride ld_elems) as the 3-D tensor [n / 64][k][64], boxes of
// {64, box_k, 2}: two 64-column panels per load.
bool EncodePanels(void* fn, CUtensorMap* map, const void* base, uint64_t n, uint64_t k, uint64_t ld_elems,
                  uint32_t box_k) {
  const cuuint64_t dims[3] = {64, k, n / 64};
  const cuuint64_t strides[2] = {ld_elems * 2, 128};
  const cuuint32_t box[3] = {64, box_k, 2};
  return EncodeTiled(fn, map, base, 3, dims, strides, box);
}

bool Encode(void* fn, CUtensorMap* map, const void* base, uint64_t inner, uint64_t outer,
            uint64_t ld_elems, uint32_t box_inner, uint32_t box_outer) {
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {ld_elems * 2};
  const cuuint32_t box[2] = {box_inner, box_outer};
  return EncodeTiled(fn, map, base, 2, dims, strides, box);
}

}  // namespace

namespace {

// One instantiation of the kernel: its launch set-up, done once (dynamic shared memory, and how
// many clusters of two fit on the device at once), then the schedule and the launch.
template <bool kTransB, bool kOutF32, int kCluster, int kG>
struct Instance {
  static constexpr auto kKernel = PersistentGemmKernel<kTransB, kOutF32, kCluster, kG>;

  static void Configure(cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attr, int ctas, cudaStream_t stream) {
    *cfg = cudaLaunchConfig_t{};
    cfg->gridDim = dim3(static_cast<unsigned>(ctas));
    cfg->blockDim = dim3(kThreads);
    cfg->dynamicSmemBytes = kSmemBytes;
    cfg->stream = stream;
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = kCluster;
    attr->val.clusterDim.y = 1;
    attr->val.clusterDim.z = 1;
    cfg->attrs = attr;
    cfg->numAttrs = 1;
  }

  // Units that run at once: CTAs, or clusters of two that fit together.
  static absl::StatusOr<int> Slots(int sms) {
    static std::once_flag once;
    static cudaError_t err = cudaSuccess;
    static int slots = 0;
    std::call_once(once, [&] {
      err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(kSmemBytes));
      slots = sms / kCluster;
      if (err == cudaSuccess && kCluster > 1) {
        cudaLaunchConfig_t cfg;
        cudaLaunchAttribute attr;
        Configure(&cfg, &attr, sms / kCluster * kCluster, nullptr);
        err = cudaOccupancyMaxActiveClusters(&slots, kKernel, &cfg);
        if (err != cudaSuccess) cudaGetLastError();  // not left behind for a later launch check
      }
    });
    MOONEP_CUDA_RETURN_IF_ERROR(err);
    if (slots < 1) return Internal("persistent GEMM: no cluster of %d CTAs fits on the device", kCluster);
    return slots;
  }

  static absl::Status Run(Params<kG>* p, int sms, const PersistentGemm::TailOptions& tail, int* used_slots,
                          PersistentGemm::TailChoice* chosen, cudaStream_t stream) {
    MOONEP_ASSIGN_OR_RETURN(int slots, Slots(sms));
    *used_slots = slots;
    // The cost-balanced schedule was planned by the caller for its clusters.
    int clusters = p->sched_clusters;
    if (!p->sched_mode) {
      MOONEP_ASSIGN_OR_RETURN(clusters, PlainSchedule(p, slots, tail, chosen));
    }
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr;
    Configure(&cfg, &attr, clusters * kCluster, stream);
    MOONEP_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kKernel, *p));
    return CudaStatus(cudaGetLastError(), "persistent grouped GEMM launch");
  }

  // The round-robin schedule's fields. The last, partial wave: whole waves before it run
  // data-parallel; its units are cut into K-parts (and, where chosen, first into two narrow units
  // each: 128-column halves of their tiles), as ChooseTail's model of the tail's time picks.
  // Returns the clusters to launch.
  static absl::StatusOr<int> PlainSchedule(Params<kG>* p, int slots, const PersistentGemm::TailOptions& tail,
                                           PersistentGemm::TailChoice* chosen) {
    const int units = p->total_units;
    const int rest = units % slots;
    MOONEP_ASSIGN_OR_RETURN(const PersistentGemm::TailChoice c,
                            PersistentGemm::ChooseTail(rest, slots, p->k_iters, tail));
    *chosen = c;
    const bool split = rest > 0 && (c.split >= 2 || c.narrow);
    p->dp_units = split ? units - rest : units;
    p->tail_split = split ? c.split : 1;
    p->narrow_tail = split && c.narrow ? 1 : 0;
    const int tail_parts = split ? rest * (c.narrow ? 2 : 1) * c.split : 0;
    return std::min(slots, std::max(units - rest > 0 ? slots : units, tail_parts));
  }
};

// Clusters of two of this kernel that fit on the device at once (an error, e.g., under MIG or with
// a driver that refuses the cluster occupancy query: the launch then runs without clusters).
inline absl::StatusOr<int> ClusterSlots(bool trans_b, bool f32, int sms) {
  if (trans_b && f32) return Instance<true, true, 2, kMaxG>::Slots(sms);
  if (trans_b) return Instance<true, false, 2, kMaxG>::Slots(sms);
  if (f32) return Instance<false, true, 2, kMaxG>::Slots(sms);
  return Instance<false, false, 2, kMaxG>::Slots(sms);
}
inline bool ClustersFit(bool trans_b, bool f32, int sms) { return ClusterSlots(trans_b, f32, sms).ok(); }

template <int kCluster, int kG, typename... Args>
absl::Status RunInstance(bool trans_b, bool f32, Params<kG>* p, Args... args) {
  if (trans_b && f32) return Instance<true, true, kCluster, kG>::Run(p, args...);
  if (trans_b) return Instance<true, false, kCluster, kG>::Run(p, args...);
  if (f32) return Instance<false, true, kCluster, kG>::Run(p, args...);
  return Instance<false, false, kCluster, kG>::Run(p, args...);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PersistentGemm>> PersistentGemm::Create() {
  int dev = 0, major = 0, minor = 0, sms = 0;
  MOONEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  MOONEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  MOONEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  MOONEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (major != 9 || minor != 0) {
    return Unavailable("the persistent grouped GEMM needs compute capability 9.0 (sm_90a); "
                              "device %d is %d.%d",
                              dev, major, minor);
  }
  std::unique_ptr<PersistentGemm> g(new PersistentGemm());
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &g->encode_, 12000,
                                       cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || g->encode_ == nullptr) {
    return Unavailable("the CUDA driver does not provide cuTensorMapEncodeTiled");
  }
  g->num_sms_ = sms;
  // Up to kWorkspaceRounds rounds of tail parts, one partial tile and one counter per part and CTA.
  const size_t tiles = static_cast<size_t>(kWorkspaceRounds) * sms;
  MOONEP_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&g->partials_),
                                         tiles * kTileFloats * sizeof(float)));
  MOONEP_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&g->counters_), tiles * sizeof(int32_t)));
  MOONEP_CUDA_RETURN_IF_ERROR(cudaMemset(g->counters_, 0, tiles * sizeof(int32_t)));
  g->params_.resize(sizeof(Params<kMaxG>) + alignof(Params<kMaxG>));
  return g;
}

PersistentGemm::~PersistentGemm() {
  if (partials_ != nullptr) cudaFree(partials_);
  if (counters_ != nullptr) cudaFree(counters_);
}

bool PersistentGemm::Applies(bool trans_a, DType ab, DType c, int64_t n, int64_t k, float beta) {
  return !trans_a && ab == DType::kBFloat16 && beta == 0.0f && n > 0 && k > 0 && n % kBN == 0 &&
         k % kBK == 0 && n <= INT32_MAX && k <= INT32_MAX &&
         (c == DType::kBFloat16 || c == DType::kFloat32);
}

bool PersistentGemm::Aligned(const PersistentGroup& g) {
  auto a16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  return a16(g.a) && a16(g.b) && a16(g.c) && g.lda % 8 == 0 && g.ldb % 8 == 0 && g.ldc % 8 == 0 &&
         g.rows >= 0 && g.rows <= INT32_MAX;
}

template <int kG>
absl::Status PersistentGemm::Launch(cudaStream_t stream, bool trans_b, bool f32, bool cluster, int64_t n,
                                    int64_t k, const PersistentGroup* groups) {
  void* raw = params_.data();
  size_t space = params_.size();
  using P = Params<kG>;
  P* p = static_cast<P*>(std::align(alignof(P), sizeof(P), raw, space));
  if (p == nullptr) return Internal("persistent GEMM: parameter block misaligned");
  const int n_tiles = static_cast<int>(n / kBN);
  const int k_iters = static_cast<int>(k / kBK);
  // Transposed units need clusters; the tests' forced tail forms keep the plain schedule.
  const bool may_swap = swap_ && cluster && tail_.force_split == 0;
  last_scheduled_ = false;
  last_swap_groups_ = 0;
  size_t next = 0;
  while (next < order_.size()) {
    const size_t first = next;
    const size_t end = std::min(order_.size(), first + static_cast<size_t>(kG));
    // A group's form: whether its remainder runs transposed (where `swap` allows it), its plain
    // row tiles, and its units (whole ones, then n_tiles transposed ones if so).
    struct Form {
      bool swap;
      int m_tiles, whole;
    };
    auto form = [&](int64_t rows, bool swap) {
      Form f;
      f.swap = swap && rows % kBN != 0 && (force_swap_ || PrefersSwap(rows, n_tiles));
      f.m_tiles = static_cast<int>(f.swap ? rows / kBN * 2 : (rows + kBM - 1) / kBM);
      f.whole = cluster ? (f.m_tiles / 2) * n_tiles + (f.swap ? 0 : (f.m_tiles % 2) * (n_tiles / 2))
                        : f.m_tiles * n_tiles;
      return f;
    };
    // The batch's units with transposed remainders, and their costs for the schedule.
    auto count_units = [&]() {
      int units = 0, swapped = 0;
      costs_.clear();
      for (size_t j = first; j < end; ++j) {
        const int64_t rows = groups[order_[j]].rows;
        const Form f = form(rows, true);
        costs_.insert(costs_.end(), static_cast<size_t>(f.whole), 1.0);
        if (f.swap) costs_.insert(costs_.end(), static_cast<size_t>(n_tiles), SwapCost(SwapRows(rows % kBN)));
        units += f.whole + (f.swap ? n_tiles : 0);
        swapped += f.swap ? 1 : 0;
      }
      return std::make_pair(units, swapped);
    };
    bool swap = false;
    int sched_clusters = 0;
    if (may_swap) {
      const auto [units, swapped] = count_units();
      MOONEP_ASSIGN_OR_RETURN(const int slots, ClusterSlots(trans_b, f32, num_sms_));
      const int clusters = std::min(slots, units);
      // The schedule must fit the parameter block, and the split parts the workspace.
      if (swapped > 0 && units <= SchedCap(kG) && clusters <= kMaxClusters && clusters * 2 <= num_sms_) {
        swap = true;
        sched_clusters = clusters;
        // The last plan is reused when the batch's unit costs and the options are the same (a
        // repeated batch, or the same routing's next GEMM of the same shape).
        const std::array<int, 6> key{clusters,
                                     k_iters,
                                     tail_.split ? tail_.max_split : 1,
                                     sched_force_tail_,
                                     sched_force_split_,
                                     sched_sorted_waves_ < 0 ? -1 : sched_sorted_waves_ * clusters};
        int hit = -1;
        for (size_t e = 0; e < plans_.size(); ++e) {
          if (plan_cache_ && plans_[e].key == key && plans_[e].costs == costs_) hit = static_cast<int>(e);
        }
        last_planned_ = hit < 0;
        if (hit < 0) {
          MOONEP_ASSIGN_OR_RETURN(Schedule planned, PlanSchedule(costs_, key[0], key[1], key[2], key[3], key[4], key[5]));
          if (plans_.size() < kPlanCacheEntries) plans_.emplace_back();
          hit = 0;
          for (size_t e = 0; e < plans_.size(); ++e) {  // an empty slot or the least recently used
            if (plans_[e].used < plans_[hit].used) hit = static_cast<int>(e);
          }
          plans_[hit].key = key;
          plans_[hit].costs = costs_;
          plans_[hit].schedule = std::move(planned);
        }
        plans_[hit].used = ++plan_clock_;
        last_plan_ = hit;
        last_swap_groups_ += swapped;
      }
    }
    int ng = 0, units = 0;
    p->unit_start[0] = 0;
    for (; next < end; ++next) {
      const size_t i = static_cast<size_t>(order_[next]);
      const PersistentGroup& gr = groups[i];
      // Boxes: A 128 rows x 64 k; B 64 k x 128 n as two 64-column panels (N-major, EncodePanels) or
      // 128 n x 64 k (K-major). Fewer, larger loads per stage: with 64-row A boxes and 64-column B
      // boxes (before the fourteenth session) a transposed unit of 160 rows took 22 % longer
      // (docs/cuda-history.md, "Fourteenth session").
      const bool ok =
          Encode(encode_, &p->a_map[ng], gr.a, k, gr.rows, gr.lda, kBK, 128) &&
          (trans_b ? Encode(encode_, &p->b_map[ng], gr.b, k, n, gr.ldb, kBK, 128)
                   : EncodePanels(encode_, &p->b_map[ng], gr.b, n, k, gr.ldb, kBK)) &&
          (f32 || !tma_store_ ||
           Encode(encode_, &p->c_map[ng], gr.c, n, gr.rows, gr.ldc, kCColumns, 64));
      if (!ok) return Internal("persistent GEMM: cuTensorMapEncodeTiled refused group %d", i);
      const Form f = form(gr.rows, swap);
      p->c[ng] = gr.c;
      p->ldc[ng] = gr.ldc;
      p->rows[ng] = static_cast<int32_t>(gr.rows);
      p->m_tiles[ng] = f.m_tiles;
      p->swap_n[ng] = f.swap ? SwapRows(gr.rows % kBN) : 0;
      units += f.whole + (f.swap ? n_tiles : 0);
      p->unit_start[++ng] = units;
    }
    p->sched_mode = swap ? 1 : 0;
    p->sched_clusters = sched_clusters;
    p->tail_count = 0;
    if (swap) {
      const Schedule& s = plans_[last_plan_].schedule;
      for (size_t c = 0; c < s.start.size(); ++c) p->sched_start[c] = static_cast<int16_t>(s.start[c]);
      for (size_t u = 0; u < s.units.size(); ++u) p->sched[u] = static_cast<int16_t>(s.units[u]);
      for (size_t u = 0; u < s.tail_units.size(); ++u) p->tail_units[u] = static_cast<int16_t>(s.tail_units[u]);
      for (size_t v = 0; v < s.tail_cluster.size(); ++v) p->tail_cluster[v] = static_cast<uint8_t>(s.tail_cluster[v]);
      p->tail_count = static_cast<int32_t>(s.tail_units.size());
      p->tail_split = s.split;
      last_tail_ = TailChoice{false, s.split, s.makespan};
      last_scheduled_ = true;
    }
    if (ng == 0) break;
    p->num_groups = ng;
    p->n_tiles = n_tiles;
    p->k_iters = k_iters;
    p->total_units = units;
    p->wide_store = wide_store_ ? 1 : 0;
    p->tma_store = tma_store_ && !f32 ? 1 : 0;
    p->partials = partials_;
    p->counters = counters_;
    p->trace = trace_;
    p->trace_cap = trace_cap_;
    MOONEP_RETURN_IF_ERROR(
        cluster ? RunInstance<2>(trans_b, f32, p, num_sms_, tail_, &last_slots_, &last_tail_, stream)
                : RunInstance<1>(trans_b, f32, p, num_sms_, tail_, &last_slots_, &last_tail_, stream));
  }
  return absl::OkStatus();
}

absl::Status PersistentGemm::Run(cudaStream_t stream, bool trans_b, DType c_dtype, int64_t n,
                                 int64_t k, const PersistentGroup* groups, size_t count) {
  MOONEP_CHECK_ARG(Applies(false, DType::kBFloat16, c_dtype, n, k, 0.0f),
                   "persistent GEMM: n %d, k %d or the output type is not supported", n, k);
  const int n_tiles = static_cast<int>(n / kBN);
  // Every group is checked before anything is launched: bad input writes nothing.
  order_.clear();
  for (size_t i = 0; i < count; ++i) {
    if (groups[i].rows == 0) continue;
    MOONEP_CHECK_ARG(Aligned(groups[i]),
                     "persistent GEMM: group %d is not 16-byte aligned (pointers, and leading "
                     "dimensions in multiples of 8 elements) or has negative rows",
                     i);
    order_.push_back(static_cast<int32_t>(i));
  }
  if (interleave_) {
    // Largest, smallest, second largest, ...: every wave mixes compute-bound tiles of large
    // groups with the weight-streaming tiles of small ones.
    std::stable_sort(order_.begin(), order_.end(),
                     [&](int32_t x, int32_t y) { return groups[x].rows > groups[y].rows; });
    scratch_.clear();
    for (size_t lo = 0, hi = order_.size(); lo < hi;) {
      scratch_.push_back(order_[lo++]);
      if (lo < hi) scratch_.push_back(order_[--hi]);
    }
    order_.swap(scratch_);
  }
  // Clusters of two CTAs share half of every load; they need an even number of column tiles.
  const bool f32 = c_dtype == DType::kFloat32;
  const bool cluster = cluster_ && n_tiles % 2 == 0 && ClustersFit(trans_b, f32, num_sms_);
  // Batches of up to kMaxG groups, one launch each, with the parameter block for kSmallG groups
  // where all of them fit in it.
  const bool small = small_params_ && order_.size() <= static_cast<size_t>(kSmallG);
  last_param_groups_ = small ? kSmallG : kMaxG;
  return small ? Launch<kSmallG>(stream, trans_b, f32, cluster, n, k, groups)
               : Launch<kMaxG>(stream, trans_b, f32, cluster, n, k, groups);
}

}  // namespace moonep::compute::cuda
