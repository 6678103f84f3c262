// Aligned heap buffers for O_DIRECT. Alignment is a parameter (queried from the device by
// io/file.hpp), never a hidden constant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace flashstream {

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(size_t size, size_t alignment) : size_(size) {
    void* p = nullptr;
    if (posix_memalign(&p, alignment < sizeof(void*) ? sizeof(void*) : alignment,
                       size ? size : alignment) != 0)
      throw std::bad_alloc();
    data_.reset(static_cast<uint8_t*>(p));
  }
  uint8_t* data() const noexcept { return data_.get(); }
  size_t size() const noexcept { return size_; }

 private:
  std::unique_ptr<uint8_t, FreeDeleter> data_;
  size_t size_ = 0;
};

inline uint64_t align_down(uint64_t v, uint64_t a) { return v - (v % a); }
inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace flashstream
