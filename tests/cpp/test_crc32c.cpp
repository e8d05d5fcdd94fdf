// CRC-32C against published vectors, and TFRecord's masking.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "records/crc32c.h"

namespace torch_stage::records {
namespace {

TEST(Crc32c, CheckValueOfTheCatalogue) {
  // The "check" value of CRC-32/ISCSI (Castagnoli) for "123456789".
  const std::string s = "123456789";
  EXPECT_EQ(crc32c(s.data(), s.size()), 0xE3069283u);
}

TEST(Crc32c, Rfc3720Vectors) {
  // RFC 3720 (iSCSI) appendix B.4.
  std::vector<uint8_t> zeros(32, 0x00);
  std::vector<uint8_t> ones(32, 0xff);
  std::vector<uint8_t> up(32);
  std::vector<uint8_t> down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<uint8_t>(i);
    down[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(crc32c(up.data(), up.size()), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down.data(), down.size()), 0x113FDB5Cu);
}

TEST(Crc32c, EmptyInputIsZero) {
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, ExtendEqualsOneShotAtEverySplit) {
  // Exercises the 8-byte fast path and the byte tail at every alignment.
  std::string s;
  for (int i = 0; i < 100; ++i) {
    s.push_back(static_cast<char>(i * 37 + 11));
  }
  const uint32_t whole = crc32c(s.data(), s.size());
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    const uint32_t head = crc32c(s.data(), cut);
    EXPECT_EQ(crc32c_extend(head, s.data() + cut, s.size() - cut), whole)
        << "split at " << cut;
  }
}

TEST(Crc32c, MaskMatchesTensorFlowAndRoundTrips) {
  // TensorFlow's masked CRC of the 8 zero bytes of an empty record's length,
  // as written by TFRecordWriter (bytes 29 03 98 07 little-endian).
  const std::vector<uint8_t> length(8, 0);
  EXPECT_EQ(mask_crc(crc32c(length.data(), length.size())), 0x07980329u);
  for (uint32_t v : {0u, 1u, 0xE3069283u, 0xffffffffu}) {
    EXPECT_EQ(unmask_crc(mask_crc(v)), v);
  }
}

std::vector<uint8_t> pseudo_random_bytes(size_t n, uint32_t x) {
  std::vector<uint8_t> buf(n);
  for (auto& b : buf) {
    x = x * 1103515245u + 12345u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return buf;
}

void expect_both_paths_agree(
    const std::vector<uint8_t>& buf,
    size_t start,
    size_t n,
    std::initializer_list<uint32_t> seeds) {
  for (uint32_t seed : seeds) {
    ASSERT_EQ(
        crc32c_extend(seed, buf.data() + start, n),
        crc32c_extend_portable(seed, buf.data() + start, n))
        << "start " << start << " length " << n << " seed " << seed;
  }
}

TEST(Crc32c, DispatchedPathEqualsPortableAtEveryLengthAndAlignment) {
  // crc32c_extend may take the SSE4.2 instruction; it must agree with the
  // tables bit for bit, from every start offset (unaligned words) and for
  // every tail length.
  const std::vector<uint8_t> buf = pseudo_random_bytes(300, 12345);
  for (size_t start = 0; start < 16; ++start) {
    for (size_t n = 0; n + start <= buf.size(); n += (n < 40 ? 1 : 13)) {
      expect_both_paths_agree(buf, start, n, {0u, 0xdeadbeefu});
    }
  }
}

TEST(Crc32c, LanesJoinToThePortableCrcAcrossBlocks) {
  // On CPUs with PCLMUL, buffers of 96 bytes and more run as three lanes
  // whose CRCs are joined, in blocks of up to 1536 bytes: every lane width
  // (4..64 words), several whole blocks, and each tail length after them,
  // must agree with the tables, also seeded and from unaligned starts.
  const std::vector<uint8_t> buf = pseudo_random_bytes(5000, 987654321);
  for (size_t start : {0, 1, 7}) {
    for (size_t n = 90; n + start <= buf.size(); n += (n < 1700 ? 1 : 97)) {
      expect_both_paths_agree(buf, start, n, {0u, 0x12345678u});
    }
  }
  // All ones and all zeros: degenerate lane states (0 and ~0) join right.
  for (uint8_t fill : {uint8_t{0}, uint8_t{0xff}}) {
    const std::vector<uint8_t> same(1600, fill);
    for (size_t n : {96, 97, 335, 1535, 1536, 1600}) {
      EXPECT_EQ(
          crc32c_extend(0, same.data(), n),
          crc32c_extend_portable(0, same.data(), n))
          << "fill " << int(fill) << " length " << n;
    }
  }
}

} // namespace
} // namespace torch_stage::records
