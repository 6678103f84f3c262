// Unit tests for TarScanner, split_key and is_meta_name. Tar archives are built in memory with
// a small ustar/GNU/pax writer, then fed in pieces of many sizes; every split must give the
// same samples. Expected results mirror Python tarfile + webdataset (checked against them).
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/errors.hpp"
#include "tar/tar_scanner.hpp"
#include "tests/check.hpp"
#include "tests/tar_writer.hpp"

using namespace flashstream;
using namespace fstest::tarw;

namespace {

// ---- feeding and collecting ----

struct Got {
  struct F {
    std::string ext, data;
  };
  struct S {
    std::string key;
    uint64_t offset = 0, end_offset = 0;
    std::vector<F> fields;
  };
  std::vector<S> samples;
  bool failed = false;
  std::string error;
  uint64_t error_offset = 0;
  bool shard_only = false;
  std::vector<S> group;  // what flush_open_group handed over after the error
  ScanStats stats;
  bool at_end = false;
};

bool operator==(const Got::F& a, const Got::F& b) { return a.ext == b.ext && a.data == b.data; }
bool operator==(const Got::S& a, const Got::S& b) {
  return a.key == b.key && a.offset == b.offset && a.end_offset == b.end_offset &&
         a.fields == b.fields;
}

void drain(TarScanner& sc, Got& g) {
  for (Sample& s : sc.samples()) {
    Got::S c{s.key, s.offset, s.end_offset, {}};
    for (Field& f : s.fields)
      c.fields.push_back({f.ext, std::string(reinterpret_cast<const char*>(f.data), f.size)});
    g.samples.push_back(std::move(c));
  }
  sc.clear_samples();
}

// Feeds `tar` in pieces whose sizes cycle through `sizes` (0 = the rest). Each piece is copied
// into a buffer that is overwritten after feed() returns, as a reader reuses its memory.
Got scan(const std::string& tar, std::vector<size_t> sizes, uint64_t start = 0) {
  TarScanner sc;
  sc.begin_shard(start);
  Got g;
  std::vector<uint8_t> piece;
  try {
    size_t pos = 0, i = 0;
    while (pos < tar.size()) {
      size_t n = sizes[i++ % sizes.size()];
      n = n == 0 ? tar.size() - pos : std::min(n, tar.size() - pos);
      piece.assign(tar.begin() + pos, tar.begin() + pos + n);
      sc.feed(piece.data(), n);
      pos += n;
      drain(sc, g);
      std::fill(piece.begin(), piece.end(), 0xEE);
      sc.feed(piece.data(), 0);
    }
    sc.end_shard();
    drain(sc, g);
  } catch (const FormatError& e) {
    drain(sc, g);
    g.failed = true;
    g.error = e.what();
    g.error_offset = e.offset();
    g.shard_only = e.shard_only();
    std::fill(piece.begin(), piece.end(), 0xEE);  // the group must not point into the piece
    Got flushed;
    const bool handed_over = sc.flush_open_group();
    CHECK(handed_over == !sc.samples().empty());
    drain(sc, flushed);
    g.group = std::move(flushed.samples);
  }
  g.stats = sc.stats();
  g.at_end = sc.at_end();
  return g;
}

// The same tar through many piece patterns must give the same result; returns it.
Got scan_all(const std::string& tar) {
  const std::vector<std::vector<size_t>> patterns = {
      {0}, {1}, {7}, {512}, {4096}, {511, 513}, {3, 1000, 1, 65536}, {100000}};
  Got ref = scan(tar, patterns[0]);
  for (auto& p : patterns) {
    Got g = scan(tar, p);
    CHECK(g.samples == ref.samples);
    CHECK(g.failed == ref.failed);
    CHECK(g.error == ref.error);
    CHECK(g.error_offset == ref.error_offset);
    CHECK(g.shard_only == ref.shard_only);
    CHECK(g.group == ref.group);
    CHECK(g.stats.members == ref.stats.members);
    CHECK(g.stats.skipped == ref.stats.skipped);
    CHECK(g.at_end == ref.at_end);
  }
  std::mt19937 rng(7);
  for (int round = 0; round < 5; ++round) {
    std::vector<size_t> sizes;
    for (int i = 0; i < 64; ++i) sizes.push_back(1 + rng() % (i % 2 ? 9000 : 600));
    Got g = scan(tar, sizes);
    CHECK(g.samples == ref.samples);
    CHECK(g.error == ref.error);
    CHECK(g.group == ref.group);
  }
  return ref;
}

bool has_error(const Got& g, const std::string& text) {
  if (!g.failed) return false;
  if (g.error.find(text) != std::string::npos) return true;
  std::fprintf(stderr, "  error was: %s\n", g.error.c_str());
  return false;
}

}  // namespace

// ---- split_key / is_meta_name ----

