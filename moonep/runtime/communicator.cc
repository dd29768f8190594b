#include "moonep/runtime/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>
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

// A nonblocking creation collective (MPI_Comm_idup) that did not complete by its deadline. MPI
// offers no way to cancel it, and completes it (writing the new communicator into `comm`) when
// the late ranks call it: the request and its output are kept here, allocated for good.
struct PendingIdup {
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
};
// Under g_mpi_mutex; never destroyed (a static vector's destructor could run before the last
// communicator's).
std::vector<PendingIdup*>& PendingIdups() {
  static auto* pending = new std::vector<PendingIdup*>();
  return *pending;
}

// Tests the pending creation collectives; drops those MPI completed (their communicators stay
// allocated: a late peer may still have sent to them). Returns how many are still open. Under
// g_mpi_mutex.
int SweepPendingIdups() {
  std::vector<PendingIdup*>& pending = PendingIdups();
  for (auto it = pending.begin(); it != pending.end();) {
    int done = 0;
    if (MPI_Test(&(*it)->request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
      it = pending.erase(it);  // the PendingIdup itself stays allocated (its comm, see above)
    } else {
      ++it;
    }
  }
  return static_cast<int>(pending.size());
}

void ReleaseMpi() {
  std::lock_guard<std::mutex> lock(g_mpi_mutex);
  if (--g_live_comms == 0 && g_we_initialized_mpi) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    // A creation that timed out leaves its MPI_Comm_idup open on this rank. Open MPI 4.1's
    // MPI_Finalize does not wait for it (checked: 3 and 4 ranks, ob1/vader/tcp), while a
    // process that skips MPI_Finalize is reported by mpirun as an abnormal termination that
    // kills its peers: finalize anyway, and say so.
    const int open = SweepPendingIdups();
    if (open > 0) {
      MOONEP_WARN("MPI_Finalize with %d communicator creation(s) still open on this rank (they "
                  "timed out: a rank never joined them); MPI may complete them or drop them",
                  open);
    }
    MPI_Finalize();
  }
}

// A launcher variable: unset (or empty), a non-negative base-10 int32 (digits only), or neither.
enum class EnvInt { kUnset, kOk, kMalformed };
EnvInt ReadEnvInt(const char* name, int32_t* value) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return EnvInt::kUnset;
  int64_t parsed = 0;
  for (const char* c = text; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9') return EnvInt::kMalformed;
    parsed = parsed * 10 + (*c - '0');
    if (parsed > INT32_MAX) return EnvInt::kMalformed;
  }
  *value = static_cast<int32_t>(parsed);
  return EnvInt::kOk;
}

const char* EnvText(const char* name) {
  const char* text = std::getenv(name);
  return text != nullptr ? text : "";
}

// Creation's deadline: MOONEP_TIMEOUT_MS, read once per process like every knob. Malformed: 60000
// ms for this creation's own waits, and `status` says why (creation then fails on every rank).
struct CreationTimeout {
  int64_t ms = 60000;
  absl::Status status;
};
CreationTimeout ReadCreationTimeout() {
  CreationTimeout t;
  t.status = param::CheckedTimeoutMs().status();
  t.ms = param::TimeoutMs();
  return t;
}

