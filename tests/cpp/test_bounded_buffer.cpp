// Tests of BoundedBuffer (csrc/staging/bounded_buffer.h): plain C++, also run
// under ThreadSanitizer and AddressSanitizer by `make tsan` / `make asan`.
#include "staging/bounded_buffer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace torch_stage {
namespace {

using namespace std::chrono_literals;

// Generous bound against hangs: every blocking call in these tests is
// expected to return long before this.
constexpr auto kHangBound = 30s;

// Runs `fn` on a thread and returns a future; tests wait on it with a bound so
// that a wake-up bug fails the test instead of hanging the suite.
template <typename Fn>
auto async(Fn fn) {
  return std::async(std::launch::async, std::move(fn));
}

template <typename Future>
bool finishes(Future& f, std::chrono::milliseconds bound = kHangBound) {
  return f.wait_for(bound) == std::future_status::ready;
}

// Waits until `pred` holds (another thread reaching a blocking call).
template <typename Pred>
void eventually(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + kHangBound;
  while (!pred()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline)
        << "condition never held";
    std::this_thread::sleep_for(1ms);
  }
}

struct StringBytes {
  std::size_t operator()(const std::string& s) const {
    return s.size();
  }
};

TEST(BoundedBuffer, RejectsZeroCapacityNamingTheValue) {
  try {
    BoundedBuffer<int> buffer(0);
    FAIL() << "capacity 0 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(
        std::string(e.what()).find("capacity must be >= 1, got 0"),
        std::string::npos)
        << e.what();
  }
}

TEST(BoundedBuffer, GrowingCapacityWakesBlockedProducersShrinkingKeepsItems) {
  BoundedBuffer<int> buffer(1);
  ASSERT_EQ(buffer.put(0), BufferStatus::kOk);
  auto first = async([&] { return buffer.put(1); });
  auto second = async([&] { return buffer.put(2); });
  EXPECT_FALSE(finishes(first, 50ms)); // full: both wait for room
  EXPECT_FALSE(finishes(second, 1ms));
  buffer.set_capacity(3); // room for both blocked producers
  ASSERT_TRUE(finishes(first));
  ASSERT_TRUE(finishes(second));
  EXPECT_EQ(first.get(), BufferStatus::kOk);
  EXPECT_EQ(second.get(), BufferStatus::kOk);
  EXPECT_EQ(buffer.size(), 3u);
  buffer.set_capacity(1); // below what is held: nothing is lost...
  EXPECT_EQ(buffer.size(), 3u);
  int item = -1;
  EXPECT_EQ(
      buffer.try_put_for(item, 0ms), BufferStatus::kTimeout); // ...no room
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(buffer.take(item), BufferStatus::kOk);
  }
  EXPECT_EQ(buffer.try_put_for(item, 0ms), BufferStatus::kOk);
  EXPECT_THROW(buffer.set_capacity(0), std::invalid_argument);
}

TEST(BoundedBuffer, DeliversInFifoOrder) {
  BoundedBuffer<int> buffer(4);
  EXPECT_EQ(buffer.capacity(), 4u);
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(buffer.put(int(i)), BufferStatus::kOk);
  }
  EXPECT_EQ(buffer.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    int out = -1;
    ASSERT_EQ(buffer.take(out), BufferStatus::kOk);
    EXPECT_EQ(out, i);
  }
  EXPECT_EQ(buffer.size(), 0u);
}

TEST(BoundedBuffer, MovesMoveOnlyItems) {
  BoundedBuffer<std::unique_ptr<int>> buffer(1);
  auto item = std::make_unique<int>(7);
  ASSERT_EQ(buffer.put(item), BufferStatus::kOk);
  EXPECT_EQ(item, nullptr);
  std::unique_ptr<int> out;
  ASSERT_EQ(buffer.take(out), BufferStatus::kOk);
  EXPECT_EQ(*out, 7);
}

TEST(BoundedBuffer, TryPutTimesOutWhenFullAndKeepsTheItem) {
  BoundedBuffer<std::unique_ptr<int>> buffer(1);
  ASSERT_EQ(buffer.put(std::make_unique<int>(1)), BufferStatus::kOk);
  auto item = std::make_unique<int>(2);
  EXPECT_EQ(buffer.try_put_for(item, 20ms), BufferStatus::kTimeout);
  ASSERT_NE(item, nullptr)
      << "a put that timed out must leave the item with the caller";
  EXPECT_EQ(*item, 2);
  EXPECT_EQ(buffer.try_put_for(item, 0ms), BufferStatus::kTimeout);
  EXPECT_EQ(buffer.try_put_for(item, -5ms), BufferStatus::kTimeout);
  const auto s = buffer.stats();
  EXPECT_EQ(s.put, 1u);
  // As for takes: the wait is measured after the deadline is fixed.
  EXPECT_GE(s.producer_blocked_ns, 19'000'000);
}

