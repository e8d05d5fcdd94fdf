// TorchScript registration of the stream ops the multi-stream pass emits
// (torch.ops.torch_stage.fork / set_stream / record_event / wait_event /
// record_stream / sync / join) and of their run object,
// torch.classes.torch_stage.StreamRun (semantics: csrc/streams/stream_run.h);
// and of `with torch_stage.stream(i):` for scripted code: the op
// torch.ops.torch_stage.stream and its context manager class
// torch.classes.torch_stage.StreamScope (csrc/streams/stream_scope.h).
//
// Every op is registered with AliasAnalysisKind::CONSERVATIVE: the ops
// return nothing (or a fresh object) and read no tensor data, so with
// FROM_SCHEMA TorchScript would see them as pure and dead-code eliminate,
// CSE or reorder them (Node::hasSideEffects() is true only for conservative
// ops; cuda::set_stream is special-cased there for the same reason). The
// Python side also marks them side-effecting for torch.fx
// (torch_stage/streams/fx/_ops.py).
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "streams/stream_pool.h"
#include "streams/stream_run.h"
#include "streams/stream_scope.h"

namespace torch_stage {
namespace {

using Run = c10::intrusive_ptr<StreamRun>;
using Scope = c10::intrusive_ptr<StreamScope>;

constexpr auto kEffectful = c10::AliasAnalysisKind::CONSERVATIVE;
#define TORCH_STAGE_RUN "__torch__.torch.classes.torch_stage.StreamRun"
#define TORCH_STAGE_SCOPE "__torch__.torch.classes.torch_stage.StreamScope"

// fork and fork_traced: the run, on the device of the first tensor among
// `probes`.
Run fork_run(
    int64_t num_streams,
    std::vector<int64_t> side_streams,
    int64_t num_events,
    const c10::IValue& probes) {
  return c10::make_intrusive<StreamRun>(
      StreamRun::device_of(probes), num_streams, side_streams, num_events);
}

} // namespace

TORCH_LIBRARY_FRAGMENT(torch_stage, m) {
  m.class_<StreamRun>("StreamRun")
      .def("is_active", &StreamRun::is_active)
      .def("device", &StreamRun::device)
      .def("num_streams", &StreamRun::num_streams)
      .def("stream_ids", &StreamRun::stream_ids)
      .def("kept_tensors", &StreamRun::kept_tensors);

  m.def(
      torch::schema(
          "fork(int num_streams, int[] side_streams, int num_events, "
          "Any probes) -> " TORCH_STAGE_RUN,
          kEffectful),
      &fork_run);
  m.def(
      torch::schema(
          "set_stream(" TORCH_STAGE_RUN " run, int stream) -> ()", kEffectful),
      [](const Run& run, int64_t stream) { run->set_stream(stream); });
  m.def(
      torch::schema(
          "record_event(" TORCH_STAGE_RUN " run, int event, int stream) -> ()",
          kEffectful),
      [](const Run& run, int64_t event, int64_t stream) {
        run->record_event(event, stream);
      });
  m.def(
      torch::schema(
          "wait_event(" TORCH_STAGE_RUN " run, int event, int stream) -> ()",
          kEffectful),
      [](const Run& run, int64_t event, int64_t stream) {
        run->wait_event(event, stream);
      });
  // `Any` here and in fork: without example inputs the pass does not know
  // which values are tensors (a forward argument may be an int, a list of
  // tensors, ...); non-tensors are skipped.
  m.def(
      torch::schema(
          "record_stream(" TORCH_STAGE_RUN " run, Any value, int stream) -> ()",
          kEffectful),
      [](const Run& run, const c10::IValue& value, int64_t stream) {
        run->record_stream(value, stream);
      });
  // What the pass puts between two nodes, in one call (stream_run.h).
  m.def(
      torch::schema(
          "sync(" TORCH_STAGE_RUN
          " run, int record, int stream, int[] waits, Any keep) -> ()",
          kEffectful),
      [](const Run& run,
         int64_t record,
         int64_t stream,
         std::vector<int64_t> waits,
         const c10::IValue& keep) { run->sync(record, stream, waits, keep); });
  // keep: what the output holds of the side streams' results, marked used
  // on stream 0 (the caller's) first; the pass folds the sync that did it
  // into join (stream_run.h).
  m.def(
      torch::schema(
          "join(" TORCH_STAGE_RUN " run, int[] side_streams) -> ()",
          kEffectful),
      [](const Run& run, std::vector<int64_t> side_streams) {
        run->join(side_streams);
      });
  // (An overload: an `Any` argument takes no default.)
  m.def(
      torch::schema(
          "join.keeping(" TORCH_STAGE_RUN
          " run, int[] side_streams, Any keep) -> ()",
          kEffectful),
      [](const Run& run,
         std::vector<int64_t> side_streams,
         const c10::IValue& keep) { run->join(side_streams, keep); });
  // torch.jit.trace records an op's arguments by their schema types and
  // cannot record an Any: traced, fork, sync and record_stream are these,
  // which take the tensors among the values as Tensor[] (fx/_ops.py
  // collects them; the rest of a value never mattered to the ops).
  m.def(
      torch::schema(
          "fork_traced(int num_streams, int[] side_streams, int num_events, "
          "Tensor[] probes) -> " TORCH_STAGE_RUN,
          kEffectful),
      [](int64_t num_streams,
         std::vector<int64_t> side_streams,
         int64_t num_events,
         const c10::List<at::Tensor>& probes) {
        return fork_run(
            num_streams,
            std::move(side_streams),
            num_events,
            c10::IValue(probes));
      });
  m.def(
      torch::schema(
          "sync_traced(" TORCH_STAGE_RUN
          " run, int record, int stream, int[] waits, Tensor[] keep) -> ()",
          kEffectful),
      [](const Run& run,
         int64_t record,
         int64_t stream,
         std::vector<int64_t> waits,
         const c10::List<at::Tensor>& keep) {
        run->sync(record, stream, waits, c10::IValue(keep));
      });
  m.def(
      torch::schema(
          "record_stream_traced(" TORCH_STAGE_RUN
          " run, Tensor[] value, int stream) -> ()",
          kEffectful),
      [](const Run& run, const c10::List<at::Tensor>& value, int64_t stream) {
        run->record_stream(c10::IValue(value), stream);
      });
  m.def("stream_pool_size(Device device) -> int", [](c10::Device device) {
    return StreamPool::size(device);
  });
  // Side stream `index` (1..kMaxStreams-1) of the pool, as the three
  // numbers torch.Stream(stream_id, device_index, device_type) takes: the
  // compile backend hands the same streams to inductor's generated code.
  m.def(
      "side_stream(Device device, int index) -> int[]",
      [](c10::Device device, int64_t index) {
        TORCH_CHECK_VALUE(
            index >= 1 && index < kMaxStreams,
            "side_stream: index must be in 1..",
            kMaxStreams - 1,
            ", got ",
            index);
        const c10::Stream s =
            StreamPool::side_streams(device, index + 1).at(index - 1);
        return std::vector<int64_t>{
            s.id(),
            static_cast<int64_t>(s.device_index()),
            static_cast<int64_t>(s.device_type())};
      });

  // TorchScript's `with` accepts an object whose class has __enter__(self)
  // and __exit__(self, Any, Any, Any) (ir_emitter's emitWith); custom
  // classes qualify. __enter__ returns the scope for `with ... as s`.
  m.class_<StreamScope>("StreamScope")
      .def(
          "__enter__",
          [](const Scope& self) {
            self->enter();
            return self;
          })
      .def(
          "__exit__",
          [](const Scope& self, c10::IValue, c10::IValue, c10::IValue) {
            self->exit();
          })
      .def("index", &StreamScope::index)
      .def("is_active", &StreamScope::is_active)
      .def("is_entered", &StreamScope::is_entered)
      .def("device", &StreamScope::device)
      .def("stream_id", &StreamScope::stream_id)
      .def("enclosing_stream_id", &StreamScope::enclosing_stream_id);
  // Conservative like the other stream ops: a scope must never be CSE'd
  // into another scope or hoisted, even though the op reads no tensor.
  m.def(
      torch::schema("stream(int index) -> " TORCH_STAGE_SCOPE, kEffectful),
      [](int64_t index) -> Scope {
        return c10::make_intrusive<StreamScope>(
            index, StreamScope::default_device());
      });
}

} // namespace torch_stage
