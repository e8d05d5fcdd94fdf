#include "streams/stream_run.h"

#include <ATen/autocast_mode.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "streams/stream_observer.h"
#include "streams/stream_pool.h"

namespace torch_stage {

namespace {

bool has_streams(c10::DeviceType type) {
  return type != c10::DeviceType::CPU && type != c10::DeviceType::Meta;
}

// Runs forked on this thread and not yet finished here, oldest first, by
// id: abort_thread_runs finishes those above a depth. Only the owning
// thread reads or writes its vector.
thread_local std::vector<int64_t> tls_runs;

// Every live run by id, so an abort never touches a destroyed run. Guards
// the map and, during an abort, the runs it finishes (recursive: finishing
// notifies the observer, whose Python code may drop the last reference of
// another run on this thread).
std::recursive_mutex& live_mutex() {
  static auto* m = new std::recursive_mutex();
  return *m;
}

std::unordered_map<int64_t, StreamRun*>& live_runs() {
  static auto* runs = new std::unordered_map<int64_t, StreamRun*>();
  return *runs;
}

void notify(
    const char* op,
    int64_t owner,
    int64_t stream,
    int64_t event = -1,
    std::vector<int64_t> streams = {},
    c10::IValue value = {},
    bool owner_thread = true) {
  StreamOpNote note;
  note.op = op;
  note.owner = owner;
  note.stream = stream;
  note.event = event;
  note.streams = std::move(streams);
  note.value = std::move(value);
  note.owner_thread = owner_thread;
  notify_stream_op(note);
}

// Whether autocast is on for any device type on this thread: its dispatch
// keys are excluded from the thread's key set while it is off.
bool autocast_on() {
  return !c10::impl::tls_local_dispatch_key_set().excluded_.isSupersetOf(
      c10::autocast_dispatch_keyset);
}

} // namespace

std::optional<c10::Device> StreamRun::device_of(const c10::IValue& probes) {
  if (probes.isTensor()) {
    const at::Tensor& t = probes.toTensor();
    if (t.defined() && t.device().type() != c10::DeviceType::CPU) {
      return t.device();
    }
    return std::nullopt;
  }
  auto first = [](const auto& items) -> std::optional<c10::Device> {
    for (const auto& item : items) {
      if (auto d = device_of(item)) {
        return d;
      }
    }
    return std::nullopt;
  };
  if (probes.isList()) {
    return first(probes.toListRef());
  }
  if (probes.isTuple()) {
    return first(probes.toTupleRef().elements());
  }
  if (probes.isGenericDict()) {
    for (const auto& item : probes.toGenericDict()) {
      if (auto d = device_of(item.value())) {
        return d;
      }
    }
  }
  return std::nullopt;
}

void StreamRun::check_fork(
    int64_t num_streams,
    c10::ArrayRef<int64_t> side_streams,
    int64_t num_events) {
  TORCH_CHECK_VALUE(
      num_streams >= 1 && num_streams <= kMaxStreams,
      "torch_stage.fork: num_streams must be in 1..",
      kMaxStreams,
      ", got ",
      num_streams);
  TORCH_CHECK_VALUE(
      num_events >= 0,
      "torch_stage.fork: num_events must be >= 0, got ",
      num_events);
  for (size_t k = 0; k < side_streams.size(); ++k) {
    const int64_t s = side_streams[k];
    TORCH_CHECK_VALUE(
        s >= 1 && s < num_streams,
        "torch_stage.fork: side stream ",
        s,
        " is outside 1..",
        num_streams - 1,
        " (stream 0 is the caller's and is not forked)");
    TORCH_CHECK_VALUE(
        std::find(side_streams.begin(), side_streams.begin() + k, s) ==
            side_streams.begin() + k,
        "torch_stage.fork: side stream ",
        s,
        " is listed twice");
  }
}

StreamRun::StreamRun(
    std::optional<c10::Device> device,
    int64_t num_streams,
    const std::vector<int64_t>& side_streams,
    int64_t num_events)
    : owner_(std::this_thread::get_id()),
      id_(next_stream_owner_id()),
      num_streams_(num_streams),
      device_(device) {
  check_fork(num_streams, side_streams, num_events);
  forked_ = side_streams;
  recorded_.assign(static_cast<size_t>(num_events), false);
  if (!device_ || !has_streams(device_->type())) {
    register_live();
    return;
  }
  impl_ = c10::impl::getDeviceGuardImpl(device_->type());
  streams_.push_back(impl_->getStream(*device_));
  for (const auto& s : StreamPool::side_streams(*device_, num_streams)) {
    streams_.push_back(s);
  }
  events_ = StreamPool::acquire_events(*device_, num_events);
  own_events_ = StreamPool::acquire_events(*device_, num_streams);
  active_ = true;
  // Fork: side streams start after everything the caller queued so far,
  // even when they read nothing of it (the allocator may hand them memory
  // that pending caller work still uses).
  if (!forked_.empty()) {
    own_events_[0].record(streams_[0]);
    for (const int64_t s : forked_) {
      own_events_[0].block(streams_[s]);
    }
  }
  register_live();
}

bool StreamRun::restart(
    std::optional<c10::Device> device,
    int64_t num_streams,
    c10::ArrayRef<int64_t> side_streams,
    int64_t num_events) {
  check_fork(num_streams, side_streams, num_events);
  // The observer tells runs apart by id, so it gets a new run; so does any
  // run another holder could still see (a ScriptObject of it, say).
  if ((device && has_streams(device->type())) || active_ || !joined_ ||
      restore_autocast_cache_ || stream_observer_active() ||
      c10::raw::intrusive_ptr::use_count(this) != 1) {
    return false;
  }
  owner_ = std::this_thread::get_id();
  device_ = device;
  num_streams_ = num_streams;
  joined_ = false;
  forked_.assign(side_streams.begin(), side_streams.end());
  current_ = 0;
  recorded_.assign(static_cast<size_t>(num_events), false);
  kept_tensors_ = 0;
  // Still in live_runs: the entry lives as long as the run.
  enter_thread();
  return true;
}

void StreamRun::register_live() {
  // Last in the constructor, after the note (an observer may throw): a
  // constructor that throws gets no destructor, and the registry must never
  // hold a run that does not exist.
  if (stream_observer_active()) {
    notify("fork", id_, num_streams_, -1, forked_);
  }
  {
    std::lock_guard<std::recursive_mutex> lock(live_mutex());
    auto& live = live_runs();
    // Ids of runs finished or destroyed on other threads stay behind here.
    tls_runs.erase(
        std::remove_if(
            tls_runs.begin(),
            tls_runs.end(),
            [&](int64_t id) { return live.count(id) == 0; }),
        tls_runs.end());
    live[id_] = this;
  }
  enter_thread();
}

void StreamRun::enter_thread() {
  tls_runs.push_back(id_);
  // Autocast keeps one low-precision copy of each weight per thread for the
  // whole autocast region, whatever the stream: a layer called on two
  // streams would read, on the second, the copy the first is still
  // making, with no event between them. For the run each use casts its
  // own copy: a cast more per reuse of a weight within one forward, and,
  // where one autocast region spans several forwards, per forward (the
  // usual region of one step clears the cache at every step anyway). Only
  // inside autocast: outside there is nothing cached, and with the cache
  // off every op pays more host time (torch.autocast's own enter sets the
  // cache as it asks, so a region opened inside forward is its own). Last
  // here, so a constructor that throws leaves the setting as it was.
  if (num_streams_ > 1 && autocast_on() &&
      at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
    restore_autocast_cache_ = true;
  }
}

StreamRun::~StreamRun() {
  {
    std::lock_guard<std::recursive_mutex> lock(live_mutex());
    live_runs().erase(id_);
  }
  if (joined_) {
    return;
  }
  try {
    finish(forked_);
  } catch (...) {
    // A destructor must not throw; the device reported the failure already
    // or will at its next synchronisation.
  }
}

void StreamRun::check_usable(const char* op) const {
  TORCH_CHECK(
      std::this_thread::get_id() == owner_,
      "torch_stage.",
      op,
      ": this stream run was forked on another thread; a run belongs to the "
      "thread (and so the current stream) of the call that forked it");
  TORCH_CHECK(
      !joined_,
      "torch_stage.",
      op,
      ": the stream run was already joined; fork a new one per call");
}

void StreamRun::check_stream(const char* op, int64_t stream) const {
  TORCH_CHECK_VALUE(
      stream >= 0 && stream < num_streams_,
      "torch_stage.",
      op,
      ": stream ",
      stream,
      " is outside the pool of ",
      num_streams_,
      " streams (valid: 0..",
      num_streams_ - 1,
      ")");
}

void StreamRun::check_event(const char* op, int64_t event) const {
  TORCH_CHECK_VALUE(
      event >= 0 && event < static_cast<int64_t>(recorded_.size()),
      "torch_stage.",
      op,
      ": event ",
      event,
      " does not exist (this run has ",
      recorded_.size(),
      " events)");
}

void StreamRun::set_stream(int64_t stream) {
  check_usable("set_stream");
  check_stream("set_stream", stream);
  if (stream_observer_active()) {
    notify("set_stream", id_, stream);
  }
  if (active_ && stream != current_) {
    impl_->exchangeStream(streams_[stream]);
  }
  current_ = stream;
}

void StreamRun::record_event(int64_t event, int64_t stream) {
  check_usable("record_event");
  check_event("record_event", event);
  check_stream("record_event", stream);
  TORCH_CHECK(
      !recorded_[event],
      "torch_stage.record_event: event ",
      event,
      " is recorded twice in one run (the stream plan is inconsistent)");
  recorded_[event] = true;
  if (stream_observer_active()) {
    notify("record_event", id_, stream, event);
  }
  if (active_) {
    events_[event].record(streams_[stream]);
  }
}

void StreamRun::wait_event(int64_t event, int64_t stream) {
  check_usable("wait_event");
  check_event("wait_event", event);
  check_stream("wait_event", stream);
  // Waiting on an event that was never recorded is a no-op on the device:
  // the consumer would run unordered. That is a broken plan, never a race
  // to tolerate.
  TORCH_CHECK(
      recorded_[event],
      "torch_stage.wait_event: stream ",
      stream,
      " waits on event ",
      event,
      ", which has not been recorded in this run (the stream plan is "
      "inconsistent)");
  if (stream_observer_active()) {
    notify("wait_event", id_, stream, event);
  }
  if (active_) {
    events_[event].block(streams_[stream]);
  }
}

void StreamRun::keep(const c10::IValue& value, const c10::Stream& stream) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (t.defined() && t.device() == *device_ && t.has_storage()) {
      impl_->recordDataPtrOnStream(t.storage().data_ptr(), stream);
      ++kept_tensors_;
    }
  } else if (value.isList()) {
    for (const auto& item : value.toListRef()) {
      keep(item, stream);
    }
  } else if (value.isTuple()) {
    for (const auto& item : value.toTupleRef().elements()) {
      keep(item, stream);
    }
  } else if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) {
      keep(item.value(), stream);
    }
  }
}

