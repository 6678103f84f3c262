// SequentialReader: in-order chunks from a pool of queue_depth + 1 aligned buffers, with up to
// queue_depth reads in flight. The issuer walks the extents ahead of delivery (opening files
// lazily) and records every request, or a marker for an extent without requests, in `queue`,
// which is therefore in delivery order. Completions only update their slot; next() hands out
// the queue's front once it is complete.
#include "io/sequential_reader.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <deque>
#include <exception>
#include <stdexcept>

#include "common/aligned.hpp"
#include "common/errors.hpp"
#include "io/buffer_cache.hpp"
#include "common/owner_process.hpp"
#include "io/file.hpp"

namespace flashstream {
namespace {

constexpr size_t kMaxChunk = size_t(1) << 30;  // keeps one request well below the kernel cap
constexpr size_t kReapBatch = 64;

using Clock = std::chrono::steady_clock;

uint64_t ns_since(Clock::time_point t) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count());
}

enum class SlotState { kFree, kInFlight, kReady, kHeld };

// One buffer of the pool and the request filling it.
struct Slot {
  AlignedBuffer buf;
  SlotState state = SlotState::kFree;
  bool orphan = false;  // its extent was dropped while in flight: free it on completion
  uint32_t extent = 0;
  uint64_t offset = 0;  // file offset of buf[0]
  size_t len = 0;       // bytes requested, a multiple of the file's alignment
  size_t filled = 0;    // bytes read so far
  bool direct = false;  // last submitted on an O_DIRECT fd
  bool first = false;   // first request of its extent
  bool eof = false;     // the file ended before the expected end (it shrank)
  int fixed = -1;       // index of buf among the engine's registered buffers, or -1
  Clock::time_point submitted;  // of the request in flight, for the latency histogram
  std::exception_ptr error;
};

struct ExtentState {
  std::unique_ptr<InputFile> file;      // kept open while requests may be issued or in flight
  std::unique_ptr<InputFile> buffered;  // opened on demand for unaligned short-read remainders
  bool opened = false;
  bool stop = false;        // issue nothing more: done, failed, shrunk or skipped
  bool issued_any = false;
  uint64_t start = 0;       // wanted range; end clamped to the file size
  uint64_t end = 0;
  uint64_t next = 0;        // file offset of the next request
  size_t chunk = 0;         // request size for this file
  unsigned in_flight = 0;
  std::exception_ptr error;  // open failure, raised when this extent's turn comes
};

// A request's slot, or slot < 0 for an extent without requests (empty or failed to open).
struct Entry {
  uint32_t extent;
  int slot;
};

}  // namespace

struct SequentialReader::Impl {
  Impl(std::vector<Extent> extents, ReaderOptions options);
  ~Impl();

  bool next(Chunk& out);
  void skip_extent();

  void fill();
  void open_extent(uint32_t k);
  void give_buffer(Slot& sl, size_t size, size_t alignment);
  void issue(uint32_t k, int s);
  void submit(int s);
  int free_slot() const;
  void close_if_idle(uint32_t k);

  void poll(size_t min_wait);
  void wait_for_data();
  void on_completion(int s, int64_t res) noexcept;
  void on_data(int s, size_t got);
  void on_error(int s, int err);
  void read_rest_buffered(Slot& sl, ExtentState& x);

  bool deliver_marker(uint32_t k, Chunk& out);
  void deliver(int s, Chunk& out);
  void drop_front(uint32_t k);
  void release_held();
  void drain() noexcept;
  void close() noexcept;
  void check_open() const;

  OwnerProcess owner;
  bool closed = false;
  std::vector<Extent> extents;
  ReaderOptions opts;
  size_t chunk_base = 0;
  std::unique_ptr<IoEngine> engine;
  const char* engine_name = "";  // kept after close()
  std::vector<ExtentState> ext;
  std::vector<Slot> slots;
  size_t slots_with_buffers = 0;
  bool registration_tried = false;
  std::deque<Entry> queue;  // issued requests and markers, in delivery order
  uint32_t issue_ext = 0;   // the extent the issuer is working on
  unsigned in_flight = 0;
  int held = -1;            // slot whose data the caller holds
  int64_t current = -1;     // extent of the last chunk delivered or error raised
  ReaderStats stats;
};

SequentialReader::Impl::Impl(std::vector<Extent> e, ReaderOptions o)
    : extents(std::move(e)), opts(std::move(o)) {
  if (extents.size() > UINT32_MAX) throw std::invalid_argument("too many extents");
  chunk_base = std::clamp<size_t>(opts.chunk_size, 1, kMaxChunk);
  engine = make_engine(opts.engine, std::max(1u, opts.queue_depth));
  engine_name = engine->name();
  ext.resize(extents.size());
  slots.resize(engine->depth() + 1);  // +1: the chunk the caller holds
  try {
    fill();  // start reading before the first next()
  } catch (...) {
    drain();  // the destructor will not run: no buffer may go while the kernel writes it
    throw;
  }
}

