#include "records/example.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>
#include <unordered_set>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

// The fast walk's helpers are inlined into scan_fast<true>, which is
// compiled for BMI1/BMI2 and POPCNT (every CPU with a fast pext has them):
// the library itself targets baseline x86-64 and picks that walk at run
// time (BatchParser::has_fast_pext), so no instruction of it runs elsewhere.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TORCH_STAGE_TARGET_BMI2 __attribute__((target("bmi,bmi2,popcnt")))
#else
#define TORCH_STAGE_TARGET_BMI2
#endif
#if defined(__GNUC__) || defined(__clang__)
#define TORCH_STAGE_ALWAYS_INLINE __attribute__((always_inline))
#define TORCH_STAGE_NOINLINE __attribute__((noinline))
#else
#define TORCH_STAGE_ALWAYS_INLINE
#define TORCH_STAGE_NOINLINE
#endif

namespace torch_stage::records {

const char* to_string(FeatureKind kind) {
  switch (kind) {
    case FeatureKind::kNone:
      return "empty";
    case FeatureKind::kBytes:
      return "BytesList";
    case FeatureKind::kFloat:
      return "FloatList";
    case FeatureKind::kInt64:
      return "Int64List";
  }
  return "?";
}

namespace {

// "a BytesList", "a FloatList", "an Int64List": for messages.
std::string with_article(FeatureKind kind) {
  return std::string(kind == FeatureKind::kInt64 ? "an " : "a ") +
      to_string(kind);
}

// Wire types (https://protobuf.dev/programming-guides/encoding/).
constexpr uint32_t kVarint = 0;
constexpr uint32_t kFixed64 = 1;
constexpr uint32_t kLen = 2;
constexpr uint32_t kFixed32 = 5;

[[noreturn]] void malformed(
    const uint8_t* record,
    const uint8_t* at,
    const std::string& what) {
  throw RecordError(
      RecordErrorKind::kNotExample,
      what + " at byte " + std::to_string(at - record));
}

// A bounds-checked cursor over [p, end); `record` is only for messages.
struct Cursor {
  const uint8_t* record;
  const uint8_t* p;
  const uint8_t* end;

  bool done() const {
    return p >= end;
  }

  uint64_t varint() {
    // Tags, lengths and small values are one byte: most varints here.
    if (p < end && *p < 0x80) {
      return *p++;
    }
    // With 10 bytes left no byte of the varint needs a bounds check.
    if (end - p >= 10) {
      uint64_t v = 0;
      for (int k = 0; k < 10; ++k) {
        const uint8_t b = p[k];
        v |= static_cast<uint64_t>(b & 0x7f) << (7 * k);
        if (b < 0x80) {
          p += k + 1;
          return v;
        }
      }
      malformed(record, p, "varint longer than 10 bytes");
    }
    return varint_long();
  }

  uint64_t varint_long() {
    uint64_t v = 0;
    const uint8_t* start = p;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) {
        malformed(record, start, "truncated varint");
      }
      const uint8_t b = *p++;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) {
        return v;
      }
    }
    malformed(record, start, "varint longer than 10 bytes");
  }

  // A length-delimited payload: returns its start, advances past it.
  const uint8_t* bytes(size_t* size) {
    const uint8_t* at = p;
    const uint64_t len = varint();
    if (len > static_cast<uint64_t>(end - p)) {
      malformed(
          record,
          at,
          "length " + std::to_string(len) + " runs past the end of its " +
              "message (" + std::to_string(end - p) + " bytes left)");
    }
    const uint8_t* data = p;
    p += len;
    *size = static_cast<size_t>(len);
    return data;
  }

  void tag(uint32_t* field, uint32_t* wire) {
    const uint8_t* at = p;
    const uint64_t t = varint();
    *field = static_cast<uint32_t>(t >> 3);
    *wire = static_cast<uint32_t>(t & 7);
    if ((t >> 3) == 0 || (t >> 3) > 0x1fffffffu) {
      malformed(record, at, "invalid field number " + std::to_string(t >> 3));
    }
  }

  void skip(uint32_t wire) {
    const uint8_t* at = p;
    size_t n = 0;
    switch (wire) {
      case kVarint:
        varint();
        return;
      case kFixed64:
        n = 8;
        break;
      case kLen:
        bytes(&n);
        return;
      case kFixed32:
        n = 4;
        break;
      default:
        malformed(
            record,
            at,
            "unsupported wire type " + std::to_string(wire) +
                " (groups and reserved types cannot appear in an Example)");
    }
    if (n > static_cast<size_t>(end - p)) {
      malformed(record, at, "truncated fixed-width field");
    }
    p += n;
  }
};

void parse_feature(Cursor c, FeatureView* view) {
  view->found = true;
  view->kind = FeatureKind::kNone;
  view->data = nullptr;
  view->size = 0;
  while (!c.done()) {
    uint32_t field = 0;
    uint32_t wire = 0;
    c.tag(&field, &wire);
    if (field >= 1 && field <= 3 && wire == kLen) {
      // A oneof: the last member on the wire wins. (Protobuf would merge a
      // member repeated on the wire; encoders never write that.)
      view->kind = static_cast<FeatureKind>(field);
      view->data = c.bytes(&view->size);
    } else {
      c.skip(wire);
    }
  }
}

void parse_entry(
    Cursor c,
    const KeyIndex& keys,
    KeyIndex::Order* order,
    FeatureView* views) {
  const uint8_t* key = nullptr;
  size_t key_size = 0;
  const uint8_t* value = nullptr;
  size_t value_size = 0;
  while (!c.done()) {
    uint32_t field = 0;
    uint32_t wire = 0;
    c.tag(&field, &wire);
    if (field == 1 && wire == kLen) {
      key = c.bytes(&key_size);
    } else if (field == 2 && wire == kLen) {
      value = c.bytes(&value_size);
    } else {
      c.skip(wire);
    }
  }
  const size_t i = keys.find(key, key_size, order);
  if (i != KeyIndex::kNone) {
    // A map's last entry for a key wins.
    parse_feature(Cursor{c.record, value, value + value_size}, &views[i]);
    views[i].record = c.record;
  }
}

void parse_features(
    Cursor c,
    const KeyIndex& keys,
    KeyIndex::Order* order,
    FeatureView* views) {
  while (!c.done()) {
    uint32_t field = 0;
    uint32_t wire = 0;
    c.tag(&field, &wire);
    if (field == 1 && wire == kLen) {
      size_t n = 0;
      const uint8_t* entry = c.bytes(&n);
      parse_entry(Cursor{c.record, entry, entry + n}, keys, order, views);
    } else {
      c.skip(wire);
    }
  }
}

// Walks the `value` fields of a list, calling on_packed(payload) for a
// packed run and on_single(cursor at the value) for one unpacked value.
template <typename Packed, typename Single>
void walk_list(const FeatureView& view, Packed on_packed, Single on_single) {
  Cursor c{view.record, view.data, view.data + view.size};
  while (!c.done()) {
    uint32_t field = 0;
    uint32_t wire = 0;
    c.tag(&field, &wire);
    if (field != 1) {
      c.skip(wire);
      continue;
    }
    if (wire == kLen) {
      size_t n = 0;
      const uint8_t* payload = c.bytes(&n);
      on_packed(Cursor{view.record, payload, payload + n});
    } else {
      on_single(c, wire);
    }
  }
}

