// CRC-32C (Castagnoli, polynomial 0x1EDC6F41, reflected 0x82F63B78), as
// used by the TFRecord framing, and TFRecord's masking of stored CRCs.
//
// On x86-64 with SSE4.2 (checked at run time) the crc32 instruction, in
// three interleaved chains where PCLMUL joins them: ~20 GB/s a core on long
// buffers against ~7.5 for one chain, 25-28 ns against 58 for a 330-byte
// record (records_bench --phase crc; reading packed Criteo-like rows,
// records_bench --phase read: 137 -> ~100 ns per record). At a few million
// records a second every record's CRC is checked without the check being what
// limits reading. Elsewhere software slicing-by-8, about 1-2 GB/s. Pure C++17
// (plus intrinsics on x86-64).
//
// Thread-safe: the tables are constant, the functions have no state.
#pragma once

#include <cstddef>
#include <cstdint>

namespace torch_stage::records {

// Extends `crc` (the CRC of some preceding bytes; 0 for none) over `n` bytes.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
// The software path alone (what crc32c_extend uses without SSE4.2), for
// tests comparing the two.
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);

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
