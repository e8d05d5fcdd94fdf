// Tests of the Stage runtime (csrc/staging/stage.h) with C++ work, and of
// the device stager's fusion and host-buffer reuse (run on the CPU with
// fuse_on_cpu, so CI exercises it without a GPU).
#include "staging/stage.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <gtest/gtest.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "staging/device_stager.h"

namespace torch_stage {
namespace {

using namespace std::chrono_literals;

// Items 0..n-1 as one-element tensors; `fail_at` raises, `skip` skips,
// `jitter` makes processing finish out of order.
class CountingWork : public StageWork {
 public:
  explicit CountingWork(int64_t n) : n_(n) {}

  Outcome pull(int64_t index, StageItem& item) override {
    ++pulls;
    if (std::this_thread::get_id() == consumer) {
      ++consumer_pulls;
      if (index >= n_) {
        ++consumer_end_pulls;
      } else if (index % 10 == 3 && skip_threes) {
        ++consumer_skipped_pulls; // its process skips it, on this thread
      }
    }
    if (sleep_us > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    }
    if (index >= n_) {
      return Outcome::kEnd;
    }
    if (index == fail_at) {
      item.error = std::make_shared<ItemError>(ItemError{"bad item", nullptr});
      return Outcome::kError;
    }
    item.tensors = {at::full({1}, index, at::kLong)};
    if (index == meta_at) { // no data: its copy to a device fails
      item.tensors[0] = item.tensors[0].to(at::kMeta);
    }
    return Outcome::kItem;
  }

  Outcome process(StageItem& item) override {
    if (jitter) {
      thread_local std::mt19937 rng(std::random_device{}());
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    }
    if (item.index % 10 == 3 && skip_threes) {
      return Outcome::kSkip;
    }
    if (block_forever) {
      std::this_thread::sleep_for(std::chrono::hours(1));
    }
    if (process_sleep_us > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(process_sleep_us));
    }
    return Outcome::kItem;
  }

  Outcome expose_tensors(StageItem&) override {
    return Outcome::kItem;
  }

  std::atomic<int64_t> pulls{0};
  std::atomic<int64_t> consumer_pulls{0}; // pulls made on `consumer`
  // Of those, pulls past the end and of positions process skips.
  std::atomic<int64_t> consumer_end_pulls{0};
  std::atomic<int64_t> consumer_skipped_pulls{0};
  std::thread::id consumer = std::this_thread::get_id();
  int64_t sleep_us = 0;
  int64_t process_sleep_us = 0;
  int64_t fail_at = -1;
  int64_t meta_at = -1;
  bool skip_threes = false;
  bool jitter = false;
  bool block_forever = false;

 private:
  const int64_t n_;
};

StageOptions options(int64_t capacity, int64_t threads, bool ordered = true) {
  StageOptions o;
  o.name = "test";
  o.capacity = capacity;
  o.num_threads = threads;
  o.ordered = ordered;
  o.timeout_ms = 30000;
  return o;
}

// `step`: the consumer's own work per item (a training step), which a
// producer thread can overlap.
std::vector<int64_t> drain(
    Stage& stage,
    std::chrono::microseconds step = std::chrono::microseconds(0)) {
  std::vector<int64_t> out;
  StageItem item;
  while (stage.take(item) == TakeStatus::kItem) {
    if (step.count() > 0) {
      std::this_thread::sleep_for(step);
    }
    if (item.error) {
      out.push_back(-1);
      continue;
    }
    out.push_back(item.tensors.at(0).item<int64_t>());
  }
  return out;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) {
    v[i] = i;
  }
  return v;
}

TEST(Stage, RejectsBadOptionsBeforeStarting) {
  auto work = std::make_shared<CountingWork>(3);
  EXPECT_THROW(Stage(options(0, 1), work), c10::ValueError);
  EXPECT_THROW(Stage(options(1, 0), work), c10::ValueError);
  EXPECT_THROW(Stage(options(1, 1025), work), c10::ValueError);
  auto o = options(1, 1);
  o.pool_id = 999;
  EXPECT_THROW(Stage(o, work), c10::ValueError);
  EXPECT_EQ(work->pulls.load(), 0);
}

