// moonep-bench-dispatch: dispatch microbenchmarks, launched by mpirun. See
// docs/benchmarks-dispatch.md for what is measured and how to read the rows.
#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "moonep/core/flags_usage.h"
#include "bench/dispatch/device.h"
#include "bench/dispatch/report.h"
#include "bench/dispatch/runner.h"
#include "moonep/core/status.h"
#include "moonep/runtime/communicator.h"
#include "transport/transport.h"

ABSL_FLAG(std::string, preset, "small",
          "defaults for the shape flags left empty: small (E=16 K=2 H=512 I=256 T=256 fp32, runs "
          "in seconds on 2 cores), deepseek-v3 (E=256 K=8 H=7168 I=2048 T=4096 bf16), "
          "qwen3-30b-a3b (E=128 K=8 H=2048 I=768 T=4096 bf16), mixtral-8x7b (E=8 K=2 H=4096 "
          "I=14336 T=4096 bf16)");
ABSL_FLAG(std::string, tokens, "", "tokens per rank T, comma-separated list to sweep");
ABSL_FLAG(std::string, hidden, "", "hidden size H, list");
ABSL_FLAG(std::string, intermediate, "",
          "expert FFN intermediate size I, list (sets the prefetch/reduce payload 3*H*I and the "
          "layer's compute)");
ABSL_FLAG(std::string, topk, "", "experts per token K, list");
ABSL_FLAG(std::string, experts, "", "experts E (a multiple of the ranks), list");
ABSL_FLAG(std::string, dtype, "", "row and weight dtype: fp32, bf16, list");
ABSL_FLAG(std::string, maxvio, "",
          "routing skew as a target maxvio = max_e(T_e / mean) - 1, list (0: balanced; at most "
          "E/K - 1); routing is calibrated to hit it. Default: the preset's (small 0,2; "
          "deepseek-v3 and qwen3-30b-a3b 0,1,2,4; mixtral-8x7b 0,1,2)");
ABSL_FLAG(std::string, zipf, "",
          "routing skew as Zipf exponents in [0, 100] instead of --maxvio, list (0: balanced)");
ABSL_FLAG(std::string, policy, "moonep",
          "planner policies to measure, list: none, moonep, moonep-greedy, eplb, fastermoe-shadow");
ABSL_FLAG(std::string, backend, "mpi",
          "transport backends, list, or 'all' for every backend built (see --list_backends). nccl: "
          "device memory, one GPU per rank (rank r on GPU local_rank % GPUs); 'all' leaves it out "
          "where a rank has no GPU of its own");
ABSL_FLAG(bool, list_backends, false, "print the transport backends built and exit");
ABSL_FLAG(int32_t, slots, -1, "replica slots per rank (-1: E / R)");
ABSL_FLAG(int32_t, pad_multiple, 1, "rows of each expert group padded to a multiple of this");
ABSL_FLAG(int32_t, warmup, -1, "untimed iterations first (-1: preset, 3 for small, 5 otherwise)");
ABSL_FLAG(int32_t, iters, -1, "timed iterations (-1: preset, 20 for small, 50 otherwise)");
ABSL_FLAG(uint64_t, seed, 1, "routing seed (which experts are hot, token order)");
ABSL_FLAG(bool, baselines, true,
          "also measure policy none and MPI_Alltoallv of the same payload in the same iterations "
          "(nccl: grouped ncclSend/ncclRecv of it, impl nccl-a2a)");
ABSL_FLAG(bool, layer, true,
          "also measure the whole MoE layer forward and backward (MoeLayer with the CPU "
          "executor, or on nccl the CUDA executor on device memory; needs the expert weights of "
          "epn + slots experts per rank)");
ABSL_FLAG(int32_t, check_tokens, 2,
          "tokens per rank whose layer output, dx and d topk_weights are checked against the fp64 "
          "reference every iteration");
