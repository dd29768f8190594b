#include "moonep/core/tensor.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moonep/core/status.h"

namespace moonep {

TensorView TensorView::Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t extent : shape) view.shape[i++] = extent;
  int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.strides[d] = stride;
    stride *= view.shape[d];
  }
  return view;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::DebugString() const {
  std::vector<int64_t> dims(shape.begin(), shape.begin() + ndim);
  return absl::StrCat(DTypeName(dtype), "[", absl::StrJoin(dims, ","), "]",
                      device == Device::kCuda ? "@cuda" : "@cpu");
}

absl::Status CheckMatrix(const TensorView& view, const char* name, int64_t rows, int64_t cols,
                         DType dtype, Device device) {
  if (view.ndim != 2 || view.shape[0] != rows || view.shape[1] != cols) {
    return InvalidArgument("%s: expected shape [%d, %d], got %s", name, rows, cols,
                           view.DebugString());
  }
  if (view.dtype != dtype) {
    return InvalidArgument("%s: expected dtype %s, got %s", name, DTypeName(dtype),
                           DTypeName(view.dtype));
  }
  if (view.device != device) {
    return InvalidArgument("%s: tensor is on the wrong device (%s)", name, view.DebugString());
  }
  if (!view.is_contiguous()) return InvalidArgument("%s: tensor must be contiguous", name);
  if (rows * cols > 0 && view.data == nullptr) return InvalidArgument("%s: null data pointer", name);
  if (reinterpret_cast<uintptr_t>(view.data) % DTypeSize(dtype) != 0) {
    return InvalidArgument("%s: data pointer %p is not aligned to its element size", name,
                           view.data);
  }
  return absl::OkStatus();
}

bool RangesOverlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  auto pa = reinterpret_cast<uintptr_t>(a);
  auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

}  // namespace moonep
