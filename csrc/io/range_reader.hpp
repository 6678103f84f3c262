// Scattered reads of one file in one call: a list of (file offset, length) ranges, each read
// into its own place of one caller-owned memory region, every request in flight at once.
//
// This is how a disk-resident IVF index fetches the inverted lists a search batch probes: they
// lie scattered through the file, and a search waits for all of them, so they are submitted
// together (as SPANN-style disk indexes do) instead of faulted in one page at a time. The
// region is the caller's (an image of the file), so nothing is copied.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/owner_process.hpp"
#include "io/engine.hpp"
#include "io/file.hpp"

namespace flashstream {

struct ReadRange {
  uint64_t offset;  // file offset of the first byte
  uint64_t length;  // bytes (0: nothing to read)
  uint64_t dest;    // region offset the first byte goes to
};

struct RangeOptions {
  std::string engine = "auto";          // auto | uring | threads
  unsigned queue_depth = 32;            // requests in flight
  // A range longer than this is cut into requests of this size, so one long list is read by
  // several requests in flight rather than one at a time (a multiple of the alignment).
  size_t request_size = size_t(128) << 10;
};

struct RangeStats {
  uint64_t bytes = 0;     // bytes read from the file (past its end: not counted)
  uint64_t requests = 0;  // requests completed, resubmitted remainders included
  double seconds = 0;     // first submission to last completion
  uint64_t max_ns = 0;    // slowest request, submission to completion
  uint64_t sum_ns = 0;    // all requests' latencies added up
  std::string engine;     // "uring" or "threads"
  bool direct = false;    // the reads went with O_DIRECT
};

// One file opened for scattered reads (O_DIRECT where the filesystem takes it, else buffered;
// `direct()` says which). Its size is fixed at open: it serves files that are replaced, never
// changed in place.
//
// read() may be called from many threads at once: each call takes its own engine (an io_uring
// or a pread pool) from an idle pool, so one call's requests never wait behind another's
// bookkeeping, and engines are made once, not per call. close() waits for calls in progress.
// In a fork() child every call is refused (ForkedError) and the engines are leaked, not torn
// down (see common/owner_process.hpp).
class RangeFile {
 public:
  RangeFile(const std::string& path, bool want_direct);
  ~RangeFile();
  RangeFile(const RangeFile&) = delete;
  RangeFile& operator=(const RangeFile&) = delete;

  // Reads file[r.offset, r.offset + r.length) into region[r.dest, r.dest + r.length) for each
  // range. With O_DIRECT, offsets and lengths must be multiples of alignment().offset and
  // region + dest of alignment().memory (std::invalid_argument naming the range otherwise);
  // every range must lie inside the region. A range may run past the end of the file only
  // within its last alignment unit (an aligned tail): those bytes of the region are left as
  // they were. Short reads are resubmitted; a read that finds the file shorter than it was at
  // open throws IoError(ENODATA) naming the offset; other errors throw IoError naming the path
  // and offset, after every request in flight has come back (until then the kernel may still
  // write into the region).
  RangeStats read(uint8_t* region, uint64_t region_size, const std::vector<ReadRange>& ranges,
                  const RangeOptions& options);

  void close() noexcept;  // waits for reads in progress; idempotent

  bool direct() const noexcept { return direct_.load(std::memory_order_relaxed); }
  uint64_t size() const noexcept { return size_; }
  const DioAlignment& alignment() const noexcept { return align_; }
  const std::string& path() const noexcept { return path_; }

 private:
  friend class RangeTransfer;
  using Pooled = std::pair<std::string, std::unique_ptr<IoEngine>>;

  std::unique_ptr<IoEngine> take_engine(const RangeOptions& options, std::string* key);
  void give_back(std::string key, std::unique_ptr<IoEngine> engine) noexcept;
  void drop_direct();  // the filesystem refused an O_DIRECT request: go on buffered

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  DioAlignment align_;
  std::atomic<bool> direct_{false};
  OwnerProcess owner_;
  std::shared_mutex open_mu_;  // reads share it; close() takes it alone
  std::mutex pool_mu_;
  std::vector<Pooled> idle_;
};

}  // namespace flashstream
