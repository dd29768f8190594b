// Scratch probe (twenty-second session): what the NCCL transport's per-operation host steps cost on
// one GPU, each timed alone over many repetitions. Not part of the build:
//   nvcc -O2 -arch=sm_90 -o nccl-op-floor-probe nccl-op-floor-probe-s22.cu -lnccl
// Run on the GPU machine with one process (a one-rank non-blocking communicator, as the transport
// makes them).
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

using Clock = std::chrono::steady_clock;

static double TimeUs(int reps, const std::function<void()>& f) {
  for (int i = 0; i < 10; ++i) f();
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) f();
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / reps;
}

__global__ void Empty() {}

int main() {
  cudaSetDevice(0);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm;
  ncclCommInitRankConfig(&comm, 1, id, 0, &config);
  ncclResult_t st = ncclInProgress;
  while (st == ncclInProgress) ncclCommGetAsyncError(comm, &st);
  std::printf("comm ready: %d\n", static_cast<int>(st));
  const int reps = 2000;
  std::printf("cudaEventCreate + Destroy: %.2f us\n", TimeUs(reps, [] {
                cudaEvent_t e;
                cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
                cudaEventDestroy(e);
              }));
  cudaEvent_t e, caller;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&caller, cudaEventDisableTiming);
  std::printf("ncclCommGetAsyncError: %.2f us\n", TimeUs(reps, [&] {
                ncclResult_t r;
                ncclCommGetAsyncError(comm, &r);
              }));
  std::printf("cudaGetDevice + cudaSetDevice: %.2f us\n", TimeUs(reps, [] {
                int d;
                cudaGetDevice(&d);
                cudaSetDevice(d);
              }));
  std::printf("record on the legacy stream + wait on it: %.2f us\n", TimeUs(reps, [&] {
                cudaEventRecord(caller, 0);
                cudaStreamWaitEvent(s, caller, 0);
              }));
  std::printf("record + query (idle stream): %.2f us\n", TimeUs(reps, [&] {
                cudaEventRecord(e, s);
                while (cudaEventQuery(e) == cudaErrorNotReady) {
                }
              }));
  std::printf("empty kernel + record + poll to done: %.2f us\n", TimeUs(reps, [&] {
                Empty<<<1, 1, 0, s>>>();
                cudaEventRecord(e, s);
                while (cudaEventQuery(e) == cudaErrorNotReady) std::this_thread::yield();
              }));
  std::printf("empty kernel + record + poll with GetAsyncError each spin: %.2f us\n",
              TimeUs(reps, [&] {
                Empty<<<1, 1, 0, s>>>();
                cudaEventRecord(e, s);
                while (cudaEventQuery(e) == cudaErrorNotReady) {
                  ncclResult_t r;
                  ncclCommGetAsyncError(comm, &r);
                  std::this_thread::yield();
                }
              }));
  std::printf("ncclGroupStart/End, no ops, then wait for the comm: %.2f us\n", TimeUs(reps, [&] {
                ncclGroupStart();
                ncclGroupEnd();
                ncclResult_t r = ncclInProgress;
                while (r == ncclInProgress) ncclCommGetAsyncError(comm, &r);
              }));
  void* buf;
  cudaMalloc(&buf, 1 << 20);
  std::printf("ncclAllGather 40 B (one rank) + poll to done: %.2f us\n", TimeUs(reps, [&] {
                ncclAllGather(buf, static_cast<char*>(buf) + 4096, 40, ncclInt8, comm, s);
                ncclResult_t r = ncclInProgress;
                while (r == ncclInProgress) ncclCommGetAsyncError(comm, &r);
                cudaEventRecord(e, s);
                while (cudaEventQuery(e) == cudaErrorNotReady) std::this_thread::yield();
              }));
  void* pinned;
  cudaMallocHost(&pinned, 1 << 20);
  std::printf("D2H 4 KiB pinned + poll to done: %.2f us\n", TimeUs(reps, [&] {
                cudaMemcpyAsync(pinned, buf, 4096, cudaMemcpyDeviceToHost, s);
                cudaEventRecord(e, s);
                while (cudaEventQuery(e) == cudaErrorNotReady) std::this_thread::yield();
              }));
  ncclCommDestroy(comm);
  return 0;
}
