// Private helpers of the tar scanner: header block parsing and pax records, written to accept
// and reject exactly what CPython 3.11's tarfile accepts and rejects (frombuf, nti, nts,
// calc_chksums, _proc_pax). Not part of the public API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "common/errors.hpp"

namespace flashstream {
namespace tar {

constexpr uint64_t kBlock = 512;

// Extended header data (GNU long names, pax records) is held in memory: cap it so a corrupt
// size field cannot make us allocate without bound.
constexpr uint64_t kMaxExtendedHeader = 64ull << 20;

// Member sizes beyond this are corrupt in practice and would overflow offset arithmetic.
constexpr uint64_t kMaxMemberSize = 1ull << 60;

inline uint64_t padded(uint64_t size) { return (size + kBlock - 1) & ~(kBlock - 1); }

[[noreturn]] inline void fail(uint64_t offset, const std::string& what,
                              bool shard_only = false) {
  throw FormatError(what, offset, shard_only);
}

// tarfile.nts: the bytes up to the first NUL.
inline std::string_view nts(const void* p, size_t len) {
  const char* s = static_cast<const char*>(p);
  const void* nul = std::memchr(s, 0, len);
  return std::string_view(s, nul ? static_cast<const char*>(nul) - s : len);
}

// ASCII characters for which Python's str.isspace() is true (what str.strip() removes).
inline bool py_space(char c) { return c == ' ' || (c >= 9 && c <= 13) || (c >= 28 && c <= 31); }

enum class IntParse { kOk, kInvalid, kOverflow };

// Python's int(s, base) for base 8 or 10 on ASCII text: surrounding whitespace, a sign, a
// "0o" prefix (base 8 only, may be followed by one '_'), and single '_' between digits.
inline IntParse py_int(std::string_view s, int base, int64_t* out) {
  while (!s.empty() && py_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && py_space(s.back())) s.remove_suffix(1);
  bool negative = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    negative = s[0] == '-';
    s.remove_prefix(1);
  }
  bool underscore_ok = false;  // an '_' may follow a digit, or the base prefix
  if (base == 8 && s.size() >= 2 && s[0] == '0' && (s[1] == 'o' || s[1] == 'O')) {
    s.remove_prefix(2);
    underscore_ok = true;
  }
  if (s.empty()) return IntParse::kInvalid;
  uint64_t value = 0;
  bool overflow = false;
  for (char c : s) {
    if (c == '_' && underscore_ok) {
      underscore_ok = false;
      continue;
    }
    int digit = c - '0';
    if (digit < 0 || digit >= base) return IntParse::kInvalid;
    if (value > (uint64_t(INT64_MAX) - digit) / base) overflow = true;
    value = value * base + digit;
    underscore_ok = true;
  }
  if (s.back() == '_') return IntParse::kInvalid;
  if (overflow) return IntParse::kOverflow;
  *out = negative ? -int64_t(value) : int64_t(value);
  return IntParse::kOk;
}

// tarfile.nti: a number field, base-256 when the first byte is 0x80 (positive) or 0xff
// (negative), else octal text up to the first NUL: int(text.strip() or "0", 8).
inline IntParse nti(const uint8_t* f, size_t len, int64_t* out) {
  if (f[0] == 0x80 || f[0] == 0xff) {
    uint64_t n = 0;
    for (size_t i = 1; i < len; ++i) {
      if (n >> 55) return IntParse::kOverflow;  // more than 63 bits
      n = (n << 8) | f[i];
    }
    if (f[0] == 0x80) {
      *out = int64_t(n);
    } else {  // -(256**(len-1) - n), representable when len - 1 <= 7
      if (len - 1 > 7) return IntParse::kOverflow;
      *out = int64_t(n) - (int64_t(1) << (8 * (len - 1)));
    }
    return IntParse::kOk;
  }
  // Fast path for the usual "0000644\0" / "   644 \0": optional spaces, octal digits, then
  // only NULs or spaces. Anything else takes the exact route below.
  size_t i = 0;
  while (i < len && f[i] == ' ') ++i;
  const size_t first_digit = i;
  int64_t value = 0;
  for (; i < len && f[i] >= '0' && f[i] <= '7'; ++i) value = value * 8 + (f[i] - '0');
  if (i > first_digit) {
    while (i < len && f[i] == ' ') ++i;
    if (i == len || f[i] == 0) {
      *out = value;
      return IntParse::kOk;
    }
  }
  std::string_view text = nts(f, len);
  for (char c : text)
    if (static_cast<unsigned char>(c) >= 0x80) return IntParse::kInvalid;  // not ASCII
  bool blank = true;
  for (char c : text) blank = blank && py_space(c);
  if (blank) {
    *out = 0;
    return IntParse::kOk;
  }
  return py_int(text, 8, out);
}

// The fields of a header block that the scanner uses.
struct RawHeader {
  char type = 0;
  uint64_t size = 0;
  std::string_view name;    // nts(name field)
  std::string_view prefix;  // nts(ustar prefix field)
};

// tarfile.calc_chksums: the header's byte sum with the checksum field counted as spaces,
// taking bytes as unsigned or (some old tars) as signed.
inline void header_sums(const uint8_t* h, int64_t* unsigned_sum, int64_t* signed_sum) {
  uint32_t sum = 0, high = 0;
  for (size_t i = 0; i < 148; ++i) sum += h[i], high += h[i] >> 7;
  for (size_t i = 156; i < kBlock; ++i) sum += h[i], high += h[i] >> 7;
  *unsigned_sum = 256 + int64_t(sum);
  *signed_sum = 256 + int64_t(sum) - 256 * int64_t(high);
}

// tarfile.frombuf: returns false for an all-zero block (the end of the archive); otherwise
// verifies the checksum and every number field (tarfile rejects the header when any of them
// is malformed) and fills in the fields we need.
inline bool parse_header(const uint8_t* h, uint64_t offset, RawHeader* r) {
  int64_t checksum = 0, unsigned_sum = 0, signed_sum = 0;
  header_sums(h, &unsigned_sum, &signed_sum);
  if (unsigned_sum == 256) {  // every byte outside the checksum field is zero
    uint64_t field;
    std::memcpy(&field, h + 148, 8);
    if (field == 0) return false;
  }
  if (nti(h + 148, 8, &checksum) != IntParse::kOk ||
      (checksum != unsigned_sum && checksum != signed_sum))
    fail(offset, "invalid tar header checksum at offset " + std::to_string(offset));

  struct Field { const char* name; size_t pos, len; };
  static constexpr Field kNumbers[] = {{"mode", 100, 8},   {"uid", 108, 8},
                                       {"gid", 116, 8},    {"mtime", 136, 12},
                                       {"devmajor", 329, 8}, {"devminor", 337, 8}};
  int64_t ignored = 0;
  for (const Field& f : kNumbers)  // any magnitude is fine here, only malformed text is not
    if (nti(h + f.pos, f.len, &ignored) == IntParse::kInvalid)
      fail(offset, std::string("invalid ") + f.name + " field in tar header at offset " +
                       std::to_string(offset));

  int64_t size = 0;
  IntParse p = nti(h + 124, 12, &size);
  if (p == IntParse::kInvalid)
    fail(offset, "invalid size field in tar header at offset " + std::to_string(offset));
  if (p == IntParse::kOverflow || size < 0 || uint64_t(size) > kMaxMemberSize)
    fail(offset, "member size out of range in tar header at offset " + std::to_string(offset));
  r->size = uint64_t(size);
  r->type = char(h[156]);
  r->name = nts(h, 100);
  r->prefix = nts(h + 345, 155);
  return true;
}

// Calls fn(keyword, value) for each "LEN keyword=value\n" record of pax header data, where
// LEN counts the whole record. `buf` holds the data with its padding (tarfile matches records
// over the padded blocks), `size` the data proper. Like tarfile, parsing stops quietly where
// the text no longer starts like a record ("digits space keyword="); unlike tarfile, a record
// whose length disagrees with its text or runs past `size` is an error, not silently misread.
template <class Fn>
void parse_pax_records(std::string_view buf, size_t size, uint64_t offset, Fn&& fn) {
  size_t pos = 0;
  while (pos < size) {
    size_t i = pos;
    uint64_t len = 0;
    for (; i < buf.size() && buf[i] >= '0' && buf[i] <= '9'; ++i)
      len = std::min<uint64_t>(len * 10 + (buf[i] - '0'), UINT32_MAX);  // clamp: only compared
    if (i == pos || i == buf.size() || buf[i] != ' ') return;
    size_t key = i + 1;
    size_t eq = buf.find('=', key);
    if (eq == std::string_view::npos || eq == key) return;
    if (len == 0 || len > size - pos || eq >= pos + len - 1 || buf[pos + len - 1] != '\n')
      fail(offset, "malformed pax header record in header at offset " + std::to_string(offset));
    fn(buf.substr(key, eq - key), buf.substr(eq + 1, pos + len - 1 - (eq + 1)));
    pos += len;
  }
}

}  // namespace tar
}  // namespace flashstream
