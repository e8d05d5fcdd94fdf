// Stage: producer threads that pull items from a source, run the per-item
// stage work, optionally copy the result to a device, and hand it to
// consumers through a bounded buffer (the runtime behind torch_stage.staged).
//
// Semantics (design.md, "Staging semantics")
// -------------------------------------------
// * At most `capacity` finished items wait in the buffer; producers block
//   when it is full. `num_threads` producer threads work at once; each takes
//   the next source position under the source lock, then processes it
//   concurrently with the others.
// * ordered: items are delivered in source order whatever thread finished
//   first (a producer waits for its turn before it puts). Unordered: in the
//   order they finish.
// * End of data: StageWork::pull returns kEnd at position k. No position
//   after k is pulled; every item before k is delivered, then the buffer
//   closes and consumers see end of stream.
// * Skipped items (kSkip, the ignored exception types) are counted and do
//   not reach consumers; the stream continues.
// * Errors (kError) at position k stop the pulling; the items before k are
//   delivered, then the error item itself, which the consumer re-raises; the
//   items after k are discarded. Consumers that reach the end afterwards
//   learn that the stage failed (failed()).
// * Producers never drop an item silently. Only when put_timeout_ms is set
//   (DeepRec's discard-on-timeout, an explicit opt-in) does a producer that
//   waited that long for space discard its item, counted in stats().dropped
//   and reported through the warning callback.
// * Consumer waits are bounded by timeout_ms; the timeout error names the
//   stage and says what each producer is doing (describe()).
//
// Threads and ownership
// ---------------------
// start(), prime(), take(), close(), stats() and describe() may be called
// from any thread. start() is idempotent and also happens on the first
// take(), so a forgotten warm-up can never hang a consumer. close() stops
// the producers,
// cancels the buffer (waking every waiter) and joins the threads; a producer
// busy inside StageWork (user code that does not return) is waited for at
// most join_timeout and then left to finish on its own, holding the shared
// state alive; close() from a producer itself (StageWork closing its own
// stage) waits for the others only. The destructor closes. StageWork is
// called only from producer threads; pull() is called under the source
// lock, one position at a time.
//
// Stage thread pools: a producer holds a slot of its pool while it reads
// (once its turn at the source lock has come) and processes an item, not
// while it waits for its turn, for buffer space, or for another stage's
// item (take() gives the calling producer's slot back; it takes one again
// before processing), so stages of one pool, chained ones too, never wait
// on each other's slots.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "staging/auto_tuner.h"
#include "staging/bounded_buffer.h"
#include "staging/staging_area.h"

namespace torch_stage {

class DeviceStager;

// Why an item failed, to be re-raised by the consumer at its position.
struct ItemError {
  std::string message;
  // Owner-specific detail (the Python exception object for Python work);
  // its deleter knows how to release it from any thread.
  std::shared_ptr<void> detail;
  // The stage's contract: an error ends it (later items are not delivered).
  // False only for a failed copy under StageOptions::item_errors.
  bool ends_stage = true;
};

// One item on its way from the source to a consumer.
struct StageItem {
  int64_t index = -1; // position in the source
  TensorBundle tensors; // the tensors of the item (device staging copies them)
  // Owner-specific rest of the item (for Python work: the object itself, or
  // its structure and non-tensor leaves when the tensors were taken out).
  std::shared_ptr<void> payload;
  std::shared_ptr<const ItemError> error; // set on error items only
  // Set by device staging: the copy's completion, which consumers' streams
  // wait on (shared with the pinned buffer that must not be reused before
  // it), and the device memory they must keep safe on their own stream.
  std::shared_ptr<c10::Event> ready;
  at::Tensor device_storage;
  // The staging copy's id in StreamObserver notes (0: none was sent).
  int64_t note_id = 0;
};

// What a producer step produced.
enum class Outcome {
  kItem, // an item to deliver
  kEnd, // end of data (a closed exception type): deliver what came before
  kSkip, // an ignored exception: count, log, continue
  kError, // any other failure: item.error says why; stops the stage
};

// The source and per-item work of a stage. Implemented by the Python glue
// (Python iterables, callables and transforms) and by C++ sources.
class StageWork {
 public:
  virtual ~StageWork() = default;
  // Fetch the item at source position `index` into `item`. Called under the
  // stage's source lock.
  virtual Outcome pull(int64_t index, StageItem& item) = 0;
  // The per-item stage work (transform); runs concurrently on producers.
  virtual Outcome process(StageItem& item) = 0;
  // Make item.tensors hold every tensor of the item (device staging needs
  // them); called before device staging only.
  virtual Outcome expose_tensors(StageItem& item) = 0;
  // Bytes of one item's tensors, once known (-1 before): auto-tuning keeps
  // capacity within its memory budget with it. Any thread.
  virtual int64_t item_bytes() const {
    return -1;
  }
  // What the error item of a step that threw `error` says. The copy to the
  // device runs ops that may run Python code (a __torch_dispatch__ mode such
  // as torch.cuda._sanitizer, a tensor subclass), whose error only the work
  // can read, and must take off the thread. Called on the thread that
  // caught it, without the GIL. Default: what().
  virtual std::string explain(const std::exception_ptr& error) const;
};

// A named budget for stage work (add_stage_thread_pool): how many producers
// of all stages using it may do work at once (inter_op_threads), how many
// intra-op threads each uses, and the name their threads carry.
//
// Why a budget and not a set of shared threads: producers block on buffer
// space and on their turn, for as long as the consumer pleases. Shared
// threads parked that way would starve other stages of the pool, or
// deadlock them. So each stage keeps its own threads, named after the pool,
// and holds one of the pool's slots only while it pulls and processes.
struct StagePoolConfig {
  int64_t inter_op_threads = 0; // 0: no bound (the default pool)
  int64_t intra_op_threads = 1;
  std::string global_name;
};

class StagePools {
 public:
  // Registers a pool and returns its id (>= 1; id 0 is the default pool).
  static int64_t add(
      int64_t inter_op_threads,
      int64_t intra_op_threads,
      const std::string& global_name);
  static int64_t count();
  static StagePoolConfig config(int64_t id);

