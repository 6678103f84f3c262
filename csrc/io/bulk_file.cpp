// Whole-file transfers (see bulk_file.hpp). One Transfer moves one memory region to or from one
// file: it cuts the region into chunk_size requests, keeps queue_depth of them in flight, and
// refills each slot as it completes, as the device probe does. Writes are paced (a Pacer, whose
// rate an AdaptiveRate may set window by window) and checksummed just before submission. Errors
// stop the submitting and are thrown only once every request in flight has come back: until
// then the kernel may still read or write the caller's memory.
#include "io/bulk_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <exception>
#include <memory>
#include <stdexcept>
#include <thread>

#include "common/aligned.hpp"
#include "common/crc32c.hpp"
#include "common/errors.hpp"
#include "io/engine.hpp"

namespace flashstream {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kMinInterval = 0.001;
// Short paced requests keep a read's wait behind a write short, but each one costs the pacer a
// wake-up, late by the timer's slack, and a late request does not catch up: at many thousand
// requests a second a paced write falls behind its rate (docs/benchmarks.md, "Figures behind
// the defaults"). Past this many a second, paced requests grow with the rate instead.
constexpr double kMaxPacedRequestsPerS = 4000;

// While a paced request waits for its turn with others in flight, completions are collected
// this often, so their latencies and the windows stay accurate to about this much.
constexpr double kPollSeconds = 200e-6;
constexpr double kControlPollSeconds = 5e-3;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

Clock::duration to_duration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void validate_options(const BulkOptions& o) {
  if (o.chunk_size == 0) throw std::invalid_argument("chunk_size must be positive");
  if (o.queue_depth == 0) throw std::invalid_argument("queue_depth must be positive");
  if (!(o.interval >= kMinInterval))
    throw std::invalid_argument("interval must be at least 0.001 s");
  if (!(o.rate >= 0) || !std::isfinite(o.rate))
    throw std::invalid_argument("rate must be >= 0 bytes/s (0: unpaced)");
}

void check_alignment(const DioAlignment& a, const uint8_t* data, uint64_t offset, uint64_t len,
                     size_t chunk_size, const std::string& path, size_t paced_chunk_size = 0) {
  auto bad = [&](const std::string& what, uint64_t v, uint32_t align) {
    throw std::invalid_argument(what + " " + std::to_string(v) +
                                " is not a multiple of the O_DIRECT alignment " +
                                std::to_string(align) + " of " + path);
  };
  if (chunk_size % a.offset) bad("chunk_size", chunk_size, a.offset);
  if (paced_chunk_size % a.offset) bad("paced_chunk_size", paced_chunk_size, a.offset);
  if (offset % a.offset) bad("offset", offset, a.offset);
  if (len % a.offset) bad("length", len, a.offset);
  // An empty transfer touches no memory, and an empty buffer's address is arbitrary (a state
  // dict with no tensor bytes has an empty data region).
  if (len > 0 && reinterpret_cast<uintptr_t>(data) % a.memory)
    bad("buffer address", reinterpret_cast<uintptr_t>(data), a.memory);
}

// Clears O_DIRECT on `fd` in place (same number, same inode): for a filesystem that accepted
// O_DIRECT at open but refuses the requests.
void clear_direct(int fd, const std::string& path) {
  const int fl = fcntl(fd, F_GETFL);
  if (fl == -1 || fcntl(fd, F_SETFL, fl & ~O_DIRECT) == -1) throw_io_error(errno, "fcntl", path);
}

struct Region {
  uint8_t* data;     // memory of byte 0
  uint64_t len;      // bytes that must be transferred
  uint64_t request;  // bytes the requests cover (len, or len rounded up for a direct read)
  uint64_t offset;   // file offset of byte 0
  uint32_t align;    // O_DIRECT offset alignment (reads: a direct read ending off it hit EOF)
};

class Transfer {
 public:
  Transfer(bool write, int fd, const std::string& path, bool* direct, const Region& region,
           const BulkOptions& options)
      : write_(write), fd_(fd), path_(path), direct_(direct), r_(region), o_(options) {}

  // Checksum segments [b[i], b[i+1]) of the region as it is submitted (writes).
  void checksum(const std::vector<uint64_t>* bounds, std::vector<uint32_t>* crcs) {
    bounds_ = bounds;
    crcs_ = crcs;
  }

