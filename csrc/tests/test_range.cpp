// Unit tests for scattered reads (RangeFile): ranges land where asked through each engine,
// aligned tails past the end of the file, a file that shrank, bad ranges, many threads on one
// file, and close() against reads in progress. Real files in a temporary directory under /tmp.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/aligned.hpp"
#include "common/errors.hpp"
#include "io/engine.hpp"
#include "io/range_reader.hpp"
#include "tests/check.hpp"
#include "tests/temp_dir.hpp"

using namespace flashstream;
using Bytes = std::vector<uint8_t>;
using fstest::TempDir;

namespace {

constexpr uint64_t kSize = (uint64_t(1) << 20) + 4321;  // ends off every alignment

Bytes random_bytes(size_t n, uint64_t seed) {
  Bytes b(n);
  std::mt19937_64 rng(seed);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  return b;
}

std::string write_file(const TempDir& dir, const Bytes& data) {
  const std::string path = dir.file("data.bin");
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  return path;
}

// Page-aligned anonymous memory, as the index image is.
struct Region {
  explicit Region(size_t n) : size(n) {
    data = static_cast<uint8_t*>(
        mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (data == MAP_FAILED) throw std::bad_alloc();
  }
  ~Region() { munmap(data, size); }
  uint8_t* data;
  size_t size;
};

std::vector<std::string> engines() {
  std::vector<std::string> v{"threads"};
  if (uring_available()) v.push_back("uring");
  return v;
}

RangeOptions opts(const std::string& engine, unsigned depth, size_t request) {
  RangeOptions o;
  o.engine = engine;
  o.queue_depth = depth;
  o.request_size = request;
  return o;
}

bool same(const uint8_t* region, const Bytes& file, const ReadRange& r) {
  const uint64_t n = std::min<uint64_t>(r.length, file.size() - r.offset);
  return std::memcmp(region + r.dest, file.data() + r.offset, n) == 0;
}

}  // namespace

TEST_CASE("ranges land where asked, tail past the end untouched") {
  TempDir dir;
  const Bytes data = random_bytes(kSize, 1);
  const std::string path = write_file(dir, data);
  for (const std::string& engine : engines()) {
    RangeFile file(path, true);
    const uint64_t a = file.alignment().offset;
    CHECK(file.size() == kSize);
    Region region(4 << 20);
    std::memset(region.data, 0xAB, region.size);
    const std::vector<ReadRange> ranges = {
        {0, 4096, 0}, {7 * 4096, 3 * 4096, 16 * 4096}, {40 * 4096, 150 * 4096, 32 * 4096},
        {kSize / a * a, a, 600 * 4096}};
    const RangeStats s = file.read(region.data, region.size, ranges, opts(engine, 4, 16384));
    for (const ReadRange& r : ranges) CHECK(same(region.data, data, r));
    CHECK(s.bytes == 4096 + 3 * 4096 + 150 * 4096 + kSize % a);
    CHECK(s.requests >= 4 && s.engine == engine && s.max_ns > 0 && s.sum_ns >= s.max_ns);
    CHECK(region.data[600 * 4096 + a] == 0xAB);  // nothing written past the range
  }
}

TEST_CASE("random ranges equal the file, every depth and request size") {
  TempDir dir;
  const Bytes data = random_bytes(kSize, 2);
  const std::string path = write_file(dir, data);
  std::mt19937_64 rng(5);
  for (const std::string& engine : engines()) {
    RangeFile file(path, true);
    const uint64_t a = file.alignment().offset;
    const uint64_t limit = align_up(kSize, a);
    Region region(16 * 256 * 1024);
    for (int round = 0; round < 30; ++round) {
      std::vector<ReadRange> ranges;
      for (uint64_t i = 0; i < rng() % 16; ++i) {
        const uint64_t off = std::min(rng() % (kSize / a) * a, limit - a);
        const uint64_t len = std::min<uint64_t>((1 + rng() % 64) * a, limit - off);
        ranges.push_back({off, len, i * 256 * 1024});
      }
      const size_t request = a * (1 + rng() % 32);
      file.read(region.data, region.size, ranges, opts(engine, 1 + rng() % 8, request));
      for (const ReadRange& r : ranges) CHECK(same(region.data, data, r));
    }
  }
}

TEST_CASE("bad ranges are refused before anything is read") {
  TempDir dir;
  const std::string path = write_file(dir, random_bytes(kSize, 3));
  RangeFile file(path, true);
  CHECK(file.direct());
  const uint64_t a = file.alignment().offset;
  Region region(1 << 20);
  const RangeOptions o = opts("threads", 4, 65536);
  CHECK_THROWS(file.read(region.data, region.size, {{a + 1, a, 0}}, o), std::invalid_argument);
  CHECK_THROWS(file.read(region.data, region.size, {{0, a, 1}}, o), std::invalid_argument);
  CHECK_THROWS(file.read(region.data, region.size, {{0, a, region.size}}, o),
               std::invalid_argument);
  CHECK_THROWS(file.read(region.data, region.size, {{kSize / a * a, 2 * a, 0}}, o),
               std::invalid_argument);
  CHECK_THROWS(file.read(region.data, region.size, {{0, a, 0}}, opts("threads", 4, a + 1)),
               std::invalid_argument);
  CHECK_THROWS(file.read(region.data, region.size, {{0, a, 0}}, opts("bogus", 4, a)),
               std::invalid_argument);
  // Overflowing ranges are refused, not wrapped.
  CHECK_THROWS(file.read(region.data, region.size, {{0, a, UINT64_MAX - a + 1}}, o),
               std::invalid_argument);
  CHECK_THROWS(file.read(region.data, region.size, {{UINT64_MAX / a * a, a, 0}}, o),
               std::invalid_argument);
}

TEST_CASE("a file that shrank after open raises ENODATA past its new end") {
  TempDir dir;
  const std::string path = write_file(dir, random_bytes(1 << 20, 4));
  for (const std::string& engine : engines()) {
    RangeFile file(path, true);
    CHECK(::truncate(path.c_str(), 300000) == 0);
    Region region(1 << 20);
    int err = 0;
    int64_t offset = -1;
    try {
      file.read(region.data, region.size, {{0, 1 << 20, 0}}, opts(engine, 8, 65536));
    } catch (const IoError& e) {
      err = e.error_code();
      offset = e.offset();
    }
    CHECK(err == ENODATA);
    CHECK(offset >= 300000 && offset < (1 << 20));
    CHECK(::truncate(path.c_str(), 1 << 20) == 0);
  }
}

TEST_CASE("many threads read through one file; close waits for them") {
  TempDir dir;
  const Bytes data = random_bytes(kSize, 6);
  const std::string path = write_file(dir, data);
  for (const std::string& engine : engines()) {
    RangeFile file(path, true);
    const uint64_t a = file.alignment().offset;
    std::atomic<int> bad{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(t);
        Region region(8 * 64 * a);
        for (int i = 0; i < 40; ++i) {
          std::vector<ReadRange> ranges;
          for (uint64_t j = 0; j < 8; ++j)
            ranges.push_back({rng() % (kSize / a - 8) * a, (1 + rng() % 8) * a, j * 64 * a});
          file.read(region.data, region.size, ranges, opts(engine, 8, 2 * a));
          for (const ReadRange& r : ranges)
            if (!same(region.data, data, r)) ++bad;
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(bad == 0);
    file.close();
    Region region(a);
    int err = 0;
    try {
      file.read(region.data, region.size, {{0, a, 0}}, opts(engine, 1, a));
    } catch (const IoError& e) {
      err = e.error_code();
    }
    CHECK(err == EBADF);
  }
}

TEST_CASE("buffered where the filesystem refuses O_DIRECT, unaligned ranges allowed") {
  TempDir dir("/dev/shm");
  const Bytes data = random_bytes(10000, 7);
  const std::string path = write_file(dir, data);
  RangeFile file(path, false);  // asked for buffered: the same path as a refusing filesystem
  CHECK(!file.direct());
  Bytes region(20000);
  const RangeStats s = file.read(region.data(), region.size(), {{3, 9000, 11}, {9999, 1, 0}},
                                 opts("threads", 4, 4096));
  CHECK(std::memcmp(region.data() + 11, data.data() + 3, 9000) == 0);
  CHECK(region[0] == data[9999]);
  CHECK(s.bytes == 9001 && !s.direct);
}

TEST_MAIN()
