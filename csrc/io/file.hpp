// Opening files for O_DIRECT I/O, with a buffered fallback where the filesystem refuses it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace flashstream {

struct DioAlignment {
  uint32_t offset = 4096;  // file offsets and lengths must be multiples of this
  uint32_t memory = 4096;  // buffer addresses must be multiples of this
};

// Alignment for O_DIRECT on the file behind `fd`: statx(STATX_DIOALIGN) where the kernel
// reports it, else the logical block size of the block device behind st_dev (sysfs), else 4096.
DioAlignment query_dio_alignment(int fd);

// Opens `path` with `flags` (O_CLOEXEC is added). With want_direct, tries O_DIRECT first and
// retries without it when the filesystem refuses it (EINVAL, e.g. tmpfs before Linux 6.6);
// `*direct` says which happened. Returns the fd; throws IoError(op="open") naming the path.
int open_maybe_direct(const std::string& path, int flags, bool want_direct, bool* direct,
                      mode_t mode = 0644);

// Size of the regular file or block device behind `fd`. Throws IoError naming `path`: EISDIR
// for a directory, or what fstat reports.
uint64_t size_of(int fd, const std::string& path);

class InputFile {
 public:
  // Opens `path` read-only. With want_direct, tries O_DIRECT first and falls back to buffered
  // I/O when the filesystem refuses it (EINVAL, e.g. tmpfs); `direct()` says which happened.
  // Throws IoError (ENOENT, EACCES, EISDIR, ...) naming the path.
  InputFile(const std::string& path, bool want_direct);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  int fd() const noexcept { return fd_; }
  bool direct() const noexcept { return direct_; }
  uint64_t size() const noexcept { return size_; }
  const std::string& path() const noexcept { return path_; }
  const DioAlignment& alignment() const noexcept { return align_; }
  // Reopens without O_DIRECT (used when a read on the direct fd fails with EINVAL).
  void fall_back_to_buffered();

 private:
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  uint64_t size_ = 0;
  DioAlignment align_;
};

}  // namespace flashstream
