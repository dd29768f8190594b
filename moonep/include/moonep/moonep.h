/*
 * MoonEP: expert-parallel runtime for Mixture-of-Experts training that balances routing skew by
 * replicating hot experts online, per batch.
 *
 * C API (C99). Every call returns a moonepResult_t. Objects are opaque handles.
 *
 * Thread safety: MoonEP objects are not thread-safe, but the library is reentrant: distinct
 * planners may be used concurrently from distinct threads; one planner must not be used by two
 * threads at once. moonepGetVersion and moonepGetErrorString may be called from any thread. For
 * communicators and the objects made on them (moonep_runtime.h) the unit is the communicator.
 */
#ifndef MOONEP_H_
#define MOONEP_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOONEP_MAJOR 0
#define MOONEP_MINOR 5
#define MOONEP_PATCH 0
#define MOONEP_VERSION_CODE(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))
#define MOONEP_VERSION MOONEP_VERSION_CODE(MOONEP_MAJOR, MOONEP_MINOR, MOONEP_PATCH)

#if defined(__GNUC__)
#define MOONEP_API __attribute__((visibility("default")))
#else
#define MOONEP_API
#endif

/* Result codes. Values are stable: new codes are only ever appended. */
typedef enum {
  moonepSuccess = 0,
  moonepInvalidArgument = 1, /* a bad argument: null pointer, size, range, mismatch across ranks */
  moonepInvalidUsage = 2,    /* a call out of order: use after destroy, missing bind, ... */
  moonepSystemError = 3,     /* the OS or a library below failed (MPI, UCX, allocation) */
  moonepInternalError = 4,   /* a MoonEP bug: please report it with MOONEP_DEBUG=INFO output */
  moonepRemoteError = 5,     /* another rank failed the same operation */
  moonepTimeout = 6,         /* a wait exceeded MOONEP_TIMEOUT_MS; the message names phase + peers */
  moonepInProgress = 7,      /* an asynchronous operation has not completed yet */
  moonepOutOfMemory = 8,     /* an allocation or a declared capacity was too small */
  moonepUnavailable = 9,     /* the feature was not built (e.g. CUDA, NCCL, UCX), or its device is
                                not usable on this machine (no GPU, or no driver) */
  moonepCudaError = 10,      /* a CUDA, cuBLAS or NCCL call failed */
  moonepNumResults = 11
} moonepResult_t;

/* Writes MOONEP_VERSION of the library in use (which may differ from the header's). */
MOONEP_API moonepResult_t moonepGetVersion(int* version);

/* A static string describing a result code; never NULL. */
MOONEP_API const char* moonepGetErrorString(moonepResult_t result);

/* The message of this thread's latest MoonEP call (every call but this one, the per-object
 * ...GetLastError calls and moonepGetErrorString): the error it returned, or an empty string after
 * a success. The pointer is valid until this thread's next MoonEP call. */
MOONEP_API const char* moonepGetLastThreadError(void);


/* ---------------------------------------------------------------------------------------------
 * Planner only: counts in, plan out (for trainers with their own communication).
 *
 * A planner turns counts[R][E] (tokens of source rank r routed to expert e, once per top-k entry)
 * into a plan: which rank computes how many tokens of each expert, each rank's replica slots and
 * compute layout, and the split of each expert's canonical token order (sources in increasing
 * rank, each source's tokens by increasing index) into contiguous pieces. Identical input gives
 * identical plan bytes on every rank. A planner handle keeps the latest plan; the accessors copy
 * parts of it into caller buffers whose capacity (in elements) they check. A failed
 * moonepPlannerPlan leaves the handle without a plan (the accessors then say so) until a
 * moonepPlannerPlan succeeds.
 *
 * Handles: every call checks its planner against the library's set of live planners. A NULL planner
 * is moonepInvalidArgument (moonepPlannerDestroy(NULL) excepted: a no-op); a destroyed,
 * never-created or other-kind pointer is moonepInvalidUsage with a message, and is never
 * dereferenced; destroying a planner twice is moonepInvalidUsage. (A stale pointer whose address a
 * new planner has since taken is that planner: do not keep handles past destroy.) Distinct planners
 * may be used from distinct threads at once; one planner must not be used by two threads at once.
 *
 * Structs: moonepPlannerConfig_t and moonepPlanStats_t start with `size` (sizeof as compiled by
 * the caller). New fields are only ever appended after the previous version's sizeof. The library
 * accepts any size >= the struct's MIN_SIZE below (smaller: moonepInvalidArgument naming the
 * struct, the size and the minimum); it reads only `size` bytes of a config (fields past them take
 * the initializer's defaults) and writes only min(size, its sizeof) bytes of stats.
 * ------------------------------------------------------------------------------------------- */
typedef struct moonepPlanner* moonepPlanner_t;

