// Device kernels of the CUDA backend: pack (gather rows by an index table), unpack + weighted
// combine, SwiGLU forward/backward over the row segments of a compute view, and zeroing of row
// segments. Storage is fp32 or bf16, arithmetic fp32. Rows are moved 16 bytes per thread access
// wherever the row length and the pointers allow it (narrower otherwise), one warp per row,
// consecutive lanes on consecutive 16-byte chunks (coalesced).
//
// Every launcher enqueues on `stream` and returns the launch's error (cudaSuccess when enqueued).
// Index tables are read on the device: an entry that is out of range is not followed (the row it
// would produce is zeroed or left out of the sum) and is counted into *bad_index when bad_index is
// not null, so a bad table never makes a kernel read or write outside the caller's buffers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "moonep/core/dtype.h"

namespace moonep::compute::cuda {

// Rows [begin, begin + count) of a rows buffer. Segments given to a kernel are non-empty.
struct RowSegment {
  int64_t begin = 0;
  int64_t count = 0;
};

// A device table of `count` segments; prefix[s] = rows in segments before s, prefix[count] = the
// total (`total_rows`, also known on the host to size the launch).
struct SegmentTable {
  const RowSegment* segments = nullptr;
  const int64_t* prefix = nullptr;
  int32_t count = 0;
  int64_t total_rows = 0;
};

// Pack: dst[r] = src[index[r]] for r < dst_rows (row_bytes bytes per row, rows contiguous).
// index[r] == -1 zero-fills the row (padding); the table decides dedup: a token that goes to
// several experts of one destination appears there once per row the plan gives it, and nowhere
// else. Any dtype (rows are copied as bytes).
cudaError_t LaunchPackRows(const void* src, int64_t src_rows, const int32_t* index, int64_t dst_rows,
                           void* dst, size_t row_bytes, int32_t* bad_index, cudaStream_t stream);

// Unpack + weighted combine: out[t] = sum_k weights[t*K + k] * rows[index[t*K + k]] for
// t < tokens, skipping index -1, accumulated in fp32 in k order, stored as out_dtype.
// rows: [num_rows, cols] of rows_dtype; out: [tokens, cols]; 1 <= top_k <= 32.
cudaError_t LaunchCombineRows(const void* rows, DType rows_dtype, int64_t num_rows,
                              const int32_t* index, const float* weights, int64_t tokens,
                              int32_t top_k, int64_t cols, void* out, DType out_dtype,
                              int32_t* bad_index, cudaStream_t stream);

// SwiGLU forward over the rows of `rows`: h[r] = silu(a[r]) * b[r] for I columns, where
// a[r] = ab + r * ld_ab and b[r] = a[r] + b_offset (fp32), h[r] = h + r * ld_h (h_dtype).
cudaError_t LaunchSwiGluForward(const SegmentTable& rows, const float* ab, int64_t ld_ab,
                                int64_t b_offset, int64_t intermediate, void* h, DType h_dtype,
                                int64_t ld_h, cudaStream_t stream);

// SwiGLU backward over the rows of `rows`, given a, b (as above) and dh (fp32, ld_dh):
//   h = silu(a) * b, da = dh * b * silu'(a), db = dh * silu(a), stored as `dtype`;
// h at h + r * ld_h, da at dab + r * ld_dab, db at da + db_offset.
cudaError_t LaunchSwiGluBackward(const SegmentTable& rows, const float* ab, int64_t ld_ab,
                                 int64_t b_offset, const float* dh, int64_t ld_dh,
                                 int64_t intermediate, DType dtype, void* h, int64_t ld_h,
                                 void* dab, int64_t ld_dab, int64_t db_offset, cudaStream_t stream);

// Zeroes the rows of `rows` in a buffer of contiguous rows of row_bytes bytes.
cudaError_t LaunchZeroRows(const SegmentTable& rows, void* data, size_t row_bytes,
                           cudaStream_t stream);

}  // namespace moonep::compute::cuda
