// The replica chains every host backend moves experts along (transport/common/replica_chain.h):
// their holders and peers worked out by hand for a small plan, the chunking, and the fp32
// arithmetic against a sum in the contract's order.
#include "transport/common/replica_chain.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "moonep/core/dtype.h"

namespace moonep::transport::common {
namespace {

// 4 ranks, 8 experts (home e / 2, group e % 2), 2 slots a rank:
//   rank 0: expert 6, -   rank 1: expert 6, 5   rank 2: expert 6, -   rank 3: expert 0, 2
planner::Plan SmallPlan() {
  planner::Plan p;
  p.num_ranks = 4;
  p.num_experts = 8;
  p.experts_per_rank = 2;
  p.slots = 2;
  for (int32_t e = 0; e < 8; ++e) {
    p.home.push_back(e / 2);
    p.home_group.push_back(e % 2);
  }
  p.slot_expert = {6, -1, 6, 5, 6, -1, 0, 2};
  return p;
}

TEST(ReplicaChain, HoldersInIncreasingRankPerExpertInIncreasingId) {
  const std::vector<ReplicaChain> chains = ReplicaChains(SmallPlan());
  ASSERT_EQ(chains.size(), 4u);
  // expert, home, group, holders (rank, slot)
  struct Want {
    int32_t expert, home, group;
    std::vector<std::pair<int32_t, int32_t>> holders;
  };
  const std::vector<Want> want = {{0, 0, 0, {{3, 0}}},
                                  {2, 1, 0, {{3, 1}}},
                                  {5, 2, 1, {{1, 1}}},
                                  {6, 3, 0, {{0, 0}, {1, 0}, {2, 0}}}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(chains[i].expert, want[i].expert);
    EXPECT_EQ(chains[i].home, want[i].home);
    EXPECT_EQ(chains[i].group, want[i].group);
    ASSERT_EQ(chains[i].holders.size(), want[i].holders.size()) << i;
    for (size_t h = 0; h < want[i].holders.size(); ++h) {
      EXPECT_EQ(chains[i].holders[h].rank, want[i].holders[h].first) << i;
      EXPECT_EQ(chains[i].holders[h].slot, want[i].holders[h].second) << i;
    }
  }
  EXPECT_TRUE(ReplicaChains(planner::Plan{}).empty());
}

TEST(ReplicaChain, PeersAlongAChainOfTwoHolders) {
  // Expert 0: home 0, holder 3. Prefetch 0 -> 3; reduce 3 -> 0.
  const ReplicaChain c = ReplicaChains(SmallPlan())[0];
  ChainPeers p = PrefetchPeers(c, 0);
  EXPECT_TRUE(p.home);
  EXPECT_EQ(p.next, 3);
  EXPECT_EQ(p.prev, -1);
  p = PrefetchPeers(c, 3);
  EXPECT_FALSE(p.home);
  EXPECT_TRUE(p.first && p.last);
  EXPECT_EQ(p.prev, 0);
  EXPECT_EQ(p.next, -1);
  EXPECT_EQ(p.slot, 0);
  p = ReducePeers(c, 3);
  EXPECT_EQ(p.prev, -1);
  EXPECT_EQ(p.next, 0);
  p = ReducePeers(c, 0);
  EXPECT_TRUE(p.home);
  EXPECT_EQ(p.prev, 3);
  EXPECT_EQ(p.next, -1);
  p = ReducePeers(c, 2);  // neither home nor holder
  EXPECT_FALSE(p.home);
  EXPECT_EQ(p.prev, -1);
  EXPECT_EQ(p.next, -1);
  EXPECT_EQ(p.slot, -1);
}

TEST(ReplicaChain, PeersAlongALongerChain) {
  // Expert 6: home 3, holders 0, 1, 2: prefetch 3 -> 0 -> 1 -> 2, reduce 0 -> 1 -> 2 -> 3.
  const ReplicaChain c = ReplicaChains(SmallPlan())[3];
  ASSERT_EQ(c.expert, 6);
  const int32_t prefetch[4][2] = {{3, 1}, {0, 2}, {1, -1}, {-1, 0}};  // rank -> {prev, next}
  const int32_t reduce[4][2] = {{-1, 1}, {0, 2}, {1, 3}, {2, -1}};
  for (int32_t r = 0; r < 4; ++r) {
    const ChainPeers a = PrefetchPeers(c, r), b = ReducePeers(c, r);
    EXPECT_EQ(a.prev, prefetch[r][0]) << r;
    EXPECT_EQ(a.next, prefetch[r][1]) << r;
    EXPECT_EQ(b.prev, reduce[r][0]) << r;
    EXPECT_EQ(b.next, reduce[r][1]) << r;
    EXPECT_EQ(a.home, r == 3);
    EXPECT_EQ(b.first, r == 0);
    EXPECT_EQ(b.last, r == 2);
    EXPECT_EQ(b.slot, r == 3 ? -1 : 0);
  }
}

TEST(ReplicaChain, Chunks) {
  EXPECT_EQ(ChunkElements(0), kDefaultReplicaChunkBytes / 4);
  EXPECT_EQ(ChunkElements(16), 4);
  EXPECT_EQ(ChunkElements(18), 4);
  EXPECT_EQ(NumChunks(24, 4), 6);
  EXPECT_EQ(NumChunks(25, 4), 7);
  EXPECT_EQ(NumChunks(0, 4), 1);
  EXPECT_EQ(NumChunks(3, 4), 1);
  // One holder: nothing to pipeline, whole tensors (up to 1 GiB a chunk); two or more: as given.
  const std::vector<ReplicaChain> chains = ReplicaChains(SmallPlan());
  EXPECT_EQ(ChainChunkElements(chains[0], 4), kMaxReplicaChunkBytes / 4);
  EXPECT_EQ(ChainChunkElements(chains[3], 4), 4);
}

// ChainStart / ChainAdd / ChainFinish over chunks equal ((g1 + g2) + g3) + home in fp32, stored
// once, element by element, for fp32 and bf16 tensors.
TEST(ReplicaChain, ArithmeticIsTheContractsOrderChunkByChunk) {
  const int64_t n = 11, chunk = 4;
  for (const DType dt : {DType::kFloat32, DType::kBFloat16}) {
    std::vector<std::vector<float>> f(4, std::vector<float>(n));
    std::vector<std::vector<BFloat16>> b(4, std::vector<BFloat16>(n));
    std::vector<TensorView> v;
    for (int i = 0; i < 4; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const float x = (j % 2 ? 1.0f : -1.0f) * static_cast<float>(1 << ((i * 7 + j * 3) % 23)) *
                        (1.0f + 0.1f * static_cast<float>(i + j));
        f[i][j] = x;
        b[i][j] = BFloat16::FromFloat(x);
      }
      v.push_back(dt == DType::kFloat32 ? TensorView::Contiguous(f[i].data(), dt, {n})
                                        : TensorView::Contiguous(b[i].data(), dt, {n}));
    }
    const auto get = [&](int i, int64_t j) { return dt == DType::kFloat32 ? f[i][j] : b[i][j].ToFloat(); };
    std::vector<float> want(n);
    for (int64_t j = 0; j < n; ++j) {
      const float acc = ((get(0, j) + get(1, j)) + get(2, j)) + get(3, j);
      want[j] = dt == DType::kFloat32 ? acc : BFloat16::FromFloat(acc).ToFloat();
    }
    std::vector<float> partial(n);
    for (int64_t c = 0; c < NumChunks(n, chunk); ++c) {
      const int64_t begin = c * chunk, len = std::min(chunk, n - begin);
      ChainStart(v[0], begin, len, partial.data() + begin);
      ChainAdd(v[1], begin, len, partial.data() + begin);
      ChainAdd(v[2], begin, len, partial.data() + begin);
      ChainFinish(v[3], begin, len, partial.data() + begin);
    }
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(get(3, j), want[j]) << DTypeName(dt) << " " << j;
  }
}

}  // namespace
}  // namespace moonep::transport::common
