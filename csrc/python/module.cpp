// torch_stage._C: pybind11 glue, only where Python objects are involved.
// Operators and custom classes live in libtorch_stage.so (csrc/ops), which
// this module links and which C++ programs use without Python.
#include <torch/csrc/utils/pybind.h>

#include "python/bindings.h"

namespace torch_stage::python {

bool drain_gated_gil_users(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (gated_gil_users().load() == 0) {
    return true;
  }
  // A thread inside a gate may be waiting for the GIL this thread holds.
  ReleasedGil no_gil;
  while (gated_gil_users().load() > 0) {
    if (std::chrono::steady_clock::now() >= deadline) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

} // namespace torch_stage::python

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "torch_stage Python bindings (internal; use the torch_stage package)";
  torch_stage::python::main_thread_ident() =
      pybind11::module_::import("threading")
          .attr("main_thread")()
          .attr("ident")
          .cast<unsigned long>();
  m.def(
      "_interpreter_exit_begins",
      [](int64_t drain_timeout_ms) {
        torch_stage::python::interpreter_exit_began().store(true);
        return torch_stage::python::drain_gated_gil_users(
            std::chrono::milliseconds(drain_timeout_ms));
      },
      pybind11::arg("drain_timeout_ms"),
      "Called by torch_stage's atexit hook: from now on no thread but the "
      "main one starts waiting for the GIL from a destructor, and the waits "
      "that began before end first, for at most drain_timeout_ms (see "
      "ExitGate in csrc/python/bindings.h). Returns whether they all did.");
  m.def(
      "_delay_gil_waits",
      [](int64_t ms) { torch_stage::python::gil_wait_delay_ms().store(ms); },
      pybind11::arg("ms"),
      "Fault injection for the tests: a thread of ours sleeps ms after its "
      "last check of the exit, just before it waits for the GIL.");
  m.def(
      "_gated_gil_users",
      [] { return torch_stage::python::gated_gil_users().load(); },
      "Threads inside an ExitGate now (for the tests).");
  torch_stage::python::init_staging(m);
  torch_stage::python::init_stage(m);
  torch_stage::python::init_records(m);
  torch_stage::python::init_streams(m);
  torch_stage::python::init_trace(m);
}