TEST_CASE("split_key matches Python's base_plus_ext regex") {
  struct Case {
    const char* name;
    bool ok;
    const char* key;
    const char* ext;
  };
  // Expected values computed with re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name).
  const Case cases[] = {
      {"a.b", true, "a", "b"},           {"a", false, "", ""},
      {".a", false, "", ""},             {"a.", true, "a", ""},
      {"a.b.c", true, "a", "b.c"},       {"dir/a.b", true, "dir/a", "b"},
      {"dir/.a", true, "dir/", "a"},     {"dir/.a.b", true, "dir/", "a.b"},
      {"d.x/a.b", true, "d.x/a", "b"},   {"d.x/a", false, "", ""},
      {"d.x/.a", false, "", ""},         {"a.b/c", false, "", ""},
      {"a/b/c.d.e", true, "a/b/c", "d.e"}, {"./a.b", true, "./a", "b"},
      {"a/./b.c", true, "a/./b", "c"},   {"a\nb/c.d", true, "a\nb/c", "d"},
      {"a/b\n/c.d", true, "a/b\n/c", "d"}, {"x/y\n.z", true, "x/y\n", "z"},
      {"x\n/y.z", true, "x\n/y", "z"},   {"a.b\n", true, "a", "b\n"},
      {"a/b.c/", false, "", ""},         {"/a.b", true, "/a", "b"},
      {"//a.b", true, "//a", "b"},       {"a//b.c", true, "a//b", "c"},
      {"/.a", true, "/", "a"},           {"a./b.c", true, "a./b", "c"},
      {"a.b/.c", false, "", ""},         {"a/.b/.c", false, "", ""},
      {"/", false, "", ""},              {".", false, "", ""},
      {"..", false, "", ""},             {"a..b", true, "a", ".b"},
      {"\n.a", true, "\n", "a"},         {"a\n.b", true, "a\n", "b"},
      {"_.a/b/.c", true, "_.a/b/", "c"}, {"a.b/c/.d", true, "a.b/c/", "d"},
      {"ab/.c.d", true, "ab/", "c.d"},   {"", false, "", ""},
      {"x\n.y/.z", false, "", ""},       {"a\n/.b", true, "a\n/", "b"},
  };
  for (const Case& c : cases) {
    std::string_view key = "unset", ext = "unset";
    bool ok = split_key(c.name, &key, &ext);
    CHECK(ok == c.ok);
    if (ok && c.ok) {
      CHECK(key == c.key);
      CHECK(ext == c.ext);
    }
    if (ok != c.ok) std::fprintf(stderr, "  name: \"%s\"\n", c.name);
  }
}

TEST_CASE("is_meta_name matches webdataset's metadata filters") {
  struct Case {
    const char* name;
    bool meta;
  };
  const Case cases[] = {
      {"__meta__", true},   {"__", true},          {"___", true},        {"__a", false},
      {"a__", false},       {"__a__/b.c", true},   {"__a__.b", false},   {"x/__a__/b.c", false},
      {"__a/b__", false},   {"__a__\n", true},     {"__a__\nb", false},  {"___/x", false},
      {"____/x", true},     {"__/__", false},      {"__a/__", false},    {"__a__b/c", false},
      {"__x__\n/y", false}, {"__\n__", true},      {"____\n", true},     {"___\n", false},
      {"", false},          {"_", false},          {"a.b", false},
  };
  for (const Case& c : cases) {
    CHECK(is_meta_name(c.name) == c.meta);
    if (is_meta_name(c.name) != c.meta) std::fprintf(stderr, "  name: \"%s\"\n", c.name);
  }
}

// ---- well-formed archives ----

TEST_CASE("members of many sizes, grouped by key") {
  const size_t sizes[] = {0, 1, 511, 512, 513, 4095, 4096, 4097, (3u << 20) + 5};
  std::string tar;
  std::vector<Got::S> want;
  uint64_t off = 0;
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
    std::string key = "shard/" + std::to_string(100000 + i);
    std::string a = bytes(sizes[i], uint32_t(i)), b = std::to_string(i);
    std::string entry = member(key + ".bin", a) + member(key + ".CLS", b);
    want.push_back({key, off, off + entry.size(), {{"bin", a}, {"cls", b}}});
    off += entry.size();
    tar += entry;
  }
  Got g = scan_all(tar + kEnd);
  CHECK(!g.failed);
  CHECK(g.samples == want);
  CHECK(g.at_end);
  CHECK(g.stats.members == 18);
  CHECK(g.stats.samples == 9);
  CHECK(g.stats.skipped == 0);
  CHECK(g.stats.bytes == tar.size() + kEnd.size());
}

TEST_CASE("an archive without end-of-archive blocks is fine") {
  std::string tar = member("a.x", "1") + member("a.y", "22");
  Got g = scan_all(tar);
  CHECK(!g.failed);
  CHECK(!g.at_end);
  CHECK(g.samples.size() == 1 && g.samples[0].fields.size() == 2);
}