uint32_t load_le32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
      (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

float load_float(const uint8_t* p) {
  const uint32_t bits = load_le32(p);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void put_varint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

void put_len(std::string* out, uint32_t field, const std::string& payload) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | kLen);
  put_varint(out, payload.size());
  out->append(payload);
}

} // namespace

KeyIndex::KeyIndex(std::vector<std::string> keys) : keys_(std::move(keys)) {
  map_.reserve(keys_.size());
  for (size_t i = 0; i < keys_.size(); ++i) {
    map_.emplace(std::string_view(keys_[i]), i);
  }
}

KeyIndex::Order::Order(const KeyIndex& index) : next_(index.size() + 1) {
  // Before any record is seen, guess the keys' own order.
  for (size_t k = 0; k < next_.size(); ++k) {
    next_[k] = k + 1 < next_.size() ? k + 1 : 0;
  }
  previous_ = index.size();
}

size_t KeyIndex::find_unguessed(const uint8_t* key, size_t n, Order* order)
    const {
  const auto it =
      map_.find(std::string_view(reinterpret_cast<const char*>(key), n));
  if (it == map_.end()) {
    return kNone; // not a key of the parse; the guess stays
  }
  order->next_[order->previous_] = it->second;
  order->previous_ = it->second;
  return it->second;
}

void find_features(
    const uint8_t* data,
    size_t size,
    const std::vector<std::string>& keys,
    FeatureView* views) {
  const KeyIndex index(keys);
  KeyIndex::Order order(index);
  find_features(data, size, index, &order, views);
}

void find_features(
    const uint8_t* data,
    size_t size,
    const KeyIndex& keys,
    KeyIndex::Order* order,
    FeatureView* views) {
  for (size_t i = 0; i < keys.size(); ++i) {
    views[i] = FeatureView{};
    views[i].record = data;
  }
  keys.begin(order);
  Cursor c{data, data, data + size};
  while (!c.done()) {
    uint32_t field = 0;
    uint32_t wire = 0;
    c.tag(&field, &wire);
    if (field == 1 && wire == kLen) {
      // A repeated embedded message merges; for a map that means later
      // entries overwrite earlier ones, which parse_entry does.
      size_t n = 0;
      const uint8_t* features = c.bytes(&n);
      parse_features(Cursor{data, features, features + n}, keys, order, views);
    } else {
      c.skip(wire);
    }
  }
}

namespace {
size_t count_int64(const FeatureView& view);
} // namespace

ListSize list_size(const FeatureView& view) {
  ListSize s;
  switch (view.kind) {
    case FeatureKind::kNone:
      break;
    case FeatureKind::kInt64:
      s.values = count_int64(view);
      break;
    case FeatureKind::kFloat:
      s.values = decode_float_at_most(view, nullptr, 0);
      break;
    case FeatureKind::kBytes:
      walk_list(
          view,
          [&](Cursor p) {
            ++s.values;
            s.bytes += static_cast<size_t>(p.end - p.p);
          },
          [&](Cursor& c, uint32_t wire) {
            malformed(
                view.record,
                c.p,
                "BytesList value with wire type " + std::to_string(wire) +
                    ", expected length-delimited (2)");
          });
      break;
  }
  return s;
}

namespace {

// The values of an Int64List without decoding them. The usual encoding, one
// packed run of well-formed varints, is counted by its last bytes (those
// below 0x80); anything else (unpacked values, several runs, unknown
// fields, a bad varint) takes the full walk, which also gives the errors.
size_t count_int64(const FeatureView& view) {
  const uint8_t* p = view.data;
  const uint8_t* end = p + view.size;
  if (p == end) {
    return 0;
  }
  if (*p != 0x0a) { // not field 1, packed
    return decode_int64_at_most(view, nullptr, 0);
  }
  Cursor c{view.record, p + 1, end};
  size_t n = 0;
  const uint8_t* payload = c.bytes(&n);
  if (c.p != end || n == 0 || (payload[n - 1] & 0x80) != 0) {
    return decode_int64_at_most(view, nullptr, 0);
  }
  size_t values = 0;
  size_t run = 0; // continuation bytes in a row
  for (size_t i = 0; i < n; ++i) {
    const bool last = payload[i] < 0x80;
    values += last;
    run = last ? 0 : run + 1;
    if (run >= 10) {
      return decode_int64_at_most(view, nullptr, 0);
    }
  }
  return values;
}

} // namespace

size_t decode_int64_at_most(
    const FeatureView& view,
    int64_t* out,
    size_t limit) {
  if (view.kind != FeatureKind::kInt64) {
    return 0;
  }
  size_t n = 0;
  walk_list(
      view,
      [&](Cursor p) {
        while (!p.done()) {
          const auto v = static_cast<int64_t>(p.varint());
          if (n < limit) {
            out[n] = v;
          }
          ++n;
        }
      },
      [&](Cursor& c, uint32_t wire) {
        if (wire != kVarint) {
          malformed(
              view.record,
              c.p,
              "Int64List value with wire type " + std::to_string(wire) +
                  ", expected a varint (0) or packed (2)");
        }
        const auto v = static_cast<int64_t>(c.varint());
        if (n < limit) {
          out[n] = v;
        }
        ++n;
      });
  return n;
}

size_t decode_float_at_most(const FeatureView& view, float* out, size_t limit) {
  if (view.kind != FeatureKind::kFloat) {
    return 0;
  }
  size_t n = 0;
  walk_list(
      view,
      [&](Cursor p) {
        const size_t bytes = static_cast<size_t>(p.end - p.p);
        if (bytes % 4 != 0) {
          malformed(
              view.record,
              p.p,
              "packed FloatList of " + std::to_string(bytes) +
                  " bytes, expected a multiple of 4");
        }
        for (; p.p < p.end; p.p += 4) {
          if (n < limit) {
            out[n] = load_float(p.p);
          }
          ++n;
        }
      },
      [&](Cursor& c, uint32_t wire) {
        if (wire != kFixed32) {
          malformed(
              view.record,
              c.p,
              "FloatList value with wire type " + std::to_string(wire) +
                  ", expected fixed32 (5) or packed (2)");
        }
        const uint8_t* at = c.p;
        c.skip(kFixed32);
        if (n < limit) {
          out[n] = load_float(at);
        }
        ++n;
      });
  return n;
}

void decode_int64(const FeatureView& view, int64_t* out) {
  if (view.kind != FeatureKind::kInt64) {
    return;
  }
  walk_list(
      view,
      [&](Cursor p) {
        while (!p.done()) {
          *out++ = static_cast<int64_t>(p.varint());
        }
      },
      [&](Cursor& c, uint32_t) { *out++ = static_cast<int64_t>(c.varint()); });
}

void decode_float(const FeatureView& view, float* out) {
  if (view.kind != FeatureKind::kFloat) {
    return;
  }
  walk_list(
      view,
      [&](Cursor p) {
        for (; p.p + 4 <= p.end; p.p += 4) {
          *out++ = load_float(p.p);
        }
      },
      [&](Cursor& c, uint32_t) {
        *out++ = load_float(c.p);
        c.p += 4;
      });
}

