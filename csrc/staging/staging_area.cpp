#include "staging/staging_area.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <chrono>
#include <utility>

namespace torch_stage {

std::size_t BundleBytes::operator()(const TensorBundle& bundle) const {
  std::size_t bytes = 0;
  for (const auto& t : bundle) {
    if (t.defined()) {
      bytes += static_cast<std::size_t>(t.numel()) * t.element_size();
    }
  }
  return bytes;
}

namespace {

std::size_t checked_capacity(int64_t capacity) {
  TORCH_CHECK_VALUE(
      capacity >= 1, "StagingArea capacity must be >= 1, got ", capacity);
  return static_cast<std::size_t>(capacity);
}

std::size_t checked_byte_limit(int64_t byte_limit) {
  TORCH_CHECK_VALUE(
      byte_limit >= 0,
      "StagingArea byte_limit must be >= 0 (0 means no limit), got ",
      byte_limit);
  return static_cast<std::size_t>(byte_limit);
}

std::chrono::milliseconds checked_timeout(int64_t timeout_ms, const char* op) {
  TORCH_CHECK_VALUE(
      timeout_ms >= 0,
      "StagingArea.",
      op,
      ": timeout_ms must be >= 0 (0 tries once without waiting), got ",
      timeout_ms);
  return std::chrono::milliseconds(timeout_ms);
}

void check_bundle(const TensorBundle& tensors, const char* op) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(
        tensors[i].defined(),
        "StagingArea.",
        op,
        ": tensor ",
        i,
        " of the bundle is undefined; every element must be a tensor");
  }
}

} // namespace

StagingArea::StagingArea(int64_t capacity, int64_t byte_limit)
    : buffer_(checked_capacity(capacity), checked_byte_limit(byte_limit)) {}

StagingArea::~StagingArea() {
  // No thread can be inside a method (each holds a reference), but items
  // still buffered are released here and counted as dropped.
  buffer_.cancel();
}

std::string StagingArea::error_message(
    BufferStatus status,
    const char* op,
    const TensorBundle* bundle) const {
  switch (status) {
    case BufferStatus::kClosed:
      return c10::str(
          "[StageClosed] StagingArea.",
          op,
          bundle != nullptr
              ? ": the area is closed and accepts no more items"
              : ": the area is closed and drained (end of stream)");
    case BufferStatus::kCancelled:
      return c10::str(
          "[StageCancelled] StagingArea.",
          op,
          ": the area was cancelled; its items were discarded");
    case BufferStatus::kTooLarge:
      return c10::str(
          "StagingArea.",
          op,
          ": the bundle holds ",
          bundle != nullptr ? BundleBytes()(*bundle) : 0,
          " bytes, more than the area's byte_limit of ",
          buffer_.byte_limit(),
          " bytes, and can never fit; raise byte_limit or split the bundle");
    case BufferStatus::kOk:
    case BufferStatus::kTimeout:
      break;
  }
  return c10::str(
      "StagingArea.", op, ": unexpected status ", to_string(status));
}

void StagingArea::fail(
    BufferStatus status,
    const char* op,
    const TensorBundle* bundle) const {
  TORCH_CHECK_VALUE(
      status != BufferStatus::kTooLarge, error_message(status, op, bundle));
  TORCH_INTERNAL_ASSERT(
      status == BufferStatus::kClosed || status == BufferStatus::kCancelled,
      error_message(status, op, bundle));
  TORCH_CHECK(false, error_message(status, op, bundle));
}

void StagingArea::put(TensorBundle tensors) {
  check_bundle(tensors, "put");
  const auto status = buffer_.put(tensors);
  if (status != BufferStatus::kOk) {
    fail(status, "put", &tensors);
  }
}

TensorBundle StagingArea::take() {
  TensorBundle out;
  const auto status = buffer_.take(out);
  if (status != BufferStatus::kOk) {
    fail(status, "take", nullptr);
  }
  return out;
}

bool StagingArea::try_put(TensorBundle tensors, int64_t timeout_ms) {
  const auto timeout = checked_timeout(timeout_ms, "try_put");
  check_bundle(tensors, "try_put");
  const auto status = buffer_.try_put_for(tensors, timeout);
  if (status == BufferStatus::kTimeout) {
    return false;
  }
  if (status != BufferStatus::kOk) {
    fail(status, "try_put", &tensors);
  }
  return true;
}

std::optional<TensorBundle> StagingArea::try_take(int64_t timeout_ms) {
  const auto timeout = checked_timeout(timeout_ms, "try_take");
  TensorBundle out;
  const auto status = buffer_.try_take_for(out, timeout);
  if (status == BufferStatus::kTimeout) {
    return std::nullopt;
  }
  if (status != BufferStatus::kOk) {
    fail(status, "try_take", nullptr);
  }
  return out;
}

void StagingArea::close() {
  buffer_.close();
}

void StagingArea::cancel() {
  buffer_.cancel();
}

bool StagingArea::is_closed() const {
  return buffer_.is_closed();
}

bool StagingArea::is_cancelled() const {
  return buffer_.is_cancelled();
}

int64_t StagingArea::size() const {
  return static_cast<int64_t>(buffer_.size());
}

int64_t StagingArea::capacity() const {
  return static_cast<int64_t>(buffer_.capacity());
}

int64_t StagingArea::byte_limit() const {
  return static_cast<int64_t>(buffer_.byte_limit());
}

c10::Dict<std::string, int64_t> StagingArea::stats() const {
  const BufferStats s = buffer_.stats();
  c10::Dict<std::string, int64_t> d;
  d.insert("capacity", static_cast<int64_t>(s.capacity));
  d.insert("byte_limit", static_cast<int64_t>(s.byte_limit));
  d.insert("size", static_cast<int64_t>(s.size));
  d.insert("bytes", static_cast<int64_t>(s.bytes));
  d.insert("put", static_cast<int64_t>(s.put));
  d.insert("taken", static_cast<int64_t>(s.taken));
  d.insert("dropped", static_cast<int64_t>(s.dropped));
  d.insert("max_size", static_cast<int64_t>(s.max_size));
  d.insert("occupancy_sum", static_cast<int64_t>(s.occupancy_sum));
  d.insert("consumer_wait_ns", s.consumer_wait_ns);
  d.insert("producer_blocked_ns", s.producer_blocked_ns);
  d.insert("closed", s.closed ? 1 : 0);
  d.insert("cancelled", s.cancelled ? 1 : 0);
  return d;
}

std::vector<int64_t> StagingArea::config() const {
  return {capacity(), byte_limit()};
}

} // namespace torch_stage
