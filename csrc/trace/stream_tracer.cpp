#include "trace/stream_tracer.h"

#include <cstring>
#include <memory>
#include <unordered_map>

#include "streams/stream_observer.h"
#include "trace/trace_recorder.h"

namespace torch_stage::trace {
namespace {

struct OpenSegment {
  int64_t stream = 0;
  int64_t start_ns = 0;
  int32_t name = 0;
};

// Open segments of this thread, by owner (run or scope id).
thread_local std::unordered_map<int64_t, OpenSegment> tls_open;

struct StreamNames {
  int32_t segment = intern("torch_stage/stream");
  int32_t scope = intern("torch_stage/stream_scope");
  std::unordered_map<std::string, int32_t> ops;
};

const StreamNames& stream_names() {
  static const StreamNames* n = [] {
    auto* names = new StreamNames();
    for (const char* op :
         {"fork",
          "set_stream",
          "record_event",
          "wait_event",
          "record_stream",
          "join",
          "scope_enter",
          "scope_exit",
          "stage_copy",
          "stage_hand_over"}) {
      names->ops.emplace(op, intern(std::string("torch_stage::") + op));
    }
    return names;
  }();
  return *n;
}

void close_segment(int64_t owner, int64_t now) {
  auto it = tls_open.find(owner);
  if (it == tls_open.end()) {
    return;
  }
  Record r;
  r.start_ns = it->second.start_ns;
  r.end_ns = now;
  r.name = it->second.name;
  r.kind = Kind::kStream;
  r.a = it->second.stream;
  r.c = owner;
  tls_open.erase(it);
  record(r);
}

void open_segment(int64_t owner, int64_t stream, int32_t name, int64_t now) {
  tls_open[owner] = OpenSegment{stream, now, name};
}

void on_note(const StreamOpNote& note) {
  if (!enabled()) {
    return;
  }
  const StreamNames& names = stream_names();
  const int64_t now = now_ns();
  const char* op = note.op;
  if (std::strcmp(op, "set_stream") == 0) {
    auto it = tls_open.find(note.owner);
    if (it != tls_open.end() && it->second.stream == note.stream) {
      return; // already current: the segment goes on
    }
    close_segment(note.owner, now);
    open_segment(note.owner, note.stream, names.segment, now);
    return;
  }
  if (std::strcmp(op, "scope_exit") == 0) {
    close_segment(note.owner, now);
  } else if (std::strcmp(op, "join") == 0 && note.owner_thread) {
    close_segment(note.owner, now);
  }
  auto id = names.ops.find(op);
  if (id != names.ops.end()) {
    Record r;
    r.start_ns = r.end_ns = now;
    r.name = id->second;
    r.kind = Kind::kStreamOp;
    r.a = note.stream;
    r.b = note.event;
    r.c = note.owner;
    record(r);
  }
  if (std::strcmp(op, "fork") == 0) {
    open_segment(note.owner, 0, names.segment, now);
  } else if (std::strcmp(op, "scope_enter") == 0) {
    open_segment(note.owner, note.stream, names.scope, now);
  }
}

} // namespace

void install_stream_tracer() {
  (void)stream_names(); // intern before any note arrives
  set_stream_observer(
      StreamObserverSlot::kTrace,
      std::make_shared<const StreamObserver>(on_note));
}

void remove_stream_tracer() {
  set_stream_observer(StreamObserverSlot::kTrace, nullptr);
}

} // namespace torch_stage::trace
