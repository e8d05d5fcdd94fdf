#include "streams/stream_observer.h"

#include <atomic>
#include <mutex>
#include <utility>

namespace torch_stage {

namespace {

std::atomic<bool> g_active{false};
std::atomic<int64_t> g_next_id{1};

// The observer is swapped under the mutex and called through a copy of the
// pointer, so a concurrent uninstall never destroys one that is running.
std::mutex& observer_mutex() {
  static auto* m = new std::mutex();
  return *m;
}

std::shared_ptr<const StreamObserver>& observer_slot() {
  // Never destroyed: operations may still run from static destructors.
  static auto* slot = new std::shared_ptr<const StreamObserver>();
  return *slot;
}

} // namespace

void set_stream_observer(std::shared_ptr<const StreamObserver> observer) {
  std::shared_ptr<const StreamObserver> old;
  {
    std::lock_guard<std::mutex> lock(observer_mutex());
    old = std::exchange(observer_slot(), std::move(observer));
    g_active.store(observer_slot() != nullptr, std::memory_order_release);
  }
  // `old` is released here, outside the lock (its destructor may need the
  // GIL).
}

bool stream_observer_active() {
  return g_active.load(std::memory_order_acquire);
}

void notify_stream_op(const StreamOpNote& note) {
  std::shared_ptr<const StreamObserver> observer;
  {
    std::lock_guard<std::mutex> lock(observer_mutex());
    observer = observer_slot();
  }
  if (observer) {
    (*observer)(note);
  }
}

int64_t next_stream_owner_id() {
  return g_next_id.fetch_add(1, std::memory_order_relaxed);
}

} // namespace torch_stage