TEST_CASE("a shard ending inside the padding after complete data fails at the cut") {
  // A download cut short there lost the rest of the shard: tarfile (webdataset) raises, and
  // the sample still open is not delivered, as there.
  std::string tar = member("a.x", "1") + member("b.y", std::string(20, 'y'));
  Got g = scan_all(tar.substr(0, 512 + 512 + 512 + 100));
  CHECK(g.failed);
  CHECK(g.error_offset == 512 + 512 + 512 + 100);
  CHECK(g.error.find("truncated tar padding") != std::string::npos);
  CHECK(g.samples.size() == 1 && g.samples[0].key == "a");
}

TEST_CASE("bytes after the end-of-archive block are ignored") {
  std::string tar = member("a.x", "1") + std::string(512, '\0') + "garbage that is no header" +
                    member("b.x", "2");
  Got g = scan_all(tar);
  CHECK(!g.failed);
  CHECK(g.at_end);
  CHECK(g.samples.size() == 1 && g.samples[0].key == "a");
  CHECK(g.stats.bytes == tar.size());
}

TEST_CASE("a zero block first gives an empty archive, not an error") {
  Got g = scan_all(std::string(512, '\0') + member("a.x", "1"));
  CHECK(!g.failed);
  CHECK(g.samples.empty());
}

TEST_CASE("a new key starts a new sample even when an earlier key comes back") {
  std::string tar = member("a.x", "1") + member("b.x", "2") + member("a.y", "3") + kEnd;
  Got g = scan_all(tar);
  CHECK(!g.failed);
  CHECK(g.samples.size() == 3);
  CHECK(g.samples[0].key == "a" && g.samples[1].key == "b" && g.samples[2].key == "a");
  CHECK(g.samples[2].fields[0].ext == "y");
}

TEST_CASE("extensions are lowercased and split at the key's first dot") {
  std::string tar = member("dir.v1/Key.Seg.JPG", "j") + member("dir.v1/Key.TXT", "t") + kEnd;
  Got g = scan_all(tar);
  CHECK(g.samples.size() == 1);
  CHECK(g.samples[0].key == "dir.v1/Key");
  CHECK(g.samples[0].fields.size() == 2);
  CHECK(g.samples[0].fields[0].ext == "seg.jpg");
  CHECK(g.samples[0].fields[1].ext == "txt");
}

TEST_CASE("directories, links, devices, metadata and unsplittable names are skipped") {
  HeaderOpts dir, sym, hard, chr, fifo, areg, contig, unknown;
  dir.type = '5', sym.type = '2', hard.type = '1', chr.type = '3', fifo.type = '6';
  areg.type = '\0', contig.type = '7', unknown.type = 'V';
  std::string tar = member("k.dir/", "", dir) + header("k.sym", 0, sym) + header("k.lnk", 0, hard) +
                    header("k.chr", 0, chr) + header("k.fifo", 0, fifo) +
                    member("k.v7dir/", "", areg) +           // old-style directory
                    member("k.vol", std::string(700, 'v'), unknown) +  // unknown: data skipped
                    member("__meta__", "m") + member("__a__/k.x", "m") + member("noext", "n") +
                    member(".hidden", "h") + member("k.areg", "A", areg) + member("k.cont", "C", contig) +
                    kEnd;
  Got g = scan_all(tar);
  CHECK(!g.failed);
  CHECK(g.samples.size() == 1);
  CHECK(g.samples[0].key == "k");
  CHECK(g.samples[0].fields.size() == 2);
  CHECK(g.samples[0].fields[0].ext == "areg" && g.samples[0].fields[0].data == "A");
  CHECK(g.samples[0].fields[1].ext == "cont" && g.samples[0].fields[1].data == "C");
  CHECK(g.stats.skipped == 11);
  CHECK(g.stats.members == 2);
}

TEST_CASE("link and device headers have no data blocks, whatever their size field says") {
  HeaderOpts sym;
  sym.type = '2';
  // tarfile reads the next header right after a symlink header, even with size 1024.
  std::string tar = header("s.lnk", 1024, sym) + member("a.txt", "1") + kEnd;
  Got g = scan_all(tar);
  CHECK(!g.failed);
  CHECK(g.samples.size() == 1 && g.samples[0].key == "a");
}

TEST_CASE("ustar prefix field is joined to the name") {
  HeaderOpts o;
  o.prefix = std::string(150, 'p') + "/q";
  std::string tar = member("name.ext", "x", o) + kEnd;
  Got g = scan_all(tar);
  CHECK(g.samples.size() == 1);
  CHECK(g.samples[0].key == o.prefix + "/name");
}

TEST_CASE("GNU long names and long links") {
  std::string long_key = "deep/" + std::string(300, 'n');
  std::string tar = gnu_long(long_key + ".jpg") + member("truncated-name.jpg", "J") +
                    gnu_long("link/target", 'K') + gnu_long(long_key + ".txt") +
                    member("whatever.txt", "T") + kEnd;
  Got g = scan_all(tar);
  CHECK(!g.failed);
  CHECK(g.samples.size() == 1);
  CHECK(g.samples[0].key == long_key);
  CHECK(g.samples[0].offset == 0);  // the 'L' header's offset
  CHECK(g.samples[0].end_offset == tar.size() - kEnd.size());
  CHECK(g.samples[0].fields.size() == 2);
  CHECK(g.samples[0].fields[1].data == "T");
}

