// RecordInput: completeness, determinism, sharding, epochs, errors at their
// position, and prompt shutdown from any state. Runs under TSan.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "records/record_input.h"
#include "records_test_util.h"

namespace torch_stage::records {
namespace {

using testing::read_raw;
using testing::TempDir;
using testing::write_raw;
using testing::write_records;

// Far above any healthy wait: only says that nothing blocks forever.
constexpr auto kHangBound = std::chrono::seconds(60);

std::string rec(int file, int i) {
  return "f" + std::to_string(file) + "r" + std::to_string(i);
}

// `files` files of `per_file` records each, named f<k>.rec.
void make_files(
    const TempDir& dir,
    int files,
    int per_file,
    Compression c = Compression::kNone) {
  for (int k = 0; k < files; ++k) {
    std::vector<std::string> records;
    for (int i = 0; i < per_file; ++i) {
      records.push_back(rec(k, i));
    }
    write_records(dir.file("f" + std::to_string(k) + ".rec"), records, c);
  }
}

RecordInputOptions options(const TempDir& dir) {
  RecordInputOptions o;
  o.file_patterns = {dir.file("*.rec")};
  o.parallelism = 3;
  o.buffer_size = 16;
  o.batch_size = 5;
  o.epochs = 1;
  return o;
}

std::vector<std::string> split(const RecordBatch& b) {
  std::vector<std::string> out;
  for (size_t i = 0; i < b.size(); ++i) {
    out.emplace_back(
        reinterpret_cast<const char*>(b.data.data()) + b.offsets[i],
        static_cast<size_t>(b.offsets[i + 1] - b.offsets[i]));
  }
  return out;
}

// Every batch until the end, with a bound on each wait.
std::vector<RecordBatch> drain(RecordInput& input) {
  std::vector<RecordBatch> batches;
  while (true) {
    RecordBatch b;
    const auto status =
        input.try_take_until(&b, RecordInput::Clock::now() + kHangBound);
    if (status == BufferStatus::kClosed) {
      return batches;
    }
    EXPECT_EQ(status, BufferStatus::kOk) << to_string(status);
    if (status != BufferStatus::kOk) {
      return batches;
    }
    batches.push_back(std::move(b));
  }
}

std::vector<std::string> files_of(
    const std::map<std::string, std::vector<std::string>>& contents) {
  std::vector<std::string> files;
  for (const auto& [path, recs] : contents) {
    files.push_back(path);
  }
  return files; // sorted, as match_files gives them
}

std::vector<std::string> flatten(const std::vector<RecordBatch>& batches) {
  std::vector<std::string> all;
  for (const auto& b : batches) {
    for (auto& r : split(b)) {
      all.push_back(r);
    }
  }
  return all;
}

TEST(RecordInput, OneEpochDeliversEveryRecordOnceInFullBatches) {
  TempDir dir;
  make_files(dir, 4, 23);
  RecordInput input(options(dir));
  EXPECT_EQ(input.files().size(), 4u);
  const auto batches = drain(input);
  ASSERT_EQ(batches.size(), 19u); // 92 records = 18 * 5 + 2
  for (size_t i = 0; i + 1 < batches.size(); ++i) {
    EXPECT_EQ(batches[i].size(), 5u);
  }
  EXPECT_EQ(batches.back().size(), 2u);
  auto all = flatten(batches);
  std::multiset<std::string> got(all.begin(), all.end());
  std::multiset<std::string> want;
  for (int k = 0; k < 4; ++k) {
    for (int i = 0; i < 23; ++i) {
      want.insert(rec(k, i));
    }
  }
  EXPECT_EQ(got, want);
  const auto s = input.stats();
  EXPECT_EQ(s.records_read, 92);
  EXPECT_EQ(s.records_out, 92);
  EXPECT_EQ(s.readers, 3);
  // A later take still reports the end.
  RecordBatch b;
  EXPECT_EQ(input.take(&b), BufferStatus::kClosed);
}

TEST(RecordInput, SameSeedSameOrderWhateverTheThreadsDo) {
  TempDir dir;
  make_files(dir, 5, 40);
  auto opts = options(dir);
  opts.parallelism = 4;
  opts.epochs = 2;
  opts.chunk_records = 3;
  std::vector<std::string> first;
  for (int run = 0; run < 4; ++run) {
    RecordInput input(opts);
    auto all = flatten(drain(input));
    ASSERT_EQ(all.size(), 400u);
    if (run == 0) {
      first = all;
    } else {
      EXPECT_EQ(all, first) << "run " << run;
    }
  }
  opts.seed = 302;
  RecordInput other(opts);
  EXPECT_NE(flatten(drain(other)), first);
}

// The order record_input.h documents, computed here without threads,
// blocks or prefetching: every file's records, the epochs' file orders, the
// readers' strict round-robin, the pool filling one record per turn then two
// per record drawn, and uniform draws swapped to the pool's end.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t bounded(std::mt19937_64& rng, uint64_t n) {
  const uint64_t limit = (0 - n) % n;
  while (true) {
    const uint64_t r = rng();
    if (r >= limit) {
      return r % n;
    }
  }
}

std::vector<std::string> documented_order(
    const RecordInputOptions& o,
    const std::vector<std::string>& files,
    const std::map<std::string, std::vector<std::string>>& contents) {
  const size_t readers =
      std::min(static_cast<size_t>(o.parallelism), files.size());
  const uint64_t seed = *o.seed;
  // The records each reader gives in each epoch.
  std::vector<std::vector<std::vector<std::string>>> streams;
  for (int64_t e = 0; e < o.epochs; ++e) {
    std::vector<std::string> order = files;
    std::mt19937_64 rng(
        splitmix64(seed ^ splitmix64(static_cast<uint64_t>(e) + 1)));
    for (size_t i = order.size(); i > 1; --i) {
      std::swap(order[i - 1], order[bounded(rng, i)]);
    }
    std::vector<std::vector<std::string>> per_reader(readers);
    for (size_t j = 0; j < order.size(); ++j) {
      const auto& recs = contents.at(order[j]);
      per_reader[j % readers].insert(
          per_reader[j % readers].end(), recs.begin(), recs.end());
    }
    streams.push_back(per_reader);
  }
  // Round-robin, record by record, epoch by epoch.
  std::vector<std::string> arrivals;
  for (const auto& per_reader : streams) {
    std::vector<size_t> at(readers, 0);
    size_t done = 0;
    for (size_t turn = 0; done < readers; turn = (turn + 1) % readers) {
      if (at[turn] == per_reader[turn].size()) {
        continue;
      }
      arrivals.push_back(per_reader[turn][at[turn]++]);
      done += at[turn] == per_reader[turn].size() ? 1 : 0;
    }
  }
  const size_t capacity = static_cast<size_t>(o.buffer_size);
  std::mt19937_64 rng(splitmix64(seed));
  std::vector<std::string> pool, out;
  size_t next = 0;
  bool emitting = false;
  while (true) {
    const size_t pulls = pool.size() < capacity ? (emitting ? 2 : 1) : 0;
    for (size_t p = 0; p < pulls && pool.size() < capacity; ++p) {
      if (next < arrivals.size()) {
        pool.push_back(arrivals[next++]);
      }
    }
    const bool exhausted = next == arrivals.size();
    if (pool.empty() && exhausted) {
      return out;
    }
    emitting = emitting || pool.size() >= (capacity + 1) / 2;
    if (!emitting && !exhausted) {
      continue;
    }
    const size_t j = bounded(rng, pool.size());
    std::swap(pool[j], pool.back());
    out.push_back(pool.back());
    pool.pop_back();
  }
}

TEST(RecordInput, DeliversTheDocumentedOrderWhileCompactingItsBlocks) {
  // Records of 1 KB in 8 files: 256 to a reader's block. With 2,000 in the
  // pool, blocks would stay held for ~6x the pool's bytes; compaction moves
  // the last records of the emptiest ones, which must not change a thing.
  TempDir dir;
  std::map<std::string, std::vector<std::string>> contents;
  std::mt19937_64 gen(5);
  for (int k = 0; k < 8; ++k) {
    const std::string path = dir.file("f" + std::to_string(k) + ".rec");
    auto& recs = contents[path];
    for (int i = 0; i < 2000; ++i) {
      std::string r = rec(k, i);
      while (r.size() < 1000 + gen() % 48) {
        r.push_back(static_cast<char>('a' + gen() % 26));
      }
      recs.push_back(r);
    }
    write_records(path, recs);
  }
  auto opts = options(dir);
  opts.parallelism = 3;
  opts.buffer_size = 2000;
  opts.batch_size = 100;
  opts.epochs = 3;
  const auto want = documented_order(opts, files_of(contents), contents);
  ASSERT_EQ(want.size(), 48000u);
  RecordInput input(opts);
  std::vector<std::string> got;
  int64_t most_bytes = 0;
  while (true) {
    RecordBatch b;
    const auto status =
        input.try_take_until(&b, RecordInput::Clock::now() + kHangBound);
    if (status != BufferStatus::kOk) {
      EXPECT_EQ(status, BufferStatus::kClosed);
      break;
    }
    for (auto& r : split(b)) {
      got.push_back(std::move(r));
    }
    most_bytes = std::max(most_bytes, input.stats().buffer_bytes);
  }
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "record " << i;
  }
  const auto s = input.stats();
  EXPECT_GT(s.records_compacted, 0);
  EXPECT_LT(s.records_compacted, 48000 / 2);
  // About twice the pool's ~2 MB of records, and the slack: 3 readers'
  // blocks and 8 more of 256 KiB.
  EXPECT_LE(most_bytes, 2 * 2000 * 1048 + 11 * 256 * 1024 + 256 * 1024);
  EXPECT_GT(most_bytes, 0);
}

