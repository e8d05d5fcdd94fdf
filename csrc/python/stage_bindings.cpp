// Python side of Stage: Python sources and transforms run from C++ producer
// threads, and Python consumers take items.
//
// GIL discipline: a producer holds the GIL only while it calls Python (the
// source's next(), the callable, the transform, flattening an item for
// device staging); pinning, copying, ordering and buffering run without it.
// The time producers spend waiting for the GIL is measured (gil_wait_ns) so
// that hand-off stalls (PyTorch issue 77139) are visible in stats().
//
// Python objects held by items and by the work are released with the GIL,
// from whichever thread drops them; after interpreter finalisation has begun
// they are leaked instead (touching the interpreter then is undefined).
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "python/bindings.h"
#include "staging/device_stager.h"
#include "staging/stage.h"
#include "trace/trace_recorder.h"

namespace py = pybind11;

namespace torch_stage::python {

class GeneratorWatch; // below, with GeneratorReader

namespace {

using Clock = std::chrono::steady_clock;

bool python_alive() {
  return Py_IsInitialized() && !interpreter_finalizing();
}

// An item's Python part: the object itself, or (after flattening for device
// staging) the structure that rebuilds it around item.tensors.
struct PyPayload {
  py::object obj;
  bool flattened = false;
  ~PyPayload() {
    drop(obj);
  }
};

std::shared_ptr<void> make_payload(py::object obj, bool flattened) {
  return std::make_shared<PyPayload>(PyPayload{std::move(obj), flattened});
}

PyPayload& payload_of(const StageItem& item) {
  return *static_cast<PyPayload*>(item.payload.get());
}

// An exception to re-raise in the consumer, traceback included.
struct PyError {
  py::object value;
  ~PyError() {
    drop(value);
  }
};

class PyStageWork final : public StageWork {
 public:
  PyStageWork(
      std::string name,
      py::object source,
      bool call_source,
      py::dict feed_dict,
      py::object transform,
      py::tuple closed_types,
      py::tuple ignored_types,
      py::object helpers,
      bool flatten_for_device)
      : name_(std::move(name)),
        source_(std::move(source)),
        call_source_(call_source),
        feed_dict_(std::move(feed_dict)),
        transform_(std::move(transform)),
        closed_types_(std::move(closed_types)),
        ignored_types_(std::move(ignored_types)),
        flatten_(helpers.attr("flatten")),
        on_skip_(helpers.attr("on_skip")),
        nbytes_(helpers.attr("nbytes")),
        flatten_for_device_(flatten_for_device) {}

  ~PyStageWork() override {
    for (py::object* obj : python_objects()) {
      drop(*obj);
    }
  }

  // For the garbage collector, through the _Stage type's tp_traverse and
  // tp_clear (GIL held): the references this work holds, so that a cycle
  // through it (an object whose stage calls the object's own method) is
  // found; and dropping them, which only the stage's own quiescence makes
  // safe (PyStage::clear). Members change only under the GIL, so a
  // traversal sees them whole.
  int traverse(visitproc visit, void* arg) {
    for (py::object* obj : python_objects()) {
      Py_VISIT(obj->ptr());
    }
    return 0;
  }
  void clear() {
    for (py::object* obj : python_objects()) {
      *obj = py::object();
    }
  }

  Outcome pull(int64_t index, StageItem& item) override {
    Gil gil(gil_wait_ns_);
    try {
      if (call_source_) {
        item.payload = make_payload(source_(**feed_dict_), false);
        measure(payload_of(item).obj);
        return Outcome::kItem;
      }
      if (!iterator_) {
        iterator_ =
            py::reinterpret_steal<py::object>(PyObject_GetIter(source_.ptr()));
        if (!iterator_) {
          throw py::error_already_set();
        }
      }
      PyObject* next = PyIter_Next(iterator_.ptr());
      if (next == nullptr) {
        if (PyErr_Occurred()) {
          throw py::error_already_set();
        }
        // The iterable is exhausted: the natural end of the stream.
        return Outcome::kEnd;
      }
      item.payload =
          make_payload(py::reinterpret_steal<py::object>(next), false);
      measure(payload_of(item).obj);
      return Outcome::kItem;
    } catch (py::error_already_set& e) {
      return classify(e, index, item);
    }
  }

  Outcome process(StageItem& item) override {
    if (!transform_) {
      return Outcome::kItem;
    }
    Gil gil(gil_wait_ns_);
    try {
      PyPayload& payload = payload_of(item);
      payload.obj = transform_(payload.obj);
      return Outcome::kItem;
    } catch (py::error_already_set& e) {
      return classify(e, item.index, item);
    }
  }

  Outcome expose_tensors(StageItem& item) override {
    if (!flatten_for_device_) {
      return Outcome::kItem;
    }
    Gil gil(gil_wait_ns_);
    try {
      PyPayload& payload = payload_of(item);
      py::tuple flat = flatten_(payload.obj);
      item.tensors.clear();
      for (py::handle t : py::reinterpret_borrow<py::list>(flat[0])) {
        item.tensors.push_back(THPVariable_Unpack(t.ptr()));
      }
      payload.obj = flat[1];
      payload.flattened = true;
      return Outcome::kItem;
    } catch (py::error_already_set& e) {
      return classify(e, item.index, item);
    }
  }

