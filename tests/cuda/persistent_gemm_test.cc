// The persistent grouped GEMM (moonep/compute/cuda/persistent_gemm.h) against cuBLAS (the
// per-group cublasGemmEx of GroupedGemm's kStreams, an independent implementation) on every path
// of the kernel: data-parallel waves plus a K-split tail, with and without clusters of two CTAs
// sharing loads (TMA multicast), 16- or 4-byte bf16 stores, a tail-only launch, an odd number of
// column tiles, N-major and K-major B, bf16 and fp32 output, interleaved tile order; outputs
// poisoned first, guard columns and rows between the groups checked untouched, and two runs
// bitwise equal. The executor suite (cuda_executor_test.cc) runs the whole expert FFN with
// kPersistent against the fp64 reference.
#include "moonep/compute/cuda/persistent_gemm.h"

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "moonep/compute/cuda/grouped_gemm.h"
#include "tests/cuda/cuda_test_util.h"

namespace moonep::compute::testing {
namespace {

using cuda::GemmBatch;
using cuda::GemmProblem;
using cuda::GemmStrategy;
using cuda::GroupedGemm;
using cuda::PersistentGemm;
using cuda::PersistentGroup;
using cuda::Staging;

std::vector<uint16_t> RandomBf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) {
    const __nv_bfloat16 b = __float2bfloat16(u(rng));
    std::memcpy(&x, &b, 2);
  }
  return v;
}