TEST_CASE("pax path and size records override the header") {
  std::string data = bytes(1000, 3);
  std::string tar = pax({{"path", "pax/name.Bin"}, {"size", "1000"}, {"mtime", "1.5"}}) +
                    header("ignored.bin", 7) + pad(data) + member("pax/name.txt", "t") + kEnd;
  Got g = scan_all(tar);
  CHECK(!g.failed);
  CHECK(g.samples.size() == 1);
  CHECK(g.samples[0].key == "pax/name");
  CHECK(g.samples[0].fields[0].ext == "bin" && g.samples[0].fields[0].data == data);
  CHECK(g.samples[0].fields[1].data == "t");
  CHECK(g.samples[0].offset == 0);
}

TEST_CASE("pax path has trailing slashes stripped; size accepts Python int syntax") {
  std::string tar = pax({{"path", "k.a//"}, {"size", " +1_0 "}}) + header("x", 3) +
                    pad("0123456789") + kEnd;
  Got g = scan_all(tar);
  CHECK(!g.failed);
  CHECK(g.samples.size() == 1 && g.samples[0].key == "k");
  CHECK(g.samples[0].fields[0].ext == "a" && g.samples[0].fields[0].data == "0123456789");
}

TEST_CASE("chains of extended headers: the first one naming the member wins") {
  // tarfile applies the headers from the innermost outwards.
  std::string l_then_x = gnu_long("from.L") + pax({{"path", "from.X"}, {"size", "2"}}) +
                         header("from.H", 0) + pad("ab") + kEnd;
  Got a = scan_all(l_then_x);
  CHECK(a.samples.size() == 1 && a.samples[0].key == "from");
  CHECK(a.samples[0].fields[0].ext == "l" && a.samples[0].fields[0].data == "ab");
  CHECK(a.samples[0].offset == 0);

  std::string x_then_l = pax({{"path", "from.X"}}) + gnu_long("from.L") + member("from.H", "z") + kEnd;
  Got b = scan_all(x_then_l);
  CHECK(b.samples.size() == 1 && b.samples[0].fields[0].ext == "x");

  std::string two_l = gnu_long("first.A") + gnu_long("second.B") + member("h.H", "z") + kEnd;
  Got c = scan_all(two_l);
  CHECK(c.samples.size() == 1 && c.samples[0].key == "first");
}

TEST_CASE("global pax headers") {
  // A global comment changes nothing; the member's offset is its own header, not the 'g' one.
  std::string g1 = pax({{"comment", "hello"}}, 'g');
  Got a = scan_all(g1 + member("a.txt", "1") + kEnd);
  CHECK(!a.failed && a.samples.size() == 1 && a.samples[0].offset == g1.size());

  // A global path names every later member; through an 'x' header too, unless it has its own.
  std::string g2 = pax({{"path", "glob.G"}}, 'g');
  Got b = scan_all(g2 + pax({{"comment", "c"}}) + member("a.txt", "1") + kEnd);
  CHECK(b.samples.size() == 1 && b.samples[0].key == "glob" && b.samples[0].offset == g2.size());
  Got c = scan_all(g2 + pax({{"path", "own.X"}}) + member("a.txt", "1") + kEnd);
  CHECK(c.samples.size() == 1 && c.samples[0].key == "own");
  // An 'x' before the 'g' took its copy of the global records earlier: the later 'g' wins.
  Got d = scan_all(pax({{"mtime", "1"}}) + g2 + member("a.txt", "1") + kEnd);
  CHECK(d.samples.size() == 1 && d.samples[0].key == "glob" && d.samples[0].offset == 0);
  // Every member gets the global name: the second is a duplicate.
  Got e = scan_all(g2 + member("a.txt", "1") + member("b.txt", "2") + kEnd);
  CHECK(has_error(e, "duplicate file name in tar file: glob.G"));
}

TEST_CASE("old-style checksums and number encodings") {
  HeaderOpts sgn;
  sgn.signed_checksum = true;
  Got a = scan_all(member("\xc3\xa9\xc3\xa9.x", "s", sgn) + kEnd);
  CHECK(!a.failed && a.samples.size() == 1 && a.samples[0].key == "\xc3\xa9\xc3\xa9");

  const char base256[12] = {'\x80', 0, 0, 0, 0, 0, 0, 0, 0, 0, '\x03', '\xe8'};  // 1000
  HeaderOpts b256;
  b256.size_field = base256;
  Got b = scan_all(header("b.bin", 0, b256) + pad(std::string(1000, 'b')) + kEnd);
  CHECK(!b.failed && b.samples.size() == 1 && b.samples[0].fields[0].data.size() == 1000);

  HeaderOpts spaces;
  spaces.size_field = "   12  \0\0\0\0\0";
  Got c = scan_all(header("c.bin", 0, spaces) + pad(std::string(10, 'c')) + kEnd);
  CHECK(!c.failed && c.samples.size() == 1 && c.samples[0].fields[0].data.size() == 10);
}

