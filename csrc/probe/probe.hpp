// Device probe: measures what the drive itself does for one access pattern, as fio would, so
// that every flashstream job can report its speed as a ratio of the device's own.
//
// It keeps exactly queue_depth requests of block_size bytes in flight (refilling each slot as
// its request completes) through the same engines the reader uses, records the latency of every
// request, and optionally the bytes completed per time interval (sustained-write curves: a dense
// drive's write speed drops once its SLC cache is full).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "telemetry/histogram.hpp"

namespace flashstream {

enum class ProbeOp { kRead, kWrite };
enum class ProbePattern { kSequential, kRandom };

// "read" | "write" and "sequential" | "random"; std::invalid_argument naming the allowed values.
ProbeOp parse_probe_op(const std::string& s);
ProbePattern parse_probe_pattern(const std::string& s);

struct ProbeSpec {
  std::string path;  // an existing file (or block device) of the size to probe; never truncated
  ProbeOp op = ProbeOp::kRead;
  ProbePattern pattern = ProbePattern::kSequential;
  size_t block_size = 1 << 20;  // a multiple of the file's O_DIRECT alignment
  unsigned queue_depth = 32;
  uint64_t bytes = 0;           // total to transfer, rounded up to whole blocks; 0: the file once
  double duration = 0;          // stop issuing after this many seconds; 0: no limit
  std::string engine = "auto";  // auto | uring | threads
  bool direct = true;           // O_DIRECT, falling back to buffered I/O where refused
  uint64_t seed = 0;            // random offsets and write data
  double interval = 0;          // timeline resolution in seconds; 0: no timeline (else >= 1 ms)
  // Stop issuing once `stop_after` seconds have passed since the timeline last ran at
  // `stop_below` bytes/s or faster (0: never; needs a timeline), each rate the mean over the
  // last `stop_smooth` seconds (at least one interval), or since the start where it never
  // did: a write that only has to reach a drive's write cliff ends that long after it, however
  // long it ran before, instead of writing on in it. (The smoothing spans the bursts in which
  // a throttle or a drive completes requests.)
  double stop_below = 0;
  double stop_after = 0;
  double stop_smooth = 0;
  // Once set (by another thread), stop issuing; the requests in flight complete (the caller
  // has something more urgent to write: a checkpoint waiting for a measurement).
  const std::atomic<bool>* cancel = nullptr;
};

struct TimelinePoint {
  double seconds;  // end of the interval, since the first request was submitted
  uint64_t bytes;  // bytes whose requests completed within the interval
};

struct ProbeResult {
  uint64_t bytes = 0;         // bytes transferred
  double seconds = 0;         // first submission to last completion (the sync is not included)
  double sync_seconds = 0;    // fdatasync after the writes (0 for reads)
  uint64_t requests = 0;      // completions, one latency sample each
  LatencyHistogram latency;   // submit -> completion per request, ns
  bool direct = false;        // whether O_DIRECT was in effect for the whole run
  std::string engine;         // "uring" or "threads"
  std::vector<TimelinePoint> timeline;  // the last interval may be shorter than `interval`
};

// Sequential offsets walk the file from 0 in block_size steps and wrap around before a partial
// last block; random offsets are uniform multiples of block_size within the file (like fio's
// default blockalign). Throws std::invalid_argument for a bad spec (zero depth, block_size not
// aligned, file smaller than one block, ...) before any I/O, and IoError for I/O failures
// (ENOSPC, EIO, ...) after waiting for the requests still in flight.
ProbeResult run_probe(const ProbeSpec& spec);

// Creates (or resizes) `path` to exactly `size` bytes, preallocated and filled with
// incompressible data by large aligned O_DIRECT writes, then synced: reads of a probe file
// then measure the medium, not holes. A file this call created is removed if it fails.
void create_probe_file(const std::string& path, uint64_t size);

}  // namespace flashstream
