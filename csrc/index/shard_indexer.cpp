// index_shards: see shard_indexer.hpp. Two phases: every shard starts hopping (one read in
// flight per shard, up to queue_depth shards at once); shards whose members turn out small are
// parked with their scanner state and then read sequentially, all of them through one
// SequentialReader (which keeps large reads in flight across shard boundaries).
#include "index/shard_indexer.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "common/aligned.hpp"
#include "common/errors.hpp"
#include "io/engine.hpp"
#include "io/file.hpp"
#include "io/sequential_reader.hpp"
#include "tar/tar_scanner.hpp"

namespace flashstream {
namespace {

// tarfile's "r|*" detection (flashstream/stream/decompress.py holds the same table).
bool compressed_magic(const uint8_t* p, size_t n) {
  static const std::string_view kMagics[] = {std::string_view("\x1f\x8b", 2), "BZh",
                                             std::string_view("\xfd" "7zXZ\0", 6)};
  const std::string_view head(reinterpret_cast<const char*>(p), std::min<size_t>(n, 6));
  for (std::string_view magic : kMagics)
    if (head.substr(0, magic.size()) == magic) return true;
  return false;
}

// Extensions whose collision rules only Python knows: non-ASCII ones fold further under
// str.lower() than the scanner's ASCII lowercasing, and "__local_path__" is a key the reader
// adds to each sample dict.
bool needs_python_rules(const std::string& ext) {
  if (ext == "__local_path__") return true;
  return std::any_of(ext.begin(), ext.end(),
                     [](char c) { return static_cast<unsigned char>(c) >= 0x80; });
}

// What a file was when indexing began. A shard that is rewritten, shrunk or replaced while it
// is indexed is left to the full scan, which meets the change as reading it would.
struct Identity {
  bool known = false;
  dev_t dev = 0;
  ino_t ino = 0;
  off_t size = 0;
  int64_t mtime_ns = 0;

  static Identity of(const struct stat& st) {
    Identity id;
    id.known = true;
    id.dev = st.st_dev;
    id.ino = st.st_ino;
    id.size = st.st_size;
    id.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    return id;
  }
  static Identity of_fd(int fd) {
    struct stat st;
    return ::fstat(fd, &st) == 0 ? of(st) : Identity();
  }
  static Identity of_path(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 ? of(st) : Identity();
  }
  bool operator==(const Identity& o) const {
    return known && o.known && dev == o.dev && ino == o.ino && size == o.size &&
           mtime_ns == o.mtime_ns;
  }
};

struct Shard {
  size_t index = 0;  // into the paths and results
  std::unique_ptr<InputFile> file;
  Identity identity;  // when first opened (or stat'ed, for a shard read sequentially at once)
  TarScanner scanner;
  uint64_t end = 0;  // file size when opened
  AlignedBuffer buf;
  uint64_t buf_offset = 0;  // file offset of buf[0]
  size_t buf_filled = 0;
  uint64_t reads = 0;
};

enum class Next { kRead, kDone, kSequential };

class Indexer {
 public:
  Indexer(const std::vector<std::string>& paths, const IndexOptions& options, IndexStats* stats)
      : paths_(paths), opt_(options), stats_(stats), results_(paths.size()) {}

  std::vector<ShardIndexResult> run() {
    if (opt_.hop_threshold == UINT64_MAX) {
      for (size_t i = 0; i < paths_.size(); ++i) park_new(i);
    } else {
      hop_all();
    }
    read_parked();
    return std::move(results_);
  }

 private:
  // ---- results ----

  // Moves the samples the scanner completed into the shard's result. Returns false when one
  // of them needs Python's rules (the shard is then left to the full scan).
  bool collect(Shard& s) {
    ShardIndexResult& r = results_[s.index];
    for (const Sample& sample : s.scanner.samples()) {
      for (const Field& f : sample.fields) {
        if (needs_python_rules(f.ext)) {
          s.scanner.clear_samples();
          r = ShardIndexResult();
          r.outcome = ShardOutcome::kNeedsFullScan;
          return false;
        }
      }
      r.offsets.push_back(static_cast<int64_t>(sample.offset));
      r.ends.push_back(static_cast<int64_t>(sample.end_offset));
    }
    s.scanner.clear_samples();
    return true;
  }

