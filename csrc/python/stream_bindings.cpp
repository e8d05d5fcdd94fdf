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
// pass's functions (torch_stage/streams/fx/_ops.py) only check `type(run)` to
// pick this path, where unwrapping a ScriptObject and asking whether Dynamo or
// the JIT tracer runs cost ~0.6 us per call. Anything that must see the op
// itself (a tracer, a tensor subclass) gets the run as a ScriptObject from
// script_object(). TorchScript always calls the registered ops.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> // PyLongObject's digits; Python.h has it from 3.11
#endif

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
  // Containers first: THPVariable_Check of anything but a tensor is an
  // isinstance call (~0.8k instructions).
  if (PyTuple_Check(p) || PyList_Check(p)) {
    const Py_ssize_t size = PySequence_Fast_GET_SIZE(p);
    for (Py_ssize_t i = 0; i < size; ++i) {
      if (auto d = device_of(PySequence_Fast_GET_ITEM(p, i))) {
        return d;
      }
    }
  } else if (PyDict_Check(p)) {
    for (auto item : py::reinterpret_borrow<py::dict>(obj)) {
      if (auto d = device_of(item.second)) {
        return d;
      }
    }
  } else if (THPVariable_Check(p)) {
    const at::Tensor& t = THPVariable_Unpack(p);
    if (t.defined() && t.device().type() != c10::DeviceType::CPU) {
      return t.device();
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
  if (THPVariable_CheckExact(p) ||
      (!PyTuple_Check(p) && !PyList_Check(p) && !PyDict_Check(p) &&
       THPVariable_Check(p))) {
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

// RECORD_FUNCTION, with the guard made only where a callback listens (the
// dispatcher's own pattern): the macro makes and destroys a RecordFunction
// on every call, two thirds of its cost where nothing listens, and the
// fast functions run several times per forward.
class RecordCall {
 public:
  explicit RecordCall(const char* name) {
    auto callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION);
    if (C10_UNLIKELY(callbacks.has_value())) {
      guard_.emplace(std::move(*callbacks));
      if (guard_->isActive()) {
        ::at::detail::record_function_with_scope(
            *guard_, name, std::vector<c10::IValue>());
      }
    }
  }

  // Whether a callback listened (StreamRun::unprofiled).
  bool listened() const {
    return guard_.has_value();
  }

 private:
  std::optional<at::RecordFunction> guard_;
};

// The node targets of rewritten graphs: fork, sync, record_event and join
// as C functions (METH_FASTCALL), the same objects in the graph, in its
// generated code, in TorchScript's builtin table and in FX's side-effect
// set (torch_stage/streams/fx/_ops.py). A Python function in between cost ~1.3k
// instructions a call, pybind11's dispatcher ~2-3k more, and fork's
// torch.compiler.is_compiling() 1.3k: together most of what a rewritten
// forward adds to a plain GraphModule (benchmarks/host_instructions.py).
// Each function does what the _StreamRun method of the same name does,
// and hands every call it does not take to its Python fallback, which
// calls the registered op: a run that is not a _StreamRun (a ScriptObject
// under Dynamo, a Proxy while FX traces), an argument with
// __torch_function__ (a tensor subclass, a Proxy, a TorchFunctionMode), fork
// under the JIT tracer or torch.compile/export (torch.compiler's
// _is_compiling_flag), and any call not shaped as the pass emits it
// (keywords, another number of arguments).
struct FastOps {
  PyTypeObject* run_type = nullptr; // torch_stage._C._StreamRun
  PyObject* has_torch_function = nullptr; // torch._C._has_torch_function
  PyObject* compiler = nullptr; // the torch.compiler module's __dict__
  PyObject* compiling_flag = nullptr; // "_is_compiling_flag"
  PyObject* is_compiling = nullptr; // torch.compiler.is_compiling
  PyObject* fallback[4] = {}; // fork, sync, record_event, join
  // The last run fast_join joined that fast_fork may start again
  // (StreamRun::restart), or nullptr; a strong reference, guarded by the
  // GIL. fork hands the reference to its caller and join puts it back, so
  // the slot only ever holds a joined run: one dropped unjoined is
  // finished by its destructor, when it is dropped, as any run is.
  PyObject* spare_run = nullptr;
};

enum FastOp { kFork = 0, kSync = 1, kRecordEvent = 2, kJoin = 3 };

// Set once by _stream_fast_ops and never released: the functions it returns
// are module attributes that live as long as the interpreter.
FastOps* fast_ops = nullptr;

PyObject* fall_back(
    FastOp op,
    PyObject* const* args,
    size_t nargsf,
    PyObject* kwnames) {
  return PyObject_Vectorcall(fast_ops->fallback[op], args, nargsf, kwnames);
}

// Whether a call on a run is one its C function takes itself: `nargs`
// positional arguments, no keywords, a _StreamRun first. Any other goes to
// the Python function (fall_back).
bool takes_run_call(
    PyObject* const* args,
    size_t nargsf,
    PyObject* kwnames,
    Py_ssize_t nargs) {
  return kwnames == nullptr && PyVectorcall_NARGS(nargsf) == nargs &&
      Py_TYPE(args[0]) == fast_ops->run_type;
}

// 0 where has_torch_function can tell without a call: no mode, and a plain
// tensor, or a tuple or list of them and None; -1 where it cannot.
int has_torch_function_inline(PyObject* obj) {
  if (at::impl::torch_function_mode_enabled()) {
    return -1;
  }
  if (THPVariable_CheckExact(obj)) {
    return 0;
  }
  if (PyTuple_CheckExact(obj) || PyList_CheckExact(obj)) {
    const Py_ssize_t size = PySequence_Fast_GET_SIZE(obj);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i < size; ++i) {
      if (items[i] != Py_None && !THPVariable_CheckExact(items[i])) {
        return -1;
      }
    }
    return 0;
  }
  return -1;
}

// 1 when `obj` (or, for a tuple or list, an item of it) overrides
// __torch_function__ or a TorchFunctionMode is active, 0 if not, -1 on error.
int has_torch_function(PyObject* obj) {
  // Without a mode, a plain tensor (or a tuple or list of them and None)
  // has none: decided here, as torch does, without a call (~0.4k
  // instructions). Anything else asks torch.
  if (has_torch_function_inline(obj) == 0) {
    return 0;
  }
  PyObject* r = PyObject_CallOneArg(fast_ops->has_torch_function, obj);
  if (r == nullptr) {
    return -1;
  }
  const int t = PyObject_IsTrue(r);
  Py_DECREF(r);
  return t;
}

// has_torch_function of a sync's or join's keep; 0 for None.
int keep_overridden(PyObject* keep) {
  return keep == Py_None ? 0 : has_torch_function(keep);
}

// torch.compiler.is_compiling() without a Python call where the flag it
// returns is a module global (torch 2.5 and newer), read from the module's
// dict (a module getattr costs ~0.6k instructions); 1, 0 or -1 on error.
int compiling() {
  PyObject* flag =
      PyDict_GetItemWithError(fast_ops->compiler, fast_ops->compiling_flag);
  if (flag != nullptr) {
    return PyObject_IsTrue(flag); // borrowed
  }
  if (PyErr_Occurred()) {
    return -1;
  }
  PyObject* called = PyObject_CallNoArgs(fast_ops->is_compiling);
  if (called == nullptr) {
    return -1;
  }
  const int t = PyObject_IsTrue(called);
  Py_DECREF(called);
  return t;
}

// The StreamRun of a _StreamRun (exact type checked by the caller), or
// nullptr, no error set, for an instance whose constructor never ran.
StreamRun* plain_run(PyObject* obj) {
  auto* inst = reinterpret_cast<py::detail::instance*>(obj);
  // A class of one C++ type, as _StreamRun is, keeps its value and holder
  // in the instance itself (pybind11's simple layout): read them there
  // rather than through get_value_and_holder, a call a tenth of a sync.
  if (C10_LIKELY(inst->simple_layout)) {
    return inst->simple_holder_constructed
        ? static_cast<StreamRun*>(inst->simple_value_holder[0])
        : nullptr;
  }
  auto v_h = inst->get_value_and_holder(nullptr, false);
  // (A constructed holder may still hold no run: value_ptr is null then.)
  return v_h && v_h.holder_constructed() ? v_h.value_ptr<StreamRun>() : nullptr;
}

// plain_run, with a TypeError where there is no run.
StreamRun* run_of(PyObject* obj, const char* op) {
  StreamRun* run = plain_run(obj);
  if (run == nullptr) {
    PyErr_Format(
        PyExc_TypeError,
        "torch_stage.%s: the stream run holds no run (make runs with fork)",
        op);
  }
  return run;
}

// What the inline paths below read without a Python error or a C++
// exception: an exact int that fits (here), a tuple or list of a few such
// (plain_ints), a run whose constructor ran (plain_run). Anything else is
// false, no error set: the general path then reads it again and says what
// is wrong.
bool plain_int(PyObject* obj, int64_t* out) {
  if (!PyLong_CheckExact(obj)) {
    return false;
  }
  // The pass's ints (streams, events) are small: read one digit where
  // CPython keeps one, without PyLong_AsLongLongAndOverflow (a call and its
  // checks, a fifth of a sync's instructions for its two or three ints).
#if PY_VERSION_HEX >= 0x030C0000
  auto* value = reinterpret_cast<PyLongObject*>(obj);
  if (PyUnstable_Long_IsCompact(value)) {
    *out = PyUnstable_Long_CompactValue(value);
    return true;
  }
#else
  const Py_ssize_t digits = Py_SIZE(obj);
  if (digits >= -1 && digits <= 1) {
    *out = digits *
        static_cast<int64_t>(reinterpret_cast<PyLongObject*>(obj)->ob_digit[0]);
    return true;
  }
#endif
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(obj, &overflow);
  return overflow == 0 && !(*out == -1 && PyErr_Occurred());
}

bool read_int(PyObject* obj, const char* op, const char* name, int64_t* out) {
  if (plain_int(obj, out)) {
    return true;
  }
  if (!PyLong_Check(obj)) {
    PyErr_Format(
        PyExc_TypeError,
        "torch_stage.%s: %s must be an int, got %s",
        op,
        name,
        Py_TYPE(obj)->tp_name);
    return false;
  }
  *out = PyLong_AsLongLong(obj);
  return !(*out == -1 && PyErr_Occurred());
}

template <typename Ints>
bool read_ints(PyObject* obj, const char* op, const char* name, Ints* out) {
  if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
    PyErr_Format(
        PyExc_TypeError,
        "torch_stage.%s: %s must be a list of ints, got %s",
        op,
        name,
        Py_TYPE(obj)->tp_name);
    return false;
  }
  const Py_ssize_t size = PySequence_Fast_GET_SIZE(obj);
  PyObject** items = PySequence_Fast_ITEMS(obj);
  for (Py_ssize_t i = 0; i < size; ++i) {
    int64_t v = 0;
    if (!read_int(items[i], op, name, &v)) {
      return false;
    }
    out->push_back(v);
  }
  return true;
}

