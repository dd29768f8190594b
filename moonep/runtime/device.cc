#include "moonep/runtime/device.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "moonep/compute/cpu/cpu_executor.h"
#include "moonep/core/host_memory.h"
#include "moonep/core/status.h"

#ifdef MOONEP_HAVE_CUDA
#include <cuda_runtime.h>

#include "moonep/compute/cuda/cuda_check.h"
#include "moonep/compute/cuda/cuda_executor.h"
#include "moonep/runtime/device_kernels.h"
#endif

namespace moonep::runtime {
namespace {

constexpr size_t kHostAlign = 64;

absl::Status NotBuilt() {
  return Unavailable("device cuda: this MoonEP was built without CUDA (configure with "
                     "-DMOONEP_WITH_CUDA=ON on a machine with the CUDA toolkit)");
}

class CpuOps final : public DeviceOps {
 public:
  absl::Status Zero(void* data, size_t bytes) override {
    if (bytes > 0) std::memset(data, 0, bytes);
    return absl::OkStatus();
  }
  absl::Status ScaleRows(void* rows, DType dtype, int64_t num_rows, int64_t hidden,
                         const float* weights) override {
    char* base = static_cast<char*>(rows);
    const size_t row_bytes = static_cast<size_t>(hidden) * DTypeSize(dtype);
    for (int64_t r = 0; r < num_rows; ++r) {
      char* row = base + static_cast<size_t>(r) * row_bytes;
      const float w = weights[r];
      if (dtype == DType::kFloat32) {
        float* f = reinterpret_cast<float*>(row);
        for (int64_t h = 0; h < hidden; ++h) f[h] *= w;
      } else {
        for (int64_t h = 0; h < hidden; ++h) {
          StoreFromFloat(row, dtype, h, LoadAsFloat(row, dtype, h) * w);
        }
      }
    }
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
};

#ifdef MOONEP_HAVE_CUDA
class CudaOps final : public DeviceOps {
 public:
  explicit CudaOps(cudaStream_t stream) : stream_(stream) {}
  absl::Status Zero(void* data, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    MOONEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(data, 0, bytes, stream_));
    return absl::OkStatus();
  }
  absl::Status ScaleRows(void* rows, DType dtype, int64_t num_rows, int64_t hidden,
                         const float* weights) override {
    if (num_rows == 0) return absl::OkStatus();
    MOONEP_CUDA_RETURN_IF_ERROR(LaunchScaleRows(rows, dtype, num_rows, hidden, weights, stream_));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    MOONEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  cudaStream_t stream_;
};
#endif

}  // namespace

bool CudaBuilt() {
#ifdef MOONEP_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

absl::Status UseDevice(Device device, int32_t index) {
  if (device == Device::kCpu) return absl::OkStatus();
#ifdef MOONEP_HAVE_CUDA
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Unavailable("device cuda: no usable GPU (%s)", cudaGetErrorString(err));
  }
  if (index < 0 || index >= count) {
    return InvalidArgument("device_index is %d; this node has %d GPU(s)", index, count);
  }
  MOONEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  return absl::OkStatus();
#else
  (void)index;
  return NotBuilt();
#endif
}

ScopedDevice::ScopedDevice(Device device, int32_t index) {
#ifdef MOONEP_HAVE_CUDA
  if (device != Device::kCuda) return;
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  if (current != index && cudaSetDevice(index) == cudaSuccess) previous_ = current;
#else
  (void)device;
  (void)index;
#endif
}

ScopedDevice::~ScopedDevice() {
#ifdef MOONEP_HAVE_CUDA
  if (previous_ >= 0) cudaSetDevice(previous_);
#endif
}

DeviceMemory::~DeviceMemory() { Free(); }

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      device_(other.device_) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    Free();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
  }
  return *this;
}

void DeviceMemory::Free() {
  if (data_ == nullptr) return;
  if (device_ == Device::kCpu) {
    std::free(data_);
  } else {
#ifdef MOONEP_HAVE_CUDA
    cudaFree(data_);
#endif
  }
  data_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<DeviceMemory> DeviceMemory::Allocate(Device device, size_t bytes,
                                                    const char* what) {
  DeviceMemory m;
  m.device_ = device;
  if (bytes == 0) return m;
  if (bytes > SIZE_MAX / 2) return OutOfMemory("cannot allocate %d bytes for %s", bytes, what);
  if (device == Device::kCpu) {
    // Refused up front: with overcommit the allocation succeeds and the zero-fill below is what
    // runs out of memory, and the kernel kills the process instead of returning an error.
    MOONEP_RETURN_IF_ERROR(CheckHostAllocation(bytes, what));
    const size_t rounded = (bytes + kHostAlign - 1) / kHostAlign * kHostAlign;
    m.data_ = std::aligned_alloc(kHostAlign, rounded);
    if (m.data_ == nullptr) return OutOfMemory("cannot allocate %d host bytes for %s", bytes, what);
    std::memset(m.data_, 0, bytes);
    m.bytes_ = bytes;
    return m;
  }
#ifdef MOONEP_HAVE_CUDA
  if (cudaMalloc(&m.data_, bytes) != cudaSuccess) {
    cudaGetLastError();
    m.data_ = nullptr;
    return OutOfMemory("cannot allocate %d GPU bytes for %s", bytes, what);
  }
  m.bytes_ = bytes;
  MOONEP_CUDA_RETURN_IF_ERROR(cudaMemset(m.data_, 0, bytes));
  return m;
#else
  return NotBuilt();
#endif
}

absl::Status CopyToDevice(Device device, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (device == Device::kCpu) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
#ifdef MOONEP_HAVE_CUDA
  MOONEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return absl::OkStatus();
#else
  return NotBuilt();
#endif
}

absl::Status SynchronizeDevice(Device device) {
  if (device == Device::kCpu) return absl::OkStatus();
#ifdef MOONEP_HAVE_CUDA
  MOONEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
#else
  return NotBuilt();
#endif
}

const compute::BufferAllocator* DeviceAllocator(Device device) {
#ifdef MOONEP_HAVE_CUDA
  if (device == Device::kCuda) {
    static const compute::BufferAllocator cuda{
        Device::kCuda,
        [](size_t bytes) -> void* {
          void* p = nullptr;
          if (cudaMalloc(&p, bytes) != cudaSuccess) {
            cudaGetLastError();
            return nullptr;
          }
          if (cudaMemset(p, 0, bytes) != cudaSuccess) {
            cudaGetLastError();
            cudaFree(p);
            return nullptr;
          }
          return p;
        },
        [](void* p) { cudaFree(p); },
        [](void* p, size_t bytes) { cudaMemset(p, 0, bytes); }};
    return &cuda;
  }
#else
  (void)device;
#endif
  return nullptr;
}

absl::StatusOr<DeviceBackend> MakeDeviceBackend(Device device,
                                                const compute::ExecutorConfig& config) {
  DeviceBackend b;
  if (device == Device::kCpu) {
    MOONEP_ASSIGN_OR_RETURN(b.executor, compute::cpu::CpuExecutor::Create(config));
    b.ops = std::make_unique<CpuOps>();
    return b;
  }
#ifdef MOONEP_HAVE_CUDA
  MOONEP_ASSIGN_OR_RETURN(auto cuda, compute::cuda::CudaExecutor::Create(config));
  b.ops = std::make_unique<CudaOps>(cuda->stream());
  b.executor = std::move(cuda);
  return b;
#else
  return NotBuilt();
#endif
}

}  // namespace moonep::runtime
