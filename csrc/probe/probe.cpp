// The device probe (see probe.hpp). One ProbeRun owns the file, the engine and queue_depth
// aligned buffers ("slots"); each completion refills its slot, so the device always sees
// exactly queue_depth requests until the byte count or the time limit is reached. Errors stop
// the refilling, and are thrown only once every request in flight has come back: the kernel
// may write into a buffer until then.
#include "probe/probe.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>

#include "common/aligned.hpp"
#include "common/errors.hpp"
#include "io/engine.hpp"
#include "io/file.hpp"

namespace flashstream {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxBlock = size_t(1) << 30;
constexpr double kMinInterval = 0.001;  // finer timelines would mostly measure the reaping
constexpr size_t kStampEvery = 4096;    // the block size a deduplicating drive compares
constexpr double kMaxSeconds = 1e9;     // longer spans would overflow the clock's nanoseconds

Clock::duration to_duration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::min(seconds, kMaxSeconds)));
}

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Incompressible bytes, so a compressing drive is not flattered.
void fill_random(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = splitmix64(seed);
    std::memcpy(p + i, &v, std::min<size_t>(8, n - i));
  }
}

struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

class ProbeRun {
 public:
  explicit ProbeRun(const ProbeSpec& spec);
  ProbeResult run();

 private:
  struct Slot {
    AlignedBuffer buf;
    uint64_t offset = 0;  // of the block
    size_t done = 0;      // bytes of the block transferred so far
    bool busy = false;
    Clock::time_point submitted;
  };

  void open_file();
  uint64_t next_offset();
  void start_block(size_t s);
  void submit(size_t s);
  void on_completion(const IoCompletion& c, Clock::time_point now);
  void fall_back_to_buffered();
  void account(uint64_t bytes, Clock::time_point now);
  bool fell_below() noexcept;  // the stop_below rule, over the timeline so far
  void fail(std::exception_ptr e) noexcept;
  void abandon_buffers() noexcept;
  const char* op() const { return write_ ? "write" : "read"; }

  const ProbeSpec& spec_;
  const bool write_;
  FdGuard file_;
  bool direct_ = false;
  uint64_t region_ = 0;   // bytes of the file's whole blocks
  uint64_t total_ = 0;    // blocks to transfer
  uint64_t started_ = 0;  // blocks issued so far
  uint64_t seq_next_ = 0;
  std::mt19937_64 rng_;
  std::vector<Slot> slots_;
  std::unique_ptr<IoEngine> engine_;  // after slots_: its threads are gone before the buffers
  unsigned in_flight_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  Clock::time_point start_, deadline_, next_mark_;
  Clock::duration interval_{};
  uint64_t interval_bytes_ = 0;
  double fast_until_ = 0;  // end (s) of the last interval whose smoothed rate met stop_below
  ProbeResult result_;
};

ProbeRun::ProbeRun(const ProbeSpec& spec)
    : spec_(spec), write_(spec.op == ProbeOp::kWrite), rng_(spec.seed) {
  if (spec.queue_depth == 0) throw std::invalid_argument("queue_depth must be positive");
  if (spec.block_size == 0 || spec.block_size > kMaxBlock)
    throw std::invalid_argument("block_size must be between 1 byte and 1 GiB");
  if (!(spec.duration >= 0)) throw std::invalid_argument("duration must be >= 0");
  if (!(spec.interval == 0 || spec.interval >= kMinInterval))
    throw std::invalid_argument("interval must be 0 (no timeline) or at least 0.001 s");
  if (!(spec.stop_below >= 0) || !(spec.stop_after >= 0) || !(spec.stop_smooth >= 0))
    throw std::invalid_argument("stop_below, stop_after and stop_smooth must be >= 0");
  if (spec.stop_below > 0 && (spec.interval == 0 || spec.stop_after < spec.interval))
    throw std::invalid_argument(
        "stop_below needs a timeline (interval > 0) and stop_after of at least one interval");
  open_file();
  engine_ = make_engine(spec.engine, spec.queue_depth, /*single_thread=*/true);
  const DioAlignment a = query_dio_alignment(file_.fd);
  const size_t n = static_cast<size_t>(std::min<uint64_t>(engine_->depth(), total_));
  slots_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    slots_[i].buf = AlignedBuffer(spec.block_size, std::max<size_t>(4096, a.memory));
    if (write_) fill_random(slots_[i].buf.data(), spec.block_size, spec.seed * 1000003 + i + 1);
  }
  if (spec.interval > 0) interval_ = to_duration(spec.interval);
}

void ProbeRun::open_file() {
  // Writes never truncate: the caller sized (and ideally filled) the file beforehand.
  file_.fd = open_maybe_direct(spec_.path, write_ ? O_WRONLY : O_RDONLY, spec_.direct, &direct_);
  const uint64_t size = size_of(file_.fd, spec_.path);
  const uint32_t align = query_dio_alignment(file_.fd).offset;
  const size_t bs = spec_.block_size;
  if (bs % align != 0)
    throw std::invalid_argument("block_size " + std::to_string(bs) +
                                " is not a multiple of the O_DIRECT alignment " +
                                std::to_string(align) + " of " + spec_.path);
  if (size < bs)
    throw std::invalid_argument(spec_.path + " (" + std::to_string(size) +
                                " bytes) is smaller than one block of " + std::to_string(bs));
  region_ = align_down(size, bs);
  total_ = spec_.bytes ? (spec_.bytes + bs - 1) / bs : region_ / bs;
}

