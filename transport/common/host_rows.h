// Row and block operations shared by the host-memory backends (mpi/, ucx/): walking the rows a
// source fills, zeroing the rows no group fills, and summing replica gradients into their home.
#pragma once

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

// Zeroes every row of rank d's compute layout in `rows` (and its weight, when `weights` is not
// null) that no group fills: the gaps between groups, each group's padding, and the rows after the
// last group up to rank_rows[d].
void ZeroUnfilledRows(const planner::Plan& plan, int32_t d, const TensorView& rows, float* weights);

// home[j] += sum of sources[*][j] for every element of `home` (fp32 accumulation, in the order of
// `sources`, stored once in home's dtype; each source holds home.numel() elements of home's
// dtype). Identical order and rounding on every backend, so reductions agree bit for bit.
void AddIntoHome(const TensorView& home, const std::vector<const char*>& sources);

}  // namespace moonep::transport::common
