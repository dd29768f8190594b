#include "moonep/compute/cpu/cpu_executor.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "moonep/compute/cpu/gemm.h"
#include "moonep/core/env.h"
#include "moonep/core/status.h"

namespace moonep::compute::cpu {
namespace {

constexpr size_t kAlignFloats = 16;  // 64 bytes

size_t RoundUp(size_t v, size_t m) { return (v + m - 1) / m * m; }

// Per-thread scratch layout, in floats.
struct ScratchLayout {
  int64_t rb = 0;
  size_t a = 0, b = 0, t = 0, x = 0, dy = 0, gemm = 0, tile = 0, total = 0;
};

ScratchLayout Layout(const ExecutorConfig& c) {
  ScratchLayout l;
  const int64_t H = c.hidden, I = c.intermediate, M = std::max(H, I);
  const int64_t tw = std::min(kWeightTile, M);
  l.rb = std::max<int64_t>(1, std::min(kRowBlock, c.max_rows));
  const size_t rbi = static_cast<size_t>(l.rb * I), rbh = static_cast<size_t>(l.rb * H);
  l.a = 0;
  l.b = rbi;
  l.t = 2 * rbi;
  size_t end = 3 * rbi;
  if (c.dtype == DType::kBFloat16) {
    l.x = end;
    l.dy = l.x + rbh;
    l.gemm = l.dy + rbh;
    l.tile = l.gemm + static_cast<size_t>(kPanelK * (tw + M));
    end = l.tile + static_cast<size_t>(tw * M);
  }
  l.total = RoundUp(end, kAlignFloats);
  return l;
}

size_t SharedFloats(const ExecutorConfig& c) {
  return RoundUp(3 * static_cast<size_t>(c.max_rows * c.intermediate), kAlignFloats);
}

int ResolveThreads(const ExecutorConfig& c) {
  int64_t n = c.num_threads;
  if (n <= 0) n = param::NumThreads();
  if (n <= 0) n = std::thread::hardware_concurrency();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n, 1024)));
}

inline float Sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

Operand Weight(const TensorView& t, bool trans) {
  return Operand{t.data, t.dtype, t.strides[0], trans};
}

const TensorView& Matrix(const ExpertParams& p, int32_t which) {
  return which == 0 ? p.gate : (which == 1 ? p.up : p.down);
}

}  // namespace

size_t CpuWorkspaceBytes(const ExecutorConfig& config, int threads) {
  return sizeof(float) * (static_cast<size_t>(threads) * Layout(config).total + SharedFloats(config));
}

absl::StatusOr<std::unique_ptr<CpuExecutor>> CpuExecutor::Create(const ExecutorConfig& config) {
  MOONEP_RETURN_IF_ERROR(CheckExecutorConfig(config));
  std::unique_ptr<CpuExecutor> ex(new CpuExecutor(config, ResolveThreads(config)));
  ex->workspace_bytes_ = CpuWorkspaceBytes(config, ex->pool_->size());
  ex->per_thread_floats_ = Layout(config).total;
  ex->workspace_ = static_cast<float*>(std::aligned_alloc(64, RoundUp(ex->workspace_bytes_, 64)));
  if (ex->workspace_ == nullptr) {
    return OutOfMemory("CpuExecutor: cannot allocate a %d-byte workspace", ex->workspace_bytes_);
  }
  ex->shared_ = ex->workspace_ + ex->pool_->size() * ex->per_thread_floats_;
  // Enough task slots for max_rows spread over up to 256 groups; more groups grow it once.
  ex->tasks_.reserve(static_cast<size_t>(config.max_rows / kRowBlock + 256) * 3);
  return ex;
}

CpuExecutor::CpuExecutor(const ExecutorConfig& config, int threads)
    : config_(config), pool_(new ThreadPool(threads)) {}

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

void CpuExecutor::RowTasks(const ComputeView& view) {
  tasks_.clear();
  for (int32_t g : order_) {
    const int64_t n = view.groups[g].row_count;
    for (int64_t r = 0; r < n; r += kRowBlock) {
      tasks_.push_back(Task{g, 0, r, std::min(kRowBlock, n - r)});
    }
  }
}

