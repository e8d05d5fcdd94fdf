// Tests of StagingArea (csrc/staging/staging_area.h): the tensor-bundle
// buffer behind torch.classes.torch_stage.StagingArea.
#include "staging/staging_area.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

namespace torch_stage {
namespace {

using namespace std::chrono_literals;

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(StagingArea, HandsOverTheSameTensors) {
  auto area = c10::make_intrusive<StagingArea>(2);
  const auto a = at::arange(6).reshape({2, 3});
  const auto b = at::ones({4}, at::kFloat);
  area->put({a, b});
  EXPECT_EQ(area->size(), 1);
  const auto out = area->take();
  ASSERT_EQ(out.size(), 2u);
  // Staging hands over the producer's tensors, not copies.
  EXPECT_TRUE(out[0].is_same(a));
  EXPECT_TRUE(out[1].is_same(b));
  EXPECT_EQ(area->size(), 0);
}

TEST(StagingArea, BadArgumentsNameTheValueAndTheRule) {
  EXPECT_THROW(StagingArea(0), c10::ValueError);
  EXPECT_TRUE(contains(
      error_of([] { StagingArea(0); }), "capacity must be >= 1, got 0"));
  EXPECT_TRUE(contains(error_of([] { StagingArea(-3); }), "got -3"));
  EXPECT_THROW(StagingArea(1, -1), c10::ValueError);
  EXPECT_TRUE(contains(
      error_of([] { StagingArea(1, -1); }), "byte_limit must be >= 0"));
  StagingArea area(1);
  EXPECT_THROW(area.try_take(-1), c10::ValueError);
  const auto timeout_error = error_of([&] { area.try_take(-1); });
  EXPECT_TRUE(contains(timeout_error, "timeout_ms must be >= 0"))
      << timeout_error;
  EXPECT_TRUE(contains(timeout_error, "got -1")) << timeout_error;
  EXPECT_THROW(area.try_put({at::ones({1})}, -5), c10::ValueError);
  EXPECT_THROW(area.put({at::Tensor()}), c10::ValueError);
  EXPECT_TRUE(contains(
      error_of([&] { area.put({at::ones({1}), at::Tensor()}); }), "tensor 1"));
}

TEST(StagingArea, TimeoutsReturnInsteadOfFailing) {
  StagingArea area(1);
  EXPECT_FALSE(area.try_take(10).has_value());
  EXPECT_TRUE(area.try_put({at::ones({1})}, 0));
  EXPECT_FALSE(area.try_put({at::ones({1})}, 10));
  const auto out = area.try_take(0);
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->size(), 1u);
}

TEST(StagingArea, PutAfterCloseAndEndOfStreamAreTaggedErrors) {
  StagingArea area(2);
  area.put({at::ones({1})});
  area.close();
  EXPECT_TRUE(area.is_closed());
  const auto put_error = error_of([&] { area.put({at::ones({1})}); });
  EXPECT_TRUE(contains(put_error, "[StageClosed]")) << put_error;
  EXPECT_TRUE(contains(put_error, "accepts no more items")) << put_error;
  EXPECT_EQ(area.take().size(), 1u);
  const auto take_error = error_of([&] { area.take(); });
  EXPECT_TRUE(contains(take_error, "[StageClosed]")) << take_error;
  EXPECT_TRUE(contains(take_error, "end of stream")) << take_error;
  EXPECT_TRUE(contains(error_of([&] { area.try_take(5); }), "[StageClosed]"));
}

TEST(StagingArea, CancelFailsEveryWaiterWithATaggedError) {
  auto area = c10::make_intrusive<StagingArea>(1);
  auto consumer = std::async(
      std::launch::async, [area] { return error_of([&] { area->take(); }); });
  std::this_thread::sleep_for(20ms);
  area->cancel();
  ASSERT_EQ(consumer.wait_for(30s), std::future_status::ready);
  EXPECT_TRUE(contains(consumer.get(), "[StageCancelled]"));
  EXPECT_TRUE(contains(
      error_of([&] { area->put({at::ones({1})}); }), "[StageCancelled]"));
  EXPECT_TRUE(area->is_cancelled());
}

TEST(StagingArea, ByteLimitCountsTensorBytes) {
  StagingArea area(8, 100);
  EXPECT_EQ(area.byte_limit(), 100);
  area.put({at::zeros({20}, at::kFloat)}); // 80 bytes
  EXPECT_FALSE(area.try_put({at::zeros({6}, at::kFloat)}, 5)); // 104 > 100
  EXPECT_TRUE(area.try_put({at::zeros({5}, at::kFloat)}, 5)); // 100
  const auto too_big =
      error_of([&] { area.put({at::zeros({26}, at::kFloat)}); });
  EXPECT_TRUE(contains(too_big, "104 bytes")) << too_big;
  EXPECT_TRUE(contains(too_big, "byte_limit of 100")) << too_big;
  EXPECT_EQ(area.stats().at("bytes"), 100);
}

TEST(StagingArea, StatsReportCounters) {
  StagingArea area(4);
  area.put({at::ones({2})});
  area.put({at::ones({2})});
  area.take();
  const auto s = area.stats();
  EXPECT_EQ(s.at("capacity"), 4);
  EXPECT_EQ(s.at("put"), 2);
  EXPECT_EQ(s.at("taken"), 1);
  EXPECT_EQ(s.at("size"), 1);
  EXPECT_EQ(s.at("max_size"), 2);
  EXPECT_EQ(s.at("occupancy_sum"), 2);
  EXPECT_EQ(s.at("closed"), 0);
  for (const char* key :
       {"dropped",
        "bytes",
        "consumer_wait_ns",
        "producer_blocked_ns",
        "cancelled",
        "byte_limit"}) {
    EXPECT_TRUE(s.contains(key)) << key;
  }
}

TEST(StagingArea, IsRegisteredAsATorchScriptClass) {
  const auto type = c10::getCustomClassType<c10::intrusive_ptr<StagingArea>>();
  ASSERT_NE(type, nullptr);
  EXPECT_EQ(
      type->name()->qualifiedName(),
      "__torch__.torch.classes.torch_stage.StagingArea");
  // Round trip through an IValue, as scripted code and attributes hold it.
  auto area = c10::make_intrusive<StagingArea>(3);
  c10::IValue value(area);
  EXPECT_EQ(value.toCustomClass<StagingArea>()->capacity(), 3);
}

TEST(StagingArea, ProducerThreadFeedsConsumer) {
  auto area = c10::make_intrusive<StagingArea>(2);
  constexpr int kItems = 200;
  std::thread producer([area] {
    for (int i = 0; i < kItems; ++i) {
      area->put({at::full({1}, i, at::kLong)});
    }
    area->close();
  });
  int64_t expected = 0;
  while (true) {
    TensorBundle bundle;
    try {
      bundle = area->take();
    } catch (const c10::Error&) {
      break;
    }
    EXPECT_EQ(bundle[0].item<int64_t>(), expected);
    ++expected;
  }
  producer.join();
  EXPECT_EQ(expected, kItems);
}

} // namespace
} // namespace torch_stage
