/*
 * MoonEP C API, levels 2 and 3: communicators, the EP buffer (dispatch / combine / prefetch /
 * reduce on caller tensors) and the MoE layer (forward / backward with the built-in executor).
 * Level 1 (planner only) is in moonep.h. C99; compiles as C and C++.
 *
 * Conventions
 *   - Every call returns a moonepResult_t. On failure, moonepGetLastThreadError() and
 *     moonepGetLastError(comm) give a message that names the argument or the phase and peer.
 *   - Objects are opaque handles. A handle that was destroyed (or never created) is refused with
 *     moonepInvalidUsage, never dereferenced, as long as its address was not reused: a later
 *     object may get the address of a destroyed one, and a stale handle then names that object.
 *     Layer and EP handles (of a forward / dispatch) are values new for every call, never reused
 *     in the process: a released one is always refused with moonepInvalidUsage. Do not keep
 *     handles past destroy or release.
 *   - Config structs carry their own size and version. Initialise them with their
 *     ..._INITIALIZER macro, then set fields: a library newer than the header reads only `size`
 *     bytes and uses defaults for the rest.
 *   - Tensors are row-major and contiguous, of the layer dtype unless said otherwise, in host
 *     memory for moonepDeviceCpu and in the GPU memory of config->device_index for
 *     moonepDeviceCuda (MoE layer and EP buffer; the EP buffer's calls order themselves after the
 *     legacy default stream). Top-k ids are int32 (-1: no expert), top-k weights fp32.
 *   - Collective calls (marked [collective]) must be called by every rank of the communicator, in
 *     the same order, on the handles of the same forward / dispatch. Over mpi and ucx, a rank
 *     that makes another call than its peers at one point (two backwards in another order, a
 *     combine where they dispatch-backward) fails with moonepInvalidUsage naming both calls, its
 *     peers with moonepRemoteError; over nccl that is not detected, and handles of different
 *     dispatches where the row counts agree are detected over mpi and ucx, in the row calls
 *     (over mpi for dispatches less than 16 apart); where not detected (nccl, mpi 16 apart,
 *     prefetch and reduce, which take no handle) they compute on the wrong rows. A
 *     bad argument on one rank fails that call on every rank: the others get
 *     moonepRemoteError naming it, at once (over nccl, after a call that begins with an exchange
 *     - creation, forward, dispatch - only; its other calls' peers fail with moonepTimeout after
 *     MOONEP_TIMEOUT_MS). A rank that times out tells its peers too (mpi, ucx): a late rank's
 *     next call fails at once with moonepRemoteError ("rank 0 gave up waiting in ...").
 *
 * Thread safety: MoonEP objects are not thread-safe, but the library is reentrant: distinct
 * communicators (and the layers and buffers made on them) may be used concurrently from distinct
 * threads when MPI provides MPI_THREAD_MULTIPLE (initialise MPI with it before the first MoonEP
 * call; MoonEP itself initialises MPI_THREAD_SERIALIZED: then use MoonEP from one thread at a time);
 * one communicator and its objects (two layers of it included: they share its replica buffers)
 * must not be used by two threads at once. Creation calls over the same parent communicator
 * (MPI_COMM_WORLD for moonepCommInitRank and moonepCommInitFromEnv) are collectives over it: make
 * them from one thread at a time, in the same order on every process. The moonepGetUniqueId,
 * moonepGetVersion and moonepGetErrorString calls may be made from any thread.
 *
 * Backends: transports mpi, ucx (host memory) and nccl (GPU memory). Every communicator is built
 * on MPI (mpirun, srun): moonepCommInitRank and moonepCommInitFromEnv build it out of
 * MPI_COMM_WORLD, and the UCX and NCCL transports bootstrap over it. When MoonEP initialises MPI
 * itself it finalizes it when its last communicator is destroyed (that moonepCommDestroy then
 * waits in MPI_Finalize for every process of the job, and no communicator can be made after it:
 * MPI cannot be initialised twice), or at process exit when no communicator is live (a creation
 * that failed). A caller
 * that initialises MPI itself destroys MoonEP's objects before its MPI_Finalize: calls after it
 * return moonepInvalidUsage ("MPI was finalized") and leave the objects' MPI resources as they
 * are.
 */
#ifndef MOONEP_RUNTIME_H_
#define MOONEP_RUNTIME_H_

#include "moonep.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOONEP_CONFIG_MAGIC 0x4d4f4f4eu /* "MOON" */

typedef enum { moonepFloat32 = 0, moonepBFloat16 = 1 } moonepDataType_t;
typedef enum { moonepDeviceCpu = 0, moonepDeviceCuda = 1 } moonepDevice_t;

