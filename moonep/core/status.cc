#include "moonep/core/status.h"

#include <string>

namespace moonep {
namespace {
constexpr char kResultPayload[] = "moonep.result";
}

absl::Status MakeStatus(moonepResult_t result, absl::string_view message) {
  absl::StatusCode code = absl::StatusCode::kUnknown;
  switch (result) {
    case moonepSuccess: return absl::OkStatus();
    case moonepInvalidArgument: code = absl::StatusCode::kInvalidArgument; break;
    case moonepInvalidUsage: code = absl::StatusCode::kFailedPrecondition; break;
    case moonepSystemError: code = absl::StatusCode::kUnknown; break;
    case moonepInternalError: code = absl::StatusCode::kInternal; break;
    case moonepRemoteError: code = absl::StatusCode::kAborted; break;
    case moonepTimeout: code = absl::StatusCode::kDeadlineExceeded; break;
    case moonepInProgress: code = absl::StatusCode::kUnavailable; break;
    case moonepOutOfMemory: code = absl::StatusCode::kResourceExhausted; break;
    case moonepUnavailable: code = absl::StatusCode::kUnimplemented; break;
    case moonepCudaError: code = absl::StatusCode::kInternal; break;
    default: code = absl::StatusCode::kInternal; break;
  }
  absl::Status status(code, message);
  status.SetPayload(kResultPayload, absl::Cord(std::to_string(static_cast<int>(result))));
  return status;
}

moonepResult_t ToResult(const absl::Status& status) {
  if (status.ok()) return moonepSuccess;
  if (auto payload = status.GetPayload(kResultPayload)) {
    int value = std::stoi(std::string(*payload));
    if (value > 0 && value < moonepNumResults) return static_cast<moonepResult_t>(value);
  }
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
      return moonepInvalidArgument;
    case absl::StatusCode::kFailedPrecondition: return moonepInvalidUsage;
    case absl::StatusCode::kDeadlineExceeded: return moonepTimeout;
    case absl::StatusCode::kAborted: return moonepRemoteError;
    case absl::StatusCode::kResourceExhausted: return moonepOutOfMemory;
    case absl::StatusCode::kUnimplemented: return moonepUnavailable;
    case absl::StatusCode::kUnavailable: return moonepInProgress;
    case absl::StatusCode::kInternal: return moonepInternalError;
    default: return moonepSystemError;
  }
}

namespace {
// `status` with `message` instead of its own: same code and payloads.
absl::Status WithMessage(const absl::Status& status, absl::string_view message) {
  absl::Status rewritten(status.code(), message);
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    rewritten.SetPayload(url, payload);
  });
  return rewritten;
}
}  // namespace

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return WithMessage(status, absl::StrCat(context, ": ", status.message()));
}

absl::Status AppendNote(const absl::Status& status, absl::string_view note) {
  if (status.ok() || note.empty()) return status;
  return WithMessage(status, absl::StrCat(status.message(), "; ", note));
}

}  // namespace moonep
