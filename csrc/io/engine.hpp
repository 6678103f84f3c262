// Asynchronous read engines behind one interface: io_uring (raw syscalls, no liburing needed)
// and a pread thread pool. The reader above keeps `depth` requests in flight through this.
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

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  // Queue one read of `len` bytes at `offset` of `fd` into `buf`. Never blocks for I/O; the
  // caller never has more than depth() requests outstanding. EINTR/EAGAIN are retried inside
  // the engine and never reach the caller.
  virtual void submit_read(int fd, void* buf, size_t len, uint64_t offset, uint64_t tag) = 0;
  // Collect up to `max` completions; blocks until at least `min_wait` are available
  // (min_wait <= outstanding). Returns the number written to `out`.
  virtual size_t reap(IoCompletion* out, size_t max, size_t min_wait) = 0;
  virtual unsigned depth() const noexcept = 0;
  virtual const char* name() const noexcept = 0;  // "uring" or "threads"
};

// kind: "auto" | "uring" | "threads". "auto" picks io_uring when io_uring_setup succeeds (kernel
// support, not disabled by sysctl or seccomp), else threads. "uring" throws IoError when
// io_uring is unavailable; any other kind throws std::invalid_argument.
std::unique_ptr<IoEngine> make_engine(const std::string& kind, unsigned depth);

// True when this process can create an io_uring instance (probed once, cached).
bool uring_available();

}  // namespace flashstream
