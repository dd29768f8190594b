#include "bench/dispatch/device.h"

#include "absl/strings/str_format.h"
#include "moonep/core/status.h"

#ifdef MOONEP_BENCH_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
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

int CurrentDevice() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

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

absl::Status DeviceBuffer::DownloadRange(size_t offset, void* host, size_t bytes) const {
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return Internal("download of bytes [%d, %d) from a %d-byte buffer", offset, offset + bytes, bytes_);
  }
  if (bytes == 0) return absl::OkStatus();
  return Check(cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes,
                          cudaMemcpyDeviceToHost), "cudaMemcpy (to host)");
}

absl::Status DeviceBuffer::Fill(unsigned char byte) {
  if (bytes_ == 0) return absl::OkStatus();
  MOONEP_RETURN_IF_ERROR(Check(cudaMemset(ptr_, byte, bytes_), "cudaMemset"));
  return Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

namespace {
absl::Status CheckNccl(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return Internal("%s failed: %s", what, ncclGetErrorString(r));
}
}  // namespace

DeviceAlltoall::~DeviceAlltoall() {
  if (stream_ != nullptr) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  if (comm_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status DeviceAlltoall::Init(MPI_Comm comm) {
  if (comm_ != nullptr) return Internal("DeviceAlltoall::Init called twice");
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  // Rank 0's id and its verdict travel together, so a failure there ends every rank cleanly.
  struct {
    int ok;
    ncclUniqueId id;
  } msg{};
  msg.ok = 1;
  if (rank == 0 && ncclGetUniqueId(&msg.id) != ncclSuccess) msg.ok = 0;
  MPI_Bcast(&msg, static_cast<int>(sizeof(msg)), MPI_BYTE, 0, comm);
  if (!msg.ok) return Internal("ncclGetUniqueId failed on rank 0");
  cudaStream_t s = nullptr;
  MOONEP_RETURN_IF_ERROR(
      Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
  stream_ = s;
  ncclComm_t c = nullptr;
  MOONEP_RETURN_IF_ERROR(CheckNccl(ncclCommInitRank(&c, size, msg.id, rank), "ncclCommInitRank"));
  comm_ = c;
  size_ = size;
  return absl::OkStatus();
}

absl::Status DeviceAlltoall::Exchange(const void* send, const int* send_count,
                                      const int* send_displ, void* recv, const int* recv_count,
                                      const int* recv_displ, size_t unit) {
  if (comm_ == nullptr) return Internal("DeviceAlltoall::Exchange before Init");
  ncclComm_t c = static_cast<ncclComm_t>(comm_);
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  MOONEP_RETURN_IF_ERROR(CheckNccl(ncclGroupStart(), "ncclGroupStart"));
  absl::Status status;
  for (int p = 0; p < size_ && status.ok(); ++p) {
    if (send_count[p] > 0) {
      status = CheckNccl(
          ncclSend(static_cast<const char*>(send) + static_cast<size_t>(send_displ[p]) * unit,
                   static_cast<size_t>(send_count[p]) * unit, ncclChar, p, c, s),
          "ncclSend");
    }
    if (status.ok() && recv_count[p] > 0) {
      status = CheckNccl(
          ncclRecv(static_cast<char*>(recv) + static_cast<size_t>(recv_displ[p]) * unit,
                   static_cast<size_t>(recv_count[p]) * unit, ncclChar, p, c, s),
          "ncclRecv");
    }
  }
  const absl::Status end = CheckNccl(ncclGroupEnd(), "ncclGroupEnd");
  MOONEP_RETURN_IF_ERROR(status);
  MOONEP_RETURN_IF_ERROR(end);
  return Check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
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
int CurrentDevice() { return -1; }
std::string DeviceName() { return "no GPU support built"; }
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&&) noexcept { return *this; }
DeviceBuffer::~DeviceBuffer() = default;
absl::Status DeviceBuffer::Allocate(size_t) { return NotBuilt(); }
absl::Status DeviceBuffer::Upload(const void*, size_t) { return NotBuilt(); }
absl::Status DeviceBuffer::Download(void*, size_t) const { return NotBuilt(); }
absl::Status DeviceBuffer::DownloadRange(size_t, void*, size_t) const { return NotBuilt(); }
absl::Status DeviceBuffer::Fill(unsigned char) { return NotBuilt(); }
DeviceAlltoall::~DeviceAlltoall() = default;
absl::Status DeviceAlltoall::Init(MPI_Comm) { return NotBuilt(); }
absl::Status DeviceAlltoall::Exchange(const void*, const int*, const int*, void*, const int*,
                                      const int*, size_t) {
  return NotBuilt();
}

#endif

}  // namespace moonep::bench
