// Force-included (-include) into tests/transport/transport_test.cc for the nccl_suite_test binary:
// the host-memory suite, unchanged, runs over the NCCL transport through HostStagedTransport
// (host buffers copied to the GPU and back around each blocking NCCL operation). The backend list
// and the factory of that translation unit are redirected here; transport.h is included first so
// its own declarations keep their names.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace moonep::transport {
// {"nccl"}.
std::vector<std::string> NcclSuiteBackends();
// CreateTransport for "nccl": the NCCL transport behind a host-staging adapter.
absl::StatusOr<std::unique_ptr<Transport>> NcclSuiteCreateTransport(
    absl::string_view backend, const TransportOptions& options);
}  // namespace moonep::transport

#define AvailableBackends NcclSuiteBackends
#define CreateTransport NcclSuiteCreateTransport
