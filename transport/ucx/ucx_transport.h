// The UCX backend: one-sided puts into registered host memory. A receiver announces where rows go
// (its buffers' addresses and memory keys, keys sent once per peer), senders write every row
// straight to its final row with ucp_put_nbx, then, after a fence, a per-peer completion signal;
// the receiver only waits for signals. See docs/transport-ucx.md.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace moonep::transport::ucx {

// Collective over options.comm (duplicated; used for the bootstrap of worker addresses and the
// signal area's key, and for the barrier at destruction). UCX reads its own UCX_* environment
// (UCX_TLS, UCX_NET_DEVICES, ...).
absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options);
// MOONEP_UCX_EAGER_BYTES parsed strictly (InvalidArgument naming it when malformed or out of range).
absl::Status CheckUcxEnvironment();

// Memory registration of one UCX transport since its creation (the signal area not included).
struct RegistrationStats {
  int64_t regions_registered = 0;  // ucp_mem_map calls for receive buffers, staging and slots
  int64_t regions_evicted = 0;     // unregistered to keep the cache bounded
  int64_t regions_cached = 0;      // registered now
  int64_t keys_sent = 0;           // packed keys sent to peers (once per region and peer)
  int64_t keys_unpacked = 0;       // peers' keys unpacked here
};
// InvalidArgument when `transport` is not a UCX transport.
absl::StatusOr<RegistrationStats> GetRegistrationStats(const Transport& transport);

}  // namespace moonep::transport::ucx
