#include "snapshot/copy_ranges.hpp"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace flashstream {
namespace {

// Below this per thread, starting a thread costs more than it saves.
constexpr size_t kMinBytesPerThread = size_t(4) << 20;

// Copies bytes [from, to) of the concatenation of the jobs.
void copy_span(const CopyRange* jobs, size_t count, size_t from, size_t to) {
  size_t at = 0;  // offset of jobs[i] in the concatenation
  for (size_t i = 0; i < count && at < to; at += jobs[i].len, ++i) {
    const size_t lo = std::max(from, at), hi = std::min(to, at + jobs[i].len);
    if (hi > lo) std::memcpy(jobs[i].dst + (lo - at), jobs[i].src + (lo - at), hi - lo);
  }
}

}  // namespace

void copy_ranges(const CopyRange* jobs, size_t count, unsigned threads) {
  size_t total = 0;
  for (size_t i = 0; i < count; ++i) total += jobs[i].len;
  const size_t useful = std::max<size_t>(1, total / kMinBytesPerThread);
  const unsigned n = static_cast<unsigned>(std::min<size_t>(std::max(threads, 1u), useful));
  if (n <= 1) {
    copy_span(jobs, count, 0, total);
    return;
  }
  std::vector<std::thread> helpers;
  helpers.reserve(n - 1);
  const size_t share = (total + n - 1) / n;
  for (unsigned t = 1; t < n; ++t)
    helpers.emplace_back(copy_span, jobs, count, std::min(total, t * share),
                         std::min(total, (t + 1) * share));
  copy_span(jobs, count, 0, std::min(total, share));
  for (std::thread& h : helpers) h.join();
}

}  // namespace flashstream