/* ---------------------------------------------------------------------------------------------
 * Communicators
 * ------------------------------------------------------------------------------------------- */

typedef struct moonepComm* moonepComm_t;

#define MOONEP_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[MOONEP_UNIQUE_ID_BYTES];
} moonepUniqueId;

/* A fresh id. Rank 0 calls it and passes the bytes to the other ranks out of band (e.g. a
 * broadcast over the trainer's own process group). */
MOONEP_API moonepResult_t moonepGetUniqueId(moonepUniqueId* unique_id);

/* [collective over MPI_COMM_WORLD] Every process of MPI_COMM_WORLD calls this at once; the
 * processes that pass the same id form one communicator of `nranks` ranks ordered by `rank`.
 * Fails on every member when the ranks are not 0..nranks-1 exactly once. */
MOONEP_API moonepResult_t moonepCommInitRank(moonepComm_t* comm, int nranks,
                                             moonepUniqueId unique_id, int rank);

/* [collective over mpi_comm] From an existing MPI intracommunicator, which MoonEP duplicates.
 * `mpi_comm` points to an MPI_Comm (so this header needs no mpi.h): pass &comm. MPI_COMM_NULL and
 * intercommunicators are refused (moonepInvalidArgument; merge an intercommunicator's groups with
 * MPI_Intercomm_merge first). */
MOONEP_API moonepResult_t moonepCommInitMpi(moonepComm_t* comm, const void* mpi_comm);

/* [collective over MPI_COMM_WORLD] Finds this process's place from the launcher's environment:
 * OMPI_COMM_WORLD_RANK/SIZE (mpirun), PMI_RANK/SIZE, SLURM_PROCID/NTASKS (srun), or torchrun's
 * RANK/WORLD_SIZE (the first pair set; local ranks are not read), and orders MPI_COMM_WORLD by
 * that rank. A malformed variable: moonepInvalidArgument naming it (the other ranks:
 * moonepRemoteError); a rank given twice: moonepInvalidArgument; no launcher variable at all, or
 * a size that is not MPI_COMM_WORLD's (no MPI launcher): moonepInvalidUsage.
 *
 * Every communicator creation waits at most MOONEP_TIMEOUT_MS for the other ranks, then fails
 * with moonepTimeout naming the phase; a rank that calls it after the others gave up fails too.
 * The parent communicator then has the creation's collective outstanding: the late ranks must
 * still make the call. */
MOONEP_API moonepResult_t moonepCommInitFromEnv(moonepComm_t* comm);

/* Local. The trainer's own NCCL communicator (an ncclComm_t, passed as void* so this header needs
 * no nccl.h) carries the token rows of every device layer and EP buffer made on `comm`
 * afterwards; MoonEP adds one communicator of its own for replica weights and gradients, made
 * once per `comm` (not per layer). The NCCL communicator must have the same size as `comm` and
 * the same rank on every member; MoonEP never destroys it. A failure that makes a device layer
 * unusable (a peer timed out, an NCCL error, a local error once work was posted) revokes it
 * (ncclCommRevoke: its operations in flight stop, so no NCCL kernel blocks the caller's stream;
 * the error message says so); the caller then destroys it (ncclCommDestroy) or shrinks it. Only
 * with a libnccl that has no ncclCommRevoke (2.28.3 has none, 2.28.9 has it) is it aborted
 * (freed) instead, and the message says that: then it must not be used or destroyed. A failed
 * creation that stopped it makes later device layers on `comm` fail (moonepInvalidUsage). Make
 * it non-blocking (ncclConfig_t blocking = 0) for every wait on it to end at MOONEP_TIMEOUT_MS:
 * on a blocking one NCCL itself may wait without a deadline for a peer that never comes.
 * Call before the first device layer or buffer (moonepInvalidUsage afterwards);
 * moonepInvalidArgument for NULL or a mismatched communicator; moonepUnavailable when MoonEP was
 * built without NCCL. Without this call, device layers share one
 * NCCL communicator pair that MoonEP makes over `comm` at the first device layer. Call it on every
 * rank of `comm` or on none: the first device layer or buffer checks, and fails on every rank
 * naming the ranks that differ (moonepInvalidArgument). */
MOONEP_API moonepResult_t moonepCommSetNcclComm(moonepComm_t comm, void* nccl_comm);

/* Local. Layers and buffers made on the communicator must be destroyed first (refused
 * otherwise with moonepInvalidUsage). */
MOONEP_API moonepResult_t moonepCommDestroy(moonepComm_t comm);
MOONEP_API moonepResult_t moonepCommRank(moonepComm_t comm, int* rank);
MOONEP_API moonepResult_t moonepCommSize(moonepComm_t comm, int* size);

