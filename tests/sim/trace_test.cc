// Trace reading: round trips of both formats, malformed files rejected naming the line, a cut
// last record skipped, and sizes no record can match refused before anything is allocated.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/sim/trace.h"

namespace moonep::sim {
namespace {

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

std::vector<TraceRecord> ReadAll(TraceReader* reader) {
  std::vector<TraceRecord> out;
  TraceRecord r;
  while (true) {
    auto got = reader->Next(&r);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok() || !*got) break;
    out.push_back(r);
  }
  return out;
}

TEST(TraceTest, MoonEPRoundTrip) {
  const std::vector<int64_t> a = {1, 2, 3, 4, 5, 6, 7, 8}, b = {0, 0, 9, 1, 2, 3, 4, 5};
  std::string text = FormatTraceHeader(2, 4, 2);
  EXPECT_EQ(text, "# moonep-trace v1 R=2 E=4 K=2\n");
  text += FormatTraceRecord(0, 0, a) + "\n# a comment\n" + FormatTraceRecord(0, 1, b);
  text += FormatTraceRecord(1, 0, b);
  auto reader = TraceReader::Open(WriteFile("rt.trace", text), TraceFormat::kAuto, 0, 0);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->format(), TraceFormat::kMoonEP);
  EXPECT_EQ((*reader)->num_ranks(), 2);
  EXPECT_EQ((*reader)->num_experts(), 4);
  EXPECT_EQ((*reader)->topk(), 2);
  const std::vector<TraceRecord> recs = ReadAll(reader->get());
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0].counts, a);
  EXPECT_EQ(recs[1].layer, 1);
  EXPECT_EQ(recs[1].counts, b);
  EXPECT_EQ(recs[2].step, 1);
}

TEST(TraceTest, CsvRoundTrip) {
  const std::string text = "e0,e1,e2\n1,2,3\n4, 5 ,6\n\n7,8,9\n10,11,12\n";
  auto reader = TraceReader::Open(WriteFile("rt.csv", text), TraceFormat::kAuto, 2, 1);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->format(), TraceFormat::kCsv);
  EXPECT_EQ((*reader)->num_experts(), 3);
  const std::vector<TraceRecord> recs = ReadAll(reader->get());
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0].counts, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(recs[1].counts, (std::vector<int64_t>{7, 8, 9, 10, 11, 12}));
  EXPECT_EQ(recs[1].step, 1);
  // Without a header line as well.
  auto plain = TraceReader::Open(WriteFile("plain.csv", "1,2\n3,4\n"), TraceFormat::kCsv, 1, 0);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(ReadAll(plain->get()).size(), 2u);
  // Comments and blank lines before the header, a UTF-8 byte order mark, and a first data line
  // with a sign ('+1' is a number, so that line is data, not a header).
  for (const std::string& text :
       {std::string("# exported by a spreadsheet\n\ne0,e1\n# rank 0\n1,2\n3,4\n"),
        std::string("\xEF\xBB\xBF" "e0,e1\n1,2\n3,4\n"), std::string("\xEF\xBB\xBF" "1,2\n3,4\n"),
        std::string("+1,2\n3,4\n")}) {
    auto r = TraceReader::Open(WriteFile("variants.csv", text), TraceFormat::kAuto, 2, 1);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)->num_experts(), 2);
    const std::vector<TraceRecord> got = ReadAll(r->get());
    ASSERT_EQ(got.size(), 1u) << text;
    EXPECT_EQ(got[0].counts, (std::vector<int64_t>{1, 2, 3, 4})) << text;
  }
}

