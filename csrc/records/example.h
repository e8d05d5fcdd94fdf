// tf.train.Example without protobuf: a minimal wire-format reader for the
// fixed schema, an encoder, and a batch parser that writes into caller-owned
// buffers (parse_example.cpp gives it tensors; tests give it vectors).
//
// The schema (tensorflow/core/example/{example,feature}.proto):
//
//   Example   { Features features = 1; }
//   Features  { map<string, Feature> feature = 1; }   // entries: key=1 value=2
//   Feature   { oneof kind { BytesList bytes_list = 1;
//                            FloatList float_list = 2;
//                            Int64List int64_list = 3; } }
//   BytesList { repeated bytes value = 1; }
//   FloatList { repeated float value = 1 [packed = true]; }
//   Int64List { repeated int64 value = 1 [packed = true]; }
//
// Protobuf rules honoured: packed and unpacked encodings of the repeated
// scalars (and mixtures of both), unknown fields skipped, a repeated
// embedded `features` merged, the last map entry for a key wins, the last
// member of the oneof wins. Groups (wire types 3/4, deprecated, never in an
// Example) are rejected as malformed. Every length is bounds-checked: any
// byte string yields either a result or RecordError(kNotExample), never a
// read outside the record (fuzzed under ASan: tests/cpp/test_records_fuzz).
//
// Pure C++17; all functions are reentrant (no shared state).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "records/record_error.h"

namespace torch_stage::records {

// The list type a Feature holds. kNone: the Feature has no list set (an
// empty Feature{}), which, as in TensorFlow, a var-length spec of any type
// reads as an empty list and a fixed-length spec as a missing key.
enum class FeatureKind : uint8_t {
  kNone = 0,
  kBytes = 1,
  kFloat = 2,
  kInt64 = 3
};

const char* to_string(FeatureKind kind);

// Where a feature's list lives inside a serialized Example.
struct FeatureView {
  const uint8_t* record = nullptr; // the Example it is in, for error offsets
  bool found = false;
  FeatureKind kind = FeatureKind::kNone;
  const uint8_t* data = nullptr; // the BytesList/FloatList/Int64List payload
  size_t size = 0;
};

// The keys a parse looks for, with the lookup of an entry's key. Records of
// one dataset list their features in one order, so the lookup first tries
// the key that followed the previous key last time (one comparison per
// entry once the order is learned), then a hash table (any order, unknown
// keys). Immutable after construction; the learned order lives in a
// KeyOrder owned by one thread.
class KeyIndex {
 public:
  static constexpr size_t kNone = static_cast<size_t>(-1);

  explicit KeyIndex(std::vector<std::string> keys);
  KeyIndex(const KeyIndex&) = delete;
  KeyIndex& operator=(const KeyIndex&) = delete;

  size_t size() const {
    return keys_.size();
  }

  // Per-thread state of the lookup: which key followed which.
  class Order {
   public:
    explicit Order(const KeyIndex& index);

   private:
    friend class KeyIndex;
    // next_[k]: the key guessed after key k; next_[size()]: the first key.
    std::vector<size_t> next_;
    size_t previous_ = 0; // the last key found in this record, or size()
  };

  // Call at the start of each record.
  void begin(Order* order) const {
    order->previous_ = keys_.size();
  }
  // The index of the key `key[0:n]`, or kNone. The guess is checked here,
  // inline (feature keys are a few bytes: a loop beats a call to memcmp).
  // The key find() tries first (>= size(): none), and accepting it without
  // find(): for a caller that matched the guessed key's bytes itself.
  size_t guess(const Order& order) const {
    return order.next_[order.previous_];
  }
  void accept_guess(Order* order) const {
    order->previous_ = order->next_[order->previous_];
  }
  size_t find(const uint8_t* key, size_t n, Order* order) const {
    const size_t guess = order->next_[order->previous_];
    if (guess < keys_.size()) {
      const std::string& want = keys_[guess];
      bool same = want.size() == n;
      for (size_t i = 0; same && i < n; ++i) {
        same = static_cast<uint8_t>(want[i]) == key[i];
      }
      if (same) {
        order->previous_ = guess;
        return guess;
      }
    }
    return find_unguessed(key, n, order);
  }

 private:
  size_t find_unguessed(const uint8_t* key, size_t n, Order* order) const;

