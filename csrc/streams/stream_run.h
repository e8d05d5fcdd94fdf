// StreamRun: the run-time state of one call of a multi-stream module, behind
// the ops torch.ops.torch_stage.{fork, set_stream, record_event, wait_event,
// record_stream, join} (csrc/ops/stream_ops.cpp). The FX pass
// (torch_stage/streams/fx/) emits, in this order:
//
//   run = fork(num_streams, side_streams, num_events, probes)
//   set_stream(run, s)        before a node on stream s (when s changes)
//   wait_event(run, e, s)     stream s waits on event e
//   record_stream(run, x, s)  x, produced on another stream, is used on s
//   <the node>
//   record_event(run, e, s)   stream s records event e after the node
//   ...
//   join(run, side_streams)   stream 0 waits on those streams; the caller's
//                             stream is current again
//
// (join(run, side_streams, keep) = record_stream(run, keep, 0), then join:
// the output's tensors made on side streams, marked used on the caller's
// stream in the call that ends the run rather than in a sync of their own.)
//
// and, to cut host cost, fuses each run of consecutive ops between two
// nodes into one call (the record after the previous node, then the
// prelude of the next):
//
//   sync(run, e, s, waits, keep)  = record_event(run, e, <current stream>)
//                                   (if e >= 0), set_stream(run, s),
//                                   wait_event(run, w, s) for w in waits,
//                                   record_stream(run, keep, s) (if keep is
//                                   not None), in that order, with the same
//                                   checks and StreamObserver notes.
//
// Device: that of the first non-CPU tensor found in `probes` (the module's
// inputs and one of its parameters, searched through lists, tuples and
// dicts). With none, or on a device without streams
// (CPU, Meta), the run is *inactive*: every op still checks its arguments
// and the plan's consistency (a wait on an event not yet recorded is an
// error) and then does nothing, so CPU results are the plain ones.
//
// Active run: stream 0 is the device's current stream when fork runs (the
// caller's), streams 1..N-1 come from StreamPool. Construction records a
// fork event on stream 0 and makes each listed side stream wait on it;
// set_stream exchanges the thread's current stream for the device; events
// come from StreamPool's free list and go back at join. record_stream tells
// the caching allocator (recordDataPtrOnStream) that the tensors' memory is
// used on stream s, so it is not handed out again before that work is done.
// (Design choice: the alternative, holding references until the join,
// raises peak memory by every cross-stream intermediate and is only safe if
// nobody else uses the pool's streams; the pass records each producer once
// per consuming stream, so the allocator cost that makes record_stream
// notorious (pytorch#76861) stays proportional to the cross-stream edges.)
//
// If the call fails between fork and join (an op throws), the run must be
// finished before the exception reaches the caller: the caller's stream is
// restored and waits on every forked side stream, so nothing is left
// running unordered and the caller's `except` block runs on its own stream.
// TorchScript and C++ callers get that from the destructor (the run dies as
// the frame unwinds); in Python the failed frame lives on in the traceback,
// so the multi-stream GraphModule calls abort_thread_runs when forward
// raises (torch_stage/streams/fx/multi_stream_pass.py). The destructor still
// finishes a run nobody finished.
//
// Autocast: from fork to join (or abort, on the owning thread) a run of
// more than one stream turns off autocast's cache of low-precision weight
// copies on its thread (the cache is per thread, not per stream: a weight
// cast on one stream would be read from another unordered) and turns it
// back on if it was on.
//
// Threads: a StreamRun belongs to the thread that forked it (the current
// stream is thread-local); any other thread gets an error. Different runs
// on different threads are independent: each has its own events.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ArrayRef.h>
#include <torch/custom_class.h>

#include "streams/stream_observer.h"

#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace torch_stage {

class StreamRun : public torch::CustomClassHolder {
 public:
  // The device a run uses for these probes: that of the first defined
  // tensor not on CPU, or nullopt (inactive).
  static std::optional<c10::Device> device_of(const c10::IValue& probes);

  // num_streams in 1..kMaxStreams; side_streams: distinct, each in
  // 1..num_streams-1 (the streams to fork); num_events >= 0.
  StreamRun(
      std::optional<c10::Device> device,
      int64_t num_streams,
      const std::vector<int64_t>& side_streams,
      int64_t num_events);
  ~StreamRun() override;

  // Makes this run what the constructor would make of these arguments, in
  // place, where no one can tell: a run on a device without streams (where
  // the run keeps only its checks' state), joined, and held by the caller
  // alone (a use count of 1: no ScriptObject of it), with no StreamObserver
  // listening (its notes tell runs apart by id). Returns false, the run
  // unchanged, otherwise. The arguments are checked first either way, as
  // the constructor checks them. Saves eager forwards on CPU the
  // allocation and registration of a run and of its Python object
  // (csrc/python/stream_bindings.cpp keeps the last joined run).
  bool restart(
      std::optional<c10::Device> device,
      int64_t num_streams,
      c10::ArrayRef<int64_t> side_streams,
      int64_t num_events);

  StreamRun(const StreamRun&) = delete;
  StreamRun& operator=(const StreamRun&) = delete;

