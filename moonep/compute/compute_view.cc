#include "moonep/compute/compute_view.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "moonep/core/host_memory.h"
#include "moonep/core/status.h"

namespace moonep::compute {
namespace {

constexpr size_t kAlign = 64;

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

const char* const kParamNames[3] = {"gate", "up", "down"};

const TensorView& Param(const ExpertParams& p, int which) {
  return which == 0 ? p.gate : (which == 1 ? p.up : p.down);
}

// The first tensor that fixes H, I, dtype and device for BuildComputeView.
const ExpertParams* FirstParams(const planner::Plan& plan, int32_t rank,
                                absl::Span<const ExpertParams> local,
                                absl::Span<const ExpertParams> replica) {
  if (!local.empty()) return &local[0];
  for (int32_t s = 0; s < plan.slots && s < static_cast<int32_t>(replica.size()); ++s) {
    if (plan.slot_expert[static_cast<size_t>(rank) * plan.slots + s] >= 0) return &replica[s];
  }
  return nullptr;
}

}  // namespace

size_t SpanBytes(const TensorView& t) {
  if (t.ndim != 2 || t.shape[0] <= 0 || t.shape[1] <= 0) return 0;
  return static_cast<size_t>((t.shape[0] - 1) * t.strides[0] + t.shape[1]) * DTypeSize(t.dtype);
}

namespace {

// A 2-D view as byte ranges: rows ranges of `width` bytes, the first at `base`, `stride` apart.
struct ByteRows {
  int64_t base = 0, rows = 0, stride = 0, width = 0;
};

bool AsByteRows(const TensorView& t, ByteRows* out) {
  if (t.ndim != 2 || t.strides[1] != 1 || t.strides[0] < 0) return false;
  const int64_t e = static_cast<int64_t>(DTypeSize(t.dtype));
  *out = ByteRows{static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data)), t.shape[0],
                  t.strides[0] * e, t.shape[1] * e};
  return true;
}

int64_t FloorDiv(int64_t a, int64_t b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// Rows of `a` and `b` sharing a byte, both rows `stride` bytes apart (stride > 0). Row i of a is
// [i S, i S + wa), row j of b is [d + j S, d + j S + wb) with d = b.base - a.base; they meet iff
// k = i - j satisfies d - wa < k S < d + wb, with k in [-(nb - 1), na - 1].
bool SameStrideOverlap(const ByteRows& a, const ByteRows& b, int64_t stride) {
  const int64_t d = b.base - a.base;
  const int64_t k_lo = std::max(FloorDiv(d - a.width, stride) + 1, -(b.rows - 1));
  const int64_t k_hi = std::min(-FloorDiv(-(d + b.width), stride) - 1, a.rows - 1);
  return k_lo <= k_hi;
}

bool ByteRowsOverlap(ByteRows a, ByteRows b) {
  if (a.rows <= 0 || b.rows <= 0 || a.width <= 0 || b.width <= 0) return false;
  // Bounding spans first: disjoint spans (the usual case) cost nothing more.
  const int64_t a_end = a.base + (a.rows - 1) * a.stride + a.width;
  const int64_t b_end = b.base + (b.rows - 1) * b.stride + b.width;
  if (a.base >= b_end || b.base >= a_end) return false;
  if (a.rows == 1) a.stride = b.stride;
  if (b.rows == 1) b.stride = a.stride;
  if (a.stride == b.stride) {
    if (a.stride <= 0) return true;  // rows on top of each other, spans meet
    return SameStrideOverlap(a, b, a.stride);
  }
  // Different strides: each row of the view with fewer rows against the other, O(1) each.
  if (a.rows > b.rows) std::swap(a, b);
  for (int64_t r = 0; r < a.rows; ++r) {
    const ByteRows one{a.base + r * a.stride, 1, b.stride, a.width};
    if (b.stride <= 0 ? RangesOverlap(reinterpret_cast<void*>(one.base), one.width,
                                      reinterpret_cast<void*>(b.base), b.width)
                      : SameStrideOverlap(one, b, b.stride)) {
      return true;
    }
  }
  return false;
}

}  // namespace