  // keys_ is never modified after construction: map_'s views point into it.
  const std::vector<std::string> keys_;
  std::unordered_map<std::string_view, size_t> map_;
};

// Locates keys[i] in the Example `data[0:size]` into views[i] (views has
// keys.size() entries; absent keys keep found=false). Throws
// RecordError(kNotExample) naming the byte position of malformed wire data.
void find_features(
    const uint8_t* data,
    size_t size,
    const KeyIndex& keys,
    KeyIndex::Order* order,
    FeatureView* views);
// The same with a one-off index (tests, single records).
void find_features(
    const uint8_t* data,
    size_t size,
    const std::vector<std::string>& keys,
    FeatureView* views);

// Number of values in a list (for bytes: of byte strings) and, for bytes,
// their total length. Validates the list's wire format (kNotExample).
struct ListSize {
  size_t values = 0;
  size_t bytes = 0;
};
ListSize list_size(const FeatureView& view);

// Decode a list into `out`, which has room for list_size(view).values
// values (bytes: list_size(view).bytes bytes; `value_ends`, if not null, gets
// the end offset of each string relative to `out`, plus `base`).
void decode_int64(const FeatureView& view, int64_t* out);
void decode_float(const FeatureView& view, float* out);

// One walk that validates the list as list_size() does (same errors) and
// decodes its first min(values, limit) values into `out`; returns the
// number of values. For fixed-length features: the count is checked after,
// and nothing is written past `limit`.
size_t decode_int64_at_most(
    const FeatureView& view,
    int64_t* out,
    size_t limit);
size_t decode_float_at_most(const FeatureView& view, float* out, size_t limit);
void decode_bytes(
    const FeatureView& view,
    uint8_t* out,
    int64_t* value_ends,
    int64_t base);

// Builds a serialized Example. Lists are written packed, features in the
// order added (deterministic bytes, as a test vector needs). For tests,
// writers and the Python encode_example().
class ExampleEncoder {
 public:
  void add_bytes(
      const std::string& key,
      const std::vector<std::string>& values);
  void add_float(const std::string& key, const std::vector<float>& values);
  void add_int64(const std::string& key, const std::vector<int64_t>& values);
  // The Example so far.
  std::string serialize() const;

 private:
  void add_entry(const std::string& key, const std::string& feature);
  // A Feature holding one packed numeric list (field 2: floats, 3: int64s).
  void add_packed(
      const std::string& key,
      uint32_t list_field,
      const std::string& packed);
  std::string features_; // serialized map entries
};

// ------------------------------------------------------------ batch parsing

struct FeatureSpec {
  std::string key;
  FeatureKind kind = FeatureKind::kInt64; // kBytes, kFloat or kInt64
  bool var_len = false;
  // Fixed-length features: values per record (bytes: bytes per record, all
  // of the record's byte strings concatenated).
  int64_t fixed_count = 1;
  // The per-record shape of a fixed-length feature's output (its product is
  // fixed_count); only the tensor layer (parse_example.h) reads it.
  std::vector<int64_t> shape;
  // Used when the key is absent; without one an absent key is an error.
  // Fixed-length: exactly fixed_count values (bytes: fixed_count bytes).
  // Var-length: any number of values; for bytes, one string per element of
  // bytes_default.
  bool has_default = false;
  std::vector<int64_t> int64_default;
  std::vector<float> float_default;
  std::vector<std::string> bytes_default;
};

// Checks specs (kinds, counts, defaults, duplicate keys); throws
// RecordError(kInvalidArgument) naming the key and the rule.
void validate_specs(const std::vector<FeatureSpec>& specs);

struct RecordRef {
  const uint8_t* data;
  size_t size;
  // Where readable memory ends, if past the record (records of one batch
  // lie in one buffer): the fast walk reads whole words up to here rather
  // than copying a record's last bytes aside first. Null: the record's end.
  const uint8_t* readable_end = nullptr;
};

// Where the parse writes one feature. Fixed-length: `values` holds
// n * fixed_count elements (int64_t, float or uint8_t per kind), record i at
// slot i. Var-length: after count(), allocate `values` for var_values(s)
// elements (bytes: var_bytes(s) bytes), `offsets` for n + 1 entries and, for
// bytes, `value_offsets` for var_values(s) + 1 entries.
struct FeatureOutput {
  void* values = nullptr;
  int64_t* offsets = nullptr;
  int64_t* value_offsets = nullptr;
};

// What the parse of a batch needs to know of its specs, worked out once:
// the validated specs, the key lookup, and the fast walk's per-spec tables.
// Immutable once made: BatchParsers of many batches, on any threads, share
// one (parse_example's callers keep it per feature mapping).
class ParseSchema {
 public:
  // Validates (RecordError kInvalidArgument naming the key and the rule).
  explicit ParseSchema(std::vector<FeatureSpec> specs);
  ParseSchema(const ParseSchema&) = delete;
  ParseSchema& operator=(const ParseSchema&) = delete;

