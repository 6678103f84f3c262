// Push parser for tar streams that groups members into WebDataset samples.
//
// Bytes of one shard are fed in order, in pieces of any size (chunks from the reader, or
// decompressed gzip output). The scanner parses 512-byte headers (ustar, GNU long names, pax
// 'x'/'g' records, old v7), follows Python tarfile's rules for names and member types, and
// applies webdataset's rules for keys (`base_plus_ext`), skipped metadata members, lowercase
// extensions and sample boundaries (a new key starts a new sample; a repeated extension within
// one sample is an error). Samples never span shards.
//
// Memory: member data lying wholly inside one fed piece is referenced in place (no copy); data
// that spans pieces, or belongs to the sample still open when feed() returns, is copied into
// buffers the scanner owns. So samples() emitted by a feed() may point into that piece: the
// caller consumes them (clear_samples) before the piece's memory is reused or freed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace flashstream {

struct Field {
  std::string ext;  // extension after the key's first dot, ASCII-lowercased
  const uint8_t* data = nullptr;  // null in index-only mode (see set_index_only)
  uint64_t size = 0;
  std::shared_ptr<std::vector<uint8_t>> owned;  // set when `data` points into scanner storage
};

struct Sample {
  std::string key;          // raw bytes of the key (the name's bytes up to the split point)
  std::vector<Field> fields;  // in member order
  uint64_t offset = 0;      // shard offset of the first header belonging to the first member
  uint64_t end_offset = 0;  // shard offset just past the last member's padded data
};

struct ScanStats {
  uint64_t members = 0;       // regular-file members delivered into samples
  uint64_t skipped = 0;       // directories, links, metadata and unsplittable names
  uint64_t samples = 0;
  uint64_t bytes = 0;         // shard bytes consumed
};

// webdataset's base_plus_ext: re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name). Returns false
// when the pattern does not match (such members are skipped, as webdataset skips them).
bool split_key(std::string_view name, std::string_view* key, std::string_view* ext);

// webdataset's metadata filter: names like "__meta__" or "__x__/..." are skipped.
bool is_meta_name(std::string_view name);

class TarScanner {
 public:
  TarScanner();

  // Starts a new shard. `start_offset` is the shard offset of the first byte fed (0 normally;
  // a 512-aligned header offset when resuming mid-shard). Clears pending state and samples.
  void begin_shard(uint64_t start_offset = 0);

  // Parses `size` bytes that follow the previously fed bytes. Completed samples are appended
  // to samples(). Throws FormatError (bad checksum, bad number field, duplicate extension in
  // a sample, unsupported sparse member, ...) with the shard offset of the offending header.
  void feed(const uint8_t* data, size_t size);

  // No more bytes for this shard. Flushes the last sample. Throws FormatError for an empty
  // shard, a truncated header or a truncated member (offset = where the shard ended).
  void end_shard();

  // After feed() or end_shard() threw FormatError: hands over the group of members being
  // assembled when the shard failed (webdataset's current sample: the members completed
  // before the bad spot, possibly all of the sample's) by appending it to samples(), with its
  // end_offset cut to the bytes fed; returns false when there is none. Whether to deliver it
  // is the caller's policy: webdataset yields it unless its handler raises. Ends the shard:
  // later bytes are ignored until begin_shard. Where tarfile ends the archive quietly (a bad
  // or cut header after the first) the scanner already delivered the group before throwing.
  bool flush_open_group();

  // True once the end-of-archive marker (a zero block) was seen; later bytes are ignored.
  bool at_end() const noexcept;

  // Index-only mode (for building shard indexes): member data is neither referenced nor
  // copied, so samples carry their key, field extensions and sizes and the two offsets, but
  // every Field::data is null. Names, grouping and errors are exactly as in the full mode.
  // Set it before feeding a shard; it stays until changed.
  void set_index_only(bool on) noexcept;

  // Index-only mode: how many of the bytes from the current position on the scanner would
  // only count, not look at (member data and padding); 0 when it needs the next byte (a header
  // or an extended header's data). After the end-of-archive block: UINT64_MAX.
  uint64_t skippable() const noexcept;

  // Index-only mode: consume `n` <= skippable() bytes without their contents, as feeding them
  // would (a member whose data ends here completes its field).
  void skip(uint64_t n);

  // Shard offset of the next byte to be fed.
  uint64_t position() const noexcept;

  std::vector<Sample>& samples() noexcept { return samples_; }
  void clear_samples() noexcept { samples_.clear(); }
  const ScanStats& stats() const noexcept { return stats_; }

 private:
  struct State;
  std::shared_ptr<State> state_;
  std::vector<Sample> samples_;
  ScanStats stats_;
};

}  // namespace flashstream