ABSL_FLAG(int32_t, check_iters, -1,
          "iterations, warm-up first, whose transport and all-to-all results are checked in "
          "full (-1: every one; else at least 1; the layer's sampled tokens are checked every "
          "iteration). The checks run outside the timed regions, but on large shapes they take "
          "seconds per iteration on the host: sweeps there can check the first iteration only");
ABSL_FLAG(int32_t, threads, 0,
          "executor threads per rank for the layer (0: the host's cores / ranks on the host)");
ABSL_FLAG(std::string, corrupt, "",
          "self-test of the checks: every rank flips bytes of this operation's result ("
          "dispatch, combine, prefetch, reduce, layer-fwd) before checking it; the run must then "
          "report #wrong > 0 and exit 1 (and fails, saying so, if that operation never ran: "
          "prefetch and reduce need replicas, layer-fwd the layer)");
ABSL_FLAG(std::string, json, "", "write every figure as JSON to this file (rank 0)");

namespace moonep::bench {
namespace {

struct Preset {
  const char* name;
  int32_t experts, topk;
  int64_t hidden, intermediate, tokens;
  const char* dtype;
  const char* maxvio;
  int32_t warmup, iters;
};
constexpr Preset kPresets[] = {
    {"small", 16, 2, 512, 256, 256, "fp32", "0,2", 3, 20},
    {"deepseek-v3", 256, 8, 7168, 2048, 4096, "bf16", "0,1,2,4", 5, 50},
    {"qwen3-30b-a3b", 128, 8, 2048, 768, 4096, "bf16", "0,1,2,4", 5, 50},
    {"mixtral-8x7b", 8, 2, 4096, 14336, 4096, "bf16", "0,1,2", 5, 50},
};

template <typename T>
absl::Status ParseList(const char* flag, const std::string& text, std::vector<T>* out) {
  out->clear();
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    T v{};
    bool ok;
    if constexpr (std::is_floating_point_v<T>) {
      ok = absl::SimpleAtod(item, &v);
    } else {
      ok = absl::SimpleAtoi(item, &v);
    }
    if (!ok) return InvalidArgument("--%s: '%s' is not a number", flag, std::string(item));
    out->push_back(v);
  }
  if (out->empty()) return InvalidArgument("--%s: empty list", flag);
  return absl::OkStatus();
}

std::vector<std::string> Words(const std::string& text) {
  return absl::StrSplit(text, ',', absl::SkipWhitespace());
}

// The backends this binary can run: the transport library's (host memory) and nccl (device
// memory; the library leaves it out of AvailableBackends() because its suites pass host buffers).
std::vector<std::string> BuiltBackends() {
  std::vector<std::string> built = transport::AvailableBackends();
#ifdef MOONEP_BENCH_WITH_NCCL
  built.push_back("nccl");
#endif
  return built;
}

// Whether every rank has a GPU of its own (the NCCL transport refuses two ranks on one GPU).
struct GpuPlacement {
  bool enough = false;         // on every host, GPUs >= ranks
  int32_t max_local_ranks = 0;  // over hosts
  int32_t min_gpus = 0;         // over hosts
};

std::string LoadAverage() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a.empty() ? "unknown" : a + " " + b + " " + c;
}

