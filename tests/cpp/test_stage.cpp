// Tests of the Stage runtime (csrc/staging/stage.h) with C++ work, and of
// the device stager's fusion and host-buffer reuse (run on the CPU with
// fuse_on_cpu, so CI exercises it without a GPU).
#include "staging/stage.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
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
    if (index >= n_) {
      return Outcome::kEnd;
    }
    if (index == fail_at) {
      item.error = std::make_shared<ItemError>(ItemError{"bad item", nullptr});
      return Outcome::kError;
    }
    item.tensors = {at::full({1}, index, at::kLong)};
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
    return Outcome::kItem;
  }

  Outcome expose_tensors(StageItem&) override {
    return Outcome::kItem;
  }

  std::atomic<int64_t> pulls{0};
  int64_t fail_at = -1;
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

std::vector<int64_t> drain(Stage& stage) {
  std::vector<int64_t> out;
  StageItem item;
  while (stage.take(item) == TakeStatus::kItem) {
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
  stage->close();
  EXPECT_NE(warning.find("still inside user code"), std::string::npos)
      << warning;
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
}

TEST(DeviceStager, RejectsStreamsOutsideThePool) {
  EXPECT_THROW(
      DeviceStager(c10::Device(c10::kCPU), kMaxStreams), c10::ValueError);
  EXPECT_THROW(DeviceStager(c10::Device(c10::kCPU), -1), c10::ValueError);
}

} // namespace
} // namespace torch_stage
