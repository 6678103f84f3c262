// Index tar shards (where each sample starts and ends) without reading their payloads.
//
// Header hopping: a shard's scanner runs in index-only mode; the indexer reads the block that
// holds the next header, lets the scanner take it, then jumps over the member's data straight
// to the following header. Each shard has one read in flight (the next position depends on the
// header just read), so many shards are hopped at once, up to the queue depth, through the
// engine (io_uring or the thread pool).
//
// Hopping costs one small read per header run. Where members are small, reading everything is
// cheaper: after `decide_after` reads of a shard, if it advanced fewer than `hop_threshold`
// bytes per read on average, the rest of it is read sequentially (large reads in flight,
// through the SequentialReader) into the same scanner. The index, and any error, are the same
// either way, and the same as the full scan's (same scanner, same rules).
//
// Shards that start with a compression magic (gzip, bzip2, xz) cannot be hopped (offsets count
// in the decompressed stream) and are left to the caller, as are shards whose extensions need
// Python's Unicode rules and shards that changed while indexed (see kNeedsFullScan).
//
// Equal to the full scan means: the same samples and the same format errors for a file that
// does not change meanwhile. Read errors can differ: a bad sector inside member data fails a
// full read but is never read by hopping.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashstream {

struct IndexOptions {
  std::string engine = "auto";   // auto | uring | threads
  unsigned queue_depth = 32;     // reads in flight: shards hopped at once, or sequential reads
  bool direct = true;            // O_DIRECT where the filesystem allows it
  size_t chunk_size = 1 << 20;   // bytes per sequential read
  size_t hop_read = 4096;        // bytes per hop read (rounded up to the file's alignment)
  // Mean bytes advanced per hop read below which a shard is read sequentially instead.
  // 0: always hop; UINT64_MAX: never hop (read every shard sequentially).
  uint64_t hop_threshold = 64 << 10;
  unsigned decide_after = 8;     // hop reads of a shard before judging it
  // Polled every 50 ms or so from the indexing thread; returning true stops the run with
  // IndexCancelled (reads in flight are waited for first). E.g. a pending Ctrl-C.
  std::function<bool()> cancelled;
};

// Thrown by index_shards when options.cancelled() returned true.
struct IndexCancelled : std::runtime_error {
  IndexCancelled() : std::runtime_error("indexing cancelled") {}
};

enum class ShardOutcome : uint8_t {
  kIndexed,        // whole shard indexed
  kFailed,         // `error` holds the FormatError or IoError; offsets hold the samples before
                   // it (and, for a FormatError, the group of members open at it)
  kCompressed,     // starts with a compression magic: not indexed here
  kNeedsFullScan,  // a field extension that is not ASCII, or "__local_path__" (webdataset's
                   // sample dict, i.e. Python's str.lower, decides whether two fields
                   // collide); or a shard that changed while it was indexed
};

struct ShardIndexResult {
  ShardOutcome outcome = ShardOutcome::kIndexed;
  std::vector<int64_t> offsets;  // first header of each sample
  std::vector<int64_t> ends;     // just past each sample's last member (padding included)
  std::exception_ptr error;
  bool sequential = false;  // read sequentially after the first hops (members too small)
  uint64_t hops = 0;        // hop reads
};

struct IndexStats {
  uint64_t bytes_read = 0;
  uint64_t requests = 0;
  std::string engine;              // "uring" or "threads"
};

// One result per path, in order. Errors of one shard (open, read, format) are kept in its
// result and never stop the others. Throws std::invalid_argument for bad options.
std::vector<ShardIndexResult> index_shards(const std::vector<std::string>& paths,
                                           const IndexOptions& options,
                                           IndexStats* stats = nullptr);

}  // namespace flashstream
