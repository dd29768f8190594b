#include "moonep/compute/cpu/cpu_executor.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>

#include "moonep/compute/cpu/activation.h"
#include "moonep/compute/cpu/gemm.h"
#include "moonep/core/env.h"
#include "moonep/core/host_memory.h"
#include "moonep/core/status.h"

namespace moonep::compute::cpu {
namespace {

constexpr size_t kAlignFloats = 16;  // 64 bytes

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

// a * b and a + b in size_t; *overflow is set when one wraps (sizes of a config past size_t).
size_t Mul(size_t a, size_t b, bool* overflow) {
  size_t v = 0;
  *overflow |= __builtin_mul_overflow(a, b, &v);
  return v;
}
size_t Add(size_t a, size_t b, bool* overflow) {
  size_t v = 0;
  *overflow |= __builtin_add_overflow(a, b, &v);
  return v;
}

// Per-thread scratch layout, in floats. `a` doubles as the output tile of F2/B2 (bf16 storage).
// `overflow`: the layout does not fit in size_t (its other fields are then meaningless).
struct ScratchLayout {
  int64_t rb = 0;
  size_t a = 0, b = 0, t = 0, x = 0, dy = 0, gemm = 0, tile = 0, total = 0;
  bool overflow = false;
};

// (H, I > 0 and max_rows >= 0: CheckExecutorConfig.)
ScratchLayout Layout(const ExecutorConfig& c) {
  ScratchLayout l;
  bool* of = &l.overflow;
  const int64_t H = c.hidden, I = c.intermediate, M = std::max(H, I);
  const int64_t tw = std::min(kWeightTile, M), tc = std::min(kColTile, M);
  l.rb = std::max<int64_t>(1, std::min(kRowBlock, c.max_rows));
  const size_t rbc = static_cast<size_t>(l.rb * tc);
  const size_t rbh = Mul(static_cast<size_t>(l.rb), static_cast<size_t>(H), of);
  l.a = 0;
  l.b = rbc;
  l.t = 2 * rbc;
  size_t end = 3 * rbc;
  if (c.dtype == DType::kBFloat16) {
    l.x = end;
    l.dy = Add(l.x, rbh, of);
    l.gemm = Add(l.dy, rbh, of);
    // B panel of the widest GEMM: M columns, or 2I for the fused gate|up GEMM (I <= kColTile).
    const int64_t widest = std::max(M, I <= kColTile ? 2 * I : 0);
    l.tile = Add(l.gemm, Mul(kPanelK, Add(static_cast<size_t>(tw), static_cast<size_t>(widest), of), of),
                 of);
    end = Add(l.tile, Mul(static_cast<size_t>(tw), static_cast<size_t>(M), of), of);
  }
  *of |= end > SIZE_MAX - kAlignFloats;
  l.total = RoundUp(end, kAlignFloats);
  return l;
}

size_t SharedFloats(const ExecutorConfig& c, bool* overflow) {
  const size_t n = Mul(3, Mul(static_cast<size_t>(c.max_rows), static_cast<size_t>(c.intermediate),
                              overflow), overflow);
  *overflow |= n > SIZE_MAX - kAlignFloats;
  return RoundUp(n, kAlignFloats);
}

// The workspace bytes: 4 * (threads * per-thread floats + shared floats) (the per-thread floats in
// *per_thread); false when they do not fit in size_t (with room to round them up to 64).
bool CheckedWorkspaceBytes(const ExecutorConfig& c, int threads, size_t* per_thread, size_t* bytes) {
  const ScratchLayout l = Layout(c);
  bool overflow = l.overflow;
  const size_t floats = Add(Mul(static_cast<size_t>(threads), l.total, &overflow),
                            SharedFloats(c, &overflow), &overflow);
  *per_thread = l.total;
  *bytes = Mul(sizeof(float), floats, &overflow);
  return !overflow && *bytes <= SIZE_MAX - 64;
}

// config.num_threads, else MOONEP_NUM_THREADS, else every core; at most kMaxExecutorThreads.
// MOONEP_NUM_THREADS is checked even when the config sets num_threads, as MOONEP_HOST_THREADS is
// by every transport: a negative or malformed value fails creation naming it (a negative value
// meant every core, and garbage the default, without a word).
absl::StatusOr<int> ResolveThreads(const ExecutorConfig& c) {
  const absl::StatusOr<int64_t>& env = param::CheckedNumThreads();
  MOONEP_RETURN_IF_ERROR(env.status());
  int64_t n = c.num_threads;
  if (n <= 0) n = *env;
  if (n <= 0) n = std::thread::hardware_concurrency();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n, kMaxExecutorThreads)));
}

