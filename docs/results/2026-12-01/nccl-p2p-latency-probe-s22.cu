// Scratch probe (twenty-second session): the latency of one small NCCL exchange between two GPUs,
// with the communicator non-blocking (as the NCCL transport makes it: ncclGroupEnd returns
// ncclInProgress and the caller polls ncclCommGetAsyncError) and blocking. Not part of the build:
//   nvcc -O2 -arch=sm_90 -ccbin mpicxx -o nccl-p2p-latency-probe nccl-p2p-latency-probe-s22.cu -lnccl
//   mpirun -np 2 ./nccl-p2p-latency-probe
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

using Clock = std::chrono::steady_clock;

static double TimeUs(int reps, const std::function<void()>& f) {
  for (int i = 0; i < 20; ++i) f();
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) f();
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / reps;
}

static void WaitComm(ncclComm_t c) {
  ncclResult_t r = ncclInProgress;
  while (r == ncclInProgress) ncclCommGetAsyncError(c, &r);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  cudaSetDevice(rank);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  void* buf;
  cudaMalloc(&buf, 1 << 20);
  void* pinned;
  cudaMallocHost(&pinned, 1 << 20);
  const int peer = (rank + 1) % size;
  for (int blocking = 0; blocking <= 1; ++blocking) {
    ncclUniqueId id;
    if (rank == 0) ncclGetUniqueId(&id);
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking;
    ncclComm_t comm;
    ncclCommInitRankConfig(&comm, size, id, rank, &config);
    WaitComm(comm);
    auto poll = [&] {
      cudaEventRecord(e, s);
      while (cudaEventQuery(e) == cudaErrorNotReady) std::this_thread::yield();
    };
    const double sendrecv = TimeUs(500, [&] {
      ncclGroupStart();
      ncclSend(buf, 8, ncclInt8, peer, comm, s);
      ncclRecv(static_cast<char*>(buf) + 4096, 8, ncclInt8, peer, comm, s);
      ncclGroupEnd();
      WaitComm(comm);
      poll();
    });
    const double groupend_only = TimeUs(500, [&] {
      ncclGroupStart();
      ncclSend(buf, 8, ncclInt8, peer, comm, s);
      ncclRecv(static_cast<char*>(buf) + 4096, 8, ncclInt8, peer, comm, s);
      ncclGroupEnd();
      WaitComm(comm);
    });
    cudaStreamSynchronize(s);
    const double allgather = TimeUs(500, [&] {
      ncclAllGather(buf, static_cast<char*>(buf) + 4096, 40, ncclInt8, comm, s);
      WaitComm(comm);
      poll();
    });
    const double allgather_d2h = TimeUs(500, [&] {
      ncclAllGather(buf, static_cast<char*>(buf) + 4096, 40, ncclInt8, comm, s);
      WaitComm(comm);
      cudaMemcpyAsync(pinned, static_cast<char*>(buf) + 4096, 80, cudaMemcpyDeviceToHost, s);
      poll();
    });
    if (rank == 0) {
      std::printf("%s: send+recv 8 B, poll to done %.1f us; the enqueue alone %.1f us; allgather 40 B "
                  "%.1f us; + D2H %.1f us\n",
                  blocking ? "blocking    " : "non-blocking", sendrecv, groupend_only, allgather,
                  allgather_d2h);
    }
    cudaStreamSynchronize(s);
    ncclCommDestroy(comm);
  }
  MPI_Finalize();
  return 0;
}