TEST(RecordInput, ShufflesAcrossFilesAndWithinThePool) {
  TempDir dir;
  make_files(dir, 2, 200);
  auto opts = options(dir);
  opts.buffer_size = 100;
  RecordInput input(opts);
  const auto all = flatten(drain(input));
  ASSERT_EQ(all.size(), 400u);
  // Not file order: the first 50 records come from both files and are not
  // each file's first records in sequence.
  std::set<char> first_files;
  int in_order = 0;
  for (size_t i = 0; i < 50; ++i) {
    first_files.insert(all[i][1]);
    if (i > 0 && all[i] > all[i - 1]) {
      ++in_order;
    }
  }
  EXPECT_EQ(first_files.size(), 2u);
  EXPECT_LT(in_order, 45);
}

TEST(RecordInput, EmitsOnceThePoolIsHalfFullThenFillsIt) {
  // One file read in order into a pool of 8: the first record out is drawn
  // from the pool as it is at the threshold, ceil(8 / 2) = 4 records, so it
  // is one of r0..r3 for every seed (waiting for a full pool would let
  // r4..r7 come first for some seeds).
  TempDir dir;
  make_files(dir, 1, 100);
  auto opts = options(dir);
  opts.parallelism = 1;
  opts.buffer_size = 8;
  opts.batch_size = 1;
  std::set<std::string> firsts;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    opts.seed = seed;
    RecordInput input(opts);
    RecordBatch b;
    ASSERT_EQ(
        input.try_take_until(&b, RecordInput::Clock::now() + kHangBound),
        BufferStatus::kOk);
    firsts.insert(split(b)[0]);
  }
  EXPECT_GE(firsts.size(), 3u);
  for (const auto& r : firsts) {
    EXPECT_TRUE(
        r == rec(0, 0) || r == rec(0, 1) || r == rec(0, 2) || r == rec(0, 3))
        << r;
  }
  // Once flowing, the pool grows to its full size and stays there (the
  // count is recorded after each fill step).
  opts.epochs = -1;
  RecordInput input(opts);
  for (int i = 0; i < 50; ++i) {
    RecordBatch b;
    ASSERT_EQ(
        input.try_take_until(&b, RecordInput::Clock::now() + kHangBound),
        BufferStatus::kOk);
  }
  EXPECT_EQ(input.stats().pool_size, 8);
}

