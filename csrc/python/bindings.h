// Entry points of the pybind11 glue, one per concern, called from module.cpp.
#pragma once

#include <c10/util/StringUtil.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/jit/python/module_python.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace torch_stage::python {

// A blocking wait for Python callers (StagingArea, Stage, RecordInput):
// `attempt(deadline)` runs first without waiting and without giving up the
// GIL (the common, cheap case), then, while it returns `timed_out` and time
// is left, in slices of at most 100 ms with the GIL released, checking for
// signals between slices so that a main thread blocked here still gets
// KeyboardInterrupt. timeout_ms < 0 waits without bound; 0 tries once.
// Returns the last status (`timed_out` when the time ran out).
template <typename Status, typename Attempt>
Status wait_releasing_gil(
    int64_t timeout_ms,
    Status timed_out,
    Attempt attempt) {
  using Clock = std::chrono::steady_clock;
  constexpr auto kSlice = std::chrono::milliseconds(100);
  Status status = attempt(Clock::now());
  if (status != timed_out || timeout_ms == 0) {
    return status;
  }
  const bool forever = timeout_ms < 0;
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(forever ? 0 : timeout_ms);
  while (true) {
    const auto slice_end = Clock::now() + kSlice;
    const auto until = forever ? slice_end : std::min(slice_end, deadline);
    {
      pybind11::gil_scoped_release no_gil;
      status = attempt(until);
    }
    if (status != timed_out || (!forever && Clock::now() >= deadline)) {
      return status;
    }
    if (PyErr_CheckSignals() != 0) {
      throw pybind11::error_already_set();
    }
  }
}

// The C++ object behind a torch.ScriptObject of custom class T (`name` is
// the class's Python name, for the TypeError when it is something else).
template <typename T>
c10::intrusive_ptr<T> custom_class_from(
    pybind11::handle obj,
    const char* name) {
  auto object = torch::jit::as_object(obj);
  if (!object.has_value()) {
    throw pybind11::type_error(
        c10::str("expected a ", name, ", got ", Py_TYPE(obj.ptr())->tp_name));
  }
  c10::IValue value(object->_ivalue());
  if (value.type() != c10::getCustomClassType<c10::intrusive_ptr<T>>()) {
    throw pybind11::type_error(
        c10::str("expected a ", name, ", got a ", value.type()->repr_str()));
  }
  return value.toCustomClass<T>();
}

// _StagingAreaHandle: the GIL-aware Python fast path of StagingArea.
void init_staging(pybind11::module_& m);

// _Stage: Python sources, transforms and consumers of a Stage; stage pools.
void init_stage(pybind11::module_& m);

// The multi-stream pass's stream ops without the torch.ops call overhead.
void init_streams(pybind11::module_& m);

// TFRecord files, Example encoding/parsing and RecordInput.
void init_records(pybind11::module_& m);

} // namespace torch_stage::python