/* The message of the last failing call on this communicator or an object made on it (empty when
 * none): unlike moonepGetLastThreadError it stays after later successful calls, until the next
 * failure replaces it. Valid until the next MoonEP call on them. Returns a static message for an invalid
 * handle; never NULL. */
MOONEP_API const char* moonepGetLastError(moonepComm_t comm);

/* Routing traces: rank 0 appends each forward's counts[R][E] per layer to `path` in the format
 * of docs/trace-format.md (which `moonep-sim --trace` replays). NULL or "" turns tracing off.
 * MOONEP_TRACE=path does the same for every communicator at creation. Local. On rank 0, a path
 * that cannot be written (no such directory, no permission) is moonepSystemError and tracing stays
 * off (MOONEP_TRACE: a warning); an error when the file is opened or written later turns tracing
 * off with a warning, and the steps go on. */
MOONEP_API moonepResult_t moonepCommSetTrace(moonepComm_t comm, const char* path);

/* ---------------------------------------------------------------------------------------------
 * Per-step statistics (levels 2 and 3)
 * ------------------------------------------------------------------------------------------- */

typedef enum {
  moonepPhaseCounts = 0,          /* routing check + counts allgather */
  moonepPhasePlan = 1,            /* planner */
  moonepPhaseDispatch = 2,        /* token rows to their compute ranks */
  moonepPhaseComputeHome = 3,     /* executor, home experts */
  moonepPhasePrefetchWait = 4,    /* waiting for replica weights after the home experts */
  moonepPhaseComputeReplica = 5,  /* executor, replica experts */
  moonepPhaseCombine = 6,         /* expert outputs back, weighted sum */
  moonepPhaseBackwardDispatch = 7,/* dy rows to the compute ranks */
  moonepPhaseTopkGrad = 8,        /* d topk_weights */
  moonepPhaseBackwardCompute = 9, /* executor backward */
  moonepPhaseBackwardCombine = 10,/* dx rows back */
  moonepPhaseReduce = 11,         /* replica gradients into the home experts */
  moonepNumPhases = 12
} moonepPhase_t;

typedef enum {
  moonepOpCounts = 0,
  moonepOpDispatch = 1,
  moonepOpCombine = 2,
  moonepOpCombineBackward = 3,
  moonepOpDispatchBackward = 4,
  moonepOpTopkWeightGrad = 5,
  moonepOpPrefetch = 6,
  moonepOpReduce = 7,
  moonepNumOps = 8
} moonepOp_t;

typedef struct {
  size_t size;           /* set by the caller: sizeof(moonepStepStats_t) */
  unsigned int magic;
  unsigned int version;
  /* The plan of the last forward (global, identical on every rank). */
  int64_t step;              /* forwards made so far */
  int64_t tokens;            /* this rank's tokens in the last forward */
  int64_t total_tokens;      /* routed (token, expert) pairs over all ranks */
  int64_t max_load_before;   /* largest rank load with home placement only */
  int64_t max_load_after;    /* largest rank load with the plan */
  double mean_load;          /* total_tokens / ranks */
  int replicas;              /* replica slots in use over all ranks */
  int64_t rows_computed;     /* rows this rank's executor computed (no padding) */
  /* This rank's traffic per operation (moonepOp_t), last forward and last backward. */
  int64_t rows_sent[moonepNumOps];
  int64_t bytes_sent[moonepNumOps];
  int64_t bytes_received[moonepNumOps];
  /* This rank's time per phase (moonepPhase_t), milliseconds. */
  double time_ms[moonepNumPhases];
  double forward_ms, backward_ms;
} moonepStepStats_t;

#define MOONEP_STEP_STATS_INITIALIZER \
  { sizeof(moonepStepStats_t), MOONEP_CONFIG_MAGIC, MOONEP_VERSION, 0, 0, 0, 0, 0, 0.0, 0, 0, \
    {0}, {0}, {0}, {0}, 0.0, 0.0 }

/* Expert parameters (or their gradients) of `num_experts` experts stored back to back:
 * gate [E][H][I], up [E][H][I], down [E][I][H]. */
typedef struct {
  void* gate;
  void* up;
  void* down;
  moonepDataType_t dtype;
} moonepExpertTensors_t;

/* ---------------------------------------------------------------------------------------------
 * Level 3: the MoE layer
 * ------------------------------------------------------------------------------------------- */

typedef struct moonepLayer* moonepLayer_t;
/* One forward's saved state, consumed by moonepLayerBackward or moonepLayerRelease. */
typedef struct moonepLayerHandle* moonepLayerHandle_t;

