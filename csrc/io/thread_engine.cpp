// pread/pwrite thread pool: the fallback engine where io_uring is unavailable.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io/engines_internal.hpp"

namespace flashstream {
namespace {

constexpr unsigned kMaxThreads = 16;

struct Request {
  bool write;
  int fd;
  void* buf;
  size_t len;
  uint64_t offset;
  uint64_t tag;
};

int64_t run_once(const Request& r) {
  for (;;) {
    const off_t off = static_cast<off_t>(r.offset);
    ssize_t n = r.write ? ::pwrite(r.fd, r.buf, r.len, off) : ::pread(r.fd, r.buf, r.len, off);
    if (n >= 0) return n;  // short counts go back as they are; the caller handles them
    if (errno != EINTR && errno != EAGAIN) return -errno;
  }
}

// Blocks every signal in the calling thread for its lifetime, so threads started meanwhile
// inherit a full mask: signals (e.g. Python's SIGINT) then go to the application's threads.
class BlockSignals {
 public:
  BlockSignals() {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old_);
  }
  ~BlockSignals() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }

 private:
  sigset_t old_;
};

class ThreadEngine final : public IoEngine {
 public:
  explicit ThreadEngine(unsigned depth);
  ~ThreadEngine() override { stop(); }
  void submit_read(int fd, void* buf, size_t len, uint64_t offset, uint64_t tag) override {
    push(Request{false, fd, buf, len, offset, tag});
  }
  void submit_write(int fd, const void* buf, size_t len, uint64_t offset, uint64_t tag) override {
    // pwrite only reads from buf; the cast just fits the shared Request.
    push(Request{true, fd, const_cast<void*>(buf), len, offset, tag});
  }
  size_t reap(IoCompletion* out, size_t max, size_t min_wait) override;
  unsigned depth() const noexcept override { return depth_; }
  const char* name() const noexcept override { return "threads"; }

 private:
  void push(const Request& r);
  void work();
  void stop() noexcept;

  unsigned depth_;
  std::mutex mu_;
  std::condition_variable has_work_;
  std::condition_variable has_done_;
  std::deque<Request> todo_;
  std::deque<IoCompletion> done_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

ThreadEngine::ThreadEngine(unsigned depth) : depth_(std::clamp(depth, 1u, kMaxEngineDepth)) {
  BlockSignals blocked;
  try {
    for (unsigned i = 0; i < std::min(depth_, kMaxThreads); ++i) threads_.emplace_back([this] { work(); });
  } catch (...) {
    stop();  // join the threads that did start; the destructor will not run
    throw;
  }
}

void ThreadEngine::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  has_work_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void ThreadEngine::work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    has_work_.wait(lock, [this] { return stopping_ || !todo_.empty(); });
    // Finish queued requests even when stopping: their buffers are still owned by the caller.
    if (todo_.empty()) return;
    Request r = todo_.front();
    todo_.pop_front();
    lock.unlock();
    int64_t res = run_once(r);
    lock.lock();
    done_.push_back(IoCompletion{r.tag, res});
    has_done_.notify_one();
  }
}

void ThreadEngine::push(const Request& r) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    todo_.push_back(r);
  }
  has_work_.notify_one();
}

size_t ThreadEngine::reap(IoCompletion* out, size_t max, size_t min_wait) {
  std::unique_lock<std::mutex> lock(mu_);
  has_done_.wait(lock, [&] { return done_.size() >= std::min(min_wait, max); });
  size_t n = 0;
  while (n < max && !done_.empty()) {
    out[n++] = done_.front();
    done_.pop_front();
  }
  return n;
}

}  // namespace

std::unique_ptr<IoEngine> make_thread_engine(unsigned depth) {
  return std::make_unique<ThreadEngine>(depth);
}

}  // namespace flashstream