  class Slot;
  // Blocks until pool `id` has a free slot or `stop()` holds (then returns
  // an empty slot). Release by destroying the Slot.
  static Slot acquire(int64_t id, const std::function<bool()>& stop);
  // Wakes waiters of every pool (after a stop condition changed).
  static void wake_all();

  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& other) noexcept : pool_(other.pool_) {
      other.pool_ = -1;
    }
    Slot& operator=(Slot&& other) noexcept;
    ~Slot();
    explicit operator bool() const {
      return pool_ >= 0;
    }
    void release();

   private:
    friend class StagePools;
    explicit Slot(int64_t pool) : pool_(pool) {}
    int64_t pool_ = -1;
  };
};

// Auto-tuning (StageOptions::auto_tune; AutoTuner in auto_tuner.h says how
// it decides). The tuner lets `threads` of the `num_threads` producers work
// (the others park) and sets the buffer's capacity, from the consumers'
// take(). A producer thread starts when a setting first lets it work (at
// start() for the initial setting): a stage the tuner keeps at no thread
// starts none. With `threads` 0 a consumer that
// finds the buffer empty and no item in flight produces the next item
// itself, on its own thread, inside take() (as a single-process DataLoader
// does): that work is the consumer's, so take()'s timeout does not bound it,
// and it runs outside any stage thread pool. Delivery order, end of data and
// errors are the same whoever produced an item.
struct StageOptions {
  std::string name = "stage";
  int64_t capacity = 1;
  int64_t num_threads = 1;
  // Consumers served at once (DeepRec's Take pool): further consumers wait
  // for one of them to finish its take. Any number may share the stage.
  int64_t num_clients = 1;
  int64_t timeout_ms = 300000;
  bool ordered = true;
  int64_t pool_id = 0;
  std::optional<c10::Device> device; // device staging target
  int64_t stream_id = 0; // staging stream (0: the consumer's stream)
  std::optional<int64_t> put_timeout_ms; // opt-in discard-on-timeout
  // A failed copy to the device is an error at its item only: consumers
  // raise it there and then take the items after it (the DataLoader's
  // contract: the plain one raises a failed pin_memory at its batch and goes
  // on). Errors of the source and the transform still end the stage.
  bool item_errors = false;
  std::chrono::milliseconds join_timeout{10000};
  // Auto-tuning: threads in [min_threads, num_threads] starting at
  // initial_threads; capacity in [capacity, max_capacity], and at most
  // memory_budget_bytes over the item size once it is known (0: no bound).
  bool auto_tune = false;
  int64_t min_threads = 1;
  int64_t initial_threads = 1;
  int64_t max_capacity = 1;
  int64_t memory_budget_bytes = 0;
  // The tuner's measuring window (TunerLimits); tests shorten it to make
  // the setting change all the time.
  int64_t tune_window_items = 8;
  int64_t tune_window_ns = 50'000'000;
  // The share of windows trials may take (TunerLimits::explore_share; 0:
  // no bound); tests that change the setting all the time make it 0.
  double tune_explore_share = 0.05;
  // Inline production under this share of its time on the consumer's CPU
  // counts as waiting (TunerLimits::waiting_cpu_share); benchmarks vary it.
  double tune_waiting_cpu_share = 0.5;
  // Start from what an earlier stage's tuner learnt (Stage::tuning_memory;
  // clamped to these bounds) instead of initial_threads and capacity.
  std::optional<TunerMemory> tuning_memory;
  // Fault injection (tests): producers from this one on are refused as the
  // system refuses a thread (std::system_error); -1: none.
  int64_t refuse_threads_from = -1;
};

