// Packs scanned samples into one batch in caller-provided memory: each field (extension) gets
// its own contiguous region, and samples are appended in the order they are added. This is
// what ShardStream.tensors() uses to copy payloads once, from the reader's O_DIRECT buffers
// (or the scanner's storage for data that spanned chunks) straight into shared memory that the
// DataLoader hands to the training loop; a field whose payloads all have one length is then a
// [B, n] tensor without any further copy.
//
// Layout of the memory: region k (the k-th extension known to the batch) starts at
// base + k * region_bytes and holds at most region_bytes. The caller sizes region_bytes so that
// no field can exceed it (the sum of the batch's sample spans in the shard bounds every field)
// and passes the extensions it expects, so regions keep their place from batch to batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tar/tar_scanner.hpp"

namespace flashstream {

struct PackedField {
  std::string ext;              // as the scanner reports it (ASCII-lowercased)
  uint64_t region = 0;          // offset of the region's first byte in the memory
  uint64_t bytes = 0;           // bytes used
  std::vector<int64_t> lengths;  // per sample added: payload bytes, or -1 when absent
};

class BatchPacker {
 public:
  enum class Status { kOk, kNoRegion };

  // `memory` (capacity bytes) must stay valid while the packer is used. Regions start at
  // `base`; `exts` are assigned the first regions, in order.
  BatchPacker(uint8_t* memory, uint64_t capacity, uint64_t base, uint64_t region_bytes,
              const std::vector<std::string>& exts);

  // Appends the sample's fields. kNoRegion (nothing copied): the sample has an extension the
  // batch has no region for and the memory has no room for another; relocate() and retry.
  // Throws std::length_error if a field would overflow its region (a wrong region_bytes).
  Status add(const Sample& sample);

  // Moves the packed bytes to new memory with more room (regions keep their order).
  void relocate(uint8_t* memory, uint64_t capacity, uint64_t region_bytes);

  // Regions that fit in `capacity` bytes from `base`.
  static uint64_t regions_that_fit(uint64_t capacity, uint64_t base, uint64_t region_bytes);

  size_t count() const noexcept { return keys_.size(); }
  const std::vector<std::string>& keys() const noexcept { return keys_; }
  const std::vector<uint64_t>& offsets() const noexcept { return offsets_; }  // first headers
  const std::vector<PackedField>& fields() const noexcept { return fields_; }
  uint64_t region_bytes() const noexcept { return region_bytes_; }

 private:
  int field_index(const std::string& ext) const;

  uint8_t* memory_;
  uint64_t capacity_;
  uint64_t base_;
  uint64_t region_bytes_;
  std::vector<PackedField> fields_;
  std::vector<std::string> keys_;
  std::vector<uint64_t> offsets_;
};

}  // namespace flashstream
