// DeviceStager: the host-to-device step of a stage (DeepRec's
// TensorBufferPutGpuOp, redone with c10's device-generic streams and events).
//
// For each item:
//   1. The item's dense CPU tensors are laid out in one fused buffer, each at
//      an offset aligned to kAlignment bytes.
//   2. They are copied (CPU work, no GIL) into a pinned host buffer taken
//      from a free list; buffers are reused, never allocated per item. A
//      buffer is written only after the event of the last copy that read it
//      has completed. So that one item's gather overlaps the copy of the
//      item before, a free buffer whose copy is done is preferred, and up
//      to producers + 1 buffers are made before a gather waits for a copy
//      (a Python model of this step on an H200 host, 64 MB pageable items,
//      4 gather threads: 2 buffers took 2.7 ms an item where 1 took 3.6,
//      gather and copy taking turns; 3 took 3.3, so no more are made).
//   3. One non-blocking copy sends the fused buffer to a device buffer, on
//      the staging stream; an event is recorded after it.
//   4. The item's tensors become views of the device buffer. Tensors that
//      cannot be fused (already on the target device: passed through; other
//      devices or sparse layouts: copied one by one) keep their own memory.
// The gather of step 2 runs with gather_threads(producers) intra-op threads,
// more than the one a stage thread is bound to, on machines with cores to
// spare (see gather_threads()).
// A pinned tensor of kDirectCopyBytes or more (pin_memory=True loaders,
// pinned transforms) is not gathered: its own non-blocking copy saves a
// host memcpy of its size (on one thread ~12 ms for 64 MB on a GPU machine,
// against 1.6 ms over PCIe). torch's host allocator keeps its memory until
// that copy is done, as for any non-blocking .to(); the source must not
// write into it after yielding it. Smaller ones are gathered: one fused
// copy beats a launch per tensor.
// StreamObserver (torch_stage.sanitize_streams): with stream_id >= 1, each
// item sends "stage_copy" (its tensors are allocated and written on staging
// stream stream_id, an event is recorded) and hand_over sends
// "stage_hand_over" (the consumer's stream waits on it). CPU targets send
// the same notes, describing what a device would do, so the protocol is
// checked on machines without one.
//
// Consumers call hand_over() on their thread: their current stream waits on
// the event, and the device buffer is recorded on that stream so the caching
// allocator does not reuse it while the consumer's work may still read it
// (one record per item thanks to fusion, not one per tensor).
//
// Streams: stream_id 0 is the stream that was current on the thread that
// built the stager (the consumer's, when a stage starts lazily on first
// take); ids >= 1 are StreamPool's staging streams (high priority, held for
// the process, never a new stream per epoch or per call), which no
// multi-stream plan or capture uses.
//
// Threads: stage() may be called from several producer threads at once; the
// free list has its own lock. hand_over() is static and thread-safe.
//
// CPU target: nothing to copy, so stage() leaves items as they are, unless
// fuse_on_cpu is set (tests use it to run the fusion and reuse logic
// without a GPU; host buffers are then plain CPU memory).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "staging/stage.h"
#include "streams/stream_pool.h"

namespace torch_stage {

struct FusedLayout {
  // For each tensor of the bundle: its byte offset in the fused buffer, or
  // -1 when it is not fused.
  std::vector<int64_t> offsets;
  int64_t total_bytes = 0;
  // Pinned tensors left out to be copied as they are, and their bytes.
  int64_t direct_copies = 0;
  int64_t direct_bytes = 0;
};

// Which tensors of `tensors` fuse into one transfer to `device`, and where:
// dense CPU tensors, except those already on `device` unless
// `fuse_same_device` (the CPU test mode), and, for an accelerator, pinned
// ones of kDirectCopyBytes or more. Exposed for tests.
FusedLayout plan_fused_layout(
    const TensorBundle& tensors,
    const c10::Device& device,
    bool fuse_same_device = false);

// A free host buffer as a gather finds it: its size, and whether a copy
// still reads it.
struct FreeHostBuffer {
  int64_t bytes = 0;
  bool busy = false;
};
struct HostBufferChoice {
  int64_t index = -1; // into the free list; -1: make a new buffer
  bool wait = false; // the buffer is busy: wait for its copy first
};

// Which free buffer a gather of `bytes` takes, with `buffers` made so far
// and `producers` gathering at once (see step 2 above). Exposed for tests:
// on a device, making a pinned buffer synchronizes it (CUDA's implicit
// synchronization), so a test there cannot hold copies in flight at will.
HostBufferChoice choose_host_buffer(
    const std::vector<FreeHostBuffer>& free,
    int64_t bytes,
    int64_t buffers,
    int64_t producers);

struct DeviceStagerStats {
  int64_t items = 0;
  int64_t fused_tensors = 0;
  int64_t bytes = 0;
  int64_t host_buffers_allocated = 0;
  int64_t host_buffer_reuses = 0;
  // Reuses that waited for a copy still reading the buffer (producers + 1
  // buffers made, each fitting free one still being copied from).
  int64_t host_buffer_waits = 0;
  int64_t direct_copies = 0; // pinned tensors copied without a gather
};

class DeviceStager {
 public:
  static constexpr int64_t kAlignment = 64;
  static constexpr int64_t kDirectCopyBytes = 256 << 10;

  // Throws c10::ValueError for a stream id outside [0, kMaxStreams) or
  // a device that does not exist.
  DeviceStager(c10::Device device, int64_t stream_id, bool fuse_on_cpu = false);

  // Copies item.tensors to the device (see above). Producer threads;
  // `producers`: how many stage at once now (the buffers' and the gather
  // threads' share).
  void stage(StageItem& item, int64_t producers = 1);

  // Consumer side; a no-op for items that were not staged.
  static void hand_over(StageItem& item);

  DeviceStagerStats stats() const;

  // Intra-op threads for one producer's gather into pinned memory, for an
  // accelerator: half the machine's hardware threads shared by the
  // producers, between 1 and 8 each. The gather is a memcpy of the item's
  // size, bound by one core's bandwidth: on an H200 host 64 MB took 10.6 ms
  // on one thread, 2.5 on 4 and 1.4 on 8, against 1.3 for the copy over
  // PCIe. (A pin_memory DataLoader without workers pins in the loop's thread
  // on all of torch's intra-op threads; its pin thread, with workers, on 1.)
  // A stage thread's own bound (one intra-op thread) is for machines whose
  // cores the training step needs; half leaves those on a 2-core machine at
  // one. Never fewer than the thread already has.
  static int gather_threads(int64_t producers = 1);

  const c10::Device& device() const {
    return device_;
  }
  c10::Stream stream() const {
    return stream_;
  }

 private:
  struct HostBuffer {
    at::Tensor memory; // uint8, pinned for accelerators
    std::shared_ptr<c10::Event> last_copy; // must complete before reuse
  };
  HostBuffer acquire_host_buffer(int64_t bytes, int64_t producers);
  void release_host_buffer(HostBuffer buffer);
  // A buffer that was made and will not come back (see stage()).
  void forget_host_buffer();

  // Sends the "stage_copy" note for `item` (StreamObserver).
  void note_copy(StageItem& item) const;

  const c10::Device device_;
  const bool fuse_on_cpu_;
  const int64_t stream_id_;
  c10::Stream stream_;

  mutable std::mutex mu_;
  std::vector<HostBuffer> free_; // guarded by mu_
  // Buffers made and not forgotten, free or being gathered into: what
  // choose_host_buffer counts. Guarded by mu_.
  int64_t host_buffers_ = 0;
  DeviceStagerStats stats_; // guarded by mu_
};

} // namespace torch_stage
