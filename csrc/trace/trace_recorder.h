// Trace recorder: per-thread spans of staged runs and host-side stream ops,
// written by torch_stage.trace() as Chrome trace JSON (Perfetto,
// chrome://tracing).
//
// What is recorded
// ----------------
// Stage producers record `pull` (the source), `process` (the transform),
// `copy_to_device` and `put` (the hand-over: waiting for the turn and for
// space, then the put); consumers record `take` (the wait for an item). The
// buffer's occupancy is a counter sampled after every put and take. Stream
// runs, scopes and staging copies are seen through a StreamObserver
// (streams/stream_observer.h): the host time a pool stream was current
// (`stream` segments from fork or set_stream to the next set_stream or
// join), and fork, record_event, wait_event, record_stream, join and the
// staging notes as instants. Spans also open an at::RecordFunction
// (USER_SCOPE) under the same name, so torch.profiler shows them whether or
// not a trace is recording.
//
// Cost when off: `enabled()` is one relaxed atomic load; nothing else runs,
// no clock is read, no memory is touched.
//
// Threads
// -------
// start() and stop() are called by one controlling thread at a time
// (torch_stage.trace refuses a second recording). Any thread may record:
// each appends to a buffer of its own (created on its first record of a
// recording, registered in a global list), guarded by a mutex that only the
// collector in stop() also takes, so recording threads never contend with
// each other. A span that started before start() is not recorded; one that
// ends after stop() collected is lost (its thread's buffer is no longer
// listed). Buffers outlive their threads until the next start(), so spans of
// producers that exited are still collected. intern() and name() may be
// called from any thread; names are never freed, so the pointer name()
// returns stays valid for the life of the process.
#pragma once

#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torch_stage::trace {

enum class Kind : uint8_t {
  kPull = 0, // a producer reads the source
  kProcess = 1, // a producer runs the transform
  kCopy = 2, // a producer stages the item to the device (host side)
  kPut = 3, // a producer waits for its turn and for space, then puts
  kTake = 4, // a consumer waits for and takes an item
  kStream = 5, // a pool stream is current on this thread (host time)
  kStreamOp = 6, // an instant: fork, record/wait event, join, ...
  kCounter = 7, // a counter sample (buffer occupancy)
  kStageInfo = 8, // an instant carrying a stage's capacity and threads
};

// One recorded span, instant or sample. Times are steady_clock ns.
struct Record {
  int64_t start_ns = 0;
  int64_t end_ns = 0; // == start_ns for instants and samples
  int32_t name = 0; // an interned name
  Kind kind = Kind::kPull;
  // Per kind: spans: a = item index (-1: none), b = outcome (0: item, 1:
  // end of data, 2: skipped, 3: error, 4: closed or timed out). kStream: a =
  // pool stream, c = owner. kStreamOp: a = stream, b = event, c = owner.
  // kCounter: a = value. kStageInfo: a = capacity, b = num_threads.
  int64_t a = -1;
  int64_t b = 0;
  int64_t c = 0;
};

struct ThreadRecords {
  int64_t tid = 0; // the kernel's thread id (threading.get_native_id())
  std::string thread_name; // the pthread name when first recorded
  std::vector<Record> records;
};

struct Collected {
  int64_t start_ns = 0; // when start() ran
  int64_t stop_ns = 0;
  std::vector<ThreadRecords> threads;
};

namespace detail {
extern std::atomic<bool> g_enabled;
} // namespace detail

// Whether a recording is on (one relaxed load).
inline bool enabled() {
  return detail::g_enabled.load(std::memory_order_relaxed);
}

int64_t now_ns();

// Starts a recording (discarding the previous one's buffers). Throws if one
// is already on.
void start();
// Ends the recording and returns what every thread recorded. A no-op
// returning nothing when none is on.
Collected stop();

// A process-wide id for `name` (stable: the same name, the same id).
int32_t intern(const std::string& name);
// The name of an interned id; valid for the life of the process.
const char* name(int32_t id);
// Every interned name, by id.
std::vector<std::string> names();

// Names the calling thread in traces (the kernel keeps 15 characters of a
// pthread name; this keeps all of them). Call before its first record.
void set_thread_name(std::string name);

// Appends to the calling thread's buffer (only call while enabled()).
void record(const Record& r);

// Records a counter sample now (checks enabled() itself).
inline void sample(int32_t name, int64_t value) {
  if (enabled()) {
    Record r;
    r.start_ns = r.end_ns = now_ns();
    r.name = name;
    r.kind = Kind::kCounter;
    r.a = value;
    record(r);
  }
}

// A span: a RecordFunction range under its name while torch.profiler (or any
// RecordFunction callback) is active, and a trace record while a recording
// is on. Ends at destruction or end().
class Span {
 public:
  Span(Kind kind, int32_t name, int64_t item = -1)
      : rf_(at::RecordScope::USER_SCOPE),
        kind_(kind),
        name_(name),
        item_(item) {
    if (rf_.isActive()) {
      rf_.before(trace::name(name));
    }
    if (enabled()) {
      start_ns_ = now_ns();
    }
  }
  ~Span() {
    end();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  void set_item(int64_t item) {
    item_ = item;
  }
  void set_outcome(int64_t outcome) {
    outcome_ = outcome;
  }
  void end() {
    if (start_ns_ != 0) {
      Record r;
      r.start_ns = start_ns_;
      r.end_ns = now_ns();
      r.name = name_;
      r.kind = kind_;
      r.a = item_;
      r.b = outcome_;
      start_ns_ = 0;
      record(r);
    }
    rf_.end();
  }

 private:
  at::RecordFunction rf_;
  Kind kind_;
  int32_t name_;
  int64_t item_;
  int64_t outcome_ = 0;
  int64_t start_ns_ = 0; // 0: not recording
};

} // namespace torch_stage::trace
