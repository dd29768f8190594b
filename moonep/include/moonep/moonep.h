/*
 * MoonEP: expert-parallel runtime for Mixture-of-Experts training that balances routing skew by
 * replicating hot experts online, per batch.
 *
 * C API (C99). Every call returns a moonepResult_t. Objects are opaque handles.
 *
 * Thread safety: MoonEP objects are not thread-safe, but the library is reentrant: distinct
 * handles may be used concurrently from distinct threads; one handle must not be used by two
 * threads at once. moonepGetVersion and moonepGetErrorString may be called from any thread.
 */
#ifndef MOONEP_H_
#define MOONEP_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOONEP_MAJOR 0
#define MOONEP_MINOR 1
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
  moonepUnavailable = 9,     /* the feature was not built (e.g. CUDA, NCCL, UCX) */
  moonepCudaError = 10,      /* a CUDA, cuBLAS or NCCL call failed */
  moonepNumResults = 11
} moonepResult_t;

/* Writes MOONEP_VERSION of the library in use (which may differ from the header's). */
MOONEP_API moonepResult_t moonepGetVersion(int* version);

/* A static string describing a result code; never NULL. */
MOONEP_API const char* moonepGetErrorString(moonepResult_t result);

/* The message of the last failing call made by this thread (empty string if none). The pointer is
 * valid until this thread's next MoonEP call. */
MOONEP_API const char* moonepGetLastThreadError(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOONEP_H_ */