TEST_CASE("names with newlines and non-UTF-8 bytes") {
  std::string tar = gnu_long("a\nb/c.d") + member("x", "1") + gnu_long("a\nb/c.e") +
                    member("x", "2") + member("x/y\n.z", "3") + member("k\xff.ext", "4") + kEnd;
  Got g = scan_all(tar);
  CHECK(!g.failed);
  CHECK(g.samples.size() == 3);
  CHECK(g.samples[0].key == "a\nb/c" && g.samples[0].fields.size() == 2);
  CHECK(g.samples[1].key == "x/y\n" && g.samples[1].fields[0].ext == "z");
  CHECK(g.samples[2].key == "k\xff");
}

TEST_CASE("begin_shard offsets, and samples never span shards") {
  std::string part = member("k.a", "1") + member("k.b", "2");
  Got g = scan(part, {0}, 4096);
  CHECK(g.samples.size() == 1);
  CHECK(g.samples[0].offset == 4096 && g.samples[0].end_offset == 4096 + part.size());

  TarScanner sc;
  sc.begin_shard();
  sc.feed(reinterpret_cast<const uint8_t*>(part.data()), part.size());
  sc.end_shard();
  CHECK(sc.samples().size() == 1);
  sc.begin_shard();
  CHECK(sc.samples().empty());
  std::string next = member("k.c", "3");
  sc.feed(reinterpret_cast<const uint8_t*>(next.data()), next.size());
  sc.end_shard();
  CHECK(sc.samples().size() == 1 && sc.samples()[0].key == "k");
  CHECK(sc.samples()[0].fields.size() == 1 && sc.samples()[0].fields[0].ext == "c");
  CHECK(sc.stats().samples == 2);
}

TEST_CASE("data inside one piece is referenced in place; other data is owned") {
  std::string big = bytes(10000, 9);
  std::string tar = member("a.x", "in place") + member("b.x", big) + member("c.x", "last");
  std::vector<uint8_t> buf(tar.begin(), tar.end());
  TarScanner sc;
  sc.begin_shard();
  sc.feed(buf.data(), 2048);  // "a" complete, "b" starts
  CHECK(sc.samples().empty());  // "a" is still open: it was copied
  sc.feed(buf.data() + 2048, buf.size() - 2048);
  auto& s = sc.samples();
  CHECK(s.size() == 2);
  const uint8_t* lo = buf.data();
  const uint8_t* hi = buf.data() + buf.size();
  auto inside = [&](const Field& f) { return f.data >= lo && f.data < hi; };
  CHECK(s[0].fields[0].owned && !inside(s[0].fields[0]));  // was open when feed returned
  CHECK(s[1].fields[0].owned && s[1].fields[0].owned->size() == big.size());  // spanned pieces
  CHECK(std::memcmp(s[1].fields[0].data, big.data(), big.size()) == 0);
  sc.end_shard();
  CHECK(s.size() == 3);
  CHECK(s[2].fields[0].owned);  // open at the end of the second feed

  TarScanner whole;
  whole.begin_shard();
  std::string two = member("a.x", "1") + member("b.x", "2") + kEnd;
  whole.feed(reinterpret_cast<const uint8_t*>(two.data()), two.size());
  CHECK(whole.samples().size() == 2);  // the zero block closed the last sample
  for (auto& smp : whole.samples()) {
    CHECK(!smp.fields[0].owned);
    CHECK(smp.fields[0].data >= reinterpret_cast<const uint8_t*>(two.data()));
    CHECK(smp.fields[0].data < reinterpret_cast<const uint8_t*>(two.data()) + two.size());
  }
  CHECK(whole.at_end());
}

TEST_CASE("empty members have a non-null data pointer") {
  TarScanner sc;
  std::string tar = member("e.x", "") + kEnd;
  sc.feed(reinterpret_cast<const uint8_t*>(tar.data()), tar.size());
  CHECK(sc.samples().size() == 1);
  CHECK(sc.samples()[0].fields[0].size == 0 && sc.samples()[0].fields[0].data != nullptr);
}

// ---- errors ----

TEST_CASE("bad checksums raise, at any offset") {
  HeaderOpts bad;
  bad.checksum_delta = 5;
  Got a = scan_all(member("a.txt", "1", bad) + kEnd);
  CHECK(has_error(a, "invalid tar header checksum at offset 0"));
  Got b = scan_all(member("a.txt", "1") + member("b.txt", "1", bad) + kEnd);
  CHECK(has_error(b, "invalid tar header checksum at offset 1024"));
  CHECK(b.error_offset == 1024);
  // The open sample "a" is complete: it is delivered before the error, as webdataset does
  // (tarfile ends the archive at the bad header and group_by_keys flushes the open sample).
  CHECK(b.samples.size() == 1 && b.samples[0].key == "a");
}

