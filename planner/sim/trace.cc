#include "planner/sim/trace.h"

#include <sys/stat.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "moonep/core/host_memory.h"
#include "moonep/core/status.h"

namespace moonep::sim {

bool ParseTraceFormat(const std::string& name, TraceFormat* format) {
  if (name == "auto") *format = TraceFormat::kAuto;
  else if (name == "moonep") *format = TraceFormat::kMoonEP;
  else if (name == "csv") *format = TraceFormat::kCsv;
  else return false;
  return true;
}

namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

// Parses fields of non-negative decimal integers from [s, end). Whitespace separates fields;
// with `comma`, commas do (spaces around them are allowed). On failure sets `error`.
bool ParseFields(const char* s, const char* end, bool comma, std::vector<int64_t>* out,
                 std::string* error) {
  out->clear();
  const char* p = s;
  auto skip_space = [&] {
    while (p < end && IsSpace(*p)) ++p;
  };
  skip_space();
  if (p == end) return true;
  while (true) {
    const size_t field = out->size() + 1;
    const char* start = p;
    if (p == end || (comma && *p == ',')) {
      *error = absl::StrFormat("field %d is empty", field);
      return false;
    }
    bool negative = false;
    if (*p == '-' || *p == '+') {
      negative = *p == '-';
      ++p;
    }
    if (p == end || *p < '0' || *p > '9') {
      const char* q = p;
      while (q < end && !IsSpace(*q) && *q != ',') ++q;
      *error = absl::StrFormat("field %d ('%s') is not an integer", field,
                               absl::CHexEscape(std::string(start, q).substr(0, 32)));
      return false;
    }
    int64_t v = 0;
    while (p < end && *p >= '0' && *p <= '9') {
      if (v > (INT64_MAX - 9) / 10) {
        *error = absl::StrFormat("field %d is too large", field);
        return false;
      }
      v = v * 10 + (*p - '0');
      ++p;
    }
    if (p < end && !IsSpace(*p) && !(comma && *p == ',')) {
      const char* q = p;
      while (q < end && !IsSpace(*q) && *q != ',') ++q;
      *error = absl::StrFormat("field %d ('%s') is not an integer", field,
                               absl::CHexEscape(std::string(start, q).substr(0, 32)));
      return false;
    }
    if (negative && v != 0) {
      *error = absl::StrFormat("field %d is negative (-%d)", field, v);
      return false;
    }
    out->push_back(v);
    skip_space();
    if (p == end) return true;
    if (comma) {
      if (*p != ',') {
        *error = absl::StrFormat("field %d is followed by '%s', expected ','", field,
                                 absl::CHexEscape(std::string(1, *p)));
        return false;
      }
      ++p;
      skip_space();
      if (p == end) {
        *error = absl::StrFormat("field %d is empty (trailing comma)", field + 1);
        return false;
      }
    }
  }
}

bool IsBlankOrComment(const char* s, size_t n) {
  size_t i = 0;
  while (i < n && IsSpace(s[i])) ++i;
  return i == n || s[i] == '#';
}

// The header's fields after its version: R=, E= and K= (K optional), each at most once, each a
// decimal number up to INT32_MAX. Absent ones are -1. Anything else is an error naming the field.
absl::Status ParseHeaderFields(absl::string_view fields, int64_t* R, int64_t* E, int64_t* K) {
  *R = *E = *K = -1;
  for (absl::string_view field : absl::StrSplit(fields, absl::ByAnyChar(" \t"), absl::SkipEmpty())) {
    const size_t eq = field.find('=');
    const absl::string_view key = field.substr(0, eq);
    int64_t* out = key == "R" ? R : key == "E" ? E : key == "K" ? K : nullptr;
    if (eq == absl::string_view::npos || out == nullptr) {
      return InvalidArgument("header field '%s' is none of R=, E=, K=",
                             absl::CHexEscape(field.substr(0, 32)));
    }
    if (*out != -1) return InvalidArgument("header gives %s= twice", key);
    const absl::string_view value = field.substr(eq + 1);
    int64_t v = 0;
    for (char c : value) {
      if (c < '0' || c > '9') {
        return InvalidArgument("header %s='%s' is not a decimal number", key,
                               absl::CHexEscape(value.substr(0, 32)));
      }
      v = std::min<int64_t>(v * 10 + (c - '0'), int64_t{INT32_MAX} + 1);
    }
    if (value.empty()) return InvalidArgument("header %s= has no value", key);
    if (v > INT32_MAX) return InvalidArgument("header %s= is above %d", key, INT32_MAX);
    *out = v;
  }
  return absl::OkStatus();
}

// The planner's bound on one step's counts: each below 2^52, summing to at most 2^52 (so no sum
// over a record overflows). `first_field` numbers counts[0] among the line's fields; `sum` runs
// over the lines of one record.
constexpr int64_t kMaxTokens = int64_t{1} << 52;

bool CheckCounts(const int64_t* counts, size_t n, size_t first_field, int64_t* sum,
                 std::string* error) {
  for (size_t i = 0; i < n; ++i) {
    if (counts[i] >= kMaxTokens) {
      *error = absl::StrFormat("field %d (%d) is not below 2^52", first_field + i, counts[i]);
      return false;
    }
    *sum += counts[i];  // both below 2^52: no overflow
    if (*sum > kMaxTokens) {
      *error = absl::StrFormat("the counts of one step sum past 2^52 (at field %d)", first_field + i);
      return false;
    }
  }
  return true;
}

}  // namespace