// ---- issuing ----

void SequentialReader::Impl::fill() {
  while (issue_ext < ext.size() && queue.size() < slots.size()) {
    ExtentState& x = ext[issue_ext];
    if (!x.opened) {
      if (free_slot() < 0) return;  // open files no faster than buffers free up
      open_extent(issue_ext);
    }
    if (x.stop || x.next >= x.end) {
      x.stop = true;
      close_if_idle(issue_ext++);
      continue;
    }
    int s = free_slot();
    if (s < 0 || in_flight >= engine->depth()) return;
    issue(issue_ext, s);
  }
}

void SequentialReader::Impl::open_extent(uint32_t k) {
  ExtentState& x = ext[k];
  const Extent& e = extents[k];
  x.opened = true;
  x.start = e.start;
  try {
    x.file = std::make_unique<InputFile>(e.path, opts.direct);
  } catch (...) {
    x.error = std::current_exception();  // raised at this extent's turn, not now
    x.stop = true;
    queue.push_back({k, -1});
    return;
  }
  if (x.file->direct()) ++stats.direct_files;
  else if (opts.direct) ++stats.buffered_files;
  const DioAlignment& a = x.file->alignment();
  x.end = std::min(e.end, x.file->size());
  x.chunk = align_up(chunk_base, a.offset);
  x.next = align_down(x.start, a.offset);
  if (x.start >= x.end) {  // nothing to read: one empty chunk
    x.stop = true;
    queue.push_back({k, -1});
  }
}

int SequentialReader::Impl::free_slot() const {
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i].state == SlotState::kFree) return static_cast<int>(i);
  return -1;
}

void SequentialReader::Impl::issue(uint32_t k, int s) {
  ExtentState& x = ext[k];
  Slot& sl = slots[s];
  const DioAlignment& a = x.file->alignment();
  const size_t mem_align = std::max<size_t>(4096, a.memory);
  if (sl.buf.size() < x.chunk || reinterpret_cast<uintptr_t>(sl.buf.data()) % mem_align != 0)
    give_buffer(sl, x.chunk, mem_align);  // first use, or a file with larger alignment
  sl.extent = k;
  sl.offset = x.next;
  // The last request is rounded up to the alignment; O_DIRECT stops short at EOF.
  sl.len = static_cast<size_t>(std::min<uint64_t>(x.chunk, align_up(x.end - x.next, a.offset)));
  sl.filled = 0;
  sl.first = !x.issued_any;
  sl.eof = false;
  sl.orphan = false;
  sl.error = nullptr;
  submit(s);
  x.issued_any = true;
  x.next += sl.len;
  queue.push_back({k, s});
}

// Once every slot has a buffer (a reader that goes on past its first depth + 1 requests), the
// buffers are registered with the engine, which then need not pin each page of each request.
// A buffer replaced later (a file with a larger alignment) reads unregistered.
void SequentialReader::Impl::give_buffer(Slot& sl, size_t size, size_t alignment) {
  slots_with_buffers -= sl.buf.data() != nullptr;
  BufferCache::give(std::move(sl.buf));
  sl.buf = BufferCache::take(size, alignment);
  sl.fixed = -1;
  if (++slots_with_buffers < slots.size() || registration_tried) return;
  registration_tried = true;
  std::vector<BufferSpan> spans;
  for (const Slot& each : slots) spans.push_back({each.buf.data(), each.buf.size()});
  if (!engine->register_buffers(spans.data(), spans.size())) return;
  for (size_t i = 0; i < slots.size(); ++i) slots[i].fixed = static_cast<int>(i);
}

// (Re)submits the unfilled rest of slot s. Throws only if the engine refuses the request.
void SequentialReader::Impl::submit(int s) {
  Slot& sl = slots[s];
  ExtentState& x = ext[sl.extent];
  sl.submitted = Clock::now();  // before: io_uring may issue the read inside the syscall
  if (sl.fixed >= 0) {
    engine->submit_read_fixed(x.file->fd(), sl.buf.data() + sl.filled, sl.len - sl.filled,
                              sl.offset + sl.filled, static_cast<uint64_t>(s),
                              static_cast<unsigned>(sl.fixed));
    ++stats.registered_requests;
  } else {
    engine->submit_read(x.file->fd(), sl.buf.data() + sl.filled, sl.len - sl.filled,
                        sl.offset + sl.filled, static_cast<uint64_t>(s));
  }
  sl.direct = x.file->direct();
  sl.state = SlotState::kInFlight;
  ++in_flight;
  ++x.in_flight;
}