struct StageStats {
  int64_t produced = 0; // items put in the buffer
  int64_t consumed = 0; // items handed to consumers
  int64_t skipped = 0; // ignored exceptions
  int64_t dropped = 0; // discarded on put timeout (opt-in)
  int64_t discarded = 0; // produced but still buffered when close() ran
  int64_t errors = 0;
  int64_t consumer_wait_ns = 0;
  int64_t producer_blocked_ns = 0; // waiting for space or for the turn
  int64_t pull_ns = 0; // inside StageWork::pull
  int64_t process_ns = 0; // inside StageWork::process
  int64_t copy_ns = 0; // device staging on the host (pin, fuse, launch)
  int64_t occupancy_sum = 0; // items found in the buffer by takes, summed
  int64_t max_occupancy = 0;
  int64_t capacity = 0;
  // Device staging (zero without a device): items copied, tensors fused into
  // shared transfers, bytes sent, host buffers allocated and reused.
  int64_t staged_items = 0;
  int64_t fused_tensors = 0;
  int64_t staged_bytes = 0;
  int64_t host_buffers = 0;
  int64_t host_buffer_reuses = 0;
  int64_t host_buffer_waits = 0; // reuses that waited for a copy in flight
  int64_t direct_copies = 0; // pinned tensors sent without a gather
  // Producer threads allowed to work now (num_threads unless auto-tuned),
  // items consumers produced themselves, and the tuner's windows and trials.
  int64_t threads = 0;
  int64_t inline_items = 0;
  int64_t inline_ns = 0;
  // From the start of consumers' first take to the end of their last
  // (their loop's time, for telling input- from compute-bound where no
  // producer ran).
  int64_t loop_ns = 0;
  int64_t tuning_windows = 0;
  int64_t tuning_trials = 0;
  int64_t tuning_trial_windows = 0;
  int64_t tuning_max_capacity = 0; // after the memory budget
  bool auto_tune = false;
  bool started = false;
  bool finished = false; // every producer has exited
  bool failed = false;
};

// What a consumer got from take().
enum class TakeStatus { kItem, kEnd, kTimeout, kClosed };

// What a consumer span records as its outcome (trace::Record::b): 0 an
// item, 1 the end, 3 an error item, 4 closed or timed out.
inline int64_t take_outcome(TakeStatus status, const StageItem& item) {
  switch (status) {
    case TakeStatus::kItem:
      return item.error ? 3 : 0;
    case TakeStatus::kEnd:
      return 1;
    case TakeStatus::kTimeout:
    case TakeStatus::kClosed:
      return 4;
  }
  return 4;
}

class Stage {
 public:
  // Throws c10::ValueError for invalid options (before any thread starts).
  Stage(StageOptions options, std::shared_ptr<StageWork> work);
  ~Stage();
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;

  // Starts the producer threads the setting lets work: all of them without
  // auto-tuning (idempotent). The system refusing one is an error here;
  // refused later, when auto-tuning first lets it work, the tuner keeps to
  // the threads started and the warning callback says why.
  void start();
  // start(), and where no producer is at work (auto-tuning settled on, or
  // started with, none: consumers make items themselves), makes one item
  // on the calling thread if none is buffered or on its way: the first
  // item is wanted ahead of the first take. Blocks while it makes it.
  void prime();

