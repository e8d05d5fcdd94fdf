// The stream ops of multi-stream GraphModules, called from Python without
// torch.ops.
//
// Why: an operator call from Python looks up __torch_function__ on every
// argument; on a torch.ScriptObject (the StreamRun every stream op takes)
// that lookup goes through ScriptObject.__getattr__, which throws and
// catches a C++ exception: ~20 us per call on the project's CPU machine,
// against ~5 us for an aten op, and a rewritten module calls a few stream
// ops per node. These functions unwrap the run directly and call the same
// StreamRun methods the registered ops call (csrc/ops/stream_ops.cpp), with
// a RECORD_FUNCTION under the op's name so profiles look the same. Which
// path runs is chosen in torch_stage/fx/_ops.py; TorchScript always calls
// the registered ops.
#include <ATen/record_function.h>
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

Run run_from(py::handle obj) {
  return custom_class_from<StreamRun>(
      obj, "torch.classes.torch_stage.StreamRun");
}

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

} // namespace

void init_streams(py::module_& m) {
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
        auto run = c10::make_intrusive<StreamRun>(
            device_of(probes), num_streams, side_streams, num_events);
        return torch::jit::toPyObject(c10::IValue(std::move(run)));
      },
      py::arg("num_streams"),
      py::arg("side_streams"),
      py::arg("num_events"),
      py::arg("probes"));
  m.def(
      "_stream_set_stream",
      [](py::handle run, int64_t stream) {
        RECORD_FUNCTION("torch_stage::set_stream", std::vector<c10::IValue>());
        run_from(run)->set_stream(stream);
      },
      py::arg("run"),
      py::arg("stream"));
  m.def(
      "_stream_record_event",
      [](py::handle run, int64_t event, int64_t stream) {
        RECORD_FUNCTION(
            "torch_stage::record_event", std::vector<c10::IValue>());
        run_from(run)->record_event(event, stream);
      },
      py::arg("run"),
      py::arg("event"),
      py::arg("stream"));
  m.def(
      "_stream_wait_event",
      [](py::handle run, int64_t event, int64_t stream) {
        RECORD_FUNCTION("torch_stage::wait_event", std::vector<c10::IValue>());
        run_from(run)->wait_event(event, stream);
      },
      py::arg("run"),
      py::arg("event"),
      py::arg("stream"));
  m.def(
      "_stream_record_stream",
      [](py::handle run, py::handle value, int64_t stream) {
        RECORD_FUNCTION(
            "torch_stage::record_stream", std::vector<c10::IValue>());
        // The op's `Any` argument: tensors, lists, tuples, dicts, None.
        const c10::IValue ivalue = THPVariable_Check(value.ptr())
            ? c10::IValue(THPVariable_Unpack(value.ptr()))
            : torch::jit::toIValue(value, c10::AnyType::get());
        run_from(run)->record_stream(ivalue, stream);
      },
      py::arg("run"),
      py::arg("value"),
      py::arg("stream"));
  m.def(
      "_stream_join",
      [](py::handle run, const std::vector<int64_t>& side_streams) {
        RECORD_FUNCTION("torch_stage::join", std::vector<c10::IValue>());
        run_from(run)->join(side_streams);
      },
      py::arg("run"),
      py::arg("side_streams"));
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
  m.def("_stream_run_id", [](py::handle run) { return run_from(run)->id(); });
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