  // The shard changed while it was indexed (or a read came back short before its end): the
  // full scan decides what it holds, or how it fails.
  void leave_to_full_scan(Shard& s) {
    s.scanner.clear_samples();
    results_[s.index] = ShardIndexResult();
    results_[s.index].outcome = ShardOutcome::kNeedsFullScan;
  }

  // After a shard is done: whether it is still the file indexing began with.
  void check_unchanged(Shard& s, const Identity& now) {
    const ShardOutcome outcome = results_[s.index].outcome;
    if (outcome == ShardOutcome::kIndexed || outcome == ShardOutcome::kFailed)
      if (s.identity.known && !(now == s.identity)) leave_to_full_scan(s);
  }

  // Polled between completions, at most every 50 ms: a Ctrl-C must not wait for a whole scan.
  void poll_cancel() {
    if (!opt_.cancelled) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_poll_ < std::chrono::milliseconds(50)) return;
    last_poll_ = now;
    if (opt_.cancelled()) throw IndexCancelled();
  }

  // The current exception ends shard s: samples completed before it stay in its index. For a
  // format error, so does the group of members being assembled (webdataset's current sample,
  // which it yields unless the handler raises; the caller's handler decides on the index).
  void fail(Shard& s) {
    std::exception_ptr error = std::current_exception();
    try {
      throw;
    } catch (const FormatError&) {
      s.scanner.flush_open_group();
    } catch (...) {
    }
    if (!collect(s)) return;
    results_[s.index].outcome = ShardOutcome::kFailed;
    results_[s.index].error = error;
  }

  void fail_unopened(size_t index) {
    results_[index].outcome = ShardOutcome::kFailed;
    results_[index].error = std::current_exception();
  }

  // ---- hopping ----

  void hop_all() {
    engine_ = make_engine(opt_.engine, opt_.queue_depth, /*single_thread=*/true);
    if (stats_) stats_->engine = engine_->name();
    slots_.resize(opt_.queue_depth);
    busy_.assign(opt_.queue_depth, false);
    std::vector<IoCompletion> done(opt_.queue_depth);
    size_t in_flight = 0;
    try {
      for (size_t slot = 0; slot < slots_.size(); ++slot) in_flight += start_next(slot);
      while (in_flight > 0) {
        const size_t n = engine_->reap(done.data(), done.size(), 1);
        for (size_t k = 0; k < n; ++k) busy_[done[k].tag] = false;
        poll_cancel();
        for (size_t k = 0; k < n; ++k) {
          const size_t slot = static_cast<size_t>(done[k].tag);
          if (!on_read(slot, done[k].result)) {
            --in_flight;
            in_flight += start_next(slot);
          }
        }
      }
    } catch (...) {  // a failing engine or allocation, not a shard's error (those are kept)
      abandon();
      throw;
    }
    engine_.reset();
  }

  // Reads still in flight write into their shards' buffers: wait for them before anything
  // is freed. If even that fails, the buffers are leaked rather than handed back to the heap
  // under the kernel's feet.
  void abandon() noexcept {
    try {
      std::vector<IoCompletion> done(opt_.queue_depth);
      while (std::find(busy_.begin(), busy_.end(), true) != busy_.end()) {
        const size_t n = engine_->reap(done.data(), done.size(), 1);
        for (size_t k = 0; k < n; ++k) busy_[done[k].tag] = false;
      }
    } catch (...) {
      for (auto& s : slots_) s.release();  // deliberately leaked
    }
  }

