// Whole-file transfers between one caller-owned memory region and one file, as large aligned
// requests kept in flight: the checkpoint writer's writes (paced, checksummed) and its loader's
// reads. The memory is the caller's (a reused staging buffer), so nothing is copied.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/file.hpp"
#include "io/pacing.hpp"
#include "telemetry/histogram.hpp"

namespace flashstream {

struct BulkOptions {
  size_t chunk_size = size_t(8) << 20;  // bytes per request (a multiple of the alignment)
  // Bytes per request while a write is paced (0: chunk_size). A paced write has time to spare,
  // so it gives up nothing by cutting its requests small, and a read that arrives behind one
  // waits for a 1 MiB request, not an 8 MiB one (benchmarks/reads_beside_writes.py measures
  // the reads' p95 both ways).
  size_t paced_chunk_size = 0;
  unsigned queue_depth = 8;
  std::string engine = "auto";          // auto | uring | threads
  double rate = 0;                      // fixed pacing in bytes/s; 0: unpaced
  bool adaptive = false;                // pace with AdaptiveRate (then `rate` is the ceiling)
  AdaptiveConfig adaptive_config;
  double interval = 0.05;               // timeline resolution, seconds (>= 0.001)
  // Set by another thread while the write runs; when present it alone sets the pace.
  std::shared_ptr<RateControl> control;
};

struct RatePoint {
  double seconds;  // end of the interval since the first submission
  uint64_t bytes;  // bytes whose requests completed within the interval
  double rate;     // pacing rate in force at the end of the interval (0: unpaced)
};

struct BulkStats {
  uint64_t bytes = 0;       // bytes transferred
  double seconds = 0;       // first submission to last completion
  uint64_t requests = 0;    // completed requests, one latency sample each
  LatencyHistogram latency; // per request, submit -> completion, ns
  double paused = 0;        // seconds spent waiting on the pacer
  std::vector<RatePoint> timeline;
  double peak = 0;          // adaptive: best window throughput (bytes/s)
  double sustained = 0;     // adaptive: sustained throughput after a cliff; 0 if none seen
  double final_rate = 0;    // pacing rate in force at the end (0: unpaced)
  std::string engine;       // the engine that ran the transfer: "uring" or "threads"
};

// A file being written from memory. Open with O_DIRECT where the filesystem allows it (else
// buffered, `direct()` says so); space for `size` bytes is reserved up front with fallocate, so a
// full disk fails here (ENOSPC) before any data is written. Filesystems without fallocate skip
// the reservation. The file is created new (O_EXCL); the destructor closes it without syncing.
class OutputFile {
 public:
  // Creates `path` (it must not exist), or with `existing` opens the regular file already
  // there to write over its blocks (a recycled checkpoint file: no block allocation, and no
  // discard of the old file's blocks). Either way `size` bytes are reserved (fallocate).
  OutputFile(const std::string& path, uint64_t size, bool want_direct, bool existing = false);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  // Writes data[0, len) at file offset `offset` in requests of chunk_size, queue_depth in
  // flight, paced as `options` says. With O_DIRECT, `data`, `offset` and `len` must be multiples
  // of alignment() (std::invalid_argument otherwise): pad the tail and commit() the exact size.
  // `crc_bounds` splits [0, len) into segments [b[i], b[i+1]) (sorted, first 0, last <= len);
  // the CRC-32C of each is computed chunk by chunk as the chunk is submitted, and returned in
  // `crcs` (one per segment). Short writes are resubmitted; an I/O error (ENOSPC, EIO) is thrown
  // as IoError naming the path and offset once all requests in flight have come back.
  BulkStats write(const uint8_t* data, uint64_t len, uint64_t offset, const BulkOptions& options,
                  const std::vector<uint64_t>& crc_bounds, std::vector<uint32_t>* crcs);

  // Sets the file size to `size` (drops the alignment padding), fdatasync, close. Returns the
  // seconds the sync took.
  double commit(uint64_t size);
  void close() noexcept;  // without syncing (abandoning the file); idempotent

  bool direct() const noexcept { return direct_; }
  const DioAlignment& alignment() const noexcept { return align_; }
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  DioAlignment align_;
};

// Reads `path`'s bytes [0, len) into data[0, len) with chunk_size requests, queue_depth in
// flight, O_DIRECT where allowed (the tail request is rounded up to the alignment, so `data`
// must have room for align_up(len, alignment) bytes: `capacity`). Throws IoError naming the path
// and offset; a file shorter than `len` throws IoError(ENODATA) naming the first missing offset.
// Rate fields of `options` are ignored.
BulkStats read_file_into(const std::string& path, uint8_t* data, uint64_t len, uint64_t capacity,
                         const BulkOptions& options, bool want_direct, bool* direct);

}  // namespace flashstream
