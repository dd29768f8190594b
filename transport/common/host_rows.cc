#include "transport/common/host_rows.h"

#include <algorithm>
#include <cstring>

#include "moonep/core/dtype.h"

namespace moonep::transport::common {

void ZeroUnfilledRows(const planner::Plan& plan, int32_t d, const TensorView& rows, float* weights) {
  const int32_t G = plan.num_groups();
  const size_t row_bytes = static_cast<size_t>(rows.shape[1]) * DTypeSize(rows.dtype);
  auto zero = [&](int64_t a, int64_t b) {
    if (b <= a) return;
    std::memset(rows.row(a), 0, static_cast<size_t>(b - a) * row_bytes);
    if (weights) std::fill(weights + a, weights + b, 0.0f);
  };
  int64_t end = 0;
  for (int32_t g = 0; g < G; ++g) {
    const size_t i = static_cast<size_t>(d) * G + g;
    zero(end, plan.group_offset[i]);
    zero(plan.group_offset[i] + plan.group_count[i], plan.group_offset[i] + plan.group_padded[i]);
    end = plan.group_offset[i] + plan.group_padded[i];
  }
  zero(end, plan.rank_rows[d]);
}

}  // namespace moonep::transport::common