typedef struct {
  size_t size;             /* sizeof(moonepLayerConfig_t) */
  unsigned int magic;      /* MOONEP_CONFIG_MAGIC */
  unsigned int version;    /* MOONEP_VERSION */
  int num_experts;         /* E, a multiple of the number of ranks, at most 2^20; rank r holds
                              experts r*E/R .. (r+1)*E/R - 1 */
  int top_k;               /* K */
  int64_t hidden;          /* H */
  int64_t intermediate;    /* I; the expert FFN is (silu(x Wg) * (x Wu)) Wd */
  moonepDataType_t dtype;  /* x, y, weights */
  moonepDataType_t grad_dtype; /* weight gradients: fp32 or dtype */
  int slots;               /* replica slots per rank, >= 1 (policy none fills none); -1: E / R */
  int pad_multiple;        /* rows of each expert group padded to a multiple of this */
  moonepPlannerPolicy_t policy; /* moonepPolicyMoonEP by default (see moonep.h) */
  moonepDevice_t device;   /* moonepDeviceCpu, or moonepDeviceCuda (built with CUDA + NCCL):
                              tensors in GPU memory, the CUDA executor, the NCCL transport */
  int device_index;        /* the GPU of this rank (moonepDeviceCuda); made current at creation */
  int64_t max_tokens;      /* largest token count this rank will pass; sizes every buffer */
  int64_t max_recv_rows;   /* rows of this rank's dispatch buffer; 0: the worst case no
                              routing can exceed, (sum of every rank's max_tokens) *
                              min(K, G) + G * (pad_multiple - 1), G = E/R + slots (see
                              docs/runtime.md) */
  int max_inflight;        /* forwards alive at once before their backward (micro-batches),
                              1..1024 */
  int layer_id;            /* id in routing traces; -1: creation order */
  int num_threads;         /* executor threads, at most 1024; 0: MOONEP_NUM_THREADS or every core */
  int ranks_per_node;      /* 0: flat; else topology for the planner */
  int eplb_period;         /* eplb: re-plan every this many steps */
  const char* transport;   /* backend: "mpi", "ucx" where built (host memory), "nccl" (device
                              cuda); NULL: $MOONEP_TRANSPORT, else "nccl" for moonepDeviceCuda
                              and "mpi" for the CPU. Must agree on every rank. Copied. */
  int64_t replica_cost_intra; /* added in 0.2.0: moonep weighs replicas (as in
                                 moonepPlannerConfig_t, tokens); must agree on every rank; a
                                 0.1.0 library ignores both (check moonepGetVersion) */
  int64_t replica_cost_inter;
  int64_t row_cost_intra;     /* added in 0.3.0: moonep weighs the rows a plan moves too (as in
                                 moonepPlannerConfig_t, 1/1024 tokens); must agree on every
                                 rank; a 0.2.0 library ignores both */
  int64_t row_cost_inter;
  const double* speeds;       /* added in 0.5.0: NULL (every rank alike) or [R] relative compute
                                 speeds, finite and > 0, read at creation: the planner balances
                                 time, not tokens (rank d's share of the load proportional to
                                 speeds[d]; replica and row costs in tokens of the fastest rank).
                                 For a slow GPU or a rank that does other work;
                                 moonepMeasureCosts measures them. Policies moonep and
                                 moonep-greedy only (others: moonepInvalidArgument). Must agree
                                 on every rank; a 0.4.0 library ignores it (check
                                 moonepGetVersion) */
} moonepLayerConfig_t;

#define MOONEP_LAYER_CONFIG_INITIALIZER                                                       \
  { sizeof(moonepLayerConfig_t), MOONEP_CONFIG_MAGIC, MOONEP_VERSION, 0, 0, 0, 0, moonepFloat32, \
    moonepFloat32, -1, 1, moonepPolicyMoonEP, moonepDeviceCpu, 0, 0, 0, 1, -1, 0, 0, 1, NULL, 0, 0, \
    0, 0, NULL }

/* [collective] Checks the config and that every rank passed the same one (all fields but
 * max_tokens, max_recv_rows, layer_id, num_threads, device_index): a difference fails on every
 * rank with a message naming the field and the ranks. Sizes every buffer, the transport's staging
 * included: no buffer is allocated during a step. A rank that cannot allocate its buffers fails
 * creation on every rank (moonepOutOfMemory there, moonepRemoteError naming it elsewhere). */
MOONEP_API moonepResult_t moonepLayerCreate(moonepComm_t comm, const moonepLayerConfig_t* config,
                                            moonepLayer_t* layer);