uint64_t ProbeRun::next_offset() {
  const uint64_t bs = spec_.block_size;
  if (spec_.pattern == ProbePattern::kRandom)
    return std::uniform_int_distribution<uint64_t>(0, region_ / bs - 1)(rng_) * bs;
  const uint64_t off = seq_next_;
  seq_next_ = seq_next_ + bs >= region_ ? 0 : seq_next_ + bs;  // wrap before a partial block
  return off;
}

void ProbeRun::start_block(size_t s) {
  Slot& sl = slots_[s];
  sl.offset = next_offset();
  sl.done = 0;
  ++started_;
  if (write_) {
    // A few unique bytes in every 4 KiB, so a deduplicating drive cannot fold rewritten blocks.
    const uint64_t stamp[2] = {started_, sl.offset};
    for (size_t i = 0; i + sizeof stamp <= spec_.block_size; i += kStampEvery)
      std::memcpy(sl.buf.data() + i, stamp, sizeof stamp);
  }
  submit(s);
}

void ProbeRun::submit(size_t s) {
  Slot& sl = slots_[s];
  uint8_t* p = sl.buf.data() + sl.done;
  const size_t len = spec_.block_size - sl.done;
  const uint64_t off = sl.offset + sl.done;
  sl.submitted = Clock::now();
  if (write_) engine_->submit_write(file_.fd, p, len, off, s);
  else engine_->submit_read(file_.fd, p, len, off, s);
  sl.busy = true;
  ++in_flight_;
}

void ProbeRun::fail(std::exception_ptr e) noexcept {
  if (!error_) error_ = e;  // the first error is the cause; later ones are its echoes
  stopping_ = true;
}

void ProbeRun::fall_back_to_buffered() {
  const int fl = fcntl(file_.fd, F_GETFL);
  if (fl == -1 || fcntl(file_.fd, F_SETFL, fl & ~O_DIRECT) == -1)
    throw_io_error(errno, "fcntl", spec_.path);
  direct_ = false;
}

void ProbeRun::on_completion(const IoCompletion& c, Clock::time_point now) {
  const size_t s = static_cast<size_t>(c.tag);
  Slot& sl = slots_[s];
  sl.busy = false;
  --in_flight_;
  ++result_.requests;
  result_.latency.record(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(now - sl.submitted).count()));
  const int64_t pos = static_cast<int64_t>(sl.offset + sl.done);
  try {
    if (c.result < 0) {
      // The filesystem took O_DIRECT at open but refuses this request: go on buffered.
      if (c.result == -EINVAL && direct_ && !error_) {
        fall_back_to_buffered();
        submit(s);
        return;
      }
      throw_io_error(static_cast<int>(-c.result), op(), spec_.path, pos);
    }
    // 0 bytes inside the file: it shrank under a read; a write made no progress.
    if (c.result == 0) throw_io_error(write_ ? EIO : ENODATA, op(), spec_.path, pos);
    const size_t got = static_cast<size_t>(c.result);
    result_.bytes += got;
    account(got, now);
    sl.done += got;
    if (error_) return;
    if (sl.done < spec_.block_size) {  // short: finish the block
      submit(s);
      return;
    }
    if (now >= deadline_ || (spec_.cancel && spec_.cancel->load(std::memory_order_relaxed)))
      stopping_ = true;
    if (!stopping_ && started_ < total_) start_block(s);
  } catch (...) {
    fail(std::current_exception());
  }
}

void ProbeRun::account(uint64_t bytes, Clock::time_point now) {
  if (interval_ == Clock::duration::zero()) return;
  while (now >= next_mark_) {  // a long stall shows up as intervals with 0 bytes
    result_.timeline.push_back({seconds_between(start_, next_mark_), interval_bytes_});
    interval_bytes_ = 0;
    next_mark_ += interval_;
    if (spec_.stop_below > 0 && fell_below()) stopping_ = true;
  }
  interval_bytes_ += bytes;
}

bool ProbeRun::fell_below() noexcept {
  const auto& t = result_.timeline;
  const size_t n = std::max<size_t>(
      1, static_cast<size_t>(std::ceil(spec_.stop_smooth / spec_.interval - 1e-9)));
  if (t.size() >= n) {
    uint64_t sum = 0;
    for (size_t i = t.size() - n; i < t.size(); ++i) sum += t[i].bytes;
    if (static_cast<double>(sum) >= spec_.stop_below * static_cast<double>(n) * spec_.interval)
      fast_until_ = t.back().seconds;
  }
  return t.back().seconds - fast_until_ >= spec_.stop_after - 1e-9;
}

