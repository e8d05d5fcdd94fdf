// Modules scripted in Python (tests/cpp/make_fixtures.py), loaded and run
// here with LibTorch and libtorch_stage only: one holds a StagingArea
// attribute fed by a C++ producer thread, one was rewritten by
// torch_stage.multi_stream (and is served by the C++ example's loop,
// examples/cpp/serving.h), one uses `with torch_stage.stream(i):` scopes.
#include "staging/staging_area.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/script.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

#include "serving.h"

namespace torch_stage {
namespace {

std::string fixture(const char* name) {
  const char* dir = std::getenv("TORCH_STAGE_FIXTURES");
  if (dir == nullptr) {
    ADD_FAILURE() << "TORCH_STAGE_FIXTURES is not set (run through ctest)";
    return name;
  }
  return std::string(dir) + "/" + name;
}

TEST(ScriptModule, LoadsAndConsumesFromAProducerThread) {
  torch::jit::Module module = torch::jit::load(fixture("staged_consumer.pt"));
  module.eval();
  auto area = module.attr("area").toCustomClass<StagingArea>();
  // The saved state is the configuration, and the loaded area starts empty.
  EXPECT_EQ(area->capacity(), 3);
  EXPECT_EQ(area->size(), 0);
  const at::Tensor weight = module.attr("weight").toTensor();

  constexpr int kItems = 50;
  std::thread producer([area] {
    for (int i = 0; i < kItems; ++i) {
      area->put({at::full({2, 4}, static_cast<float>(i)), at::full({3}, 1.0f)});
    }
    area->close();
  });
  torch::NoGradGuard no_grad;
  for (int i = 0; i < kItems; ++i) {
    const at::Tensor out = module.forward({}).toTensor();
    const at::Tensor expected =
        at::full({2, 4}, static_cast<float>(i)).matmul(weight) + 1.0f;
    ASSERT_TRUE(at::equal(out, expected)) << "item " << i;
  }
  producer.join();
  // End of stream surfaces as the tagged error through the interpreter (which
  // rethrows it as a std::runtime_error carrying the TorchScript traceback).
  try {
    module.forward({});
    FAIL() << "forward on a closed, drained area returned";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("[StageClosed]"), std::string::npos)
        << e.what();
  }
}

TEST(ScriptModule, ScriptedMethodsPutIntoTheSameArea) {
  torch::jit::Module module = torch::jit::load(fixture("staged_consumer.pt"));
  module.run_method("feed", at::ones({1, 4}), at::zeros({3}));
  auto area = module.attr("area").toCustomClass<StagingArea>();
  EXPECT_EQ(area->size(), 1);
  const at::Tensor out = module.forward({}).toTensor();
  const at::Tensor weight = module.attr("weight").toTensor();
  EXPECT_TRUE(at::allclose(out, at::ones({1, 4}).matmul(weight)));
}

// A multi-stream module scripted in Python runs here with LibTorch and
// libtorch_stage alone: its torch_stage:: stream ops resolve, survive
// loading, and (on CPU, where they do nothing) change no result.
TEST(ScriptModule, RunsAMultiStreamModelLoadedFromPython) {
  torch::jit::Module multi =
      torch::jit::load(fixture("towers_multi_stream.pt"));
  torch::jit::Module plain = torch::jit::load(fixture("towers_plain.pt"));
  int stream_ops = 0;
  for (const auto* node : multi.get_method("forward").graph()->nodes()) {
    const std::string kind = node->kind().toQualString();
    stream_ops += kind.rfind("torch_stage::", 0) == 0 ? 1 : 0;
  }
  EXPECT_GE(stream_ops, 4); // fork, set_stream, record/wait, join at least
  for (const auto* node : plain.get_method("forward").graph()->nodes()) {
    EXPECT_NE(
        std::string(node->kind().toQualString()).rfind("torch_stage::", 0), 0u);
  }
  torch::NoGradGuard no_grad;
  at::manual_seed(3);
  for (int i = 0; i < 5; ++i) {
    const at::Tensor a = at::randn({4, 8});
    const at::Tensor b = at::randn({4, 8});
    const at::Tensor expected = plain.forward({a, b}).toTensor();
    EXPECT_TRUE(at::equal(multi.forward({a, b}).toTensor(), expected));
  }
}

int count_ops(torch::jit::Module& module, const std::string& kind) {
  int count = 0;
  for (const auto* node : module.get_method("forward").graph()->nodes()) {
    count += node->kind().toQualString() == kind ? 1 : 0;
  }
  return count;
}

torch_stage_example::Batch example_batch(int64_t i) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + i);
  return {at::randn({4, 8}, gen), at::randn({4, 8}, gen)};
}

// What examples/cpp/serve_model.cpp does, checked against the plain model:
// a producer thread stages batches, the multi-stream model serves them in
// order.
TEST(ScriptModule, ServesTheExampleModelFromAProducerThread) {
  torch::jit::Module multi =
      torch::jit::load(fixture("towers_multi_stream.pt"));
  torch::jit::Module plain = torch::jit::load(fixture("towers_plain.pt"));
  multi.eval();
  constexpr int64_t kBatches = 40;
  int64_t checked = 0;
  const int64_t served = torch_stage_example::serve(
      multi,
      kBatches,
      /*capacity=*/3,
      example_batch,
      [&](int64_t i,
          const torch_stage_example::Batch& batch,
          const at::Tensor& out) {
        EXPECT_EQ(i, checked);
        EXPECT_TRUE(at::equal(batch[0], example_batch(i)[0])) << "batch " << i;
        const at::Tensor expected =
            plain.forward({batch[0], batch[1]}).toTensor();
        EXPECT_TRUE(at::equal(out, expected)) << "batch " << i;
        ++checked;
      });
  EXPECT_EQ(served, kBatches);
  EXPECT_EQ(checked, kBatches);
}

TEST(ScriptModule, ServingRethrowsAProducerError) {
  torch::jit::Module multi =
      torch::jit::load(fixture("towers_multi_stream.pt"));
  int64_t outputs = 0;
  try {
    torch_stage_example::serve(
        multi,
        10,
        2,
        [](int64_t i) -> torch_stage_example::Batch {
          if (i == 5) {
            throw std::runtime_error("no batch 5");
          }
          return example_batch(i);
        },
        [&](int64_t, const torch_stage_example::Batch&, const at::Tensor&) {
          ++outputs;
        });
    FAIL() << "serve returned although the producer failed";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "no batch 5");
  }
  // Batches staged before the failure may have been served; never more.
  EXPECT_LE(outputs, 5);
}

// `with torch_stage.stream(i):` scripted as written: the StreamScope ops
// resolve in LibTorch and results equal the plain model's.
TEST(ScriptModule, RunsScriptedStreamScopes) {
  torch::jit::Module scoped = torch::jit::load(fixture("towers_scoped.pt"));
  torch::jit::Module plain = torch::jit::load(fixture("towers_plain.pt"));
  EXPECT_EQ(count_ops(scoped, "torch_stage::stream"), 2);
  EXPECT_EQ(count_ops(scoped, "prim::Enter"), 2);
  EXPECT_EQ(count_ops(scoped, "prim::Exit"), 2);
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < 5; ++i) {
    const auto batch = example_batch(i);
    EXPECT_TRUE(at::equal(
        scoped.forward({batch[0], batch[1]}).toTensor(),
        plain.forward({batch[0], batch[1]}).toTensor()));
  }
}

} // namespace
} // namespace torch_stage