  // Opens shards in turn until one has a read in flight in `slot`; returns 1, or 0 when no
  // shard is left.
  size_t start_next(size_t slot) {
    while (next_ < paths_.size()) {
      const size_t index = next_++;
      auto s = std::make_unique<Shard>();
      s->index = index;
      try {
        s->file = std::make_unique<InputFile>(paths_[index], opt_.direct);
      } catch (...) {
        fail_unopened(index);
        continue;
      }
      s->end = s->file->size();
      s->identity = Identity::of_fd(s->file->fd());
      s->scanner.set_index_only(true);
      s->scanner.begin_shard(0);
      const DioAlignment& a = s->file->alignment();
      s->buf = AlignedBuffer(align_up(std::max<size_t>(opt_.hop_read, a.offset), a.offset),
                             a.memory);
      try {
        if (s->end == 0) {  // nothing to read: the scanner says "empty shard"
          s->scanner.end_shard();
          continue;
        }
      } catch (...) {
        fail(*s);
        continue;
      }
      slots_[slot] = std::move(s);
      submit(slot);
      return 1;
    }
    return 0;
  }

  void submit(size_t slot) {
    Shard& s = *slots_[slot];
    const uint64_t pos = s.scanner.position();
    s.buf_offset = align_down(pos, s.file->alignment().offset);
    s.buf_filled = 0;
    ++s.reads;
    ++results_[s.index].hops;
    engine_->submit_read(s.file->fd(), s.buf.data(), s.buf.size(), s.buf_offset, slot);
    busy_[slot] = true;
  }

  // A read of `slot` completed. Returns true when the shard has another read in flight.
  bool on_read(size_t slot, int64_t result) {
    Shard& s = *slots_[slot];
    ShardIndexResult& r = results_[s.index];
    if (stats_) ++stats_->requests;
    Next next = Next::kDone;
    try {
      if (result == -EINVAL && s.file->direct()) {  // O_DIRECT refused after all: buffered
        s.file->fall_back_to_buffered();
        --s.reads;
        --r.hops;
        submit(slot);
        return true;
      }
      if (result < 0)
        throw_io_error(static_cast<int>(-result), "read", paths_[s.index],
                       static_cast<int64_t>(s.buf_offset));
      s.buf_filled = static_cast<size_t>(result);
      if (stats_) stats_->bytes_read += static_cast<uint64_t>(result);
      if (s.buf_filled < s.buf.size() && s.buf_offset + s.buf_filled < s.end) {
        leave_to_full_scan(s);  // short of the size at open: the file shrank under us
      } else if (s.buf_offset == 0 && compressed_magic(s.buf.data(), s.buf_filled)) {
        r.outcome = ShardOutcome::kCompressed;
      } else {
        next = advance(s);
      }
    } catch (...) {
      fail(s);
    }
    if (next == Next::kRead) {
      submit(slot);
      return true;
    }
    if (next == Next::kSequential) {
      park(std::move(slots_[slot]));
    } else {
      check_unchanged(s, Identity::of_fd(s.file->fd()));
    }
    slots_[slot].reset();
    return false;
  }

  // Feeds the scanner from the shard's window and hops over what it does not need, until it
  // needs bytes outside the window (or the shard is done).
  Next advance(Shard& s) {
    while (true) {
      if (s.scanner.at_end()) {  // the end-of-archive block: the rest is never looked at
        s.scanner.end_shard();
        return collect(s), Next::kDone;
      }
      const uint64_t pos = s.scanner.position();
      const uint64_t hop = std::min(s.scanner.skippable(), s.end - std::min(pos, s.end));
      if (hop > 0) {
        s.scanner.skip(hop);
        if (!collect(s)) return Next::kDone;
        continue;
      }
      if (pos >= s.end) {
        s.scanner.end_shard();  // throws for a shard cut short
        return collect(s), Next::kDone;
      }
      const uint64_t window_end = s.buf_offset + s.buf_filled;
      if (pos >= s.buf_offset && pos < window_end) {
        s.scanner.feed(s.buf.data() + (pos - s.buf_offset), window_end - pos);
        if (!collect(s)) return Next::kDone;
        continue;
      }
      // Small members: a read per header costs more than reading them all.
      if (s.reads >= opt_.decide_after && pos / s.reads < opt_.hop_threshold)
        return Next::kSequential;
      return Next::kRead;
    }
  }