  const std::vector<FeatureSpec>& specs() const {
    return specs_;
  }

 private:
  friend class BatchParser;
  // What the fast walk reads of each spec, packed (a FeatureSpec is large).
  struct Compact {
    size_t fixed_count;
    size_t column; // var_index_
    FeatureKind kind;
    bool var_len;
  };
  // A map entry's bytes from its key field to its value's tag, for each
  // spec: 0x0a, the key's length, the key, 0x12, as two little-endian words
  // and masks, compared at once where the key is the guessed one (keys of
  // up to 13 bytes; size 0 for longer ones, which find() compares).
  struct KeyPattern {
    uint64_t lo = 0, hi = 0, lo_mask = 0, hi_mask = 0;
    size_t size = 0;
  };
  // A whole usual entry's framing up to its packed numbers, per spec (see
  // scan_fast_body): byte k of the entry is byte k of base + L * length,
  // where L is the entry's length (one byte); size 0 for bytes features and
  // keys of more than 14 bytes.
  struct EntryPattern {
    uint64_t base[3] = {0, 0, 0};
    uint64_t length[3] = {0, 0, 0};
    uint64_t mask[3] = {0, 0, 0};
    size_t size = 0; // bytes before the packed numbers
    size_t min_length = 0; // of the entry: a list of one byte or more
  };

  const std::vector<FeatureSpec> specs_;
  KeyIndex keys_;
  // var_index_[spec]: the spec's column among the var-length specs (cell
  // record * num_var_ + column), or -1 for a fixed-length spec.
  std::vector<int64_t> var_index_;
  size_t num_var_ = 0;
  std::vector<size_t> bytes_specs_; // specs of bytes, in spec order
  std::vector<size_t> var_specs_; // var-length specs, in spec order
  std::vector<Compact> compact_;
  std::vector<KeyPattern> key_patterns_;
  std::vector<EntryPattern> entry_patterns_;
  uint64_t all_specs_mask_ = 0; // one bit per spec (fast walk: <= 64 specs)
};

// Parses a batch of Examples in two passes, each over disjoint record
// ranges that may run on different threads at once:
//
//   scan(b, e, outs)   locate every feature, check types and sizes, decode
//                      fixed-length features into their slots, decode
//                      var-length numbers into a scratch buffer of the
//                      range (bytes: count them)
//   count()            (one thread, after every scan) prefix sums
//   fill(b, e, outs)   var-length features into place (numbers: a copy
//                      from the scratch; bytes: decoded from the record)
//
// Each record is first tried by a fast walk that accepts only the usual
// encoding (one `features` field, entries of key then value, each Feature
// one list, numbers packed, every key of the specs once) and never throws;
// a record it does not accept, for any reason, is parsed again from the
// start by the general walk, which gives the same values for every record
// the fast walk accepts and the errors and the protobuf corner cases
// (defaults, repeated keys, unpacked values, ...) for the rest.
//
// Errors never escape scan/fill: each range stops at its first bad record
// and the error with the lowest record index is kept, so the error reported
// is the same whatever the threads did. check() rethrows it (call it after
// scan and again after fill). Thread-safety: scan/fill of disjoint ranges
// concurrently; everything else from one thread between passes.
class BatchParser {
 public:
  // Which walks parse: kAuto (the fast walk, with BMI2's pext where the CPU
  // runs it fast, then the general one) for use; the others for tests that
  // compare them (kFastPext needs a CPU with BMI2: has_fast_pext()).
  enum class Walk { kAuto, kGeneral, kFastPortable, kFastPext };

  BatchParser(
      std::shared_ptr<const ParseSchema> schema,
      std::vector<RecordRef> records,
      Walk walk = Walk::kAuto);
  // With a schema of its own (tests, one-off parses).
  BatchParser(
      const std::vector<FeatureSpec>& specs,
      std::vector<RecordRef> records,
      Walk walk = Walk::kAuto);
  ~BatchParser();
  BatchParser(const BatchParser&) = delete;
  BatchParser& operator=(const BatchParser&) = delete;

  // BMI2 is there and its pext is not microcoded (AMD before Zen 3).
  static bool has_fast_pext();

