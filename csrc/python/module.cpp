// torch_stage._C: pybind11 glue, only where Python objects are involved.
// Operators and custom classes live in libtorch_stage.so (csrc/ops), which
// this module links and which C++ programs use without Python.
#include <torch/csrc/utils/pybind.h>

#include "python/bindings.h"

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
      [] { torch_stage::python::interpreter_exit_began().store(true); },
      "Called by torch_stage's atexit hook: from now on no thread but the "
      "main one starts waiting for the GIL (see csrc/python/bindings.h).");
  torch_stage::python::init_staging(m);
  torch_stage::python::init_stage(m);
  torch_stage::python::init_records(m);
  torch_stage::python::init_streams(m);
  torch_stage::python::init_trace(m);
}
