// Copy-on-write snapshot with userfaultfd write protection (see cow_snapshot.hpp).
//
// Construction: validate, plan (which pages are protected, which bytes are copied eagerly),
// register the protectable spans, build the block table, start the handler and copier threads,
// write-protect, let the copier go, copy the eager bytes. Everything the two threads use is
// allocated before the first page is protected: a thread that allocated afterwards could be
// handed a freed chunk inside a protected page and fault on itself (the handler would then
// wait for itself). For the same reason the threads record errors as (errno, op) and the
// IoError is built in wait(), on the caller's thread.
//
// Block protocol: state 0 -> 1 (claimed by a compare-exchange, by the copier or the handler)
// -> copied -> un-protected (which wakes writers waiting on it) -> 2. Nobody holds a lock while
// copying; whoever loses the claim waits for state 2, which the winner always reaches because
// copying reads the source and writes the destination, neither of which is protected.
#include "snapshot/cow_snapshot.hpp"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>

#include "common/errors.hpp"

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)  // Linux 6.4; older headers lack it
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

namespace flashstream {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Probe {
  CowMode mode = CowMode::kNone;
  int flags = 0;          // extra userfaultfd(2) flags (UFFD_USER_MODE_ONLY or 0)
  uint64_t features = 0;  // UFFDIO_API features to request
  bool wp_unpopulated = false;
  bool events = false;    // told when protected memory is unmapped, zapped or moved
};

// Memory-change events: a source released while the snapshot runs (free() of a tensor's
// storage, FSDP's storage.resize_(0)) is reported by lost(), not copied as zeros or as someone
// else's data. Not EVENT_REMAP: with it, mremap keeps the moved pages registered and
// write-protected at an address no block covers, and a write there would fault forever.
// Without it the kernel clears their protection, and the old range reports as unmapped.
constexpr uint64_t kEventFeatures = UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMOVE;

int uffd_open(int extra_flags) {
  return static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | extra_flags));
}

// ioctl, retried on EINTR and EAGAIN (the mm is changing under us); 0 or errno.
int uffd_ioctl(int fd, unsigned long request, void* arg) {
  for (;;) {
    if (ioctl(fd, request, arg) == 0) return 0;
    if (errno != EINTR && errno != EAGAIN) return errno;
    sched_yield();
  }
}

int set_protection(int fd, uintptr_t start, size_t len, bool protect) {
  uffdio_writeprotect wp{};
  wp.range.start = start;
  wp.range.len = len;
  wp.mode = protect ? UFFDIO_WRITEPROTECT_MODE_WP : 0;  // un-protecting wakes the waiters
  return uffd_ioctl(fd, UFFDIO_WRITEPROTECT, &wp);
}

