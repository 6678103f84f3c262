// Scattered reads (see range_reader.hpp). One RangeTransfer serves one read() call: it cuts the
// ranges into requests, keeps queue_depth of them in flight on the call's engine, resubmits
// short reads, and throws the first error only once every request in flight has come back.
#include "io/range_reader.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <exception>
#include <stdexcept>

#include "common/aligned.hpp"
#include "common/errors.hpp"

namespace flashstream {

namespace {

using Clock = std::chrono::steady_clock;

// Idle engines kept per file: one per thread that searched at the same time, up to this many.
constexpr size_t kMaxIdleEngines = 16;

std::string range_text(size_t i, const ReadRange& r) {
  return "range " + std::to_string(i) + " (offset " + std::to_string(r.offset) + ", length " +
         std::to_string(r.length) + ", dest " + std::to_string(r.dest) + ")";
}

}  // namespace

// One read() call's requests on one engine.
class RangeTransfer {
 public:
  struct Piece {
    uint64_t offset;  // file offset
    uint64_t length;  // bytes requested
    uint64_t need;    // bytes that must arrive (the rest lies past the end of the file)
    uint8_t* dest;
    uint64_t done = 0;
    bool direct = false;  // submitted while the fd had O_DIRECT
    Clock::time_point submitted;
  };

  RangeTransfer(RangeFile& file, IoEngine& engine, std::vector<Piece> pieces, unsigned depth)
      : file_(file), engine_(engine), pieces_(std::move(pieces)),
        depth_(std::max(1u, std::min(depth, engine.depth()))), batch_(depth_) {}

  RangeStats run();
  bool engine_broken() const noexcept { return broken_; }

 private:
  void submit(size_t i);
  void on_completion(const IoCompletion& c, Clock::time_point now);
  void reap(size_t min_wait);
  void fail(std::exception_ptr e) noexcept {
    if (!error_) error_ = e;  // the first error is the cause; later ones are its echoes
  }

  RangeFile& file_;
  IoEngine& engine_;
  std::vector<Piece> pieces_;
  const unsigned depth_;
  std::vector<IoCompletion> batch_;
  unsigned in_flight_ = 0;
  bool broken_ = false;
  std::exception_ptr error_;
  RangeStats stats_;
};

void RangeTransfer::submit(size_t i) {
  Piece& p = pieces_[i];
  p.direct = file_.direct();
  p.submitted = Clock::now();
  engine_.submit_read(file_.fd_, p.dest + p.done, static_cast<size_t>(p.length - p.done),
                      p.offset + p.done, i);
  ++in_flight_;
}

void RangeTransfer::on_completion(const IoCompletion& c, Clock::time_point now) {
  Piece& p = pieces_[static_cast<size_t>(c.tag)];
  --in_flight_;
  ++stats_.requests;
  const uint64_t ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(now - p.submitted).count());
  stats_.sum_ns += ns;
  stats_.max_ns = std::max(stats_.max_ns, ns);
  const uint64_t at = p.offset + p.done;
  try {
    if (c.result < 0) {
      // The filesystem took O_DIRECT at open but refuses this request: go on buffered.
      if (c.result == -EINVAL && p.direct && !error_) {
        file_.drop_direct();
        submit(static_cast<size_t>(c.tag));
        return;
      }
      throw_io_error(static_cast<int>(-c.result), "read", file_.path(), static_cast<int64_t>(at));
    }
    const uint64_t got = static_cast<uint64_t>(c.result);
    stats_.bytes += std::min(got, p.need > p.done ? p.need - p.done : 0);
    p.done += got;
    if (p.done >= p.need || error_) return;
    // Short of what the file held at open. A read that returned nothing, or a direct read that
    // stopped at an unaligned offset (only the end of the file does that), found it shorter.
    const uint64_t next = p.offset + p.done;
    if (got == 0 || (p.direct && next % file_.alignment().offset != 0))
      throw_io_error(ENODATA, "read", file_.path(), static_cast<int64_t>(next));
    submit(static_cast<size_t>(c.tag));
  } catch (...) {
    fail(std::current_exception());
  }
}

void RangeTransfer::reap(size_t min_wait) {
  size_t n = 0;
  try {
    n = engine_.reap(batch_.data(), batch_.size(), min_wait);
  } catch (...) {
    // The engine is broken with requests outstanding; the caller destroys it, which waits for
    // (threads) or cancels (io_uring) what the kernel still holds of the region.
    fail(std::current_exception());
    broken_ = true;
    in_flight_ = 0;
    return;
  }
  const Clock::time_point now = Clock::now();
  for (size_t i = 0; i < n; ++i) on_completion(batch_[i], now);
}

RangeStats RangeTransfer::run() {
  const Clock::time_point start = Clock::now();
  size_t next = 0;
  for (;;) {
    while (!error_ && next < pieces_.size() && in_flight_ < depth_) {
      try {
        submit(next++);
      } catch (...) {
        fail(std::current_exception());
      }
    }
    if (in_flight_ == 0) break;
    reap(1);
  }
  if (error_) std::rethrow_exception(error_);
  stats_.seconds = pieces_.empty()
                       ? 0
                       : std::chrono::duration<double>(Clock::now() - start).count();
  stats_.engine = engine_.name();
  stats_.direct = file_.direct();
  return std::move(stats_);
}