TraceReader::~TraceReader() {
  if (file_) std::fclose(file_);
  std::free(line_);
}

void TraceReader::SetMaxLine(int64_t integers) {
  max_line_ = std::max(kMinTraceLineBound,
                       static_cast<size_t>(integers + 2) * kMaxTraceBytesPerInteger + 4096);
}

absl::StatusOr<bool> TraceReader::ReadLine() {
  // getc_unlocked, not getline: a line's length is bounded (max_line_), its buffer's growth is
  // checked against free memory, and a failed read or allocation is an error, never the end.
  size_t n = 0;
  int ch = 0;
  errno = 0;
  while ((ch = getc_unlocked(file_)) != EOF) {
    // Past max_line_ bytes only the line end may follow: "\n", or "\r\n" right at the bound. (The
    // buffer may be larger than the bound: an earlier line's bound was.)
    if (n >= max_line_ && ch != '\n' && !(ch == '\r' && n == max_line_)) {
      return InvalidArgument("trace '%s': line %d is longer than %d bytes (without its line end), "
                             "the most %s", path_, line_number_ + 1, max_line_,
                             num_experts_ > 0 ? "a line of a trace of these sizes may hold"
                                              : "a header or a first CSV row may hold");
    }
    if (n + 1 >= line_capacity_) {  // room for this byte and a terminating NUL
      // The bound, a line end of two bytes and the NUL.
      const size_t want = std::min(max_line_ + 3, std::max<size_t>(4096, 2 * line_capacity_));
      MOONEP_RETURN_IF_ERROR(CheckHostAllocation(
          want - line_capacity_, absl::StrFormat("line %d of trace '%s'", line_number_ + 1, path_)));
      char* grown = static_cast<char*>(std::realloc(line_, want));
      if (grown == nullptr) {
        return OutOfMemory("trace '%s': no memory for line %d (%d bytes)", path_,
                           line_number_ + 1, want);
      }
      line_ = grown;
      line_capacity_ = want;
    }
    line_[n++] = static_cast<char>(ch);
    if (ch == '\n') break;
  }
  if (ch == EOF && std::ferror(file_)) {
    // A read error (a directory, EISDIR, or EIO) must not pass for a shorter trace.
    return InvalidArgument("cannot read trace '%s' after line %d: %s", path_, line_number_,
                           std::strerror(errno != 0 ? errno : EIO));
  }
  if (n == 0) return false;
  line_[n] = '\0';
  line_length_ = n;
  terminated_ = line_length_ > 0 && line_[line_length_ - 1] == '\n';
  if (line_number_ == 0 && line_length_ >= 3 && std::memcmp(line_, "\xEF\xBB\xBF", 3) == 0) {
    // A UTF-8 byte order mark (spreadsheets write one) is not part of the first line.
    std::memmove(line_, line_ + 3, line_length_ - 3);
    line_length_ -= 3;
  }
  while (line_length_ > 0 && (line_[line_length_ - 1] == '\n' || line_[line_length_ - 1] == '\r')) {
    --line_length_;
  }
  ++line_number_;
  return true;
}