  int64_t gil_wait_ns() const {
    return gil_wait_ns_.load();
  }

  int64_t item_bytes() const override {
    return item_bytes_.load();
  }

  std::string explain(const std::exception_ptr& error) const override {
    try {
      std::rethrow_exception(error);
    } catch (python_error& e) {
      // Python code inside an op failed: its error is still set on this
      // thread, where the next Python call would raise it instead of its
      // own result (a later batch's next(), or a producer's pull).
      AcquiredGil gil;
      e.persist();
      const char* type = e.type != nullptr
          ? reinterpret_cast<PyTypeObject*>(e.type)->tp_name
          : "python_error";
      return c10::str(type, ": ", e.what());
    } catch (...) {
      return StageWork::explain(error);
    }
  }

 private:
  // Acquires the GIL, adding the time it took to `total`.
  class Gil {
   public:
    explicit Gil(std::atomic<int64_t>& total) {
      const auto start = Clock::now();
      gil_.emplace();
      total += std::chrono::duration_cast<std::chrono::nanoseconds>(
                   Clock::now() - start)
                   .count();
    }

   private:
    std::optional<AcquiredGil> gil_;
  };

  // The first item's tensor bytes, for auto-tuning's memory budget (one
  // walk of one item; called with the GIL held).
  void measure(const py::object& obj) {
    if (item_bytes_.load() >= 0) {
      return;
    }
    item_bytes_.store(nbytes_(obj).cast<int64_t>());
  }

  // Called with the GIL held; the Python error is in `e`.
  Outcome classify(py::error_already_set& e, int64_t index, StageItem& item) {
    if (PyErr_GivenExceptionMatches(e.type().ptr(), closed_types_.ptr())) {
      return Outcome::kEnd;
    }
    if (PyErr_GivenExceptionMatches(e.type().ptr(), ignored_types_.ptr())) {
      on_skip_(name_, index, e.value());
      return Outcome::kSkip;
    }
    py::object value = e.value();
    if (e.trace() && PyException_GetTraceback(value.ptr()) == nullptr) {
      PyException_SetTraceback(value.ptr(), e.trace().ptr());
    }
    auto detail = std::make_shared<PyError>(PyError{value});
    item.error = std::make_shared<ItemError>(ItemError{
        c10::str(
            "stage '",
            name_,
            "' item ",
            index,
            ": ",
            py::str(py::type::handle_of(value).attr("__name__"))
                .cast<std::string>(),
            ": ",
            py::str(value).cast<std::string>()),
        std::move(detail)});
    return Outcome::kError;
  }

  std::array<py::object*, 9> python_objects() {
    return {
        &source_,
        &iterator_,
        &feed_dict_,
        &transform_,
        &closed_types_,
        &ignored_types_,
        &flatten_,
        &on_skip_,
        &nbytes_};
  }

  const std::string name_;
  py::object source_;
  const bool call_source_;
  py::object iterator_; // made on the first pull, under the source lock
  py::dict feed_dict_;
  py::object transform_;
  py::tuple closed_types_;
  py::tuple ignored_types_;
  py::object flatten_;
  py::object on_skip_;
  py::object nbytes_;
  const bool flatten_for_device_;
  std::atomic<int64_t> gil_wait_ns_{0};
  std::atomic<int64_t> item_bytes_{-1};
};

[[noreturn]] void raise(const char* type, const std::string& message) {
  py::object cls = py::module_::import("torch_stage.errors").attr(type);
  PyErr_SetString(cls.ptr(), message.c_str());
  throw py::error_already_set();
}

// The Python handle of a stage: owns it, and closes it without the GIL.
class PyStage {
 public:
  PyStage(
      StageOptions options,
      std::shared_ptr<PyStageWork> work,
      py::object warn)
      : work_(work), stage_(std::make_unique<Stage>(std::move(options), work)) {
    // The handler lives in the stage's state, which a producer thread may
    // be the last to hold: the callable is released the safe way.
    std::shared_ptr<py::object> warn_fn(
        new py::object(std::move(warn)), [](py::object* o) {
          drop(*o);
          delete o;
        });
    stage_->set_warning_handler([warn_fn](const std::string& message) {
      // Gated: close() warns, and ~Stage closes.
      ExitGate gate;
      if (!gate.open()) {
        return;
      }
      AcquiredGil gil;
      try {
        (*warn_fn)(message);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("torch_stage stage warning");
      }
    });
  }

  ~PyStage() {
    // Joining producers that need the GIL while holding it would deadlock.
    if (python_alive() && PyGILState_Check()) {
      ReleasedGil no_gil;
      stage_.reset();
    } else {
      stage_.reset();
    }
  }

  Stage& stage() {
    return *stage_;
  }

  // The generator watch of batches made in the loop (GeneratorWatch, below),
  // or null; used with the GIL held.
  std::shared_ptr<GeneratorWatch> watch;

  int traverse(visitproc visit, void* arg) {
    return work_->traverse(visit, arg);
  }

