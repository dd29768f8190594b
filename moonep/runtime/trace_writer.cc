#include "moonep/runtime/trace_writer.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moonep/core/status.h"

namespace moonep::runtime {

std::string TraceHeader(int32_t num_ranks, int32_t num_experts, int32_t top_k) {
  return absl::StrFormat("# moonep-trace v1 R=%d E=%d K=%d\n", num_ranks, num_experts, top_k);
}

TraceWriter::~TraceWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::Status TraceWriter::Open(int32_t num_ranks, int32_t num_experts, int32_t top_k) {
  const std::string header = TraceHeader(num_ranks, num_experts, top_k);
  // An existing trace is continued only when it describes the same shape.
  if (std::FILE* existing = std::fopen(path_.c_str(), "r")) {
    char first[256] = {};
    const bool has_line = std::fgets(first, sizeof(first), existing) != nullptr;
    std::fclose(existing);
    if (has_line && header != first) {
      return InvalidArgument(
          "MOONEP_TRACE: %s already holds a trace of another shape ('%s'); this job writes '%s'",
          path_, absl::StripTrailingAsciiWhitespace(first),
          absl::StripTrailingAsciiWhitespace(header));
    }
  }
  file_ = std::fopen(path_.c_str(), "a");
  if (file_ == nullptr) {
    return SystemError("MOONEP_TRACE: cannot open %s for appending: %s", path_,
                       std::strerror(errno));
  }
  std::fseek(file_, 0, SEEK_END);
  if (std::ftell(file_) == 0) {
    std::fputs(header.c_str(), file_);
    std::fflush(file_);
  }
  num_ranks_ = num_ranks;
  num_experts_ = num_experts;
  top_k_ = top_k;
  return absl::OkStatus();
}

absl::Status TraceWriter::Append(int64_t step, int32_t layer, int32_t num_ranks,
                                 int32_t num_experts, int32_t top_k,
                                 absl::Span<const int64_t> counts) {
  if (counts.size() != static_cast<size_t>(num_ranks) * static_cast<size_t>(num_experts)) {
    return InvalidArgument("trace: counts has %d entries, expected R*E = %d", counts.size(),
                           static_cast<int64_t>(num_ranks) * num_experts);
  }
  if (file_ == nullptr) {
    MOONEP_RETURN_IF_ERROR(Open(num_ranks, num_experts, top_k));
  } else if (num_ranks != num_ranks_ || num_experts != num_experts_ || top_k != top_k_) {
    return InvalidArgument(
        "trace %s holds R=%d E=%d K=%d; layer %d has R=%d E=%d K=%d (one trace, one shape)",
        path_, num_ranks_, num_experts_, top_k_, layer, num_ranks, num_experts, top_k);
  }
  line_.clear();
  absl::StrAppend(&line_, step, " ", layer);
  for (int64_t c : counts) absl::StrAppend(&line_, " ", c);
  line_.push_back('\n');
  if (std::fwrite(line_.data(), 1, line_.size(), file_) != line_.size() ||
      std::fflush(file_) != 0) {
    return SystemError("MOONEP_TRACE: write to %s failed: %s", path_, std::strerror(errno));
  }
  ++records_;
  return absl::OkStatus();
}

}  // namespace moonep::runtime