  BulkStats run();

 private:
  struct Slot {
    uint64_t pos = 0;  // region offset of the request
    size_t len = 0;
    size_t done = 0;   // bytes transferred so far
    bool busy = false;
    bool direct = false;  // submitted while the fd had O_DIRECT
    Clock::time_point submitted;
  };

  bool paced() const { return write_ && (o_.rate > 0 || o_.adaptive || o_.control); }
  uint64_t next_request_len() const;
  void follow_control(Clock::time_point now);
  double pacing_rate(double adaptive) const;
  void start_next(size_t s, Clock::time_point now);
  void submit(size_t s);
  void on_completion(const IoCompletion& c, Clock::time_point now);
  void finish_read_short(Slot& sl, size_t got);
  void account(uint64_t bytes, Clock::time_point now);
  void observe_window(Clock::time_point now);
  void fail(std::exception_ptr e) noexcept;
  void reap(size_t min_wait);
  void update_crcs(uint64_t p, uint64_t q);
  double secs(Clock::time_point t) const { return seconds_between(start_, t); }
  const char* op() const { return write_ ? "write" : "read"; }

  const bool write_;
  const int fd_;
  const std::string& path_;
  bool* direct_;
  const Region r_;
  const BulkOptions& o_;
  const std::vector<uint64_t>* bounds_ = nullptr;
  std::vector<uint32_t>* crcs_ = nullptr;
  size_t segment_ = 0;

  std::unique_ptr<IoEngine> engine_;
  std::vector<Slot> slots_;
  std::vector<IoCompletion> batch_;
  unsigned in_flight_ = 0;
  uint64_t next_pos_ = 0;  // region offset of the next new request
  uint64_t eof_at_ = UINT64_MAX;  // reads: first offset the file did not have
  bool stopping_ = false;
  std::exception_ptr error_;

  Pacer pacer_;
  std::unique_ptr<AdaptiveRate> adaptive_;
  bool admitted_ = false;  // the next request has its turn from the pacer
  Clock::time_point due_, ready_;
  Clock::time_point window_start_;
  uint64_t window_bytes_ = 0;