TEST(RecordInput, ShardsSplitTheFilesWithoutOverlap) {
  TempDir dir;
  make_files(dir, 5, 10);
  std::multiset<std::string> all;
  for (int rank = 0; rank < 2; ++rank) {
    auto opts = options(dir);
    opts.shard_rank = rank;
    opts.shard_world = 2;
    RecordInput input(opts);
    EXPECT_EQ(input.files().size(), rank == 0 ? 3u : 2u);
    for (auto& r : flatten(drain(input))) {
      all.insert(r);
    }
  }
  EXPECT_EQ(all.size(), 50u);
  EXPECT_EQ(std::set<std::string>(all.begin(), all.end()).size(), 50u);
}

TEST(RecordInput, ShiftRatioRotatesTheFileOrder) {
  TempDir dir;
  make_files(dir, 4, 30);
  auto opts = options(dir);
  opts.parallelism = 1;
  opts.buffer_size = 1; // no pool shuffle: the output is file order
  opts.batch_size = 30;
  RecordInput base(opts);
  opts.shift_ratio = 0.5;
  RecordInput shifted(opts);
  std::vector<std::string> base_files;
  std::vector<std::string> shifted_files;
  for (auto& b : drain(base)) {
    base_files.push_back(split(b)[0].substr(0, 2));
  }
  for (auto& b : drain(shifted)) {
    shifted_files.push_back(split(b)[0].substr(0, 2));
  }
  ASSERT_EQ(base_files.size(), 4u);
  std::vector<std::string> rotated = base_files;
  std::rotate(rotated.begin(), rotated.begin() + 2, rotated.end());
  EXPECT_EQ(shifted_files, rotated);
}

