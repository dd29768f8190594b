// Checks the fp64 reference layer itself: gradients against central finite differences, and the
// forward pass against an independent per-token formula.
#include "moonep/reference/reference_moe.h"

#include <gtest/gtest.h>

#include <cmath>

#include "moonep/reference/gradient_check.h"

namespace moonep::reference {
namespace {

struct Shape {
  int64_t E, K, H, I, T;
};

class FiniteDifferenceTest : public ::testing::TestWithParam<Shape> {};

TEST_P(FiniteDifferenceTest, EveryGradientMatches) {
  const Shape s = GetParam();
  GradientCheckCase c;
  c.shape = {s.E, s.K, s.H, s.I};
  c.tokens = s.T;
  c.seed = 42 + s.E * 7 + s.H;
  std::vector<GradientCheckResult> results;
  ASSERT_TRUE(CheckGradients(c, &results).ok());
  ASSERT_EQ(results.size(), 5u);
  for (const auto& r : results) {
    std::printf("[ FD-CHECK ] E=%ld K=%ld H=%ld I=%ld T=%ld %-14s %5ld entries  max rel err %.2e\n",
                s.E, s.K, s.H, s.I, s.T, r.tensor.c_str(), r.checked, r.max_rel_error);
    EXPECT_GT(r.checked, 0);
    EXPECT_LT(r.max_rel_error, 1e-6) << r.tensor;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, FiniteDifferenceTest,
                         ::testing::Values(Shape{4, 2, 5, 3, 6}, Shape{3, 3, 4, 7, 5},
                                           Shape{6, 1, 3, 2, 9}, Shape{1, 1, 2, 2, 1}));

TEST(ReferenceTest, ForwardEqualsPerTokenSum) {
  MoeShape shape{5, 3, 6, 4};
  const int64_t T = 7;
  RandomProblem p = MakeRandomProblem(shape, T, 3, 0.3);
  ForwardResult out;
  ASSERT_TRUE(Forward(shape, p.weights, T, p.x, p.topk_ids, p.topk_weights, &out).ok());
  // Independent formula: expand SwiGLU with explicit sums per element.
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < shape.hidden; ++h) {
      double expected = 0.0;
      for (int64_t k = 0; k < shape.top_k; ++k) {
        int32_t e = p.topk_ids[t * shape.top_k + k];
        if (e < 0) continue;
        double v = 0.0;
        for (int64_t i = 0; i < shape.intermediate; ++i) {
          double a = 0.0, b = 0.0;
          for (int64_t hh = 0; hh < shape.hidden; ++hh) {
            a += p.x[t * shape.hidden + hh] * p.weights.wg[(e * shape.hidden + hh) * shape.intermediate + i];
            b += p.x[t * shape.hidden + hh] * p.weights.wu[(e * shape.hidden + hh) * shape.intermediate + i];
          }
          v += a / (1.0 + std::exp(-a)) * b * p.weights.wd[(e * shape.intermediate + i) * shape.hidden + h];
        }
        expected += p.topk_weights[t * shape.top_k + k] * v;
      }
      EXPECT_NEAR(out.y[t * shape.hidden + h], expected, 1e-12 * (1 + std::fabs(expected)));
    }
  }
}

TEST(ReferenceTest, DroppedEntriesContributeNothing) {
  MoeShape shape{3, 2, 4, 3};
  RandomProblem p = MakeRandomProblem(shape, 4, 9, 0.0);
  for (auto& id : p.topk_ids) id = -1;
  ForwardResult out;
  ASSERT_TRUE(Forward(shape, p.weights, 4, p.x, p.topk_ids, p.topk_weights, &out).ok());
  for (double v : out.y) EXPECT_EQ(v, 0.0);
  BackwardResult g;
  ASSERT_TRUE(Backward(shape, p.weights, 4, p.x, p.topk_ids, p.topk_weights, p.dy, &g).ok());
  for (double v : g.dx) EXPECT_EQ(v, 0.0);
  for (double v : g.dwg) EXPECT_EQ(v, 0.0);
}

TEST(ReferenceTest, RejectsBadInput) {
  MoeShape shape{3, 2, 4, 3};
  RandomProblem p = MakeRandomProblem(shape, 4, 9, 0.0);
  ForwardResult out;
  p.topk_ids[3] = 3;  // out of range
  absl::Status s = Forward(shape, p.weights, 4, p.x, p.topk_ids, p.topk_weights, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("topk_ids[1][1] = 3"), std::string::npos) << s.message();
  p.topk_ids[3] = 0;
  p.x.pop_back();
  EXPECT_FALSE(Forward(shape, p.weights, 4, p.x, p.topk_ids, p.topk_weights, &out).ok());
}


// E * H * I = 2^21 * 2^21 * 2^22 = 2^64 once wrapped to 0, so empty weights passed the check.
TEST(ReferenceTest, SizesPastInt64AreRejected) {
  const MoeShape shape{int64_t{1} << 21, 1, int64_t{1} << 21, int64_t{1} << 22};
  ExpertWeights w;
  ForwardResult out;
  absl::Status s = Forward(shape, w, 0, {}, {}, {}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("E*H*I"), std::string::npos) << s;
  BackwardResult grads;
  s = Backward(shape, w, 0, {}, {}, {}, {}, &grads);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // tokens * K and tokens * K * H (the expert outputs) as well.
  const MoeShape wide{1, int64_t{1} << 40, 1, 1};
  ExpertWeights one{{0.5}, {0.5}, {0.5}};
  s = Forward(wide, one, int64_t{1} << 24, {}, {}, {}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("T*K"), std::string::npos) << s;
}

// An invalid shape is rejected before the random problem is built (E = 0 once divided by zero in
// MakeRandomProblem's k % E).
TEST(ReferenceTest, GradientCheckValidatesTheShapeFirst) {
  for (const MoeShape shape : {MoeShape{0, 1, 1, 1}, MoeShape{2, 0, 1, 1}, MoeShape{-1, 1, 1, 1},
                               MoeShape{2, 1, -3, 1}, MoeShape{int64_t{1} << 21, 1, int64_t{1} << 21,
                                                               int64_t{1} << 22}}) {
    GradientCheckCase c;
    c.shape = shape;
    c.tokens = 2;
    std::vector<GradientCheckResult> results;
    const absl::Status s = CheckGradients(c, &results);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(results.empty());
  }
  GradientCheckCase c;
  c.shape = MoeShape{2, 1, 2, 2};
  c.tokens = -1;
  std::vector<GradientCheckResult> results;
  EXPECT_EQ(CheckGradients(c, &results).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moonep::reference
