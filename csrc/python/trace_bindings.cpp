// torch_stage.trace: start and stop the C++ trace recorder
// (trace/trace_recorder.h) and hand its records to Python, which writes the
// Chrome trace JSON (torch_stage/observe/tracing.py).
#include <torch/csrc/utils/pybind.h>

#include "python/bindings.h"
#include "trace/trace_recorder.h"

namespace py = pybind11;

namespace torch_stage::python {

void init_trace(py::module_& m) {
  m.def("_trace_start", &trace::start, py::call_guard<ReleasedGil>());
  // (start_ns, stop_ns, names, [(tid, thread_name, [record tuples])]); a
  // record is (start_ns, end_ns, name id, kind, a, b, c).
  m.def("_trace_stop", [] {
    trace::Collected c;
    {
      ReleasedGil no_gil;
      c = trace::stop();
    }
    py::list threads;
    for (const auto& t : c.threads) {
      py::list records(t.records.size());
      for (size_t i = 0; i < t.records.size(); ++i) {
        const trace::Record& r = t.records[i];
        records[i] = py::make_tuple(
            r.start_ns,
            r.end_ns,
            r.name,
            static_cast<int>(r.kind),
            r.a,
            r.b,
            r.c);
      }
      threads.append(py::make_tuple(t.tid, t.thread_name, records));
    }
    return py::make_tuple(c.start_ns, c.stop_ns, trace::names(), threads);
  });
  m.def("_trace_enabled", &trace::enabled);
  m.def("_trace_now_ns", &trace::now_ns);
}

} // namespace torch_stage::python
