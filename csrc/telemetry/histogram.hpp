// Log-bucketed latency histogram (HDR style) for per-request latencies in nanoseconds.
//
// Values below 128 get one bucket each. Above that, every power-of-two magnitude [2^m, 2^(m+1))
// is split into 128 equal sub-buckets, so a bucket is at most 1/128 of its lower bound wide and
// its midpoint is within 1/256 (0.4%) of any value in it. Values above kMaxValue (about 2.4
// hours) are clamped to it. Memory is fixed (kBuckets counters, allocated once at construction);
// record() is O(1) with no allocation and no locks: keep one histogram per thread or reader and
// merge() them afterwards.
//
// The bucket layout is static, so counts exported elsewhere (Python/numpy) can be turned into
// percentiles with bucket_lower() alone: bucket i holds [lower(i), lower(i+1)), and its
// representative value is lower(i) + width(i) / 2 (integer division), as percentile() returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace flashstream {

class LatencyHistogram {
 public:
  static constexpr unsigned kSubBits = 7;              // 128 sub-buckets per magnitude
  static constexpr uint64_t kSubBuckets = 1u << kSubBits;
  static constexpr unsigned kMaxMagnitude = 42;        // top bucket group: [2^42, 2^43)
  static constexpr uint64_t kMaxValue = (uint64_t(1) << (kMaxMagnitude + 1)) - 1;
  static constexpr size_t kBuckets = (kMaxMagnitude - kSubBits + 2) * kSubBuckets;

  LatencyHistogram() : counts_(kBuckets, 0) {}

  static size_t bucket_index(uint64_t v) noexcept {
    if (v < kSubBuckets) return static_cast<size_t>(v);
    if (v > kMaxValue) v = kMaxValue;
    const unsigned shift = (63u - static_cast<unsigned>(__builtin_clzll(v))) - kSubBits;
    return static_cast<size_t>(shift) * kSubBuckets + static_cast<size_t>(v >> shift);
  }
  static uint64_t bucket_lower(size_t i) noexcept;
  static uint64_t bucket_width(size_t i) noexcept;
  // The value percentile() reports for bucket i: its midpoint (its only value when width is 1).
  static uint64_t bucket_value(size_t i) noexcept { return bucket_lower(i) + bucket_width(i) / 2; }

  void record(uint64_t ns) noexcept {
    if (ns > kMaxValue) ns = kMaxValue;
    ++counts_[bucket_index(ns)];
    ++count_;
    sum_ += ns;
    if (ns < min_) min_ = ns;
    if (ns > max_) max_ = ns;
  }
  void merge(const LatencyHistogram& other) noexcept;
  void reset() noexcept;

  // Nearest-rank percentile, q in [0, 100]: the representative value of the bucket holding the
  // ceil(q/100 * count)-th smallest sample, kept within [min, max]. 0 when empty.
  uint64_t percentile(double q) const noexcept;

  uint64_t count() const noexcept { return count_; }
  uint64_t sum() const noexcept { return sum_; }   // of clamped values
  uint64_t min() const noexcept { return count_ ? min_ : 0; }
  uint64_t max() const noexcept { return max_; }
  double mean() const noexcept { return count_ ? double(sum_) / double(count_) : 0.0; }
  const uint64_t* counts() const noexcept { return counts_.data(); }  // kBuckets entries

 private:
  std::vector<uint64_t> counts_;  // heap, not inline: ~37 KiB would be heavy on small stacks
  uint64_t count_ = 0;
  uint64_t sum_ = 0;
  uint64_t min_ = UINT64_MAX;
  uint64_t max_ = 0;
};

}  // namespace flashstream
