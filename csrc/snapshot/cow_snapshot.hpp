// Copy-on-write snapshot of host memory with userfaultfd write protection.
//
// A checkpoint must capture tensors as of save() without blocking training for a full copy.
// CowSnapshot write-protects the sources' pages (UFFDIO_REGISTER_MODE_WP + UFFDIO_WRITEPROTECT)
// and returns; a background copier then copies them block by block into their destinations,
// un-protecting each block once it is copied. A write to a block not yet copied (by any thread,
// and by the kernel, e.g. read(2) into a tensor) faults; a handler thread copies that block first
// and then un-protects it, which resumes the writer. So every destination ends up holding the
// bytes as of the constructor, and the caller may write to the sources as soon as it returns.
//
// What cannot be protected is copied eagerly in the constructor: partial pages at range edges,
// ranges shorter than a page, ranges whose protectable pages overlap an earlier range's (tied or
// shared tensors), and memory that is not private anonymous (file mappings, shared memory,
// hugetlbfs: another process could write shared pages behind our back) or that userfaultfd
// refuses. Without userfaultfd everything is eager, which is an ordinary memcpy snapshot.
//
// The caller keeps every destination valid until wait() returns (or the object is destroyed).
// A source released before its copy (free(), a storage resized to 0, madvise(MADV_DONTNEED),
// mremap) is caught where the kernel reports it (userfaultfd's unmap and remove events) or
// where the copy finds nothing mapped (process_vm_readv's EFAULT): its blocks are reported by
// lost(), not copied silently from whatever lies there afterwards. Where seccomp refuses
// process_vm_readv the copy is a memcpy, and a source unmapped under it still faults.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "snapshot/copy_ranges.hpp"

namespace flashstream {

// How userfaultfd write protection can be used in this process (probed once).
enum class CowMode {
  kNone,      // not at all: everything is copied eagerly
  kUserOnly,  // only with UFFD_USER_MODE_ONLY: kernel writes into protected pages (read(2),
              // recv, io_uring) fail with EFAULT instead of faulting through the handler
  kFull,      // kernel writes fault through the handler too (root, CAP_SYS_PTRACE, or
              // vm.unprivileged_userfaultfd=1)
};

CowMode cow_mode();
const char* cow_mode_name(CowMode mode);  // "none", "user", "full"

// True when this process can write-protect anonymous memory with userfaultfd in a way that is
// transparent to its other code: kernel writes into protected pages are served too (kFull).
bool cow_available();

struct CowStats {
  uint64_t protected_bytes = 0;   // bytes write-protected and copied later
  uint64_t eager_bytes = 0;       // bytes copied in the constructor
  uint64_t fault_copies = 0;      // blocks copied by the fault handler (a write hit them first)
  uint64_t fault_bytes = 0;       // bytes in those blocks
  uint64_t background_bytes = 0;  // protected bytes copied by the background copier
  double protect_seconds = 0;     // constructor time spent registering and write-protecting
  double eager_seconds = 0;       // constructor time spent copying eagerly
  double copy_seconds = 0;        // from protection until the last block was copied (0 before)
  uint64_t lost_bytes = 0;        // protected bytes whose source was released before the copy
};

class CowSnapshot {
 public:
  // Snapshots every range's bytes into its dst (see the file comment). When the constructor
  // returns, every byte is either copied or protected. dst regions must not overlap any src
  // (std::invalid_argument, thrown before anything is protected). `block` is the unit of
  // background copies and of fault resolution: a positive multiple of the page size.
  // With allow_user_mode_only, a process limited to UFFD_USER_MODE_ONLY protects memory too;
  // a kernel write into a protected page then fails with EFAULT, so only use it when nothing
  // reads from files or sockets straight into the sources until wait() returns.
  explicit CowSnapshot(std::vector<CopyRange> ranges, size_t block = size_t(2) << 20,
                       bool allow_user_mode_only = false);
  ~CowSnapshot();  // wait()s, ignoring errors: never leaves memory protected
  CowSnapshot(const CowSnapshot&) = delete;
  CowSnapshot& operator=(const CowSnapshot&) = delete;

  // Until every block is copied and un-protected and the ranges are unregistered; rethrows the
  // first error a thread hit (an IoError naming the ioctl), every time it is called.
  void wait();
  bool done() const;
  CowStats stats() const;
  // After wait(): destination intervals (dst, len) that do NOT hold the snapshot because their
  // source memory was released before it was copied. Empty when the snapshot is whole.
  std::vector<std::pair<uint8_t*, size_t>> lost() const;

 private:
  struct Segment {  // a write-protected, page-aligned source interval
    uintptr_t start, end;
    uint8_t* dst;        // destination of byte `start`
    size_t first_block;  // its blocks are blocks_[first_block, first_block + count)
    size_t span;         // index into spans_ (the registration that covers it)
  };
  struct Span {  // one UFFDIO_REGISTER: the hull of neighbouring segments in one mapping
    uintptr_t start, end;
    bool registered;
  };
  struct Block {
    uintptr_t addr;
    size_t len;
    uint8_t* dst;
    std::atomic<uint8_t> state{0};  // 0 pending, 1 being copied, 2 copied and un-protected
    std::atomic<bool> lost{false};  // its source was released before the copy finished
    uint64_t done_epoch = 0;        // the handler's epoch when the copy finished
  };

  void plan(const std::vector<CopyRange>& ranges);
  bool open_uffd(bool allow_user_mode_only) noexcept;
  void register_spans();
  void build_blocks();
  void protect_segments();
  void abort_and_finish() noexcept;
  void release_all() noexcept;
  void start_threads();
  void copier_main() noexcept;
  void handler_main() noexcept;
  void serve_fault(uintptr_t addr) noexcept;
  void lose(uintptr_t start, uintptr_t end, uint64_t epoch) noexcept;
  bool copy_block(Block& b, bool by_fault) noexcept;
  void wait_block(const Block& b) const noexcept;
  Block* find_block(uintptr_t addr) noexcept;
  void fail(int err, const char* op) noexcept;
  void finish() noexcept;

  size_t block_;
  size_t page_;
  int uffd_ = -1;
  int wake_fd_ = -1;  // eventfd: tells the handler to exit
  std::vector<CopyRange> eager_;
  std::vector<Segment> segments_;  // sorted by address, disjoint
  std::vector<Span> spans_;
  std::unique_ptr<Block[]> blocks_;
  size_t nblocks_ = 0;

  std::thread copier_, handler_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool go_ = false;  // under mu_: protection is in place, the copier may start
  std::atomic<bool> finished_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> aborted_{false};
  std::atomic<uint64_t> epoch_{0};  // counts the handler's reads of events (see lose())
  std::atomic<int> error_{0};  // first errno a thread hit (set once)
  const char* error_op_ = nullptr;
  bool joined_ = false;

  std::atomic<uint64_t> fault_copies_{0}, fault_bytes_{0}, background_bytes_{0};
  uint64_t protected_bytes_ = 0, eager_bytes_ = 0;
  double protect_seconds_ = 0, eager_seconds_ = 0;
  std::atomic<double> copy_seconds_{0};
  std::chrono::steady_clock::time_point protected_at_;
};

}  // namespace flashstream
