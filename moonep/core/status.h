// Status handling: absl::Status everywhere inside MoonEP, converted to moonepResult_t only at the
// C API edge. A status may carry the exact C result code as a payload, for codes absl has no
// equivalent for (remote error, CUDA error).
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "moonep/moonep.h"

namespace moonep {

// A status whose C result is `result` exactly.
absl::Status MakeStatus(moonepResult_t result, absl::string_view message);

// The C result for a status: the payload if present, else a mapping of the absl code.
moonepResult_t ToResult(const absl::Status& status);

template <typename... Args>
absl::Status InvalidArgument(const absl::FormatSpec<Args...>& format, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrFormat(format, args...));
}
template <typename... Args>
absl::Status InvalidUsage(const absl::FormatSpec<Args...>& format, const Args&... args) {
  return absl::FailedPreconditionError(absl::StrFormat(format, args...));
}
template <typename... Args>
absl::Status Internal(const absl::FormatSpec<Args...>& format, const Args&... args) {
  return absl::InternalError(absl::StrFormat(format, args...));
}
template <typename... Args>
absl::Status Timeout(const absl::FormatSpec<Args...>& format, const Args&... args) {
  return absl::DeadlineExceededError(absl::StrFormat(format, args...));
}
template <typename... Args>
absl::Status RemoteError(const absl::FormatSpec<Args...>& format, const Args&... args) {
  return MakeStatus(moonepRemoteError, absl::StrFormat(format, args...));
}
template <typename... Args>
absl::Status SystemError(const absl::FormatSpec<Args...>& format, const Args&... args) {
  return MakeStatus(moonepSystemError, absl::StrFormat(format, args...));
}
template <typename... Args>
absl::Status OutOfMemory(const absl::FormatSpec<Args...>& format, const Args&... args) {
  return absl::ResourceExhaustedError(absl::StrFormat(format, args...));
}
template <typename... Args>
absl::Status Unavailable(const absl::FormatSpec<Args...>& format, const Args&... args) {
  return absl::UnimplementedError(absl::StrFormat(format, args...));
}

// Prefixes a status message with context, keeping code and payload.
absl::Status Annotate(const absl::Status& status, absl::string_view context);
// Appends "; note" to a status message (nothing for an empty note), keeping code and payload.
absl::Status AppendNote(const absl::Status& status, absl::string_view note);

}  // namespace moonep

#define MOONEP_CONCAT_INNER_(a, b) a##b
#define MOONEP_CONCAT_(a, b) MOONEP_CONCAT_INNER_(a, b)

#define MOONEP_RETURN_IF_ERROR(expr)                  \
  do {                                                \
    ::absl::Status moonep_status_ = (expr);           \
    if (!moonep_status_.ok()) return moonep_status_;  \
  } while (0)

#define MOONEP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(*tmp)

#define MOONEP_ASSIGN_OR_RETURN(lhs, expr) \
  MOONEP_ASSIGN_OR_RETURN_IMPL_(MOONEP_CONCAT_(moonep_statusor_, __LINE__), lhs, expr)

// Argument checks that return InvalidArgument naming the condition.
#define MOONEP_CHECK_ARG(cond, ...)                                                   \
  do {                                                                                \
    if (!(cond)) return ::moonep::InvalidArgument(__VA_ARGS__);                        \
  } while (0)
