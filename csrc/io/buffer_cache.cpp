// BufferCache: see buffer_cache.hpp.
#include "io/buffer_cache.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace flashstream {
namespace {

struct Cache {
  explicit Cache(pid_t p) : pid(p) {}
  const pid_t pid;
  std::mutex mu;
  std::vector<AlignedBuffer> kept;
  size_t bytes = 0;
};

std::atomic<Cache*> g_cache{nullptr};

// This process's cache. One made by a parent process is abandoned, never locked or freed: a
// thread of the parent may have held its lock at fork().
Cache& cache() {
  const pid_t self = ::getpid();
  Cache* c = g_cache.load(std::memory_order_acquire);
  if (c != nullptr && c->pid == self) return *c;
  Cache* fresh = new Cache(self);
  if (g_cache.compare_exchange_strong(c, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;  // another thread of this process installed one first
  return *c;
}

}  // namespace

AlignedBuffer BufferCache::take(size_t size, size_t alignment) {
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    for (size_t i = c.kept.size(); i-- > 0;) {
      AlignedBuffer& b = c.kept[i];
      if (b.size() != size || reinterpret_cast<uintptr_t>(b.data()) % alignment != 0) continue;
      AlignedBuffer out = std::move(b);
      c.kept[i] = std::move(c.kept.back());
      c.kept.pop_back();
      c.bytes -= size;
      return out;
    }
  }
  return AlignedBuffer(size, alignment);
}

void BufferCache::give(AlignedBuffer&& buffer) {
  if (buffer.data() == nullptr) return;
  AlignedBuffer b = std::move(buffer);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.bytes + b.size() > kMaxBytes) return;  // freed as `b` goes
  c.bytes += b.size();
  c.kept.push_back(std::move(b));
}

size_t BufferCache::bytes() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.bytes;
}

}  // namespace flashstream