PyObject* fast_fork(
    PyObject* /*self*/,
    PyObject* const* args,
    size_t nargsf,
    PyObject* kwnames) {
  HANDLE_TH_ERRORS
  if (kwnames != nullptr || PyVectorcall_NARGS(nargsf) != 4 ||
      torch::jit::tracer::isTracing()) {
    return fall_back(kFork, args, nargsf, kwnames);
  }
  const int is_compiling = compiling();
  const int overridden = is_compiling == 0 ? has_torch_function(args[3]) : 0;
  if (is_compiling < 0 || overridden < 0) {
    return nullptr;
  }
  if (is_compiling || overridden) {
    return fall_back(kFork, args, nargsf, kwnames);
  }
  int64_t num_streams = 0;
  int64_t num_events = 0;
  // On the stack for the pool's 32 streams: a heap vector was a third of
  // what fork cost (callgrind).
  c10::SmallVector<int64_t, 32> side_streams;
  if (!read_int(args[0], "fork", "num_streams", &num_streams) ||
      !read_ints(args[1], "fork", "side_streams", &side_streams) ||
      !read_int(args[2], "fork", "num_events", &num_events)) {
    return nullptr;
  }
  RecordCall record_call("torch_stage::fork");
  const std::optional<c10::Device> device = device_of(args[3]);
  // A forward on CPU makes a run per call and drops it: starting the last
  // one again saves a third of what fork and join cost the host between
  // two ops (a new run, its Python object, and the registries of both).
  PyObject* spare = fast_ops->spare_run;
  if (spare != nullptr && Py_REFCNT(spare) == 1) {
    StreamRun* run = run_of(spare, "fork");
    if (run->restart(device, num_streams, side_streams, num_events)) {
      run->set_unprofiled(!record_call.listened());
      fast_ops->spare_run = nullptr;
      return spare;
    }
  }
  auto run = c10::make_intrusive<StreamRun>(
      device,
      num_streams,
      std::vector<int64_t>(side_streams.begin(), side_streams.end()),
      num_events);
  run->set_unprofiled(!record_call.listened());
  return py::cast(std::move(run)).release().ptr();
  END_HANDLE_TH_ERRORS
}