// Files stay open only while they may still be read: bounds open fds to about queue_depth.
void SequentialReader::Impl::close_if_idle(uint32_t k) {
  ExtentState& x = ext[k];
  if (!x.stop || x.in_flight) return;
  x.file.reset();
  x.buffered.reset();
}

// ---- completions ----

void SequentialReader::Impl::poll(size_t min_wait) {
  IoCompletion done[kReapBatch];
  size_t n = engine->reap(done, kReapBatch, min_wait);
  for (size_t i = 0; i < n; ++i) on_completion(static_cast<int>(done[i].tag), done[i].result);
}

// Never throws: losing track of one completion would lose the others reaped with it.
void SequentialReader::Impl::on_completion(int s, int64_t res) noexcept {
  Slot& sl = slots[s];
  const uint32_t k = sl.extent;
  --in_flight;
  --ext[k].in_flight;
  ++stats.requests;
  stats.latency.record(ns_since(sl.submitted));
  if (res > 0) stats.bytes_read += static_cast<uint64_t>(res);
  if (sl.orphan) {
    sl.orphan = false;
    sl.state = SlotState::kFree;
  } else {
    try {
      if (res < 0) on_error(s, static_cast<int>(-res));
      else on_data(s, static_cast<size_t>(res));
    } catch (...) {
      sl.error = std::current_exception();
      sl.state = SlotState::kReady;
      ext[k].stop = true;
    }
  }
  close_if_idle(k);
}

void SequentialReader::Impl::on_data(int s, size_t got) {
  Slot& sl = slots[s];
  ExtentState& x = ext[sl.extent];
  sl.filled += got;
  const uint64_t pos = sl.offset + sl.filled;
  sl.state = SlotState::kReady;
  if (sl.filled >= sl.len || pos >= x.end) return;
  if (got == 0) {  // EOF before the size seen at open: the file shrank, deliver what there is
    sl.eof = true;
    x.stop = true;
    return;
  }
  ++stats.short_reads;
  const DioAlignment& a = x.file->alignment();
  if (!x.file->direct() || (pos % a.offset == 0 && sl.filled % a.memory == 0)) {
    submit(s);  // the remainder is a valid request on this fd
    return;
  }
  read_rest_buffered(sl, x);  // O_DIRECT cannot continue at an unaligned offset
}

void SequentialReader::Impl::read_rest_buffered(Slot& sl, ExtentState& x) {
  const std::string& path = extents[sl.extent].path;
  if (!x.buffered) x.buffered = std::make_unique<InputFile>(path, false);
  const uint64_t want = std::min<uint64_t>(sl.offset + sl.len, x.end);
  while (sl.offset + sl.filled < want) {
    const uint64_t pos = sl.offset + sl.filled;
    ssize_t n = ::pread(x.buffered->fd(), sl.buf.data() + sl.filled, want - pos,
                        static_cast<off_t>(pos));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_io_error(errno, "read", path, static_cast<int64_t>(pos));
    if (n == 0) {
      sl.eof = true;
      x.stop = true;
      return;
    }
    sl.filled += static_cast<size_t>(n);
    stats.bytes_read += static_cast<uint64_t>(n);
  }
}

void SequentialReader::Impl::on_error(int s, int err) {
  Slot& sl = slots[s];
  ExtentState& x = ext[sl.extent];
  if (err == EINVAL && sl.direct) {
    // The filesystem took O_DIRECT at open but refuses this read: go on buffered.
    if (x.file->direct()) {
      x.file->fall_back_to_buffered();
      ++stats.buffered_files;
    }
    submit(s);
    return;
  }
  x.stop = true;
  sl.state = SlotState::kReady;
  sl.error = std::make_exception_ptr(IoError(err, "read", extents[sl.extent].path,
                                             static_cast<int64_t>(sl.offset + sl.filled)));
}

// ---- delivery ----

bool SequentialReader::Impl::next(Chunk& out) {
  release_held();
  poll(0);  // collect finished reads without blocking
  fill();
  wait_for_data();
  if (queue.empty()) return false;
  const Entry e = queue.front();
  current = e.extent;
  if (e.slot < 0) return deliver_marker(e.extent, out);
  if (slots[e.slot].error) std::rethrow_exception(slots[e.slot].error);  // until skip_extent()
  queue.pop_front();
  deliver(e.slot, out);
  try {
    fill();  // keep reading while the caller works on this chunk
  } catch (...) {
    // The chunk is already taken off the queue; the next call's fill() reports the failure.
  }
  return true;
}