bool TensorsOverlap(const TensorView& a, const TensorView& b) {
  if (a.data == nullptr || b.data == nullptr || a.numel() <= 0 || b.numel() <= 0) return false;
  ByteRows ra, rb;
  if (AsByteRows(a, &ra) && AsByteRows(b, &rb)) return ByteRowsOverlap(ra, rb);
  // Other layouts: the whole span from the first element to one past the last (a negative stride
  // counts as overlapping anything, which no parameter check lets through anyway).
  auto span = [](const TensorView& t, size_t* bytes) {
    int64_t last = 0;
    for (int d = 0; d < t.ndim; ++d) {
      if (t.strides[d] < 0) return false;
      last += (t.shape[d] - 1) * t.strides[d];
    }
    *bytes = static_cast<size_t>(last + 1) * DTypeSize(t.dtype);
    return true;
  };
  size_t sa = 0, sb = 0;
  if (!span(a, &sa) || !span(b, &sb)) return true;
  return RangesOverlap(a.data, sa, b.data, sb);
}

absl::Status CheckParamMatrix(const TensorView& t, const char* what, int32_t group, int64_t rows,
                              int64_t cols, DType dtype, Device device) {
  if (t.ndim != 2 || t.shape[0] != rows || t.shape[1] != cols) {
    return InvalidArgument("group %d %s: expected shape [%d, %d], got %s", group, what, rows, cols,
                           t.DebugString());
  }
  if (t.dtype != dtype) {
    return InvalidArgument("group %d %s: expected dtype %s, got %s", group, what, DTypeName(dtype),
                           DTypeName(t.dtype));
  }
  if (t.device != device) {
    return InvalidArgument("group %d %s: on the wrong device (%s)", group, what, t.DebugString());
  }
  if (t.strides[1] != 1 || t.strides[0] < cols) {
    return InvalidArgument("group %d %s: needs unit column stride and row stride >= %d, got "
                           "strides [%d, %d]", group, what, cols, t.strides[0], t.strides[1]);
  }
  if (t.data == nullptr) return InvalidArgument("group %d %s: null data pointer", group, what);
  if (reinterpret_cast<uintptr_t>(t.data) % DTypeSize(dtype) != 0) {
    return InvalidArgument("group %d %s: data pointer %p is not aligned to its element size",
                           group, what, t.data);
  }
  return absl::OkStatus();
}

