// moonep-bench-speeds: what telling the planner each rank's speed buys when ranks compute at
// different rates (docs/runtime.md, "Ranks of different speeds"). Usage:
//   mpirun -np N moonep-bench-speeds [--slow-ranks LIST] [--threads N] [--slow-threads N]
//     [--speeds measured|LIST] [--policy NAME] [--tokens T] [--hidden H] [--inter I]
//     [--experts-per-rank N] [--topk K] [--zipf S] [--dtype fp32|bf16] [--warmup N] [--iters N]
//     [--probe-rows N] [--seed N]
//
// The ranks of --slow-ranks run their executor on --slow-threads threads and the others on
// --threads, so they compute slower, as a throttled or older GPU, or a rank sharing its cores,
// would. The cost probe then measures every rank's speed (or --speeds gives them), and three
// layers of one shape run the same steps, interleaved in every iteration (their order rotating):
//   - the policy with the speeds (LayerConfig::speeds),
//   - the same policy without them (what a layer does when not told),
//   - policy none (home placement only).
// Per layer: the step time (forward + backward, from a barrier to the slowest rank's end) as the
// median and maximum over the iterations, the slowest rank's executor time, the rows the slow ranks
// computed against the others, and the ratios of the other two layers' step times to the first's.
// y, dx, d_topk_weights and the weight gradients of the two balanced layers are checked against
// policy none's after every step (outside the timed region); the run fails when one differs.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/dispatch/workload.h"
#include "moonep/core/dtype.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/cost_probe.h"
#include "moonep/runtime/moe_layer.h"
#include "moonep/runtime/tool_args.h"
#include "planner/plan.h"

namespace {

using moonep::DType;
using moonep::TensorView;
using moonep::runtime::LayerConfig;
using moonep::runtime::MoeLayer;
using moonep::runtime::Phase;

constexpr const char* kUsage =
    "usage: moonep-bench-speeds [--slow-ranks LIST] [--threads N] [--slow-threads N]\n"
    "  [--speeds measured|LIST] [--policy NAME] [--tokens T] [--hidden H] [--inter I]\n"
    "  [--experts-per-rank N] [--topk K] [--zipf S] [--dtype fp32|bf16] [--warmup N] [--iters N]\n"
    "  [--probe-rows N] [--seed N]";

struct Options {
  std::vector<int64_t> slow_ranks = {0};
  int64_t threads = 2, slow_threads = 1;
  std::vector<double> speeds;  // empty: measured by the cost probe
  moonep::planner::Policy policy = moonep::planner::Policy::kMoonEP;
  int64_t tokens = 1024, hidden = 512, inter = 512, epn = 4, topk = 4;
  double zipf = 1.2;
  DType dtype = DType::kFloat32;
  int64_t warmup = 2, iters = 10, probe_rows = 0, seed = 1;
};

// A comma list of numbers: true with every item parsed by `parse`.
template <typename T, typename Parse>
bool ParseList(const std::string& v, Parse parse, std::vector<T>* out) {
  out->clear();
  for (absl::string_view item : absl::StrSplit(v, ',')) {
    T x{};
    if (!parse(item, &x)) return false;
    out->push_back(x);
  }
  return !out->empty();
}

bool ParseArgs(int argc, char** argv, Options* o, std::string* error) {
  using moonep::runtime::IntFlag;
  const IntFlag ints[] = {{"--threads", 1, 1024, &o->threads},
                          {"--slow-threads", 1, 1024, &o->slow_threads},
                          {"--tokens", 1, 1 << 20, &o->tokens},
                          {"--hidden", 1, 1 << 16, &o->hidden},
                          {"--inter", 1, 1 << 16, &o->inter},
                          {"--experts-per-rank", 1, 1024, &o->epn},
                          {"--topk", 1, 1024, &o->topk},
                          {"--warmup", 0, 1000, &o->warmup},
                          {"--iters", 1, 100000, &o->iters},
                          {"--probe-rows", 0, 1 << 20, &o->probe_rows},
                          {"--seed", 0, int64_t{1} << 40, &o->seed}};
  auto other = [o](const std::string& arg, const std::string& v, std::string* error) {
    *error = "";
    if (arg == "--slow-ranks") {
      if (v == "none") {
        o->slow_ranks.clear();
      } else if (!ParseList<int64_t>(v, [](absl::string_view s, int64_t* x) {
                   return absl::SimpleAtoi(s, x) && *x >= 0;
                 }, &o->slow_ranks)) {
        *error = "--slow-ranks " + v + ": expected 'none' or a comma list of ranks";
        return false;
      }
    } else if (arg == "--speeds") {
      if (v == "measured") {
        o->speeds.clear();
      } else if (!ParseList<double>(v, [](absl::string_view s, double* x) {
                   return absl::SimpleAtod(s, x) && std::isfinite(*x) && *x > 0;
                 }, &o->speeds)) {
        *error = "--speeds " + v + ": expected 'measured' or a comma list of positive numbers";
        return false;
      }
    } else if (arg == "--zipf") {
      if (!absl::SimpleAtod(v, &o->zipf) || !(o->zipf >= 0 && o->zipf <= 100)) {
        *error = "--zipf " + v + ": expected a number in [0, 100]";
        return false;
      }
    } else if (arg == "--dtype") {
      if (v != "fp32" && v != "bf16") {
        *error = "--dtype " + v + ": expected fp32 or bf16";
        return false;
      }
      o->dtype = v == "fp32" ? DType::kFloat32 : DType::kBFloat16;
    } else if (arg == "--policy") {
      if (!moonep::planner::ParsePolicy(v, &o->policy) ||
          (o->policy != moonep::planner::Policy::kMoonEP &&
           o->policy != moonep::planner::Policy::kMoonEPGreedy)) {
        *error = "--policy " + v + ": expected moonep or moonep-greedy, the policies that use "
                 "speeds (none runs anyway as the baseline)";
        return false;
      }
    } else {
      return false;
    }
    return true;
  };
  return moonep::runtime::ParseToolArgs(argc, argv, ints, kUsage, other, error);
}

double MaxOver(double v) { return moonep::runtime::MaxOverRanks(v, MPI_COMM_WORLD); }

// Quantile q of `v` (nearest rank).
double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
  return v[std::min(i, v.size() - 1)];
}

