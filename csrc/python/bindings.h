// Entry points of the pybind11 glue, one per concern, called from module.cpp.
#pragma once

#include <c10/util/StringUtil.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/jit/python/module_python.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "staging/bounded_buffer.h"

namespace torch_stage::python {

// Whether the interpreter has begun to finalize (from any thread, GIL or not).
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// The interpreter's main thread (threading.main_thread()), which is the one
// that finalizes it; set when the extension module is initialised.
inline unsigned long& main_thread_ident() {
  static unsigned long ident = 0;
  return ident;
}

// Whether CPython would refuse the GIL to the calling thread: finalization
// has begun and this is not the thread doing it (CPython's tstate_must_exit).
// The finalizing thread itself goes on taking and releasing the GIL (objects
// freed during finalization close their stages).
inline bool gil_closed_to_this_thread() {
  return interpreter_finalizing() &&
      PyThread_get_thread_ident() != main_thread_ident();
}

// Set when torch_stage's exit hook starts (torch_stage.stage._close_all, an
// atexit handler, so before finalization): from then on no thread but the
// main one starts waiting for the GIL.
inline std::atomic<bool>& interpreter_exit_began() {
  static std::atomic<bool> began{false};
  return began;
}

// Whether the calling thread must not start waiting for the GIL from a
// destructor (releasing a Python object held by an item or a stage): the
// exit has begun and it is not the main thread. Such a wait could end after
// finalization started, where CPython pthread_exits the thread from inside
// it, and a forced unwind out of a destructor (noexcept) is std::terminate;
// the object is leaked instead. Outside destructors a producer may still
// wait (AcquiredGil): a forced unwind there passes through ordinary frames.
// A destructor asks through an ExitGate (below), which closes the window
// between this check and the wait.
inline bool gil_wait_unsafe() {
  return (interpreter_exit_began().load() || interpreter_finalizing()) &&
      PyThread_get_thread_ident() != main_thread_ident();
}

// Threads inside an ExitGate: counted before they check the exit flag, so
// that the exit hook, which sets the flag first, sees every thread that
// found it unset (both are sequentially consistent: one of the two sees the
// other).
inline std::atomic<int64_t>& gated_gil_users() {
  static std::atomic<int64_t> users{0};
  return users;
}

// Fault injection for the tests: how long a thread of ours sleeps after its
// last check of the exit, just before it waits for the GIL (the window a
// slow thread leaves between the two; 0 in production).
inline std::atomic<int64_t>& gil_wait_delay_ms() {
  static std::atomic<int64_t> ms{0};
  return ms;
}

inline void injected_gil_wait_delay() {
  if (const int64_t ms = gil_wait_delay_ms().load(std::memory_order_relaxed);
      ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }
}

// Leave to take the GIL from a destructor (or from code a destructor may
// call), safe at interpreter exit: `open()` is false once the exit began
// (gil_wait_unsafe) and, on any thread, once finalization began; the caller
// then leaks what it would have released. A
// gate passed before then holds the exit (drain_gated_gil_users, from the
// exit hook) until it closes, so its GIL wait ends before finalization can
// begin: without it, a producer thread that checked the flag just before the
// exit hook set it, then waited for the GIL, could be handed it during
// finalization and be pthread_exited from inside a destructor
// (std::terminate: "terminate called without an active exception", the
// abort of a process whose loop had just left a DataLoader epoch while its
// staging thread was ending). Take the GIL inside the gate's scope and
// release it before the gate goes.
class ExitGate {
 public:
  ExitGate() {
    gated_gil_users().fetch_add(1);
    open_ =
        Py_IsInitialized() && !interpreter_finalizing() && !gil_wait_unsafe();
    if (!open_) {
      gated_gil_users().fetch_sub(1);
    }
  }
  ExitGate(const ExitGate&) = delete;
  ExitGate& operator=(const ExitGate&) = delete;
  ~ExitGate() {
    if (open_) {
      gated_gil_users().fetch_sub(1);
    }
  }
  bool open() const {
    return open_;
  }

