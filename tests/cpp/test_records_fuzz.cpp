// Fuzzing the reader and the parser with the corpus of
// tests/data/records_fuzz_seeds.txt (shared with the hypothesis tests):
// random bytes and mutated seeds must give a result or a RecordError, never
// a crash, a hang or (under `make asan`) an out-of-bounds access or UB.
// Deterministic: a fixed PRNG seed, so a failure reproduces.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "records/example.h"
#include "records/record_io.h"
#include "records_test_util.h"

#ifndef TORCH_STAGE_TEST_DATA
#error \
    "TORCH_STAGE_TEST_DATA must name tests/data (set by tests/cpp/CMakeLists.txt)"
#endif

namespace torch_stage::records {
namespace {

using testing::hex_decode;
using testing::TempDir;
using testing::write_raw;

struct Seeds {
  std::vector<std::string> examples;
  std::vector<std::string> files;
};

Seeds load_seeds() {
  Seeds seeds;
  std::ifstream in(
      std::string(TORCH_STAGE_TEST_DATA) + "/records_fuzz_seeds.txt");
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') {
      continue;
    }
    const size_t space = line.find(' ');
    const std::string kind = line.substr(0, space);
    const std::string hex =
        space == std::string::npos ? "" : line.substr(space + 1);
    (kind == "example" ? seeds.examples : seeds.files)
        .push_back(hex_decode(hex));
  }
  return seeds;
}

// One random mutation of `s`, in the style of the hypothesis tests: flip
// bits, overwrite, truncate, insert, duplicate a slice, or plant a byte
// that looks like a long varint or a big length.
std::string mutate(std::string s, std::mt19937_64& rng) {
  auto pick = [&](size_t n) {
    return n == 0 ? 0 : static_cast<size_t>(rng() % n);
  };
  const int rounds = 1 + static_cast<int>(rng() % 3);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 6) {
      case 0:
        if (!s.empty()) {
          s[pick(s.size())] ^= static_cast<char>(1u << (rng() % 8));
        }
        break;
      case 1:
        if (!s.empty()) {
          s[pick(s.size())] = static_cast<char>(rng());
        }
        break;
      case 2:
        s.resize(pick(s.size() + 1));
        break;
      case 3: {
        std::string junk(pick(8) + 1, '\0');
        for (auto& c : junk) {
          c = static_cast<char>(rng());
        }
        s.insert(pick(s.size() + 1), junk);
        break;
      }
      case 4:
        if (!s.empty()) {
          const size_t a = pick(s.size());
          const size_t n = pick(s.size() - a) + 1;
          s.insert(pick(s.size() + 1), s.substr(a, n));
        }
        break;
      default:
        if (!s.empty()) {
          s[pick(s.size())] = static_cast<char>(rng() % 2 ? 0xff : 0x7f);
        }
    }
  }
  return s;
}

std::string random_bytes(std::mt19937_64& rng, size_t max_len) {
  std::string s(static_cast<size_t>(rng() % (max_len + 1)), '\0');
  for (auto& c : s) {
    c = static_cast<char>(rng());
  }
  return s;
}

const std::vector<std::string> kKeys = {"b", "f", "i", "d", "s", "v", "t", ""};

// Everything a caller can do with untrusted Example bytes.
void exercise_example(const std::string& bytes) {
  std::vector<FeatureView> views(kKeys.size());
  try {
    find_features(
        reinterpret_cast<const uint8_t*>(bytes.data()),
        bytes.size(),
        kKeys,
        views.data());
  } catch (const RecordError& e) {
    EXPECT_EQ(e.kind(), RecordErrorKind::kNotExample);
    return;
  }
  for (const auto& v : views) {
    if (!v.found) {
      continue;
    }
    ListSize n;
    try {
      n = list_size(v);
    } catch (const RecordError& e) {
      EXPECT_EQ(e.kind(), RecordErrorKind::kNotExample);
      continue;
    }
    // Exactly sized buffers: ASan catches any write past what list_size said.
    std::vector<int64_t> ints(n.values);
    std::vector<float> floats(n.values);
    std::vector<uint8_t> bytes_out(n.bytes);
    std::vector<int64_t> ends(n.values);
    decode_int64(v, ints.data());
    decode_float(v, floats.data());
    decode_bytes(v, bytes_out.data(), ends.data(), 0);
  }
}