TEST(BoundedBuffer, TryTakeTimesOutWhenEmpty) {
  BoundedBuffer<int> buffer(2);
  int out = 0;
  EXPECT_EQ(buffer.try_take_for(out, 20ms), BufferStatus::kTimeout);
  EXPECT_EQ(buffer.try_take_for(out, 0ms), BufferStatus::kTimeout);
  // The deadline is fixed before the lock is taken and the wait measured, so
  // the measured wait may fall a few microseconds short of the timeout (it
  // did under ThreadSanitizer); a millisecond of slack covers that.
  EXPECT_GE(buffer.stats().consumer_wait_ns, 19'000'000);
}

TEST(BoundedBuffer, HugeTimeoutsDoNotOverflow) {
  BoundedBuffer<int> buffer(1);
  auto waiter = async([&] {
    int out = 0;
    return buffer.try_take_for(out, std::chrono::hours::max());
  });
  std::this_thread::sleep_for(20ms);
  ASSERT_EQ(buffer.put(5), BufferStatus::kOk);
  ASSERT_TRUE(finishes(waiter));
  EXPECT_EQ(waiter.get(), BufferStatus::kOk);
}

TEST(BoundedBuffer, BlockedPutResumesWhenSpaceFrees) {
  BoundedBuffer<int> buffer(1);
  ASSERT_EQ(buffer.put(1), BufferStatus::kOk);
  auto producer = async([&] { return buffer.put(2); });
  EXPECT_EQ(producer.wait_for(30ms), std::future_status::timeout)
      << "put on a full buffer returned";
  int out = 0;
  ASSERT_EQ(buffer.take(out), BufferStatus::kOk);
  EXPECT_EQ(out, 1);
  ASSERT_TRUE(finishes(producer));
  EXPECT_EQ(producer.get(), BufferStatus::kOk);
  ASSERT_EQ(buffer.take(out), BufferStatus::kOk);
  EXPECT_EQ(out, 2);
}

TEST(BoundedBuffer, CloseRefusesPutsAndDrainsBeforeEndOfStream) {
  BoundedBuffer<int> buffer(4);
  ASSERT_EQ(buffer.put(1), BufferStatus::kOk);
  ASSERT_EQ(buffer.put(2), BufferStatus::kOk);
  buffer.close();
  buffer.close(); // idempotent
  EXPECT_TRUE(buffer.is_closed());
  EXPECT_EQ(buffer.put(3), BufferStatus::kClosed);
  int out = 0;
  ASSERT_EQ(buffer.take(out), BufferStatus::kOk);
  EXPECT_EQ(out, 1);
  ASSERT_EQ(buffer.try_take_for(out, 10ms), BufferStatus::kOk);
  EXPECT_EQ(out, 2);
  EXPECT_EQ(buffer.take(out), BufferStatus::kClosed);
  EXPECT_EQ(buffer.try_take_for(out, 10ms), BufferStatus::kClosed);
}

TEST(BoundedBuffer, CloseWakesBlockedProducersAndConsumers) {
  BoundedBuffer<int> full(1);
  ASSERT_EQ(full.put(0), BufferStatus::kOk);
  BoundedBuffer<int> empty(1);
  std::vector<std::future<BufferStatus>> producers, consumers;
  for (int i = 0; i < 4; ++i) {
    producers.push_back(async([&] { return full.put(1); }));
    consumers.push_back(async([&] {
      int out = 0;
      return empty.take(out);
    }));
  }
  std::this_thread::sleep_for(20ms);
  full.close();
  empty.close();
  for (auto& f : producers) {
    ASSERT_TRUE(finishes(f));
    EXPECT_EQ(f.get(), BufferStatus::kClosed);
  }
  for (auto& f : consumers) {
    ASSERT_TRUE(finishes(f));
    EXPECT_EQ(f.get(), BufferStatus::kClosed);
  }
  // The item put before close is still delivered.
  int out = -1;
  EXPECT_EQ(full.take(out), BufferStatus::kOk);
  EXPECT_EQ(out, 0);
}

