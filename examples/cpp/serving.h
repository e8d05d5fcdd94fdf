// A scripted model fed from a StagingArea: the serving loop of the C++
// example (examples/cpp/serve_model.cpp), shared with its GoogleTest
// (tests/cpp/test_script_module.cpp) so CI runs the same code.
//
// One producer thread makes batches and puts them into a bounded
// StagingArea (it blocks while `capacity` batches wait); the calling thread
// takes each batch, runs the model's forward on it and hands the output to
// `on_output`. close() after the last batch ends the loop once the area is
// drained; an error in the producer cancels the area and is rethrown here.
#pragma once

#include <torch/script.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "staging/staging_area.h"

namespace torch_stage_example {

using Batch = std::vector<at::Tensor>;

// make_batch(i) -> the i-th batch (the model's positional inputs);
// on_output(i, inputs, output) sees every result in order. Returns the number
// of batches served.
inline int64_t serve(
    torch::jit::Module& model,
    int64_t num_batches,
    int64_t capacity,
    const std::function<Batch(int64_t)>& make_batch,
    const std::function<void(int64_t, const Batch&, const at::Tensor&)>&
        on_output) {
  auto area = c10::make_intrusive<torch_stage::StagingArea>(capacity);
  std::exception_ptr producer_error;
  std::thread producer([&, area] {
    try {
      for (int64_t i = 0; i < num_batches; ++i) {
        area->put(make_batch(i));
      }
      area->close();
    } catch (...) {
      producer_error = std::current_exception();
      area->cancel();
    }
  });
  int64_t served = 0;
  std::exception_ptr consumer_error;
  try {
    torch::NoGradGuard no_grad;
    Batch batch;
    // The status-level take: end of stream is a status, not an exception.
    while (area->buffer().take(batch) == torch_stage::BufferStatus::kOk) {
      std::vector<c10::IValue> inputs(batch.begin(), batch.end());
      const at::Tensor output = model.forward(inputs).toTensor();
      on_output(served, batch, output);
      ++served;
    }
  } catch (...) {
    consumer_error = std::current_exception();
    area->cancel(); // unblocks the producer
  }
  producer.join();
  if (producer_error) {
    std::rethrow_exception(producer_error);
  }
  if (consumer_error) {
    std::rethrow_exception(consumer_error);
  }
  return served;
}

} // namespace torch_stage_example
