// The count exchange's message and verdict, shared by the host-memory backends (mpi/, ucx/): each
// rank sends every peer [invalid, T, K, E, capacity, counts[E]] (int64) by its own means, and
// once every message is in, each rank reaches the same verdict from the same rows.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "transport/transport.h"

namespace moonep::transport::common {

constexpr int kCountHeader = 5;  // invalid flag, T, K, E, receive capacity
// The count values take at least this many words, so that a refusing rank's reason has room
// (255 bytes) whatever num_experts is; a message of E < 32 counts is padded with zeros.
constexpr int kMinCountWords = 32;
// A count message's length in int64 words: kCountHeader + max(E, kMinCountWords).
inline int64_t CountMessageWords(int32_t num_experts) {
  return kCountHeader + (num_experts > kMinCountWords ? num_experts : kMinCountWords);
}

// This rank's message (CountMessageWords(E) values). When `local` failed, the count values carry
// its message instead (up to 8 max(E, 32) - 1 bytes, NUL-terminated), so the peers can say why.
void PackCountMessage(const absl::Status& local, absl::Span<const int32_t> topk_ids,
                      int64_t num_tokens, int32_t top_k, int32_t num_experts,
                      int64_t recv_capacity_rows, std::vector<int64_t>* message);

// Keeps this rank's routing in the handle (the layouts of its dispatch need it).
void KeepRouting(const absl::Status& local, absl::Span<const int32_t> topk_ids, int64_t num_tokens,
                 int32_t top_k, DispatchHandle* handle);

// The verdict once `all` holds every rank's message (R rows of CountMessageWords(E); rank `me`'s
// row is `mine`) and mismatch[r] is set for a peer whose message had another length: a different
// num_experts (InvalidArgument; where the lengths agree, both E at most 32, the E in the header
// tells), this rank's own error, a peer's rejected routing (RemoteError),
// else the handle filled with counts, tokens, capacities and source offsets.
absl::Status FinishCountExchange(const absl::Status& local, absl::Span<const int64_t> mine,
                                 absl::Span<const int64_t> all, absl::Span<const char> mismatch,
                                 int32_t me, int32_t num_ranks, int32_t num_experts,
                                 DispatchHandle* handle);

}  // namespace moonep::transport::common