// Opens a userfaultfd with `extra_flags` and negotiates write-protect faults; -1 when refused.
int uffd_open_wp(int extra_flags, uint64_t features) {
  int fd = uffd_open(extra_flags);
  if (fd < 0) return -1;
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = features;
  if (uffd_ioctl(fd, UFFDIO_API, &api) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Register, protect, un-protect and unregister one private anonymous page.
bool test_registration(int extra_flags, uint64_t features) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  int fd = uffd_open_wp(extra_flags, features);
  if (fd < 0) return false;
  void* mem = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  bool ok = false;
  if (mem != MAP_FAILED) {
    static_cast<volatile uint8_t*>(mem)[0] = 1;
    uffdio_register reg{};
    reg.range.start = reinterpret_cast<uintptr_t>(mem);
    reg.range.len = page;
    reg.mode = UFFDIO_REGISTER_MODE_WP;
    if (uffd_ioctl(fd, UFFDIO_REGISTER, &reg) == 0) {
      ok = (reg.ioctls & (uint64_t(1) << _UFFDIO_WRITEPROTECT)) &&
           set_protection(fd, reg.range.start, page, true) == 0 &&
           set_protection(fd, reg.range.start, page, false) == 0;
      uffd_ioctl(fd, UFFDIO_UNREGISTER, &reg.range);
    }
    munmap(mem, page);
  }
  close(fd);
  return ok;
}

Probe run_probe() {
  Probe p;
  for (int extra : {0, UFFD_USER_MODE_ONLY}) {  // full mode first: kernel writes fault too
    int fd = uffd_open(extra);
    if (fd < 0) continue;
    uffdio_api api{};
    api.api = UFFD_API;
    api.features = 0;  // ask what the kernel supports
    const bool api_ok = uffd_ioctl(fd, UFFDIO_API, &api) == 0;
    close(fd);
    if (!api_ok || !(api.features & UFFD_FEATURE_PAGEFAULT_FLAG_WP)) continue;
    uint64_t want = UFFD_FEATURE_PAGEFAULT_FLAG_WP;
    const bool unpopulated = api.features & UFFD_FEATURE_WP_UNPOPULATED;
    if (unpopulated) want |= UFFD_FEATURE_WP_UNPOPULATED;
    const bool events = (api.features & kEventFeatures) == kEventFeatures;
    if (events) want |= kEventFeatures;
    if (!test_registration(extra, want)) continue;
    p.mode = extra ? CowMode::kUserOnly : CowMode::kFull;
    p.flags = extra;
    p.features = want;
    p.wp_unpopulated = unpopulated;
    p.events = events;
    break;
  }
  return p;
}

const Probe& probe() {
  static const Probe p = run_probe();
  return p;
}

// Copies len bytes from src in this process's own memory without faulting: process_vm_readv
// returns short (EFAULT) where src was unmapped under us, where memcpy would SIGSEGV. Falls
// back to memcpy where a seccomp filter refuses the call (probed once). True when all copied.
bool self_readv_usable() noexcept {
  static const bool usable = [] {
    char a = 1, b = 0;
    iovec local{&b, 1}, remote{&a, 1};
    return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == 1 && b == 1;
  }();
  return usable;
}

bool safe_copy(void* dst, const void* src, size_t len) noexcept {
  if (!self_readv_usable()) {
    std::memcpy(dst, src, len);
    return true;
  }
  const pid_t self = getpid();
  size_t done = 0;
  while (done < len) {
    iovec local{static_cast<uint8_t*>(dst) + done, len - done};
    iovec remote{const_cast<uint8_t*>(static_cast<const uint8_t*>(src)) + done, len - done};
    const ssize_t n = process_vm_readv(self, &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

uintptr_t round_down(uintptr_t v, size_t a) { return v / a * a; }
uintptr_t round_up(uintptr_t v, size_t a) { return (v + a - 1) / a * a; }

// Intervals of private, writable, anonymous memory (heap included), merged where adjacent.
// Shared memory is left out on purpose: another process writing it would not fault here.
std::vector<std::pair<uintptr_t, uintptr_t>> private_anonymous_memory() {
  std::vector<std::pair<uintptr_t, uintptr_t>> out;
  int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;  // nothing is protected
  std::string text;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    // start-end perms offset dev inode [path]
    char* rest = nullptr;
    const uintptr_t start = std::strtoull(line.c_str(), &rest, 16);
    if (*rest != '-') continue;
    const uintptr_t end = std::strtoull(rest + 1, &rest, 16);
    if (std::strlen(rest) < 5) continue;
    const char* perms = rest + 1;
    if (perms[0] != 'r' || perms[1] != 'w' || perms[3] != 'p') continue;
    const char* p = perms + 4;
    for (int field = 0; field < 3; ++field) {  // offset, dev, inode
      while (*p == ' ') ++p;
      while (*p && *p != ' ') ++p;
    }
    while (*p == ' ') ++p;
    const std::string path(p);
    const bool anonymous = path.empty() || path == "[heap]" || path.rfind("[anon:", 0) == 0;
    if (!anonymous) continue;
    if (!out.empty() && out.back().second == start)
      out.back().second = end;
    else
      out.emplace_back(start, end);
  }
  return out;
}

void validate(const std::vector<CopyRange>& ranges, size_t block, size_t page) {
  if (block == 0 || block % page)
    throw std::invalid_argument("block must be a positive multiple of the page size " +
                                std::to_string(page));
  std::vector<std::pair<uintptr_t, uintptr_t>> srcs;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const CopyRange& r = ranges[i];
    if (r.len == 0) continue;
    const uintptr_t s = reinterpret_cast<uintptr_t>(r.src), d = reinterpret_cast<uintptr_t>(r.dst);
    if (!s || !d)
      throw std::invalid_argument("range " + std::to_string(i) + " has a null address");
    if (s + r.len < s || d + r.len < d)
      throw std::invalid_argument("range " + std::to_string(i) + " wraps around memory");
    srcs.emplace_back(s, s + r.len);
  }
  std::sort(srcs.begin(), srcs.end());
  std::vector<uintptr_t> max_end(srcs.size());  // max end over srcs[0..i]
  for (size_t i = 0; i < srcs.size(); ++i)
    max_end[i] = std::max(srcs[i].second, i ? max_end[i - 1] : 0);
  for (size_t i = 0; i < ranges.size(); ++i) {
    const CopyRange& r = ranges[i];
    if (r.len == 0) continue;
    const uintptr_t d = reinterpret_cast<uintptr_t>(r.dst), e = d + r.len;
    // Sources starting before e; one of them overlaps [d, e) iff the largest end exceeds d.
    auto it = std::lower_bound(srcs.begin(), srcs.end(), std::make_pair(e, uintptr_t(0)));
    if (it != srcs.begin() && max_end[static_cast<size_t>(it - srcs.begin()) - 1] > d)
      throw std::invalid_argument("destination of range " + std::to_string(i) +
                                  " overlaps a source");
  }
}

}  // namespace

CowMode cow_mode() { return probe().mode; }

const char* cow_mode_name(CowMode mode) {
  switch (mode) {
    case CowMode::kFull: return "full";
    case CowMode::kUserOnly: return "user";
    default: return "none";
  }
}

bool cow_available() { return cow_mode() == CowMode::kFull; }

CowSnapshot::CowSnapshot(std::vector<CopyRange> ranges, size_t block, bool allow_user_mode_only)
    : block_(block), page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
  validate(ranges, block_, page_);
  const CowMode mode = cow_mode();
  const bool use_uffd =
      mode == CowMode::kFull || (mode == CowMode::kUserOnly && allow_user_mode_only);
  if (use_uffd) plan(ranges);
  else eager_ = std::move(ranges);
  if (!segments_.empty() && !open_uffd(allow_user_mode_only)) {
    for (const Segment& s : segments_)
      eager_.push_back({reinterpret_cast<const uint8_t*>(s.start), s.dst, s.end - s.start});
    segments_.clear();
  }
  if (!segments_.empty()) {
    (void)self_readv_usable();  // probed here: the copier thread must not start by doing it
    register_spans();  // throws with nothing protected
    build_blocks();
  }
  if (!segments_.empty()) {
    try {
      start_threads();
      const Clock::time_point t0 = Clock::now();
      protect_segments();
      protect_seconds_ = seconds_since(t0);
      protected_at_ = Clock::now();
      {
        std::lock_guard<std::mutex> lock(mu_);
        go_ = true;
      }
      cv_.notify_all();
    } catch (...) {
      abort_and_finish();
      throw;
    }
  } else {
    if (uffd_ >= 0) close(uffd_);
    uffd_ = -1;
    finished_ = true;
    joined_ = true;
  }
  const Clock::time_point t1 = Clock::now();
  for (const CopyRange& r : eager_) {
    if (r.len) std::memcpy(r.dst, r.src, r.len);
    eager_bytes_ += r.len;
  }
  eager_seconds_ = seconds_since(t1);
}

