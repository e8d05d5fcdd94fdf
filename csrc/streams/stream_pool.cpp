#include "streams/stream_pool.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

namespace torch_stage {

namespace {

struct DeviceState {
  std::vector<c10::Stream> side; // guarded by Registry::mutex
  std::vector<c10::Stream> staging; // guarded by Registry::mutex
  std::optional<c10::Stream> capture; // guarded by Registry::mutex
  std::vector<c10::Event> free_events; // guarded by Registry::mutex
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<c10::Device, DeviceState> devices; // guarded by mutex
};

// Never destroyed: streams and events may still be released from other
// static destructors at exit.
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

} // namespace

std::vector<c10::Stream> StreamPool::side_streams(
    c10::Device device,
    int64_t num_streams) {
  TORCH_CHECK_VALUE(
      num_streams >= 1 && num_streams <= kMaxStreams,
      "num_streams must be in 1..",
      kMaxStreams,
      ", got ",
      num_streams,
      ": PyTorch's stream pool hands out ",
      kMaxStreams,
      " streams per priority round robin, so more would alias ",
      "(stream k and k+32 are one stream; pytorch#9646)");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto& held = r.devices[device].side;
  const size_t wanted = static_cast<size_t>(num_streams - 1);
  if (held.size() < wanted) {
    const c10::impl::VirtualGuardImpl impl(device.type());
    while (held.size() < wanted) {
      // Other code takes from the same round robin, so a stream we already
      // hold can come back before the pool is exhausted: skip it, up to one
      // full turn of the pool.
      bool added = false;
      for (int64_t attempt = 0; attempt <= kMaxStreams && !added; ++attempt) {
        const c10::Stream s = impl.getStreamFromGlobalPool(device);
        if (std::find(held.begin(), held.end(), s) == held.end()) {
          held.push_back(s);
          added = true;
        }
      }
      TORCH_CHECK(
          added,
          "num_streams=",
          num_streams,
          " needs ",
          wanted,
          " side streams on ",
          device,
          ", but its stream pool gives only ",
          held.size(),
          " distinct streams; use num_streams <= ",
          held.size() + 1);
    }
  }
  return {held.begin(), held.begin() + static_cast<std::ptrdiff_t>(wanted)};
}

c10::Stream StreamPool::staging_stream(c10::Device device, int64_t stream_id) {
  TORCH_CHECK_VALUE(
      stream_id >= 1 && stream_id < kMaxStreams,
      "staging stream id must be in 1..",
      kMaxStreams - 1,
      ", got ",
      stream_id);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  DeviceState& state = r.devices[device];
  auto& held = state.staging;
  const size_t wanted = static_cast<size_t>(stream_id);
  if (held.size() < wanted) {
    const c10::impl::VirtualGuardImpl impl(device.type());
    while (held.size() < wanted) {
      bool added = false;
      for (int64_t attempt = 0; attempt <= kMaxStreams && !added; ++attempt) {
        const c10::Stream s =
            impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
        if (std::find(held.begin(), held.end(), s) == held.end() &&
            s != state.capture) {
          held.push_back(s);
          added = true;
        }
      }
      TORCH_CHECK(
          added,
          "staging stream ",
          stream_id,
          " needs ",
          wanted,
          " distinct high-priority streams on ",
          device,
          ", but its stream pool gives only ",
          held.size());
    }
  }
  return held[wanted - 1];
}

c10::Stream StreamPool::capture_stream(c10::Device device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  DeviceState& state = r.devices[device];
  if (!state.capture) {
    const c10::impl::VirtualGuardImpl impl(device.type());
    for (int64_t attempt = 0; attempt <= kMaxStreams; ++attempt) {
      const c10::Stream s =
          impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
      if (std::find(state.staging.begin(), state.staging.end(), s) ==
          state.staging.end()) {
        state.capture = s;
        break;
      }
    }
    TORCH_CHECK(
        state.capture.has_value(),
        "no high-priority stream of ",
        device,
        " is free for CUDA graph capture: staging holds all of them");
  }
  return *state.capture;
}

std::vector<c10::Event> StreamPool::acquire_events(
    c10::Device device,
    int64_t count) {
  std::vector<c10::Event> out;
  out.reserve(static_cast<size_t>(count));
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto& free_events = r.devices[device].free_events;
    while (static_cast<int64_t>(out.size()) < count && !free_events.empty()) {
      out.push_back(std::move(free_events.back()));
      free_events.pop_back();
    }
  }
  while (static_cast<int64_t>(out.size()) < count) {
    // The native event is created lazily, on its first record.
    out.emplace_back(device.type(), c10::EventFlag::PYTORCH_DEFAULT);
  }
  return out;
}

void StreamPool::release_events(
    c10::Device device,
    std::vector<c10::Event>&& events) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto& free_events = r.devices[device].free_events;
  for (auto& e : events) {
    free_events.push_back(std::move(e));
  }
  events.clear();
}

int64_t StreamPool::size(c10::Device device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.devices.find(device);
  return it == r.devices.end() ? 0
                               : static_cast<int64_t>(it->second.side.size());
}

} // namespace torch_stage