TEST(Stage, DeliversInSourceOrderWithManyThreads) {
  auto work = std::make_shared<CountingWork>(500);
  work->jitter = true;
  Stage stage(options(3, 4), work);
  EXPECT_EQ(drain(stage), iota(500));
  const auto s = stage.stats();
  EXPECT_EQ(s.produced, 500);
  EXPECT_EQ(s.consumed, 500);
  EXPECT_TRUE(s.finished);
}

TEST(Stage, UnorderedDeliversEveryItemOnce) {
  auto work = std::make_shared<CountingWork>(500);
  work->jitter = true;
  Stage stage(options(3, 4, /*ordered=*/false), work);
  auto out = drain(stage);
  std::sort(out.begin(), out.end());
  EXPECT_EQ(out, iota(500));
}

TEST(Stage, SkipsAreCountedAndNotDelivered) {
  auto work = std::make_shared<CountingWork>(30);
  work->skip_threes = true;
  Stage stage(options(2, 2), work);
  EXPECT_EQ(drain(stage).size(), 27u);
  EXPECT_EQ(stage.stats().skipped, 3);
}

TEST(Stage, AnErrorArrivesAtItsPositionAfterTheItemsBefore) {
  auto work = std::make_shared<CountingWork>(100);
  work->fail_at = 40;
  work->jitter = true;
  Stage stage(options(2, 4), work);
  auto out = drain(stage);
  auto expected = iota(40);
  expected.push_back(-1); // the error item
  EXPECT_EQ(out, expected);
  EXPECT_TRUE(stage.failed());
  EXPECT_EQ(stage.stats().errors, 1);
}

TEST(Stage, AFailedCopyEndsTheStageUnlessItemErrorsIsSet) {
  for (const bool item_errors : {false, true}) {
    auto work = std::make_shared<CountingWork>(60);
    work->meta_at = 25;
    work->jitter = true;
    auto o = options(2, 4);
    o.device = c10::Device(c10::kCPU);
    o.item_errors = item_errors;
    Stage stage(o, work);
    auto expected = iota(item_errors ? 60 : 26);
    expected[25] = -1; // the error item
    EXPECT_EQ(drain(stage), expected) << "item_errors=" << item_errors;
    EXPECT_EQ(stage.failed(), !item_errors);
    EXPECT_EQ(stage.stats().errors, 1);
  }
}

