// Sequential reader over a list of byte ranges ("extents") of files, e.g. whole tar shards.
//
// Reads chunk_size pieces with aligned O_DIRECT requests, keeps queue_depth of them in flight,
// and runs ahead across extent boundaries so the next shard is already being read while the
// current one is scanned. Chunks are delivered strictly in order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/engine.hpp"
#include "telemetry/histogram.hpp"

namespace flashstream {

constexpr uint64_t kToEnd = UINT64_MAX;

struct Extent {
  std::string path;
  uint64_t start = 0;       // first byte wanted
  uint64_t end = kToEnd;    // one past the last byte wanted; clamped to the file size
};

struct ReaderOptions {
  size_t chunk_size = 4 << 20;  // rounded up to the file's O_DIRECT alignment
  unsigned queue_depth = 8;     // reads in flight
  std::string engine = "auto";  // auto | uring | threads
  bool direct = true;           // try O_DIRECT (falls back per file, see InputFile)
};

struct Chunk {
  uint32_t extent = 0;     // index into the extent list
  uint64_t offset = 0;     // file offset of data[0]
  const uint8_t* data = nullptr;
  size_t size = 0;         // bytes of [start, end) in this chunk; 0 only for an empty extent
  bool first = false;      // first chunk of its extent
  bool last = false;       // last chunk of its extent
};

struct ReaderStats {
  uint64_t bytes_read = 0;      // bytes transferred from the files (including alignment over-read)
  uint64_t requests = 0;        // read requests completed
  uint64_t short_reads = 0;     // requests that had to be resubmitted for the remainder
  uint64_t registered_requests = 0;  // submissions into buffers registered with the engine
  uint64_t direct_files = 0;    // files opened with O_DIRECT
  uint64_t buffered_files = 0;  // files that fell back to buffered reads
  // Total time next() spent blocked waiting for data. Small next to the caller's wall time:
  // the consumer is the bottleneck; large: reading is.
  uint64_t wait_ns = 0;
  // Submit -> completion time of every read request (steady clock, ns). Completions are only
  // seen when next() looks for them, so while the consumer is the bottleneck a request that
  // finished during its work is counted as finishing when next() was called: the values are
  // then upper bounds of the device latency.
  LatencyHistogram latency;
};

class SequentialReader {
 public:
  SequentialReader(std::vector<Extent> extents, ReaderOptions options);
  // close()s. In a process other than the creator (a fork() child) it touches nothing and leaks
  // the reader instead: see common/owner_process.hpp.
  ~SequentialReader();
  SequentialReader(const SequentialReader&) = delete;
  SequentialReader& operator=(const SequentialReader&) = delete;

  // Not thread-safe: one call at a time. Every call but stats() and engine_name() throws
  // ForkedError in a process other than the creator, and std::logic_error after close().

  // Blocks until the next chunk in order is complete. Returns false after the last chunk.
  // Every extent yields at least one chunk (an empty file yields one chunk with size 0, first
  // and last set). `out.data` stays valid until the next call to next() or skip_extent().
  // Errors of an extent (open failure, read error) are thrown as IoError when that extent's
  // turn comes, never earlier; after an error, call skip_extent() to go on with the next one.
  bool next(Chunk& out);

  // Drops the rest of the current extent (the one whose chunk was delivered last, or which
  // raised); the next call to next() returns the first chunk of the following extent.
  void skip_extent();

  // Waits for (and discards) requests still in flight, then closes the files and the engine.
  // The chunk buffers stay until destruction, so data a caller still points at stays readable
  // (it holds the last bytes read into it). Idempotent; a no-op in another process.
  void close() noexcept;
  bool closed() const noexcept;

  const char* engine_name() const noexcept;
  const ReaderStats& stats() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashstream
