#include "io/file.hpp"

#include <fcntl.h>
#include <linux/fs.h>  // BLKGETSIZE64
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <string>

#include "common/errors.hpp"

namespace flashstream {
namespace {

constexpr uint32_t kMaxAlign = 1u << 20;  // anything larger is not a believable DIO alignment

bool plausible(uint32_t a) { return a != 0 && a <= kMaxAlign; }

uint32_t next_pow2(uint32_t v) {
  uint32_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Asks the filesystem (Linux 6.1+). Only compiled where the headers know the statx fields:
// guessing the struct layout of a newer kernel would read garbage on an older one.
bool statx_alignment(int fd, uint32_t& offset, uint32_t& memory) {
#ifdef STATX_DIOALIGN
  struct statx sx = {};
  unsigned mask = STATX_DIOALIGN;
#ifdef STATX_DIO_READ_ALIGN
  mask |= STATX_DIO_READ_ALIGN;  // reads may allow a finer offset alignment than writes
#endif
  if (statx(fd, "", AT_EMPTY_PATH, mask, &sx) != 0) return false;
  if (!(sx.stx_mask & STATX_DIOALIGN) || !plausible(sx.stx_dio_offset_align)) return false;
  offset = sx.stx_dio_offset_align;
  memory = sx.stx_dio_mem_align;
#ifdef STATX_DIO_READ_ALIGN
  if ((sx.stx_mask & STATX_DIO_READ_ALIGN) && plausible(sx.stx_dio_read_offset_align))
    offset = sx.stx_dio_read_offset_align;
#endif
  return true;
#else
  (void)fd, (void)offset, (void)memory;
  return false;
#endif
}

bool read_u32_file(const std::string& path, uint32_t& value) {
  FILE* f = std::fopen(path.c_str(), "re");
  if (!f) return false;
  unsigned long v = 0;
  bool ok = std::fscanf(f, "%lu", &v) == 1 && v <= UINT32_MAX;
  std::fclose(f);
  if (ok) value = static_cast<uint32_t>(v);
  return ok;
}

// Logical block size of the block device holding the file. A partition has no queue/ of its
// own, so look in its parent directory too. Virtual filesystems (major 0) have no device.
bool sysfs_block_size(int fd, uint32_t& block) {
  struct stat st;
  if (fstat(fd, &st) != 0 || major(st.st_dev) == 0) return false;
  std::string dev = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                    std::to_string(minor(st.st_dev));
  return (read_u32_file(dev + "/queue/logical_block_size", block) ||
          read_u32_file(dev + "/../queue/logical_block_size", block)) &&
         plausible(block);
}

uint64_t file_size(int fd, const struct stat& st) {
  uint64_t size = 0;
  if (S_ISBLK(st.st_mode) && ioctl(fd, BLKGETSIZE64, &size) == 0) return size;
  return st.st_size > 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

}  // namespace

DioAlignment query_dio_alignment(int fd) {
  uint32_t offset = 0, memory = 0;
  if (!statx_alignment(fd, offset, memory) && !sysfs_block_size(fd, offset)) offset = 4096;
  DioAlignment a;
  a.offset = offset;
  // posix_memalign needs a power of two; a buffer aligned for file offsets is always accepted.
  a.memory = next_pow2(std::max({memory, offset, 512u}));
  return a;
}

int open_maybe_direct(const std::string& path, int flags, bool want_direct, bool* direct,
                      mode_t mode) {
  flags |= O_CLOEXEC;
  *direct = false;
  if (want_direct) {
    int fd = ::open(path.c_str(), flags | O_DIRECT, mode);
    if (fd >= 0) {
      *direct = true;
      return fd;
    }
    if (errno != EINVAL) throw_io_error(errno, "open", path);  // EINVAL: no O_DIRECT here
  }
  int fd = ::open(path.c_str(), flags, mode);
  if (fd < 0) throw_io_error(errno, "open", path);
  return fd;
}

uint64_t size_of(int fd, const std::string& path) {
  struct stat st;
  int err = fstat(fd, &st) != 0 ? errno : S_ISDIR(st.st_mode) ? EISDIR : 0;
  if (err) throw_io_error(err, err == EISDIR ? "open" : "fstat", path);
  return file_size(fd, st);
}

InputFile::InputFile(const std::string& path, bool want_direct) : path_(path) {
  fd_ = open_maybe_direct(path, O_RDONLY, want_direct, &direct_);
  try {
    size_ = size_of(fd_, path);
  } catch (...) {
    ::close(fd_);  // the destructor will not run
    throw;
  }
  if (direct_) align_ = query_dio_alignment(fd_);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::fall_back_to_buffered() {
  if (!direct_) return;
  // Clearing O_DIRECT in place keeps the fd number and the inode: reads already queued on fd_
  // (thread pool) never see a closed or reused descriptor, and a renamed path cannot swap files.
  int fl = fcntl(fd_, F_GETFL);
  if (fl == -1 || fcntl(fd_, F_SETFL, fl & ~O_DIRECT) == -1) {
    // Should not happen on Linux; reopen by path and install it under the same number.
    int nfd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (nfd < 0) throw_io_error(errno, "open", path_);
    int rc = dup3(nfd, fd_, O_CLOEXEC);
    int err = errno;
    ::close(nfd);
    if (rc < 0) throw_io_error(err, "dup3", path_);
  }
  direct_ = false;
}

}  // namespace flashstream