TEST(RecordInput, RepeatsForeverWithoutEpochs) {
  TempDir dir;
  make_files(dir, 2, 3);
  auto opts = options(dir);
  opts.epochs = -1;
  opts.buffer_size = 4;
  RecordInput input(opts);
  std::map<std::string, int> seen;
  for (int i = 0; i < 20; ++i) { // 100 records from 6: ~16 epochs
    RecordBatch b;
    ASSERT_EQ(
        input.try_take_until(&b, RecordInput::Clock::now() + kHangBound),
        BufferStatus::kOk);
    for (auto& r : split(b)) {
      ++seen[r];
    }
  }
  EXPECT_EQ(seen.size(), 6u);
  for (auto& [r, n] : seen) {
    EXPECT_GE(n, 10) << r;
  }
  EXPECT_GE(input.stats().epoch, 10);
}

TEST(RecordInput, GzipFilesToo) {
  TempDir dir;
  make_files(dir, 3, 11, Compression::kGzip);
  auto opts = options(dir);
  opts.compression = Compression::kGzip;
  RecordInput input(opts);
  EXPECT_EQ(flatten(drain(input)).size(), 33u);
}

TEST(RecordInput, ACorruptFileRaisesAtItsPositionAndTheRestFollows) {
  TempDir dir;
  make_files(dir, 3, 20);
  // Damage f1.rec's 6th record's data CRC.
  std::string bytes = read_raw(dir.file("f1.rec"));
  size_t at = 0;
  for (int i = 0; i < 5; ++i) {
    at += 16 + rec(1, i).size();
  }
  bytes[at + 12] ^= 0x01;
  write_raw(dir.file("f1.rec"), bytes);

  auto opts = options(dir);
  std::vector<std::string> first;
  for (int run = 0; run < 2; ++run) {
    RecordInput input(opts);
    std::vector<std::string> got;
    int errors = 0;
    int error_at = -1;
    while (true) {
      RecordBatch b;
      BufferStatus status;
      try {
        status =
            input.try_take_until(&b, RecordInput::Clock::now() + kHangBound);
      } catch (const RecordError& e) {
        ++errors;
        error_at = static_cast<int>(got.size());
        EXPECT_EQ(e.kind(), RecordErrorKind::kCorrupt);
        EXPECT_EQ(e.path(), dir.file("f1.rec"));
        EXPECT_EQ(e.record_index(), 5);
        continue;
      }
      if (status == BufferStatus::kClosed) {
        break;
      }
      ASSERT_EQ(status, BufferStatus::kOk);
      for (auto& r : split(b)) {
        got.push_back(r);
      }
    }
    EXPECT_EQ(errors, 1);
    // Records 0-4 of f1 and every record of f0 and f2.
    EXPECT_EQ(got.size(), 45u);
    EXPECT_EQ(input.stats().errors, 1);
    got.push_back("error at " + std::to_string(error_at));
    if (run == 0) {
      first = got;
    } else {
      EXPECT_EQ(got, first); // the error's position is deterministic too
    }
  }
}

// ---------------------------------------------------------------- bad files
//
// A whole pass without a record must end the data (finite epochs) or fail
// naming the files (epochs < 0); before, it spun through empty passes.

// What successive takes give: "n" for a batch of n records, the error kind,
// "end", or "hang" when a wait outlasts kHangBound.
std::vector<std::string> outcomes(RecordInput& input, size_t limit = 50) {
  std::vector<std::string> got;
  while (got.size() < limit) {
    RecordBatch b;
    BufferStatus status;
    try {
      status = input.try_take_until(&b, RecordInput::Clock::now() + kHangBound);
    } catch (const RecordError& e) {
      got.emplace_back(to_string(e.kind()));
      continue;
    }
    if (status == BufferStatus::kClosed) {
      got.emplace_back("end");
      break;
    }
    if (status != BufferStatus::kOk) {
      got.emplace_back("hang");
      break;
    }
    got.push_back(std::to_string(b.size()));
  }
  return got;
}

