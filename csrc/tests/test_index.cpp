// Unit tests for index_shards: hopping and sequential indexing give the full scanner's sample
// offsets and errors on real files, through each engine; compressed shards, unreadable files
// and extensions only Python can compare are reported, never guessed.
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.hpp"
#include "index/shard_indexer.hpp"
#include "io/engine.hpp"
#include "tar/tar_scanner.hpp"
#include "tests/check.hpp"
#include "tests/tar_writer.hpp"
#include "tests/temp_dir.hpp"

using namespace flashstream;
using namespace fstest::tarw;

namespace {

using Spans = std::vector<std::pair<int64_t, int64_t>>;

void write_file(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

// The full scanner's samples over the whole archive (after an error, the samples before it and
// the group of members open at it, as the reader delivers them unless its handler raises), and
// its error ("" when none).
std::pair<Spans, std::string> full_scan(const std::string& tar) {
  TarScanner scanner;
  scanner.begin_shard(0);
  Spans spans;
  std::string error;
  try {
    scanner.feed(reinterpret_cast<const uint8_t*>(tar.data()), tar.size());
    scanner.end_shard();
  } catch (const FormatError& e) {
    error = std::string(e.what()) + " @" + std::to_string(e.offset()) +
            (e.shard_only() ? " shard_only" : "");
    scanner.flush_open_group();
  }
  for (const Sample& s : scanner.samples())
    spans.emplace_back(static_cast<int64_t>(s.offset), static_cast<int64_t>(s.end_offset));
  return {spans, error};
}

Spans spans_of(const ShardIndexResult& r) {
  Spans out;
  for (size_t i = 0; i < r.offsets.size(); ++i) out.emplace_back(r.offsets[i], r.ends[i]);
  return out;
}

std::string error_of(const ShardIndexResult& r) {
  if (!r.error) return "";
  try {
    std::rethrow_exception(r.error);
  } catch (const FormatError& e) {
    return std::string(e.what()) + " @" + std::to_string(e.offset()) +
           (e.shard_only() ? " shard_only" : "");
  } catch (const IoError& e) {
    return std::string("io: ") + e.what();
  }
}

std::vector<std::string> engines() {
  std::vector<std::string> v{"threads"};
  if (uring_available()) v.push_back("uring");
  return v;
}

// Archives exercising what hopping must get right: big members to jump over, GNU long names
// and pax records (data the scanner must read), skipped members, a header straddling windows.
std::vector<std::string> archives() {
  std::vector<std::string> out;
  std::string a;
  for (int i = 0; i < 6; ++i)
    a += member("s" + std::to_string(i) + ".bin", bytes(300000 + 517 * i, i)) +
         member("s" + std::to_string(i) + ".json", "{}");
  out.push_back(a + kEnd);
  std::string b = gnu_long(std::string(300, 'n') + ".bin") +
                  member("x.bin", bytes(200000, 7)) +
                  pax({{"path", std::string(150, 'p') + "/k.txt"}}) + member("y", bytes(5000, 8)) +
                  member(std::string(90, 'd') + "/", "", HeaderOpts{'5'}) +
                  member("z.cls", bytes(70000, 9)) + kEnd + "trailing garbage";
  out.push_back(b);
  // Members sized so the next header lands at every offset within a 4 KiB window.
  std::string c;
  for (int i = 0; i < 16; ++i) c += member("w" + std::to_string(i) + ".bin", bytes(4096 * i + 512 * (i % 8), i));
  out.push_back(c + kEnd);
  return out;
}

TEST_CASE("hopping and sequential indexing equal the full scan, on every engine") {
  fstest::TempDir dir;
  std::vector<std::string> paths, tars = archives();
  for (size_t i = 0; i < tars.size(); ++i) {
    paths.push_back(dir.file("a" + std::to_string(i) + ".tar"));
    write_file(paths.back(), tars[i]);
  }
  for (const std::string& engine : engines()) {
    for (uint64_t threshold : {uint64_t(0), uint64_t(64) << 10, UINT64_MAX}) {
      IndexOptions o;
      o.engine = engine;
      o.queue_depth = 2;  // fewer slots than shards: slots are reused
      o.hop_threshold = threshold;
      o.decide_after = 2;
      IndexStats stats;
      std::vector<ShardIndexResult> got = index_shards(paths, o, &stats);
      CHECK(got.size() == tars.size());
      for (size_t i = 0; i < tars.size(); ++i) {
        auto [spans, error] = full_scan(tars[i]);
        CHECK(error.empty());
        CHECK(got[i].outcome == ShardOutcome::kIndexed);
        CHECK(spans_of(got[i]) == spans);
        if (threshold == 0) CHECK(!got[i].sequential);
        if (threshold == UINT64_MAX) CHECK(got[i].sequential);
      }
      CHECK(stats.engine == engine);
      size_t total = 0;
      for (const std::string& t : tars) total += t.size();
      if (threshold == 0) CHECK(stats.bytes_read * 10 < total);  // a 4 KiB read per header run
    }
  }
}

TEST_CASE("a cut or corrupt shard fails as the full scan does, keeping the samples before") {
  // ... and the group of members open at the error, with the same shard_only mark.
  fstest::TempDir dir;
  std::string tar = archives()[0];
  HeaderOpts bad;
  bad.checksum_delta = 3;
  const std::vector<std::string> broken = {
      tar.substr(0, 100), tar.substr(0, 512 * 3 + 7), tar.substr(0, 400000),
      tar.substr(0, 512 + 300000 + 8),  // inside the padding after the first member
      tar.substr(0, tar.size() - 1024 - 512),
      member("a.bin", bytes(90000, 1)) + member("a.txt", "t", bad) + kEnd,
      std::string(),  // an empty shard
  };
  std::vector<std::string> paths;
  for (size_t i = 0; i < broken.size(); ++i) {
    paths.push_back(dir.file("b" + std::to_string(i) + ".tar"));
    write_file(paths.back(), broken[i]);
  }
  for (uint64_t threshold : {uint64_t(0), UINT64_MAX}) {
    IndexOptions o;
    o.hop_threshold = threshold;
    std::vector<ShardIndexResult> got = index_shards(paths, o);
    for (size_t i = 0; i < broken.size(); ++i) {
      auto [spans, error] = full_scan(broken[i]);
      if (broken[i].empty()) error = "empty shard @0";
      CHECK(got[i].outcome == ShardOutcome::kFailed);
      CHECK(error_of(got[i]) == error);
      if (error_of(got[i]) != error)
        std::fprintf(stderr, "  shard %zu: got '%s', want '%s'\n", i, error_of(got[i]).c_str(),
                     error.c_str());
      CHECK(spans_of(got[i]) == spans);
    }
  }
}

TEST_CASE("missing files, compressed shards and non-ASCII extensions are reported") {
  fstest::TempDir dir;
  const std::string good = archives()[0];
  write_file(dir.file("good.tar"), good);
  write_file(dir.file("a.tar.gz"), std::string("\x1f\x8b\x08\0", 4) + bytes(5000, 3));
  write_file(dir.file("a.tar.xz"), std::string("\xfd" "7zXZ\0", 6) + bytes(100, 3));
  write_file(dir.file("k.tar"), member("a.bin", bytes(80000, 4)) + member("a.\xc3\xa9", "x") + kEnd);
  const std::vector<std::string> paths = {dir.file("missing.tar"), dir.file("a.tar.gz"),
                                          dir.file("good.tar"), dir.file("a.tar.xz"),
                                          dir.file("k.tar")};
  for (uint64_t threshold : {uint64_t(0), UINT64_MAX}) {
    IndexOptions o;
    o.hop_threshold = threshold;
    std::vector<ShardIndexResult> got = index_shards(paths, o);
    CHECK(got[0].outcome == ShardOutcome::kFailed);
    CHECK(error_of(got[0]).find("io: ") == 0);
    CHECK(got[1].outcome == ShardOutcome::kCompressed);
    CHECK(got[2].outcome == ShardOutcome::kIndexed && spans_of(got[2]) == full_scan(good).first);
    CHECK(got[3].outcome == ShardOutcome::kCompressed);
    CHECK(got[4].outcome == ShardOutcome::kNeedsFullScan && got[4].offsets.empty());
  }
}

TEST_CASE("small members switch to sequential reading after the first hops") {
  fstest::TempDir dir;
  std::string tar;
  for (int i = 0; i < 500; ++i) tar += member("k" + std::to_string(i) + ".bin", bytes(3000, i));
  tar += kEnd;
  write_file(dir.file("small.tar"), tar);
  IndexOptions o;
  o.hop_threshold = 64 << 10;
  o.decide_after = 4;
  std::vector<ShardIndexResult> got = index_shards({dir.file("small.tar")}, o);
  CHECK(got[0].outcome == ShardOutcome::kIndexed && got[0].sequential);
  CHECK(got[0].hops == 4);
  CHECK(spans_of(got[0]) == full_scan(tar).first);
}

TEST_CASE("a cancelled run waits for its reads and throws IndexCancelled") {
  fstest::TempDir dir;
  std::vector<std::string> paths;
  const std::string tar = archives()[0];
  for (int i = 0; i < 40; ++i) {
    paths.push_back(dir.file("c" + std::to_string(i) + ".tar"));
    write_file(paths.back(), tar);
  }
  for (const std::string& engine : engines()) {
    for (uint64_t threshold : {uint64_t(0), UINT64_MAX}) {
      IndexOptions o;
      o.engine = engine;
      o.hop_threshold = threshold;
      int polls = 0;
      o.cancelled = [&polls] { return ++polls >= 1; };
      CHECK_THROWS(index_shards(paths, o), IndexCancelled);
      CHECK(polls == 1);
      o.cancelled = nullptr;  // the same files index fine afterwards
      CHECK(index_shards(paths, o)[39].offsets.size() == 6);
    }
  }
}

TEST_CASE("bad options are refused") {
  IndexOptions o;
  o.queue_depth = 0;
  CHECK_THROWS(index_shards({}, o), std::invalid_argument);
  o = IndexOptions();
  o.hop_read = 100;
  CHECK_THROWS(index_shards({}, o), std::invalid_argument);
  o = IndexOptions();
  o.engine = "bogus";
  CHECK_THROWS(index_shards({"/nonexistent"}, o), std::invalid_argument);
}

}  // namespace

TEST_MAIN()