// Opening or reading fails, and the message holds every expected fragment.
void ExpectError(const std::string& name, const std::string& text, TraceFormat format, int32_t ranks,
                 int32_t topk, const std::vector<std::string>& fragments) {
  const std::string path = WriteFile(name, text);
  absl::Status status;
  auto reader = TraceReader::Open(path, format, ranks, topk);
  if (!reader.ok()) {
    status = reader.status();
  } else {
    TraceRecord r;
    while (true) {
      auto got = (*reader)->Next(&r);
      if (!got.ok()) {
        status = got.status();
        break;
      }
      if (!*got) break;
    }
  }
  ASSERT_FALSE(status.ok()) << name << " was accepted";
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& f : fragments) {
    EXPECT_NE(status.message().find(f), std::string::npos) << name << ": '" << status.message()
                                                           << "' lacks '" << f << "'";
  }
}

TEST(TraceTest, MalformedFilesNameTheLine) {
  const std::string h = "# moonep-trace v1 R=2 E=2 K=1\n";
  ExpectError("short.trace", h + "0 0 1 2 3 4\n0 1 1 2 3\n", TraceFormat::kAuto, 0, 0,
              {"short.trace:3:", "expected 6 integers", "got 5"});
  ExpectError("junk.trace", h + "0 0 1 2 x3 4\n", TraceFormat::kAuto, 0, 0,
              {"junk.trace:2:", "field 5", "'x3'", "not an integer"});
  ExpectError("suffix.trace", h + "0 0 1 2 3q 4\n", TraceFormat::kAuto, 0, 0,
              {"suffix.trace:2:", "field 5", "'3q'"});
  ExpectError("neg.trace", h + "0 0 1 -2 3 4\n", TraceFormat::kAuto, 0, 0,
              {"neg.trace:2:", "field 4", "negative"});
  ExpectError("ver.trace", "# moonep-trace v2 R=2 E=2\n", TraceFormat::kAuto, 0, 0,
              {"ver.trace:1:", "v2", "v1"});
  ExpectError("nor.trace", "# moonep-trace v1 E=2\n", TraceFormat::kAuto, 0, 0, {"nor.trace:1:", "R="});
  ExpectError("badk.trace", "# moonep-trace v1 R=2 E=2 K=3\n", TraceFormat::kAuto, 0, 0,
              {"badk.trace:1:", "K="});
  ExpectError("kmismatch.trace", h, TraceFormat::kAuto, 0, 4, {"K=1", "--topk is 4"});
  ExpectError("noheader.trace", "0 0 1 2\n", TraceFormat::kMoonEP, 0, 0, {"noheader.trace:1:", "header"});
  ExpectError("ragged.csv", "1,2,3\n4,5\n", TraceFormat::kCsv, 2, 0,
              {"ragged.csv:2:", "expected 3 counts", "got 2"});
  ExpectError("truncated.csv", "1,2\n3,4\n5,6\n", TraceFormat::kCsv, 2, 0,
              {"truncated.csv:3:", "1 of the 2 rows", "step 1"});
  ExpectError("empty_field.csv", "1,,2\n", TraceFormat::kCsv, 1, 0, {"empty_field.csv:1:", "field 2 is empty"});
  ExpectError("trailing.csv", "1,2,\n", TraceFormat::kCsv, 1, 0, {"trailing.csv:1:", "trailing comma"});
  ExpectError("csv_noranks.csv", "1,2\n", TraceFormat::kCsv, 0, 0, {"--ranks"});
  ExpectError("empty.trace", "\n\n", TraceFormat::kAuto, 1, 0, {"empty"});
  // A first line starting with '-' is a negative count, not a header.
  ExpectError("neg_first.csv", "-1,6\n9,7\n", TraceFormat::kCsv, 2, 0,
              {"neg_first.csv:1:", "field 1", "negative"});
  ExpectError("header_only.csv", "# c\ne0,e1\n\n", TraceFormat::kCsv, 2, 0, {"header but no counts"});
  ExpectError("comments_only.csv", "# c\n# d\n", TraceFormat::kCsv, 2, 0, {"no counts"});
  // K above E: from --topk for a CSV or a header without K.
  ExpectError("topk.csv", "1,2\n3,4\n", TraceFormat::kCsv, 2, 3, {"topk.csv:1:", "--topk (3)", "(2)"});
  ExpectError("topk.trace", "# moonep-trace v1 R=2 E=2\n", TraceFormat::kAuto, 0, 3,
              {"topk.trace:1:", "--topk (3)", "E=2"});
  auto missing = TraceReader::Open(::testing::TempDir() + "/does-not-exist.trace", TraceFormat::kAuto, 1, 0);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("does-not-exist.trace"), std::string::npos);
}


