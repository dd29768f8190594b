// The runtime's MOONEP_TRACE writer against the simulator's reader: a FIFO or a device is written
// without ever being read (reading one hung the job), an existing trace is continued only at its
// shape, a partial last record left by a crash or a full disk is cut off instead of merged with
// the next, and a header that cannot be written is an error.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "moonep/runtime/trace_writer.h"
#include "planner/sim/trace.h"

namespace moonep::runtime {
namespace {

const std::vector<int64_t> kA = {10, 6, 2, 2, 9, 7, 2, 2}, kB = {1, 1, 5, 5, 1, 1, 6, 4};
const std::string kHeader = "# moonep-trace v1 R=2 E=4 K=2\n";

std::string TempPath(const std::string& name) {
  const std::string path = ::testing::TempDir() + "/" + std::to_string(::getpid()) + "_" + name;
  std::remove(path.c_str());
  return path;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Every record the simulator's reader takes from `path`; it must read without error.
std::vector<sim::TraceRecord> Replay(const std::string& path) {
  std::vector<sim::TraceRecord> out;
  auto reader = sim::TraceReader::Open(path, sim::TraceFormat::kMoonEP, 0, 0);
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return out;
  sim::TraceRecord r;
  while (true) {
    auto got = (*reader)->Next(&r);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok() || !*got) break;
    out.push_back(r);
  }
  EXPECT_EQ((*reader)->warning(), "") << path;
  return out;
}

absl::Status Append(TraceWriter* w, int64_t step, const std::vector<int64_t>& counts) {
  return w->Append(step, 0, 2, 4, 2, counts);
}

// The writer only ever writes a FIFO: the test holds the reading end (non-blocking, so that
// nothing here can wait), and finds the header and both records in it.
TEST(TraceWriterTest, WritesAFifoWithoutReadingIt) {
  const std::string path = TempPath("trace.fifo");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  const int in = ::open(path.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(in, 0) << std::strerror(errno);
  {
    TraceWriter w(path);
    ASSERT_TRUE(Append(&w, 0, kA).ok());
    ASSERT_TRUE(Append(&w, 1, kB).ok());
    EXPECT_EQ(w.records(), 2);
  }
  char buffer[4096];
  const ssize_t n = ::read(in, buffer, sizeof(buffer));
  ::close(in);
  ASSERT_GT(n, 0) << std::strerror(errno);
  EXPECT_EQ(std::string(buffer, static_cast<size_t>(n)),
            kHeader + "0 0 10 6 2 2 9 7 2 2\n1 0 1 1 5 5 1 1 6 4\n");
  // Nobody reading: an error at once (ENXIO), where a blocking open would wait for a reader.
  TraceWriter nobody(path);
  const absl::Status status = Append(&nobody, 0, kA);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("cannot open " + path), std::string::npos) << status;
  std::remove(path.c_str());
}

// A device (here through a symlink, as /dev/stdout is one) gets a header and the records; it is
// not a file with a header to read back.
TEST(TraceWriterTest, WritesADeviceThroughASymlink) {
  const std::string link = TempPath("null.link");
  ASSERT_EQ(::symlink("/dev/null", link.c_str()), 0) << std::strerror(errno);
  for (int run = 0; run < 2; ++run) {
    TraceWriter w(link);
    ASSERT_TRUE(Append(&w, 0, kA).ok());
    ASSERT_TRUE(Append(&w, 1, kB).ok());
    EXPECT_EQ(w.records(), 2);
  }
  struct stat st;
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  std::remove(link.c_str());
}

TEST(TraceWriterTest, ContinuesATraceOfItsShape) {
  const std::string path = TempPath("continue.trace");
  {
    TraceWriter w(path);
    ASSERT_TRUE(Append(&w, 0, kA).ok());
  }
  {
    TraceWriter w(path);
    ASSERT_TRUE(Append(&w, 1, kB).ok());
  }
  EXPECT_EQ(ReadFile(path), kHeader + "0 0 10 6 2 2 9 7 2 2\n1 0 1 1 5 5 1 1 6 4\n");
  // Another shape, or a file that is no trace, is refused and left alone.
  TraceWriter other(path);
  absl::Status status = other.Append(0, 0, 1, 8, 2, kA);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("another shape ('# moonep-trace v1 R=2 E=4 K=2')"), std::string::npos)
      << status;
  const std::string notes = TempPath("notes.txt");
  WriteFile(notes, "my notes\nmore notes");
  TraceWriter not_trace(notes);
  status = Append(&not_trace, 0, kA);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("is not a moonep trace (its first line is 'my notes')"),
            std::string::npos) << status;
  EXPECT_EQ(ReadFile(notes), "my notes\nmore notes");
  std::remove(path.c_str());
  std::remove(notes.c_str());
}