CowSnapshot::~CowSnapshot() { finish(); }

void CowSnapshot::plan(const std::vector<CopyRange>& ranges) {
  const auto anon = private_anonymous_memory();
  std::map<uintptr_t, uintptr_t> claimed;  // protected page intervals so far (disjoint)
  struct Piece {
    uintptr_t start, end;
    uint8_t* dst;
    size_t area;  // index into anon
  };
  std::vector<Piece> pieces;
  auto eager = [&](uintptr_t s, uintptr_t e, const CopyRange& r) {
    if (e > s) eager_.push_back({reinterpret_cast<const uint8_t*>(s),
                                 r.dst + (s - reinterpret_cast<uintptr_t>(r.src)), e - s});
  };
  for (const CopyRange& r : ranges) {
    if (r.len == 0) continue;
    const uintptr_t s = reinterpret_cast<uintptr_t>(r.src), e = s + r.len;
    const uintptr_t a = round_up(s, page_), b = round_down(e, page_);
    if (a >= b) {
      eager(s, e, r);
      continue;
    }
    eager(s, a, r);  // partial pages at the edges
    eager(b, e, r);
    auto next = claimed.lower_bound(b);  // first claimed interval starting at or after b
    const bool overlaps = next != claimed.begin() && std::prev(next)->second > a;
    if (overlaps) {  // tied/shared storage: protect each page for one destination only
      eager(a, b, r);
      continue;
    }
    claimed.emplace(a, b);
    uintptr_t cur = a;
    auto it = std::upper_bound(anon.begin(), anon.end(), std::make_pair(a, UINTPTR_MAX));
    if (it != anon.begin()) --it;
    for (; it != anon.end() && it->first < b && cur < b; ++it) {
      const uintptr_t lo = std::max(cur, it->first), hi = std::min(b, it->second);
      if (hi <= lo) continue;
      eager(cur, lo, r);  // not private anonymous memory
      pieces.push_back({lo, hi, r.dst + (lo - s), static_cast<size_t>(it - anon.begin())});
      cur = hi;
    }
    eager(cur, b, r);
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& x, const Piece& y) { return x.start < y.start; });
  // One registration per mapping area covers all its pieces: registering every tensor on its
  // own would split the mapping into one VMA per tensor.
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    if (i == 0 || pieces[i - 1].area != p.area) spans_.push_back({p.start, p.end, false});
    spans_.back().end = p.end;
    segments_.push_back({p.start, p.end, p.dst, 0, spans_.size() - 1});
  }
}

