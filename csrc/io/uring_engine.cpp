// io_uring engine on raw syscalls (no liburing). One SQE per read or write; the SQ array is an
// identity map set up once, so SQEs are filled in ring order.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common/errors.hpp"
#include "io/engines_internal.hpp"

// Generic syscall numbers (identical on every architecture but alpha) for old libc headers.
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif
// Kernel ABI values (5.19 and 6.1) for headers older than the running kernel.
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#define IORING_SETUP_TASKRUN_FLAG (1U << 9)
#endif
#ifndef IORING_SQ_TASKRUN
#define IORING_SQ_TASKRUN (1U << 2)
#endif
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif

namespace flashstream {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}
int sys_register(int fd, unsigned op, void* arg, unsigned nr) {
  return static_cast<int>(syscall(__NR_io_uring_register, fd, op, arg, nr));
}

// Results the kernel may hand back for a request that simply has to be tried again. The cap only
// guards against a ring that cancels forever (e.g. its creating thread is gone).
bool retryable(int res) { return res == -EINTR || res == -EAGAIN || res == -ECANCELED; }
constexpr unsigned kMaxRetries = 1000;

// The kernel caps one read or write at MAX_RW_COUNT anyway; a shorter count is a legal short one.
constexpr size_t kMaxIoLen = 0x7ffff000;
// The kernel's bounds on registered buffers: their number, and each one's size.
constexpr size_t kMaxRegistered = 1 << 14;
constexpr size_t kMaxRegisteredSize = size_t(1) << 30;

struct Fd {
  int fd = -1;
  ~Fd() { if (fd >= 0) ::close(fd); }
};

struct Mapping {
  void* ptr = MAP_FAILED;
  size_t size = 0;
  ~Mapping() { if (ptr != MAP_FAILED) munmap(ptr, size); }
  void map(int fd, size_t len, off_t what) {
    ptr = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, what);
    if (ptr == MAP_FAILED) throw_io_error(errno, "io_uring_setup", "");
    size = len;
  }
  template <typename T>
  T* at(uint32_t off) const { return reinterpret_cast<T*>(static_cast<char*>(ptr) + off); }
};

void nap() {
  struct timespec ts = {0, 50 * 1000};
  nanosleep(&ts, nullptr);
}

class UringEngine final : public IoEngine {
 public:
  UringEngine(unsigned depth, bool single_thread);
  void submit_read(int fd, void* buf, size_t len, uint64_t offset, uint64_t tag) override {
    submit(IORING_OP_READ, fd, buf, len, offset, tag);
  }
  bool register_buffers(const BufferSpan* buffers, size_t count) override;
  void submit_read_fixed(int fd, void* buf, size_t len, uint64_t offset, uint64_t tag,
                         unsigned index) override {
    if (index >= registered_) throw std::invalid_argument("io_uring: no such registered buffer");
    submit(IORING_OP_READ_FIXED, fd, buf, len, offset, tag, index);
  }
  void submit_write(int fd, const void* buf, size_t len, uint64_t offset, uint64_t tag) override {
    // The kernel only reads from buf for a write; the cast just fits the shared Request.
    submit(IORING_OP_WRITE, fd, const_cast<void*>(buf), len, offset, tag);
  }
  size_t reap(IoCompletion* out, size_t max, size_t min_wait) override;
  unsigned depth() const noexcept override { return depth_; }
  const char* name() const noexcept override { return "uring"; }

 private:
  struct Request {
    uint8_t opcode;  // IORING_OP_READ, IORING_OP_READ_FIXED or IORING_OP_WRITE
    int fd;
    void* buf;
    size_t len;
    uint64_t offset;
    uint64_t tag;
    unsigned retries;
    uint16_t buf_index;  // IORING_OP_READ_FIXED: the registered buffer
  };

  void submit(uint8_t opcode, int fd, void* buf, size_t len, uint64_t offset, uint64_t tag,
              uint16_t buf_index = 0);
  void push_sqe(uint32_t idx);
  unsigned unsubmitted() const { return sq_tail_local_ - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE); }
  void enter(unsigned min_complete, unsigned flags);
  bool task_work_pending() const {
    return sq_flags_ && (__atomic_load_n(sq_flags_, __ATOMIC_RELAXED) & IORING_SQ_TASKRUN);
  }
  void try_flush() noexcept;
  size_t drain_cq(IoCompletion* out, size_t max);

  unsigned depth_;
  // Declared before the mappings so the rings are unmapped before the fd is closed.
  Fd ring_;
  Mapping sq_map_, cq_map_, sqe_map_;
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_flags_ = nullptr;  // set only with IORING_SETUP_TASKRUN_FLAG
  unsigned sq_mask_ = 0, sq_entries_ = 0;
  unsigned sq_tail_local_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  std::vector<Request> reqs_;  // indexed by SQE user_data
  std::vector<uint32_t> free_;
  unsigned registered_ = 0;  // buffers registered
  bool register_tried_ = false;
};

