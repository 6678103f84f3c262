// Unit tests for the write path of both engines and for the device probe, on small files in a
// temporary directory under /tmp (ext4 here: O_DIRECT) and /dev/shm (tmpfs).
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/aligned.hpp"
#include "common/errors.hpp"
#include "io/engine.hpp"
#include "probe/probe.hpp"
#include "tests/check.hpp"
#include "tests/temp_dir.hpp"

using namespace flashstream;
using Bytes = std::vector<uint8_t>;

namespace {

constexpr uint64_t kKiB = 1024, kMiB = 1024 * 1024;

using fstest::TempDir;

std::vector<std::string> engines() {
  std::vector<std::string> v{"threads"};
  if (uring_available()) v.push_back("uring");
  else std::printf("  (io_uring unavailable here: testing the thread engine only)\n");
  return v;
}

Bytes read_file(const std::string& path) {
  Bytes d(static_cast<size_t>(std::filesystem::file_size(path)));
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  size_t got = 0;
  while (fd >= 0 && got < d.size()) {
    ssize_t n = ::pread(fd, d.data() + got, d.size() - got, static_cast<off_t>(got));
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (fd >= 0) ::close(fd);
  CHECK(got == d.size());
  return d;
}

void write_zeros(const std::string& path, uint64_t size) {
  Bytes zeros(static_cast<size_t>(size));
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  CHECK(fd >= 0 && ::write(fd, zeros.data(), zeros.size()) == ssize_t(size));
  ::close(fd);
}

// The (sequence, offset) stamp the probe writes at the start of every 4 KiB of a block.
uint64_t stamped_offset(const Bytes& d, uint64_t pos) {
  uint64_t v[2];
  std::memcpy(v, d.data() + pos, sizeof v);
  return v[1];
}

ProbeSpec spec_for(const std::string& path, ProbeOp op, size_t bs, unsigned qd,
                   const std::string& engine) {
  ProbeSpec s;
  s.path = path;
  s.op = op;
  s.block_size = bs;
  s.queue_depth = qd;
  s.engine = engine;
  return s;
}

int io_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const IoError& e) {
    return e.error_code();
  }
  return 0;
}

}  // namespace

TEST_CASE("engines: concurrent writes (buffered and O_DIRECT), mixed with reads, errors") {
  TempDir dir;
  for (const auto& kind : engines())
    for (int flags : {0, O_DIRECT}) {
      const std::string p = dir.file("w" + kind + std::to_string(flags));
      write_zeros(p, 64 * kKiB);
      int fd = ::open(p.c_str(), O_RDWR | O_CLOEXEC | flags);
      CHECK(fd >= 0);
      auto eng = make_engine(kind, 8);
      std::vector<AlignedBuffer> bufs;
      for (int i = 0; i < 8; ++i) {
        bufs.emplace_back(8 * kKiB, 4096);
        std::memset(bufs[i].data(), 'a' + i, 8 * kKiB);
      }
      // 6 writes (one past the old end: the file grows) and 2 reads in flight together.
      for (int i = 0; i < 6; ++i) eng->submit_write(fd, bufs[i].data(), 8 * kKiB, i * 16 * kKiB, i);
      eng->submit_read(fd, bufs[6].data(), 8 * kKiB, 8 * kKiB, 6);
      eng->submit_read(fd, bufs[7].data(), 8 * kKiB, 56 * kKiB, 7);
      IoCompletion done[8];
      size_t n = 0;
      while (n < 8) n += eng->reap(done + n, 8 - n, 1);
      for (auto& c : done) CHECK(c.result == int64_t(8 * kKiB));
      Bytes d = read_file(p);
      CHECK(d.size() == 88 * kKiB);
      for (int i = 0; i < 6; ++i) {
        CHECK(d[i * 16 * kKiB] == 'a' + i && d[i * 16 * kKiB + 8 * kKiB - 1] == 'a' + i);
        CHECK(i == 5 || d[i * 16 * kKiB + 8 * kKiB] == 0);
      }
      ::close(fd);
      int ro = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
      eng->submit_write(ro, bufs[0].data(), 10, 0, 40);
      eng->submit_write(-1, bufs[0].data(), 10, 0, 41);
      n = 0;
      while (n < 2) n += eng->reap(done + n, 2 - n, 1);
      CHECK(done[0].result == -EBADF && done[1].result == -EBADF);
      ::close(ro);
    }
}

