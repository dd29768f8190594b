// Reports of a simulation: the summary table, per-step CSV and JSON rows, and SVG plots
// (hand-written SVG 1.1, no dependencies; any browser opens them).
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "planner/sim/simulator.h"

namespace moonep::sim {

// The summary table: per policy the mean and p99 of rank max/mean load, replicas per step, bytes
// per step, estimated step time (mean, p99, and its parts) and speedup over `none`.
std::string FormatSummary(const SimResult& result, const SimOptions& options);

// Streams one CSV line per (step, policy) to `file` (not owned); the header first.
class CsvSink : public StepSink {
 public:
  // `name` says which output a write error is about (e.g. "--csv file 'out.csv'").
  explicit CsvSink(std::FILE* file, std::string name = "the CSV output");
  absl::Status OnStep(const StepRecord& record) override;

 private:
  std::FILE* file_;
  std::string name_;
};

// Streams a JSON array of one object per (step, policy) to `file` (not owned). Finish() closes
// the array; without it the file is not valid JSON.
class JsonSink : public StepSink {
 public:
  explicit JsonSink(std::FILE* file, std::string name = "the JSON output");
  absl::Status OnStep(const StepRecord& record) override;
  absl::Status Finish();

 private:
  std::FILE* file_;
  std::string name_;
  bool first_ = true;
};

// Forwards every row to several sinks.
class TeeSink : public StepSink {
 public:
  void Add(StepSink* sink) { sinks_.push_back(sink); }
  absl::Status OnStep(const StepRecord& record) override;

 private:
  std::vector<StepSink*> sinks_;
};

// The CSV header line (without newline); one column per field of a StepRecord.
std::string CsvHeader();

// The three plots, as SVG documents.
std::string ImbalanceSvg(const SimResult& result);  // max/mean load over steps, per policy
std::string RankLoadSvg(const SimResult& result);   // per-rank load at the snapshot step
std::string StepTimeSvg(const SimResult& result);   // mean step time by part, per policy

// Writes imbalance.svg, rank_load.svg and step_time.svg into `dir` (created if missing).
absl::Status WriteSvgs(const SimResult& result, const std::string& dir);
// Creates `dir` when missing and checks that files can be made in it (what WriteSvgs does first),
// so that a run can refuse a bad --svg before it starts.
absl::Status PrepareSvgDir(const std::string& dir);

}  // namespace moonep::sim