// One layer of the comparison, its gradients and outputs.
struct Arm {
  std::string name;
  std::unique_ptr<MoeLayer> layer;
  std::vector<float> grads;  // [epn][3][H * I] fp32
  std::vector<char> y, dx;
  std::vector<float> dtopk;
  std::vector<double> step_ms, compute_ms;
  int64_t slow_rows = 0, other_rows = 0;  // summed over the timed steps, over slow / other ranks
};

// Policy none's results of a step, each with its largest magnitude over every rank.
struct Reference {
  std::vector<float> values;
  double scale = 0;
  explicit Reference(std::vector<float> v) : values(std::move(v)) {
    for (float x : values) scale = std::max(scale, static_cast<double>(std::abs(x)));
    scale = MaxOver(scale);
  }
};

// Elements of `a` that differ from the reference by more than tol times its largest magnitude.
int64_t CountDiffering(const std::vector<float>& a, const Reference& ref, double tol) {
  int64_t wrong = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(std::abs(static_cast<double>(a[i]) - ref.values[i]) <= tol * ref.scale)) ++wrong;
  }
  return wrong;
}

std::vector<float> ToFloat(const std::vector<char>& bytes, DType dtype) {
  std::vector<float> out(bytes.size() / moonep::DTypeSize(dtype));
  moonep::ConvertToFloat(bytes.data(), dtype, out.data(), out.size());
  return out;
}