// MPI_Comm_idup(parent), waited for until `timeout_ms` has passed. Every rank of `parent` takes
// part, so the wait ends only when all of them have called it: on a timeout at least one has not,
// but a nonblocking collective does not say which. A request that times out cannot be cancelled:
// it is kept (PendingIdups) and MPI completes it if the late ranks call it later.
absl::StatusOr<MPI_Comm> IdupWithDeadline(MPI_Comm parent, const char* parent_name,
                                          int64_t timeout_ms, const char* phase) {
  auto pending = std::make_unique<PendingIdup>();
  int rc = MPI_Comm_idup(parent, &pending->comm, &pending->request);
  if (rc != MPI_SUCCESS) return MpiError(rc, "communicator creation: MPI_Comm_idup");
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (int spins = 0;; ++spins) {
    int done = 0;
    rc = MPI_Test(&pending->request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) break;
    if (done) return pending->comm;
    if (std::chrono::steady_clock::now() > deadline) break;
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  int rank = 0, size = 0;
  MPI_Comm_rank(parent, &rank);
  MPI_Comm_size(parent, &size);
  {
    std::lock_guard<std::mutex> lock(g_mpi_mutex);
    PendingIdups().push_back(pending.release());
  }
  if (rc != MPI_SUCCESS) return MpiError(rc, "communicator creation: MPI_Test of MPI_Comm_idup");
  return Timeout("%s: MPI_Comm_idup of %s (%d ranks) not complete after MOONEP_TIMEOUT_MS = %d "
                 "ms on rank %d: at least one rank of it has not called this creation (an MPI "
                 "nonblocking collective does not say which). This rank's part stays open in "
                 "MPI: the ranks that did not join must still make the same call (it fails "
                 "too), or %s must not be used for further collectives",
                 phase, parent_name, size, timeout_ms, rank, parent_name);
}

// What a rank found wrong with its own arguments before a creation agreement: carried through
// the agreement, so that every other rank fails at once (RemoteError quoting it) instead of
// waiting for it until the timeout.
struct LocalError {
  int32_t failed = 0;
  char why[124] = {};  // the start of the rank's own message
};
LocalError Carry(const absl::Status& status) {
  LocalError e;
  if (status.ok()) return e;
  e.failed = 1;
  const absl::string_view text = status.message();
  std::memcpy(e.why, text.data(), std::min(text.size(), sizeof(e.why) - 1));
  return e;
}
std::string Quote(const LocalError& e) {
  return std::string(e.why, strnlen(e.why, sizeof(e.why)));
}

std::string RankList(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

// A communicator of the ranks `members` of `world` (a duplicate of MPI_COMM_WORLD), ordered as
// given. MPI_Comm_create_group blocks until every member calls it; it is called only after an
// agreement showed all of them present and willing.
absl::StatusOr<MPI_Comm> CreateGroup(MPI_Comm world, const std::vector<int>& members) {
  MPI_Group world_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  MPI_Comm made = MPI_COMM_NULL;
  int rc = MPI_Comm_group(world, &world_group);
  if (rc == MPI_SUCCESS) {
    rc = MPI_Group_incl(world_group, static_cast<int>(members.size()), members.data(), &group);
  }
  if (rc == MPI_SUCCESS) rc = MPI_Comm_create_group(world, group, 0, &made);
  if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
  if (world_group != MPI_GROUP_NULL) MPI_Group_free(&world_group);
  if (rc != MPI_SUCCESS) return MpiError(rc, "communicator creation: MPI_Comm_create_group");
  MPI_Comm_set_errhandler(made, MPI_ERRORS_RETURN);
  return made;
}

}  // namespace

namespace {

void FinalizeAtExit() {
  std::lock_guard<std::mutex> lock(g_mpi_mutex);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && g_live_comms == 0) MPI_Finalize();
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
    // A creation that fails leaves no communicator to destroy, so ReleaseMpi never runs; a process
    // that exits without MPI_Finalize is reported by mpirun as an abnormal termination (exit 1,
    // its peers killed). Finalize at exit then, when no communicator is live.
    std::atexit(FinalizeAtExit);
  }
  return absl::OkStatus();
}

