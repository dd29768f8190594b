#include "transport/common/replica_chain.h"

#include <algorithm>
#include <cstring>

#include "moonep/core/dtype.h"

namespace moonep::transport::common {

std::vector<ReplicaChain> ReplicaChains(const planner::Plan& plan) {
  const int32_t E = plan.num_experts, R = plan.num_ranks, S = plan.slots;
  std::vector<int32_t> index(static_cast<size_t>(E), -1);
  std::vector<ReplicaChain> chains;
  // Experts in increasing id: mark those with a slot, then fill holders rank by rank.
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t sl = 0; sl < S; ++sl) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * S + sl];
      if (e >= 0) index[static_cast<size_t>(e)] = 0;
    }
  }
  for (int32_t e = 0; e < E; ++e) {
    if (index[static_cast<size_t>(e)] < 0) continue;
    index[static_cast<size_t>(e)] = static_cast<int32_t>(chains.size());
    ReplicaChain c;
    c.expert = e;
    c.home = plan.home[static_cast<size_t>(e)];
    c.group = plan.home_group[static_cast<size_t>(e)];
    chains.push_back(std::move(c));
  }
  for (int32_t d = 0; d < R; ++d) {
    for (int32_t sl = 0; sl < S; ++sl) {
      const int32_t e = plan.slot_expert[static_cast<size_t>(d) * S + sl];
      if (e >= 0) chains[static_cast<size_t>(index[static_cast<size_t>(e)])].holders.push_back({d, sl});
    }
  }
  return chains;
}

namespace {

// Position of `rank` among the holders, or -1.
int32_t HolderIndex(const ReplicaChain& chain, int32_t rank) {
  const auto it = std::lower_bound(chain.holders.begin(), chain.holders.end(), rank,
                                   [](const ChainHolder& h, int32_t r) { return h.rank < r; });
  return it != chain.holders.end() && it->rank == rank ? static_cast<int32_t>(it - chain.holders.begin())
                                                        : -1;
}

// The holders in increasing rank, with the home before them (prefetch) or after them (reduce).
ChainPeers PeersAlong(const ReplicaChain& chain, int32_t rank, bool prefetch) {
  ChainPeers p;
  if (rank == chain.home) {
    p.home = true;
    (prefetch ? p.next : p.prev) = (prefetch ? chain.holders.front() : chain.holders.back()).rank;
    return p;
  }
  const int32_t i = HolderIndex(chain, rank);
  if (i < 0) return p;
  const int32_t n = static_cast<int32_t>(chain.holders.size());
  p.slot = chain.holders[static_cast<size_t>(i)].slot;
  p.first = i == 0;
  p.last = i == n - 1;
  p.prev = !p.first ? chain.holders[static_cast<size_t>(i - 1)].rank : prefetch ? chain.home : -1;
  p.next = !p.last ? chain.holders[static_cast<size_t>(i + 1)].rank : prefetch ? -1 : chain.home;
  return p;
}

}  // namespace

ChainPeers PrefetchPeers(const ReplicaChain& chain, int32_t rank) {
  return PeersAlong(chain, rank, /*prefetch=*/true);
}

ChainPeers ReducePeers(const ReplicaChain& chain, int32_t rank) {
  return PeersAlong(chain, rank, /*prefetch=*/false);
}

int64_t ChunkElements(int64_t chunk_bytes) {
  if (chunk_bytes <= 0) chunk_bytes = kDefaultReplicaChunkBytes;
  return std::max<int64_t>(1, chunk_bytes / 4);
}

int64_t NumChunks(int64_t numel, int64_t chunk_elements) {
  return std::max<int64_t>(1, (numel + chunk_elements - 1) / chunk_elements);
}

int64_t ChainChunkElements(const ReplicaChain& chain, int64_t chunk_elements) {
  return chain.holders.size() >= 2 ? chunk_elements : kMaxReplicaChunkBytes / 4;
}

void ChainStart(const TensorView& slot, int64_t begin, int64_t n, float* partial) {
  if (slot.dtype == DType::kFloat32) {
    std::memcpy(partial, static_cast<const float*>(slot.data) + begin, static_cast<size_t>(n) * 4);
    return;
  }
  for (int64_t j = 0; j < n; ++j) partial[j] = LoadAsFloat(slot.data, slot.dtype, static_cast<size_t>(begin + j));
}

void ChainAdd(const TensorView& slot, int64_t begin, int64_t n, float* partial) {
  if (slot.dtype == DType::kFloat32) {
    const float* g = static_cast<const float*>(slot.data) + begin;
    for (int64_t j = 0; j < n; ++j) partial[j] += g[j];
    return;
  }
  for (int64_t j = 0; j < n; ++j) partial[j] += LoadAsFloat(slot.data, slot.dtype, static_cast<size_t>(begin + j));
}

void ChainFinish(const TensorView& home, int64_t begin, int64_t n, const float* partial) {
  if (home.dtype == DType::kFloat32) {
    float* h = static_cast<float*>(home.data) + begin;
    for (int64_t j = 0; j < n; ++j) h[j] = partial[j] + h[j];
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const size_t k = static_cast<size_t>(begin + j);
    StoreFromFloat(home.data, home.dtype, k, partial[j] + LoadAsFloat(home.data, home.dtype, k));
  }
}

}  // namespace moonep::transport::common