int Run(int argc, char** argv) {
  int rank = 0, R = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  const bool root = rank == 0;
  Options o;
  std::string error;
  if (!ParseArgs(argc, argv, &o, &error)) {
    const bool help = error == kUsage;
    if (root) std::fprintf(help ? stdout : stderr, "%s\n", error.c_str());
    return help ? 0 : 2;
  }
  auto fail = [&](const std::string& what) {
    if (root) std::fprintf(stderr, "moonep-bench-speeds: %s\n", what.c_str());
    return 2;
  };
  for (size_t i = 0; i < o.slow_ranks.size(); ++i) {
    const int64_t r = o.slow_ranks[i];
    if (r >= R) return fail(absl::StrFormat("--slow-ranks: rank %d of %d ranks", r, R));
    if (std::count(o.slow_ranks.begin(), o.slow_ranks.begin() + i, r) > 0) {
      return fail(absl::StrFormat("--slow-ranks: rank %d given twice", r));
    }
  }
  if (!o.speeds.empty() && static_cast<int>(o.speeds.size()) != R) {
    return fail(absl::StrFormat("--speeds gives %d speeds for %d ranks", o.speeds.size(), R));
  }
  const int32_t E = static_cast<int32_t>(o.epn * R), K = static_cast<int32_t>(o.topk);
  if (K > E) return fail(absl::StrFormat("--topk %d exceeds the %d experts", K, E));
  const int64_t T = o.tokens, H = o.hidden, I = o.inter;
  const bool slow = std::count(o.slow_ranks.begin(), o.slow_ranks.end(), rank) > 0;

  moonep::bench::RoutingSpec spec;
  spec.num_ranks = R;
  spec.num_experts = E;
  spec.top_k = K;
  spec.tokens = T;
  spec.skew.kind = moonep::bench::SkewSpec::Kind::kZipf;
  spec.skew.value = o.zipf;
  spec.seed = static_cast<uint64_t>(o.seed);
  auto routing = moonep::bench::MakeRouting(spec);
  if (!routing.ok()) return fail(std::string(routing.status().message()));

  auto comm = moonep::runtime::Communicator::FromMpi(MPI_COMM_WORLD);
  if (!comm.ok()) return fail(std::string(comm.status().message()));

  LayerConfig config;
  config.num_experts = E;
  config.top_k = K;
  config.hidden = H;
  config.intermediate = I;
  config.dtype = o.dtype;
  config.max_tokens = T;
  config.num_threads = static_cast<int32_t>(slow ? o.slow_threads : o.threads);

  std::vector<double> speeds = o.speeds;
  std::string speeds_from = "given";
  if (speeds.empty()) {
    moonep::runtime::CostProbeOptions probe;
    // By default the rows a rank's experts hold on average in a step, as in the layers below.
    probe.compute_rows = o.probe_rows > 0 ? o.probe_rows : std::max<int64_t>(1, T * K / o.epn);
    probe.link_rows = 64;
    probe.transfer_rows = 64;
    auto m = moonep::runtime::MeasureCosts(comm->get(), config, probe);
    if (!m.ok()) {
      std::fprintf(stderr, "[rank %d] moonep-bench-speeds: cost probe: %s\n", rank,
                   std::string(m.status().message()).c_str());
      return 1;
    }
    speeds = m->speeds;
    speeds_from = absl::StrFormat("measured by the cost probe, %d rows", probe.compute_rows);
  }

  // Every rank's home experts, the same values for every layer.
  const size_t block = static_cast<size_t>(H * I), ds = moonep::DTypeSize(o.dtype);
  std::vector<char> weights(static_cast<size_t>(o.epn) * 3 * block * ds);
  std::vector<moonep::compute::ExpertParams> params(static_cast<size_t>(o.epn));
  for (int64_t e = 0; e < o.epn; ++e) {
    TensorView* views[3] = {&params[e].gate, &params[e].up, &params[e].down};
    for (int m = 0; m < 3; ++m) {
      char* at = weights.data() + (static_cast<size_t>(e) * 3 + m) * block * ds;
      moonep::bench::FillWeights(static_cast<int32_t>(rank * o.epn + e), m, H, I, o.dtype,
                                 static_cast<int64_t>(block), at);
      *views[m] = m == 2 ? TensorView::Contiguous(at, o.dtype, {I, H})
                         : TensorView::Contiguous(at, o.dtype, {H, I});
    }
  }
  // This rank's tokens.
  std::vector<char> x(static_cast<size_t>(T * H) * ds), dy(x.size());
  std::vector<float> topk_w(static_cast<size_t>(T * K));
  const std::vector<int32_t> ids(routing->ids_of(rank), routing->ids_of(rank) + T * K);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < H; ++c) {
      moonep::StoreFromFloat(x.data(), o.dtype, static_cast<size_t>(t * H + c),
                             moonep::bench::TokenValue(rank, t, c));
      moonep::StoreFromFloat(dy.data(), o.dtype, static_cast<size_t>(t * H + c),
                             moonep::bench::GradValue(rank, t, c));
    }
    for (int32_t k = 0; k < K; ++k) {
      topk_w[static_cast<size_t>(t * K + k)] = moonep::bench::TopkWeightValue(rank, t, k);
    }
  }

  std::vector<Arm> arms(3);
  const std::string policy = moonep::planner::PolicyName(o.policy);
  arms[0].name = policy + " + speeds";
  arms[1].name = policy;
  arms[2].name = "none";
  for (int a = 0; a < 3; ++a) {
    LayerConfig c = config;
    c.policy = a == 2 ? moonep::planner::Policy::kNone : o.policy;
    if (a == 0) c.speeds = speeds;
    auto layer = MoeLayer::Create(comm->get(), c);
    if (!layer.ok()) {
      std::fprintf(stderr, "[rank %d] moonep-bench-speeds: %s\n", rank,
                   std::string(layer.status().message()).c_str());
      return 1;
    }
    Arm& arm = arms[static_cast<size_t>(a)];
    arm.layer = std::move(*layer);
    arm.grads.assign(static_cast<size_t>(o.epn) * 3 * block, 0.0f);
    std::vector<moonep::compute::ExpertParams> grads(static_cast<size_t>(o.epn));
    for (int64_t e = 0; e < o.epn; ++e) {
      float* g = arm.grads.data() + static_cast<size_t>(e) * 3 * block;
      grads[e].gate = TensorView::Contiguous(g, DType::kFloat32, {H, I});
      grads[e].up = TensorView::Contiguous(g + block, DType::kFloat32, {H, I});
      grads[e].down = TensorView::Contiguous(g + 2 * block, DType::kFloat32, {I, H});
    }
    // Local: a rank that fails says so, and every rank stops here together.
    const absl::Status bound = arm.layer->BindParameters(params, grads);
    if (!bound.ok()) {
      std::fprintf(stderr, "[rank %d] moonep-bench-speeds: %s\n", rank,
                   std::string(bound.message()).c_str());
    }
    int failed = bound.ok() ? 0 : 1;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (failed) return 1;
    arm.y.assign(x.size(), 0);
    arm.dx.assign(x.size(), 0);
    arm.dtopk.assign(topk_w.size(), 0.0f);
  }

  if (root) {
    std::printf("moonep-bench-speeds: %d ranks, slow ranks %s on %ld executor thread(s), the "
                "others on %ld; H=%ld I=%ld %s, %ld tokens a rank, top-%d of %d experts, Zipf %.2f "
                "(max/mean expert load %.2f)\n",
                R, o.slow_ranks.empty() ? "none" : absl::StrJoin(o.slow_ranks, ",").c_str(),
                static_cast<long>(o.slow_threads), static_cast<long>(o.threads),
                static_cast<long>(H), static_cast<long>(I), moonep::DTypeName(o.dtype),
                static_cast<long>(T), K, E, routing->zipf_s, routing->maxvio + 1);
    std::printf("speeds (%s): %s\n", speeds_from.c_str(),
                absl::StrJoin(speeds, ",", [](std::string* out, double v) {
                  absl::StrAppendFormat(out, "%.3f", v);
                }).c_str());
    std::fflush(stdout);
  }

  const double tol = o.dtype == DType::kFloat32 ? 1e-5 : 1e-2;
  int64_t wrong = 0, checked = 0;
  for (int64_t it = 0; it < o.warmup + o.iters; ++it) {
    const bool timed = it >= o.warmup;
    for (int j = 0; j < 3; ++j) {
      Arm& arm = arms[static_cast<size_t>((it + j) % 3)];
      std::fill(arm.grads.begin(), arm.grads.end(), 0.0f);
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      auto h = arm.layer->Forward(T, TensorView::Contiguous(x.data(), o.dtype, {T, H}), ids,
                                  topk_w, TensorView::Contiguous(arm.y.data(), o.dtype, {T, H}));
      absl::Status s = h.status();
      if (s.ok()) {
        s = arm.layer->Backward(*h, TensorView::Contiguous(dy.data(), o.dtype, {T, H}),
                                TensorView::Contiguous(arm.dx.data(), o.dtype, {T, H}),
                                absl::MakeSpan(arm.dtopk));
      }
      const double seconds = MPI_Wtime() - t0;
      if (!s.ok()) {
        std::fprintf(stderr, "[rank %d] moonep-bench-speeds: %s: %s\n", rank, arm.name.c_str(),
                     std::string(s.message()).c_str());
        return 1;
      }
      const auto& st = arm.layer->stats();
      // The executor's own time (not the wait for replica weights).
      const double compute = st.seconds[static_cast<int>(Phase::kComputeHome)] +
                             st.seconds[static_cast<int>(Phase::kComputeReplica)] +
                             st.seconds[static_cast<int>(Phase::kBackwardCompute)];
      const double step_ms = MaxOver(seconds) * 1e3, compute_ms = MaxOver(compute) * 1e3;
      int64_t rows[2] = {slow ? st.rows_computed : 0, slow ? 0 : st.rows_computed};
      MPI_Allreduce(MPI_IN_PLACE, rows, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
      if (timed) {
        arm.step_ms.push_back(step_ms);
        arm.compute_ms.push_back(compute_ms);
        arm.slow_rows += rows[0];
        arm.other_rows += rows[1];
      }
    }
    // The balanced layers against policy none's results.
    const Arm& none = arms[2];
    const Reference y(ToFloat(none.y, o.dtype)), dx(ToFloat(none.dx, o.dtype)),
        dtopk(none.dtopk), grads(none.grads);
    for (int a = 0; a < 2; ++a) {
      const Arm& arm = arms[static_cast<size_t>(a)];
      wrong += CountDiffering(ToFloat(arm.y, o.dtype), y, tol) +
               CountDiffering(ToFloat(arm.dx, o.dtype), dx, tol) +
               CountDiffering(arm.dtopk, dtopk, tol) + CountDiffering(arm.grads, grads, tol);
      checked += static_cast<int64_t>(2 * x.size() / ds + arm.dtopk.size() + arm.grads.size());
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &checked, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);

  if (root) {
    const int64_t n_slow = static_cast<int64_t>(o.slow_ranks.size()), n_other = R - n_slow;
    const double first = Quantile(arms[0].step_ms, 0.5);
    std::printf("%-24s %12s %9s %14s %22s %10s\n", "layer", "step ms p50", "max",
                "compute ms p50", "rows: slow / other rank", "p50/first");
    for (const Arm& arm : arms) {
      const double p50 = Quantile(arm.step_ms, 0.5);
      const double per = static_cast<double>(o.iters);
      std::printf("%-24s %12.2f %9.2f %14.2f %10.0f / %-10.0f %9.2fx\n", arm.name.c_str(), p50,
                  Quantile(arm.step_ms, 1.0), Quantile(arm.compute_ms, 0.5),
                  n_slow > 0 ? static_cast<double>(arm.slow_rows) / per / n_slow : 0.0,
                  n_other > 0 ? static_cast<double>(arm.other_rows) / per / n_other : 0.0,
                  p50 / first);
    }
    if (n_slow > 0 && n_other > 0) {
      auto share = [&](const Arm& arm) {
        return static_cast<double>(arm.slow_rows) * n_other /
               std::max(1.0, static_cast<double>(arm.other_rows) * n_slow);
      };
      std::printf("rows computed, a slow rank's over another rank's (means): %.2f with speeds, "
                  "%.2f without, %.2f none\n", share(arms[0]), share(arms[1]), share(arms[2]));
    }
    std::printf("check against policy none (y, dx, d_topk_weights, weight gradients; tolerance "
                "%.0e of the largest): %ld of %ld values differ: %s\n",
                tol, static_cast<long>(wrong), static_cast<long>(checked),
                wrong == 0 ? "PASS" : "FAIL");
  }
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return moonep::runtime::RunToolUnderMpi(argc, argv, Run); }
