// Unit tests for CowSnapshot: the destination must hold the sources' bytes as of construction
// however the sources are written afterwards (by other threads, by read(2)), every byte must be
// accounted for as eager or protected, and memory must never stay write-protected.
//
// Under ASan these run too: the handler's memcpy and the read(2) interceptor only check shadow
// memory, and the kernel serves their faults like any other.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.hpp"
#include "snapshot/cow_snapshot.hpp"
#include "tests/check.hpp"
#include "tests/temp_dir.hpp"

using namespace flashstream;

namespace {

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

// A private anonymous mapping, unmapped on scope exit.
struct Map {
  uint8_t* p;
  size_t n;
  explicit Map(size_t size) : n(size) {
    void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("mmap failed");
    p = static_cast<uint8_t*>(m);
  }
  ~Map() { munmap(p, n); }
  Map(const Map&) = delete;
  Map& operator=(const Map&) = delete;
};

void fill_random(uint8_t* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

// dst[i] must equal the bytes of src as of `ref` for every range.
bool matches(const std::vector<CopyRange>& ranges, const std::vector<std::vector<uint8_t>>& ref) {
  for (size_t i = 0; i < ranges.size(); ++i)
    if (ranges[i].len && std::memcmp(ranges[i].dst, ref[i].data(), ranges[i].len) != 0) {
      std::fprintf(stderr, "  range %zu differs\n", i);
      return false;
    }
  return true;
}

std::vector<std::vector<uint8_t>> reference(const std::vector<CopyRange>& ranges) {
  std::vector<std::vector<uint8_t>> ref;
  for (const CopyRange& r : ranges) ref.emplace_back(r.src, r.src + r.len);
  return ref;
}

uint64_t total(const std::vector<CopyRange>& ranges) {
  uint64_t t = 0;
  for (const CopyRange& r : ranges) t += r.len;
  return t;
}

void check_stats(const CowSnapshot& snap, uint64_t bytes) {
  const CowStats s = snap.stats();
  CHECK(s.eager_bytes + s.protected_bytes == bytes);
  CHECK(s.fault_bytes + s.background_bytes == s.protected_bytes);
  CHECK(s.fault_copies <= s.fault_bytes);
}

// Lays out ranges over `src` with awkward edges: unaligned starts and ends, sub-page, one byte,
// zero length, a range inside another (a view) and one equal to another (tied weights).
std::vector<CopyRange> awkward_ranges(uint8_t* src, size_t src_len, uint8_t* dst) {
  std::vector<CopyRange> r;
  size_t d = 0;
  auto add = [&](size_t off, size_t len) {
    if (off + len > src_len) return;
    r.push_back({src + off, dst + d, len});
    d += len + 13;
  };
  add(0, 3 * (2 << 20) + 5);         // aligned start, unaligned end, several blocks
  add(7 << 20 | 17, (5 << 20) + 99);  // unaligned both ends
  add(13 << 20, 100);                 // sub-page
  add((13 << 20) + 4000, 200);        // sub-page crossing a page boundary
  add(14 << 20, 1);
  add(15 << 20, 0);
  add(16 << 20, 4 << 20);             // exactly page aligned
  add((17 << 20) + 4096, 4096);       // a view inside the previous one
  add(16 << 20, 4 << 20);             // the same storage again
  add((19 << 20) + 5, kPage);         // one page long but straddling two pages
  add(21 << 20, kPage - 1);
  add((22 << 20) - 1, 2 * kPage + 2);
  add((24 << 20) + 3, src_len - (24 << 20) - 9);  // the bulk: the writer faults on it often
  return r;
}

// Keeps writing random bytes into the ranges' sources until told to stop.
struct Writer {
  std::atomic<bool> go{false}, stop{false};
  std::atomic<uint64_t> writes{0};
  std::thread t;
  Writer(const std::vector<CopyRange>& ranges, uint64_t seed) {
    t = std::thread([this, ranges, seed] {
      std::mt19937_64 rng(seed);
      std::vector<size_t> nonempty;
      for (size_t i = 0; i < ranges.size(); ++i)
        if (ranges[i].len) nonempty.push_back(i);
      while (!go.load()) std::this_thread::yield();
      while (!stop.load()) {
        const CopyRange& r = ranges[nonempty[rng() % nonempty.size()]];
        const_cast<uint8_t*>(r.src)[rng() % r.len] = static_cast<uint8_t>(rng() | 1);
        writes.fetch_add(1, std::memory_order_relaxed);
      }
    });
  }
  void finish() {
    stop = true;
    t.join();
  }
};

}  // namespace

TEST_CASE("cow_available here") {
  std::printf("  mode: %s\n", cow_mode_name(cow_mode()));
  CHECK(cow_mode() != CowMode::kNone);
  CHECK(cow_available() == (cow_mode() == CowMode::kFull));
}

TEST_CASE("plain snapshot of one large range") {
  const size_t n = 64 << 20;
  Map src(n), dst(n);
  fill_random(src.p, n, 1);
  std::vector<CopyRange> ranges{{src.p, dst.p, n}};
  auto ref = reference(ranges);
  CowSnapshot snap(ranges);
  snap.wait();
  CHECK(snap.done());
  CHECK(matches(ranges, ref));
  check_stats(snap, n);
  if (cow_available()) CHECK(snap.stats().protected_bytes == n);
}

TEST_CASE("writer hammering right after construction") {
  const size_t n = 256 << 20;
  Map src(n), dst(n + (64 << 20));
  fill_random(src.p, n, 2);
  auto ranges = awkward_ranges(src.p, n, dst.p);
  for (int round = 0; round < 3; ++round) {
    std::memset(dst.p, 0, dst.n);
    Writer writer(ranges, 100 + round);  // parked: the world is stopped for the reference
    auto ref = reference(ranges);
    {
      CowSnapshot snap(ranges, size_t(round == 2 ? 1 : 2) << 20);
      writer.go = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(round * 20));
      snap.wait();
      CHECK(snap.done());
      CHECK(matches(ranges, ref));
      check_stats(snap, total(ranges));
      const CowStats s = snap.stats();
      std::printf("  round %d: protected %llu eager %llu fault copies %llu, writes %llu\n", round,
                  (unsigned long long)s.protected_bytes, (unsigned long long)s.eager_bytes,
                  (unsigned long long)s.fault_copies, (unsigned long long)writer.writes.load());
      if (cow_available()) CHECK(s.protected_bytes > 0 && s.eager_bytes > 0);
    }
    writer.finish();
  }
}

