// TarScanner: see tar_scanner.hpp. Member rules follow CPython 3.11 tarfile read in stream mode
// ("r|*"); sample rules follow webdataset 1.0.2 (tar_file_iterator, base_plus_ext,
// group_by_keys). Where tarfile silently stops on a damaged archive, we raise FormatError
// (marked shard_only: webdataset goes on with the next shard there).
#include "tar/tar_scanner.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <unordered_set>

#include "common/errors.hpp"
#include "tar/tar_format.hpp"

namespace flashstream {

constexpr size_t kLinearDuplicateCheck = 16;  // fields checked one by one below this

using tar::fail;
using tar::kBlock;

// re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name). Working through the backtracking: the
// extension cannot hold '/', and `[^.]+` runs to the first dot after where it starts, so on a
// match the key always ends at the first dot after the last '/'. What remains is whether some
// start p for `[^.]+` works: p is 0 or just after a '/' that `.*/` can reach (no '\n' before
// it, since '.' does not match '\n'); name[p] must not be '.', and no '.' may lie between p and
// the last '/' (else `[^.]+` would stop before the last '/'). `$` also matches before a final
// '\n', but the greedy `[^/]*` reaches the true end first, so the extension keeps that '\n'.
bool split_key(std::string_view name, std::string_view* key, std::string_view* ext) {
  constexpr size_t npos = std::string_view::npos;
  const size_t last_slash = name.rfind('/');
  const size_t dot = name.find('.', last_slash == npos ? 0 : last_slash + 1);
  if (dot == npos) return false;
  bool ok = false;
  if (last_slash == npos) {
    ok = name[0] != '.';
  } else {
    const size_t dot_before = name.rfind('.', last_slash);  // p must lie after it
    const size_t newline = name.find('\n');                 // `.*/` cannot reach past it
    size_t slash = last_slash;
    while (!ok) {
      const size_t p = slash + 1;
      if (dot_before != npos && p <= dot_before) return false;
      ok = slash < newline && name[p] != '.';
      if (slash == 0) break;
      slash = name.rfind('/', slash - 1);
      if (slash == npos) break;
    }
    if (!ok) ok = dot_before == npos && name[0] != '.';  // p = 0, the empty alternative
  }
  if (!ok) return false;
  *key = name.substr(0, dot);
  *ext = name.substr(dot + 1);
  return true;
}

// tar_file_iterator skips a name when it has no '/' and starts and ends with "__", or when
// re.match(r"__[^/]*__($|/)", name): "__", then "__" again right before the first '/', the
// end, or a final '\n' (where Python's `$` also matches).
bool is_meta_name(std::string_view name) {
  if (name.size() < 2 || name[0] != '_' || name[1] != '_') return false;
  const size_t slash = name.find('/');
  if (slash == std::string_view::npos) {
    const size_t n = name.size();
    const bool ends_meta = name[n - 1] == '_' && name[n - 2] == '_';
    const bool ends_meta_newline = n >= 5 && name.substr(n - 3) == "__\n";
    return ends_meta || ends_meta_newline;
  }
  return slash >= 4 && name[slash - 1] == '_' && name[slash - 2] == '_';
}

namespace {

enum class Phase : uint8_t {
  kHeader,   // collecting a 512-byte header block
  kExtData,  // collecting the data of an extended header (GNU 'L', pax 'x'/'X'/'g')
  kData,     // collecting the data of a member that goes into a sample
  kSkip,     // skipping data nobody reads, and padding
  kEnd,      // past the end-of-archive block (or end_shard): bytes are ignored
};

// REGTYPE, AREGTYPE, CONTTYPE ('S' sparse is regular too, but rejected).
bool is_regular(char type) { return type == '0' || type == '\0' || type == '7'; }

// Link, symlink, char, block, directory, fifo: tarfile reads no data blocks after these, so
// the next header follows directly whatever the size field says. All other types (regular
// and unknown ones) are followed by size bytes of data, padded to a block.
bool has_no_data(char type) { return type >= '1' && type <= '6'; }

void rstrip_slashes(std::string& s) {
  while (!s.empty() && s.back() == '/') s.pop_back();
}

const uint8_t kEmpty[1] = {0};  // data pointer for empty fields, so it is never null

// Extended headers seen since the last member; they describe the next member.
struct Pending {
  bool active = false;
  uint64_t first_offset = 0;  // first extended header of any type
  bool has_offset = false;    // tarfile reports the first L/K/x/X header as the member's offset
  uint64_t offset = 0;
  // tarfile applies the headers from the innermost outwards, so the first one (in stream order)
  // that sets a name or size wins.
  bool has_name = false;
  std::string name;
  bool has_size = false;
  uint64_t size = 0;

