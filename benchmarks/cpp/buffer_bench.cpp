// Throughput of StagingArea driven by C++ threads: P producers put the same
// small tensor bundle, C consumers take, for every (P, C, capacity) given.
// Driven by benchmarks/buffer_throughput.py, which compares it in the same run
// with Python threads on StagingArea and on queue.Queue.
//
// Usage: buffer_bench ITEMS P:C:CAPACITY...   (prints one JSON object a line)
#include "staging/staging_area.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

double run(int producers, int consumers, int64_t capacity, int64_t items) {
  auto area = c10::make_intrusive<torch_stage::StagingArea>(capacity);
  const at::Tensor payload = at::ones({16}, at::kFloat);
  const int64_t per_producer = items / producers;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int p = 0; p < producers; ++p) {
    threads.emplace_back([&] {
      for (int64_t i = 0; i < per_producer; ++i) {
        area->put({payload});
      }
    });
  }
  std::vector<std::thread> takers;
  for (int c = 0; c < consumers; ++c) {
    takers.emplace_back([&] {
      try {
        while (true) {
          area->take();
        }
      } catch (const c10::Error&) {
        // end of stream
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  area->close();
  for (auto& t : takers) {
    t.join();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return static_cast<double>(per_producer * producers) / seconds;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s ITEMS P:C:CAPACITY...\n", argv[0]);
    return 2;
  }
  const int64_t items = std::atoll(argv[1]);
  for (int i = 2; i < argc; ++i) {
    int p = 0, c = 0;
    long long capacity = 0;
    if (std::sscanf(argv[i], "%d:%d:%lld", &p, &c, &capacity) != 3 || p < 1 ||
        c < 1 || capacity < 1) {
      std::fprintf(
          stderr, "bad configuration '%s', expected P:C:CAPACITY\n", argv[i]);
      return 2;
    }
    const double rate = run(p, c, capacity, items);
    std::printf(
        "{\"producers\": %d, \"consumers\": %d, \"capacity\": %lld, \"items_per_s\": %.1f}\n",
        p,
        c,
        capacity,
        rate);
  }
  return 0;
}