TEST(RecordInput, ForeverOverEmptyFilesFailsNamingThem) {
  TempDir dir;
  write_raw(dir.file("a.rec"), "");
  write_raw(dir.file("b.rec"), "");
  auto opts = options(dir);
  opts.epochs = -1;
  RecordInput input(opts);
  RecordBatch b;
  try {
    input.try_take_until(&b, RecordInput::Clock::now() + kHangBound);
    FAIL() << "expected a kNoRecords error";
  } catch (const RecordError& e) {
    EXPECT_EQ(e.kind(), RecordErrorKind::kNoRecords);
    const std::string what = e.what();
    EXPECT_NE(what.find("'" + dir.file("a.rec") + "'"), std::string::npos);
    EXPECT_NE(what.find("'" + dir.file("b.rec") + "'"), std::string::npos);
    EXPECT_NE(what.find("epochs=None"), std::string::npos) << what;
  }
  EXPECT_EQ(outcomes(input), std::vector<std::string>{"end"});
}

TEST(RecordInput, FiniteEpochsOverEmptyFilesEndAfterOnePass) {
  TempDir dir;
  write_raw(dir.file("a.rec"), "");
  auto opts = options(dir);
  opts.epochs = int64_t{1} << 40; // would spin for days pass by pass
  RecordInput input(opts);
  EXPECT_EQ(outcomes(input), std::vector<std::string>{"end"});
  EXPECT_EQ(input.stats().epoch, 0);
}

TEST(RecordInput, NoCompleteRecordIsItsErrorThenTheEnd) {
  TempDir dir;
  write_raw(dir.file("t.rec"), std::string("\x05\x00\x00", 3));
  for (const int64_t epochs : {int64_t{-1}, int64_t{3}}) {
    auto opts = options(dir);
    opts.epochs = epochs;
    RecordInput input(opts);
    const std::vector<std::string> want = epochs < 0
        ? std::vector<std::string>{"truncated", "no records", "end"}
        : std::vector<std::string>{"truncated", "end"};
    EXPECT_EQ(outcomes(input), want) << "epochs " << epochs;
  }
}

TEST(RecordInput, EmptyFilesAmongOthersAddNothing) {
  TempDir dir;
  make_files(dir, 2, 7);
  write_raw(dir.file("e0.rec"), "");
  write_raw(dir.file("e1.rec"), "");
  auto opts = options(dir);
  opts.parallelism = 4;
  opts.epochs = 2;
  RecordInput input(opts);
  auto got = flatten(drain(input));
  std::sort(got.begin(), got.end());
  std::vector<std::string> want;
  for (int e = 0; e < 2; ++e) {
    for (int k = 0; k < 2; ++k) {
      for (int i = 0; i < 7; ++i) {
        want.push_back(rec(k, i));
      }
    }
  }
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
}

TEST(RecordInput, AFileCutShortWhileReadIsAnIoErrorNamingIt) {
  TempDir dir;
  const std::string path = dir.file("big.rec");
  write_records(path, std::vector<std::string>(2000, std::string(1000, 'x')));
  auto opts = options(dir);
  opts.parallelism = 1;
  opts.buffer_size = 1;
  opts.batch_size = 1;
  opts.prefetch_batches = 1;
  opts.chunk_records = 1;
  opts.reader_queue_chunks = 1;
  RecordInput input(opts);
  RecordBatch b;
  ASSERT_EQ(
      input.try_take_until(&b, RecordInput::Clock::now() + kHangBound),
      BufferStatus::kOk);
  // The reader now waits on its full queue, its file half read at most.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  write_raw(path, "");
  int errors = 0;
  while (true) {
    BufferStatus status;
    try {
      status = input.try_take_until(&b, RecordInput::Clock::now() + kHangBound);
    } catch (const RecordError& e) {
      ++errors;
      EXPECT_EQ(e.kind(), RecordErrorKind::kIo);
      EXPECT_EQ(e.path(), path);
      EXPECT_NE(
          std::string(e.what()).find("shrank while being read"),
          std::string::npos)
          << e.what();
      continue;
    }
    ASSERT_NE(status, BufferStatus::kTimeout);
    if (status == BufferStatus::kClosed) {
      break;
    }
  }
  EXPECT_EQ(errors, 1);
}