void decode_bytes(
    const FeatureView& view,
    uint8_t* out,
    int64_t* value_ends,
    int64_t base) {
  if (view.kind != FeatureKind::kBytes) {
    return;
  }
  int64_t written = 0;
  walk_list(
      view,
      [&](Cursor p) {
        const size_t n = static_cast<size_t>(p.end - p.p);
        if (n > 0) {
          std::memcpy(out + written, p.p, n);
        }
        written += static_cast<int64_t>(n);
        if (value_ends != nullptr) {
          *value_ends++ = base + written;
        }
      },
      [&](Cursor& c, uint32_t) { c.skip(kLen); });
}

// ---------------------------------------------------------------- encoding

void ExampleEncoder::add_entry(
    const std::string& key,
    const std::string& feature) {
  std::string entry;
  put_len(&entry, 1, key);
  put_len(&entry, 2, feature);
  put_len(&features_, 1, entry);
}

void ExampleEncoder::add_bytes(
    const std::string& key,
    const std::vector<std::string>& values) {
  std::string list;
  for (const auto& v : values) {
    put_len(&list, 1, v);
  }
  std::string feature;
  put_len(&feature, 1, list);
  add_entry(key, feature);
}

void ExampleEncoder::add_float(
    const std::string& key,
    const std::vector<float>& values) {
  std::string packed;
  for (float f : values) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    for (int i = 0; i < 4; ++i) {
      packed.push_back(static_cast<char>(bits >> (8 * i)));
    }
  }
  add_packed(key, 2, packed);
}

void ExampleEncoder::add_int64(
    const std::string& key,
    const std::vector<int64_t>& values) {
  std::string packed;
  for (int64_t v : values) {
    put_varint(&packed, static_cast<uint64_t>(v));
  }
  add_packed(key, 3, packed);
}

void ExampleEncoder::add_packed(
    const std::string& key,
    uint32_t list_field,
    const std::string& packed) {
  std::string list;
  // Every value takes at least one byte, so no bytes means no values, and
  // protobuf writes no field for an empty packed list.
  if (!packed.empty()) {
    put_len(&list, 1, packed);
  }
  std::string feature;
  put_len(&feature, list_field, list);
  add_entry(key, feature);
}

std::string ExampleEncoder::serialize() const {
  std::string out;
  put_len(&out, 1, features_);
  return out;
}

// ---------------------------------------------------------- batch parsing

void validate_specs(const std::vector<FeatureSpec>& specs) {
  std::unordered_set<std::string> seen;
  for (const auto& s : specs) {
    auto bad = [&](const std::string& what) {
      throw RecordError(
          RecordErrorKind::kInvalidArgument,
          "feature '" + s.key + "': " + what,
          "",
          -1,
          -1,
          s.key);
    };
    if (!seen.insert(s.key).second) {
      bad("the key appears twice in the feature specs");
    }
    if (s.kind != FeatureKind::kBytes && s.kind != FeatureKind::kFloat &&
        s.kind != FeatureKind::kInt64) {
      bad("the type must be bytes, float or int64");
    }
    if (!s.var_len && s.fixed_count < 0) {
      bad("a fixed length must be >= 0, got " + std::to_string(s.fixed_count));
    }
    if (!s.has_default) {
      continue;
    }
    if (s.var_len) {
      continue; // any number of default values
    }
    size_t n = 0;
    switch (s.kind) {
      case FeatureKind::kInt64:
        n = s.int64_default.size();
        break;
      case FeatureKind::kFloat:
        n = s.float_default.size();
        break;
      default:
        for (const auto& b : s.bytes_default) {
          n += b.size();
        }
        break;
    }
    if (static_cast<int64_t>(n) != s.fixed_count) {
      bad("the default has " + std::to_string(n) +
          (s.kind == FeatureKind::kBytes ? " bytes" : " values") +
          ", the fixed length is " + std::to_string(s.fixed_count));
    }
  }
}

namespace {

std::vector<std::string> keys_of(const std::vector<FeatureSpec>& specs) {
  std::vector<std::string> keys;
  keys.reserve(specs.size());
  for (const auto& s : specs) {
    keys.push_back(s.key);
  }
  return keys;
}

} // namespace

// ------------------------------------------------------------- fast walk
//
// Helpers of BatchParser::scan_fast: they never throw and never read
// outside [p, end); false means "not the usual encoding, or malformed":
// the general walk decides.

namespace {

constexpr uint64_t kHighBits = 0x8080808080808080ull;

TORCH_STAGE_ALWAYS_INLINE inline uint64_t load_le64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, sizeof(w));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  w = __builtin_bswap64(w);
#endif
  return w;
}

// The low 7 bits of each byte of x (whose high bits are clear), packed
// together: BMI2's pext(x, 0x7f7f...) in three shift-and-mask steps, which
// every x86-64 and ARM runs fast (pext is microcoded on AMD before Zen 3).
template <bool kPext>
TORCH_STAGE_ALWAYS_INLINE inline uint64_t compact7(uint64_t x) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if constexpr (kPext) {
    // Inline assembly, not _pext_u64: the library is built for baseline
    // x86-64 and chooses this path at run time (has_fast_pext()).
    uint64_t r;
    asm("pextq %2, %1, %0" : "=r"(r) : "r"(x), "r"(~kHighBits));
    return r;
  }
#endif
  x = ((x & 0x7f007f007f007f00ull) >> 1) | (x & 0x007f007f007f007full);
  x = ((x & 0x3fff00003fff0000ull) >> 2) | (x & 0x00003fff00003fffull);
  x = ((x & 0x0fffffff00000000ull) >> 4) | (x & 0x000000000fffffffull);
  return x;
}

// One varint at p, which must end by `end`, with the value Cursor::varint
// gives (up to 10 bytes, bits past 64 dropped). Reads stay below
// `load_end` (>= end: the end of the record): with 8 bytes there, a varint
// of up to 8 bytes is decoded from one load (its end is the first byte
// below 0x80), even when its field ends sooner.
TORCH_STAGE_ALWAYS_INLINE inline bool fast_varint(
    const uint8_t*& p,
    const uint8_t* end,
    const uint8_t* load_end,
    uint64_t* out) {
  if (p < end && *p < 0x80) {
    *out = *p++;
    return true;
  }
  if (load_end - p >= 8) {
    const uint64_t w = load_le64(p);
    const uint64_t stops = ~w & kHighBits;
    if (stops != 0) {
      const size_t n = (__builtin_ctzll(stops) >> 3) + 1;
      if (n > static_cast<size_t>(end - p)) {
        return false; // truncated
      }
      *out = compact7<false>(w & (stops ^ (stops - 1)) & ~kHighBits);
      p += n;
      return true;
    }
  }
  uint64_t v = 0;
  for (int k = 0; k < 10; ++k) {
    if (k >= end - p) {
      return false; // truncated
    }
    const uint8_t b = p[k];
    v |= static_cast<uint64_t>(b & 0x7f) << (7 * k);
    if (b < 0x80) {
      p += k + 1;
      *out = v;
      return true;
    }
  }
  return false; // longer than 10 bytes
}