// With single_thread, io_uring posts completions only when the thread enters the kernel
// (COOP/DEFER_TASKRUN): a non-blocking reap must still find them.
TEST_CASE("engines: single-thread mode, non-blocking reaps see completions") {
  TempDir dir;
  const std::string p = dir.file("st");
  write_zeros(p, 64 * kKiB);
  int fd = ::open(p.c_str(), O_RDWR | O_CLOEXEC | O_DIRECT);
  CHECK(fd >= 0);
  for (const auto& kind : engines()) {
    auto eng = make_engine(kind, 4, /*single_thread=*/true);
    AlignedBuffer buf(8 * kKiB, 4096);
    std::memset(buf.data(), 'z', 8 * kKiB);
    for (int round = 0; round < 50; ++round) {
      if (round % 2) eng->submit_read(fd, buf.data(), 8 * kKiB, 8 * kKiB, round);
      else eng->submit_write(fd, buf.data(), 8 * kKiB, 8 * kKiB, round);
      IoCompletion c{};
      size_t n = 0;
      for (int spin = 0; n == 0 && spin < 200000; ++spin) {
        n = eng->reap(&c, 1, 0);
        if (n == 0) usleep(10);
      }
      CHECK(n == 1 && c.tag == uint64_t(round) && c.result == int64_t(8 * kKiB));
    }
  }
  ::close(fd);
}

TEST_CASE("probe: parse op and pattern; invalid specs fail before any I/O") {
  CHECK(parse_probe_op("read") == ProbeOp::kRead && parse_probe_op("write") == ProbeOp::kWrite);
  CHECK(parse_probe_pattern("random") == ProbePattern::kRandom);
  bool listed = false;
  try {
    parse_probe_pattern("seq");
  } catch (const std::invalid_argument& e) {
    listed = std::string(e.what()).find("sequential, random") != std::string::npos;
  }
  CHECK(listed);
  CHECK_THROWS(parse_probe_op("trim"), std::invalid_argument);

  TempDir dir;
  const std::string p = dir.file("f");
  write_zeros(p, 1 * kMiB);
  auto bad = [&](const std::function<void(ProbeSpec&)>& edit) {
    ProbeSpec s = spec_for(p, ProbeOp::kRead, 64 * kKiB, 4, "auto");
    edit(s);
    CHECK_THROWS(run_probe(s), std::invalid_argument);
  };
  bad([](ProbeSpec& s) { s.queue_depth = 0; });
  bad([](ProbeSpec& s) { s.block_size = 0; });
  bad([](ProbeSpec& s) { s.block_size = 1000; });  // not a multiple of the alignment
  bad([](ProbeSpec& s) { s.block_size = 2 * kMiB; });  // larger than the file
  bad([](ProbeSpec& s) { s.interval = 0.0001; });
  bad([](ProbeSpec& s) { s.duration = -1; });
  bad([](ProbeSpec& s) { s.engine = "bogus"; });
  bad([](ProbeSpec& s) { s.stop_below = -1; });
  bad([](ProbeSpec& s) { s.stop_smooth = -1; });
  bad([](ProbeSpec& s) { s.stop_below = 1e6; });  // no timeline to judge it by
  bad([](ProbeSpec& s) { s.stop_below = 1e6, s.interval = 0.01, s.stop_after = 0.001; });
  ProbeSpec s = spec_for(dir.file("missing"), ProbeOp::kRead, 4096, 1, "auto");
  CHECK(io_error_of([&] { run_probe(s); }) == ENOENT);
  s.path = dir.path;
  CHECK(io_error_of([&] { run_probe(s); }) == EISDIR);
}

