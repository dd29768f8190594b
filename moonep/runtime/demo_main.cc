// moonep-demo: a few training steps of one MoE layer on Zipf-skewed routing whose hot experts
// move every step, under mpirun. Per step: the slowest rank's load over the mean with home
// placement only ("without MoonEP") and with MoonEP's plan, the replicas it made, the bytes it
// moved, the time of each phase, and the check of y and every gradient against the fp64
// reference layer. Usage: mpirun -np 4 moonep-demo [--steps N] [--tokens T] [--experts-per-rank
// N] [--topk K] [--hidden H] [--inter I] [--zipf S] [--dtype fp32|bf16] [--policy NAME]
// [--replica-cost TOKENS] (moonep weighs replicas: one transfer costs TOKENS of compute)
// [--row-cost N] (with --replica-cost: a token row moved costs N/1024 tokens, weighed too)
// [--measure-costs ROWS] (both costs measured first on these ranks by the cost probe, timing ROWS
// rows of compute and of rows sent, and one expert's gradients sent; docs/runtime.md "Measured
// costs").
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moonep/core/dtype.h"
#include "moonep/core/env.h"
#include "moonep/reference/reference_moe.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/cost_probe.h"
#include "moonep/runtime/moe_layer.h"
#include "moonep/runtime/tool_args.h"

namespace {

using moonep::DType;
using moonep::TensorView;
using moonep::runtime::MaxOverRanks;
using moonep::runtime::Phase;
using moonep::runtime::SumOverRanks;
using moonep::transport::OpKind;

struct Options {
  int steps = 6;
  int64_t tokens = 128;
  int experts_per_rank = 4;
  int topk = 2;
  int64_t hidden = 128;
  int64_t inter = 256;
  double zipf = 1.2;
  DType dtype = DType::kFloat32;
  moonep::planner::Policy policy = moonep::planner::Policy::kMoonEP;
  int64_t replica_cost = 0;  // PlannerConfig::replica_cost_intra and _inter (0: perfect balance)
  int64_t row_cost = 0;      // PlannerConfig::row_cost_intra and _inter (1/1024 tokens a row)
  int64_t measure_rows = 0;  // > 0: the costs come from the cost probe, with this many rows
};

bool ParseArgs(int argc, char** argv, Options* o, std::string* error) {
  constexpr const char* kUsage =
      "usage: moonep-demo [--steps N] [--tokens T] [--experts-per-rank N] [--topk K] "
      "[--hidden H] [--inter I] [--zipf S] [--dtype fp32|bf16] [--policy NAME] [--replica-cost TOKENS]\n"
      "  [--row-cost N] [--measure-costs ROWS]";
  // name, target, bounds: the demo checks every step against an fp64 reference of the whole
  // layer on every rank, so its sizes are those of a demonstration, not of a model.
  using moonep::runtime::IntFlag;
  int64_t steps = o->steps, epn = o->experts_per_rank, topk = o->topk;
  const IntFlag ints[] = {{"--steps", 1, 1000000, &steps},
                          {"--tokens", 1, 1 << 20, &o->tokens},
                          {"--experts-per-rank", 1, 1024, &epn},
                          {"--topk", 1, 1024, &topk},
                          {"--hidden", 1, 1 << 16, &o->hidden},
                          {"--inter", 1, 1 << 16, &o->inter},
                          {"--replica-cost", 0, moonep::planner::kMaxReplicaCost, &o->replica_cost},
                          {"--row-cost", 0, moonep::planner::kMaxRowCost, &o->row_cost},
                          {"--measure-costs", 0, 1 << 20, &o->measure_rows}};
  auto other = [o](const std::string& arg, const std::string& v, std::string* error) {
    *error = "";
    if (arg == "--zipf") {
      char* end = nullptr;
      const double z = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !std::isfinite(z) || z < 0 || z > 100) {
        *error = "--zipf " + v + ": expected a number in [0, 100]";
        return false;
      }
      o->zipf = z;
    } else if (arg == "--dtype") {
      if (v != "fp32" && v != "bf16") {
        *error = "--dtype " + v + ": expected fp32 or bf16";
        return false;
      }
      o->dtype = v == "fp32" ? DType::kFloat32 : DType::kBFloat16;
    } else if (arg == "--policy") {
      if (!moonep::planner::ParsePolicy(v, &o->policy)) {
        *error = "--policy " + v + ": not a policy name (none, moonep, moonep-greedy, eplb, ...)";
        return false;
      }
    } else {
      return false;
    }
    return true;
  };
  if (!moonep::runtime::ParseToolArgs(argc, argv, ints, kUsage, other, error)) return false;
  if (o->measure_rows > 0 && (o->replica_cost > 0 || o->row_cost > 0)) {
    *error = "--measure-costs measures the costs that --replica-cost and --row-cost give: pass "
             "one or the others";
    return false;
  }
  o->steps = static_cast<int>(steps);
  o->experts_per_rank = static_cast<int>(epn);
  o->topk = static_cast<int>(topk);
  return true;
}