TEST_CASE("a bad header after an extended header loses the open sample, as in webdataset") {
  // tarfile raises (SubsequentHeaderError) instead of ending the archive quietly.
  HeaderOpts bad;
  bad.checksum_delta = 5;
  Got a = scan_all(member("a.txt", "1") + gnu_long("x.y") + member("b.txt", "1", bad) + kEnd);
  CHECK(has_error(a, "invalid tar header checksum at offset 2048"));
  CHECK(a.samples.empty());
  Got b = scan_all((member("a.txt", "1") + gnu_long("x.y") + member("b.txt", "1")).substr(0, 2148));
  CHECK(has_error(b, "truncated tar header at offset 2048"));
  CHECK(b.samples.empty());
}

TEST_CASE("malformed number fields raise") {
  HeaderOpts o;
  o.size_field = "99\0         ";
  Got a = scan_all(member("a.txt", "1") + header("b.bin", 0, o) + kEnd);
  CHECK(has_error(a, "invalid size field"));
  CHECK(a.error_offset == 1024);
  std::string h = header("c.bin", 0);
  h.replace(100, 8, std::string("abc\0\0\0\0\0", 8));  // mode
  h.replace(148, 8, "        ");
  long sum = 0;
  for (char c : h) sum += static_cast<unsigned char>(c);
  put_octal(h, 148, 7, uint64_t(sum));
  Got b = scan_all(h + kEnd);
  CHECK(has_error(b, "invalid mode field"));
  const char negative[12] = {'\xff', '\xff', '\xff', '\xff', '\xff', '\xff',
                             '\xff', '\xff', '\xff', '\xff', '\xff', '\xfe'};
  HeaderOpts neg;
  neg.size_field = negative;
  Got c = scan_all(header("n.bin", 0, neg) + kEnd);
  CHECK(has_error(c, "size out of range"));
}

TEST_CASE("truncated headers and members raise") {
  std::string tar = member("a.txt", "1") + member("b.bin", std::string(2000, 'x'));
  Got a = scan_all(tar.substr(0, 1024 + 300));
  CHECK(has_error(a, "truncated tar header at offset 1024: 300 of 512 bytes"));
  CHECK(a.error_offset == 1324);
  CHECK(a.samples.size() == 1);  // complete before the cut header, as above
  Got b = scan_all(tar.substr(0, 1024 + 512 + 1000));
  CHECK(has_error(b, "truncated member b.bin: 1000 of 2000 bytes"));
  CHECK(b.error_offset == 1024 + 512 + 1000);
  CHECK(b.samples.empty());  // "a" was still open, as in webdataset
  HeaderOpts dir;
  dir.type = 'V';  // skipped data must be complete too
  Got c = scan_all(member("v.vol", std::string(600, 'v'), dir).substr(0, 700));
  CHECK(has_error(c, "truncated member v.vol: 188 of 600 bytes"));
  Got d = scan_all(gnu_long("x.y").substr(0, 520));
  CHECK(has_error(d, "truncated extended tar header at offset 0"));
}

TEST_CASE("an extended header must be followed by a member") {
  Got a = scan_all(member("a.txt", "1") + gnu_long("x.y") + kEnd);
  CHECK(has_error(a, "end of archive right after the extended tar header at offset 1024"));
  Got b = scan_all(member("a.txt", "1") + pax({{"comment", "x"}}, 'g'));
  CHECK(has_error(b, "extended tar header at offset 1024 is not followed by a member"));
}

TEST_CASE("an empty shard raises") {
  TarScanner sc;
  sc.begin_shard(0);
  sc.feed(nullptr, 0);
  bool thrown = false;
  try {
    sc.end_shard();
  } catch (const FormatError& e) {
    thrown = std::string(e.what()) == "empty shard";
  }
  CHECK(thrown);
}

TEST_CASE("duplicate extensions within a sample raise") {
  Got a = scan_all(member("a.txt", "1") + member("a.TXT", "2") + kEnd);
  CHECK(has_error(a, "duplicate file name in tar file: a.TXT"));
  CHECK(a.error_offset == 1024);
  // webdataset's sample dict holds __key__ and __url__ already.
  Got b = scan_all(member("a.__key__", "1") + kEnd);
  CHECK(has_error(b, "duplicate file name in tar file: a.__key__"));
  Got c = scan_all(member("a.txt", "1") + member("a.__url__", "1") + kEnd);
  CHECK(has_error(c, "duplicate file name"));
}

TEST_CASE("sparse members raise") {
  HeaderOpts s;
  s.type = 'S';
  Got a = scan_all(member("s.bin", "", s) + kEnd);
  CHECK(has_error(a, "sparse members are not supported"));
  Got b = scan_all(pax({{"GNU.sparse.major", "1"}, {"GNU.sparse.minor", "0"}}) +
                   member("s.bin", "x") + kEnd);
  CHECK(has_error(b, "sparse members are not supported"));
}

