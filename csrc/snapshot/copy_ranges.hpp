// Many memory copies in one call, on a chosen number of threads.
//
// The checkpoint snapshot copies every CPU tensor into staging. torch's copy_ runs on its
// OpenMP pool and pays a barrier per tensor, which costs milliseconds per tensor when another
// process holds a core (a training job's data loader usually does), and copying tensor by
// tensor from Python costs microseconds each (50,000 small tensors: a quarter of a second).
// copy_ranges takes the whole list at once and splits its bytes evenly over `threads` plain
// threads, the caller's own being one of them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashstream {

struct CopyRange {
  const uint8_t* src;
  uint8_t* dst;
  size_t len;
};

// Copies every range (src and dst of one range must not overlap). threads <= 1, or too little
// to share, copies on the caller's thread.
void copy_ranges(const CopyRange* ranges, size_t count, unsigned threads);

}  // namespace flashstream