TEST(Stage, CloseWakesConsumersAndJoinsProducers) {
  auto work = std::make_shared<CountingWork>(1'000'000);
  Stage stage(options(2, 3), work);
  StageItem item;
  ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  auto consumer = std::async(std::launch::async, [&] {
    StageItem it;
    TakeStatus st;
    while ((st = stage.take(it)) == TakeStatus::kItem) {
    }
    return st;
  });
  std::this_thread::sleep_for(20ms);
  stage.close();
  ASSERT_EQ(consumer.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(consumer.get(), TakeStatus::kClosed);
  EXPECT_TRUE(stage.closed());
}

TEST(Stage, TimeoutDescribesTheProducers) {
  auto work = std::make_shared<CountingWork>(10);
  work->block_forever = true;
  auto o = options(1, 1);
  o.join_timeout = 50ms; // the producer never returns: leave it
  auto stage = std::make_unique<Stage>(o, work);
  StageItem item;
  EXPECT_EQ(stage->take_for(item, 50ms), TakeStatus::kTimeout);
  const std::string message = stage->timeout_message(50ms);
  EXPECT_NE(
      message.find("stage 'test' delivered no item for 50 ms"),
      std::string::npos)
      << message;
  EXPECT_NE(
      message.find("producer 0: running the stage work (transform) (item 0)"),
      std::string::npos)
      << message;
  std::string warning;
  stage->set_warning_handler([&](const std::string& w) { warning = w; });
  // A consumer that waited while another was served is told so.
  EXPECT_NE(
      stage->timeout_message(50ms, 0).find("stage 'test' delivered no item"),
      std::string::npos);
  EXPECT_FALSE(stage->quiescent());
  stage->close();
  EXPECT_NE(warning.find("still inside user code"), std::string::npos)
      << warning;
  // The producer left behind still runs the work: what it holds must stay.
  EXPECT_FALSE(stage->quiescent());
}

TEST(Stage, AProducerLeftOnPurposeIsLeftQuietlyAndEndsAfterItsCall) {
  auto work = std::make_shared<CountingWork>(1000);
  work->process_sleep_us = 300000; // a slow read the consumer will not wait for
  auto stage = std::make_unique<Stage>(options(1, 1), work);
  std::string warning;
  stage->set_warning_handler([&](const std::string& w) { warning = w; });
  StageItem item;
  ASSERT_EQ(stage->take(item), TakeStatus::kItem);
  // The producer went on to the next item's 300 ms process(): close()
  // returns while it is still inside.
  std::this_thread::sleep_for(50ms); // for it to get there
  stage->close(0ms, /*warn_if_left=*/false);
  EXPECT_EQ(warning, "");
  EXPECT_FALSE(stage->quiescent());
  const int64_t pulls = work->pulls.load();
  for (int i = 0; i < 300 && !stage->quiescent(); ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(stage->quiescent());
  EXPECT_EQ(work->pulls.load(), pulls); // nothing pulled after the close
}

TEST(Stage, ATimedOutConsumerIsToldWhenOthersWereServed) {
  auto work = std::make_shared<CountingWork>(10);
  Stage stage(options(2, 1), work);
  const int64_t before = stage.consumed();
  StageItem item;
  ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  const std::string message = stage.timeout_message(50ms, before);
  EXPECT_NE(
      message.find("stage 'test' gave this consumer no item for 50 ms "
                   "(timeout_millis="),
      std::string::npos)
      << message;
  EXPECT_NE(
      message.find("while it delivered 2 to other consumers"),
      std::string::npos)
      << message;
  EXPECT_NE(message.find("Each item goes to one consumer"), std::string::npos);
}

TEST(Stage, QuiescentOnceClosedAndEveryProducerHasLeft) {
  auto work = std::make_shared<CountingWork>(1'000'000);
  Stage never_started(options(2, 3), work);
  EXPECT_FALSE(never_started.quiescent());
  never_started.close();
  EXPECT_TRUE(never_started.quiescent());

  Stage stage(options(2, 3), work);
  StageItem item;
  ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  EXPECT_FALSE(stage.quiescent());
  stage.close();
  EXPECT_TRUE(stage.quiescent());
}

std::string log_of(const Stage& stage) {
  std::string out;
  for (const auto& line : stage.tuning_log()) {
    out += line + "\n";
  }
  return out;
}

// Auto-tuning that changes its setting after every item (windows of one
// item, no minimum time), between no thread (the consumer produces) and 4.
StageOptions restless(int64_t threads, int64_t initial, bool ordered = true) {
  auto o = options(2, threads, ordered);
  o.auto_tune = true;
  o.min_threads = 0;
  o.initial_threads = initial;
  o.max_capacity = 6;
  o.tune_window_items = 1;
  o.tune_window_ns = 0;
  return o;
}

// Auto-tuning held at no thread (the consumer produces): a tuning window
// no test reaches, so the setting never changes.
StageOptions no_thread(int64_t threads) {
  auto o = options(2, threads);
  o.auto_tune = true;
  o.min_threads = 0;
  o.initial_threads = 0;
  o.max_capacity = 2;
  o.tune_window_ns = 60'000'000'000;
  return o;
}

TEST(Stage, AutoTunedDeliversInOrderWhileTheSettingChanges) {
  auto work = std::make_shared<CountingWork>(3000);
  work->jitter = true;
  work->skip_threes = true;
  Stage stage(restless(4, 0), work);
  // The consumer has a step of its own: with none, no thread can overlap
  // anything, the tuner rightly settles on producing inline and, its trials
  // refused, tries them ever more rarely (3 to 9 in 3000 items when this
  // test's drain had no step). With one, a move is always open (more
  // threads from none, fewer from any), at least every max_backoff windows.
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < 3000; ++i) {
    if (i % 10 != 3) {
      expected.push_back(i);
    }
  }
  EXPECT_EQ(drain(stage, std::chrono::microseconds(500)), expected)
      << stage.describe() << "\n"
      << log_of(stage);
  const auto s = stage.stats();
  EXPECT_EQ(s.consumed, 2700);
  EXPECT_EQ(s.skipped, 300);
  EXPECT_GT(s.tuning_trials, 10) << log_of(stage);
  EXPECT_GT(s.inline_items, 0); // some items came from the consumer
  EXPECT_LT(s.inline_items, 3000); // and some from producers
  // Items, not steps: the consumer's pulls also include the skipped
  // positions it met and perhaps the end. (How many skipped positions it
  // meets depends on where its turns begin, which the load decides: a
  // bound of one in ten failed 2 of 40 repeats beside four busy loops.)
  EXPECT_EQ(
      work->consumer_pulls.load(),
      s.inline_items + work->consumer_skipped_pulls.load() +
          work->consumer_end_pulls.load());
  EXPECT_LE(work->consumer_end_pulls.load(), 1);
  EXPECT_FALSE(stage.tuning_log().empty());
}

TEST(Stage, AutoTunedUnorderedDeliversEveryItemOnce) {
  auto work = std::make_shared<CountingWork>(2000);
  work->jitter = true;
  Stage stage(restless(3, 2, /*ordered=*/false), work);
  auto out = drain(stage);
  std::sort(out.begin(), out.end());
  EXPECT_EQ(out, iota(2000));
}

TEST(Stage, AutoTunedErrorArrivesAtItsPositionWhoeverProducedIt) {
  for (int64_t initial : {0, 1, 3}) {
    auto work = std::make_shared<CountingWork>(400);
    work->fail_at = 150;
    work->jitter = true;
    Stage stage(restless(3, initial), work);
    auto expected = iota(150);
    expected.push_back(-1);
    EXPECT_EQ(drain(stage), expected) << "initial threads " << initial;
    EXPECT_TRUE(stage.failed());
  }
}

// Threads of this process whose kernel name begins with `prefix`.
int64_t threads_named(const std::string& prefix) {
  int64_t n = 0;
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    if (std::getline(comm, name) && name.rfind(prefix, 0) == 0) {
      ++n;
    }
  }
  return n;
}

