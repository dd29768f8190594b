// Test-only fault injection: a rank that "never joins" an operation. The transport asks
// ShouldSkip at the start of every operation; a skipping rank returns a completed request without
// sending or receiving anything, so its peers see a silent rank and must time out.
#pragma once

#include <cstdint>

#include "transport/transport.h"

namespace moonep::transport::testing {

// From now on, rank `rank` of any transport skips every operation of `kind` (one rule at a time).
void SetSkipRank(int32_t rank, OpKind kind);
void ClearSkip();
bool ShouldSkip(int32_t rank, OpKind kind);

}  // namespace moonep::transport::testing
