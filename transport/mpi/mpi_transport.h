// The MPI backend: host memory, point-to-point messages with derived datatypes so rows land at
// their final rows (no permutation pass). See docs/transport.md.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace moonep::transport::mpi {

// Collective over options.comm (it is duplicated: one communicator for row operations, one for
// weight operations, one for abort notices).
absl::StatusOr<std::unique_ptr<Transport>> CreateMpiTransport(const TransportOptions& options);

}  // namespace moonep::transport::mpi