  Clock::time_point start_, last_, next_mark_;
  Clock::duration interval_{};
  uint64_t interval_bytes_ = 0;
  BulkStats stats_;
};

double Transfer::pacing_rate(double adaptive) const {
  if (!(adaptive > 0)) return o_.rate;  // the ceiling, or unpaced
  return o_.rate > 0 ? std::min(o_.rate, adaptive) : adaptive;
}

void Transfer::fail(std::exception_ptr e) noexcept {
  if (!error_) error_ = e;  // the first error is the cause; later ones are its echoes
  stopping_ = true;
}

void Transfer::update_crcs(uint64_t p, uint64_t q) {
  const std::vector<uint64_t>& b = *bounds_;
  while (p < q && segment_ + 1 < b.size()) {
    const uint64_t end = b[segment_ + 1];
    if (p >= end) {
      ++segment_;
      continue;
    }
    const uint64_t e = std::min(q, end);
    (*crcs_)[segment_] = crc32c(r_.data + p, static_cast<size_t>(e - p), (*crcs_)[segment_]);
    p = e;
  }
}

// The length of the next new request: paced_chunk_size while the pacer holds a rate, longer
// where that would mean more than kMaxPacedRequestsPerS requests a second.
uint64_t Transfer::next_request_len() const {
  uint64_t chunk = o_.chunk_size;
  if (write_ && o_.paced_chunk_size && pacer_.rate() > 0) {
    const uint64_t align = r_.align ? r_.align : 4096;
    const double per_request = std::min(pacer_.rate() / kMaxPacedRequestsPerS,
                                        static_cast<double>(chunk));
    const uint64_t grown = static_cast<uint64_t>(per_request) / align * align;
    chunk = std::min<uint64_t>(chunk, std::max<uint64_t>(o_.paced_chunk_size, grown));
  }
  return std::min<uint64_t>(chunk, r_.request - next_pos_);
}

void Transfer::start_next(size_t s, Clock::time_point now) {
  Slot& sl = slots_[s];
  sl.pos = next_pos_;
  sl.len = static_cast<size_t>(next_request_len());
  sl.done = 0;
  next_pos_ += sl.len;
  if (crcs_) update_crcs(sl.pos, std::min(sl.pos + sl.len, r_.len));
  if (admitted_) {  // waited for the pacer
    stats_.paused += seconds_between(ready_, now);
    admitted_ = false;
  }
  submit(s);
}

void Transfer::submit(size_t s) {
  Slot& sl = slots_[s];
  uint8_t* p = r_.data + sl.pos + sl.done;
  const size_t len = sl.len - sl.done;
  const uint64_t off = r_.offset + sl.pos + sl.done;
  sl.direct = *direct_;
  sl.submitted = Clock::now();
  if (write_) engine_->submit_write(fd_, p, len, off, s);
  else engine_->submit_read(fd_, p, len, off, s);
  sl.busy = true;
  ++in_flight_;
}

void Transfer::on_completion(const IoCompletion& c, Clock::time_point now) {
  const size_t s = static_cast<size_t>(c.tag);
  Slot& sl = slots_[s];
  sl.busy = false;
  --in_flight_;
  ++stats_.requests;
  stats_.latency.record(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(now - sl.submitted).count()));
  const uint64_t pos = sl.pos + sl.done;
  try {
    if (c.result < 0) {
      // The filesystem took O_DIRECT at open but refuses this request: go on buffered.
      if (c.result == -EINVAL && sl.direct && !error_) {
        if (*direct_) clear_direct(fd_, path_);
        *direct_ = false;
        submit(s);
        return;
      }
      throw_io_error(static_cast<int>(-c.result), op(), path_,
                     static_cast<int64_t>(r_.offset + pos));
    }
    const size_t got = static_cast<size_t>(c.result);
    if (got == 0) {
      if (write_) throw_io_error(EIO, op(), path_, static_cast<int64_t>(r_.offset + pos));
      eof_at_ = std::min(eof_at_, pos);  // a read past the end of the file
      return;
    }
    const uint64_t counted = std::min<uint64_t>(got, pos < r_.len ? r_.len - pos : 0);
    stats_.bytes += counted;
    account(counted, now);
    sl.done += got;
    if (error_) return;
    if (sl.done < sl.len) {
      // Short. A read whose request reached the end of the file, or a direct read that stopped
      // at an unaligned offset (only the end of the file does that), is finished.
      const uint64_t at = sl.pos + sl.done;
      if (!write_ && (at >= r_.len || (sl.direct && (r_.offset + at) % r_.align != 0))) {
        if (at < r_.len) eof_at_ = std::min(eof_at_, at);
        return;
      }
      submit(s);
      return;
    }
  } catch (...) {
    fail(std::current_exception());
  }
}

void Transfer::account(uint64_t bytes, Clock::time_point now) {
  while (now >= next_mark_) {  // a long stall shows up as intervals with 0 bytes
    stats_.timeline.push_back({seconds_between(start_, next_mark_), interval_bytes_,
                               pacer_.rate()});
    interval_bytes_ = 0;
    next_mark_ += interval_;
  }
  interval_bytes_ += bytes;
  window_bytes_ += bytes;
  if (o_.control) o_.control->done.fetch_add(bytes, std::memory_order_relaxed);
}

// A new rate from the controlling thread starts a fresh schedule now; a request waiting on
// the old one is admitted again under the new one.
void Transfer::follow_control(Clock::time_point now) {
  const double rate = o_.control->rate.load(std::memory_order_relaxed);
  if (rate == pacer_.rate()) return;
  pacer_ = Pacer(rate > 0 ? rate : 0);
  if (admitted_) {
    stats_.paused += seconds_between(ready_, now);
    admitted_ = false;
  }
}

// A window ends at a completion, so it holds whole requests: paced at r, it measures r.
void Transfer::observe_window(Clock::time_point now) {
  if (!adaptive_) return;
  const double span = seconds_between(window_start_, now);
  if (span < adaptive_->config().window) return;
  const double rate = adaptive_->observe(window_bytes_, span);
  pacer_.set_rate(pacing_rate(rate), secs(now));
  window_start_ = now;
  window_bytes_ = 0;
}