// The writer runs through construction: each dst byte must be the byte's value at some instant
// between the start and the end of the constructor, i.e. the reference or a value written by a
// write that was not started after the constructor returned.
TEST_CASE("writer hammering during construction") {
  const size_t n = 128 << 20;
  Map src(n), dst(n + (64 << 20));
  fill_random(src.p, n, 3);
  std::vector<CopyRange> ranges = awkward_ranges(src.p, n, dst.p);
  struct Write {
    uint32_t range, off;
    uint8_t value;
  };
  std::vector<Write> log(1 << 24);
  std::atomic<uint64_t> seq{0};
  std::atomic<bool> stop{false};
  auto ref = reference(ranges);
  std::thread writer([&] {
    std::mt19937_64 rng(7);
    while (!stop.load() && seq.load() < log.size()) {
      const uint32_t ri = static_cast<uint32_t>(rng() % ranges.size());
      if (!ranges[ri].len) continue;
      const uint64_t s = seq.load(std::memory_order_relaxed);
      Write w{ri, static_cast<uint32_t>(rng() % ranges[ri].len), static_cast<uint8_t>(rng())};
      log[s] = w;
      const_cast<uint8_t*>(ranges[ri].src)[w.off] = w.value;
      seq.store(s + 1, std::memory_order_release);
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const uint64_t before = seq.load(std::memory_order_acquire);
  uint64_t after = 0;
  {
    CowSnapshot snap(ranges);
    after = seq.load(std::memory_order_acquire);  // writes >= after+1 began after the return
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    snap.wait();
    check_stats(snap, total(ranges));
  }
  stop = true;
  writer.join();
  // Allowed values per byte: its value when the constructor started, or any value written to
  // it by writes [before, after] (write `after` may have been in flight at the return). Ranges
  // alias (a view, tied storage), so bytes are identified by their offset in the mapping.
  std::vector<uint8_t> at_start(n);
  for (size_t ri = 0; ri < ranges.size(); ++ri)
    if (ranges[ri].len)
      std::memcpy(at_start.data() + (ranges[ri].src - src.p), ref[ri].data(), ranges[ri].len);
  auto where = [&](const Write& w) { return size_t(ranges[w.range].src - src.p) + w.off; };
  for (uint64_t s = 0; s < before; ++s) at_start[where(log[s])] = log[s].value;
  std::multimap<size_t, uint8_t> during;
  for (uint64_t s = before; s <= after && s < log.size(); ++s)
    during.emplace(where(log[s]), log[s].value);
  bool ok = true;
  for (size_t ri = 0; ri < ranges.size() && ok; ++ri) {
    for (size_t off = 0; off < ranges[ri].len; ++off) {
      const uint8_t got = ranges[ri].dst[off];
      const size_t at = size_t(ranges[ri].src - src.p) + off;
      if (got == at_start[at]) continue;
      bool found = false;
      for (auto [it, end] = during.equal_range(at); it != end && !found; ++it)
        found = it->second == got;
      if (!found) {
        std::fprintf(stderr, "  range %zu byte %zu: %u not a value it had during construction\n",
                     ri, off, got);
        ok = false;
        break;
      }
    }
  }
  CHECK(ok);
  std::printf("  writes before %llu, during %llu, total %llu\n", (unsigned long long)before,
              (unsigned long long)(after - before), (unsigned long long)seq.load());
}

TEST_CASE("zero-length, sub-page, shared and many ranges") {
  CowSnapshot empty(std::vector<CopyRange>{});
  empty.wait();
  CHECK(empty.done());
  const size_t n = 64 << 20;
  Map src(n), dst(2 * n);
  fill_random(src.p, n, 4);
  std::mt19937_64 rng(5);
  std::vector<CopyRange> ranges;
  size_t d = 0;
  for (int i = 0; i < 3000; ++i) {
    size_t len = rng() % 4 == 0 ? rng() % 100 : rng() % (256 << 10);
    size_t off = rng() % (n - len);
    if (i % 7 == 0) off = off / kPage * kPage;
    ranges.push_back({src.p + off, dst.p + d, len});
    d += len;
    if (d + (256 << 10) > 2 * n) break;
  }
  ranges.push_back({src.p, dst.p, 0});
  auto ref = reference(ranges);
  Writer writer(ranges, 6);
  CowSnapshot snap(ranges, 64 << 10);
  writer.go = true;
  snap.wait();
  writer.finish();
  CHECK(matches(ranges, ref));
  check_stats(snap, total(ranges));
}

TEST_CASE("heap memory, and malloc while protected") {
  std::vector<std::vector<uint8_t>> srcs;
  for (size_t len : {size_t(100), size_t(5000), size_t(70000), size_t(3) << 20, size_t(40) << 20})
    srcs.emplace_back(len, uint8_t(len));
  std::vector<uint8_t> dst(size_t(50) << 20);
  std::vector<CopyRange> ranges;
  size_t d = 0;
  for (auto& s : srcs) {
    fill_random(s.data(), s.size(), s.size());
    ranges.push_back({s.data(), dst.data() + d, s.size()});
    d += s.size();
  }
  auto ref = reference(ranges);
  CowSnapshot snap(ranges);
  std::vector<std::unique_ptr<uint8_t[]>> churn;  // allocations while pages are protected
  for (int i = 0; i < 2000; ++i) churn.emplace_back(new uint8_t[(i * 37) % 5000 + 1]());
  for (auto& s : srcs) std::memset(s.data(), 0xEE, s.size());
  snap.wait();
  CHECK(matches(ranges, ref));
  check_stats(snap, total(ranges));
}

TEST_CASE("file-backed shared mapping is copied eagerly") {
  fstest::TempDir dir;
  const std::string path = dir.file("mapped");
  const size_t n = 8 << 20;
  int fd = open(path.c_str(), O_RDWR | O_CREAT, 0600);
  CHECK(fd >= 0);
  CHECK(ftruncate(fd, n) == 0);
  void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  CHECK(m != MAP_FAILED);
  auto* src = static_cast<uint8_t*>(m);
  fill_random(src, n, 8);
  Map dst(n), anon(n), dst2(n);
  fill_random(anon.p, n, 9);
  std::vector<CopyRange> ranges{{src, dst.p, n}, {anon.p, dst2.p, n}};
  auto ref = reference(ranges);
  CowSnapshot snap(ranges);
  std::memset(src, 1, n);
  std::memset(anon.p, 2, n);
  snap.wait();
  CHECK(matches(ranges, ref));
  const CowStats s = snap.stats();
  CHECK(s.eager_bytes >= n);
  if (cow_available()) CHECK(s.protected_bytes == n);
  check_stats(snap, 2 * n);
  munmap(m, n);
  close(fd);
}

TEST_CASE("sources unmapped or zapped during the copy are lost, never a crash") {
  // A tensor's storage freed right after the snapshot (munmap by malloc) or its pages dropped
  // (MADV_DONTNEED): their blocks are reported by lost(); the untouched range is whole.
  const size_t n = 64 << 20;
  void* a = mmap(nullptr, 3 * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(a != MAP_FAILED);
  auto* src = static_cast<uint8_t*>(a);
  fill_random(src, 3 * n, 12);
  Map dst(3 * n);
  std::vector<CopyRange> ranges{{src, dst.p, n}, {src + n, dst.p + n, n},
                                {src + 2 * n, dst.p + 2 * n, n}};
  const std::vector<uint8_t> kept(src, src + n);
  CowSnapshot snap(ranges);
  CHECK(munmap(src + 2 * n, n) == 0);
  CHECK(madvise(src + n, n, MADV_DONTNEED) == 0);
  snap.wait();
  const CowStats s = snap.stats();
  uint64_t lost = 0;
  for (const auto& [d, len] : snap.lost()) {
    CHECK(d >= dst.p + n && d + len <= dst.p + 3 * n);  // only the released ranges
    lost += len;
  }
  CHECK(lost == s.lost_bytes);
  if (cow_available()) CHECK(s.lost_bytes > 0);
  if (s.lost_bytes == 0) std::fprintf(stderr, "  (copy finished before the release)\n");
  CHECK(std::memcmp(dst.p, kept.data(), n) == 0);
  munmap(src, 2 * n);
}

TEST_CASE("memory stays writable after wait and after the destructor") {
  const size_t n = 16 << 20;
  Map src(n), dst(n);
  fill_random(src.p, n, 10);
  {
    CowSnapshot snap({{src.p, dst.p, n}});
    snap.wait();
    snap.wait();  // twice is fine
  }
  for (size_t i = 0; i < n; i += kPage) src.p[i] = 3;  // would hang if still protected
  {
    CowSnapshot snap({{src.p, dst.p, n}});  // destroyed without wait()
  }
  for (size_t i = 0; i < n; i += kPage) src.p[i] = 4;
  CowSnapshot again({{src.p, dst.p, n}});  // the same memory can be registered again
  again.wait();
  CHECK(again.stats().protected_bytes == (cow_available() ? n : 0));
  CHECK(dst.p[0] == 4);
}

TEST_CASE("a second snapshot of memory still protected is eager") {
  const size_t n = 16 << 20;
  Map src(n), dst(n), dst2(n);
  fill_random(src.p, n, 11);
  std::vector<uint8_t> ref(src.p, src.p + n);
  CowSnapshot first({{src.p, dst.p, n}});
  CowSnapshot second({{src.p, dst2.p, n}});
  std::memset(src.p, 5, n);
  first.wait();
  second.wait();
  CHECK(std::memcmp(dst.p, ref.data(), n) == 0);
  CHECK(std::memcmp(dst2.p, ref.data(), n) == 0);
}

TEST_CASE("read(2) into a protected range from another thread") {
  if (!cow_available()) {
    std::printf("  skipped: kernel writes are only served in full mode\n");
    return;
  }
  fstest::TempDir dir;
  const std::string path = dir.file("data");
  // The copier works from the start; the read lands near the end, before it gets there.
  const size_t n = 128 << 20, file_len = (6 << 20) + 123, at = n - file_len - 777;
  std::vector<uint8_t> content(file_len);
  fill_random(content.data(), file_len, 12);
  {
    int fd = open(path.c_str(), O_WRONLY | O_CREAT, 0600);
    CHECK(write(fd, content.data(), file_len) == static_cast<ssize_t>(file_len));
    close(fd);
  }
  Map src(n), dst(n);
  fill_random(src.p, n, 13);
  std::vector<uint8_t> ref(src.p, src.p + n);
  CowSnapshot snap({{src.p, dst.p, n}});
  ssize_t got = -1;
  int err = 0;
  std::thread reader([&] {
    int fd = open(path.c_str(), O_RDONLY);
    got = read(fd, src.p + at, file_len);  // crosses several blocks, unaligned
    err = errno;
    close(fd);
  });
  reader.join();
  snap.wait();
  CHECK(got == static_cast<ssize_t>(file_len));
  if (got < 0) std::fprintf(stderr, "  read failed: %s\n", std::strerror(err));
  CHECK(std::memcmp(src.p + at, content.data(), file_len) == 0);
  CHECK(std::memcmp(dst.p, ref.data(), n) == 0);
  CHECK(snap.stats().fault_copies > 0);
}

TEST_CASE("invalid arguments are refused before anything is protected") {
  const size_t n = 4 << 20;
  Map src(n), dst(n);
  CHECK_THROWS(CowSnapshot({{src.p, dst.p, n}}, 1000), std::invalid_argument);
  CHECK_THROWS(CowSnapshot({{src.p, dst.p, n}}, 0), std::invalid_argument);
  CHECK_THROWS(CowSnapshot({{src.p, src.p + 4096, 8192}}), std::invalid_argument);
  CHECK_THROWS(CowSnapshot({{src.p, dst.p, 100}, {dst.p + 50, dst.p + 4096, 10}}),
               std::invalid_argument);
  CHECK_THROWS(CowSnapshot({{nullptr, dst.p, 10}}), std::invalid_argument);
  std::memset(src.p, 1, n);  // still writable
  CHECK(src.p[n - 1] == 1);
}

int main() {
  alarm(300);  // a page left protected hangs its writer: fail instead of waiting forever
  return fstest::run_all();
}
