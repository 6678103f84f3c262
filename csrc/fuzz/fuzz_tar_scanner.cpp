// libFuzzer harness for the tar scanner on arbitrary bytes.
//
// The input is fed in pieces of varied sizes (1 byte, around a block, a few blocks, the rest),
// each copied into a heap buffer of exactly its size that is freed as soon as the samples it
// completed have been consumed: under AddressSanitizer a field still pointing into a piece
// after that (a sample that outlives its memory) or a read past a piece's end is caught.
// FormatError is the scanner's answer to a malformed archive and ends the run; any other
// exception, a crash or a broken invariant is a finding.
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  TarScanner scanner;
  scanner.begin_shard(0);
  uint64_t fed = 0, last_offset = 0;
  try {
    for (const fuzz::Piece& p : fuzz::split(data, size)) {
      std::unique_ptr<uint8_t[]> piece(new uint8_t[p.size ? p.size : 1]);
      std::memcpy(piece.get(), data + p.offset, p.size);
      fed += p.size;
      scanner.feed(piece.get(), p.size);
      consume(scanner, fed, &last_offset);
      piece.reset();  // no sample may point here any more
    }
    scanner.end_shard();
    consume(scanner, fed, &last_offset);
  } catch (const FormatError& e) {
    if (e.offset() > fed + 512)
      std::fprintf(stderr, "FormatError at %llu after %llu bytes fed: %s\n",
                   static_cast<unsigned long long>(e.offset()),
                   static_cast<unsigned long long>(fed), e.what());
    fuzz::require(e.offset() <= fed + 512, "a FormatError offset past the input");
  }
  return 0;
}
