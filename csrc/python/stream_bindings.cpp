// The stream ops of multi-stream GraphModules, called from Python without
// torch.ops.
//
// Why: an operator call from Python looks up __torch_function__ on every
// argument; on a torch.ScriptObject (the StreamRun every stream op takes)
// that lookup goes through ScriptObject.__getattr__, which throws and
// catches a C++ exception: ~20 us per call on the project's CPU machine,
// against ~5 us for an aten op, and a rewritten module calls a few stream
// ops per node. Eagerly, fork returns the run as a _StreamRun (a plain
// pybind11 object holding the same StreamRun) whose methods call the
// StreamRun methods the registered ops call (csrc/ops/stream_ops.cpp), with
// a RECORD_FUNCTION under the op's name so profiles look the same: the
// pass's functions (torch_stage/fx/_ops.py) only check `type(run)` to pick
// this path, where unwrapping a ScriptObject and asking whether Dynamo or
// the JIT tracer runs cost ~0.6 us per call. Anything that must see the op
// itself (a tracer, a tensor subclass) gets the run as a ScriptObject from
// script_object(). TorchScript always calls the registered ops.
#include <ATen/record_function.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

#include "python/bindings.h"
#include "streams/stream_observer.h"
#include "streams/stream_pool.h"
#include "streams/stream_run.h"

namespace py = pybind11;

