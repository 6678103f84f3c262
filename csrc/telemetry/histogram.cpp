#include "telemetry/histogram.hpp"

#include <algorithm>
#include <cmath>

namespace flashstream {

// Inverse of bucket_index(): index = shift * 128 + (v >> shift) with (v >> shift) in
// [128, 256), so i / 128 == shift + 1 and (v >> shift) == 128 + i % 128.
uint64_t LatencyHistogram::bucket_lower(size_t i) noexcept {
  if (i < kSubBuckets) return i;
  const unsigned shift = static_cast<unsigned>(i / kSubBuckets) - 1;
  return (kSubBuckets + i % kSubBuckets) << shift;
}

uint64_t LatencyHistogram::bucket_width(size_t i) noexcept {
  if (i < kSubBuckets) return 1;
  return uint64_t(1) << (i / kSubBuckets - 1);
}

void LatencyHistogram::merge(const LatencyHistogram& other) noexcept {
  for (size_t i = 0; i < kBuckets; ++i) counts_[i] += other.counts_[i];
  count_ += other.count_;
  sum_ += other.sum_;
  min_ = std::min(min_, other.min_);
  max_ = std::max(max_, other.max_);
}

void LatencyHistogram::reset() noexcept {
  std::fill(counts_.begin(), counts_.end(), 0);
  count_ = sum_ = max_ = 0;
  min_ = UINT64_MAX;
}

uint64_t LatencyHistogram::percentile(double q) const noexcept {
  if (count_ == 0) return 0;
  if (!(q > 0)) return min_;  // also NaN
  if (q >= 100) return max_;
  // Rank of the wanted sample, 1-based (sorted[rank - 1]). The tiny shrink keeps a product that
  // is an integer in exact arithmetic (99.9% of 1e5) from rounding up to the next rank.
  const double exact = q / 100.0 * static_cast<double>(count_);
  uint64_t rank = static_cast<uint64_t>(std::ceil(exact * (1.0 - 1e-12)));
  rank = std::clamp<uint64_t>(rank, 1, count_);
  uint64_t seen = 0;
  for (size_t i = 0; i < kBuckets; ++i) {
    seen += counts_[i];
    if (seen >= rank) return std::clamp(bucket_value(i), min_, max_);
  }
  return max_;
}

}  // namespace flashstream