/* [collective] Every rank destroys the layers and EP buffers of a communicator in the same order
 * (e.g. the order it created them, or its reverse, alike on every rank). Outstanding handles are
 * released. The host transports check that every peer is destroying the same layer, within
 * MOONEP_TIMEOUT_MS (mpi) or twice that and 2 s (ucx, which also flushes its endpoints for up to
 * 2 s): when a peer does not get there in time (it failed, hangs, or destroys its layers in
 * another order) the call still frees the layer and returns, after that wait,
 * moonepTimeout with a message naming the layer, the phase ("destruction") and the peers not heard
 * from (also logged as a WARN); that layer's MPI communicators then stay allocated. In every case
 * the layer handle is invalid once the call returns. With the calls out of order, which ranks
 * report it depends on timing (at least one does). */
MOONEP_API moonepResult_t moonepLayerDestroy(moonepLayer_t layer);

/* Local. Binds this rank's E/R home experts' weights and, for training, their gradients (NULL
 * grads: forward only). Weights must have the layer dtype, gradients grad_dtype. MoonEP reads the
 * weights and accumulates (+=) into the gradients in place during forward/backward; the memory
 * stays the caller's and must outlive its use. May be called again to rebind between steps: with
 * a forward handle outstanding it returns moonepInvalidUsage (a step's backward uses the weights
 * its forward saw); a rebinding takes effect at the next forward. */
MOONEP_API moonepResult_t moonepLayerBindParams(moonepLayer_t layer,
                                                const moonepExpertTensors_t* weights,
                                                const moonepExpertTensors_t* grads);

/* [collective] x [num_tokens][H] -> y [num_tokens][H], y[t] = sum_k topk_weights[t][k] *
 * FFN_{topk_ids[t][k]}(x[t]). num_tokens may differ between ranks and steps (<= max_tokens).
 * *handle is needed by backward (or release).
 * stream: for a moonepDeviceCuda layer, the caller's cudaStream_t (NULL: the legacy default
 * stream); every pointer is then memory of the layer's GPU. The layer's work starts after the work
 * queued on `stream`, and the call returns once y is complete in GPU memory. Ignored (pass NULL)
 * for moonepDeviceCpu. */
MOONEP_API moonepResult_t moonepLayerForward(moonepLayer_t layer, int64_t num_tokens,
                                             const void* x, const int32_t* topk_ids,
                                             const float* topk_weights, void* y,
                                             moonepLayerHandle_t* handle, void* stream);
/* [collective] This rank's part of a forward that it refuses: for a caller that found its own
 * input wrong (a binding checking tensor shapes, a framework's failed step) while the peers make
 * the forward. Every rank's forward fails and nothing moves: here moonepInvalidArgument giving
 * `reason` (NULL: "no reason given"; at most its first 1024 bytes are read), on the peers
 * moonepRemoteError naming this rank and, over mpi and ucx, giving "refused by the caller: " and
 * `reason` up to 8 max(num_experts, 32) - 1 bytes in all (the first 232 bytes of `reason` at
 * least; nccl: "their own error says why"). No handle is made and the layer stays usable, as
 * after any refused forward. `stream` as for moonepLayerForward. */
MOONEP_API moonepResult_t moonepLayerRefuseForward(moonepLayer_t layer, const char* reason,
                                                   void* stream);
/* [collective] dy [T][H] -> dx [T][H], d_topk_weights [T][K] (fp32; NULL to skip), and the
 * weight gradients += into the bound gradients (replica gradients reduced in a fixed order, so
 * results are bit-identical run to run). Releases the handle once the backward has run or failed
 * midway; one refused for this rank's arguments leaves it to moonepLayerRelease. `stream` as for
 * forward: the call
 * returns once dx, d_topk_weights and the gradients are complete. A wrong argument on one rank
 * (a NULL, released or foreign handle, NULL dy or dx, overlapping dy and dx, no gradients bound)
 * fails it there naming the argument and, over mpi and ucx, every peer's backward at once with
 * moonepRemoteError (nccl: they time out naming it); the layer is then unusable on every rank,
 * as after any failed collective call (destroy it and create another). */
MOONEP_API moonepResult_t moonepLayerBackward(moonepLayer_t layer, moonepLayerHandle_t handle,
                                              const void* dy, void* dx, float* d_topk_weights,
                                              void* stream);
/* Local. Releases a forward's handle without backward (inference). */
MOONEP_API moonepResult_t moonepLayerRelease(moonepLayer_t layer, moonepLayerHandle_t handle);