void CpuExecutor::WeightTasks(const ComputeView& view) {
  tasks_.clear();
  for (int32_t g : order_) {
    for (int32_t m = 0; m < 3; ++m) {
      const int64_t rows = m == 2 ? view.intermediate : view.hidden;
      for (int64_t r = 0; r < rows; r += kWeightTile) {
        tasks_.push_back(Task{g, m, r, std::min(kWeightTile, rows - r)});
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

absl::Status CpuExecutor::Forward(const ComputeView& view, const TensorView& x_rows,
                                  const TensorView& y_rows, const ForwardOptions& options) {
  MOONEP_RETURN_IF_ERROR(CheckForwardArgs(config_, Device::kCpu, view, x_rows, y_rows, options));
  ScopedSingleThreadedBlas single_threaded_blas;
  const int64_t H = view.hidden, I = view.intermediate;
  const bool bf16 = view.dtype == DType::kBFloat16;
  const ScratchLayout lay = Layout(config_);
  float* saved = static_cast<float*>(options.preactivations.data);
  OrderGroups(view);
  RowTasks(view);
  auto task_fn = [&](int64_t task, int worker) {
    const Task& t = tasks_[task];
    const GroupView& gv = view.groups[t.group];
    const int64_t row0 = gv.row_offset + t.begin, n = t.count;
    float* s = ThreadScratch(worker);
    Operand x{x_rows.row(row0), DType::kFloat32, H, false};
    if (bf16) {
      ConvertToFloat(x.data, DType::kBFloat16, s + lay.x, static_cast<size_t>(n * H));
      x.data = s + lay.x;
    }
    float* a = saved ? saved + row0 * 2 * I : s + lay.a;
    float* b = saved ? saved + row0 * 2 * I + I : s + lay.b;
    const int64_t ldab = saved ? 2 * I : I;
    float* gemm = s + lay.gemm;
    Gemm(n, I, H, x, Weight(gv.weights.gate, false), 0.0f, a, ldab, gemm);
    Gemm(n, I, H, x, Weight(gv.weights.up, false), 0.0f, b, ldab, gemm);
    float* h = s + lay.t;
    for (int64_t r = 0; r < n; ++r) {
      const float* ar = a + r * ldab;
      const float* br = b + r * ldab;
      float* hr = h + r * I;
      for (int64_t i = 0; i < I; ++i) hr[i] = ar[i] * Sigmoid(ar[i]) * br[i];
    }
    const Operand hop{h, DType::kFloat32, I, false};
    if (bf16) {
      float* y = s + lay.x;  // x is consumed
      Gemm(n, H, I, hop, Weight(gv.weights.down, false), 0.0f, y, H, gemm);
      ConvertFromFloat(y, y_rows.row(row0), DType::kBFloat16, static_cast<size_t>(n * H));
    } else {
      Gemm(n, H, I, hop, Weight(gv.weights.down, false), 0.0f,
           reinterpret_cast<float*>(y_rows.row(row0)), H, gemm);
    }
  };
  pool_->Run(static_cast<int64_t>(tasks_.size()), task_fn);
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
  const bool bf16 = view.dtype == DType::kBFloat16;
  const ScratchLayout lay = Layout(config_);
  const float* saved = static_cast<const float*>(options.preactivations.data);
  OrderGroups(view);

  // Pass 1, per row block: h, da, db (kept for pass 2) and dx.
  RowTasks(view);
  auto rows_fn = [&](int64_t task, int worker) {
    const Task& t = tasks_[task];
    const GroupView& gv = view.groups[t.group];
    const int64_t row0 = gv.row_offset + t.begin, n = t.count;
    float* s = ThreadScratch(worker);
    float* gemm = s + lay.gemm;
    const float *a, *b;
    int64_t ldab;
    if (saved) {
      a = saved + row0 * 2 * I;
      b = a + I;
      ldab = 2 * I;
    } else {
      Operand x{x_rows.row(row0), DType::kFloat32, H, false};
      if (bf16) {
        ConvertToFloat(x.data, DType::kBFloat16, s + lay.x, static_cast<size_t>(n * H));
        x.data = s + lay.x;
      }
      Gemm(n, I, H, x, Weight(gv.weights.gate, false), 0.0f, s + lay.a, I, gemm);
      Gemm(n, I, H, x, Weight(gv.weights.up, false), 0.0f, s + lay.b, I, gemm);
      a = s + lay.a;
      b = s + lay.b;
      ldab = I;
    }
    Operand dy{dy_rows.row(row0), DType::kFloat32, H, false};
    if (bf16) {
      ConvertToFloat(dy.data, DType::kBFloat16, s + lay.dy, static_cast<size_t>(n * H));
      dy.data = s + lay.dy;
    }
    float* dh = s + lay.t;
    Gemm(n, I, H, dy, Weight(gv.weights.down, true), 0.0f, dh, I, gemm);
    float* h = h_all + row0 * I;
    float* da = da_all + row0 * I;
    float* db = db_all + row0 * I;
    for (int64_t r = 0; r < n; ++r) {
      const float* ar = a + r * ldab;
      const float* br = b + r * ldab;
      for (int64_t i = 0; i < I; ++i) {
        const float av = ar[i], bv = br[i], g = dh[r * I + i];
        const float sg = Sigmoid(av), silu = av * sg;
        h[r * I + i] = silu * bv;
        da[r * I + i] = g * bv * (sg + silu * (1.0f - sg));
        db[r * I + i] = g * silu;
      }
    }
    float* dx = bf16 ? s + lay.x : reinterpret_cast<float*>(dx_rows.row(row0));
    Gemm(n, H, I, Operand{da, DType::kFloat32, I, false}, Weight(gv.weights.gate, true), 0.0f, dx,
         H, gemm);
    Gemm(n, H, I, Operand{db, DType::kFloat32, I, false}, Weight(gv.weights.up, true), 1.0f, dx,
         H, gemm);
    if (bf16) ConvertFromFloat(dx, dx_rows.row(row0), DType::kBFloat16, static_cast<size_t>(n * H));
  };
  pool_->Run(static_cast<int64_t>(tasks_.size()), rows_fn);
  ZeroUncoveredRows(view, dx_rows);

  // Pass 2, per tile of gradient rows: dWg += X^T da, dWu += X^T db, dWd += h^T dY, each a GEMM
  // over all the group's rows, so every gradient element is summed in one fixed order.
  WeightTasks(view);
  auto weights_fn = [&](int64_t task, int worker) {
    const Task& t = tasks_[task];
    const GroupView& gv = view.groups[t.group];
    const int64_t n = gv.row_count, off = gv.row_offset;
    float* s = ThreadScratch(worker);
    const size_t esize = DTypeSize(view.dtype);
    Operand a_op, b_op;
    int64_t cols;
    if (t.matrix < 2) {  // [H, I] tile rows t.begin.. of X^T times da / db
      a_op = Operand{x_rows.row(off) + t.begin * esize, view.dtype, H, true};
      b_op = Operand{(t.matrix == 0 ? da_all : db_all) + off * I, DType::kFloat32, I, false};
      cols = I;
    } else {  // [I, H] tile rows of h^T times dY
      a_op = Operand{h_all + off * I + t.begin, DType::kFloat32, I, true};
      b_op = Operand{dy_rows.row(off), view.dtype, H, false};
      cols = H;
    }
    const TensorView& grad = Matrix(gv.grads, t.matrix);
    if (grad.dtype == DType::kFloat32) {
      float* c = static_cast<float*>(grad.data) + t.begin * grad.strides[0];
      Gemm(t.count, cols, n, a_op, b_op, 1.0f, c, grad.strides[0], s + lay.gemm);
    } else {
      float* tile = s + lay.tile;
      Gemm(t.count, cols, n, a_op, b_op, 0.0f, tile, cols, s + lay.gemm);
      BFloat16* g = static_cast<BFloat16*>(grad.data) + t.begin * grad.strides[0];
      for (int64_t r = 0; r < t.count; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          BFloat16& e = g[r * grad.strides[0] + c];
          e = BFloat16::FromFloat(e.ToFloat() + tile[r * cols + c]);
        }
      }
    }
  };
  pool_->Run(static_cast<int64_t>(tasks_.size()), weights_fn);
  return absl::OkStatus();
}

}  // namespace moonep::compute::cpu