  // tp_clear: the collector found this stage in a cycle nobody can reach.
  // Stage.__del__ (a finalizer, run before any clear) has normally closed
  // it already; close() here covers a bare handle. The work's references
  // are dropped only once no producer can call into it again: one left
  // behind by the join timeout (stuck in user code) may still use them, and
  // then the cycle is left as it is (leaked, as before the collector could
  // see it) rather than freed under that thread.
  void clear() {
    {
      ReleasedGil no_gil;
      stage_->close();
    }
    if (stage_->quiescent()) {
      work_->clear();
    }
  }

  // Consumer side: the next item as a Python object; raises StopIteration
  // at the end and the item's own exception at a failed position.
  py::object next(int64_t timeout_ms) {
    const auto timeout = std::chrono::milliseconds(
        timeout_ms >= 0 ? timeout_ms : stage_->options().timeout_ms);
    StageItem out;
    const auto start = Clock::now();
    const int64_t consumed_before = stage_->consumed();
    trace::Span span(trace::Kind::kTake, stage_->take_span_name());
    const TakeStatus status = wait_releasing_gil(
        timeout.count(), TakeStatus::kTimeout, [&](Clock::time_point until) {
          // Rounded up, so a slice never becomes a zero-length busy retry;
          // the first attempt (until = now) does not wait.
          const auto left = std::chrono::ceil<std::chrono::milliseconds>(
              until - Clock::now());
          // Never makes an item while holding the GIL (the first, quick
          // attempt): a producer inside the source holds the source lock
          // and waits for the GIL.
          return stage_->take_for(
              out,
              std::max(left, std::chrono::milliseconds(0)),
              /*may_produce=*/PyGILState_Check() == 0);
        });
    span.set_item(out.index);
    span.set_outcome(take_outcome(status, out));
    span.end();
    if (status == TakeStatus::kTimeout) {
      raise(
          "StageTimeoutError",
          stage_->timeout_message(
              std::chrono::duration_cast<std::chrono::milliseconds>(
                  Clock::now() - start),
              consumed_before));
    }
    switch (status) {
      case TakeStatus::kItem:
        break;
      case TakeStatus::kEnd:
        if (stage_->failed()) {
          raise(
              "StageError",
              c10::str(
                  "stage '",
                  stage_->name(),
                  "' failed on an earlier item (raised to the consumer that "
                  "took it) and has no more items"));
        }
        throw py::stop_iteration();
      case TakeStatus::kClosed:
        raise(
            "StageClosed", c10::str("stage '", stage_->name(), "' was closed"));
      case TakeStatus::kTimeout:
        break;
    }
    if (out.error) {
      auto* detail = static_cast<PyError*>(out.error->detail.get());
      if (detail != nullptr && detail->value &&
          (PyErr_GivenExceptionMatches(
               detail->value.ptr(), PyExc_StopIteration) != 0 ||
           PyErr_GivenExceptionMatches(
               detail->value.ptr(), PyExc_StopAsyncIteration) != 0)) {
        // Not one of closed_exception_types, so it ends nothing: re-raised
        // as itself it would end the consumer's for loop without a word,
        // the data cut short. A StageError from it instead, as Python turns
        // a StopIteration inside a generator into RuntimeError (PEP 479).
        py::object error =
            py::module_::import("torch_stage.errors")
                .attr("StageError")(c10::str(
                    "stage '",
                    stage_->name(),
                    "': item ",
                    out.index,
                    " raised ",
                    Py_TYPE(detail->value.ptr())->tp_name,
                    ", which is not one of closed_exception_types here, so "
                    "it ends nothing and is an error at its item (see "
                    "__cause__)"));
        PyException_SetCause(error.ptr(), detail->value.inc_ref().ptr());
        PyErr_SetObject(
            reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
        throw py::error_already_set();
      }
      if (detail != nullptr && detail->value) {
        PyErr_SetObject(
            reinterpret_cast<PyObject*>(Py_TYPE(detail->value.ptr())),
            detail->value.ptr());
        throw py::error_already_set();
      }
      raise("StageError", out.error->message);
    }
    PyPayload& payload = payload_of(out);
    if (!payload.flattened) {
      return payload.obj;
    }
    py::list tensors(out.tensors.size());
    for (size_t i = 0; i < out.tensors.size(); ++i) {
      tensors[i] = py::reinterpret_steal<py::object>(
          THPVariable_Wrap(std::move(out.tensors[i])));
    }
    return py::module_::import("torch_stage.staging._pytree")
        .attr("unflatten")(tensors, payload.obj);
  }

  py::dict stats() const {
    const StageStats s = stage_->stats();
    py::dict d;
    d["produced"] = s.produced;
    d["consumed"] = s.consumed;
    d["skipped"] = s.skipped;
    d["dropped"] = s.dropped;
    d["discarded"] = s.discarded;
    d["errors"] = s.errors;
    d["consumer_wait_s"] = s.consumer_wait_ns / 1e9;
    d["producer_blocked_s"] = s.producer_blocked_ns / 1e9;
    d["source_s"] = s.pull_ns / 1e9;
    d["transform_s"] = s.process_ns / 1e9;
    d["copy_s"] = s.copy_ns / 1e9;
    d["gil_wait_s"] = work_->gil_wait_ns() / 1e9;
    d["capacity"] = s.capacity;
    d["mean_occupancy"] = s.consumed + s.errors > 0
        ? double(s.occupancy_sum) / (s.consumed + s.errors)
        : 0.0;
    d["max_occupancy"] = s.max_occupancy;
    d["staged_items"] = s.staged_items;
    d["fused_tensors"] = s.fused_tensors;
    d["staged_bytes"] = s.staged_bytes;
    d["pinned_buffers"] = s.host_buffers;
    d["pinned_buffer_reuses"] = s.host_buffer_reuses;
    d["pinned_buffer_waits"] = s.host_buffer_waits;
    d["pinned_direct_copies"] = s.direct_copies;
    d["threads"] = s.threads;
    d["inline_items"] = s.inline_items;
    d["inline_s"] = s.inline_ns / 1e9;
    d["loop_s"] = s.loop_ns / 1e9;
    if (s.auto_tune) {
      py::dict tuning;
      tuning["windows"] = s.tuning_windows;
      tuning["trials"] = s.tuning_trials;
      tuning["trial_windows"] = s.tuning_trial_windows;
      tuning["max_capacity"] = s.tuning_max_capacity;
      tuning["decisions"] = py::cast(stage_->tuning_log());
      d["tuning"] = tuning;
    } else {
      d["tuning"] = py::none();
    }
    d["started"] = s.started;
    d["finished"] = s.finished;
    d["failed"] = s.failed;
    return d;
  }

 private:
  std::shared_ptr<PyStageWork> work_;
  std::unique_ptr<Stage> stage_;
};

// A tuner's memory as Python sees it: {"threads", "capacity", "backoff",
// "cooldown", "windows", "trial_windows"} (the lists indexed by
// AutoTuner::Move; the window counts optional on the way in, 0 if absent),
// kept by the DataLoader from one epoch's stage for the next.
py::dict memory_to(const TunerMemory& m) {
  py::dict d;
  d["threads"] = m.setting.threads;
  d["capacity"] = m.setting.capacity;
  d["backoff"] =
      py::cast(std::vector<int64_t>(m.backoff.begin(), m.backoff.end()));
  d["cooldown"] =
      py::cast(std::vector<int64_t>(m.cooldown.begin(), m.cooldown.end()));
  d["windows"] = m.windows;
  d["trial_windows"] = m.trial_windows;
  return d;
}

TunerMemory memory_from(const py::object& obj) {
  const auto d = obj.cast<py::dict>();
  TunerMemory m;
  m.setting.threads = d["threads"].cast<int64_t>();
  m.setting.capacity = d["capacity"].cast<int64_t>();
  const auto backoff = d["backoff"].cast<std::vector<int64_t>>();
  const auto cooldown = d["cooldown"].cast<std::vector<int64_t>>();
  if (backoff.size() != m.backoff.size() ||
      cooldown.size() != m.cooldown.size()) {
    throw py::value_error(
        "tuning_memory: backoff and cooldown need 3 entries each");
  }
  std::copy(backoff.begin(), backoff.end(), m.backoff.begin());
  std::copy(cooldown.begin(), cooldown.end(), m.cooldown.begin());
  m.windows = d.contains("windows") ? d["windows"].cast<int64_t>() : 0;
  m.trial_windows =
      d.contains("trial_windows") ? d["trial_windows"].cast<int64_t>() : 0;
  return m;
}

std::optional<c10::Device> parse_device(const py::object& device) {
  if (device.is_none()) {
    return std::nullopt;
  }
  return py::cast<c10::Device>(device);
}

} // namespace

// The default CPU generator's twister, read in place.
// CPUGeneratorImpl::engine() and mt19937_engine::data() each return a copy
// (2.5 KB: the 624 words), and the DataLoader's generator watch reads twice
// per batch, after a batch's own work has pushed those words out of the
// cache. The members are private: pointers to them, taken the way explicit
// instantiation allows (its access checks are waived, [temp.explicit]);
// a torch that renamed them fails to build here, not at run time.
template <typename Tag, typename Tag::type Member>
struct MemberOf {
  friend typename Tag::type member(Tag) {
    return Member;
  }
};
struct EngineOf {
  using type = at::mt19937 at::CPUGeneratorImpl::*;
  friend type member(EngineOf);
};
struct TwisterOf {
  using type = at::mt19937_data_pod at::mt19937::*;
  friend type member(TwisterOf);
};
template struct MemberOf<EngineOf, &at::CPUGeneratorImpl::engine_>;
template struct MemberOf<TwisterOf, &at::mt19937::data_>;

// What changes with every draw from torch's default CPU generator: the
// twister's position and next word (each draw moves them; a regeneration
// of the words after 624 draws changes the first), and the cached normal
// samples, which a draw may take without moving the twister.
struct CpuGeneratorReading {
  uint64_t seed = 0;
  int left = 0;
  uint32_t next = 0;
  uint32_t first = 0;
  std::optional<float> normal_float;
  std::optional<double> normal_double;

