// The process that made an object which owns threads, an io_uring or a userfaultfd.
//
// fork() gives the child a copy of such an object but none of its threads, and the very same
// ring (shared memory) and userfaultfd as the parent. Tidying the copy up would join threads that
// do not exist there (a crash), wait on a condition variable or mutex a vanished thread held (a
// hang), or reap completions the parent is waiting for (the parent then hangs forever). So in
// any other process such an object is never joined, drained or reaped: every use is refused
// with ForkedError and its destructor leaks it (its memory is the child's copy, nothing else).
#pragma once

#include <unistd.h>

#include <stdexcept>
#include <string>

namespace flashstream {

class ForkedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class OwnerProcess {
 public:
  OwnerProcess() noexcept : pid_(::getpid()) {}
  // getpid() is a real syscall (glibc stopped caching it), tens of ns: fine per chunk or call.
  bool here() const noexcept { return ::getpid() == pid_; }
  pid_t pid() const noexcept { return pid_; }

  // Throws ForkedError naming `what` unless called in the owning process.
  void check(const char* what) const {
    const pid_t self = ::getpid();
    if (self == pid_) return;
    throw ForkedError(std::string(what) + " was created in process " + std::to_string(pid_) +
                      " and cannot be used in process " + std::to_string(self) +
                      " (a fork() child shares its I/O state with the parent): create a new "
                      "one in this process");
  }

 private:
  pid_t pid_;
};

}  // namespace flashstream
