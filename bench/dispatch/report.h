// Output of moonep-bench-dispatch: nccl-tests style rows on stdout, and every figure as JSON.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "bench/dispatch/runner.h"

namespace moonep::bench {

struct RunInfo {
  int32_t num_ranks = 0;
  int32_t num_hosts = 0;
  std::vector<std::string> backends;  // AvailableBackends()
  std::string command;
  std::string load_start, load_end;   // /proc/loadavg of rank 0
  std::string started_utc;
};

void PrintRunHeader(const RunInfo& info, std::FILE* out);
// One block per configuration: a header, a row per (operation, implementation), a summary line.
void PrintConfig(const ConfigResult& r, int32_t index, int32_t total, std::FILE* out);
// corrupt: the --corrupt operation ("" when none): its run's verdict says whether the checks
// caught the corruption, instead of a plain OK or FAILED.
void PrintFooter(const std::vector<ConfigResult>& results, std::FILE* out,
                 const std::string& corrupt);

// time(op, impl) / time(op, baseline) from medians; 0 when either is missing or wrong.
double Ratio(const ConfigResult& r, const std::string& op, const std::string& impl,
             const std::string& baseline);

std::string ToJson(const RunInfo& info, const std::vector<ConfigResult>& results);

}  // namespace moonep::bench
