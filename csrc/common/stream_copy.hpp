// Copies whose destination is not read again by this process soon: tensor batches written into
// shared memory that the training loop reads later, in another process.
//
// A plain copy of a large payload first reads every destination cache line from memory (the
// store needs the line in the cache: read for ownership) and evicts other data for it, so each
// byte crosses the memory bus three times. Streaming (non-temporal) stores write whole lines
// straight to memory: twice. Small copies stay plain: a partly written line would be flushed
// early. Callers end a run of copies with stream_fence() before another thread or process may
// look: streaming stores are not ordered with ordinary ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace flashstream {

// Below this many bytes copy_streaming() is a plain memcpy.
constexpr size_t kStreamCopyMin = 4096;

inline void copy_streaming(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
  if (n >= kStreamCopyMin) {
    const size_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;  // to a line start
    std::memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
  }
#endif
  if (n) std::memcpy(dst, src, n);
}

// Makes the streaming stores before it visible before any store after it.
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace flashstream
