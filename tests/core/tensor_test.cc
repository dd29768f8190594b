#include "moonep/core/tensor.h"

#include <gtest/gtest.h>

#include <vector>

namespace moonep {
namespace {

TEST(TensorViewTest, ContiguousShapeAndStrides) {
  std::vector<float> data(24);
  TensorView v = TensorView::Contiguous(data.data(), DType::kFloat32, {2, 3, 4});
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.nbytes(), 96u);
  EXPECT_EQ(v.strides[0], 12);
  EXPECT_EQ(v.strides[2], 1);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.DebugString(), "fp32[2,3,4]@cpu");
}

TEST(TensorViewTest, CheckMatrixNamesTheProblem) {
  std::vector<float> data(12);
  TensorView v = TensorView::Contiguous(data.data(), DType::kFloat32, {3, 4});
  EXPECT_TRUE(CheckMatrix(v, "x", 3, 4, DType::kFloat32).ok());
  absl::Status bad = CheckMatrix(v, "x", 4, 4, DType::kFloat32);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("x: expected shape [4, 4]"), std::string::npos);
  EXPECT_FALSE(CheckMatrix(v, "x", 3, 4, DType::kBFloat16).ok());
  TensorView null = TensorView::Contiguous(nullptr, DType::kFloat32, {3, 4});
  EXPECT_NE(CheckMatrix(null, "w", 3, 4, DType::kFloat32).message().find("null"), std::string::npos);
  TensorView empty = TensorView::Contiguous(nullptr, DType::kFloat32, {0, 4});
  EXPECT_TRUE(CheckMatrix(empty, "w", 0, 4, DType::kFloat32).ok());
  TensorView misaligned = TensorView::Contiguous(reinterpret_cast<char*>(data.data()) + 1,
                                                 DType::kFloat32, {2, 2});
  EXPECT_FALSE(CheckMatrix(misaligned, "m", 2, 2, DType::kFloat32).ok());
  TensorView wrong_device = TensorView::Contiguous(data.data(), DType::kFloat32, {3, 4}, Device::kCuda);
  EXPECT_FALSE(CheckMatrix(wrong_device, "x", 3, 4, DType::kFloat32).ok());
}

TEST(TensorViewTest, Overlap) {
  char buf[64] = {0};
  EXPECT_TRUE(RangesOverlap(buf, 16, buf + 8, 16));
  EXPECT_FALSE(RangesOverlap(buf, 16, buf + 16, 16));
  EXPECT_FALSE(RangesOverlap(buf, 0, buf, 16));
}

}  // namespace
}  // namespace moonep
