#include "moonep/compute/cpu/gemm.h"

#include <algorithm>
#include <mutex>

#include <cblas.h>

// Weak so that any CBLAS links; the thread-count calls exist only in OpenBLAS.
extern "C" {
#pragma weak openblas_set_num_threads
#pragma weak openblas_get_num_threads
}

namespace moonep::compute::cpu {
namespace {

// dst[r, c] (ld = cols) = src[r0 + r, c0 + c] for a stored matrix with row stride ld.
void ConvertBlock(const void* src, DType dtype, int64_t ld, int64_t r0, int64_t rows, int64_t c0,
                  int64_t cols, float* dst) {
  const size_t esize = DTypeSize(dtype);
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = static_cast<const char*>(src) + static_cast<size_t>((r0 + r) * ld + c0) * esize;
    ConvertToFloat(row, dtype, dst + r * cols, static_cast<size_t>(cols));
  }
}

const float* Offset(const Operand& op, int64_t r, int64_t c) {
  return static_cast<const float*>(op.data) + r * op.ld + c;
}

}  // namespace

void Gemm(int64_t M, int64_t N, int64_t K, const Operand& a, const Operand& b, float beta,
          float* c, int64_t ldc, float* scratch) {
  if (M == 0 || N == 0) return;
  const CBLAS_TRANSPOSE ta = a.trans ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = b.trans ? CblasTrans : CblasNoTrans;
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) c[m * ldc + n] = beta == 0.0f ? 0.0f : beta * c[m * ldc + n];
    }
    return;
  }
  if (a.dtype == DType::kFloat32 && b.dtype == DType::kFloat32) {
    cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(K), 1.0f, static_cast<const float*>(a.data),
                static_cast<int>(a.ld), static_cast<const float*>(b.data), static_cast<int>(b.ld),
                beta, c, static_cast<int>(ldc));
    return;
  }
  float* a_panel = scratch;
  float* b_panel = scratch + (a.dtype == DType::kBFloat16 ? kPanelK * M : 0);
  for (int64_t k0 = 0; k0 < K; k0 += kPanelK) {
    const int64_t kc = std::min(kPanelK, K - k0);
    const float* ap;
    int64_t lda;
    if (a.dtype == DType::kBFloat16) {
      // op(A) columns [k0, k0 + kc): stored rows when transposed, stored columns otherwise.
      if (a.trans) {
        ConvertBlock(a.data, a.dtype, a.ld, k0, kc, 0, M, a_panel);
        lda = M;
      } else {
        ConvertBlock(a.data, a.dtype, a.ld, 0, M, k0, kc, a_panel);
        lda = kc;
      }
      ap = a_panel;
    } else {
      ap = a.trans ? Offset(a, k0, 0) : Offset(a, 0, k0);
      lda = a.ld;
    }
    const float* bp;
    int64_t ldb;
    if (b.dtype == DType::kBFloat16) {
      if (b.trans) {
        ConvertBlock(b.data, b.dtype, b.ld, 0, N, k0, kc, b_panel);
        ldb = kc;
      } else {
        ConvertBlock(b.data, b.dtype, b.ld, k0, kc, 0, N, b_panel);
        ldb = N;
      }
      bp = b_panel;
    } else {
      bp = b.trans ? Offset(b, 0, k0) : Offset(b, k0, 0);
      ldb = b.ld;
    }
    cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(kc), 1.0f, ap, static_cast<int>(lda), bp, static_cast<int>(ldb),
                k0 == 0 ? beta : 1.0f, c, static_cast<int>(ldc));
  }
}

namespace {

// The guards alive in the process and the count the first of them saved.
std::mutex blas_mutex;
int blas_guards = 0;
int blas_saved = 0;

bool HaveOpenBlas() {
  return openblas_get_num_threads != nullptr && openblas_set_num_threads != nullptr;
}

}  // namespace

ScopedSingleThreadedBlas::ScopedSingleThreadedBlas() {
  if (!HaveOpenBlas()) return;
  std::lock_guard<std::mutex> lock(blas_mutex);
  if (blas_guards++ == 0) {
    blas_saved = openblas_get_num_threads();
    if (blas_saved != 1) openblas_set_num_threads(1);
  }
}

ScopedSingleThreadedBlas::~ScopedSingleThreadedBlas() {
  if (!HaveOpenBlas()) return;
  std::lock_guard<std::mutex> lock(blas_mutex);
  if (--blas_guards == 0 && blas_saved > 1) openblas_set_num_threads(blas_saved);
}

}  // namespace moonep::compute::cpu