absl::StatusOr<bool> TraceReader::NextDataLine() {
  if (pending_) {
    pending_ = false;
    return true;
  }
  while (true) {
    MOONEP_ASSIGN_OR_RETURN(const bool got, ReadLine());
    if (!got) return false;
    if (!IsBlankOrComment(line_, line_length_)) return true;
  }
}

absl::Status TraceReader::LineError(const std::string& what) const {
  return InvalidArgument("%s:%d: %s", path_, line_number_, what);
}

absl::Status TraceReader::CheckRecordMemory(const std::string& sizes) const {
  // The record's counts, and its line's integers parsed before them.
  return CheckHostAllocation(static_cast<uint64_t>(num_ranks_) * num_experts_ * 2 * sizeof(int64_t),
                             absl::StrFormat("one record of trace '%s' (%s)", path_, sizes));
}

absl::StatusOr<std::unique_ptr<TraceReader>> TraceReader::Open(const std::string& path,
                                                               TraceFormat format,
                                                               int32_t csv_ranks, int32_t topk) {
  MOONEP_CHECK_ARG(!path.empty(), "trace path is empty");
  MOONEP_CHECK_ARG(topk >= 0, "topk must be >= 0, got %d", topk);
  std::unique_ptr<TraceReader> r(new TraceReader());
  r->path_ = path;
  r->file_ = std::fopen(path.c_str(), "r");
  if (!r->file_) {
    return InvalidArgument("cannot open trace '%s': %s", path, std::strerror(errno));
  }
  struct stat st;
  if (::fstat(::fileno(r->file_), &st) != 0) {
    return InvalidArgument("cannot read trace '%s': %s", path, std::strerror(errno));
  }
  if (S_ISDIR(st.st_mode)) return InvalidArgument("cannot read trace '%s': %s", path, std::strerror(EISDIR));
  // First non-blank line decides the format (and holds the moonep header).
  bool got = false;
  while (true) {
    MOONEP_ASSIGN_OR_RETURN(got, r->ReadLine());
    if (!got) break;
    size_t i = 0;
    while (i < r->line_length_ && IsSpace(r->line_[i])) ++i;
    if (i < r->line_length_) break;
  }
  if (!got) return InvalidArgument("trace '%s' is empty", path);
  const std::string first(r->line_, r->line_length_);
  const bool moonep_header = first.rfind("# moonep-trace", 0) == 0;
  if (format == TraceFormat::kAuto) format = moonep_header ? TraceFormat::kMoonEP : TraceFormat::kCsv;
  r->format_ = format;
  if (format == TraceFormat::kMoonEP) {
    if (!moonep_header) {
      return r->LineError("expected the header '# moonep-trace v1 R=<ranks> E=<experts> [K=<topk>]'");
    }
    // "# moonep-trace " then the version up to the next space.
    const std::string version =
        first.size() > 15 && first[14] == ' ' ? first.substr(15, first.find(' ', 15) - 15) : "";
    if (version != "v1") {
      return r->LineError(absl::StrCat("unsupported trace version '", absl::CHexEscape(version),
                                       "' (this reader knows v1)"));
    }
    int64_t R = -1, E = -1, K = -1;
    const absl::Status fields =
        ParseHeaderFields(absl::string_view(first).substr(15 + version.size()), &R, &E, &K);
    if (!fields.ok()) return r->LineError(std::string(fields.message()));
    if (R <= 0) return r->LineError("header needs R=<ranks> with ranks > 0");
    if (E <= 0) return r->LineError("header needs E=<experts> with experts > 0");
    if (K == 0 || K > E) return r->LineError("header K=<topk> must be in [1, E]");
    if (R * E > kMaxTraceCounts) {
      return r->LineError(absl::StrFormat("header R=%d E=%d: R*E = %d counts a record is above %d",
                                          R, E, R * E, kMaxTraceCounts));
    }
    r->num_ranks_ = static_cast<int32_t>(R);
    r->num_experts_ = static_cast<int32_t>(E);
    r->SetMaxLine(R * E);
    r->topk_ = K > 0 ? static_cast<int32_t>(K) : topk;
    if (K > 0 && topk > 0 && K != topk) {
      return r->LineError(absl::StrFormat("header says K=%d but --topk is %d", K, topk));
    }
    if (r->topk_ > E) {
      return r->LineError(absl::StrFormat("--topk (%d) is above the header's E=%d", topk, E));
    }
    // A header and nothing else is a trace of no records (the simulator says so). Anything after
    // it must hold a record: R*E + 2 integers of a digit or more, a space between two, a newline.
    // A header that no record in the file can match is the error, named before any reading.
    const std::string sizes = absl::StrFormat("the header's R=%d E=%d", R, E);
    const int64_t left = st.st_size - std::ftell(r->file_), min_bytes = 2 * (R * E + 2);
    if (S_ISREG(st.st_mode) && left > 0 && left < min_bytes) {
      return r->LineError(absl::StrFormat("%s make records of at least %d bytes, but the file has "
                                          "%d bytes after the header: no record fits", sizes,
                                          min_bytes, left));
    }
    MOONEP_RETURN_IF_ERROR(r->CheckRecordMemory(sizes));
    return r;
  }
  // CSV: R from the caller, E from the first data line (a non-numeric first line is a header).
  MOONEP_CHECK_ARG(csv_ranks > 0, "a CSV trace needs the number of source ranks (--ranks), got %d",
                   csv_ranks);
  r->num_ranks_ = csv_ranks;
  r->topk_ = topk;
  // The first line that is neither blank nor a comment is data, or a header when its first field
  // is not a number (an optional sign, then a digit: "-1,..." is data, and an error below).
  if (IsBlankOrComment(r->line_, r->line_length_)) {
    MOONEP_ASSIGN_OR_RETURN(got, r->NextDataLine());
    if (!got) return InvalidArgument("trace '%s' has no counts", path);
  }
  size_t i = 0;
  while (i < r->line_length_ && IsSpace(r->line_[i])) ++i;
  if (i < r->line_length_ && (r->line_[i] == '-' || r->line_[i] == '+')) ++i;
  const bool header = !(i < r->line_length_ && r->line_[i] >= '0' && r->line_[i] <= '9');
  if (header) {
    MOONEP_ASSIGN_OR_RETURN(got, r->NextDataLine());
    if (!got) return InvalidArgument("trace '%s' has a header but no counts", path);
  }
  std::string error;
  if (!ParseFields(r->line_, r->line_ + r->line_length_, /*comma=*/true, &r->fields_, &error)) {
    return r->LineError(error);
  }
  const int64_t R = csv_ranks, E = static_cast<int64_t>(r->fields_.size());
  r->num_experts_ = static_cast<int32_t>(E);
  r->SetMaxLine(E);
  if (R * E > kMaxTraceCounts) {
    return r->LineError(absl::StrFormat("--ranks=%d rows of %d counts: R*E = %d counts a step is "
                                        "above %d", R, E, R * E, kMaxTraceCounts));
  }
  if (topk > r->num_experts_) {
    return r->LineError(absl::StrFormat("--topk (%d) is above the experts on this row (%d)", topk,
                                        r->num_experts_));
  }
  // A step's rows are read one by one (a --ranks above the file's rows costs what they hold),
  // which errors name better than a check of sizes ahead.
  MOONEP_RETURN_IF_ERROR(r->CheckRecordMemory(absl::StrFormat("--ranks=%d rows of E=%d counts", R, E)));
  r->pending_ = true;
  return r;
}

