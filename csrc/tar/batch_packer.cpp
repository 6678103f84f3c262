// BatchPacker: see batch_packer.hpp.
#include "tar/batch_packer.hpp"

#include <cstring>
#include <stdexcept>

#include "common/stream_copy.hpp"

namespace flashstream {

BatchPacker::BatchPacker(uint8_t* memory, uint64_t capacity, uint64_t base,
                         uint64_t region_bytes, const std::vector<std::string>& exts)
    : memory_(memory), capacity_(capacity), base_(base), region_bytes_(region_bytes) {
  if (base > capacity) throw std::invalid_argument("packer base lies past the memory's end");
  for (const std::string& ext : exts) {
    if (field_index(ext) >= 0) continue;
    if (fields_.size() >= regions_that_fit(capacity_, base_, region_bytes_)) break;
    PackedField& f = fields_.emplace_back();
    f.ext = ext;
    f.region = base_ + region_bytes_ * (fields_.size() - 1);
  }
}

uint64_t BatchPacker::regions_that_fit(uint64_t capacity, uint64_t base, uint64_t region_bytes) {
  if (capacity < base) return 0;
  if (region_bytes == 0) return UINT64_MAX;  // empty regions: any number fits
  return (capacity - base) / region_bytes;
}

int BatchPacker::field_index(const std::string& ext) const {
  for (size_t i = 0; i < fields_.size(); ++i)
    if (fields_[i].ext == ext) return static_cast<int>(i);
  return -1;
}

BatchPacker::Status BatchPacker::add(const Sample& sample) {
  // First make sure every extension has a region, so a refused sample copies nothing.
  size_t missing = 0;
  for (const Field& field : sample.fields) missing += field_index(field.ext) < 0;
  if (fields_.size() + missing > regions_that_fit(capacity_, base_, region_bytes_))
    return Status::kNoRegion;
  for (const Field& field : sample.fields) {
    if (field_index(field.ext) >= 0) continue;
    PackedField& f = fields_.emplace_back();
    f.ext = field.ext;
    f.region = base_ + region_bytes_ * (fields_.size() - 1);
    f.lengths.assign(keys_.size(), -1);  // absent from the samples before this one
  }
  for (const Field& field : sample.fields) {
    PackedField& f = fields_[field_index(field.ext)];
    if (field.size > region_bytes_ - f.bytes)
      throw std::length_error("batch field '" + field.ext + "' overflows its region of " +
                              std::to_string(region_bytes_) + " bytes");
    // The batch is read next by the training loop, in another process: stream it past the cache.
    copy_streaming(memory_ + f.region + f.bytes, field.data, field.size);
    f.bytes += field.size;
    f.lengths.push_back(static_cast<int64_t>(field.size));
  }
  stream_fence();
  keys_.push_back(sample.key);
  offsets_.push_back(sample.offset);
  for (PackedField& f : fields_)  // absent fields of this sample
    if (f.lengths.size() < keys_.size()) f.lengths.push_back(-1);
  return Status::kOk;
}

void BatchPacker::relocate(uint8_t* memory, uint64_t capacity, uint64_t region_bytes) {
  if (region_bytes < region_bytes_)
    throw std::invalid_argument("relocate: regions may only grow");
  if (fields_.size() > regions_that_fit(capacity, base_, region_bytes))
    throw std::invalid_argument("relocate: the new memory holds fewer regions");
  // Last region first: when `memory` is the same memory with larger regions, every region
  // moves up, and moving the highest first never overwrites one not yet moved.
  for (size_t i = fields_.size(); i-- > 0;) {
    PackedField& f = fields_[i];
    const uint64_t region = base_ + region_bytes * i;
    if (f.bytes) std::memmove(memory + region, memory_ + f.region, f.bytes);
    f.region = region;
  }
  memory_ = memory;
  capacity_ = capacity;
  region_bytes_ = region_bytes;
}

}  // namespace flashstream