// A length-delimited field's length, which must end within [p, end).
TORCH_STAGE_ALWAYS_INLINE inline bool fast_length(
    const uint8_t*& p,
    const uint8_t* end,
    const uint8_t* load_end,
    size_t* n) {
  uint64_t len = 0;
  if (!fast_varint(p, end, load_end, &len) ||
      len > static_cast<uint64_t>(end - p)) {
    return false;
  }
  *n = static_cast<size_t>(len);
  return true;
}

// Bit k set: p[k] < 0x80, the last byte of a varint, for the 64 bytes at
// p. SSE2 (part of x86-64) tests 16 bytes an instruction; elsewhere each
// 8-byte word's high bits are gathered by a multiply.
TORCH_STAGE_ALWAYS_INLINE inline uint64_t varint_stops64(const uint8_t* p) {
#if defined(__SSE2__)
  const auto mask16 = [p](int k) {
    return static_cast<uint64_t>(static_cast<uint16_t>(_mm_movemask_epi8(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k)))));
  };
  return ~(
      mask16(0) | (mask16(1) << 16) | (mask16(2) << 32) | (mask16(3) << 48));
#else
  uint64_t high = 0;
  for (int k = 0; k < 8; ++k) {
    high |= (((load_le64(p + 8 * k) & kHighBits) * 0x0002040810204081ull) >> 56)
        << (8 * k);
  }
  return ~high;
#endif
}

// The low 7 bits of each of the low `len` (1..8) bytes: pext's mask for a
// varint of `len` bytes.
constexpr uint64_t kVarintKeep[9] = {
    0,
    0x7full,
    0x7f7full,
    0x7f7f7full,
    0x7f7f7f7full,
    0x7f7f7f7f7full,
    0x7f7f7f7f7f7full,
    0x7f7f7f7f7f7f7full,
    0x7f7f7f7f7f7f7f7full};

// The varint of `len` (1..8) bytes in the low bytes of w.
template <bool kPext>
TORCH_STAGE_ALWAYS_INLINE inline uint64_t varint_of_keep(
    uint64_t w,
    size_t len) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if constexpr (kPext) {
    uint64_t v;
    asm("pextq %2, %1, %0" : "=r"(v) : "r"(w), "r"(kVarintKeep[len]));
    return v;
  }
#endif
  return compact7<false>(w & kVarintKeep[len]);
}

// A varint of 9 or 10 bytes at p (negative values): bits 56..62 from byte
// 8, bit 63 from byte 9 (its other bits fall past 64 and are dropped), as
// Cursor::varint gives it.
template <bool kPext>
uint64_t long_varint(const uint8_t* p, size_t len) {
  uint64_t v = compact7<kPext>(load_le64(p) & ~kHighBits) |
      (static_cast<uint64_t>(p[8] & 0x7f) << 56);
  if (len == 10) {
    v |= static_cast<uint64_t>(p[9]) << 63;
  }
  return v;
}

// The packed varints [p, end) into out[0:count]: at most `limit` of them
// (false past it: a fixed-length feature with too many values). Reads
// stay below `load_end` (>= end).
//
// The varints' ends are found 64 bytes at a time, as a bit mask of the
// bytes below 0x80; each varint is then [previous end + 1, next set bit].
// Finding the next varint needs only the mask, not the value of the one
// before, so the varints of a window decode side by side (the walk this
// replaced waited, for each, on the load that gave the previous one's
// length). Near load_end the window is copied into a zero-padded buffer.
template <bool kPext>
TORCH_STAGE_ALWAYS_INLINE inline bool decode_packed_varints_body(
    const uint8_t* p,
    const uint8_t* end,
    const uint8_t* load_end,
    int64_t* out,
    size_t limit,
    size_t* count) {
  // A window's last varint may start at byte 63 and is read 8 bytes wide.
  constexpr size_t kWindow = 64;
  constexpr size_t kReach = kWindow + 8;
  size_t n = 0;
  while (p < end) {
    const size_t left = static_cast<size_t>(end - p);
    const size_t window = std::min(left, kWindow);
    alignas(16) uint8_t padded[kReach];
    const uint8_t* base = p;
    if (static_cast<size_t>(load_end - p) < kReach) {
      std::memset(padded, 0, sizeof(padded));
      std::memcpy(padded, p, window);
      base = padded;
    }
    uint64_t stops = varint_stops64(base);
    if (window < kWindow) {
      stops &= (uint64_t{1} << window) - 1;
    }
    // No end: truncated, or a varint of more than 10 bytes. More ends than
    // room: too many values.
    if (stops == 0 ||
        static_cast<size_t>(__builtin_popcountll(stops)) > limit - n) {
      return false;
    }
    size_t start = 0;
    do {
      const auto last = static_cast<size_t>(__builtin_ctzll(stops));
      const size_t len = last - start + 1;
      uint64_t v;
      if (len <= 8) {
        v = varint_of_keep<kPext>(load_le64(base + start), len);
      } else if (len <= 10) {
        v = long_varint<kPext>(base + start, len);
      } else {
        return false;
      }
      out[n++] = static_cast<int64_t>(v);
      start = last + 1;
      stops &= stops - 1;
    } while (stops != 0);
    // What follows the last end in the window starts the next window.
    p += start;
  }
  *count = n;
  return true;
}

// Out of line: inside the walk, with its many live values, the loop's
// own ones went to the stack (a load and a store more per varint).
TORCH_STAGE_TARGET_BMI2 TORCH_STAGE_NOINLINE bool decode_varints_bmi2(
    const uint8_t* p,
    const uint8_t* end,
    const uint8_t* load_end,
    int64_t* out,
    size_t limit,
    size_t* count) {
  return decode_packed_varints_body<true>(p, end, load_end, out, limit, count);
}

TORCH_STAGE_NOINLINE bool decode_varints_portable(
    const uint8_t* p,
    const uint8_t* end,
    const uint8_t* load_end,
    int64_t* out,
    size_t limit,
    size_t* count) {
  return decode_packed_varints_body<false>(p, end, load_end, out, limit, count);
}

template <bool kPext>
TORCH_STAGE_ALWAYS_INLINE inline bool decode_packed_varints(
    const uint8_t* p,
    const uint8_t* end,
    const uint8_t* load_end,
    int64_t* out,
    size_t limit,
    size_t* count) {
  // A list of one value of up to 8 bytes (a scalar feature: one per
  // feature in some layouts) from one load, without the call.
  if (limit > 0 && load_end - p >= 8) {
    const uint64_t w = load_le64(p);
    const uint64_t stops = ~w & kHighBits;
    if (stops != 0) {
      const size_t len = (static_cast<size_t>(__builtin_ctzll(stops)) >> 3) + 1;
      if (len == static_cast<size_t>(end - p)) {
        out[0] = static_cast<int64_t>(varint_of_keep<kPext>(w, len));
        *count = 1;
        return true;
      }
    }
  }
  return kPext ? decode_varints_bmi2(p, end, load_end, out, limit, count)
               : decode_varints_portable(p, end, load_end, out, limit, count);
}

void copy_floats(const uint8_t* p, size_t n, float* out) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  if (n > 0) {
    std::memcpy(out, p, n * sizeof(float));
  }
#else
  for (size_t k = 0; k < n; ++k) {
    out[k] = load_float(p + 4 * k);
  }
