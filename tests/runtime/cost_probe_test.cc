// The cost probe (moonep/runtime/cost_probe.h): its derivation against docs/planner.md's formulas
// in closed form, and the collective measurement on 1-4 ranks (flat and with nodes): every rank
// gets the same figures, the classes measured are the topology's, the costs are the derivation of
// the medians, a layer made with them runs, routing traces stay untouched, and bad or mismatched
// input fails every rank without a hang.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "moonep/core/status.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/cost_probe.h"
#include "moonep/runtime/moe_layer.h"
#include "planner/plan.h"
#include "tests/harness/mpi_test.h"
#include "tests/runtime/layer_problem.h"

namespace moonep::testing {
namespace {

using runtime::Communicator;
using runtime::CostProbeOptions;
using runtime::DeriveCosts;
using runtime::LayerConfig;
using runtime::MeasureCosts;
using runtime::MeasuredCosts;

// What the formulas of docs/planner.md give from a flop rate and a bandwidth, as the probe's
// figures: a token's 18 H I flops (6 H I forward only), a row's H act bytes and a transfer's
// 3 H I gradient bytes (weight bytes forward only) over the link.
runtime::ProbeFigures FromRates(double H, double I, double act_bytes, double transfer_bytes,
                                bool training, double flops, double intra, double inter) {
  runtime::ProbeFigures f;
  f.token_seconds = (training ? 18 : 6) * H * I / flops;
  f.row_seconds[0] = H * act_bytes / intra;
  f.row_seconds[1] = H * act_bytes / inter;
  f.transfer_seconds[0] = 3 * H * I * transfer_bytes / intra;
  f.transfer_seconds[1] = 3 * H * I * transfer_bytes / inter;
  f.measured[0] = f.measured[1] = true;
  return f;
}

// docs/planner.md: replica_cost = grad_bytes * flop_per_s / (6 * link_bytes_per_s) and
// row_cost = 1024 * 4 * H * act_bytes / link_bytes_per_s / (18 * H * I / flop_per_s), for
// training; forward only, weights instead of gradients and 6 * H * I flops a token, 2 crossings.
TEST(CostProbeDerive, MatchesTheDocumentedFormulas) {
  const double flops = 400e12, intra = 150e9, inter = 40e9, H = 7168, I = 2048;
  MeasuredCosts m =
      DeriveCosts(/*training=*/true, FromRates(H, I, 2, 4, true, flops, intra, inter), 64);
  EXPECT_EQ(m.replica_cost_intra, std::llround(4 * flops / (6 * intra)));
  EXPECT_EQ(m.replica_cost_inter, std::llround(4 * flops / (6 * inter)));
  EXPECT_EQ(m.replica_cost_intra, 1778);  // the figures docs/planner.md gives
  EXPECT_EQ(m.replica_cost_inter, 6667);
  EXPECT_EQ(m.row_cost_intra, 593);
  EXPECT_EQ(m.row_cost_inter, 2222);
  EXPECT_EQ(m.ranks, 64);

  const double fwd_token = 6 * H * I / flops;
  m = DeriveCosts(/*training=*/false, FromRates(H, I, 2, 2, false, flops, intra, inter), 8);
  EXPECT_EQ(m.replica_cost_inter, std::llround(3 * H * I * 2 / inter / fwd_token));
  EXPECT_EQ(m.row_cost_inter, std::llround(1024 * 2 * H * 2 / inter / fwd_token));
  EXPECT_EQ(m.row_cost_intra, std::llround(1024 * 2 * H * 2 / intra / fwd_token));
}

TEST(CostProbeDerive, UnmeasuredClassesAndLimits) {
  runtime::ProbeFigures f;
  f.token_seconds = 1e-6;
  f.row_seconds[1] = 2e-6;
  f.transfer_seconds[1] = 5e-5;
  f.measured[1] = true;
  // Flat: only inter measured; intra takes its figures.
  MeasuredCosts m = DeriveCosts(true, f, 4);
  EXPECT_FALSE(m.intra_measured);
  EXPECT_EQ(m.row_seconds_intra, 0);
  EXPECT_EQ(m.transfer_seconds_intra, 0);
  EXPECT_EQ(m.transfer_seconds_inter, 5e-5);
  EXPECT_EQ(m.replica_cost_intra, m.replica_cost_inter);
  EXPECT_EQ(m.row_cost_intra, m.row_cost_inter);
  EXPECT_EQ(m.row_cost_inter, 1024 * 4 * 2);
  EXPECT_EQ(m.replica_cost_inter, 50);
  // One node: inter takes intra's.
  f = {};
  f.token_seconds = 1e-6;
  f.row_seconds[0] = 3e-6;
  f.transfer_seconds[0] = 7e-6;
  f.measured[0] = true;
  m = DeriveCosts(true, f, 2);
  EXPECT_EQ(m.row_cost_inter, m.row_cost_intra);
  EXPECT_EQ(m.row_cost_intra, 1024 * 4 * 3);
  EXPECT_EQ(m.replica_cost_inter, 7);
  // Forward only: 2 crossings.
  EXPECT_EQ(DeriveCosts(false, f, 2).row_cost_intra, 1024 * 2 * 3);
  // No link, or no compute time: no costs.
  f = {};
  f.token_seconds = 1e-6;
  m = DeriveCosts(true, f, 1);
  EXPECT_EQ(m.replica_cost_intra + m.replica_cost_inter + m.row_cost_intra + m.row_cost_inter, 0);
  f = FromRates(64, 32, 4, 4, true, 1e12, 1e9, 1e9);
  f.token_seconds = 0;
  m = DeriveCosts(true, f, 2);
  EXPECT_EQ(m.replica_cost_inter + m.row_cost_inter, 0);
  // Clamped to the planner's ranges.
  f = FromRates(64, 32, 4, 4, true, 1e12, 1e9, 1e9);
  f.token_seconds = 1e-300;
  m = DeriveCosts(true, f, 2);
  EXPECT_EQ(m.replica_cost_inter, planner::kMaxReplicaCost);
  EXPECT_EQ(m.row_cost_inter, planner::kMaxRowCost);
}

// Each rank's speed is the median token time over its own; the fastest and slowest are kept. A
// rank that timed nothing (0) leaves the speeds out rather than dividing by it.
TEST(CostProbeDerive, SpeedsAreTheMedianOverEachRanksTime) {
  const runtime::ProbeFigures base = FromRates(64, 32, 4, 4, true, 1e12, 1e9, 1e9);
  const double t = base.token_seconds;  // the median of the four below
  runtime::ProbeFigures f = base;
  f.rank_token_seconds = {t, 2 * t, t, 0.8 * t};
  MeasuredCosts m = DeriveCosts(true, f, 4);
  EXPECT_EQ(m.rank_token_seconds, f.rank_token_seconds);
  ASSERT_EQ(m.speeds.size(), 4u);
  const double expected[] = {1.0, 0.5, 1.0, 1.25};
  for (int r = 0; r < 4; ++r) EXPECT_DOUBLE_EQ(m.speeds[r], expected[r]) << "rank " << r;
  EXPECT_EQ(m.token_seconds_fastest, 0.8 * t);
  EXPECT_EQ(m.token_seconds_slowest, 2 * t);
  // The costs stay in tokens of the median rank.
  const MeasuredCosts same = DeriveCosts(true, base, 4);
  EXPECT_EQ(m.replica_cost_inter, same.replica_cost_inter);
  EXPECT_EQ(m.row_cost_intra, same.row_cost_intra);
  // Applied with the speeds, the costs count in tokens of the fastest rank (here 1.25 x the
  // median's); applied alone, in the median rank's.
  LayerConfig config;
  runtime::ApplyCosts(m, &config);
  EXPECT_TRUE(config.speeds.empty());
  EXPECT_EQ(config.replica_cost_inter, m.replica_cost_inter);
  runtime::ApplyCostsAndSpeeds(m, &config);
  EXPECT_EQ(config.speeds, m.speeds);
  EXPECT_EQ(config.replica_cost_inter, std::llround(m.replica_cost_inter * 1.25));
  EXPECT_EQ(config.replica_cost_intra, std::llround(m.replica_cost_intra * 1.25));
  EXPECT_EQ(config.row_cost_intra, std::llround(m.row_cost_intra * 1.25));
  EXPECT_EQ(config.row_cost_inter, std::llround(m.row_cost_inter * 1.25));
  // One rank: speed 1 and no link costs.
  f = {};
  f.token_seconds = 3e-6;
  f.rank_token_seconds = {3e-6};
  m = DeriveCosts(true, f, 1);
  EXPECT_EQ(m.speeds, std::vector<double>{1.0});
  f.rank_token_seconds = {3e-6, 0};
  EXPECT_TRUE(DeriveCosts(true, f, 2).speeds.empty());
  EXPECT_EQ(DeriveCosts(true, f, 2).token_seconds_fastest, 0);
}

// A transfer is timed as rows of the layer's dtype: how many (capped at 2^20), and the time of the
// whole transfer from a row's time, bf16 rows carrying fp32 gradients or bf16 weights.
TEST(CostProbeDerive, TransferRowsAndTheirScaling) {
  LayerConfig c;
  c.hidden = 64;
  c.intermediate = 32;
  c.dtype = DType::kBFloat16;
  c.grad_dtype = DType::kFloat32;
  EXPECT_EQ(runtime::TransferRows(c, /*training=*/true), 3 * 64 * 32 * 4 / (64 * 2));   // 192
  EXPECT_EQ(runtime::TransferRows(c, /*training=*/false), 3 * 64 * 32 * 2 / (64 * 2));  // 96
  EXPECT_DOUBLE_EQ(runtime::TransferSeconds(1e-6, c, true), 192e-6);
  EXPECT_DOUBLE_EQ(runtime::TransferSeconds(1e-6, c, false), 96e-6);
  c.hidden = 3;
  c.intermediate = 33;  // 3 x 3 x 33 x 4 bytes in rows of 6 bytes: 198 rows
  EXPECT_EQ(runtime::TransferRows(c, true), 198);
  c.hidden = 8;
  c.intermediate = int64_t{1} << 22;  // 3 x 2^23 rows: capped, and the time scaled past the cap
  EXPECT_EQ(runtime::TransferRows(c, true), int64_t{1} << 20);
  EXPECT_DOUBLE_EQ(runtime::TransferSeconds(1e-9, c, true), 1e-9 * 3 * (1 << 22) * 2);
}

TEST(CostProbeDerive, OptionsAreChecked) {
  CostProbeOptions o;
  EXPECT_TRUE(runtime::CheckCostProbeOptions(o).ok());
  o.compute_rows = 0;  // the device's default
  EXPECT_TRUE(runtime::CheckCostProbeOptions(o).ok());
  EXPECT_EQ(runtime::DefaultProbeRows(Device::kCpu), 512);
  EXPECT_EQ(runtime::DefaultProbeRows(Device::kCuda), 4096);
  o.compute_rows = -1;
  EXPECT_NE(runtime::CheckCostProbeOptions(o).message().find("compute_rows"), std::string::npos);
  o = {};
  o.link_rows = (int64_t{1} << 20) + 1;
  EXPECT_NE(runtime::CheckCostProbeOptions(o).message().find("link_rows"), std::string::npos);
  o = {};
  o.transfer_rows = -2;
  EXPECT_NE(runtime::CheckCostProbeOptions(o).message().find("transfer_rows"), std::string::npos);
  o = {};
  o.repetitions = 0;
  EXPECT_NE(runtime::CheckCostProbeOptions(o).message().find("repetitions"), std::string::npos);
}

// Every rank's partner against the topology, for every size and node size up to 17: intra
// partners share the node, inter partners do not, a rank is its own partner exactly where it has
// none of that class, and no rank receives from two others (a shared link would be timed).
TEST(CostProbePartners, LieInTheirClassAndNoRankReceivesTwice) {
  for (int32_t R = 1; R <= 17; ++R) {
    for (int32_t rpn = 0; rpn <= R + 1; ++rpn) {
      const int32_t node = rpn == 0 || rpn >= R ? R : rpn;
      auto node_of = [&](int32_t r) { return r / node; };
      const int32_t nodes = (R + node - 1) / node;
      for (bool intra : {true, false}) {
        const std::vector<int32_t> d = runtime::ProbePartners(R, rpn, intra);
        ASSERT_EQ(static_cast<int32_t>(d.size()), R);
        std::vector<int> senders(R, 0);
        int measuring = 0;
        for (int32_t r = 0; r < R; ++r) {
          ASSERT_GE(d[r], 0);
          ASSERT_LT(d[r], R);
          if (d[r] == r) continue;
          ++measuring;
          ++senders[d[r]];
          if (rpn == 0) {
            EXPECT_FALSE(intra) << "flat: one class, inter";
          } else if (intra) {
            EXPECT_EQ(node_of(d[r]), node_of(r)) << R << " " << rpn << " rank " << r;
          } else {
            EXPECT_NE(node_of(d[r]), node_of(r)) << R << " " << rpn << " rank " << r;
          }
        }
        for (int32_t r = 0; r < R; ++r) EXPECT_LE(senders[r], 1) << R << " " << rpn << " " << r;
        // Who measures: intra, every rank of a node of two or more; inter, with two nodes or more
        // (flat: two ranks or more), at least the places both nodes have.
        int32_t want = 0;
        for (int32_t r = 0; r < R; ++r) {
          const int32_t base = node_of(r) * node, here = std::min(node, R - base);
          if (intra && rpn > 0) want += here >= 2;
        }
        if (intra) {
          EXPECT_EQ(measuring, want) << R << " " << rpn;
        } else if (rpn == 0) {
          EXPECT_EQ(measuring, R >= 2 ? R : 0);
        } else if (nodes >= 2) {
          EXPECT_GE(measuring, 2 * std::min(node, R - (nodes - 1) * node)) << R << " " << rpn;
        } else {
          EXPECT_EQ(measuring, 0);
        }
      }
    }
  }
}

class CostProbeTest : public CommunicatorTest {
 protected:
  LayerConfig Config(int32_t ranks_per_node) const {
    LayerConfig c;
    c.num_experts = 2 * size();
    c.top_k = 2;
    c.hidden = 64;
    c.intermediate = 32;
    c.ranks_per_node = ranks_per_node;
    c.max_tokens = 64;
    c.num_threads = 1;
    return c;
  }
  static CostProbeOptions Small() {
    CostProbeOptions o;
    o.compute_rows = 64;
    o.link_rows = 48;
    o.repetitions = 3;
    return o;
  }
  // Every rank's figures are rank 0's.
  void ExpectSameOnEveryRank(const MeasuredCosts& m) {
    const double mine[] = {m.token_seconds,
                           m.row_seconds_intra,
                           m.row_seconds_inter,
                           m.transfer_seconds_intra,
                           m.transfer_seconds_inter,
                           static_cast<double>(m.replica_cost_intra),
                           static_cast<double>(m.replica_cost_inter),
                           static_cast<double>(m.row_cost_intra),
                           static_cast<double>(m.row_cost_inter),
                           static_cast<double>(m.intra_measured + 2 * m.inter_measured),
                           m.token_seconds_fastest,
                           m.token_seconds_slowest};
    const int n = sizeof(mine) / sizeof(mine[0]);
    std::vector<double> all(static_cast<size_t>(n) * size());
    MPI_Allgather(mine, n, MPI_DOUBLE, all.data(), n, MPI_DOUBLE, MPI_COMM_WORLD);
    for (int r = 1; r < size(); ++r) {
      for (int i = 0; i < n; ++i) EXPECT_EQ(all[r * n + i], all[i]) << "rank " << r << " field " << i;
    }
    // Each rank's speed, the same list everywhere.
    ASSERT_EQ(m.speeds.size(), static_cast<size_t>(size()));
    std::vector<double> speeds(static_cast<size_t>(size()) * size());
    MPI_Allgather(m.speeds.data(), size(), MPI_DOUBLE, speeds.data(), size(), MPI_DOUBLE,
                  MPI_COMM_WORLD);
    for (int r = 1; r < size(); ++r) {
      for (int i = 0; i < size(); ++i) EXPECT_EQ(speeds[r * size() + i], speeds[i]) << "rank " << r;
    }
  }
};

// Nodes of 2 ranks: intra measured from 2 ranks, inter from 4 (np 1, 2, 3, 4: with 3 the second
// node is one rank, which measures inter but not intra).
TEST_F(CostProbeTest, MeasuresTheTopologysClassesAndAgrees) {
  const LayerConfig config = Config(/*ranks_per_node=*/2);
  auto m = MeasureCosts(comm_.get(), config, Small());
  ASSERT_TRUE(m.ok()) << m.status();
  ExpectSameOnEveryRank(*m);
  EXPECT_EQ(m->ranks, size());
  EXPECT_EQ(m->compute_rows, 64);
  EXPECT_EQ(m->link_rows, 48);
  // One expert's fp32 gradients (3 x 64 x 32 x 4 bytes) as rows of 64 fp32 values.
  EXPECT_EQ(m->transfer_rows, 96);
  EXPECT_EQ(runtime::TransferRows(config, /*training=*/true), 96);
  EXPECT_TRUE(std::isfinite(m->token_seconds));
  EXPECT_GT(m->token_seconds, 0);
  EXPECT_EQ(m->intra_measured, size() >= 2);
  EXPECT_EQ(m->inter_measured, size() >= 3);
  if (m->intra_measured) {
    EXPECT_GT(m->row_seconds_intra, 0);
    EXPECT_GT(m->transfer_seconds_intra, 0);
  }
  if (m->inter_measured) {
    EXPECT_GT(m->row_seconds_inter, 0);
    EXPECT_GT(m->transfer_seconds_inter, 0);
  }
  // The costs are the derivation of the figures.
  runtime::ProbeFigures figures;
  figures.token_seconds = m->token_seconds;
  figures.row_seconds[0] = m->row_seconds_intra;
  figures.row_seconds[1] = m->row_seconds_inter;
  figures.transfer_seconds[0] = m->transfer_seconds_intra;
  figures.transfer_seconds[1] = m->transfer_seconds_inter;
  figures.measured[0] = m->intra_measured;
  figures.measured[1] = m->inter_measured;
  figures.rank_token_seconds = m->rank_token_seconds;
  const MeasuredCosts d = DeriveCosts(true, figures, size());
  EXPECT_EQ(m->speeds, d.speeds);
  // Every rank timed its own token; the median of those is the token time, and each rank's
  // speed is that median over its own time.
  ASSERT_EQ(m->rank_token_seconds.size(), static_cast<size_t>(size()));
  std::vector<double> sorted = m->rank_token_seconds;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  EXPECT_DOUBLE_EQ(m->token_seconds,
                   n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2);
  EXPECT_EQ(m->token_seconds_fastest, sorted.front());
  EXPECT_EQ(m->token_seconds_slowest, sorted.back());
  ASSERT_EQ(m->speeds.size(), n);
  for (size_t r = 0; r < n; ++r) {
    EXPECT_DOUBLE_EQ(m->speeds[r], m->token_seconds / m->rank_token_seconds[r]) << "rank " << r;
  }
  // The speeds are what a layer config takes.
  LayerConfig with_speeds = config;
  with_speeds.speeds = m->speeds;
  EXPECT_TRUE(runtime::CheckLayerConfig(with_speeds, size(), true).ok());
  EXPECT_EQ(m->replica_cost_intra, d.replica_cost_intra);
  EXPECT_EQ(m->replica_cost_inter, d.replica_cost_inter);
  EXPECT_EQ(m->row_cost_intra, d.row_cost_intra);
  EXPECT_EQ(m->row_cost_inter, d.row_cost_inter);
  if (size() == 1) {
    EXPECT_EQ(m->replica_cost_intra + m->replica_cost_inter + m->row_cost_intra +
                  m->row_cost_inter,
              0);
  }
  // Forward only measures too (fewer crossings, weights instead of gradients).
  CostProbeOptions fwd = Small();
  fwd.training = false;
  auto f = MeasureCosts(comm_.get(), config, fwd);
  ASSERT_TRUE(f.ok()) << f.status();
  ExpectSameOnEveryRank(*f);
  EXPECT_GT(f->token_seconds, 0);
}

// Flat: one class, taken as inter; intra copies it. Rows left 0: the CPU's default.
TEST_F(CostProbeTest, FlatTopologyMeasuresOneClass) {
  CostProbeOptions o = Small();
  o.compute_rows = 0;
  o.link_rows = 0;
  o.repetitions = 1;
  auto m = MeasureCosts(comm_.get(), Config(/*ranks_per_node=*/0), o);
  ASSERT_TRUE(m.ok()) << m.status();
  ExpectSameOnEveryRank(*m);
  EXPECT_FALSE(m->intra_measured);
  EXPECT_EQ(m->inter_measured, size() >= 2);
  EXPECT_EQ(m->compute_rows, runtime::DefaultProbeRows(Device::kCpu));
  EXPECT_EQ(m->link_rows, runtime::DefaultProbeRows(Device::kCpu));
  EXPECT_EQ(m->replica_cost_intra, m->replica_cost_inter);
  EXPECT_EQ(m->row_cost_intra, m->row_cost_inter);
}

// A layer made with the measured costs weighs with them and matches the fp64 reference; the
// probe recorded nothing in the routing trace, whose shape stays the layer's.
TEST_F(CostProbeTest, LayerRunsWithTheMeasuredCostsAndTracesStayTheLayers) {
  const std::string path = "moonep_cost_probe_trace_" + std::to_string(size()) + ".txt";
  if (rank() == 0) std::remove(path.c_str());
  MPI_Barrier(MPI_COMM_WORLD);
  ASSERT_TRUE(comm_->SetTracePath(path).ok());
  LayerConfig config = Config(/*ranks_per_node=*/2);
  auto m = MeasureCosts(comm_.get(), config, Small());
  ASSERT_TRUE(m.ok()) << m.status();
  runtime::ApplyCosts(*m, &config);
  EXPECT_EQ(config.replica_cost_inter, m->replica_cost_inter);
  EXPECT_EQ(config.row_cost_intra, m->row_cost_intra);
  config.layer_id = 5;
  auto layer = runtime::MoeLayer::Create(comm_.get(), config);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const int32_t epn = 2;
  const GlobalProblem g =
      MakeGlobalProblem(size(), epn, config.top_k, config.hidden, config.intermediate, 40,
                        DType::kFloat32, 7);
  RankTensors t = MakeRankTensors(g, rank(), DType::kFloat32);
  ASSERT_TRUE((*layer)->BindParameters(t.params, t.grads).ok());
  auto h = RunForward(layer->get(), &t, DType::kFloat32, config.hidden);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(RunBackward(layer->get(), *h, &t, DType::kFloat32, config.hidden).ok());
  reference::ForwardResult fr;
  reference::BackwardResult br;
  ASSERT_TRUE(ReferenceLayer(g, &fr, &br).ok());
  const int64_t o = g.offset[rank()], T = t.tokens;
  EXPECT_LT(RelError(Decode(t.y, DType::kFloat32), fr.y.data() + o * config.hidden,
                     T * config.hidden),
            1e-5);
  EXPECT_LT(RelError(Decode(t.dx, DType::kFloat32), br.dx.data() + o * config.hidden,
                     T * config.hidden),
            1e-5);
  ASSERT_TRUE((*layer)->Close().ok());
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() != 0) return;
  comm_->SetTracePath("").IgnoreError();
  std::ifstream in(path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_EQ(line, runtime::TraceHeader(size(), config.num_experts, config.top_k).substr(
                      0, line.size()));
  int records = 0;
  while (std::getline(in, line)) {
    ++records;
    EXPECT_EQ(line.rfind("0 5 ", 0), 0u) << line;  // step 0 of layer 5 only
  }
  EXPECT_EQ(records, 1);
  std::remove(path.c_str());
}

// Bad options on one rank: that rank's error there, RemoteError naming it elsewhere; valid options
// that differ: the same InvalidArgument on every rank; a bad config: refused. Then the
// communicator still measures.
TEST_F(CostProbeTest, BadInputFailsEveryRankAndLeavesTheCommunicatorUsable) {
  const LayerConfig config = Config(/*ranks_per_node=*/2);
  const int last = size() - 1;
  CostProbeOptions o = Small();
  if (rank() == last) o.repetitions = -1;
  auto m = MeasureCosts(comm_.get(), config, o);
  ASSERT_FALSE(m.ok());
  if (rank() == last) {
    EXPECT_EQ(ToResult(m.status()), moonepInvalidArgument) << m.status();
    EXPECT_NE(m.status().message().find("repetitions"), std::string::npos) << m.status();
  } else {
    EXPECT_EQ(ToResult(m.status()), moonepRemoteError) << m.status();
  }

  if (size() > 1) {
    o = Small();
    if (rank() == last) o.link_rows = 32;
    m = MeasureCosts(comm_.get(), config, o);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(ToResult(m.status()), moonepInvalidArgument) << m.status();
    EXPECT_NE(m.status().message().find("different options"), std::string::npos) << m.status();
  }

  // transfer_rows: an explicit value equal to the default agrees with 0; another one does not.
  o = Small();
  if (rank() == 0) o.transfer_rows = runtime::TransferRows(config, /*training=*/true);
  m = MeasureCosts(comm_.get(), config, o);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->transfer_rows, runtime::TransferRows(config, true));
  if (size() > 1) {
    o = Small();
    if (rank() == last) o.transfer_rows = 95;
    m = MeasureCosts(comm_.get(), config, o);
    ASSERT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find("different options"), std::string::npos) << m.status();
  }

  LayerConfig no_executor = config;
  no_executor.intermediate = 0;
  m = MeasureCosts(comm_.get(), no_executor, Small());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("intermediate"), std::string::npos) << m.status();

  EXPECT_EQ(ToResult(MeasureCosts(nullptr, config, Small()).status()), moonepInvalidArgument);

  m = MeasureCosts(comm_.get(), config, Small());
  ASSERT_TRUE(m.ok()) << m.status();
  ExpectSameOnEveryRank(*m);
}

}  // namespace
}  // namespace moonep::testing