TEST(Stage, WithNoThreadTheConsumerProducesAndNoProducerStarts) {
  auto work = std::make_shared<CountingWork>(50);
  auto o = no_thread(3);
  o.name = "idle";
  Stage stage(o, work);
  StageItem item;
  ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  EXPECT_TRUE(stage.started());
  EXPECT_EQ(threads_named("ts:idle:"), 0);
  EXPECT_NE(stage.describe().find("producer 2: not started"), std::string::npos)
      << stage.describe();
  auto rest = drain(stage);
  EXPECT_EQ(rest.size(), 49u);
  EXPECT_EQ(work->consumer_pulls.load(), 51); // the end too
  EXPECT_EQ(stage.stats().inline_items, 50); // items, not the end
  EXPECT_EQ(stage.stats().threads, 0);
  EXPECT_TRUE(stage.stats().finished); // the consumer ended the stream
  stage.close();
  EXPECT_TRUE(stage.quiescent());
}

TEST(Stage, AProducerThreadStartsWhenTheTunerFirstLetsItWork) {
  auto work = std::make_shared<CountingWork>(200000);
  work->sleep_us = 100;
  auto o = restless(2, 0);
  o.name = "late";
  Stage stage(o, work);
  StageItem item;
  ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  int64_t most = threads_named("ts:late:");
  EXPECT_EQ(most, 0);
  // Windows of one item: the tuner tries a thread within a few items.
  for (int i = 0; i < 2000 && most < 2; ++i) {
    ASSERT_EQ(stage.take(item), TakeStatus::kItem);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    most = std::max(most, threads_named("ts:late:"));
  }
  EXPECT_GE(most, 1) << log_of(stage);
  EXPECT_LE(most, 2);
  stage.close();
  EXPECT_TRUE(stage.quiescent());
  EXPECT_EQ(threads_named("ts:late:"), 0);
}

