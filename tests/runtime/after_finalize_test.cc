// MoonEP objects destroyed (or used) after the caller's MPI_Finalize: each call returns
// moonepInvalidUsage saying MPI was finalized, instead of calling MPI (Open MPI aborts the whole job
// on a call after MPI_Finalize, so a trainer whose finalizers ran in the wrong order lost every
// rank). Its own main: MPI_Finalize is part of the test. Run under mpirun, with the transport of
// MOONEP_TRANSPORT; exits 0 only when every check holds.
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "moonep/moonep_runtime.h"

namespace {

int failures = 0;

void Expect(bool ok, int rank, const char* what, const std::string& detail) {
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "[rank %d] FAILED: %s: %s\n", rank, what, detail.c_str());
}

// `r` is moonepInvalidUsage and the thread's error says MPI was finalized.
void ExpectFinalizedError(moonepResult_t r, int rank, const char* call) {
  const std::string message = moonepGetLastThreadError();
  Expect(r == moonepInvalidUsage, rank, call,
         std::string("returned ") + moonepGetErrorString(r) + ": " + message);
  Expect(message.find("MPI was finalized") != std::string::npos, rank, call,
         "message does not say MPI was finalized: " + message);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "failed-creation") == 0) {
    moonepUniqueId id;
    std::memset(&id, 0, sizeof(id));  // not made by moonepGetUniqueId: refused on every rank
    moonepComm_t comm = nullptr;
    const moonepResult_t r = moonepCommInitRank(&comm, 2, id, 0);
    Expect(r == moonepInvalidArgument, -1, "moonepCommInitRank with a zeroed id",
           std::string(moonepGetErrorString(r)) + ": " + moonepGetLastThreadError());
    return failures == 0 ? 0 : 1;
  }
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm world = MPI_COMM_WORLD;
  moonepComm_t comm = nullptr;
  if (moonepCommInitMpi(&comm, &world) != moonepSuccess) {
    std::fprintf(stderr, "[rank %d] moonepCommInitMpi: %s\n", rank, moonepGetLastThreadError());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  moonepLayerConfig_t config = MOONEP_LAYER_CONFIG_INITIALIZER;
  config.num_experts = 2 * size;
  config.top_k = 2;
  config.hidden = 8;
  config.intermediate = 4;
  config.dtype = moonepFloat32;
  config.max_tokens = 4;
  config.num_threads = 1;
  moonepLayer_t layer = nullptr;
  moonepEpBuffer_t buffer = nullptr;
  if (moonepLayerCreate(comm, &config, &layer) != moonepSuccess ||
      moonepEpBufferCreate(comm, &config, &buffer) != moonepSuccess) {
    std::fprintf(stderr, "[rank %d] creation: %s\n", rank, moonepGetLastThreadError());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();

  // A step after MPI_Finalize: refused, nothing sent.
  std::vector<float> x(4 * 8, 1.0f), y(4 * 8);
  std::vector<int32_t> ids = {0, 1, 0, 1, 0, 1, 0, 1};
  std::vector<float> w(8, 0.5f);
  moonepEpHandle_t handle = nullptr;
  ExpectFinalizedError(moonepEpDispatch(buffer, 4, x.data(), ids.data(), w.data(), &handle), rank,
                       "moonepEpDispatch after MPI_Finalize");
  // Destruction frees what is MoonEP's own and says why the rest stays.
  ExpectFinalizedError(moonepEpBufferDestroy(buffer), rank, "moonepEpBufferDestroy");
  ExpectFinalizedError(moonepLayerDestroy(layer), rank, "moonepLayerDestroy");
  const moonepResult_t r = moonepCommDestroy(comm);
  Expect(r == moonepSuccess, rank, "moonepCommDestroy",
         std::string(moonepGetErrorString(r)) + ": " + moonepGetLastThreadError());
  // The handles are gone: using one again is refused, not dereferenced.
  Expect(moonepLayerDestroy(layer) == moonepInvalidUsage, rank, "moonepLayerDestroy twice", "");
  if (failures == 0) std::printf("[rank %d] after MPI_Finalize: every call refused cleanly\n", rank);
  return failures == 0 ? 0 : 1;
}
