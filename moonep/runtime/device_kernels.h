// The runtime's own CUDA kernel (built with MOONEP_WITH_CUDA): scaling dispatched rows by their
// top-k weight before the executor's backward.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moonep/core/dtype.h"

namespace moonep::runtime {

// rows[r, h] *= weights[r] for r < num_rows, h < hidden; rows fp32 or bf16 (round to nearest
// even), contiguous.
cudaError_t LaunchScaleRows(void* rows, DType dtype, int64_t num_rows, int64_t hidden,
                            const float* weights, cudaStream_t stream);

}  // namespace moonep::runtime