// The planner takes counts below 2^52 summing to at most 2^52; a trace past that is rejected at its
// line (the simulator's sums of a record then cannot overflow).
TEST(TraceTest, CountsPast2To52NameTheLine) {
  const std::string h = "# moonep-trace v1 R=2 E=2 K=1\n";
  const std::string at = std::to_string(int64_t{1} << 52), below = std::to_string((int64_t{1} << 52) - 1);
  ExpectError("big.trace", h + "0 0 1 2 3 4\n1 0 1 " + at + " 3 4\n", TraceFormat::kAuto, 0, 0,
              {"big.trace:3:", "field 4", "2^52"});
  ExpectError("sum.trace", h + "0 0 " + below + " 0 0 2\n", TraceFormat::kAuto, 0, 0,
              {"sum.trace:2:", "sum past 2^52"});
  ExpectError("max.trace", h + "0 0 4611686018427387904 4611686018427387904 1 1\n", TraceFormat::kAuto,
              0, 0, {"max.trace:2:", "field 3", "2^52"});
  ExpectError("big.csv", "1,2\n" + at + ",0\n", TraceFormat::kCsv, 2, 0, {"big.csv:2:", "field 1", "2^52"});
  ExpectError("sum.csv", below + ",0\n0,2\n", TraceFormat::kCsv, 2, 0, {"sum.csv:2:", "sum past 2^52"});
  // The limit itself is accepted.
  auto ok = TraceReader::Open(WriteFile("limit.trace", h + "0 0 " + below + " 1 0 0\n"), TraceFormat::kAuto, 0, 0);
  ASSERT_TRUE(ok.ok()) << ok.status();
  const std::vector<TraceRecord> recs = ReadAll(ok->get());
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0].counts[0], (int64_t{1} << 52) - 1);
}

// A moonep trace's last line without a newline is a record cut short (a crash, a full disk): the
// records before it replay, it is not replayed even when it parses (a count cut in its middle),
// and the warning names its line.
TEST(TraceTest, CutLastRecordIsSkippedWithAWarning) {
  const std::string h = "# moonep-trace v1 R=2 E=4 K=2\n", rec = "0 0 10 6 2 2 9 7 2 2\n";
  for (const std::string& cut : {std::string("0 1 1 1 5 5 1 1 6 1"), std::string("0 1 1 1 5"),
                                 std::string("\0\0\0\0", 4)}) {
    auto reader = TraceReader::Open(WriteFile("cut.trace", h + rec + cut), TraceFormat::kAuto, 0, 0);
    ASSERT_TRUE(reader.ok()) << reader.status();
    const std::vector<TraceRecord> recs = ReadAll(reader->get());
    ASSERT_EQ(recs.size(), 1u) << cut;
    EXPECT_EQ(recs[0].counts, (std::vector<int64_t>{10, 6, 2, 2, 9, 7, 2, 2}));
    EXPECT_NE((*reader)->warning().find("cut.trace:3: the last line has no newline"), std::string::npos)
        << (*reader)->warning();
  }
  // Every record whole, or a last line that is only a comment: nothing skipped, no warning.
  for (const std::string& tail : {std::string(), std::string("# end")}) {
    auto reader = TraceReader::Open(WriteFile("whole.trace", h + rec + rec + tail), TraceFormat::kAuto, 0, 0);
    ASSERT_TRUE(reader.ok()) << reader.status();
    EXPECT_EQ(ReadAll(reader->get()).size(), 2u);
    EXPECT_EQ((*reader)->warning(), "");
  }
  // A CSV comes from other tools, which often end it without a newline: its last row counts.
  auto csv = TraceReader::Open(WriteFile("nonl.csv", "1,2\n3,4"), TraceFormat::kAuto, 2, 0);
  ASSERT_TRUE(csv.ok()) << csv.status();
  const std::vector<TraceRecord> rows = ReadAll(csv->get());
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].counts, (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ((*csv)->warning(), "");
}