#endif
}

// The wire tag of a Feature's list of `kind`: field 1..3, length-delimited.
constexpr uint8_t list_tag(FeatureKind kind) {
  return static_cast<uint8_t>((static_cast<uint32_t>(kind) << 3) | kLen);
}

} // namespace

namespace {

constexpr size_t kScratchBlock = 64 * 1024;

// The memory a thread's parsers use per batch, kept for its next batch:
// allocated and freed afresh each time, glibc gave it back to the system at
// the free and faulted it in again at the next batch (records_bench: 2.5x
// the parse's time, most of it in page faults). Bounded per thread.
struct ParserMemory {
  static constexpr size_t kMaxBlocks = 32; // 2 MiB of scratch blocks
  std::vector<std::unique_ptr<uint8_t[]>> blocks; // of kScratchBlock bytes
  std::unique_ptr<uint8_t[]> arrays;
  size_t arrays_size = 0;
};
thread_local ParserMemory parser_memory;

} // namespace

uint8_t* BatchParser::Scratch::reserve(size_t bytes) {
  if (left < bytes) {
    Block block;
    block.size = std::max(bytes, kScratchBlock);
    if (block.size == kScratchBlock && !parser_memory.blocks.empty()) {
      block.bytes = std::move(parser_memory.blocks.back());
      parser_memory.blocks.pop_back();
    } else {
      block.bytes.reset(new uint8_t[block.size]);
    }
    at = block.bytes.get();
    left = block.size;
    blocks.push_back(std::move(block));
  }
  return at;
}

BatchParser::~BatchParser() {
  // To this thread's memory (the one that made the parser; scan ranges on
  // other threads took their blocks from theirs).
  for (auto& block : scratches_) {
    if (block.size == kScratchBlock &&
        parser_memory.blocks.size() < ParserMemory::kMaxBlocks) {
      parser_memory.blocks.push_back(std::move(block.bytes));
    }
  }
  if (arrays_.size > parser_memory.arrays_size) {
    parser_memory.arrays = std::move(arrays_.bytes);
    parser_memory.arrays_size = arrays_.size;
  }
}

bool BatchParser::has_fast_pext() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool fast = __builtin_cpu_supports("bmi2") &&
      !__builtin_cpu_is("amdfam15h") && !__builtin_cpu_is("amdfam17h");
  return fast;
#else
  return false;
#endif
}

ParseSchema::ParseSchema(std::vector<FeatureSpec> specs)
    : specs_(std::move(specs)), keys_(keys_of(specs_)) {
  validate_specs(specs_);
  var_index_.assign(specs_.size(), -1);
  for (size_t s = 0; s < specs_.size(); ++s) {
    if (specs_[s].var_len) {
      var_index_[s] = static_cast<int64_t>(num_var_++);
      var_specs_.push_back(s);
    }
    if (specs_[s].kind == FeatureKind::kBytes) {
      bytes_specs_.push_back(s);
    }
    compact_.push_back(Compact{
        static_cast<size_t>(specs_[s].fixed_count),
        static_cast<size_t>(std::max<int64_t>(var_index_[s], 0)),
        specs_[s].kind,
        specs_[s].var_len});
  }
  key_patterns_.resize(specs_.size());
  for (size_t s = 0; s < specs_.size(); ++s) {
    const std::string& key = specs_[s].key;
    if (key.size() + 3 > 16) {
      continue;
    }
    uint8_t bytes[16] = {};
    bytes[0] = 0x0a;
    bytes[1] = static_cast<uint8_t>(key.size());
    std::memcpy(bytes + 2, key.data(), key.size());
    bytes[key.size() + 2] = 0x12;
    KeyPattern& pat = key_patterns_[s];
    pat.size = key.size() + 3;
    pat.lo = load_le64(bytes);
    pat.hi = load_le64(bytes + 8);
    pat.lo_mask =
        pat.size >= 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * pat.size)) - 1;
    pat.hi_mask = pat.size <= 8 ? 0
        : pat.size >= 16        ? ~uint64_t{0}
                                : (uint64_t{1} << (8 * (pat.size - 8))) - 1;
  }
  entry_patterns_.resize(specs_.size());
  for (size_t s = 0; s < specs_.size(); ++s) {
    // The bytes of entry_patterns_ (see scan_fast_body), with the entry's
    // length L at byte 1 and L - key - 4, - 6, - 8 at the lengths after the
    // key: byte k holds base + L * length, the sum staying within the byte.
    const std::string& key = specs_[s].key;
    if (specs_[s].kind == FeatureKind::kBytes || key.size() > 14) {
      continue;
    }
    const size_t k = key.size();
    uint8_t bytes[24] = {};
    uint8_t per_length[24] = {};
    uint8_t minus[24] = {};
    bytes[0] = 0x0a;
    per_length[1] = 1;
    bytes[2] = 0x0a;
    bytes[3] = static_cast<uint8_t>(k);
    std::memcpy(bytes + 4, key.data(), k);
    bytes[4 + k] = 0x12;
    per_length[5 + k] = 1;
    minus[5 + k] = static_cast<uint8_t>(k + 4);
    bytes[6 + k] = list_tag(specs_[s].kind);
    per_length[7 + k] = 1;
    minus[7 + k] = static_cast<uint8_t>(k + 6);
    bytes[8 + k] = 0x0a;
    per_length[9 + k] = 1;
    minus[9 + k] = static_cast<uint8_t>(k + 8);
    EntryPattern& e = entry_patterns_[s];
    e.size = k + 10;
    e.min_length = k + 9; // a list of at least one byte
    for (size_t w = 0; w < 3; ++w) {
      e.base[w] = load_le64(bytes + 8 * w) - load_le64(minus + 8 * w);
      e.length[w] = load_le64(per_length + 8 * w);
      uint64_t mask = 0;
      for (size_t b = 0; b < 8; ++b) {
        if (8 * w + b < e.size) {
          mask |= uint64_t{0xff} << (8 * b);
        }
      }
      e.mask[w] = mask;
    }
  }
  all_specs_mask_ =
      specs_.size() >= 64 ? ~uint64_t{0} : (uint64_t{1} << specs_.size()) - 1;
}

