// Unit tests for the I/O core: engines, InputFile and SequentialReader, run against real files
// in a temporary directory under /tmp (O_DIRECT capable on ext4/xfs) and /dev/shm (tmpfs).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/aligned.hpp"
#include "common/errors.hpp"
#include "common/owner_process.hpp"
#include "io/buffer_cache.hpp"
#include "io/engine.hpp"
#include "io/file.hpp"
#include "io/sequential_reader.hpp"
#include "tests/check.hpp"
#include "tests/temp_dir.hpp"

using namespace flashstream;
using Bytes = std::vector<uint8_t>;

#include "tests/fake_statx.hpp"  // g_fake_dio_offset

namespace {

constexpr size_t kMiB = 1 << 20;
const size_t kSizes[] = {0, 1, 511, 512, 513, 4095, 4096, 4097, 3 * kMiB + 17};

using fstest::TempDir;

Bytes make_data(size_t n, uint32_t seed) {
  Bytes v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    b = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

void write_file(const std::string& path, const Bytes& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

Bytes slice(const Bytes& d, uint64_t start, uint64_t end) {
  end = std::min<uint64_t>(end, d.size());
  if (start >= end) return {};
  return Bytes(d.begin() + static_cast<long>(start), d.begin() + static_cast<long>(end));
}

std::vector<std::string> engines() {
  std::vector<std::string> v{"threads"};
  if (uring_available()) v.push_back("uring");
  else std::printf("  (io_uring unavailable here: testing the thread engine only)\n");
  return v;
}

bool on_fs_with_direct_io(const std::string& path) {
  struct statfs s;
  return statfs(path.c_str(), &s) == 0 && (s.f_type == 0xEF53 /* ext4 */ || s.f_type == 0x58465342 /* xfs */);
}

size_t open_fds() {
  size_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

// Reads everything, checking chunk invariants; returns the bytes per extent.
std::vector<Bytes> read_all(SequentialReader& r, const std::vector<Extent>& ex) {
  std::vector<Bytes> got(ex.size());
  std::vector<bool> seen(ex.size()), finished(ex.size());
  uint64_t expect_offset = 0;
  int64_t prev = -1;
  Chunk c;
  while (r.next(c)) {
    CHECK(c.extent < ex.size());
    if (c.extent >= ex.size()) break;
    CHECK(static_cast<int64_t>(c.extent) >= prev);
    if (c.first) {
      CHECK(!seen[c.extent]);
      CHECK(prev < 0 || finished[prev]);
      seen[c.extent] = true;
      expect_offset = ex[c.extent].start;
    }
    CHECK(seen[c.extent] && !finished[c.extent]);
    CHECK(c.offset == expect_offset);
    CHECK(c.size > 0 || (c.first && c.last));
    got[c.extent].insert(got[c.extent].end(), c.data, c.data + c.size);
    expect_offset += c.size;
    if (c.last) finished[c.extent] = true;
    prev = c.extent;
  }
  for (size_t i = 0; i < ex.size(); ++i) CHECK(finished[i]);
  return got;
}

struct Files {
  TempDir dir;
  std::vector<std::string> paths;
  std::vector<Bytes> data;
  explicit Files(const std::string& base = "/tmp") : dir(base) {
    uint32_t seed = 1;
    for (size_t n : kSizes) {
      paths.push_back(dir.file("f" + std::to_string(n)));
      data.push_back(make_data(n, seed++));
      write_file(paths.back(), data.back());
    }
  }
};

ReaderOptions opts(const std::string& engine, size_t chunk, unsigned depth) {
  ReaderOptions o;
  o.engine = engine;
  o.chunk_size = chunk;
  o.queue_depth = depth;
  return o;
}

}  // namespace

TEST_CASE("IoError message names op, errno text, path and offset") {
  IoError e(ENOENT, "read", "/path", 123);
  CHECK(std::string(e.what()) == "read failed: No such file or directory: '/path' at offset 123");
  CHECK(e.error_code() == ENOENT && e.op() == "read" && e.path() == "/path" && e.offset() == 123);
  CHECK(std::string(IoError(EACCES, "open", "/x", -1).what()) ==
        "open failed: Permission denied: '/x'");
  CHECK(std::string(IoError(EPERM, "io_uring_setup", "", -1).what()) ==
        "io_uring_setup failed: Operation not permitted");
  CHECK_THROWS(throw_io_error(EIO, "read", "/y", 7), IoError);
}

TEST_CASE("make_engine validates the kind") {
  bool thrown = false;
  try {
    make_engine("bogus", 4);
  } catch (const std::invalid_argument& e) {
    thrown = std::string(e.what()).find("auto, uring, threads") != std::string::npos;
  }
  CHECK(thrown);
  CHECK(std::string(make_engine("threads", 4)->name()) == "threads");
  CHECK(std::string(make_engine("auto", 4)->name()) == (uring_available() ? "uring" : "threads"));
  if (!uring_available()) CHECK_THROWS(make_engine("uring", 4), IoError);
}

TEST_CASE("engines: concurrent reads, short reads, EOF and errors") {
  TempDir dir;
  Bytes data = make_data(64 * 1024 + 100, 7);
  write_file(dir.file("e"), data);
  int fd = ::open(dir.file("e").c_str(), O_RDONLY | O_CLOEXEC);
  CHECK(fd >= 0);
  for (const auto& kind : engines()) {
    auto eng = make_engine(kind, 8);
    CHECK(eng->depth() == 8);
    IoCompletion none[4];
    CHECK(eng->reap(none, 4, 0) == 0);
    std::vector<AlignedBuffer> bufs;
    for (int i = 0; i < 8; ++i) bufs.emplace_back(8192, 4096);
    // 8 outstanding at once: 6 full reads, one short read at EOF, one past EOF.
    for (int i = 0; i < 6; ++i) eng->submit_read(fd, bufs[i].data(), 8192, i * 8192 + 3, i);
    eng->submit_read(fd, bufs[6].data(), 8192, data.size() - 50, 6);
    eng->submit_read(fd, bufs[7].data(), 8192, data.size() + 4096, 7);
    IoCompletion done[8];
    size_t n = 0;
    while (n < 8) n += eng->reap(done + n, 8 - n, 1);
    bool seen[8] = {};
    for (auto& c : done) {
      CHECK(c.tag < 8 && !seen[c.tag]);
      seen[c.tag] = true;
      int64_t want = c.tag < 6 ? 8192 : c.tag == 6 ? 50 : 0;
      CHECK(c.result == want);
      if (c.tag < 7)
        CHECK(std::memcmp(bufs[c.tag].data(), data.data() + (c.tag < 6 ? c.tag * 8192 + 3 : data.size() - 50), want) == 0);
    }
    eng->submit_read(-1, bufs[0].data(), 10, 0, 42);
    CHECK(eng->reap(done, 8, 1) == 1);
    CHECK(done[0].tag == 42 && done[0].result == -EBADF);
  }
  ::close(fd);
}

TEST_CASE("InputFile: O_DIRECT, alignment, size, errors, fallback") {
  TempDir dir;
  Bytes data = make_data(10000, 3);
  write_file(dir.file("a"), data);
  InputFile f(dir.file("a"), true);
  CHECK(f.size() == 10000);
  if (on_fs_with_direct_io(dir.path)) CHECK(f.direct());
  const DioAlignment& a = f.alignment();
  CHECK(a.offset >= 1 && a.memory >= 512 && a.memory >= a.offset);
  CHECK((a.memory & (a.memory - 1)) == 0);
  const int fd = f.fd();
  f.fall_back_to_buffered();
  CHECK(!f.direct() && f.fd() == fd);
  char buf[7];
  CHECK(::pread(f.fd(), buf, 7, 3) == 7 && std::memcmp(buf, data.data() + 3, 7) == 0);
  InputFile b(dir.file("a"), false);
  CHECK(!b.direct() && b.size() == 10000);

  auto err_of = [](const std::string& p) {
    try {
      InputFile x(p, true);
    } catch (const IoError& e) {
      return e.error_code();
    }
    return 0;
  };
  CHECK(err_of(dir.file("missing")) == ENOENT);
  CHECK(err_of(dir.path) == EISDIR);
}

TEST_CASE("reader: all sizes, chunk sizes, depths, both engines") {
  Files fs;
  std::vector<Extent> ex;
  for (auto& p : fs.paths) ex.push_back({p, 0, kToEnd});
  for (const auto& kind : engines())
    for (size_t chunk : {size_t(4096), size_t(8192), size_t(5000)})
      for (unsigned depth : {1u, 8u}) {
        SequentialReader r(ex, opts(kind, chunk, depth));
        CHECK(std::string(r.engine_name()) == kind);
        auto got = read_all(r, ex);
        for (size_t i = 0; i < ex.size(); ++i) CHECK(got[i] == fs.data[i]);
        const ReaderStats& s = r.stats();
        if (on_fs_with_direct_io(fs.dir.path)) CHECK(s.direct_files == ex.size() && s.buffered_files == 0);
        CHECK(s.bytes_read >= 3 * kMiB + 17 && s.short_reads == 0);
        CHECK(s.requests >= (3 * kMiB) / align_up(chunk, 4096));
        Chunk c;
        CHECK(!r.next(c));  // stays at the end
      }
}

TEST_CASE("reader: unaligned sub-ranges and empty ranges") {
  Files fs;
  const std::string& big = fs.paths.back();
  const Bytes& d = fs.data.back();
  const uint64_t n = d.size();
  std::vector<Extent> ex = {
      {big, 1, 2},          {big, 511, 513},     {big, 4095, 4097},   {big, 100000, 2000000},
      {big, 3 * kMiB, kToEnd}, {big, 5, 5},      {big, n + 10, kToEnd}, {big, n - 1, n + 1000},
      {fs.paths[0], 0, 10}, {big, 7, 3},         {fs.paths[4], 512, 513}, {big, 0, 4096 * 3 + 1},
  };
  for (const auto& kind : engines())
    for (unsigned depth : {1u, 3u, 8u}) {
      SequentialReader r(ex, opts(kind, 4096, depth));
      auto got = read_all(r, ex);
      for (size_t i = 0; i < ex.size(); ++i) {
        const Bytes& src = ex[i].path == big ? d : ex[i].path == fs.paths[0] ? fs.data[0] : fs.data[4];
        CHECK(got[i] == slice(src, ex[i].start, ex[i].end));
      }
    }
}

TEST_CASE("reader: open errors raised at their turn; skip_extent continues") {
  Files fs;
  const std::string missing = fs.dir.file("no-such-file");
  std::vector<Extent> ex = {{fs.paths.back()}, {missing}, {fs.paths[7]}, {fs.dir.path}, {fs.paths[1]}};
  for (const auto& kind : engines())
    for (unsigned depth : {1u, 8u}) {
      SequentialReader r(ex, opts(kind, 4096, depth));
      Bytes first;
      Chunk c;
      int err = 0;
      std::string err_path;
      try {
        while (r.next(c)) {
          CHECK(c.extent == 0);
          first.insert(first.end(), c.data, c.data + c.size);
        }
      } catch (const IoError& e) {
        err = e.error_code();
        err_path = e.path();
      }
      CHECK(err == ENOENT && err_path == missing);
      CHECK(first == fs.data.back());  // every chunk of the earlier extent came first
      CHECK_THROWS(r.next(c), IoError);  // sticky until skipped
      r.skip_extent();
      Bytes third;
      err = 0;
      try {
        while (r.next(c)) {
          CHECK(c.extent == 2);
          third.insert(third.end(), c.data, c.data + c.size);
        }
      } catch (const IoError& e) {
        err = e.error_code();
      }
      CHECK(err == EISDIR);
      CHECK(third == fs.data[7]);
      r.skip_extent();
      CHECK(r.next(c) && c.extent == 4 && c.size == 1 && c.first && c.last && c.data[0] == fs.data[1][0]);
      CHECK(!r.next(c));
    }
}

TEST_CASE("reader: skip_extent drops the rest of the current extent") {
  Files fs;
  std::vector<Extent> ex = {{fs.paths.back()}, {fs.paths[7]}, {fs.paths.back(), 10, 20000}};
  for (const auto& kind : engines())
    for (unsigned depth : {1u, 8u}) {
      SequentialReader r(ex, opts(kind, 4096, depth));
      r.skip_extent();  // nothing delivered yet: no-op
      Chunk c;
      CHECK(r.next(c) && c.extent == 0 && c.first && !c.last);
      r.skip_extent();
      r.skip_extent();  // twice is harmless
      CHECK(r.next(c) && c.extent == 1 && c.first && c.size == 4096);
      CHECK(std::memcmp(c.data, fs.data[7].data(), 4096) == 0);
      CHECK(r.next(c) && c.extent == 1 && c.last && c.size == 1);
      r.skip_extent();  // after the last chunk: the next extent is untouched
      Bytes third;
      while (r.next(c)) third.insert(third.end(), c.data, c.data + c.size);
      CHECK(third == slice(fs.data.back(), 10, 20000));
    }
}

TEST_CASE("reader: tmpfs file under /dev/shm") {
  if (access("/dev/shm", W_OK) != 0) return;
  Files fs("/dev/shm");
  std::vector<Extent> ex;
  for (auto& p : fs.paths) ex.push_back({p, 3, kToEnd});
  for (const auto& kind : engines()) {
    SequentialReader r(ex, opts(kind, 8192, 4));
    auto got = read_all(r, ex);
    for (size_t i = 0; i < ex.size(); ++i) CHECK(got[i] == slice(fs.data[i], 3, kToEnd));
    // tmpfs refuses O_DIRECT before Linux 6.6 (buffered fallback) and accepts it since.
    CHECK(r.stats().direct_files + r.stats().buffered_files == ex.size());
  }
}

TEST_CASE("reader: file refusing O_DIRECT with a size larger than its content (sysfs)") {
  const std::string p = "/sys/devices/system/cpu/online";
  std::ifstream in(p, std::ios::binary);
  if (!in) return;
  Bytes want((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& kind : engines()) {
    std::vector<Extent> ex = {{p}, {p, 1, kToEnd}};
    SequentialReader r(ex, opts(kind, 4096, 4));
    auto got = read_all(r, ex);
    CHECK(got[0] == want && got[1] == slice(want, 1, kToEnd));
    CHECK(r.stats().buffered_files == 2 && r.stats().short_reads == 2);
  }
}

#ifdef STATX_DIOALIGN
TEST_CASE("reader: EINVAL from an O_DIRECT read falls back to buffered") {
  Files fs;
  if (!on_fs_with_direct_io(fs.dir.path)) return;
  std::vector<Extent> ex = {{fs.paths.back(), 300, 100000}, {fs.paths[8], 1, 9000}};
  for (const auto& kind : engines()) {
    g_fake_dio_offset = 1;  // requests will start at unaligned offsets
    SequentialReader r(ex, opts(kind, 4096, 8));
    auto got = read_all(r, ex);
    g_fake_dio_offset = 0;
    CHECK(got[0] == slice(fs.data.back(), 300, 100000));
    CHECK(got[1] == slice(fs.data[8], 1, 9000));
    CHECK(r.stats().direct_files == 2 && r.stats().buffered_files == 2);
  }
}
#endif

TEST_CASE("reader: a file shrinking while read ends its extent early") {
  TempDir dir;
  const Bytes data = make_data(3 * kMiB, 11);
  const std::pair<size_t, uint64_t> cases[] = {{4096, 10000}, {4096, 8192}, {16384, 20480}, {16384, 30000}};
  for (const auto& kind : engines())
    for (const auto& [chunk, cut] : cases) {
      const std::string p = dir.file("shrink");
      write_file(p, data);
      std::vector<Extent> ex = {{p}, {p, 0, 5}};
      // Depth 1: only [0, chunk) can be read before the cut, and it lies below the cut.
      SequentialReader r(ex, opts(kind, chunk, 1));
      CHECK(truncate(p.c_str(), static_cast<off_t>(cut)) == 0);
      Bytes got;
      Chunk c;
      bool last = false;
      while (!last && r.next(c)) {
        CHECK(c.extent == 0);
        got.insert(got.end(), c.data, c.data + c.size);
        last = c.last;
      }
      CHECK(last && got == slice(data, 0, cut));
      CHECK(r.next(c) && c.extent == 1 && c.size == 5);
      CHECK(!r.next(c));
      if (cut % chunk) CHECK(r.stats().short_reads >= 1);
    }
}

// A handler installed without SA_RESTART makes blocking syscalls fail with EINTR.
static void on_alarm(int) {}

TEST_CASE("reader: EINTR from a signal storm is retried") {
  Files fs;
  std::vector<Extent> ex;
  for (auto& p : fs.paths) ex.push_back({p, 1, kToEnd});
  struct sigaction sa = {}, old = {};
  sa.sa_handler = on_alarm;
  sigaction(SIGALRM, &sa, &old);
  struct itimerval it = {{0, 200}, {0, 200}}, off = {};
  setitimer(ITIMER_REAL, &it, nullptr);
  for (const auto& kind : engines())
    for (int round = 0; round < 5; ++round) {
      SequentialReader r(ex, opts(kind, 4096, 8));
      auto got = read_all(r, ex);
      for (size_t i = 0; i < ex.size(); ++i) CHECK(got[i] == slice(fs.data[i], 1, kToEnd));
    }
  setitimer(ITIMER_REAL, &off, nullptr);
  sigaction(SIGALRM, &old, nullptr);
}

TEST_CASE("reader: buffered mode and degenerate options") {
  Files fs;
  std::vector<Extent> ex;
  for (auto& p : fs.paths) ex.push_back({p, 2, kToEnd});
  for (const auto& kind : engines()) {
    ReaderOptions o = opts(kind, 0, 0);  // chunk and depth are raised to their minimum
    o.direct = false;
    SequentialReader r(ex, o);
    auto got = read_all(r, ex);
    for (size_t i = 0; i < ex.size(); ++i) CHECK(got[i] == slice(fs.data[i], 2, kToEnd));
    CHECK(r.stats().direct_files == 0 && r.stats().buffered_files == 0);
  }
  SequentialReader empty({}, ReaderOptions());
  Chunk c;
  CHECK(!empty.next(c));
  empty.skip_extent();
  CHECK(!empty.next(c));
}

TEST_CASE("reader: many extents keep few files open") {
  Files fs;
  std::vector<Extent> ex;
  for (int i = 0; i < 300; ++i) ex.push_back({fs.paths[i % fs.paths.size()], 0, kToEnd});
  for (const auto& kind : engines()) {
    const size_t before = open_fds();
    SequentialReader r(ex, opts(kind, 4096, 4));
    size_t most = 0, total = 0;
    Chunk c;
    while (r.next(c)) {
      most = std::max(most, open_fds());
      total += c.size;
    }
    size_t want = 0;
    for (int i = 0; i < 300; ++i) want += fs.data[i % fs.data.size()].size();
    CHECK(total == want);
    CHECK(most <= before + 4 + 2 + 2);  // queue_depth + held + engine fds
  }
}

TEST_CASE("reader: destroyed with reads in flight") {
  Files fs;
  std::vector<Extent> ex = {{fs.paths.back()}, {fs.paths.back()}};
  for (const auto& kind : engines()) {
    { SequentialReader r(ex, opts(kind, 4096, 16)); }
    SequentialReader r(ex, opts(kind, 4096, 16));
    Chunk c;
    CHECK(r.next(c) && c.size == 4096);
  }
}

// A fork() child gets a copy of the reader but not its threads, and shares its io_uring: it
// must refuse use and tidy nothing up (a join would crash, a drain would eat the parent's
// completions and hang it), while the parent reads on undisturbed.
TEST_CASE("reader: a fork() child is refused and leaks; the parent reads on") {
  Files fs;
  const Bytes& want = fs.data.back();
  for (const auto& kind : engines()) {
    auto r = std::make_unique<SequentialReader>(std::vector<Extent>{{fs.paths.back()}},
                                                opts(kind, 65536, 16));
    Chunk c;
    CHECK(r->next(c));
    Bytes got(c.data, c.data + c.size);  // the next requests are now in flight
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        r->next(c);
        code = 2;
      } catch (const ForkedError&) {
      }
      r->close();
      r.reset();
      _exit(code);  // no atexit handlers: the leak is intended
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    while (r->next(c)) got.insert(got.end(), c.data, c.data + c.size);
    CHECK(got == want);
  }
}

TEST_CASE("reader: close() waits, keeps the buffers, and refuses further use") {
  Files fs;
  for (const auto& kind : engines()) {
    SequentialReader r({{fs.paths.back()}}, opts(kind, 65536, 16));
    Chunk c;
    CHECK(r.next(c));
    const uint8_t* data = c.data;
    const Bytes first(c.data, c.data + c.size);
    r.close();
    r.close();
    CHECK(r.closed());
    CHECK(Bytes(data, data + first.size()) == first);  // still this reader's memory
    bool refused = false;
    try {
      r.next(c);
    } catch (const std::logic_error&) {
      refused = true;
    }
    CHECK(refused);
    CHECK(std::string(r.engine_name()) == kind);
  }
}

// A reader per epoch must not fault in and unmap a fresh buffer pool every time.
TEST_CASE("buffer cache: a destroyed reader's buffers serve the next reader") {
  Files fs;
  const size_t chunk = 3 * 65536;  // a size no other test reads with: no stale entries
  for (const auto& kind : engines()) {
    std::set<const uint8_t*> first;
    {
      SequentialReader r({{fs.paths.back()}}, opts(kind, chunk, 4));
      Chunk c;
      while (r.next(c)) first.insert(c.data);
    }
    CHECK(first.size() == 5);  // depth + the chunk held: the file is 3 MiB and change
    size_t reused = 0;
    Bytes got;
    SequentialReader r({{fs.paths.back()}}, opts(kind, chunk, 4));
    Chunk c;
    while (r.next(c)) {
      reused += first.count(c.data);
      got.insert(got.end(), c.data, c.data + c.size);
    }
    CHECK(reused == r.stats().requests);
    CHECK(got == fs.data.back());
  }
}

TEST_CASE("buffer cache: sizes and alignment match, bytes bounded, a fork() child starts empty") {
  AlignedBuffer a = BufferCache::take(12288, 4096);
  const uint8_t* where = a.data();
  BufferCache::give(std::move(a));
  CHECK(a.data() == nullptr);
  AlignedBuffer other = BufferCache::take(8192, 4096);  // another size: a new buffer
  CHECK(other.data() != where && other.size() == 8192);
  AlignedBuffer same = BufferCache::take(12288, 4096);
  CHECK(same.data() == where);
  BufferCache::give(std::move(same));
  const pid_t pid = fork();
  if (pid == 0) _exit(BufferCache::bytes() == 0 ? 0 : 3);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const size_t big = BufferCache::kMaxBytes / 2 + 4096;
  for (int i = 0; i < 3; ++i) BufferCache::give(AlignedBuffer(big, 4096));
  CHECK(BufferCache::bytes() <= BufferCache::kMaxBytes);
  BufferCache::take(big, 4096);  // leave room for the other tests
  BufferCache::give(AlignedBuffer());  // nothing to keep
}

// io_uring pins registered buffers once instead of every page of every request. Registration
// needs every slot's buffer, so it starts with the (depth + 1)th request.
TEST_CASE("reader: io_uring reads into registered buffers once every slot has one") {
  if (!uring_available()) return;
  Files fs;
  const Bytes& want = fs.data.back();  // 3 MiB and change
  for (unsigned depth : {1u, 4u, 16u}) {
    SequentialReader r({{fs.paths.back()}, {fs.paths[3]}, {fs.paths.back(), 5, 70000}},
                       opts("uring", 65536, depth));
    std::vector<Bytes> got(3);
    Chunk c;
    while (r.next(c)) got[c.extent].insert(got[c.extent].end(), c.data, c.data + c.size);
    CHECK(got[0] == want && got[1] == fs.data[3] && got[2] == slice(want, 5, 70000));
    const ReaderStats& s = r.stats();
    CHECK(s.registered_requests > 0);
    CHECK(s.requests - s.registered_requests == depth);  // before the last slot's first
  }
  // A reader that never uses every slot registers nothing.
  SequentialReader small({{fs.paths[3]}}, opts("uring", 65536, 8));
  Chunk c;
  while (small.next(c)) {}
  CHECK(small.stats().registered_requests == 0);
}

// wait_ns tells a slow consumer (little waiting) from a slow drive (next() mostly blocked).
TEST_CASE("reader: latency histogram per request and time spent waiting") {
  Files fs;
  std::vector<Extent> ex = {{fs.paths.back()}, {fs.paths[3]}};
  using clk = std::chrono::steady_clock;
  for (const auto& kind : engines())
    for (bool slow : {false, true}) {
      SequentialReader r(ex, opts(kind, slow ? 64 * 1024 : 4096, slow ? 8 : 1));
      const auto t0 = clk::now();
      Chunk c;
      while (r.next(c))
        if (slow) usleep(3000);
      const uint64_t wall =
          std::chrono::duration_cast<std::chrono::nanoseconds>(clk::now() - t0).count();
      const ReaderStats& s = r.stats();
      CHECK(s.latency.count() == s.requests && s.requests > 0);
      CHECK(s.latency.min() > 0 && s.latency.max() < wall);
      const uint64_t p50 = s.latency.percentile(50);
      CHECK(p50 >= s.latency.min() && p50 <= s.latency.max());
      CHECK(s.wait_ns <= wall);
      if (slow) CHECK(s.wait_ns < wall / 2);  // the consumer, not the reading, took the time
      else CHECK(s.wait_ns > 0);  // depth 1, 4 KiB: next() outruns every read at least once
    }
}

TEST_CASE("reader: randomized extents, chunk sizes, depths and skips") {
  Files fs;
  std::mt19937 rng(12345);
  auto pick = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  const auto kinds = engines();
  for (int iter = 0; iter < 150; ++iter) {
    std::vector<Extent> ex(pick(1, 12));
    std::vector<size_t> which(ex.size());
    for (size_t i = 0; i < ex.size(); ++i) {
      which[i] = pick(0, fs.paths.size() - 1);
      const uint64_t n = fs.data[which[i]].size();
      ex[i].path = fs.paths[which[i]];
      ex[i].start = pick(0, 3) ? pick(0, n + 1) : 0;
      ex[i].end = pick(0, 2) ? pick(ex[i].start, n + 2) : kToEnd;
    }
    ReaderOptions o = opts(kinds[iter % kinds.size()], pick(1, 3 * 8192), unsigned(pick(1, 12)));
    SequentialReader r(ex, o);
    std::vector<Bytes> got(ex.size());
    std::vector<bool> skipped(ex.size());
    Chunk c;
    while (r.next(c)) {
      got[c.extent].insert(got[c.extent].end(), c.data, c.data + c.size);
      if (!c.last && pick(0, 9) == 0) {
        r.skip_extent();
        skipped[c.extent] = true;
      }
    }
    for (size_t i = 0; i < ex.size(); ++i) {
      Bytes want = slice(fs.data[which[i]], ex[i].start, ex[i].end);
      if (skipped[i]) CHECK(got[i].size() <= want.size() && got[i] == slice(want, 0, got[i].size()));
      else CHECK(got[i] == want);
    }
  }
}

TEST_MAIN()