TEST_CASE("create_probe_file: sizes, no holes, no repeated 4 KiB blocks, resize, errors") {
  TempDir dir;
  for (uint64_t size : std::vector<uint64_t>{0, 1, 4095, 4096, 4097, 3 * kMiB + 17, 9 * kMiB}) {
    const std::string p = dir.file("c" + std::to_string(size));
    create_probe_file(p, size);
    Bytes d = read_file(p);
    CHECK(d.size() == size);
    std::set<std::string> blocks;
    size_t zero_blocks = 0;
    for (uint64_t off = 0; off < size; off += 4096) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(4096, size - off));
      std::string b(reinterpret_cast<const char*>(d.data() + off), len);
      zero_blocks += b.find_first_not_of('\0') == std::string::npos;
      blocks.insert(std::move(b));
    }
    CHECK(zero_blocks == 0 || size == 1);  // one random byte may be 0
    CHECK(blocks.size() == (size + 4095) / 4096);
  }
  const std::string p = dir.file("resize");
  create_probe_file(p, 2 * kMiB);
  create_probe_file(p, 1 * kMiB);
  CHECK(std::filesystem::file_size(p) == 1 * kMiB);
  CHECK(io_error_of([&] { create_probe_file(dir.file("no/such/dir"), 4096); }) == ENOENT);
  CHECK(io_error_of([&] { create_probe_file(dir.path, 4096); }) == EISDIR);
}

TEST_CASE("probe: sequential reads, both engines, bytes wrap around the file") {
  TempDir dir;
  const std::string p = dir.file("r");
  create_probe_file(p, 4 * kMiB);
  for (const auto& kind : engines()) {
    ProbeSpec s = spec_for(p, ProbeOp::kRead, 64 * kKiB, 4, kind);
    ProbeResult r = run_probe(s);
    CHECK(r.bytes == 4 * kMiB && r.requests == 64 && r.latency.count() == 64);
    CHECK(r.engine == kind && r.direct && r.seconds > 0 && r.sync_seconds == 0);
    CHECK(r.latency.min() > 0 && r.latency.max() < uint64_t(r.seconds * 1e9) + 1);
    CHECK(r.timeline.empty());
    s.bytes = 10 * kMiB + 1;  // rounded up to whole blocks, wrapping around the file twice
    s.pattern = ProbePattern::kRandom;
    r = run_probe(s);
    CHECK(r.bytes == 10 * kMiB + 64 * kKiB && r.requests == 161);
  }
}

TEST_CASE("probe: stop_below ends a run whose throughput stays below it") {
  TempDir dir;
  const std::string p = dir.file("s");
  create_probe_file(p, 4 * kMiB);
  for (const auto& kind : engines()) {
    ProbeSpec s = spec_for(p, ProbeOp::kRead, 64 * kKiB, 2, kind);
    s.bytes = uint64_t(1) << 40;  // far more than it can read in the time the rule allows
    s.interval = 0.005;
    s.stop_after = 0.05;
    s.stop_below = 1e15;  // unreachable: stop_after from the start, never at it
    s.stop_smooth = 0.02;
    const ProbeResult r = run_probe(s);
    CHECK(r.bytes < s.bytes);
    CHECK(r.seconds >= 0.05);
    CHECK(r.seconds < 5.0);
    CHECK(r.timeline.size() >= 10);
    s.bytes = 4 * kMiB;
    s.stop_below = 1.0;  // always above: the run reads what it was asked to
    CHECK(run_probe(s).bytes == 4 * kMiB);
  }
}

TEST_CASE("probe: cancel set from another thread ends a run") {
  TempDir dir;
  const std::string p = dir.file("c");
  create_probe_file(p, 4 * kMiB);
  for (const auto& kind : engines()) {
    ProbeSpec s = spec_for(p, ProbeOp::kRead, 64 * kKiB, 2, kind);
    s.bytes = uint64_t(1) << 40;  // far more than it reads before the cancel
    std::atomic<bool> cancel{false};
    s.cancel = &cancel;
    std::thread setter([&cancel] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      cancel.store(true);
    });
    const ProbeResult r = run_probe(s);
    setter.join();
    CHECK(r.bytes < s.bytes);
    CHECK(r.bytes > 0);
    CHECK(r.seconds < 5.0);
    std::atomic<bool> set_before{true};  // set before it starts: the first requests only
    s.cancel = &set_before;
    CHECK(run_probe(s).requests <= 2);
  }
}