namespace torch_stage::python {
namespace {

using Run = c10::intrusive_ptr<StreamRun>;

// StreamRun::device_of over the Python objects themselves (the first
// non-CPU tensor, depth first), without converting them to IValues.
std::optional<c10::Device> device_of(py::handle obj) {
  PyObject* p = obj.ptr();
  if (THPVariable_Check(p)) {
    const at::Tensor& t = THPVariable_Unpack(p);
    if (t.defined() && t.device().type() != c10::DeviceType::CPU) {
      return t.device();
    }
    return std::nullopt;
  }
  if (PyTuple_Check(p) || PyList_Check(p)) {
    for (py::handle item : obj) {
      if (auto d = device_of(item)) {
        return d;
      }
    }
  } else if (PyDict_Check(p)) {
    for (auto item : py::reinterpret_borrow<py::dict>(obj)) {
      if (auto d = device_of(item.second)) {
        return d;
      }
    }
  }
  return std::nullopt;
}

// The op's `Any` value from a Python object, for record_stream: tensors,
// and tuples, lists and dicts of them, built directly (the generic toIValue
// infers the type of a tuple first: ~18 us for one tensor); other leaves
// become None, as record_stream skips them anyway. The observer sees
// containers as tuples.
c10::IValue any_value(py::handle value) {
  PyObject* p = value.ptr();
  if (THPVariable_Check(p)) {
    return c10::IValue(THPVariable_Unpack(p));
  }
  std::vector<c10::IValue> items;
  if (PyTuple_Check(p) || PyList_Check(p)) {
    const Py_ssize_t size = PySequence_Fast_GET_SIZE(p);
    PyObject** objects = PySequence_Fast_ITEMS(p);
    items.reserve(static_cast<size_t>(size));
    for (Py_ssize_t i = 0; i < size; ++i) {
      items.push_back(any_value(objects[i]));
    }
  } else if (PyDict_Check(p)) {
    for (auto item : py::reinterpret_borrow<py::dict>(value)) {
      items.push_back(any_value(item.second));
    }
  } else {
    return c10::IValue();
  }
  return c10::ivalue::Tuple::create(std::move(items));
}

} // namespace

void init_streams(py::module_& m) {
  py::class_<StreamRun, Run>(m, "_StreamRun")
      .def(
          "set_stream",
          [](StreamRun& run, int64_t stream) {
            RECORD_FUNCTION(
                "torch_stage::set_stream", std::vector<c10::IValue>());
            run.set_stream(stream);
          },
          py::arg("stream"))
      .def(
          "record_event",
          [](StreamRun& run, int64_t event, int64_t stream) {
            RECORD_FUNCTION(
                "torch_stage::record_event", std::vector<c10::IValue>());
            run.record_event(event, stream);
          },
          py::arg("event"),
          py::arg("stream"))
      .def(
          "wait_event",
          [](StreamRun& run, int64_t event, int64_t stream) {
            RECORD_FUNCTION(
                "torch_stage::wait_event", std::vector<c10::IValue>());
            run.wait_event(event, stream);
          },
          py::arg("event"),
          py::arg("stream"))
      .def(
          "record_stream",
          [](StreamRun& run, py::handle value, int64_t stream) {
            RECORD_FUNCTION(
                "torch_stage::record_stream", std::vector<c10::IValue>());
            run.record_stream(any_value(value), stream);
          },
          py::arg("value"),
          py::arg("stream"))
      .def(
          "sync",
          [](StreamRun& run,
             int64_t record,
             int64_t stream,
             py::handle waits,
             py::handle keep) {
            RECORD_FUNCTION("torch_stage::sync", std::vector<c10::IValue>());
            // The pass passes a list of ints; reading it by hand saves
            // pybind11's generic sequence caster (~0.3 us a call).
            c10::SmallVector<int64_t, 8> events;
            if (!PyList_Check(waits.ptr())) {
              throw py::type_error(c10::str(
                  "torch_stage.sync: waits must be a list of ints, got ",
                  Py_TYPE(waits.ptr())->tp_name));
            }
            for (py::handle e : waits) {
              events.push_back(e.cast<int64_t>());
            }
            run.sync(record, stream, events, any_value(keep));
          },
          py::arg("record"),
          py::arg("stream"),
          py::arg("waits"),
          py::arg("keep"))
      .def(
          "join",
          [](StreamRun& run, const std::vector<int64_t>& side_streams) {
            RECORD_FUNCTION("torch_stage::join", std::vector<c10::IValue>());
            run.join(side_streams);
          },
          py::arg("side_streams"))
      .def("id", &StreamRun::id)
      .def("is_active", &StreamRun::is_active)
      .def("device", &StreamRun::device)
      .def("kept_tensors", &StreamRun::kept_tensors)
      // The same run as the torch.classes.torch_stage.StreamRun the ops
      // take.
      .def("script_object", [](const Run& run) {
        return torch::jit::toPyObject(c10::IValue(run));
      });
  // fork through torch.ops converts its `Any` probes to IValues and checks
  // every argument for __torch_function__: ~10-20 us, the largest host cost
  // of a rewritten forward. Same StreamRun, same observer notes.
  m.def(
      "_stream_fork",
      [](int64_t num_streams,
         const std::vector<int64_t>& side_streams,
         int64_t num_events,
         py::handle probes) {
        RECORD_FUNCTION("torch_stage::fork", std::vector<c10::IValue>());
        return c10::make_intrusive<StreamRun>(
            device_of(probes), num_streams, side_streams, num_events);
      },
      py::arg("num_streams"),
      py::arg("side_streams"),
      py::arg("num_events"),
      py::arg("probes"));
  // torch_stage.sanitize_streams: every stream op, from any caller, as
  // observer(op, owner, stream, event, streams, value, owner_thread).
  m.def(
      "_set_stream_observer",
      [](py::object observer) {
        if (observer.is_none()) {
          ReleasedGil no_gil;
          set_stream_observer(nullptr);
          return;
        }
        // The Python callable is released with the GIL held, whichever
        // thread drops the last reference.
        std::shared_ptr<py::object> held(
            new py::object(std::move(observer)), [](py::object* o) {
              py::gil_scoped_acquire gil;
              delete o;
            });
        auto call = std::make_shared<const StreamObserver>(
            [held](const StreamOpNote& note) {
              py::gil_scoped_acquire gil;
              (*held)(
                  note.op,
                  note.owner,
                  note.stream,
                  note.event,
                  note.streams,
                  torch::jit::toPyObject(note.value),
                  note.owner_thread);
            });
        ReleasedGil no_gil;
        set_stream_observer(std::move(call));
      },
      py::arg("observer"));
  m.def("_stream_run_depth", &StreamRun::thread_run_depth);
  // CUDAGraphModule's capture stream as (stream_id, device_index,
  // device_type), the arguments of torch.cuda.Stream.
  m.def(
      "_capture_stream",
      [](const std::string& device) {
        const c10::Stream s = StreamPool::capture_stream(c10::Device(device));
        return py::make_tuple(
            s.id(),
            static_cast<int64_t>(s.device_index()),
            static_cast<int64_t>(s.device_type()));
      },
      py::arg("device"));
  m.def("_stream_abort_runs", &StreamRun::abort_thread_runs, py::arg("depth"));
}

} // namespace torch_stage::python
