// Unit tests for the checkpoint I/O core: CRC-32C, the pacer, the adaptive rate controller, and
// whole-file writes and reads (OutputFile, read_file_into) through each engine, on real files in
// a temporary directory under /tmp (a disk that takes O_DIRECT) and /dev/shm.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/aligned.hpp"
#include "common/crc32c.hpp"
#include "common/errors.hpp"
#include "io/bulk_file.hpp"
#include "io/engine.hpp"
#include "io/pacing.hpp"
#include "tests/check.hpp"
#include "tests/temp_dir.hpp"

using namespace flashstream;
using Bytes = std::vector<uint8_t>;

#include "tests/fake_statx.hpp"  // g_fake_dio_offset

namespace {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;
using fstest::TempDir;

void fill(uint8_t* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(p + i, &v, std::min<size_t>(8, n - i));
  }
}

Bytes read_file(const std::string& path) {
  Bytes out;
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    uint8_t buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.insert(out.end(), buf, buf + n);
    std::fclose(f);
  }
  return out;
}

uint64_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : UINT64_MAX;
}

std::vector<std::string> engines() {
  std::vector<std::string> v{"threads"};
  if (uring_available()) v.push_back("uring");
  else std::printf("  (io_uring unavailable here: testing the thread engine only)\n");
  return v;
}

BulkOptions opts(const std::string& engine, size_t chunk, unsigned depth) {
  BulkOptions o;
  o.engine = engine;
  o.chunk_size = chunk;
  o.queue_depth = depth;
  return o;
}

int io_errno(const std::function<void()>& fn, int64_t* offset = nullptr) {
  try {
    fn();
  } catch (const IoError& e) {
    if (offset) *offset = e.offset();
    return e.error_code();
  }
  return 0;
}

// ---- CRC-32C ----