bool CowSnapshot::open_uffd(bool allow_user_mode_only) noexcept {
  const Probe& p = probe();
  if (p.mode == CowMode::kNone) return false;
  if (p.mode == CowMode::kUserOnly && !allow_user_mode_only) return false;
  uffd_ = uffd_open_wp(p.flags, p.features);
  return uffd_ >= 0;
}

void CowSnapshot::register_spans() {
  for (Span& sp : spans_) {
    uffdio_register reg{};
    reg.range.start = sp.start;
    reg.range.len = sp.end - sp.start;
    reg.mode = UFFDIO_REGISTER_MODE_WP;
    const int err = uffd_ioctl(uffd_, UFFDIO_REGISTER, &reg);
    if (err == 0) {
      sp.registered = true;
      continue;
    }
    // Memory userfaultfd refuses, or that another snapshot still holds: copy it now.
    if (err == EINVAL || err == EPERM || err == EBUSY) continue;
    release_all();
    close(uffd_);
    uffd_ = -1;
    throw_io_error(err, "UFFDIO_REGISTER", "", static_cast<int64_t>(sp.start));
  }
  std::vector<Segment> kept;
  kept.reserve(segments_.size());
  for (const Segment& s : segments_) {
    if (spans_[s.span].registered)
      kept.push_back(s);
    else
      eager_.push_back({reinterpret_cast<const uint8_t*>(s.start), s.dst, s.end - s.start});
  }
  segments_ = std::move(kept);
}

void CowSnapshot::build_blocks() {
  nblocks_ = 0;
  for (Segment& s : segments_) {
    s.first_block = nblocks_;
    nblocks_ += (s.end - 1) / block_ - s.start / block_ + 1;
    protected_bytes_ += s.end - s.start;
  }
  blocks_.reset(new Block[nblocks_]);
  for (const Segment& s : segments_) {
    Block* b = &blocks_[s.first_block];
    for (uintptr_t at = s.start; at < s.end; ++b) {
      const uintptr_t next = std::min<uintptr_t>(round_down(at, block_) + block_, s.end);
      b->addr = at;
      b->len = next - at;
      b->dst = s.dst + (at - s.start);
      at = next;
    }
  }
}

void CowSnapshot::start_threads() {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw_io_error(errno, "eventfd", "");
  handler_ = std::thread([this] { handler_main(); });
  copier_ = std::thread([this] { copier_main(); });
}

void CowSnapshot::protect_segments() {
  const bool populate = !probe().wp_unpopulated;
  for (const Segment& s : segments_) {
    if (populate) {
      // Without UFFD_FEATURE_WP_UNPOPULATED a page never touched has no PTE to protect and its
      // first write would not fault: map the zero page there first.
      if (madvise(reinterpret_cast<void*>(s.start), s.end - s.start, MADV_POPULATE_READ) != 0)
        for (uintptr_t a = s.start; a < s.end; a += page_)
          (void)*reinterpret_cast<const volatile uint8_t*>(a);
    }
    const int err = set_protection(uffd_, s.start, s.end - s.start, true);
    if (err) throw_io_error(err, "UFFDIO_WRITEPROTECT", "", static_cast<int64_t>(s.start));
  }
}