TEST(Stage, AThreadRefusedWhenTheTunerAddsItLeavesTheTunerFewer) {
  auto work = std::make_shared<CountingWork>(3000);
  work->jitter = true;
  auto o = restless(4, 0);
  o.refuse_threads_from = 1;
  Stage stage(o, work);
  std::vector<std::string> warnings;
  std::mutex mu;
  stage.set_warning_handler([&](const std::string& w) {
    std::lock_guard<std::mutex> lock(mu);
    warnings.push_back(w);
  });
  // Every item arrives, in order, whoever made it.
  EXPECT_EQ(drain(stage, std::chrono::microseconds(500)), iota(3000))
      << log_of(stage);
  ASSERT_FALSE(warnings.empty()) << log_of(stage);
  EXPECT_NE(
      warnings[0].find("the system refused producer thread 1"),
      std::string::npos)
      << warnings[0];
  EXPECT_NE(
      warnings[0].find("auto-tuning goes on with at most 1 thread(s)"),
      std::string::npos)
      << warnings[0];
  EXPECT_EQ(warnings.size(), 1u); // the bound holds: no second refusal
  EXPECT_LE(stage.stats().threads, 1);
}

TEST(Stage, AThreadRefusedAtStartIsAnErrorAndTheStageCloses) {
  auto work = std::make_shared<CountingWork>(100);
  auto o = options(2, 3);
  o.refuse_threads_from = 1;
  Stage stage(o, work);
  StageItem item;
  try {
    stage.take(item);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "refused to start producer thread 1 of num_threads=3"),
        std::string::npos)
        << e.what();
  }
  EXPECT_EQ(stage.take(item), TakeStatus::kClosed);
  const auto start = std::chrono::steady_clock::now();
  stage.close();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_TRUE(stage.quiescent());
}

TEST(Stage, AConsumerMakesItsOwnItemsOnlyWhereNoThreadMayWork) {
  auto work = std::make_shared<CountingWork>(1000);
  Stage stage(no_thread(3), work);
  StageItem item;
  ASSERT_EQ(stage.take(item), TakeStatus::kItem); // position 0, inline
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(stage.begin_own_item());
    EXPECT_FALSE(stage.begin_own_item()); // one owner at a time
    stage.end_own_item(/*made=*/i % 2 == 0);
  }
  auto s = stage.stats();
  EXPECT_EQ(s.consumed, 11);
  EXPECT_EQ(s.produced, 11);
  EXPECT_EQ(s.inline_items, 11);
  EXPECT_EQ(work->pulls.load(), 1); // own items are not the stage's positions
  ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  EXPECT_EQ(item.tensors.at(0).item<int64_t>(), 1);

  // With a producer allowed to work, never.
  auto busy = std::make_shared<CountingWork>(1000);
  Stage threaded(restless(2, 2), busy);
  ASSERT_EQ(threaded.take(item), TakeStatus::kItem);
  EXPECT_FALSE(threaded.stats().threads == 2 && threaded.begin_own_item());
}

