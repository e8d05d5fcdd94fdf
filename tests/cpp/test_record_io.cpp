// TFRecord framing: fixed byte vectors, round trips with and without
// compression, and every kind of damaged file.
#include <gtest/gtest.h>
#include <zlib.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "records/record_io.h"
#include "records_test_util.h"

namespace torch_stage::records {
namespace {

using testing::expect_error;
using testing::hex_decode;
using testing::read_all;
using testing::read_raw;
using testing::TempDir;
using testing::write_raw;
using testing::write_records;

// Made by the PyPI `tfrecord` package (its own framing code, the `crc32c`
// package): an empty record, then b"hello".
const char* kEmptyRecordHex = "000000000000000029039807d8ea82a2";
const char* kHelloRecordHex = "0500000000000000eab2043e68656c6c6fbb1f1c19";

TEST(RecordWriter, WritesTheExactFramingBytes) {
  TempDir dir;
  const auto path = dir.file("a.tfrecord");
  write_records(path, {"", "hello"});
  EXPECT_EQ(
      read_raw(path),
      hex_decode(kEmptyRecordHex) + hex_decode(kHelloRecordHex));
}

TEST(RecordReader, ReadsTheFixedVectorAndReportsPositions) {
  TempDir dir;
  const auto path = dir.file("a.tfrecord");
  write_raw(path, hex_decode(kHelloRecordHex) + hex_decode(kEmptyRecordHex));
  RecordReader reader(path, Compression::kNone);
  std::string r;
  ASSERT_TRUE(reader.read(&r));
  EXPECT_EQ(r, "hello");
  EXPECT_EQ(reader.offset(), 21u);
  EXPECT_EQ(reader.index(), 1);
  ASSERT_TRUE(reader.read(&r));
  EXPECT_EQ(r, "");
  EXPECT_FALSE(reader.read(&r));
  EXPECT_FALSE(reader.read(&r)); // stays at the end
}

TEST(RecordIo, RoundTripsEveryCompression) {
  TempDir dir;
  std::vector<std::string> records;
  for (int i = 0; i < 300; ++i) {
    records.push_back(std::string(
        static_cast<size_t>(i * 7), static_cast<char>('a' + i % 26)));
  }
  records.push_back(std::string(3 * 1024 * 1024, 'z')); // spans many buffers
  for (auto c : {Compression::kNone, Compression::kGzip, Compression::kZlib}) {
    const auto path = dir.file(std::string("r") + to_string(c));
    write_records(path, records, c);
    EXPECT_EQ(read_all(path, c), records) << to_string(c);
  }
}

TEST(RecordIo, CompressedFilesAreStandardStreams) {
  // gzip magic 1f 8b; zlib header 78 xx with (CMF*256+FLG) % 31 == 0.
  TempDir dir;
  write_records(dir.file("g"), {"abc"}, Compression::kGzip);
  write_records(dir.file("z"), {"abc"}, Compression::kZlib);
  const std::string g = read_raw(dir.file("g"));
  const std::string z = read_raw(dir.file("z"));
  ASSERT_GE(g.size(), 2u);
  EXPECT_EQ(static_cast<uint8_t>(g[0]), 0x1f);
  EXPECT_EQ(static_cast<uint8_t>(g[1]), 0x8b);
  ASSERT_GE(z.size(), 2u);
  EXPECT_EQ(static_cast<uint8_t>(z[0]), 0x78);
  EXPECT_EQ(
      (static_cast<uint8_t>(z[0]) * 256 + static_cast<uint8_t>(z[1])) % 31, 0);
}

TEST(RecordIo, ConcatenatedGzipMembersReadAsOneStream) {
  TempDir dir;
  write_records(dir.file("a"), {"one", "two"}, Compression::kGzip);
  write_records(dir.file("b"), {"three"}, Compression::kGzip);
  write_raw(dir.file("ab"), read_raw(dir.file("a")) + read_raw(dir.file("b")));
  EXPECT_EQ(
      read_all(dir.file("ab"), Compression::kGzip),
      (std::vector<std::string>{"one", "two", "three"}));
}

TEST(RecordIo, FlushKeepsTheFileReadableSoFar) {
  TempDir dir;
  const auto path = dir.file("f");
  RecordWriter writer(path, Compression::kNone);
  writer.write(std::string("first"));
  writer.flush();
  EXPECT_EQ(read_all(path), std::vector<std::string>{"first"});
  writer.close();
  EXPECT_EQ(writer.records_written(), 1);
  const auto e = expect_error([&] { writer.write(std::string("late")); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kIo);
  EXPECT_NE(std::string(e.what()).find("closed"), std::string::npos);
}

TEST(RecordReader, TruncatedHeaderNamesFileOffsetAndIndex) {
  TempDir dir;
  const auto path = dir.file("t");
  const std::string good = hex_decode(kHelloRecordHex);
  write_raw(path, good + good.substr(0, 5));
  RecordReader reader(path, Compression::kNone);
  std::string r;
  ASSERT_TRUE(reader.read(&r));
  const auto e = expect_error([&] { reader.read(&r); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kTruncated);
  EXPECT_EQ(e.path(), path);
  EXPECT_EQ(e.offset(), 21);
  EXPECT_EQ(e.record_index(), 1);
  const std::string msg = e.what();
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte offset 21"), std::string::npos) << msg;
  EXPECT_NE(msg.find("12-byte header"), std::string::npos) << msg;
  // A failed reader does not pretend to go on.
  EXPECT_EQ(
      expect_error([&] { reader.read(&r); }).kind(), RecordErrorKind::kIo);
}

TEST(RecordReader, TruncatedDataAndFooter) {
  TempDir dir;
  const std::string good = hex_decode(kHelloRecordHex);
  write_raw(dir.file("d"), good.substr(0, 14));
  write_raw(dir.file("f"), good.substr(0, 19));
  auto e = expect_error([&] { read_all(dir.file("d")); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kTruncated);
  EXPECT_NE(
      std::string(e.what()).find("expected 5 data bytes"), std::string::npos)
      << e.what();
  e = expect_error([&] { read_all(dir.file("f")); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kTruncated);
  EXPECT_NE(std::string(e.what()).find("4-byte data CRC"), std::string::npos)
      << e.what();
}

TEST(RecordReader, BadLengthCrc) {
  TempDir dir;
  std::string bad = hex_decode(kHelloRecordHex);
  bad[9] ^= 0x01;
  write_raw(dir.file("l"), bad);
  const auto e = expect_error([&] { read_all(dir.file("l")); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kCorrupt);
  EXPECT_EQ(e.offset(), 0);
  EXPECT_EQ(e.record_index(), 0);
  EXPECT_NE(
      std::string(e.what()).find("length CRC mismatch"), std::string::npos)
      << e.what();
}

TEST(RecordReader, BadDataCrc) {
  TempDir dir;
  std::string bad = hex_decode(kEmptyRecordHex) + hex_decode(kHelloRecordHex);
  bad[16 + 12] ^= 0x20; // 'h' -> 'H' in the second record
  write_raw(dir.file("c"), bad);
  const auto e = expect_error([&] { read_all(dir.file("c")); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kCorrupt);
  EXPECT_EQ(e.offset(), 16);
  EXPECT_EQ(e.record_index(), 1);
  EXPECT_NE(std::string(e.what()).find("data CRC mismatch"), std::string::npos)
      << e.what();
}

TEST(RecordReader, HugeLengthIsTruncationNotAnAllocation) {
  // A length of 2^60 with a valid length CRC: the reader must report the
  // end of the file, not try to allocate the length up front.
  TempDir dir;
  uint8_t header[12];
  frame_header(1ull << 60, header);
  write_raw(
      dir.file("h"), std::string(reinterpret_cast<char*>(header), 12) + "xyz");
  const auto e = expect_error([&] { read_all(dir.file("h")); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kTruncated);
}

TEST(RecordReader, CorruptAndTruncatedCompressedStreams) {
  TempDir dir;
  std::vector<std::string> records(50, std::string(1000, 'q'));
  write_records(dir.file("g"), records, Compression::kGzip);
  const std::string gz = read_raw(dir.file("g"));
  write_raw(dir.file("cut"), gz.substr(0, gz.size() / 2));
  auto e = expect_error([&] { read_all(dir.file("cut"), Compression::kGzip); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kTruncated) << e.what();
  EXPECT_NE(std::string(e.what()).find("GZIP"), std::string::npos) << e.what();

  std::string flipped = gz;
  flipped[gz.size() / 2] ^= 0x55;
  flipped[gz.size() / 2 + 1] ^= 0x55;
  write_raw(dir.file("flip"), flipped);
  e = expect_error([&] { read_all(dir.file("flip"), Compression::kGzip); });
  EXPECT_TRUE(
      e.kind() == RecordErrorKind::kCorrupt ||
      e.kind() == RecordErrorKind::kTruncated)
      << e.what();
  EXPECT_EQ(e.path(), dir.file("flip"));

  // An uncompressed file read as GZIP: not a gzip stream.
  write_records(dir.file("plain"), {"abc"});
  e = expect_error([&] { read_all(dir.file("plain"), Compression::kGzip); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kCorrupt) << e.what();
  EXPECT_EQ(e.record_index(), 0);
}

// Records of a few sizes around and above the reader's 256 KiB blocks.
std::vector<std::string> mixed_records(
    size_t n,
    uint64_t seed,
    bool large = true) {
  std::mt19937_64 rng(seed);
  std::vector<std::string> out(n);
  for (auto& r : out) {
    const size_t size =
        large && rng() % 50 == 0 ? 300000 + rng() % 300000 : rng() % 3000;
    r.resize(size);
    for (auto& c : r) {
      c = static_cast<char>('a' + rng() % 16); // compressible: Huffman blocks
    }
  }
  return out;
}

TEST(RecordReader, NextLeavesRecordsInBlocksThatOutliveTheReader) {
  TempDir dir;
  const auto records = mixed_records(600, 11);
  for (auto c : {Compression::kNone, Compression::kGzip}) {
    write_records(dir.file("m"), records, c);
    std::vector<std::shared_ptr<RecordBlock>> held;
    std::vector<RecordSpan> spans;
    size_t blocks = 0;
    {
      RecordReader reader(dir.file("m"), c);
      RecordSpan span;
      while (reader.next(&span)) {
        if (held.empty() || held.back() != reader.block()) {
          held.push_back(reader.block());
          ++blocks;
        }
        spans.push_back(span);
      }
    } // the reader is gone; the blocks held keep every record
    ASSERT_EQ(spans.size(), records.size());
    EXPECT_GT(blocks, 10u); // records lie in many blocks
    for (size_t i = 0; i < records.size(); ++i) {
      ASSERT_EQ(
          std::string(
              reinterpret_cast<const char*>(spans[i].data), spans[i].size),
          records[i])
          << "record " << i << ", compression " << to_string(c);
    }
  }
}

// Inflates `gz` in one go until its end or its first error: the bytes a
// reader could have had before the error.
std::string inflate_until_error(const std::string& gz) {
  z_stream z{};
  EXPECT_EQ(inflateInit2(&z, 16 + MAX_WBITS), Z_OK);
  std::string out(64 << 20, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(gz.data()));
  z.avail_in = static_cast<uInt>(gz.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  while (inflate(&z, Z_NO_FLUSH) == Z_OK) {
  }
  out.resize(z.total_out);
  inflateEnd(&z);
  return out;
}

TEST(RecordReader, ACorruptCompressedStreamGivesEveryRecordBeforeIt) {
  // The reader reads ahead a block (~170 of these records) at a time: an
  // inflate error past the record it is on waits until a record needs
  // those bytes.
  TempDir dir;
  const auto records = mixed_records(2000, 12, false);
  write_records(dir.file("g"), records, Compression::kGzip);
  const std::string gz = read_raw(dir.file("g"));
  std::vector<std::string> framed_records;
  for (const auto& r : records) {
    write_records(dir.file("one"), {r});
    framed_records.push_back(read_raw(dir.file("one")));
  }
  size_t stream_errors = 0;
  for (int tenth = 1; tenth <= 9; ++tenth) {
    const double at = tenth / 10.0;
    std::string bad = gz;
    const auto k = static_cast<size_t>(static_cast<double>(gz.size()) * at);
    for (size_t j = k; j < k + 16; ++j) {
      bad[j] = static_cast<char>(0xff);
    }
    write_raw(dir.file("bad"), bad);
    // The records that inflate intact before the error: their framing and
    // bytes are a prefix of what the damaged stream gives.
    const std::string plain = inflate_until_error(bad);
    size_t complete = 0;
    for (size_t pos = 0; complete < records.size(); ++complete) {
      const std::string& framed = framed_records[complete];
      if (plain.compare(pos, framed.size(), framed) != 0) {
        break;
      }
      pos += framed.size();
    }
    ASSERT_LT(complete, records.size());
    RecordReader reader(dir.file("bad"), Compression::kGzip);
    std::string got;
    size_t read = 0;
    const auto e = expect_error([&] {
      while (reader.read(&got)) {
        ASSERT_EQ(got, records[read]) << "record " << read;
        ++read;
      }
    });
    EXPECT_EQ(read, complete) << "corrupted at " << k;
    EXPECT_EQ(e.record_index(), static_cast<int64_t>(complete)) << e.what();
    // (Or the damage inflates to wrong bytes: a data CRC mismatch.)
    stream_errors +=
        std::string(e.what()).find("GZIP stream") != std::string::npos ? 1 : 0;
    EXPECT_TRUE(
        e.kind() == RecordErrorKind::kCorrupt ||
        e.kind() == RecordErrorKind::kTruncated)
        << e.what();
  }
  EXPECT_GE(stream_errors, 3u); // inflate's own errors are exercised
}

TEST(RecordReader, MissingFileIsNotFound) {
  TempDir dir;
  const auto e = expect_error(
      [&] { RecordReader r(dir.file("nope"), Compression::kNone); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kNotFound);
  EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos);
}

TEST(RecordReader, AFileCutShortWhileReadIsAnIoErrorNotAnEnd) {
  TempDir dir;
  const std::string path = dir.file("big");
  // Larger than the reader's 256 KiB buffer, so the cut lands unread.
  write_records(path, std::vector<std::string>(1000, std::string(1000, 'x')));
  RecordReader reader(path, Compression::kNone);
  std::string record;
  ASSERT_TRUE(reader.read(&record));
  write_raw(path, ""); // truncated to zero, at a record boundary for the
                       // reader: without the check, a clean end
  const auto e = expect_error([&] {
    while (reader.read(&record)) {
    }
  });
  EXPECT_EQ(e.kind(), RecordErrorKind::kIo) << e.what();
  EXPECT_EQ(e.path(), path);
  const std::string what = e.what();
  EXPECT_NE(what.find("shrank while being read"), std::string::npos) << what;
  EXPECT_NE(what.find("1016000 bytes when opened"), std::string::npos) << what;
}

TEST(RecordReader, AnEmptyFileIsACleanEnd) {
  TempDir dir;
  write_raw(dir.file("empty"), "");
  RecordReader reader(dir.file("empty"), Compression::kNone);
  std::string record;
  EXPECT_FALSE(reader.read(&record));
  EXPECT_FALSE(reader.read(&record));
}

TEST(RecordWriter, UnwritablePathIsAnIoError) {
  TempDir dir;
  const auto e = expect_error(
      [&] { RecordWriter w(dir.file("no/such/dir/x"), Compression::kNone); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kIo);
}

TEST(Compression, ParsesTensorFlowNamesAndRejectsOthers) {
  EXPECT_EQ(parse_compression(""), Compression::kNone);
  EXPECT_EQ(parse_compression("none"), Compression::kNone);
  EXPECT_EQ(parse_compression("gzip"), Compression::kGzip);
  EXPECT_EQ(parse_compression("ZLIB"), Compression::kZlib);
  const auto e = expect_error([] { parse_compression("zstd"); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("\"zstd\""), std::string::npos);
}

TEST(MatchFiles, SortsDeduplicatesAndRejectsEmptyMatches) {
  TempDir dir;
  for (const char* n : {"b.rec", "a.rec", "c.txt"}) {
    write_records(dir.file(n), {"x"});
  }
  const auto files = match_files({dir.file("*.rec"), dir.file("a.rec")});
  EXPECT_EQ(
      files, (std::vector<std::string>{dir.file("a.rec"), dir.file("b.rec")}));
  const auto e = expect_error([&] { match_files({dir.file("*.none")}); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kNotFound);
  EXPECT_NE(std::string(e.what()).find("*.none"), std::string::npos);
}

TEST(ShardFiles, SplitsByFileAndChecksTheShard) {
  const std::vector<std::string> files{"0", "1", "2", "3", "4"};
  EXPECT_EQ(
      shard_files(files, 0, 2), (std::vector<std::string>{"0", "2", "4"}));
  EXPECT_EQ(shard_files(files, 1, 2), (std::vector<std::string>{"1", "3"}));
  EXPECT_EQ(shard_files(files, 0, 1), files);
  for (auto [rank, world] : {std::pair<int, int>{2, 2}, {-1, 2}, {0, 0}}) {
    EXPECT_EQ(
        expect_error([&] { shard_files(files, rank, world); }).kind(),
        RecordErrorKind::kInvalidArgument);
  }
  const auto e = expect_error([&] { shard_files(files, 6, 8); });
  EXPECT_NE(std::string(e.what()).find("gets no file"), std::string::npos)
      << e.what();
}

} // namespace
} // namespace torch_stage::records
