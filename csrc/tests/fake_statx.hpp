// A statx() interposer for tests: lets a test pretend the filesystem allows a finer O_DIRECT
// alignment than it does (set g_fake_dio_offset), so direct requests fail with EINVAL and the
// code under test must fall back to buffered I/O. Include from exactly one file per test binary.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#ifdef STATX_DIOALIGN
static std::atomic<uint32_t> g_fake_dio_offset{0};
extern "C" int statx(int dirfd, const char* path, int flags, unsigned mask,
                     struct statx* buf) noexcept {
  long rc = syscall(SYS_statx, dirfd, path, flags, mask, buf);
  uint32_t fake = g_fake_dio_offset.load();
  if (rc == 0 && fake && (buf->stx_mask & STATX_DIOALIGN)) {
    buf->stx_dio_offset_align = fake;
#ifdef STATX_DIO_READ_ALIGN
    buf->stx_dio_read_offset_align = fake;
#endif
  }
  return static_cast<int>(rc);
}
#endif
