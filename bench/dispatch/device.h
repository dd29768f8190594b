// Device memory for the NCCL backend of moonep-bench-dispatch, behind a small interface so the
// runner compiles without CUDA (MOONEP_BENCH_WITH_NCCL off: every call fails with Unavailable).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <string>

#include "absl/status/status.h"

namespace moonep::bench {

// GPUs this process sees (0 when CUDA is not built in, no driver, or no device).
int DeviceCount();
// Makes `device` current; checks that it exists.
absl::Status SelectDevice(int device);
// Waits for all work queued on the current device.
absl::Status DeviceSynchronize();
// The current device's index (-1 when none).
int CurrentDevice();
// A description of the current device ("NVIDIA H200, device 0"), for the run header.
std::string DeviceName();

// One allocation of device memory, made once (no allocation per iteration) and freed with it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  ~DeviceBuffer();

  absl::Status Allocate(size_t bytes);  // at least one byte, so the pointer is never null
  absl::Status Upload(const void* host, size_t bytes);  // synchronous
  absl::Status Download(void* host, size_t bytes) const;  // synchronous
  // `bytes` from byte `offset` of the buffer into host, synchronous.
  absl::Status DownloadRange(size_t offset, void* host, size_t bytes) const;
  absl::Status Fill(unsigned char byte);                  // every byte, synchronous
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  bool allocated() const { return ptr_ != nullptr; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The raw NCCL all-to-all baseline: its own ncclComm_t over the ranks of an MPI communicator
// (ncclUniqueId broadcast over MPI, ncclCommInitRank) and its own stream. Exchange moves
// count[p] units of `unit` bytes from send + displ[p] units to peer p with one grouped
// ncclSend/ncclRecv round, and returns when the stream has finished it.
class DeviceAlltoall {
 public:
  DeviceAlltoall() = default;
  DeviceAlltoall(const DeviceAlltoall&) = delete;
  DeviceAlltoall& operator=(const DeviceAlltoall&) = delete;
  ~DeviceAlltoall();

  absl::Status Init(MPI_Comm comm);  // collective over comm; the rank's GPU must be current
  absl::Status Exchange(const void* send, const int* send_count, const int* send_displ, void* recv,
                        const int* recv_count, const int* recv_displ, size_t unit);

 private:
  void* comm_ = nullptr;    // ncclComm_t
  void* stream_ = nullptr;  // cudaStream_t
  int size_ = 0;
};

}  // namespace moonep::bench
