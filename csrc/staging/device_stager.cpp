#include "staging/device_stager.h"

#include "streams/stream_observer.h"
#include "streams/stream_pool.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>
#include <utility>

// Weak, as in stage.cpp: a torch built without OpenMP skips the bound.
extern "C" void omp_set_num_threads(int) __attribute__((weak));
extern "C" int omp_get_max_threads() __attribute__((weak));

namespace torch_stage {
namespace {

// Raises this thread's OpenMP team size for one scope, then restores it.
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int threads) {
    if (omp_set_num_threads == nullptr || omp_get_max_threads == nullptr) {
      return;
    }
    before_ = omp_get_max_threads();
    if (threads > before_) {
      omp_set_num_threads(threads);
    } else {
      before_ = 0;
    }
  }
  ~IntraOpThreads() {
    if (before_ > 0) {
      omp_set_num_threads(before_);
    }
  }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  int before_ = 0;
};

int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

bool fusable(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && !t.is_quantized();
}

int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// is_pinned() asks the accelerator's host allocator: only for large tensors.
bool copied_directly(const at::Tensor& t, const c10::Device& device) {
  return !device.is_cpu() && nbytes(t) >= DeviceStager::kDirectCopyBytes &&
      t.is_pinned();
}

c10::Device checked_device(c10::Device device) {
  if (device.is_cpu()) {
    return device;
  }
  int64_t count = 0;
  try {
    c10::impl::VirtualGuardImpl impl(device.type());
    count = impl.deviceCount();
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(
        false,
        "device ",
        device,
        " is not available in this build of torch: ",
        e.what_without_backtrace());
  }
  const int64_t index = device.has_index() ? device.index() : 0;
  TORCH_CHECK_VALUE(
      index < count,
      "device ",
      device,
      " does not exist: ",
      count,
      " ",
      c10::DeviceTypeName(device.type(), /*lower_case=*/true),
      " device(s) are visible");
  if (!device.has_index()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    return impl.getDevice();
  }
  return device;
}

c10::Stream staging_stream(const c10::Device& device, int64_t stream_id) {
  TORCH_CHECK_VALUE(
      stream_id >= 0 && stream_id < kMaxStreams,
      "stage_subgraph_stream_id must be in [0, ",
      kMaxStreams,
      ") (0 is the consumer's current stream), got ",
      stream_id);
  c10::impl::VirtualGuardImpl impl(device.type());
  if (device.is_cpu() || stream_id == 0) {
    return impl.getStream(device);
  }
  // Staging streams of their own, taken once per process, never per stage
  // or per epoch (a stream per epoch strands the caching allocator's
  // per-stream blocks: timm #2781), and never a multi-stream side stream.
  return StreamPool::staging_stream(device, stream_id);
}

} // namespace

FusedLayout plan_fused_layout(
    const TensorBundle& tensors,
    const c10::Device& device,
    bool fuse_same_device) {
  FusedLayout layout;
  layout.offsets.assign(tensors.size(), -1);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!t.defined() || !fusable(t) ||
        (t.device() == device && !fuse_same_device)) {
      continue;
    }
    if (copied_directly(t, device)) {
      ++layout.direct_copies;
      layout.direct_bytes += nbytes(t);
      continue;
    }
    layout.total_bytes = align_up(layout.total_bytes, DeviceStager::kAlignment);
    layout.offsets[i] = layout.total_bytes;
    layout.total_bytes += nbytes(t);
  }
  return layout;
}

DeviceStager::DeviceStager(
    c10::Device device,
    int64_t stream_id,
    bool fuse_on_cpu)
    : device_(checked_device(device)),
      fuse_on_cpu_(fuse_on_cpu),
      stream_id_(stream_id),
      stream_(staging_stream(device_, stream_id)) {}

void DeviceStager::note_copy(StageItem& item) const {
  if (stream_id_ == 0 || !stream_observer_active()) {
    return;
  }
  c10::List<at::Tensor> tensors;
  for (const auto& t : item.tensors) {
    if (t.defined()) {
      tensors.push_back(t);
    }
  }
  StreamOpNote note;
  note.op = "stage_copy";
  note.owner = item.note_id = next_stream_owner_id();
  note.stream = stream_id_;
  note.value = std::move(tensors);
  notify_stream_op(note);
}

