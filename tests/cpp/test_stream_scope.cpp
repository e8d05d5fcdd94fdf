// StreamScope (csrc/streams/stream_scope.h), the context manager behind
// `with torch_stage.stream(i):` in TorchScript, on the fake device of
// fake_stream_device.h (every fork, join and stream switch is logged) and on
// CPU, where it is inactive.
#include "streams/stream_scope.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "fake_stream_device.h"
#include "streams/stream_pool.h"

namespace torch_stage {
namespace {

using namespace test_util;

std::string s(int64_t id) {
  return "s" + std::to_string(id);
}

TEST(StreamScope, InactiveWithoutADeviceButChecksTheOrder) {
  StreamScope scope(3, std::nullopt);
  EXPECT_FALSE(scope.is_active());
  EXPECT_EQ(scope.device(), "cpu");
  EXPECT_TRUE(contains(
      error_of([&] { scope.exit(); }), "exit without enter (use the scope"));
  scope.enter();
  EXPECT_TRUE(scope.is_entered());
  EXPECT_TRUE(contains(
      error_of([&] { scope.enter(); }), "this scope is already entered"));
  StreamScope inner(1, c10::Device(c10::DeviceType::CPU));
  EXPECT_FALSE(inner.is_active());
  inner.enter();
  EXPECT_TRUE(contains(
      error_of([&] { scope.exit(); }),
      "scopes must be exited innermost first"));
  std::string other;
  std::thread([&] { other = error_of([&] { inner.exit(); }); }).join();
  EXPECT_TRUE(contains(other, "exited on another thread")) << other;
  inner.exit();
  scope.exit();
  EXPECT_FALSE(scope.is_entered());
}

TEST(StreamScope, RejectsIdsOutsideThePool) {
  EXPECT_TRUE(contains(
      error_of([] { StreamScope(-1, std::nullopt); }),
      "stream id -1 is outside the pool of 32 streams (valid ids: 0..31)"));
  EXPECT_TRUE(contains(
      error_of([] { StreamScope(32, std::nullopt); }),
      "stream id 32 is outside the pool of 32 streams"));
}

// The op's default device is the current device of the first device type
// with streams that has devices: here the fake one.
TEST(StreamScope, DefaultsToTheCurrentDeviceWithStreams) {
  fake();
  const auto device = StreamScope::default_device();
  ASSERT_TRUE(device.has_value());
  EXPECT_EQ(device->type(), kFake);
}

//   caller s0 ──fork──▶ side stream 1 ──join──▶ s0
TEST(StreamScope, ForksOnEnterAndJoinsOnExit) {
  const auto device = fake_device(0);
  const std::string s1 = s(StreamPool::side_streams(device, 2).back().id());
  fake().take_log();
  {
    StreamScope scope(1, device);
    scope.enter();
    EXPECT_EQ(s(scope.stream_id()), s1);
    EXPECT_EQ(scope.enclosing_stream_id(), 0);
    EXPECT_EQ(s(fake().current(0)), s1);
    const Log fork = fake().take_log();
    ASSERT_EQ(fork.size(), 3u);
    // One event: recorded on the caller's stream, waited on by stream 1.
    const std::string event = fork[0].substr(7, fork[0].find(' ', 7) - 7);
    EXPECT_EQ(fork[0], "record " + event + " s0");
    EXPECT_EQ(fork[1], "wait " + event + " " + s1);
    EXPECT_EQ(fork[2], "current " + s1);
    scope.exit();
    EXPECT_EQ(fake().current(0), 0);
    const Log log = fake().take_log();
    ASSERT_EQ(log.size(), 3u);
    EXPECT_EQ(log[0], "current s0");
    EXPECT_TRUE(contains(log[1], "record") && contains(log[1], " " + s1));
    EXPECT_TRUE(contains(log[2], "wait") && contains(log[2], " s0"));
  }
  EXPECT_TRUE(fake().take_log().empty());
}

// Nested scopes: stream(0) inside stream(2) is the caller's stream, not the
// side stream around it; stream(2) inside stream(2) switches nothing.
//
//   s0 ─fork─▶ s2 ─fork─▶ s0 (inner stream(0)) ─join─▶ s2 ─join─▶ s0
TEST(StreamScope, NestedScopesUseTheCallersStreamAsStreamZero) {
  const auto device = fake_device(1);
  const auto s2 = StreamPool::side_streams(device, 3).back().id();
  fake().take_log();
  StreamScope outer(2, device);
  outer.enter();
  EXPECT_EQ(fake().current(1), s2);
  StreamScope same(2, device);
  same.enter();
  StreamScope zero(0, device);
  zero.enter();
  EXPECT_EQ(zero.stream_id(), 0);
  EXPECT_EQ(zero.enclosing_stream_id(), s2);
  EXPECT_EQ(fake().current(1), 0);
  zero.exit();
  EXPECT_EQ(fake().current(1), s2);
  same.exit();
  outer.exit();
  EXPECT_EQ(fake().current(1), 0);
  // Two forks and two joins: the scope on the stream it was entered from
  // neither forks nor joins.
  int records = 0;
  int waits = 0;
  for (const auto& line : fake().take_log()) {
    records += contains(line, "record") ? 1 : 0;
    waits += contains(line, "wait") ? 1 : 0;
  }
  EXPECT_EQ(records, 4);
  EXPECT_EQ(waits, 4);
}

TEST(StreamScope, AScopeDestroyedWhileEnteredJoinsAndRestores) {
  const auto device = fake_device(2);
  const auto s3 = StreamPool::side_streams(device, 4).back().id();
  {
    StreamScope scope(3, device);
    scope.enter();
    EXPECT_EQ(fake().current(2), s3);
    fake().take_log();
  }
  EXPECT_EQ(fake().current(2), 0);
  const Log log = fake().take_log();
  ASSERT_EQ(log.size(), 3u);
  EXPECT_EQ(log[0], "current s0");
  EXPECT_TRUE(contains(log[2], "wait") && contains(log[2], " s0"));
  // The thread's stack is clean: a new outermost scope sees s0 as stream 0.
  StreamScope zero(0, device);
  zero.enter();
  EXPECT_EQ(zero.stream_id(), 0);
  zero.exit();
}

} // namespace
} // namespace torch_stage