void exercise_batch(const std::vector<std::string>& records) {
  std::vector<FeatureSpec> specs(4);
  specs[0].key = "d";
  specs[0].kind = FeatureKind::kBytes;
  specs[0].fixed_count = 194;
  specs[0].has_default = true;
  specs[0].bytes_default = {std::string(194, '\0')};
  specs[1].key = "s";
  specs[1].kind = FeatureKind::kInt64;
  specs[1].fixed_count = 1;
  specs[1].has_default = true;
  specs[1].int64_default = {0};
  specs[2].key = "v";
  specs[2].kind = FeatureKind::kFloat;
  specs[2].var_len = true;
  specs[2].has_default = true;
  specs[3].key = "b";
  specs[3].kind = FeatureKind::kBytes;
  specs[3].var_len = true;
  specs[3].has_default = true;
  std::vector<RecordRef> refs;
  for (const auto& r : records) {
    refs.push_back(
        RecordRef{reinterpret_cast<const uint8_t*>(r.data()), r.size()});
  }
  const size_t n = refs.size();
  BatchParser parser(specs, refs);
  std::vector<uint8_t> d(n * 194);
  std::vector<int64_t> s(n);
  std::vector<FeatureOutput> outs(4);
  outs[0].values = d.data();
  outs[1].values = s.data();
  parser.scan(0, n, outs);
  try {
    parser.check();
  } catch (const RecordError& e) {
    EXPECT_GE(e.record_index(), 0);
    EXPECT_LT(e.record_index(), static_cast<int64_t>(n));
    return;
  }
  parser.count();
  std::vector<float> v(static_cast<size_t>(parser.var_values(2)));
  std::vector<int64_t> v_off(n + 1);
  std::vector<uint8_t> b(static_cast<size_t>(parser.var_bytes(3)));
  std::vector<int64_t> b_off(n + 1);
  std::vector<int64_t> b_voff(static_cast<size_t>(parser.var_values(3)) + 1);
  outs[2] = FeatureOutput{v.data(), v_off.data(), nullptr};
  outs[3] = FeatureOutput{b.data(), b_off.data(), b_voff.data()};
  parser.fill(0, n, outs);
  parser.check();
  EXPECT_EQ(v_off[n], static_cast<int64_t>(v.size()));
  EXPECT_EQ(b_voff.back(), static_cast<int64_t>(b.size()));
}

void exercise_file(const std::string& path, Compression c) {
  try {
    RecordReader reader(path, c);
    std::string r;
    int guard = 0;
    while (reader.read(&r)) {
      ASSERT_LT(++guard, 100000) << "reader does not advance";
    }
  } catch (const RecordError& e) {
    EXPECT_NE(e.kind(), RecordErrorKind::kInvalidArgument) << e.what();
    EXPECT_EQ(e.path(), path);
  }
}

TEST(RecordsFuzz, CorpusLoads) {
  const Seeds seeds = load_seeds();
  EXPECT_GE(seeds.examples.size(), 5u);
  EXPECT_GE(seeds.files.size(), 2u);
  // The seeds themselves are valid.
  for (const auto& e : seeds.examples) {
    std::vector<FeatureView> views(kKeys.size());
    EXPECT_NO_THROW(find_features(
        reinterpret_cast<const uint8_t*>(e.data()),
        e.size(),
        kKeys,
        views.data()));
  }
}

TEST(RecordsFuzz, ParserSurvivesMutatedAndRandomExamples) {
  const Seeds seeds = load_seeds();
  std::mt19937_64 rng(20240601);
  for (int i = 0; i < 20000; ++i) {
    const std::string& seed =
        seeds.examples[static_cast<size_t>(i) % seeds.examples.size()];
    exercise_example(i % 5 == 4 ? random_bytes(rng, 300) : mutate(seed, rng));
  }
  for (int i = 0; i < 500; ++i) {
    std::vector<std::string> batch;
    for (int k = 0; k < 8; ++k) {
      batch.push_back(mutate(
          seeds.examples[static_cast<size_t>(rng() % seeds.examples.size())],
          rng));
    }
    exercise_batch(batch);
  }
}