void Transfer::reap(size_t min_wait) {
  size_t n = 0;
  try {
    n = engine_->reap(batch_.data(), batch_.size(), min_wait);
  } catch (...) {
    // The engine is broken with requests outstanding. Destroying it waits for (threads) or
    // cancels (io_uring) what the kernel still holds of the caller's memory.
    fail(std::current_exception());
    engine_.reset();
    in_flight_ = 0;
    return;
  }
  if (n == 0) return;
  last_ = Clock::now();
  for (size_t i = 0; i < n; ++i) on_completion(batch_[i], last_);
  if (!error_) observe_window(last_);
}

BulkStats Transfer::run() {
  engine_ = make_engine(o_.engine, o_.queue_depth, /*single_thread=*/true);
  const uint64_t requests = (r_.request + o_.chunk_size - 1) / o_.chunk_size;
  slots_.resize(static_cast<size_t>(
      std::min<uint64_t>({engine_->depth(), o_.queue_depth, std::max<uint64_t>(requests, 1)})));
  batch_.resize(slots_.size());
  if (write_ && o_.adaptive) adaptive_ = std::make_unique<AdaptiveRate>(o_.adaptive_config);
  pacer_ = Pacer(o_.control ? o_.control->rate.load() : pacing_rate(0));
  interval_ = to_duration(o_.interval);
  start_ = last_ = window_start_ = Clock::now();
  next_mark_ = start_ + interval_;

  for (;;) {
    size_t free_slot = slots_.size();
    if (!stopping_ && next_pos_ < r_.request) {
      for (size_t s = 0; s < slots_.size(); ++s)
        if (!slots_[s].busy) {
          free_slot = s;
          break;
        }
    }
    if (free_slot < slots_.size()) {
      Clock::time_point now = Clock::now();
      if (o_.control) follow_control(now);
      if (paced() && !admitted_) {
        const double delay = pacer_.admit(next_request_len(), secs(now));
        if (delay > 0) {
          admitted_ = true;
          ready_ = now;
          due_ = now + to_duration(delay);
        }
      }
      if (!admitted_ || now >= due_) {
        try {
          start_next(free_slot, now);
        } catch (...) {
          fail(std::current_exception());
        }
        continue;
      }
      // Wait for the pacer, collecting completions meanwhile.
      reap(0);
      now = Clock::now();
      if (now < due_) {
        const double left = seconds_between(now, due_);
        // With a controlling thread, wake often enough to see a new rate.
        const double cap = in_flight_ ? kPollSeconds : o_.control ? kControlPollSeconds : left;
        std::this_thread::sleep_for(to_duration(std::min(left, cap)));
      }
      continue;
    }
    if (in_flight_ == 0) break;
    reap(1);
  }

  if (error_) std::rethrow_exception(error_);
  if (!write_ && eof_at_ < r_.len)
    throw_io_error(ENODATA, "read", path_, static_cast<int64_t>(r_.offset + eof_at_));
  stats_.seconds = r_.request ? seconds_between(start_, last_) : 0;
  if (interval_bytes_ > 0)
    stats_.timeline.push_back({stats_.seconds, interval_bytes_, pacer_.rate()});
  if (adaptive_) {
    stats_.peak = adaptive_->peak();
    stats_.sustained = adaptive_->sustained();
  }
  stats_.final_rate = pacer_.rate();
  stats_.engine = engine_ ? engine_->name() : o_.engine;
  return std::move(stats_);
}

}  // namespace