absl::StatusOr<LaunchInfo> ReadLaunchInfo() {
  struct Source {
    const char *rank, *size, *name;
  };
  static const Source kSources[] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_*"},
      {"PMI_RANK", "PMI_SIZE", "PMI_*"},
      {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_*"},
      {"RANK", "WORLD_SIZE", "RANK/WORLD_SIZE"},
  };
  std::string partial;  // the first source with only one of its two variables set
  for (const Source& s : kSources) {
    LaunchInfo info;
    const EnvInt rank = ReadEnvInt(s.rank, &info.rank);
    const EnvInt size = ReadEnvInt(s.size, &info.size);
    if (rank != EnvInt::kUnset && size != EnvInt::kUnset) {
      if (rank == EnvInt::kMalformed) {
        return InvalidArgument("launcher environment: %s=%s is not a rank (a base-10 integer "
                               "from 0 to 2^31-1)", s.rank, EnvText(s.rank));
      }
      if (size == EnvInt::kMalformed || info.size == 0) {
        return InvalidArgument("launcher environment: %s=%s is not a number of ranks (a base-10 "
                               "integer from 1 to 2^31-1)", s.size, EnvText(s.size));
      }
      if (info.rank >= info.size) {
        return InvalidArgument("launcher environment: %s=%d is not below %s=%d", s.rank,
                               info.rank, s.size, info.size);
      }
      info.source = s.name;
      info.rank_var = s.rank;
      info.size_var = s.size;
      return info;
    }
    if (partial.empty() && (rank != EnvInt::kUnset || size != EnvInt::kUnset)) {
      const char* set = rank != EnvInt::kUnset ? s.rank : s.size;
      partial = absl::StrFormat("%s=%s is set but %s is not", set, EnvText(set),
                                rank != EnvInt::kUnset ? s.size : s.rank);
    }
  }
  if (!partial.empty()) {
    return InvalidArgument("launcher environment incomplete: %s (looked for "
                           "OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE, SLURM_PROCID/NTASKS and "
                           "RANK/WORLD_SIZE)", partial);
  }
  return absl::NotFoundError(
      "no launcher environment found (OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE, "
      "SLURM_PROCID/NTASKS or RANK/WORLD_SIZE): start the processes with an MPI launcher "
      "(mpirun, srun)");
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
  if (!trace.empty()) {
    // Rank 0 alone checks the path: a failure here is a warning, since the others made their
    // communicator already.
    const absl::Status traced = comm->SetTracePath(trace);
    if (!traced.ok()) MOONEP_WARN("MOONEP_TRACE: %s", traced.message());
  }
  MOONEP_INFO("communicator: rank %d of %d", rank, size);
  return comm;
}

absl::StatusOr<MPI_Comm> Communicator::CreationAgreement(MPI_Comm parent, const char* parent_name,
                                                        absl::Span<const char> bytes,
                                                        std::string* out, const char* phase,
                                                        int64_t timeout_ms) {
  MOONEP_ASSIGN_OR_RETURN(MPI_Comm dup, IdupWithDeadline(parent, parent_name, timeout_ms, phase));
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(dup, &rank);
  MPI_Comm_size(dup, &size);
  std::vector<std::unique_ptr<Exchange>> parked;
  const absl::Status status = Agree(dup, rank, size, bytes, out, phase, timeout_ms, &parked);
  // Buffers MPI may still use (a late peer's messages, an unmatched send): kept for good, like
  // `dup` itself after a failure (left allocated: peers may still send to it).
  for (auto& exchange : parked) (void)exchange.release();
  MOONEP_RETURN_IF_ERROR(status);
  return dup;
}