// A record or header cut short (a crash, a full disk) is cut off before the next append, which
// then starts on a line of its own; the reader takes every record whole.
TEST(TraceWriterTest, CutsOffAPartialLastLineBeforeAppending) {
  const std::string path = TempPath("partial.trace");
  WriteFile(path, kHeader + "0 0 10 6 2 2 9 7 2 2\n0 1 1 1 5");
  {
    TraceWriter w(path);
    ASSERT_TRUE(Append(&w, 1, kB).ok());
  }
  EXPECT_EQ(ReadFile(path), kHeader + "0 0 10 6 2 2 9 7 2 2\n1 0 1 1 5 5 1 1 6 4\n");
  const std::vector<sim::TraceRecord> records = Replay(path);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].counts, kA);
  EXPECT_EQ(records[1].counts, kB);
  // Only part of the header (the file once read as "another shape" than its own header).
  for (const std::string& cut : {kHeader.substr(0, kHeader.size() - 1), kHeader.substr(0, 9)}) {
    WriteFile(path, cut);
    TraceWriter w(path);
    ASSERT_TRUE(Append(&w, 0, kA).ok()) << cut;
    EXPECT_EQ(ReadFile(path), kHeader + "0 0 10 6 2 2 9 7 2 2\n") << cut;
  }
  std::remove(path.c_str());
}

// RLIMIT_FSIZE makes writes past `bytes` fail (EFBIG) while it is held.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &old_);
    old_signal_ = ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit = {bytes, old_.rlim_max};
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_signal_);
  }

 private:
  rlimit old_;
  sighandler_t old_signal_;
};

// A header that cannot be written is an error (MoeLayer then warns and stops tracing), as a record
// is; what the full disk left is repaired by the next writer.
TEST(TraceWriterTest, WriteErrorsAreErrorsAndTheNextWriterRepairs) {
  const std::string path = TempPath("full.trace");
  {
    FileSizeLimit limit(10);
    TraceWriter w(path);
    const absl::Status status = Append(&w, 0, kA);
    EXPECT_NE(status.message().find("writing the header to " + path + " failed: File too large"),
              std::string::npos) << status;
    EXPECT_EQ(w.records(), 0);
  }
  EXPECT_EQ(ReadFile(path), kHeader.substr(0, 10));
  {
    FileSizeLimit limit(kHeader.size() + 26);  // the header, one record, part of the next
    TraceWriter w(path);
    ASSERT_TRUE(Append(&w, 0, kA).ok());
    const absl::Status status = Append(&w, 1, kB);
    EXPECT_NE(status.message().find("write to " + path + " failed: File too large"), std::string::npos)
        << status;
  }
  EXPECT_EQ(ReadFile(path), kHeader + "0 0 10 6 2 2 9 7 2 2\n1 0 1");
  {
    TraceWriter w(path);
    ASSERT_TRUE(Append(&w, 1, kB).ok());
  }
  const std::vector<sim::TraceRecord> records = Replay(path);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[1].step, 1);
  EXPECT_EQ(records[1].counts, kB);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace moonep::runtime
