// moonep-cost-probe: runs the cost probe (moonep/runtime/cost_probe.h) on the ranks of an mpirun
// and prints what it measured and the four costs to set in a layer config. Usage:
//   mpirun -np N moonep-cost-probe [--hidden H] [--inter I] [--dtype fp32|bf16]
//     [--grad-dtype fp32|bf16] [--device cpu|cuda] [--ranks-per-node N] [--transport NAME]
//     [--compute-rows N] [--link-rows N] [--transfer-rows N] [--repetitions N] [--forward-only 0|1]
//     [--threads N]
// CUDA: rank r uses GPU OMPI_COMM_WORLD_LOCAL_RANK (else LOCAL_RANK, else 0).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "moonep/core/dtype.h"
#include "moonep/core/env.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/cost_probe.h"
#include "moonep/runtime/tool_args.h"

namespace {

using moonep::DType;
using moonep::runtime::CostProbeOptions;
using moonep::runtime::LayerConfig;

constexpr const char* kUsage =
    "usage: moonep-cost-probe [--hidden H] [--inter I] [--dtype fp32|bf16]\n"
    "  [--grad-dtype fp32|bf16] [--device cpu|cuda] [--ranks-per-node N] [--transport NAME]\n"
    "  [--compute-rows N] [--link-rows N] [--transfer-rows N] [--repetitions N]\n"
    "  [--forward-only 0|1] [--threads N]";

bool ParseArgs(int argc, char** argv, LayerConfig* c, CostProbeOptions* o, std::string* error) {
  int64_t rpn = 0, threads = 0, reps = o->repetitions, fwd = 0;
  using moonep::runtime::IntFlag;
  const IntFlag ints[] = {{"--hidden", 1, 1 << 20, &c->hidden},
                          {"--inter", 1, 1 << 20, &c->intermediate},
                          {"--ranks-per-node", 0, 1 << 20, &rpn},
                          {"--compute-rows", 0, 1 << 20, &o->compute_rows},
                          {"--link-rows", 0, 1 << 20, &o->link_rows},
                          {"--transfer-rows", 0, 1 << 20, &o->transfer_rows},
                          {"--repetitions", 1, 1000, &reps},
                          {"--forward-only", 0, 1, &fwd},
                          {"--threads", 0, 1024, &threads}};
  auto other = [c](const std::string& arg, const std::string& v, std::string* error) {
    *error = "";
    if (arg == "--dtype" || arg == "--grad-dtype") {
      if (v != "fp32" && v != "bf16") {
        *error = arg + " " + v + ": expected fp32 or bf16";
        return false;
      }
      (arg == "--dtype" ? c->dtype : c->grad_dtype) =
          v == "fp32" ? DType::kFloat32 : DType::kBFloat16;
    } else if (arg == "--device") {
      if (v != "cpu" && v != "cuda") {
        *error = "--device " + v + ": expected cpu or cuda";
        return false;
      }
      c->device = v == "cpu" ? moonep::Device::kCpu : moonep::Device::kCuda;
    } else if (arg == "--transport") {
      c->transport = v;
    } else {
      return false;
    }
    return true;
  };
  if (!moonep::runtime::ParseToolArgs(argc, argv, ints, kUsage, other, error)) return false;
  c->ranks_per_node = static_cast<int32_t>(rpn);
  c->num_threads = static_cast<int32_t>(threads);
  o->repetitions = static_cast<int32_t>(reps);
  o->training = fwd == 0;
  return true;
}

int Run(int argc, char** argv) {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  LayerConfig config;
  config.hidden = 7168;
  config.intermediate = 2048;
  config.dtype = DType::kBFloat16;
  config.grad_dtype = DType::kFloat32;
  config.top_k = 1;
  config.max_tokens = 1;
  CostProbeOptions options;
  std::string error;
  if (!ParseArgs(argc, argv, &config, &options, &error)) {
    const bool help = error == kUsage;
    if (world_rank == 0) std::fprintf(help ? stdout : stderr, "%s\n", error.c_str());
    return help ? 0 : 2;
  }
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"}) {
    int64_t local = 0;
    const char* v = std::getenv(var);
    if (v != nullptr && moonep::env::ParseBase10InRange(v, 0, 1 << 20, &local)) {
      config.device_index = static_cast<int32_t>(local);
      break;
    }
  }
  auto comm = moonep::runtime::Communicator::FromMpi(MPI_COMM_WORLD);
  if (!comm.ok()) {
    std::fprintf(stderr, "moonep-cost-probe: %s\n", std::string(comm.status().message()).c_str());
    return 1;
  }
  config.num_experts = (*comm)->size();
  auto m = moonep::runtime::MeasureCosts(comm->get(), config, options);
  if (!m.ok()) {
    std::fprintf(stderr, "[rank %d] moonep-cost-probe: %s\n", world_rank,
                 std::string(m.status().message()).c_str());
    return 1;
  }
  if (world_rank != 0) return 0;
  const double H = static_cast<double>(config.hidden), I = static_cast<double>(config.intermediate);
  const double flops = (options.training ? 18 : 6) * H * I;
  const double row_bytes = H * static_cast<double>(moonep::DTypeSize(config.dtype));
  std::printf("moonep-cost-probe: %d ranks (%s), H=%ld I=%ld %s, gradients %s, device %s, "
              "transport %s, %s\n",
              m->ranks,
              config.ranks_per_node > 0
                  ? ("nodes of " + std::to_string(config.ranks_per_node)).c_str()
                  : "flat",
              static_cast<long>(config.hidden), static_cast<long>(config.intermediate),
              moonep::DTypeName(config.dtype), moonep::DTypeName(config.grad_dtype),
              config.device == moonep::Device::kCuda ? "cuda" : "cpu",
              moonep::runtime::TransportBackend(config).c_str(),
              options.training ? "training (forward + backward)" : "forward only");
  const double rate = flops / m->token_seconds;
  // Effective: of the flops a token counts (18 H I, or 6 H I forward); backward redoes the two
  // forward GEMMs, as the layer's does (it keeps no pre-activations).
  std::printf("  token      %10.3f us   (%.1f effective %s; median of the ranks, %ld rows)\n",
              m->token_seconds * 1e6, rate >= 1e12 ? rate / 1e12 : rate / 1e9,
              rate >= 1e12 ? "TFLOP/s" : "GFLOP/s", static_cast<long>(m->compute_rows));
  if (m->token_seconds_fastest > 0) {  // every rank timed its token (always, on success)
    std::printf("  ranks      %10.3f us fastest, %.3f us slowest (speeds %.3f-%.3f of the "
                "median)\n",
                m->token_seconds_fastest * 1e6, m->token_seconds_slowest * 1e6,
                m->token_seconds / m->token_seconds_slowest,
                m->token_seconds / m->token_seconds_fastest);
  }
  const char* names[2] = {"intra-node", "inter-node"};
  const double seconds[2] = {m->row_seconds_intra, m->row_seconds_inter};
  const double transfer[2] = {m->transfer_seconds_intra, m->transfer_seconds_inter};
  const double transfer_bytes =
      3 * H * I *
      static_cast<double>(moonep::DTypeSize(options.training ? config.grad_dtype : config.dtype));
  const bool measured[2] = {m->intra_measured, m->inter_measured};
  for (int c = 0; c < 2; ++c) {
    if (measured[c]) {
      std::printf("  row %s %8.3f us   (%.2f GB/s one way; %ld rows to a partner)\n", names[c],
                  seconds[c] * 1e6, row_bytes / seconds[c] / 1e9,
                  static_cast<long>(m->link_rows));
      std::printf("  expert %s %8.3f us   (%.2f GB/s one way; %.1f MB of %s, timed as %ld rows)\n",
                  names[c], transfer[c] * 1e6, transfer_bytes / transfer[c] / 1e9,
                  transfer_bytes / 1e6, options.training ? "gradients" : "weights",
                  static_cast<long>(m->transfer_rows));
    } else {
      std::printf("  row %s   not measured (%s)\n", names[c],
                  m->ranks == 1 ? "one rank" : "no two ranks of this class; the other class's "
                                               "figures are used");
    }
  }
  std::printf("replica_cost_intra=%ld replica_cost_inter=%ld row_cost_intra=%ld "
              "row_cost_inter=%ld\n",
              static_cast<long>(m->replica_cost_intra), static_cast<long>(m->replica_cost_inter),
              static_cast<long>(m->row_cost_intra), static_cast<long>(m->row_cost_inter));
  // Each rank's speed (LayerConfig::speeds, where ranks differ in more than noise).
  std::printf("speeds=%s\n", absl::StrJoin(m->speeds, ",", [](std::string* out, double v) {
                absl::StrAppendFormat(out, "%.3f", v);
              }).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return moonep::runtime::RunToolUnderMpi(argc, argv, Run); }