constexpr Py_ssize_t kInlineWaits = 8;

// At most `capacity` plain ints into `out`.
bool plain_ints(
    PyObject* obj,
    int64_t* out,
    Py_ssize_t* size,
    Py_ssize_t capacity = kInlineWaits) {
  if (!PyTuple_CheckExact(obj) && !PyList_CheckExact(obj)) {
    return false;
  }
  *size = PySequence_Fast_GET_SIZE(obj);
  if (*size > capacity) {
    return false;
  }
  PyObject** items = PySequence_Fast_ITEMS(obj);
  for (Py_ssize_t i = 0; i < *size; ++i) {
    if (!plain_int(items[i], &out[i])) {
      return false;
    }
  }
  return true;
}

// A sync's or join's keep as the run takes it: None on an inactive run,
// which marks nothing, unless an observer would see the value.
c10::IValue kept_value(const StreamRun* run, PyObject* keep) {
  return keep != Py_None && (run->is_active() || stream_observer_active())
      ? any_value(keep)
      : c10::IValue();
}

// sync on an inactive, unprofiled run (a forward on CPU) with nothing to
// record, check or say: the run's bookkeeping alone
// (StreamRun::sync_inactive), without HANDLE_TH_ERRORS (whose warning
// handler is a fifth of a sync's instructions) or a RecordCall. True when
// done; false, nothing changed and no error set, for the general path to
// do the call.
bool sync_inline(PyObject* const* args) {
  PyObject* keep = args[4];
  if (keep != Py_None && has_torch_function_inline(keep) != 0) {
    return false;
  }
  StreamRun* run = plain_run(args[0]);
  int64_t record = 0;
  int64_t stream = 0;
  int64_t waits[kInlineWaits];
  Py_ssize_t count = 0;
  return run != nullptr && run->unprofiled() && plain_int(args[1], &record) &&
      plain_int(args[2], &stream) && plain_ints(args[3], waits, &count) &&
      run->sync_inactive(record, stream, c10::ArrayRef<int64_t>(waits, count));
}

