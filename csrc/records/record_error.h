// RecordError: the one exception type of the records code (TFRecord files,
// tf.train.Example parsing, RecordInput).
//
// Plain C++17 (no torch headers), like everything in csrc/records except
// parse_example.{h,cpp}, so the readers, the parser and RecordInput build and
// run under ThreadSanitizer and AddressSanitizer (`make tsan`, `make asan`).
//
// Every error says where and what: the file (when there is one), the byte
// offset or the record index, the feature key (for parse errors), and what was
// expected. The Python bindings map `kind` to torch_stage.RecordError's
// subclasses and copy path/offset/record_index/key onto the exception.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace torch_stage::records {

enum class RecordErrorKind {
  kInvalidArgument, // a caller's bad value (Python: ValueError)
  kNotFound, // no file matches a pattern, or a file does not exist
  kIo, // open/read/write failed (errno text in the message)
  kTruncated, // the file ends inside a record
  kCorrupt, // a CRC mismatch, or a compressed stream that does not inflate
  kNoRecords, // a whole pass over a reader's files yielded no record
  kNotExample, // bytes that are not a serialized tf.train.Example
  kMissingFeature, // a required key is absent from an Example
  kWrongType, // a feature holds another list type than the spec asks for
  kWrongSize, // a fixed-length feature holds the wrong number of values
};

const char* to_string(RecordErrorKind kind);

class RecordError : public std::runtime_error {
 public:
  // `message` is the full, user-facing text; the fields repeat its parts so
  // callers can act on them without parsing text. -1 / "" mean "not known".
  RecordError(
      RecordErrorKind kind,
      const std::string& message,
      std::string path = "",
      int64_t offset = -1,
      int64_t record_index = -1,
      std::string key = "")
      : std::runtime_error(message),
        kind_(kind),
        path_(std::move(path)),
        offset_(offset),
        record_index_(record_index),
        key_(std::move(key)) {}

  RecordErrorKind kind() const {
    return kind_;
  }
  const std::string& path() const {
    return path_;
  }
  int64_t offset() const {
    return offset_;
  }
  int64_t record_index() const {
    return record_index_;
  }
  const std::string& key() const {
    return key_;
  }

 private:
  RecordErrorKind kind_;
  std::string path_;
  int64_t offset_;
  int64_t record_index_;
  std::string key_;
};

} // namespace torch_stage::records
