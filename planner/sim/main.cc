// moonep-sim: what routing skew costs, and what each balancing policy buys, at any scale.
// See docs/simulator.md.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "moonep/core/flags_usage.h"
#include "moonep/core/status.h"
#include "planner/plan.h"
#include "planner/sim/report.h"
#include "planner/sim/simulator.h"

// Model and machine.
ABSL_FLAG(std::string, preset, "",
          "model + machine preset: deepseek-v3-ep64, kimi-k3.1-like-ep128 or mixtral-ep8; the size "
          "flags below override its values");
ABSL_FLAG(int32_t, ranks, 0, "R: expert-parallel ranks (required without --preset; a CSV trace needs it)");
ABSL_FLAG(int32_t, experts, 0, "E: experts (a multiple of R)");
ABSL_FLAG(int32_t, topk, 0, "K: experts per token");
ABSL_FLAG(int32_t, tokens, 0, "T: tokens per rank per step (default 4096 with a preset)");
ABSL_FLAG(int32_t, hidden, 0, "H: model hidden size");
ABSL_FLAG(int32_t, intermediate, 0, "I: expert FFN intermediate size");
ABSL_FLAG(double, tflops, 400.0, "achieved expert-GEMM rate per rank, TFLOP/s");
ABSL_FLAG(int32_t, ranks_per_node, 8, "ranks per node (0: flat, every rank its own node)");
ABSL_FLAG(double, intra_gbps, 150.0, "intra-node bandwidth per rank and direction, GB/s");
ABSL_FLAG(double, inter_gbps, 40.0, "inter-node bandwidth per rank and direction, GB/s");
ABSL_FLAG(int32_t, act_bytes, 2, "bytes per activation element on the wire (2: bf16)");
ABSL_FLAG(int32_t, weight_bytes, 2, "bytes per expert weight element (prefetch)");
ABSL_FLAG(int32_t, grad_bytes, 4, "bytes per weight-gradient element (gradient reduction)");
ABSL_FLAG(bool, training, true, "model forward+backward (3x forward FLOPs, backward comms, "
                                "gradient reduction); false: forward only");
ABSL_FLAG(bool, overlap_prefetch, true, "replica prefetch overlaps the forward dispatch");
ABSL_FLAG(std::string, rank_speeds, "",
          "each rank's compute speed relative to --tflops: a list of R speeds (1,1,0.7,1), or "
          "speed@rank items with every other rank at 1 (0.7@3; 0.7@3,0.5@17; 0.8@8-15 for a node); "
          "moonep, moonep-weighed and moonep-greedy plan with them, and --policies=all adds "
          "moonep-nospeeds (moonep planned without them); empty: all 1");

// Routing.
ABSL_FLAG(std::string, routing, "zipf",
          "routing model: uniform, zipf, hotspot, drift, domain or coactivation (ignored with --trace)");
ABSL_FLAG(double, zipf_s, 0.3, "Zipf exponent s of the expert popularity (all models but uniform); "
          "0.3 gives a per-expert max/mean of about 3.7 at E=256, K=8");
ABSL_FLAG(int32_t, hot_experts, 4, "hotspot: experts that spike in each step");
ABSL_FLAG(double, hot_factor, 20.0, "hotspot: weight multiplier of a spiking expert");
ABSL_FLAG(double, drift_sigma, 0.1, "drift: std-dev of each expert's log-weight step");
ABSL_FLAG(double, drift_theta, 0.0, "drift: pull back towards the start per step (0: pure random walk)");
ABSL_FLAG(int32_t, domains, 4, "domain: data domains (blocks of consecutive ranks), each its own Zipf permutation");
ABSL_FLAG(int32_t, coact_group, 4, "coactivation: experts per co-activation group");
ABSL_FLAG(double, coact_prob, 0.5, "coactivation: chance a later choice stays in the first choice's group");
ABSL_FLAG(uint64_t, seed, 1, "random seed (same seed, same output)");
ABSL_FLAG(std::string, trace, "", "replay this routing trace (docs/trace-format.md) instead of a model");
ABSL_FLAG(std::string, trace_format, "auto", "trace format: auto, moonep or csv");
ABSL_FLAG(int32_t, trace_layer, -1,
          "replay only this layer's records (-1: every record, in order; each layer is planned on "
          "its own)");