float ToFloat(const std::vector<unsigned char>& bytes, size_t i, bool f32) {
  if (f32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  uint32_t w = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

struct Layout {
  std::vector<int64_t> rows;
  int64_t n, k;
};

// The kernel's schedule knobs.
struct Mode {
  bool split = true;       // K-split tail
  bool interleave = false;
  bool cluster = true;     // clusters of two CTAs sharing loads (where n % 512 == 0)
  bool wide_store = true;  // bf16 epilogue through a quad transpose and 16-byte stores
  bool narrow_tail = true; // the split tail in 128-column halves of the tiles
  bool tma_store = true;   // bf16 epilogue staged in shared memory, written by TMA stores
  int force_split = 0;     // > 0: the tail in exactly this many K-parts (set_tail_override)
  bool force_narrow = false;
  bool small_params = true;  // the 8-group parameter block where the groups fit in it
  bool swap = true;          // transposed remainders where the model prefers them (set_swap)
  bool force_swap = false;   // every remainder transposed (set_force_swap)
  int sched_tail = 0, sched_split = 0;  // the cost-balanced schedule's tail forced
  const char* Name() const {
    static thread_local char buf[128];
    char forced[48] = "";
    if (force_split > 0) {
      std::snprintf(forced, sizeof(forced), ",forced-%d-%s-parts", force_split, force_narrow ? "narrow" : "whole");
    }
    std::snprintf(buf, sizeof(buf), "%s%s%s%s%s%s", split ? "split-tail" : "data-parallel",
                  interleave ? ",interleaved" : "", cluster ? ",clusters" : ",no-clusters",
                  tma_store ? ",tma-stores" : wide_store ? ",16-byte-stores" : ",4-byte-stores",
                  split && !narrow_tail ? ",whole-tile-tail" : "", forced);
    if (!small_params) std::strncat(buf, ",64-group-params", sizeof(buf) - std::strlen(buf) - 1);
    if (!swap) std::strncat(buf, ",no-swap", sizeof(buf) - std::strlen(buf) - 1);
    if (force_swap) std::strncat(buf, ",all-swapped", sizeof(buf) - std::strlen(buf) - 1);
    if (sched_split > 0) {
      char t[40];
      std::snprintf(t, sizeof(t), ",sched-tail-%dx%d", sched_tail, sched_split);
      std::strncat(buf, t, sizeof(buf) - std::strlen(buf) - 1);
    }
    return buf;
  }
};

// Runs one configuration and compares it with cuBLAS.
void CheckAgainstCublas(const Layout& l, bool trans_b, DType c_dtype, const Mode& mode) {
  SCOPED_TRACE(::testing::Message() << "n " << l.n << " k " << l.k << (trans_b ? " B^T" : "")
                                    << (c_dtype == DType::kFloat32 ? " fp32" : " bf16") << " "
                                    << mode.Name());
  const int64_t guard = 16;            // guard rows after every group
  const int64_t ldc = l.n + 64;        // guard columns right of every row
  const bool f32 = c_dtype == DType::kFloat32;
  const size_t ec = f32 ? 4 : 2;
  int64_t total = 0;
  for (int64_t r : l.rows) total += r;
  const size_t groups = l.rows.size();
  DeviceBuffer a(static_cast<size_t>(total) * l.k * 2);
  DeviceBuffer b(groups * static_cast<size_t>(l.n * l.k) * 2);
  const int64_t c_rows = total + guard * static_cast<int64_t>(groups);
  DeviceBuffer c(static_cast<size_t>(c_rows * ldc) * ec), ref(static_cast<size_t>(c_rows * ldc) * ec);
  a.Upload(RandomBf16(static_cast<size_t>(total * l.k), 1).data());
  b.Upload(RandomBf16(groups * static_cast<size_t>(l.n * l.k), 2).data());

  std::vector<PersistentGroup> pg;
  GemmBatch batch;
  batch.Clear(false, trans_b, DType::kBFloat16, c_dtype);
  int64_t row = 0, c_row = 0;
  for (size_t g = 0; g < groups; ++g) {
    PersistentGroup x;
    x.a = static_cast<const char*>(a.data()) + row * l.k * 2;
    x.lda = l.k;
    x.b = static_cast<const char*>(b.data()) + g * static_cast<size_t>(l.n * l.k) * 2;
    x.ldb = trans_b ? l.k : l.n;
    x.c = static_cast<char*>(c.data()) + c_row * ldc * static_cast<int64_t>(ec);
    x.ldc = ldc;
    x.rows = l.rows[g];
    pg.push_back(x);
    if (x.rows > 0) {
      GemmProblem q = cuda::ToProblem(x, l.n, l.k);
      q.c = static_cast<char*>(ref.data()) + c_row * ldc * static_cast<int64_t>(ec);
      batch.problems.push_back(q);
    }
    row += l.rows[g];
    c_row += l.rows[g] + guard;
  }
  // Reference: per-group cuBLAS.
  void* ws = nullptr;
  MOONEP_CUDA_OK(cudaMalloc(&ws, 4 * GroupedGemm::kCublasWorkspaceBytes));
  {
    auto gg = GroupedGemm::Create(nullptr, 4, ws);
    ASSERT_TRUE(gg.ok()) << gg.status();
    (*gg)->set_strategy(GemmStrategy::kStreams);
    auto staging = Staging::Create(1 << 16);
    ASSERT_TRUE(staging.ok());
    ref.Poison();
    ASSERT_TRUE((*staging)->Begin().ok());
    ASSERT_TRUE((*gg)->Plan(&batch, staging->get()).ok());
    ASSERT_TRUE((*staging)->Upload(nullptr).ok());
    ASSERT_TRUE((*gg)->Run(&batch, **staging).ok());
    MOONEP_CUDA_OK(cudaDeviceSynchronize());
  }
  MOONEP_CUDA_OK(cudaFree(ws));

  auto pgemm = PersistentGemm::Create();
  ASSERT_TRUE(pgemm.ok()) << pgemm.status();
  (*pgemm)->set_stream_k(mode.split);
  (*pgemm)->set_interleave(mode.interleave);
  (*pgemm)->set_cluster(mode.cluster);
  (*pgemm)->set_wide_store(mode.wide_store);
  (*pgemm)->set_narrow_tail(mode.narrow_tail);
  (*pgemm)->set_tma_store(mode.tma_store);
  (*pgemm)->set_tail_override(mode.force_split, mode.force_narrow);
  (*pgemm)->set_small_params(mode.small_params);
  (*pgemm)->set_swap(mode.swap);
  (*pgemm)->set_force_swap(mode.force_swap);
  (*pgemm)->set_schedule_tail_override(mode.sched_tail, mode.sched_split);
  std::vector<unsigned char> got(c.bytes()), again(c.bytes()), want(ref.bytes());
  for (int run = 0; run < 2; ++run) {
    c.Poison();
    ASSERT_TRUE((*pgemm)->Run(nullptr, trans_b, c_dtype, l.n, l.k, pg.data(), pg.size()).ok());
    MOONEP_CUDA_OK(cudaDeviceSynchronize());
    c.Download(run == 0 ? got.data() : again.data());
  }
  ref.Download(want.data());
  EXPECT_EQ(got, again) << "two runs differ";
  // The second run of the same batch reuses the first one's plan.
  if ((*pgemm)->last_scheduled()) {
    EXPECT_FALSE((*pgemm)->last_planned());
  }
  int64_t nonempty = 0;
  for (int64_t r : l.rows) nonempty += r > 0 ? 1 : 0;
  EXPECT_EQ((*pgemm)->last_param_groups(), mode.small_params && nonempty <= 8 ? 8 : PersistentGemm::kMaxGroupsPerLaunch);
  // Which schedule ran: transposed remainders (and the cost-balanced schedule) exactly where the
  // model, or the forcing, asks for them.
  {
    const int n_tiles = static_cast<int>(l.n / PersistentGemm::kTileN);
    const bool clusters = mode.cluster && n_tiles % 2 == 0 && mode.force_split == 0;
    int swapped = 0;
    for (int64_t r : l.rows) {
      if (r % PersistentGemm::kTileN == 0) continue;
      swapped += mode.force_swap || PersistentGemm::PrefersSwap(r, n_tiles) ? 1 : 0;
    }
    if (!mode.swap || !clusters) swapped = 0;
    EXPECT_EQ((*pgemm)->last_swap_groups(), swapped);
    EXPECT_EQ((*pgemm)->last_scheduled(), swapped > 0);
    if (mode.sched_split > 0 && swapped > 0) {
      EXPECT_EQ((*pgemm)->last_schedule().split, mode.sched_split);
      EXPECT_EQ(static_cast<int>((*pgemm)->last_schedule().tail_units.size()), mode.sched_tail);
    }
  }
  if (mode.force_split > 0) {
    EXPECT_EQ((*pgemm)->last_tail().split, mode.force_split);
    EXPECT_EQ((*pgemm)->last_tail().narrow, mode.force_narrow);
  }

  // Every data element written and close to cuBLAS; every guard element untouched.
  double max_diff = 0, max_ref = 0;
  int64_t unwritten = 0, guard_written = 0;
  c_row = 0;
  for (size_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < l.rows[g] + guard; ++r) {
      for (int64_t j = 0; j < ldc; ++j) {
        const size_t i = static_cast<size_t>((c_row + r) * ldc + j);
        const float v = ToFloat(got, i, f32);
        if (r >= l.rows[g] || j >= l.n) {
          guard_written += std::isnan(v) ? 0 : 1;
          continue;
        }
        if (!std::isfinite(v)) {
          ++unwritten;
          continue;
        }
        const float w = ToFloat(want, i, f32);
        max_diff = std::max(max_diff, static_cast<double>(std::fabs(v - w)));
        max_ref = std::max(max_ref, static_cast<double>(std::fabs(w)));
      }
    }
    c_row += l.rows[g] + guard;
  }
  EXPECT_EQ(unwritten, 0);
  EXPECT_EQ(guard_written, 0);
  ASSERT_GT(max_ref, 0.0);
  // Both sides accumulate in fp32 in different orders; bf16 output rounds to 8 bits.
  EXPECT_LT(max_diff / max_ref, f32 ? 1e-5 : 1e-2);
  std::printf("[ PERSISTENT ] n %-5lld k %-5lld %-3s %-4s %-45s max|diff|/max|ref| %.2e\n",
              static_cast<long long>(l.n), static_cast<long long>(l.k), trans_b ? "B^T" : "B",
              f32 ? "fp32" : "bf16", mode.Name(), max_diff / max_ref);
}

TEST(PersistentGemm, AppliesOnlyToWhatTheKernelSupports) {
  EXPECT_TRUE(PersistentGemm::Applies(false, DType::kBFloat16, DType::kBFloat16, 2048, 7168, 0.0f));
  EXPECT_TRUE(PersistentGemm::Applies(false, DType::kBFloat16, DType::kFloat32, 256, 64, 0.0f));
  EXPECT_FALSE(PersistentGemm::Applies(true, DType::kBFloat16, DType::kBFloat16, 2048, 7168, 0.0f));
  EXPECT_FALSE(PersistentGemm::Applies(false, DType::kFloat32, DType::kFloat32, 2048, 7168, 0.0f));
  EXPECT_FALSE(PersistentGemm::Applies(false, DType::kBFloat16, DType::kBFloat16, 2048, 7168, 1.0f));
  EXPECT_FALSE(PersistentGemm::Applies(false, DType::kBFloat16, DType::kBFloat16, 2000, 7168, 0.0f));
  EXPECT_FALSE(PersistentGemm::Applies(false, DType::kBFloat16, DType::kBFloat16, 2048, 7000, 0.0f));
  PersistentGroup g;
  g.a = g.b = g.c = reinterpret_cast<void*>(uintptr_t{4096});
  g.lda = g.ldb = g.ldc = 64;
  g.rows = 3;
  EXPECT_TRUE(PersistentGemm::Aligned(g));
  g.lda = 65;
  EXPECT_FALSE(PersistentGemm::Aligned(g));
  g.lda = 64;
  g.b = reinterpret_cast<void*>(uintptr_t{4098});
  EXPECT_FALSE(PersistentGemm::Aligned(g));
}

// Where the device is not Hopper, Create says so; on Hopper a misaligned group is a clear error.
TEST(PersistentGemm, BadInputIsAnError) {
  MOONEP_SKIP_WITHOUT_GPU();
  auto pgemm = PersistentGemm::Create();
  if (!pgemm.ok()) {
    EXPECT_NE(pgemm.status().message().find("9.0"), std::string::npos) << pgemm.status();
    GTEST_SKIP() << "not an sm_90 device: " << pgemm.status();
  }
  DeviceBuffer buf(1 << 20);
  PersistentGroup g;
  g.a = static_cast<char*>(buf.data()) + 2;  // not 16-byte aligned
  g.b = buf.data();
  g.c = buf.data();
  g.lda = g.ldb = g.ldc = 256;
  g.rows = 4;
  const absl::Status st = (*pgemm)->Run(nullptr, false, DType::kBFloat16, 256, 64, &g, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_FALSE((*pgemm)->Run(nullptr, false, DType::kBFloat16, 200, 64, &g, 1).ok());
}

// The tail's form (host only: runs without a GPU). Against a brute force over every form under
// the same cost model, and the choices the benchmark's skewed shapes get on an H200 (66 clusters
// of two, K = 7168: 112 K-steps).
TEST(PersistentGemmTail, ChoosesTheCheapestFormThatFits) {
  using Options = PersistentGemm::TailOptions;
  const Options o;
  for (int slots : {1, 7, 66, 132}) {
    for (int k_iters : {4, 16, 32, 112}) {
      for (int rest = 0; rest < slots; ++rest) {
        auto got = PersistentGemm::ChooseTail(rest, slots, k_iters, o);
        ASSERT_TRUE(got.ok()) << got.status();
        double best = PersistentGemm::TailCost(rest, slots, k_iters, false, 1);
        for (bool narrow : {false, true}) {
          for (int split = 1; split <= o.max_split; ++split) {
            const int parts = rest * (narrow ? 2 : 1) * split;
            if (split > 1 && (parts > PersistentGemm::kWorkspaceRounds * slots || k_iters / split < 4)) continue;
            best = std::min(best, PersistentGemm::TailCost(rest, slots, k_iters, narrow, split));
          }
        }
        SCOPED_TRACE(::testing::Message() << "rest " << rest << " slots " << slots << " k " << k_iters);
        EXPECT_DOUBLE_EQ(got->cost, best);
        EXPECT_DOUBLE_EQ(got->cost, PersistentGemm::TailCost(rest, slots, k_iters, got->narrow, got->split));
        const int parts = rest * (got->narrow ? 2 : 1) * got->split;
        if (got->split > 1) {
          EXPECT_LE(parts, PersistentGemm::kWorkspaceRounds * slots);
          EXPECT_GE(k_iters / got->split, 4);
        }
        if (rest == 0) {
          EXPECT_EQ(got->split, 1);
        }
      }
    }
  }
  auto pick = [&](int rest) {
    auto c = PersistentGemm::ChooseTail(rest, 66, 112, o);
    EXPECT_TRUE(c.ok());
    return std::make_pair(c->narrow, c->split);
  };
  EXPECT_EQ(pick(8), std::make_pair(true, 4));    // 8x512_zipf: 16 narrow units in 4 parts
  EXPECT_EQ(pick(22), std::make_pair(false, 3));  // 64x512_zipf: 22 units in 3 parts, one round
  EXPECT_EQ(pick(36), std::make_pair(false, 1));  // 32x512_zipf: 36 units whole (split: two rounds)
  EXPECT_EQ(pick(32), std::make_pair(false, 2));  // 64x128_zipf: 32 units in 2 parts
  // Without splitting, or without narrow units.
  Options off = o;
  off.split = false;
  EXPECT_EQ(PersistentGemm::ChooseTail(36, 66, 112, off)->split, 1);
  Options whole = o;
  whole.narrow = false;
  EXPECT_FALSE(PersistentGemm::ChooseTail(8, 66, 112, whole)->narrow);
  // A forced form is taken as it is when it fits, and refused when it does not.
  Options forced = o;
  forced.force_split = 2;
  forced.force_narrow = true;
  auto f = PersistentGemm::ChooseTail(8, 66, 112, forced);
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->narrow);
  EXPECT_EQ(f->split, 2);
  forced.force_split = 2;
  forced.force_narrow = false;
  EXPECT_EQ(PersistentGemm::ChooseTail(36, 66, 112, forced).status().code(), absl::StatusCode::kInvalidArgument);
  forced.force_split = 8;
  EXPECT_EQ(PersistentGemm::ChooseTail(8, 66, 16, forced).status().code(), absl::StatusCode::kInvalidArgument);
}

// The cost-balanced schedule (host only). Invariants on random costs: every unit runs once, whole
// or as all its K-parts, each part on its own cluster; the makespan it reports is the one its lists
// give under the model; it is no worse than the plain longest-first assignment without a tail; and
// that assignment is within Graham's 4/3 - 1/(3m) of the optimum, found here by brute force.
TEST(PersistentGemmSchedule, ListsEveryUnitOnceAndBalancesByCost) {
  std::mt19937_64 rng(7);
  const int k_iters = 112;
  const double tile_us = 0.67 * k_iters, publish = 3.5 / tile_us, fixup = 2.3 / tile_us;
  for (int trial = 0; trial < 200; ++trial) {
    const int clusters = 1 + static_cast<int>(rng() % 20);
    const int units = static_cast<int>(rng() % 90);
    std::vector<double> costs(units);
    for (double& c : costs) c = rng() % 3 == 0 ? 1.0 : PersistentGemm::SwapCost(32 * (1 + static_cast<int>(rng() % 8)));
    for (int sorted : {-1, 0, 2 * clusters}) {
    SCOPED_TRACE(::testing::Message() << units << " units, " << clusters << " clusters, sorted " << sorted);
    auto s = PersistentGemm::PlanSchedule(costs, clusters, k_iters, 8, 0, 0, sorted);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ(static_cast<int>(s->start.size()), clusters + 1);
    std::vector<int> seen(units, 0);
    std::vector<double> load(clusters, 0.0);
    for (int c = 0; c < clusters; ++c) {
      for (int i = s->start[c]; i < s->start[c + 1]; ++i) {
        ++seen[s->units[i]];
        load[c] += costs[s->units[i]];
      }
    }
    ASSERT_LE(static_cast<int>(s->tail_units.size()), PersistentGemm::kMaxTailUnits);
    ASSERT_EQ(s->tail_cluster.size(), s->tail_units.size() * s->split);
    if (!s->tail_units.empty()) {
      EXPECT_GE(s->split, 2);
      EXPECT_GE(k_iters / s->split, 4);
    }
    std::vector<double> finish = load;
    std::vector<int> parts_on(clusters, 0);
    for (size_t v = 0; v < s->tail_cluster.size(); ++v) {
      const int c = s->tail_cluster[v], u = s->tail_units[v / s->split];
      ASSERT_GE(c, 0);
      ASSERT_LT(c, clusters);
      EXPECT_EQ(++parts_on[c], 1) << "two parts on cluster " << c;
      if (v % s->split == 0) ++seen[u];
      finish[c] = std::max(finish[c], load[c] + costs[u] / s->split + publish + (s->split - 1) * fixup);
    }
    for (int u = 0; u < units; ++u) EXPECT_EQ(seen[u], 1) << "unit " << u;
    const double makespan = clusters > 0 && units > 0 ? *std::max_element(finish.begin(), finish.end()) : 0.0;
    EXPECT_NEAR(s->makespan, makespan, 1e-9);
    auto plain = PersistentGemm::PlanSchedule(costs, clusters, k_iters, 1, 0, 0, sorted);
    ASSERT_TRUE(plain.ok());
    EXPECT_TRUE(plain->tail_units.empty());
    EXPECT_LE(s->makespan, plain->makespan + 1e-9);
    // Brute force on the small ones: every assignment of the units to the clusters.
    if (sorted < 0 && units <= 8 && clusters <= 3) {
      double opt = 1e30;
      std::vector<int> a(units, 0);
      for (;;) {
        std::vector<double> l(clusters, 0.0);
        for (int u = 0; u < units; ++u) l[a[u]] += costs[u];
        opt = std::min(opt, units ? *std::max_element(l.begin(), l.end()) : 0.0);
        int u = 0;
        while (u < units && ++a[u] == clusters) a[u++] = 0;
        if (u == units) break;
      }
      EXPECT_LE(plain->makespan, (4.0 / 3.0 - 1.0 / (3.0 * clusters)) * opt + 1e-9)
          << units << " units on " << clusters << " clusters";
    }
    }
  }
  // Equal costs fill the clusters round-robin (as the plain schedule does): unit u on cluster
  // u % clusters.
  auto rr = PersistentGemm::PlanSchedule(std::vector<double>(140, 1.0), 66, k_iters, 1);
  ASSERT_TRUE(rr.ok());
  for (int c = 0; c < 66; ++c) {
    for (int i = rr->start[c]; i < rr->start[c + 1]; ++i) EXPECT_EQ(rr->units[i] % 66, c);
  }
  // Bad input: no clusters, a cost that is not positive, a forced tail that does not fit.
  EXPECT_FALSE(PersistentGemm::PlanSchedule({1.0}, 0, k_iters, 8).ok());
  EXPECT_FALSE(PersistentGemm::PlanSchedule({1.0, 0.0}, 4, k_iters, 8).ok());
  EXPECT_FALSE(PersistentGemm::PlanSchedule(std::vector<double>(10, 1.0), 4, k_iters, 8, 3, 2).ok());  // 6 parts
  EXPECT_FALSE(PersistentGemm::PlanSchedule(std::vector<double>(10, 1.0), 66, 8, 8, 2, 4).ok());  // 2 K-steps
  auto forced = PersistentGemm::PlanSchedule(std::vector<double>(10, 1.0), 66, k_iters, 8, 3, 4);
  ASSERT_TRUE(forced.ok());
  EXPECT_EQ(forced->tail_units.size(), 3u);
  EXPECT_EQ(forced->split, 4);
}

// Which remainders run transposed, under the model (n = 2048: 8 column tiles): the cost of the
// remainder both ways, by the definitions in the header.
TEST(PersistentGemmSchedule, TransposesTheRemaindersThatCostLess) {
  for (int64_t rows = 1; rows <= 1024; ++rows) {
    const int64_t rest = rows % PersistentGemm::kTileN;
    const double plain = rest == 0 ? 0 : rest <= PersistentGemm::kTileM ? 4.0 : 8.0;
    const double swapped = rest == 0 ? 0 : 8 * PersistentGemm::SwapCost(PersistentGemm::SwapRows(rest));
    EXPECT_EQ(PersistentGemm::PrefersSwap(rows, 8), rest != 0 && swapped < 0.98 * plain) << rows;
    if (rest) {
      EXPECT_EQ(PersistentGemm::SwapRows(rest) % 32, 0);
      EXPECT_GE(PersistentGemm::SwapRows(rest), rest);
      EXPECT_LT(PersistentGemm::SwapRows(rest), rest + 32);
    }
  }
  // 8x512_zipf's groups: 1760 (rest 224), 764 (252), 469 (213), 332 (76), 254, 204, 169, 144.
  EXPECT_TRUE(PersistentGemm::PrefersSwap(1760, 8));
  EXPECT_FALSE(PersistentGemm::PrefersSwap(764, 8));  // 256 rows transposed cost a whole tile
  EXPECT_TRUE(PersistentGemm::PrefersSwap(469, 8));
  EXPECT_FALSE(PersistentGemm::PrefersSwap(332, 8));  // 76 rows: one plain 128-row tile is cheaper
  EXPECT_TRUE(PersistentGemm::PrefersSwap(144, 8));
  EXPECT_FALSE(PersistentGemm::PrefersSwap(20, 8));   // 32 transposed rows cost more than 128 plain
}

class PersistentVsCublas : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(PersistentVsCublas, EveryPath) {
  MOONEP_SKIP_WITHOUT_GPU();
  if (!PersistentGemm::Create().ok()) GTEST_SKIP() << "not an sm_90 device";
  const bool trans_b = std::get<0>(GetParam());
  const DType c_dtype = std::get<1>(GetParam()) ? DType::kFloat32 : DType::kBFloat16;
  // 43 row tiles (700 = 6, 0, 1 = 1, 129 = 2, 300 = 3, 2000 = 16, 63 = 1, 1600 = 13, 8 = 1) x 4
  // column tiles. In clusters of two: units of two row tiles sharing the weights, and for a group's
  // odd last row tile two column tiles sharing the rows: 86 units, one wave of 66 clusters and a
  // tail of 20 units = 40 narrow units split in 1 (whole-tile tail: 20 units split in 3). Without
  // clusters: 172 tiles, one wave of 132 and a tail of 40 = 80 narrow tiles (whole: split in 3).
  // Zero-row, one-row and non-multiple-of-128 groups. (On 132 SMs.)
  const Layout waves{{700, 0, 1, 129, 300, 2000, 63, 1600, 8}, 1024, 1024};
  // A few tiles: the whole launch is a split tail.
  const Layout tail{{5, 300}, 1024, 1024};
  // Three column tiles (n = 768): no pairs, so no clusters.
  const Layout odd_columns{{700, 0, 1, 300, 63}, 768, 512};
  Mode whole, interleaved, no_cluster, narrow, wide, whole_tail, no_cluster_whole_tail;
  whole.split = false;
  interleaved.interleave = true;
  no_cluster.cluster = false;
  narrow.wide_store = narrow.tma_store = false;
  wide.tma_store = false;
  whole_tail.narrow_tail = false;
  no_cluster_whole_tail.cluster = no_cluster_whole_tail.narrow_tail = false;
  // Forced forms of the tail: 20 units in 3 whole parts (60 of 66 clusters); 40 narrow units
  // whole (split 1); without clusters, 40 tiles in 3 parts (120 of 132 CTAs).
  Mode whole3, narrow1, whole3_no_cluster, big_params;
  big_params.small_params = false;
  whole3.force_split = whole3_no_cluster.force_split = 3;
  whole3_no_cluster.cluster = false;
  narrow1.force_split = 1;
  narrow1.force_narrow = true;
  // The plain schedule's forms without transposed units (the default transposes 700, 129 and
  // 2000's remainders and balances the units by cost).
  Mode no_swap, no_swap_interleaved, no_swap_narrow, no_swap_wide, no_swap_whole_tail, no_swap_big;
  no_swap.swap = no_swap_interleaved.swap = no_swap_narrow.swap = no_swap_wide.swap = false;
  no_swap_whole_tail.swap = no_swap_big.swap = false;
  no_swap_interleaved.interleave = true;
  no_swap_narrow.wide_store = no_swap_narrow.tma_store = false;
  no_swap_wide.tma_store = false;
  no_swap_whole_tail.narrow_tail = false;
  no_swap_big.small_params = false;
  // (narrow and wide: transposed units with the scalar stores; whole: the cost-balanced schedule
  // without a split.) The cost-balanced schedule with a forced split tail: 3 units in 4 K-parts.
  Mode sched_tail;
  sched_tail.sched_tail = 3;
  sched_tail.sched_split = 4;
  for (const Mode& m : {Mode{}, whole, interleaved, no_cluster, narrow, wide, whole_tail, no_cluster_whole_tail,
                        whole3, narrow1, whole3_no_cluster, big_params, no_swap, no_swap_interleaved,
                        no_swap_narrow, no_swap_wide, no_swap_whole_tail, no_swap_big, sched_tail}) {
    CheckAgainstCublas(waves, trans_b, c_dtype, m);
  }
  // Every transposed width (32 .. 256 rows in steps of 32) and a group without a remainder, with
  // every remainder transposed; with the scalar stores; split in 2 K-parts.
  const Layout widths{{276, 50, 90, 128, 140, 512, 180, 210, 250}, 1024, 512};
  Mode all, all_scalar, all_split;
  all.force_swap = all_scalar.force_swap = all_split.force_swap = true;
  all_scalar.tma_store = all_scalar.wide_store = false;
  all_split.sched_tail = 8;
  all_split.sched_split = 2;
  for (const Mode& m : {all, all_scalar, all_split}) CheckAgainstCublas(widths, trans_b, c_dtype, m);
  // tail: 4 row tiles x 4 = 16 tiles, 8 cluster units: 16 narrow units split in 4 (the fix-up).
  for (const Mode& m : {Mode{}, no_cluster, whole_tail, no_swap, no_swap_whole_tail}) {
    CheckAgainstCublas(tail, trans_b, c_dtype, m);
  }
  // 2 row tiles x 4 = 8 tiles with 32 K-steps: every form of the tail in the default most parts
  // (8), so the fix-up sums eight partial tiles.
  const Layout tail8{{5, 120}, 1024, 2048};
  for (const Mode& m : {Mode{}, no_cluster, whole_tail, no_cluster_whole_tail, no_swap, no_swap_whole_tail}) {
    CheckAgainstCublas(tail8, trans_b, c_dtype, m);
  }
  // More than 8 groups: the 64-group parameter block by default.
  const Layout many{{100, 0, 3, 250, 130, 64, 1, 700, 129, 40, 300, 17, 5}, 1024, 512};
  CheckAgainstCublas(many, trans_b, c_dtype, Mode{});
  CheckAgainstCublas(many, trans_b, c_dtype, no_swap);
  CheckAgainstCublas(odd_columns, trans_b, c_dtype, Mode{});
  CheckAgainstCublas(odd_columns, trans_b, c_dtype, wide);
}

INSTANTIATE_TEST_SUITE_P(Forms, PersistentVsCublas, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<bool, bool>>& info) {
                           return std::string(std::get<0>(info.param) ? "Bt" : "B") +
                                  (std::get<1>(info.param) ? "_fp32" : "_bf16");
                         });

}  // namespace
}  // namespace moonep::compute::testing