// A parameter matrix from row r0, column c0 on (as a GEMM operand, transposed when `trans`).
Operand Weight(const TensorView& t, bool trans, int64_t r0, int64_t c0) {
  const char* p = static_cast<const char*>(t.data) +
                  static_cast<size_t>(r0 * t.strides[0] + c0) * DTypeSize(t.dtype);
  return Operand{p, t.dtype, t.strides[0], trans};
}

// True when up is the right half of one [H, 2I] gate|up tensor (same dtype and row stride, up
// starting I elements after gate): then x [Wg | Wu] is one GEMM of 2I columns.
bool FusedGateUp(const ExpertParams& w, int64_t I) {
  return w.gate.dtype == w.up.dtype && w.gate.strides[0] == w.up.strides[0] &&
         w.gate.strides[0] >= 2 * I &&
         static_cast<const char*>(w.up.data) ==
             static_cast<const char*>(w.gate.data) + I * DTypeSize(w.gate.dtype);
}

// a = x Wg, b = x Wu for columns [c0, c0 + nc) of I, into a and b (row stride ldab). When the
// tile covers all of I, the weights are fused and b == a + I (the [a | b] layout), one GEMM.
void GateUpGemm(int64_t n, int64_t nc, int64_t c0, int64_t H, int64_t I, const Operand& x,
                const ExpertParams& w, float* a, float* b, int64_t ldab, float* scratch) {
  if (nc == I && b == a + I && FusedGateUp(w, I)) {
    Gemm(n, 2 * I, H, x, Weight(w.gate, false, 0, 0), 0.0f, a, ldab, scratch);
    return;
  }
  Gemm(n, nc, H, x, Weight(w.gate, false, 0, c0), 0.0f, a, ldab, scratch);
  Gemm(n, nc, H, x, Weight(w.up, false, 0, c0), 0.0f, b, ldab, scratch);
}

const TensorView& Matrix(const ExpertParams& p, int32_t which) {
  return which == 0 ? p.gate : (which == 1 ? p.up : p.down);
}

}  // namespace

int64_t RowBlock(int64_t n, int64_t max_block) {
  if (n <= max_block) return n;
  const int64_t blocks = (n + max_block - 1) / max_block;
  return std::min<int64_t>(
      max_block, static_cast<int64_t>(RoundUp(static_cast<size_t>((n + blocks - 1) / blocks), 16)));
}

int64_t ColTile(int64_t width, int64_t max_tile) {
  if (width <= max_tile) return width;
  const int64_t parts = (width + max_tile - 1) / max_tile;
  return static_cast<int64_t>(RoundUp(static_cast<size_t>((width + parts - 1) / parts), 16));
}

std::pair<int64_t, int64_t> TileLimits(const std::vector<int64_t>& rows, int64_t width,
                                       int threads) {
  int64_t max_block = kRowBlock, max_tile = kColTile;
  const int64_t want = kTilesPerThread * std::max<int64_t>(threads, 2);
  auto tiles = [&] {
    const int64_t tile = ColTile(width, max_tile);
    const int64_t col_tiles = tile == 0 ? 0 : (width + tile - 1) / tile;
    int64_t n = 0;
    for (int64_t r : rows) {
      if (r <= 0) continue;
      const int64_t block = RowBlock(r, max_block);
      n += (r + block - 1) / block * col_tiles;
    }
    return n;
  };
  while (tiles() < want) {
    if (max_block > kMinRowBlock) {
      max_block /= 2;
    } else if (max_tile > kMinColTile && ColTile(width, max_tile) > kMinColTile) {
      max_tile /= 2;
    } else {
      break;
    }
  }
  return {max_block, max_tile};
}