// Planning.
ABSL_FLAG(std::string, policies, "all",
          "comma-separated policies: none, moonep, moonep-weighed (moonep weighing replica "
          "transfers against the compute they save, with this machine's rates), moonep-greedy, "
          "eplb, fastermoe-shadow, moonep-nospeeds (moonep not told --rank_speeds), or all (every "
          "one; moonep-nospeeds only with --rank_speeds; none always runs: it is the baseline)");
ABSL_FLAG(bool, lower_bound, true, "also report the planner's load lower bound");
ABSL_FLAG(int32_t, slots, -1, "replica slots per rank (-1: E/R)");
ABSL_FLAG(int32_t, pad_multiple, 1, "each expert group's rows are padded to a multiple of this (GEMM alignment); the padding rows count in the compute time, not in the loads");
ABSL_FLAG(int64_t, replica_cost_intra, -1,
          "moonep-weighed: what one replica transfer within a node costs, in tokens of compute "
          "(-1: from the cost model: the reduce of its gradients at --intra_gbps against "
          "--tflops)");
ABSL_FLAG(int64_t, replica_cost_inter, -1,
          "moonep-weighed: the same across nodes (-1: from the cost model, at --inter_gbps)");
ABSL_FLAG(int64_t, row_cost_intra, -1,
          "moonep-weighed: what one token row sent or received within a node costs (dispatch and "
          "combine, forward and backward), in 1/1024 tokens of compute (-1: from the cost model, "
          "at --intra_gbps against --tflops; 0 with --row_cost_inter=0: rows left out)");
ABSL_FLAG(int64_t, row_cost_inter, -1,
          "moonep-weighed: the same across nodes (-1: from the cost model, at --inter_gbps)");
ABSL_FLAG(bool, shadow_from_cost_model, false,
          "fastermoe-shadow decides with this machine's compute rate and inter-node bandwidth "
          "instead of the planner's defaults (which the runtime uses, so counts match it)");
ABSL_FLAG(int32_t, eplb_period, 10, "eplb: re-plan every this many steps on the average of past counts");

// Run and output.
ABSL_FLAG(std::optional<int64_t>, steps, std::nullopt,
          "steps to simulate (default 100); with --trace: at most this many records (default and "
          "0: the whole trace)");
ABSL_FLAG(std::string, detail, "auto",
          "tokens (every token sampled: exact bytes), counts (counts[R][E]: exact rows, dedup "
          "estimated), totals (per-expert totals: scales to R=4096), or auto");
ABSL_FLAG(std::string, csv, "", "write one CSV row per step and policy to this file");
ABSL_FLAG(std::string, json, "", "write one JSON object per step and policy to this file");
ABSL_FLAG(std::string, svg, "", "write imbalance.svg, rank_load.svg and step_time.svg into this directory");
ABSL_FLAG(int64_t, svg_step, 0, "step whose per-rank loads rank_load.svg shows");
ABSL_FLAG(int32_t, threads, 0, "threads planning policies in parallel (0: one per core); results do "
          "not depend on it, memory grows with it (one plan per thread)");
ABSL_FLAG(bool, progress, true, "show progress on stderr during long runs");