absl::Status BuildConfigs(int32_t num_ranks, int32_t threads, const GpuPlacement& gpus,
                          std::vector<BenchConfig>* out, std::vector<std::string>* notes) {
  const std::string preset_name = absl::GetFlag(FLAGS_preset);
  const Preset* preset = nullptr;
  std::vector<std::string> names;
  for (const Preset& p : kPresets) {
    names.push_back(p.name);
    if (preset_name == p.name) preset = &p;
  }
  if (preset == nullptr) {
    return InvalidArgument("--preset: unknown '%s' (one of %s)", preset_name,
                           absl::StrJoin(names, ", "));
  }
  auto or_preset = [](const std::string& v, const std::string& def) { return v.empty() ? def : v; };
  std::vector<int64_t> tokens, hidden, inter;
  std::vector<int32_t> topk, experts;
  MOONEP_RETURN_IF_ERROR(ParseList("tokens", or_preset(absl::GetFlag(FLAGS_tokens), std::to_string(preset->tokens)), &tokens));
  MOONEP_RETURN_IF_ERROR(ParseList("hidden", or_preset(absl::GetFlag(FLAGS_hidden), std::to_string(preset->hidden)), &hidden));
  MOONEP_RETURN_IF_ERROR(ParseList("intermediate", or_preset(absl::GetFlag(FLAGS_intermediate), std::to_string(preset->intermediate)), &inter));
  MOONEP_RETURN_IF_ERROR(ParseList("topk", or_preset(absl::GetFlag(FLAGS_topk), std::to_string(preset->topk)), &topk));
  MOONEP_RETURN_IF_ERROR(ParseList("experts", or_preset(absl::GetFlag(FLAGS_experts), std::to_string(preset->experts)), &experts));
  std::vector<DType> dtypes;
  for (const std::string& d : Words(or_preset(absl::GetFlag(FLAGS_dtype), preset->dtype))) {
    if (d == "fp32" || d == "float32") {
      dtypes.push_back(DType::kFloat32);
    } else if (d == "bf16" || d == "bfloat16") {
      dtypes.push_back(DType::kBFloat16);
    } else {
      return InvalidArgument("--dtype: unknown '%s' (fp32 or bf16)", d);
    }
  }
  if (dtypes.empty()) return InvalidArgument("--dtype: empty list");
  std::vector<SkewSpec> skews;
  const std::string maxvio = absl::GetFlag(FLAGS_maxvio), zipf = absl::GetFlag(FLAGS_zipf);
  if (!maxvio.empty() && !zipf.empty()) {
    return InvalidArgument("--maxvio and --zipf are alternatives; pass one");
  }
  std::vector<double> values;
  MOONEP_RETURN_IF_ERROR(ParseList(zipf.empty() ? "maxvio" : "zipf",
                                   zipf.empty() ? or_preset(maxvio, preset->maxvio) : zipf, &values));
  for (double v : values) {
    SkewSpec s;
    s.kind = zipf.empty() ? SkewSpec::Kind::kMaxvio : SkewSpec::Kind::kZipf;
    s.value = v;
    skews.push_back(s);
  }
  std::vector<planner::Policy> policies;
  for (const std::string& p : Words(absl::GetFlag(FLAGS_policy))) {
    planner::Policy policy;
    if (!planner::ParsePolicy(p, &policy) || policy == planner::Policy::kTestForceReplicas) {
      return InvalidArgument("--policy: unknown '%s' (none, moonep, moonep-greedy, eplb, "
                             "fastermoe-shadow)", p);
    }
    policies.push_back(policy);
  }
  if (policies.empty()) return InvalidArgument("--policy: empty list");
  const std::vector<std::string> built = BuiltBackends();
  std::vector<std::string> backends = Words(absl::GetFlag(FLAGS_backend));
  const bool all = backends.size() == 1 && backends[0] == "all";
  if (all) {
    backends.clear();
    for (const std::string& b : built) {
      if (b == "nccl" && !gpus.enough) {
        notes->push_back(absl::StrFormat(
            "--backend=all: nccl left out: it needs one GPU per rank (%d rank(s) on a host, %d "
            "GPU(s) visible)", gpus.max_local_ranks, gpus.min_gpus));
        continue;
      }
      backends.push_back(b);
    }
  }
  for (const std::string& b : backends) {
    if (std::find(built.begin(), built.end(), b) == built.end()) {
      return InvalidArgument("--backend: '%s' is not built (built: %s)", b, absl::StrJoin(built, ", "));
    }
    if (b == "nccl" && !gpus.enough) {
      return InvalidArgument(
          "--backend=nccl needs one GPU per rank: %d rank(s) on a host, %d GPU(s) visible there "
          "(run on a machine with GPUs, with at most one rank per GPU)",
          gpus.max_local_ranks, gpus.min_gpus);
    }
  }
  if (backends.empty()) return InvalidArgument("--backend: empty list");
  const int32_t warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  MOONEP_CHECK_ARG(warmup >= -1, "--warmup must be >= 0, got %d", warmup);
  MOONEP_CHECK_ARG(iters == -1 || iters >= 1, "--iters must be >= 1, got %d", iters);
  const std::string corrupt = absl::GetFlag(FLAGS_corrupt);
  MOONEP_CHECK_ARG(corrupt.empty() || corrupt == "dispatch" ||
                       corrupt == "combine" || corrupt == "prefetch" || corrupt == "reduce" ||
                       corrupt == "layer-fwd",
                   "--corrupt: unknown operation '%s'", corrupt);
  MOONEP_CHECK_ARG(absl::GetFlag(FLAGS_check_tokens) >= 0, "--check_tokens must be >= 0");
  MOONEP_CHECK_ARG(absl::GetFlag(FLAGS_check_iters) == -1 || absl::GetFlag(FLAGS_check_iters) >= 1,
                   "--check_iters must be -1 (every iteration) or >= 1, got %d",
                   absl::GetFlag(FLAGS_check_iters));
  MOONEP_CHECK_ARG(corrupt.empty() || absl::GetFlag(FLAGS_check_iters) == -1,
                   "--corrupt needs every iteration checked (--check_iters=-1)");
  const int32_t pad = absl::GetFlag(FLAGS_pad_multiple), slots = absl::GetFlag(FLAGS_slots);
  MOONEP_CHECK_ARG(pad >= 1 && pad <= (1 << 16), "--pad_multiple must be in [1, 65536], got %d",
                   pad);
  MOONEP_CHECK_ARG(slots == -1 || slots >= 1, "--slots must be -1 (E/R) or >= 1, got %d", slots);
  for (int32_t e : experts) {
    MOONEP_CHECK_ARG(e >= num_ranks && e % num_ranks == 0,
                     "--experts=%d must be a positive multiple of the number of ranks (%d)", e,
                     num_ranks);
    // Every rank keeps per-expert state (counts, plans, weights of its slots) of this size.
    MOONEP_CHECK_ARG(e <= (1 << 20), "--experts=%d: at most 2^20", e);
    MOONEP_CHECK_ARG(slots <= e, "--slots=%d must not exceed --experts=%d", slots, e);
  }
  if (!corrupt.empty()) {
    // An operation the run never performs would leave the self-test with nothing to find.
    MOONEP_CHECK_ARG(corrupt != "layer-fwd" ||
                         (absl::GetFlag(FLAGS_layer) && absl::GetFlag(FLAGS_check_tokens) >= 1),
                     "--corrupt=layer-fwd needs --layer=true and --check_tokens >= 1");
  }
  // The checks RunConfig would make, up front, so bad flags end every rank cleanly.
  for (int64_t t : tokens) MOONEP_CHECK_ARG(t >= 1, "--tokens must be >= 1, got %d", t);
  for (int64_t h : hidden) {
    MOONEP_CHECK_ARG(h >= 1, "--hidden must be >= 1, got %d", h);
    for (DType d : dtypes) {
      MOONEP_CHECK_ARG(h <= transport::kMaxRowBytes / static_cast<int64_t>(DTypeSize(d)),
                       "--hidden=%d: a row of %s is above %d bytes, the transports' "
                       "max_row_bytes", h, DTypeName(d), transport::kMaxRowBytes);
    }
  }
  for (int64_t t : tokens) {
    for (int32_t k : topk) {
      MOONEP_CHECK_ARG(k < 1 || t <= kMaxEntriesPerRank / k,
                       "--tokens * --topk = %d * %d is above %d, the most entries a rank can "
                       "route", t, k, kMaxEntriesPerRank);
    }
  }
  for (int64_t i : inter) {
    MOONEP_CHECK_ARG(i >= 1 && i <= (int64_t{1} << 30), "--intermediate must be in [1, 2^30], got %d",
                     i);
    for (int64_t h : hidden) {
      for (DType d : dtypes) {
        // An expert's three matrices are what prefetch and reduce move (the planner's bound on
        // their bytes); h <= 2^30 and i <= 2^30, so the product fits in 128 bits.
        const __int128 bytes = static_cast<__int128>(3) * h * i * static_cast<int64_t>(DTypeSize(d));
        MOONEP_CHECK_ARG(bytes <= (__int128{1} << 40),
                         "--hidden x --intermediate = %d x %d: an expert's three %s matrices are "
                         "then above 2^40 bytes", h, i, DTypeName(d));
      }
    }
  }
  for (int32_t e : experts) {
    for (int32_t k : topk) {
      MOONEP_CHECK_ARG(k >= 1 && k <= e, "--topk=%d must be in [1, experts=%d]", k, e);
      for (const SkewSpec& skew : skews) {
        MOONEP_CHECK_ARG(std::isfinite(skew.value) && skew.value >= 0, "--%s must be >= 0, got %g",
                         skew.kind == SkewSpec::Kind::kZipf ? "zipf" : "maxvio", skew.value);
        MOONEP_CHECK_ARG(skew.kind != SkewSpec::Kind::kZipf || skew.value <= 100,
                         "--zipf must be in [0, 100], got %g", skew.value);
        MOONEP_CHECK_ARG(skew.kind == SkewSpec::Kind::kZipf ||
                             skew.value <= static_cast<double>(e) / k - 1.0 + 1e-9,
                         "--maxvio=%g cannot be reached with experts=%d, topk=%d (at most E/K - 1 "
                         "= %g)", skew.value, e, k, static_cast<double>(e) / k - 1.0);
      }
    }
  }
  for (const std::string& backend : backends) {
    for (planner::Policy policy : policies) {
      for (DType dtype : dtypes) {
        for (int32_t e : experts) {
          for (int32_t k : topk) {
            for (int64_t h : hidden) {
              for (int64_t i : inter) {
                for (int64_t t : tokens) {
                  for (const SkewSpec& skew : skews) {
                    BenchConfig c;
                    c.backend = backend;
                    c.policy = policy;
                    c.dtype = dtype;
                    c.num_experts = e;
                    c.top_k = k;
                    c.hidden = h;
                    c.intermediate = i;
                    c.tokens = t;
                    c.skew = skew;
                    c.slots = absl::GetFlag(FLAGS_slots);
                    c.pad_multiple = absl::GetFlag(FLAGS_pad_multiple);
                    c.warmup = warmup >= 0 ? warmup : preset->warmup;
                    c.iters = iters >= 1 ? iters : preset->iters;
                    c.seed = absl::GetFlag(FLAGS_seed);
                    c.baselines = absl::GetFlag(FLAGS_baselines);
                    c.layer = absl::GetFlag(FLAGS_layer);
                    c.check_tokens = absl::GetFlag(FLAGS_check_tokens);
                    c.check_iters = absl::GetFlag(FLAGS_check_iters);
                    c.threads = threads;
                    c.corrupt_op = absl::GetFlag(FLAGS_corrupt);
                    out->push_back(c);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv, const std::string& command) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const bool root = rank == 0;
  (void)argc;
  (void)argv;
  if (absl::GetFlag(FLAGS_list_backends)) {
    if (root) std::printf("%s\n", absl::StrJoin(BuiltBackends(), "\n").c_str());
    return 0;
  }
  // Ranks on this host decide the default executor threads.
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  int local_size = 1, local_rank = 0;
  MPI_Comm_size(local, &local_size);
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_free(&local);
  int leaders = local_rank == 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &leaders, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  int32_t threads = absl::GetFlag(FLAGS_threads);
  if (threads <= 0) {
    const int hw = static_cast<int>(std::thread::hardware_concurrency());
    threads = std::max(1, std::min(1024, hw / std::max(1, local_size)));  // the executor's cap
  }

  GpuPlacement gpus;
  {
    // Collective, so every rank reaches the same verdict. Without CUDA built in: 0 GPUs.
    int v[2] = {local_size, -DeviceCount()};
    MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    gpus.max_local_ranks = v[0];
    gpus.min_gpus = -v[1];
    int enough = DeviceCount() >= local_size ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &enough, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    gpus.enough = enough == 1;
  }
  std::vector<BenchConfig> configs;
  std::vector<std::string> notes;
  if (absl::Status s = BuildConfigs(size, threads, gpus, &configs, &notes); !s.ok()) {
    if (root) std::fprintf(stderr, "moonep-bench-dispatch: error: %s\n", std::string(s.message()).c_str());
    return 2;  // every rank reached the same verdict from the same flags
  }
  {
    // An unwritable --json fails now, not after the whole run.
    const std::string path = absl::GetFlag(FLAGS_json);
    int writable = 1;
    if (root && !path.empty()) {
      std::ofstream f(path);
      writable = f.good() ? 1 : 0;
    }
    MPI_Bcast(&writable, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (!writable) {
      if (root) {
        std::fprintf(stderr, "moonep-bench-dispatch: error: --json: cannot write '%s'\n",
                     path.c_str());
      }
      return 2;
    }
  }
  bool uses_gpu = false;
  for (const BenchConfig& c : configs) uses_gpu |= c.backend == "nccl";
  if (uses_gpu) {
    // One rank per GPU: the host's rank i on GPU i (gpus.enough: there are that many).
    int ok = 1;
    if (absl::Status s = SelectDevice(local_rank % std::max(1, DeviceCount())); !s.ok()) {
      std::fprintf(stderr, "[rank %d] moonep-bench-dispatch: error: %s\n", rank,
                   std::string(s.message()).c_str());
      ok = 0;
    }
    MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!ok) return 1;
  }
  auto rt = runtime::Communicator::FromMpi(MPI_COMM_WORLD);
  if (!rt.ok()) {
    std::fprintf(stderr, "[rank %d] moonep-bench-dispatch: error: %s\n", rank,
                 std::string(rt.status().message()).c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  RunInfo info;
  info.num_ranks = size;
  info.num_hosts = leaders;
  info.backends = BuiltBackends();
  info.command = command;
  info.load_start = LoadAverage();
  {
    char buf[64];
    const std::time_t now = std::time(nullptr);
    std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", std::gmtime(&now));
    info.started_utc = buf;
  }
  if (root) {
    PrintRunHeader(info, stdout);
    for (const std::string& n : notes) std::printf("# %s\n", n.c_str());
    std::fflush(stdout);
  }
  std::vector<ConfigResult> results;
  for (size_t i = 0; i < configs.size(); ++i) {
    ConfigResult r;
    absl::Status s;
    try {
      s = RunConfig(configs[i], MPI_COMM_WORLD, rt->get(), &r);
    } catch (const std::bad_alloc&) {
      // The host allocations (weights, fp32 gradients, buffers) of this configuration do not fit
      // on this rank: said as an error like any other, not an abort with a stack dump.
      s = absl::ResourceExhaustedError(
          "out of host memory setting up or running this configuration (its experts' weights, "
          "fp32 gradients and buffers do not fit on this rank: use more ranks, fewer --tokens, or "
          "--layer=false)");
    } catch (const std::length_error& e) {
      s = absl::ResourceExhaustedError(absl::StrCat(
          "a buffer of this configuration is larger than a vector can hold (", e.what(),
          "): use fewer --tokens, a smaller --hidden or --intermediate"));
    } catch (const std::exception& e) {
      s = absl::InternalError(absl::StrCat("this configuration failed: ", e.what()));
    }
    if (!s.ok()) {
      // An operation failed (or the setup did): say where, and end the job rather than hang.
      std::fprintf(stderr, "[rank %d] moonep-bench-dispatch: configuration %zu: %s\n", rank, i + 1,
                   s.ToString().c_str());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
    }
    if (root) {
      PrintConfig(r, static_cast<int32_t>(i + 1), static_cast<int32_t>(configs.size()), stdout);
      std::fflush(stdout);
    }
    results.push_back(std::move(r));
  }
  info.load_end = LoadAverage();
  int64_t wrong = 0, corrupted = 0;
  for (const ConfigResult& r : results) {
    for (const OpResult& o : r.ops) wrong += o.wrong;
    corrupted += r.corrupted;
  }
  const std::string corrupt = absl::GetFlag(FLAGS_corrupt);
  MPI_Allreduce(MPI_IN_PLACE, &corrupted, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  const bool corrupt_unused = !corrupt.empty() && corrupted == 0;
  if (root) {
    std::printf("# load average at the end: %s\n", info.load_end.c_str());
    PrintFooter(results, stdout, corrupt);
    const std::string path = absl::GetFlag(FLAGS_json);
    if (!path.empty()) {
      std::ofstream f(path);
      f << ToJson(info, results);
      if (!f.good()) {
        std::fprintf(stderr, "moonep-bench-dispatch: error: --json: cannot write '%s'\n", path.c_str());
        return 1;
      }
    }
  }
  if (corrupt_unused && root) {
    std::fprintf(stderr,
                 "moonep-bench-dispatch: error: --corrupt=%s: no configuration ran that operation "
                 "(prefetch and reduce run only where the plan makes replicas: a skewed routing "
                 "and a policy other than none), so the checks were not tested\n",
                 corrupt.c_str());
  }
  rt->reset();
  return wrong == 0 && !corrupt_unused ? 0 : 1;
}

}  // namespace
}  // namespace moonep::bench

int main(int argc, char** argv) {
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  // --help and flag errors come from the flags library, before MPI is up: only the launcher's
  // rank 0 prints them (every rank parses the same arguments and exits the same way).
  const char* launcher_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const bool quiet = launcher_rank != nullptr && std::string(launcher_rank) != "0";
  int saved_out = -1, saved_err = -1;
  if (quiet) {
    std::fflush(stdout);
    std::fflush(stderr);
    saved_out = dup(1);
    saved_err = dup(2);
    const int null_fd = open("/dev/null", O_WRONLY);
    if (null_fd >= 0) {
      dup2(null_fd, 1);
      dup2(null_fd, 2);
      close(null_fd);
    }
  }
  moonep::SetToolUsage(
      "dispatch microbenchmarks of MoonEP, launched by mpirun:\n"
      "  mpirun -np 4 moonep-bench-dispatch                       # small preset, maxvio 0 and 2\n"
      "  mpirun -np 16 moonep-bench-dispatch --preset=deepseek-v3 --maxvio=0,1,2,4 --layer=false\n"
      "  mpirun -np 8 moonep-bench-dispatch --tokens=256,1024,4096 --policy=moonep,eplb --json=out.json\n"
      "Every operation's result is checked in every iteration (#wrong). See "
      "docs/benchmarks-dispatch.md.",
      "bench/dispatch/bench_dispatch.cc", argc, argv);
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (quiet) {
    std::fflush(stdout);
    std::fflush(stderr);
    if (saved_out >= 0) dup2(saved_out, 1), close(saved_out);
    if (saved_err >= 0) dup2(saved_err, 2), close(saved_err);
  }
  if (rest.size() > 1) {
    // MPI is not up yet: only the launcher's rank 0 speaks.
    if (quiet) return 2;
    std::fprintf(stderr,
                 "moonep-bench-dispatch: error: unexpected argument '%s' (flags take the form "
                 "--name=value)\n", rest[1]);
    return 2;
  }
  if (auto s = moonep::runtime::EnsureMpi(); !s.ok()) {
    std::fprintf(stderr, "moonep-bench-dispatch: error: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  const int rc = moonep::bench::Main(argc, argv, command);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
  return rc;
}
