// A latency histogram that many threads record into: the per-call timer behind
// IndexReader.search.
//
// record() takes a mutex around LatencyHistogram::record (O(1), no allocation); uncontended that
// costs tens of nanoseconds, far below a search, and callers that record from Python already
// serialize on the GIL. stop(start_ns) reads CLOCK_MONOTONIC itself, the clock behind Python's
// time.perf_counter_ns() and time.monotonic_ns() on Linux, so one call from Python both ends
// the timing and records it.
#pragma once

#include <time.h>

#include <cstdint>
#include <mutex>

#include "telemetry/histogram.hpp"

namespace flashstream {

inline uint64_t monotonic_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
}

class LatencyRecorder {
 public:
  void record(uint64_t ns) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    hist_.record(ns);
  }
  // Records now - start_ns (0 when start_ns lies in the future) and returns it.
  uint64_t stop(uint64_t start_ns) noexcept {
    const uint64_t now = monotonic_ns();
    const uint64_t ns = now > start_ns ? now - start_ns : 0;
    record(ns);
    return ns;
  }
  // A copy of the counts so far; with reset, the recorder starts over atomically with the copy.
  LatencyHistogram snapshot(bool reset) {
    std::lock_guard<std::mutex> lock(mu_);
    LatencyHistogram copy = hist_;
    if (reset) hist_.reset();
    return copy;
  }

 private:
  std::mutex mu_;
  LatencyHistogram hist_;
};

}  // namespace flashstream