UringEngine::UringEngine(unsigned depth, bool single_thread)
    : depth_(std::clamp(depth, 1u, kMaxEngineDepth)) {
  // Newest flag set first; a kernel that lacks a flag says EINVAL, then the next set is tried.
  // TASKRUN_FLAG marks deferred completions in the SQ flags, so a non-blocking reap still
  // finds them (see reap()).
  constexpr unsigned kCoop = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;      // 5.19
  constexpr unsigned kDefer = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;  // 6.1
  std::vector<unsigned> tries;
  if (single_thread) tries = {IORING_SETUP_CLAMP | kCoop | kDefer, IORING_SETUP_CLAMP | kCoop};
  tries.push_back(IORING_SETUP_CLAMP);
  io_uring_params p;
  for (unsigned flags : tries) {
    std::memset(&p, 0, sizeof p);
    p.flags = flags;
    ring_.fd = sys_setup(depth_, &p);
    if (ring_.fd >= 0 || errno != EINVAL) break;
  }
  if (ring_.fd < 0) throw_io_error(errno, "io_uring_setup", "");
  if (p.sq_entries < depth_) depth_ = p.sq_entries;  // clamped by the kernel

  size_t sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  size_t cq_size = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = p.features & IORING_FEAT_SINGLE_MMAP;
  if (single) sq_size = cq_size = std::max(sq_size, cq_size);
  sq_map_.map(ring_.fd, sq_size, IORING_OFF_SQ_RING);
  const Mapping& cq = single ? sq_map_ : cq_map_;
  if (!single) cq_map_.map(ring_.fd, cq_size, IORING_OFF_CQ_RING);
  sqe_map_.map(ring_.fd, p.sq_entries * sizeof(io_uring_sqe), IORING_OFF_SQES);

  sq_head_ = sq_map_.at<unsigned>(p.sq_off.head);
  sq_tail_ = sq_map_.at<unsigned>(p.sq_off.tail);
  sq_mask_ = *sq_map_.at<unsigned>(p.sq_off.ring_mask);
  sq_entries_ = p.sq_entries;
  if (p.flags & IORING_SETUP_TASKRUN_FLAG) sq_flags_ = sq_map_.at<unsigned>(p.sq_off.flags);
  sq_tail_local_ = *sq_tail_;
  unsigned* array = sq_map_.at<unsigned>(p.sq_off.array);
  for (unsigned i = 0; i < sq_entries_; ++i) array[i] = i;
  sqes_ = static_cast<io_uring_sqe*>(sqe_map_.ptr);
  cq_head_ = cq.at<unsigned>(p.cq_off.head);
  cq_tail_ = cq.at<unsigned>(p.cq_off.tail);
  cq_mask_ = *cq.at<unsigned>(p.cq_off.ring_mask);
  cqes_ = cq.at<io_uring_cqe>(p.cq_off.cqes);

  reqs_.resize(depth_);
  for (uint32_t i = depth_; i > 0; --i) free_.push_back(i - 1);
}

void UringEngine::push_sqe(uint32_t idx) {
  // At most depth_ <= sq_entries_ requests exist, so the SQ cannot be full.
  if (sq_tail_local_ - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE) >= sq_entries_)
    throw std::logic_error("io_uring submission queue overflow");
  const Request& r = reqs_[idx];
  io_uring_sqe* sqe = &sqes_[sq_tail_local_ & sq_mask_];
  std::memset(sqe, 0, sizeof *sqe);
  sqe->opcode = r.opcode;
  sqe->fd = r.fd;
  sqe->addr = reinterpret_cast<uintptr_t>(r.buf);
  sqe->len = static_cast<uint32_t>(r.len);
  sqe->off = r.offset;
  sqe->buf_index = r.buf_index;
  sqe->user_data = idx;
  ++sq_tail_local_;
  // Release: the kernel must see the SQE contents before it sees the new tail.
  __atomic_store_n(sq_tail_, sq_tail_local_, __ATOMIC_RELEASE);
}

// Submits what is queued; with IORING_ENTER_GETEVENTS also waits for min_complete CQEs.
void UringEngine::enter(unsigned min_complete, unsigned flags) {
  const bool wait = flags & IORING_ENTER_GETEVENTS;
  for (;;) {
    unsigned pending = unsubmitted();
    if (pending == 0 && !wait) return;
    int rc = sys_enter(ring_.fd, pending, min_complete, flags);
    if (rc >= 0) {
      if (wait || rc == 0 || unsubmitted() == 0) return;
      continue;  // partial submission: push the rest
    }
    int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EBUSY) {  // transient kernel resource shortage
      if (!wait) return;                  // stays queued; the next enter() submits it
      if (__atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE) != *cq_head_) return;
      nap();
      continue;
    }
    throw_io_error(err, "io_uring_enter", "");
  }
}