// Un-protects every segment (waking anyone waiting) and unregisters every span. Idempotent;
// errors are ignored: this is the path that must not stop half-way.
void CowSnapshot::release_all() noexcept {
  if (uffd_ < 0) return;
  for (const Segment& s : segments_) set_protection(uffd_, s.start, s.end - s.start, false);
  for (Span& sp : spans_) {
    if (!sp.registered) continue;
    uffdio_range range{sp.start, sp.end - sp.start};
    uffd_ioctl(uffd_, UFFDIO_UNREGISTER, &range);
    sp.registered = false;
  }
}

void CowSnapshot::fail(int err, const char* op) noexcept {
  int expected = 0;
  if (error_.compare_exchange_strong(expected, err)) error_op_ = op;
  aborted_ = true;
}

bool CowSnapshot::copy_block(Block& b, bool by_fault) noexcept {
  if (!safe_copy(b.dst, reinterpret_cast<const void*>(b.addr), b.len))
    b.lost.store(true, std::memory_order_relaxed);  // the source went away mid-copy
  int err = set_protection(uffd_, b.addr, b.len, false);
  if (err == ENOENT) {  // nothing mapped there any more: nothing left to un-protect
    b.lost.store(true, std::memory_order_relaxed);
    err = 0;
  }
  if (err) fail(err, "UFFDIO_WRITEPROTECT");
  b.done_epoch = epoch_.load();  // before state 2: lose() reads it after seeing 2
  b.state.store(2, std::memory_order_release);
  if (by_fault) {
    fault_copies_.fetch_add(1, std::memory_order_relaxed);
    fault_bytes_.fetch_add(b.len, std::memory_order_relaxed);
  } else {
    background_bytes_.fetch_add(b.len, std::memory_order_relaxed);
  }
  return err == 0;
}

void CowSnapshot::wait_block(const Block& b) const noexcept {
  for (unsigned spin = 0; b.state.load(std::memory_order_acquire) == 1; ++spin)
    if (spin > 64) sched_yield();
}

CowSnapshot::Block* CowSnapshot::find_block(uintptr_t addr) noexcept {
  auto it = std::upper_bound(segments_.begin(), segments_.end(), addr,
                             [](uintptr_t a, const Segment& s) { return a < s.start; });
  if (it == segments_.begin()) return nullptr;
  --it;
  if (addr >= it->end) return nullptr;
  return &blocks_[it->first_block + addr / block_ - it->start / block_];
}

void CowSnapshot::serve_fault(uintptr_t addr) noexcept {
  Block* b = find_block(addr);
  if (b) {
    uint8_t expected = 0;
    if (b->state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
      copy_block(*b, true);  // un-protecting wakes the writer
      return;
    }
    wait_block(*b);
  }
  // Copied already (a race with the copier), or not ours: the writer may still be queued.
  uffdio_range range{round_down(addr, page_), page_};
  const int err = uffd_ioctl(uffd_, UFFDIO_WAKE, &range);
  if (err && err != ENOENT) fail(err, "UFFDIO_WAKE");
}

// Memory in [start, end) was unmapped or zapped (MADV_DONTNEED/REMOVE): whatever part of it
// was not copied before the event was read is gone. The kernel zaps only once the event is
// read, so a copy that finished after that read began (epoch) may have read zeros: lost too.
// Runs on the handler thread, so it must not allocate.
void CowSnapshot::lose(uintptr_t start, uintptr_t end, uint64_t epoch) noexcept {
  auto it = std::upper_bound(segments_.begin(), segments_.end(), start,
                             [](uintptr_t a, const Segment& s) { return a < s.start; });
  if (it != segments_.begin()) --it;
  for (; it != segments_.end() && it->start < end; ++it) {
    if (it->end <= start) continue;
    const uintptr_t lo = std::max(start, it->start), hi = std::min(end, it->end);
    const size_t first = it->first_block + lo / block_ - it->start / block_;
    const size_t last = it->first_block + (hi - 1) / block_ - it->start / block_;
    for (size_t i = first; i <= last; ++i) {
      Block& b = blocks_[i];
      if (b.state.load(std::memory_order_acquire) != 2 || b.done_epoch >= epoch)
        b.lost.store(true, std::memory_order_relaxed);
    }
  }
}

