// StreamRun and StreamPool (csrc/streams/) without a GPU: a fake device
// (PrivateUse1) registers a DeviceGuardImpl whose streams and events only
// log what is asked of them, so the device-generic code paths run here and
// every record, wait and stream switch can be asserted. On CPU the run is
// inactive and only checks the plan.
#include "streams/stream_pool.h"
#include "streams/stream_run.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "fake_stream_device.h"

namespace torch_stage {
namespace {

using namespace test_util;

TEST(StreamRun, InactiveOnCpuButChecksThePlan) {
  const auto device = StreamRun::device_of(c10::IValue(std::make_tuple(
      at::ones({2}), int64_t{3}, c10::List<at::Tensor>({at::ones({1})}))));
  EXPECT_FALSE(device.has_value());
  StreamRun run(device, 3, {1, 2}, 2);
  EXPECT_FALSE(run.is_active());
  EXPECT_EQ(run.device(), "cpu");
  EXPECT_TRUE(run.stream_ids().empty());
  run.set_stream(2);
  run.record_event(1, 2);
  run.record_stream(at::ones({2}), 0);
  EXPECT_EQ(run.kept_tensors(), 0);
  EXPECT_TRUE(contains(
      error_of([&] { run.wait_event(0, 1); }),
      "stream 1 waits on event 0, which has not been recorded in this run"));
  EXPECT_TRUE(contains(
      error_of([&] { run.record_event(1, 0); }), "event 1 is recorded twice"));
  EXPECT_TRUE(contains(
      error_of([&] { run.wait_event(2, 0); }),
      "event 2 does not exist (this run has 2 events)"));
  EXPECT_TRUE(contains(
      error_of([&] { run.set_stream(3); }),
      "stream 3 is outside the pool of 3 streams (valid: 0..2)"));
  EXPECT_TRUE(contains(
      error_of([&] { run.join({0}); }), "stream 0 was not forked by this run"));
  std::string other;
  std::thread([&] { other = error_of([&] { run.set_stream(0); }); }).join();
  EXPECT_TRUE(contains(other, "forked on another thread")) << other;
  run.wait_event(1, 0);
  run.join({1, 2});
  EXPECT_TRUE(contains(
      error_of([&] { run.set_stream(0); }),
      "the stream run was already joined"));
}

TEST(StreamRun, RejectsBadForks) {
  EXPECT_TRUE(contains(
      error_of([] { StreamRun(std::nullopt, 0, {}, 0); }),
      "num_streams must be in 1..32, got 0"));
  EXPECT_TRUE(contains(
      error_of([] { StreamRun(std::nullopt, 2, {2}, 0); }),
      "side stream 2 is outside 1..1"));
  EXPECT_TRUE(contains(
      error_of([] { StreamRun(std::nullopt, 3, {1, 1}, 0); }),
      "side stream 1 is listed twice"));
  EXPECT_TRUE(contains(
      error_of([] { StreamRun(std::nullopt, 2, {}, -1); }),
      "num_events must be >= 0, got -1"));
}

TEST(StreamRun, RestartsOnlyAJoinedInactiveRunNoOneElseHolds) {
  auto run = c10::make_intrusive<StreamRun>(
      std::nullopt, 2, std::vector<int64_t>{1}, 1);
  EXPECT_FALSE(run->restart(std::nullopt, 3, {1, 2}, 2)); // not joined
  run->record_event(0, 0);
  run->join({1});
  const int64_t id = run->id();
  {
    auto other = run; // a second holder, as a ScriptObject of it is
    EXPECT_FALSE(run->restart(std::nullopt, 3, {1, 2}, 2));
  }
  EXPECT_TRUE(contains(
      error_of([&] { run->restart(std::nullopt, 0, {}, 0); }),
      "num_streams must be in 1..32, got 0"));
  EXPECT_FALSE(run->restart(fake_device(0), 3, {1, 2}, 2)); // has streams
  ASSERT_TRUE(run->restart(std::nullopt, 3, {1, 2}, 2));
  EXPECT_EQ(run->id(), id);
  EXPECT_EQ(run->num_streams(), 3);
  // As new: no event recorded, three streams, not joined.
  EXPECT_TRUE(contains(
      error_of([&] { run->wait_event(0, 1); }), "has not been recorded"));
  EXPECT_TRUE(run->sync_inactive(1, 2, {}));
  EXPECT_TRUE(run->sync_inactive(0, 0, std::vector<int64_t>{0, 1}));
  run->join({1, 2});
}

TEST(StreamRun, TheInlinePathsLeaveAnythingButPlainBookkeepingToSync) {
  StreamRun run(std::nullopt, 2, {1}, 2);
  EXPECT_FALSE(run.sync_inactive(-1, 2, {})); // no stream 2
  EXPECT_FALSE(run.sync_inactive(-1, -1, {}));
  EXPECT_FALSE(run.sync_inactive(2, 1, {})); // no event 2
  EXPECT_FALSE(
      run.sync_inactive(-1, 1, std::vector<int64_t>{0})); // not recorded
  EXPECT_FALSE(run.record_event_inactive(2, 0));
  EXPECT_TRUE(run.sync_inactive(0, 1, std::vector<int64_t>{0}));
  EXPECT_FALSE(run.sync_inactive(0, 1, {})); // recorded twice
  EXPECT_FALSE(run.record_event_inactive(0, 1));
  EXPECT_TRUE(run.record_event_inactive(1, 1));
  bool elsewhere = true;
  std::thread([&] { elsewhere = run.sync_inactive(-1, 0, {}); }).join();
  EXPECT_FALSE(elsewhere); // another thread's call: for sync to refuse
  std::thread([&] { elsewhere = run.join_inactive({1}); }).join();
  EXPECT_FALSE(elsewhere);
  EXPECT_FALSE(run.join_inactive({0})); // not forked: for join to refuse
  EXPECT_FALSE(run.join_inactive({2}));
  const int64_t depth = StreamRun::thread_run_depth();
  EXPECT_TRUE(run.join_inactive({1}));
  EXPECT_EQ(StreamRun::thread_run_depth(), depth - 1); // left the thread's
  EXPECT_FALSE(run.sync_inactive(-1, 0, {})); // joined
  EXPECT_FALSE(run.join_inactive({})); // joined: join says so
  EXPECT_TRUE(contains(
      error_of([&] { run.join({}); }), "the stream run was already joined"));
}

// The diamond's plan (csrc/schedule tests): node 2 on stream 1 waits for
// node 0's event; node 3 on stream 0 waits for node 2's.
TEST(StreamRun, RunsAPlanOnADeviceWithStreams) {
  const auto device = fake_device(0);
  fake().take_log();
  EventNames named;
  {
    StreamRun run(device, 3, {1}, 2);
    ASSERT_TRUE(run.is_active());
    EXPECT_FALSE(run.sync_inactive(-1, 1, {})); // device work: sync's
    EXPECT_FALSE(run.record_event_inactive(0, 0));
    EXPECT_EQ(run.device(), "privateuseone:0");
    const auto ids = run.stream_ids();
    ASSERT_EQ(ids.size(), 3u);
    EXPECT_EQ(ids[0], 0); // the caller's current stream
    EXPECT_NE(ids[1], ids[2]);
    const std::string s1 = "s" + std::to_string(ids[1]);
    // Fork: the side stream waits for the caller's stream.
    EXPECT_EQ(named(fake().take_log()), (Log{"record e1 s0", "wait e1 " + s1}));
    run.record_event(0, 0); // after node 0
    run.set_stream(1);
    run.wait_event(0, 1);
    run.record_stream(at::ones({2}), 1); // a CPU tensor: not the run's device
    run.record_event(1, 1); // after node 2
    run.set_stream(0);
    run.wait_event(1, 0);
    EXPECT_EQ(fake().current(0), 0);
    run.join({});
    EXPECT_EQ(
        named(fake().take_log()),
        (
            Log{"record e2 s0",
                "current " + s1,
                "wait e2 " + s1,
                "record e3 " + s1,
                "current s0",
                "wait e3 s0"}));
  }
  EXPECT_TRUE(fake().take_log().empty());
}

// sync is the separate ops in one call: the device sees the same records,
// switches and waits in the same order (the plan of the test above).
TEST(StreamRun, SyncIsTheOpsItFusesOnTheDevice) {
  const auto device = fake_device(0);
  auto run_plan = [&](bool fused) {
    fake().take_log();
    StreamRun run(device, 3, {1}, 2);
    if (fused) {
      // Node 0 on stream 0, then node 1 on stream 1 after event 0, then
      // node 2 on stream 0 after event 1.
      run.sync(0, 1, {0}, c10::IValue(at::ones({2})));
      run.sync(1, 0, {1}, c10::IValue());
    } else {
      run.record_event(0, 0);
      run.set_stream(1);
      run.wait_event(0, 1);
      run.record_stream(at::ones({2}), 1);
      run.record_event(1, 1);
      run.set_stream(0);
      run.wait_event(1, 0);
    }
    run.join({});
    // Events come from the pool's free list: name them by first use.
    return EventNames()(fake().take_log());
  };
  const Log separate = run_plan(false);
  EXPECT_EQ(run_plan(true), separate);
  EXPECT_EQ(separate.size(), 8u);
  // A sync to the current stream with nothing to do touches nothing.
  StreamRun run(device, 2, {}, 0);
  fake().take_log();
  run.sync(-1, 0, {}, c10::IValue());
  EXPECT_TRUE(fake().take_log().empty());
  EXPECT_THROW(run.sync(-1, 2, {}, c10::IValue()), c10::ValueError);
  EXPECT_THROW(run.sync(0, 0, {}, c10::IValue()), c10::ValueError);
  EXPECT_THROW(run.sync(-1, 1, {0}, c10::IValue()), c10::ValueError);
}

TEST(StreamRun, JoinRestoresTheCallersStreamAndWaitsForSideStreams) {
  const auto device = fake_device(1);
  StreamRun run(device, 2, {1}, 0);
  const std::string s1 = "s" + std::to_string(run.stream_ids()[1]);
  fake().take_log();
  run.set_stream(1);
  EXPECT_EQ(fake().current(1), run.stream_ids()[1]);
  run.join({1});
  EXPECT_EQ(fake().current(1), 0);
  const Log log = fake().take_log();
  ASSERT_EQ(log.size(), 4u);
  EXPECT_EQ(log[0], "current " + s1);
  EXPECT_EQ(log[1], "current s0");
  EXPECT_TRUE(contains(log[2], "record") && contains(log[2], s1)) << log[2];
  EXPECT_TRUE(contains(log[3], "wait") && contains(log[3], " s0")) << log[3];
}

// A forward that raises in Python: the run lives on in the traceback, and
// abort_thread_runs finishes the runs forked since the call began, newest
// first, leaving older ones (an enclosing module's) alone.
TEST(StreamRun, AbortFinishesTheRunsForkedAboveADepth) {
  const auto device = fake_device(1);
  const int64_t depth = StreamRun::thread_run_depth();
  StreamRun outer(device, 2, {1}, 0);
  const int64_t inner_depth = StreamRun::thread_run_depth();
  EXPECT_EQ(inner_depth, depth + 1);
  {
    StreamRun inner(device, 3, {2}, 0);
    inner.set_stream(2);
    EXPECT_NE(fake().current(1), 0);
    EXPECT_EQ(StreamRun::thread_run_depth(), depth + 2);
    StreamRun::abort_thread_runs(inner_depth);
    EXPECT_EQ(fake().current(1), 0); // the caller's stream again
    EXPECT_EQ(StreamRun::thread_run_depth(), inner_depth);
    EXPECT_TRUE(contains(
        error_of([&] { inner.set_stream(0); }),
        "the stream run was already joined"));
  }
  outer.set_stream(1); // untouched by the abort
  outer.join({1});
  EXPECT_EQ(StreamRun::thread_run_depth(), depth);
  StreamRun::abort_thread_runs(depth); // nothing left: a no-op
  fake().take_log();
}

// A fork that fails after its checks (the device's pool is too small)
// leaves nothing behind for an abort to touch.
TEST(StreamRun, AFailedForkIsNotRegistered) {
  fake().set_pool_size(5, 2);
  const auto device = fake_device(5);
  const int64_t depth = StreamRun::thread_run_depth();
  EXPECT_TRUE(contains(
      error_of([&] { StreamRun run(device, 6, {1}, 0); }), "distinct streams"));
  EXPECT_EQ(StreamRun::thread_run_depth(), depth);
  StreamRun::abort_thread_runs(depth);
  fake().take_log();
}

TEST(StreamRun, AnAbandonedRunRestoresAndJoinsEverything) {
  const auto device = fake_device(1);
  fake().take_log();
  std::vector<int64_t> ids;
  {
    StreamRun run(device, 3, {1, 2}, 1);
    ids = run.stream_ids();
    run.set_stream(2);
    run.record_event(0, 2);
    fake().take_log();
    // An op of the module throws here; the run is dropped without join.
  }
  EXPECT_EQ(fake().current(1), 0);
  const Log log = fake().take_log();
  ASSERT_EQ(log.size(), 5u);
  EXPECT_EQ(log[0], "current s0");
  EXPECT_TRUE(contains(log[1], "s" + std::to_string(ids[1])));
  EXPECT_TRUE(contains(log[2], "wait") && contains(log[2], " s0"));
  EXPECT_TRUE(contains(log[3], "s" + std::to_string(ids[2])));
  EXPECT_TRUE(contains(log[4], "wait") && contains(log[4], " s0"));
}

TEST(StreamRun, RecordStreamMarksEveryTensorOnTheDevice) {
  const auto device = fake_device(2);
  // A tensor on the fake device, made by hand: factory functions would
  // need the device's hooks and allocator, the run only needs its storage.
  std::vector<float> memory(8, 0.0f);
  auto on_device = [&](int offset) {
    c10::Storage storage(
        c10::Storage::use_byte_size_t(),
        2 * sizeof(float),
        c10::DataPtr(memory.data() + offset, device),
        nullptr,
        false);
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        std::move(storage),
        c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
        caffe2::TypeMeta::Make<float>());
    impl->set_sizes_contiguous({2});
    return at::Tensor(std::move(impl));
  };
  StreamRun run(device, 2, {1}, 0);
  fake().take_log();
  const c10::IValue value(std::make_tuple(
      on_device(0),
      at::ones({2}),
      c10::List<at::Tensor>({on_device(2), on_device(4)}),
      c10::IValue(),
      int64_t{3}));
  // The first non-CPU tensor decides a run's device, however nested.
  EXPECT_EQ(
      StreamRun::device_of(c10::IValue(std::make_tuple(
          at::ones({1}), c10::List<at::Tensor>({on_device(6)})))),
      device);
  run.record_stream(value, 1);
  EXPECT_EQ(run.kept_tensors(), 3);
  const std::string keep = "keep s" + std::to_string(run.stream_ids()[1]);
  EXPECT_EQ(fake().take_log(), (Log{keep, keep, keep}));
  run.join({1});
}

TEST(StreamPool, TakesSideStreamsOnceAndReusesEvents) {
  const auto device = fake_device(3);
  const auto first = StreamPool::side_streams(device, 3);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(StreamPool::size(device), 2);
  // Others take from the same round robin meanwhile.
  fake().getStreamFromGlobalPool(device, false);
  const auto again = StreamPool::side_streams(device, 2);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0], first[0]);
  const auto more = StreamPool::side_streams(device, 5);
  ASSERT_EQ(more.size(), 4u);
  EXPECT_EQ(more[0], first[0]);
  EXPECT_EQ(more[1], first[1]);
  for (size_t i = 0; i < more.size(); ++i) {
    for (size_t j = i + 1; j < more.size(); ++j) {
      EXPECT_NE(more[i], more[j]);
    }
  }
  // Runs reuse the events of finished runs: twenty runs of four records
  // each create no more native events than one run holds (4 + 3).
  fake().take_log();
  const intptr_t created = fake().events_created();
  for (int i = 0; i < 20; ++i) {
    StreamRun run(device, 3, {1, 2}, 4);
    run.record_event(3, 1);
    run.join({1, 2});
  }
  // Per run: fork (record, 2 waits), the event, join (2 records, 2 waits).
  EXPECT_EQ(fake().take_log().size(), 20u * 8u);
  EXPECT_LE(fake().events_created() - created, 7);
}

