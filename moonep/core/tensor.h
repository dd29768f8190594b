// Non-owning tensor views: pointer, shape, strides (in elements), dtype and device. MoonEP never
// owns caller tensors; a view is checked once at the API edge and then trusted.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "moonep/core/dtype.h"

namespace moonep {

enum class Device : int32_t { kCpu = 0, kCuda = 1 };

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device = Device::kCpu;
  int32_t device_index = 0;
  int32_t ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // elements, not bytes

  // A contiguous row-major view.
  static TensorView Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::kCpu);

  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
  bool is_contiguous() const;
  // Byte address of element (i, j) of a 2-D view.
  char* row(int64_t i) const {
    return static_cast<char*>(data) + static_cast<size_t>(i * strides[0]) * DTypeSize(dtype);
  }
  std::string DebugString() const;
};

// Checks that `view` is a contiguous 2-D tensor of the given shape and dtype on `device` whose data
// is non-null when it has elements. `name` appears in the error.
absl::Status CheckMatrix(const TensorView& view, const char* name, int64_t rows, int64_t cols,
                         DType dtype, Device device = Device::kCpu);

// True when [a, a+a_bytes) and [b, b+b_bytes) overlap (empty ranges never overlap).
bool RangesOverlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes);

}  // namespace moonep