TEST(BoundedBuffer, CancelWakesEveryWaiterAndDiscardsItems) {
  BoundedBuffer<int> full(2);
  ASSERT_EQ(full.put(1), BufferStatus::kOk);
  ASSERT_EQ(full.put(2), BufferStatus::kOk);
  BoundedBuffer<int> empty(1);
  std::vector<std::future<BufferStatus>> waiters;
  for (int i = 0; i < 4; ++i) {
    waiters.push_back(async([&] { return full.put(3); }));
    waiters.push_back(async([&] {
      int out = 0;
      return empty.try_take_for(out, std::chrono::hours(1));
    }));
  }
  std::this_thread::sleep_for(20ms);
  full.cancel();
  empty.cancel();
  for (auto& f : waiters) {
    ASSERT_TRUE(finishes(f));
    EXPECT_EQ(f.get(), BufferStatus::kCancelled);
  }
  EXPECT_TRUE(full.is_cancelled());
  EXPECT_EQ(full.size(), 0u);
  EXPECT_EQ(full.stats().dropped, 2u);
  int out = 0;
  EXPECT_EQ(full.take(out), BufferStatus::kCancelled);
  EXPECT_EQ(full.put(4), BufferStatus::kCancelled);
  full.cancel(); // idempotent, counts nothing twice
  EXPECT_EQ(full.stats().dropped, 2u);
}

TEST(BoundedBuffer, CancelWinsOverClose) {
  BoundedBuffer<int> buffer(2);
  ASSERT_EQ(buffer.put(1), BufferStatus::kOk);
  buffer.close();
  buffer.cancel();
  int out = 0;
  EXPECT_EQ(buffer.take(out), BufferStatus::kCancelled);
  EXPECT_EQ(buffer.put(1), BufferStatus::kCancelled);
}

TEST(BoundedBuffer, ByteLimitBlocksOnBytesAndRefusesOversizeItems) {
  BoundedBuffer<std::string, StringBytes> buffer(10, 8);
  EXPECT_EQ(buffer.byte_limit(), 8u);
  std::string big(9, 'x');
  EXPECT_EQ(buffer.put(big), BufferStatus::kTooLarge);
  EXPECT_EQ(big.size(), 9u) << "a refused item stays with the caller";
  ASSERT_EQ(buffer.put(std::string(5, 'a')), BufferStatus::kOk);
  std::string three(4, 'b');
  EXPECT_EQ(buffer.try_put_for(three, 10ms), BufferStatus::kTimeout)
      << "5 + 4 > 8 bytes";
  std::string small(3, 'c');
  ASSERT_EQ(buffer.try_put_for(small, 10ms), BufferStatus::kOk)
      << "5 + 3 <= 8 bytes";
  EXPECT_EQ(buffer.stats().bytes, 8u);
  // One take frees room for the blocked producer.
  auto producer = async([&] { return buffer.put(std::string(4, 'd')); });
  std::string out;
  ASSERT_EQ(buffer.take(out), BufferStatus::kOk);
  EXPECT_EQ(out, "aaaaa");
  ASSERT_TRUE(finishes(producer));
  EXPECT_EQ(producer.get(), BufferStatus::kOk);
  EXPECT_EQ(buffer.stats().bytes, 7u);
}

TEST(BoundedBuffer, ByteLimitWakesSeveralSmallProducers) {
  BoundedBuffer<std::string, StringBytes> buffer(10, 8);
  ASSERT_EQ(buffer.put(std::string(8, 'a')), BufferStatus::kOk);
  std::vector<std::future<BufferStatus>> producers;
  for (int i = 0; i < 4; ++i) {
    producers.push_back(async([&] { return buffer.put(std::string(2, 'b')); }));
  }
  std::this_thread::sleep_for(20ms);
  std::string out;
  ASSERT_EQ(buffer.take(out), BufferStatus::kOk);
  for (auto& f : producers) {
    ASSERT_TRUE(finishes(f));
    EXPECT_EQ(f.get(), BufferStatus::kOk);
  }
  EXPECT_EQ(buffer.size(), 4u);
}

TEST(BoundedBuffer, CountsOccupancyAndPeaks) {
  BoundedBuffer<int> buffer(8);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(buffer.put(int(i)), BufferStatus::kOk);
  }
  int out = 0;
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(buffer.take(out), BufferStatus::kOk);
  }
  const auto s = buffer.stats();
  EXPECT_EQ(s.capacity, 8u);
  EXPECT_EQ(s.put, 3u);
  EXPECT_EQ(s.taken, 3u);
  EXPECT_EQ(s.max_size, 3u);
  EXPECT_EQ(s.occupancy_sum, 3u + 2u + 1u);
  EXPECT_EQ(s.size, 0u);
  EXPECT_FALSE(s.closed);
  EXPECT_FALSE(s.cancelled);
}

