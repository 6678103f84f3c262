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
  FormatError(const std::string& what, uint64_t offset, bool shard_only = false)
      : std::runtime_error(what), offset_(offset), shard_only_(shard_only) {}
  uint64_t offset() const noexcept { return offset_; }  // byte offset inside the shard
  // True where webdataset, told of the same damage, could end only this shard: tarfile meets
  // it while a member's data is read (webdataset's member loop hands that error to its
  // handler, whose False then ends the shard), or not at all (tarfile ends the archive
  // quietly at a bad header after the first). The caller's handler policy follows suit.
  bool shard_only() const noexcept { return shard_only_; }

 private:
  uint64_t offset_;
  bool shard_only_;
};

}  // namespace flashstream