/* Local. Statistics of the last forward and backward. stats->size must be set. */
MOONEP_API moonepResult_t moonepLayerGetStats(moonepLayer_t layer, moonepStepStats_t* stats);
/* Local. Bytes allocated by this layer (its rows, scratch, executor workspace and the transport
 * staging of every handle: host memory for mpi and ucx, reserved at creation; GPU and pinned memory
 * for nccl, as allocated by the steps so far; see docs/runtime.md, "Memory"), and by the replica buffers
 * shared by the layers of the communicator (slots * 3 * H * I * (dtype + grad dtype bytes) per
 * layer shape). */
MOONEP_API moonepResult_t moonepLayerGetMemory(moonepLayer_t layer, size_t* layer_bytes,
                                               size_t* shared_replica_bytes);

/* Added in 0.4.0: the cost probe (docs/runtime.md, "Measured costs"). Options; NULL or a zero
 * field: the default. */
typedef struct {
  size_t size;           /* sizeof(moonepCostProbeOptions_t) */
  int64_t compute_rows;  /* rows of the timed expert, at most 2^20; 0: 512 on the CPU, 4096 on
                            a GPU */
  int64_t link_rows;     /* rows each rank sends its partner, at most 2^20; 0: 512 on the CPU,
                            4096 on a GPU (whatever compute_rows is) */
  int repetitions;       /* timed runs of each measurement, at most 1000; 0: 5 */
  int forward_only;      /* nonzero: time the forward only, and count weights, not gradients */
  int64_t transfer_rows; /* rows sent to time one expert's transfer, at most 2^20; 0: as many as
                            hold its bytes (its gradients, or its weights when forward_only), at
                            most 2^20; the time is scaled to the transfer's bytes */
  double* speeds;        /* added in 0.5.0: NULL (not wanted), or an array of R doubles that a
                            successful call fills with each rank's speed relative to the median
                            of the ranks' token times (the median time over the rank's own), the
                            same on every rank: moonepLayerConfig_t.speeds takes them where ranks
                            differ in more than noise (docs/runtime.md, "Ranks of different
                            speeds"). Then multiply the four costs by the largest speed: with
                            speeds the planner counts them in tokens of the fastest rank. */
} moonepCostProbeOptions_t;
/* Every option at its default (0.5.0); set the fields wanted after it. */
#define MOONEP_COST_PROBE_OPTIONS_INITIALIZER \
  { sizeof(moonepCostProbeOptions_t), 0, 0, 0, 0, 0, NULL }
/* The smallest size accepted (0.4.0's struct; later versions only append fields). */
#define MOONEP_COST_PROBE_OPTIONS_MIN_SIZE \
  (offsetof(moonepCostProbeOptions_t, transfer_rows) + sizeof(int64_t))

/* The probe's figures (medians over ranks, the same on every rank) and the costs they give. */
typedef struct {
  size_t size;               /* sizeof(moonepMeasuredCosts_t), set by the caller */
  double token_seconds;      /* one token through one expert (forward + backward unless
                                forward_only) */
  double row_seconds_intra;  /* one row of H values one way inside a node; 0: not measured */
  double row_seconds_inter;  /* across nodes (every link, when flat); 0: not measured */
  int intra_measured, inter_measured;
  int ranks;
  int64_t replica_cost_intra, replica_cost_inter;  /* for moonepLayerConfig_t (tokens) */
  int64_t row_cost_intra, row_cost_inter;          /* (1/1024 tokens) */
  int64_t compute_rows, link_rows;                 /* the rows timed, defaults resolved */
  double transfer_seconds_intra;  /* one expert's transfer one way inside a node; 0: not measured */
  double transfer_seconds_inter;  /* across nodes */
  int64_t transfer_rows;          /* the rows that timed it */
  /* Added in 0.5.0 (a caller's smaller size leaves them unwritten): each rank times its own
   * token; the fastest and the slowest rank's time (token_seconds is the median; each rank's
   * speed goes to options->speeds where set). */
  double token_seconds_fastest;
  double token_seconds_slowest;
} moonepMeasuredCosts_t;
/* The smallest size accepted. min(size, the library's sizeof) bytes are written and size is set to
 * that count, so a newer caller learns which of its fields were filled. */
#define MOONEP_MEASURED_COSTS_MIN_SIZE \
  (offsetof(moonepMeasuredCosts_t, transfer_rows) + sizeof(int64_t))

/* [collective] Measures what a layer of `config` costs on this communicator's ranks and links,
 * for its replica_cost_* and row_cost_* fields: each rank times its executor on one expert of the
 * config's shape, dtype and device, and sends rows of H values to a partner inside its node and
 * one in the next node over the config's transport, all at once; the medians over ranks give the
 * costs (formulas in docs/runtime.md). The config must be one moonepLayerCreate accepts, the same
 * on every rank, and so must the options. Allocates its own buffers (one expert's weights and
 * gradients, 4 x compute_rows rows, an EP buffer of max(link_rows, transfer_rows) rows; host
 * buffers checked against the rank's and the node's memory first) and frees them; touches no
 * layer and writes nothing to the routing trace. A rank whose config or options are bad fails it
 * on every rank (moonepInvalidArgument there, moonepRemoteError naming it elsewhere); a peer that
 * does not join fails it with moonepTimeout naming the phase and the peers. Copy the four costs
 * into the config of the layers it was measured for. */
