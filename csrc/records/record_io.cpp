#include "records/record_io.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <exception>
#include <limits>
#include <sstream>

#include "records/crc32c.h"

namespace torch_stage::records {

const char* to_string(RecordErrorKind kind) {
  switch (kind) {
    case RecordErrorKind::kInvalidArgument:
      return "invalid argument";
    case RecordErrorKind::kNotFound:
      return "not found";
    case RecordErrorKind::kIo:
      return "I/O error";
    case RecordErrorKind::kTruncated:
      return "truncated";
    case RecordErrorKind::kCorrupt:
      return "corrupt";
    case RecordErrorKind::kNoRecords:
      return "no records";
    case RecordErrorKind::kNotExample:
      return "not an Example";
    case RecordErrorKind::kMissingFeature:
      return "missing feature";
    case RecordErrorKind::kWrongType:
      return "wrong feature type";
    case RecordErrorKind::kWrongSize:
      return "wrong feature size";
  }
  return "unknown";
}

namespace {

constexpr size_t kIoBuffer = 256 * 1024;
// A reader's blocks: ~720 Criteo-like rows, one read(2) each.
constexpr size_t kBlockBytes = 256 * 1024;
// A record's bytes are read in pieces of at most this much, so a corrupt
// length (that still passed its CRC, or a fuzzed one) costs at most what the
// file really holds, never an up-front allocation of `length` bytes.
constexpr size_t kReadPiece = 4 * 1024 * 1024;

std::string errno_text(int err) {
  return std::strerror(err);
}

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) {
    v = (v << 8) | p[i];
  }
  return v;
}

