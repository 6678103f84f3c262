// Aligned read buffers kept in a process from one reader to the next.
//
// A fresh buffer is paid for on its first read: O_DIRECT pins its pages, faulting in and
// zeroing every 4 KiB page, and freeing it unmaps them again. A DataLoader worker opens a new
// reader every epoch, so without a cache it paid that for the whole buffer pool each epoch.
// Readers take their buffers here and give them back when they are destroyed (when no read
// and no Python view can still use them).
//
// Buffers are reused for the same size and a compatible alignment only; at most kMaxBytes are
// kept (a buffer given back beyond that is freed). A fork() child starts with an empty cache:
// the parent's entries, and their lock, are the parent's, and are left alone (the child's copies
// cost nothing until written).
#pragma once

#include <cstddef>

#include "common/aligned.hpp"

namespace flashstream {

class BufferCache {
 public:
  static constexpr size_t kMaxBytes = size_t(128) << 20;

  // A buffer of `size` bytes aligned to `alignment`: a cached one, else a new one.
  static AlignedBuffer take(size_t size, size_t alignment);
  // Keeps `buffer` for a later take() (or frees it: no room, or an empty buffer).
  static void give(AlignedBuffer&& buffer);
  // Bytes kept now, in this process.
  static size_t bytes();
};

}  // namespace flashstream
