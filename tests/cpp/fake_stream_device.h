// A fake device for the stream tests (test_stream_run.cpp,
// test_stream_scope.cpp): PrivateUse1 gets a DeviceGuardImpl whose streams
// and events only log what is asked of them, so the device-generic code of
// csrc/streams/ runs without a GPU and every record, wait and stream switch
// can be asserted.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace torch_stage {
namespace test_util {

constexpr auto kFake = c10::DeviceType::PrivateUse1;

// Streams are named by id: 0 is each device's default (current at start),
// pool streams are 100 + k for k in 0..pool_size-1, handed out round robin.
class FakeGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override {
    return kFake;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    return d;
  }
  c10::Device getDevice() const override {
    return c10::Device(kFake, 0);
  }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stream(d.index(), current_[d.index()]);
  }
  // Two pools, as CUDA's: low priority (ids 100..) and high (ids 200..),
  // each handed out round robin.
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    const int size = pool_size_.count(d.index()) ? pool_size_[d.index()] : 32;
    if (high) {
      return stream(d.index(), 200 + next_high_[d.index()]++ % size);
    }
    const int k = next_[d.index()]++ % size;
    return stream(d.index(), 100 + k);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto old = stream(s.device_index(), current_[s.device_index()]);
    current_[s.device_index()] = s.id();
    log_.push_back("current s" + std::to_string(s.id()));
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return 4;
  }
  void record(
      void** event,
      const c10::Stream& s,
      const c10::DeviceIndex,
      const c10::EventFlag) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (*event == nullptr) {
      *event = reinterpret_cast<void*>(++events_created_);
    }
    log_.push_back(
        "record e" + std::to_string(reinterpret_cast<intptr_t>(*event)) + " s" +
        std::to_string(s.id()));
  }
  void block(void* event, const c10::Stream& s) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    log_.push_back(
        "wait e" + std::to_string(reinterpret_cast<intptr_t>(event)) + " s" +
        std::to_string(s.id()));
  }
  bool queryEvent(void*) const override {
    return true;
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& s)
      const override {
    std::lock_guard<std::mutex> lock(mutex_);
    log_.push_back("keep s" + std::to_string(s.id()));
  }

  std::vector<std::string> take_log() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(log_, {});
  }
  int64_t current(c10::DeviceIndex index) {
    std::lock_guard<std::mutex> lock(mutex_);
    return current_[index];
  }
  void set_pool_size(c10::DeviceIndex index, int size) {
    std::lock_guard<std::mutex> lock(mutex_);
    pool_size_[index] = size;
  }
  intptr_t events_created() {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_created_;
  }

 private:
  static c10::Stream stream(c10::DeviceIndex index, int64_t id) {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kFake, index), id);
  }

  mutable std::mutex mutex_;
  mutable std::map<c10::DeviceIndex, int64_t> current_; // guarded by mutex_
  mutable std::map<c10::DeviceIndex, int> next_; // guarded by mutex_
  mutable std::map<c10::DeviceIndex, int> next_high_; // guarded by mutex_
  mutable std::map<c10::DeviceIndex, int> pool_size_; // guarded by mutex_
  mutable std::vector<std::string> log_; // guarded by mutex_
  mutable intptr_t events_created_ = 0; // guarded by mutex_
};

inline FakeGuardImpl& fake() {
  static auto* impl = [] {
    auto* f = new FakeGuardImpl();
    c10::impl::DeviceGuardImplRegistrar registrar(kFake, f);
    return f;
  }();
  return *impl;
}

inline c10::Device fake_device(c10::DeviceIndex index) {
  fake();
  return c10::Device(kFake, index);
}

using Log = std::vector<std::string>;

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

// Names a log's events by first use (e1, e2, ...), across the logs it is
// given: the fake device numbers events process-wide and runs take them
// from a pool that earlier tests filled, so raw ids depend on test order.
class EventNames {
 public:
  Log operator()(Log log) {
    for (auto& line : log) {
      const auto at = line.find(" e");
      if (at == std::string::npos) {
        continue;
      }
      const auto end = line.find(' ', at + 1);
      const std::string event = line.substr(at + 1, end - at - 1);
      auto it = std::find(seen_.begin(), seen_.end(), event);
      if (it == seen_.end()) {
        it = seen_.insert(seen_.end(), event);
      }
      line.replace(
          at + 1, event.size(), "e" + std::to_string(it - seen_.begin() + 1));
    }
    return log;
  }

 private:
  std::vector<std::string> seen_;
};

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

} // namespace test_util
} // namespace torch_stage
