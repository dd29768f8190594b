#include "moonep/runtime/trace_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "moonep/core/logging.h"
#include "moonep/core/status.h"

namespace moonep::runtime {

std::string TraceHeader(int32_t num_ranks, int32_t num_experts, int32_t top_k) {
  return absl::StrFormat("# moonep-trace v1 R=%d E=%d K=%d\n", num_ranks, num_experts, top_k);
}

namespace {

// write(2) until all of `data` is out; errno is set on failure. A regular file takes it in one
// call, so O_APPEND appends a record whole.
bool WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// Up to `size` bytes of `fd` at `offset` (fewer at the end of the file); false on a read error.
bool ReadAt(int fd, int64_t offset, size_t size, std::string* out) {
  out->resize(size);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, out->data() + done, size - done, offset + static_cast<int64_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  out->resize(done);
  return true;
}

// Closes a descriptor when it goes out of scope.
struct ScopedFd {
  int fd;
  ~ScopedFd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

TraceWriter::~TraceWriter() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<int64_t> TraceWriter::Continue(int64_t size, const std::string& header) {
  // Read through a second, non-blocking descriptor (the first is write-only); it must reach the
  // file that was opened for appending, not one put at the path in between.
  ScopedFd in{::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)};
  struct stat appended, reread;
  if (in.fd < 0 || ::fstat(in.fd, &reread) != 0 || ::fstat(fd_, &appended) != 0) {
    return SystemError("MOONEP_TRACE: cannot read back the header of %s: %s", path_,
                       std::strerror(errno));
  }
  if (reread.st_dev != appended.st_dev || reread.st_ino != appended.st_ino) {
    return SystemError("MOONEP_TRACE: %s was replaced while it was opened", path_);
  }
  std::string head;
  if (!ReadAt(in.fd, 0, std::min<int64_t>(size, 256), &head)) {
    return SystemError("MOONEP_TRACE: cannot read back the header of %s: %s", path_,
                       std::strerror(errno));
  }
  const size_t newline = head.find('\n');
  if (newline == std::string::npos && head.size() < header.size() &&
      absl::StartsWith(header, head)) {
    // A header cut short (by a crash or a full disk, before any record): start the file again.
    MOONEP_WARN("MOONEP_TRACE: %s holds only part of a header ('%s'); writing it again", path_,
                absl::CHexEscape(head));
    if (::ftruncate(fd_, 0) != 0) {
      return SystemError("MOONEP_TRACE: cannot truncate %s: %s", path_, std::strerror(errno));
    }
    return 0;
  }
  const absl::string_view first = absl::string_view(head).substr(0, newline);
  if (newline == std::string::npos || head.compare(0, newline + 1, header) != 0) {
    const std::string shown = absl::CHexEscape(first.substr(0, 80));
    const absl::string_view wanted = absl::StripTrailingAsciiWhitespace(header);
    if (!absl::StartsWith(first, "# moonep-trace")) {
      return InvalidArgument("MOONEP_TRACE: %s is not a moonep trace (its first line is '%s'); this "
                             "job writes '%s'", path_, shown, wanted);
    }
    return InvalidArgument(
        "MOONEP_TRACE: %s already holds a trace of another shape ('%s'); this job writes '%s'",
        path_, shown, wanted);
  }
  // A last line without a newline is a record cut short: appending to it would merge it with
  // the next record. Cut it off, back to the last newline (at worst the header's).
  std::string tail;
  if (!ReadAt(in.fd, size - 1, 1, &tail)) {
    return SystemError("MOONEP_TRACE: cannot read %s: %s", path_, std::strerror(errno));
  }
  if (tail == "\n") return size;
  int64_t end = size;
  constexpr int64_t kChunk = 1 << 20;
  while (true) {
    const int64_t from = std::max<int64_t>(end - kChunk, 0);
    if (!ReadAt(in.fd, from, static_cast<size_t>(end - from), &tail)) {
      return SystemError("MOONEP_TRACE: cannot read %s: %s", path_, std::strerror(errno));
    }
    const size_t last = tail.rfind('\n');
    if (last != std::string::npos) {
      end = from + static_cast<int64_t>(last) + 1;
      break;
    }
    end = from;
  }
  MOONEP_WARN("MOONEP_TRACE: %s ends in a partial record (%d bytes after its last newline, left by "
              "a crash or a full disk); cutting it off before appending", path_, size - end);
  if (::ftruncate(fd_, end) != 0) {
    return SystemError("MOONEP_TRACE: cannot truncate %s: %s", path_, std::strerror(errno));
  }
  return end;
}

absl::Status TraceWriter::Open(int32_t num_ranks, int32_t num_experts, int32_t top_k) {
  const std::string header = TraceHeader(num_ranks, num_experts, top_k);
  // Opened for appending only: reading a FIFO, a terminal or /dev/stdout (a pipe under mpirun)
  // waits for someone to write to it, which stalled rank 0 and, in the next collective, the whole
  // job. O_NONBLOCK makes a FIFO without a reader an error (ENXIO) instead of a wait; it is
  // cleared right away, so that writes wait for a slow reader as usual.
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0666);
  if (fd_ < 0) {
    return SystemError("MOONEP_TRACE: cannot open %s for appending: %s", path_, std::strerror(errno));
  }
  absl::Status status = [&]() -> absl::Status {
    const int flags = ::fcntl(fd_, F_GETFL);
    struct stat st;
    if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0 || ::fstat(fd_, &st) != 0) {
      return SystemError("MOONEP_TRACE: cannot open %s for appending: %s", path_,
                         std::strerror(errno));
    }
    // Only a regular file has a header to read back; anything else gets one of its own.
    int64_t size = 0;
    if (S_ISREG(st.st_mode) && st.st_size > 0) {
      MOONEP_ASSIGN_OR_RETURN(size, Continue(st.st_size, header));
    }
    if (size == 0 && !WriteAll(fd_, header)) {
      return SystemError("MOONEP_TRACE: writing the header to %s failed: %s", path_,
                         std::strerror(errno));
    }
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    ::close(fd_);
    fd_ = -1;
    return status;
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
  if (fd_ < 0) {
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
  if (!WriteAll(fd_, line_)) {
    return SystemError("MOONEP_TRACE: write to %s failed: %s", path_, std::strerror(errno));
  }
  ++records_;
  return absl::OkStatus();
}

}  // namespace moonep::runtime