MOONEP_API moonepResult_t moonepMeasureCosts(moonepComm_t comm, const moonepLayerConfig_t* config,
                                             const moonepCostProbeOptions_t* options,
                                             moonepMeasuredCosts_t* costs);

/* ---------------------------------------------------------------------------------------------
 * Level 2: the EP buffer (DeepEP-style). MoonEP plans and moves rows and expert parameters; the
 * caller computes the experts.
 *
 *   moonepEpDispatch(buf, T, x, ids, w, &h)          counts, plan, rows into the compute layout
 *   moonepEpGetLayout(buf, h, &layout)               rows, per-row weights, groups -> experts
 *   moonepEpPrefetch(buf, h, &home_w, &replica_w)    home weights into replica slots (caller's)
 *   ... caller computes out_rows[layout.num_rows][H] from layout.rows ...
 *   moonepEpCombine(buf, h, out_rows, y)             y[t] = sum_k w[t][k] out(t, k)
 *   backward: moonepEpCombineBackward(buf, h, dy, dy_rows)   dy rows (unweighted)
 *             moonepEpTopkWeightGrad(buf, h, dy_rows, out_rows, d_topk_weights)
 *             moonepEpDispatchBackward(buf, h, dx_rows, dx)   dx[t] = sum_k dx_rows(t, k)
 *             moonepEpReduce(buf, h, &home_grads, &replica_grads)
 *   moonepEpRelease(buf, h)
 *
 * [collective] calls are made by every rank, on the handles of the same dispatch, in the same
 * order (as NCCL's collectives are): a handle of another dispatch on one rank is detected over
 * mpi and ucx in the row calls (over mpi not 16 dispatches apart; not in prefetch and reduce),
 * not over nccl when the row counts match; another call is, over mpi and ucx
 * (moonepInvalidUsage naming both calls, moonepRemoteError on the peers). moonepEpDispatch's
 * local errors are agreed in its count exchange (every rank fails it, the buffer stays usable;
 * over mpi and ucx the peers' message gives the rank's reason). A local error in a later
 * collective call (a NULL pointer, a released handle, expert tensors of the wrong shape) fails
 * the call on this rank and, over mpi
 * and ucx, the same call on every peer at once with moonepRemoteError naming this rank (nccl: the
 * peers time out naming it; a peer whose part of the call completed without this rank fails its
 * next call instead); a peer may still write into the tensors given to a failed call until the
 * EP buffer is destroyed on every rank, so destroy it before freeing them; the EP buffer is
 * unusable afterwards on every rank, as after any failed
 * collective call. Every dispatch returns a new handle value: a released handle is refused
 * with moonepInvalidUsage (which, in a collective call, fails the peers' call too).
 * ------------------------------------------------------------------------------------------- */

typedef struct moonepEpBuffer* moonepEpBuffer_t;
typedef struct moonepEpHandle* moonepEpHandle_t;

/* The EP buffer uses the routing fields of a layer config: num_experts, top_k, hidden,
 * intermediate (for prefetch/reduce; 0 when unused), dtype, grad_dtype, slots, pad_multiple,
 * policy, device, device_index, max_tokens, max_recv_rows, max_inflight, layer_id (its trace),
 * ranks_per_node, eplb_period, transport, replica_cost_intra and replica_cost_inter (0.2.0: its
 * plans weigh replicas as a layer's do), row_cost_intra and row_cost_inter (0.3.0). num_threads is not used (no executor), but is checked
 * like a layer's. Tensors are host memory for moonepDeviceCpu and GPU memory of device_index for
 * moonepDeviceCuda. */
typedef moonepLayerConfig_t moonepEpBufferConfig_t;
#define MOONEP_EP_BUFFER_CONFIG_INITIALIZER MOONEP_LAYER_CONFIG_INITIALIZER

/* This rank's compute layout after a dispatch. Pointers are MoonEP's and valid until the handle
 * is released. */
typedef struct {
  int64_t num_rows;           /* rows of the layout (padding included) */
  const void* rows;           /* [num_rows][H] dispatched x rows; padding rows are zero */
  const float* row_weights;   /* [num_rows] top-k weight of each row (0 on padding) */
  int num_groups;             /* E/R home groups, then `slots` replica groups */
  const int32_t* group_expert;/* [num_groups] expert of each group, -1 for an unused slot */
  const int64_t* group_offset;/* [num_groups] first row */
  const int64_t* group_count; /* [num_groups] rows holding tokens */
} moonepEpLayout_t;

