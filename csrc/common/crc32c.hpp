// CRC-32C (Castagnoli), the checksum of checkpoint tensors. Uses the SSE4.2 / ARMv8 CRC
// instruction when the CPU has it (checked at run time), else a slicing table; both give the
// same value. crc32c("123456789") == 0xE3069283. Chaining: crc32c(b, m, crc32c(a, n)) is the
// CRC of the concatenation a + b, so a long buffer can be checksummed piece by piece.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashstream {

uint32_t crc32c(const void* data, size_t len, uint32_t crc = 0) noexcept;

// True when crc32c() uses the CPU's CRC instruction.
bool crc32c_hardware() noexcept;

// The table path whatever the CPU: the reference the hardware path is tested against.
uint32_t crc32c_software(const void* data, size_t len, uint32_t crc = 0) noexcept;

}  // namespace flashstream
