// The layer's device as the runtime sees it: memory (host or GPU), the few small operations the
// runtime itself runs on rows (zeroing, scaling rows by their top-k weight), and the executor of
// that device. CPU layers use host memory and host loops; CUDA layers (built with
// MOONEP_WITH_CUDA) use cudaMalloc'd memory and kernels on the executor's stream. Without CUDA,
// every CUDA request is refused with moonepNotSupported (InvalidArgument here) naming the build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "moonep/compute/executor.h"
#include "moonep/core/dtype.h"
#include "moonep/core/tensor.h"

namespace moonep::runtime {

// True when this library was built with the CUDA backend.
bool CudaBuilt();

// Makes GPU `index` current (CUDA; nothing for the CPU). Fails when there is no such GPU.
absl::Status UseDevice(Device device, int32_t index);

// Makes the layer's GPU current for a scope and restores the caller's (nothing for the CPU).
class ScopedDevice {
 public:
  ScopedDevice(Device device, int32_t index);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
};

// An allocation on a device, zeroed at creation, freed by the destructor. Host memory is 64-byte
// aligned.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  ~DeviceMemory();
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  // `what` names the buffer in the OutOfMemory message.
  static absl::StatusOr<DeviceMemory> Allocate(Device device, size_t bytes, const char* what);

  template <typename T = char>
  T* get() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void Free();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::kCpu;
};

// Copies `bytes` of host memory at `src` to `dst` on `device` (CUDA: synchronous cudaMemcpy; CPU:
// memcpy).
absl::Status CopyToDevice(Device device, void* dst, const void* src, size_t bytes);
// Waits until every queued piece of work of the current GPU is done (CUDA: cudaDeviceSynchronize;
// nothing for the CPU).
absl::Status SynchronizeDevice(Device device);

// The allocator of `device` for buffers the compute layer owns (compute::ReplicaBuffer): null for
// the CPU (host memory), cudaMalloc'd, zeroed memory of the current GPU for CUDA. Null too when
// CUDA is not built (device cuda is refused earlier, by the config check).
const compute::BufferAllocator* DeviceAllocator(Device device);

// The runtime's own row operations on `device`, ordered on `stream` (CUDA: a cudaStream_t; null:
// the legacy default stream; ignored for the CPU). They return once the work is queued.
class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  // bytes of zeros at data.
  virtual absl::Status Zero(void* data, size_t bytes) = 0;
  // rows[r, :] *= weights[r] for r < num_rows (rows [num_rows, hidden] of dtype, fp32 math).
  virtual absl::Status ScaleRows(void* rows, DType dtype, int64_t num_rows, int64_t hidden,
                                 const float* weights) = 0;
  // Waits until the queued work is done (returns its first error).
  virtual absl::Status Synchronize() = 0;
};

// The executor of `device` (CPU: the OpenBLAS executor; CUDA: the cuBLAS executor on the current
// GPU) and the row operations, ordered before that executor's work. For CUDA the executor is
// synchronous: each call returns when its results are in memory.
struct DeviceBackend {
  std::unique_ptr<compute::Executor> executor;
  std::unique_ptr<DeviceOps> ops;
};
absl::StatusOr<DeviceBackend> MakeDeviceBackend(Device device,
                                                const compute::ExecutorConfig& config);

}  // namespace moonep::runtime