// Blocks until the queue's front is deliverable (or nothing more will come), timing the wait.
void SequentialReader::Impl::wait_for_data() {
  // Only reads of a dropped extent hold the buffers or the depth: wait until they finish.
  auto starved = [&] { return queue.empty() && issue_ext < ext.size() && in_flight > 0; };
  auto pending = [&] {
    return !queue.empty() && queue.front().slot >= 0 &&
           slots[queue.front().slot].state == SlotState::kInFlight;
  };
  if (!starved() && !pending()) return;  // reading keeps ahead: no clock call
  struct Timer {  // adds the wait even when poll() throws
    uint64_t& total;
    Clock::time_point start = Clock::now();
    ~Timer() { total += ns_since(start); }
  } timer{stats.wait_ns};
  while (starved() || pending()) {
    poll(1);
    fill();  // completions lower in_flight: a buffer freed above may now be issued
  }
}

bool SequentialReader::Impl::deliver_marker(uint32_t k, Chunk& out) {
  const ExtentState& x = ext[k];
  if (x.error) std::rethrow_exception(x.error);  // stays queued until skip_extent()
  queue.pop_front();
  out = Chunk();
  out.extent = k;
  out.offset = x.start;
  out.first = out.last = true;
  return true;
}

void SequentialReader::Impl::deliver(int s, Chunk& out) {
  Slot& sl = slots[s];
  const ExtentState& x = ext[sl.extent];
  const uint64_t begin = std::max(sl.offset, x.start);
  const uint64_t end = std::max(begin, std::min<uint64_t>(sl.offset + sl.filled, x.end));
  out.extent = sl.extent;
  out.offset = begin;
  out.data = sl.buf.data() + (begin - sl.offset);
  out.size = static_cast<size_t>(end - begin);
  out.first = sl.first;
  out.last = sl.eof || sl.offset + sl.len >= x.end;
  sl.state = SlotState::kHeld;
  held = s;
  if (sl.eof) drop_front(sl.extent);  // later requests of a shrunk file read nothing
}

// Drops the queued rest of extent k, which is at the queue's front when k is current.
void SequentialReader::Impl::drop_front(uint32_t k) {
  while (!queue.empty() && queue.front().extent == k) {
    const int s = queue.front().slot;
    queue.pop_front();
    if (s < 0) continue;
    Slot& sl = slots[s];
    if (sl.state == SlotState::kInFlight) sl.orphan = true;  // the kernel still owns it
    else sl.state = SlotState::kFree;
    sl.error = nullptr;
  }
  ext[k].stop = true;
  close_if_idle(k);
}

void SequentialReader::Impl::skip_extent() {
  release_held();
  if (current >= 0) drop_front(static_cast<uint32_t>(current));
}

void SequentialReader::Impl::release_held() {
  if (held >= 0) slots[held].state = SlotState::kFree;
  held = -1;
}

void SequentialReader::Impl::drain() noexcept {
  try {
    while (in_flight > 0) {
      IoCompletion done[kReapBatch];
      size_t n = engine->reap(done, kReapBatch, 1);
      for (size_t i = 0; i < n; ++i) slots[done[i].tag].state = SlotState::kFree;
      in_flight -= static_cast<unsigned>(n);
    }
  } catch (...) {
    // The engine broke with reads outstanding: leak their buffers rather than free memory
    // the kernel may still write.
    for (Slot& sl : slots)
      if (sl.state == SlotState::kInFlight) (void)new AlignedBuffer(std::move(sl.buf));
  }
}

// Only here are the buffers given back: after close() a Python view of the last chunk may
// still read its buffer, and it keeps the reader alive until it goes. Buffers drain() could
// not wait for are gone from their slots by now (leaked).
SequentialReader::Impl::~Impl() {
  close();
  for (Slot& sl : slots) BufferCache::give(std::move(sl.buf));
}

void SequentialReader::Impl::close() noexcept {
  if (closed) return;
  drain();
  engine.reset();
  ext.clear();  // closes the files
  queue.clear();
  held = -1;
  closed = true;
}

void SequentialReader::Impl::check_open() const {
  owner.check("this reader");
  if (closed) throw std::logic_error("the reader is closed");
}

// ---- public ----

SequentialReader::SequentialReader(std::vector<Extent> extents, ReaderOptions options)
    : impl_(std::make_unique<Impl>(std::move(extents), std::move(options))) {}

SequentialReader::~SequentialReader() {
  if (!impl_->owner.here()) (void)impl_.release();  // a fork() child's copy: leak, touch nothing
}

bool SequentialReader::next(Chunk& out) {
  impl_->check_open();
  return impl_->next(out);
}

void SequentialReader::skip_extent() {
  impl_->check_open();
  impl_->skip_extent();
}

void SequentialReader::close() noexcept {
  if (impl_->owner.here()) impl_->close();
}

bool SequentialReader::closed() const noexcept { return impl_->closed; }

const char* SequentialReader::engine_name() const noexcept { return impl_->engine_name; }

const ReaderStats& SequentialReader::stats() const noexcept { return impl_->stats; }

}  // namespace flashstream