// ------------------------------------------ fast walk against general walk

// The parse of `records` by one walk, as text: every output byte, or the
// error (kind, record, message). Equal texts: equal results.
// With one_buffer, the records lie back to back in one allocation of
// exactly their size, as in a RecordBatch, and the parser may read up to its
// end (RecordRef::readable_end): the fast walk then reads words that run
// past a record into the next one, and ASan checks it stays inside.
std::string parse_with(
    const std::vector<std::string>& records,
    const std::vector<FeatureSpec>& specs,
    BatchParser::Walk walk,
    size_t threads,
    size_t* fast_records = nullptr,
    bool one_buffer = false) {
  std::vector<RecordRef> refs;
  size_t total = 0;
  for (const auto& r : records) {
    total += r.size();
  }
  std::unique_ptr<uint8_t[]> buffer(new uint8_t[std::max<size_t>(total, 1)]);
  size_t at = 0;
  for (const auto& r : records) {
    if (one_buffer) {
      std::memcpy(buffer.get() + at, r.data(), r.size());
      refs.push_back(
          RecordRef{buffer.get() + at, r.size(), buffer.get() + total});
      at += r.size();
    } else {
      refs.push_back(
          RecordRef{reinterpret_cast<const uint8_t*>(r.data()), r.size()});
    }
  }
  const size_t n = refs.size();
  BatchParser parser(specs, refs, walk);
  auto elem = [](const FeatureSpec& s) -> size_t {
    return s.kind == FeatureKind::kInt64 ? 8
        : s.kind == FeatureKind::kFloat  ? 4
                                         : 1;
  };
  std::vector<std::vector<uint8_t>> values(specs.size());
  std::vector<std::vector<int64_t>> offsets(specs.size());
  std::vector<std::vector<int64_t>> value_offsets(specs.size());
  std::vector<FeatureOutput> outs(specs.size());
  for (size_t s = 0; s < specs.size(); ++s) {
    if (!specs[s].var_len) {
      values[s].resize(
          n * static_cast<size_t>(specs[s].fixed_count) * elem(specs[s]));
      outs[s].values = values[s].data();
    }
  }
  auto run = [&](auto pass) { // disjoint ranges, one after another
    for (size_t k = 0; k < threads; ++k) {
      pass(n * k / threads, n * (k + 1) / threads);
    }
  };
  auto error_text = [](const RecordError& e) {
    return "error " + std::to_string(static_cast<int>(e.kind())) + " record " +
        std::to_string(e.record_index()) + ": " + e.what();
  };
  try {
    run([&](size_t b, size_t e) { parser.scan(b, e, outs); });
    parser.check();
    parser.count();
    for (size_t s = 0; s < specs.size(); ++s) {
      if (!specs[s].var_len) {
        continue;
      }
      const bool bytes = specs[s].kind == FeatureKind::kBytes;
      const auto count = static_cast<size_t>(parser.var_values(s));
      values[s].resize(
          bytes ? static_cast<size_t>(parser.var_bytes(s))
                : count * elem(specs[s]));
      offsets[s].resize(n + 1);
      value_offsets[s].resize(bytes ? count + 1 : 0);
      outs[s] = FeatureOutput{
          values[s].data(),
          offsets[s].data(),
          bytes ? value_offsets[s].data() : nullptr};
    }
    run([&](size_t b, size_t e) { parser.fill(b, e, outs); });
    parser.check();
  } catch (const RecordError& e) {
    return error_text(e);
  }
  if (fast_records != nullptr) {
    *fast_records += parser.fast_records();
  }
  std::string text;
  for (size_t s = 0; s < specs.size(); ++s) {
    text += specs[s].key + ":";
    text.append(values[s].begin(), values[s].end());
    for (int64_t o : offsets[s]) {
      text += " " + std::to_string(o);
    }
    for (int64_t o : value_offsets[s]) {
      text += " " + std::to_string(o);
    }
    text += "\n";
  }
  return text;
}

