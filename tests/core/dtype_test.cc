#include "moonep/core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

namespace moonep {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Independent reference: choose the nearer of the two bf16 neighbours in double arithmetic,
// ties to the even mantissa.
uint16_t ReferenceRound(float f) {
  uint32_t u = Bits(f);
  uint16_t lo = static_cast<uint16_t>(u >> 16);
  uint16_t hi = static_cast<uint16_t>(lo + 1);
  double vlo = FromBits(static_cast<uint32_t>(lo) << 16);
  double vhi = FromBits(static_cast<uint32_t>(hi) << 16);
  double dlo = std::fabs(static_cast<double>(f) - vlo);
  double dhi = std::isinf(vhi) ? std::fabs(static_cast<double>(f) - vlo) * 2 + 1
                               : std::fabs(vhi - static_cast<double>(f));
  if ((u & 0xffffu) == 0) return lo;
  if (std::isinf(vhi)) {
    // Rounding past the largest finite value: IEEE rounds to infinity when at or beyond the
    // halfway point 0x7f7f8000.
    return (u & 0x7fffffffu) >= 0x7f7f8000u ? hi : lo;
  }
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(BFloat16Test, ExactValuesRoundTrip) {
  for (float v : {0.0f, -0.0f, 1.0f, -2.5f, 65536.0f, 1.0f / 1024}) {
    EXPECT_EQ(BFloat16::FromFloat(v).ToFloat(), v);
  }
  EXPECT_EQ(BFloat16::FromFloat(-0.0f).bits, 0x8000);
}

TEST(BFloat16Test, TiesRoundToEven) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: rounds to 1 (even mantissa).
  EXPECT_EQ(BFloat16::FromFloat(1.0f + 1.0f / 256).ToFloat(), 1.0f);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  EXPECT_EQ(BFloat16::FromFloat(1.0f + 3.0f / 256).ToFloat(), 1.0f + 1.0f / 64);
}

TEST(BFloat16Test, SpecialValues) {
  float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(BFloat16::FromFloat(inf).ToFloat(), inf);
  EXPECT_EQ(BFloat16::FromFloat(-inf).ToFloat(), -inf);
  EXPECT_TRUE(std::isnan(BFloat16::FromFloat(std::nanf("")).ToFloat()));
  // A NaN whose payload sits only in the low bits must not turn into infinity.
  EXPECT_TRUE(std::isnan(BFloat16::FromFloat(FromBits(0x7f800001u)).ToFloat()));
  EXPECT_EQ(BFloat16::FromFloat(std::numeric_limits<float>::max()).ToFloat(), inf);
}

TEST(BFloat16Test, MatchesReferenceOnRandomBitPatterns) {
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t u = rng();
    float f = FromBits(u);
    if (std::isnan(f)) continue;
    ASSERT_EQ(BFloat16::FromFloat(f).bits, ReferenceRound(f)) << std::hex << u;
  }
}

TEST(BFloat16Test, BulkConversion) {
  std::vector<float> src = {1.0f, 2.0f, 3.1415926f, -7.25f};
  std::vector<BFloat16> mid(src.size());
  std::vector<float> back(src.size());
  ConvertFromFloat(src.data(), mid.data(), DType::kBFloat16, src.size());
  ConvertToFloat(mid.data(), DType::kBFloat16, back.data(), src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_EQ(back[i], BFloat16::FromFloat(src[i]).ToFloat());
    EXPECT_NEAR(back[i], src[i], std::fabs(src[i]) / 128);
  }
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_STREQ(DTypeName(DType::kFloat32), "fp32");
}

}  // namespace
}  // namespace moonep