TEST(RecordInput, BadOptionsFailBeforeAnyThread) {
  TempDir dir;
  make_files(dir, 2, 1);
  auto expect_invalid = [&](auto mutate, const std::string& text) {
    auto opts = options(dir);
    mutate(opts);
    try {
      RecordInput input(opts);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const RecordError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos)
          << e.what();
    }
  };
  expect_invalid(
      [](auto& o) { o.parallelism = 0; }, "parallelism must be >= 1, got 0");
  expect_invalid(
      [](auto& o) { o.buffer_size = -3; }, "buffer_size must be >= 1, got -3");
  expect_invalid(
      [](auto& o) { o.batch_size = 0; }, "batch_size must be >= 1, got 0");
  expect_invalid(
      [](auto& o) { o.shift_ratio = 1.0; }, "shift_ratio must be in [0, 1)");
  expect_invalid([](auto& o) { o.epochs = 0; }, "epochs must be >= 1");
  expect_invalid(
      [](auto& o) {
        o.shard_rank = 2;
        o.shard_world = 2;
      },
      "shard must be");
  expect_invalid(
      [](auto& o) {
        o.shard_rank = 2;
        o.shard_world = 3;
      },
      "gets no file");
  expect_invalid(
      [&](auto& o) { o.file_patterns = {dir.file("*.nothing")}; },
      "no file matches");
}

TEST(RecordInput, CloseWakesBlockedTakersAndJoinsBusyReaders) {
  TempDir dir;
  make_files(dir, 3, 2000);
  for (int scenario = 0; scenario < 3; ++scenario) {
    auto opts = options(dir);
    opts.epochs = -1;
    opts.buffer_size = 1000;
    RecordInput input(opts);
    std::thread taker;
    std::atomic<int> result{-1};
    if (scenario == 0) {
      // Readers and mixer blocked on full queues: nobody takes.
      input.start();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } else {
      taker = std::thread([&] {
        RecordBatch b;
        try {
          BufferStatus s;
          do {
            s = input.take(&b); // scenario 2 takes until close
          } while (scenario == 2 && s == BufferStatus::kOk);
          result = static_cast<int>(s);
        } catch (...) {
          result = 100;
        }
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const auto t0 = std::chrono::steady_clock::now();
    input.close();
    if (taker.joinable()) {
      taker.join();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, kHangBound);
    if (scenario == 2) {
      EXPECT_EQ(result.load(), static_cast<int>(BufferStatus::kCancelled));
    }
    RecordBatch b;
    EXPECT_EQ(input.take(&b), BufferStatus::kCancelled);
    input.close(); // idempotent
    EXPECT_TRUE(input.stats().closed);
  }
}

TEST(RecordInput, ConcurrentTakersShareTheBatchesExactlyOnce) {
  TempDir dir;
  make_files(dir, 4, 250);
  auto opts = options(dir);
  opts.batch_size = 7;
  RecordInput input(opts);
  std::vector<std::vector<std::string>> per(3);
  std::vector<std::thread> ts;
  for (int k = 0; k < 3; ++k) {
    ts.emplace_back([&, k] {
      while (true) {
        RecordBatch b;
        if (input.try_take_until(&b, RecordInput::Clock::now() + kHangBound) !=
            BufferStatus::kOk) {
          return;
        }
        for (auto& r : split(b)) {
          per[k].push_back(r);
        }
      }
    });
  }
  for (auto& t : ts) {
    t.join();
  }
  std::set<std::string> all;
  size_t total = 0;
  for (auto& v : per) {
    total += v.size();
    all.insert(v.begin(), v.end());
  }
  EXPECT_EQ(total, 1000u);
  EXPECT_EQ(all.size(), 1000u);
}

TEST(RecordInput, DestructionWithoutCloseJoins) {
  TempDir dir;
  make_files(dir, 2, 500);
  auto opts = options(dir);
  opts.epochs = -1;
  for (int i = 0; i < 5; ++i) {
    RecordInput input(opts);
    RecordBatch b;
    ASSERT_EQ(
        input.try_take_until(&b, RecordInput::Clock::now() + kHangBound),
        BufferStatus::kOk);
  } // the destructor stops and joins the running threads
}

} // namespace
} // namespace torch_stage::records
