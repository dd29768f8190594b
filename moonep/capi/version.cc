// Version, result strings and the per-thread last error.
#include <string>

#include "moonep/capi/capi_common.h"

namespace moonep::capi {
namespace {
thread_local std::string t_last_error;
}

moonepResult_t Report(const absl::Status& status) {
  t_last_error = std::string(status.message());
  return ToResult(status);
}

void ClearLastError() { t_last_error.clear(); }

}  // namespace moonep::capi

extern "C" {

moonepResult_t moonepGetVersion(int* version) {
  moonep::capi::ClearLastError();  // like every call that reports errors: empty after success
  if (version == nullptr) {
    return moonep::capi::Report(moonep::InvalidArgument("moonepGetVersion: version is NULL"));
  }
  *version = MOONEP_VERSION;
  return moonepSuccess;
}

const char* moonepGetErrorString(moonepResult_t result) {
  switch (result) {
    case moonepSuccess: return "no error";
    case moonepInvalidArgument: return "invalid argument";
    case moonepInvalidUsage: return "invalid usage (call out of order or on a destroyed object)";
    case moonepSystemError: return "system error (OS, MPI, UCX or allocation failure)";
    case moonepInternalError: return "internal error (a MoonEP bug)";
    case moonepRemoteError: return "remote error (another rank failed)";
    case moonepTimeout: return "timeout (a peer did not answer within MOONEP_TIMEOUT_MS)";
    case moonepInProgress: return "operation in progress";
    case moonepOutOfMemory: return "out of memory or capacity";
    case moonepUnavailable: return "feature not built into this library, or not usable here (no GPU)";
    case moonepCudaError: return "CUDA, cuBLAS or NCCL error";
    default: return "unknown result code";
  }
}

const char* moonepGetLastThreadError(void) { return moonep::capi::t_last_error.c_str(); }

}  // extern "C"