TEST_CASE("malformed pax headers raise") {
  HeaderOpts x;
  x.type = 'x';
  Got a = scan_all(member("p", "99 path=foo.bar\n", x) + member("a.txt", "1") + kEnd);
  CHECK(has_error(a, "malformed pax header record"));
  Got b = scan_all(member("p", "0 path=x\n", x) + member("a.txt", "1") + kEnd);
  CHECK(has_error(b, "malformed pax header record"));
  Got c = scan_all(member("p", "18 path=foo.bar\nzz", x) + member("a.txt", "1") + kEnd);
  CHECK(has_error(c, "malformed pax header record"));
  // The size field says 2, the record (read by tarfile over the padding) says 18.
  Got c2 = scan_all(header("p", 2, x) + pad("18 path=foo.bar\n") + member("a.txt", "1") + kEnd);
  CHECK(has_error(c2, "malformed pax header record"));
  Got d = scan_all(pax({{"size", "12x"}}) + member("a.txt", "1") + kEnd);
  CHECK(has_error(d, "invalid size record"));
  Got e = scan_all(pax({{"size", "5"}}, 'g') + member("a.txt", "1") + kEnd);
  CHECK(has_error(e, "global pax header"));
  // Text that does not start like a record ends parsing quietly, as in tarfile.
  Got f = scan_all(member("p", "junk", x) + member("a.txt", "1") + kEnd);
  CHECK(!f.failed && f.samples.size() == 1 && f.samples[0].key == "a");
}

// ---- the group open when a shard fails (flush_open_group) and shard_only ----
// webdataset (tar_file_iterator over tarfile "r|*", then group_by_keys) yields the sample it was
// assembling when a shard fails unless its handler raises; a False handler ends only the shard
// where tarfile raises inside the member loop (cut member data) or never raises (a bad or cut
// header after the first ends the archive quietly). Checked against webdataset 1.0.2.

TEST_CASE("a cut inside member data hands over the members completed before it") {
  const std::string cls = member("s1.cls", "7"), png = member("s1.png", std::string(900, 'p'));
  const std::string tar = member("s0.cls", "0") + cls + png;
  const uint64_t cut = 2048 + 512 + 100;  // s1.png's data, 100 of 900 bytes
  Got g = scan_all(tar.substr(0, cut));
  CHECK(has_error(g, "truncated member s1.png: 100 of 900 bytes"));
  CHECK(g.error_offset == cut && g.shard_only);
  CHECK(g.samples.size() == 1 && g.samples[0].key == "s0");
  const Got::S want{"s1", 1024, 2048, {{"cls", "7"}}};
  CHECK(g.group.size() == 1 && g.group[0] == want);
  // Cut in the first member of s1: the group is s0, whole (webdataset's current sample).
  Got h = scan_all(tar.substr(0, 1024 + 512));
  CHECK(has_error(h, "truncated member s1.cls: 0 of 1 bytes") && h.shard_only);
  CHECK(h.samples.empty() && h.group.size() == 1 && h.group[0].key == "s0");
}

TEST_CASE("a cut in the padding hands over the whole sample, its end at the cut") {
  const std::string tar = member("a.x", "1") + member("b.y", std::string(20, 'y'));
  const uint64_t cut = 512 + 512 + 512 + 100;
  Got g = scan_all(tar.substr(0, cut));
  CHECK(has_error(g, "truncated tar padding"));
  CHECK(!g.shard_only);  // tarfile raises looking for the next header: a False handler stops
  CHECK(g.samples.size() == 1 && g.samples[0].key == "a");
  CHECK(g.group.size() == 1 && g.group[0].key == "b");
  CHECK(g.group[0].offset == 1024 && g.group[0].end_offset == cut);
  // Cut right after the data: the same.
  Got h = scan_all(tar.substr(0, 512 + 512 + 512 + 20));
  CHECK(has_error(h, "truncated tar padding") && !h.shard_only);
  CHECK(h.group.size() == 1 && h.group[0].end_offset == 512 + 512 + 512 + 20);
}

TEST_CASE("where tarfile ends the archive quietly the group comes before the error") {
  HeaderOpts bad;
  bad.checksum_delta = 5;
  const std::string a = member("s0.x", "0") + member("s1.x", "1");
  Got g = scan_all(a + member("s1.y", "2", bad) + kEnd);
  CHECK(has_error(g, "invalid tar header checksum at offset 2048") && g.shard_only);
  CHECK(g.samples.size() == 2 && g.samples[1].key == "s1" && g.group.empty());
  Got h = scan_all((a + member("s1.y", "2")).substr(0, 2048 + 300));
  CHECK(has_error(h, "truncated tar header at offset 2048") && h.shard_only);
  CHECK(h.samples.size() == 2 && h.group.empty());
  // At offset 0 tarfile raises ("bad checksum", "truncated header"), so webdataset stops.
  Got z = scan_all(member("s0.x", "0", bad) + kEnd);
  CHECK(z.failed && !z.shard_only && z.samples.empty() && z.group.empty());
  Got t = scan_all(member("s0.x", "0").substr(0, 300));
  CHECK(has_error(t, "truncated tar header at offset 0") && !t.shard_only);
  // After an extended header tarfile raises (SubsequentHeaderError): the group is handed over.
  Got x = scan_all(a + gnu_long("s9.z") + member("s9.z", "9", bad) + kEnd);
  CHECK(has_error(x, "invalid tar header checksum at offset 3072") && !x.shard_only);
  CHECK(x.samples.size() == 1 && x.group.size() == 1 && x.group[0].key == "s1");
  Got y = scan_all((a + gnu_long("s9.z") + member("s9.z", "9")).substr(0, 3072 + 100));
  CHECK(has_error(y, "truncated tar header at offset 3072") && !y.shard_only);
  CHECK(y.samples.size() == 1 && y.group.size() == 1 && y.group[0].key == "s1");
}