TEST(StreamPool, RefusesMoreStreamsThanThePoolGivesWithoutAliasing) {
  EXPECT_TRUE(contains(
      error_of([] { StreamPool::side_streams(fake_device(3), 33); }),
      "num_streams must be in 1..32, got 33"));
  const auto device = fake_device(4);
  fake().set_pool_size(4, 3);
  EXPECT_EQ(StreamPool::side_streams(device, 4).size(), 3u);
  EXPECT_TRUE(contains(
      error_of([&] { StreamPool::side_streams(device, 5); }),
      "needs 4 side streams on privateuseone:4, but its stream pool gives "
      "only 3 distinct streams; use num_streams <= 4"));
}

} // namespace
} // namespace torch_stage

namespace torch_stage {
namespace {

// gpu-review #2, #7: staging copies must never share a stream with a
// multi-stream plan or a CUDA graph capture.
TEST(StreamPool, StagingStreamsAreTheirOwn) {
  // A device of its own: the side streams it takes would grow the pool
  // TakesSideStreamsOnceAndReusesEvents counts.
  const auto device = test_util::fake_device(7);
  const auto side = StreamPool::side_streams(device, 8);
  const c10::Stream capture = StreamPool::capture_stream(device);
  std::vector<c10::Stream> staging;
  for (int64_t k = 1; k <= 4; ++k) {
    staging.push_back(StreamPool::staging_stream(device, k));
    EXPECT_EQ(StreamPool::staging_stream(device, k), staging.back());
  }
  for (size_t i = 0; i < staging.size(); ++i) {
    EXPECT_NE(staging[i], capture);
    EXPECT_EQ(std::count(side.begin(), side.end(), staging[i]), 0);
    for (size_t j = 0; j < i; ++j) {
      EXPECT_NE(staging[i], staging[j]);
    }
  }
  EXPECT_EQ(std::count(side.begin(), side.end(), capture), 0);
  EXPECT_EQ(StreamPool::capture_stream(device), capture);
  EXPECT_TRUE(test_util::contains(
      test_util::error_of([&] { StreamPool::staging_stream(device, 0); }),
      "staging stream id must be in 1..31, got 0"));
}

TEST(StreamRun, TheInlineJoinLeavesARunOnADeviceToJoin) {
  const auto device = fake_device(6);
  StreamRun run(device, 2, {1}, 0);
  fake().take_log();
  EXPECT_FALSE(run.join_inactive({1})); // device work
  EXPECT_TRUE(fake().take_log().empty());
  run.join({1});
}

} // namespace
} // namespace torch_stage