HostBufferChoice choose_host_buffer(
    const std::vector<FreeHostBuffer>& free,
    int64_t bytes,
    int64_t buffers,
    int64_t producers) {
  // Among the free buffers large enough: the smallest whose last copy is
  // done. Reusing one that a copy still reads would make this gather wait
  // for that copy, so that gathers and copies take turns instead of
  // overlapping. So while there are fewer buffers than producers + 1 (one
  // being gathered into per producer, one being copied from), a new one is
  // made instead; past that the copies set the pace and another buffer
  // would only hold pinned memory, so the gather waits for the oldest.
  HostBufferChoice choice;
  int64_t oldest_busy = -1;
  for (size_t i = 0; i < free.size(); ++i) {
    const FreeHostBuffer& b = free[i];
    if (b.bytes < bytes) {
      continue;
    }
    const auto k = static_cast<int64_t>(i);
    if (!b.busy) {
      if (choice.index < 0 || b.bytes < free[choice.index].bytes) {
        choice.index = k;
      }
    } else if (oldest_busy < 0) {
      oldest_busy = k; // released first: its copy was queued first
    }
  }
  if (choice.index < 0 && oldest_busy >= 0 &&
      buffers >= std::max<int64_t>(producers, 1) + 1) {
    choice.index = oldest_busy;
    choice.wait = true;
  }
  return choice;
}

DeviceStager::HostBuffer DeviceStager::acquire_host_buffer(
    int64_t bytes,
    int64_t producers) {
  HostBuffer buffer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<FreeHostBuffer> candidates;
    candidates.reserve(free_.size());
    for (const HostBuffer& b : free_) {
      const bool fits = b.memory.numel() >= bytes;
      candidates.push_back(
          {b.memory.numel(), fits && b.last_copy && !b.last_copy->query()});
    }
    const HostBufferChoice choice =
        choose_host_buffer(candidates, bytes, host_buffers_, producers);
    if (choice.index >= 0) {
      buffer = std::move(free_[choice.index]);
      free_.erase(free_.begin() + choice.index);
      ++stats_.host_buffer_reuses;
      stats_.host_buffer_waits += choice.wait ? 1 : 0;
    } else {
      ++stats_.host_buffers_allocated;
      ++host_buffers_;
    }
  }
  if (buffer.memory.defined()) {
    // The copy that last read this buffer may still be in flight.
    if (buffer.last_copy) {
      buffer.last_copy->synchronize();
      buffer.last_copy.reset();
    }
    return buffer;
  }
  // Round up so that items of slightly varying size share buffers.
  const int64_t size =
      std::max<int64_t>(align_up(bytes + bytes / 8, 4096), 4096);
  try {
    buffer.memory = at::empty(
        {size},
        at::TensorOptions().dtype(at::kByte).pinned_memory(!device_.is_cpu()));
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    --host_buffers_;
    --stats_.host_buffers_allocated;
    throw;
  }
  return buffer;
}

void DeviceStager::forget_host_buffer() {
  std::lock_guard<std::mutex> lock(mu_);
  --host_buffers_;
}

int DeviceStager::gather_threads(int64_t producers) {
  static const int64_t half = std::thread::hardware_concurrency() / 2;
  return static_cast<int>(
      std::clamp<int64_t>(half / std::max<int64_t>(producers, 1), 1, 8));
}

void DeviceStager::release_host_buffer(HostBuffer buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(std::move(buffer));
}