template <typename T>
absl::StatusOr<MPI_Comm> Communicator::AgreeOnRecords(MPI_Comm parent, const char* parent_name,
                                                      const T& mine, std::vector<T>* all,
                                                      const char* phase, int64_t timeout_ms) {
  static_assert(std::is_trivially_copyable<T>::value, "records travel as bytes");
  std::string gathered;
  MOONEP_ASSIGN_OR_RETURN(
      MPI_Comm dup,
      CreationAgreement(parent, parent_name,
                        absl::Span<const char>(reinterpret_cast<const char*>(&mine), sizeof(mine)),
                        &gathered, phase, timeout_ms));
  all->resize(gathered.size() / sizeof(T));
  std::memcpy(all->data(), gathered.data(), all->size() * sizeof(T));
  return dup;
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::AdoptGroup(
    MPI_Comm world, const absl::Status& verdict, const std::vector<int>& by_rank) {
  if (!verdict.ok()) {
    MPI_Comm_free(&world);
    return verdict;
  }
  absl::StatusOr<MPI_Comm> made = CreateGroup(world, by_rank);
  MPI_Comm_free(&world);
  if (!made.ok()) return made.status();
  return Adopt(*made);
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::FromMpi(MPI_Comm comm) {
  MOONEP_RETURN_IF_ERROR(EnsureMpi());
  if (comm == MPI_COMM_NULL) return InvalidArgument("comm is MPI_COMM_NULL");
  // An intercommunicator's ranks name the other group's processes: the agreement below would
  // pair each rank with a process of the other group, and the transports' node split crashed in
  // MPI_Comm_split_type. Every member gets the same answer, so no agreement is needed first.
  int inter = 0;
  if (const int rc = MPI_Comm_test_inter(comm, &inter); rc != MPI_SUCCESS) {
    return InvalidArgument("comm is not a valid MPI communicator (MPI_Comm_test_inter: error %d)",
                           rc);
  }
  if (inter) {
    return InvalidArgument("comm is an MPI intercommunicator; MoonEP needs an intracommunicator "
                           "(merge the two groups with MPI_Intercomm_merge)");
  }
  const CreationTimeout timeout = ReadCreationTimeout();
  constexpr const char* kPhase = "communicator creation (moonepCommInitMpi)";
  // Every rank of `comm` calls the duplication; the agreement on the duplicate (which MoonEP owns,
  // so its point-to-point messages are private) makes a rank that gave up fail the others, and a
  // rank that joins after the others gave up fail too, instead of going on alone.
  const absl::Status local =
      timeout.status.ok() ? absl::OkStatus() : Annotate(timeout.status, kPhase);
  std::vector<LocalError> all;
  MOONEP_ASSIGN_OR_RETURN(MPI_Comm dup, AgreeOnRecords(comm, "the caller's communicator",
                                                       Carry(local), &all, kPhase, timeout.ms));
  const int size = static_cast<int>(all.size());
  absl::Status verdict = local;
  for (int r = 0; r < size && verdict.ok(); ++r) {
    if (all[r].failed) verdict = RemoteError("%s: rank %d failed: %s", kPhase, r, Quote(all[r]));
  }
  if (!verdict.ok()) {
    MPI_Comm_free(&dup);
    return verdict;
  }
  return Adopt(dup);
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::FromUniqueId(const UniqueId& id,
                                                                         int32_t size,
                                                                         int32_t rank) {
  MOONEP_RETURN_IF_ERROR(EnsureMpi());
  constexpr const char* kPhase = "communicator creation (moonepCommInitRank)";
  const CreationTimeout timeout = ReadCreationTimeout();
  // Local checks must not skip the agreement below, or the other processes would wait for this
  // one until their timeout; a bad argument is carried through it and reported by everyone.
  struct Member {
    char id[kUniqueIdBytes];
    int32_t rank, size;
    LocalError error;
  } mine{};
  std::memcpy(mine.id, id.bytes, sizeof(mine.id));
  mine.rank = rank;
  mine.size = size;
  absl::Status local = absl::OkStatus();
  if (std::memcmp(id.bytes, kIdMagic, sizeof(kIdMagic)) != 0) {
    local = InvalidArgument("id was not made by moonepGetUniqueId (bad magic)");
  } else if (size <= 0) {
    local = InvalidArgument("nranks is %d; must be positive", size);
  } else if (rank < 0 || rank >= size) {
    local = InvalidArgument("rank is %d; must be in [0, nranks = %d)", rank, size);
  } else if (!timeout.status.ok()) {
    local = Annotate(timeout.status, kPhase);
  }
  mine.error = Carry(local);
  // A private duplicate of MPI_COMM_WORLD: every process of it takes part in the agreement, which
  // names the processes not heard from; then only the processes that passed this id make the
  // communicator, together.
  std::vector<Member> all;
  MOONEP_ASSIGN_OR_RETURN(MPI_Comm world, AgreeOnRecords(MPI_COMM_WORLD, "MPI_COMM_WORLD", mine,
                                                         &all, kPhase, timeout.ms));
  const int world_size = static_cast<int>(all.size());
  // Every member checks the same gathered data, so all reach the same verdict.
  std::vector<int> group;  // world ranks that passed this id
  for (int w = 0; w < world_size; ++w) {
    if (std::memcmp(all[w].id, id.bytes, kUniqueIdBytes) == 0) group.push_back(w);
  }
  const int got_size = static_cast<int>(group.size());
  absl::Status verdict = local;
  for (int w : group) {
    if (!verdict.ok()) break;
    if (all[w].error.failed) {
      verdict = RemoteError("%s: the process of MPI_COMM_WORLD rank %d, which passed the same id, "
                            "failed: %s", kPhase, w, Quote(all[w].error));
    } else if (all[w].size != got_size) {
      verdict = InvalidArgument(
          "%d processes called moonepCommInitRank with this id, but the process with rank %d "
          "passed nranks = %d", got_size, all[w].rank, all[w].size);
    }
  }
  std::vector<int> by_rank(static_cast<size_t>(got_size), -1);  // world rank of each rank
  for (int w : group) {
    if (!verdict.ok()) break;
    int& slot = by_rank[static_cast<size_t>(all[w].rank)];
    if (slot >= 0) {
      verdict = InvalidArgument("ranks passed with this id are not 0..%d exactly once (rank %d is "
                                "given twice, by the processes of MPI_COMM_WORLD ranks %d and %d)",
                                got_size - 1, all[w].rank, slot, w);
    }
    slot = w;
  }
  return AdoptGroup(world, verdict, by_rank);
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::FromEnvironment() {
  absl::StatusOr<LaunchInfo> info = ReadLaunchInfo();
  // No launcher variable at all: not started by a launcher, so no peer waits for this process.
  // It is a misuse (no launcher) like a size that is not MPI_COMM_WORLD's: InvalidUsage for both.
  if (absl::IsNotFound(info.status())) return InvalidUsage("%s", info.status().message());
  MOONEP_RETURN_IF_ERROR(EnsureMpi());
  constexpr const char* kPhase = "communicator creation (moonepCommInitFromEnv)";
  const CreationTimeout timeout = ReadCreationTimeout();
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  struct Member {
    int32_t rank = -1;
    LocalError error;
  } mine;
  absl::Status local = absl::OkStatus();
  if (!info.ok()) {
    local = info.status();
  } else if (info->size != world_size) {
    local = InvalidUsage(
        "%s: %s=%d and %s=%d, but MPI_COMM_WORLD has %d process(es). The communicator is made "
        "out of MPI_COMM_WORLD, so every rank must be started by an MPI launcher (mpirun, or "
        "srun with PMI/PMIx) that puts them all in it; a launcher without MPI (e.g. plain "
        "torchrun) leaves each process alone in its own MPI_COMM_WORLD",
        kPhase, info->rank_var, info->rank, info->size_var, info->size, world_size);
  } else if (!timeout.status.ok()) {
    local = Annotate(timeout.status, kPhase);
  } else {
    mine.rank = info->rank;
  }
  mine.error = Carry(local);
  std::vector<Member> all;
  MOONEP_ASSIGN_OR_RETURN(MPI_Comm world, AgreeOnRecords(MPI_COMM_WORLD, "MPI_COMM_WORLD", mine,
                                                         &all, kPhase, timeout.ms));
  absl::Status verdict = local;
  for (int w = 0; w < world_size && verdict.ok(); ++w) {
    if (all[w].error.failed) {
      verdict = RemoteError("%s: the process of MPI_COMM_WORLD rank %d failed: %s", kPhase, w,
                            Quote(all[w].error));
    }
  }
  // Every rank's launcher rank is below world_size (its own checks); each must appear once.
  std::vector<int> by_rank(static_cast<size_t>(world_size), -1);
  for (int w = 0; w < world_size && verdict.ok(); ++w) {
    int& slot = by_rank[static_cast<size_t>(all[w].rank)];
    if (slot >= 0) {
      verdict = InvalidArgument(
          "%s: the launcher environment (%s) gives rank %d to two processes, MPI_COMM_WORLD ranks "
          "%d and %d; each rank 0..%d must be given exactly once", kPhase, info->source,
          all[w].rank, slot, w, world_size - 1);
    }
    slot = w;
  }
  return AdoptGroup(world, verdict, by_rank);
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

namespace {
auto ReplicaKey(int32_t slots, int64_t hidden, int64_t intermediate, DType dtype,
                DType grad_dtype, Device device) {
  return std::make_tuple(slots, hidden, intermediate, static_cast<int32_t>(dtype),
                         static_cast<int32_t>(grad_dtype), static_cast<int32_t>(device));
}
}  // namespace

bool Communicator::HasReplicas(int32_t slots, int64_t hidden, int64_t intermediate, DType dtype,
                               DType grad_dtype, Device device) const {
  return replicas_.count(ReplicaKey(slots, hidden, intermediate, dtype, grad_dtype, device)) > 0;
}

absl::StatusOr<SharedReplicas*> Communicator::Replicas(int32_t slots, int64_t hidden,
                                                       int64_t intermediate, DType dtype,
                                                       DType grad_dtype, Device device,
                                                       bool* created) {
  auto key = ReplicaKey(slots, hidden, intermediate, dtype, grad_dtype, device);
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
  if (path.empty() || rank_ != 0) return absl::OkStatus();
  // The file opens at the first forward; a path that cannot be written at all (no such directory,
  // no permission) is said now, to the caller that gave it, rather than as a warning later.
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const bool writable = ::access(path.c_str(), F_OK) == 0 ? ::access(path.c_str(), W_OK) == 0
                                                          : ::access(dir.c_str(), W_OK | X_OK) == 0;
  if (!writable) {
    return SystemError("routing trace: cannot write %s: %s (tracing stays off)", path,
                       std::strerror(errno));
  }
  trace_ = std::make_unique<TraceWriter>(path);
  return absl::OkStatus();
}

absl::Status Communicator::Allgather(absl::Span<const char> bytes, std::string* out,
                                     const char* phase) {
  if (!broken_.ok()) {
    return InvalidUsage("%s: an earlier agreement on this communicator failed (%s); destroy it",
                        phase, broken_.message());
  }
  absl::Status status = Agree(comm_, rank_, size_, bytes, out, phase, param::TimeoutMs(), &parked_);
  if (!status.ok()) broken_ = status;
  return status;
}

absl::Status Communicator::Agree(MPI_Comm comm, int rank, int size,
                                 absl::Span<const char> bytes, std::string* out, const char* phase,
                                 int64_t timeout_ms,
                                 std::vector<std::unique_ptr<Exchange>>* parked) {
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
  ex->recv.assign(bytes.size() * static_cast<size_t>(size), '\0');
  std::memcpy(ex->recv.data() + static_cast<size_t>(rank) * n, bytes.data(), bytes.size());
  ex->confirm.assign(static_cast<size_t>(size) + 1, 0);  // [r]: from rank r; [size]: to send
  std::vector<int> peers;
  for (int r = 0; r < size; ++r) {
    if (r != rank) peers.push_back(r);
  }
  const size_t P = peers.size();
  std::vector<MPI_Status> status(2 * P);
  std::vector<int> indices(2 * P);
  // Fails the agreement: open receives cancelled, "gave up" sent to every peer, the buffers
  // parked (MPI may still use them).
  auto give_up = [&](absl::Status why) {
    for (size_t i = 0; i < P; ++i) {
      if (ex->requests[i] == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&ex->requests[i]);
      MPI_Request_free(&ex->requests[i]);
    }
    for (int r : peers) {
      MPI_Request notice = MPI_REQUEST_NULL;
      if (MPI_Isend(&ex->confirm[static_cast<size_t>(size)], 1, MPI_BYTE, r, kGaveUpTag, comm,
                    &notice) == MPI_SUCCESS) {
        MPI_Request_free(&notice);
      }
    }
    parked->push_back(std::move(ex));
    return why;
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
        std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
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
  ex->confirm_tag.assign(P, 0);
  absl::StatusOr<std::vector<int>> missing = round(
      [&](int r, MPI_Request* q) {
        return MPI_Irecv(ex->recv.data() + static_cast<size_t>(r) * n, n, MPI_BYTE, r, kDataTag,
                         comm, q);
      },
      [&](int r, MPI_Request* q) {
        return MPI_Isend(ex->send.data(), n, MPI_BYTE, r, kDataTag, comm, q);
      },
      phase);
  if (!missing.ok()) return give_up(missing.status());
  if (!missing->empty()) {
    return give_up(Timeout("%s timed out after MOONEP_TIMEOUT_MS = %d ms on rank %d: nothing "
                           "heard from rank(s) %s", phase, timeout_ms, rank,
                           RankList(*missing)));
  }
  // Confirmation: the receive from each peer takes its confirmation or its "gave up".
  missing = round(
      [&](int r, MPI_Request* q) {
        return MPI_Irecv(&ex->confirm[static_cast<size_t>(r)], 1, MPI_BYTE, r, MPI_ANY_TAG, comm, q);
      },
      [&](int r, MPI_Request* q) {
        return MPI_Isend(&ex->confirm[static_cast<size_t>(size)], 1, MPI_BYTE, r, kConfirmTag,
                         comm, q);
      },
      phase);
  if (!missing.ok()) return give_up(missing.status());
  if (!missing->empty()) {
    return give_up(Timeout("%s timed out after MOONEP_TIMEOUT_MS = %d ms on rank %d: no "
                           "confirmation from rank(s) %s", phase, timeout_ms, rank,
                           RankList(*missing)));
  }
  std::vector<int> gave_up;
  for (size_t i = 0; i < P; ++i) {
    if (ex->confirm_tag[i] == kGaveUpTag) gave_up.push_back(peers[i]);
  }
  absl::Status result = absl::OkStatus();
  if (!gave_up.empty()) {
    result = RemoteError("%s: rank(s) %s gave up waiting (MOONEP_TIMEOUT_MS) and failed", phase,
                         RankList(gave_up));
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
  if (open) parked->push_back(std::move(ex));
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

absl::Status Communicator::CheckTransportDevice(const std::string& backend) const {
#ifdef MOONEP_HAVE_NCCL
  if (backend != "nccl" || nccl_comms_ == nullptr) return absl::OkStatus();
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
#else
  (void)backend;
#endif
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<transport::Transport>> Communicator::MakeTransport(
    const std::string& backend, const transport::TransportOptions& options) {
#ifdef MOONEP_HAVE_NCCL
  if (backend == "nccl") {
    if (nccl_comms_ == nullptr) {
      MOONEP_RETURN_IF_ERROR(caller_nccl_stopped_);
      transport::nccl::NcclBootstrap b;
      if (caller_nccl_comm_ != nullptr) {
        b.kind = transport::nccl::NcclBootstrap::Kind::kWrap;
        b.comm = static_cast<ncclComm_t>(caller_nccl_comm_);
      }
      auto made = transport::nccl::CreateNcclComms(options, b);
      if (!made.ok()) {
        // A failed creation that revoked (or aborted) the caller's communicator: a retry must not
        // touch it again.
        if (made.status().GetPayload(transport::nccl::kCallersCommStopped).has_value()) {
          caller_nccl_stopped_ = InvalidUsage(
              "the NCCL communicator given to moonepCommSetNcclComm was stopped by an earlier "
              "failed creation of this communicator's NCCL communicators (%s): make a new MoonEP "
              "communicator (and NCCL communicator)", made.status().message());
        }
        return made.status();
      }
      nccl_comms_ = std::move(*made);
    }
    MOONEP_RETURN_IF_ERROR(CheckTransportDevice(backend));
    return transport::nccl::CreateNcclTransport(options, nccl_comms_);
  }
#endif
  return transport::CreateTransport(backend, options);
}

}  // namespace moonep::runtime
