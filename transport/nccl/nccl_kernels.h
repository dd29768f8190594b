// Device kernels of the NCCL transport that the compute kernels (moonep/compute/cuda/kernels.h:
// pack, weighted combine) do not cover: routing validation + counting, per-row dispatch metadata,
// dedup expansion into the compute layout, per-row dot products, a scatter of per-entry scalars and
// the fixed-order sum of replica gradients. Every launcher enqueues on `stream` and returns the
// launch error. Index tables are checked on the device: an out-of-range entry is not followed and
// is counted into *bad (when not null), so a bad table never reads or writes outside the buffers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "moonep/core/dtype.h"
#include "transport/nccl/nccl_tables.h"

namespace moonep::transport::nccl {

// counts[e] += number of entries with id e; *invalid = 1 when an id is outside [-1, E) or a token
// names an expert twice. counts must be zeroed before.
cudaError_t LaunchCountRouting(const int32_t* topk_ids, int64_t num_tokens, int32_t top_k,
                               int32_t num_experts, int64_t* counts, int64_t* invalid,
                               cudaStream_t stream);

// meta[i].unique = unique[i], meta[i].weight = weights[entries[i]] (entries checked against
// num_entries).
cudaError_t LaunchFillRowMeta(const int32_t* unique, const int32_t* entries, const float* weights,
                              int64_t num_entries, int64_t n, RowMeta* meta, int32_t* bad,
                              cudaStream_t stream);

// rows[r] (r < num_rows) from source[r] (see RowSource); weights_out[r] likewise (skipped when
// null). staging: unique rows from peers; x: local tokens ([num_entries / top_k] rows); meta: the
// received metadata in receive order (num_meta entries); staging_begin: [R + 1].
cudaError_t LaunchExpandRows(const RowSource* source, int64_t num_rows, const RowMeta* meta,
                             int64_t num_meta, const int64_t* staging_begin, int32_t num_ranks,
                             const void* staging, const void* x, int64_t num_entries, int32_t top_k,
                             const float* topk_weights, size_t row_bytes, void* rows,
                             float* weights_out, int32_t* bad, cudaStream_t stream);

// dots[p] = <a[row[p]], b[row[p]]> for p < n, rows of `cols` elements of `dtype`, fp64 sums.
cudaError_t LaunchRowDots(const void* a, const void* b, DType dtype, int64_t cols,
                          const int32_t* row, int64_t num_rows, int64_t n, float* dots,
                          int32_t* bad, cudaStream_t stream);

// out[i] = index[i] >= 0 ? values[index[i]] : 0 for i < n (index checked against num_values).
cudaError_t LaunchScatterValues(const float* values, int64_t num_values, const int32_t* index,
                                int64_t n, float* out, int32_t* bad, cudaStream_t stream);

// home[j] = ((sources[0][j] + sources[1][j]) + ...) + home[j], in that order, fp32, stored as
// dtype (fp32 or bf16, round to nearest even), for j < n; num_sources >= 1. The order of the host
// backends' replica chains (transport/common/replica_chain.h), so every backend gets the same bits.
cudaError_t LaunchSumInOrder(void* home, DType dtype, int64_t n, const void* const* sources,
                             int32_t num_sources, cudaStream_t stream);

}  // namespace moonep::transport::nccl