// Each fast function is its inline path, then a call of its general one:
// kept apart (not inlined), the inline path is a few cache lines with a
// small frame, where the general path's frame and code came first
// (HANDLE_TH_ERRORS, a RecordFunction, vectors on the stack).
C10_NOINLINE PyObject* sync_general(
    PyObject* const* args,
    size_t nargsf,
    PyObject* kwnames,
    bool run_call) {
  HANDLE_TH_ERRORS
  if (!run_call) {
    return fall_back(kSync, args, nargsf, kwnames);
  }
  PyObject* keep = args[4];
  const int overridden = keep_overridden(keep);
  if (overridden != 0) {
    return overridden < 0 ? nullptr : fall_back(kSync, args, nargsf, kwnames);
  }
  StreamRun* run = run_of(args[0], "sync");
  int64_t record = 0;
  int64_t stream = 0;
  c10::SmallVector<int64_t, 8> waits;
  if (run == nullptr || !read_int(args[1], "sync", "record", &record) ||
      !read_int(args[2], "sync", "stream", &stream)) {
    return nullptr;
  }
  if (!read_ints(args[3], "sync", "waits", &waits)) {
    return nullptr;
  }
  RecordCall record_call("torch_stage::sync");
  if (run->sync_inactive(record, stream, waits)) {
    Py_RETURN_NONE;
  }
  run->sync(record, stream, waits, kept_value(run, keep));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* fast_sync(
    PyObject* /*self*/,
    PyObject* const* args,
    size_t nargsf,
    PyObject* kwnames) {
  const bool run_call = takes_run_call(args, nargsf, kwnames, 5);
  if (run_call && sync_inline(args)) {
    Py_RETURN_NONE;
  }
  return sync_general(args, nargsf, kwnames, run_call);
}

C10_NOINLINE PyObject* record_event_general(
    PyObject* const* args,
    size_t nargsf,
    PyObject* kwnames,
    bool run_call) {
  HANDLE_TH_ERRORS
  if (!run_call) {
    return fall_back(kRecordEvent, args, nargsf, kwnames);
  }
  StreamRun* run = run_of(args[0], "record_event");
  int64_t event = 0;
  int64_t stream = 0;
  if (run == nullptr || !read_int(args[1], "record_event", "event", &event) ||
      !read_int(args[2], "record_event", "stream", &stream)) {
    return nullptr;
  }
  RecordCall record_call("torch_stage::record_event");
  if (!run->record_event_inactive(event, stream)) {
    run->record_event(event, stream);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* fast_record_event(
    PyObject* /*self*/,
    PyObject* const* args,
    size_t nargsf,
    PyObject* kwnames) {
  // The inline path, as sync's (sync_inline).
  const bool run_call = takes_run_call(args, nargsf, kwnames, 3);
  if (run_call) {
    StreamRun* run = plain_run(args[0]);
    int64_t event = 0;
    int64_t stream = 0;
    if (run != nullptr && run->unprofiled() && plain_int(args[1], &event) &&
        plain_int(args[2], &stream) &&
        run->record_event_inactive(event, stream)) {
      Py_RETURN_NONE;
    }
  }
  return record_event_general(args, nargsf, kwnames, run_call);
}

// After a join: an inactive run is the one the next fork may start again.
void keep_spare(PyObject* joined, const StreamRun* run) {
  if (!run->is_active() && fast_ops->spare_run != joined) {
    Py_XSETREF(fast_ops->spare_run, Py_NewRef(joined));
  }
}

// join on an inactive, unprofiled run, as sync_inline: true when done;
// false, nothing changed and no error set, for the general path.
bool join_inline(PyObject* const* args, bool with_keep) {
  PyObject* keep = with_keep ? args[2] : Py_None;
  if (keep != Py_None && has_torch_function_inline(keep) != 0) {
    return false;
  }
  StreamRun* run = plain_run(args[0]);
  int64_t side_streams[kMaxStreams];
  Py_ssize_t count = 0;
  if (run == nullptr || !run->unprofiled() ||
      !plain_ints(args[1], side_streams, &count, kMaxStreams) ||
      !run->join_inactive(c10::ArrayRef<int64_t>(side_streams, count))) {
    return false;
  }
  keep_spare(args[0], run);
  return true;
}

C10_NOINLINE PyObject* join_general(
    PyObject* const* args,
    size_t nargsf,
    PyObject* kwnames,
    bool run_call,
    bool with_keep) {
  HANDLE_TH_ERRORS
  if (!run_call) {
    return fall_back(kJoin, args, nargsf, kwnames);
  }
  PyObject* keep = with_keep ? args[2] : Py_None;
  const int overridden = keep_overridden(keep);
  if (overridden != 0) {
    return overridden < 0 ? nullptr : fall_back(kJoin, args, nargsf, kwnames);
  }
  StreamRun* run = run_of(args[0], "join");
  c10::SmallVector<int64_t, 32> side_streams;
  if (run == nullptr ||
      !read_ints(args[1], "join", "side_streams", &side_streams)) {
    return nullptr;
  }
  RecordCall record_call("torch_stage::join");
  run->join(side_streams, kept_value(run, keep));
  keep_spare(args[0], run);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* fast_join(
    PyObject* /*self*/,
    PyObject* const* args,
    size_t nargsf,
    PyObject* kwnames) {
  // join(run, side_streams) or join(run, side_streams, keep).
  const bool with_keep = takes_run_call(args, nargsf, kwnames, 3);
  const bool run_call = with_keep || takes_run_call(args, nargsf, kwnames, 2);
  if (run_call && join_inline(args, with_keep)) {
    Py_RETURN_NONE;
  }
  return join_general(args, nargsf, kwnames, run_call, with_keep);
}

PyObject* fast_run_depth(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyLong_FromLongLong(StreamRun::thread_run_depth());
}

// Static: a C function keeps a pointer to its PyMethodDef. The docstrings'
// first lines are the signatures inspect.signature reads.
PyMethodDef fast_op_defs[] = {
    {"fork",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_fork)),
     METH_FASTCALL | METH_KEYWORDS,
     "fork(num_streams, side_streams, num_events, probes)\n--\n\n"
     "Start a stream run: the side streams wait for the current stream\n"
     "(torch.ops.torch_stage.fork); probes (forward's inputs, or a\n"
     "parameter for modules whose inputs hold no tensor) give the device.\n"
     "Eagerly a torch_stage._C._StreamRun; the op's ScriptObject while\n"
     "tracing or compiling, or for tensor subclasses."},
    {"sync",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_sync)),
     METH_FASTCALL | METH_KEYWORDS,
     "sync(run, record, stream, waits, keep)\n--\n\n"
     "What the pass puts between two nodes, in one call\n"
     "(torch.ops.torch_stage.sync): the current stream records event\n"
     "record (if >= 0), pool stream stream becomes current and waits on\n"
     "each of waits, and the tensors in keep (unless None) are marked\n"
     "used on it."},
    {"record_event",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)()>(fast_record_event)),
     METH_FASTCALL | METH_KEYWORDS,
     "record_event(run, event, stream)\n--\n\n"
     "Pool stream stream records event event\n"
     "(torch.ops.torch_stage.record_event)."},
    {"join",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_join)),
     METH_FASTCALL | METH_KEYWORDS,
     "join(run, side_streams, keep=None)\n--\n\n"
     "Join the side streams into stream 0 (torch.ops.torch_stage.join),\n"
     "the tensors in keep (unless None) first marked used on stream 0."},
};