 private:
  bool open_;
};

// Called by the main thread, with the GIL held, once the exit flag is set:
// waits, with the GIL released, until no thread is inside an ExitGate, or
// for `timeout` (a destructor's Python code that runs longer is left to the
// old window). Returns whether none is left.
bool drain_gated_gil_users(std::chrono::milliseconds timeout);

// Parks the calling thread for good: what CPython >= 3.14 does to a thread
// that wants the GIL after finalization began (older ones pthread_exit it).
[[noreturn]] inline void park_forever() {
  while (true) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

// The GIL released for a scope, like pybind11::gil_scoped_release, but safe
// for a daemon thread that comes back after the interpreter began to exit.
//
// Why not gil_scoped_release: taking the GIL back during finalization makes
// CPython (< 3.14) end the thread with pthread_exit, a forced unwind; from
// inside gil_scoped_release's noexcept destructor that is std::terminate
// ("terminate called without an active exception", the abort of a process
// that exits while a daemon thread waits in StagingArea.put). A thread that
// comes back too late is parked instead: it holds no lock of ours by then,
// and the process's exit ends it.
//
// The destructor is noexcept(false) for the window between the check and
// PyEval_RestoreThread: a finalization that starts there still ends the
// thread with a forced unwind, which then passes through ordinary frames
// (pybind11's dispatcher rethrows it) instead of aborting.
class ReleasedGil {
 public:
  ReleasedGil() : state_(PyEval_SaveThread()) {}
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;
  ~ReleasedGil() noexcept(false) {
    if (gil_closed_to_this_thread()) {
      park_forever();
    }
    PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

// A thread of ours keeps its Python thread state from one AcquiredGil to
// the next, as a thread Python made keeps its own: gil_scoped_acquire makes
// one for a thread that has none and deletes it when its scope ends, so a
// producer got a fresh one for every item: its threading.local() values
// were lost between items (a per-thread cache was rebuilt each time), and
// each call into Python mapped and unmapped a frame stack (mmap/munmap with
// the TLB shootdowns that follow: 3-4% of a records producer's samples,
// perf). The state goes with the thread: its exit drops it, with the GIL
// taken as drop() takes it; past the start of the interpreter's exit it is
// left to the interpreter, which frees its threads' states.
class ThreadStateKeeper {
 public:
  // With the GIL held by `gil`, in a thread that had no state before it.
  void keep(pybind11::gil_scoped_acquire& gil) {
    if (!kept_) {
      gil.inc_ref();
      kept_ = true;
    }
  }
  ThreadStateKeeper() = default;
  ThreadStateKeeper(const ThreadStateKeeper&) = delete;
  ThreadStateKeeper& operator=(const ThreadStateKeeper&) = delete;
  ~ThreadStateKeeper() {
    if (!kept_) {
      return;
    }
    ExitGate gate;
    if (!gate.open()) {
      return;
    }
    injected_gil_wait_delay();
    pybind11::gil_scoped_acquire gil;
    gil.dec_ref(); // the scope's end then deletes the state
  }

 private:
  bool kept_ = false;
};

// The GIL taken for a scope from a thread of ours (a stage's producer), like
// pybind11::gil_scoped_acquire, but safe at interpreter exit. A producer
// still inside user code when its stage's close() gave up joining it is
// detached; if it comes back after finalization began:
// - wanting the GIL here, it is parked (see park_forever);
// - inside CPython (a Python call that released and retakes the GIL),
//   CPython < 3.14 ends it with pthread_exit, whose unwind runs this
//   destructor: releasing the thread state then would touch a finalized
//   interpreter (a segfault in PyThreadState_Clear), so it is leaked.
class AcquiredGil {
 public:
  AcquiredGil() {
    if (gil_closed_to_this_thread()) {
      park_forever();
    }
    // Before taking it: whether the thread has a state (one of Python's
    // threads, or one of ours since its first call) or gets a new one.
    const bool fresh = PyGILState_GetThisThreadState() == nullptr;
    injected_gil_wait_delay();
    gil_ = new pybind11::gil_scoped_acquire();
    if (fresh) {
      static thread_local ThreadStateKeeper keeper;
      keeper.keep(*gil_);
    }
  }
  AcquiredGil(const AcquiredGil&) = delete;
  AcquiredGil& operator=(const AcquiredGil&) = delete;
  ~AcquiredGil() {
    if (!gil_closed_to_this_thread()) {
      delete gil_;
    }
  }

 private:
  pybind11::gil_scoped_acquire* gil_;
};

// Releases a Python reference from any thread, destructors included (see
// ExitGate): past the start of the exit, outside the main thread, it is
// leaked on purpose, the interpreter going away.
inline void drop(pybind11::object& obj) {
  if (!obj) {
    return;
  }
  ExitGate gate;
  if (!gate.open()) {
    obj.release();
    return;
  }
  AcquiredGil gil;
  obj = pybind11::object();
}

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
  // A timeout too long for the clock (about 292 years) waits forever.
  const auto deadline = timeout_ms < 0
      ? Clock::time_point::max()
      : deadline_after(std::chrono::milliseconds(timeout_ms));
  const bool forever = deadline == Clock::time_point::max();
  while (true) {
    const auto slice_end = Clock::now() + kSlice;
    const auto until = forever ? slice_end : std::min(slice_end, deadline);
    {
      ReleasedGil no_gil;
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
void init_trace(pybind11::module_& m);

// TFRecord files, Example encoding/parsing and RecordInput.
void init_records(pybind11::module_& m);

} // namespace torch_stage::python