// Examples in the usual encoding of every feature kind, with their corner
// cases: negative and 10-byte ints, 8 one-byte ints in a row, empty lists,
// unknown keys, a repeated key, a missing key, unpacked values.
std::vector<std::string> walk_seeds(std::mt19937_64& rng) {
  std::vector<std::string> out;
  for (int k = 0; k < 40; ++k) {
    ExampleEncoder e;
    std::vector<int64_t> fixed_ints(9);
    for (auto& v : fixed_ints) {
      const int shift = static_cast<int>(rng() % 64);
      v = static_cast<int64_t>(rng() >> shift) * (rng() % 4 == 0 ? -1 : 1);
    }
    if (k % 3 == 0) {
      for (auto& v : fixed_ints) {
        v = static_cast<int64_t>(rng() % 128); // one byte each
      }
    }
    std::vector<int64_t> ids(rng() % 7);
    for (auto& v : ids) {
      v = static_cast<int64_t>(rng() % (uint64_t{1} << 32));
    }
    if (k % 5 == 2) {
      // A list over several 64-byte windows of the varint decoder, with
      // varints of every length, some across a window's end.
      ids.resize(20 + rng() % 40);
      for (auto& v : ids) {
        v = static_cast<int64_t>(rng() >> (rng() % 64)) *
            (rng() % 5 == 0 ? -1 : 1);
      }
    }
    std::vector<float> floats(rng() % 4);
    for (auto& f : floats) {
      f = static_cast<float>(static_cast<int64_t>(rng() % 1000) - 500) / 7.0f;
    }
    if (k % 7 == 5) {
      e.add_int64("unknown", {1, 2, 3});
    }
    e.add_int64("i", fixed_ints);
    e.add_float("f", {0.5f * k, -1.0f});
    e.add_int64("c", ids);
    e.add_float("v", floats);
    e.add_bytes("d", {"ab", std::string(2, static_cast<char>('a' + k % 26))});
    e.add_bytes(
        "t", std::vector<std::string>(rng() % 3, std::string(k % 5, 'x')));
    if (k % 11 == 3) {
      e.add_int64("c", {7}); // the last entry for a key wins
    }
    out.push_back(e.serialize());
  }
  ExampleEncoder missing; // no "c"
  missing.add_int64("i", std::vector<int64_t>(9, 1));
  missing.add_float("f", {1.0f, 2.0f});
  missing.add_float("v", {});
  missing.add_bytes("d", {"abcd"});
  missing.add_bytes("t", {});
  out.push_back(missing.serialize());
  // "c" unpacked: tag 0x08 per value inside the Int64List.
  std::string list = "\x08\x05\x08\x96\x01";
  std::string feature =
      "\x1a" + std::string(1, static_cast<char>(list.size())) + list;
  std::string entry = std::string("\x0a\x01") + "c" + "\x12" +
      std::string(1, static_cast<char>(feature.size())) + feature;
  std::string with_unpacked = out[0].substr(0, out[0].size());
  // Append the entry inside the features message: re-encode the outer length.
  {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(out[0].data()) + 1;
    uint64_t len = 0;
    int shift = 0;
    size_t used = 0;
    while (true) {
      const uint8_t b = p[used++];
      len |= static_cast<uint64_t>(b & 0x7f) << shift;
      shift += 7;
      if (b < 0x80) {
        break;
      }
    }
    std::string body = out[0].substr(1 + used, len) + "\x0a" +
        std::string(1, static_cast<char>(entry.size())) + entry;
    std::string rebuilt = "\x0a";
    uint64_t v = body.size();
    while (v >= 0x80) {
      rebuilt.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    rebuilt.push_back(static_cast<char>(v));
    out.push_back(rebuilt + body);
  }
  return out;
}

std::vector<FeatureSpec> walk_specs(bool defaults) {
  std::vector<FeatureSpec> specs(6);
  specs[0].key = "i";
  specs[0].kind = FeatureKind::kInt64;
  specs[0].fixed_count = 9;
  specs[1].key = "f";
  specs[1].kind = FeatureKind::kFloat;
  specs[1].fixed_count = 2;
  specs[2].key = "c";
  specs[2].kind = FeatureKind::kInt64;
  specs[2].var_len = true;
  specs[3].key = "v";
  specs[3].kind = FeatureKind::kFloat;
  specs[3].var_len = true;
  specs[4].key = "d";
  specs[4].kind = FeatureKind::kBytes;
  specs[4].fixed_count = 4;
  specs[5].key = "t";
  specs[5].kind = FeatureKind::kBytes;
  specs[5].var_len = true;
  if (defaults) {
    for (auto& s : specs) {
      s.has_default = true;
    }
    specs[0].int64_default = std::vector<int64_t>(9, -3);
    specs[1].float_default = {1.5f, 2.5f};
    specs[2].int64_default = {4, 5};
    specs[3].float_default = {0.25f};
    specs[4].bytes_default = {"wxyz"};
    specs[5].bytes_default = {"q", ""};
  }
  return specs;
}

TEST(RecordsFuzz, FastWalkGivesWhatTheGeneralWalkGives) {
  std::mt19937_64 rng(1515);
  const std::vector<std::string> seeds = walk_seeds(rng);
  std::vector<BatchParser::Walk> fast = {BatchParser::Walk::kFastPortable};
  if (BatchParser::has_fast_pext()) {
    fast.push_back(BatchParser::Walk::kFastPext);
  }
  size_t parsed = 0;
  size_t fast_records = 0;
  size_t records = 0;
  for (int i = 0; i < 4000; ++i) {
    std::vector<std::string> batch(1 + rng() % 8);
    for (auto& r : batch) {
      const std::string& seed = seeds[rng() % seeds.size()];
      r = rng() % 3 == 0 ? mutate(seed, rng) : seed;
    }
    const auto specs = walk_specs(i % 2 == 1);
    const size_t threads = 1 + rng() % 3;
    const std::string want =
        parse_with(batch, specs, BatchParser::Walk::kGeneral, threads);
    const bool ok = want.rfind("error", 0) != 0;
    parsed += ok ? 1 : 0;
    records += ok ? batch.size() : 0;
    for (auto walk : fast) {
      ASSERT_EQ(parse_with(batch, specs, walk, threads, &fast_records), want)
          << "batch " << i << ", walk " << static_cast<int>(walk);
      ASSERT_EQ(parse_with(batch, specs, walk, threads, nullptr, true), want)
          << "batch " << i << " in one buffer, walk " << static_cast<int>(walk);
    }
  }
  // Both outcomes are exercised, and both walks: most records of the
  // batches that parse take the fast walk, some the general one.
  EXPECT_GT(parsed, 1000u);
  EXPECT_LT(parsed, 3900u);
  EXPECT_GT(fast_records, records * fast.size() / 2);
  EXPECT_LT(fast_records, records * fast.size());
}

TEST(RecordsFuzz, ReaderSurvivesMutatedAndRandomFiles) {
  const Seeds seeds = load_seeds();
  TempDir dir;
  std::mt19937_64 rng(7);
  // Compressed seeds: each file seed's records re-written under GZIP/ZLIB.
  std::vector<std::pair<std::string, Compression>> bases;
  for (size_t k = 0; k < seeds.files.size(); ++k) {
    bases.emplace_back(seeds.files[k], Compression::kNone);
    const std::string plain = dir.file("plain" + std::to_string(k));
    write_raw(plain, seeds.files[k]);
    std::vector<std::string> records;
    try {
      records = testing::read_all(plain);
    } catch (const RecordError&) {
      continue;
    }
    for (auto c : {Compression::kGzip, Compression::kZlib}) {
      const std::string path = dir.file("c" + std::to_string(k) + to_string(c));
      testing::write_records(path, records, c);
      bases.emplace_back(testing::read_raw(path), c);
    }
  }
  const std::string path = dir.file("fuzz");
  for (int i = 0; i < 3000; ++i) {
    const auto& [bytes, c] = bases[static_cast<size_t>(i) % bases.size()];
    write_raw(path, i % 7 == 6 ? random_bytes(rng, 200) : mutate(bytes, rng));
    exercise_file(path, c);
  }
}

} // namespace
} // namespace torch_stage::records