TEST_CASE("probe: writes stay within the file, aligned, without truncating it") {
  TempDir dir;
  const std::string p = dir.file("w");
  const uint64_t size = 1 * kMiB + 100;  // a partial last block the probe must not touch
  for (const auto& kind : engines())
    for (auto pattern : {ProbePattern::kSequential, ProbePattern::kRandom}) {
      write_zeros(p, size);
      ProbeSpec s = spec_for(p, ProbeOp::kWrite, 8 * kKiB, 8, kind);
      s.pattern = pattern;
      s.bytes = 2 * kMiB;  // sequential: twice over the file's 128 whole blocks
      s.seed = 99;
      ProbeResult r = run_probe(s);
      CHECK(r.bytes == 2 * kMiB && r.requests == 256 && r.direct && r.sync_seconds >= 0);
      Bytes d = read_file(p);
      CHECK(d.size() == size);
      size_t written = 0;
      for (uint64_t off = 0; off + 8 * kKiB <= size; off += 8 * kKiB) {
        const bool touched = std::any_of(d.begin() + off, d.begin() + off + 8 * kKiB,
                                         [](uint8_t b) { return b != 0; });
        if (!touched) continue;
        ++written;
        CHECK(stamped_offset(d, off) == off && stamped_offset(d, off + 4096) == off);
      }
      CHECK(std::all_of(d.end() - 100, d.end(), [](uint8_t b) { return b == 0; }));
      if (pattern == ProbePattern::kSequential) CHECK(written == 128);
      else CHECK(written > 64);  // 256 uniform picks of 128 blocks cover ~112
    }
}

TEST_CASE("probe: duration limit and timeline") {
  TempDir dir;
  const std::string p = dir.file("t");
  create_probe_file(p, 4 * kMiB);
  for (const auto& kind : engines()) {
    ProbeSpec s = spec_for(p, ProbeOp::kRead, 64 * kKiB, 8, kind);
    s.bytes = uint64_t(1) << 40;  // the time limit ends it
    s.duration = 0.3;
    s.interval = 0.05;
    ProbeResult r = run_probe(s);
    CHECK(r.seconds >= 0.3 && r.seconds < 3);
    CHECK(r.bytes > 0 && r.bytes % (64 * kKiB) == 0);
    CHECK(r.timeline.size() >= 6 && r.timeline.size() <= 60);
    uint64_t sum = 0;
    double prev = 0;
    for (const auto& pt : r.timeline) {
      CHECK(pt.seconds > prev);
      prev = pt.seconds;
      sum += pt.bytes;
    }
    CHECK(sum == r.bytes);
    CHECK(std::abs(r.timeline[0].seconds - 0.05) < 1e-6);
  }
}

TEST_CASE("probe: tmpfs file under /dev/shm") {
  if (access("/dev/shm", W_OK) != 0) return;
  TempDir dir("/dev/shm");
  const std::string p = dir.file("s");
  create_probe_file(p, 1 * kMiB);
  for (const auto& kind : engines())
    for (auto op : {ProbeOp::kRead, ProbeOp::kWrite}) {
      ProbeResult r = run_probe(spec_for(p, op, 64 * kKiB, 4, kind));
      CHECK(r.bytes == 1 * kMiB);  // O_DIRECT since Linux 6.6, buffered fallback before
    }
}

// A write past RLIMIT_FSIZE fails with EFBIG while other writes are in flight: the same path as
// ENOSPC on a full drive, which cannot be staged here.
TEST_CASE("probe: a write error mid-run is an IoError after the queue drains") {
  TempDir dir;
  const std::string p = dir.file("big");
  create_probe_file(p, 4 * kMiB);
  struct sigaction ign = {}, old = {};
  ign.sa_handler = SIG_IGN;
  sigaction(SIGXFSZ, &ign, &old);  // else the kernel's SIGXFSZ would kill the test
  struct rlimit saved;
  getrlimit(RLIMIT_FSIZE, &saved);
  struct rlimit lim = saved;
  lim.rlim_cur = 2 * kMiB;
  setrlimit(RLIMIT_FSIZE, &lim);
  for (const auto& kind : engines()) {
    ProbeSpec s = spec_for(p, ProbeOp::kWrite, 64 * kKiB, 8, kind);
    int err = 0;
    int64_t offset = -1;
    try {
      run_probe(s);
    } catch (const IoError& e) {
      err = e.error_code();
      offset = e.offset();
      CHECK(e.op() == "write" && e.path() == p);
    }
    CHECK(err == EFBIG && offset >= int64_t(2 * kMiB));
  }
  const std::string fresh = dir.file("fresh");
  CHECK(io_error_of([&] { create_probe_file(fresh, 8 * kMiB); }) == EFBIG);
  CHECK(access(fresh.c_str(), F_OK) != 0);  // the half-made file was removed
  setrlimit(RLIMIT_FSIZE, &saved);
  sigaction(SIGXFSZ, &old, nullptr);
}

TEST_MAIN()
