// The CUDA kernels against host brute force: pack (gather by index, -1 zero-fills, bad entries
// counted and never followed), combine (weighted fp32 sum, every dtype pair), SwiGLU forward and
// backward over segments, zeroing of segments. Outputs are poisoned first and every element is
// checked; shapes cover the 16-byte vector paths and the narrow fallbacks.
#include "moonep/compute/cuda/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "tests/cuda/cuda_test_util.h"

namespace moonep::compute {
namespace {

using cuda::RowSegment;
using cuda::SegmentTable;
using testing::Buffer;
using testing::DeviceBuffer;

constexpr DType kF32 = DType::kFloat32;
constexpr DType kBF16 = DType::kBFloat16;

Buffer RandomRows(int64_t rows, int64_t cols, DType dt, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
  Buffer b(rows, cols, dt);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) b.Set(r, c, uni(rng));
  return b;
}

DeviceBuffer ToDevice(Buffer& b) {
  DeviceBuffer d(b.bytes());
  d.Upload(b.data());
  return d;
}

template <typename T>
DeviceBuffer ToDevice(const std::vector<T>& v) {
  DeviceBuffer d(v.size() * sizeof(T));
  d.Upload(v.data());
  return d;
}

struct PackCase {
  int64_t cols;
  DType dtype;
};

class PackRows : public ::testing::TestWithParam<PackCase> {};

TEST_P(PackRows, GathersByIndexAndZeroFills) {
  MOONEP_SKIP_WITHOUT_GPU();
  const auto [cols, dt] = GetParam();
  const int64_t src_rows = 300, dst_rows = 517;
  Buffer src = RandomRows(src_rows, cols, dt, 1);
  std::mt19937_64 rng(2);
  std::vector<int32_t> index(dst_rows);
  for (int64_t r = 0; r < dst_rows; ++r) {
    const int64_t u = static_cast<int64_t>(rng() % 10);
    index[r] = u == 0 ? -1 : static_cast<int32_t>(rng() % src_rows);
  }
  index[5] = static_cast<int32_t>(src_rows);  // out of range: counted, zero-filled
  index[9] = -7;
  DeviceBuffer d_src = ToDevice(src), d_index = ToDevice(index), bad(sizeof(int32_t));
  DeviceBuffer dst(static_cast<size_t>(dst_rows * cols) * DTypeSize(dt));
  dst.Poison();
  MOONEP_CUDA_OK(cudaMemset(bad.data(), 0, sizeof(int32_t)));
  MOONEP_CUDA_OK(cuda::LaunchPackRows(d_src.data(), src_rows, static_cast<const int32_t*>(d_index.data()),
                                      dst_rows, dst.data(), cols * DTypeSize(dt),
                                      static_cast<int32_t*>(bad.data()), nullptr));
  MOONEP_CUDA_OK(cudaDeviceSynchronize());
  Buffer out(dst_rows, cols, dt);
  dst.Download(out.data());
  int32_t bad_count = 0;
  bad.Download(&bad_count);
  EXPECT_EQ(bad_count, 2);
  const size_t row_bytes = cols * DTypeSize(dt);
  const std::vector<char> zeros(row_bytes, 0);
  for (int64_t r = 0; r < dst_rows; ++r) {
    const char* got = static_cast<const char*>(out.data()) + r * row_bytes;
    const bool valid = index[r] >= 0 && index[r] < src_rows;
    const char* want = valid ? static_cast<const char*>(src.data()) + index[r] * row_bytes : zeros.data();
    ASSERT_EQ(std::memcmp(got, want, row_bytes), 0) << "row " << r << " index " << index[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PackRows,
                         ::testing::Values(PackCase{7168, kBF16}, PackCase{13, kBF16},
                                           PackCase{3, kF32}, PackCase{1030, kF32},
                                           PackCase{6, kBF16}));

struct CombineCase {
  int64_t cols;
  int32_t top_k;
  DType in, out;
};

class CombineRows : public ::testing::TestWithParam<CombineCase> {};

TEST_P(CombineRows, WeightedSumInFp32) {
  MOONEP_SKIP_WITHOUT_GPU();
  const auto [cols, K, in_dt, out_dt] = GetParam();
  const int64_t num_rows = 400, tokens = 150;
  Buffer rows = RandomRows(num_rows, cols, in_dt, 3);
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<float> w01(0.0f, 1.0f);
  std::vector<int32_t> index(tokens * K);
  std::vector<float> weights(tokens * K);
  for (int64_t i = 0; i < tokens * K; ++i) {
    index[i] = rng() % 8 == 0 ? -1 : static_cast<int32_t>(rng() % num_rows);
    weights[i] = w01(rng);
  }
  index[K] = num_rows + 3;  // out of range: counted, left out of the sum
  DeviceBuffer d_rows = ToDevice(rows), d_index = ToDevice(index), d_w = ToDevice(weights);
  DeviceBuffer bad(sizeof(int32_t)), out(static_cast<size_t>(tokens * cols) * DTypeSize(out_dt));
  out.Poison();
  MOONEP_CUDA_OK(cudaMemset(bad.data(), 0, sizeof(int32_t)));
  MOONEP_CUDA_OK(cuda::LaunchCombineRows(d_rows.data(), in_dt, num_rows,
                                         static_cast<const int32_t*>(d_index.data()),
                                         static_cast<const float*>(d_w.data()), tokens, K, cols,
                                         out.data(), out_dt, static_cast<int32_t*>(bad.data()), nullptr));
  MOONEP_CUDA_OK(cudaDeviceSynchronize());
  Buffer got(tokens, cols, out_dt);
  out.Download(got.data());
  int32_t bad_count = 0;
  bad.Download(&bad_count);
  EXPECT_EQ(bad_count, 1);
  testing::ErrorMeter err;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < cols; ++c) {
      double want = 0;
      for (int32_t k = 0; k < K; ++k) {
        const int32_t r = index[t * K + k];
        if (r >= 0 && r < num_rows) want += static_cast<double>(weights[t * K + k]) * rows.Get(r, c);
      }
      err.Add(got.Get(t, c), want);
    }
  }
  EXPECT_LT(err.rel(), out_dt == kF32 ? 1e-6 : 8e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CombineRows,
    ::testing::Values(CombineCase{7168, 8, kBF16, kBF16}, CombineCase{7168, 8, kBF16, kF32},
                      CombineCase{512, 6, kF32, kF32}, CombineCase{512, 6, kF32, kBF16},
                      CombineCase{13, 3, kBF16, kBF16}, CombineCase{13, 1, kF32, kF32},
                      CombineCase{40, 32, kBF16, kF32}, CombineCase{7, 2, kF32, kBF16}));

TEST(CombineRows, RejectsTopKOutsideOneTo32) {
  MOONEP_SKIP_WITHOUT_GPU();
  EXPECT_EQ(cuda::LaunchCombineRows(nullptr, kF32, 0, nullptr, nullptr, 1, 33, 4, nullptr, kF32,
                                    nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchCombineRows(nullptr, kF32, 0, nullptr, nullptr, 1, 0, 4, nullptr, kF32,
                                    nullptr, nullptr),
            cudaErrorInvalidValue);
}

// Segments of a 60-row buffer, with rows outside them that no kernel may touch.
struct Segments {
  std::vector<RowSegment> segs{{2, 5}, {9, 1}, {20, 33}, {55, 4}};
  std::vector<int64_t> prefix{0, 5, 6, 39, 43};
  DeviceBuffer d_segs = ToDevice(segs), d_prefix = ToDevice(prefix);
  SegmentTable Table() const {
    return SegmentTable{static_cast<const RowSegment*>(d_segs.data()),
                        static_cast<const int64_t*>(d_prefix.data()), 4, 43};
  }
  bool Covers(int64_t r) const {
    for (const RowSegment& s : segs)
      if (r >= s.begin && r < s.begin + s.count) return true;
    return false;
  }
  static constexpr int64_t kRows = 60;
};

double Silu(double a) { return a / (1.0 + std::exp(-a)); }

class SwiGlu : public ::testing::TestWithParam<std::tuple<int64_t, DType>> {};

TEST_P(SwiGlu, ForwardAndBackwardOverSegments) {
  MOONEP_SKIP_WITHOUT_GPU();
  const auto [I, dt] = GetParam();
  Segments s;
  const int64_t R = Segments::kRows;
  Buffer ab = RandomRows(R, 2 * I, kF32, 5), dh = RandomRows(R, I, kF32, 6);
  DeviceBuffer d_ab = ToDevice(ab), d_dh = ToDevice(dh);
  const size_t e = DTypeSize(dt);
  DeviceBuffer h(R * I * e), h2(R * I * e), dab(R * 2 * I * e);
  for (const DeviceBuffer* b : {&h, &h2, &dab}) b->Poison();
  const auto* abp = static_cast<const float*>(d_ab.data());
  MOONEP_CUDA_OK(cuda::LaunchSwiGluForward(s.Table(), abp, 2 * I, I, I, h.data(), dt, I, nullptr));
  MOONEP_CUDA_OK(cuda::LaunchSwiGluBackward(s.Table(), abp, 2 * I, I,
                                            static_cast<const float*>(d_dh.data()), I, I, dt,
                                            h2.data(), I, dab.data(), 2 * I, I, nullptr));
  MOONEP_CUDA_OK(cudaDeviceSynchronize());
  Buffer hh(R, I, dt), hh2(R, I, dt), dd(R, 2 * I, dt);
  h.Download(hh.data());
  h2.Download(hh2.data());
  dab.Download(dd.data());
  testing::ErrorMeter eh, eh2, eda, edb;
  int64_t untouched_changed = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      if (!s.Covers(r)) {  // still poisoned (NaN): outside the segments nothing is written
        untouched_changed += !std::isnan(hh.Get(r, i)) + !std::isnan(dd.Get(r, i)) + !std::isnan(dd.Get(r, I + i));
        continue;
      }
      const double a = ab.Get(r, i), b = ab.Get(r, I + i), g = dh.Get(r, i);
      const double sg = 1.0 / (1.0 + std::exp(-a));
      eh.Add(hh.Get(r, i), Silu(a) * b);
      eh2.Add(hh2.Get(r, i), Silu(a) * b);
      eda.Add(dd.Get(r, i), g * b * (sg + a * sg * (1 - sg)));
      edb.Add(dd.Get(r, I + i), g * Silu(a));
    }
  }
  EXPECT_EQ(untouched_changed, 0);
  const double tol = dt == kF32 ? 1e-6 : 8e-3;
  EXPECT_LT(eh.rel(), tol);
  EXPECT_LT(eh2.rel(), tol);
  EXPECT_LT(eda.rel(), tol);
  EXPECT_LT(edb.rel(), tol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwiGlu,
                         ::testing::Combine(::testing::Values(int64_t{2048}, int64_t{24}, int64_t{7}),
                                            ::testing::Values(kF32, kBF16)));

TEST(ZeroRows, ZeroesExactlyTheSegments) {
  MOONEP_SKIP_WITHOUT_GPU();
  Segments s;
  for (int64_t row_bytes : {int64_t{14336}, int64_t{26}, int64_t{12}}) {
    DeviceBuffer d(Segments::kRows * row_bytes);
    d.Poison();
    MOONEP_CUDA_OK(cuda::LaunchZeroRows(s.Table(), d.data(), row_bytes, nullptr));
    std::vector<unsigned char> host(Segments::kRows * row_bytes);
    d.Download(host.data());
    for (int64_t r = 0; r < Segments::kRows; ++r) {
      const unsigned char want = s.Covers(r) ? 0 : 0xff;
      for (int64_t b = 0; b < row_bytes; ++b) ASSERT_EQ(host[r * row_bytes + b], want) << r;
    }
  }
}

}  // namespace
}  // namespace moonep::compute