  // Makes pool stream `stream` the thread's current stream for the device.
  void set_stream(int64_t stream);
  // Pool stream `stream` records event `event` (once per run).
  void record_event(int64_t event, int64_t stream);
  // Pool stream `stream` waits on `event`, which must have been recorded.
  void wait_event(int64_t event, int64_t stream);
  // Marks every tensor in `value` (tensors, lists, tuples, dicts, None) on
  // the run's device as used on pool stream `stream`.
  void record_stream(const c10::IValue& value, int64_t stream);
  // record_event(record, current stream) when record >= 0, set_stream(
  // stream), wait_event(w, stream) for each of `waits`, record_stream(keep,
  // stream) unless keep is None: one call for what the pass puts between
  // two nodes. A switch to the stream that is already current is not noted.
  void sync(
      int64_t record,
      int64_t stream,
      c10::ArrayRef<int64_t> waits,
      const c10::IValue& keep);
  // sync and record_event where all they do is their checks' bookkeeping:
  // on an inactive run, on its owner thread, with valid arguments and no
  // StreamObserver. Inline, so that an eager forward on CPU makes one call
  // into this library per op (the observer's flag), not five
  // (csrc/python/stream_bindings.cpp). Return
  // false, having changed nothing, otherwise: the caller then calls sync or
  // record_event, which do the work or say what is wrong.
  bool sync_inactive(
      int64_t record,
      int64_t stream,
      c10::ArrayRef<int64_t> waits) {
    const auto events = static_cast<int64_t>(recorded_.size());
    if (active_ || joined_ || stream < 0 || stream >= num_streams_ ||
        (record >= 0 && (record >= events || recorded_[record])) ||
        owner_ != std::this_thread::get_id()) {
      return false;
    }
    for (const int64_t e : waits) {
      if (e < 0 || e >= events || !(recorded_[e] || e == record)) {
        return false;
      }
    }
    if (stream_observer_active()) {
      return false;
    }
    if (record >= 0) {
      recorded_[record] = true;
    }
    current_ = stream;
    return true;
  }
  bool record_event_inactive(int64_t event, int64_t stream) {
    if (active_ || joined_ || stream < 0 || stream >= num_streams_ ||
        event < 0 || event >= static_cast<int64_t>(recorded_.size()) ||
        recorded_[event] || owner_ != std::this_thread::get_id() ||
        stream_observer_active()) {
      return false;
    }
    recorded_[event] = true;
    return true;
  }

  // Stream 0 waits on the given side streams; stream 0 is current again.
  // After join the run accepts no more ops.
  void join(c10::ArrayRef<int64_t> side_streams);
  // join where all it does is its checks' bookkeeping, as sync_inactive:
  // false, having changed nothing, where join would do more or throw.
  bool join_inactive(c10::ArrayRef<int64_t> side_streams);
  // record_stream(keep, 0) unless keep is None, then join: the outputs
  // made on side streams marked used on the caller's stream by the call
  // that ends the run.
  void join(c10::ArrayRef<int64_t> side_streams, const c10::IValue& keep);

  // The run's id in StreamObserver notes (csrc/streams/stream_observer.h).
  int64_t id() const {
    return id_;
  }
  // Runs forked on the calling thread and not finished (an abort depth).
  static int64_t thread_run_depth();
  // Finishes (joins, and restores the caller's stream) the runs forked on
  // the calling thread after it was at `depth`, newest first: the
  // multi-stream module calls it when forward raises, so the caller's
  // stream is current again before the exception leaves forward (the run
  // itself lives on in the traceback).
  static void abort_thread_runs(int64_t depth);

  bool is_active() const {
    return active_;
  }
  // Whether this run's calls go unprofiled: set by the Python fork
  // (csrc/python/stream_bindings.cpp) where no RecordFunction callback
  // listened when it forked or restarted the run. The inline paths there
  // (an inactive run's calls) then make no RecordFunction and do not look
  // for callbacks again (at every sync that look was a fifth of the call's
  // instructions), so a profiler started between an inactive run's fork
  // and its join does not see that run's calls; the next forward's are
  // seen. False for every other run: its calls look each time, as an
  // active run's do (they take the general path).
  bool unprofiled() const {
    return unprofiled_;
  }
  void set_unprofiled(bool unprofiled) {
    unprofiled_ = unprofiled;
  }
  // "cpu" for an inactive run, else the device ("cuda:0").
  std::string device() const;
  int64_t num_streams() const {
    return num_streams_;
  }
  // Ids of the pool's streams (index 0 = the caller's); empty when inactive.
  std::vector<int64_t> stream_ids() const;
  // Tensors marked with record_stream so far (active runs only).
  int64_t kept_tensors() const {
    return kept_tensors_;
  }

 private:
  // Enters the run in the thread's and the process's registries (for
  // abort_thread_runs) and notes the fork to the StreamObserver.
  void register_live();
  // The thread's part of register_live: the thread's registry of runs, and
  // autocast's cache.
  void enter_thread();
  static void check_fork(
      int64_t num_streams,
      c10::ArrayRef<int64_t> side_streams,
      int64_t num_events);
  void check_usable(const char* op) const;
  void check_stream(const char* op, int64_t stream) const;
  void check_event(const char* op, int64_t event) const;
  void keep(const c10::IValue& value, const c10::Stream& stream);
  // Stream 0 waits on each of `streams`; the caller's stream is current.
  void finish(c10::ArrayRef<int64_t> streams);

  std::thread::id owner_;
  // This run's id in StreamObserver notes.
  const int64_t id_;
  int64_t num_streams_;
  bool active_ = false;
  bool joined_ = false;
  std::optional<c10::Device> device_;
  // The device's stream and event interface (active runs only).
  const c10::impl::DeviceGuardImplInterface* impl_ = nullptr;
  std::vector<c10::Stream> streams_; // [0] = caller's, [k] = side stream k
  std::vector<int64_t> forked_;
  int64_t current_ = 0;
  std::vector<bool> recorded_;
  std::vector<c10::Event> events_;
  // Fork event, then one exit event per side stream.
  std::vector<c10::Event> own_events_;
  int64_t kept_tensors_ = 0;
  // The run turned autocast's weight cache off on its thread (see
  // register_live) and turns it back on when it finishes.
  bool restore_autocast_cache_ = false;
  bool unprofiled_ = false;
};

} // namespace torch_stage