  void reset() { active = has_offset = has_name = has_size = false; }
};

}  // namespace

struct TarScanner::State {
  // Outputs, rebound by every public call so that the TarScanner may move.
  std::vector<Sample>* samples = nullptr;
  ScanStats* stats = nullptr;

  Phase phase = Phase::kHeader;
  bool index_only = false;  // member data is counted, never referenced (see set_index_only)
  bool saw_end_block = false;
  bool fed = false;
  uint64_t pos = 0;  // shard offset of the next byte

  uint8_t header[kBlock];  // a header block that straddles fed pieces
  size_t header_fill = 0;

  Pending pending;
  bool has_global_path = false;  // "path" from a pax 'g' header applies to all later members
  std::string global_path;

  char ext_type = 0;  // the extended header whose data is being collected
  uint64_t ext_offset = 0;
  uint64_t ext_need = 0;
  std::string ext_data;

  // The member (or extended header) whose data is being read or skipped.
  std::string name;
  uint64_t member_offset = 0;
  uint64_t size = 0;
  uint64_t got = 0;
  uint64_t data_end = 0;  // shard offset just past the data proper
  uint64_t skip_end = 0;  // ... and past its padding
  bool data_read = false;  // webdataset reads this member's data (see begin_member)
  std::string key, ext;
  std::shared_ptr<std::vector<uint8_t>> assembled;  // data spanning pieces

  Sample open;  // the sample being grouped; emitted when the key changes or the shard ends
  // The open sample's extensions, once it has kLinearDuplicateCheck of them (see
  // finish_member): checked one by one, a key with very many members is quadratic.
  std::unordered_set<std::string> open_exts;

  void begin(uint64_t start_offset);
  void feed(const uint8_t* p, size_t n);
  void end();
  uint64_t skippable() const noexcept;
  void skip(uint64_t n);
  bool flush_open_group();

