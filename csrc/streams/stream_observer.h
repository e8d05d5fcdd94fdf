// StreamObserver: the one place that sees every stream operation torch_stage
// performs, whoever calls it (eager Python through torch_stage._C, the
// registered ops from TorchScript, torch.compile graphs or C++, StreamScope,
// device staging). torch_stage.sanitize_streams() installs an observer to
// model CUDA stream semantics on any device, CPU included, where the
// operations themselves do nothing (csrc/python/stream_bindings.cpp,
// torch_stage/streams/sanitizer.py).
//
// What is reported (StreamOpNote::op; `owner` is the id of the StreamRun,
// StreamScope or staging copy the operation belongs to, unique per process):
//
//   "fork"          a StreamRun starts: `stream` = num_streams, `streams` =
//                   the side streams that wait for the caller's stream;
//                   stream 0 of the run is the thread's current stream.
//   "set_stream"    pool stream `stream` of the run becomes current.
//   "record_event"  pool stream `stream` records run event `event`.
//   "wait_event"    pool stream `stream` waits on run event `event`.
//   "record_stream" the tensors in `value` are used on pool stream `stream`.
//   "join"          stream 0 waits on `streams`; on the owner thread
//                   (`owner_thread`) stream 0 is current again. Also sent
//                   when a run is destroyed without join.
//   "scope_enter"   StreamScope `owner` of pool index `stream` is entered.
//   "scope_exit"    it is left (or destroyed while entered).
//   "stage_copy"    a staging thread wrote the tensors in `value` on staging
//                   stream `stream` and recorded event `event` after it.
//   "stage_hand_over" the consumer's current stream waits on staging event
//                   `event` before it receives the tensors in `value`.
//
// Indices are pool indices (0 = the caller's stream), not device stream ids,
// so the same notes come from CPU runs (inactive: the device does nothing)
// and device runs.
//
// Observers: one per slot, so the sanitizer and the trace recorder
// (csrc/trace) observe at once; each note goes to every installed observer
// in slot order (the trace first: it never throws, and so records an
// operation the sanitizer then rejects).
//
// Threads: notes are sent on the thread that performs the operation, in
// program order for that thread; set_stream_observer may be called from any
// thread. The observer is called without any torch_stage lock held, so it
// may call back into torch_stage. An observer that throws makes the
// operation throw (except in destructors, which swallow it).
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace torch_stage {

struct StreamOpNote {
  const char* op = "";
  int64_t owner = 0;
  int64_t stream = -1;
  int64_t event = -1;
  std::vector<int64_t> streams;
  c10::IValue value;
  bool owner_thread = true;
};

using StreamObserver = std::function<void(const StreamOpNote&)>;

enum class StreamObserverSlot : int { kTrace = 0, kSanitizer = 1 };
constexpr int kStreamObserverSlots = 2;

// Installs `observer` (nullptr: none) in `slot` for every later operation.
void set_stream_observer(
    StreamObserverSlot slot,
    std::shared_ptr<const StreamObserver> observer);

// The sanitizer's slot (torch_stage._C._set_stream_observer).
inline void set_stream_observer(
    std::shared_ptr<const StreamObserver> observer) {
  set_stream_observer(StreamObserverSlot::kSanitizer, std::move(observer));
}

// True while any observer is installed and the calling thread is not inside
// an UnobservedStreamOps: callers skip building notes otherwise (one atomic
// load and one thread-local read).
bool stream_observer_active();

// While one lives on a thread, that thread's stream operations are not sent
// to the observers. Only for runs that are torch_stage's own and touch no
// user tensor: the multi-stream pass times its calls with them, and a
// sanitizer or trace must neither see those runs nor make them slower.
// Nests; must be destroyed on the thread that made it.
class UnobservedStreamOps {
 public:
  UnobservedStreamOps();
  ~UnobservedStreamOps();
  UnobservedStreamOps(const UnobservedStreamOps&) = delete;
  UnobservedStreamOps& operator=(const UnobservedStreamOps&) = delete;
};

// Sends `note` to the installed observers.
void notify_stream_op(const StreamOpNote& note);

// A fresh id for a run, scope or staging copy (never 0).
int64_t next_stream_owner_id();

} // namespace torch_stage