uint32_t load_le32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
      (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

void store_le64(uint64_t v, uint8_t* p) {
  for (int i = 0; i < 8; ++i) {
    p[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

void store_le32(uint32_t v, uint8_t* p) {
  for (int i = 0; i < 4; ++i) {
    p[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// The raw bytes of a file, read with read(2): the RecordReader buffers them
// itself, in blocks it can hand out.
class FileInput : public InputStream {
 public:
  explicit FileInput(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      const int err = errno;
      throw RecordError(
          err == ENOENT ? RecordErrorKind::kNotFound : RecordErrorKind::kIo,
          "cannot open TFRecord file '" + path + "': " + errno_text(err),
          path);
    }
    struct stat st;
    if (::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode)) {
      size_at_open_ = static_cast<uint64_t>(st.st_size);
#if defined(POSIX_FADV_SEQUENTIAL)
      ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
    }
  }
  ~FileInput() override {
    ::close(fd_);
  }

  size_t read(void* dst, size_t n) override {
    if (deferred_) {
      std::rethrow_exception(deferred_);
    }
    size_t got = 0;
    try {
      while (got < n) {
        const ssize_t r = ::read(fd_, static_cast<char*>(dst) + got, n - got);
        if (r < 0) {
          const int err = errno;
          if (err == EINTR) {
            continue;
          }
          throw RecordError(
              RecordErrorKind::kIo,
              "cannot read TFRecord file '" + path_ + "': " + errno_text(err),
              path_);
        }
        if (r == 0) {
          break;
        }
        got += static_cast<size_t>(r);
        position_ += static_cast<uint64_t>(r);
      }
      // A file cut shorter after it was opened (truncated or rewritten in
      // place) would otherwise end "cleanly" at a record boundary and lose
      // the rest without a word: report the change instead.
      if (got < n && position_ < size_at_open_) {
        throw RecordError(
            RecordErrorKind::kIo,
            "TFRecord file '" + path_ + "' shrank while being read: it held " +
                std::to_string(size_at_open_) +
                " bytes when opened, reading ends at byte " +
                std::to_string(position_) + " (was it truncated or rewritten?)",
            path_,
            static_cast<int64_t>(position_));
      }
    } catch (const RecordError&) {
      if (got == 0) {
        throw;
      }
      deferred_ = std::current_exception();
    }
    return got;
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t position_ = 0; // bytes read so far
  // The size of a regular file when opened; 0 for pipes and the like, whose
  // size says nothing.
  uint64_t size_at_open_ = 0;
  std::exception_ptr deferred_;
};

// Inflates a GZIP (windowBits 16+15) or ZLIB (15) stream read from a file.
// Concatenated gzip members are read as one stream, like gzip(1) does.
class ZlibInput : public InputStream {
 public:
  ZlibInput(const std::string& path, Compression compression)
      : path_(path), file_(path), gzip_(compression == Compression::kGzip) {
    std::memset(&z_, 0, sizeof(z_));
    in_.resize(kIoBuffer);
    if (inflateInit2(&z_, gzip_ ? 16 + MAX_WBITS : MAX_WBITS) != Z_OK) {
      throw RecordError(
          RecordErrorKind::kIo,
          "zlib inflateInit2 failed for '" + path + "'",
          path);
    }
  }
  ~ZlibInput() override {
    inflateEnd(&z_);
  }

  size_t read(void* dst, size_t n) override {
    if (deferred_) {
      std::rethrow_exception(deferred_);
    }
    size_t produced = 0;
    try {
      produce(dst, n, &produced);
    } catch (const RecordError&) {
      if (produced == 0) {
        throw;
      }
      deferred_ = std::current_exception();
    }
    return produced;
  }

 private:
  // Inflates into dst until n bytes or the stream's end; *produced counts
  // the bytes written so far, also when it throws.
  void produce(void* dst, size_t n, size_t* produced_out) {
    size_t& produced = *produced_out;
    while (produced < n && !done_) {
      if (z_.avail_in == 0 && !file_eof_) {
        const size_t got = file_.read(in_.data(), in_.size());
        if (got == 0) {
          file_eof_ = true;
        }
        z_.next_in = reinterpret_cast<Bytef*>(in_.data());
        z_.avail_in = static_cast<uInt>(got);
      }
      if (z_.avail_in == 0 && file_eof_) {
        if (!member_started_) { // clean end after a complete gzip member
          done_ = true;
          break;
        }
        throw RecordError(
            RecordErrorKind::kTruncated,
            std::string("truncated ") + (gzip_ ? "GZIP" : "ZLIB") +
                " stream in '" + path_ +
                "': the file ends at compressed byte " +
                std::to_string(consumed_) + " before the stream's end marker",
            path_,
            static_cast<int64_t>(consumed_));
      }
      const size_t want = std::min<size_t>(n - produced, 1u << 30);
      z_.next_out = static_cast<Bytef*>(dst) + produced;
      z_.avail_out = static_cast<uInt>(want);
      const uInt before_in = z_.avail_in;
      const int rc = inflate(&z_, Z_NO_FLUSH);
      consumed_ += before_in - z_.avail_in;
      produced += want - z_.avail_out;
      inflated_any_ = inflated_any_ || want > z_.avail_out;
      member_started_ = true;
      if (rc == Z_STREAM_END) {
        member_started_ = false;
        if (gzip_) {
          // Another member may follow; an empty remainder ends the stream.
          inflateReset(&z_);
        } else {
          done_ = true;
          if (z_.avail_in > 0 || file_.read(in_.data(), 1) > 0) {
            throw RecordError(
                RecordErrorKind::kCorrupt,
                "corrupt ZLIB stream in '" + path_ +
                    "': bytes follow the stream's end marker at compressed "
                    "byte " +
                    std::to_string(consumed_),
                path_,
                static_cast<int64_t>(consumed_));
          }
        }
      } else if (rc == Z_BUF_ERROR) {
        // No progress possible: more input needed (loop reads it) or none
        // is left (caught above on the next turn).
        continue;
      } else if (rc != Z_OK) {
        throw RecordError(
            RecordErrorKind::kCorrupt,
            std::string("corrupt ") + (gzip_ ? "GZIP" : "ZLIB") +
                " stream in '" + path_ + "' near compressed byte " +
                std::to_string(consumed_) + ": " +
                (z_.msg != nullptr ? z_.msg
                                   : "inflate error " + std::to_string(rc)) +
                (inflated_any_
                     ? ""
                     : " (nothing of the file inflates: a plain "
                       "TFRecord file is read with compression=None)"),
            path_,
            static_cast<int64_t>(consumed_));
      }
    }
  }

  std::string path_;
  FileInput file_;
  bool gzip_;
  z_stream z_;
  std::vector<char> in_;
  bool file_eof_ = false;
  bool done_ = false;
  // True while inside a (gzip) member whose end marker is not yet seen.
  bool member_started_ = false;
  // Whether any byte inflated: an error before the first one suggests the
  // file is not compressed at all.
  bool inflated_any_ = false;
  uint64_t consumed_ = 0;
  std::exception_ptr deferred_;
};

} // namespace

Compression parse_compression(const std::string& name) {
  std::string upper;
  for (char c : name) {
    upper.push_back(
        static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  }
  if (upper.empty() || upper == "NONE") {
    return Compression::kNone;
  }
  if (upper == "GZIP") {
    return Compression::kGzip;
  }
  if (upper == "ZLIB") {
    return Compression::kZlib;
  }
  throw RecordError(
      RecordErrorKind::kInvalidArgument,
      "compression must be None, \"\", \"GZIP\" or \"ZLIB\", got \"" + name +
          "\"");
}

const char* to_string(Compression compression) {
  switch (compression) {
    case Compression::kNone:
      return "";
    case Compression::kGzip:
      return "GZIP";
    case Compression::kZlib:
      return "ZLIB";
  }
  return "?";
}

std::vector<std::string> match_files(const std::vector<std::string>& patterns) {
  if (patterns.empty()) {
    throw RecordError(
        RecordErrorKind::kInvalidArgument,
        "no file pattern given: pass a path, a glob pattern or a list of them");
  }
  std::vector<std::string> files;
  for (const auto& pattern : patterns) {
    glob_t g;
    std::memset(&g, 0, sizeof(g));
    const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
    size_t found = 0;
    if (rc == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) {
        files.emplace_back(g.gl_pathv[i]);
        ++found;
      }
    }
    globfree(&g);
    if (found == 0) {
      throw RecordError(
          RecordErrorKind::kNotFound,
          "no file matches the pattern '" + pattern + "'",
          pattern);
    }
  }
  std::sort(files.begin(), files.end());
  files.erase(std::unique(files.begin(), files.end()), files.end());
  return files;
}

std::vector<std::string> shard_files(
    const std::vector<std::string>& files,
    int64_t rank,
    int64_t world) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw RecordError(
        RecordErrorKind::kInvalidArgument,
        "shard must be (rank, world_size) with world_size >= 1 and 0 <= rank "
        "< world_size, got (" +
            std::to_string(rank) + ", " + std::to_string(world) + ")");
  }
  std::vector<std::string> mine;
  for (size_t i = static_cast<size_t>(rank); i < files.size();
       i += static_cast<size_t>(world)) {
    mine.push_back(files[i]);
  }
  if (mine.empty()) {
    throw RecordError(
        RecordErrorKind::kInvalidArgument,
        "shard (" + std::to_string(rank) + ", " + std::to_string(world) +
            ") gets no file: sharding is by file and only " +
            std::to_string(files.size()) +
            " matched; use at most that many shards");
  }
  return mine;
}

// ---------------------------------------------------------------- reading

namespace {

// A compressed file read as a plain one fails its first header; its first
// bytes tell which compression was meant (TensorFlow's reader says nothing).
std::string compression_hint(const uint8_t* bytes, size_t n) {
  if (n >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b) {
    return "; the file starts like a GZIP stream: read it with "
           "compression=\"GZIP\"";
  }
  if (n >= 2 && bytes[0] == 0x78 && ((bytes[0] << 8) | bytes[1]) % 31 == 0) {
    return "; the file starts like a ZLIB stream: read it with "
           "compression=\"ZLIB\"";
  }
  return "";
}

} // namespace

RecordReader::RecordReader(std::string path, Compression compression)
    : path_(std::move(path)), compressed_(compression != Compression::kNone) {
  if (compression == Compression::kNone) {
    in_ = std::make_unique<FileInput>(path_);
  } else {
    in_ = std::make_unique<ZlibInput>(path_, compression);
  }
}

RecordReader::~RecordReader() = default;

void RecordReader::fail(
    RecordErrorKind kind,
    uint64_t at,
    const std::string& what) {
  failed_ = true;
  std::ostringstream msg;
  msg << (kind == RecordErrorKind::kTruncated ? "truncated" : "corrupt")
      << " record " << index_ << " at byte offset " << at << " in '" << path_
      << "': " << what;
  throw RecordError(kind, msg.str(), path_, static_cast<int64_t>(at), index_);
}

size_t RecordReader::fill(size_t n) {
  while (end_ - begin_ < n && !eof_) {
    const size_t held = end_ - begin_;
    if (block_ == nullptr || end_ == block_->capacity) {
      // Room for the rest of n, growing at most to twice the block (and
      // kReadPiece) at a time: a corrupt length (one that passed its CRC, or
      // a fuzzed one) costs about what the stream really holds, never an
      // allocation of `length`, and a huge record still copies in linear
      // time.
      const size_t cap = block_ == nullptr ? 0 : block_->capacity;
      const size_t want = std::max(
          kBlockBytes, std::min(n, std::max(2 * cap, held + kReadPiece)));
      if (block_ != nullptr && block_.use_count() == 1 &&
          block_->capacity >= want) {
        // Nobody else holds the records before begin_: reuse the block.
        // (use_count() is a relaxed load; the fence orders the last other
        // holder's reads, before its release, before these writes.)
        std::atomic_thread_fence(std::memory_order_acquire);
        std::memmove(block_->bytes.get(), block_->bytes.get() + begin_, held);
      } else {
        auto fresh = std::make_shared<RecordBlock>();
        fresh->bytes.reset(new uint8_t[want]);
        fresh->capacity = want;
        if (held > 0) {
          std::memcpy(fresh->bytes.get(), block_->bytes.get() + begin_, held);
        }
        block_ = std::move(fresh);
      }
      begin_ = 0;
      end_ = held;
    }
    const size_t got =
        in_->read(block_->bytes.get() + end_, block_->capacity - end_);
    if (got == 0) {
      eof_ = true;
    }
    end_ += got;
  }
  return std::min(end_ - begin_, n);
}

bool RecordReader::read(std::string* out) {
  RecordSpan rec;
  if (!next(&rec)) {
    out->clear();
    return false;
  }
  out->assign(reinterpret_cast<const char*>(rec.data), rec.size);
  return true;
}

bool RecordReader::read_append(std::vector<uint8_t>* out) {
  RecordSpan rec;
  if (!next(&rec)) {
    return false;
  }
  out->insert(out->end(), rec.data, rec.data + rec.size);
  return true;
}

bool RecordReader::next(RecordSpan* out) {
  if (failed_) {
    throw RecordError(
        RecordErrorKind::kIo,
        "the reader of '" + path_ +
            "' was stopped by an earlier error and cannot continue",
        path_,
        static_cast<int64_t>(offset_),
        index_);
  }
  const uint64_t start = offset_;
  try {
    constexpr size_t kHeader = 12;
    constexpr size_t kFooter = 4;
    const size_t got = fill(kHeader);
    if (got == 0) {
      return false;
    }
    const uint8_t* header = block_->bytes.get() + begin_;
    // Only on a failure: this runs once per record.
    const auto hint = [&] {
      return start == 0 && !compressed_ ? compression_hint(header, got)
                                        : std::string();
    };
    if (got < kHeader) {
      fail(
          RecordErrorKind::kTruncated,
          start,
          "expected a 12-byte header (8-byte length + 4-byte length CRC), "
          "the file ends after " +
              std::to_string(got) + " bytes" + hint());
    }
    const uint64_t length = load_le64(header);
    const uint32_t stored = load_le32(header + 8);
    const uint32_t expected = mask_crc(crc32c(header, 8));
    if (stored != expected) {
      fail(
          RecordErrorKind::kCorrupt,
          start,
          "length CRC mismatch: expected masked crc32c " + hex32(expected) +
              " of the length field, found " + hex32(stored) + hint());
    }
    // Bounded so that the sum below cannot wrap; such a record cannot be
    // in a stream anyway, and fill() finds where the stream ends.
    const size_t data_size = static_cast<size_t>(
        std::min<uint64_t>(length, std::numeric_limits<size_t>::max() / 2));
    const size_t have = fill(kHeader + data_size);
    if (have < kHeader + data_size) {
      fail(
          RecordErrorKind::kTruncated,
          start,
          "expected " + std::to_string(length) +
              " data bytes, the file ends after " +
              std::to_string(have - kHeader));
    }
    const size_t f = fill(kHeader + data_size + kFooter) - kHeader - data_size;
    if (f < kFooter) {
      fail(
          RecordErrorKind::kTruncated,
          start,
          "expected a 4-byte data CRC after " + std::to_string(length) +
              " data bytes, the file ends after " + std::to_string(f));
    }
    const uint8_t* data = block_->bytes.get() + begin_ + kHeader;
    const uint32_t stored_data = load_le32(data + data_size);
    const uint32_t expected_data = mask_crc(crc32c(data, data_size));
    if (stored_data != expected_data) {
      fail(
          RecordErrorKind::kCorrupt,
          start,
          "data CRC mismatch: expected masked crc32c " + hex32(expected_data) +
              " of " + std::to_string(length) + " data bytes, found " +
              hex32(stored_data));
    }
    out->data = data;
    out->size = data_size;
    begin_ += kHeader + data_size + kFooter;
    offset_ = start + kHeader + length + kFooter;
    ++index_;
    return true;
  } catch (const RecordError& e) {
    failed_ = true;
    if (e.record_index() >= 0) {
      throw;
    }
    // A stream-level error (I/O, bad compressed data): add the record.
    throw RecordError(
        e.kind(),
        std::string(e.what()) + " (while reading record " +
            std::to_string(index_) + ", which starts at uncompressed byte " +
            std::to_string(start) + ")",
        path_,
        static_cast<int64_t>(start),
        index_);
  }
}

// ---------------------------------------------------------------- writing

struct RecordWriter::Deflate {
  z_stream z;
  std::vector<uint8_t> out;
};

RecordWriter::RecordWriter(std::string path, Compression compression)
    : path_(std::move(path)), compression_(compression) {
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr) {
    const int err = errno;
    throw RecordError(
        RecordErrorKind::kIo,
        "cannot create TFRecord file '" + path_ + "': " + errno_text(err),
        path_);
  }
  std::setvbuf(file_, nullptr, _IOFBF, kIoBuffer);
  if (compression_ != Compression::kNone) {
    deflate_ = std::make_unique<Deflate>();
    std::memset(&deflate_->z, 0, sizeof(deflate_->z));
    deflate_->out.resize(kIoBuffer);
    const int bits =
        compression_ == Compression::kGzip ? 16 + MAX_WBITS : MAX_WBITS;
    if (deflateInit2(
            &deflate_->z,
            Z_DEFAULT_COMPRESSION,
            Z_DEFLATED,
            bits,
            8,
            Z_DEFAULT_STRATEGY) != Z_OK) {
      std::fclose(file_);
      file_ = nullptr;
      throw RecordError(
          RecordErrorKind::kIo,
          "zlib deflateInit2 failed for '" + path_ + "'",
          path_);
    }
  }
}

RecordWriter::~RecordWriter() {
  try {
    close();
  } catch (const RecordError&) {
    // Destructors must not throw; close() explicitly to see the error.
  }
}

void RecordWriter::write_file(const void* data, size_t size) {
  if (size > 0 && std::fwrite(data, 1, size, file_) != size) {
    const int err = errno;
    throw RecordError(
        RecordErrorKind::kIo,
        "cannot write TFRecord file '" + path_ + "': " + errno_text(err),
        path_);
  }
}

void RecordWriter::drain(int flush_mode) {
  auto& z = deflate_->z;
  do {
    z.next_out = deflate_->out.data();
    z.avail_out = static_cast<uInt>(deflate_->out.size());
    const int rc = ::deflate(&z, flush_mode);
    if (rc == Z_STREAM_ERROR) {
      throw RecordError(
          RecordErrorKind::kIo,
          "zlib deflate failed for '" + path_ + "'",
          path_);
    }
    write_file(deflate_->out.data(), deflate_->out.size() - z.avail_out);
  } while (z.avail_out == 0 || z.avail_in > 0);
}

void RecordWriter::put(const void* data, size_t size) {
  if (!deflate_) {
    write_file(data, size);
    return;
  }
  auto& z = deflate_->z;
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const size_t piece = std::min<size_t>(size, 1u << 30);
    z.next_in = const_cast<Bytef*>(p);
    z.avail_in = static_cast<uInt>(piece);
    drain(Z_NO_FLUSH);
    p += piece;
    size -= piece;
  }
}

void RecordWriter::write(const void* data, size_t size) {
  if (file_ == nullptr) {
    throw RecordError(
        RecordErrorKind::kIo,
        "cannot write to '" + path_ + "': the writer is closed",
        path_);
  }
  uint8_t header[12];
  frame_header(size, header);
  uint8_t footer[4];
  store_le32(frame_footer(data, size), footer);
  put(header, sizeof(header));
  put(data, size);
  put(footer, sizeof(footer));
  ++records_;
}

void RecordWriter::flush() {
  if (file_ == nullptr) {
    return;
  }
  if (deflate_) {
    deflate_->z.avail_in = 0;
    drain(Z_SYNC_FLUSH);
  }
  if (std::fflush(file_) != 0) {
    const int err = errno;
    throw RecordError(
        RecordErrorKind::kIo,
        "cannot flush '" + path_ + "': " + errno_text(err),
        path_);
  }
}

void RecordWriter::close() {
  if (file_ == nullptr) {
    return;
  }
  std::FILE* file = file_;
  bool ok = true;
  std::string what;
  try {
    if (deflate_) {
      deflate_->z.avail_in = 0;
      drain(Z_FINISH);
    }
  } catch (const RecordError& e) {
    ok = false;
    what = e.what();
  }
  if (deflate_) {
    deflateEnd(&deflate_->z);
    deflate_.reset();
  }
  file_ = nullptr;
  if (std::fclose(file) != 0 && ok) {
    const int err = errno;
    ok = false;
    what = "cannot close '" + path_ + "': " + errno_text(err);
  }
  if (!ok) {
    throw RecordError(RecordErrorKind::kIo, what, path_);
  }
}

void frame_header(uint64_t size, uint8_t out[12]) {
  store_le64(size, out);
  store_le32(mask_crc(crc32c(out, 8)), out + 8);
}

uint32_t frame_footer(const void* data, size_t size) {
  return mask_crc(crc32c(data, size));
}

} // namespace torch_stage::records
