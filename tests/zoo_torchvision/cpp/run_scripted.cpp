// Runs a scripted model from C++ with LibTorch alone, as a serving program
// would, for the torchvision zoo (tests/zoo_torchvision): no Python, only
// libtorch_stage.so loaded for the stream ops the model calls.
//
//   run_scripted LIBTORCH_STAGE.so MODEL.pt CASE.pt THREADS
//
// CASE.pt is torch.save((input, expected)) from Python; THREADS the
// intra-op thread count it was computed with (reductions split by thread
// count may round differently). Prints "equal" and
// exits 0 when the model's output on `input` equals `expected` bit for bit;
// exits 1 with the largest difference otherwise, 2 on bad use or errors.
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/script.h>
#include <torch/serialize.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 5 || std::atoi(argv[4]) < 1) {
    std::cerr << "usage: " << argv[0]
              << " LIBTORCH_STAGE.so MODEL.pt CASE.pt THREADS (>= 1)\n";
    return 2;
  }
  at::set_num_threads(std::atoi(argv[4]));
  // The library registers the torch_stage ops and classes when it loads;
  // the model refers to them by name.
  if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::cerr << "cannot load " << argv[1] << ": " << dlerror() << "\n";
    return 2;
  }
  try {
    torch::jit::Module model = torch::jit::load(argv[2]);
    model.eval();
    std::ifstream file(argv[3], std::ios::binary);
    if (!file) {
      std::cerr << "cannot read " << argv[3] << "\n";
      return 2;
    }
    const std::vector<char> bytes(
        (std::istreambuf_iterator<char>(file)),
        std::istreambuf_iterator<char>());
    const auto saved = torch::pickle_load(bytes).toTuple();
    const at::Tensor input = saved->elements().at(0).toTensor();
    const at::Tensor expected = saved->elements().at(1).toTensor();
    torch::NoGradGuard no_grad;
    const at::Tensor got = model.forward({input}).toTensor();
    if (got.sizes() == expected.sizes() && torch::equal(got, expected)) {
      std::cout << "equal\n";
      return 0;
    }
    std::cout << "different: got " << got.sizes() << ", expected "
              << expected.sizes();
    if (got.sizes() == expected.sizes()) {
      std::cout << ", max |difference| "
                << (got - expected).abs().max().item<double>();
    }
    std::cout << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
}
