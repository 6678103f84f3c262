// One error convention for the C++ core.
//
// Syscalls and io_uring report -errno; `throw_io_error` turns that into an IoError naming the
// operation, the path and the byte offset. Tar format problems raise FormatError with the byte
// offset inside the shard. The bindings map IoError to the matching Python OSError subclass
// (via errno) and FormatError to flashstream's ShardFormatError.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace flashstream {

class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string op, std::string path, int64_t offset);
  int error_code() const noexcept { return err_; }
  const std::string& path() const noexcept { return path_; }
  const std::string& op() const noexcept { return op_; }
  int64_t offset() const noexcept { return offset_; }  // -1 when no offset applies

 private:
  int err_;
  std::string op_;
  std::string path_;
  int64_t offset_;
};

// `err` is a positive errno value.
[[noreturn]] void throw_io_error(int err, const std::string& op, const std::string& path,
                                 int64_t offset = -1);

class FormatError : public std::runtime_error {
 public:
  FormatError(const std::string& what, uint64_t offset)
      : std::runtime_error(what), offset_(offset) {}
  uint64_t offset() const noexcept { return offset_; }  // byte offset inside the shard

 private:
  uint64_t offset_;
};

}  // namespace flashstream