// 8 producers and 4 consumers move over 10^6 items through buffers of random
// capacities. Every item must arrive exactly once, and each consumer must see
// each producer's items in the order they were put (the buffer is FIFO).
TEST(BoundedBufferStress, EightProducersFourConsumersDeliverEveryItemOnce) {
  constexpr int kProducers = 8;
  constexpr int kConsumers = 4;
  constexpr std::int64_t kPerProducer = 31'250; // 250'000 items a round
  constexpr int kRounds = 4;
  std::mt19937 rng(20261122);
  std::uniform_int_distribution<std::size_t> capacity_dist(1, 64);
  std::int64_t total_moved = 0;

  for (int round = 0; round < kRounds; ++round) {
    const std::size_t capacity = round == 0 ? 1 : capacity_dist(rng);
    SCOPED_TRACE("capacity " + std::to_string(capacity));
    BoundedBuffer<std::int64_t> buffer(capacity);
    const std::int64_t total = kPerProducer * kProducers;
    std::vector<std::atomic<std::uint8_t>> seen(
        static_cast<std::size_t>(total));
    for (auto& s : seen) {
      s.store(0, std::memory_order_relaxed);
    }
    std::atomic<std::int64_t> sum{0}, count{0}, order_violations{0};

    std::vector<std::thread> producers;
    for (int p = 0; p < kProducers; ++p) {
      producers.emplace_back([&, p] {
        for (std::int64_t i = 0; i < kPerProducer; ++i) {
          // Item id encodes (producer, sequence number).
          const std::int64_t id = p * kPerProducer + i;
          if (buffer.put(std::int64_t(id)) != BufferStatus::kOk) {
            return;
          }
        }
      });
    }
    std::vector<std::thread> consumers;
    for (int c = 0; c < kConsumers; ++c) {
      consumers.emplace_back([&] {
        std::vector<std::int64_t> last(kProducers, -1);
        std::int64_t local_sum = 0, local_count = 0;
        std::int64_t id = 0;
        while (buffer.take(id) == BufferStatus::kOk) {
          seen[static_cast<std::size_t>(id)].fetch_add(
              1, std::memory_order_relaxed);
          const auto p = static_cast<std::size_t>(id / kPerProducer);
          if (id <= last[p]) {
            order_violations.fetch_add(1);
          }
          last[p] = id;
          local_sum += id;
          ++local_count;
        }
        sum += local_sum;
        count += local_count;
      });
    }
    for (auto& t : producers) {
      t.join();
    }
    buffer.close();
    for (auto& t : consumers) {
      t.join();
    }

    EXPECT_EQ(count.load(), total);
    EXPECT_EQ(sum.load(), total * (total - 1) / 2);
    EXPECT_EQ(order_violations.load(), 0);
    const auto duplicates_or_losses = std::count_if(
        seen.begin(), seen.end(), [](const auto& s) { return s.load() != 1; });
    EXPECT_EQ(duplicates_or_losses, 0);
    const auto s = buffer.stats();
    EXPECT_EQ(s.put, static_cast<std::uint64_t>(total));
    EXPECT_EQ(s.taken, static_cast<std::uint64_t>(total));
    EXPECT_LE(s.max_size, capacity);
    total_moved += count.load();
  }
  EXPECT_GE(total_moved, 1'000'000);
}

// Close and cancel must wake everyone even mid-stream with many threads.
TEST(BoundedBufferStress, CloseAndCancelMidStreamWakeEveryone) {
  for (const bool use_cancel : {false, true}) {
    SCOPED_TRACE(use_cancel ? "cancel" : "close");
    BoundedBuffer<int> buffer(2);
    std::atomic<int> produced{0}, consumed{0};
    std::vector<std::future<void>> threads;
    for (int p = 0; p < 8; ++p) {
      threads.push_back(async([&] {
        while (buffer.put(1) == BufferStatus::kOk) {
          ++produced;
        }
      }));
    }
    for (int c = 0; c < 4; ++c) {
      threads.push_back(async([&] {
        int out = 0;
        while (buffer.take(out) == BufferStatus::kOk) {
          ++consumed;
          std::this_thread::yield();
        }
      }));
    }
    eventually([&] { return consumed.load() > 1000; });
    if (use_cancel) {
      buffer.cancel();
    } else {
      buffer.close();
    }
    for (auto& f : threads) {
      ASSERT_TRUE(finishes(f));
    }
    const auto s = buffer.stats();
    // Nothing is lost: every accepted item was taken or counted as dropped.
    EXPECT_EQ(s.put, s.taken + s.dropped + s.size);
    EXPECT_EQ(static_cast<std::uint64_t>(consumed.load()), s.taken);
  }
}

} // namespace
} // namespace torch_stage
