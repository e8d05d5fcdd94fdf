// StagingArea: a BoundedBuffer of tensor bundles, registered as the
// TorchScript custom class torch.classes.torch_stage.StagingArea.
//
// It is the runtime object behind torch_stage.StagingArea (Python), scripted
// modules that hold one as an attribute, and C++ programs that load them. All
// of BoundedBuffer's semantics hold (see bounded_buffer.h); this layer turns
// statuses into errors a user can act on:
//
//   put after close          -> c10::Error "[StageClosed] ..."
//   take when closed+drained -> c10::Error "[StageClosed] ..." (end of stream)
//   anything after cancel    -> c10::Error "[StageCancelled] ..."
//   bad arguments            -> c10::ValueError naming the value and the rule
//
// The bracketed tags are a stable contract: the Python facade maps them to
// torch_stage.StageClosed / torch_stage.StageCancelled, and C++ callers may
// match them. Timeouts are not errors: try_put returns false and try_take
// returns nullopt.
//
// Threads: every method may be called from any thread at once. Blocking
// methods block only inside BoundedBuffer; when called from Python through
// torch.classes the interpreter has already released the GIL (the script
// method call path drops it around the call), so a blocked take() never
// stalls other Python threads.
//
// Lifetime: held by c10::intrusive_ptr. Destroying the last reference cancels
// the buffer; since a thread inside a method holds a reference through the
// script object or its own intrusive_ptr, the buffer outlives every caller.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "staging/bounded_buffer.h"

namespace torch_stage {

using TensorBundle = std::vector<at::Tensor>;

// Bytes held by a bundle: the sum of each tensor's elements * element size.
// Views count their own extent, not their base storage's.
struct BundleBytes {
  std::size_t operator()(const TensorBundle& bundle) const;
};

class StagingArea : public torch::CustomClassHolder {
 public:
  // capacity >= 1 items; byte_limit >= 0 bytes (0: no byte limit).
  StagingArea(int64_t capacity, int64_t byte_limit = 0);
  ~StagingArea() override;

  void put(TensorBundle tensors);
  TensorBundle take();
  // timeout_ms >= 0; 0 tries once without waiting.
  bool try_put(TensorBundle tensors, int64_t timeout_ms);
  std::optional<TensorBundle> try_take(int64_t timeout_ms);

  void close();
  void cancel();
  bool is_closed() const;
  bool is_cancelled() const;
  int64_t size() const;
  int64_t capacity() const;
  int64_t byte_limit() const;
  // Keys: capacity, byte_limit, size, bytes, put, taken, dropped, max_size,
  // occupancy_sum, consumer_wait_ns, producer_blocked_ns, closed, cancelled.
  c10::Dict<std::string, int64_t> stats() const;

  // Serialised state for torch.jit.save: the configuration, not the contents
  // (a buffer of in-flight items is a runtime resource, like an open file).
  std::vector<int64_t> config() const;

  using Buffer = BoundedBuffer<TensorBundle, BundleBytes>;
  // The status-level interface, for callers that map statuses themselves
  // (the Python bindings try without waiting before they release the GIL).
  Buffer& buffer() {
    return buffer_;
  }

  // The message for a failed status, tagged as described above; `op` names
  // the method, `bundle` is the rejected bundle of a put (nullptr for takes).
  std::string error_message(
      BufferStatus status,
      const char* op,
      const TensorBundle* bundle) const;

 private:
  [[noreturn]] void fail(
      BufferStatus status,
      const char* op,
      const TensorBundle* bundle) const;

  Buffer buffer_;
};

} // namespace torch_stage