OutputFile::OutputFile(const std::string& path, uint64_t size, bool want_direct, bool existing)
    : path_(path) {
  // Created buffered, then switched to O_DIRECT: a filesystem that refuses O_DIRECT at open
  // (tmpfs, ramfs) would otherwise leave the file created, and a buffered retry with O_EXCL
  // would then fail with EEXIST.
  const int flags = existing ? O_WRONLY | O_NOFOLLOW | O_CLOEXEC
                             : O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
  fd_ = ::open(path.c_str(), flags, 0644);
  if (fd_ < 0) throw_io_error(errno, "open", path);
  try {
    if (existing) {
      struct stat st;
      if (::fstat(fd_, &st) != 0) throw_io_error(errno, "fstat", path);
      if (!S_ISREG(st.st_mode)) throw_io_error(EINVAL, "open (not a regular file)", path);
    }
    // Reserve the space first: a full disk fails here, at once, before any data is written.
    // (On an existing file only what lies beyond its allocated blocks is new.)
    if (size > 0 && ::fallocate(fd_, 0, 0, static_cast<off_t>(size)) != 0 &&
        errno != EOPNOTSUPP && errno != ENOSYS)
      throw_io_error(errno, "fallocate", path, 0);
    if (want_direct) {
      const int fl = fcntl(fd_, F_GETFL);
      if (fl == -1) throw_io_error(errno, "fcntl", path);
      if (fcntl(fd_, F_SETFL, fl | O_DIRECT) == 0) direct_ = true;
      else if (errno != EINVAL) throw_io_error(errno, "fcntl", path);  // EINVAL: no O_DIRECT
    }
    if (direct_) align_ = query_dio_alignment(fd_);
  } catch (...) {
    ::close(fd_);
    if (!existing) ::unlink(path.c_str());  // ours (O_EXCL), and nothing was written
    fd_ = -1;
    throw;
  }
}

OutputFile::~OutputFile() { close(); }

void OutputFile::close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

BulkStats OutputFile::write(const uint8_t* data, uint64_t len, uint64_t offset,
                            const BulkOptions& options, const std::vector<uint64_t>& crc_bounds,
                            std::vector<uint32_t>* crcs) {
  validate_options(options);
  if (len > 0 && data == nullptr) throw std::invalid_argument("data is null");
  if (!crc_bounds.empty()) {
    if (crc_bounds.front() != 0) throw std::invalid_argument("crc_bounds must start at 0");
    if (!std::is_sorted(crc_bounds.begin(), crc_bounds.end()))
      throw std::invalid_argument("crc_bounds must be sorted");
    if (crc_bounds.back() > len)
      throw std::invalid_argument("crc_bounds must end at or before the length " +
                                  std::to_string(len));
    if (crcs == nullptr) throw std::invalid_argument("crc_bounds given without crcs");
  }
  if (fd_ < 0) throw_io_error(EBADF, "write", path_, static_cast<int64_t>(offset));
  if (direct_)
    check_alignment(align_, data, offset, len, options.chunk_size, path_,
                    options.paced_chunk_size);
  if (crcs) crcs->assign(crc_bounds.empty() ? 0 : crc_bounds.size() - 1, 0);

  Region region{const_cast<uint8_t*>(data), len, len, offset, align_.offset};  // only read
  Transfer t(/*write=*/true, fd_, path_, &direct_, region, options);
  if (!crc_bounds.empty()) t.checksum(&crc_bounds, crcs);
  return t.run();
}

double OutputFile::commit(uint64_t size) {
  if (fd_ < 0) throw_io_error(EBADF, "commit", path_);
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) throw_io_error(errno, "ftruncate", path_);
  const Clock::time_point t = Clock::now();
  if (::fdatasync(fd_) != 0) throw_io_error(errno, "fdatasync", path_);
  const double seconds = seconds_between(t, Clock::now());
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 && errno != EINTR) throw_io_error(errno, "close", path_);
  return seconds;
}

BulkStats read_file_into(const std::string& path, uint8_t* data, uint64_t len, uint64_t capacity,
                         const BulkOptions& options, bool want_direct, bool* direct) {
  validate_options(options);
  if (capacity < len) throw std::invalid_argument("capacity is smaller than the length");
  if (len > 0 && data == nullptr) throw std::invalid_argument("data is null");
  InputFile file(path, want_direct);
  bool is_direct = file.direct();
  uint64_t request = len;
  if (is_direct) {
    const DioAlignment& a = file.alignment();
    request = align_up(len, a.offset);
    if (capacity < request)
      throw std::invalid_argument("capacity " + std::to_string(capacity) +
                                  " has no room for the length rounded up to the O_DIRECT "
                                  "alignment (" + std::to_string(request) + ")");
    check_alignment(a, data, 0, request, options.chunk_size, path);
  }
  if (file.size() < len) throw_io_error(ENODATA, "read", path, static_cast<int64_t>(file.size()));
  Region region{data, len, request, 0, file.alignment().offset};
  Transfer t(/*write=*/false, file.fd(), path, &is_direct, region, options);
  BulkStats stats = t.run();
  if (direct) *direct = is_direct;
  return stats;
}

}  // namespace flashstream
