// Helpers shared by the C API translation units: the per-thread last error and the conversion of
// absl::Status into moonepResult_t. No exception may cross the C boundary.
#pragma once

#include <cstring>
#include <exception>
#include <string>

#include "moonep/core/status.h"
#include "moonep/moonep.h"

namespace moonep::capi {

// Records `status` as this thread's last error and returns its C result.
moonepResult_t Report(const absl::Status& status);
void ClearLastError();

// Runs `body` (returning absl::Status), catching any exception as an internal error.
template <typename Body>
moonepResult_t Guard(const char* function, Body&& body) {
  ClearLastError();
  try {
    absl::Status status = body();
    if (status.ok()) return moonepSuccess;
    return Report(Annotate(status, function));
  } catch (const std::bad_alloc&) {
    return Report(OutOfMemory("%s: out of host memory", function));
  } catch (const std::exception& e) {
    return Report(Internal("%s: unexpected exception: %s", function, e.what()));
  } catch (...) {
    return Report(Internal("%s: unexpected exception", function));
  }
}

// The integer stored in a C enum field, read without assuming it is a valid enumerator (a caller
// may pass any int there; loading it as the enum type would be undefined behaviour).
template <typename Enum>
int RawEnum(const Enum& field) {
  static_assert(sizeof(Enum) == sizeof(int), "C enums are int-sized here");
  int value;
  std::memcpy(&value, &field, sizeof(value));
  return value;
}

// The error of a collective call that its caller refuses (moonepLayerRefuseForward,
// moonepEpRefuseDispatch): InvalidArgument giving `reason`, of which at most kMaxReasonBytes are
// read (a C string the caller forgot to end is not read past that); NULL: "no reason given".
constexpr size_t kMaxReasonBytes = 1024;
inline absl::Status CallerRefusal(const char* reason) {
  const std::string text =
      reason == nullptr ? std::string() : std::string(reason, strnlen(reason, kMaxReasonBytes));
  return InvalidArgument("refused by the caller: %s", text.empty() ? "(no reason given)" : text);
}

}  // namespace moonep::capi
