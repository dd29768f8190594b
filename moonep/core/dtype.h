// Element types: fp32 and bf16 storage (compute is always fp32 or wider).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace moonep {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1 };

constexpr size_t DTypeSize(DType dtype) { return dtype == DType::kBFloat16 ? 2 : 4; }
const char* DTypeName(DType dtype);
bool IsValidDType(int32_t value);

// bfloat16 stored as its 16 bits. Conversion from fp32 rounds to nearest, ties to even; NaN stays
// NaN (quiet), infinities and signed zeros are preserved.
struct BFloat16 {
  uint16_t bits = 0;

  static BFloat16 FromBits(uint16_t b) {
    BFloat16 v;
    v.bits = b;
    return v;
  }
  static BFloat16 FromFloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      return FromBits(static_cast<uint16_t>((u >> 16) | 0x0040u));  // quiet NaN, sign kept
    }
    uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
    return FromBits(static_cast<uint16_t>((u + rounding_bias) >> 16));
  }
  float ToFloat() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
};
static_assert(sizeof(BFloat16) == 2, "BFloat16 must be 2 bytes");

inline float LoadAsFloat(const void* base, DType dtype, size_t index) {
  if (dtype == DType::kFloat32) return static_cast<const float*>(base)[index];
  return static_cast<const BFloat16*>(base)[index].ToFloat();
}
inline void StoreFromFloat(void* base, DType dtype, size_t index, float value) {
  if (dtype == DType::kFloat32) {
    static_cast<float*>(base)[index] = value;
  } else {
    static_cast<BFloat16*>(base)[index] = BFloat16::FromFloat(value);
  }
}

// Bulk conversions (contiguous).
void ConvertToFloat(const void* src, DType src_dtype, float* dst, size_t count);
void ConvertFromFloat(const float* src, void* dst, DType dst_dtype, size_t count);

}  // namespace moonep