void StreamRun::record_stream(const c10::IValue& value, int64_t stream) {
  check_usable("record_stream");
  check_stream("record_stream", stream);
  if (stream_observer_active()) {
    notify("record_stream", id_, stream, -1, {}, value);
  }
  if (active_) {
    keep(value, streams_[stream]);
  }
}

void StreamRun::sync(
    int64_t record,
    int64_t stream,
    c10::ArrayRef<int64_t> waits,
    const c10::IValue& keep) {
  check_usable("sync");
  check_stream("sync", stream);
  if (record >= 0) {
    record_event(record, current_);
  }
  if (stream != current_) {
    set_stream(stream);
  }
  for (const int64_t e : waits) {
    wait_event(e, stream);
  }
  if (!keep.isNone()) {
    record_stream(keep, stream);
  }
}

void StreamRun::join(c10::ArrayRef<int64_t> side_streams) {
  check_usable("join");
  for (const int64_t s : side_streams) {
    TORCH_CHECK_VALUE(
        std::find(forked_.begin(), forked_.end(), s) != forked_.end(),
        "torch_stage.join: stream ",
        s,
        " was not forked by this run (forked: ",
        c10::IntArrayRef(forked_),
        ")");
  }
  finish(side_streams);
}

bool StreamRun::join_inactive(c10::ArrayRef<int64_t> side_streams) {
  if (active_ || joined_ || owner_ != std::this_thread::get_id() ||
      stream_observer_active()) {
    return false;
  }
  for (const int64_t s : side_streams) {
    if (std::find(forked_.begin(), forked_.end(), s) == forked_.end()) {
      return false;
    }
  }
  // Without streams or an observer, finish only leaves the thread's
  // registry and turns autocast's cache back on: nothing that throws.
  finish(side_streams);
  return true;
}

