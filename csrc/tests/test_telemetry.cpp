// Unit tests for the latency histogram: bucket layout, percentiles against exact sorted
// percentiles of known distributions, merging, and edge values.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "telemetry/histogram.hpp"
#include "telemetry/recorder.hpp"
#include "tests/check.hpp"

using namespace flashstream;
using H = LatencyHistogram;

namespace {

constexpr double kQuantiles[] = {50, 95, 99, 99.9};

// Nearest-rank percentile of sorted samples, the definition percentile() implements.
uint64_t exact_percentile(const std::vector<uint64_t>& sorted, double q) {
  const size_t rank = static_cast<size_t>(std::ceil(q / 100.0 * sorted.size() * (1 - 1e-12)));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

double rel_error(uint64_t got, uint64_t want) {
  return std::fabs(double(got) - double(want)) / std::max(1.0, double(want));
}

std::vector<uint64_t> draw(size_t n, const std::function<double()>& gen) {
  std::vector<uint64_t> v(n);
  for (auto& x : v) x = static_cast<uint64_t>(std::max(0.0, gen()));
  return v;
}

// Records the samples and checks every statistic against the exact values.
void check_against_exact(std::vector<uint64_t> samples) {
  H h;
  uint64_t sum = 0;
  for (uint64_t v : samples) {
    h.record(v);
    sum += v;
  }
  std::sort(samples.begin(), samples.end());
  CHECK(h.count() == samples.size());
  CHECK(h.sum() == sum);
  CHECK(h.min() == samples.front() && h.max() == samples.back());
  for (double q : kQuantiles) {
    const uint64_t want = exact_percentile(samples, q);
    const double err = rel_error(h.percentile(q), want);
    if (err > 0.01)
      std::fprintf(stderr, "  p%g: got %llu want %llu (%.4f)\n", q,
                   (unsigned long long)h.percentile(q), (unsigned long long)want, err);
    CHECK(err <= 0.01);
  }
  CHECK(h.percentile(0) == samples.front());
  CHECK(h.percentile(100) == samples.back());
}

bool same(const H& a, const H& b) {
  return a.count() == b.count() && a.sum() == b.sum() && a.min() == b.min() &&
         a.max() == b.max() && std::equal(a.counts(), a.counts() + H::kBuckets, b.counts());
}

}  // namespace

TEST_CASE("layout: contiguous buckets, index inverts lower bound, width below 1/128") {
  CHECK(H::kMaxValue >= 3600ull * 1000 * 1000 * 1000);  // at least one hour in ns
  CHECK(H::bucket_lower(0) == 0 && H::bucket_width(0) == 1);
  for (size_t i = 0; i < H::kBuckets; ++i) {
    const uint64_t lo = H::bucket_lower(i), w = H::bucket_width(i);
    CHECK(H::bucket_index(lo) == i);
    CHECK(H::bucket_index(lo + w - 1) == i);
    if (i + 1 < H::kBuckets) CHECK(H::bucket_lower(i + 1) == lo + w);
    if (i >= H::kSubBuckets) CHECK(w * H::kSubBuckets <= lo);
    CHECK(H::bucket_value(i) >= lo && H::bucket_value(i) < lo + w);
  }
  const size_t last = H::kBuckets - 1;
  CHECK(H::bucket_lower(last) + H::bucket_width(last) - 1 == H::kMaxValue);
  CHECK(H::bucket_index(H::kMaxValue) == last && H::bucket_index(UINT64_MAX) == last);
}

TEST_CASE("percentiles within 1%: uniform, exponential, lognormal (1e5 samples)") {
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> uniform(1e3, 1e7);       // 1 us .. 10 ms
  std::exponential_distribution<double> expo(1.0 / 100e3);        // mean 100 us
  std::lognormal_distribution<double> lognorm(std::log(200e3), 1.0);  // median 200 us
  check_against_exact(draw(100000, [&] { return uniform(rng); }));
  check_against_exact(draw(100000, [&] { return expo(rng); }));
  check_against_exact(draw(100000, [&] { return lognorm(rng); }));
  // Heavy spread: nanoseconds to minutes in one histogram.
  std::lognormal_distribution<double> wide(std::log(1e5), 3.0);
  check_against_exact(draw(100000, [&] { return wide(rng); }));
}

TEST_CASE("percentiles are exact for small values and few samples") {
  std::vector<uint64_t> small;
  for (uint64_t v = 0; v < 128; ++v) small.push_back(v);
  H h;
  for (uint64_t v : small) h.record(v);
  for (double q : {1.0, 10.0, 50.0, 99.0, 99.9})
    CHECK(h.percentile(q) == exact_percentile(small, q));
  H two;
  two.record(1000);
  two.record(5000);
  // p50 is the first sample's bucket (midpoint 1002), p50.1 the second's, held at max.
  CHECK(two.percentile(50) >= 1000 && two.percentile(50) <= 1010);
  CHECK(two.percentile(50.1) == 5000);
  H one;
  one.record(123456789);
  CHECK(one.percentile(0) == 123456789 && one.percentile(50) == 123456789 &&
        one.percentile(100) == 123456789);
}

TEST_CASE("merge equals recording both") {
  std::mt19937_64 rng(7);
  std::exponential_distribution<double> fast(1.0 / 20e3);
  std::lognormal_distribution<double> slow(std::log(5e6), 0.5);
  H a, b, both;
  for (int i = 0; i < 50000; ++i) {
    const uint64_t x = static_cast<uint64_t>(fast(rng)), y = static_cast<uint64_t>(slow(rng));
    a.record(x);
    b.record(y);
    both.record(x);
    both.record(y);
  }
  H merged = a;
  merged.merge(b);
  CHECK(same(merged, both));
  for (double q : kQuantiles) CHECK(merged.percentile(q) == both.percentile(q));
  H empty, copy = a;
  copy.merge(empty);
  CHECK(same(copy, a));
  empty.merge(a);
  CHECK(same(empty, a));
  merged.reset();
  CHECK(same(merged, H()) && merged.count() == 0 && merged.min() == 0);
}

TEST_CASE("edge values: 0, 1, one hour, huge; empty histogram") {
  H e;
  CHECK(e.count() == 0 && e.min() == 0 && e.max() == 0 && e.percentile(50) == 0 && e.mean() == 0);
  H h;
  h.record(0);
  CHECK(h.percentile(50) == 0 && h.min() == 0 && h.max() == 0);
  h.record(1);
  CHECK(h.percentile(100) == 1 && h.percentile(50) == 0);
  const uint64_t hour = 3600ull * 1000 * 1000 * 1000;
  H big;
  big.record(hour);
  big.record(hour + 1);
  CHECK(rel_error(big.percentile(50), hour) <= 0.01 && big.max() == hour + 1);
  H huge;
  huge.record(UINT64_MAX);  // clamped, never an out-of-range index or an overflowing sum
  huge.record(UINT64_MAX);
  CHECK(huge.max() == H::kMaxValue && huge.min() == H::kMaxValue);
  CHECK(huge.sum() == 2 * H::kMaxValue && huge.percentile(99) == H::kMaxValue);
  CHECK(huge.counts()[H::kBuckets - 1] == 2);
  CHECK(h.percentile(std::nan("")) == h.min() && h.percentile(-5) == h.min());
  CHECK(h.percentile(250) == h.max());
}

TEST_MAIN()

TEST_CASE("recorder: threads recording at once lose nothing; snapshot(reset) starts over") {
  LatencyRecorder rec;
  constexpr int kThreads = 4, kEach = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&rec, t] {
      for (int i = 0; i < kEach; ++i) rec.record(static_cast<uint64_t>(1000 * (t + 1) + i % 7));
    });
  for (auto& th : threads) th.join();
  const H all = rec.snapshot(true);
  CHECK(all.count() == uint64_t(kThreads) * kEach);
  CHECK(all.min() == 1000 && all.max() == 4006);
  CHECK(rec.snapshot(false).count() == 0);
  const uint64_t start = monotonic_ns();
  const uint64_t took = rec.stop(start);
  CHECK(took < 1000000000ull);  // now - start, not the clock's raw value
  CHECK(rec.stop(start + 3600ull * 1000000000ull) == 0);  // a start in the future records 0
  CHECK(rec.snapshot(false).count() == 2);
}
