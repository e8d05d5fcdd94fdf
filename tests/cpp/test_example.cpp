// tf.train.Example wire format: fixed vectors from protobuf, the encodings
// protobuf allows, and the batch parser's results and errors.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "records/example.h"
#include "records_test_util.h"

namespace torch_stage::records {
namespace {

using testing::expect_error;
using testing::hex_decode;

// Serialized by protobuf (the PyPI `tfrecord` package's example_pb2):
//   {"b": BytesList([b"ab", b""])}, {"f": FloatList([1.5, -2.0])},
//   {"i": Int64List([1, -1, 300])}
const char* kBytesHex = "0a0f0a0d0a016212080a060a0261620a00";
const char* kFloatHex = "0a130a110a0166120c120a0a080000c03f000000c0";
const char* kInt64Hex = "0a180a160a016912111a0f0a0d01ffffffffffffffffff01ac02";

RecordRef ref(const std::string& s) {
  return RecordRef{reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

FeatureView find(const std::string& example, const std::string& key) {
  FeatureView v;
  find_features(
      reinterpret_cast<const uint8_t*>(example.data()),
      example.size(),
      {key},
      &v);
  return v;
}

TEST(KeyIndex, FindsEveryKeyInAnyOrderBesideUnknownOnes) {
  const KeyIndex index({"a", "bb", "b", ""});
  KeyIndex::Order order(index);
  auto find = [&](const std::string& key) {
    return index.find(
        reinterpret_cast<const uint8_t*>(key.data()), key.size(), &order);
  };
  const std::vector<std::string> forward{"a", "bb", "b", ""};
  const std::vector<std::string> backward{"", "b", "bb", "a"};
  // The keys' own order, then the reverse twice (the second time learnt),
  // then forward again: unknown keys and near misses between never match.
  for (const auto* seen : {&forward, &backward, &backward, &forward}) {
    index.begin(&order);
    for (const auto& key : *seen) {
      EXPECT_EQ(find("nope"), KeyIndex::kNone);
      EXPECT_EQ(find(key + "x"), KeyIndex::kNone);
      const size_t want = key == "a" ? 0 : key == "bb" ? 1 : key == "b" ? 2 : 3;
      EXPECT_EQ(find(key), want) << "key '" << key << "'";
    }
  }
}

TEST(ExampleEncoder, MatchesProtobufBytes) {
  ExampleEncoder b;
  b.add_bytes("b", {"ab", ""});
  EXPECT_EQ(b.serialize(), hex_decode(kBytesHex));
  ExampleEncoder f;
  f.add_float("f", {1.5f, -2.0f});
  EXPECT_EQ(f.serialize(), hex_decode(kFloatHex));
  ExampleEncoder i;
  i.add_int64("i", {1, -1, 300});
  EXPECT_EQ(i.serialize(), hex_decode(kInt64Hex));
}

TEST(FindFeatures, DecodesTheProtobufVectors) {
  const std::string bytes = hex_decode(kBytesHex);
  FeatureView v = find(bytes, "b");
  ASSERT_TRUE(v.found);
  EXPECT_EQ(v.kind, FeatureKind::kBytes);
  ListSize s = list_size(v);
  EXPECT_EQ(s.values, 2u);
  EXPECT_EQ(s.bytes, 2u);
  std::vector<uint8_t> out(2);
  std::vector<int64_t> ends(2);
  decode_bytes(v, out.data(), ends.data(), 10);
  EXPECT_EQ(std::string(out.begin(), out.end()), "ab");
  EXPECT_EQ(ends, (std::vector<int64_t>{12, 12}));

  // Views point into the Example: keep it alive while they are used.
  const std::string floats = hex_decode(kFloatHex);
  v = find(floats, "f");
  ASSERT_EQ(list_size(v).values, 2u);
  std::vector<float> fl(2);
  decode_float(v, fl.data());
  EXPECT_EQ(fl, (std::vector<float>{1.5f, -2.0f}));

  const std::string ints = hex_decode(kInt64Hex);
  v = find(ints, "i");
  ASSERT_EQ(list_size(v).values, 3u);
  std::vector<int64_t> il(3);
  decode_int64(v, il.data());
  EXPECT_EQ(il, (std::vector<int64_t>{1, -1, 300}));

  EXPECT_FALSE(find(bytes, "x").found);
  EXPECT_FALSE(find(bytes, "").found);
}

TEST(FindFeatures, UnpackedScalarsAndMixturesCount) {
  // Int64List{value: 7 (unpacked), value: [8, 9] (packed)} and
  // FloatList{value: 0.5 (unpacked fixed32)}.
  std::string ilist =
      std::string("\x08\x07", 2) + std::string("\x0a\x02\x08\x09", 4);
  std::string flist = std::string("\x0d\x00\x00\x00\x3f", 5);
  auto feature = [](char field, const std::string& list) {
    return std::string(1, static_cast<char>((field << 3) | 2)) +
        std::string(1, static_cast<char>(list.size())) + list;
  };
  auto entry = [](const std::string& key, const std::string& feat) {
    std::string e = std::string("\x0a", 1) + static_cast<char>(key.size()) +
        key + std::string("\x12", 1) + static_cast<char>(feat.size()) + feat;
    return std::string("\x0a", 1) + static_cast<char>(e.size()) + e;
  };
  std::string features =
      entry("i", feature(3, ilist)) + entry("f", feature(2, flist));
  std::string example =
      std::string("\x0a", 1) + static_cast<char>(features.size()) + features;

  FeatureView v = find(example, "i");
  ASSERT_EQ(list_size(v).values, 3u);
  std::vector<int64_t> il(3);
  decode_int64(v, il.data());
  EXPECT_EQ(il, (std::vector<int64_t>{7, 8, 9}));
  v = find(example, "f");
  ASSERT_EQ(list_size(v).values, 1u);
  float f = 0;
  decode_float(v, &f);
  EXPECT_EQ(f, 0.5f);
}

TEST(FindFeatures, LastEntryWinsAndUnknownFieldsAreSkipped) {
  ExampleEncoder a;
  a.add_int64("k", {1});
  a.add_int64("k", {2, 3});
  // An unknown top-level varint field (field 5) after the features.
  const std::string example = a.serialize() + std::string("\x28\x01", 2);
  FeatureView v = find(example, "k");
  ASSERT_EQ(list_size(v).values, 2u);
  std::vector<int64_t> out(2);
  decode_int64(v, out.data());
  EXPECT_EQ(out, (std::vector<int64_t>{2, 3}));
}

TEST(FindFeatures, MalformedBytesNameThePosition) {
  const std::string good = hex_decode(kInt64Hex);
  const auto e =
      expect_error([&] { find(good.substr(0, good.size() - 4), "i"); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kNotExample);
  EXPECT_NE(std::string(e.what()).find("at byte 1"), std::string::npos)
      << e.what();
  // Wire type 3 (a group) at the top level.
  EXPECT_EQ(
      expect_error([] { find(std::string("\x0b", 1), "i"); }).kind(),
      RecordErrorKind::kNotExample);
  // Field number 0.
  EXPECT_EQ(
      expect_error([] { find(std::string("\x02\x00", 2), "i"); }).kind(),
      RecordErrorKind::kNotExample);
  // An 11-byte varint.
  EXPECT_EQ(
      expect_error([] { find(std::string(11, '\xff'), "i"); }).kind(),
      RecordErrorKind::kNotExample);
  // The empty string is an empty Example: valid, no features.
  EXPECT_FALSE(find("", "i").found);
}

// ------------------------------------------------------------ BatchParser

FeatureSpec fixed(const std::string& key, FeatureKind kind, int64_t n) {
  FeatureSpec s;
  s.key = key;
  s.kind = kind;
  s.fixed_count = n;
  return s;
}

FeatureSpec var(const std::string& key, FeatureKind kind) {
  FeatureSpec s;
  s.key = key;
  s.kind = kind;
  s.var_len = true;
  return s;
}

std::string make_example(int i) {
  ExampleEncoder e;
  e.add_bytes("d", {std::string(3, static_cast<char>('a' + i))});
  e.add_int64("s", {i * 100 - 1});
  e.add_float("v", std::vector<float>(static_cast<size_t>(i % 3), 0.25f * i));
  e.add_bytes(
      "t",
      std::vector<std::string>(
          static_cast<size_t>(i % 2 + 1),
          std::string(static_cast<size_t>(i), 'x')));
  return e.serialize();
}

struct Parsed {
  std::vector<uint8_t> d;
  std::vector<int64_t> s;
  std::vector<float> v;
  std::vector<int64_t> v_off;
  std::vector<uint8_t> t;
  std::vector<int64_t> t_off;
  std::vector<int64_t> t_voff;
};

// Runs the two passes over `threads` ranges, as parse_example.cpp does,
// with a schema of its own or the one given.
Parsed parse(
    const std::vector<std::string>& records,
    const std::vector<FeatureSpec>& specs,
    int threads,
    std::shared_ptr<const ParseSchema> schema = nullptr) {
  std::vector<RecordRef> refs;
  for (const auto& r : records) {
    refs.push_back(ref(r));
  }
  const size_t n = refs.size();
  if (schema == nullptr) {
    schema = std::make_shared<const ParseSchema>(specs);
  }
  BatchParser parser(schema, refs);
  Parsed p;
  p.d.resize(n * 3);
  p.s.resize(n);
  std::vector<FeatureOutput> outs(4);
  outs[0].values = p.d.data();
  outs[1].values = p.s.data();
  auto run = [&](auto pass) {
    std::vector<std::thread> ts;
    for (int k = 0; k < threads; ++k) {
      const size_t b = n * k / threads;
      const size_t e = n * (k + 1) / threads;
      ts.emplace_back([&, b, e] { pass(b, e); });
    }
    for (auto& t : ts) {
      t.join();
    }
  };
  run([&](size_t b, size_t e) { parser.scan(b, e, outs); });
  parser.check();
  parser.count();
  p.v.resize(static_cast<size_t>(parser.var_values(2)));
  p.v_off.resize(n + 1);
  p.t.resize(static_cast<size_t>(parser.var_bytes(3)));
  p.t_off.resize(n + 1);
  p.t_voff.resize(static_cast<size_t>(parser.var_values(3)) + 1);
  outs[2] = FeatureOutput{p.v.data(), p.v_off.data(), nullptr};
  outs[3] = FeatureOutput{p.t.data(), p.t_off.data(), p.t_voff.data()};
  run([&](size_t b, size_t e) { parser.fill(b, e, outs); });
  parser.check();
  return p;
}

std::vector<FeatureSpec> four_specs() {
  return {
      fixed("d", FeatureKind::kBytes, 3),
      fixed("s", FeatureKind::kInt64, 1),
      var("v", FeatureKind::kFloat),
      var("t", FeatureKind::kBytes)};
}

TEST(BatchParser, FixedAndVarLengthFeaturesLandInTheirSlots) {
  std::vector<std::string> records;
  for (int i = 0; i < 37; ++i) {
    records.push_back(make_example(i));
  }
  const auto specs = four_specs();
  const Parsed one = parse(records, specs, 1);
  for (int threads : {2, 5}) {
    const Parsed many = parse(records, specs, threads);
    EXPECT_EQ(many.d, one.d);
    EXPECT_EQ(many.v, one.v);
    EXPECT_EQ(many.t_voff, one.t_voff);
  }
  for (int i = 0; i < 37; ++i) {
    EXPECT_EQ(one.d[i * 3], 'a' + i);
    EXPECT_EQ(one.s[i], i * 100 - 1);
    EXPECT_EQ(one.v_off[i + 1] - one.v_off[i], i % 3);
    for (int64_t j = one.v_off[i]; j < one.v_off[i + 1]; ++j) {
      EXPECT_EQ(one.v[j], 0.25f * i);
    }
    const int64_t strings = one.t_off[i + 1] - one.t_off[i];
    EXPECT_EQ(strings, i % 2 + 1);
    for (int64_t j = one.t_off[i]; j < one.t_off[i + 1]; ++j) {
      EXPECT_EQ(one.t_voff[j + 1] - one.t_voff[j], i);
    }
  }
  EXPECT_EQ(one.t_voff.front(), 0);
  EXPECT_EQ(one.t_voff.back(), static_cast<int64_t>(one.t.size()));
}

TEST(BatchParser, OneSchemaServesParsersOnManyThreadsAtOnce) {
  // As parse_example's callers do: one schema per feature mapping, the
  // batches parsed on several threads at the same time (TSan checks that
  // nothing of it is written).
  std::vector<std::vector<std::string>> batches(8);
  for (size_t b = 0; b < batches.size(); ++b) {
    for (int i = 0; i < 20 + static_cast<int>(b); ++i) {
      batches[b].push_back(make_example(i + static_cast<int>(b)));
    }
  }
  const auto specs = four_specs();
  const auto schema = std::make_shared<const ParseSchema>(specs);
  std::vector<Parsed> shared(batches.size());
  std::vector<std::thread> threads;
  for (size_t b = 0; b < batches.size(); ++b) {
    threads.emplace_back(
        [&, b] { shared[b] = parse(batches[b], specs, 2, schema); });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (size_t b = 0; b < batches.size(); ++b) {
    const Parsed own = parse(batches[b], specs, 1);
    EXPECT_EQ(shared[b].d, own.d) << "batch " << b;
    EXPECT_EQ(shared[b].s, own.s) << "batch " << b;
    EXPECT_EQ(shared[b].v, own.v) << "batch " << b;
    EXPECT_EQ(shared[b].v_off, own.v_off) << "batch " << b;
    EXPECT_EQ(shared[b].t, own.t) << "batch " << b;
    EXPECT_EQ(shared[b].t_voff, own.t_voff) << "batch " << b;
  }
}

TEST(BatchParser, EmptyBatch) {
  const Parsed p = parse({}, four_specs(), 1);
  EXPECT_EQ(p.v_off, std::vector<int64_t>{0});
  EXPECT_EQ(p.t_voff, std::vector<int64_t>{0});
}

TEST(BatchParser, ReportsTheLowestBadRecordWhateverTheThreads) {
  std::vector<std::string> records;
  for (int i = 0; i < 40; ++i) {
    records.push_back(make_example(i));
  }
  ExampleEncoder no_s;
  no_s.add_bytes("d", {"abc"});
  records[31] = no_s.serialize();
  records[17] = "\xff\xff"; // not an Example
  for (int threads : {1, 4}) {
    const auto e = expect_error([&] { parse(records, four_specs(), threads); });
    EXPECT_EQ(e.kind(), RecordErrorKind::kNotExample);
    EXPECT_EQ(e.record_index(), 17);
    EXPECT_NE(
        std::string(e.what()).find("record 17 is not a tf.train.Example"),
        std::string::npos)
        << e.what();
  }
  records[17] = make_example(17);
  const auto e = expect_error([&] { parse(records, four_specs(), 3); });
  EXPECT_EQ(e.kind(), RecordErrorKind::kMissingFeature);
  EXPECT_EQ(e.record_index(), 31);
  EXPECT_EQ(e.key(), "s");
  EXPECT_NE(
      std::string(e.what()).find("record 31 has no feature 's'"),
      std::string::npos)
      << e.what();
}

TEST(BatchParser, WrongTypeAndWrongSizeNameKeyAndRecord) {
  ExampleEncoder wrong_type;
  wrong_type.add_bytes("d", {"abc"});
  wrong_type.add_float("s", {1.0f});
  auto e = expect_error([&] {
    parse(
        {make_example(0), wrong_type.serialize()},
        {fixed("d", FeatureKind::kBytes, 3),
         fixed("s", FeatureKind::kInt64, 1)},
        1);
  });
  // (parse() expects four specs' outputs; two specs only use the first two.)
  EXPECT_EQ(e.kind(), RecordErrorKind::kWrongType);
  EXPECT_EQ(e.record_index(), 1);
  EXPECT_EQ(e.key(), "s");
  EXPECT_NE(
      std::string(e.what()).find("is a FloatList, expected an Int64List"),
      std::string::npos)
      << e.what();

  ExampleEncoder wrong_size;
  wrong_size.add_bytes("d", {"abcd"});
  wrong_size.add_int64("s", {1});
  e = expect_error([&] {
    parse(
        {wrong_size.serialize()},
        {fixed("d", FeatureKind::kBytes, 3),
         fixed("s", FeatureKind::kInt64, 1)},
        1);
  });
  EXPECT_EQ(e.kind(), RecordErrorKind::kWrongSize);
  EXPECT_NE(
      std::string(e.what()).find("holds 4 bytes, expected exactly 3"),
      std::string::npos)
      << e.what();
}

TEST(BatchParser, DefaultsFillMissingKeysAndEmptyFeaturesMatchAnyType) {
  ExampleEncoder only_d;
  only_d.add_bytes("d", {"xyz"});
  auto specs = four_specs();
  specs[1].has_default = true;
  specs[1].int64_default = {-7};
  specs[2].has_default = true;
  specs[2].float_default = {1.0f, 2.0f};
  specs[3].has_default = true;
  specs[3].bytes_default = {"q", "rs"};
  const Parsed p = parse({only_d.serialize(), make_example(2)}, specs, 1);
  EXPECT_EQ(p.s, (std::vector<int64_t>{-7, 199}));
  EXPECT_EQ(p.v_off, (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(p.v[0], 1.0f);
  EXPECT_EQ(p.v[1], 2.0f);
  EXPECT_EQ(p.t_off[1], 2);
  EXPECT_EQ(std::string(p.t.begin(), p.t.begin() + 3), "qrs");
  EXPECT_EQ(p.t_voff[1], 1);
  EXPECT_EQ(p.t_voff[2], 3);

  // A Feature with no list set is an empty list of the spec's type.
  const std::string empty_feature = hex_decode("0a070a050a01761200");
  FeatureView v = find(empty_feature, "v");
  EXPECT_TRUE(v.found);
  EXPECT_EQ(v.kind, FeatureKind::kNone);
  EXPECT_EQ(list_size(v).values, 0u);
}

TEST(ValidateSpecs, RejectsBadSpecsByKey) {
  auto e = expect_error([] {
    validate_specs(
        {fixed("a", FeatureKind::kInt64, 1),
         fixed("a", FeatureKind::kInt64, 1)});
  });
  EXPECT_NE(std::string(e.what()).find("appears twice"), std::string::npos);
  e = expect_error(
      [] { validate_specs({fixed("a", FeatureKind::kInt64, -1)}); });
  EXPECT_NE(std::string(e.what()).find("got -1"), std::string::npos);
  auto s = fixed("a", FeatureKind::kFloat, 2);
  s.has_default = true;
  s.float_default = {1.0f};
  e = expect_error([&] { validate_specs({s}); });
  EXPECT_EQ(e.key(), "a");
  EXPECT_NE(
      std::string(e.what()).find("default has 1 values, the fixed length is 2"),
      std::string::npos)
      << e.what();
}

} // namespace
} // namespace torch_stage::records