BatchParser::BatchParser(
    std::shared_ptr<const ParseSchema> schema,
    std::vector<RecordRef> records,
    Walk walk)
    : schema_(std::move(schema)),
      specs_(schema_->specs_),
      keys_(schema_->keys_),
      var_index_(schema_->var_index_),
      num_var_(schema_->num_var_),
      bytes_specs_(schema_->bytes_specs_),
      var_specs_(schema_->var_specs_),
      compact_(schema_->compact_),
      key_patterns_(schema_->key_patterns_),
      entry_patterns_(schema_->entry_patterns_),
      all_specs_mask_(schema_->all_specs_mask_),
      records_(std::move(records)),
      walk_(walk),
      min_error_record_(std::numeric_limits<size_t>::max()) {
  if (walk_ == Walk::kAuto) {
    walk_ = has_fast_pext() ? Walk::kFastPext : Walk::kFastPortable;
  }
  if (walk_ == Walk::kFastPext && !has_fast_pext()) {
    throw RecordError(
        RecordErrorKind::kInvalidArgument,
        "BatchParser: Walk::kFastPext needs a CPU with a fast BMI2 pext");
  }
  if (specs_.size() > 64) {
    walk_ = Walk::kGeneral; // the fast walk keeps one bit per spec
  }
  const size_t n = records_.size();
  const size_t cells = n * num_var_;
  // One allocation for the three per-cell arrays, this thread's from its
  // last parser when large enough.
  const size_t need = cells * (sizeof(VarCell) + 2 * sizeof(int64_t));
  if (parser_memory.arrays_size >= need) {
    arrays_.bytes = std::move(parser_memory.arrays);
    arrays_.size = std::exchange(parser_memory.arrays_size, 0);
  } else if (need > 0) {
    arrays_.bytes.reset(new uint8_t[need]);
    arrays_.size = need;
  }
  static_assert(alignof(VarCell) <= alignof(std::max_align_t));
  cells_ = reinterpret_cast<VarCell*>(arrays_.bytes.get());
  counts_ =
      reinterpret_cast<int64_t*>(arrays_.bytes.get() + cells * sizeof(VarCell));
  byte_counts_ = counts_ + cells;
  totals_.assign(specs_.size(), 0);
  byte_totals_.assign(specs_.size(), 0);
}

BatchParser::BatchParser(
    const std::vector<FeatureSpec>& specs,
    std::vector<RecordRef> records,
    Walk walk)
    : BatchParser(
          std::make_shared<const ParseSchema>(specs),
          std::move(records),
          walk) {}

void BatchParser::record_error(size_t record, const RecordError& error) {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (!has_error_ || record < error_record_) {
    has_error_ = true;
    error_record_ = record;
    error_ = error;
    min_error_record_.store(record, std::memory_order_relaxed);
  }
}

void BatchParser::check() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (has_error_) {
    throw error_;
  }
}

