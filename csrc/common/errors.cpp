#include "common/errors.hpp"

#include <cstring>

namespace flashstream {
namespace {

// strerror_r has a GNU (char*) and an XSI (int) flavour; overloads pick whichever the libc has.
[[maybe_unused]] const char* strerror_result(const char* msg, const char*) { return msg; }
[[maybe_unused]] const char* strerror_result(int rc, const char* buf) {
  return rc == 0 ? buf : "Unknown error";
}

std::string describe(int err, const std::string& op, const std::string& path, int64_t offset) {
  char buf[128] = {0};
  std::string msg = op + " failed: " + strerror_result(strerror_r(err, buf, sizeof buf), buf);
  if (!path.empty()) msg += ": '" + path + "'";
  if (offset >= 0) msg += " at offset " + std::to_string(offset);
  return msg;
}

}  // namespace

IoError::IoError(int err, std::string op, std::string path, int64_t offset)
    : std::runtime_error(describe(err, op, path, offset)),
      err_(err),
      op_(std::move(op)),
      path_(std::move(path)),
      offset_(offset) {}

void throw_io_error(int err, const std::string& op, const std::string& path, int64_t offset) {
  throw IoError(err, op, path, offset);
}

}  // namespace flashstream