  bool operator!=(const CpuGeneratorReading& o) const {
    return seed != o.seed || left != o.left || next != o.next ||
        first != o.first || normal_float != o.normal_float ||
        normal_double != o.normal_double;
  }
};

CpuGeneratorReading read_cpu_generator() {
  // (By reference: a copy of the Generator is two atomic count changes.)
  auto* impl = at::detail::getDefaultCPUGenerator().get<at::CPUGeneratorImpl>();
  std::lock_guard<std::mutex> lock(impl->mutex_);
  const at::mt19937_data_pod& pod =
      (impl->*member(EngineOf{})).*member(TwisterOf{});
  CpuGeneratorReading r;
  r.seed = pod.seed_;
  r.left = pod.left_;
  r.next = pod.next_;
  r.first = pod.state_[0];
  r.normal_float = impl->next_float_normal_sample();
  r.normal_double = impl->next_double_normal_sample();
  return r;
}

py::tuple as_tuple(const CpuGeneratorReading& r) {
  return py::make_tuple(
      r.seed,
      r.left,
      r.next,
      r.first,
      r.normal_float.has_value() ? py::cast(*r.normal_float) : py::none(),
      r.normal_double.has_value() ? py::cast(*r.normal_double) : py::none());
}

// read_cpu_generator() for Python (torch_stage/staging/loader.py reads it
// where the in-place reader of the other generators is not made).
py::tuple cpu_generator_fingerprint() {
  return as_tuple(read_cpu_generator());
}

// torch_stage.DataLoader's generator watch reads the global generators at
// the start of each next() and after each batch made in it; each call
// between a batch's own calls cost several times what it does alone, and
// a reading of three generators in Python took six. So one call: torch's
// CPU generator as above, and the twisters of Python's random and NumPy's
// legacy global generator read in place, at addresses the Python side
// found and checked against their getters (torch_stage/staging/loader.py,
// _Fingerprints). Returns None when sys.modules' numpy is not the one the
// reader was made for (imported since, or removed): the caller makes a new
// reader. Holds the objects whose memory it reads. Called with the GIL.
class GeneratorReader {
 public:
  GeneratorReader(
      py::object random_inst,
      uintptr_t random_index,
      uintptr_t random_first,
      py::object numpy_module,
      py::object numpy_owner,
      uintptr_t numpy_pos,
      uintptr_t numpy_first)
      : random_inst_(std::move(random_inst)),
        random_index_(reinterpret_cast<const int*>(random_index)),
        random_first_(reinterpret_cast<const uint32_t*>(random_first)),
        numpy_module_(std::move(numpy_module)),
        numpy_owner_(std::move(numpy_owner)),
        numpy_pos_(reinterpret_cast<const int*>(numpy_pos)),
        numpy_first_(reinterpret_cast<const uint32_t*>(numpy_first)) {
    if (random_index_ == nullptr || random_first_ == nullptr ||
        (numpy_pos_ == nullptr) != (numpy_first_ == nullptr) ||
        (numpy_pos_ != nullptr) == numpy_module_.is_none()) {
      throw py::value_error(
          "_GeneratorReader: random's addresses, and NumPy's exactly when "
          "NumPy is given");
    }
  }