// While a consumer makes its own item, no producer pulls, whatever the tuner
// lets them do meanwhile; every position still arrives once, in order.
TEST(Stage, NoProducerPullsWhileAConsumerMakesItsOwnItem) {
  class Watched : public CountingWork {
   public:
    using CountingWork::CountingWork;
    Outcome pull(int64_t index, StageItem& item) override {
      if (owned.load()) {
        ++overlaps;
      }
      return CountingWork::pull(index, item);
    }
    std::atomic<bool> owned{false};
    std::atomic<int64_t> overlaps{0};
  };
  auto work = std::make_shared<Watched>(600);
  work->jitter = true;
  Stage stage(restless(3, 0), work); // a new setting after every item
  std::vector<int64_t> positions;
  int64_t own = 0;
  StageItem item;
  while (true) {
    if (stage.begin_own_item()) {
      work->owned.store(true);
      std::this_thread::sleep_for(200us);
      work->owned.store(false);
      stage.end_own_item(true);
      ++own;
      continue;
    }
    const auto status = stage.take(item);
    if (status != TakeStatus::kItem) {
      ASSERT_EQ(status, TakeStatus::kEnd);
      break;
    }
    positions.push_back(item.tensors.at(0).item<int64_t>());
  }
  EXPECT_EQ(positions, iota(600));
  EXPECT_EQ(work->overlaps.load(), 0);
  EXPECT_GT(own, 0) << log_of(stage);
  EXPECT_EQ(stage.stats().consumed, 600 + own);
}