TEST(TraceTest, AtEndLooksAheadWithoutConsuming) {
  const std::string h = "# moonep-trace v1 R=1 E=2\n";
  auto reader = TraceReader::Open(WriteFile("ahead.trace", h + "0 0 1 2\n# c\n\n1 0 3 4\n# end\n"),
                                  TraceFormat::kAuto, 0, 0);
  ASSERT_TRUE(reader.ok()) << reader.status();
  TraceRecord r;
  for (int64_t step = 0; step < 2; ++step) {
    auto at_end = (*reader)->AtEnd();
    ASSERT_TRUE(at_end.ok()) << at_end.status();
    EXPECT_FALSE(*at_end);
    auto got = (*reader)->Next(&r);
    ASSERT_TRUE(got.ok() && *got);
    EXPECT_EQ(r.step, step);
  }
  auto at_end = (*reader)->AtEnd();
  ASSERT_TRUE(at_end.ok()) << at_end.status();
  EXPECT_TRUE(*at_end);
  // A cut last record is no record.
  auto cut = TraceReader::Open(WriteFile("ahead_cut.trace", h + "0 0 1 2\n1 0 3"), TraceFormat::kAuto, 0, 0);
  ASSERT_TRUE(cut.ok()) << cut.status();
  ASSERT_TRUE((*cut)->Next(&r).ok());
  at_end = (*cut)->AtEnd();
  ASSERT_TRUE(at_end.ok()) << at_end.status();
  EXPECT_TRUE(*at_end);
}

// A directory (or a read error) is not an empty trace: the error names the path and errno's text.
TEST(TraceTest, UnreadableTraceIsAnError) {
  const std::string dir = ::testing::TempDir();
  auto reader = TraceReader::Open(dir, TraceFormat::kAuto, 1, 0);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(reader.status().message().find("cannot read trace '" + dir + "'"), std::string::npos)
      << reader.status();
  EXPECT_NE(reader.status().message().find("Is a directory"), std::string::npos) << reader.status();
}

// A header whose records cannot fit in the file is refused at its line before a record is read:
// a 45-byte file once made the reader allocate R*E counts (16 GiB) first.
TEST(TraceTest, SizesNoRecordCanMatchAreRefused) {
  ExpectError("hugehdr.trace", "# moonep-trace v1 R=32768 E=65536 K=8\n0 0 1\n", TraceFormat::kAuto, 0, 0,
              {"hugehdr.trace:1:", "the header's R=32768 E=65536", "at least 4294967300 bytes",
               "the file has 6 bytes after the header", "no record fits"});
  // One byte short of the smallest record (single digits, single spaces, a newline): refused;
  // that record itself is read.
  const std::string h = "# moonep-trace v1 R=1 E=2\n";
  ExpectError("short_rec.trace", h + "0 0 1 \n", TraceFormat::kAuto, 0, 0,
              {"short_rec.trace:1:", "at least 8 bytes", "has 7 bytes"});
  auto ok = TraceReader::Open(WriteFile("min_rec.trace", h + "0 0 1 2\n"), TraceFormat::kAuto, 0, 0);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ReadAll(ok->get()).size(), 1u);
  // R*E above 2^31, from a header or from --ranks times a CSV row.
  ExpectError("above.trace", "# moonep-trace v1 R=65536 E=65536\n0 0\n", TraceFormat::kAuto, 0, 0,
              {"above.trace:1:", "R*E = 4294967296", "above 2147483648"});
  ExpectError("above.csv", "1,2\n", TraceFormat::kCsv, 2000000000, 0,
              {"above.csv:1:", "--ranks=2000000000 rows of 2 counts", "above 2147483648"});
  // A CSV's rows are read one at a time: a --ranks far above them is an error naming the rows.
  ExpectError("ranks.csv", "1,2\n3,4\n", TraceFormat::kCsv, 1000000, 0,
              {"ranks.csv:2:", "file ends after 2 of the 1000000 rows of step 0"});
}

