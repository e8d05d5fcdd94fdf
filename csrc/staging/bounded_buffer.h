// BoundedBuffer: a blocking, bounded, multi-producer multi-consumer FIFO.
//
// This header is plain C++17 (no torch headers) so that it and its tests can
// be built under ThreadSanitizer and AddressSanitizer (`make tsan`, `make
// asan`).
//
// Semantics
// ---------
// * Bounded: at most capacity() items are held. When a byte limit is set
//   (byte_limit() > 0), the items held also weigh at most byte_limit() bytes,
//   as measured by the SizeOf functor given at construction; an item heavier
//   than the whole limit can never fit and is refused at once.
// * FIFO: items leave in the order they were put. With several producers the
//   order between producers is the order in which they acquired the lock.
// * Exactly once: each item put is taken by exactly one consumer, or is still
//   in the buffer (size()) or was discarded by cancel() (counted in stats).
// * close(): no more items are accepted (put fails with
//   BufferStatus::kClosed); consumers drain what is buffered, then every take
//   returns kClosed (end of stream). Producers blocked in put wake and fail.
// * cancel(): every waiter, producer or consumer, wakes and fails with
//   kCancelled at once; buffered items are discarded (counted as dropped);
//   every later call fails with kCancelled. Cancel wins over close.
//
// Threads
// -------
// Every public method may be called from any thread, concurrently, including
// close() and cancel() while other threads are blocked in put/take. The
// destructor must not run while another thread is inside a method: owners
// close or cancel first and join their threads (RAII owners such as
// StagingArea hold the buffer by shared ownership for this reason).
//
// Blocking and timeouts
// ---------------------
// put/take block without bound, but always return on close() or cancel().
// try_put_for/try_take_for (and the _until forms) give up at a deadline and
// report kTimeout; the item given to a put that timed out is left with the
// caller (never silently dropped).
//
// Locking
// -------
// One mutex (mu_) guards every member below it; two condition variables
// signal "space may be free" (not_full_) and "an item may be ready"
// (not_empty_). Counters are read under the lock so stats() is a consistent
// snapshot.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

namespace torch_stage {

enum class BufferStatus {
  kOk,
  kTimeout, // the deadline passed before the operation could complete
  kClosed, // put: the buffer is closed; take: closed and drained
  kCancelled, // cancel() was called
  kTooLarge, // put: the item alone weighs more than byte_limit()
};

inline const char* to_string(BufferStatus status) {
  switch (status) {
    case BufferStatus::kOk:
      return "ok";
    case BufferStatus::kTimeout:
      return "timeout";
    case BufferStatus::kClosed:
      return "closed";
    case BufferStatus::kCancelled:
      return "cancelled";
    case BufferStatus::kTooLarge:
      return "too large";
  }
  return "unknown";
}

// A consistent snapshot of a buffer's counters (see BoundedBuffer::stats()).
struct BufferStats {
  std::size_t capacity = 0;
  std::size_t byte_limit = 0;
  std::size_t size = 0; // items held now
  std::size_t bytes = 0; // bytes held now
  std::uint64_t put = 0; // items accepted
  std::uint64_t taken = 0; // items handed to consumers
  std::uint64_t dropped = 0; // items discarded by cancel()
  std::size_t max_size = 0; // the most items ever held at once
  // Sum over takes of the items held just before the take; divided by `taken`
  // it gives the mean occupancy consumers found (near capacity: the consumer
  // is the bottleneck; near 1 or 0: the producers are).
  std::uint64_t occupancy_sum = 0;
  std::int64_t consumer_wait_ns = 0; // time consumers spent waiting for items
  std::int64_t producer_blocked_ns = 0; // time producers spent waiting for
                                        // space
  bool closed = false;
  bool cancelled = false;
};

// The steady-clock time `timeout` from now, saturated at time_point::max()
// so that huge timeouts (hours::max(), 2**63 - 1 ms) wait forever instead of
// overflowing into the past: compared in floating point, since converting
// such a timeout to the clock's nanoseconds is itself the overflow.
template <typename Rep, typename Period>
std::chrono::steady_clock::time_point deadline_after(
    std::chrono::duration<Rep, Period> timeout) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  const auto max_wait = Clock::time_point::max() - now;
  using Seconds = std::chrono::duration<double>;
  if (Seconds(timeout) >= Seconds(max_wait)) {
    return Clock::time_point::max();
  }
  return now + std::chrono::duration_cast<Clock::duration>(timeout);
}

