#include "moonep/core/dtype.h"

namespace moonep {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
  }
  return "invalid";
}

bool IsValidDType(int32_t value) { return value == 0 || value == 1; }

void ConvertToFloat(const void* src, DType src_dtype, float* dst, size_t count) {
  if (src_dtype == DType::kFloat32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  const BFloat16* in = static_cast<const BFloat16*>(src);
  for (size_t i = 0; i < count; ++i) dst[i] = in[i].ToFloat();
}

void ConvertFromFloat(const float* src, void* dst, DType dst_dtype, size_t count) {
  if (dst_dtype == DType::kFloat32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  BFloat16* out = static_cast<BFloat16*>(dst);
  for (size_t i = 0; i < count; ++i) out[i] = BFloat16::FromFloat(src[i]);
}

}  // namespace moonep