typedef enum {
  moonepPolicyNone = 0,             /* home placement only */
  moonepPolicyMoonEP = 1,           /* perfect balance, fewest replicas, locality (default) */
  moonepPolicyMoonEPGreedy = 2,     /* the published MoonEP greedy policy */
  moonepPolicyEplb = 3,             /* DeepSeek EPLB on past counts, re-planned every eplb_period */
  moonepPolicyFasterMoEShadow = 4,  /* FasterMoE dynamic shadowing */
  moonepPolicyTestForceReplicas = 5 /* tests: fills replica slots, splits experts */
} moonepPlannerPolicy_t;

typedef struct {
  size_t size;          /* sizeof(moonepPlannerConfig_t) as compiled by the caller */
  int version;          /* MOONEP_VERSION of the header the caller compiled against */
  int num_ranks;        /* R > 0; R * E <= 2^40 */
  int num_experts;      /* E, a multiple of R */
  int slots;            /* replica slots per rank, 1..E; -1 means E / R; R * slots and
                           E / R + slots <= 2^31 - 1 */
  int pad_multiple;     /* each group's rows padded to a multiple of this (>= 1) */
  int ranks_per_node;   /* 0: flat; else ranks [n*rpn, (n+1)*rpn) form node n */
  moonepPlannerPolicy_t policy;
  const int* home;      /* NULL (home(e) = e / (E/R)) or [E] ranks, E/R experts each; copied */
  const double* speeds; /* NULL (all equal) or [R] relative speeds > 0; copied */
  int64_t row_bytes;    /* bytes of one token row, for byte stats (0: rows only) */
  int64_t expert_bytes; /* bytes of one expert's parameters, for byte stats */
  int eplb_period;      /* eplb: re-plan every this many steps (>= 1) */
  /* Added in 0.2.0. moonep: what one replica transfer on a rank costs (its weights arriving or
   * leaving, its gradients leaving or arriving), in tokens of the fastest rank's compute, between
   * ranks of one node and across nodes (every replica when flat); each in [0, 2^52]. Both 0
   * (default): perfect balance whatever replicas cost. Otherwise moonep balances only as far as
   * it pays: a heuristic search for a low (max rank load, in tokens of the fastest rank) + (max
   * over ranks of the larger of intra transfers x replica_cost_intra and inter transfers x
   * replica_cost_inter), never above that of the plan made without costs or of no replica; see
   * docs/planner.md "Weighing replicas". Ignored by the other policies. A 0.1.0 library reads
   * neither field (a config of this header is still accepted there, and plans perfect balance):
   * check the version moonepGetVersion(&v) writes (v >= MOONEP_VERSION_CODE(0, 2, 0)) before
   * relying on them. */
  int64_t replica_cost_intra;
  int64_t replica_cost_inter;
  /* Added in 0.3.0. moonep, when it weighs replicas (a replica cost above is set): what one token
   * row sent or received costs (its dispatch and combine, forward and backward), in 1/1024 tokens
   * of the fastest rank's compute, inside a node and across nodes; each in [0, 2^40]. The search
   * then adds the highest rank row cost (the larger of intra rows x row_cost_intra and inter rows
   * x row_cost_inter, each class counting the larger of rows sent and received, estimated from
   * the plan's decisions) to a plan's cost, so replicas that take rows off a hot home count for
   * the rows they save; see docs/planner.md "Rows in the objective". Both 0 (default): rows are
   * left out. A 0.2.0 library reads neither field. */
  int64_t row_cost_intra;
  int64_t row_cost_inter;
} moonepPlannerConfig_t;

/* The smallest config->size accepted: the end of the first version's last field (eplb_period).
 * config->version must be a MOONEP_VERSION (>= 0.1.0) of the library's major version. */
#define MOONEP_PLANNER_CONFIG_MIN_SIZE (offsetof(moonepPlannerConfig_t, eplb_period) + sizeof(int))

#define MOONEP_PLANNER_CONFIG_INITIALIZER                                                     \
  {                                                                                           \
    sizeof(moonepPlannerConfig_t), MOONEP_VERSION, 0, 0, -1, 1, 0, moonepPolicyMoonEP, NULL, \
        NULL, 0, 0, 1, 0, 0, 0, 0                                                             \
  }