size_t CpuWorkspaceBytes(const ExecutorConfig& config, int threads) {
  size_t per_thread = 0, bytes = 0;
  return CheckedWorkspaceBytes(config, threads, &per_thread, &bytes) ? bytes : SIZE_MAX;
}

absl::StatusOr<std::unique_ptr<CpuExecutor>> CpuExecutor::Create(const ExecutorConfig& config) {
  MOONEP_RETURN_IF_ERROR(CheckExecutorConfig(config));
  MOONEP_ASSIGN_OR_RETURN(const int threads, ResolveThreads(config));
  size_t per_thread = 0, bytes = 0;
  MOONEP_CHECK_ARG(CheckedWorkspaceBytes(config, threads, &per_thread, &bytes),
                   "config: the workspace for hidden %d, intermediate %d, max_rows %d and %d "
                   "threads does not fit in size_t", config.hidden, config.intermediate,
                   config.max_rows, threads);
  MOONEP_RETURN_IF_ERROR(CheckHostAllocation(bytes, "the CPU executor's workspace"));
  std::unique_ptr<CpuExecutor> ex(new CpuExecutor(config, threads));
  ex->workspace_bytes_ = bytes;
  ex->per_thread_floats_ = per_thread;
  ex->workspace_ = static_cast<float*>(std::aligned_alloc(64, RoundUp(ex->workspace_bytes_, 64)));
  if (ex->workspace_ == nullptr) {
    return OutOfMemory("CpuExecutor: cannot allocate a %d-byte workspace", ex->workspace_bytes_);
  }
  ex->shared_ = ex->workspace_ + ex->pool_->size() * ex->per_thread_floats_;
  // Enough task slots for max_rows spread over up to 256 groups, plus the finer tiles of
  // TileLimits (fewer than 2 * kTilesPerThread per thread beyond one per group); more groups grow
  // it once. (Fewer bytes than the workspace, but an allocation all the same: a failure is
  // OutOfMemory, not an exception out of Create.)
  const size_t tasks = static_cast<size_t>(config.max_rows / kRowBlock + 256) * 3 +
                       static_cast<size_t>(2 * kTilesPerThread * std::max(ex->pool_->size(), 2));
  try {
    ex->tasks_.reserve(tasks);
    ex->group_rows_.reserve(256);
  } catch (const std::bad_alloc&) {
    return OutOfMemory("CpuExecutor: cannot allocate %d task slots", tasks);
  } catch (const std::length_error&) {
    return OutOfMemory("CpuExecutor: cannot allocate %d task slots", tasks);
  }
  return ex;
}

CpuExecutor::CpuExecutor(const ExecutorConfig& config, int threads)
    // Tiles take milliseconds: the workers sleep between phases (no polling).
    : config_(config), pool_(new WorkerPool(threads, std::chrono::microseconds(0))) {}

CpuExecutor::~CpuExecutor() { std::free(workspace_); }

void CpuExecutor::OrderGroups(const ComputeView& view) {
  const int32_t G = static_cast<int32_t>(view.groups.size());
  order_.clear();
  for (int32_t g = 0; g < G; ++g) {
    if (view.groups[g].row_count > 0) order_.push_back(g);
  }
  std::sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
    const int64_t ra = view.groups[a].row_count, rb = view.groups[b].row_count;
    return ra != rb ? ra > rb : a < b;
  });
}

void CpuExecutor::RowTasks(const ComputeView& view, int64_t width) {
  tasks_.clear();
  group_rows_.clear();
  for (int32_t g : order_) group_rows_.push_back(view.groups[g].row_count);
  const auto [max_block, max_tile] = TileLimits(group_rows_, width, pool_->size());
  const int64_t tile = ColTile(width, max_tile);
  for (int32_t g : order_) {
    const int64_t n = view.groups[g].row_count;
    const int64_t block = RowBlock(n, max_block);
    for (int64_t r = 0; r < n; r += block) {
      for (int64_t c = 0; c < width; c += tile) {
        tasks_.push_back(Task{g, 0, r, std::min(block, n - r), c, std::min(tile, width - c)});
      }
    }
  }
}

