// Replica chains: how a transport moves an expert's parameters to its replicas (prefetch) and their
// gradients back home (reduce) without every transfer converging on the home rank
// (docs/transport.md, "Prefetch and reduce along chains").
//
// The holders of an expert e are the ranks whose replica slots hold e, in increasing rank (a rank
// holds at most one slot of an expert). With holders h_1 < h_2 < ... < h_n and home H:
//
//   prefetch  H -> h_1 -> h_2 -> ... -> h_n        every holder keeps the bytes and passes them on
//   reduce    h_1 -> h_2 -> ... -> h_n -> H        p_1 = g_1, p_i = p_(i-1) + g_i (fp32),
//                                                  home = store(p_n + home)
//
// so each rank sends at most one copy and receives at most one copy per expert it takes part in,
// whatever the replica count, and the home sends one copy of its weights and receives one sum.
// Each tensor is cut into chunks of ChunkElements() elements that travel one after the other, so a
// chain of n hops takes about one transfer time plus n - 1 chunk times, not n transfer times (a
// chain of one holder sends its tensors whole: ChainChunkElements).
// Reduce partials travel as fp32 whatever the gradient dtype, and the sum is
// ((g_1 + g_2) + ... + g_n) + home, accumulated in fp32 and stored once: the same bits on every
// backend and every run (the nccl backend's LaunchSumInOrder sums in this order too).
//
// A plan with home replicas (Plan::home_replicas, one rank only) has the home rank among the
// holders: every hop is then local, and the transport does it by copies (prefetch) and
// ChainStart / ChainAdd / ChainFinish in the same order (reduce), without ChainPeers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moonep/core/tensor.h"
#include "planner/plan.h"

namespace moonep::transport::common {

struct ChainHolder {
  int32_t rank = -1;
  int32_t slot = -1;  // the rank's replica slot holding the chain's expert
};

struct ReplicaChain {
  int32_t expert = -1;
  int32_t home = -1;   // plan.home[expert]
  int32_t group = -1;  // plan.home_group[expert]: the expert's group on its home rank
  std::vector<ChainHolder> holders;  // increasing rank, at least one
};

// Every expert with at least one replica slot, in increasing expert id. Same result on every rank
// (a function of the plan only). O(E + R * slots).
std::vector<ReplicaChain> ReplicaChains(const planner::Plan& plan);

// Where `rank` sits in `chain`: the peers it receives from and sends to, per operation; -1 where it
// has none. A rank that is neither home nor holder has none at all. For chains whose home is not a
// holder (every plan without home replicas).
struct ChainPeers {
  int32_t prev = -1;  // receives from
  int32_t next = -1;  // sends to
  int32_t slot = -1;  // this rank's slot of the expert (-1: not a holder)
  bool home = false;  // this rank is the expert's home
  bool first = false, last = false;  // first / last holder
};
ChainPeers PrefetchPeers(const ReplicaChain& chain, int32_t rank);
ChainPeers ReducePeers(const ReplicaChain& chain, int32_t rank);

// Default and limits of TransportOptions::replica_chunk_bytes (0 selects the default).
inline constexpr int64_t kDefaultReplicaChunkBytes = int64_t{1} << 20;
inline constexpr int64_t kMinReplicaChunkBytes = 16;
inline constexpr int64_t kMaxReplicaChunkBytes = int64_t{1} << 30;

// Whether `chunk_bytes` is a valid chunk size: 0 (the default) or in [kMin, kMax].
inline bool ValidReplicaChunkBytes(int64_t chunk_bytes) {
  return chunk_bytes == 0 ||
         (chunk_bytes >= kMinReplicaChunkBytes && chunk_bytes <= kMaxReplicaChunkBytes);
}

// Elements per chunk for a chunk size in bytes (0: the default): chunk_bytes / 4, so a reduce
// chunk of fp32 partials is chunk_bytes long (a prefetch chunk of a 2-byte dtype half of it).
int64_t ChunkElements(int64_t chunk_bytes);
// Chunks of a tensor of `numel` elements (at least 1, for an empty tensor too).
int64_t NumChunks(int64_t numel, int64_t chunk_elements);
// Elements per chunk along `chain`: `chunk_elements` (ChunkElements) when it has two holders or
// more, whose hops the chunks pipeline along; a chain of one holder is one hop with nothing to
// pipeline, and its tensors go whole (chunks of kMaxReplicaChunkBytes / 4 elements at most):
// chunking it only added messages (measured: docs/transport.md).
int64_t ChainChunkElements(const ReplicaChain& chain, int64_t chunk_elements);

// The prefetches and reduces in flight on a host transport. A holder passes chunks on from its
// operation's Test, so every operation's Test also tests these (Progress): chunks then pass through
// a rank while it waits on anything else of the transport, in whatever order the ranks wait.
template <typename Op>
class ChainOpsInFlight {
 public:
  void Add(Op* op) { ops_.push_back(op); }
  void Remove(Op* op) { ops_.erase(std::remove(ops_.begin(), ops_.end(), op), ops_.end()); }
  // Tests each op in flight but `caller`, once; a call from inside one of those Tests does nothing.
  // An op's failure stays its own (its caller's Test or Wait returns it).
  void Progress(const Op* caller) {
    if (progressing_ || ops_.empty()) return;
    progressing_ = true;
    copy_.assign(ops_.begin(), ops_.end());  // an op that ends in its Test leaves ops_
    for (Op* op : copy_) {
      if (op != caller) static_cast<void>(op->Test());
    }
    progressing_ = false;
  }

 private:
  std::vector<Op*> ops_;
  std::vector<Op*> copy_;  // Progress's, kept so that a poll allocates nothing
  bool progressing_ = false;
};

// Reduce arithmetic on elements [begin, begin + n) of a tensor, partials in fp32:
//   ChainStart:  partial[j] = slot[begin + j]                      (the first holder)
//   ChainAdd:    partial[j] += slot[begin + j]                     (every next holder)
//   ChainFinish: home[begin + j] = store(partial[j] + home[begin + j])   (the home)
void ChainStart(const TensorView& slot, int64_t begin, int64_t n, float* partial);
void ChainAdd(const TensorView& slot, int64_t begin, int64_t n, float* partial);
void ChainFinish(const TensorView& home, int64_t begin, int64_t n, const float* partial);

}  // namespace moonep::transport::common