absl::Status CheckComputeView(const ComputeView& view, bool need_grads) {
  const int64_t H = view.hidden, I = view.intermediate;
  MOONEP_CHECK_ARG(H > 0 && I > 0, "view: hidden (%d) and intermediate (%d) must be positive", H, I);
  MOONEP_CHECK_ARG(view.dtype == DType::kFloat32 || view.dtype == DType::kBFloat16,
                   "view: invalid dtype %d", static_cast<int>(view.dtype));
  MOONEP_CHECK_ARG(view.total_rows >= 0, "view: total_rows %d is negative", view.total_rows);
  const int32_t G = static_cast<int32_t>(view.groups.size());
  for (int32_t g = 0; g < G; ++g) {
    const GroupView& gv = view.groups[g];
    MOONEP_CHECK_ARG(gv.row_offset >= 0 && gv.row_count >= 0 && gv.padded_count >= gv.row_count,
                     "group %d: bad row segment (offset %d, count %d, padded %d)", g,
                     gv.row_offset, gv.row_count, gv.padded_count);
    // offset + padded <= total_rows, in a form that cannot overflow.
    MOONEP_CHECK_ARG(gv.padded_count <= view.total_rows &&
                         gv.row_offset <= view.total_rows - gv.padded_count,
                     "group %d: rows [%d, %d + %d) run past total_rows %d", g, gv.row_offset,
                     gv.row_offset, gv.padded_count, view.total_rows);
    if (gv.row_count == 0) continue;  // empty groups are never read: their tensors may be empty
    for (int p = 0; p < 3; ++p) {
      const int64_t rows = p == 2 ? I : H, cols = p == 2 ? H : I;
      MOONEP_RETURN_IF_ERROR(CheckParamMatrix(Param(gv.weights, p), kParamNames[p], g, rows, cols,
                                              view.dtype, view.device));
      if (!need_grads) continue;
      const TensorView& grad = Param(gv.grads, p);
      const DType gd = grad.dtype == DType::kFloat32 ? DType::kFloat32 : view.dtype;
      static const char* const kGradNames[3] = {"grad gate", "grad up", "grad down"};
      MOONEP_RETURN_IF_ERROR(CheckParamMatrix(grad, kGradNames[p], g, rows, cols, gd, view.device));
    }
  }
  // Row segments must not overlap (each row belongs to one group). Quadratic in G, but G is tens
  // to a few hundred and this avoids allocating a sort buffer on every call.
  for (int32_t a = 0; a < G; ++a) {
    const GroupView& ga = view.groups[a];
    if (ga.padded_count == 0) continue;
    for (int32_t b = a + 1; b < G; ++b) {
      const GroupView& gb = view.groups[b];
      if (gb.padded_count == 0) continue;
      // a.offset < b.offset + b.padded and b.offset < a.offset + a.padded (offsets >= 0: no
      // difference overflows).
      if (ga.row_offset - gb.row_offset < gb.padded_count &&
          gb.row_offset - ga.row_offset < ga.padded_count) {
        return InvalidArgument("groups %d and %d: row segments overlap", a, b);
      }
    }
  }
  if (!need_grads) return absl::OkStatus();
  // Gradients are written concurrently per group: two gradient tensors sharing an element would
  // race. Element-exact, so gate and up gradients interleaved in one fused [H, 2I] tensor pass.
  for (int32_t a = 0; a < G; ++a) {
    if (view.groups[a].row_count == 0) continue;
    for (int pa = 0; pa < 3; ++pa) {
      const TensorView& ta = Param(view.groups[a].grads, pa);
      for (int32_t b = a; b < G; ++b) {
        if (view.groups[b].row_count == 0) continue;
        for (int pb = (b == a ? pa + 1 : 0); pb < 3; ++pb) {
          const TensorView& tb = Param(view.groups[b].grads, pb);
          if (TensorsOverlap(ta, tb)) {
            return InvalidArgument("group %d grad %s overlaps group %d grad %s", a,
                                   kParamNames[pa], b, kParamNames[pb]);
          }
        }
      }
      // Any group's weights, not only its own: every group's weights are read while this
      // gradient is written.
      for (int32_t b = 0; b < G; ++b) {
        if (view.groups[b].row_count == 0) continue;
        for (int p = 0; p < 3; ++p) {
          if (!TensorsOverlap(ta, Param(view.groups[b].weights, p))) continue;
          if (b == a) {
            return InvalidArgument("group %d grad %s overlaps its weight %s", a, kParamNames[pa],
                                   kParamNames[p]);
          }
          return InvalidArgument("group %d grad %s overlaps group %d weight %s", a,
                                 kParamNames[pa], b, kParamNames[p]);
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status BuildComputeView(const planner::Plan& plan, int32_t rank,
                              absl::Span<const ExpertParams> local_weights,
                              absl::Span<const ExpertParams> local_grads,
                              absl::Span<const ExpertParams> replica_weights,
                              absl::Span<const ExpertParams> replica_grads, ComputeView* view) {
  MOONEP_CHECK_ARG(view != nullptr, "view: null pointer");
  MOONEP_CHECK_ARG(rank >= 0 && rank < plan.num_ranks, "rank %d is outside [0, %d)", rank,
                   plan.num_ranks);
  const int32_t epn = plan.experts_per_rank, slots = plan.slots, G = plan.num_groups();
  const size_t base = static_cast<size_t>(rank) * G;
  MOONEP_CHECK_ARG(epn >= 0 && slots >= 0 && plan.group_offset.size() >= base + G &&
                       plan.group_count.size() >= base + G &&
                       plan.group_padded.size() >= base + G &&
                       plan.rank_rows.size() > static_cast<size_t>(rank) &&
                       plan.local_experts.size() >= static_cast<size_t>(rank + 1) * epn &&
                       plan.slot_expert.size() >= static_cast<size_t>(rank + 1) * slots,
                   "plan: layout arrays are not sized for rank %d (was the plan finalized?)", rank);
  MOONEP_CHECK_ARG(static_cast<int32_t>(local_weights.size()) == epn,
                   "local_weights: has %d entries, the plan has %d home experts per rank",
                   local_weights.size(), epn);
  MOONEP_CHECK_ARG(local_grads.empty() || static_cast<int32_t>(local_grads.size()) == epn,
                   "local_grads: has %d entries, need 0 (forward only) or %d",
                   local_grads.size(), epn);
  MOONEP_CHECK_ARG(static_cast<int32_t>(replica_weights.size()) == slots,
                   "replica_weights: has %d entries, the plan has %d slots per rank",
                   replica_weights.size(), slots);
  MOONEP_CHECK_ARG(replica_grads.empty() || static_cast<int32_t>(replica_grads.size()) == slots,
                   "replica_grads: has %d entries, need 0 (forward only) or %d",
                   replica_grads.size(), slots);

  const ExpertParams* first = FirstParams(plan, rank, local_weights, replica_weights);
  view->groups.resize(G);
  view->total_rows = plan.rank_rows[rank];
  if (first != nullptr) {
    view->hidden = first->gate.ndim == 2 ? first->gate.shape[0] : 0;
    view->intermediate = first->gate.ndim == 2 ? first->gate.shape[1] : 0;
    view->dtype = first->gate.dtype;
    view->device = first->gate.device;
  }
  for (int32_t g = 0; g < G; ++g) {
    GroupView& gv = view->groups[g];
    gv.row_offset = plan.group_offset[base + g];
    gv.row_count = plan.group_count[base + g];
    gv.padded_count = plan.group_padded[base + g];
    gv.replica = g >= epn;
    if (!gv.replica) {
      gv.expert = plan.local_experts[static_cast<size_t>(rank) * epn + g];
      gv.weights = local_weights[g];
      gv.grads = local_grads.empty() ? ExpertParams{} : local_grads[g];
    } else {
      const int32_t s = g - epn;
      gv.expert = plan.slot_expert[static_cast<size_t>(rank) * slots + s];
      if (gv.expert < 0) {
        MOONEP_CHECK_ARG(gv.row_count == 0, "plan: unused slot %d of rank %d has %d rows", s, rank,
                         gv.row_count);
        gv.weights = ExpertParams{};
        gv.grads = ExpertParams{};
      } else {
        gv.weights = replica_weights[s];
        gv.grads = replica_grads.empty() ? ExpertParams{} : replica_grads[s];
      }
    }
  }
  // Home groups always get their tensors checked (they are the caller's parameters, and an empty
  // home group this step holds rows the next); replica slots only when in use.
  if (first == nullptr) {
    return InvalidArgument("local_weights: no weights to take the shape from");
  }
  for (int32_t g = 0; g < G; ++g) {
    const GroupView& gv = view->groups[g];
    if (gv.expert < 0) continue;
    const char* list = gv.replica ? "replica_weights" : "local_weights";
    for (int p = 0; p < 3; ++p) {
      const int64_t rows = p == 2 ? view->intermediate : view->hidden;
      const int64_t cols = p == 2 ? view->hidden : view->intermediate;
      absl::Status st = CheckParamMatrix(Param(gv.weights, p), kParamNames[p], g, rows, cols,
                                         view->dtype, view->device);
      if (!st.ok()) return Annotate(st, list);
      const bool has_grads = gv.replica ? !replica_grads.empty() : !local_grads.empty();
      if (!has_grads) continue;
      const TensorView& grad = Param(gv.grads, p);
      const DType gd = grad.dtype == DType::kFloat32 ? DType::kFloat32 : view->dtype;
      st = CheckParamMatrix(grad, kParamNames[p], g, rows, cols, gd, view->device);
      if (!st.ok()) return Annotate(st, gv.replica ? "replica_grads" : "local_grads");
    }
  }
  return CheckComputeView(*view, /*need_grads=*/false);
}

// ----------------------------------------------------------------------------------------------
// ReplicaBuffer

namespace {

// Bytes of `slots` blocks of 3 * H * I elements of `dtype`, rounded up to kAlign; false when they
// (or one block) do not fit in size_t.
bool SlotsBytes(int32_t slots, int64_t hidden, int64_t intermediate, DType dtype, size_t* bytes) {
  size_t block = 0, all = 0;
  if (slots < 0 || hidden < 0 || intermediate < 0 ||
      __builtin_mul_overflow(static_cast<size_t>(hidden), static_cast<size_t>(intermediate), &block) ||
      __builtin_mul_overflow(block, 3 * DTypeSize(dtype), &block) ||
      __builtin_mul_overflow(block, static_cast<size_t>(slots), &all) || all > SIZE_MAX - kAlign) {
    return false;
  }
  *bytes = RoundUp(all, kAlign);
  return true;
}

}  // namespace

size_t ReplicaBuffer::BytesFor(int32_t slots, int64_t hidden, int64_t intermediate, DType dtype,
                               DType grad_dtype) {
  size_t weights = 0, grads = 0;
  if (!SlotsBytes(slots, hidden, intermediate, dtype, &weights) ||
      !SlotsBytes(slots, hidden, intermediate, grad_dtype, &grads) || weights > SIZE_MAX - grads) {
    return SIZE_MAX;
  }
  return weights + grads;
}

absl::StatusOr<std::unique_ptr<ReplicaBuffer>> ReplicaBuffer::Create(
    int32_t slots, int64_t hidden, int64_t intermediate, DType dtype, DType grad_dtype,
    const BufferAllocator* allocator) {
  MOONEP_CHECK_ARG(slots >= 0, "slots: %d is negative", slots);
  MOONEP_CHECK_ARG(hidden > 0 && intermediate > 0,
                   "hidden (%d) and intermediate (%d) must be positive", hidden, intermediate);
  MOONEP_CHECK_ARG(IsValidDType(static_cast<int32_t>(dtype)), "dtype: invalid value %d",
                   static_cast<int>(dtype));
  MOONEP_CHECK_ARG(grad_dtype == DType::kFloat32 || grad_dtype == dtype,
                   "grad_dtype: must be fp32 or the weight dtype (%s), got %s", DTypeName(dtype),
                   DTypeName(grad_dtype));
  // One slot's blocks are checked too (slot_weight_bytes() and the views multiply them out).
  const size_t bytes = BytesFor(std::max(slots, 1), hidden, intermediate, dtype, grad_dtype);
  MOONEP_CHECK_ARG(bytes != SIZE_MAX,
                   "ReplicaBuffer: %d slots of 3 x hidden (%d) x intermediate (%d) elements (%s "
                   "weights, %s gradients) do not fit in size_t", slots, hidden, intermediate,
                   DTypeName(dtype), DTypeName(grad_dtype));
  std::unique_ptr<ReplicaBuffer> buf(new ReplicaBuffer());
  buf->slots_ = slots;
  buf->hidden_ = hidden;
  buf->intermediate_ = intermediate;
  buf->dtype_ = dtype;
  buf->grad_dtype_ = grad_dtype;
  buf->bytes_ = BytesFor(slots, hidden, intermediate, dtype, grad_dtype);
  buf->grad_base_ = RoundUp(buf->slot_weight_bytes() * slots, kAlign);
  buf->allocator_ = allocator;
  if (buf->bytes_ > 0) {
    // Host memory is zero-filled below: refused up front where the node cannot back it (the
    // out-of-memory killer would end the process during the fill).
    if (allocator == nullptr) {
      MOONEP_RETURN_IF_ERROR(CheckHostAllocation(buf->bytes_, "the replica buffer"));
    }
    void* mem = allocator ? allocator->allocate(buf->bytes_) : std::aligned_alloc(kAlign, buf->bytes_);
    if (mem == nullptr) {
      return OutOfMemory("ReplicaBuffer: cannot allocate %d bytes for %d slots", buf->bytes_, slots);
    }
    if (allocator == nullptr) std::memset(mem, 0, buf->bytes_);
    buf->storage_ = std::unique_ptr<char, void (*)(void*)>(static_cast<char*>(mem),
                                                          allocator ? allocator->release : std::free);
  }
  const Device device = allocator ? allocator->device : Device::kCpu;
  const int64_t H = hidden, I = intermediate;
  buf->weights_.resize(slots);
  buf->grads_.resize(slots);
  for (int32_t s = 0; s < slots; ++s) {
    for (int kind = 0; kind < 2; ++kind) {
      const DType dt = kind == 0 ? dtype : grad_dtype;
      char* block = static_cast<char*>(kind == 0 ? buf->slot_weights(s) : buf->slot_grads(s));
      const size_t part = static_cast<size_t>(H * I) * DTypeSize(dt);
      ExpertParams& p = kind == 0 ? buf->weights_[s] : buf->grads_[s];
      p.gate = TensorView::Contiguous(block, dt, {H, I}, device);
      p.up = TensorView::Contiguous(block + part, dt, {H, I}, device);
      p.down = TensorView::Contiguous(block + 2 * part, dt, {I, H}, device);
    }
  }
  return buf;
}

void* ReplicaBuffer::slot_weights(int32_t s) const {
  return storage_.get() + static_cast<size_t>(s) * slot_weight_bytes();
}

void* ReplicaBuffer::slot_grads(int32_t s) const {
  return storage_.get() + grad_base_ + static_cast<size_t>(s) * slot_grad_bytes();
}

void ReplicaBuffer::ZeroGrads() {
  if (slots_ == 0) return;
  if (allocator_ != nullptr) {
    allocator_->zero(slot_grads(0), slot_grad_bytes() * slots_);
  } else {
    std::memset(slot_grads(0), 0, slot_grad_bytes() * slots_);
  }
}

}  // namespace moonep::compute
