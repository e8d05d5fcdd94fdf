// Serve a scripted multi-stream model from C++ with LibTorch and
// libtorch_stage alone: a producer thread stages input batches in a
// torch_stage::StagingArea, the main thread runs inference on each.
//
//   serve_model MODEL.pt [BATCHES] [BATCH_SIZE]
//
// MODEL.pt comes from examples/cpp/export_model.py (a two-tower model
// rewritten by torch_stage.multi_stream and scripted). On a CUDA machine the
// model and batches go to the GPU and its towers run on two streams.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/script.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>

#include "serving.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt [BATCHES] [BATCH_SIZE]\n";
    return 2;
  }
  const int64_t batches = argc > 2 ? std::atoll(argv[2]) : 20;
  const int64_t batch_size = argc > 3 ? std::atoll(argv[3]) : 16;
  if (batches < 1 || batch_size < 1) {
    std::cerr << "BATCHES and BATCH_SIZE must be >= 1, got " << batches
              << " and " << batch_size << "\n";
    return 2;
  }
  const c10::Device device =
      torch::cuda::is_available() ? c10::Device("cuda") : c10::Device("cpu");
  try {
    torch::jit::Module model = torch::jit::load(argv[1], device);
    model.eval();
    // The example model takes two [batch, 8] inputs.
    auto make_batch = [&](int64_t i) {
      const auto gen = at::make_generator<at::CPUGeneratorImpl>(i);
      const auto options = at::TensorOptions().dtype(at::kFloat);
      return torch_stage_example::Batch{
          at::randn({batch_size, 8}, gen, options).to(device),
          at::randn({batch_size, 8}, gen, options).to(device)};
    };
    double total = 0.0;
    bool finite = true;
    const int64_t served = torch_stage_example::serve(
        model,
        batches,
        /*capacity=*/4,
        make_batch,
        [&](int64_t, const torch_stage_example::Batch&, const at::Tensor& out) {
          const double sum = out.sum().item<double>();
          finite = finite && std::isfinite(sum) && out.size(0) == batch_size;
          total += sum;
        });
    std::cout << "served " << served << " batches of " << batch_size << " on "
              << device << "; sum of outputs " << total << "\n";
    if (served != batches || !finite) {
      std::cerr << "expected " << batches << " finite outputs of " << batch_size
                << " rows\n";
      return 1;
    }
  } catch (const std::exception& e) {
    std::cerr << "serve_model: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