typedef struct {
  size_t size;               /* set by the caller to sizeof(moonepPlanStats_t) */
  int64_t total_tokens;      /* sum(counts) */
  int64_t max_load_before;   /* max rank load with home placement only */
  int64_t max_load_after;    /* max rank load of the plan */
  double mean_load;          /* total_tokens / R */
  int replicas;              /* replica slots in use, all ranks */
  int prefetch_intra;        /* replicas whose home is on the same node */
  int prefetch_inter;        /* replicas whose home is on another node */
  int64_t rows_local;        /* token rows computed on their source rank */
  int64_t rows_travel_intra; /* token rows sent inside a node */
  int64_t rows_travel_inter; /* token rows sent across nodes (all, when flat) */
  int64_t dispatch_bytes_intra, dispatch_bytes_inter;
  int64_t prefetch_bytes_intra, prefetch_bytes_inter;
  int64_t reduce_bytes_intra, reduce_bytes_inter;
} moonepPlanStats_t;

/* The smallest stats->size accepted: the end of the first version's last field. */
#define MOONEP_PLAN_STATS_MIN_SIZE \
  (offsetof(moonepPlanStats_t, reduce_bytes_inter) + sizeof(int64_t))
/* Start from this (sets size); the other fields are outputs. */
#define MOONEP_PLAN_STATS_INITIALIZER \
  { sizeof(moonepPlanStats_t), 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }

/* Creates a planner; the config is checked and copied. */
MOONEP_API moonepResult_t moonepPlannerCreate(const moonepPlannerConfig_t* config,
                                              moonepPlanner_t* planner);
/* Destroys a planner (NULL is a no-op; a destroyed one is moonepInvalidUsage). */
MOONEP_API moonepResult_t moonepPlannerDestroy(moonepPlanner_t planner);
/* Plans one step from counts[num_counts], num_counts == R * E, row-major [source][expert]. Each
 * entry in [0, 2^52); each expert's sum over sources and each rank's load at most 2^52 (exact in
 * a double): otherwise moonepInvalidArgument naming the entry or expert, and no plan. */
MOONEP_API moonepResult_t moonepPlannerPlan(moonepPlanner_t planner, const int64_t* counts,
                                            size_t num_counts);
/* R, E, slots per rank and groups per rank (E/R + slots) of the planner. */
MOONEP_API moonepResult_t moonepPlannerGetShape(moonepPlanner_t planner, int* num_ranks,
                                                int* num_experts, int* slots, int* num_groups);
/* Stats of the latest plan; stats->size must be set by the caller (>= MOONEP_PLAN_STATS_MIN_SIZE).
 * Writes min(stats->size, the library's sizeof) bytes, stats->size included (set to that count). */
MOONEP_API moonepResult_t moonepPlannerGetStats(moonepPlanner_t planner, moonepPlanStats_t* stats);
/* alloc[e * R + d]: tokens of expert e computed on rank d (capacity >= R * E). */
MOONEP_API moonepResult_t moonepPlannerGetAlloc(moonepPlanner_t planner, int64_t* alloc,
                                                size_t capacity);
/* Replica slots, [R * slots] each: expert in the slot (-1 unused) and its tokens. Either may be NULL. */
MOONEP_API moonepResult_t moonepPlannerGetSlots(moonepPlanner_t planner, int32_t* slot_expert,
                                                int64_t* slot_tokens, size_t capacity);
/* Compute layout of `rank`: per group (E/R home groups, then the slots) its row offset, row count
 * and padded count; capacity >= num_groups; any pointer may be NULL. rank_rows gets the total. */
MOONEP_API moonepResult_t moonepPlannerGetLayout(moonepPlanner_t planner, int rank,
                                                 int64_t* offset, int64_t* count, int64_t* padded,
                                                 size_t capacity, int64_t* rank_rows);
/* Pieces of `expert`: *num_pieces always; then for each piece its destination rank, first
 * position in the expert's canonical order, length and destination row. Any array pointer may be
 * NULL; when one is not, capacity must be >= *num_pieces, else moonepInvalidArgument (with
 * *num_pieces written, so a first call with NULL arrays or capacity 0 gives the size). */
MOONEP_API moonepResult_t moonepPlannerGetPieces(moonepPlanner_t planner, int expert,
                                                 int* num_pieces, int* dest, int64_t* start,
                                                 int64_t* count, int64_t* row, size_t capacity);
/* Canonical bytes of the latest plan (identical on every rank for identical input). With
 * buffer NULL only *size is written; otherwise capacity must be >= the size. */
MOONEP_API moonepResult_t moonepPlannerSerialize(moonepPlanner_t planner, void* buffer,
                                                 size_t capacity, size_t* size);
/* The message of the latest call on this planner: its error, or an empty string after a success
 * (as moonepGetLastThreadError); for a NULL or non-live planner, a static message saying so. The string is the planner's: valid until the
 * next call on that planner or its destruction (copy it to keep it). */
MOONEP_API const char* moonepPlannerGetLastError(moonepPlanner_t planner);

#ifdef __cplusplus
} /* extern "C" */
#endif

/* Communicators, the EP buffer and the MoE layer (levels 2 and 3). */
#include "moonep_runtime.h"

#endif /* MOONEP_H_ */
