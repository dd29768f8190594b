// The routing-trace writer: appends counts[R][E] per (step, layer) to a file in the moonep-trace
// format of docs/trace-format.md, which `moonep-sim --trace` replays:
//
//   # moonep-trace v1 R=4 E=16 K=2
//   <step> <layer> c[0][0] c[0][1] ... c[R-1][E-1]
//
// The header is written when the file is empty; an existing file is appended to only when its
// header names the same R, E and K. Only rank 0 of a communicator writes. Each record is one
// fwrite + fflush, so a crashed job leaves every finished step readable.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace moonep::runtime {

class TraceWriter {
 public:
  explicit TraceWriter(std::string path) : path_(std::move(path)) {}
  ~TraceWriter();
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  const std::string& path() const { return path_; }

  // Appends one record. The first call fixes R, E and K (header); a later call with other sizes
  // fails with InvalidArgument (a trace holds one shape).
  absl::Status Append(int64_t step, int32_t layer, int32_t num_ranks, int32_t num_experts,
                      int32_t top_k, absl::Span<const int64_t> counts);

  int64_t records() const { return records_; }

 private:
  absl::Status Open(int32_t num_ranks, int32_t num_experts, int32_t top_k);

  std::string path_;
  std::FILE* file_ = nullptr;
  int32_t num_ranks_ = 0, num_experts_ = 0, top_k_ = 0;
  int64_t records_ = 0;
  std::string line_;  // reused for every record
};

// The header line (with newline), "# moonep-trace v1 R=.. E=.. K=..".
std::string TraceHeader(int32_t num_ranks, int32_t num_experts, int32_t top_k);

}  // namespace moonep::runtime
