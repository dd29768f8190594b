#include "moonep/runtime/communicator.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "moonep/core/env.h"
#include "moonep/core/logging.h"
#include "moonep/core/status.h"
#include "moonep/runtime/device.h"
#ifdef MOONEP_HAVE_NCCL
#include <cuda_runtime.h>

#include "transport/nccl/nccl_transport.h"
#endif

namespace moonep::runtime {
namespace {

constexpr char kIdMagic[8] = {'M', 'O', 'O', 'N', 'E', 'P', 'I', 'D'};

std::mutex g_mpi_mutex;
bool g_we_initialized_mpi = false;
int g_live_comms = 0;

absl::Status MpiError(int code, const char* what) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return SystemError("%s failed: %s", what, text);
}

bool ReadEnvInt(const char* name, int32_t* value) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return false;
  char* end = nullptr;
  const long parsed = std::strtol(text, &end, 10);
  if (*end != '\0' || parsed < 0 || parsed > INT32_MAX) return false;
  *value = static_cast<int32_t>(parsed);
  return true;
}

void ReleaseMpi() {
  std::lock_guard<std::mutex> lock(g_mpi_mutex);
  if (--g_live_comms == 0 && g_we_initialized_mpi) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
}

}  // namespace

absl::Status EnsureMpi() {
  std::lock_guard<std::mutex> lock(g_mpi_mutex);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    return InvalidUsage("MPI was already finalized (by the caller, or by MoonEP when its last "
                        "communicator was destroyed); MPI cannot be initialized twice");
  }
  if (!initialized) {
    int provided = 0;
    // SERIALIZED: MoonEP's own calls come from one thread at a time unless the caller asks for
    // more by initialising MPI itself with MPI_THREAD_MULTIPLE (see moonep_runtime.h); MULTIPLE
    // would make every MPI call of a single-threaded program take MPI's locks.
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Init_thread");
    g_we_initialized_mpi = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<LaunchInfo> ReadLaunchInfo() {
  LaunchInfo info;
  struct Source {
    const char *rank, *size, *local, *name;
  };
  static const Source kSources[] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_*"},
      {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "PMI_*"},
      {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_*"},
      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK/WORLD_SIZE"},
  };
  for (const Source& s : kSources) {
    if (ReadEnvInt(s.rank, &info.rank) && ReadEnvInt(s.size, &info.size)) {
      if (!ReadEnvInt(s.local, &info.local_rank)) info.local_rank = -1;
      info.source = s.name;
      if (info.size <= 0 || info.rank >= info.size) {
        return InvalidArgument("launcher environment %s gives rank %d of size %d", s.name,
                               info.rank, info.size);
      }
      return info;
    }
  }
  return absl::NotFoundError(
      "no launcher environment found (OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE, "
      "SLURM_PROCID/NTASKS or RANK/WORLD_SIZE)");
}

UniqueId Communicator::NewUniqueId() {
  UniqueId id;
  std::memcpy(id.bytes, kIdMagic, sizeof(kIdMagic));
  std::random_device device;
  std::seed_seq seed{device(), device(), device(), device(), static_cast<unsigned>(getpid()),
                     static_cast<unsigned>(
                         std::chrono::steady_clock::now().time_since_epoch().count())};
  std::mt19937_64 generator(seed);
  for (size_t i = sizeof(kIdMagic); i + 8 <= sizeof(id.bytes); i += 8) {
    const uint64_t word = generator();
    std::memcpy(id.bytes + i, &word, 8);
  }
  return id;
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Adopt(MPI_Comm owned) {
  std::unique_ptr<Communicator> comm(new Communicator());
  {
    std::lock_guard<std::mutex> lock(g_mpi_mutex);
    ++g_live_comms;
  }
  comm->comm_ = owned;
  int rank = 0, size = 0;
  MPI_Comm_rank(owned, &rank);
  MPI_Comm_size(owned, &size);
  comm->rank_ = rank;
  comm->size_ = size;
  log::SetRank(rank);
  const std::string& trace = param::TracePath();
  if (!trace.empty()) MOONEP_RETURN_IF_ERROR(comm->SetTracePath(trace));
  MOONEP_INFO("communicator: rank %d of %d", rank, size);
  return comm;
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::FromMpi(MPI_Comm comm) {
  MOONEP_RETURN_IF_ERROR(EnsureMpi());
  if (comm == MPI_COMM_NULL) return InvalidArgument("comm is MPI_COMM_NULL");
  MPI_Comm dup = MPI_COMM_NULL;
  const int rc = MPI_Comm_dup(comm, &dup);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_dup");
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  return Adopt(dup);
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::FromUniqueId(const UniqueId& id,
                                                                         int32_t size,
                                                                         int32_t rank) {
  MOONEP_RETURN_IF_ERROR(EnsureMpi());
  // Local checks must not skip the collective split below, or the other processes would wait
  // forever; a bad argument is carried through it as color/flag and reported by everyone.
  absl::Status local = absl::OkStatus();
  if (std::memcmp(id.bytes, kIdMagic, sizeof(kIdMagic)) != 0) {
    local = InvalidArgument("id was not made by moonepGetUniqueId (bad magic)");
  } else if (size <= 0) {
    local = InvalidArgument("nranks is %d; must be positive", size);
  } else if (rank < 0 || rank >= size) {
    local = InvalidArgument("rank is %d; must be in [0, nranks = %d)", rank, size);
  }
  uint32_t hash = 2166136261u;  // FNV-1a of the id: processes with the same id share a color
  for (char c : id.bytes) hash = (hash ^ static_cast<unsigned char>(c)) * 16777619u;
  const int color = local.ok() ? static_cast<int>(hash & 0x3fffffff) : MPI_UNDEFINED;
  MPI_Comm split = MPI_COMM_NULL;
  int rc = MPI_Comm_split(MPI_COMM_WORLD, color, local.ok() ? rank : 0, &split);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_split(MPI_COMM_WORLD)");
  if (!local.ok()) return local;
  MPI_Comm_set_errhandler(split, MPI_ERRORS_RETURN);
  int got_size = 0, got_rank = 0;
  MPI_Comm_size(split, &got_size);
  MPI_Comm_rank(split, &got_rank);
  // Every member checks the same gathered data, so all reach the same verdict.
  struct Member {
    char id[kUniqueIdBytes];
    int32_t rank, size;
  } mine{};
  std::memcpy(mine.id, id.bytes, sizeof(mine.id));
  mine.rank = rank;
  mine.size = size;
  std::vector<Member> all(static_cast<size_t>(got_size));
  rc = MPI_Allgather(&mine, sizeof(Member), MPI_BYTE, all.data(), sizeof(Member), MPI_BYTE, split);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(&split);
    return MpiError(rc, "MPI_Allgather of the unique ids");
  }
  absl::Status verdict = absl::OkStatus();
  for (int i = 0; i < got_size && verdict.ok(); ++i) {
    if (std::memcmp(all[i].id, id.bytes, kUniqueIdBytes) != 0) {
      verdict = Internal("unique id hash collision between two jobs; call moonepGetUniqueId again");
    } else if (all[i].size != got_size) {
      verdict = InvalidArgument(
          "%d processes called moonepCommInitRank with this id, but the process with rank %d "
          "passed nranks = %d", got_size, all[i].rank, all[i].size);
    } else if (all[i].rank != i) {
      verdict = InvalidArgument("ranks passed with this id are not 0..%d exactly once "
                                "(rank %d is %s)", got_size - 1, i,
                                i < got_size - 1 && all[i].rank == all[i + 1].rank
                                    ? "given twice" : "missing");
    }
  }
  (void)got_rank;
  if (!verdict.ok()) {
    MPI_Comm_free(&split);
    return verdict;
  }
  return Adopt(split);
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::FromEnvironment() {
  MOONEP_ASSIGN_OR_RETURN(LaunchInfo info, ReadLaunchInfo());
  MOONEP_RETURN_IF_ERROR(EnsureMpi());
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != info.size) {
    return Unavailable(
        "%s says %d ranks but MPI_COMM_WORLD has %d: this process was not started by an MPI "
        "launcher (mpirun/srun). The MPI backend needs one; launches without MPI (e.g. plain "
        "torchrun) need the UCX or NCCL backend, not built yet", info.source, info.size, world);
  }
  MPI_Comm split = MPI_COMM_NULL;
  const int rc = MPI_Comm_split(MPI_COMM_WORLD, 0, info.rank, &split);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_split(MPI_COMM_WORLD)");
  MPI_Comm_set_errhandler(split, MPI_ERRORS_RETURN);
  return Adopt(split);
}

Communicator::~Communicator() {
  replicas_.clear();
  nccl_comms_.reset();  // finalizes the shared NCCL pair (bounded), before MPI goes
  trace_.reset();
  // Parked exchanges: a late peer's messages may still land in their buffers, or MPI still read
  // a send's. They are left allocated, and after a failed agreement so is the communicator, which
  // may still carry them (as the transports do).
  for (auto& exchange : parked_) (void)exchange.release();
  if (broken_.ok() && comm_ != MPI_COMM_NULL) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  ReleaseMpi();
}

absl::StatusOr<SharedReplicas*> Communicator::Replicas(int32_t slots, int64_t hidden,
                                                       int64_t intermediate, DType dtype,
                                                       DType grad_dtype, Device device,
                                                       bool* created) {
  auto key = std::make_tuple(slots, hidden, intermediate, static_cast<int32_t>(dtype),
                             static_cast<int32_t>(grad_dtype), static_cast<int32_t>(device));
  if (created != nullptr) *created = false;
  auto it = replicas_.find(key);
  if (it != replicas_.end()) return it->second.get();
  auto shared = std::make_unique<SharedReplicas>();
  MOONEP_ASSIGN_OR_RETURN(shared->buffer,
                          compute::ReplicaBuffer::Create(slots, hidden, intermediate, dtype,
                                                         grad_dtype, DeviceAllocator(device)));
  SharedReplicas* raw = shared.get();
  replicas_.emplace(key, std::move(shared));
  if (created != nullptr) *created = true;
  return raw;
}

void Communicator::DropReplicas(const SharedReplicas* replicas) {
  for (auto it = replicas_.begin(); it != replicas_.end(); ++it) {
    if (it->second.get() == replicas) {
      replicas_.erase(it);
      return;
    }
  }
}

size_t Communicator::ReplicaBytes() const {
  size_t total = 0;
  for (const auto& entry : replicas_) total += entry.second->buffer->total_bytes();
  return total;
}

absl::Status Communicator::SetTracePath(const std::string& path) {
  trace_.reset();
  if (!path.empty() && rank_ == 0) trace_ = std::make_unique<TraceWriter>(path);
  return absl::OkStatus();
}

absl::Status Communicator::Allgather(absl::Span<const char> bytes, std::string* out,
                                     const char* phase) {
  if (!broken_.ok()) {
    return InvalidUsage("%s: an earlier agreement on this communicator failed (%s); destroy it",
                        phase, broken_.message());
  }
  // Point to point (the communicator is MoonEP's own duplicate, so every tag on it is ours),
  // in two rounds: the data, then a confirmation from every peer that it has all of it. A rank
  // that times out in either round sends "gave up" to every peer instead, which a peer's
  // confirmation receive takes in its place, so a rank that joins late fails too instead of
  // going on alone into the next collective. Unlike a nonblocking collective, a timeout can name
  // the ranks not heard from and cancel its receives.
  constexpr int kDataTag = 1, kConfirmTag = 2, kGaveUpTag = 3;
  const int n = static_cast<int>(bytes.size());
  auto ex = std::make_unique<Exchange>();
  ex->send.assign(bytes.begin(), bytes.end());
  ex->recv.assign(bytes.size() * static_cast<size_t>(size_), '\0');
  std::memcpy(ex->recv.data() + static_cast<size_t>(rank_) * n, bytes.data(), bytes.size());
  ex->confirm.assign(static_cast<size_t>(size_) + 1, 0);  // [r]: from rank r; [size_]: to send
  std::vector<int> peers;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) peers.push_back(r);
  }
  const size_t P = peers.size();
  std::vector<MPI_Status> status(2 * P);
  std::vector<int> indices(2 * P);
  // Fails the agreement: open receives cancelled, "gave up" sent to every peer, the buffers
  // parked (MPI may still use them), the communicator refusing further agreements.
  auto give_up = [&](absl::Status why) {
    for (size_t i = 0; i < P; ++i) {
      if (ex->requests[i] == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&ex->requests[i]);
      MPI_Request_free(&ex->requests[i]);
    }
    for (int r : peers) {
      MPI_Request notice = MPI_REQUEST_NULL;
      if (MPI_Isend(&ex->confirm[static_cast<size_t>(size_)], 1, MPI_BYTE, r, kGaveUpTag, comm_,
                    &notice) == MPI_SUCCESS) {
        MPI_Request_free(&notice);
      }
    }
    broken_ = std::move(why);
    parked_.push_back(std::move(ex));
    return broken_;
  };
  // Posts the receives (requests [0, P)) and sends ([P, 2P)) of one round; then waits for all of
  // them until the deadline. Returns the peers whose receive is still open at the deadline (empty:
  // done) or an MPI error.
  auto round = [&](auto post_recv, auto post_send, const char* what) -> absl::StatusOr<std::vector<int>> {
    // Sends of an earlier round still open (every receive came in by its deadline) stay
    // with the exchange, so that it is parked while they are.
    for (MPI_Request q : ex->requests) {
      if (q != MPI_REQUEST_NULL) ex->open_sends.push_back(q);
    }
    ex->requests.assign(2 * P, MPI_REQUEST_NULL);
    for (size_t i = 0; i < P; ++i) {
      int rc = post_recv(peers[i], &ex->requests[i]);
      if (rc == MPI_SUCCESS) rc = post_send(peers[i], &ex->requests[P + i]);
      if (rc != MPI_SUCCESS) return MpiError(rc, what);
    }
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(param::TimeoutMs());
    for (int spins = 0;; ++spins) {
      // Testsome, not Testall: completed requests become MPI_REQUEST_NULL, so a timeout can
      // tell which receives are still open.
      int completed = 0;
      const int rc = MPI_Testsome(static_cast<int>(2 * P), ex->requests.data(), &completed,
                                  indices.data(), status.data());
      if (rc != MPI_SUCCESS) return MpiError(rc, what);
      if (completed == MPI_UNDEFINED) return std::vector<int>();
      for (int j = 0; j < completed; ++j) {
        if (indices[j] < static_cast<int>(P)) ex->confirm_tag[indices[j]] = status[j].MPI_TAG;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        std::vector<int> missing;
        for (size_t i = 0; i < P; ++i) {
          if (ex->requests[i] != MPI_REQUEST_NULL) missing.push_back(peers[i]);
        }
        return missing;  // empty: every receive done, a send still open (parked below)
      }
      if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  };
  auto names = [](const std::vector<int>& ranks) {
    std::string s;
    for (int r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
    return s;
  };
  ex->confirm_tag.assign(P, 0);
  absl::StatusOr<std::vector<int>> missing = round(
      [&](int r, MPI_Request* q) {
        return MPI_Irecv(ex->recv.data() + static_cast<size_t>(r) * n, n, MPI_BYTE, r, kDataTag,
                         comm_, q);
      },
      [&](int r, MPI_Request* q) {
        return MPI_Isend(ex->send.data(), n, MPI_BYTE, r, kDataTag, comm_, q);
      },
      phase);
  if (!missing.ok()) return give_up(missing.status());
  if (!missing->empty()) {
    return give_up(Timeout("%s timed out after MOONEP_TIMEOUT_MS = %d ms on rank %d: nothing "
                           "heard from rank(s) %s", phase, param::TimeoutMs(), rank_,
                           names(*missing)));
  }
  // Confirmation: the receive from each peer takes its confirmation or its "gave up".
  missing = round(
      [&](int r, MPI_Request* q) {
        return MPI_Irecv(&ex->confirm[static_cast<size_t>(r)], 1, MPI_BYTE, r, MPI_ANY_TAG, comm_, q);
      },
      [&](int r, MPI_Request* q) {
        return MPI_Isend(&ex->confirm[static_cast<size_t>(size_)], 1, MPI_BYTE, r, kConfirmTag,
                         comm_, q);
      },
      phase);
  if (!missing.ok()) return give_up(missing.status());
  if (!missing->empty()) {
    return give_up(Timeout("%s timed out after MOONEP_TIMEOUT_MS = %d ms on rank %d: no "
                           "confirmation from rank(s) %s", phase, param::TimeoutMs(), rank_,
                           names(*missing)));
  }
  std::vector<int> gave_up;
  for (size_t i = 0; i < P; ++i) {
    if (ex->confirm_tag[i] == kGaveUpTag) gave_up.push_back(peers[i]);
  }
  absl::Status result = absl::OkStatus();
  if (!gave_up.empty()) {
    broken_ = RemoteError("%s: rank(s) %s gave up waiting (MOONEP_TIMEOUT_MS) and failed", phase,
                          names(gave_up));
    result = broken_;
  } else {
    out->assign(ex->recv.begin(), ex->recv.end());
  }
  // A send a peer never took (it gave up) still owns its buffer: released to complete in the
  // background, with the buffer parked.
  bool open = false;
  for (std::vector<MPI_Request>* list : {&ex->requests, &ex->open_sends}) {
    for (MPI_Request& q : *list) {
      if (q == MPI_REQUEST_NULL) continue;
      MPI_Request_free(&q);
      open = true;
    }
  }
  if (open) parked_.push_back(std::move(ex));
  return result;
}

}  // namespace moonep::runtime

namespace moonep::runtime {

absl::Status Communicator::SetNcclComm(void* nccl_comm) {
#ifdef MOONEP_HAVE_NCCL
  MOONEP_CHECK_ARG(nccl_comm != nullptr, "nccl_comm (the NCCL communicator) is NULL");
  if (nccl_comms_ != nullptr) {
    return InvalidUsage("SetNcclComm: NCCL communicators already exist on this communicator "
                        "(call it before creating device layers or buffers)");
  }
  auto* c = static_cast<ncclComm_t>(nccl_comm);
  int n = 0, r = 0;
  if (ncclCommCount(c, &n) != ncclSuccess || ncclCommUserRank(c, &r) != ncclSuccess) {
    return InvalidArgument("SetNcclComm: nccl_comm is not a usable NCCL communicator");
  }
  if (n != size_ || r != rank_) {
    return InvalidArgument("SetNcclComm: the NCCL communicator has rank %d of %d, this "
                           "communicator rank %d of %d (same size and rank order required)",
                           r, n, rank_, size_);
  }
  caller_nccl_comm_ = nccl_comm;
  return absl::OkStatus();
#else
  (void)nccl_comm;
  return Unavailable("SetNcclComm: MoonEP was built without NCCL (MOONEP_WITH_NCCL=OFF)");
#endif
}

absl::StatusOr<std::unique_ptr<transport::Transport>> Communicator::MakeTransport(
    const std::string& backend, const transport::TransportOptions& options) {
#ifdef MOONEP_HAVE_NCCL
  if (backend == "nccl") {
    if (nccl_comms_ == nullptr) {
      transport::nccl::NcclBootstrap b;
      if (caller_nccl_comm_ != nullptr) {
        b.kind = transport::nccl::NcclBootstrap::Kind::kWrap;
        b.comm = static_cast<ncclComm_t>(caller_nccl_comm_);
      }
      MOONEP_ASSIGN_OR_RETURN(nccl_comms_, transport::nccl::CreateNcclComms(options, b));
    }
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
      cudaGetLastError();
      return SystemError("cudaGetDevice failed");
    }
    const int pair_device = transport::nccl::DeviceOf(*nccl_comms_);
    if (device != pair_device) {
      return InvalidArgument("a layer on GPU %d, but this communicator's NCCL communicators are on "
                             "GPU %d (one GPU per rank)", device, pair_device);
    }
    return transport::nccl::CreateNcclTransport(options, nccl_comms_);
  }
#endif
  return transport::CreateTransport(backend, options);
}

}  // namespace moonep::runtime