template <typename T>
struct ZeroSize {
  std::size_t operator()(const T&) const {
    return 0;
  }
};

template <typename T, typename SizeOf = ZeroSize<T>>
class BoundedBuffer {
 public:
  using Clock = std::chrono::steady_clock;

  // Throws std::invalid_argument unless capacity >= 1. byte_limit == 0 means
  // no byte limit.
  explicit BoundedBuffer(
      std::size_t capacity,
      std::size_t byte_limit = 0,
      SizeOf size_of = SizeOf())
      : capacity_(capacity),
        byte_limit_(byte_limit),
        size_of_(std::move(size_of)) {
    if (capacity < 1) {
      throw std::invalid_argument(
          "capacity must be >= 1, got " + std::to_string(capacity));
    }
  }

  BoundedBuffer(const BoundedBuffer&) = delete;
  BoundedBuffer& operator=(const BoundedBuffer&) = delete;

  // Blocks until there is room, then appends `item`. Returns kOk, kClosed,
  // kCancelled or kTooLarge; on failure `item` is left untouched.
  BufferStatus put(T& item) {
    return put_impl(item, nullptr);
  }
  BufferStatus put(T&& item) {
    return put_impl(item, nullptr);
  }

  // As put(), but gives up with kTimeout once `timeout` has passed (a zero or
  // negative timeout only tries once). On any status but kOk the caller
  // keeps `item`.
  template <typename Rep, typename Period>
  BufferStatus try_put_for(
      T& item,
      std::chrono::duration<Rep, Period> timeout) {
    return try_put_until(item, deadline_after(timeout));
  }
  BufferStatus try_put_until(T& item, Clock::time_point deadline) {
    return put_impl(item, &deadline);
  }

  // Blocks until an item is ready and moves it into `out`. Returns kOk,
  // kClosed (closed and drained: end of stream) or kCancelled.
  BufferStatus take(T& out) {
    return take_impl(out, nullptr);
  }

  // As take(), but gives up with kTimeout once `timeout` has passed.
  template <typename Rep, typename Period>
  BufferStatus try_take_for(
      T& out,
      std::chrono::duration<Rep, Period> timeout) {
    return try_take_until(out, deadline_after(timeout));
  }
  BufferStatus try_take_until(T& out, Clock::time_point deadline) {
    return take_impl(out, &deadline);
  }

