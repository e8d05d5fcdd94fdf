// TorchScript registration of torch.classes.torch_stage.StagingArea.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "staging/staging_area.h"

namespace torch_stage {
namespace {

using Area = c10::intrusive_ptr<StagingArea>;

} // namespace

TORCH_LIBRARY_FRAGMENT(torch_stage, m) {
  m.class_<StagingArea>("StagingArea")
      .def(
          torch::init<int64_t, int64_t>(),
          "Bounded blocking buffer of tensor bundles",
          {torch::arg("capacity"), torch::arg("byte_limit") = 0})
      .def(
          "put",
          &StagingArea::put,
          "Blocks until there is room, then appends the bundle",
          {torch::arg("tensors")})
      .def(
          "take",
          &StagingArea::take,
          "Blocks until a bundle is ready and returns it")
      .def(
          "try_put",
          &StagingArea::try_put,
          "As put, but returns False after timeout_ms",
          {torch::arg("tensors"), torch::arg("timeout_ms")})
      .def(
          "try_take",
          &StagingArea::try_take,
          "As take, but returns None after timeout_ms",
          {torch::arg("timeout_ms")})
      .def("close", &StagingArea::close)
      .def("cancel", &StagingArea::cancel)
      .def("is_closed", &StagingArea::is_closed)
      .def("is_cancelled", &StagingArea::is_cancelled)
      .def("size", &StagingArea::size)
      .def("capacity", &StagingArea::capacity)
      .def("byte_limit", &StagingArea::byte_limit)
      .def("stats", &StagingArea::stats)
      .def_pickle(
          [](const Area& self) -> std::vector<int64_t> {
            return self->config();
          },
          [](std::vector<int64_t> state) -> Area {
            TORCH_CHECK_VALUE(
                state.size() == 2,
                "StagingArea: a saved state holds [capacity, byte_limit], got ",
                state.size(),
                " values");
            return c10::make_intrusive<StagingArea>(state[0], state[1]);
          });
}

} // namespace torch_stage