  // read(Reading*) as Python tuples: (torch's, (index, first word,
  // gauss_next) of random's, (position, first word) of NumPy's or None).
  py::object read() const {
    Reading r;
    if (!read(&r)) {
      return py::none();
    }
    py::object numpy_state = numpy_pos_ == nullptr
        ? py::object(py::none())
        : py::object(py::make_tuple(r.numpy_pos, r.numpy_first));
    return py::make_tuple(
        as_tuple(r.torch),
        py::make_tuple(r.random_index, r.random_first, r.random_gauss),
        numpy_state);
  }

  // What read() returns, as plain values: for GeneratorWatch, which
  // compares readings without making Python objects.
  struct Reading {
    CpuGeneratorReading torch;
    int random_index = 0;
    uint32_t random_first = 0;
    py::object random_gauss; // compared by identity: each gauss() sets a new
    int numpy_pos = 0;
    uint32_t numpy_first = 0;
  };

  // False (and `out` untouched) where read() would return None.
  bool read(Reading* out) const {
    if (!numpy_unchanged()) {
      return false;
    }
    out->torch = read_cpu_generator();
    out->random_index = *random_index_;
    out->random_first = *random_first_;
    out->random_gauss = random_inst_.attr(gauss_next_);
    if (numpy_pos_ != nullptr) {
      out->numpy_pos = *numpy_pos_;
      out->numpy_first = *numpy_first_;
    }
    return true;
  }

  // The generators (bits: 1 torch's CPU one, 2 Python's random, 4 NumPy's)
  // whose readings differ.
  static uint32_t changed(const Reading& a, const Reading& b) {
    uint32_t bits = 0;
    if (a.torch != b.torch) {
      bits |= 1;
    }
    if (a.random_index != b.random_index || a.random_first != b.random_first ||
        !a.random_gauss.is(b.random_gauss)) {
      bits |= 2;
    }
    if (a.numpy_pos != b.numpy_pos || a.numpy_first != b.numpy_first) {
      bits |= 4;
    }
    return bits;
  }

 private:
  bool numpy_unchanged() const {
    PyObject* numpy =
        PyDict_GetItem(PyImport_GetModuleDict(), numpy_name_.ptr());
    return (numpy != nullptr ? numpy : Py_None) == numpy_module_.ptr();
  }

