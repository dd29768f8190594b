// Helpers for the CUDA tests: GPU detection (tests skip visibly without one), owned device
// buffers, and a tests/compute Problem mirrored onto the device.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moonep/compute/compute_view.h"
#include "tests/compute/problem.h"

namespace moonep::compute::testing {

// Empty when a CUDA device is usable, else why not (the skip message).
std::string NoGpuReason();

#define MOONEP_SKIP_WITHOUT_GPU()                                          \
  do {                                                                     \
    const std::string reason = ::moonep::compute::testing::NoGpuReason();  \
    if (!reason.empty()) GTEST_SKIP() << "no CUDA device: " << reason;     \
  } while (0)

#define MOONEP_CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void Upload(const void* host) const;
  void Download(void* host) const;
  // Every byte 0xff: NaN in fp32 and bf16, so an element left unwritten shows up.
  void Poison() const;
  TensorView View(int64_t rows, int64_t cols, DType dtype) const {
    return TensorView::Contiguous(ptr_, dtype, {rows, cols}, Device::kCuda);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A Problem's weights, gradients, x and dy on the device and a ComputeView over them. With
// `fuse_gate_up`, each group's gate and up weights are the two halves of one [H, 2I] tensor, the
// layout of a fused gate|up parameter (gradients stay separate: CheckComputeView keeps gradient
// spans apart).
struct DeviceProblem {
  DeviceProblem(Problem& p, bool fuse_gate_up);
  void UploadGrads(Problem& p);    // host gradients -> device
  void DownloadGrads(Problem& p);  // device gradients -> host

  Problem* host;
  bool fused;
  std::vector<DeviceBuffer> weights;  // per group: gate, up, down (fused: gate|up, unused, down)
  std::vector<DeviceBuffer> grads;    // per group: gate, up, down
  DeviceBuffer x, dy;
  ComputeView view;
};

}  // namespace moonep::compute::testing
