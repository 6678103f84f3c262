// Rate control for background writes: a fixed-rate schedule and an adaptive controller that
// finds a dense drive's write cliff and paces below its sustained rate.
//
// Both are clock-free (times are passed in), so the C++ tests drive them with synthetic traces.
#pragma once

#include <atomic>
#include <cstdint>

namespace flashstream {

// Token schedule with no initial burst: with rate r, the request that brings the bytes admitted
// so far to B may start at start + (B - first request's size) / r. Over a long write the average
// rate (bytes / time) therefore converges on r. (Measured from the first submission to the last
// completion it is slightly above r when the last request finishes within its own share of
// time: at most B / (B - last request's size) x r.) A request admitted late (the caller fell
// behind) starts the schedule again from then: no burst to catch up. rate <= 0 means unpaced.
class Pacer {
 public:
  explicit Pacer(double bytes_per_s = 0) : rate_(bytes_per_s) {}
  // The delay in seconds (>= 0) before a request of `bytes` may be submitted at time `now`
  // (seconds on any monotonic clock). Counts the bytes as admitted at now + delay.
  double admit(uint64_t bytes, double now) noexcept;
  // Changes the rate from `now` on; bytes already admitted keep their times. 0: unpaced.
  void set_rate(double bytes_per_s, double now) noexcept;
  double rate() const noexcept { return rate_; }

 private:
  double rate_;
  double next_ = -1;  // earliest start of the next request; < 0 before the first one
};

// A pacing rate that another thread sets while a write runs, and the write's progress that
// thread reads: the checkpoint writer's planner (in Python) steers a write through this. The
// write applies a new rate at its next request (restarting its schedule there: no burst).
struct RateControl {
  std::atomic<double> rate{0};    // bytes/s from now on; 0: unpaced
  std::atomic<uint64_t> done{0};  // bytes completed so far
};

struct AdaptiveConfig {
  double window = 0.1;        // seconds of completions per throughput measurement
  double cliff_ratio = 0.5;   // a window below cliff_ratio x the running peak is in the cliff
  unsigned cliff_windows = 2; // consecutive such windows that confirm a cliff
  double margin = 0.9;        // pace at margin x the sustained (post-cliff) throughput
  double min_rate = 16.0 * 1024 * 1024;  // never pace below this many bytes/s
};

// Watches per-window write throughput. Until a cliff it leaves the write unpaced (rate 0) and
// tracks the peak. When `cliff_windows` consecutive windows fall below cliff_ratio x peak, it
// takes the median throughput of those windows as the sustained rate and paces at margin x that.
// While paced, a window whose throughput falls below 0.9 x the rate in force (the drive cannot
// keep even that) lowers the rate to margin x that window's throughput; it never raises it
// again within one write (the cache does not refill while we keep writing).
class AdaptiveRate {
 public:
  explicit AdaptiveRate(const AdaptiveConfig& config = {});
  // One finished window: `bytes` completed over `seconds`. Returns the rate to pace at from now
  // on (bytes/s; 0 = unpaced).
  double observe(uint64_t bytes, double seconds) noexcept;
  double rate() const noexcept { return rate_; }
  double peak() const noexcept { return peak_; }            // best window throughput, bytes/s
  double sustained() const noexcept { return sustained_; }  // 0 until a cliff was detected
  bool cliff() const noexcept { return sustained_ > 0; }
  const AdaptiveConfig& config() const noexcept { return config_; }

 private:
  AdaptiveConfig config_;
  double rate_ = 0;
  double peak_ = 0;
  double sustained_ = 0;
  unsigned low_run_ = 0;
  double low_rates_[16] = {};  // the current run of low windows' throughputs (cliff_windows <= 16)
};

}  // namespace flashstream