TEST_CASE("crc32c known vectors") {
  const char* s = "123456789";
  CHECK(crc32c(s, 9) == 0xE3069283u);
  CHECK(crc32c_software(s, 9) == 0xE3069283u);
  CHECK(crc32c(nullptr, 0) == 0);
  uint8_t buf[32];
  std::memset(buf, 0, 32);
  CHECK(crc32c(buf, 32) == 0x8A9136AAu);  // RFC 3720 B.4
  std::memset(buf, 0xff, 32);
  CHECK(crc32c(buf, 32) == 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<uint8_t>(i);
  CHECK(crc32c(buf, 32) == 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<uint8_t>(31 - i);
  CHECK(crc32c(buf, 32) == 0x113FDB5Cu);
  std::printf("  hardware: %s\n", crc32c_hardware() ? "yes" : "no");
}

TEST_CASE("crc32c chains and hardware equals software") {
  Bytes data(300 * kKiB + 77);
  fill(data.data(), data.size(), 7);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200; ++i) {
    const size_t off = rng() % 64;
    const size_t max = data.size() - off;
    // Lengths around the 3-way block sizes (3 x 256, 3 x 8192) and arbitrary odd ones.
    const size_t picks[] = {rng() % 64, 3 * 256 + rng() % 17, 3 * 8192 - 1 + rng() % 3,
                            rng() % max};
    const size_t len = std::min(max, picks[i % 4]);
    const uint32_t seed = static_cast<uint32_t>(rng());
    const uint32_t hw = crc32c(data.data() + off, len, seed);
    CHECK(hw == crc32c_software(data.data() + off, len, seed));
    const size_t cut = len ? rng() % len : 0;
    const uint32_t a = crc32c(data.data() + off, cut, seed);
    CHECK(crc32c(data.data() + off + cut, len - cut, a) == hw);
  }
  CHECK(crc32c("6789", 4, crc32c("12345", 5)) == 0xE3069283u);
}

// ---- Pacer ----

TEST_CASE("pacer: unpaced never waits") {
  Pacer p;
  CHECK(p.rate() == 0);
  for (int i = 0; i < 100; ++i) CHECK(p.admit(1 << 20, i * 1e-6) == 0);
}

TEST_CASE("pacer: schedule, average rate, no catch-up burst") {
  Pacer p(100.0);  // 100 B/s, 10-byte requests: one every 0.1 s
  double now = 5.0;
  for (int i = 0; i < 1000; ++i) {
    const double d = p.admit(10, now);
    CHECK(d >= 0);
    if (i == 0) CHECK(d == 0);  // no initial wait
    now += d;
    CHECK(std::fabs(now - (5.0 + i * 0.1)) < 1e-9);
  }
  // Average over the write (last request takes its own 0.1 s): exactly the rate.
  CHECK(std::fabs(10000.0 / (now + 0.1 - 5.0) - 100.0) < 1e-6);
  // Falling behind restarts the schedule: no burst to catch up.
  now += 50;
  CHECK(p.admit(10, now) == 0);
  CHECK(std::fabs(p.admit(10, now) - 0.1) < 1e-9);
}

TEST_CASE("pacer: set_rate mid-way") {
  Pacer p(100.0);
  double now = 0;
  for (int i = 0; i < 10; ++i) now += p.admit(10, now);  // last admitted at 0.9, next at 1.0
  p.set_rate(200.0, now);                               // the remaining 0.1 s becomes 0.05 s
  CHECK(p.rate() == 200.0);
  double d = p.admit(10, now);
  CHECK(std::fabs(d - 0.05) < 1e-9);
  now += d;
  d = p.admit(10, now);
  CHECK(std::fabs(d - 0.05) < 1e-9);
  now += d;
  p.set_rate(0, now);  // unpaced from now on
  CHECK(p.admit(10, now) == 0);
  CHECK(p.admit(10, now) == 0);
  p.set_rate(100.0, now);  // and paced again: no debt from the unpaced stretch
  CHECK(p.admit(10, now) == 0);
  CHECK(std::fabs(p.admit(10, now) - 0.1) < 1e-9);
}

// ---- AdaptiveRate ----

constexpr double kGB = 1e9;

TEST_CASE("adaptive: flat throughput never paces") {
  AdaptiveRate a;
  for (int i = 0; i < 200; ++i) CHECK(a.observe(static_cast<uint64_t>(3 * kGB * 0.1), 0.1) == 0);
  CHECK(!a.cliff());
  CHECK(std::fabs(a.peak() - 3 * kGB) < 1);
  CHECK(a.sustained() == 0);
}

TEST_CASE("adaptive: detects the cliff and paces below it") {
  AdaptiveConfig c;
  AdaptiveRate a(c);
  for (int i = 0; i < 20; ++i) a.observe(static_cast<uint64_t>(3 * kGB * 0.1), 0.1);
  int windows = 0;
  while (!a.cliff() && windows < 10) {
    a.observe(static_cast<uint64_t>(1 * kGB * 0.1), 0.1);
    ++windows;
  }
  CHECK(a.cliff());
  CHECK(windows == static_cast<int>(c.cliff_windows));
  CHECK(std::fabs(a.sustained() - kGB) < 1e3);
  CHECK(std::fabs(a.rate() - 0.9 * kGB) < 1e3);
  // Paced windows at the rate keep it.
  for (int i = 0; i < 20; ++i) a.observe(static_cast<uint64_t>(0.9 * kGB * 0.1), 0.1);
  CHECK(std::fabs(a.rate() - 0.9 * kGB) < 1e3);
  // A further drop lowers it to margin x that window...
  a.observe(static_cast<uint64_t>(0.5 * kGB * 0.1), 0.1);
  CHECK(std::fabs(a.rate() - 0.45 * kGB) < 1e3);
  // ...and a recovery does not raise it again.
  for (int i = 0; i < 20; ++i) a.observe(static_cast<uint64_t>(3 * kGB * 0.1), 0.1);
  CHECK(std::fabs(a.rate() - 0.45 * kGB) < 1e3);
}

TEST_CASE("adaptive: +-20% noise around a flat rate does not trigger") {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> noise(0.8, 1.2);
  AdaptiveRate a;
  for (int i = 0; i < 5000; ++i) a.observe(static_cast<uint64_t>(2 * kGB * 0.1 * noise(rng)), 0.1);
  CHECK(!a.cliff());
  CHECK(a.rate() == 0);
}

TEST_CASE("adaptive: a single slow window is not a cliff; median of the run") {
  AdaptiveConfig c;
  c.cliff_windows = 3;
  AdaptiveRate a(c);
  a.observe(static_cast<uint64_t>(3 * kGB), 1.0);
  a.observe(static_cast<uint64_t>(1 * kGB), 1.0);  // one low window...
  a.observe(static_cast<uint64_t>(3 * kGB), 1.0);  // ...then a good one resets the run
  a.observe(static_cast<uint64_t>(1 * kGB), 1.0);
  a.observe(static_cast<uint64_t>(1 * kGB), 1.0);
  CHECK(!a.cliff());
  a.observe(static_cast<uint64_t>(1.2 * kGB), 1.0);  // third low window: median of 1, 1, 1.2
  CHECK(a.cliff());
  CHECK(std::fabs(a.sustained() - kGB) < 1e3);
}

TEST_CASE("adaptive: min_rate floor and config validation") {
  AdaptiveRate a;
  a.observe(static_cast<uint64_t>(3 * kGB), 1.0);
  a.observe(1000, 1.0);
  a.observe(1000, 1.0);
  CHECK(a.cliff());
  CHECK(a.rate() == a.config().min_rate);
  a.observe(10, 1.0);
  CHECK(a.rate() == a.config().min_rate);
  AdaptiveConfig bad;
  bad.cliff_windows = 17;
  CHECK_THROWS(AdaptiveRate{bad}, std::invalid_argument);
  bad = {};
  bad.window = 0;
  CHECK_THROWS(AdaptiveRate{bad}, std::invalid_argument);
  bad = {};
  bad.margin = 1.5;
  CHECK_THROWS(AdaptiveRate{bad}, std::invalid_argument);
}

// ---- OutputFile and read_file_into ----

// Writes `size` bytes (padded to the alignment when direct) and checks the file.
void round_trip(const std::string& dir, const std::string& engine, size_t size, size_t chunk,
                unsigned depth) {
  const std::string path = dir + "/out-" + engine + "-" + std::to_string(size) + "-" +
                           std::to_string(chunk);
  OutputFile f(path, size, true);
  const size_t padded = f.direct() ? align_up(size, f.alignment().offset) : size;
  AlignedBuffer buf(padded, 4096);
  fill(buf.data(), padded, size * 31 + chunk);
  std::vector<uint32_t> crcs;
  BulkStats st = f.write(buf.data(), padded, 0, opts(engine, chunk, depth), {}, &crcs);
  CHECK(st.bytes == padded);
  CHECK(crcs.empty());
  CHECK(st.latency.count() == st.requests);
  CHECK(st.requests >= (padded + chunk - 1) / chunk);
  uint64_t in_timeline = 0;
  for (const RatePoint& p : st.timeline) in_timeline += p.bytes;
  CHECK(in_timeline == padded);
  CHECK(st.final_rate == 0 && st.paused == 0);
  f.commit(size);
  CHECK(file_size(path) == size);
  Bytes got = read_file(path);
  CHECK(got.size() == size && (size == 0 || std::memcmp(got.data(), buf.data(), size) == 0));
  f.close();  // idempotent after commit
}

TEST_CASE("OutputFile round trips at edge sizes and chunkings") {
  TempDir dir;
  for (const std::string& e : engines()) {
    round_trip(dir.path, e, 0, 4096, 4);
    round_trip(dir.path, e, 1, 4096, 4);
    round_trip(dir.path, e, 4096, 4096, 4);
    round_trip(dir.path, e, 4097, 4096, 1);
    round_trip(dir.path, e, 6 * kMiB, kMiB, 4);          // divides
    round_trip(dir.path, e, 6 * kMiB, 320 * kKiB, 8);    // does not divide
    round_trip(dir.path, e, 6 * kMiB + 12 * kKiB + 5, kMiB, 3);
  }
}

TEST_CASE("OutputFile: direct where the disk takes it, buffered on /dev/shm") {
  TempDir disk, shm("/dev/shm");
  for (const std::string& e : engines()) {
    round_trip(shm.path, e, 3 * kMiB + 17, kMiB, 4);
    round_trip(shm.path, e, 4097, 4096, 2);
  }
  OutputFile f(disk.file("d"), 4096, true);
  std::printf("  /tmp direct: %s (alignment %u/%u)\n", f.direct() ? "yes" : "no",
              f.alignment().offset, f.alignment().memory);
  OutputFile g(disk.file("b"), 4096, false);
  CHECK(!g.direct());
}

TEST_CASE("OutputFile: header written last at offset 0, crcs per segment") {
  TempDir dir;
  for (const std::string& e : engines()) {
    const std::string path = dir.file("ckpt-" + e);
    const size_t header = 4096, body = 5 * kMiB + 8192, total = header + body;
    AlignedBuffer buf(total, 4096);
    fill(buf.data(), total, 99);
    OutputFile f(path, total, true);
    // Segments crossing chunk boundaries, an empty one, and bytes after the last bound.
    const std::vector<uint64_t> bounds = {0, 100, 100, kMiB + 7, 3 * kMiB, body - 3};
    std::vector<uint32_t> crcs;
    BulkStats st = f.write(buf.data() + header, body, header, opts(e, kMiB, 4), bounds, &crcs);
    CHECK(st.bytes == body);
    CHECK(crcs.size() == bounds.size() - 1);
    for (size_t i = 0; i + 1 < bounds.size() && i < crcs.size(); ++i)
      CHECK(crcs[i] == crc32c(buf.data() + header + bounds[i], bounds[i + 1] - bounds[i]));
    f.write(buf.data(), header, 0, opts(e, 4096, 1), {0, header}, &crcs);
    CHECK(crcs.size() == 1 && crcs[0] == crc32c(buf.data(), header));
    f.commit(total - 10);
    Bytes got = read_file(path);
    CHECK(got.size() == total - 10 && std::memcmp(got.data(), buf.data(), total - 10) == 0);
  }
}

TEST_CASE("OutputFile: O_EXCL refuses an existing file and leaves it alone") {
  TempDir dir;
  const std::string path = dir.file("exists");
  { std::ofstream(path) << "keep"; }
  CHECK(io_errno([&] { OutputFile f(path, 4096, true); }) == EEXIST);
  CHECK(read_file(path).size() == 4);
  CHECK(io_errno([&] { OutputFile f(dir.file("no/such/dir"), 0, true); }) == ENOENT);
}

TEST_CASE("OutputFile: a full disk fails at open, or mid-write once requests are back") {
  TempDir dir;
  if (::mount("none", dir.path.c_str(), "tmpfs", 0, "size=4m") != 0) {
    std::printf("  (cannot mount a small tmpfs without root: skipped)\n");
    return;
  }
  int64_t offset = -1;
  CHECK(io_errno([&] { OutputFile f(dir.file("big"), 16 * kMiB, true); }, &offset) == ENOSPC);
  CHECK(offset == 0);
  CHECK(file_size(dir.file("big")) == UINT64_MAX);  // removed again
  AlignedBuffer buf(8 * kMiB, 4096);
  fill(buf.data(), 8 * kMiB, 4);
  for (const std::string& e : engines()) {
    OutputFile f(dir.file("unreserved-" + e), 0, true);
    std::vector<uint32_t> crcs;
    offset = -1;
    CHECK(io_errno([&] { f.write(buf.data(), 8 * kMiB, 0, opts(e, kMiB, 4), {}, &crcs); },
                   &offset) == ENOSPC);
    CHECK(offset > 0 && offset < static_cast<int64_t>(8 * kMiB));
    f.close();
    ::unlink(dir.file("unreserved-" + e).c_str());
  }
  ::umount2(dir.path.c_str(), MNT_DETACH);
}

TEST_CASE("OutputFile: argument validation") {
  TempDir dir;
  OutputFile f(dir.file("v"), 0, true);
  if (!f.direct()) {
    std::printf("  (no O_DIRECT under /tmp: alignment checks skipped)\n");
    return;
  }
  const uint32_t a = f.alignment().offset;
  AlignedBuffer buf(1 * kMiB, 4096);
  auto w = [&](const uint8_t* p, uint64_t len, uint64_t off, BulkOptions o,
               std::vector<uint64_t> bounds = {}) {
    std::vector<uint32_t> crcs;
    f.write(p, len, off, o, bounds, &crcs);
  };
  const BulkOptions ok = opts("threads", 64 * kKiB, 2);
  CHECK_THROWS(w(buf.data(), 4096, 0, opts("threads", 0, 2)), std::invalid_argument);
  CHECK_THROWS(w(buf.data(), 4096, 0, opts("threads", 4096, 0)), std::invalid_argument);
  CHECK_THROWS(w(buf.data(), 4096, 0, opts("threads", 4096 + a / 2, 2)), std::invalid_argument);
  CHECK_THROWS(w(buf.data() + 1, 4096, 0, ok), std::invalid_argument);
  CHECK_THROWS(w(buf.data(), 4096, a / 2, ok), std::invalid_argument);
  CHECK_THROWS(w(buf.data(), 4096 + a / 2, 0, ok), std::invalid_argument);
  CHECK_THROWS(w(buf.data(), 4096, 0, ok, {0, 200, 100}), std::invalid_argument);
  CHECK_THROWS(w(buf.data(), 4096, 0, ok, {1, 200}), std::invalid_argument);
  CHECK_THROWS(w(buf.data(), 4096, 0, ok, {0, 4097}), std::invalid_argument);
  BulkOptions fine = ok;
  fine.interval = 0.0001;
  CHECK_THROWS(w(buf.data(), 4096, 0, fine), std::invalid_argument);
  fine = ok;
  fine.rate = -1;
  CHECK_THROWS(w(buf.data(), 4096, 0, fine), std::invalid_argument);
  CHECK_THROWS(w(buf.data(), 4096, 0, opts("bogus", 4096, 2)), std::invalid_argument);
  fine = ok;
  fine.paced_chunk_size = 4096 + a / 2;
  CHECK_THROWS(w(buf.data(), 4096, 0, fine), std::invalid_argument);
  // An empty write touches no memory: its buffer's address need not be aligned (a state
  // dict without tensor bytes has an empty data region at any address).
  w(buf.data() + 1, 0, 0, ok);
  w(buf.data(), 4096, 0, ok);  // still usable after refused calls
  f.close();
  CHECK(io_errno([&] { w(buf.data(), 4096, 0, ok); }) == EBADF);
}

TEST_CASE("OutputFile: a direct write the filesystem refuses goes on buffered") {
#ifdef STATX_DIOALIGN
  TempDir dir;
  g_fake_dio_offset = 4;  // the fd takes O_DIRECT, but 4-byte-aligned requests get EINVAL
  for (const std::string& e : engines()) {
    const std::string path = dir.file("fallback-" + e);
    OutputFile f(path, 0, true);
    if (!f.direct() || f.alignment().offset != 4) {
      std::printf("  (statx does not report DIO alignment here: skipped)\n");
      break;
    }
    AlignedBuffer buf(64 * kKiB, 4096);
    fill(buf.data(), 64 * kKiB, 5);
    std::vector<uint32_t> crcs;
    f.write(buf.data(), 10000, 100, opts(e, 1000, 4), {}, &crcs);
    CHECK(!f.direct());
    f.write(buf.data(), 100, 0, opts(e, 1000, 4), {}, &crcs);
    f.commit(10100);
    Bytes got = read_file(path);
    CHECK(got.size() == 10100 && std::memcmp(got.data(), buf.data(), 100) == 0 &&
          std::memcmp(got.data() + 100, buf.data(), 10000) == 0);
  }
  g_fake_dio_offset = 0;
#endif
}

TEST_CASE("OutputFile: fixed-rate pacing holds the average rate") {
  TempDir dir;  // a disk, not /dev/shm: the write must take real time per request
  const size_t size = 64 * kMiB;
  const double rate = 128.0 * kMiB;
  AlignedBuffer buf(size, 4096);
  fill(buf.data(), 1 * kMiB, 1);
  for (size_t i = 1; i < 64; ++i) std::memcpy(buf.data() + i * kMiB, buf.data(), kMiB);
  for (const std::string& e : engines()) {
    // A shared (virtual) disk sometimes stalls for longer than the whole write: then the
    // average says nothing about the pacer, so a stalled attempt is repeated (at most twice).
    double avg = 0;
    BulkStats st;
    for (int attempt = 0; attempt < 3; ++attempt) {
      const std::string path = dir.file("paced-" + e + std::to_string(attempt));
      OutputFile f(path, size, true);
      BulkOptions o = opts(e, 512 * kKiB, 8);
      o.rate = rate;
      std::vector<uint32_t> crcs;
      st = f.write(buf.data(), size, 0, o, {}, &crcs);
      avg = static_cast<double>(st.bytes) / st.seconds;
      std::printf("  %s: %.1f MiB/s over %.3f s (target %.0f), paused %.3f s, max latency "
                  "%.1f ms\n", e.c_str(), avg / kMiB, st.seconds, rate / kMiB, st.paused,
                  st.latency.max() / 1e6);
      f.close();
      ::unlink(path.c_str());
      if (std::fabs(avg / rate - 1) < 0.05) break;
    }
    CHECK(std::fabs(avg / rate - 1) < 0.05);
    CHECK(st.paused > 0.2);
    CHECK(st.final_rate == rate);
    CHECK(!st.timeline.empty() && st.timeline.front().rate == rate);
  }
}

TEST_CASE("OutputFile: adaptive pacing under a ceiling completes and reports") {
  TempDir dir;
  const size_t size = 16 * kMiB;
  AlignedBuffer buf(size, 4096);
  fill(buf.data(), size, 2);
  for (const std::string& e : engines()) {
    const std::string path = dir.file("adaptive-" + e);
    OutputFile f(path, size, true);
    BulkOptions o = opts(e, kMiB, 4);
    o.rate = 256.0 * kMiB;  // a ceiling
    o.adaptive = true;
    o.adaptive_config.window = 0.01;
    std::vector<uint32_t> crcs;
    BulkStats st = f.write(buf.data(), size, 0, o, {0, size}, &crcs);
    CHECK(st.bytes == size);
    CHECK(st.peak > 0);
    CHECK(st.final_rate > 0 && st.final_rate <= o.rate);
    CHECK(crcs.size() == 1 && crcs[0] == crc32c(buf.data(), size));
    f.commit(size);
    CHECK(read_file(path) == Bytes(buf.data(), buf.data() + size));
  }
}

TEST_CASE("read_file_into round trips and reports a short file") {
  TempDir dir;
  for (const std::string& e : engines()) {
    for (size_t size : {size_t(0), size_t(1), size_t(4096), size_t(4097), 3 * kMiB + 17}) {
      const std::string path = dir.file("r" + std::to_string(size));
      Bytes data(size);
      fill(data.data(), size, size + 1);
      { std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data.data()),
                                                    static_cast<std::streamsize>(size)); }
      for (bool want_direct : {true, false}) {
        const size_t cap = align_up(size, 4096);
        AlignedBuffer buf(cap, 4096);
        bool direct = !want_direct;
        BulkStats st = read_file_into(path, buf.data(), size, cap, opts(e, 64 * kKiB, 4),
                                      want_direct, &direct);
        CHECK(st.bytes == size);
        CHECK(st.latency.count() == st.requests);
        CHECK(size == 0 || std::memcmp(buf.data(), data.data(), size) == 0);
        if (!want_direct) CHECK(!direct);
        // Fewer bytes than the file has: only those.
        if (size > 10) {
          st = read_file_into(path, buf.data(), size - 7, cap, opts(e, 4096, 2), want_direct,
                              &direct);
          CHECK(st.bytes == size - 7);
        }
      }
    }
    const std::string shorty = dir.file("short");
    { std::ofstream(shorty, std::ios::binary) << std::string(10000, 'x'); }
    AlignedBuffer buf(32 * kKiB, 4096);
    int64_t offset = -1;
    CHECK(io_errno([&] {
            read_file_into(shorty, buf.data(), 20000, 32 * kKiB, opts(e, 4096, 4), true, nullptr);
          }, &offset) == ENODATA);
    CHECK(offset == 10000);
    CHECK(io_errno([&] {
            read_file_into(dir.file("missing"), buf.data(), 1, 4096, opts(e, 4096, 4), true,
                           nullptr);
          }) == ENOENT);
    CHECK_THROWS(read_file_into(shorty, buf.data(), 8192, 4096, opts(e, 4096, 4), true, nullptr),
                 std::invalid_argument);
  }
}

}  // namespace

TEST_MAIN()
