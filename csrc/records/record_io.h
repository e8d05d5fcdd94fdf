// TFRecord files: reading, writing, and finding them.
//
// The framing (tensorflow/core/lib/io/record_writer.h), for every record:
//
//   uint64  length        little-endian
//   uint32  masked_crc32c(length's 8 bytes)
//   byte    data[length]
//   uint32  masked_crc32c(data)
//
// optionally inside one GZIP or ZLIB stream covering the whole file. Both CRCs
// are checked on read. Pure C++17 + zlib.
//
// Errors are RecordError (record_error.h) naming the file, the byte offset of
// the record (in the uncompressed stream for compressed files, which is what
// TensorFlow reports too) and its index, and what was expected.
//
// Threads: a reader or writer object is used by one thread at a time (it is
// a file cursor); distinct objects are independent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "records/record_error.h"

namespace torch_stage::records {

enum class Compression { kNone, kGzip, kZlib };

// "" / "NONE" -> kNone, "GZIP", "ZLIB" (any case), as TensorFlow spells them.
// Throws RecordError(kInvalidArgument) naming the value and the choices.
Compression parse_compression(const std::string& name);
const char* to_string(Compression compression);

// The files matching each pattern (glob(3): *, ?, [...]; a plain path matches
// itself if it exists), sorted, without duplicates. Throws
// RecordError(kNotFound) when a pattern matches nothing.
std::vector<std::string> match_files(const std::vector<std::string>& patterns);

// Files [rank::world] of `files` (already sorted): sharding by file, as
// distributed readers do. Throws RecordError(kInvalidArgument) for a bad
// (rank, world) and when the shard would hold no file.
std::vector<std::string> shard_files(
    const std::vector<std::string>& files,
    int64_t rank,
    int64_t world);

// A byte source: a plain file, or a zlib/gzip stream over one.
class InputStream {
 public:
  virtual ~InputStream() = default;
  // Reads up to n bytes; returns 0 only at the end of the stream. An error
  // after some bytes were produced is deferred: the call returns those, and
  // the next call throws it (a reader reading ahead still gets every record
  // before the error, and the error at the record it spoils).
  virtual size_t read(void* dst, size_t n) = 0;
};

// A piece of a stream's bytes that a RecordReader read records into. The
// records next() hands out point into it; whoever holds the block (shared)
// keeps them valid after the reader has moved on.
struct RecordBlock {
  std::unique_ptr<uint8_t[]> bytes;
  size_t capacity = 0;
};

// A record's bytes inside a RecordBlock.
struct RecordSpan {
  const uint8_t* data = nullptr;
  size_t size = 0;
};

class RecordReader {
 public:
  // Opens `path`; throws RecordError(kNotFound / kIo) when it cannot.
  RecordReader(std::string path, Compression compression);
  ~RecordReader();
  RecordReader(const RecordReader&) = delete;
  RecordReader& operator=(const RecordReader&) = delete;

  // Reads the next record into *out (replacing its contents). Returns false
  // at a clean end of file (between records). Throws RecordError kTruncated
  // (the file ends inside a record), kCorrupt (CRC mismatch, bad compressed
  // data) or kIo (a read failed, or the file shrank below its size when
  // opened: truncated or rewritten while read, which must not pass for a
  // clean end). A reader that threw stays failed: later calls throw kIo
  // ("stopped by an earlier error"), since the framing cannot be resynced.
  bool read(std::string* out);
  // As read(), but appends the record to *out (a reader's chunk of records
  // back to back, without a copy through a record buffer). On an error *out
  // keeps its size from before the call.
  bool read_append(std::vector<uint8_t>* out);
  // As read(), without a copy: *out points into block(), valid for as long
  // as a holder of that block lives (the reader itself holds it only until
  // it needs room: then it goes on in a fresh block, or reuses this one if
  // nobody else holds it). Same errors as read().
  bool next(RecordSpan* out);
  // The block of the record next() returned last.
  const std::shared_ptr<RecordBlock>& block() const {
    return block_;
  }

  const std::string& path() const {
    return path_;
  }
  // Byte offset of the next record (uncompressed stream).
  uint64_t offset() const {
    return offset_;
  }
  // Records read so far = index of the next record.
  int64_t index() const {
    return index_;
  }

 private:
  [[noreturn]] void fail(
      RecordErrorKind kind,
      uint64_t at,
      const std::string& what);
  // Makes n bytes from begin_ on available in block_ unless the stream
  // ends first; returns how many are (< n only at the end).
  size_t fill(size_t n);

  std::string path_;
  std::unique_ptr<InputStream> in_;
  // The stream's bytes read ahead: [begin_, end_) of block_ are not yet
  // handed out as records.
  std::shared_ptr<RecordBlock> block_;
  size_t begin_ = 0;
  size_t end_ = 0;
  bool eof_ = false;
  bool compressed_ = false;
  uint64_t offset_ = 0;
  int64_t index_ = 0;
  bool failed_ = false;
};

class RecordWriter {
 public:
  // Creates (truncates) `path`; throws RecordError(kIo) when it cannot.
  RecordWriter(std::string path, Compression compression);
  // Closes; errors at this point are swallowed (call close() to see them).
  ~RecordWriter();
  RecordWriter(const RecordWriter&) = delete;
  RecordWriter& operator=(const RecordWriter&) = delete;

  // Appends one framed record. Throws RecordError(kIo) on write failure or
  // after close().
  void write(const void* data, size_t size);
  void write(const std::string& record) {
    write(record.data(), record.size());
  }
  // Pushes buffered bytes to the OS (compressed: a zlib sync flush, which
  // keeps the stream valid for readers that stop there).
  void flush();
  // Finishes the compressed stream and closes the file. Idempotent.
  void close();

  const std::string& path() const {
    return path_;
  }
  int64_t records_written() const {
    return records_;
  }

 private:
  void put(const void* data, size_t size); // through compression
  void drain(int flush_mode);
  void write_file(const void* data, size_t size);

  std::string path_;
  Compression compression_;
  std::FILE* file_ = nullptr;
  struct Deflate;
  std::unique_ptr<Deflate> deflate_;
  int64_t records_ = 0;
};

// The 16 bytes of framing around a record of `size` bytes: header (length +
// its masked CRC) and footer (masked CRC of data). For tests and writers.
void frame_header(uint64_t size, uint8_t out[12]);
uint32_t frame_footer(const void* data, size_t size);

} // namespace torch_stage::records