void StreamRun::join(
    c10::ArrayRef<int64_t> side_streams,
    const c10::IValue& keep) {
  if (!keep.isNone()) {
    record_stream(keep, 0);
  }
  join(side_streams);
}

int64_t StreamRun::thread_run_depth() {
  return static_cast<int64_t>(tls_runs.size());
}

void StreamRun::abort_thread_runs(int64_t depth) {
  std::lock_guard<std::recursive_mutex> lock(live_mutex());
  while (static_cast<int64_t>(tls_runs.size()) > std::max<int64_t>(depth, 0)) {
    const int64_t id = tls_runs.back();
    tls_runs.pop_back();
    auto it = live_runs().find(id);
    if (it != live_runs().end() && !it->second->joined_) {
      it->second->finish(it->second->forked_);
    }
  }
}

void StreamRun::finish(c10::ArrayRef<int64_t> streams) {
  joined_ = true;
  const bool on_owner = std::this_thread::get_id() == owner_;
  if (on_owner) {
    auto it = std::find(tls_runs.rbegin(), tls_runs.rend(), id_);
    if (it != tls_runs.rend()) {
      tls_runs.erase(std::next(it).base());
    }
  }
  if (on_owner && restore_autocast_cache_) {
    // (The setting is thread-local: a run finished by its destructor on
    // another thread leaves the owner's, which that thread cannot reach.)
    at::autocast::set_autocast_cache_enabled(true);
    restore_autocast_cache_ = false;
  }
  if (stream_observer_active()) {
    notify("join", id_, 0, -1, streams.vec(), {}, on_owner);
  }
  if (!active_) {
    return;
  }
  // Restoring the current stream is only meaningful on the owning thread
  // (it is thread-local); joins are device work and valid from any thread.
  if (on_owner && current_ != 0) {
    impl_->exchangeStream(streams_[0]);
  }
  current_ = 0;
  for (const int64_t s : streams) {
    own_events_[s].record(streams_[s]);
    own_events_[s].block(streams_[0]);
  }
  StreamPool::release_events(*device_, std::move(events_));
  StreamPool::release_events(*device_, std::move(own_events_));
}

std::string StreamRun::device() const {
  return device_ ? device_->str() : "cpu";
}

std::vector<int64_t> StreamRun::stream_ids() const {
  std::vector<int64_t> ids;
  for (const auto& s : streams_) {
    ids.push_back(s.id());
  }
  return ids;
}

} // namespace torch_stage
