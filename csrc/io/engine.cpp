#include <cerrno>
#include <cstdio>
#include <stdexcept>

#include "common/errors.hpp"
#include "io/engine.hpp"
#include "io/engines_internal.hpp"

namespace flashstream {
namespace {

// /proc/sys/kernel/io_uring_disabled (Linux 6.6+): 2 means io_uring_setup always fails, so
// skip the syscall (and any audit noise). 1 restricts it to a group; the probe decides.
bool disabled_by_sysctl() {
  FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "re");
  if (!f) return false;
  int v = 0;
  bool disabled = std::fscanf(f, "%d", &v) == 1 && v == 2;
  std::fclose(f);
  return disabled;
}

int uring_status() {
  static const int status = disabled_by_sysctl() ? EPERM : probe_uring();
  return status;
}

}  // namespace

bool uring_available() { return uring_status() == 0; }

std::unique_ptr<IoEngine> make_engine(const std::string& kind, unsigned depth,
                                      bool single_thread) {
  if (kind == "threads") return make_thread_engine(depth);
  if (kind == "uring") {
    if (int err = uring_status()) throw_io_error(err, "io_uring_setup", "");
    return make_uring_engine(depth, single_thread);
  }
  if (kind == "auto") {
    if (uring_available()) {
      try {
        return make_uring_engine(depth, single_thread);
      } catch (const IoError&) {
        // e.g. RLIMIT_MEMLOCK on kernels before 5.12 for a large ring: threads still work.
      }
    }
    return make_thread_engine(depth);
  }
  throw std::invalid_argument("unknown I/O engine '" + kind +
                              "' (expected one of: auto, uring, threads)");
}

}  // namespace flashstream
