// The Python fast path of StagingArea.
//
// Calling a torch.classes method from Python costs a script-method dispatch
// and a GIL release/reacquire on every call, waiting or not: ~15 us, several
// times the cost of queue.Queue (benchmarks/buffer_throughput.py). Here each
// operation first tries without waiting while holding the GIL (it only takes
// the buffer's mutex, which no holder keeps while needing the GIL, so this
// cannot deadlock), and releases the GIL only when it has to wait. Waits run
// in slices so that a main thread blocked here still sees KeyboardInterrupt.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <string>

#include "python/bindings.h"
#include "staging/staging_area.h"

namespace py = pybind11;

namespace torch_stage::python {
namespace {

using Clock = std::chrono::steady_clock;
using Area = c10::intrusive_ptr<StagingArea>;

[[noreturn]] void raise(const char* type, const std::string& message) {
  // torch_stage.errors defines the Python classes; look them up at raise
  // time (a rare event) rather than caching objects past interpreter exit.
  py::object cls = py::module_::import("torch_stage.errors").attr(type);
  PyErr_SetString(cls.ptr(), message.c_str());
  throw py::error_already_set();
}

[[noreturn]] void raise_status(
    const StagingArea& area,
    BufferStatus status,
    const char* op,
    const TensorBundle* bundle) {
  const std::string message = area.error_message(status, op, bundle);
  switch (status) {
    case BufferStatus::kClosed:
      raise("StageClosed", message.substr(message.find(']') + 2));
    case BufferStatus::kCancelled:
      raise("StageCancelled", message.substr(message.find(']') + 2));
    case BufferStatus::kTooLarge:
      throw py::value_error(message);
    default:
      throw std::logic_error(message);
  }
}

TensorBundle to_bundle(py::handle tensors, const char* op) {
  if (THPVariable_Check(tensors.ptr()) ||
      !(PyList_Check(tensors.ptr()) || PyTuple_Check(tensors.ptr()))) {
    throw py::type_error(c10::str(
        "StagingArea.",
        op,
        " takes a list of tensors, got ",
        Py_TYPE(tensors.ptr())->tp_name,
        "; wrap a single tensor as [tensor]"));
  }
  py::sequence seq = py::reinterpret_borrow<py::sequence>(tensors);
  TensorBundle bundle;
  bundle.reserve(seq.size());
  for (size_t i = 0; i < seq.size(); ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq.ptr(), i);
    if (!THPVariable_Check(item)) {
      throw py::type_error(c10::str(
          "StagingArea.",
          op,
          ": element ",
          i,
          " of the bundle is a ",
          Py_TYPE(item)->tp_name,
          ", not a torch.Tensor; a bundle holds tensors only"));
    }
    bundle.push_back(THPVariable_Unpack(item));
  }
  return bundle;
}

Area from_script_object(py::handle obj) {
  return custom_class_from<StagingArea>(
      obj, "torch.classes.torch_stage.StagingArea");
}

// put/try_put: returns False only when the timeout passed.
bool put(const Area& area, py::handle tensors, int64_t timeout_ms) {
  TensorBundle bundle = to_bundle(tensors, timeout_ms < 0 ? "put" : "try_put");
  const BufferStatus status = wait_releasing_gil(
      timeout_ms, BufferStatus::kTimeout, [&](Clock::time_point t) {
        return area->buffer().try_put_until(bundle, t);
      });
  if (status == BufferStatus::kTimeout) {
    return false;
  }
  if (status != BufferStatus::kOk) {
    raise_status(*area, status, timeout_ms < 0 ? "put" : "try_put", &bundle);
  }
  return true;
}

// take/try_take: returns None only when the timeout passed.
py::object take(const Area& area, int64_t timeout_ms) {
  TensorBundle out;
  const BufferStatus status = wait_releasing_gil(
      timeout_ms, BufferStatus::kTimeout, [&](Clock::time_point t) {
        return area->buffer().try_take_until(out, t);
      });
  if (status == BufferStatus::kTimeout) {
    return py::none();
  }
  if (status != BufferStatus::kOk) {
    raise_status(*area, status, timeout_ms < 0 ? "take" : "try_take", nullptr);
  }
  py::list result(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    result[i] =
        py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[i])));
  }
  return result;
}

} // namespace

void init_staging(py::module_& m) {
  py::class_<StagingArea, Area>(m, "_StagingAreaHandle")
      .def(py::init(&from_script_object), py::arg("script_object"))
      .def(
          "put",
          &put,
          py::arg("tensors"),
          py::arg("timeout_ms") = -1,
          "Put a bundle; timeout_ms < 0 waits without bound. "
          "Returns False if the timeout passed.")
      .def(
          "take",
          &take,
          py::arg("timeout_ms") = -1,
          "Take a bundle; timeout_ms < 0 waits without bound. "
          "Returns None if the timeout passed.");
}

} // namespace torch_stage::python