void DeviceStager::stage(StageItem& item, int64_t producers) {
  if (device_.is_cpu() && !fuse_on_cpu_) {
    for (auto& t : item.tensors) {
      if (t.defined() && !t.device().is_cpu()) {
        t = t.to(device_);
      }
    }
    note_copy(item);
    return;
  }
  const FusedLayout layout =
      plan_fused_layout(item.tensors, device_, fuse_on_cpu_);
  const bool accelerator = !device_.is_cpu();
  c10::StreamGuard guard(stream_);
  bool on_device_already = false;
  for (const auto& t : item.tensors) {
    on_device_already |= t.defined() && t.device() == device_;
  }
  if (accelerator && on_device_already && guard.original_stream() != stream_) {
    // Work that made these tensors (a transform) ran on this thread's own
    // stream; the copy stream, and through its event every consumer, must
    // wait for it.
    c10::Event made(device_.type());
    made.record(guard.original_stream());
    made.block(stream_);
  }
  int64_t fused = 0;
  const bool any_fused =
      std::any_of(layout.offsets.begin(), layout.offsets.end(), [](int64_t o) {
        return o >= 0;
      });
  if (any_fused) {
    HostBuffer host = acquire_host_buffer(layout.total_bytes, producers);
    // A gather or an allocation that throws (a tensor that cannot be read,
    // device memory exhausted) leaves the item's tensors as they were and
    // the buffer unread by any copy: it goes back to the free list. Lost,
    // it stayed counted among the buffers made, and later gathers waited
    // for copies as if it existed. (Once the copy is queued, only the
    // event can throw; the buffer is then dropped, torch's host allocator
    // keeping its memory until that copy ends.)
    bool copy_queued = false;
    try {
      const IntraOpThreads gather(accelerator ? gather_threads(producers) : 1);
      at::Tensor device_buffer = at::empty(
          {layout.total_bytes},
          at::TensorOptions().dtype(at::kByte).device(device_));
      TensorBundle staged = item.tensors;
      for (size_t i = 0; i < staged.size(); ++i) {
        const int64_t offset = layout.offsets[i];
        if (offset < 0) {
          continue;
        }
        at::Tensor& t = staged[i];
        const int64_t bytes = nbytes(t);
        // The CPU side of the transfer, done in the producer thread without
        // the GIL: gather into the fused host buffer (any strides).
        host.memory.narrow(0, offset, bytes)
            .view(t.scalar_type())
            .view(t.sizes())
            .copy_(t);
        t = device_buffer.narrow(0, offset, bytes)
                .view(t.scalar_type())
                .view(t.sizes());
        ++fused;
      }
      device_buffer.copy_(
          host.memory.narrow(0, 0, layout.total_bytes), /*non_blocking=*/true);
      copy_queued = true;
      if (accelerator) {
        auto done = std::make_shared<c10::Event>(device_.type());
        done->record(stream_);
        host.last_copy = done;
        item.ready = std::move(done);
      }
      item.tensors = std::move(staged);
      item.device_storage = std::move(device_buffer);
    } catch (...) {
      if (copy_queued) {
        forget_host_buffer();
      } else {
        release_host_buffer(std::move(host));
      }
      throw;
    }
    release_host_buffer(std::move(host));
  }
  // What did not fuse: large pinned tensors, tensors on other devices or
  // with other layouts.
  bool copied_separately = false;
  for (size_t i = 0; i < item.tensors.size(); ++i) {
    auto& t = item.tensors[i];
    if (layout.offsets[i] < 0 && t.defined() && t.device() != device_) {
      t = t.to(device_, /*non_blocking=*/true);
      copied_separately = true;
    }
  }
  if (accelerator && (copied_separately || on_device_already)) {
    // Re-record so that the event also covers these copies; the host
    // buffer keeps the earlier event, which is all its reuse needs.
    auto done = std::make_shared<c10::Event>(device_.type());
    done->record(stream_);
    item.ready = std::move(done);
  }
  note_copy(item);
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.items;
  stats_.fused_tensors += fused;
  stats_.direct_copies += layout.direct_copies;
  stats_.bytes += layout.total_bytes + layout.direct_bytes;
}

void DeviceStager::hand_over(StageItem& item) {
  if (item.note_id != 0 && stream_observer_active()) {
    StreamOpNote note;
    note.op = "stage_hand_over";
    note.owner = item.note_id;
    notify_stream_op(note);
    item.note_id = 0;
  }
  if (!item.ready) {
    return;
  }
  c10::impl::VirtualGuardImpl impl(item.ready->device_type());
  const c10::Device device(
      item.ready->device_type(), item.ready->device_index());
  const c10::Stream current = impl.getStream(device);
  item.ready->block(current);
  // Memory made on another stream (the fused buffer, separate copies,
  // tensors a transform made) must not be recycled by the caching allocator
  // while this consumer's stream may still read it.
  const c10::StorageImpl* fused = item.device_storage.defined()
      ? item.device_storage.storage().unsafeGetStorageImpl()
      : nullptr;
  if (fused != nullptr) {
    impl.recordDataPtrOnStream(
        item.device_storage.storage().data_ptr(), current);
  }
  for (const auto& t : item.tensors) {
    if (t.defined() && t.device() == device && t.has_storage() &&
        t.storage().unsafeGetStorageImpl() != fused) {
      impl.recordDataPtrOnStream(t.storage().data_ptr(), current);
    }
  }
  item.ready.reset();
}

DeviceStagerStats DeviceStager::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

} // namespace torch_stage