  // ---- sequential ----

  void park_new(size_t index) {
    auto s = std::make_unique<Shard>();
    s->index = index;
    s->identity = Identity::of_path(paths_[index]);
    s->scanner.set_index_only(true);
    s->scanner.begin_shard(0);
    park(std::move(s));
  }

  void park(std::unique_ptr<Shard> s) {
    s->file.reset();  // the sequential reader opens it again; keep few files open meanwhile
    s->buf = AlignedBuffer();
    results_[s->index].sequential = true;
    parked_.push_back(std::move(s));
  }

  void read_parked() {
    if (parked_.empty()) return;
    std::vector<Extent> extents;
    for (const auto& s : parked_) extents.push_back({paths_[s->index], s->scanner.position()});
    ReaderOptions ro;
    ro.chunk_size = opt_.chunk_size;
    ro.queue_depth = opt_.queue_depth;
    ro.engine = opt_.engine;
    ro.direct = opt_.direct;
    SequentialReader reader(std::move(extents), ro);
    if (stats_ && stats_->engine.empty()) stats_->engine = reader.engine_name();
    size_t expected = 0;  // the extent whose chunks come next
    while (true) {
      Chunk c;
      try {
        if (!reader.next(c)) break;
      } catch (...) {  // an open or read error, at the failing extent's turn
        Shard& s = *parked_[expected];
        fail(s);
        reader.skip_extent();
        ++expected;
        continue;
      }
      poll_cancel();
      expected = c.extent + (c.last ? 1 : 0);
      Shard& s = *parked_[c.extent];
      ShardIndexResult& r = results_[s.index];
      bool done = c.last;
      try {
        if (c.first && c.offset == 0 && compressed_magic(c.data, c.size)) {
          r.outcome = ShardOutcome::kCompressed;
          done = true;
        } else {
          s.scanner.feed(c.data, c.size);
          if (!collect(s)) {
            done = true;
          } else if (c.last || s.scanner.at_end()) {
            s.scanner.end_shard();
            collect(s);
            done = true;
          }
        }
      } catch (...) {
        fail(s);
        done = true;
      }
      if (done) check_unchanged(s, Identity::of_path(paths_[s.index]));
      if (done && !c.last) {
        reader.skip_extent();
        expected = c.extent + 1;
      }
    }
    if (stats_) {
      stats_->bytes_read += reader.stats().bytes_read;
      stats_->requests += reader.stats().requests;
    }
    reader.close();
  }

  const std::vector<std::string>& paths_;
  const IndexOptions& opt_;
  IndexStats* stats_;
  std::vector<ShardIndexResult> results_;
  std::unique_ptr<IoEngine> engine_;
  std::vector<std::unique_ptr<Shard>> slots_;   // the shard each hop slot (request tag) serves
  std::vector<bool> busy_;                      // whether each slot's read is in flight
  std::vector<std::unique_ptr<Shard>> parked_;  // for sequential reading, as they were parked
  size_t next_ = 0;                             // the next path to open for hopping
  std::chrono::steady_clock::time_point last_poll_;  // the first poll comes at once
};

}  // namespace

std::vector<ShardIndexResult> index_shards(const std::vector<std::string>& paths,
                                           const IndexOptions& options, IndexStats* stats) {
  if (options.queue_depth < 1 || options.queue_depth > 256)
    throw std::invalid_argument("queue_depth must be from 1 to 256");
  if (options.hop_read < 512 || options.hop_read > (1u << 20))
    throw std::invalid_argument("hop_read must be from 512 bytes to 1 MiB");
  if (options.chunk_size < 4096)
    throw std::invalid_argument("chunk_size must be at least 4 KiB");
  if (options.decide_after < 1) throw std::invalid_argument("decide_after must be at least 1");
  if (stats) *stats = IndexStats();
  return Indexer(paths, options, stats).run();
}

}  // namespace flashstream