/* [collective] Like moonepLayerCreate: every buffer is allocated here, the transport staging
 * included over mpi and ucx; over nccl the staging grows over the first dispatches
 * (docs/runtime.md, "Memory"). */
MOONEP_API moonepResult_t moonepEpBufferCreate(moonepComm_t comm,
                                               const moonepEpBufferConfig_t* config,
                                               moonepEpBuffer_t* buffer);
/* [collective] Like moonepLayerDestroy: in the same order on every rank; moonepTimeout naming the
 * buffer, the phase and the peers when a peer does not get there in time (the buffer is freed
 * either way). */
MOONEP_API moonepResult_t moonepEpBufferDestroy(moonepEpBuffer_t buffer);

/* [collective] */
MOONEP_API moonepResult_t moonepEpDispatch(moonepEpBuffer_t buffer, int64_t num_tokens,
                                           const void* x, const int32_t* topk_ids,
                                           const float* topk_weights, moonepEpHandle_t* handle);
/* [collective] This rank's part of a dispatch that it refuses, as moonepLayerRefuseForward: every
 * rank's dispatch fails (moonepInvalidArgument giving `reason` here, moonepRemoteError naming
 * this rank and, over mpi and ucx, giving `reason` on the peers); the buffer stays usable. */
MOONEP_API moonepResult_t moonepEpRefuseDispatch(moonepEpBuffer_t buffer, const char* reason);
/* Local. */
MOONEP_API moonepResult_t moonepEpGetLayout(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                                            moonepEpLayout_t* layout);
/* [collective] out_rows: [layout.num_rows][H] caller's expert outputs; y: [T][H]. */
MOONEP_API moonepResult_t moonepEpCombine(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                                          const void* out_rows, void* y);
/* [collective] dy [T][H] -> dy_rows [layout.num_rows][H] (caller's), unweighted. */
MOONEP_API moonepResult_t moonepEpCombineBackward(moonepEpBuffer_t buffer,
                                                  moonepEpHandle_t handle, const void* dy,
                                                  void* dy_rows);
/* [collective] d_topk_weights[t][k] = <dy[t], out(t, k)> (fp32 [T][K]). */
MOONEP_API moonepResult_t moonepEpTopkWeightGrad(moonepEpBuffer_t buffer,
                                                 moonepEpHandle_t handle, const void* dy_rows,
                                                 const void* out_rows, float* d_topk_weights);
/* [collective] dx_rows [layout.num_rows][H] -> dx [T][H], dx[t] = sum_k dx_rows(t, k). */
MOONEP_API moonepResult_t moonepEpDispatchBackward(moonepEpBuffer_t buffer,
                                                   moonepEpHandle_t handle, const void* dx_rows,
                                                   void* dx);
/* [collective] The home weights (E/R experts, layer dtype) of each replicated expert into the
 * caller's replica slots (`slots` experts, same layout), as the handle's plan says. */
MOONEP_API moonepResult_t moonepEpPrefetch(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                                           const moonepExpertTensors_t* home_weights,
                                           const moonepExpertTensors_t* replica_weights);
/* [collective] Each replica slot's gradients added into its home expert's gradients (fixed
 * order: home + lowest rank first, fp32). Both of grad_dtype. */
MOONEP_API moonepResult_t moonepEpReduce(moonepEpBuffer_t buffer, moonepEpHandle_t handle,
                                         const moonepExpertTensors_t* home_grads,
                                         const moonepExpertTensors_t* replica_grads);
/* Local. */
MOONEP_API moonepResult_t moonepEpRelease(moonepEpBuffer_t buffer, moonepEpHandle_t handle);
/* Local. Statistics of the EP buffer's last calls, in a moonepStepStats_t (stats->size set by
 * the caller; magic and version are written, not read): step, tokens, the plan's loads and
 * replicas, rows and bytes per operation, and per phase the time of the call that does it
 * (dispatch, combine, prefetch in prefetch-wait, reduce, and the backward calls); forward_ms
 * is the time in the step's dispatch, prefetch and combine calls, backward_ms in its backward
 * calls and reduce (the caller's compute between them is not counted). step counts the
 * dispatches that were planned (one then refused for receive capacity included: the planner and
 * the trace saw its counts). */
MOONEP_API moonepResult_t moonepEpGetStats(moonepEpBuffer_t buffer, moonepStepStats_t* stats);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOONEP_RUNTIME_H_ */