TEST(Stage, CloseWhileAConsumerMakesItsOwnItemReturnsAtOnce) {
  auto work = std::make_shared<CountingWork>(1'000'000);
  Stage stage(no_thread(4), work);
  StageItem item;
  ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  ASSERT_TRUE(stage.begin_own_item());
  const auto start = std::chrono::steady_clock::now();
  stage.close(30s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  stage.end_own_item(true);
  EXPECT_FALSE(stage.begin_own_item());
  EXPECT_EQ(stage.take(item), TakeStatus::kClosed);
}

TEST(Stage, CloseReleasesParkedProducersAtOnce) {
  auto work = std::make_shared<CountingWork>(1'000'000);
  auto o = no_thread(4);
  o.initial_threads = 4; // started, then parked by the limit
  Stage stage(o, work);
  StageItem item;
  ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  stage.limit_threads(0, "parked by the test");
  // Each producer finishes the item it holds (the buffer holds two) and
  // parks (or parks as soon as it runs: it may not have yet).
  for (int i = 0; i < 6; ++i) {
    ASSERT_EQ(stage.take(item), TakeStatus::kItem);
  }
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (stage.describe().find("producer 3: parked") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_NE(stage.describe().find("producer 3: parked"), std::string::npos)
      << stage.describe();
  const auto start = std::chrono::steady_clock::now();
  stage.close(30s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_EQ(stage.take(item), TakeStatus::kClosed);
}

TEST(Stage, AutoTuningAddsThreadsForASlowSource) {
  // Each item sleeps 3 ms in the transform (no CPU: any machine load leaves
  // the sleep as it is); the consumer does nothing. One thread gives ~330
  // items/s, more threads proportionally more: the tuner must find that.
  auto work = std::make_shared<CountingWork>(600);
  work->process_sleep_us = 3000;
  auto o = options(2, 4);
  o.auto_tune = true;
  o.min_threads = 1;
  o.initial_threads = 1;
  o.max_capacity = 8;
  o.tune_window_ns = 20'000'000;
  Stage stage(o, work);
  EXPECT_EQ(drain(stage), iota(600));
  EXPECT_GE(stage.stats().threads, 3);
  bool kept = false;
  for (const auto& line : stage.tuning_log()) {
    kept = kept || line.find("kept") != std::string::npos;
  }
  EXPECT_TRUE(kept);
}

TEST(Stage, AutoTuningRejectsBadBounds) {
  auto work = std::make_shared<CountingWork>(3);
  auto o = options(2, 2);
  o.auto_tune = true;
  o.min_threads = 3; // above num_threads
  EXPECT_THROW(Stage(o, work), c10::ValueError);
  o.min_threads = 0;
  o.initial_threads = 0;
  o.max_capacity = 1; // below capacity
  EXPECT_THROW(Stage(o, work), c10::ValueError);
  EXPECT_EQ(work->pulls.load(), 0);
}

TEST(Stage, PoolsBoundConcurrentWork) {
  const int64_t pool = StagePools::add(1, 1, "cpp_pool_test");
  class Tracking : public CountingWork {
   public:
    using CountingWork::CountingWork;
    Outcome process(StageItem& item) override {
      const int now = ++active;
      int seen = peak.load();
      while (now > seen && !peak.compare_exchange_weak(seen, now)) {
      }
      std::this_thread::sleep_for(1ms);
      --active;
      return Outcome::kItem;
    }
    std::atomic<int> active{0}, peak{0};
  };
  auto work = std::make_shared<Tracking>(40);
  auto o = options(4, 4);
  o.pool_id = pool;
  Stage stage(o, work);
  EXPECT_EQ(drain(stage), iota(40));
  EXPECT_EQ(work->peak.load(), 1);
}

TEST(DeviceStager, FusedLayoutAlignsEveryTensor) {
  const TensorBundle tensors = {
      at::ones({3}, at::kByte),
      at::ones({5}, at::kDouble),
      at::ones({2, 2}, at::kFloat)};
  const auto layout = plan_fused_layout(tensors, c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(layout.offsets, (std::vector<int64_t>{0, 64, 128}));
  EXPECT_EQ(layout.total_bytes, 128 + 16);
  // Nothing fuses when the target is where the tensors already are.
  const auto none = plan_fused_layout(tensors, c10::Device(c10::kCPU));
  EXPECT_EQ(none.offsets, (std::vector<int64_t>{-1, -1, -1}));
}

TEST(DeviceStager, FusesIntoOneBufferAndReusesHostBuffers) {
  DeviceStager stager(c10::Device(c10::kCPU), 0, /*fuse_on_cpu=*/true);
  for (int i = 0; i < 20; ++i) {
    StageItem item;
    const at::Tensor a =
        at::arange(12, at::kFloat).reshape({3, 4}).t(); // strided
    const at::Tensor b = at::full({7}, i, at::kLong);
    item.tensors = {a, b};
    stager.stage(item);
    ASSERT_TRUE(at::equal(item.tensors[0], a));
    ASSERT_TRUE(at::equal(item.tensors[1], b));
    EXPECT_TRUE(item.tensors[0].is_contiguous());
    // Both now live in the one fused buffer.
    EXPECT_EQ(
        item.tensors[0].storage().unsafeGetStorageImpl(),
        item.device_storage.storage().unsafeGetStorageImpl());
    EXPECT_EQ(
        item.tensors[1].storage().unsafeGetStorageImpl(),
        item.device_storage.storage().unsafeGetStorageImpl());
  }
  const auto s = stager.stats();
  EXPECT_EQ(s.items, 20);
  EXPECT_EQ(s.fused_tensors, 40);
  EXPECT_EQ(s.host_buffers_allocated, 1);
  EXPECT_EQ(s.host_buffer_reuses, 19);
  EXPECT_EQ(s.host_buffer_waits, 0); // a CPU copy is done when it returns
}

// Faults injected into aten ops: c10's testing-only dispatch key, switched
// on for one thread by a guard, runs this fallback in front of every op; it
// throws for the op named (as a copy out of a tensor that cannot be read,
// or an allocation of exhausted memory, does) and runs the others.
std::string injected_fault; // "aten::copy_", "aten::empty", ...

void inject_faults(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  TORCH_CHECK(
      op.schema().name() != injected_fault, "injected fault: ", injected_fault);
  c10::impl::ExcludeDispatchKeyGuard next(
      c10::DispatchKey::TESTING_ONLY_GenericMode);
  op.callBoxed(stack);
}

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&inject_faults>());
}

TEST(DeviceStager, AGatherOrAllocationThatThrowsLosesNoHostBuffer) {
  DeviceStager stager(c10::Device(c10::kCPU), 0, /*fuse_on_cpu=*/true);
  const at::Tensor source = at::arange(1000, at::kFloat);
  auto stage_one = [&](const std::string& fault) {
    StageItem item;
    item.tensors = {source};
    if (fault.empty()) {
      stager.stage(item);
      return;
    }
    injected_fault = fault;
    c10::impl::IncludeDispatchKeyGuard failing(
        c10::DispatchKey::TESTING_ONLY_GenericMode);
    EXPECT_THROW(stager.stage(item), c10::Error);
    // The item is as it was: its tensor not replaced by a view of a buffer
    // half written.
    EXPECT_TRUE(item.tensors[0].is_same(source));
    EXPECT_FALSE(item.device_storage.defined());
  };
  // The first buffer's allocation fails: none is counted as made.
  stage_one("aten::empty");
  EXPECT_EQ(stager.stats().host_buffers_allocated, 0);
  stage_one("");
  for (int i = 0; i < 5; ++i) {
    stage_one("aten::copy_");
  }
  stage_one("");
  const auto s = stager.stats();
  EXPECT_EQ(s.items, 2);
  // The one buffer went back to the free list after each failed gather:
  // nothing more was made, and none was lost while still counted (which
  // made later gathers wait for copies as if all of them existed).
  EXPECT_EQ(s.host_buffers_allocated, 1);
  EXPECT_EQ(s.host_buffer_reuses, 6);
}

TEST(DeviceStager, AGatherTakesAnotherBufferWhileTheCopyBeforeRuns) {
  using torch_stage::choose_host_buffer;
  using torch_stage::FreeHostBuffer;
  // One producer: the only buffer is still copied from, so a second is made
  // (the gather overlaps the copy) ...
  auto c = choose_host_buffer({{100, true}}, 80, 1, 1);
  EXPECT_EQ(c.index, -1);
  // ... and with two made, the gather waits for the oldest busy one.
  c = choose_host_buffer({{100, true}, {100, true}}, 80, 2, 1);
  EXPECT_EQ(c.index, 0);
  EXPECT_TRUE(c.wait);
  // A buffer whose copy is done is taken first, the smallest that fits,
  // before any busy one and without making another.
  c = choose_host_buffer(
      {{100, true}, {300, false}, {50, false}, {200, false}}, 80, 4, 1);
  EXPECT_EQ(c.index, 3);
  EXPECT_FALSE(c.wait);
  // Three producers may hold four buffers before one waits.
  c = choose_host_buffer({{100, true}, {100, true}}, 80, 3, 3);
  EXPECT_EQ(c.index, -1);
  c = choose_host_buffer({{100, true}}, 80, 4, 3);
  EXPECT_EQ(c.index, 0);
  EXPECT_TRUE(c.wait);
  // Nothing large enough: a new one, whatever the count (no producer may
  // wait for a buffer it cannot use).
  c = choose_host_buffer({{10, true}, {20, false}}, 80, 9, 1);
  EXPECT_EQ(c.index, -1);
  c = choose_host_buffer({}, 80, 0, 0);
  EXPECT_EQ(c.index, -1);
}

TEST(DeviceStager, RejectsStreamsOutsideThePool) {
  EXPECT_THROW(
      DeviceStager(c10::Device(c10::kCPU), kMaxStreams), c10::ValueError);
  EXPECT_THROW(DeviceStager(c10::Device(c10::kCPU), -1), c10::ValueError);
}

} // namespace
} // namespace torch_stage
