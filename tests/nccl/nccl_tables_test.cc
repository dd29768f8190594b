// The NCCL transport's data movement emulated on the host, all ranks in one process: the tables
// (transport/nccl/nccl_tables.h) drive host versions of the device steps exactly as the transport
// drives the kernels and the grouped sends/receives (pack, metadata, unique counts, expansion,
// rows back, weighted combine, row dots and scatter). Runs without a GPU; the results are checked
// against the brute-force placement (tests/transport/transport_test_util.h) and fp64 sums.
#include "transport/nccl/nccl_tables.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "moonep/core/worker_pool.h"
#include "planner/plan_builder.h"
#include "planner/planner.h"
#include "tests/transport/transport_test_util.h"
#include "transport/layout.h"

namespace moonep::transport::nccl {
namespace {

using test::Problem;

float Scale(int32_t e) { return 1.0f + 0.25f * static_cast<float>(e % 5); }

struct RankState {
  SendLayout send;
  ReceiveLayout recv;
  DispatchTables tables;
};

absl::Status MakePlan(const std::string& kind, const Problem& p, planner::Plan* plan) {
  if (kind == "home" || kind == "random") {
    return test::MakeRandomPlan(kind, p, 7, kind == "home" ? 0 : 2, 2, plan);
  }
  planner::PlannerConfig c;
  c.num_ranks = p.R;
  c.num_experts = p.E;
  c.pad_multiple = 4;
  if (!planner::ParsePolicy(kind, &c.policy)) return absl::InvalidArgumentError(kind);
  auto made = planner::Planner::Create(c);
  if (!made.ok()) return made.status();
  return (*made)->MakePlan(p.counts, plan);
}

class NcclTablesTest : public ::testing::TestWithParam<std::tuple<int32_t, std::string>> {};

TEST_P(NcclTablesTest, EmulatedDispatchCombineAndBackwardMatchBruteForce) {
  const int32_t R = std::get<0>(GetParam());
  const Problem p = test::MakeProblem(R, 2 * R, std::min(4, 2 * R), 3, 10, 11 + R, R > 2 ? 1 : -1);
  planner::Plan plan;
  ASSERT_TRUE(MakePlan(std::get<1>(GetParam()), p, &plan).ok());
  const int32_t K = p.K;
  const int64_t H = p.H;
  std::vector<int64_t> offsets;
  planner::ComputeSourceOffsets(p.counts, R, p.E, &offsets);
  std::vector<RankState> st(R);
  for (int32_t r = 0; r < R; ++r) {
    ASSERT_TRUE(BuildSendLayout(plan, offsets, r, p.ids[r], p.T[r], K, &st[r].send).ok());
    BuildReceiveLayout(plan, offsets, r, &st[r].recv);
    BuildDispatchTables(st[r].send, st[r].recv, r, &st[r].tables);
  }

  // Dispatch, stage 1: metadata (send order) and unique counts, per ordered pair.
  std::vector<std::vector<RowMeta>> meta_recv(R);
  std::vector<std::vector<int64_t>> unique_recv(R, std::vector<int64_t>(R, 0));
  for (int32_t d = 0; d < R; ++d) meta_recv[d].assign(st[d].recv.rows_begin[R], RowMeta{-7, -7.0f});
  for (int32_t s = 0; s < R; ++s) {
    const DispatchTables& t = st[s].tables;
    std::vector<RowMeta> meta_send(t.meta_unique.size());
    for (size_t i = 0; i < meta_send.size(); ++i) {
      meta_send[i] = RowMeta{t.meta_unique[i], p.weights[s][t.meta_entries[i]]};
    }
    for (int32_t d = 0; d < R; ++d) {
      const int64_t n = st[s].send.rows_to(d);
      if (d == s || n == 0) continue;
      ASSERT_EQ(n, st[d].recv.rows_from(s)) << "pair " << s << "->" << d;
      std::copy(meta_send.begin() + st[s].send.entry_begin[d],
                meta_send.begin() + st[s].send.entry_begin[d] + n,
                meta_recv[d].begin() + st[d].recv.rows_begin[s]);
      unique_recv[d][s] = t.unique_send[d];
    }
  }
  // Stage 2: pack unique rows, move them, expand into the compute layout.
  std::vector<std::vector<float>> rows(R), row_w(R);
  std::vector<std::vector<int64_t>> staging_begin(R, std::vector<int64_t>(R + 1, 0));
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t s = 0; s < R; ++s) {
      const int64_t n = s == d ? 0 : st[d].recv.rows_from(s);
      const int64_t u = n == 0 ? 0 : unique_recv[d][s];
      ASSERT_TRUE(n == 0 || (u >= 1 && u <= n));
      staging_begin[d][s + 1] = staging_begin[d][s] + u;
    }
  }
  std::vector<std::vector<float>> recv_staging(R);
  for (int32_t d = 0; d < R; ++d) recv_staging[d].assign(staging_begin[d][R] * H, 0.0f);
  for (int32_t s = 0; s < R; ++s) {
    const DispatchTables& t = st[s].tables;
    for (int32_t d = 0; d < R; ++d) {
      if (d == s) continue;
      ASSERT_EQ(t.pack_begin[d + 1] - t.pack_begin[d],
                staging_begin[d][s + 1] - staging_begin[d][s]);
      for (int64_t i = t.pack_begin[d]; i < t.pack_begin[d + 1]; ++i) {
        const int32_t token = t.pack_index[i];
        ASSERT_TRUE(token >= 0 && token < p.T[s]);
        std::memcpy(&recv_staging[d][(staging_begin[d][s] + i - t.pack_begin[d]) * H],
                    &p.x[s][token * H], H * 4);
      }
    }
  }
  for (int32_t d = 0; d < R; ++d) {
    const DispatchTables& t = st[d].tables;
    const int64_t rank_rows = plan.rank_rows[d];
    ASSERT_EQ(static_cast<int64_t>(t.row_source.size()), rank_rows);
    rows[d].assign(rank_rows * H, -1.0f);
    row_w[d].assign(rank_rows, -1.0f);
    for (int64_t r = 0; r < rank_rows; ++r) {
      const RowSource src = t.row_source[r];
      const float* from = nullptr;
      float w = 0.0f;
      if (src.src >= 0) {
        const RowMeta m = meta_recv[d][src.pos];
        ASSERT_GE(m.unique, 0);
        const int64_t row = staging_begin[d][src.src] + m.unique;
        ASSERT_LT(row, staging_begin[d][src.src + 1]);
        from = &recv_staging[d][row * H];
        w = m.weight;
      } else if (src.src == -2) {
        from = &p.x[d][(src.pos / K) * H];
        w = p.weights[d][src.pos];
      }
      for (int64_t j = 0; j < H; ++j) rows[d][r * H + j] = from ? from[j] : 0.0f;
      row_w[d][r] = w;
    }
  }
  const auto truth = test::BruteForcePlacement(p, plan);
  for (int32_t d = 0; d < R; ++d) {
    std::vector<char> filled(plan.rank_rows[d], 0);
    for (int32_t s = 0; s < R; ++s) {
      for (int64_t tok = 0; tok < p.T[s]; ++tok) {
        for (int32_t k = 0; k < K; ++k) {
          const auto& pl = truth[s][tok * K + k];
          if (pl.rank != d) continue;
          filled[pl.row] = 1;
          ASSERT_EQ(0, std::memcmp(&rows[d][pl.row * H], &p.x[s][tok * H], H * 4))
              << "rank " << d << " row " << pl.row << " token " << tok << " of " << s;
          ASSERT_EQ(row_w[d][pl.row], p.weights[s][tok * K + k]);
        }
      }
    }
    for (int64_t r = 0; r < plan.rank_rows[d]; ++r) {
      if (filled[r]) continue;
      ASSERT_EQ(row_w[d][r], 0.0f) << "padding row " << r;
      for (int64_t j = 0; j < H; ++j) ASSERT_EQ(rows[d][r * H + j], 0.0f);
    }
  }