  // Refuses further puts; consumers drain, then see kClosed. Idempotent.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    not_full_.notify_all();
    not_empty_.notify_all();
  }

  // Wakes and fails every waiter; discards what is buffered. Idempotent.
  void cancel() {
    std::deque<T> discarded;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!cancelled_) {
        dropped_ += items_.size();
      }
      cancelled_ = true;
      discarded.swap(items_);
      bytes_ = 0;
    }
    not_full_.notify_all();
    not_empty_.notify_all();
    // `discarded` is destroyed here, outside the lock: item destructors may be
    // slow (tensor storage, Python objects) and must not stall other threads.
  }

  bool is_closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }
  bool is_cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }
  std::size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return items_.size();
  }
  std::size_t capacity() const {
    std::lock_guard<std::mutex> lock(mu_);
    return capacity_;
  }

  // Changes the item bound (the stage's auto-tuning). Growing wakes blocked
  // producers; shrinking below what is held keeps the items and refuses puts
  // until consumers took enough. Throws std::invalid_argument unless >= 1.
  void set_capacity(std::size_t capacity) {
    if (capacity < 1) {
      throw std::invalid_argument(
          "capacity must be >= 1, got " + std::to_string(capacity));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      capacity_ = capacity;
    }
    not_full_.notify_all();
  }
  std::size_t byte_limit() const {
    return byte_limit_;
  }

  BufferStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    BufferStats s;
    s.capacity = capacity_;
    s.byte_limit = byte_limit_;
    s.size = items_.size();
    s.bytes = bytes_;
    s.put = put_count_;
    s.taken = taken_count_;
    s.dropped = dropped_;
    s.max_size = max_size_;
    s.occupancy_sum = occupancy_sum_;
    s.consumer_wait_ns = consumer_wait_ns_;
    s.producer_blocked_ns = producer_blocked_ns_;
    s.closed = closed_;
    s.cancelled = cancelled_;
    return s;
  }

 private:
  // Requires mu_ held.
  bool has_room(std::size_t item_bytes) const {
    if (items_.size() >= capacity_) {
      return false;
    }
    // An empty buffer always admits an item that fits the limit at all, so a
    // heavy item cannot starve behind a limit it alone satisfies.
    return byte_limit_ == 0 || items_.empty() ||
        bytes_ + item_bytes <= byte_limit_;
  }

  BufferStatus put_impl(T& item, const Clock::time_point* deadline) {
    const std::size_t item_bytes = byte_limit_ == 0 ? 0 : size_of_(item);
    if (byte_limit_ != 0 && item_bytes > byte_limit_) {
      return BufferStatus::kTooLarge;
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (cancelled_) {
      return BufferStatus::kCancelled;
    }
    if (closed_) {
      return BufferStatus::kClosed;
    }
    if (!has_room(item_bytes)) {
      const auto start = Clock::now();
      // A deadline already passed means "try once": skip the wait (a futex
      // call and a mutex round trip) that could only time out.
      if (deadline != nullptr && *deadline <= start) {
        return BufferStatus::kTimeout;
      }
      auto ready = [&] {
        return cancelled_ || closed_ || has_room(item_bytes);
      };
      bool woke = true;
      if (deadline == nullptr) {
        not_full_.wait(lock, ready);
      } else {
        woke = not_full_.wait_until(lock, *deadline, ready);
      }
      producer_blocked_ns_ += elapsed_ns(start);
      if (cancelled_) {
        return BufferStatus::kCancelled;
      }
      if (closed_) {
        return BufferStatus::kClosed;
      }
      if (!woke) {
        return BufferStatus::kTimeout;
      }
    }
    items_.push_back(std::move(item));
    bytes_ += item_bytes;
    ++put_count_;
    if (items_.size() > max_size_) {
      max_size_ = items_.size();
    }
    lock.unlock();
    not_empty_.notify_one();
    return BufferStatus::kOk;
  }

  BufferStatus take_impl(T& out, const Clock::time_point* deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (items_.empty() && !cancelled_ && !closed_) {
      const auto start = Clock::now();
      if (deadline != nullptr && *deadline <= start) {
        return BufferStatus::kTimeout;
      }
      auto ready = [&] { return cancelled_ || closed_ || !items_.empty(); };
      if (deadline == nullptr) {
        not_empty_.wait(lock, ready);
      } else {
        not_empty_.wait_until(lock, *deadline, ready);
      }
      consumer_wait_ns_ += elapsed_ns(start);
    }
    if (cancelled_) {
      return BufferStatus::kCancelled;
    }
    if (items_.empty()) {
      return closed_ ? BufferStatus::kClosed : BufferStatus::kTimeout;
    }
    occupancy_sum_ += items_.size();
    T item(std::move(items_.front()));
    items_.pop_front();
    if (byte_limit_ != 0) {
      bytes_ -= size_of_(item);
    }
    ++taken_count_;
    lock.unlock();
    // Assigned outside the lock: whatever `out` held before is destroyed
    // here, and item destructors may take other locks (the GIL).
    out = std::move(item);
    // Under a byte limit one take may make room for several small items.
    if (byte_limit_ != 0) {
      not_full_.notify_all();
    } else {
      not_full_.notify_one();
    }
    return BufferStatus::kOk;
  }

  static std::int64_t elapsed_ns(Clock::time_point start) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               Clock::now() - start)
        .count();
  }

  std::size_t capacity_; // guarded by mu_ (set_capacity)
  const std::size_t byte_limit_;
  const SizeOf size_of_;

  mutable std::mutex mu_;
  std::condition_variable not_full_; // waited on by producers
  std::condition_variable not_empty_; // waited on by consumers

  // All guarded by mu_.
  std::deque<T> items_;
  std::size_t bytes_ = 0;
  bool closed_ = false;
  bool cancelled_ = false;
  std::uint64_t put_count_ = 0;
  std::uint64_t taken_count_ = 0;
  std::uint64_t dropped_ = 0;
  std::size_t max_size_ = 0;
  std::uint64_t occupancy_sum_ = 0;
  std::int64_t consumer_wait_ns_ = 0;
  std::int64_t producer_blocked_ns_ = 0;
};

} // namespace torch_stage
