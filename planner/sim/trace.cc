#include "planner/sim/trace.h"

#include <sys/types.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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
                               std::string(start, q).substr(0, 32));
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
                               std::string(start, q).substr(0, 32));
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
        *error = absl::StrFormat("field %d is followed by '%c', expected ','", field, *p);
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

// Reads "KEY=<int>" from a header; -1 when absent, -2 when malformed.
int64_t HeaderValue(const std::string& header, const std::string& key) {
  const std::string needle = " " + key + "=";
  const size_t at = header.find(needle);
  if (at == std::string::npos) return -1;
  const char* p = header.c_str() + at + needle.size();
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(p, &end, 10);
  if (end == p || errno != 0 || v < 0 || v > INT32_MAX || (*end && !IsSpace(*end))) return -2;
  return v;
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

bool TraceReader::ReadLine() {
  const ssize_t n = ::getline(&line_, &line_capacity_, file_);
  if (n < 0) return false;
  line_length_ = static_cast<size_t>(n);
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

absl::Status TraceReader::LineError(const std::string& what) const {
  return InvalidArgument("%s:%d: %s", path_, line_number_, what);
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
  // First non-blank line decides the format (and holds the moonep header).
  bool got = false;
  while ((got = r->ReadLine())) {
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
    const std::string version = first.size() > 15 ? first.substr(15, first.find(' ', 15) - 15) : "";
    if (version != "v1") {
      return r->LineError(absl::StrCat("unsupported trace version '", version,
                                       "' (this reader knows v1)"));
    }
    const int64_t R = HeaderValue(first, "R"), E = HeaderValue(first, "E"), K = HeaderValue(first, "K");
    if (R <= 0) return r->LineError("header needs R=<ranks> with ranks > 0");
    if (E <= 0) return r->LineError("header needs E=<experts> with experts > 0");
    if (K == -2 || K == 0 || K > E) return r->LineError("header K=<topk> must be in [1, E]");
    if (static_cast<int64_t>(R) * E > (int64_t{1} << 31)) {
      return r->LineError("R*E is too large for one record");
    }
    r->num_ranks_ = static_cast<int32_t>(R);
    r->num_experts_ = static_cast<int32_t>(E);
    r->topk_ = K > 0 ? static_cast<int32_t>(K) : topk;
    if (K > 0 && topk > 0 && K != topk) {
      return r->LineError(absl::StrFormat("header says K=%d but --topk is %d", K, topk));
    }
    if (r->topk_ > E) {
      return r->LineError(absl::StrFormat("--topk (%d) is above the header's E=%d", topk, E));
    }
    return r;
  }
  // CSV: R from the caller, E from the first data line (a non-numeric first line is a header).
  MOONEP_CHECK_ARG(csv_ranks > 0, "a CSV trace needs the number of source ranks (--ranks), got %d",
                   csv_ranks);
  r->num_ranks_ = csv_ranks;
  r->topk_ = topk;
  // The first line that is neither blank nor a comment is data, or a header when its first field
  // is not a number (an optional sign, then a digit: "-1,..." is data, and an error below).
  auto skip_comments = [&r]() {
    bool more = true;
    while (IsBlankOrComment(r->line_, r->line_length_) && (more = r->ReadLine())) {
    }
    return more;
  };
  if (!skip_comments()) return InvalidArgument("trace '%s' has no counts", path);
  size_t i = 0;
  while (i < r->line_length_ && IsSpace(r->line_[i])) ++i;
  if (i < r->line_length_ && (r->line_[i] == '-' || r->line_[i] == '+')) ++i;
  const bool header = !(i < r->line_length_ && r->line_[i] >= '0' && r->line_[i] <= '9');
  if (header && !(r->ReadLine() && skip_comments())) {
    return InvalidArgument("trace '%s' has a header but no counts", path);
  }
  std::vector<int64_t> fields;
  std::string error;
  if (!ParseFields(r->line_, r->line_ + r->line_length_, /*comma=*/true, &fields, &error)) {
    return r->LineError(error);
  }
  r->num_experts_ = static_cast<int32_t>(fields.size());
  if (topk > r->num_experts_) {
    return r->LineError(absl::StrFormat("--topk (%d) is above the experts on this row (%d)", topk,
                                        r->num_experts_));
  }
  r->pending_ = true;
  return r;
}

absl::StatusOr<bool> TraceReader::Next(TraceRecord* record) {
  const int32_t R = num_ranks_, E = num_experts_;
  std::string error;
  std::vector<int64_t> fields;
  if (format_ == TraceFormat::kMoonEP) {
    do {
      if (!ReadLine()) return false;
    } while (IsBlankOrComment(line_, line_length_));
    record->counts.resize(static_cast<size_t>(R) * E);
    if (!ParseFields(line_, line_ + line_length_, /*comma=*/false, &fields, &error)) {
      return LineError(error);
    }
    const size_t need = static_cast<size_t>(R) * E + 2;
    if (fields.size() != need) {
      return LineError(absl::StrFormat(
          "expected %d integers (step, layer, then R*E = %d*%d counts), got %d", need, R, E,
          fields.size()));
    }
    if (fields[1] > INT32_MAX) return LineError("layer is too large");
    int64_t sum = 0;
    if (!CheckCounts(fields.data() + 2, fields.size() - 2, 3, &sum, &error)) return LineError(error);
    record->step = fields[0];
    record->layer = static_cast<int32_t>(fields[1]);
    std::copy(fields.begin() + 2, fields.end(), record->counts.begin());
    return true;
  }
  // CSV: R consecutive data lines form one step.
  record->counts.resize(static_cast<size_t>(R) * E);
  int64_t sum = 0;
  for (int32_t row = 0; row < R; ++row) {
    if (!pending_) {
      bool got;
      while ((got = ReadLine()) && IsBlankOrComment(line_, line_length_)) {
      }
      if (!got) {
        if (row == 0) return false;
        return InvalidArgument("%s:%d: file ends after %d of the %d rows of step %d", path_,
                               line_number_, row, R, csv_records_);
      }
    }
    pending_ = false;
    if (!ParseFields(line_, line_ + line_length_, /*comma=*/true, &fields, &error)) {
      return LineError(error);
    }
    if (static_cast<int32_t>(fields.size()) != E) {
      return LineError(absl::StrFormat("expected %d counts (one per expert, as on the first row), got %d",
                                       E, fields.size()));
    }
    if (!CheckCounts(fields.data(), fields.size(), 1, &sum, &error)) return LineError(error);
    std::copy(fields.begin(), fields.end(), record->counts.begin() + static_cast<size_t>(row) * E);
  }
  record->step = csv_records_++;
  record->layer = 0;
  return true;
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