// max |a - b| / max |b| over all ranks.
double RelErrorAll(const std::vector<double>& got, const std::vector<double>& want, MPI_Comm comm) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num = std::max(num, std::abs(got[i] - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  num = MaxOverRanks(num, comm);
  den = MaxOverRanks(den, comm);
  return den > 0 ? num / den : num;
}

int Run(int argc, char** argv) {
  const double kWall0 = MPI_Wtime();
  Options o;
  std::string error;
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  if (!ParseArgs(argc, argv, &o, &error)) {
    const bool help = error.rfind("usage:", 0) == 0;  // --help: the usage on stdout, exit 0
    if (world_rank == 0) std::fprintf(help ? stdout : stderr, "%s\n", error.c_str());
    return help ? 0 : 2;
  }
  auto comm_or = moonep::runtime::Communicator::FromMpi(MPI_COMM_WORLD);
  if (!comm_or.ok()) {
    std::fprintf(stderr, "moonep-demo: %s\n", std::string(comm_or.status().message()).c_str());
    return 1;
  }
  auto comm = std::move(*comm_or);
  const int R = comm->size(), rank = comm->rank();
  const bool root = rank == 0;
  const int epn = o.experts_per_rank, E = epn * R, K = o.topk;
  const int64_t H = o.hidden, I = o.inter, T = o.tokens;
  // Every rank holds the fp64 reference of all E experts (weights; the reference's gradients as
  // much again) and about 128 bytes per element of its token rows: refuse sizes that would not
  // fit before allocating anything, alike on every rank.
  const double reference_gib =
      (6.0 * E * static_cast<double>(H) * I * 8 + 128.0 * T * static_cast<double>(H)) / (1 << 30);
  if (K > E || reference_gib > 8) {
    if (root) {
      if (K > E) {
        std::fprintf(stderr, "moonep-demo: --topk %d exceeds the %d experts (%d ranks x %d)\n",
                     K, E, R, epn);
      } else {
        std::fprintf(stderr,
                     "moonep-demo: %d experts x H=%ld x I=%ld and %ld tokens need %.1f GiB on "
                     "every rank with the fp64 reference (at most 8): lower --tokens, "
                     "--experts-per-rank, --hidden or --inter\n",
                     E, static_cast<long>(H), static_cast<long>(I), static_cast<long>(T),
                     reference_gib);
      }
    }
    return 2;
  }
  const DType dt = o.dtype;
  const size_t ds = moonep::DTypeSize(dt), block = static_cast<size_t>(H * I);

  moonep::runtime::LayerConfig config;
  config.num_experts = E;
  config.top_k = K;
  config.hidden = H;
  config.intermediate = I;
  config.dtype = dt;
  config.policy = o.policy;
  config.replica_cost_intra = config.replica_cost_inter = o.replica_cost;
  config.row_cost_intra = config.row_cost_inter = o.row_cost;
  config.max_tokens = T;
  config.num_threads = 1;  // ranks share the cores of one machine here
  if (o.measure_rows > 0) {
    moonep::runtime::CostProbeOptions probe;
    probe.compute_rows = probe.link_rows = o.measure_rows;
    auto m = moonep::runtime::MeasureCosts(comm.get(), config, probe);
    if (!m.ok()) {
      std::fprintf(stderr, "[rank %d] moonep-demo: %s\n", rank,
                   std::string(m.status().message()).c_str());
      return 1;
    }
    moonep::runtime::ApplyCosts(*m, &config);
    // Flat topology: every link is one class (inter), and the probe copies it to intra.
    o.replica_cost = m->replica_cost_inter;
    o.row_cost = m->row_cost_inter;
    if (root) {
      std::printf("Cost probe (%ld rows, median of %d ranks): a token %.3g us of compute, an "
                  "expert's gradients %.3g us and a row %.3g us one way -> a replica transfer "
                  "costs %ld tokens, a row %ld/1024\n",
                  static_cast<long>(o.measure_rows), m->ranks, m->token_seconds * 1e6,
                  m->transfer_seconds_inter * 1e6, m->row_seconds_inter * 1e6,
                  static_cast<long>(o.replica_cost), static_cast<long>(o.row_cost));
    }
  }
  auto layer_or = moonep::runtime::MoeLayer::Create(comm.get(), config);
  if (!layer_or.ok()) {
    std::fprintf(stderr, "[rank %d] moonep-demo: %s\n", rank,
                 std::string(layer_or.status().message()).c_str());
    return 1;
  }
  auto& layer = *layer_or;

  // Every rank draws the same global weights; each keeps its home experts in the layer dtype.
  std::mt19937_64 rng(2024);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto draw = [&](size_t n, double scale) {
    std::vector<double> v(n);
    for (double& x : v) x = normal(rng) * scale;
    return v;
  };
  moonep::reference::ExpertWeights global;
  global.wg = draw(E * block, 1.0 / std::sqrt(static_cast<double>(H)));
  global.wu = draw(E * block, 1.0 / std::sqrt(static_cast<double>(H)));
  global.wd = draw(E * block, 1.0 / std::sqrt(static_cast<double>(I)));
  std::vector<char> w[3];
  std::vector<float> g[3];
  std::vector<double>* gw[3] = {&global.wg, &global.wu, &global.wd};
  for (int m = 0; m < 3; ++m) {
    w[m].resize(epn * block * ds);
    moonep::ConvertFromFloat(std::vector<float>(gw[m]->begin() + rank * epn * block,
                                                gw[m]->begin() + (rank + 1) * epn * block).data(),
                             w[m].data(), dt, epn * block);
    g[m].assign(epn * block, 0.0f);
  }
  std::vector<moonep::compute::ExpertParams> params(epn), grads(epn);
  for (int e = 0; e < epn; ++e) {
    params[e].gate = TensorView::Contiguous(w[0].data() + e * block * ds, dt, {H, I});
    params[e].up = TensorView::Contiguous(w[1].data() + e * block * ds, dt, {H, I});
    params[e].down = TensorView::Contiguous(w[2].data() + e * block * ds, dt, {I, H});
    grads[e].gate = TensorView::Contiguous(g[0].data() + e * block, DType::kFloat32, {H, I});
    grads[e].up = TensorView::Contiguous(g[1].data() + e * block, DType::kFloat32, {H, I});
    grads[e].down = TensorView::Contiguous(g[2].data() + e * block, DType::kFloat32, {I, H});
  }
  if (auto s = layer->BindParameters(params, grads); !s.ok()) {
    std::fprintf(stderr, "moonep-demo: %s\n", std::string(s.message()).c_str());
    return 1;
  }

  if (root) {
    std::printf(
        "MoonEP demo: %d ranks x %d experts = %d experts, top-%d, H=%ld I=%ld %s, %ld tokens/rank,\n"
        "Zipf(%.1f) routing whose hot experts move every step, policy %s%s, SGD on "
        "L = mean over tokens of 0.5 |y - target|^2\n\n",
        R, epn, E, K, static_cast<long>(H), static_cast<long>(I), moonep::DTypeName(dt),
        static_cast<long>(T), o.zipf, moonep::planner::PolicyName(o.policy),
        o.replica_cost > 0 ? (" weighing replicas at " + std::to_string(o.replica_cost) +
                              " tokens a transfer" +
                              (o.row_cost > 0 ? " and " + std::to_string(o.row_cost) +
                                                "/1024 tokens a row" : "")).c_str() : "");
    std::printf("%4s  | %-25s | %6s | %-11s | %-38s | %s\n", "", "slowest rank / mean load", "",
                "MB moved", "ms per phase (slowest rank)", "vs fp64 reference");
    std::printf("%4s  | %11s %13s | %6s | %5s %5s | %5s %5s %5s %5s %6s %6s | %-7s  %-7s %-4s  %s\n",
                "step", "without", "with MoonEP", "repl.", "rows", "wts", "plan", "disp", "comp",
                "comb", "bwd", "total", "y", "grads", "", "loss");
    std::printf("------+---------------------------+--------+-------------+--------------------------"
                "--------------+----------------------------\n");
  }

  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  double worst_y = 0, worst_g = 0, sum_before = 0, sum_after = 0;
  const double lr = 2.0;
  for (int step = 1; step <= o.steps; ++step) {
    // Routing: every rank the same expert popularity (hot experts shift each step), own tokens.
    std::vector<double> pop(E);
    std::vector<int> perm(E);
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::mt19937_64 step_rng(1000 + step);
    std::shuffle(perm.begin(), perm.end(), step_rng);
    for (int e = 0; e < E; ++e) pop[perm[e]] = 1.0 / std::pow(e + 1.0, o.zipf);
    std::mt19937_64 tok_rng(77 * step + 1000003ull * rank);
    std::normal_distribution<double> tok_normal(0.0, 1.0);
    std::vector<double> x(T * H), target(T * H), topw(T * K);
    std::vector<int32_t> ids(T * K, -1);
    for (double& v : x) v = tok_normal(tok_rng);
    for (double& v : target) v = 0.1 * tok_normal(tok_rng);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> q = pop;
      double norm = 0;
      for (int k = 0; k < K; ++k) {
        std::discrete_distribution<int> pick(q.begin(), q.end());
        const int e = pick(tok_rng);
        q[e] = 0;
        ids[t * K + k] = e;
        topw[t * K + k] = pop[e];
        norm += pop[e];
      }
      for (int k = 0; k < K; ++k) topw[t * K + k] = static_cast<float>(topw[t * K + k] / norm);
    }
    // What the layer sees, rounded to its dtype (and the reference sees the same values).
    std::vector<char> xb(T * H * ds), yb(T * H * ds), dyb(T * H * ds), dxb(T * H * ds);
    std::vector<float> xf(x.begin(), x.end());
    moonep::ConvertFromFloat(xf.data(), xb.data(), dt, xf.size());
    std::vector<float> xr(T * H);
    moonep::ConvertToFloat(xb.data(), dt, xr.data(), xr.size());
    x.assign(xr.begin(), xr.end());
    std::vector<float> topwf(topw.begin(), topw.end()), dtopk(T * K);

    auto h = layer->Forward(T, TensorView::Contiguous(xb.data(), dt, {T, H}), ids, topwf,
                            TensorView::Contiguous(yb.data(), dt, {T, H}));
    if (!h.ok()) {
      std::fprintf(stderr, "[rank %d] forward: %s\n", rank, std::string(h.status().message()).c_str());
      return 1;
    }
    const auto fstats = layer->stats();
    std::vector<float> y(T * H);
    moonep::ConvertToFloat(yb.data(), dt, y.data(), y.size());
    std::vector<float> dy(T * H);
    double loss = 0;
    for (int64_t i = 0; i < T * H; ++i) {
      const double d = y[i] - target[i];
      loss += 0.5 * d * d;
      dy[i] = static_cast<float>(d / static_cast<double>(R * T));  // L is a mean over tokens
    }
    moonep::ConvertFromFloat(dy.data(), dyb.data(), dt, dy.size());
    std::vector<float> dyr(T * H);
    moonep::ConvertToFloat(dyb.data(), dt, dyr.data(), dyr.size());
    for (auto& v : g) std::fill(v.begin(), v.end(), 0.0f);
    if (auto s = layer->Backward(*h, TensorView::Contiguous(dyb.data(), dt, {T, H}),
                                 TensorView::Contiguous(dxb.data(), dt, {T, H}),
                                 absl::MakeSpan(dtopk));
        !s.ok()) {
      std::fprintf(stderr, "[rank %d] backward: %s\n", rank, std::string(s.message()).c_str());
      return 1;
    }
    const auto& st = layer->stats();

    // The fp64 reference on this rank's tokens; weight gradients summed over ranks.
    moonep::reference::MoeShape shape{E, K, H, I};
    moonep::reference::ForwardResult rf;
    moonep::reference::BackwardResult rb;
    std::vector<double> topwd(topwf.begin(), topwf.end()), dyd(dyr.begin(), dyr.end());
    (void)moonep::reference::Forward(shape, global, T, x, ids, topwd, &rf);
    (void)moonep::reference::Backward(shape, global, T, x, ids, topwd, dyd, &rb);
    std::vector<double> yd(y.begin(), y.end());
    const double err_y = RelErrorAll(yd, rf.y, comm->mpi_comm());
    std::vector<float> dxf(T * H);
    moonep::ConvertToFloat(dxb.data(), dt, dxf.data(), dxf.size());
    double err_g = RelErrorAll(std::vector<double>(dxf.begin(), dxf.end()), rb.dx, comm->mpi_comm());
    err_g = std::max(err_g, RelErrorAll(std::vector<double>(dtopk.begin(), dtopk.end()),
                                        rb.dtopk_weights, comm->mpi_comm()));
    std::vector<double>* rg[3] = {&rb.dwg, &rb.dwu, &rb.dwd};
    for (int m = 0; m < 3; ++m) {
      std::vector<double> total(E * block);
      MPI_Allreduce(rg[m]->data(), total.data(), static_cast<int>(total.size()), MPI_DOUBLE,
                    MPI_SUM, comm->mpi_comm());
      std::vector<double> mine(total.begin() + rank * epn * block,
                               total.begin() + (rank + 1) * epn * block);
      err_g = std::max(err_g, RelErrorAll(std::vector<double>(g[m].begin(), g[m].end()), mine,
                                          comm->mpi_comm()));
    }
    worst_y = std::max(worst_y, err_y);
    worst_g = std::max(worst_g, err_g);
    loss = SumOverRanks(loss, comm->mpi_comm());

    // Traffic over all ranks: token rows (dispatch, combine and their backward forms) and expert
    // weights (prefetch) + gradients (reduce).
    auto bytes = [&](std::initializer_list<OpKind> kinds, const moonep::runtime::StepStats& s) {
      double b = 0;
      for (OpKind k : kinds) b += static_cast<double>(s.ops[static_cast<int>(k)].bytes_sent);
      return SumOverRanks(b, comm->mpi_comm()) / 1e6;
    };
    const double rows_mb = bytes({OpKind::kDispatch, OpKind::kCombine}, fstats) +
                           bytes({OpKind::kCombineBackward, OpKind::kDispatchBackward,
                                  OpKind::kTopkWeightGrad}, st);
    const double wts_mb = bytes({OpKind::kPrefetch}, fstats) + bytes({OpKind::kReduce}, st);
    auto ms = [&](std::initializer_list<Phase> phases) {
      double s = 0;
      for (Phase p : phases) s += st.seconds[static_cast<int>(p)];
      return MaxOverRanks(s * 1e3, comm->mpi_comm());
    };
    const double t_plan = ms({Phase::kCounts, Phase::kPlan});
    const double t_disp = ms({Phase::kDispatch});
    const double t_comp = ms({Phase::kComputeHome, Phase::kPrefetchWait, Phase::kComputeReplica});
    const double t_comb = ms({Phase::kCombine});
    const double t_bwd = ms({Phase::kBackwardDispatch, Phase::kTopkGrad, Phase::kBackwardCompute,
                             Phase::kBackwardCombine, Phase::kReduce});
    const double t_total =
        MaxOverRanks((st.forward_seconds + st.backward_seconds) * 1e3, comm->mpi_comm());
    const double before = st.plan.imbalance_before(), after = st.plan.imbalance_after();
    sum_before += before;
    sum_after += after;
    const double tol = dt == DType::kFloat32 ? 1e-5 : 1e-2;
    if (root) {
      std::printf("%4d  | %11.2f %13.2f | %6d | %5.2f %5.2f | %5.1f %5.1f %5.1f %5.1f %6.1f %6.1f | %.1e  %.1e %-4s  %.4g\n",
                  step, before, after, st.plan.replicas, rows_mb, wts_mb, t_plan, t_disp, t_comp,
                  t_comb, t_bwd, t_total, err_y, err_g,
                  err_y < tol && err_g < tol ? "ok  " : "FAIL", loss / (R * T));
      std::fflush(stdout);
    }
    // SGD on the home experts; the reference weights follow with the same rounded values.
    for (int m = 0; m < 3; ++m) {
      std::vector<float> cur(epn * block);
      moonep::ConvertToFloat(w[m].data(), dt, cur.data(), cur.size());
      for (size_t i = 0; i < cur.size(); ++i) cur[i] -= static_cast<float>(lr * g[m][i]);
      moonep::ConvertFromFloat(cur.data(), w[m].data(), dt, cur.size());
      moonep::ConvertToFloat(w[m].data(), dt, cur.data(), cur.size());
      std::vector<float> all(E * block);
      MPI_Allgather(cur.data(), static_cast<int>(cur.size()), MPI_FLOAT, all.data(),
                    static_cast<int>(cur.size()), MPI_FLOAT, comm->mpi_comm());
      gw[m]->assign(all.begin(), all.end());
    }
  }
  const double tol = dt == DType::kFloat32 ? 1e-5 : 1e-2;
  const bool ok = worst_y < tol && worst_g < tol;
  if (root) {
    std::printf("\nrepl. = hot experts replicated this step; rows = MB of token rows moved (dispatch, "
                "combine, backward);\nwts = MB of expert weights prefetched + replica gradients "
                "reduced; plan = count exchange + planning.\n");
    std::printf("\nWithout MoonEP the slowest rank computes %.2fx the mean on average: everyone waits "
                "for it.\nWith MoonEP (%s) it computes %.2fx: %s.\nEvery step matched the fp64 reference (worst relative error y "
                "%.1e, gradients %.1e; bar %.0e): %s  [%.1f s]\n",
                sum_before / o.steps,
                (std::string(moonep::planner::PolicyName(o.policy)) +
                 (o.replica_cost > 0 ? " weighing replicas" : "")).c_str(),
                sum_after / o.steps,
                o.replica_cost > 0 ? "hot experts were replicated onto idle ranks where a replica "
                                     "cost less than the compute it saved"
                                   : "hot experts were replicated onto idle ranks each step",
                worst_y, worst_g, tol, ok ? "PASS" : "FAIL", MPI_Wtime() - kWall0);
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return moonep::runtime::RunToolUnderMpi(argc, argv, Run); }