  // The names it looks up, made once (a C string is made a str per call).
  const py::str gauss_next_{"gauss_next"};
  const py::str numpy_name_{"numpy"};

  py::object random_inst_;
  const int* random_index_;
  const uint32_t* random_first_;
  py::object numpy_module_;
  py::object numpy_owner_; // keeps the bit generator (numpy_pos_'s memory)
  const int* numpy_pos_;
  const uint32_t* numpy_first_;
};

// The watch (torch_stage/staging/loader.py, _GlobalDraws) for batches made
// in the loop, inside _own_next, the one call that makes them: a reading
// when the loop asks for a batch (what changed since the last batch's
// making ended is the loop's) and one when the making ends (the pull's),
// with no call of its own. Installed by the loader for a stage without
// transform while it watches; readings span only batches made this way
// (a begin_own_item() that fails, with a producer at work, starts over),
// with no pull of the stage between them (the loop's reading comes after
// begin_own_item(), whose positions say whether one ran: a producer the
// tuner started as the last batch ended, or a take()).
// Used with the GIL held, by the thread that calls _own_next.
//
// News is written to `signal`'s first byte (a bytearray the loader reads
// as signal[0] after each batch): a subscript costs the batch far less
// than a call (asking take_news() after each was a third of the watch's
// cost in place). take_news() reads and clears it.
class GeneratorWatch {
 public:
  GeneratorWatch(std::shared_ptr<GeneratorReader> reader, py::object signal)
      : reader_(std::move(reader)), signal_(std::move(signal)) {
    if (!PyByteArray_Check(signal_.ptr()) ||
        PyByteArray_GET_SIZE(signal_.ptr()) < 1) {
      throw py::type_error(
          "watch_generators: signal must be a bytearray of at least one byte");
    }
    // Held while the watch lives: a bytearray with an export cannot be
    // resized, so its first byte stays where it is.
    if (PyObject_GetBuffer(signal_.ptr(), &signal_view_, PyBUF_WRITABLE) != 0) {
      throw py::error_already_set();
    }
  }
  ~GeneratorWatch() {
    PyBuffer_Release(&signal_view_);
  }
  GeneratorWatch(const GeneratorWatch&) = delete;
  GeneratorWatch& operator=(const GeneratorWatch&) = delete;

  // `positions`: the stage's pulls so far (Stage::begin_own_item). Where
  // they moved since the last reading, a pull ran in between, on a
  // producer or in a take(): what changed is not the loop's alone, and
  // this reading only starts over.
  void loop_resumes(int64_t positions) {
    if (positions != positions_) {
      valid_ = false;
      positions_ = positions;
    }
    read_into(&loop_);
  }
  void made() {
    read_into(&pull_);
  }
  void start_over() {
    valid_ = false;
  }
  // Whether a reading found a generator drawn from where it had not been
  // seen drawn, or numpy changed in sys.modules (then it reads no more):
  // once per finding.
  bool take_news() {
    const bool news = signal() != 0;
    signal() = 0;
    return news;
  }
  py::tuple state() const {
    return py::make_tuple(loop_, pull_, stale_);
  }

 private:
  void read_into(uint32_t* bits) {
    if (stale_) {
      return;
    }
    GeneratorReader::Reading now;
    if (!reader_->read(&now)) {
      stale_ = true;
      signal() = 1;
      return;
    }
    if (valid_) {
      const uint32_t found = GeneratorReader::changed(last_, now) & ~*bits;
      if (found != 0) {
        *bits |= found;
        signal() = 1;
      }
    }
    last_ = std::move(now);
    valid_ = true;
  }

  char& signal() {
    return static_cast<char*>(signal_view_.buf)[0];
  }

