#include "io/pacing.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace flashstream {

double Pacer::admit(uint64_t bytes, double now) noexcept {
  if (!(rate_ > 0)) {
    next_ = now;  // unpaced: no debt carried into a later paced stretch
    return 0;
  }
  // A request never starts before its turn, and never before now: falling behind restarts the
  // schedule from now rather than bursting to catch up.
  const double start = std::max(now, next_);
  next_ = start + static_cast<double>(bytes) / rate_;
  return start - now;
}

void Pacer::set_rate(double bytes_per_s, double now) noexcept {
  if (!(bytes_per_s > 0)) bytes_per_s = 0;
  // What is still owed at the old rate (next_ - now seconds of it) is owed at the new one too.
  if (rate_ > 0 && next_ > now) {
    next_ = bytes_per_s > 0 ? now + (next_ - now) * rate_ / bytes_per_s : now;
  }
  rate_ = bytes_per_s;
}

AdaptiveRate::AdaptiveRate(const AdaptiveConfig& config) : config_(config) {
  auto bad = [](const std::string& what) { throw std::invalid_argument(what); };
  if (!(config.window > 0)) bad("adaptive window must be > 0 seconds");
  if (!(config.cliff_ratio > 0 && config.cliff_ratio < 1))
    bad("cliff_ratio must be between 0 and 1 (exclusive)");
  if (config.cliff_windows < 1 || config.cliff_windows > 16)
    bad("cliff_windows must be from 1 to 16");
  if (!(config.margin > 0 && config.margin <= 1)) bad("margin must be in (0, 1]");
  if (!(config.min_rate >= 0) || !std::isfinite(config.min_rate)) bad("min_rate must be >= 0");
}

double AdaptiveRate::observe(uint64_t bytes, double seconds) noexcept {
  if (!(seconds > 0)) return rate_;
  const double tput = static_cast<double>(bytes) / seconds;
  if (cliff()) {
    // Paced, and the drive cannot keep even that: step down, never up.
    if (tput < 0.9 * rate_)
      rate_ = std::min(rate_, std::max(config_.min_rate, config_.margin * tput));
    return rate_;
  }
  if (peak_ > 0 && tput < config_.cliff_ratio * peak_) {
    low_rates_[low_run_++] = tput;
    if (low_run_ >= config_.cliff_windows) {
      double* end = low_rates_ + low_run_;
      std::sort(low_rates_, end);
      const unsigned mid = low_run_ / 2;
      sustained_ = (low_run_ % 2) ? low_rates_[mid] : 0.5 * (low_rates_[mid - 1] + low_rates_[mid]);
      if (!(sustained_ > 0)) sustained_ = config_.min_rate > 0 ? config_.min_rate : 1.0;
      rate_ = std::max(config_.min_rate, config_.margin * sustained_);
      low_run_ = 0;
    }
    return rate_;
  }
  low_run_ = 0;  // a good window breaks the run: a single slow window is noise
  peak_ = std::max(peak_, tput);
  return rate_;
}

}  // namespace flashstream
