// Asynchronous I/O engines behind one interface: io_uring (raw syscalls, no liburing needed)
// and a pread/pwrite thread pool. The reader and the device probe keep `depth` requests in
// flight through this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace flashstream {

struct IoCompletion {
  uint64_t tag;    // the caller's tag from submit()
  int64_t result;  // bytes transferred (may be short; 0 at EOF) or -errno
};

struct BufferSpan {
  void* data;
  size_t size;
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  // Queue one read of `len` bytes at `offset` of `fd` into `buf`. Never blocks for I/O; the
  // caller never has more than depth() requests (reads and writes together) outstanding.
  // EINTR/EAGAIN are retried inside the engine and never reach the caller.
  virtual void submit_read(int fd, void* buf, size_t len, uint64_t offset, uint64_t tag) = 0;
  // Queue one write of `len` bytes from `buf` to `offset` of `fd`, under the same rules. A short
  // count is returned as it is: the caller resubmits the rest. `buf` must stay untouched until
  // the completion is reaped.
  virtual void submit_write(int fd, const void* buf, size_t len, uint64_t offset,
                            uint64_t tag) = 0;
  // Registers buffers that reads may then name by index (submit_read_fixed). io_uring pins
  // their pages once here; a plain read pins, marks dirty and unpins every page of every
  // request, most of the kernel's CPU per byte read. At most once per engine, with no request
  // in flight into a buffer being registered from elsewhere. False when the engine has no such
  // thing or the kernel refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK, an old kernel): plain
  // reads then go on as before.
  virtual bool register_buffers(const BufferSpan* buffers, size_t count) {
    (void)buffers;
    (void)count;
    return false;
  }
  // submit_read into registered buffer `index`; [buf, buf + len) lies inside it.
  virtual void submit_read_fixed(int fd, void* buf, size_t len, uint64_t offset, uint64_t tag,
                                 unsigned index) {
    (void)index;
    submit_read(fd, buf, len, offset, tag);
  }
  // Collect up to `max` completions; blocks until at least `min_wait` are available
  // (min_wait <= outstanding). Returns the number written to `out`.
  virtual size_t reap(IoCompletion* out, size_t max, size_t min_wait) = 0;
  virtual unsigned depth() const noexcept = 0;
  virtual const char* name() const noexcept = 0;  // "uring" or "threads"
};

// kind: "auto" | "uring" | "threads". "auto" picks io_uring when io_uring_setup succeeds (kernel
// support, not disabled by sysctl or seccomp), else threads. "uring" throws IoError when
// io_uring is unavailable; any other kind throws std::invalid_argument.
//
// single_thread is a promise that the thread creating the engine makes every call on it (the
// device probe, a writer's own thread). io_uring then completes requests without interrupting
// that thread for each one (COOP_TASKRUN, DEFER_TASKRUN where the kernel has them), as fio does:
// markedly more IOPS on VMs. A reader that Python may drive from several threads must not
// promise it: a completion would wait for its submitting thread to enter the kernel, and that
// thread may be asleep waiting for the other one.
std::unique_ptr<IoEngine> make_engine(const std::string& kind, unsigned depth,
                                      bool single_thread = false);

// True when this process can create an io_uring instance (probed once, cached).
bool uring_available();

}  // namespace flashstream
