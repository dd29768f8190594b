#include "bench/dispatch/device.h"

#include "absl/strings/str_format.h"
#include "moonep/core/status.h"

#ifdef MOONEP_BENCH_WITH_NCCL
#include <cuda_runtime.h>
#endif

namespace moonep::bench {

#ifdef MOONEP_BENCH_WITH_NCCL
namespace {
absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear the sticky-free error so later calls start clean
  return Internal("%s failed: %s", what, cudaGetErrorString(e));
}
}  // namespace

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

absl::Status SelectDevice(int device) {
  const int n = DeviceCount();
  if (device < 0 || device >= n) {
    return InvalidArgument("GPU %d does not exist (%d visible)", device, n);
  }
  return Check(cudaSetDevice(device), "cudaSetDevice");
}

absl::Status DeviceSynchronize() { return Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

std::string DeviceName() {
  int device = -1;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "unknown GPU";
  }
  return absl::StrFormat("%s, device %d", prop.name, device);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

absl::Status DeviceBuffer::Allocate(size_t bytes) {
  if (ptr_ != nullptr) {
    cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes > 0 ? bytes : 1);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return OutOfMemory("cudaMalloc of %d bytes failed: %s", bytes, cudaGetErrorString(e));
  }
  ptr_ = p;
  bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status DeviceBuffer::Upload(const void* host, size_t bytes) {
  if (bytes > bytes_) return Internal("upload of %d bytes into a %d-byte buffer", bytes, bytes_);
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (to device)");
}

absl::Status DeviceBuffer::Download(void* host, size_t bytes) const {
  if (bytes > bytes_) return Internal("download of %d bytes from a %d-byte buffer", bytes, bytes_);
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (to host)");
}

absl::Status DeviceBuffer::Fill(unsigned char byte) {
  if (bytes_ == 0) return absl::OkStatus();
  MOONEP_RETURN_IF_ERROR(Check(cudaMemset(ptr_, byte, bytes_), "cudaMemset"));
  return Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

#else  // !MOONEP_BENCH_WITH_NCCL

namespace {
absl::Status NotBuilt() {
  return Unavailable("device memory: moonep-bench-dispatch was built without CUDA and NCCL");
}
}  // namespace

int DeviceCount() { return 0; }
absl::Status SelectDevice(int) { return NotBuilt(); }
absl::Status DeviceSynchronize() { return NotBuilt(); }
std::string DeviceName() { return "no GPU support built"; }
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&&) noexcept { return *this; }
DeviceBuffer::~DeviceBuffer() = default;
absl::Status DeviceBuffer::Allocate(size_t) { return NotBuilt(); }
absl::Status DeviceBuffer::Upload(const void*, size_t) { return NotBuilt(); }
absl::Status DeviceBuffer::Download(void*, size_t) const { return NotBuilt(); }
absl::Status DeviceBuffer::Fill(unsigned char) { return NotBuilt(); }

#endif

}  // namespace moonep::bench