void CpuExecutor::WeightTasks(const ComputeView& view) {
  tasks_.clear();
  for (int32_t g : order_) {
    for (int32_t m = 0; m < 3; ++m) {
      const int64_t rows = m == 2 ? view.intermediate : view.hidden;
      for (int64_t r = 0; r < rows; r += kWeightTile) {
        tasks_.push_back(Task{g, m, r, std::min(kWeightTile, rows - r), 0,
                              m == 2 ? view.hidden : view.intermediate});
      }
    }
  }
}

// Output rows outside every group's data rows are zeroed (see executor.h).
void CpuExecutor::ZeroUncoveredRows(const ComputeView& view, const TensorView& out) {
  by_offset_.clear();
  for (int32_t g = 0; g < static_cast<int32_t>(view.groups.size()); ++g) {
    if (view.groups[g].row_count > 0) by_offset_.push_back(g);
  }
  std::sort(by_offset_.begin(), by_offset_.end(), [&](int32_t a, int32_t b) {
    return view.groups[a].row_offset < view.groups[b].row_offset;
  });
  const size_t row_bytes = static_cast<size_t>(view.hidden) * DTypeSize(view.dtype);
  int64_t next = 0;
  auto zero = [&](int64_t from, int64_t to) {
    if (to > from) std::memset(out.row(from), 0, static_cast<size_t>(to - from) * row_bytes);
  };
  for (int32_t g : by_offset_) {
    zero(next, view.groups[g].row_offset);
    next = view.groups[g].row_offset + view.groups[g].row_count;
  }
  zero(next, view.total_rows);
}

namespace {

// Converts rows [row0, row0 + n) of a bf16 rows tensor into `dst`; fp32 is used in place.
Operand RowsOperand(const TensorView& rows, int64_t row0, int64_t n, float* dst) {
  Operand op{rows.row(row0), DType::kFloat32, rows.shape[1], false};
  if (rows.dtype == DType::kBFloat16) {
    ConvertToFloat(op.data, DType::kBFloat16, dst, static_cast<size_t>(n * rows.shape[1]));
    op.data = dst;
  }
  return op;
}

// out[:, col0 : col0 + cols] of rows [row0, row0 + n) = op(A) op(B): straight into fp32 storage,
// through the fp32 `tile` for bf16.
void GemmIntoRows(const TensorView& out, int64_t row0, int64_t n, int64_t col0, int64_t cols,
                  int64_t K, const Operand& a, const Operand& b, const Operand* a2,
                  const Operand* b2, float* tile, float* gemm) {
  const int64_t ld = out.shape[1];
  const bool bf16 = out.dtype == DType::kBFloat16;
  float* c = bf16 ? tile : reinterpret_cast<float*>(out.row(row0)) + col0;
  const int64_t ldc = bf16 ? cols : ld;
  Gemm(n, cols, K, a, b, 0.0f, c, ldc, gemm);
  if (a2 != nullptr) Gemm(n, cols, K, *a2, *b2, 1.0f, c, ldc, gemm);
  if (!bf16) return;
  for (int64_t r = 0; r < n; ++r) {
    ConvertFromFloat(tile + r * cols, static_cast<BFloat16*>(static_cast<void*>(out.row(row0 + r))) + col0,
                     DType::kBFloat16, static_cast<size_t>(cols));
  }
}

}  // namespace

