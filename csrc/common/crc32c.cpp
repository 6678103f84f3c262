// CRC-32C (reflected polynomial 0x82F63B78). The hardware path runs three independent CRC
// streams over three adjacent blocks, so the CRC instruction's 3-cycle latency is hidden, then
// joins them: the register of block A shifted over len(B) zero bytes, XOR the register of B
// (started at 0), is the register of A + B. The shift is linear over GF(2), so for a fixed
// length it is four 256-entry tables built once. The software path is slicing-by-8.
#include "common/crc32c.hpp"

#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define FS_CRC_X86 1
#define FS_CRC_TARGET __attribute__((target("sse4.2")))
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define FS_CRC_ARM 1
#define FS_CRC_TARGET
#endif

namespace flashstream {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial
constexpr size_t kLong = 8192;           // bytes per stream in the long 3-way loop
constexpr size_t kShort = 256;           // bytes per stream in the short 3-way loop

struct Tables {
  uint32_t slice[8][256];  // slicing-by-8
  uint32_t shift_long[4][256];
  uint32_t shift_short[4][256];

  Tables() {
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      slice[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; ++n)
      for (int k = 1; k < 8; ++k)
        slice[k][n] = (slice[k - 1][n] >> 8) ^ slice[0][slice[k - 1][n] & 0xff];
    build_shift(shift_long, kLong);
    build_shift(shift_short, kShort);
  }

  // The register after `zeros` zero bytes, starting from `reg` (no pre/post inversion).
  uint32_t append_zeros(uint32_t reg, size_t zeros) const {
    for (size_t i = 0; i < zeros; ++i) reg = slice[0][reg & 0xff] ^ (reg >> 8);
    return reg;
  }

  // table[k][b] = shift of the register b << 8k; any register's shift is the XOR of its bytes'.
  void build_shift(uint32_t (&table)[4][256], size_t zeros) const {
    uint32_t basis[32];
    for (int bit = 0; bit < 32; ++bit) basis[bit] = append_zeros(uint32_t(1) << bit, zeros);
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int bit = 0; bit < 8; ++bit)
          if (b & (1u << bit)) v ^= basis[8 * k + bit];
        table[k][b] = v;
      }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

inline uint32_t shift(const uint32_t (&t)[4][256], uint32_t reg) {
  return t[0][reg & 0xff] ^ t[1][(reg >> 8) & 0xff] ^ t[2][(reg >> 16) & 0xff] ^ t[3][reg >> 24];
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;  // little-endian hosts only (x86-64, aarch64 Linux), as the tables assume
}

uint32_t crc_software(const uint8_t* p, size_t n, uint32_t reg, const Tables& t) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    reg = t.slice[0][(reg ^ *p++) & 0xff] ^ (reg >> 8);
    --n;
  }
  while (n >= 8) {
    const uint64_t v = load64(p) ^ reg;
    reg = t.slice[7][v & 0xff] ^ t.slice[6][(v >> 8) & 0xff] ^ t.slice[5][(v >> 16) & 0xff] ^
          t.slice[4][(v >> 24) & 0xff] ^ t.slice[3][(v >> 32) & 0xff] ^
          t.slice[2][(v >> 40) & 0xff] ^ t.slice[1][(v >> 48) & 0xff] ^ t.slice[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) reg = t.slice[0][(reg ^ *p++) & 0xff] ^ (reg >> 8);
  return reg;
}

#if defined(FS_CRC_X86) || defined(FS_CRC_ARM)

#if defined(FS_CRC_X86)
FS_CRC_TARGET inline uint32_t hw8(uint32_t reg, uint8_t b) { return _mm_crc32_u8(reg, b); }
FS_CRC_TARGET inline uint32_t hw64(uint32_t reg, const uint8_t* p) {
  return static_cast<uint32_t>(_mm_crc32_u64(reg, load64(p)));
}
#else
inline uint32_t hw8(uint32_t reg, uint8_t b) { return __crc32cb(reg, b); }
inline uint32_t hw64(uint32_t reg, const uint8_t* p) { return __crc32cd(reg, load64(p)); }
#endif

// Three streams over blocks of `block` bytes while at least 3 blocks remain.
FS_CRC_TARGET inline uint32_t hw_3way(const uint8_t*& p, size_t& n, uint32_t reg, size_t block,
                                      const uint32_t (&t)[4][256]) {
  while (n >= 3 * block) {
    uint32_t r1 = 0, r2 = 0;
    const uint8_t* end = p + block;
    do {
      reg = hw64(reg, p);
      r1 = hw64(r1, p + block);
      r2 = hw64(r2, p + 2 * block);
      p += 8;
    } while (p < end);
    reg = shift(t, reg) ^ r1;
    reg = shift(t, reg) ^ r2;
    p += 2 * block;
    n -= 3 * block;
  }
  return reg;
}

FS_CRC_TARGET uint32_t crc_hardware(const uint8_t* p, size_t n, uint32_t reg, const Tables& t) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    reg = hw8(reg, *p++);
    --n;
  }
  reg = hw_3way(p, n, reg, kLong, t.shift_long);
  reg = hw_3way(p, n, reg, kShort, t.shift_short);
  while (n >= 8) {
    reg = hw64(reg, p);
    p += 8;
    n -= 8;
  }
  while (n--) reg = hw8(reg, *p++);
  return reg;
}

bool detect_hardware() noexcept {
#if defined(FS_CRC_X86)
  return __builtin_cpu_supports("sse4.2");
#else
  return true;  // compiled for a CPU with the CRC extension
#endif
}

#else
bool detect_hardware() noexcept { return false; }
#endif

}  // namespace

bool crc32c_hardware() noexcept {
  static const bool hw = detect_hardware();
  return hw;
}

uint32_t crc32c(const void* data, size_t len, uint32_t crc) noexcept {
  const Tables& t = tables();
  const uint8_t* p = static_cast<const uint8_t*>(data);
#if defined(FS_CRC_X86) || defined(FS_CRC_ARM)
  if (crc32c_hardware()) return ~crc_hardware(p, len, ~crc, t);
#endif
  return ~crc_software(p, len, ~crc, t);
}

uint32_t crc32c_software(const void* data, size_t len, uint32_t crc) noexcept {
  return ~crc_software(static_cast<const uint8_t*>(data), len, ~crc, tables());
}

}  // namespace flashstream