PyMethodDef run_depth_def[] = {
    {"_stream_run_depth",
     fast_run_depth,
     METH_NOARGS,
     "Runs forked on the calling thread and not finished (an abort depth)."},
    {nullptr, nullptr, 0, nullptr},
};

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
            // The pass passes a tuple of ints; reading it by hand saves
            // pybind11's generic sequence caster (~0.3 us a call).
            c10::SmallVector<int64_t, 8> events;
            if (!PyList_Check(waits.ptr()) && !PyTuple_Check(waits.ptr())) {
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
          [](StreamRun& run,
             const std::vector<int64_t>& side_streams,
             py::handle keep) {
            RECORD_FUNCTION("torch_stage::join", std::vector<c10::IValue>());
            run.join(side_streams, any_value(keep));
          },
          py::arg("side_streams"),
          py::arg("keep") = py::none())
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
  // fn() with this thread's stream ops hidden from the observers
  // (UnobservedStreamOps): the multi-stream pass's timing of its own calls.
  m.def("_call_unobserved", [](const py::object& fn) {
    UnobservedStreamOps unobserved;
    return fn();
  });
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
              drop(*o);
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
  // Raw: the multi-stream module calls it on every forward.
  if (PyModule_AddFunctions(m.ptr(), run_depth_def) != 0) {
    throw py::error_already_set();
  }
  m.def(
      "_stream_fast_ops",
      [](const std::string& module,
         py::object has_torch_function,
         py::object compiler,
         py::object fork,
         py::object sync,
         py::object record_event,
         py::object join) {
        if (fast_ops != nullptr) {
          throw py::value_error(
              "torch_stage._C._stream_fast_ops: already made (once per "
              "process, by torch_stage.streams.fx._ops)");
        }
        auto* ops = new FastOps();
        ops->run_type = reinterpret_cast<PyTypeObject*>(
            py::type::of<StreamRun>().release().ptr());
        ops->has_torch_function = has_torch_function.release().ptr();
        ops->is_compiling =
            py::object(compiler.attr("is_compiling")).release().ptr();
        ops->compiler = py::object(compiler.attr("__dict__")).release().ptr();
        ops->compiling_flag = py::str("_is_compiling_flag").release().ptr();
        PyObject* fallbacks[] = {
            fork.release().ptr(),
            sync.release().ptr(),
            record_event.release().ptr(),
            join.release().ptr()};
        std::copy(std::begin(fallbacks), std::end(fallbacks), ops->fallback);
        fast_ops = ops;
        py::str module_name(module);
        py::list functions;
        for (auto& def : fast_op_defs) {
          PyObject* f = PyCFunction_NewEx(&def, nullptr, module_name.ptr());
          if (f == nullptr) {
            throw py::error_already_set();
          }
          functions.append(py::reinterpret_steal<py::object>(f));
        }
        return py::tuple(functions);
      },
      py::arg("module"),
      py::arg("has_torch_function"),
      py::arg("compiler"),
      py::arg("fork"),
      py::arg("sync"),
      py::arg("record_event"),
      py::arg("join"),
      "The C functions fork, sync, record_event and join of "
      "torch_stage.streams.fx._ops (module: their __module__), each falling back to "
      "the given Python function (see csrc/python/stream_bindings.cpp).");
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