absl::Status CpuExecutor::Forward(const ComputeView& view, const TensorView& x_rows,
                                  const TensorView& y_rows, const ForwardOptions& options) {
  MOONEP_RETURN_IF_ERROR(CheckForwardArgs(config_, Device::kCpu, view, x_rows, y_rows, options));
  ScopedSingleThreadedBlas single_threaded_blas;
  const int64_t H = view.hidden, I = view.intermediate;
  const ScratchLayout lay = Layout(config_);
  float* saved = static_cast<float*>(options.preactivations.data);
  float* h_all = shared_;
  OrderGroups(view);

  // F1: a, b and h for a tile of rows x columns of I.
  RowTasks(view, I);
  auto f1 = [&](int64_t task, int worker) {
    const Task& t = tasks_[task];
    const GroupView& gv = view.groups[t.group];
    const int64_t row0 = gv.row_offset + t.row0, n = t.rows, c0 = t.col0, nc = t.cols;
    float* s = ThreadScratch(worker);
    const Operand x = RowsOperand(x_rows, row0, n, s + lay.x);
    // Scratch a and b side by side ([a | b] rows of 2 nc, like the kept pre-activations), so a
    // fused gate|up weight is one GEMM either way.
    float* a = saved ? saved + row0 * 2 * I + c0 : s + lay.a;
    float* b = saved ? saved + row0 * 2 * I + I + c0 : s + lay.a + nc;
    const int64_t ldab = 2 * (saved ? I : nc);
    GateUpGemm(n, nc, c0, H, I, x, gv.weights, a, b, ldab, s + lay.gemm);
    for (int64_t r = 0; r < n; ++r) {
      SwiGluForward(a + r * ldab, b + r * ldab, h_all + (row0 + r) * I + c0, nc);
    }
  };
  pool_->Run(static_cast<int64_t>(tasks_.size()), f1);

  // F2: y = h Wd for a tile of rows x columns of H.
  RowTasks(view, H);
  auto f2 = [&](int64_t task, int worker) {
    const Task& t = tasks_[task];
    const GroupView& gv = view.groups[t.group];
    const int64_t row0 = gv.row_offset + t.row0;
    float* s = ThreadScratch(worker);
    const Operand h{h_all + row0 * I, DType::kFloat32, I, false};
    GemmIntoRows(y_rows, row0, t.rows, t.col0, t.cols, I, h,
                 Weight(gv.weights.down, false, 0, t.col0), nullptr, nullptr, s + lay.a,
                 s + lay.gemm);
  };
  pool_->Run(static_cast<int64_t>(tasks_.size()), f2);
  ZeroUncoveredRows(view, y_rows);
  return absl::OkStatus();
}