namespace {

using moonep::InvalidArgument;
using namespace moonep::sim;

// Where `path` points: its canonical path when it exists, else its directory's canonical path
// and its name (so "x" and "./x" match before either is written); a dangling symbolic link points
// where its target will be written (followed up to 40 links, as the kernel does).
std::string WherePathPoints(const std::string& path, int depth = 0) {
  if (char* real = ::realpath(path.c_str(), nullptr)) {
    std::string out(real);
    std::free(real);
    return out;
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  struct stat lst;
  if (depth < 40 && ::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode)) {
    char target[4096];
    const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
    if (n > 0) {
      target[n] = '\0';
      // A relative target is relative to the link's directory ("." has no slash to end it).
      const std::string next = target[0] == '/' || slash == std::string::npos
                                   ? std::string(target)
                                   : path.substr(0, slash + 1) + target;
      return WherePathPoints(next, depth + 1);
    }
  }
  char* real_dir = ::realpath(dir.c_str(), nullptr);
  if (real_dir == nullptr) return path;
  std::string out = std::string(real_dir) + "/" + name;
  std::free(real_dir);
  return out;
}

// The named files (empty names skipped) are pairwise distinct: the same regular file, or two paths
// to where one file will be written, is an InvalidArgument naming both flags. Devices and pipes
// (/dev/null, /dev/stdout) may be shared.
absl::Status CheckDistinctFiles(const std::vector<std::pair<const char*, std::string>>& files) {
  for (size_t a = 0; a < files.size(); ++a) {
    for (size_t b = a + 1; b < files.size(); ++b) {
      const std::string& pa = files[a].second;
      const std::string& pb = files[b].second;
      if (pa.empty() || pb.empty()) continue;
      // Two names of one inode (hard links, or links to them) are one file whatever the paths.
      struct stat st, stb;
      const bool a_exists = ::stat(pa.c_str(), &st) == 0;
      const bool special = a_exists && !S_ISREG(st.st_mode);
      const bool same_inode = a_exists && ::stat(pb.c_str(), &stb) == 0 &&
                              st.st_dev == stb.st_dev && st.st_ino == stb.st_ino;
      const bool same = !special && (same_inode || WherePathPoints(pa) == WherePathPoints(pb));
      if (same) {
        return InvalidArgument("%s and %s name the same file '%s': writing one would destroy the "
                               "other", files[a].first, files[b].first, pb);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status BuildOptions(SimOptions* o) {
  const std::string preset_name = absl::GetFlag(FLAGS_preset);
  const Preset* preset = nullptr;
  if (!preset_name.empty()) {
    preset = FindPreset(preset_name);
    if (!preset) {
      std::vector<std::string> names;
      for (const Preset& p : Presets()) names.push_back(p.name);
      return InvalidArgument("--preset: unknown preset '%s' (known: %s)", preset_name,
                             absl::StrJoin(names, ", "));
    }
  }
  const bool has_trace = !absl::GetFlag(FLAGS_trace).empty();
  auto size = [&](const char* name, int32_t flag, int32_t from_preset, bool required,
                  int32_t* out) -> absl::Status {
    MOONEP_CHECK_ARG(flag >= 0, "--%s must be positive, got %d", name, flag);
    *out = flag > 0 ? flag : preset ? from_preset : 0;
    MOONEP_CHECK_ARG(*out > 0 || !required, "--%s is required (or pick a --preset)", name);
    return absl::OkStatus();
  };
  RoutingParams& rp = o->routing;
  MOONEP_RETURN_IF_ERROR(size("ranks", absl::GetFlag(FLAGS_ranks), preset ? preset->ranks : 0,
                              !has_trace, &rp.num_ranks));
  MOONEP_RETURN_IF_ERROR(size("experts", absl::GetFlag(FLAGS_experts), preset ? preset->experts : 0,
                              !has_trace, &rp.num_experts));
  MOONEP_RETURN_IF_ERROR(size("topk", absl::GetFlag(FLAGS_topk), preset ? preset->topk : 0,
                              !has_trace, &rp.topk));
  MOONEP_RETURN_IF_ERROR(size("tokens", absl::GetFlag(FLAGS_tokens), preset ? preset->tokens : 0,
                              !has_trace, &rp.tokens_per_rank));
  MOONEP_RETURN_IF_ERROR(size("hidden", absl::GetFlag(FLAGS_hidden), preset ? preset->hidden : 0,
                              true, &o->cost.hidden));
  MOONEP_RETURN_IF_ERROR(size("intermediate", absl::GetFlag(FLAGS_intermediate),
                              preset ? preset->intermediate : 0, true, &o->cost.intermediate));
  if (has_trace && preset) {
    // A trace brings its own R, E and K: the preset only lends H and I unless sizes were given
    // (given ones must match the trace: Simulator::Create checks).
    if (absl::GetFlag(FLAGS_ranks) == 0) rp.num_ranks = 0;
    if (absl::GetFlag(FLAGS_experts) == 0) rp.num_experts = 0;
    if (absl::GetFlag(FLAGS_topk) == 0) rp.topk = 0;
  }
  const std::string routing = absl::GetFlag(FLAGS_routing);
  if (!ParseRoutingKind(routing, &rp.kind)) {
    return InvalidArgument("--routing: unknown model '%s' (known: uniform, zipf, hotspot, drift, "
                           "domain, coactivation)", routing);
  }
  rp.zipf_s = absl::GetFlag(FLAGS_zipf_s);
  rp.hot_experts = absl::GetFlag(FLAGS_hot_experts);
  rp.hot_factor = absl::GetFlag(FLAGS_hot_factor);
  rp.drift_sigma = absl::GetFlag(FLAGS_drift_sigma);
  rp.drift_theta = absl::GetFlag(FLAGS_drift_theta);
  rp.domains = absl::GetFlag(FLAGS_domains);
  rp.coact_group = absl::GetFlag(FLAGS_coact_group);
  rp.coact_prob = absl::GetFlag(FLAGS_coact_prob);
  rp.seed = absl::GetFlag(FLAGS_seed);

  o->trace_path = absl::GetFlag(FLAGS_trace);
  const std::string trace_format = absl::GetFlag(FLAGS_trace_format);
  if (!ParseTraceFormat(trace_format, &o->trace_format)) {
    return InvalidArgument("--trace_format: unknown format '%s' (known: auto, moonep, csv)", trace_format);
  }
  o->trace_layer = absl::GetFlag(FLAGS_trace_layer);

  // Resolved against R by Simulator::Create (a trace's R is in its header); parsed here so that
  // --policies=all knows whether the machine has speeds.
  absl::StatusOr<RankSpeedsSpec> speeds = ParseRankSpeeds(absl::GetFlag(FLAGS_rank_speeds));
  if (!speeds.ok()) return moonep::Annotate(speeds.status(), "--rank_speeds");
  o->rank_speeds = *std::move(speeds);

  const std::string policies = absl::GetFlag(FLAGS_policies);
  for (absl::string_view name : absl::StrSplit(policies, ',', absl::SkipWhitespace())) {
    const std::string n(absl::StripAsciiWhitespace(name));
    if (n == "all") {
      for (const SimPolicy& p : AllPolicies(!o->rank_speeds.all_one())) o->policies.push_back(p);
      continue;
    }
    SimPolicy p;
    if (!ParseSimPolicy(n, &p)) {
      return InvalidArgument("--policies: unknown policy '%s' (known: none, moonep, moonep-weighed, "
                             "moonep-greedy, eplb, fastermoe-shadow, moonep-nospeeds, all)", n);
    }
    o->policies.push_back(p);
  }
  o->lower_bound = absl::GetFlag(FLAGS_lower_bound);
  o->slots = absl::GetFlag(FLAGS_slots);
  o->pad_multiple = absl::GetFlag(FLAGS_pad_multiple);
  o->eplb_period = absl::GetFlag(FLAGS_eplb_period);
  o->shadow_from_cost_model = absl::GetFlag(FLAGS_shadow_from_cost_model);
  o->replica_cost_intra = absl::GetFlag(FLAGS_replica_cost_intra);
  o->replica_cost_inter = absl::GetFlag(FLAGS_replica_cost_inter);
  o->row_cost_intra = absl::GetFlag(FLAGS_row_cost_intra);
  o->row_cost_inter = absl::GetFlag(FLAGS_row_cost_inter);

  CostConfig& c = o->cost;
  c.tflops = absl::GetFlag(FLAGS_tflops);
  c.ranks_per_node = absl::GetFlag(FLAGS_ranks_per_node);
  c.intra_gbps = absl::GetFlag(FLAGS_intra_gbps);
  c.inter_gbps = absl::GetFlag(FLAGS_inter_gbps);
  c.act_bytes = absl::GetFlag(FLAGS_act_bytes);
  c.weight_bytes = absl::GetFlag(FLAGS_weight_bytes);
  c.grad_bytes = absl::GetFlag(FLAGS_grad_bytes);
  c.training = absl::GetFlag(FLAGS_training);
  c.overlap_prefetch = absl::GetFlag(FLAGS_overlap_prefetch);

  // A replay runs to the end of the trace unless told otherwise; a model runs 100 steps.
  o->steps = absl::GetFlag(FLAGS_steps).value_or(has_trace ? 0 : 100);
  const std::string detail = absl::GetFlag(FLAGS_detail);
  if (!ParseDetailChoice(detail, &o->detail)) {
    return InvalidArgument("--detail: unknown level '%s' (known: auto, tokens, counts, totals)", detail);
  }
  o->snapshot_step = absl::GetFlag(FLAGS_svg_step);
  o->threads = absl::GetFlag(FLAGS_threads);
  return absl::OkStatus();
}

// Progress on stderr: a refreshed line on a terminal, a line every 5 s otherwise.
class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled), tty_(::isatty(2) == 1) {}
  void Update(int64_t done, int64_t total) {
    if (!enabled_) return;
    const double t = Elapsed();
    if (t < 1.0 || t - last_ < (tty_ ? 0.25 : 5.0)) return;
    last_ = t;
    const double rate = done / t;
    std::string line = absl::StrFormat("moonep-sim: step %d", done);
    if (total > 0) {
      absl::StrAppendFormat(&line, "/%d (%.0f%%), %.1f steps/s, %.0f s left", total,
                            100.0 * done / total, rate, (total - done) / std::max(rate, 1e-9));
    } else {
      absl::StrAppendFormat(&line, ", %.1f steps/s", rate);
    }
    std::fprintf(stderr, tty_ ? "\r%-78s" : "%s\n", line.c_str());
    shown_ = true;
  }
  void Done() {
    if (enabled_ && shown_ && tty_) std::fprintf(stderr, "\n");
  }

 private:
  double Elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  bool enabled_, tty_, shown_ = false;
  double last_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Temporaries of the outputs not yet committed, for the signal handler below: a run stopped by
// SIGINT, SIGTERM or SIGHUP removes them (as a failed run does) before it dies of the signal.
// Fixed buffers, written before a slot is marked live: the handler only reads and unlinks.
struct PendingTemp {
  char path[4096];
  volatile std::sig_atomic_t live = 0;
};
PendingTemp g_pending_temps[2];

extern "C" void RemoveTempsAndDie(int sig) {
  for (PendingTemp& t : g_pending_temps) {
    if (t.live) ::unlink(t.path);
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// A slot for `temp` (nullptr when none is free or the path does not fit: then a signal leaves it).
PendingTemp* TrackTemp(const std::string& temp) {
  static const bool installed = [] {
    struct sigaction sa = {};
    sa.sa_handler = RemoveTempsAndDie;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
      // A signal the run was started with ignored (nohup; a background job's SIGINT) stays so.
      struct sigaction old = {};
      if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
      ::sigaction(sig, &sa, nullptr);
    }
    return true;
  }();
  (void)installed;
  for (PendingTemp& t : g_pending_temps) {
    if (t.live || temp.size() >= sizeof(t.path)) continue;
    std::memcpy(t.path, temp.c_str(), temp.size() + 1);
    std::atomic_signal_fence(std::memory_order_seq_cst);  // the path before the flag
    t.live = 1;
    return &t;
  }
  return nullptr;
}

// An output of --csv or --json. A new file, or a regular one (not a symlink), is written under a
// temporary name in its directory and renamed over the path once the run has succeeded, so a
// failed run leaves the path as it was: absent, or an earlier run's results. Anything else (a
// symlink, a device, a pipe: /dev/stdout, /dev/null) is written in place and never removed:
// renaming over it or unlinking it would replace what the path stands for (a failed run once
// deleted /dev/full).
class OutputFile {
 public:
  OutputFile(const char* flag, std::string path) : flag_(flag), path_(std::move(path)) {}
  ~OutputFile() {
    if (file_) std::fclose(file_);
    if (!temp_.empty()) ::unlink(temp_.c_str());  // not committed: the run failed
    if (pending_) pending_->live = 0;
  }
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  // InvalidArgument when the path cannot be written (bad usage, like a missing directory).
  absl::Status Open();
  std::FILE* file() const { return file_; }
  // Closes the file: SystemError when what was written did not reach it.
  absl::Status Finish();
  // Puts a finished temporary in place of the path.
  absl::Status Commit();

 private:
  const char* flag_;
  std::string path_;
  std::string temp_;  // the temporary until committed; empty when writing in place
  std::FILE* file_ = nullptr;
  PendingTemp* pending_ = nullptr;  // temp_'s slot for the signal handler
};

absl::Status OutputFile::Open() {
  struct stat st;
  const bool exists = ::lstat(path_.c_str(), &st) == 0;
  if (exists && !S_ISREG(st.st_mode)) {
    file_ = std::fopen(path_.c_str(), "w");
    if (!file_) return InvalidArgument("%s: cannot write '%s': %s", flag_, path_, std::strerror(errno));
    return absl::OkStatus();
  }
  // In the path's directory, so that the rename replaces the file in one step.
  const size_t slash = path_.rfind('/');
  temp_ = slash == std::string::npos ? "." + path_ + ".XXXXXX"
                                     : absl::StrCat(path_.substr(0, slash + 1), ".",
                                                    path_.substr(slash + 1), ".XXXXXX");
  const int fd = ::mkostemp(temp_.data(), O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    temp_.clear();
    return InvalidArgument("%s: cannot write '%s' (a temporary file in its directory): %s", flag_,
                           path_, std::strerror(error));
  }
  pending_ = TrackTemp(temp_);
  // mkostemp makes the file 0600: give it the mode of the file it replaces, or of a new file.
  const mode_t mask = ::umask(0);  // read it back: there is no call that only reads it
  ::umask(mask);
  file_ = ::fchmod(fd, exists ? st.st_mode & 07777 : 0666 & ~mask) == 0 ? ::fdopen(fd, "w") : nullptr;
  if (!file_) {
    const int error = errno;
    ::close(fd);
    return InvalidArgument("%s: cannot write '%s': %s", flag_, temp_, std::strerror(error));
  }
  return absl::OkStatus();
}

absl::Status OutputFile::Finish() {
  if (!file_) return absl::OkStatus();
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  if (!closed) {
    return moonep::SystemError("writing %s file '%s' failed: %s", flag_, path_, std::strerror(errno));
  }
  return absl::OkStatus();
}

absl::Status OutputFile::Commit() {
  if (temp_.empty()) return absl::OkStatus();
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    return moonep::SystemError("%s: cannot move '%s' to '%s': %s", flag_, temp_, path_,
                               std::strerror(errno));
  }
  temp_.clear();
  if (pending_) pending_->live = 0;
  pending_ = nullptr;
  return absl::OkStatus();
}

// The run once its options are built; `totals` is set to whether it runs at totals detail, once
// the simulator has resolved auto.
absl::Status Simulate(const SimOptions& options, bool* totals) {
  MOONEP_ASSIGN_OR_RETURN(std::unique_ptr<Simulator> sim, Simulator::Create(options));
  *totals = sim->detail() == Detail::kTotals;
  if (!options.trace_path.empty()) {
    // Sizes given with a trace must be the trace's (a CSV's R is --ranks itself).
    const int32_t ranks = absl::GetFlag(FLAGS_ranks), experts = absl::GetFlag(FLAGS_experts);
    MOONEP_CHECK_ARG(ranks == 0 || ranks == sim->num_ranks(), "--ranks is %d but the trace '%s' has R=%d",
                     ranks, options.trace_path, sim->num_ranks());
    MOONEP_CHECK_ARG(experts == 0 || experts == sim->num_experts(),
                     "--experts is %d but the trace '%s' has E=%d", experts, options.trace_path,
                     sim->num_experts());
  }
  const std::string svg_dir = absl::GetFlag(FLAGS_svg);
  if (!svg_dir.empty()) MOONEP_RETURN_IF_ERROR(moonep::Annotate(PrepareSvgDir(svg_dir), "--svg"));

  const std::string csv_path = absl::GetFlag(FLAGS_csv), json_path = absl::GetFlag(FLAGS_json);
  // An output that is the trace being read, or the other output, would be truncated under it:
  // the trace destroyed, or CSV and JSON interleaved.
  MOONEP_RETURN_IF_ERROR(CheckDistinctFiles({{"--trace", options.trace_path},
                                             {"--csv", csv_path},
                                             {"--json", json_path}}));
  TeeSink tee;
  OutputFile csv_file("--csv", csv_path), json_file("--json", json_path);
  std::unique_ptr<CsvSink> csv;
  std::unique_ptr<JsonSink> json;
  if (!csv_path.empty()) {
    MOONEP_RETURN_IF_ERROR(csv_file.Open());
    csv = std::make_unique<CsvSink>(csv_file.file(), absl::StrCat("--csv file '", csv_path, "'"));
    tee.Add(csv.get());
  }
  if (!json_path.empty()) {
    MOONEP_RETURN_IF_ERROR(json_file.Open());
    json = std::make_unique<JsonSink>(json_file.file(),
                                      absl::StrCat("--json file '", json_path, "'"));
    tee.Add(json.get());
  }
  Progress progress(absl::GetFlag(FLAGS_progress));
  absl::StatusOr<SimResult> result =
      sim->Run(&tee, [&progress](int64_t done, int64_t total) { progress.Update(done, total); });
  progress.Done();
  // On any error the outputs' temporaries are removed: no half-written files that look like
  // results.
  MOONEP_RETURN_IF_ERROR(result.status());
  if (json) MOONEP_RETURN_IF_ERROR(json->Finish());
  MOONEP_RETURN_IF_ERROR(csv_file.Finish());
  MOONEP_RETURN_IF_ERROR(json_file.Finish());
  MOONEP_RETURN_IF_ERROR(csv_file.Commit());
  MOONEP_RETURN_IF_ERROR(json_file.Commit());
  for (const std::string& warning : result->warnings) {
    std::fprintf(stderr, "moonep-sim: warning: %s\n", warning.c_str());
  }
  std::printf("%s", FormatSummary(*result, sim->options()).c_str());
  if (!svg_dir.empty()) {
    MOONEP_RETURN_IF_ERROR(moonep::Annotate(WriteSvgs(*result, svg_dir), "--svg"));
    std::printf("wrote %s/imbalance.svg, rank_load.svg, step_time.svg\n", svg_dir.c_str());
  }
  return absl::OkStatus();
}

absl::Status RunMain() {
  SimOptions options;
  MOONEP_RETURN_IF_ERROR(BuildOptions(&options));
  bool totals = options.detail == DetailChoice::kTotals;
  // Out of memory on this thread; the simulator's worker threads report theirs as a status.
  try {
    return Simulate(options, &totals);
  } catch (const std::bad_alloc&) {
    return OutOfMemoryError(options, totals);
  }
}

}  // namespace

// Abseil 20220623's ParseCommandLine ends the program on a flag it cannot parse (unknown, a
// malformed value, a missing --flagfile) with std::exit(1), right after calling this hook, which
// a program may define: exiting here gives those errors the code of every other usage error.
extern "C" void ABSL_INTERNAL_C_SYMBOL(AbslInternalReportFatalUsageError)(absl::string_view) {
  std::exit(2);
}

int main(int argc, char** argv) {
  moonep::SetToolUsage(
      "simulates MoE routing skew and the expert-balancing policies of MoonEP's planner.\n"
      "  moonep-sim --preset=deepseek-v3-ep64 --routing=zipf --zipf_s=0.5 --steps=200 --svg=out\n"
      "  moonep-sim --preset=mixtral-ep8 --trace=run.trace --csv=steps.csv\n"
      "  moonep-sim --ranks=4096 --experts=8192 --topk=8 --tokens=4096 --hidden=7168 "
      "--intermediate=2048 --steps=1000\n"
      "See docs/simulator.md.",
      "planner/sim/main.cc", argc, argv);
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "moonep-sim: error: unexpected argument '%s' (flags take the form --name=value)\n",
                 rest[1]);
    return 2;
  }
  const absl::Status status = RunMain();
  if (!status.ok()) {
    std::fprintf(stderr, "moonep-sim: error: %s\n", std::string(status.message()).c_str());
    // Exit codes (docs/simulator.md): 2 bad usage or input, 1 a failure while running.
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
