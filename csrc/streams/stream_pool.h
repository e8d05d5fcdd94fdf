// StreamPool: the side streams of multi-stream execution, per device, taken
// once per process from PyTorch's stream pool, and a free list of events.
//
// Stream 0 of a multi-stream run is never stored here: it is the caller's
// current stream at call time (design.md, "Multi-stream semantics"). Side
// streams 1..N-1 are taken from the device's global pool
// (DeviceGuardImplInterface::getStreamFromGlobalPool) the first time a run
// needs them and kept for the life of the process, so every multi-stream
// module on a device shares the same few streams instead of creating
// streams per call (memory stranded per stream, cuBLAS workspaces per
// stream).
//
// PyTorch's CUDA pool hands out 32 streams per priority round robin, so the
// 33rd stream taken is the 1st again (pytorch#9646): two "different" side
// streams would then serialise. The pool therefore refuses num_streams above
// kMaxStreams (32, counting the caller's stream), and checks that every side
// stream it takes differs from the ones it holds, retrying past streams
// other code took meanwhile; a backend whose pool is smaller fails with an
// error that says how many distinct streams it gave.
//
// Only c10's device-generic interfaces are used, so the CPU wheel builds
// this and a CUDA (or other stream-capable) device runs it.
//
// Threads: every function may be called from any thread; one mutex guards
// the per-device state.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <vector>

namespace torch_stage {

// PyTorch's pool size per priority; also the scheduler's limit
// (schedule::kMaxStreams).
constexpr int64_t kMaxStreams = 32;

class StreamPool {
 public:
  // Side streams 1..num_streams-1 of `device` (entry k-1 is stream k). The
  // same streams every call: the pool only grows. num_streams in
  // 1..kMaxStreams; c10::ValueError otherwise, c10::Error when the device's
  // pool cannot give that many distinct streams.
  static std::vector<c10::Stream> side_streams(
      c10::Device device,
      int64_t num_streams);

  // Staging stream `stream_id` (>= 1) of `device`: a high-priority stream of
  // the device's pool, held for the process and distinct from every other
  // staging stream. Never a side stream (those come from the low-priority
  // pool), so no multi-stream plan and no capture of one pulls staging
  // copies in, and the caching allocator never hands staging a block that
  // compute freed onto a side stream (gpu-review #2, #7). c10::ValueError
  // for ids outside 1..kMaxStreams-1.
  static c10::Stream staging_stream(c10::Device device, int64_t stream_id);

  // The stream CUDAGraphModule captures on: high priority, held for the
  // process, distinct from every staging stream (a capture would pull in
  // the staging copies queued on it).
  static c10::Stream capture_stream(c10::Device device);

  // `count` events for `device`, reused from earlier runs when possible
  // (their native events already exist). Give them back with
  // release_events when no stream op will use them again; a record or wait
  // already queued keeps its meaning when the event is recorded anew (a
  // wait captures the record that precedes it).
  static std::vector<c10::Event> acquire_events(
      c10::Device device,
      int64_t count);
  static void release_events(c10::Device device, std::vector<c10::Event>&&);

  // Side streams held for `device` so far (tests).
  static int64_t size(c10::Device device);
};

} // namespace torch_stage