absl::StatusOr<bool> TraceReader::Next(TraceRecord* record) {
  const int32_t R = num_ranks_, E = num_experts_;
  std::string error;
  // Counts are stored once a line has proved to hold them, never sized from the header or
  // --ranks ahead of it: a bad size then costs what the file holds, not R*E.
  if (format_ == TraceFormat::kMoonEP) {
    MOONEP_ASSIGN_OR_RETURN(const bool got, NextDataLine());
    if (!got) return false;
    if (!terminated_) {
      // The writer ends every record with a newline, so this is a record cut short by a crash or
      // a full disk. It may even parse (a count cut in its middle): it is not replayed.
      warning_ = absl::StrFormat("%s:%d: the last line has no newline: a record cut short "
                                 "(a crash or a full disk), skipped", path_, line_number_);
      return false;
    }
    if (!ParseFields(line_, line_ + line_length_, /*comma=*/false, &fields_, &error)) {
      return LineError(error);
    }
    const size_t need = static_cast<size_t>(R) * E + 2;
    if (fields_.size() != need) {
      return LineError(absl::StrFormat(
          "expected %d integers (step, layer, then R*E = %d*%d counts), got %d", need, R, E,
          fields_.size()));
    }
    if (fields_[1] > INT32_MAX) return LineError("layer is too large");
    int64_t sum = 0;
    if (!CheckCounts(fields_.data() + 2, fields_.size() - 2, 3, &sum, &error)) return LineError(error);
    record->step = fields_[0];
    record->layer = static_cast<int32_t>(fields_[1]);
    record->counts.assign(fields_.begin() + 2, fields_.end());
    return true;
  }
  // CSV: R consecutive data lines form one step.
  record->counts.clear();
  int64_t sum = 0;
  for (int32_t row = 0; row < R; ++row) {
    MOONEP_ASSIGN_OR_RETURN(const bool got, NextDataLine());
    if (!got) {
      if (row == 0) return false;
      return InvalidArgument("%s:%d: file ends after %d of the %d rows of step %d", path_,
                             line_number_, row, R, csv_records_);
    }
    if (!ParseFields(line_, line_ + line_length_, /*comma=*/true, &fields_, &error)) {
      return LineError(error);
    }
    if (static_cast<int32_t>(fields_.size()) != E) {
      return LineError(absl::StrFormat("expected %d counts (one per expert, as on the first row), got %d",
                                       E, fields_.size()));
    }
    if (!CheckCounts(fields_.data(), fields_.size(), 1, &sum, &error)) return LineError(error);
    record->counts.insert(record->counts.end(), fields_.begin(), fields_.end());
  }
  record->step = csv_records_++;
  record->layer = 0;
  return true;
}

absl::StatusOr<bool> TraceReader::AtEnd() {
  MOONEP_ASSIGN_OR_RETURN(const bool got, NextDataLine());
  pending_ = got;
  // A moonep trace's cut last line is no record (Next skips it).
  return !got || (format_ == TraceFormat::kMoonEP && !terminated_);
}

std::string FormatTraceHeader(int32_t num_ranks, int32_t num_experts, int32_t topk) {
  if (topk > 0) return absl::StrFormat("# moonep-trace v1 R=%d E=%d K=%d\n", num_ranks, num_experts, topk);
  return absl::StrFormat("# moonep-trace v1 R=%d E=%d\n", num_ranks, num_experts);
}

std::string FormatTraceRecord(int64_t step, int32_t layer, absl::Span<const int64_t> counts) {
  std::string out = absl::StrCat(step, " ", layer);
  out.reserve(out.size() + counts.size() * 4 + 1);
  for (int64_t c : counts) absl::StrAppend(&out, " ", c);
  out.push_back('\n');
  return out;
}

}  // namespace moonep::sim