  // Takes the next item, waiting at most `timeout` (defaults to the stage's
  // timeout_ms). On kItem, `out` is ready to use on the calling thread's
  // current stream (device items: the stream waits on the copy). kEnd: end
  // of stream (check failed()); kClosed: close() was called.
  // take() records a consumer span (trace::Span, `take_span_name()`);
  // take_for() does not, so that a consumer waiting in several slices (the
  // Python binding, to see signals) records one span around them.
  // `may_produce` false: never make the item on this thread (auto-tuning's
  // no-thread setting), only wait for one. A caller holding a lock that
  // producers need (the Python binding's first, GIL-holding attempt) must
  // pass false: making an item takes the source lock, which a producer may
  // hold while it waits for that lock.
  TakeStatus take(StageItem& out);
  TakeStatus take_for(
      StageItem& out,
      std::chrono::milliseconds timeout,
      bool may_produce = true);
  int32_t take_span_name() const;

  // A consumer that owns the source's object makes the next item itself,
  // outside the stage, where auto-tuning's no-thread setting holds: what
  // torch_stage.DataLoader does on the training loop's thread, as the plain
  // DataLoader does, without the stage's hand-over per item. True when no
  // producer may work, nothing is buffered or on its way, the source has
  // not ended and no other consumer is making one: the caller then makes
  // the item and must call end_own_item() (on every path; producers that
  // the tuner lets work meanwhile wait for it). False: take() as usual.
  // Never blocks (a try-lock of the source lock), so it may be called
  // holding a lock that producers need (the GIL). Positions are the
  // stage's own: an item made this way is not one of them. `positions`,
  // where given and the result is true: the positions the stage's pulls
  // (producers', and consumers' inside take()) have taken so far, which
  // tells a caller whether any pull ran between two of its own items.
  bool begin_own_item(int64_t* positions = nullptr);
  // Ends what begin_own_item() began. `made`: an item came of it, counted
  // as produced inline and taken (stats, the tuner, which runs here as
  // after a take); false: the source ended or raised, which is the
  // caller's to handle.
  void end_own_item(bool made);

  // Stops and joins the producers; idempotent; safe from any thread. A
  // producer still inside StageWork after `join_timeout` (default: the
  // stage's option) is left to finish on its own, with a warning unless
  // `warn_if_left` is false (a caller that leaves them on purpose: a
  // training loop's `break` that must not wait for a slow read).
  void close();
  void close(std::chrono::milliseconds join_timeout, bool warn_if_left = true);

  bool started() const;
  bool closed() const;
  // Closed, and no producer is inside StageWork or will enter it again:
  // every producer has exited (none was left behind by close()'s join
  // timeout). Consumers are the caller's affair: one making an item itself
  // (auto-tuning's no-thread setting) is inside take(), which the caller
  // can see. What lets a binding release what the work holds (the Python
  // garbage collector's tp_clear) without a thread still using it.
  bool quiescent() const;
  // Items waiting in the buffer now.
  int64_t buffered() const;
  // Items taken by consumers so far (stats().consumed, without the rest).
  int64_t consumed() const;
  bool failed() const;
  const std::string& name() const;
  const StageOptions& options() const;
  StageStats stats() const;
  // What each producer is doing now, for timeout errors and debugging.
  std::string describe() const;
  // The auto-tuner's decisions, oldest first (empty unless auto_tune).
  std::vector<std::string> tuning_log() const;
  // Auto-tuning uses at most `max_threads` producer threads from now on
  // (never under min_threads); `why` goes to the tuning log. For what the
  // tuner cannot measure (torch_stage.DataLoader: a batch's making and the
  // training loop draw from one global random generator, whose order of
  // draws a producer thread would leave to timing). A no-op without
  // auto-tuning. Any thread.
  void limit_threads(int64_t max_threads, const std::string& why);
  // What the auto-tuner learnt so far, for a later stage of the same work
  // (StageOptions::tuning_memory); nullopt unless auto_tune.
  std::optional<TunerMemory> tuning_memory() const;
  // The error a consumer reports when it waited past timeout_ms.
  // `consumed_before`: stats().consumed when its wait began (-1: unknown),
  // so that a consumer starved while others were served is told so.
  std::string timeout_message(
      std::chrono::milliseconds waited,
      int64_t consumed_before = -1) const;

  // Where warnings go (dropped items); the default prints with TORCH_WARN.
  using WarnFn = std::function<void(const std::string&)>;
  void set_warning_handler(WarnFn fn);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

} // namespace torch_stage