RangeFile::RangeFile(const std::string& path, bool want_direct) : path_(path) {
  bool direct = false;
  fd_ = open_maybe_direct(path, O_RDONLY, want_direct, &direct);
  try {
    size_ = size_of(fd_, path);
    if (direct) align_ = query_dio_alignment(fd_);
  } catch (...) {
    ::close(fd_);
    throw;
  }
  direct_.store(direct);
}

RangeFile::~RangeFile() {
  if (owner_.here()) {
    close();
    return;
  }
  // A fork() child's copy: the engines' threads and rings are the parent's (leak them).
  for (Pooled& p : idle_) p.second.release();
  if (fd_ >= 0) ::close(fd_);
}

void RangeFile::close() noexcept {
  std::unique_lock<std::shared_mutex> lock(open_mu_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  std::lock_guard<std::mutex> pool(pool_mu_);
  idle_.clear();
}

void RangeFile::drop_direct() {
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (!direct_.load()) return;
  const int fl = fcntl(fd_, F_GETFL);
  if (fl == -1 || fcntl(fd_, F_SETFL, fl & ~O_DIRECT) == -1) throw_io_error(errno, "fcntl", path_);
  direct_.store(false);
}

std::unique_ptr<IoEngine> RangeFile::take_engine(const RangeOptions& o, std::string* key) {
  *key = o.engine + ":" + std::to_string(o.queue_depth);
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
      if (it->first != *key) continue;
      std::unique_ptr<IoEngine> engine = std::move(it->second);
      idle_.erase(std::next(it).base());
      return engine;
    }
  }
  // Not single_thread: a pooled engine serves whichever thread calls next.
  return make_engine(o.engine, o.queue_depth, /*single_thread=*/false);
}

void RangeFile::give_back(std::string key, std::unique_ptr<IoEngine> engine) noexcept {
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (idle_.size() < kMaxIdleEngines) idle_.emplace_back(std::move(key), std::move(engine));
}

RangeStats RangeFile::read(uint8_t* region, uint64_t region_size,
                           const std::vector<ReadRange>& ranges, const RangeOptions& o) {
  owner_.check("RangeFile");
  if (o.queue_depth == 0) throw std::invalid_argument("queue_depth must be positive");
  if (o.request_size == 0) throw std::invalid_argument("request_size must be positive");
  std::shared_lock<std::shared_mutex> open(open_mu_);
  if (fd_ < 0) throw_io_error(EBADF, "read", path_);
  const bool direct = direct_.load();
  const uint64_t a = align_.offset;
  if (direct && o.request_size % a)
    throw std::invalid_argument("request_size " + std::to_string(o.request_size) +
                                " is not a multiple of the O_DIRECT alignment " +
                                std::to_string(a) + " of " + path_);
  // A range may end past the file only inside the alignment unit holding its last byte.
  const uint64_t limit = align_up(size_, a);
  std::vector<RangeTransfer::Piece> pieces;
  pieces.reserve(ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    const ReadRange& r = ranges[i];
    if (r.length == 0) continue;
    if (r.dest > region_size || r.length > region_size - r.dest)
      throw std::invalid_argument(range_text(i, r) + " does not fit the region of " +
                                  std::to_string(region_size) + " bytes");
    if (r.offset > limit || r.length > limit - r.offset)
      throw std::invalid_argument(range_text(i, r) + " lies past the end of " + path_ +
                                  " (" + std::to_string(size_) + " bytes)");
    if (direct && (r.offset % a || r.length % a ||
                   reinterpret_cast<uintptr_t>(region + r.dest) % align_.memory))
      throw std::invalid_argument(range_text(i, r) + " is not aligned for O_DIRECT on " +
                                  path_ + " (offsets and lengths: multiples of " +
                                  std::to_string(a) + ", memory: " +
                                  std::to_string(align_.memory) + ")");
    for (uint64_t pos = 0; pos < r.length; pos += o.request_size) {
      const uint64_t off = r.offset + pos;
      const uint64_t len = std::min<uint64_t>(o.request_size, r.length - pos);
      const uint64_t need = off >= size_ ? 0 : std::min(len, size_ - off);
      if (need == 0) continue;
      RangeTransfer::Piece piece{};
      piece.offset = off;
      piece.length = len;
      piece.need = need;
      piece.dest = region + r.dest + pos;
      pieces.push_back(piece);
    }
  }
  std::string key;
  std::unique_ptr<IoEngine> engine = take_engine(o, &key);
  RangeTransfer transfer(*this, *engine, std::move(pieces), o.queue_depth);
  try {
    RangeStats stats = transfer.run();
    give_back(std::move(key), std::move(engine));
    return stats;
  } catch (...) {
    if (!transfer.engine_broken()) give_back(std::move(key), std::move(engine));
    throw;
  }
}

}  // namespace flashstream