// A line longer than a record of the trace's sizes could take (64 bytes an integer, plus 4 KiB;
// at least 1 MiB, so that comments fit) is an error naming the line, before its buffer grows
// further: a device or a pipe with no newline (`--trace=/dev/zero`) used to grow one buffer until
// memory ran out, and then pass for the end of the trace. The bound counts the line without its
// line end ("\n" or "\r\n").
TEST(TraceTest, LinesLongerThanARecordCanTakeAreRefused) {
  constexpr size_t kFloor = size_t{1} << 20;
  const std::string h = "# moonep-trace v1 R=2 E=4\n";  // 10 integers a record: the floor
  const std::string counts = "1 2 3 4 5 6 7 8";
  auto record = [&](size_t length, const std::string& end) {  // "0 0 ", blanks, counts
    return "0 0 " + std::string(length - 4 - counts.size(), ' ') + counts + end;
  };
  for (const std::string end : {"\n", "\r\n"}) {
    // Exactly the bound is read, with either line end; a byte more is not.
    auto edge = TraceReader::Open(WriteFile("edge.trace", h + record(kFloor, end)),
                                  TraceFormat::kAuto, 0, 0);
    ASSERT_TRUE(edge.ok()) << edge.status();
    const auto records = ReadAll(edge->get());
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].counts, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
    ExpectError("edge1.trace", h + record(kFloor + 1, end), TraceFormat::kAuto, 0, 0,
                {"edge1.trace': line 2 is longer than 1048576 bytes (without its line end), the "
                 "most a line of a trace of these sizes may hold"});
  }
  ExpectError("nonl.trace", h + std::string(2 * kFloor, '7'), TraceFormat::kAuto, 0, 0,
              {"line 2 is longer than 1048576 bytes"});
  // A comment longer than a record is still a comment.
  auto comment = TraceReader::Open(
      WriteFile("comment.trace", h + "# " + std::string(5000, 'c') + "\n" + record(20, "\n")),
      TraceFormat::kAuto, 0, 0);
  ASSERT_TRUE(comment.ok()) << comment.status();
  EXPECT_EQ(ReadAll(comment->get()).size(), 1u);
  // Larger sizes raise the bound: R = E = 128 is 16386 integers, 1052800 bytes.
  const std::string big = "# moonep-trace v1 R=128 E=128\n";
  std::string ones;
  for (int i = 0; i < 128 * 128; ++i) ones += i ? " 1" : "1";
  auto wide = [&](size_t length) {
    return "0 0 " + std::string(length - 4 - ones.size(), ' ') + ones + "\n";
  };
  auto fits = TraceReader::Open(WriteFile("wide.trace", big + wide(1052800)), TraceFormat::kAuto, 0, 0);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(ReadAll(fits->get()).size(), 1u);
  ExpectError("wide1.trace", big + wide(1052801), TraceFormat::kAuto, 0, 0,
              {"line 2 is longer than 1052800 bytes"});
  // A CSV row: its width sets the bound for the rows after it, also after a header line longer
  // than that.
  ExpectError("longrow.csv", "1,2\n" + std::string(kFloor, ' ') + "3,4\n", TraceFormat::kCsv, 1, 0,
              {"line 2 is longer than 1048576 bytes"});
  ExpectError("longrow2.csv", "a" + std::string(2 * kFloor, ' ') + ",b\n1,2\n" +
              std::string(kFloor, ' ') + "3,4\n", TraceFormat::kCsv, 1, 0,
              {"line 3 is longer than 1048576 bytes"});
}

