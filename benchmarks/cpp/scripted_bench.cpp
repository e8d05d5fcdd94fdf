// Host time per forward of scripted models run from C++ with LibTorch, as a
// serving program runs them: no Python in the process.
//
//   scripted_bench INPUTS.pt ITERS ROUNDS MODEL.pt...
//
// INPUTS.pt is torch.save(tuple_of_inputs) from Python. The models (for
// benchmarks/multi_stream.py: the traced module scripted on one stream, and
// its multi-stream plan scripted) are called on the same inputs in
// interleaved rounds of ITERS calls each, after a warm-up: a machine whose
// load changes slows every model of a round alike. Prints one JSON object:
// each model's median over rounds of its mean microseconds per call, and
// each model's median per-round time relative to the first model.
#include <ATen/Parallel.h>
#include <torch/script.h>
#include <torch/serialize.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 5 || std::atoi(argv[2]) < 1 || std::atoi(argv[3]) < 1) {
    std::cerr << "usage: " << argv[0]
              << " INPUTS.pt ITERS (>= 1) ROUNDS (>= 1) MODEL.pt...\n";
    return 2;
  }
  const int iters = std::atoi(argv[2]);
  const int rounds = std::atoi(argv[3]);
  try {
    std::ifstream file(argv[1], std::ios::binary);
    if (!file) {
      std::cerr << "cannot read " << argv[1] << "\n";
      return 2;
    }
    const std::vector<char> bytes(
        (std::istreambuf_iterator<char>(file)),
        std::istreambuf_iterator<char>());
    const c10::IValue saved = torch::pickle_load(bytes);
    std::vector<c10::IValue> inputs;
    for (const auto& v : saved.toTupleRef().elements()) {
      inputs.push_back(v);
    }
    std::vector<torch::jit::Module> models;
    for (int i = 4; i < argc; ++i) {
      models.push_back(torch::jit::load(argv[i]));
      models.back().eval();
    }
    torch::NoGradGuard no_grad;
    for (auto& model : models) { // warm-up: the profiling executor's runs
      for (int i = 0; i < 20; ++i) {
        model.forward(inputs);
      }
    }
    std::vector<std::vector<double>> us(models.size());
    for (int r = 0; r < rounds; ++r) {
      for (size_t m = 0; m < models.size(); ++m) {
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) {
          models[m].forward(inputs);
        }
        const std::chrono::duration<double, std::micro> took =
            std::chrono::steady_clock::now() - start;
        us[m].push_back(took.count() / iters);
      }
    }
    std::cout << "{\"threads\": " << at::get_num_threads()
              << ", \"us_per_call\": [";
    for (size_t m = 0; m < models.size(); ++m) {
      std::cout << (m ? ", " : "") << median(us[m]);
    }
    std::cout << "], \"vs_first_per_round_median\": [";
    for (size_t m = 0; m < models.size(); ++m) {
      std::vector<double> ratio;
      for (int r = 0; r < rounds; ++r) {
        ratio.push_back(us[m][r] / us[0][r]);
      }
      std::cout << (m ? ", " : "") << median(ratio);
    }
    std::cout << "]}\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
}