// The engine failed with requests outstanding: we cannot know when the kernel is done with
// their buffers, so leak them rather than free memory it may still write.
void ProbeRun::abandon_buffers() noexcept {
  for (Slot& sl : slots_)
    if (sl.busy) (void)new AlignedBuffer(std::move(sl.buf));
  in_flight_ = 0;
}

ProbeResult ProbeRun::run() {
  start_ = Clock::now();
  deadline_ = spec_.duration > 0 ? start_ + to_duration(spec_.duration) : Clock::time_point::max();
  next_mark_ = start_ + interval_;
  Clock::time_point last = start_;
  try {
    for (size_t s = 0; s < slots_.size() && started_ < total_; ++s) start_block(s);
  } catch (...) {
    fail(std::current_exception());
  }
  std::vector<IoCompletion> batch(std::max<size_t>(slots_.size(), 1));
  while (in_flight_ > 0) {
    size_t n = 0;
    try {
      n = engine_->reap(batch.data(), batch.size(), 1);
    } catch (...) {
      fail(std::current_exception());
      abandon_buffers();
      break;
    }
    last = Clock::now();
    for (size_t i = 0; i < n; ++i) on_completion(batch[i], last);
  }
  if (error_) std::rethrow_exception(error_);
  result_.seconds = seconds_between(start_, last);
  if (interval_ != Clock::duration::zero() && interval_bytes_ > 0)
    result_.timeline.push_back({result_.seconds, interval_bytes_});
  if (write_) {
    const Clock::time_point t = Clock::now();
    if (::fdatasync(file_.fd) != 0) throw_io_error(errno, "fdatasync", spec_.path);
    result_.sync_seconds = seconds_between(t, Clock::now());
  }
  result_.direct = direct_;
  result_.engine = engine_->name();
  return std::move(result_);
}

// Writes [from, size) of fd with buffered pwrite: the unaligned tail of a probe file.
void write_tail(int fd, const std::string& path, uint64_t from, uint64_t size) {
  std::vector<uint8_t> data(static_cast<size_t>(std::min<uint64_t>(size - from, 1 << 20)));
  uint64_t seed = from + 1;
  while (from < size) {
    const size_t len = static_cast<size_t>(std::min<uint64_t>(data.size(), size - from));
    fill_random(data.data(), len, splitmix64(seed));
    const ssize_t n = ::pwrite(fd, data.data(), len, static_cast<off_t>(from));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw_io_error(n < 0 ? errno : EIO, "write", path, static_cast<int64_t>(from));
    from += static_cast<uint64_t>(n);
  }
}

}  // namespace

ProbeOp parse_probe_op(const std::string& s) {
  if (s == "read") return ProbeOp::kRead;
  if (s == "write") return ProbeOp::kWrite;
  throw std::invalid_argument("unknown probe op '" + s + "' (expected one of: read, write)");
}

ProbePattern parse_probe_pattern(const std::string& s) {
  if (s == "sequential") return ProbePattern::kSequential;
  if (s == "random") return ProbePattern::kRandom;
  throw std::invalid_argument("unknown probe pattern '" + s +
                              "' (expected one of: sequential, random)");
}

ProbeResult run_probe(const ProbeSpec& spec) { return ProbeRun(spec).run(); }

void create_probe_file(const std::string& path, uint64_t size) {
  bool created = true;
  FdGuard f;
  f.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f.fd < 0 && errno == EEXIST) {
    created = false;
    f.fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  }
  if (f.fd < 0) throw_io_error(errno, "open", path);
  try {
    if (::ftruncate(f.fd, static_cast<off_t>(size)) != 0) throw_io_error(errno, "ftruncate", path);
    // Reserve the space first: a full disk fails here, at once, not after minutes of writing.
    if (size > 0 && ::fallocate(f.fd, 0, 0, static_cast<off_t>(size)) != 0 &&
        errno != EOPNOTSUPP && errno != ENOSYS)
      throw_io_error(errno, "fallocate", path, 0);
    // The bulk in large blocks through the probe itself (queued O_DIRECT writes); the block is
    // a power of two, so a multiple of any alignment up to it.
    const uint32_t align = query_dio_alignment(f.fd).offset;
    size_t bs = size_t(8) << 20;
    while (bs > size) bs >>= 1;
    uint64_t bulk = 0;
    if (bs >= 4096 && bs % align == 0) {
      ProbeSpec spec;
      spec.path = path;
      spec.op = ProbeOp::kWrite;
      spec.block_size = bs;
      spec.queue_depth = 4;
      spec.bytes = align_down(size, bs);
      spec.seed = 0x5eed;
      bulk = run_probe(spec).bytes;
    }
    if (bulk < size) write_tail(f.fd, path, bulk, size);
    if (::fdatasync(f.fd) != 0) throw_io_error(errno, "fdatasync", path);
  } catch (...) {
    if (created) ::unlink(path.c_str());  // no half-written probe file left behind
    throw;
  }
}

}  // namespace flashstream
