#include "streams/stream_scope.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "streams/stream_observer.h"
#include "streams/stream_pool.h"

namespace torch_stage {

namespace {

// The scopes entered on this thread, outermost first. Only their own thread
// reads or writes it, so it needs no lock.
thread_local std::vector<const StreamScope*> tls_entered;

// Device types with streams and events whose current device a scope may use,
// in the order they are tried. MPS is left out: it has one stream and no
// stream pool.
constexpr c10::DeviceType kStreamDevices[] = {
    c10::DeviceType::CUDA,
    c10::DeviceType::XPU,
    c10::DeviceType::MTIA,
    c10::DeviceType::PrivateUse1,
};

} // namespace

std::optional<c10::Device> StreamScope::default_device() {
  for (const auto type : kStreamDevices) {
    if (!c10::impl::hasDeviceGuardImpl(type)) {
      continue;
    }
    const auto* impl = c10::impl::getDeviceGuardImpl(type);
    // deviceCount() never throws: 0 on a CUDA build without a visible GPU.
    if (impl->deviceCount() > 0) {
      return impl->getDevice();
    }
  }
  return std::nullopt;
}

StreamScope::StreamScope(int64_t index, std::optional<c10::Device> device)
    : index_(index),
      id_(next_stream_owner_id()),
      device_(
          device && device->type() != c10::DeviceType::CPU &&
                  device->type() != c10::DeviceType::Meta
              ? device
              : std::nullopt) {
  TORCH_CHECK_VALUE(
      index >= 0 && index < kMaxStreams,
      "torch_stage.stream(",
      index,
      "): stream id ",
      index,
      " is outside the pool of ",
      kMaxStreams,
      " streams (valid ids: 0..",
      kMaxStreams - 1,
      ")");
  if (device_) {
    impl_ = c10::impl::getDeviceGuardImpl(device_->type());
  }
}

StreamScope::~StreamScope() {
  if (!entered_) {
    return;
  }
  try {
    if (std::this_thread::get_id() == owner_) {
      // Drop this scope (and any inner one left open) from the thread's
      // stack; other threads' stacks never hold it.
      auto it = std::find(tls_entered.begin(), tls_entered.end(), this);
      tls_entered.erase(it, tls_entered.end());
    }
    finish();
  } catch (...) {
    // A destructor must not throw; the device reports a failed record or
    // wait at its next synchronisation.
  }
}

void StreamScope::enter() {
  TORCH_CHECK(
      !entered_,
      "torch_stage.stream(",
      index_,
      "): this scope is already entered; enter a new torch_stage.stream(",
      index_,
      ") instead");
  if (device_) {
    const c10::Stream current = impl_->getStream(*device_);
    // Stream 0 is the enclosing stream of the outermost scope entered on
    // this thread for the device, or the current stream if there is none.
    std::optional<c10::Stream> base;
    for (const StreamScope* s : tls_entered) {
      if (s->device_ == device_) {
        base = s->enclosing_;
        break;
      }
    }
    const c10::Stream target = index_ == 0
        ? base.value_or(current)
        : StreamPool::side_streams(*device_, index_ + 1).back();
    if (target != current) {
      events_ = StreamPool::acquire_events(*device_, 2);
      // Fork: the block starts after everything queued so far, which may
      // produce what it reads or still use memory it may be handed.
      events_[0].record(current);
      events_[0].block(target);
      impl_->exchangeStream(target);
    }
    enclosing_ = current;
    target_ = target;
  }
  owner_ = std::this_thread::get_id();
  entered_ = true;
  tls_entered.push_back(this);
  if (stream_observer_active()) {
    StreamOpNote note;
    note.op = "scope_enter";
    note.owner = id_;
    note.stream = index_;
    notify_stream_op(note);
  }
}

void StreamScope::exit() {
  TORCH_CHECK(
      entered_,
      "torch_stage.stream(",
      index_,
      "): exit without enter (use the scope in a `with` statement)");
  TORCH_CHECK(
      std::this_thread::get_id() == owner_,
      "torch_stage.stream(",
      index_,
      "): exited on another thread than the one that entered it; the "
      "current stream is per thread");
  TORCH_CHECK(
      !tls_entered.empty() && tls_entered.back() == this,
      "torch_stage.stream(",
      index_,
      "): scopes must be exited innermost first");
  tls_entered.pop_back();
  finish();
}

void StreamScope::finish() {
  entered_ = false;
  if (stream_observer_active()) {
    StreamOpNote note;
    note.op = "scope_exit";
    note.owner = id_;
    note.stream = index_;
    note.owner_thread = std::this_thread::get_id() == owner_;
    notify_stream_op(note);
  }
  if (!device_ || !target_) {
    return;
  }
  const c10::Stream target = *target_;
  const c10::Stream enclosing = *enclosing_;
  target_.reset();
  enclosing_.reset();
  if (target == enclosing) {
    return;
  }
  // The current stream is thread-local: only the entering thread restores it
  // (a destructor may run elsewhere); the join is device work, valid anywhere.
  if (std::this_thread::get_id() == owner_) {
    impl_->exchangeStream(enclosing);
  }
  // Join: what follows the block starts after it, on the enclosing stream.
  events_[1].record(target);
  events_[1].block(enclosing);
  StreamPool::release_events(*device_, std::move(events_));
  events_.clear();
}

std::string StreamScope::device() const {
  return device_ ? device_->str() : "cpu";
}

int64_t StreamScope::stream_id() const {
  TORCH_CHECK(
      target_.has_value(),
      "torch_stage.stream(",
      index_,
      "): stream_id() needs an entered scope on a device with streams");
  return target_->id();
}

int64_t StreamScope::enclosing_stream_id() const {
  TORCH_CHECK(
      enclosing_.has_value(),
      "torch_stage.stream(",
      index_,
      "): enclosing_stream_id() needs an entered scope on a device with "
      "streams");
  return enclosing_->id();
}

} // namespace torch_stage
