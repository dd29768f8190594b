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

}  // namespace moonep::transport::ucx
