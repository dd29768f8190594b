// Row operations shared by the host-memory backends (mpi/, ucx/): walking the rows a source
// fills, and zeroing the rows no group fills.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "moonep/core/tensor.h"
#include "planner/plan.h"
#include "transport/layout.h"

namespace moonep::transport::common {

// Calls fn(i, row) for the rows source `s` fills on this rank, i counting them in the order the
// source sends them.
template <typename Fn>
void ForEachRowFrom(const ReceiveLayout& recv, int32_t s, Fn&& fn) {
  int64_t i = 0;
  for (int64_t r = recv.run_begin[s]; r < recv.run_begin[s + 1]; ++r) {
    for (int64_t j = 0; j < recv.run_count[r]; ++j) fn(i++, recv.run_row[r] + j);
  }
}

// Appends `count` rows from row `row` (row_bytes each, row_bytes <= max_block_bytes) to a block
// list (byte displacement, int length): a run longer than max_block_bytes (INT_MAX for MPI's int
// block lengths) becomes several blocks.
template <typename Displacement>
void AppendRunBlocks(int64_t row, int64_t count, int64_t row_bytes, int64_t max_block_bytes,
                     std::vector<Displacement>* displs, std::vector<int>* lengths) {
  const int64_t rows_per_block = std::max<int64_t>(1, max_block_bytes / row_bytes);
  for (int64_t done = 0; done < count; done += rows_per_block) {
    const int64_t n = std::min(rows_per_block, count - done);
    displs->push_back(static_cast<Displacement>((row + done) * row_bytes));
    lengths->push_back(static_cast<int>(n * row_bytes));
  }
}

// Zeroes every row of rank d's compute layout in `rows` (and its weight, when `weights` is not
// null) that no group fills: the gaps between groups, each group's padding, and the rows after the
// last group up to rank_rows[d].
void ZeroUnfilledRows(const planner::Plan& plan, int32_t d, const TensorView& rows, float* weights);

}  // namespace moonep::transport::common
