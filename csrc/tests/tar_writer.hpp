// A minimal in-memory tar writer for the C++ tests: ustar headers (optionally corrupt), GNU
// long names, pax records, the end-of-archive blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace fstest {
namespace tarw {

struct HeaderOpts {
  char type = '0';
  std::string prefix;
  const char* size_field = nullptr;  // raw 12-byte size field instead of octal(size)
  bool signed_checksum = false;      // checksum over signed bytes (old Sun/NeXT tars)
  int checksum_delta = 0;            // corrupt the checksum
};

inline void put_octal(std::string& h, size_t pos, size_t width, uint64_t value) {
  std::string digits(width - 1, '0');
  for (size_t i = width - 1; i-- > 0; value >>= 3) digits[i] = char('0' + (value & 7));
  h.replace(pos, width - 1, digits);
  h[pos + width - 1] = '\0';
}

inline std::string header(const std::string& name, uint64_t size, const HeaderOpts& o = {}) {
  std::string h(512, '\0');
  h.replace(0, std::min<size_t>(name.size(), 100), name.substr(0, 100));
  put_octal(h, 100, 8, 0644);
  put_octal(h, 108, 8, 1000);
  put_octal(h, 116, 8, 1000);
  if (o.size_field)
    h.replace(124, 12, std::string(o.size_field, 12));
  else
    put_octal(h, 124, 12, size);
  put_octal(h, 136, 12, 1700000000);
  h[156] = o.type;
  h.replace(257, 8, std::string("ustar\0" "00", 8));
  h.replace(345, o.prefix.size(), o.prefix);
  h.replace(148, 8, "        ");
  long sum = 0;
  for (char c : h) sum += o.signed_checksum ? static_cast<signed char>(c) : static_cast<unsigned char>(c);
  sum += o.checksum_delta;
  put_octal(h, 148, 7, uint64_t(sum));  // "%06o\0" then the trailing space stays
  return h;
}

inline std::string pad(std::string data) {
  data.resize((data.size() + 511) / 512 * 512, '\0');
  return data;
}

inline std::string member(const std::string& name, const std::string& data, const HeaderOpts& o = {}) {
  return header(name, data.size(), o) + pad(data);
}

inline std::string gnu_long(const std::string& name, char type = 'L') {
  HeaderOpts o;
  o.type = type;
  return member("././@LongLink", name + '\0', o);
}

inline std::string pax_record(const std::string& key, const std::string& value) {
  std::string body = " " + key + "=" + value + "\n";
  size_t n = body.size() + 1;
  while (std::to_string(n).size() + body.size() != n) ++n;
  return std::to_string(n) + body;
}

inline std::string pax(const std::vector<std::pair<std::string, std::string>>& records, char type = 'x') {
  std::string data;
  for (auto& [k, v] : records) data += pax_record(k, v);
  HeaderOpts o;
  o.type = type;
  return member("././@PaxHeader", data, o);
}

inline const std::string kEnd(1024, '\0');

inline std::string bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = char(rng());
  return s;
}

}  // namespace tarw
}  // namespace fstest
