// The routing-trace writer: appends counts[R][E] per (step, layer) to a file in the moonep-trace
// format of docs/trace-format.md, which `moonep-sim --trace` replays:
//
//   # moonep-trace v1 R=4 E=16 K=2
//   <step> <layer> c[0][0] c[0][1] ... c[R-1][E-1]
//
// The path is opened once, for appending, and never for reading unless it is a non-empty regular
// file: a FIFO, a terminal or /dev/stdout is only written to (the header first). An existing trace
// file is appended to only when its header names the same R, E and K; a partial last line that a
// crash or a full disk left is cut off first (with a warning), so that records never merge. Only
// rank 0 of a communicator writes. Each record is one write(2), so a crashed job leaves every
// finished step readable.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moonep::runtime {

class TraceWriter {
 public:
  explicit TraceWriter(std::string path) : path_(std::move(path)) {}
  ~TraceWriter();
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  const std::string& path() const { return path_; }

  // Appends one record. The first call opens the path and fixes R, E and K (header); a later call
  // with other sizes fails with InvalidArgument (a trace holds one shape). An error opening the
  // path, writing the header or writing a record is returned (its callers warn and stop tracing).
  absl::Status Append(int64_t step, int32_t layer, int32_t num_ranks, int32_t num_experts,
                      int32_t top_k, absl::Span<const int64_t> counts);

  int64_t records() const { return records_; }

 private:
  absl::Status Open(int32_t num_ranks, int32_t num_experts, int32_t top_k);
  // For a non-empty regular file: checks that it is a trace of `header`'s shape, cuts off a
  // partial last line, and returns the size it is appended at (0: the header is to be written).
  absl::StatusOr<int64_t> Continue(int64_t size, const std::string& header);

  std::string path_;
  int fd_ = -1;
  int32_t num_ranks_ = 0, num_experts_ = 0, top_k_ = 0;
  int64_t records_ = 0;
  std::string line_;  // reused for every record
};

// The header line (with newline), "# moonep-trace v1 R=.. E=.. K=..".
std::string TraceHeader(int32_t num_ranks, int32_t num_experts, int32_t top_k);

}  // namespace moonep::runtime
