// Unit tests for BatchPacker: regions per field in arrival order, absent fields, refusing a
// sample it has no region for (copying nothing), relocation, and overflow. Fields point into
// buffers freed right after add(), so ASan catches a packer that keeps a pointer.
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/stream_copy.hpp"
#include "tar/batch_packer.hpp"
#include "tests/check.hpp"

using namespace flashstream;

namespace {

// A sample whose fields own their bytes (as the scanner's spanning fields do).
Sample make_sample(const std::string& key, uint64_t offset,
                   const std::vector<std::pair<std::string, std::string>>& fields) {
  Sample s;
  s.key = key;
  s.offset = offset;
  s.end_offset = offset + 1024;
  for (const auto& [ext, data] : fields) {
    Field& f = s.fields.emplace_back();
    f.ext = ext;
    f.owned = std::make_shared<std::vector<uint8_t>>(data.begin(), data.end());
    f.data = f.owned->empty() ? reinterpret_cast<const uint8_t*>("") : f.owned->data();
    f.size = data.size();
  }
  return s;
}

std::string region(const std::vector<uint8_t>& memory, const PackedField& f) {
  return std::string(reinterpret_cast<const char*>(memory.data() + f.region), f.bytes);
}

}  // namespace

TEST_CASE("fields go to their regions in arrival order") {
  std::vector<uint8_t> memory(64 + 3 * 100);
  BatchPacker p(memory.data(), memory.size(), 64, 100, {"cls", "bin"});
  CHECK(p.add(make_sample("a", 0, {{"cls", "1"}, {"bin", "AAAA"}})) == BatchPacker::Status::kOk);
  CHECK(p.add(make_sample("b", 1536, {{"bin", "BBBB"}, {"cls", "22"}})) ==
        BatchPacker::Status::kOk);
  CHECK(p.count() == 2);
  CHECK(p.keys()[1] == "b" && p.offsets()[1] == 1536);
  const auto& fields = p.fields();
  CHECK(fields.size() == 2);
  CHECK(fields[0].ext == "cls" && fields[0].region == 64 && region(memory, fields[0]) == "122");
  CHECK(fields[1].ext == "bin" && fields[1].region == 164);
  CHECK(region(memory, fields[1]) == "AAAABBBB");
  CHECK((fields[1].lengths == std::vector<int64_t>{4, 4}));
  CHECK((fields[0].lengths == std::vector<int64_t>{1, 2}));
}

TEST_CASE("absent fields are -1, before and after they first appear") {
  std::vector<uint8_t> memory(3 * 50);
  BatchPacker p(memory.data(), memory.size(), 0, 50, {});
  CHECK(p.add(make_sample("a", 0, {{"txt", "x"}})) == BatchPacker::Status::kOk);
  CHECK(p.add(make_sample("b", 1, {{"txt", "y"}, {"json", "{}"}})) == BatchPacker::Status::kOk);
  CHECK(p.add(make_sample("c", 2, {{"json", ""}})) == BatchPacker::Status::kOk);
  const auto& f = p.fields();
  CHECK((f[0].lengths == std::vector<int64_t>{1, 1, -1}));
  CHECK((f[1].lengths == std::vector<int64_t>{-1, 2, 0}));
}

TEST_CASE("no region left: refused, nothing copied; relocate and retry") {
  std::vector<uint8_t> small(2 * 40);
  BatchPacker p(small.data(), small.size(), 0, 40, {"a"});
  CHECK(p.add(make_sample("k0", 0, {{"a", "aa"}, {"b", "bb"}})) == BatchPacker::Status::kOk);
  auto three = make_sample("k1", 1, {{"a", "AA"}, {"c", "cc"}});
  CHECK(p.add(three) == BatchPacker::Status::kNoRegion);
  CHECK(p.count() == 1 && p.fields().size() == 2 && p.fields()[0].bytes == 2);
  std::vector<uint8_t> big(3 * 64);
  p.relocate(big.data(), big.size(), 64);
  small.assign(small.size(), 0xEE);  // the old memory is no longer read
  CHECK(p.add(three) == BatchPacker::Status::kOk);
  const auto& f = p.fields();
  CHECK(f.size() == 3 && f[1].region == 64 && f[2].region == 128);
  CHECK(region(big, f[0]) == "aaAA" && region(big, f[1]) == "bb" && region(big, f[2]) == "cc");
  CHECK((f[2].lengths == std::vector<int64_t>{-1, 2}));
}

TEST_CASE("relocating within the same memory to larger regions keeps every byte") {
  std::vector<uint8_t> memory(3 * 64);
  BatchPacker p(memory.data(), 3 * 16, 0, 16, {"x", "y", "z"});
  CHECK(p.add(make_sample("k", 0, {{"x", "xxxx"}, {"y", "yyyy"}, {"z", "zzzz"}})) ==
        BatchPacker::Status::kOk);
  p.relocate(memory.data(), memory.size(), 64);
  const auto& f = p.fields();
  CHECK(region(memory, f[0]) == "xxxx" && region(memory, f[1]) == "yyyy" &&
        region(memory, f[2]) == "zzzz");
}

TEST_CASE("a field larger than its region throws and copies nothing past it") {
  std::vector<uint8_t> memory(2 * 8);
  BatchPacker p(memory.data(), memory.size(), 0, 8, {"a"});
  bool threw = false;
  try {
    p.add(make_sample("k", 0, {{"a", "123456789"}}));
  } catch (const std::length_error&) {
    threw = true;
  }
  CHECK(threw);
  bool bad_base = false;
  try {
    BatchPacker q(memory.data(), memory.size(), 17, 8, {});
  } catch (const std::invalid_argument&) {
    bad_base = true;
  }
  CHECK(bad_base);
}

TEST_CASE("empty payloads and zero-sized regions") {
  std::vector<uint8_t> memory(16);
  BatchPacker p(memory.data(), memory.size(), 16, 0, {});
  CHECK(p.add(make_sample("k", 0, {{"a", ""}, {"b", ""}})) == BatchPacker::Status::kOk);
  CHECK(p.fields().size() == 2 && p.fields()[1].bytes == 0);
}

TEST_CASE("streaming copies equal memcpy at every size edge and alignment") {
  std::vector<uint8_t> src(200000 + 128), dst(200000 + 128), want;
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t n : {size_t(0), size_t(1), size_t(63), size_t(64), size_t(65), size_t(4095),
                   size_t(4096), size_t(4097), size_t(100000), size_t(200000)})
    for (size_t d : {0, 1, 17, 63})
      for (size_t s : {0, 5, 64}) {
        std::fill(dst.begin(), dst.end(), 0xAB);
        want = dst;
        std::memcpy(want.data() + d, src.data() + s, n);
        copy_streaming(dst.data() + d, src.data() + s, n);
        stream_fence();
        CHECK(dst == want);  // and nothing written outside [d, d + n)
      }
}

int main() { return fstest::run_all(); }
