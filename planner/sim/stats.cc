#include "planner/sim/stats.h"

#include <algorithm>
#include <cmath>

namespace moonep::sim {

namespace {

constexpr double kLow = 1e-9;
constexpr double kGrowth = 1.001;
const double kLogGrowth = std::log(kGrowth);
const int32_t kBuckets = static_cast<int32_t>(std::ceil(std::log(1e9 / kLow) / std::log(kGrowth))) + 1;

int32_t BucketOf(double v) {
  if (!(v > kLow)) return 0;  // NaN too
  const double b = std::log(v / kLow) / kLogGrowth;
  // Compared as a double first: an infinite or huge value must not reach the integer cast.
  if (!(b < kBuckets - 1)) return kBuckets - 1;
  return static_cast<int32_t>(b);
}

}  // namespace

void Distribution::Add(double v) {
  if (count_ == 0) {
    buckets_.assign(kBuckets, 0);
    min_ = max_ = v;
  }
  ++count_;
  sum_ += v;
  min_ = std::min(min_, v);
  max_ = std::max(max_, v);
  ++buckets_[BucketOf(v)];
}

double Distribution::Quantile(double q) const {
  if (count_ == 0) return 0.0;
  q = std::clamp(q, 0.0, 1.0);
  // Nearest rank: the smallest value with at least ceil(q * n) samples at or below it.
  const int64_t rank = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(q * count_)));
  int64_t seen = 0;
  for (int32_t b = 0; b < kBuckets; ++b) {
    seen += buckets_[b];
    if (seen >= rank) {
      // The bucket's upper edge: never below the exact quantile, at most 0.1% above it.
      const double upper = kLow * std::pow(kGrowth, b + 1.0);
      return std::clamp(upper, min_, max_);
    }
  }
  return max_;
}

void DownsampledSeries::Add(double v) {
  if (buckets_.empty() || buckets_.back().n == width_) {
    if (static_cast<int32_t>(buckets_.size()) == capacity_) {
      // Merge neighbours: half as many points, each twice as wide.
      std::vector<Bucket> merged;
      for (size_t i = 0; i < buckets_.size(); i += 2) {
        Bucket b = buckets_[i];
        if (i + 1 < buckets_.size()) {
          b.sum += buckets_[i + 1].sum;
          b.n += buckets_[i + 1].n;
          b.max = std::max(b.max, buckets_[i + 1].max);
        }
        merged.push_back(b);
      }
      buckets_.swap(merged);
      width_ *= 2;
    }
    if (buckets_.empty() || buckets_.back().n == width_) buckets_.push_back(Bucket{0, v, 0});
  }
  Bucket& b = buckets_.back();
  b.sum += v;
  b.max = std::max(b.max, v);
  ++b.n;
  ++steps_;
}

std::vector<DownsampledSeries::Point> DownsampledSeries::Points() const {
  std::vector<Point> out;
  int64_t step = 0;
  for (const Bucket& b : buckets_) {
    out.push_back(Point{static_cast<double>(step), static_cast<double>(step + b.n - 1), b.sum / b.n, b.max});
    step += b.n;
  }
  return out;
}

}  // namespace moonep::sim
