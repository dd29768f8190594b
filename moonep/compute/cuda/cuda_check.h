// CUDA and cuBLAS return codes as absl::Status (moonepCudaError), naming the call that failed.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "moonep/core/status.h"

namespace moonep::compute::cuda {

inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return MakeStatus(moonepCudaError, absl::StrFormat("%s: %s (%s)", what, cudaGetErrorString(err),
                                                     cudaGetErrorName(err)));
}

inline absl::Status CublasStatus(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return MakeStatus(moonepCudaError,
                    absl::StrFormat("%s: %s (%d)", what, cublasGetStatusString(st), static_cast<int>(st)));
}

}  // namespace moonep::compute::cuda

#define MOONEP_CUDA_RETURN_IF_ERROR(call) \
  MOONEP_RETURN_IF_ERROR(::moonep::compute::cuda::CudaStatus((call), #call))
#define MOONEP_CUBLAS_RETURN_IF_ERROR(call) \
  MOONEP_RETURN_IF_ERROR(::moonep::compute::cuda::CublasStatus((call), #call))