  std::shared_ptr<GeneratorReader> reader_;
  py::object signal_; // a bytearray
  Py_buffer signal_view_{};
  GeneratorReader::Reading last_;
  bool valid_ = false;
  bool stale_ = false;
  int64_t positions_ = -1;
  uint32_t loop_ = 0;
  uint32_t pull_ = 0;
};

// _C._own_next(stage, iterator): the DataLoader's batch made in the loop
// (torch_stage/staging/loader.py, _LoaderIter.__next__) in one call:
// begin_own_item(), next(iterator), end_own_item(), and the generator
// watch's readings between them; three calls a batch were one. Returns
// `stage` itself where begin_own_item() is false (a producer is at work or
// has a batch on its way: take from the stage). The iterator's exception,
// or StopIteration at its end, propagates as next() raises it, with no
// frame of this call. Raw (METH_FASTCALL): the pybind11 call path costs
// more than the rest of it.
PyObject* own_next(PyObject* /*module*/, PyObject* const* args, Py_ssize_t n) {
  if (n != 2 || !PyIter_Check(args[1])) {
    PyErr_SetString(
        PyExc_TypeError,
        "_own_next(stage, iterator) takes a _Stage and an iterator");
    return nullptr;
  }
  PyStage* s = nullptr;
  try {
    s = &py::cast<PyStage&>(py::handle(args[0]));
  } catch (const py::cast_error&) {
    PyErr_Format(
        PyExc_TypeError,
        "_own_next: the stage must be a _Stage, got %s",
        Py_TYPE(args[0])->tp_name);
    return nullptr;
  }
  int64_t positions = 0;
  if (!s->stage().begin_own_item(&positions)) {
    if (s->watch) {
      s->watch->start_over();
    }
    Py_INCREF(args[0]);
    return args[0];
  }
  // After begin_own_item(), not before: a producer the tuner started when
  // the last item ended may have pulled (and drawn) since the last
  // reading; begin_own_item() says so (the positions moved) and, true,
  // keeps producers off until end_own_item().
  try {
    if (s->watch) {
      s->watch->loop_resumes(positions);
    }
  } catch (py::error_already_set& e) {
    s->stage().end_own_item(false);
    e.restore();
    return nullptr;
  }
  PyObject* item = Py_TYPE(args[1])->tp_iternext(args[1]);
  // The readings call Python: the iterator's exception waits meanwhile.
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  bool failed = false;
  try {
    if (s->watch) {
      s->watch->made();
    }
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("torch_stage generator watch");
    failed = true;
  }
  s->stage().end_own_item(item != nullptr);
  PyErr_Restore(type, value, traceback);
  if (failed && s->watch) {
    s->watch->start_over();
  }
  if (item == nullptr && !PyErr_Occurred()) {
    PyErr_SetNone(PyExc_StopIteration);
  }
  return item;
}

PyMethodDef own_next_def[] = {
    {"_own_next",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(own_next)),
     METH_FASTCALL,
     "_own_next(stage, iterator)\n--\n\nA batch made in the loop between "
     "the stage's begin_own_item() and end_own_item(); the stage itself "
     "where the loop may not make it."},
    {nullptr, nullptr, 0, nullptr},
};

void init_stage(py::module_& m) {
  m.def("_cpu_generator_fingerprint", &cpu_generator_fingerprint);
  if (PyModule_AddFunctions(m.ptr(), own_next_def) != 0) {
    throw py::error_already_set();
  }
  py::class_<GeneratorReader, std::shared_ptr<GeneratorReader>>(
      m, "_GeneratorReader")
      .def(
          py::init<
              py::object,
              uintptr_t,
              uintptr_t,
              py::object,
              py::object,
              uintptr_t,
              uintptr_t>(),
          py::arg("random_inst"),
          py::arg("random_index"),
          py::arg("random_first"),
          py::arg("numpy_module"),
          py::arg("numpy_owner"),
          py::arg("numpy_pos"),
          py::arg("numpy_first"))
      .def("__call__", [](const GeneratorReader& r) { return r.read(); });
  // Garbage-collected: a stage over its owner's method (transform=self.f,
  // or source=self.gen()) is a cycle through C++ that the collector would
  // otherwise never see, and the owner, the stage and its producer threads
  // would live until the interpreter exits. (pybind11's custom_type_setup
  // recipe.)
  py::class_<PyStage, std::shared_ptr<PyStage>>(
      m, "_Stage", py::custom_type_setup([](PyHeapTypeObject* heap_type) {
        auto* type = &heap_type->ht_type;
        type->tp_flags |= Py_TPFLAGS_HAVE_GC;
        type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
          Py_VISIT(Py_TYPE(self));
          if (!py::detail::is_holder_constructed(self)) {
            return 0;
          }
          return py::cast<PyStage&>(py::handle(self)).traverse(visit, arg);
        };
        type->tp_clear = [](PyObject* self) {
          if (py::detail::is_holder_constructed(self)) {
            py::cast<PyStage&>(py::handle(self)).clear();
          }
          return 0;
        };
      }))
      .def(
          py::init([](py::object source,
                      bool call_source,
                      py::dict feed_dict,
                      py::object transform,
                      py::tuple closed_types,
                      py::tuple ignored_types,
                      py::object helpers,
                      py::object warn,
                      std::string name,
                      int64_t capacity,
                      int64_t num_threads,
                      int64_t num_clients,
                      int64_t timeout_ms,
                      bool ordered,
                      int64_t pool_id,
                      py::object device,
                      int64_t stream_id,
                      std::optional<int64_t> put_timeout_ms,
                      int64_t join_timeout_ms,
                      bool item_errors,
                      bool auto_tune,
                      int64_t min_threads,
                      int64_t initial_threads,
                      int64_t max_capacity,
                      int64_t memory_budget_bytes,
                      int64_t tune_window_items,
                      int64_t tune_window_ns,
                      double tune_explore_share,
                      double tune_waiting_cpu_share,
                      py::object tuning_memory) {
            StageOptions options;
            options.name = name;
            options.capacity = capacity;
            options.num_threads = num_threads;
            options.num_clients = num_clients;
            options.timeout_ms = timeout_ms;
            options.ordered = ordered;
            options.pool_id = pool_id;
            options.device = parse_device(device);
            options.stream_id = stream_id;
            options.put_timeout_ms = put_timeout_ms;
            options.item_errors = item_errors;
            options.join_timeout = std::chrono::milliseconds(join_timeout_ms);
            options.auto_tune = auto_tune;
            options.min_threads = min_threads;
            options.initial_threads = initial_threads;
            options.max_capacity = max_capacity;
            options.memory_budget_bytes = memory_budget_bytes;
            options.tune_window_items = tune_window_items;
            options.tune_window_ns = tune_window_ns;
            options.tune_explore_share = tune_explore_share;
            options.tune_waiting_cpu_share = tune_waiting_cpu_share;
            if (!tuning_memory.is_none()) {
              options.tuning_memory = memory_from(tuning_memory);
            }
            auto work = std::make_shared<PyStageWork>(
                name,
                std::move(source),
                call_source,
                std::move(feed_dict),
                transform.is_none() ? py::object() : std::move(transform),
                std::move(closed_types),
                std::move(ignored_types),
                std::move(helpers),
                options.device.has_value());
            return std::make_shared<PyStage>(
                std::move(options), std::move(work), std::move(warn));
          }),
          py::kw_only(),
          py::arg("source"),
          py::arg("call_source"),
          py::arg("feed_dict"),
          py::arg("transform"),
          py::arg("closed_types"),
          py::arg("ignored_types"),
          py::arg("helpers"),
          py::arg("warn"),
          py::arg("name"),
          py::arg("capacity"),
          py::arg("num_threads"),
          py::arg("num_clients"),
          py::arg("timeout_ms"),
          py::arg("ordered"),
          py::arg("pool_id"),
          py::arg("device"),
          py::arg("stream_id"),
          py::arg("put_timeout_ms"),
          py::arg("join_timeout_ms"),
          py::arg("item_errors") = false,
          py::arg("auto_tune") = false,
          py::arg("min_threads") = 1,
          py::arg("initial_threads") = 1,
          py::arg("max_capacity") = 1,
          py::arg("memory_budget_bytes") = 0,
          py::arg("tune_window_items") = 8,
          py::arg("tune_window_ns") = 50'000'000,
          py::arg("tune_explore_share") = 0.1,
          py::arg("tune_waiting_cpu_share") = 0.5,
          py::arg("tuning_memory") = py::none())
      .def(
          "start",
          [](PyStage& s) { s.stage().start(); },
          py::call_guard<ReleasedGil>())
      .def(
          "prime",
          [](PyStage& s) { s.stage().prime(); },
          py::call_guard<ReleasedGil>())
      .def("next", &PyStage::next, py::arg("timeout_ms") = -1)
      .def(
          "close",
          [](PyStage& s, int64_t join_timeout_ms, bool warn_if_left) {
            if (join_timeout_ms < 0) {
              s.stage().close();
            } else {
              s.stage().close(
                  std::chrono::milliseconds(join_timeout_ms), warn_if_left);
            }
          },
          py::arg("join_timeout_ms") = -1,
          py::arg("warn_if_left") = true,
          py::call_guard<ReleasedGil>())
      .def("stats", &PyStage::stats)
      .def(
          "tuning_memory",
          [](PyStage& s) -> py::object {
            const auto memory = s.stage().tuning_memory();
            if (!memory) {
              return py::none();
            }
            return memory_to(*memory);
          })
      .def(
          "limit_threads",
          [](PyStage& s, int64_t max_threads, const std::string& why) {
            s.stage().limit_threads(max_threads, why);
          },
          py::arg("max_threads"),
          py::arg("why"),
          py::call_guard<ReleasedGil>())
      // With the GIL held: neither blocks (see Stage::begin_own_item).
      .def(
          "begin_own_item",
          [](PyStage& s) { return s.stage().begin_own_item(); })
      .def(
          "end_own_item",
          [](PyStage& s, bool made) { s.stage().end_own_item(made); })
      .def(
          "watch_generators",
          [](PyStage& s,
             std::shared_ptr<GeneratorReader> reader,
             py::object signal) {
            s.watch = reader
                ? std::make_shared<GeneratorWatch>(reader, std::move(signal))
                : nullptr;
          },
          py::arg("reader").none(true),
          py::arg("signal") = py::none())
      .def(
          "watch_news",
          // Whether the generator watch found something since asked last.
          [](PyStage& s) { return s.watch ? s.watch->take_news() : false; })
      .def(
          "watch_state",
          // (loop bits, pull bits, stale): see GeneratorWatch.
          [](PyStage& s) {
            return s.watch ? s.watch->state() : py::make_tuple(0, 0, true);
          })
      .def("describe", [](PyStage& s) { return s.stage().describe(); })
      .def("buffered", [](PyStage& s) { return s.stage().buffered(); })
      .def_property_readonly(
          "started", [](PyStage& s) { return s.stage().started(); })
      .def_property_readonly(
          "closed", [](PyStage& s) { return s.stage().closed(); })
      .def_property_readonly(
          "failed", [](PyStage& s) { return s.stage().failed(); })
      .def_property_readonly(
          "finished", [](PyStage& s) { return s.stage().stats().finished; });

  m.def(
      "_add_stage_thread_pool",
      &StagePools::add,
      py::arg("inter_op_threads"),
      py::arg("intra_op_threads"),
      py::arg("global_name"));
  m.def("_stage_thread_pool_count", &StagePools::count);
  m.attr("_MAX_STREAMS") = kMaxStreams;
}

} // namespace torch_stage::python
