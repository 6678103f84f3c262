// Shared by the fuzz harnesses: how an input is cut into the pieces fed to the scanner, and a
// check that aborts (a finding for libFuzzer) with a message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace fuzz {

inline void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "invariant broken: %s\n", what);
  std::abort();
}

struct Piece {
  size_t offset, size;
};

// Piece sizes drawn from a generator seeded by the input's hash: a mutation that changes the
// bytes also changes the cut. Sizes cluster where the scanner's bookkeeping changes: single
// bytes, one block and its neighbours, a few blocks, and "everything left".
inline std::vector<Piece> split(const uint8_t* data, size_t size) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 1099511628211ull;
  static const size_t kSizes[] = {1, 7, 100, 511, 512, 513, 1024, 1536, 4096, 10000};
  std::vector<Piece> out;
  for (size_t at = 0; at < size;) {
    h ^= h << 13, h ^= h >> 7, h ^= h << 17;  // xorshift64
    const unsigned pick = static_cast<unsigned>(h % 12);
    size_t n = pick < 10 ? kSizes[pick] : size - at;
    if (n > size - at) n = size - at;
    out.push_back({at, n});
    at += n;
  }
  if (out.empty()) out.push_back({0, 0});  // an empty shard is fed as one empty piece
  return out;
}

}  // namespace fuzz
