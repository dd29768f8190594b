#include "transport/common/count_exchange.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"
#include "moonep/core/status.h"
#include "planner/plan_builder.h"
#include "transport/common/host_checks.h"
#include "transport/layout.h"

namespace moonep::transport::common {

void PackCountMessage(const absl::Status& local, absl::Span<const int32_t> ids, int64_t T,
                      int32_t K, int32_t E, int64_t capacity, std::vector<int64_t>* message) {
  std::vector<int64_t>& mine = *message;
  mine.assign(static_cast<size_t>(CountMessageWords(E)), 0);
  mine[0] = local.ok() ? 0 : 1;
  mine[1] = T;
  mine[2] = K;
  mine[3] = E;
  mine[4] = capacity;
  if (local.ok()) {
    CountRouting(ids, E, mine.data() + kCountHeader);
  } else {
    const size_t room = static_cast<size_t>(CountMessageWords(E) - kCountHeader) * 8 - 1;
    const absl::string_view why = local.message();
    std::memcpy(mine.data() + kCountHeader, why.data(), std::min(room, why.size()));
  }
}

namespace {
// The reason a refusing rank put into its count message (PackCountMessage).
std::string RefusalReason(const int64_t* values, int32_t E) {
  const char* text = reinterpret_cast<const char*>(values);
  const size_t room = static_cast<size_t>(CountMessageWords(E) - kCountHeader) * 8 - 1;
  return std::string(text, strnlen(text, room));
}
}  // namespace

void KeepRouting(const absl::Status& local, absl::Span<const int32_t> ids, int64_t T, int32_t K,
                 DispatchHandle* handle) {
  if (!local.ok()) return;
  handle->topk_ids_.assign(ids.begin(), ids.end());
  handle->num_tokens_ = T;
  handle->top_k_ = K;
}

absl::Status FinishCountExchange(const absl::Status& local, absl::Span<const int64_t> mine,
                                 absl::Span<const int64_t> all, absl::Span<const char> mismatch,
                                 int32_t me, int32_t R, int32_t E, DispatchHandle* handle) {
  handle->counted_ = false;
  handle->dispatched_ = false;
  const int64_t width = CountMessageWords(E);
  std::vector<int> bad;
  for (int r = 0; r < R; ++r) {
    if (r != me && mine[0] == 0 && (mismatch[r] || all[r * width + 3] != E)) {
      return InvalidArgument("count exchange: rank %d uses a different num_experts than rank "
                             "%d (%d)", r, me, E);
    }
    if (all[r * width] != 0) bad.push_back(r);
  }
  // This rank's own refusal, named (the peers name it in theirs).
  if (!local.ok()) return Annotate(local, absl::StrFormat("count exchange on rank %d", me));
  if (!bad.empty()) {
    const std::string why = RefusalReason(all.data() + bad[0] * width + kCountHeader, E);
    return RemoteError("count exchange: rank(s) %s refused their dispatch input; rank %d: %s",
                       RankList(bad), bad[0], why.empty() ? "(no reason given)" : why);
  }
  handle->rank_ = me;
  handle->num_ranks_ = R;
  handle->num_experts_ = E;
  handle->counts_.resize(static_cast<size_t>(R) * E);
  handle->rank_tokens_.resize(R);
  handle->rank_capacity_.resize(R);
  for (int r = 0; r < R; ++r) {
    const int64_t* row = all.data() + r * width;
    handle->rank_tokens_[r] = row[1];
    handle->rank_capacity_[r] = row[4];
    std::copy(row + kCountHeader, row + kCountHeader + E, handle->counts_.begin() + r * E);
  }
  planner::ComputeSourceOffsets(handle->counts_, R, E, &handle->offsets_);
  handle->counted_ = true;
  return absl::OkStatus();
}

}  // namespace moonep::transport::common
