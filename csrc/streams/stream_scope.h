// StreamScope: `with torch_stage.stream(i):` inside TorchScript code (and in
// C++), registered as torch.classes.torch_stage.StreamScope and created by
// the op torch.ops.torch_stage.stream(index) (csrc/ops/stream_ops.cpp),
// which TorchScript calls for torch_stage.stream(i)
// (torch_stage/streams/multi_stream.py maps the Python name onto the op).
//
// Semantics: the block runs on pool stream `index` of the device, and is
// ordered like sequential code:
//
//   __enter__  the stream that was current (the *enclosing* stream) records
//              an event and stream `index` waits on it (fork), then stream
//              `index` becomes current;
//   __exit__   stream `index` records an event and the enclosing stream
//              waits on it (join), then the enclosing stream is current
//              again.
//
// So results are those of the same code without the block, whatever the
// block reads or writes, and no tensor is used on a stream that its
// allocation stream has not waited for: memory freed inside or after the
// block is only reused by work that comes after a join or a fork, so no
// record_stream is needed. The price is that a scope does not overlap with
// the code around it on the same thread: in TorchScript there is no data-flow
// view of which later operations read the block's results, so the join
// cannot be deferred to them. Concurrency inside a model comes from
// torch_stage.multi_stream, which plans the waits per dependency and emits
// the stream ops (its result scripts too); a scope is the safe, explicit
// placement for hand-written scripted code (design departure from the
// research notes' StreamScope sketch, which left the sync open).
//
// Streams: index 0 is the stream that was current when the outermost scope
// active on this thread (for the device) was entered, i.e. the caller's;
// index k >= 1 is side stream k of StreamPool (taken once per process and
// shared with multi_stream runs and device staging). Scopes nest; the
// innermost wins.
//
// Device: given explicitly, or (the op's default) the current device of the
// first device type that has a stream-capable device guard and at least one
// device (CUDA, XPU, MTIA, PrivateUse1, in that order). Without one (CPU-only
// machines and builds) the scope is *inactive*: enter and exit still check
// their order, and do nothing else, so scripted code runs unchanged.
//
// Exceptions: TorchScript calls __exit__ when the block raises; a scope that
// is destroyed while entered (a C++ caller that never exited) joins and
// restores the enclosing stream in its destructor.
//
// Threads: a scope is entered and exited on one thread (the current stream
// is thread-local); entering it while it is entered, or exiting it on
// another thread or out of nesting order, is an error. Different scopes on
// different threads are independent.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace torch_stage {

class StreamScope : public torch::CustomClassHolder {
 public:
  // The device a scope uses when none is given (see the header comment), or
  // nullopt (inactive).
  static std::optional<c10::Device> default_device();

  // index in 0..kMaxStreams-1 (c10::ValueError otherwise).
  StreamScope(int64_t index, std::optional<c10::Device> device);
  ~StreamScope() override;

  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

  // Fork and switch (see above). Call from the thread that will exit.
  void enter();
  // Join and restore. Call from the entering thread, innermost scope first.
  void exit();

  int64_t index() const {
    return index_;
  }
  bool is_active() const {
    return device_.has_value();
  }
  bool is_entered() const {
    return entered_;
  }
  // "cpu" for an inactive scope, else the device ("cuda:0").
  std::string device() const;
  // While entered on an active device: the id of the stream the block runs
  // on, and of the enclosing stream it returns to.
  int64_t stream_id() const;
  int64_t enclosing_stream_id() const;

 private:
  void finish();

  const int64_t index_;
  // This scope's id in StreamObserver notes.
  const int64_t id_;
  const std::optional<c10::Device> device_;
  // The device's stream and event interface (active scopes only).
  const c10::impl::DeviceGuardImplInterface* impl_ = nullptr;
  // The rest is touched only by the entering thread, between enter and exit.
  bool entered_ = false;
  std::thread::id owner_;
  std::optional<c10::Stream> enclosing_;
  std::optional<c10::Stream> target_;
  std::vector<c10::Event> events_; // [0] fork, [1] join
};

} // namespace torch_stage