void UringEngine::try_flush() noexcept {
  try {
    enter(0, 0);
  } catch (...) {
    // Left queued in the SQ; the next enter() submits it or reports the error.
  }
}

bool UringEngine::register_buffers(const BufferSpan* buffers, size_t count) {
  if (register_tried_ || count == 0 || count > kMaxRegistered) return false;
  register_tried_ = true;
  std::vector<iovec> iov(count);
  for (size_t i = 0; i < count; ++i) {
    if (buffers[i].data == nullptr || buffers[i].size == 0 || buffers[i].size > kMaxRegisteredSize)
      return false;
    iov[i] = {buffers[i].data, buffers[i].size};
  }
  // Refusals (ENOMEM past RLIMIT_MEMLOCK, EINVAL, EOPNOTSUPP, EINTR while an old kernel
  // quiesced the ring, ...) all mean: read as before.
  if (sys_register(ring_.fd, IORING_REGISTER_BUFFERS, iov.data(),
                   static_cast<unsigned>(count)) < 0)
    return false;
  registered_ = static_cast<unsigned>(count);
  return true;
}

void UringEngine::submit(uint8_t opcode, int fd, void* buf, size_t len, uint64_t offset,
                         uint64_t tag, uint16_t buf_index) {
  if (free_.empty()) throw std::logic_error("io_uring engine: more requests than depth");
  uint32_t idx = free_.back();
  reqs_[idx] = Request{opcode, fd, buf, std::min(len, kMaxIoLen), offset, tag, 0, buf_index};
  push_sqe(idx);
  free_.pop_back();
  try {
    enter(0, 0);
  } catch (...) {
    // Withdraw the SQE if the kernel did not take it, so the caller may treat the request as
    // never queued (it is the newest, and nothing else consumes the SQ between enters).
    if (unsubmitted() == 0) return;  // taken: it will complete normally
    --sq_tail_local_;
    __atomic_store_n(sq_tail_, sq_tail_local_, __ATOMIC_RELEASE);
    free_.push_back(idx);
    throw;
  }
}

size_t UringEngine::drain_cq(IoCompletion* out, size_t max) {
  size_t n = 0;
  unsigned head = *cq_head_;  // only we write the head
  // Acquire: CQE contents written by the kernel are visible once we see the tail.
  const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
  while (head != tail && n < max) {
    const io_uring_cqe& cqe = cqes_[head & cq_mask_];
    const uint32_t idx = static_cast<uint32_t>(cqe.user_data);
    const int res = cqe.res;
    ++head;
    Request& r = reqs_[idx];
    if (retryable(res) && r.retries < kMaxRetries) {
      ++r.retries;
      push_sqe(idx);  // same request again; the caller never sees the interruption
      continue;
    }
    out[n++] = IoCompletion{r.tag, res};
    free_.push_back(idx);
  }
  // Release: we are done reading those CQEs before the kernel may reuse their slots.
  __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
  if (unsubmitted()) try_flush();
  return n;
}

size_t UringEngine::reap(IoCompletion* out, size_t max, size_t min_wait) {
  size_t n = drain_cq(out, max);
  if (n == 0 && min_wait == 0 && max > 0 && task_work_pending()) {
    // A poll, and completions wait in the kernel for us to enter it: post them, without
    // waiting for more. (A blocking reap enters the kernel below anyway.)
    enter(0, IORING_ENTER_GETEVENTS);
    n = drain_cq(out, max);
  }
  while (n < min_wait && n < max) {
    try {
      enter(static_cast<unsigned>(min_wait - n), IORING_ENTER_GETEVENTS);
    } catch (...) {
      if (n) return n;  // never drop completions already taken off the ring
      throw;
    }
    n += drain_cq(out + n, max - n);
  }
  return n;
}

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(unsigned depth, bool single_thread) {
  return std::make_unique<UringEngine>(depth, single_thread);
}

int probe_uring() {
  io_uring_params p;
  std::memset(&p, 0, sizeof p);
  Fd ring;
  ring.fd = sys_setup(2, &p);
  if (ring.fd < 0) return errno;
  // IORING_OP_READ and IORING_OP_WRITE arrived with Linux 5.6, together with the probe itself.
  constexpr unsigned kOps = 256;
  std::vector<char> mem(sizeof(io_uring_probe) + kOps * sizeof(io_uring_probe_op), 0);
  auto* probe = reinterpret_cast<io_uring_probe*>(mem.data());
  if (sys_register(ring.fd, IORING_REGISTER_PROBE, probe, kOps) < 0) return errno;
  for (unsigned op : {unsigned(IORING_OP_READ), unsigned(IORING_OP_WRITE)})
    if (probe->last_op < op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) return EOPNOTSUPP;
  return 0;
}

}  // namespace flashstream