 private:
  const uint8_t* take_header(const uint8_t* p, const uint8_t* end);
  const uint8_t* take_ext_data(const uint8_t* p, const uint8_t* end);
  const uint8_t* take_data(const uint8_t* p, const uint8_t* end);
  const uint8_t* take_skip(const uint8_t* p, const uint8_t* end);
  void on_header(const uint8_t* h, uint64_t offset);
  void on_end_block(uint64_t offset);
  void begin_extended(const tar::RawHeader& h, uint64_t offset);
  void finish_extended();
  void apply_pax(bool global);
  void begin_member(const tar::RawHeader& h, uint64_t offset);
  void finish_member(const uint8_t* data, std::shared_ptr<std::vector<uint8_t>> owned);
  void enter_skip() { phase = pos < skip_end ? Phase::kSkip : Phase::kHeader; }
  void reset_open() {
    open = Sample();
    open_exts.clear();
  }
  void emit_open();
  void own_open_fields();
};

void TarScanner::State::begin(uint64_t start_offset) {
  phase = Phase::kHeader;
  saw_end_block = fed = false;
  pos = start_offset;
  header_fill = 0;
  pending.reset();
  has_global_path = false;
  assembled.reset();
  reset_open();
}

void TarScanner::State::feed(const uint8_t* p, size_t n) {
  stats->bytes += n;
  fed = fed || n > 0;
  const uint8_t* end = p + n;
  try {
    while (p != end) {
      switch (phase) {
        case Phase::kHeader: p = take_header(p, end); break;
        case Phase::kExtData: p = take_ext_data(p, end); break;
        case Phase::kData: p = take_data(p, end); break;
        case Phase::kSkip: p = take_skip(p, end); break;
        case Phase::kEnd: pos += end - p; p = end; break;
      }
    }
  } catch (const FormatError&) {
    own_open_fields();  // the open group may still be handed over (flush_open_group)
    throw;
  }
  own_open_fields();  // the caller reuses the piece's memory after we return
}

uint64_t TarScanner::State::skippable() const noexcept {
  switch (phase) {
    case Phase::kData: return index_only ? size - got : 0;
    case Phase::kSkip: return skip_end - pos;
    case Phase::kEnd: return UINT64_MAX;
    default: return 0;
  }
}

void TarScanner::State::skip(uint64_t n) {
  if (n > skippable()) throw std::logic_error("TarScanner::skip past the bytes it may skip");
  stats->bytes += n;
  if (phase == Phase::kEnd) {
    pos += n;
  } else if (phase == Phase::kData) {
    got += n;
    pos += n;
    if (got == size) finish_member(nullptr, nullptr);
  } else if (n > 0) {
    pos += n;
    if (pos == skip_end) phase = Phase::kHeader;
  }
}

void TarScanner::State::end() {
  if (!fed) fail(pos, "empty shard");
  if (phase == Phase::kEnd) return;
  const std::string at = " (shard ends at offset " + std::to_string(pos) + ")";
  if (phase == Phase::kHeader && header_fill > 0) {
    // tarfile ends the archive quietly at a cut header, except at offset 0 or right after an
    // extended header (it raises there); as in on_header, the open sample is complete.
    const uint64_t header_at = pos - header_fill;
    if (!pending.active) emit_open();
    fail(pos, "truncated tar header at offset " + std::to_string(header_at) + ": " +
                  std::to_string(header_fill) + " of 512 bytes",
         !pending.active && header_at > 0);
  }
  if (phase == Phase::kExtData || (pending.active && pos < data_end))
    fail(pos, "truncated extended tar header at offset " + std::to_string(ext_offset) + at);
  // tarfile raises inside webdataset's member loop when it reads the cut data (shard_only);
  // data webdataset does not read is found cut at the next header, outside it.
  if (phase == Phase::kData || (phase == Phase::kSkip && pos < data_end))
    fail(pos, "truncated member " + name + ": " + std::to_string(size - (data_end - pos)) +
                  " of " + std::to_string(size) + " bytes" + at,
         data_read);
  // Cut inside the padding after a member's data: a download that stopped there. The member
  // is whole, but tarfile (so webdataset) raises as it looks for the next header; the open
  // sample goes to the handler's policy (flush_open_group).
  if (phase == Phase::kSkip)
    fail(pos, "truncated tar padding after member " + name + ": the shard ends " +
                  std::to_string(skip_end - pos) + " bytes short of a 512-byte block" + at);
  if (pending.active)
    fail(pos, "extended tar header at offset " + std::to_string(pending.first_offset) +
                  " is not followed by a member" + at);
  emit_open();
  phase = Phase::kEnd;
}

const uint8_t* TarScanner::State::take_header(const uint8_t* p, const uint8_t* end) {
  const size_t avail = end - p;
  if (header_fill == 0 && avail >= kBlock) {  // the usual case: parse in place
    pos += kBlock;
    on_header(p, pos - kBlock);
    return p + kBlock;
  }
  const size_t take = std::min<size_t>(kBlock - header_fill, avail);
  std::memcpy(header + header_fill, p, take);
  header_fill += take;
  pos += take;
  if (header_fill == kBlock) {
    header_fill = 0;
    on_header(header, pos - kBlock);
  }
  return p + take;
}

const uint8_t* TarScanner::State::take_ext_data(const uint8_t* p, const uint8_t* end) {
  const size_t take = std::min<uint64_t>(ext_need - ext_data.size(), end - p);
  ext_data.append(reinterpret_cast<const char*>(p), take);
  pos += take;
  if (ext_data.size() == ext_need) finish_extended();
  return p + take;
}

const uint8_t* TarScanner::State::take_data(const uint8_t* p, const uint8_t* end) {
  const uint64_t need = size - got;
  const size_t avail = end - p;
  if (index_only) {
    const size_t take = std::min<uint64_t>(need, avail);
    got += take;
    pos += take;
    if (got == size) finish_member(nullptr, nullptr);
    return p + take;
  }
  if (got == 0 && avail >= need) {  // wholly inside this piece: reference it in place
    pos += need;
    got = size;
    finish_member(p, nullptr);
    return p + need;
  }
  if (!assembled) {
    assembled = std::make_shared<std::vector<uint8_t>>();
    assembled->reserve(std::min<uint64_t>(size, 1ull << 30));  // a corrupt size must not OOM
  }
  const size_t take = std::min<uint64_t>(need, avail);
  assembled->insert(assembled->end(), p, p + take);
  got += take;
  pos += take;
  if (got == size) {
    const uint8_t* data = assembled->data();
    finish_member(data, std::move(assembled));
  }
  return p + take;
}

const uint8_t* TarScanner::State::take_skip(const uint8_t* p, const uint8_t* end) {
  const size_t take = std::min<uint64_t>(skip_end - pos, end - p);
  pos += take;
  if (pos == skip_end) phase = Phase::kHeader;
  return p + take;
}

void TarScanner::State::on_header(const uint8_t* h, uint64_t offset) {
  tar::RawHeader raw;
  bool is_header = false;
  try {
    is_header = tar::parse_header(h, offset, &raw);
  } catch (const FormatError& e) {
    // Every member of the open sample is complete: deliver it before the error, as webdataset
    // does (tarfile ends the archive quietly at a bad header after the first, and the open
    // sample is flushed): shard_only. Not after an extended header, nor at offset 0: tarfile
    // raises there, and the open sample goes to the handler's policy (flush_open_group).
    if (pending.active || offset == 0) throw;
    emit_open();
    throw FormatError(e.what(), e.offset(), true);
  }
  if (!is_header) return on_end_block(offset);
  switch (raw.type) {
    case 'L': case 'K': case 'x': case 'X': case 'g':
      return begin_extended(raw, offset);
    case 'S':
      fail(offset, "sparse members are not supported (header at offset " +
                       std::to_string(offset) + ")");
    default:
      return begin_member(raw, offset);
  }
}

// tarfile ends the archive at the first zero block and never looks further.
void TarScanner::State::on_end_block(uint64_t offset) {
  if (pending.active)  // tarfile: SubsequentHeaderError
    fail(offset, "end of archive right after the extended tar header at offset " +
                     std::to_string(pending.first_offset));
  emit_open();
  saw_end_block = true;
  phase = Phase::kEnd;
}

void TarScanner::State::begin_extended(const tar::RawHeader& h, uint64_t offset) {
  if (h.size > tar::kMaxExtendedHeader)
    fail(offset, "extended tar header at offset " + std::to_string(offset) + " is too large");
  if (!pending.active) {
    pending.active = true;
    pending.first_offset = offset;
  }
  if (h.type != 'g' && !pending.has_offset) {
    pending.has_offset = true;
    pending.offset = offset;
  }
  ext_type = h.type;
  ext_offset = offset;
  // tarfile reads 'L' and pax data with their padding blocks; 'K' (long link) is unused.
  ext_need = h.type == 'K' ? 0 : tar::padded(h.size);
  ext_data.clear();
  size = h.size;
  data_end = pos + h.size;
  skip_end = pos + tar::padded(h.size);
  if (ext_need == 0)
    finish_extended();
  else
    phase = Phase::kExtData;
}

void TarScanner::State::finish_extended() {
  if (ext_type == 'L' && !pending.has_name) {
    pending.has_name = true;
    pending.name.assign(tar::nts(ext_data.data(), ext_data.size()));
  } else if (ext_type == 'x' || ext_type == 'X' || ext_type == 'g') {
    apply_pax(ext_type == 'g');
  }
  enter_skip();
}

// A pax 'x' header's records are applied on top of a copy of the global ('g') records, so its
// path is its own "path" record or else the global one.
void TarScanner::State::apply_pax(bool global) {
  std::string_view path, size_text;
  bool has_path = false, has_size = false;
  tar::parse_pax_records(ext_data, size, ext_offset, [&](std::string_view keyword, std::string_view value) {
    if (keyword == "path") {
      has_path = true;
      path = value;
    } else if (keyword == "size") {
      has_size = true;
      size_text = value;
    } else if (keyword.substr(0, 11) == "GNU.sparse.") {
      fail(ext_offset, "sparse members are not supported (pax header at offset " +
                           std::to_string(ext_offset) + ")");
    }
  });
  if (global) {
    // tarfile would report this size yet skip by the header's: refuse rather than guess.
    if (has_size) fail(ext_offset, "size record in a global pax header is not supported");
    if (has_path) {
      has_global_path = true;
      global_path.assign(path);
    }
    return;
  }
  if (!pending.has_name && (has_path || has_global_path)) {
    pending.has_name = true;
    pending.name.assign(has_path ? path : std::string_view(global_path));
    rstrip_slashes(pending.name);  // tarfile's _apply_pax_info strips them
  }
  if (has_size) {
    int64_t value = 0;
    if (tar::py_int(size_text, 10, &value) != tar::IntParse::kOk || value < 0 ||
        uint64_t(value) > tar::kMaxMemberSize)
      fail(ext_offset, "invalid size record in pax header at offset " + std::to_string(ext_offset));
    if (!pending.has_size) {
      pending.has_size = true;
      pending.size = uint64_t(value);
    }
  }
}

void TarScanner::State::begin_member(const tar::RawHeader& h, uint64_t offset) {
  member_offset = pending.has_offset ? pending.offset : offset;
  // Name precedence as in tarfile: extended headers, then a global pax path, then the header
  // (ustar prefix joined, unless the type is a GNU one, which are all handled elsewhere).
  if (pending.has_name) {
    name.swap(pending.name);
  } else if (has_global_path) {
    name.assign(global_path);
    rstrip_slashes(name);
  } else if (!h.prefix.empty()) {
    name.assign(h.prefix).append(1, '/').append(h.name);
  } else {
    name.assign(h.name);
  }
  char type = h.type;
  if (type == '\0' && !h.name.empty() && h.name.back() == '/') type = '5';  // old V7 directory
  size = pending.has_size ? pending.size : h.size;
  pending.reset();

  const bool regular = is_regular(type);
  const bool has_data = !has_no_data(type);
  data_end = pos + (has_data ? size : 0);
  skip_end = pos + (has_data ? tar::padded(size) : 0);
  // tar_file_iterator reads every regular member that is not metadata, even one whose name
  // has no key (group_by_keys drops it later): its cut data raises inside the member loop.
  const bool meta = regular && is_meta_name(name);
  data_read = regular && !meta;

  std::string_view k, e;
  if (!regular || meta || !split_key(name, &k, &e)) {
    ++stats->skipped;
    return enter_skip();
  }
  key.assign(k);
  ext.assign(e);
  for (char& c : ext)
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  got = 0;
  if (size == 0)
    finish_member(kEmpty, nullptr);
  else
    phase = Phase::kData;
}

// group_by_keys: a new key starts a new sample; an extension already in the sample is an error.
// webdataset's sample dict also holds "__key__" and "__url__", so those extensions collide too.
void TarScanner::State::finish_member(const uint8_t* data,
                                      std::shared_ptr<std::vector<uint8_t>> owned) {
  if (!open.fields.empty() && open.key != key) emit_open();
  if (open.fields.empty()) {
    open.key = key;
    open.offset = member_offset;
  }
  bool duplicate = ext == "__key__" || ext == "__url__";
  if (open.fields.size() < kLinearDuplicateCheck) {
    for (const Field& f : open.fields) duplicate = duplicate || f.ext == ext;
  } else {  // a sample of many members: a scan per member would be quadratic
    if (open_exts.empty())
      for (const Field& f : open.fields) open_exts.insert(f.ext);
    duplicate = !open_exts.insert(ext).second || duplicate;
  }
  if (duplicate) fail(member_offset, "duplicate file name in tar file: " + name);

  Field& f = open.fields.emplace_back();
  f.ext = std::move(ext);
  f.data = data;
  f.size = size;
  f.owned = std::move(owned);
  open.end_offset = skip_end;
  ++stats->members;
  enter_skip();
}

bool TarScanner::State::flush_open_group() {
  phase = Phase::kEnd;
  if (open.fields.empty()) return false;
  open.end_offset = std::min(open.end_offset, pos);  // a cut inside its last padding
  emit_open();
  return true;
}

void TarScanner::State::emit_open() {
  if (open.fields.empty()) return;
  samples->push_back(std::move(open));
  reset_open();
  ++stats->samples;
}

void TarScanner::State::own_open_fields() {
  if (index_only) return;  // no field points at data
  for (Field& f : open.fields) {
    if (f.owned || f.size == 0) continue;
    f.owned = std::make_shared<std::vector<uint8_t>>(f.data, f.data + f.size);
    f.data = f.owned->data();
  }
}

TarScanner::TarScanner() : state_(std::make_shared<State>()) { begin_shard(0); }

void TarScanner::begin_shard(uint64_t start_offset) {
  samples_.clear();
  state_->begin(start_offset);
}

void TarScanner::feed(const uint8_t* data, size_t size) {
  state_->samples = &samples_;
  state_->stats = &stats_;
  state_->feed(data, size);
}

void TarScanner::end_shard() {
  state_->samples = &samples_;
  state_->stats = &stats_;
  state_->end();
}

bool TarScanner::at_end() const noexcept { return state_->saw_end_block; }

void TarScanner::set_index_only(bool on) noexcept { state_->index_only = on; }

uint64_t TarScanner::skippable() const noexcept { return state_->skippable(); }

void TarScanner::skip(uint64_t n) {
  state_->samples = &samples_;
  state_->stats = &stats_;
  state_->skip(n);
}

uint64_t TarScanner::position() const noexcept { return state_->pos; }

bool TarScanner::flush_open_group() {
  state_->samples = &samples_;
  state_->stats = &stats_;
  return state_->flush_open_group();
}

}  // namespace flashstream
