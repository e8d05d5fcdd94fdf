#include "records/crc32c.h"

#include <algorithm>
#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#include <wmmintrin.h>
#define TORCH_STAGE_CRC32C_SSE42 1
#endif

namespace torch_stage::records {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u; // reflected Castagnoli polynomial

using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) {
      c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    }
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (size_t s = 1; s < 8; ++s) {
      t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
  return t;
}

constexpr Tables kTables = make_tables();

// x^k mod P as zlib's crc32.c multiplies them: reflected, bit 31 is x^0.
constexpr uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) {
      p ^= b;
    }
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(8 * bytes) mod P: what a CRC state is multiplied by when `bytes` more
// bytes follow (zeros, or bytes whose own CRC is added on).
constexpr uint32_t shift_of(size_t bytes) {
  uint32_t result = 1u << 31; // x^0
  uint32_t power = 1u << 30; // x^1, squared at each bit of the exponent
  for (size_t e = 8 * bytes; e != 0; e >>= 1) {
    if (e & 1) {
      result = multmodp(power, result);
    }
    power = multmodp(power, power);
  }
  return result;
}

#if defined(TORCH_STAGE_CRC32C_SSE42)
// SSE4.2's crc32 instruction computes exactly this polynomial, 8 bytes per
// instruction, but each waits ~3 cycles for the one before: one chain runs
// at a third of the instruction's throughput. So a buffer of at least
// kMinLaneWords * 24 bytes is cut into three lanes whose chains run side by
// side, and their CRCs are joined: the first lane's state is shifted over
// the other two lanes' bytes, the second's over the third's (a carry-less
// multiply by x^(8 * bytes) mod P, reduced by the crc32 instruction), and
// the three are added. A ~330-byte record: ~125 cycles -> ~60.
constexpr size_t kMinLaneWords = 4;
constexpr size_t kMaxLaneWords = 64; // 512-byte lanes, then the next block

struct LaneShifts {
  // [w]: lanes of w words; first: over 2 lanes, second: over 1.
  uint32_t first[kMaxLaneWords + 1];
  uint32_t second[kMaxLaneWords + 1];
};

constexpr LaneShifts make_lane_shifts() {
  LaneShifts t{};
  for (size_t w = kMinLaneWords; w <= kMaxLaneWords; ++w) {
    t.first[w] = shift_of(16 * w);
    t.second[w] = shift_of(8 * w);
  }
  return t;
}

constexpr LaneShifts kLaneShifts = make_lane_shifts();

// crc * shift mod P (both reflected): the 63-bit carry-less product, one
// bit up so that x^0 is bit 63; its low word (x^63..x^32) reduced by the
// crc32 instruction (which multiplies a word by x^32 mod P), its high word
// already below x^32.
__attribute__((target("sse4.2,pclmul"))) inline uint32_t multiply(
    uint32_t crc,
    uint32_t shift) {
  const __m128i product = _mm_clmulepi64_si128(
      _mm_cvtsi32_si128(static_cast<int>(crc)),
      _mm_cvtsi32_si128(static_cast<int>(shift)),
      0x00);
  const auto v = static_cast<uint64_t>(_mm_cvtsi128_si64(product)) << 1;
  return _mm_crc32_u32(0, static_cast<uint32_t>(v)) ^
      static_cast<uint32_t>(v >> 32);
}

inline uint64_t load_word(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, sizeof(word));
  return word;
}

// One chain, for what the lanes leave (and for short buffers).
__attribute__((target("sse4.2"))) inline uint32_t chain_sse42(
    uint32_t c32,
    const uint8_t* p,
    size_t n) {
  uint64_t c = c32;
  for (; n >= 8; p += 8, n -= 8) {
    c = _mm_crc32_u64(c, load_word(p));
  }
  c32 = static_cast<uint32_t>(c);
  for (; n > 0; ++p, --n) {
    c32 = _mm_crc32_u8(c32, *p);
  }
  return c32;
}

__attribute__((target("sse4.2"))) uint32_t
extend_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  return ~chain_sse42(~crc, p, n);
}

// The state is raw (not inverted) inside, so the lanes' states combine
// linearly: crc(s, A B C) = crc(s, A) x^|BC| + crc(0, B) x^|C| + crc(0, C).
__attribute__((target("sse4.2,pclmul"))) uint32_t
extend_sse42_lanes(uint32_t crc, const uint8_t* p, size_t n) {
  uint32_t c = ~crc;
  while (n >= 24 * kMinLaneWords) {
    const size_t words = std::min(n / 24, kMaxLaneWords);
    const size_t lane = 8 * words;
    uint64_t a = c, b = 0, d = 0;
    for (size_t i = 0; i < lane; i += 8) {
      a = _mm_crc32_u64(a, load_word(p + i));
      b = _mm_crc32_u64(b, load_word(p + lane + i));
      d = _mm_crc32_u64(d, load_word(p + 2 * lane + i));
    }
    c = multiply(static_cast<uint32_t>(a), kLaneShifts.first[words]) ^
        multiply(static_cast<uint32_t>(b), kLaneShifts.second[words]) ^
        static_cast<uint32_t>(d);
    p += 3 * lane;
    n -= 3 * lane;
  }
  return ~chain_sse42(c, p, n);
}

bool cpu_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}

bool cpu_has_pclmul() {
  static const bool has = __builtin_cpu_supports("pclmul");
  return has;
}
#endif

} // namespace

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
#if defined(TORCH_STAGE_CRC32C_SSE42)
  if (cpu_has_sse42()) {
    const auto* p = static_cast<const uint8_t*>(data);
    return cpu_has_pclmul() ? extend_sse42_lanes(crc, p, n)
                            : extend_sse42(crc, p, n);
  }
#endif
  return crc32c_extend_portable(crc, data, n);
}

uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  // Slicing-by-8: eight bytes per step through eight tables. The word is
  // assembled byte by byte, so this is endian-independent and never reads
  // unaligned memory (the compiler folds it into one load on x86/ARM).
  while (n >= 8) {
    const uint32_t lo =
        (static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24)) ^
        c;
    c = kTables[7][lo & 0xff] ^ kTables[6][(lo >> 8) & 0xff] ^
        kTables[5][(lo >> 16) & 0xff] ^ kTables[4][lo >> 24] ^
        kTables[3][p[4]] ^ kTables[2][p[5]] ^ kTables[1][p[6]] ^
        kTables[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) {
    c = kTables[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  }
  return ~c;
}

} // namespace torch_stage::records
