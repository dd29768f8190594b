// fp32-compute GEMM over fp32 or bf16 operands, on top of OpenBLAS cblas_sgemm.
//   C[M, N] = op(A)[M, K] * op(B)[K, N] + beta * C     (row-major, C fp32)
// bf16 operands are converted to fp32 per K panel of kPanelK into caller scratch, so the weights
// are never copied whole. The panel split depends only on K, never on threads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moonep/core/dtype.h"

namespace moonep::compute::cpu {

constexpr int64_t kPanelK = 256;

// A row-major matrix operand. Stored [rows, cols] with row stride `ld`; op() transposes when
// `trans` (then the stored matrix is [K, M] for A, [N, K] for B).
struct Operand {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t ld = 0;
  bool trans = false;
};

// Scratch floats Gemm needs for these operand dtypes.
inline size_t GemmScratchFloats(int64_t M, int64_t N, DType a, DType b) {
  size_t n = 0;
  if (a == DType::kBFloat16) n += static_cast<size_t>(kPanelK * M);
  if (b == DType::kBFloat16) n += static_cast<size_t>(kPanelK * N);
  return n;
}

void Gemm(int64_t M, int64_t N, int64_t K, const Operand& a, const Operand& b, float beta,
          float* c, int64_t ldc, float* scratch);

// Keeps OpenBLAS single-threaded while alive (the executor parallelizes over its own fixed tiles)
// and restores the previous thread count after. OpenBLAS's count is process-global and distinct
// executors may run at once, so the guards are counted (under a mutex): the first one in saves
// the count and sets 1, the last one out restores it. No-op when the BLAS is not OpenBLAS.
class ScopedSingleThreadedBlas {
 public:
  ScopedSingleThreadedBlas();
  ~ScopedSingleThreadedBlas();
  ScopedSingleThreadedBlas(const ScopedSingleThreadedBlas&) = delete;
  ScopedSingleThreadedBlas& operator=(const ScopedSingleThreadedBlas&) = delete;
};

}  // namespace moonep::compute::cpu
