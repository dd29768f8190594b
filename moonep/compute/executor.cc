#include "moonep/compute/executor.h"

#include "moonep/core/status.h"

namespace moonep::compute {
namespace {

// Bytes of a rows tensor; an empty (absent) tensor spans none.
size_t Bytes(const TensorView& t) { return t.data == nullptr ? 0 : t.nbytes(); }

absl::Status CheckViewAgainstConfig(const ExecutorConfig& config, Device device,
                                    const ComputeView& view, bool need_grads) {
  MOONEP_CHECK_ARG(view.hidden == config.hidden && view.intermediate == config.intermediate,
                   "view: shape H=%d I=%d does not match the executor's H=%d I=%d", view.hidden,
                   view.intermediate, config.hidden, config.intermediate);
  MOONEP_CHECK_ARG(view.dtype == config.dtype, "view: dtype %s does not match the executor's %s",
                   DTypeName(view.dtype), DTypeName(config.dtype));
  MOONEP_CHECK_ARG(view.device == device, "view: device %d does not match the executor's %d",
                   static_cast<int>(view.device), static_cast<int>(device));
  MOONEP_CHECK_ARG(view.total_rows <= config.max_rows,
                   "view: total_rows %d exceeds the executor's max_rows %d", view.total_rows,
                   config.max_rows);
  return CheckComputeView(view, need_grads);
}

absl::Status CheckRows(const TensorView& t, const char* name, const ComputeView& view) {
  return CheckMatrix(t, name, view.total_rows, view.hidden, view.dtype, view.device);
}

absl::Status CheckPreactivations(const TensorView& t, const char* name, const ComputeView& view) {
  if (t.data == nullptr && t.ndim == 0) return absl::OkStatus();
  return CheckMatrix(t, name, view.total_rows, 2 * view.intermediate, DType::kFloat32,
                     view.device);
}

// An output must not share bytes with any input or other output.
absl::Status CheckDisjoint(const TensorView& out, const char* out_name, const TensorView& other,
                           const char* other_name) {
  if (RangesOverlap(out.data, Bytes(out), other.data, Bytes(other))) {
    return InvalidArgument("%s overlaps %s", out_name, other_name);
  }
  return absl::OkStatus();
}

// Outputs against every group's parameters (weights always; gradients as well for backward).
absl::Status CheckDisjointFromParams(const TensorView& out, const char* out_name,
                                     const ComputeView& view, bool grads) {
  for (size_t g = 0; g < view.groups.size(); ++g) {
    const GroupView& gv = view.groups[g];
    if (gv.row_count == 0) continue;
    const ExpertParams* sets[2] = {&gv.weights, &gv.grads};
    for (int k = 0; k < (grads ? 2 : 1); ++k) {
      for (const TensorView* t : {&sets[k]->gate, &sets[k]->up, &sets[k]->down}) {
        if (TensorsOverlap(out, *t)) {
          return InvalidArgument("%s overlaps the %s of group %d", out_name,
                                 k == 0 ? "weights" : "gradients", static_cast<int>(g));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckExecutorConfig(const ExecutorConfig& config) {
  MOONEP_CHECK_ARG(config.hidden > 0 && config.intermediate > 0,
                   "config: hidden (%d) and intermediate (%d) must be positive", config.hidden,
                   config.intermediate);
  MOONEP_CHECK_ARG(config.dtype == DType::kFloat32 || config.dtype == DType::kBFloat16,
                   "config: invalid dtype %d", static_cast<int>(config.dtype));
  MOONEP_CHECK_ARG(config.max_rows >= 0, "config: max_rows %d is negative", config.max_rows);
  MOONEP_CHECK_ARG(config.num_threads >= 0 && config.num_threads <= kMaxExecutorThreads,
                   "config: num_threads %d is outside [0, %d] (0: MOONEP_NUM_THREADS, else every "
                   "core)", config.num_threads, kMaxExecutorThreads);
  return absl::OkStatus();
}

absl::Status CheckForwardArgs(const ExecutorConfig& config, Device device, const ComputeView& view,
                              const TensorView& x_rows, const TensorView& y_rows,
                              const ForwardOptions& options) {
  MOONEP_RETURN_IF_ERROR(CheckViewAgainstConfig(config, device, view, /*need_grads=*/false));
  MOONEP_RETURN_IF_ERROR(CheckRows(x_rows, "x_rows", view));
  MOONEP_RETURN_IF_ERROR(CheckRows(y_rows, "y_rows", view));
  const TensorView& pre = options.preactivations;
  MOONEP_RETURN_IF_ERROR(CheckPreactivations(pre, "options.preactivations", view));
  MOONEP_RETURN_IF_ERROR(CheckDisjoint(y_rows, "y_rows", x_rows, "x_rows"));
  MOONEP_RETURN_IF_ERROR(CheckDisjoint(pre, "options.preactivations", x_rows, "x_rows"));
  MOONEP_RETURN_IF_ERROR(CheckDisjoint(pre, "options.preactivations", y_rows, "y_rows"));
  MOONEP_RETURN_IF_ERROR(CheckDisjointFromParams(y_rows, "y_rows", view, false));
  return CheckDisjointFromParams(pre, "options.preactivations", view, false);
}

absl::Status CheckBackwardArgs(const ExecutorConfig& config, Device device,
                               const ComputeView& view, const TensorView& x_rows,
                               const TensorView& dy_rows, const TensorView& dx_rows,
                               const BackwardOptions& options) {
  MOONEP_RETURN_IF_ERROR(CheckViewAgainstConfig(config, device, view, /*need_grads=*/true));
  MOONEP_RETURN_IF_ERROR(CheckRows(x_rows, "x_rows", view));
  MOONEP_RETURN_IF_ERROR(CheckRows(dy_rows, "dy_rows", view));
  MOONEP_RETURN_IF_ERROR(CheckRows(dx_rows, "dx_rows", view));
  const TensorView& pre = options.preactivations;
  MOONEP_RETURN_IF_ERROR(CheckPreactivations(pre, "options.preactivations", view));
  MOONEP_RETURN_IF_ERROR(CheckDisjoint(dx_rows, "dx_rows", x_rows, "x_rows"));
  MOONEP_RETURN_IF_ERROR(CheckDisjoint(dx_rows, "dx_rows", dy_rows, "dy_rows"));
  MOONEP_RETURN_IF_ERROR(CheckDisjoint(dx_rows, "dx_rows", pre, "options.preactivations"));
  MOONEP_RETURN_IF_ERROR(CheckDisjointFromParams(dx_rows, "dx_rows", view, true));
  // Gradients are outputs too: they must not alias the row buffers.
  for (size_t g = 0; g < view.groups.size(); ++g) {
    const GroupView& gv = view.groups[g];
    if (gv.row_count == 0) continue;
    for (const TensorView* t : {&gv.grads.gate, &gv.grads.up, &gv.grads.down}) {
      for (const auto& [buf, name] : {std::pair<const TensorView*, const char*>{&x_rows, "x_rows"},
                                      {&dy_rows, "dy_rows"},
                                      {&pre, "options.preactivations"}}) {
        if (TensorsOverlap(*t, *buf)) {
          return InvalidArgument("the gradients of group %d overlap %s", static_cast<int>(g),
                                 name);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace moonep::compute
