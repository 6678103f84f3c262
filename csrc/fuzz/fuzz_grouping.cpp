// libFuzzer harness for sample grouping, differential against a model of webdataset.
//
// The input describes members (a name built from tokens chosen to hit the grouping rules: dots,
// slashes, "__", reserved keys, letter case, a non-ASCII letter; and a payload size). The
// harness writes them as a ustar archive, scans it in pieces (fuzz/pieces.hpp), and compares
// the samples with what webdataset yields for the same members: base_plus_ext
// (re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$"), std::regex here: the tokens avoid the line
// breaks where ECMAScript and Python regexes differ), the metadata filters ("__x__" and
// skip_meta=r"__[^/]*__($|/)"),
// extensions lowercased, a key change closing a sample, a duplicate extension (or "__key__",
// "__url__") being an error.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "common/errors.hpp"
#include "fuzz/pieces.hpp"
#include "tar/tar_scanner.hpp"
#include "tests/tar_writer.hpp"

using namespace flashstream;

namespace {

struct Member {
  std::string name;
  size_t size;
  uint8_t fill;
};

struct ModelSample {
  std::string key;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> fields;
};

const char* const kTokens[] = {"a", "b", "B", ".", "/", "_", "__", "key", "url", "K",
                               "\xe2\x84\xaa" /* KELVIN SIGN */, "x.y", "0", ".tar", "__key__"};

// Members from the input: per member one byte for the token count, then that many token bytes,
// then two bytes of size. Names are capped to fit a ustar name field.
std::vector<Member> parse(const uint8_t* data, size_t size) {
  std::vector<Member> out;
  size_t at = 0;
  while (at < size && out.size() < 64) {
    const size_t count = 1 + data[at++] % 8;
    std::string name;
    for (size_t i = 0; i < count && at < size; ++i)
      name += kTokens[data[at++] % (sizeof kTokens / sizeof kTokens[0])];
    if (name.size() > 99) name.resize(99);
    size_t n = 0;
    if (at + 2 <= size) n = (size_t(data[at]) | size_t(data[at + 1]) << 8) % 1500, at += 2;
    out.push_back({name, n, static_cast<uint8_t>(out.size() + 1)});
  }
  return out;
}

std::vector<uint8_t> write_tar(const std::vector<Member>& members) {
  std::string tar;
  for (const Member& m : members) tar += fstest::tarw::member(m.name, std::string(m.size, char(m.fill)));
  tar += fstest::tarw::kEnd;
  return std::vector<uint8_t>(tar.begin(), tar.end());
}

// webdataset's tar_file_iterator + group_by_keys, or nullopt where it raises.
std::optional<std::vector<ModelSample>> model(const std::vector<Member>& members) {
  static const std::regex split(R"(^((?:.*/|)[^.]+)[.]([^/]*)$)");
  static const std::regex skip_meta(R"(__[^/]*__($|/))");  // tar_file_iterator's default
  std::vector<ModelSample> out;
  std::optional<ModelSample> current;
  for (const Member& m : members) {
    const std::string& n = m.name;
    const bool meta = n.find('/') == std::string::npos && n.size() >= 2 &&
                      n.compare(0, 2, "__") == 0 && n.compare(n.size() - 2, 2, "__") == 0;
    if (meta || std::regex_search(n, skip_meta, std::regex_constants::match_continuous)) continue;
    std::smatch match;
    if (!std::regex_match(n, match, split)) continue;
    const std::string key = match[1];
    std::string ext = match[2];
    for (char& c : ext)
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    if (!current || current->key != key) {
      if (current) out.push_back(std::move(*current));
      current = ModelSample{key, {}};
    }
    if (ext == "__key__" || ext == "__url__") return std::nullopt;
    for (const auto& f : current->fields)
      if (f.first == ext) return std::nullopt;
    current->fields.emplace_back(ext, std::vector<uint8_t>(m.size, m.fill));
  }
  if (current) out.push_back(std::move(*current));
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<Member> members = parse(data, size);
  const std::vector<uint8_t> tar = write_tar(members);
  const auto want = model(members);

  TarScanner scanner;
  scanner.begin_shard(0);
  std::vector<ModelSample> got;
  auto take = [&] {
    for (const Sample& s : scanner.samples()) {
      ModelSample g{s.key, {}};
      for (const Field& f : s.fields)
        g.fields.emplace_back(f.ext, std::vector<uint8_t>(f.data, f.data + f.size));
      got.push_back(std::move(g));
    }
    scanner.clear_samples();
  };
  bool raised = false;
  try {
    for (const fuzz::Piece& p : fuzz::split(tar.data(), tar.size())) {
      std::vector<uint8_t> piece(tar.begin() + p.offset, tar.begin() + p.offset + p.size);
      scanner.feed(piece.data(), piece.size());
      take();
    }
    scanner.end_shard();
    take();
  } catch (const FormatError&) {
    raised = true;
  }
  if (!want) {
    fuzz::require(raised, "webdataset raises (duplicate field) where the scanner does not");
    return 0;
  }
  if (members.empty()) return 0;  // an archive of nothing but its end: either answer is fine
  fuzz::require(!raised, "the scanner raises where webdataset does not");
  fuzz::require(got.size() == want->size(), "a different number of samples");
  for (size_t i = 0; i < got.size(); ++i) {
    fuzz::require(got[i].key == (*want)[i].key, "a different key");
    fuzz::require(got[i].fields == (*want)[i].fields, "different fields");
  }
  return 0;
}