void CowSnapshot::handler_main() noexcept {
  pollfd fds[2] = {{uffd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  uffd_msg msgs[16];
  while (!stop_.load(std::memory_order_acquire)) {
    const int n = poll(fds, 2, 100);
    if (n < 0 && errno != EINTR) {
      fail(errno, "poll");
      return;  // the copier sees aborted_ and un-protects everything, which wakes writers
    }
    for (;;) {  // drain
      const uint64_t epoch = epoch_.fetch_add(1) + 1;  // copies finishing from now on race
      const ssize_t got = read(uffd_, msgs, sizeof msgs);
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN) {
          fail(errno, "read userfaultfd");
          return;
        }
        break;
      }
      for (size_t i = 0; i < static_cast<size_t>(got) / sizeof(uffd_msg); ++i) {
        const uffd_msg& m = msgs[i];
        if (m.event == UFFD_EVENT_PAGEFAULT)
          serve_fault(m.arg.pagefault.address);
        else if (m.event == UFFD_EVENT_UNMAP || m.event == UFFD_EVENT_REMOVE)
          lose(m.arg.remove.start, m.arg.remove.end, epoch);
      }
    }
  }
}

void CowSnapshot::copier_main() noexcept {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return go_; });
  }
  for (size_t i = 0; i < nblocks_ && !aborted_.load(std::memory_order_relaxed); ++i) {
    uint8_t expected = 0;
    if (blocks_[i].state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel))
      copy_block(blocks_[i], false);
  }
  for (size_t i = 0; i < nblocks_; ++i) wait_block(blocks_[i]);  // the handler's copies
  copy_seconds_ = std::chrono::duration<double>(Clock::now() - protected_at_).count();
  if (!aborted_) {
    for (Span& sp : spans_) {
      uffdio_range range{sp.start, sp.end - sp.start};
      const int err = uffd_ioctl(uffd_, UFFDIO_UNREGISTER, &range);
      // EINVAL/ENOENT: the span no longer is one registrable mapping (a file was mapped into a
      // gap between the sources, or memory was unmapped). Every block is copied and
      // un-protected by now, and closing the userfaultfd drops what is still registered.
      if (err && err != EINVAL && err != ENOENT) fail(err, "UFFDIO_UNREGISTER");
      else sp.registered = false;
    }
  }
  if (aborted_) release_all();
  stop_.store(true, std::memory_order_release);
  const uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
  finished_.store(true, std::memory_order_release);
}

void CowSnapshot::abort_and_finish() noexcept {
  aborted_ = true;
  if (copier_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      go_ = true;
    }
    cv_.notify_all();
  } else {
    release_all();
    stop_ = true;
  }
  finish();
  release_all();  // in case the copier never started
}

void CowSnapshot::finish() noexcept {
  if (joined_) return;
  if (copier_.joinable()) copier_.join();
  stop_ = true;
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof one);
    (void)ignored;
  }
  if (handler_.joinable()) handler_.join();
  release_all();  // no-op unless something went wrong before the copier ran
  if (uffd_ >= 0) close(uffd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  uffd_ = wake_fd_ = -1;
  finished_ = true;
  joined_ = true;
}

void CowSnapshot::wait() {
  finish();
  const int err = error_.load();
  if (err) throw_io_error(err, error_op_, "");
}

bool CowSnapshot::done() const { return finished_.load(std::memory_order_acquire); }

CowStats CowSnapshot::stats() const {
  CowStats s;
  s.protected_bytes = protected_bytes_;
  s.eager_bytes = eager_bytes_;
  s.fault_copies = fault_copies_.load();
  s.fault_bytes = fault_bytes_.load();
  s.background_bytes = background_bytes_.load();
  s.protect_seconds = protect_seconds_;
  s.eager_seconds = eager_seconds_;
  s.copy_seconds = copy_seconds_.load();
  if (finished_.load(std::memory_order_acquire))
    for (size_t i = 0; i < nblocks_; ++i)
      if (blocks_[i].lost.load(std::memory_order_relaxed)) s.lost_bytes += blocks_[i].len;
  return s;
}

std::vector<std::pair<uint8_t*, size_t>> CowSnapshot::lost() const {
  std::vector<std::pair<uint8_t*, size_t>> out;
  if (!finished_.load(std::memory_order_acquire)) return out;
  for (size_t i = 0; i < nblocks_; ++i) {
    const Block& b = blocks_[i];
    if (!b.lost.load(std::memory_order_relaxed)) continue;
    if (!out.empty() && out.back().first + out.back().second == b.dst)
      out.back().second += b.len;
    else
      out.emplace_back(b.dst, b.len);
  }
  return out;
}

}  // namespace flashstream
