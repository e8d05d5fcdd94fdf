// CRC-32C (Castagnoli, polynomial 0x1EDC6F41, reflected 0x82F63B78), as
// used by the TFRecord framing, and TFRecord's masking of stored CRCs.
//
// Software slicing-by-8: about 1-2 GB/s per core, far above what record
// reading needs here (a 200 MB file set is checked in ~0.1 s). Pure C++17.
//
// Thread-safe: the tables are constant, the functions have no state.
#pragma once

#include <cstddef>
#include <cstdint>

namespace torch_stage::records {

// Extends `crc` (the CRC of some preceding bytes; 0 for none) over `n` bytes.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);

inline uint32_t crc32c(const void* data, size_t n) {
  return crc32c_extend(0, data, n);
}

// TFRecord stores CRCs masked: a CRC of data that itself embeds CRCs is
// otherwise prone to degenerate values (tensorflow/core/lib/hash/crc32c.h).
constexpr uint32_t kCrcMaskDelta = 0xa282ead8u;

inline uint32_t mask_crc(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + kCrcMaskDelta;
}

inline uint32_t unmask_crc(uint32_t masked) {
  const uint32_t rot = masked - kCrcMaskDelta;
  return (rot >> 17) | (rot << 15);
}

} // namespace torch_stage::records