absl::Status CpuExecutor::Backward(const ComputeView& view, const TensorView& x_rows,
                                   const TensorView& dy_rows, const TensorView& dx_rows,
                                   const BackwardOptions& options) {
  MOONEP_RETURN_IF_ERROR(
      CheckBackwardArgs(config_, Device::kCpu, view, x_rows, dy_rows, dx_rows, options));
  ScopedSingleThreadedBlas single_threaded_blas;
  const int64_t H = view.hidden, I = view.intermediate;
  const size_t rows_cap = static_cast<size_t>(config_.max_rows * I);
  float* h_all = shared_;
  float* da_all = shared_ + rows_cap;
  float* db_all = shared_ + 2 * rows_cap;
  const ScratchLayout lay = Layout(config_);
  const float* saved = static_cast<const float*>(options.preactivations.data);
  OrderGroups(view);

  // B1: a, b (kept or recomputed), dh = dy Wd^T, then h, da, db for a tile of rows x columns of I.
  RowTasks(view, I);
  auto b1 = [&](int64_t task, int worker) {
    const Task& t = tasks_[task];
    const GroupView& gv = view.groups[t.group];
    const int64_t row0 = gv.row_offset + t.row0, n = t.rows, c0 = t.col0, nc = t.cols;
    float* s = ThreadScratch(worker);
    const float *a, *b;
    int64_t ldab;
    if (saved) {
      a = saved + row0 * 2 * I + c0;
      b = a + I;
      ldab = 2 * I;
    } else {
      const Operand x = RowsOperand(x_rows, row0, n, s + lay.x);
      GateUpGemm(n, nc, c0, H, I, x, gv.weights, s + lay.a, s + lay.a + nc, 2 * nc, s + lay.gemm);
      a = s + lay.a;
      b = s + lay.a + nc;
      ldab = 2 * nc;
    }
    const Operand dy = RowsOperand(dy_rows, row0, n, s + lay.dy);
    float* dh = s + lay.t;
    Gemm(n, nc, H, dy, Weight(gv.weights.down, true, c0, 0), 0.0f, dh, nc, s + lay.gemm);
    for (int64_t r = 0; r < n; ++r) {
      const size_t base = static_cast<size_t>((row0 + r) * I + c0);
      SwiGluBackward(a + r * ldab, b + r * ldab, dh + r * nc, h_all + base, da_all + base,
                     db_all + base, nc);
    }
  };
  pool_->Run(static_cast<int64_t>(tasks_.size()), b1);

  // B2: dx = da Wg^T + db Wu^T for a tile of rows x columns of H.
  RowTasks(view, H);
  auto b2 = [&](int64_t task, int worker) {
    const Task& t = tasks_[task];
    const GroupView& gv = view.groups[t.group];
    const int64_t row0 = gv.row_offset + t.row0;
    float* s = ThreadScratch(worker);
    const Operand da{da_all + row0 * I, DType::kFloat32, I, false};
    const Operand db{db_all + row0 * I, DType::kFloat32, I, false};
    const Operand wg = Weight(gv.weights.gate, true, t.col0, 0);
    const Operand wu = Weight(gv.weights.up, true, t.col0, 0);
    GemmIntoRows(dx_rows, row0, t.rows, t.col0, t.cols, I, da, wg, &db, &wu, s + lay.a,
                 s + lay.gemm);
  };
  pool_->Run(static_cast<int64_t>(tasks_.size()), b2);
  ZeroUncoveredRows(view, dx_rows);

  // B3, per tile of gradient rows: dWg += X^T da, dWu += X^T db, dWd += h^T dY, each a GEMM over
  // all the group's rows, so every gradient element is summed in one fixed order.
  WeightTasks(view);
  auto b3 = [&](int64_t task, int worker) {
    const Task& t = tasks_[task];
    const GroupView& gv = view.groups[t.group];
    const int64_t n = gv.row_count, off = gv.row_offset;
    float* s = ThreadScratch(worker);
    const size_t esize = DTypeSize(view.dtype);
    Operand a_op, b_op;
    if (t.matrix < 2) {  // rows [row0, row0 + rows) of the [H, I] gradient: X^T times da / db
      a_op = Operand{x_rows.row(off) + t.row0 * esize, view.dtype, H, true};
      b_op = Operand{(t.matrix == 0 ? da_all : db_all) + off * I, DType::kFloat32, I, false};
    } else {  // rows of the [I, H] gradient: h^T times dY
      a_op = Operand{h_all + off * I + t.row0, DType::kFloat32, I, true};
      b_op = Operand{dy_rows.row(off), view.dtype, H, false};
    }
    const int64_t cols = t.cols;
    const TensorView& grad = Matrix(gv.grads, t.matrix);
    if (grad.dtype == DType::kFloat32) {
      float* c = static_cast<float*>(grad.data) + t.row0 * grad.strides[0];
      Gemm(t.rows, cols, n, a_op, b_op, 1.0f, c, grad.strides[0], s + lay.gemm);
    } else {
      float* tile = s + lay.tile;
      Gemm(t.rows, cols, n, a_op, b_op, 0.0f, tile, cols, s + lay.gemm);
      BFloat16* g = static_cast<BFloat16*>(grad.data) + t.row0 * grad.strides[0];
      for (int64_t r = 0; r < t.rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          BFloat16& e = g[r * grad.strides[0] + c];
          e = BFloat16::FromFloat(e.ToFloat() + tile[r * cols + c]);
        }
      }
    }
  };
  pool_->Run(static_cast<int64_t>(tasks_.size()), b3);
  return absl::OkStatus();
}

}  // namespace moonep::compute::cpu