void BatchParser::scan(
    size_t begin,
    size_t end,
    const std::vector<FeatureOutput>& outs) {
  KeyIndex::Order order(keys_);
  std::vector<Scratch> scratch(std::max<size_t>(num_var_, 1));
  std::vector<FeatureView> views(specs_.size());
  size_t fast = 0;
  for (size_t i = begin; i < end; ++i) {
    // A lower-indexed record already failed: nothing here can be reported.
    if (i > min_error_record_.load(std::memory_order_relaxed)) {
      break;
    }
    try {
      fast += scan_one(i, outs, &order, scratch.data(), views.data()) ? 1 : 0;
    } catch (const RecordError& e) {
      record_error(i, e);
      break;
    }
  }
  fast_records_.fetch_add(fast, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(scratch_mu_);
  for (auto& column : scratch) {
    for (auto& block : column.blocks) {
      scratches_.push_back(std::move(block));
    }
  }
}

template <bool kPext>
TORCH_STAGE_ALWAYS_INLINE inline bool BatchParser::scan_fast_body(
    size_t i,
    const std::vector<FeatureOutput>& outs,
    KeyIndex::Order* order,
    Scratch* scratch,
    FeatureView* views) {
  const RecordRef& rec = records_[i];
  const uint8_t* p = rec.data;
  const uint8_t* const end = rec.data + rec.size;
  const uint8_t* const load_end =
      rec.readable_end != nullptr ? rec.readable_end : end;
  size_t len = 0;
  // Example: one `features` field (1, length-delimited) that is the record.
  if (p == end || *p != 0x0a) {
    return false;
  }
  ++p;
  if (!fast_length(p, end, end, &len) || len != static_cast<size_t>(end - p)) {
    return false;
  }
  uint64_t found = 0;
  keys_.begin(order);
  while (p < end) {
    size_t s = keys_.guess(*order);
    const Compact* spec = nullptr;
    const uint8_t* payload = nullptr;
    const uint8_t* entry_end = nullptr;
    // The usual entry: the key that followed the previous key last time,
    // with a numbers list of 1..(119 - key) bytes. Its first key + 10 bytes
    // (the entry's tag and length, the key field, the value's tag and
    // length, the list's tag and length, the packed field's tag and length)
    // are the key's and what the entry's length gives: compared at once.
    if (s < entry_patterns_.size() && load_end - p >= 24) {
      const EntryPattern& e = entry_patterns_[s];
      const size_t l1 = p[1];
      if (e.size != 0 && l1 >= e.min_length && l1 < 0x80 &&
          static_cast<size_t>(end - p) >= 2 + l1 &&
          ((load_le64(p) ^ (e.base[0] + l1 * e.length[0])) & e.mask[0]) == 0 &&
          ((load_le64(p + 8) ^ (e.base[1] + l1 * e.length[1])) & e.mask[1]) ==
              0 &&
          ((load_le64(p + 16) ^ (e.base[2] + l1 * e.length[2])) & e.mask[2]) ==
              0) {
        keys_.accept_guess(order);
        spec = &compact_[s];
        payload = p + e.size;
        entry_end = p + 2 + l1;
      }
    }
    if (payload == nullptr) {
      // A map entry (field 1): key (1) then value (2), nothing else.
      if (*p != 0x0a) {
        return false;
      }
      ++p;
      if (!fast_length(p, end, end, &len)) {
        return false;
      }
      entry_end = p + len;
      // The guessed key, compared with its field's framing in two masked
      // words; else (or near the end of the record) field by field, and
      // find().
      const KeyPattern* pat =
          s < key_patterns_.size() ? &key_patterns_[s] : nullptr;
      if (pat != nullptr && pat->size != 0 &&
          pat->size < static_cast<size_t>(entry_end - p) &&
          load_end - p >= 16 &&
          ((load_le64(p) ^ pat->lo) & pat->lo_mask) == 0 &&
          ((load_le64(p + 8) ^ pat->hi) & pat->hi_mask) == 0) {
        keys_.accept_guess(order);
        p += pat->size;
      } else {
        if (p == entry_end || *p != 0x0a) {
          return false;
        }
        ++p;
        size_t key_size = 0;
        if (!fast_length(p, entry_end, end, &key_size)) {
          return false;
        }
        const uint8_t* const key = p;
        p += key_size;
        if (p == entry_end || *p != 0x12) {
          return false;
        }
        ++p;
        s = keys_.find(key, key_size, order);
      }
      spec = s == KeyIndex::kNone ? nullptr : &compact_[s];
      // A numbers list of 1..122 bytes is framed by five bytes that its
      // length alone gives: the Feature's length, the list's tag and length,
      // the packed field's tag and length, each length one byte.
      const auto rest = static_cast<size_t>(entry_end - p);
      if (spec != nullptr && spec->kind != FeatureKind::kBytes && rest >= 6 &&
          rest <= 128 && load_end - p >= 8) {
        const uint64_t framing = (rest - 1) |
            (uint64_t{list_tag(spec->kind)} << 8) | (uint64_t{rest - 3} << 16) |
            (uint64_t{0x0a} << 24) | (uint64_t{rest - 5} << 32);
        if ((load_le64(p) & 0xffffffffffull) == framing) {
          payload = p + 5;
        }
      }
    }
    const uint64_t bit = s == KeyIndex::kNone ? 0 : uint64_t{1} << s;
    // A key seen twice (the last wins): the general walk decides.
    if ((found & bit) != 0) {
      return false;
    }
    found |= bit;
    if (payload == nullptr) {
      // Field by field: the Feature, and (for a key of the parse) its list.
      if (!fast_length(p, entry_end, end, &len) ||
          len != static_cast<size_t>(entry_end - p)) {
        return false;
      }
      if (spec == nullptr) {
        p = entry_end;
        continue; // not parsed, as in the general walk
      }
      const uint8_t* q = p; // the Feature
      // An empty Feature, another list type or another field: the general
      // walk decides.
      if (q == entry_end || *q != list_tag(spec->kind)) {
        return false;
      }
      ++q;
      if (!fast_length(q, entry_end, end, &len) ||
          len != static_cast<size_t>(entry_end - q)) {
        return false;
      }
      if (spec->kind == FeatureKind::kBytes) {
        views[s] = FeatureView{rec.data, true, spec->kind, q, len};
        p = entry_end;
        continue; // after the walk, by the general code
      }
      // The list: empty, or one packed `value` field (1) that is the list.
      payload = entry_end;
      if (q != entry_end) {
        if (*q != 0x0a) {
          return false;
        }
        ++q;
        if (!fast_length(q, entry_end, end, &len) ||
            len != static_cast<size_t>(entry_end - q)) {
          return false;
        }
        payload = q;
      }
    }
    p = entry_end;
    const size_t bytes = static_cast<size_t>(entry_end - payload);
    const size_t fc = spec->fixed_count;
    size_t values = 0;
    // A column's values of consecutive records lie back to back in its
    // scratch, so that fill() copies runs of records at once.
    Scratch* column = spec->var_len ? &scratch[spec->column] : nullptr;
    if (spec->kind == FeatureKind::kInt64) {
      if (spec->var_len) {
        // At most one value per byte.
        auto* out = reinterpret_cast<int64_t*>(
            column->reserve(bytes * sizeof(int64_t)));
        if (!decode_packed_varints<kPext>(
                payload, entry_end, load_end, out, bytes, &values)) {
          return false;
        }
      } else {
        auto* out = static_cast<int64_t*>(outs[s].values) + i * fc;
        if (!decode_packed_varints<kPext>(
                payload, entry_end, load_end, out, fc, &values) ||
            values != fc) {
          return false;
        }
        continue;
      }
    } else {
      if (bytes % 4 != 0) {
        return false;
      }
      values = bytes / 4;
      if (!spec->var_len) {
        if (values != fc) {
          return false;
        }
        copy_floats(
            payload, values, static_cast<float*>(outs[s].values) + i * fc);
        continue;
      }
      copy_floats(
          payload, values, reinterpret_cast<float*>(column->reserve(bytes)));
    }
    const size_t cell = i * num_var_ + spec->column;
    const size_t used = values *
        (spec->kind == FeatureKind::kInt64 ? sizeof(int64_t) : sizeof(float));
    cells_[cell].decoded = column->at;
    cells_[cell].fast = true;
    counts_[cell] = static_cast<int64_t>(values);
    byte_counts_[cell] = 0;
    column->at += used;
    column->left -= used;
  }
  if (found != all_specs_mask_) {
    return false; // a default, or the error for a missing key
  }
  for (size_t s : bytes_specs_) {
    finish_feature(i, s, views[s], outs);
  }
  return true;
}

template <>
TORCH_STAGE_TARGET_BMI2 bool BatchParser::scan_fast<true>(
    size_t i,
    const std::vector<FeatureOutput>& outs,
    KeyIndex::Order* order,
    Scratch* scratch,
    FeatureView* views) {
  return scan_fast_body<true>(i, outs, order, scratch, views);
}

template <>
bool BatchParser::scan_fast<false>(
    size_t i,
    const std::vector<FeatureOutput>& outs,
    KeyIndex::Order* order,
    Scratch* scratch,
    FeatureView* views) {
  return scan_fast_body<false>(i, outs, order, scratch, views);
}

bool BatchParser::scan_one(
    size_t i,
    const std::vector<FeatureOutput>& outs,
    KeyIndex::Order* order,
    Scratch* scratch,
    FeatureView* views) {
  if (walk_ == Walk::kFastPext ? scan_fast<true>(i, outs, order, scratch, views)
                               : walk_ == Walk::kFastPortable &&
              scan_fast<false>(i, outs, order, scratch, views)) {
    return true;
  }
  // From the start: what the fast walk wrote is overwritten or unused (a
  // scratch it filled stays allocated until the parser goes).
  const size_t ns = specs_.size();
  const RecordRef& rec = records_[i];
  try {
    find_features(rec.data, rec.size, keys_, order, views);
  } catch (const RecordError& e) {
    throw RecordError(
        RecordErrorKind::kNotExample,
        "record " + std::to_string(i) +
            " is not a tf.train.Example: " + e.what(),
        "",
        -1,
        static_cast<int64_t>(i));
  }
  for (size_t s = 0; s < ns; ++s) {
    finish_feature(i, s, views[s], outs);
  }
  return false;
}

void BatchParser::finish_feature(
    size_t i,
    size_t s,
    const FeatureView& view,
    const std::vector<FeatureOutput>& outs) {
  const FeatureSpec& spec = specs_[s];
  const auto index = static_cast<int64_t>(i);
  const size_t cell =
      spec.var_len ? i * num_var_ + static_cast<size_t>(var_index_[s]) : 0;
  if (spec.var_len) {
    cells_[cell] =
        VarCell{view.data, view.size, nullptr, view.kind, view.found, false};
  }
  // A Feature with no list set (tf.train.Feature()) is, to a fixed-length
  // spec, a missing key: TensorFlow's parse skips such an entry, so its
  // default applies (or the key is required). To a var-length spec it is
  // an empty list either way.
  const bool absent =
      !view.found || (!spec.var_len && view.kind == FeatureKind::kNone);
  if (absent) {
    if (!spec.has_default) {
      throw RecordError(
          RecordErrorKind::kMissingFeature,
          "record " + std::to_string(i) + " has no feature '" + spec.key +
              "' (expected " + with_article(spec.kind) +
              "); give the feature a default value to allow that",
          "",
          -1,
          index,
          spec.key);
    }
    if (spec.var_len) {
      counts_[cell] = static_cast<int64_t>(
          spec.kind == FeatureKind::kInt64       ? spec.int64_default.size()
              : spec.kind == FeatureKind::kFloat ? spec.float_default.size()
                                                 : spec.bytes_default.size());
      int64_t nb = 0;
      for (const auto& b : spec.bytes_default) {
        nb += static_cast<int64_t>(b.size());
      }
      byte_counts_[cell] = nb;
      return;
    }
    const size_t fc = static_cast<size_t>(spec.fixed_count);
    switch (spec.kind) {
      case FeatureKind::kInt64:
        std::copy(
            spec.int64_default.begin(),
            spec.int64_default.end(),
            static_cast<int64_t*>(outs[s].values) + i * fc);
        break;
      case FeatureKind::kFloat:
        std::copy(
            spec.float_default.begin(),
            spec.float_default.end(),
            static_cast<float*>(outs[s].values) + i * fc);
        break;
      default: {
        uint8_t* out = static_cast<uint8_t*>(outs[s].values) + i * fc;
        for (const auto& b : spec.bytes_default) {
          std::memcpy(out, b.data(), b.size());
          out += b.size();
        }
      }
    }
    return;
  }
  if (view.kind != FeatureKind::kNone && view.kind != spec.kind) {
    throw RecordError(
        RecordErrorKind::kWrongType,
        "feature '" + spec.key + "' of record " + std::to_string(i) + " is " +
            with_article(view.kind) + ", expected " + with_article(spec.kind),
        "",
        -1,
        index,
        spec.key);
  }
  const size_t fc = static_cast<size_t>(spec.fixed_count);
  // Fixed-length numbers are validated, counted and decoded in one walk
  // (never written past their slot; the count is checked below).
  const bool fixed_numbers = !spec.var_len && spec.kind != FeatureKind::kBytes;
  ListSize size;
  try {
    if (!fixed_numbers) {
      size = list_size(view);
    } else if (spec.kind == FeatureKind::kInt64) {
      size.values = decode_int64_at_most(
          view, static_cast<int64_t*>(outs[s].values) + i * fc, fc);
    } else {
      size.values = decode_float_at_most(
          view, static_cast<float*>(outs[s].values) + i * fc, fc);
    }
  } catch (const RecordError& e) {
    throw RecordError(
        RecordErrorKind::kNotExample,
        "feature '" + spec.key + "' of record " + std::to_string(i) +
            " is not " + with_article(spec.kind) + ": " + e.what(),
        "",
        -1,
        index,
        spec.key);
  }
  if (spec.var_len) {
    counts_[cell] = static_cast<int64_t>(size.values);
    byte_counts_[cell] = static_cast<int64_t>(size.bytes);
    return;
  }
  const bool bytes = spec.kind == FeatureKind::kBytes;
  const int64_t got = static_cast<int64_t>(bytes ? size.bytes : size.values);
  if (got != spec.fixed_count) {
    throw RecordError(
        RecordErrorKind::kWrongSize,
        "feature '" + spec.key + "' of record " + std::to_string(i) +
            " holds " + std::to_string(got) + (bytes ? " bytes" : " values") +
            ", expected exactly " + std::to_string(spec.fixed_count) +
            " (a fixed-length feature)",
        "",
        -1,
        index,
        spec.key);
  }
  if (!fixed_numbers) {
    decode_bytes(
        view, static_cast<uint8_t*>(outs[s].values) + i * fc, nullptr, 0);
  }
}

void BatchParser::count() {
  const size_t ns = specs_.size();
  for (size_t s = 0; s < ns; ++s) {
    if (!specs_[s].var_len) {
      continue;
    }
    const size_t column = static_cast<size_t>(var_index_[s]);
    int64_t total = 0;
    int64_t byte_total = 0;
    for (size_t i = 0; i < records_.size(); ++i) {
      const size_t cell = i * num_var_ + column;
      const int64_t c = counts_[cell];
      const int64_t b = byte_counts_[cell];
      counts_[cell] = total; // now the record's first element
      byte_counts_[cell] = byte_total;
      total += c;
      byte_total += b;
    }
    totals_[s] = total;
    byte_totals_[s] = byte_total;
  }
}

int64_t BatchParser::var_values(size_t spec) const {
  return totals_.at(spec);
}

int64_t BatchParser::var_bytes(size_t spec) const {
  return byte_totals_.at(spec);
}

void BatchParser::fill(
    size_t begin,
    size_t end,
    const std::vector<FeatureOutput>& outs) {
  const size_t n = records_.size();
  for (size_t s : var_specs_) {
    if (begin == 0 && outs[s].value_offsets != nullptr) {
      outs[s].value_offsets[0] = 0;
    }
    if (end == n) {
      outs[s].offsets[n] = totals_[s];
    }
  }
  // Column by column. A run of records the fast walk decoded lies back to
  // back in the column's scratch and goes to its place in one copy; the
  // others are decoded here. An error stops the range at its record for
  // the columns after it too (the lowest-indexed error is the one kept).
  size_t limit = end;
  for (size_t column = 0; column < num_var_; ++column) {
    const size_t s = var_specs_[column];
    const FeatureOutput& out = outs[s];
    const size_t elem = compact_[s].kind == FeatureKind::kInt64
        ? sizeof(int64_t)
        : compact_[s].kind == FeatureKind::kFloat ? sizeof(float)
                                                  : 0;
    const uint8_t* run_from = nullptr;
    uint8_t* run_to = nullptr;
    size_t run_bytes = 0;
    auto flush = [&] {
      if (run_bytes > 0) {
        std::memcpy(run_to, run_from, run_bytes);
      }
      run_bytes = 0;
    };
    for (size_t i = begin; i < limit; ++i) {
      const size_t cell = i * num_var_ + column;
      const VarCell& c = cells_[cell];
      const int64_t first = counts_[cell];
      out.offsets[i] = first;
      if (c.fast) {
        const int64_t next = i + 1 < n ? counts_[cell + num_var_] : totals_[s];
        const auto bytes = static_cast<size_t>(next - first) * elem;
        uint8_t* to = static_cast<uint8_t*>(out.values) +
            static_cast<size_t>(first) * elem;
        if (run_bytes > 0 && run_from + run_bytes == c.decoded &&
            run_to + run_bytes == to) {
          run_bytes += bytes;
        } else if (bytes > 0) { // (an empty list may have no scratch)
          flush();
          run_from = c.decoded;
          run_to = to;
          run_bytes = bytes;
        }
        continue;
      }
      flush();
      try {
        fill_one(i, column, outs);
      } catch (const RecordError& e) {
        record_error(i, e);
        limit = i;
      }
    }
    flush();
  }
}

void BatchParser::fill_one(
    size_t i,
    size_t column,
    const std::vector<FeatureOutput>& outs) {
  const size_t s = var_specs_[column];
  const FeatureSpec& spec = specs_[s];
  const size_t cell = i * num_var_ + column;
  const VarCell& c = cells_[cell];
  const int64_t first = counts_[cell];
  const int64_t first_byte = byte_counts_[cell];
  const FeatureView view{records_[i].data, c.found, c.kind, c.data, c.size};
  switch (spec.kind) {
    case FeatureKind::kInt64: {
      int64_t* out = static_cast<int64_t*>(outs[s].values) + first;
      if (view.found) {
        decode_int64(view, out);
      } else {
        std::copy(spec.int64_default.begin(), spec.int64_default.end(), out);
      }
      break;
    }
    case FeatureKind::kFloat: {
      float* out = static_cast<float*>(outs[s].values) + first;
      if (view.found) {
        decode_float(view, out);
      } else {
        std::copy(spec.float_default.begin(), spec.float_default.end(), out);
      }
      break;
    }
    default: {
      uint8_t* out = static_cast<uint8_t*>(outs[s].values) + first_byte;
      int64_t* ends = outs[s].value_offsets + first + 1;
      if (view.found) {
        decode_bytes(view, out, ends, first_byte);
      } else {
        int64_t at = first_byte;
        for (const auto& b : spec.bytes_default) {
          std::memcpy(out + (at - first_byte), b.data(), b.size());
          at += static_cast<int64_t>(b.size());
          *ends++ = at;
        }
      }
    }
  }
}

} // namespace torch_stage::records
