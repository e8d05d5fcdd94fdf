#include "streams/stream_observer.h"

#include <array>
#include <atomic>
#include <mutex>
#include <utility>

namespace torch_stage {

namespace {

std::atomic<bool> g_active{false};
std::atomic<int64_t> g_next_id{1};
thread_local int t_unobserved = 0;

// Observers are swapped under the mutex and called through copies of the
// pointers, so a concurrent uninstall never destroys one that is running.
std::mutex& observer_mutex() {
  static auto* m = new std::mutex();
  return *m;
}

using Slots =
    std::array<std::shared_ptr<const StreamObserver>, kStreamObserverSlots>;

Slots& observer_slots() {
  // Never destroyed: operations may still run from static destructors.
  static auto* slots = new Slots();
  return *slots;
}

} // namespace

void set_stream_observer(
    StreamObserverSlot slot,
    std::shared_ptr<const StreamObserver> observer) {
  std::shared_ptr<const StreamObserver> old;
  {
    std::lock_guard<std::mutex> lock(observer_mutex());
    Slots& slots = observer_slots();
    old = std::exchange(slots[static_cast<size_t>(slot)], std::move(observer));
    bool any = false;
    for (const auto& o : slots) {
      any = any || o != nullptr;
    }
    g_active.store(any, std::memory_order_release);
  }
  // `old` is released here, outside the lock (its destructor may need the
  // GIL).
}

bool stream_observer_active() {
  return g_active.load(std::memory_order_acquire) && t_unobserved == 0;
}

UnobservedStreamOps::UnobservedStreamOps() {
  ++t_unobserved;
}

UnobservedStreamOps::~UnobservedStreamOps() {
  --t_unobserved;
}

void notify_stream_op(const StreamOpNote& note) {
  Slots observers;
  {
    std::lock_guard<std::mutex> lock(observer_mutex());
    observers = observer_slots();
  }
  for (const auto& observer : observers) {
    if (observer) {
      (*observer)(note);
    }
  }
}

int64_t next_stream_owner_id() {
  return g_next_id.fetch_add(1, std::memory_order_relaxed);
}

} // namespace torch_stage