  // Combine: rows back in receive order, received in send order, summed by the combine index.
  std::vector<std::vector<float>> back(R);
  for (int32_t s = 0; s < R; ++s) back[s].assign(st[s].send.entry_begin[R] * H, -5.0f);
  for (int32_t d = 0; d < R; ++d) {
    const DispatchTables& t = st[d].tables;
    std::vector<float> send_staging(t.pos_row.size() * H);
    for (size_t pos = 0; pos < t.pos_row.size(); ++pos) {
      const int32_t row = t.pos_row[pos];
      ASSERT_TRUE(row >= 0 && row < plan.rank_rows[d]);
      const int32_t e = test::ExpertOfRow(plan, d, row);
      for (int64_t j = 0; j < H; ++j) send_staging[pos * H + j] = Scale(e) * rows[d][row * H + j];
    }
    for (int32_t s = 0; s < R; ++s) {
      const int64_t n = st[d].recv.rows_from(s);
      ASSERT_EQ(n, st[s].send.rows_to(d));
      std::copy(send_staging.begin() + st[d].recv.rows_begin[s] * H,
                send_staging.begin() + (st[d].recv.rows_begin[s] + n) * H,
                back[s].begin() + st[s].send.entry_begin[d] * H);
    }
  }
  for (int32_t s = 0; s < R; ++s) {
    const DispatchTables& t = st[s].tables;
    for (int64_t tok = 0; tok < p.T[s]; ++tok) {
      for (int64_t j = 0; j < H; ++j) {
        double got = 0, want = 0, mag = 0;
        for (int32_t k = 0; k < K; ++k) {
          const int32_t idx = t.combine_index[tok * K + k];
          const int32_t e = p.ids[s][tok * K + k];
          ASSERT_EQ(idx < 0, e < 0);
          if (e < 0) continue;
          got += static_cast<double>(p.weights[s][tok * K + k]) * back[s][idx * H + j];
          const double term =
              static_cast<double>(p.weights[s][tok * K + k]) * Scale(e) * p.x[s][tok * H + j];
          want += term;
          mag += std::fabs(term);
        }
        ASSERT_NEAR(got, want, 1e-6 * mag + 1e-9) << "rank " << s << " token " << tok;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    RanksAndPlans, NcclTablesTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                       ::testing::Values(std::string("home"), std::string("random"),
                                         std::string("moonep"),
                                         std::string("test-force-replicas"))),
    [](const ::testing::TestParamInfo<std::tuple<int32_t, std::string>>& info) {
      std::string name =
          "R" + std::to_string(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
      for (char& ch : name) {
        if (ch == '-') ch = '_';
      }
      return name;
    });

// The layouts and tables on a pool of threads (as the transport builds them where the node has
// cores to spare) are the one-thread ones, bit for bit, on a problem large enough for several
// chunks; and every receive position and every entry gets its table entry.
TEST(NcclTablesPoolTest, APoolGivesTheSameTables) {
  WorkerPool pool(3);
  for (const std::string kind : {"home", "random", "moonep"}) {
    SCOPED_TRACE(kind);
    const Problem p = test::MakeProblem(4, 16, 8, 1, 2000, 5, 2);
    planner::Plan plan;
    ASSERT_TRUE(MakePlan(kind, p, &plan).ok());
    std::vector<int64_t> offsets;
    planner::ComputeSourceOffsets(p.counts, p.R, p.E, &offsets);
    for (int32_t r = 0; r < p.R; ++r) {
      RankState one, many;
      ASSERT_TRUE(BuildSendLayout(plan, offsets, r, p.ids[r], p.T[r], p.K, &one.send).ok());
      ASSERT_TRUE(
          BuildSendLayout(plan, offsets, r, p.ids[r], p.T[r], p.K, &many.send, &pool).ok());
      BuildReceiveLayout(plan, offsets, r, &one.recv);
      BuildReceiveLayout(plan, offsets, r, &many.recv);
      BuildDispatchTables(one.send, one.recv, r, &one.tables);
      BuildDispatchTables(many.send, many.recv, r, &many.tables, &pool);
      const DispatchTables &a = one.tables, &b = many.tables;
      EXPECT_EQ(a.pack_begin, b.pack_begin);
      EXPECT_EQ(a.pack_index, b.pack_index);
      EXPECT_EQ(a.meta_unique, b.meta_unique);
      EXPECT_EQ(a.meta_entries, b.meta_entries);
      EXPECT_EQ(a.unique_send, b.unique_send);
      EXPECT_EQ(a.pos_row, b.pos_row);
      EXPECT_EQ(a.combine_index, b.combine_index);
      ASSERT_EQ(a.row_source.size(), b.row_source.size());
      EXPECT_EQ(0, std::memcmp(a.row_source.data(), b.row_source.data(),
                               a.row_source.size() * sizeof(RowSource)));
      // Every receive position has its row; every entry with an expert its send position.
      for (int32_t row : a.pos_row) ASSERT_GE(row, 0);
      for (size_t i = 0; i < p.ids[r].size(); ++i) {
        ASSERT_EQ(a.combine_index[i] >= 0, p.ids[r][i] >= 0) << "rank " << r << " entry " << i;
      }
    }
  }
}

}  // namespace
}  // namespace moonep::transport::nccl