  size_t num_records() const {
    return records_.size();
  }
  void scan(size_t begin, size_t end, const std::vector<FeatureOutput>& outs);
  void count();
  int64_t var_values(size_t spec) const;
  int64_t var_bytes(size_t spec) const;
  void fill(size_t begin, size_t end, const std::vector<FeatureOutput>& outs);
  // Rethrows the lowest-indexed error recorded so far, if any.
  void check() const;
  // Records the fast walk parsed so far (the rest took the general walk).
  size_t fast_records() const {
    return fast_records_.load(std::memory_order_relaxed);
  }

 private:
  // Decoded var-length numbers of one scan range, in blocks that never
  // move once written (cells point into them).
  struct Block {
    std::unique_ptr<uint8_t[]> bytes;
    size_t size = 0;
  };
  struct Scratch {
    std::vector<Block> blocks;
    uint8_t* at = nullptr; // the free part of the last block
    size_t left = 0;
    // Room for `bytes` more at `at`, in one block.
    uint8_t* reserve(size_t bytes);
  };
  // Where fill() finds a var-length feature of a record. Trivial, so the
  // per-batch arrays of them are not initialised (scan writes every cell
  // of a record it finishes; fill runs only when every record finished).
  struct VarCell {
    const uint8_t* data; // the list (general walk) or nothing
    size_t size;
    const uint8_t* decoded; // the values in a scratch, if `fast`
    FeatureKind kind;
    bool found;
    bool fast; // decoded by the fast walk (else: decode `data` in fill)
  };

  // true: the fast walk parsed the record.
  bool scan_one(
      size_t record,
      const std::vector<FeatureOutput>& outs,
      KeyIndex::Order* order,
      Scratch* scratch,
      FeatureView* views);
  // scan_fast<true> is compiled for BMI1/BMI2 (tzcnt, blsr, shlx, pext,
  // popcnt) and runs only where has_fast_pext(); both are scan_fast_body.
  template <bool kPext>
  bool scan_fast(
      size_t record,
      const std::vector<FeatureOutput>& outs,
      KeyIndex::Order* order,
      Scratch* scratch,
      FeatureView* views);
  template <bool kPext>
  bool scan_fast_body(
      size_t record,
      const std::vector<FeatureOutput>& outs,
      KeyIndex::Order* order,
      Scratch* scratch,
      FeatureView* views);
  void finish_feature(
      size_t record,
      size_t spec,
      const FeatureView& view,
      const std::vector<FeatureOutput>& outs);
  // A var-length column of a record the fast walk did not decode.
  void fill_one(
      size_t record,
      size_t column,
      const std::vector<FeatureOutput>& outs);
  void record_error(size_t record, const RecordError& error);

  // The schema's tables, by the names the parser's code uses.
  using Compact = ParseSchema::Compact;
  using KeyPattern = ParseSchema::KeyPattern;
  using EntryPattern = ParseSchema::EntryPattern;
  const std::shared_ptr<const ParseSchema> schema_;
  const std::vector<FeatureSpec>& specs_;
  const KeyIndex& keys_;
  const std::vector<int64_t>& var_index_;
  const size_t num_var_;
  const std::vector<size_t>& bytes_specs_;
  const std::vector<size_t>& var_specs_;
  const std::vector<Compact>& compact_;
  const std::vector<KeyPattern>& key_patterns_;
  const std::vector<EntryPattern>& entry_patterns_;
  const uint64_t all_specs_mask_;
  std::vector<RecordRef> records_;
  Walk walk_; // kGeneral, kFastPortable or kFastPext
  // Per var-length cell, written by scan of that record only: the source,
  // and the counts of values (and bytes, for bytes lists); after count(),
  // the exclusive prefix sums.
  // cells_, counts_ and byte_counts_ lie in arrays_ (kept by this thread for
  // its next parser, see example.cpp's ParserMemory).
  Block arrays_;
  VarCell* cells_ = nullptr;
  int64_t* counts_ = nullptr;
  int64_t* byte_counts_ = nullptr;
  std::vector<int64_t> totals_;
  std::vector<int64_t> byte_totals_;
  std::atomic<size_t> fast_records_{0};
  std::mutex scratch_mu_;
  // Guarded by scratch_mu_: every range's scratch, alive until the parser
  // is destroyed.
  std::vector<Block> scratches_;

  // The lowest record index with an error (SIZE_MAX: none), read without the
  // lock so ranges past it stop early; updated under error_mu_.
  std::atomic<size_t> min_error_record_;
  mutable std::mutex error_mu_;
  // Guarded by error_mu_: the lowest-indexed error so far.
  bool has_error_ = false;
  size_t error_record_ = 0;
  RecordError error_{RecordErrorKind::kInvalidArgument, ""};
};

} // namespace torch_stage::records
