// Routing traces: counts[R][E] per (step, layer), as the runtime writes them when MOONEP_TRACE is
// set, or a plain CSV of counts. The format is defined in docs/trace-format.md. Readers stream one
// record at a time, so reading takes one record's memory whatever the trace's length.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moonep::sim {

enum class TraceFormat : int32_t {
  kAuto = 0,    // by the first line: "# moonep-trace" means kMoonEP, else kCsv
  kMoonEP = 1,  // "# moonep-trace v1 R=.. E=.. [K=..]" then "step layer c[0][0] .. c[R-1][E-1]"
  kCsv = 2,     // one source rank's E counts per line, comma-separated; R lines per step
};

bool ParseTraceFormat(const std::string& name, TraceFormat* format);

// Largest R*E of a trace (either format): 16 GiB of counts in one record.
constexpr int64_t kMaxTraceCounts = int64_t{1} << 31;
// Longest first line (header or CSV row) a trace may have, bytes a line may spend on each of
// its integers (digits, sign and the blanks around them) once the sizes are known, and the least
// any line may hold (comments too), all without the line end.
constexpr size_t kMaxFirstTraceLine = size_t{1} << 30;
constexpr size_t kMaxTraceBytesPerInteger = 64;
constexpr size_t kMinTraceLineBound = size_t{1} << 20;

struct TraceRecord {
  int64_t step = 0;
  int32_t layer = 0;
  std::vector<int64_t> counts;  // [R * E]
};

class TraceReader {
 public:
  // Opens `path`. For CSV (which has no header of sizes) `csv_ranks` gives R, and `topk` gives K
  // (0: unknown); a moonep trace takes R, E and K from its header, and `topk`, when positive,
  // must agree with a K given there. R*E must be at most kMaxTraceCounts and one record must fit
  // in the host's free memory; a moonep trace file must be long enough for one record of its
  // header's size (a header no record can match is an error before anything is read).
  static absl::StatusOr<std::unique_ptr<TraceReader>> Open(const std::string& path,
                                                           TraceFormat format, int32_t csv_ranks,
                                                           int32_t topk);
  ~TraceReader();

  int32_t num_ranks() const { return num_ranks_; }
  int32_t num_experts() const { return num_experts_; }
  int32_t topk() const { return topk_; }  // 0 when neither the trace nor the caller gave it
  TraceFormat format() const { return format_; }

  // Reads the next record into `record`; returns false at the end of the file. Errors name the
  // file and line; a read error names the file and errno's text. Counts must be below 2^52 and one
  // record's sum at most 2^52 (the planner's bounds). In a moonep trace, a last line without a
  // newline is a record cut short (the writer ends every record with one): it is skipped, as the
  // end of the file, and warning() says so.
  absl::StatusOr<bool> Next(TraceRecord* record);

  // Whether no record follows (Next would return false), without consuming one.
  absl::StatusOr<bool> AtEnd();

  // "path:line: ..." when Next skipped a cut last line; empty otherwise.
  const std::string& warning() const { return warning_; }

 private:
  TraceReader() = default;
  // Reads a line into line_ (without its line end); false at the end of the file.
  absl::StatusOr<bool> ReadLine();
  // The next line that is neither blank nor a comment (the pending one first); false at the end.
  absl::StatusOr<bool> NextDataLine();
  absl::Status LineError(const std::string& what) const;
  // The host has the free memory to read one record of `sizes` (e.g. "the header's R=2 E=4").
  absl::Status CheckRecordMemory(const std::string& sizes) const;

  std::string path_;
  std::FILE* file_ = nullptr;
  TraceFormat format_ = TraceFormat::kAuto;
  int32_t num_ranks_ = 0, num_experts_ = 0, topk_ = 0;
  int64_t line_number_ = 0;
  int64_t csv_records_ = 0;
  char* line_ = nullptr;  // line buffer, reused for every line
  size_t line_capacity_ = 0;
  // Longest line read (bytes, without its line end): a stream with no newline (a device, a pipe)
  // fails with an error naming the line instead of growing the buffer until memory runs out.
  // kMaxFirstTraceLine until the sizes are known, then what a record of them may take.
  size_t max_line_ = kMaxFirstTraceLine;
  void SetMaxLine(int64_t integers);
  size_t line_length_ = 0;
  bool terminated_ = false;  // the last line read ended with a newline
  bool pending_ = false;     // line_ holds a data line not yet consumed (CSV sizes or AtEnd read it)
  std::vector<int64_t> fields_;  // one line's integers, reused for every line
  std::string warning_;
};

// The header line of a moonep trace (with its newline). K may be 0 to leave it out.
std::string FormatTraceHeader(int32_t num_ranks, int32_t num_experts, int32_t topk);
// One record line of a moonep trace (with its newline): "step layer counts...".
std::string FormatTraceRecord(int64_t step, int32_t layer, absl::Span<const int64_t> counts);

}  // namespace moonep::sim
