// libFuzzer harness for the tar scanner on arbitrary bytes.
//
// The input is fed in pieces of varied sizes (1 byte, around a block, a few blocks, the rest),
// each copied into a heap buffer of exactly its size that is freed as soon as the samples it
// completed have been consumed: under AddressSanitizer a field still pointing into a piece
// after that (a sample that outlives its memory) or a read past a piece's end is caught.
// FormatError is the scanner's answer to a malformed archive and ends the run; any other
// exception, a crash or a broken invariant is a finding.
//
// The same bytes then go through index-only mode the way the shard indexer hops: feed from
// the position the scanner needs up to the next 4 KiB boundary, skip whatever it need not see.
// Its samples' offsets and its error (message and offset) must equal the full mode's.
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.hpp"
#include "fuzz/pieces.hpp"
#include "tar/tar_scanner.hpp"

using namespace flashstream;

namespace {

// Reads every byte of every completed sample (ASan checks each access) and the invariants the
// stream relies on, then drops them, as the Python layer does after take().
void consume(TarScanner& scanner, uint64_t consumed, uint64_t* last_offset) {
  volatile uint8_t sink = 0;
  for (const Sample& s : scanner.samples()) {
    fuzz::require(s.offset >= *last_offset, "sample offsets go backwards");
    fuzz::require(s.end_offset > s.offset, "a sample ends before it starts");
    fuzz::require(s.end_offset <= consumed, "a sample ends past the bytes fed");
    fuzz::require(!s.fields.empty(), "a sample without fields");
    *last_offset = s.end_offset;
    for (const Field& f : s.fields) {
      fuzz::require(f.size <= consumed, "a field larger than the input");
      for (uint64_t i = 0; i < f.size; ++i) sink = sink + f.data[i];
    }
  }
  (void)sink;
  scanner.clear_samples();
}

struct Outcome {
  std::vector<std::pair<uint64_t, uint64_t>> spans;  // (offset, end) of each sample
  std::string error;                                 // what() and offset, or empty
};

void add_spans(TarScanner& scanner, Outcome* out) {
  for (const Sample& s : scanner.samples()) out->spans.emplace_back(s.offset, s.end_offset);
}

void take_spans(TarScanner& scanner, Outcome* out) {
  add_spans(scanner, out);
  scanner.clear_samples();
}

// Index-only mode over `data`, hopping as csrc/index/shard_indexer.cpp does.
Outcome hop(const uint8_t* data, size_t size) {
  constexpr uint64_t kWindow = 4096;
  TarScanner scanner;
  scanner.set_index_only(true);
  scanner.begin_shard(0);
  Outcome out;
  try {
    while (true) {
      const uint64_t pos = scanner.position();
      if (scanner.at_end()) break;
      const uint64_t skip = std::min<uint64_t>(scanner.skippable(), size - std::min<uint64_t>(pos, size));
      if (skip > 0) {
        scanner.skip(skip);
      } else if (pos >= size) {
        break;
      } else {
        const uint64_t end = std::min<uint64_t>((pos / kWindow + 1) * kWindow, size);
        scanner.feed(data + pos, end - pos);
      }
      take_spans(scanner, &out);
    }
    scanner.end_shard();
    take_spans(scanner, &out);
  } catch (const FormatError& e) {
    take_spans(scanner, &out);
    out.error = std::string(e.what()) + " @" + std::to_string(e.offset()) +
                (e.shard_only() ? " shard_only" : "");
    scanner.flush_open_group();  // the group open at the error, as the indexer keeps it
    take_spans(scanner, &out);
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  TarScanner scanner;
  scanner.begin_shard(0);
  uint64_t fed = 0, last_offset = 0;
  Outcome full;
  try {
    for (const fuzz::Piece& p : fuzz::split(data, size)) {
      std::unique_ptr<uint8_t[]> piece(new uint8_t[p.size ? p.size : 1]);
      std::memcpy(piece.get(), data + p.offset, p.size);
      fed += p.size;
      scanner.feed(piece.get(), p.size);
      add_spans(scanner, &full);
      consume(scanner, fed, &last_offset);
      piece.reset();  // no sample may point here any more
    }
    scanner.end_shard();
    add_spans(scanner, &full);
    consume(scanner, fed, &last_offset);
  } catch (const FormatError& e) {
    if (e.offset() > fed + 512)
      std::fprintf(stderr, "FormatError at %llu after %llu bytes fed: %s\n",
                   static_cast<unsigned long long>(e.offset()),
                   static_cast<unsigned long long>(fed), e.what());
    fuzz::require(e.offset() <= fed + 512, "a FormatError offset past the input");
    // Samples completed before the error are delivered (the reader's salvage), then the
    // group open at it (unless the handler raises).
    add_spans(scanner, &full);
    full.error = std::string(e.what()) + " @" + std::to_string(e.offset()) +
                 (e.shard_only() ? " shard_only" : "");
    scanner.clear_samples();  // they may point into the piece freed as the error unwound
    scanner.flush_open_group();
    add_spans(scanner, &full);
    consume(scanner, fed, &last_offset);  // the group owns its bytes
  }
  const Outcome hopped = hop(data, size);
  if (hopped.error != full.error)
    std::fprintf(stderr, "full: %s\nhop:  %s\n", full.error.c_str(), hopped.error.c_str());
  fuzz::require(hopped.error == full.error, "index-only hopping fails differently");
  fuzz::require(hopped.spans == full.spans, "index-only hopping finds other samples");
  return 0;
}
