// Streaming summaries whose memory does not grow with the number of samples.
#pragma once

#include <cstdint>
#include <vector>

namespace moonep::sim {

// Mean, min, max and quantiles of positive values. Quantiles come from a log-spaced histogram over
// [1e-9, 1e9] with buckets 0.1% wide: a quantile is at least the exact sample quantile and at most
// 0.1% above it (values outside the range are clamped into it; mean, min and max are exact).
class Distribution {
 public:
  void Add(double value);
  int64_t count() const { return count_; }
  double mean() const { return count_ > 0 ? sum_ / count_ : 0.0; }
  double min() const { return count_ > 0 ? min_ : 0.0; }
  double max() const { return count_ > 0 ? max_ : 0.0; }
  // The q-quantile, q in [0, 1] (nearest rank); 0 when empty.
  double Quantile(double q) const;

 private:
  int64_t count_ = 0;
  double sum_ = 0, min_ = 0, max_ = 0;
  std::vector<int64_t> buckets_;  // allocated at the first Add
};

// A series of one value per step, kept as at most `capacity` points: each point is the mean (and
// max) of a run of consecutive steps; when the points fill up, neighbours merge and runs double.
class DownsampledSeries {
 public:
  explicit DownsampledSeries(int32_t capacity = 512) : capacity_(capacity) {}
  void Add(double value);
  struct Point {
    double first_step, last_step, mean, max;
  };
  std::vector<Point> Points() const;
  int64_t steps() const { return steps_; }

 private:
  int32_t capacity_;
  int64_t width_ = 1;  // steps per full point
  int64_t steps_ = 0;
  struct Bucket {
    double sum = 0, max = 0;
    int64_t n = 0;
  };
  std::vector<Bucket> buckets_;
};

}  // namespace moonep::sim