TEST_CASE("cut data webdataset never reads stops the stream there") {
  // tar_file_iterator reads every regular member that is not metadata, even one without a key.
  const std::string head = member("s0.x", "0");
  Got keyless = scan_all((head + member("README", std::string(900, 'r'))).substr(0, 1024 + 600));
  CHECK(has_error(keyless, "truncated member README") && keyless.shard_only);
  CHECK(keyless.group.size() == 1 && keyless.group[0].key == "s0");
  Got meta = scan_all((head + member("__meta__", std::string(900, 'm'))).substr(0, 1024 + 600));
  CHECK(has_error(meta, "truncated member __meta__") && !meta.shard_only);
  CHECK(meta.group.size() == 1 && meta.group[0].key == "s0");
  HeaderOpts volume;
  volume.type = 'V';
  Got v = scan_all((head + member("v.vol", std::string(900, 'v'), volume)).substr(0, 1024 + 600));
  CHECK(has_error(v, "truncated member v.vol") && !v.shard_only);
  Got ext = scan_all((head + gnu_long("s1.x")).substr(0, 1024 + 520));
  CHECK(has_error(ext, "truncated extended tar header") && !ext.shard_only);
  CHECK(ext.group.size() == 1 && ext.group[0].key == "s0");
}

TEST_CASE("no group to hand over, and nothing after it") {
  Got empty_cut = scan_all(member("s0.x", std::string(600, 'x')).substr(0, 700));
  CHECK(empty_cut.failed && empty_cut.group.empty());  // cut in the only sample's only member
  TarScanner sc;
  sc.begin_shard(0);
  const std::string tar = member("s0.x", "0") + member("s1.x", std::string(900, '1'));
  sc.feed(reinterpret_cast<const uint8_t*>(tar.data()), 1024 + 512 + 10);
  bool shard_only = false;
  try {
    sc.end_shard();
  } catch (const FormatError& e) {
    shard_only = e.shard_only();
  }
  // s1 has no complete member: the open group is still s0 (a new key starts a new sample only
  // when its first member is complete).
  CHECK(shard_only && sc.samples().empty());
  CHECK(sc.flush_open_group());
  CHECK(sc.samples().size() == 1 && sc.samples()[0].key == "s0");
  CHECK(!sc.flush_open_group());
  const std::string more = member("s2.x", "2");  // ignored until begin_shard
  sc.feed(reinterpret_cast<const uint8_t*>(more.data()), more.size());
  CHECK(sc.samples().size() == 1);
  sc.begin_shard(0);
  sc.feed(reinterpret_cast<const uint8_t*>(more.data()), more.size());
  sc.end_shard();
  CHECK(sc.samples().size() == 1 && sc.samples()[0].key == "s2");
}

TEST_CASE("index-only mode hands over the same group, without data") {
  const std::string tar = member("s0.x", "0") + member("s1.a", "1") + member("s1.b", "22") +
                          member("s1.c", std::string(3000, 'c'));
  Got full = scan_all(tar.substr(0, tar.size() - 1000));
  CHECK(full.group.size() == 1 && full.group[0].fields.size() == 2);
  TarScanner sc;
  sc.set_index_only(true);
  sc.begin_shard(0);
  const size_t cut = tar.size() - 1000;
  bool thrown = false;
  try {
    sc.feed(reinterpret_cast<const uint8_t*>(tar.data()), 2048);
    while (sc.position() < cut) {
      const uint64_t hop = std::min<uint64_t>(sc.skippable(), cut - sc.position());
      if (hop > 0) {
        sc.skip(hop);
      } else {
        sc.feed(reinterpret_cast<const uint8_t*>(tar.data()) + sc.position(), 512);
      }
    }
    sc.end_shard();
  } catch (const FormatError& e) {
    thrown = e.shard_only();
  }
  CHECK(thrown);
  CHECK(sc.flush_open_group());
  CHECK(sc.samples().size() == 2);
  const Sample& group = sc.samples()[1];
  CHECK(group.key == "s1" && group.fields.size() == 2 && group.fields[1].data == nullptr);
  CHECK(group.offset == full.group[0].offset && group.end_offset == full.group[0].end_offset);
}

TEST_MAIN()