// Bytes from the file are escaped in messages: a NUL used to cut the message short, and a
// terminal escape sequence reached the terminal.
TEST(TraceTest, BinaryBytesInMessagesAreEscaped) {
  const std::string h = "# moonep-trace v1 R=2 E=4 K=2\n";
  ExpectError("nul.trace", h + "0 0 10 6 2 2 9 7 2 " + std::string("\0\x01", 2) + " 2\n",
              TraceFormat::kAuto, 0, 0, {"field 10 ('\\x00\\x01') is not an integer"});
  ExpectError("esc.trace", h + "0 0 10 6 2 2 9 7 2 2\x1b]0;X\x07\n", TraceFormat::kAuto, 0, 0,
              {"field 10 ('2\\x1b]0;X\\x07') is not an integer"});
  ExpectError("esc.csv", "1,2\n3\x1b,4\n", TraceFormat::kCsv, 1, 0, {"('3\\x1b')"});
  ExpectError("ver.trace", "# moonep-trace v\x1b R=2 E=4\n", TraceFormat::kAuto, 0, 0,
              {"unsupported trace version 'v\\x1b'"});
}

// The header holds R=, E= and K= once each, as decimal numbers: a second R=, a word that is no
// field, a sign or a value past INT32_MAX used to pass (the first R= won) or get the wrong message.
TEST(TraceTest, HeaderFieldsAreEachGivenOnceAsDecimalNumbers) {
  const std::string rec = "0 0 1 2 3 4 5 6 7 8\n";
  const struct {
    const char* name;
    const char* header;
    const char* error;
  } cases[] = {
      {"dup.trace", "# moonep-trace v1 R=2 R=3 E=4 K=2", "dup.trace:1: header gives R= twice"},
      {"word.trace", "# moonep-trace v1 R=2 E=4 K=2 garbage",
       "word.trace:1: header field 'garbage' is none of R=, E=, K="},
      {"key.trace", "# moonep-trace v1 R=2 E=4 X=1", "header field 'X=1' is none of R=, E=, K="},
      {"sign.trace", "# moonep-trace v1 R=+2 E=4", "header R='+2' is not a decimal number"},
      {"suffix.trace", "# moonep-trace v1 R=2x E=4", "header R='2x' is not a decimal number"},
      {"big.trace", "# moonep-trace v1 R=99999999999 E=4", "header R= is above 2147483647"},
      {"empty.trace", "# moonep-trace v1 R= E=4", "header R= has no value"},
      {"gap.trace", "# moonep-trace v1 R= 2 E=4", "header R= has no value"},
      {"glued.trace", "# moonep-tracev1 R=2 E=4", "unsupported trace version ''"},
  };
  for (const auto& c : cases) {
    ExpectError(c.name, std::string(c.header) + "\n" + rec, TraceFormat::kAuto, 0, 0, {c.error});
  }
  // Order is free, blanks may repeat, K may be left out.
  for (const std::string& h : {std::string("# moonep-trace v1 K=2 E=4 R=2\n"),
                               std::string("# moonep-trace v1  R=2\tE=4 \n")}) {
    auto ok = TraceReader::Open(WriteFile("order.trace", h + rec), TraceFormat::kAuto, 0, 0);
    ASSERT_TRUE(ok.ok()) << h << ok.status();
    EXPECT_EQ((*ok)->num_ranks(), 2);
    EXPECT_EQ((*ok)->num_experts(), 4);
    EXPECT_EQ(ReadAll(ok->get()).size(), 1u);
  }
}

}  // namespace
}  // namespace moonep::sim
