// Test fixtures for the executor: a random grouped problem laid out in a ComputeView, the same
// values in the fp64 reference layer's layout, and error measures against it.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "moonep/compute/compute_view.h"
#include "moonep/core/dtype.h"
#include "moonep/reference/reference_moe.h"

namespace moonep::compute::testing {

// Storage for a 2-D tensor of fp32 or bf16, 64-byte aligned.
class Buffer {
 public:
  Buffer() = default;
  Buffer(int64_t rows, int64_t cols, DType dtype)
      : rows_(rows), cols_(cols), dtype_(dtype),
        storage_(static_cast<size_t>(rows * cols) * DTypeSize(dtype) / sizeof(float) + 16) {}
  void* data() {
    auto p = reinterpret_cast<uintptr_t>(storage_.data());
    return reinterpret_cast<void*>((p + 63) / 64 * 64);
  }
  TensorView view() { return TensorView::Contiguous(data(), dtype_, {rows_, cols_}); }
  float Get(int64_t r, int64_t c) { return LoadAsFloat(data(), dtype_, static_cast<size_t>(r * cols_ + c)); }
  void Set(int64_t r, int64_t c, float v) { StoreFromFloat(data(), dtype_, static_cast<size_t>(r * cols_ + c), v); }
  void Fill(float v) {
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < cols_; ++c) Set(r, c, v);
  }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  size_t bytes() const { return static_cast<size_t>(rows_ * cols_) * DTypeSize(dtype_); }

 private:
  int64_t rows_ = 0, cols_ = 0;
  DType dtype_ = DType::kFloat32;
  std::vector<float> storage_;
};

struct ProblemSpec {
  int64_t hidden = 8, intermediate = 8;
  DType dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  std::vector<int64_t> counts;  // rows per group
  int64_t pad_multiple = 1;
  int64_t gap = 0;              // extra unused rows between groups (never read, zeroed in outputs)
  uint64_t seed = 1;
};

// Group g computes "expert" g of the reference weights. Padding rows of x and dy hold NaN, so a
// read of padding as data shows up in every output.
struct Problem {
  explicit Problem(const ProblemSpec& spec);

  ProblemSpec spec;
  ComputeView view;
  std::vector<Buffer> weights, grads;  // 3 per group: gate, up, down
  Buffer x, dy;                        // [total_rows, H]
  std::vector<int64_t> data_rows;      // view rows that hold data, by group then row
  std::vector<int32_t> row_group;      // group of each data row
  reference::MoeShape shape;
  reference::ExpertWeights ref;        // the stored (rounded) weights in fp64

  void ZeroGrads();
};

inline Problem::Problem(const ProblemSpec& s) : spec(s) {
  const int64_t H = s.hidden, I = s.intermediate, G = static_cast<int64_t>(s.counts.size());
  std::mt19937_64 rng(s.seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  view.hidden = H;
  view.intermediate = I;
  view.dtype = s.dtype;
  view.groups.resize(G);
  shape = reference::MoeShape{G, 1, H, I};
  ref.wg.resize(G * H * I);
  ref.wu.resize(G * H * I);
  ref.wd.resize(G * I * H);
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    GroupView& gv = view.groups[g];
    gv.expert = static_cast<int32_t>(g);
    gv.row_offset = row;
    gv.row_count = s.counts[g];
    gv.padded_count = (s.counts[g] + s.pad_multiple - 1) / s.pad_multiple * s.pad_multiple;
    row += gv.padded_count + s.gap;
    for (int m = 0; m < 3; ++m) {
      const int64_t rows = m == 2 ? I : H, cols = m == 2 ? H : I;
      weights.emplace_back(rows, cols, s.dtype);
      grads.emplace_back(rows, cols, s.grad_dtype);
      Buffer& w = weights.back();
      std::vector<double>& dst = m == 0 ? ref.wg : (m == 1 ? ref.wu : ref.wd);
      const float scale = 1.5f / std::sqrt(static_cast<float>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          w.Set(r, c, scale * uni(rng));
          dst[(g * rows + r) * cols + c] = w.Get(r, c);
        }
      }
    }
  }
  view.total_rows = row;
  for (int64_t g = 0; g < G; ++g) {
    GroupView& gv = view.groups[g];
    gv.weights = ExpertParams{weights[3 * g].view(), weights[3 * g + 1].view(), weights[3 * g + 2].view()};
    gv.grads = ExpertParams{grads[3 * g].view(), grads[3 * g + 1].view(), grads[3 * g + 2].view()};
  }
  x = Buffer(row, H, s.dtype);
  dy = Buffer(row, H, s.dtype);
  x.Fill(std::numeric_limits<float>::quiet_NaN());
  dy.Fill(std::numeric_limits<float>::quiet_NaN());
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < s.counts[g]; ++r) {
      const int64_t vr = view.groups[g].row_offset + r;
      data_rows.push_back(vr);
      row_group.push_back(static_cast<int32_t>(g));
      for (int64_t h = 0; h < H; ++h) {
        x.Set(vr, h, uni(rng));
        dy.Set(vr, h, uni(rng));
      }
    }
  }
  ZeroGrads();
}

inline void Problem::ZeroGrads() {
  for (Buffer& b : grads) b.Fill(0.0f);
}

// max |got - want| / max |want| over a tensor (normwise, so tiny entries do not dominate).
class ErrorMeter {
 public:
  void Add(double got, double want) {
    if (!std::isfinite(got)) nonfinite_ = true;
    diff_ = std::max(diff_, std::abs(got - want));
    scale_ = std::max(scale_, std::abs(want));
  }
  double rel() const {
    if (nonfinite_) return std::numeric_limits<double>::infinity();
    return scale_ > 0 ? diff_ / scale_ : diff_;
  }

 private:
  double diff_ = 0, scale_ = 0;
  bool nonfinite_ = false;
};

}  // namespace moonep::compute::testing
