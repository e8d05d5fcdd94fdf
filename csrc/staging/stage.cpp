#include "staging/stage.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <system_error>
#include <utility>

#include <time.h>

#include "staging/auto_tuner.h"
#include "staging/device_stager.h"
#include "trace/trace_recorder.h"

// Intra-op bound for stage threads. at::set_num_threads would also change
// the process-wide default that every thread not yet initialised (the main
// thread included, before its first parallel op) adopts: the DataLoader's
// pin thread idiom has that side effect. OpenMP's setting is per thread, and
// MKL's GNU OpenMP layer follows it. Weak, so that a torch built without
// OpenMP simply skips the bound; it resolves to the OpenMP runtime torch
// itself loaded.
extern "C" void omp_set_num_threads(int) __attribute__((weak));

namespace torch_stage {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kNoCutoff = std::numeric_limits<int64_t>::max();

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

} // namespace

std::string StageWork::explain(const std::exception_ptr& error) const {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

namespace {

// Whether an error item ends its stage (see ItemError::ends_stage).
bool ends_stage(const StageItem& item) {
  return !item.error || item.error->ends_stage;
}

// The calling thread's CPU time; 0 where the clock is missing (the tuner
// then treats inline production as unmeasured).
int64_t thread_cpu_ns() {
#if defined(CLOCK_THREAD_CPUTIME_ID)
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) {
    return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
  }
#endif
  return 0;
}

// ---------------------------------------------------------------------------
// Stage pools

constexpr const char* kDefaultPoolName = "torch_stage";

struct Pool {
  StagePoolConfig config;
  int64_t busy = 0; // guarded by pools_mu()
};

std::mutex& pools_mu() {
  static std::mutex mu;
  return mu;
}
std::condition_variable& pools_cv() {
  static std::condition_variable cv;
  return cv;
}
// Guarded by pools_mu(). Index 0 is the default pool.
std::vector<Pool>& pools() {
  static std::vector<Pool> all{Pool{StagePoolConfig{0, 1, kDefaultPoolName}}};
  return all;
}

} // namespace

int64_t StagePools::add(
    int64_t inter_op_threads,
    int64_t intra_op_threads,
    const std::string& global_name) {
  TORCH_CHECK_VALUE(
      inter_op_threads >= 1,
      "inter_op_threads must be >= 1, got ",
      inter_op_threads);
  TORCH_CHECK_VALUE(
      intra_op_threads >= 1,
      "intra_op_threads must be >= 1, got ",
      intra_op_threads);
  TORCH_CHECK_VALUE(
      !global_name.empty(), "global_name must be a non-empty string");
  std::lock_guard<std::mutex> lock(pools_mu());
  for (const auto& p : pools()) {
    TORCH_CHECK_VALUE(
        p.config.global_name != global_name,
        "a stage thread pool named '",
        global_name,
        "' already exists");
  }
  pools().push_back(
      Pool{StagePoolConfig{inter_op_threads, intra_op_threads, global_name}});
  return static_cast<int64_t>(pools().size()) - 1;
}

int64_t StagePools::count() {
  std::lock_guard<std::mutex> lock(pools_mu());
  return static_cast<int64_t>(pools().size());
}

StagePoolConfig StagePools::config(int64_t id) {
  std::lock_guard<std::mutex> lock(pools_mu());
  TORCH_CHECK_VALUE(
      id >= 0 && id < static_cast<int64_t>(pools().size()),
      "stage_subgraph_thread_pool_id ",
      id,
      " is unknown: ",
      pools().size() - 1,
      " pool(s) were added with add_stage_thread_pool (ids 1..",
      pools().size() - 1,
      "; 0 is the default pool)");
  return pools()[id].config;
}

StagePools::Slot StagePools::acquire(
    int64_t id,
    const std::function<bool()>& stop) {
  std::unique_lock<std::mutex> lock(pools_mu());
  Pool& pool = pools().at(id);
  // Waits are also woken by wake_all() when a stop condition changes; the
  // timed wait is a backstop for conditions changed without a wake-up.
  while (!stop()) {
    if (pool.config.inter_op_threads == 0 ||
        pool.busy < pool.config.inter_op_threads) {
      ++pool.busy;
      return Slot(id);
    }
    pools_cv().wait_for(lock, std::chrono::milliseconds(100));
  }
  return Slot();
}

void StagePools::wake_all() {
  std::lock_guard<std::mutex> lock(pools_mu());
  pools_cv().notify_all();
}

StagePools::Slot& StagePools::Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = other.pool_;
    other.pool_ = -1;
  }
  return *this;
}

StagePools::Slot::~Slot() {
  release();
}

void StagePools::Slot::release() {
  if (pool_ < 0) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(pools_mu());
    --pools()[pool_].busy;
  }
  pools_cv().notify_all();
  pool_ = -1;
}

namespace {

// The pool slot the calling producer thread holds for the item it is
// making, so that a wait for another stage's item inside that work (a
// source or transform reading a stage) gives it back meanwhile: that
// stage's producers may need the slot to make the item (stages of one pool
// chained, with fewer slots than waiting readers, deadlocked).
thread_local StagePools::Slot* held_slot = nullptr;

// Registers `slot` as the calling thread's for its lifetime.
class HoldingSlot {
 public:
  explicit HoldingSlot(StagePools::Slot* slot) : previous_(held_slot) {
    held_slot = slot;
  }
  ~HoldingSlot() {
    held_slot = previous_;
  }
  HoldingSlot(const HoldingSlot&) = delete;
  HoldingSlot& operator=(const HoldingSlot&) = delete;

 private:
  StagePools::Slot* previous_;
};

// Gives the calling thread's slot (if it holds one) back: it is about to
// wait for another stage's item. The producer takes one again when its
// read or transform returns (step()), never here: a consumer's first,
// quick attempt runs with the GIL held, and waiting for a slot there would
// keep the GIL from the producer that has it.
void give_back_slot() {
  if (held_slot != nullptr && *held_slot) {
    held_slot->release();
  }
}

} // namespace

// ---------------------------------------------------------------------------
// Stage state

namespace {

enum class Phase : int {
  kNotStarted,
  kStarting,
  kWaitingForPool,
  kPulling,
  kProcessing,
  kCopying,
  kWaitingForTurn,
  kWaitingForSpace,
  kParked,
  kExited,
};

const char* phase_text(Phase p) {
  switch (p) {
    case Phase::kNotStarted:
      return "not started (it starts with the stage, or when auto-tuning "
             "first lets it work)";
    case Phase::kStarting:
      return "starting";
    case Phase::kWaitingForPool:
      return "waiting for a slot of its stage thread pool";
    case Phase::kPulling:
      return "pulling from the source";
    case Phase::kProcessing:
      return "running the stage work (transform)";
    case Phase::kCopying:
      return "copying to the device";
    case Phase::kWaitingForTurn:
      return "waiting for earlier items (ordered delivery)";
    case Phase::kWaitingForSpace:
      return "waiting for space in the buffer (consumers are slower)";
    case Phase::kParked:
      // Not "measured as no faster": the tuner starts below num_threads
      // and adds a thread only after measuring, so before any measurement
      // the spare threads are parked too.
      return "parked by auto-tuning (its current setting uses fewer threads)";
    case Phase::kExited:
      return "exited";
  }
  return "unknown";
}

struct ProducerStatus {
  std::atomic<int> phase{static_cast<int>(Phase::kNotStarted)};
  std::atomic<int64_t> index{-1};
  std::atomic<int64_t> since_ns{0};
  std::atomic<bool> exited{false};

  void set(Phase p, int64_t item = -1) {
    index.store(item, std::memory_order_relaxed);
    since_ns.store(now_ns(), std::memory_order_relaxed);
    phase.store(static_cast<int>(p), std::memory_order_release);
  }
};

void bound_intra_op_threads(int64_t threads) {
  // Initialise this thread's intra-op settings first, so torch's lazy
  // per-thread initialisation does not later override the bound.
  (void)at::get_num_threads();
  if (omp_set_num_threads != nullptr) {
    omp_set_num_threads(static_cast<int>(threads));
  }
}

// Linux keeps 15 characters of a thread's name (what top -H, py-spy and gdb
// show): "torch_stage:augment_images:1" would be "torch_stage:aug" for every
// stage and producer alike. So a name that does not fit keeps the producer's
// id whole and as much of the stage's name as fits, after a short pool name
// ("ts" for the default pool). The full name still goes to torch_stage.trace.
std::string kernel_thread_name(
    const std::string& pool,
    const std::string& stage,
    int64_t id) {
  constexpr size_t kMax = 15;
  const std::string tail = ":" + std::to_string(id);
  std::string name = pool + ":" + stage + tail;
  if (name.size() <= kMax) {
    return name;
  }
  const std::string head =
      (pool == kDefaultPoolName ? std::string("ts") : pool.substr(0, 4)) + ":";
  const size_t room = kMax - std::min(kMax, head.size() + tail.size());
  return (head + stage.substr(0, room) + tail).substr(0, kMax);
}

void name_thread(const std::string& kernel_name, const std::string& name) {
  pthread_setname_np(pthread_self(), kernel_name.c_str());
  trace::set_thread_name(name);
}

} // namespace

struct Stage::State : std::enable_shared_from_this<State> {
  State(StageOptions o, std::shared_ptr<StageWork> w)
      : options(std::move(o)),
        work(std::move(w)),
        pool(StagePools::config(options.pool_id)),
        buffer(static_cast<size_t>(options.capacity)),
        statuses(static_cast<size_t>(options.num_threads)) {
    if (options.device.has_value()) {
      stager =
          std::make_unique<DeviceStager>(*options.device, options.stream_id);
    }
    if (options.auto_tune) {
      TunerLimits limits;
      limits.min_threads = options.min_threads;
      limits.max_threads = options.num_threads;
      limits.min_capacity = options.capacity;
      limits.max_capacity = options.max_capacity;
      limits.window_items = options.tune_window_items;
      limits.window_ns = options.tune_window_ns;
      limits.explore_share = options.tune_explore_share;
      limits.waiting_cpu_share = options.tune_waiting_cpu_share;
      if (options.tuning_memory) {
        tuner.emplace(limits, *options.tuning_memory);
        buffer.set_capacity(static_cast<size_t>(tuner->setting().capacity));
      } else {
        tuner.emplace(
            limits, TunerSetting{options.initial_threads, options.capacity});
      }
      active.store(tuner->setting().threads);
    } else {
      active.store(options.num_threads);
    }
    const std::string prefix = "torch_stage/" + options.name;
    range_pull = trace::intern(prefix + "/pull");
    range_process = trace::intern(prefix + "/process");
    range_copy = trace::intern(prefix + "/copy_to_device");
    range_put = trace::intern(prefix + "/put");
    range_take = trace::intern(prefix + "/take");
    counter_occupancy = trace::intern(prefix + "/occupancy");
    trace_info = trace::intern(prefix);
  }

  const StageOptions options;
  const std::shared_ptr<StageWork> work;
  const StagePoolConfig pool;
  std::unique_ptr<DeviceStager> stager;
  BoundedBuffer<StageItem> buffer;
  // Interned names of the stage's RecordFunction ranges and trace records
  // (trace/trace_recorder.h).
  int32_t range_pull, range_process, range_copy, range_put, range_take,
      counter_occupancy, trace_info;

  // Lifecycle, guarded by life_mu. Producers 0..spawned-1 were started
  // (threads holds them until close() takes them to join), under the
  // thread-local state of the thread that started the stage.
  std::mutex life_mu;
  bool started = false;
  bool closed = false;
  std::vector<std::thread> threads;
  int64_t spawned = 0;
  std::shared_ptr<at::ThreadLocalState> starter;
  std::atomic<bool> stop{false};

  // The source, guarded by source_mu.
  std::mutex source_mu;
  int64_t next_index = 0;
  bool source_done = false;
  std::atomic<bool> source_done_flag{false}; // mirrors source_done, lock-free
  // Positions after the cutoff (end or error) are never delivered.
  std::atomic<int64_t> cutoff{kNoCutoff};
  // A consumer making an item outside the stage (begin_own_item), and what
  // the tuner is told of such items; producers wait on source_cv until it
  // ends. Guarded by source_mu.
  bool consumer_owns = false;
  std::condition_variable source_cv;
  int64_t own_start_ns = 0;
  int64_t own_cpu_start_ns = -1; // -1: this item's CPU time is not read
  int64_t own_items = 0;
  int64_t own_unread_ns = 0; // wall time of own items since the last read

  // Delivery order, guarded by turn_mu.
  std::mutex turn_mu;
  std::condition_variable turn_cv;
  int64_t turn = 0;
  bool error_put = false; // once the error item is out, nothing follows

  // Consumers inside take, guarded by clients_mu.
  std::mutex clients_mu;
  std::condition_variable clients_cv;
  int64_t takers = 0;

  // Producer exits, guarded by exit_mu: `live` counts the producers
  // started and not yet exited.
  std::mutex exit_mu;
  std::condition_variable exit_cv;
  int64_t live = 0;

  std::vector<ProducerStatus> statuses;
  ProducerStatus consumer_status; // a consumer producing an item itself

  // Auto-tuning. `active` producers may work (the rest park on gate_cv,
  // under gate_mu); tune_mu guards the tuner, which consumers feed.
  std::atomic<int64_t> active{0};
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  std::mutex tune_mu;
  std::optional<AutoTuner> tuner;
  bool budget_applied = false; // guarded by tune_mu
  // Positions claimed and not yet delivered (or dropped); changes under
  // source_mu when it grows, so a consumer that sees 0 there with an empty
  // buffer knows no earlier item can still arrive.
  std::atomic<int64_t> in_flight{0};
  std::atomic<int64_t> inline_items{0}, inline_ns{0};
  // The consumers' thread CPU time while producing inline (for the tuner:
  // production that mostly waits is overlapped by a thread for free).
  std::atomic<int64_t> inline_cpu_ns{0};
  // The part of inline_ns spent in the transform and the copy (for the
  // tuner: producers run those side by side, the source one at a time).
  std::atomic<int64_t> inline_parallel_ns{0};
  // When consumers began their first take and ended their last (-1: not
  // yet).
  std::atomic<int64_t> first_take_ns{-1}, last_take_ns{-1};
  std::atomic<bool> end_taken{false}; // a consumer found the end

  std::mutex warn_mu;
  WarnFn warn; // guarded by warn_mu

  std::atomic<int64_t> produced{0}, consumed{0}, skipped{0}, dropped{0},
      errors{0}, blocked_ns{0}, pull_ns{0}, process_ns{0}, copy_ns{0};
  std::atomic<bool> failed{false}, finished{false};

  void warning(const std::string& message) {
    WarnFn fn;
    {
      std::lock_guard<std::mutex> lock(warn_mu);
      fn = warn;
    }
    if (fn) {
      fn(message);
    } else {
      TORCH_WARN(message);
    }
  }

  void end_source(int64_t index) {
    // Requires source_mu held.
    source_done = true;
    source_done_flag.store(true);
    int64_t current = cutoff.load();
    while (index < current && !cutoff.compare_exchange_weak(current, index)) {
    }
    wake_parked();
  }

  void wake_parked() {
    {
      // Orders the flags' stores before a parked producer's predicate check.
      std::lock_guard<std::mutex> lock(gate_mu);
    }
    gate_cv.notify_all();
  }

  // Parks producer `id` while auto-tuning leaves it out. Returns false when
  // it must exit instead (closed, or the source is done).
  bool gate(int64_t id, ProducerStatus& status) {
    if (id < active.load()) {
      return true;
    }
    status.set(Phase::kParked);
    std::unique_lock<std::mutex> lock(gate_mu);
    gate_cv.wait(lock, [&] {
      return stop.load() || source_done_flag.load() || id < active.load();
    });
    return !stop.load() && !source_done_flag.load();
  }

  // A new setting: its capacity, its threads at work, and those it lets
  // work for the first time started. A thread the system refused then
  // bounds the tuner to the threads started. Returns what to say of such a
  // refusal (empty: none), for the caller to say (the warning callback)
  // once it has let go of tune_mu: the callback may wait for the GIL, which
  // a thread waiting for tune_mu may hold. Requires tune_mu held.
  [[nodiscard]] std::string apply(TunerSetting setting) {
    buffer.set_capacity(static_cast<size_t>(setting.capacity));
    {
      std::lock_guard<std::mutex> lock(gate_mu);
      active.store(setting.threads);
    }
    gate_cv.notify_all();
    std::string why;
    int64_t started_threads = 0;
    {
      std::lock_guard<std::mutex> lock(life_mu);
      why = spawn_up_to(setting.threads, /*at_start=*/false);
      if (why.empty()) {
        return {};
      }
      started_threads = spawned;
    }
    // The started threads are at least the first setting's, which the
    // tuner's minimum bounds: the bounded setting starts no thread.
    if (tuner->set_max_threads(started_threads, why) &&
        tuner->setting().threads <= started_threads) {
      (void)apply(tuner->setting()); // (it starts no thread)
    }
    return c10::str(
        "stage '",
        options.name,
        "': ",
        why,
        "; auto-tuning goes on with at most ",
        started_threads,
        " thread(s)");
  }

  // A consumer's loop runs from its first take's start (making the first
  // item is part of it) to its last take's end.
  void taking(int64_t start) {
    int64_t none = -1;
    if (first_take_ns.load() < 0) {
      first_take_ns.compare_exchange_strong(none, start);
    }
  }
  void took(int64_t now) {
    last_take_ns.store(now);
  }

  // After each item a consumer took: feed the tuner (one consumer at a
  // time; the others skip, their items count in the next sample).
  void tune() {
    if (!tuner) {
      return;
    }
    std::unique_lock<std::mutex> lock(tune_mu, std::try_to_lock);
    if (!lock.owns_lock()) {
      return;
    }
    const int64_t now = now_ns();
    const int64_t items = consumed.load();
    if (!tuner->due(now, items)) {
      return;
    }
    bool changed = false;
    if (!budget_applied && options.memory_budget_bytes > 0) {
      int64_t bytes = work->item_bytes();
      if (bytes < 0 && stager) {
        const DeviceStagerStats d = stager->stats();
        bytes = d.items > 0 ? d.bytes / d.items : -1;
      }
      if (bytes >= 0) {
        budget_applied = true;
        const int64_t fit =
            options.memory_budget_bytes / std::max<int64_t>(bytes, 1);
        if (fit < tuner->limits().max_capacity) {
          changed = tuner->set_max_capacity(fit);
        }
      }
    }
    const BufferStats b = buffer.stats();
    TunerSample sample;
    sample.now_ns = now;
    sample.items = items;
    sample.inline_ns = inline_ns.load();
    sample.inline_cpu_ns = inline_cpu_ns.load();
    sample.inline_parallel_ns = inline_parallel_ns.load();
    sample.wait_ns = b.consumer_wait_ns + sample.inline_ns;
    sample.blocked_ns = b.producer_blocked_ns;
    changed = tuner->observe(sample) || changed;
    const std::string refusal = changed ? apply(tuner->setting()) : "";
    lock.unlock();
    if (!refusal.empty()) {
      warning(refusal);
    }
  }

  // Whether no producer may work: consumers make items themselves.
  bool consumers_produce() const {
    return tuner && active.load() == 0;
  }

  // A consumer with nothing buffered and no producer allowed to work makes
  // items itself until one is buffered (a skipped position buffers nothing)
  // or the source ends. It makes none while an earlier position is still
  // with a producer (parked since, it finishes that item first): the
  // consumer's take then waits for it in short slices and comes back here.
  void produce_inline() {
    if (!consumers_produce()) {
      return;
    }
    const int64_t start = now_ns();
    const int64_t cpu_start = thread_cpu_ns();
    // With no producer at work, the transform and copy times that grow
    // meanwhile are this consumer's (what threads could run side by side).
    const int64_t parallel_start = process_ns.load() + copy_ns.load();
    while (consumers_produce() && !source_done_flag.load() && !stop.load() &&
           buffer.size() == 0) {
      // Items only: the end of the source and skipped positions are steps
      // too.
      bool made = false;
      const bool more = step(consumer_status, /*consumer=*/true, &made);
      inline_items += made ? 1 : 0;
      if (!more) {
        break;
      }
    }
    inline_cpu_ns += thread_cpu_ns() - cpu_start;
    inline_parallel_ns += process_ns.load() + copy_ns.load() - parallel_start;
    inline_ns += now_ns() - start;
    consumer_status.set(Phase::kExited);
  }

  // Runs a StageWork step; C++ exceptions become error items.
  template <typename Fn>
  Outcome guarded(StageItem& item, const char* step, Fn fn) {
    std::string why;
    try {
      return fn();
    } catch (const c10::Error& e) {
      why = e.what_without_backtrace(); // the C++ backtrace is noise here
    } catch (const std::exception&) {
      why = work->explain(std::current_exception());
    }
    item.error = std::make_shared<ItemError>(ItemError{
        c10::str(
            "stage '",
            options.name,
            "' item ",
            item.index,
            " (",
            step,
            "): ",
            why),
        nullptr});
    return Outcome::kError;
  }

  static Outcome timed(
      std::atomic<int64_t>& total,
      trace::Kind kind,
      int32_t range,
      int64_t index,
      const std::function<Outcome()>& fn) {
    trace::Span span(kind, range, index);
    const int64_t start = now_ns();
    const Outcome o = fn();
    total += now_ns() - start;
    span.set_outcome(static_cast<int64_t>(o));
    return o;
  }

  std::string thread_name(int64_t id) const {
    return c10::str(pool.global_name, ":", options.name, ":", id);
  }
  std::string kernel_name(int64_t id) const {
    return kernel_thread_name(pool.global_name, options.name, id);
  }

  void produce(int64_t id, const at::ThreadLocalState& starter) {
    // Producers run under the starting thread's thread-local state, as
    // at::launch does for inter-op work: a profiler active there records
    // the stage's ranges, and grad mode matches the consumer's.
    at::ThreadLocalStateGuard tls(starter);
    ProducerStatus& status = statuses[id];
    name_thread(kernel_name(id), thread_name(id));
    bound_intra_op_threads(pool.intra_op_threads);
    while (!stop.load()) {
      if (!gate(id, status) || !step(status, /*consumer=*/false)) {
        break;
      }
    }
    status.set(Phase::kExited);
    producer_exited(status);
  }

  // One item from the source to the buffer. A producer loops on it (false:
  // exit); a consumer (`consumer`) runs it once, outside the stage thread
  // pool, and only when no earlier position is still on its way (true: it
  // delivered a position). `made`: whether that position was an item (not
  // the end, a skip or an error).
  bool step(ProducerStatus& status, bool consumer, bool* made = nullptr) {
    StagePools::Slot slot;
    const std::function<bool()> stopping = [this] {
      return stop.load() || source_done_flag.load();
    };
    std::optional<HoldingSlot> holding;
    StageItem item;
    Outcome outcome = Outcome::kItem;
    // The read or the transform may have given the slot back while it
    // waited for another stage's item (give_back_slot): work goes on with
    // one again (or without, when the stage is stopping: the item is then
    // dropped on delivery).
    auto hold_slot_again = [&] {
      if (!consumer && !slot) {
        status.set(Phase::kWaitingForPool, item.index);
        slot = StagePools::acquire(options.pool_id, stopping);
      }
    };
    {
      std::unique_lock<std::mutex> lock(source_mu);
      while (!consumer && consumer_owns && !stop.load()) {
        // In slices: close() does not take source_mu to notify.
        source_cv.wait_for(lock, std::chrono::milliseconds(10));
      }
      if (source_done || stop.load()) {
        return false;
      }
      if (consumer &&
          (in_flight.load() != 0 || buffer.size() != 0 || consumer_owns)) {
        return false;
      }
      // The slot is taken once this producer's turn to read has come: one
      // waiting for the source lock holds none, since the reader ahead of
      // it may be waiting for another stage of the pool (whose producers
      // need a slot) to give it an item.
      if (!consumer) {
        status.set(Phase::kWaitingForPool);
        slot = StagePools::acquire(options.pool_id, stopping);
        if (!slot) {
          return false;
        }
        holding.emplace(&slot);
      }
      item.index = next_index++;
      ++in_flight;
      status.set(Phase::kPulling, item.index);
      outcome = timed(pull_ns, trace::Kind::kPull, range_pull, item.index, [&] {
        return guarded(
            item, "source", [&] { return work->pull(item.index, item); });
      });
      if (outcome == Outcome::kEnd || outcome == Outcome::kError) {
        end_source(item.index);
      }
    }
    if (outcome == Outcome::kItem) {
      hold_slot_again();
      status.set(Phase::kProcessing, item.index);
      outcome = timed(
          process_ns, trace::Kind::kProcess, range_process, item.index, [&] {
            return guarded(
                item, "transform", [&] { return work->process(item); });
          });
    }
    if (outcome == Outcome::kItem && stager) {
      hold_slot_again();
      status.set(Phase::kCopying, item.index);
      outcome = timed(copy_ns, trace::Kind::kCopy, range_copy, item.index, [&] {
        return guarded(item, "copy to device", [&] {
          const Outcome o = work->expose_tensors(item);
          if (o == Outcome::kItem) {
            stager->stage(item, active.load());
          }
          return o;
        });
      });
      if (outcome == Outcome::kError && options.item_errors) {
        item.error = std::make_shared<ItemError>(
            ItemError{item.error->message, item.error->detail, false});
      }
    }
    if (outcome == Outcome::kEnd ||
        (outcome == Outcome::kError && ends_stage(item))) {
      std::lock_guard<std::mutex> lock(source_mu);
      end_source(item.index);
    }
    slot.release(); // a consumer's is empty: a no-op
    const bool delivered = deliver(status, std::move(item), outcome);
    if (made != nullptr) {
      *made = delivered && outcome == Outcome::kItem;
    }
    --in_flight;
    if (consumer) {
      end_stream_if_done();
    }
    return delivered;
  }

  // Hands a finished position to consumers, in turn when ordered. Returns
  // false when the stage is stopping.
  bool deliver(ProducerStatus& status, StageItem item, Outcome outcome) {
    const int64_t index = item.index;
    trace::Span span(trace::Kind::kPut, range_put, index);
    span.set_outcome(static_cast<int64_t>(outcome));
    if (options.ordered) {
      status.set(Phase::kWaitingForTurn, index);
      const int64_t start = now_ns();
      std::unique_lock<std::mutex> lock(turn_mu);
      turn_cv.wait(lock, [&] { return stop.load() || turn == index; });
      blocked_ns += now_ns() - start;
      if (stop.load()) {
        return false;
      }
    }
    bool keep_going = put(status, std::move(item), outcome, index);
    if (options.ordered) {
      {
        std::lock_guard<std::mutex> lock(turn_mu);
        ++turn;
      }
      turn_cv.notify_all();
    }
    return keep_going;
  }

  bool put(
      ProducerStatus& status,
      StageItem item,
      Outcome outcome,
      int64_t index) {
    {
      std::lock_guard<std::mutex> lock(turn_mu);
      if (error_put || index > cutoff.load()) {
        return true; // after the end or a failure: not delivered
      }
      if (outcome == Outcome::kError && ends_stage(item)) {
        error_put = true;
      }
    }
    switch (outcome) {
      case Outcome::kEnd:
        return true;
      case Outcome::kSkip:
        ++skipped;
        return true;
      case Outcome::kError:
        ++errors;
        if (ends_stage(item)) {
          failed.store(true);
        }
        break;
      case Outcome::kItem:
        break;
    }
    status.set(Phase::kWaitingForSpace, index);
    BufferStatus put_status;
    if (options.put_timeout_ms.has_value() && outcome == Outcome::kItem) {
      put_status = buffer.try_put_for(
          item, std::chrono::milliseconds(*options.put_timeout_ms));
      if (put_status == BufferStatus::kTimeout) {
        ++dropped;
        warning(c10::str(
            "stage '",
            options.name,
            "' dropped item ",
            index,
            " after waiting ",
            *options.put_timeout_ms,
            " ms for space (put_timeout_millis is set); ",
            dropped.load(),
            " item(s) dropped so far"));
        return true;
      }
    } else {
      put_status = buffer.put(item);
    }
    if (put_status != BufferStatus::kOk) {
      return false; // cancelled by close()
    }
    if (outcome == Outcome::kItem) {
      ++produced;
    }
    trace::sample(counter_occupancy, static_cast<int64_t>(buffer.size()));
    return true;
  }

  void producer_exited(ProducerStatus& status) {
    status.exited.store(true);
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(exit_mu);
      last = --live == 0;
    }
    if (last) {
      // Before the end is visible: a consumer that saw the end of the
      // stream reads stats() with `finished` set.
      finished.store(true);
      end_stream_if_done();
    }
    exit_cv.notify_all();
  }

  // The last one out ends the stream: what is buffered drains, then
  // consumers see the end (as DeepRec's last runner closes). The last one
  // is the last producer to exit or, when a consumer was still delivering
  // an item it made itself (auto-tuning's no-thread setting), that
  // consumer: it may hold the error that ended the source, which must not
  // find the buffer closed. Both check under exit_mu after their own
  // change (live, in_flight), so one of them sees the other's. Not when
  // close() stopped the stage: consumers must see "closed", which the
  // cancel that close() issues right after setting `stop` reports.
  // (With no producer started, live is 0 from the start: only the end of
  // the source makes it the end of the stream.)
  void end_stream_if_done() {
    std::lock_guard<std::mutex> lock(exit_mu);
    if (live == 0 && in_flight.load() == 0 && source_done_flag.load() &&
        !stop.load()) {
      finished.store(true);
      buffer.close();
    }
  }

  void start() {
    std::lock_guard<std::mutex> lock(life_mu);
    if (started || closed) {
      return;
    }
    started = true;
    if (trace::enabled()) {
      trace::Record r;
      r.start_ns = r.end_ns = trace::now_ns();
      r.name = trace_info;
      r.kind = trace::Kind::kStageInfo;
      r.a = options.capacity;
      r.b = options.num_threads;
      trace::record(r);
    }
    starter = std::make_shared<at::ThreadLocalState>();
    spawn_up_to(active.load(), /*at_start=*/true);
  }

  // Starts producers up to `count` (of num_threads): all of them at start()
  // without auto-tuning; with it, those its setting lets work, the rest
  // when a later setting first does. A thread that would only park costs
  // its start (some 50 us) and a core's worth of wake-ups at the start of
  // every epoch of a loop the tuner keeps on the consumer's thread.
  // The system refusing one is an error `at_start`; later, what it says is
  // returned (empty: all started). Requires life_mu held.
  std::string spawn_up_to(int64_t count, bool at_start) {
    // After the source's end a producer would only exit.
    if (!started || closed || stop.load() || source_done_flag.load()) {
      return {};
    }
    count = std::min(count, options.num_threads);
    auto self = shared_from_this();
    while (spawned < count) {
      const int64_t i = spawned;
      statuses[i].set(Phase::kStarting);
      {
        // Counted before it runs: it may exit at once (the source ended).
        std::lock_guard<std::mutex> lock(exit_mu);
        ++live;
      }
      try {
        if (options.refuse_threads_from >= 0 &&
            i >= options.refuse_threads_from) {
          throw std::system_error(
              std::make_error_code(std::errc::resource_unavailable_try_again),
              "refused by StageOptions::refuse_threads_from");
        }
        // Each thread owns a reference: a producer stuck in user code past
        // close() keeps the state it uses alive.
        threads.emplace_back(
            [self, starter = starter, i] { self->produce(i, *starter); });
      } catch (const std::system_error& e) {
        if (at_start) {
          refuse_start(i, e);
        }
        // A later setting's thread: the items taken so far are the
        // consumers', and the threads started go on.
        {
          std::lock_guard<std::mutex> lock(exit_mu);
          --live;
        }
        statuses[i].set(Phase::kNotStarted);
        return c10::str(
            "the system refused producer thread ", i, " (", e.what(), ")");
      }
      ++spawned;
      // Named here too, so that the threads are visible under their names
      // once start() returns (a parked producer may not run for a while).
      pthread_setname_np(
          threads.back().native_handle(), kernel_name(i).c_str());
    }
    return {};
  }

  // The system refused producer `first` (and so the rest): the stage is
  // unusable, say so, and leave close() only the threads that exist to join
  // (otherwise it waited join_timeout for producers that never ran).
  // Requires life_mu held.
  [[noreturn]] void refuse_start(int64_t first, const std::system_error& e) {
    for (auto i = static_cast<size_t>(first); i < statuses.size(); ++i) {
      statuses[i].set(Phase::kExited);
      statuses[i].exited.store(true);
    }
    stop.store(true);
    {
      std::lock_guard<std::mutex> lock(exit_mu);
      --live; // producer `first`, counted before its start
      if (live == 0) {
        finished.store(true);
      }
    }
    exit_cv.notify_all();
    buffer.cancel(); // takers see the stage cancelled, never a long wait
    TORCH_CHECK(
        false,
        "stage '",
        options.name,
        "': the system refused to start producer thread ",
        first,
        " of num_threads=",
        options.num_threads,
        " (",
        e.what(),
        "); use fewer threads");
  }

  void close(std::chrono::milliseconds join_timeout, bool warn_if_left) {
    std::vector<std::thread> to_join;
    {
      std::lock_guard<std::mutex> lock(life_mu);
      if (closed) {
        return;
      }
      closed = true;
      to_join.swap(threads);
    }
    stop.store(true);
    {
      // Taking the lock orders the store before any waiter's predicate
      // check, so no producer misses the wake-up.
      std::lock_guard<std::mutex> lock(turn_mu);
    }
    turn_cv.notify_all();
    // Not under source_mu, which a producer holds while it pulls (user code
    // that may take long): the waiters look at `stop` in slices.
    source_cv.notify_all();
    wake_parked();
    StagePools::wake_all();
    buffer.cancel();
    // close() from one of this stage's own producers (its source or
    // transform): that thread cannot be joined from itself, and it leaves
    // when the call returns (stop is set), so only the others are waited for.
    const auto me = std::this_thread::get_id();
    const auto self =
        std::find_if(to_join.begin(), to_join.end(), [&](const std::thread& t) {
          return t.get_id() == me;
        });
    const int64_t own = self == to_join.end() ? 0 : 1;
    {
      std::unique_lock<std::mutex> lock(exit_mu);
      exit_cv.wait_for(lock, join_timeout, [&] { return live <= own; });
    }
    std::vector<int64_t> stuck;
    for (size_t i = 0; i < to_join.size(); ++i) {
      if (to_join[i].get_id() == me) {
        to_join[i].detach();
      } else if (statuses[i].exited.load()) {
        to_join[i].join();
      } else {
        stuck.push_back(static_cast<int64_t>(i));
        to_join[i].detach();
      }
    }
    if (!stuck.empty() && warn_if_left) {
      warning(c10::str(
          "stage '",
          options.name,
          "' closed, but ",
          stuck.size(),
          " producer thread(s) are still inside user code after ",
          join_timeout.count(),
          " ms (",
          describe(),
          "); they exit when that call returns"));
    }
  }

  std::string describe() const {
    std::ostringstream out;
    const int64_t now = now_ns();
    auto write = [&](const ProducerStatus& s) {
      const auto phase = static_cast<Phase>(s.phase.load());
      out << phase_text(phase);
      if (s.index.load() >= 0) {
        out << " (item " << s.index.load() << ")";
      }
      if (phase != Phase::kExited && s.since_ns.load() > 0) {
        out << " for " << c10::str((now - s.since_ns.load()) / 1000000)
            << " ms";
      }
    };
    for (size_t i = 0; i < statuses.size(); ++i) {
      out << (i == 0 ? "" : "; ") << "producer " << i << ": ";
      write(statuses[i]);
    }
    const auto phase = static_cast<Phase>(consumer_status.phase.load());
    if (phase == Phase::kPulling || phase == Phase::kProcessing ||
        phase == Phase::kCopying) {
      out << "; a consumer producing the next item itself: ";
      write(consumer_status);
    }
    return out.str();
  }
};

// ---------------------------------------------------------------------------
// Stage

namespace {

// Each producer holds an item it is making and a stack: far above the cores
// of any machine or the requests a source keeps in flight. A larger count is
// a typo, and 2**16 started some 32k threads before the kernel refused.
// (torch_stage/_checks.py's MAX_STAGE_THREADS.)
constexpr int64_t kMaxStageThreads = 1024;

StageOptions checked(StageOptions o) {
  TORCH_CHECK_VALUE(o.capacity >= 1, "capacity must be >= 1, got ", o.capacity);
  TORCH_CHECK_VALUE(
      o.num_threads >= 1 && o.num_threads <= kMaxStageThreads,
      "num_threads must be in [1, ",
      kMaxStageThreads,
      "], got ",
      o.num_threads);
  TORCH_CHECK_VALUE(
      o.num_clients >= 1, "num_clients must be >= 1, got ", o.num_clients);
  if (o.auto_tune) {
    TORCH_CHECK_VALUE(
        o.min_threads >= 0 && o.min_threads <= o.num_threads,
        "min_threads must be in [0, num_threads=",
        o.num_threads,
        "], got ",
        o.min_threads);
    TORCH_CHECK_VALUE(
        o.initial_threads >= o.min_threads &&
            o.initial_threads <= o.num_threads,
        "initial_threads must be in [min_threads=",
        o.min_threads,
        ", num_threads=",
        o.num_threads,
        "], got ",
        o.initial_threads);
    TORCH_CHECK_VALUE(
        o.max_capacity >= o.capacity,
        "max_capacity must be >= capacity=",
        o.capacity,
        ", got ",
        o.max_capacity);
    TORCH_CHECK_VALUE(
        o.tune_window_items >= 1 && o.tune_window_ns >= 0,
        "the tuning window needs >= 1 item and >= 0 ns, got ",
        o.tune_window_items,
        " and ",
        o.tune_window_ns);
    TORCH_CHECK_VALUE(
        o.memory_budget_bytes >= 0,
        "memory_budget_bytes must be >= 0, got ",
        o.memory_budget_bytes);
  }
  TORCH_CHECK_VALUE(
      o.timeout_ms >= 1, "timeout_millis must be >= 1, got ", o.timeout_ms);
  TORCH_CHECK_VALUE(
      !o.put_timeout_ms.has_value() || *o.put_timeout_ms >= 1,
      "put_timeout_millis must be >= 1 (or None), got ",
      o.put_timeout_ms.value_or(0));
  (void)StagePools::config(o.pool_id); // checks the id
  if (!o.device.has_value()) {
    TORCH_CHECK_VALUE(
        o.stream_id >= 0 && o.stream_id < kMaxStreams,
        "stage_subgraph_stream_id must be in [0, ",
        kMaxStreams,
        ") (0 is the consumer's current stream), got ",
        o.stream_id);
  }
  return o;
}

} // namespace

Stage::Stage(StageOptions options, std::shared_ptr<StageWork> work) {
  TORCH_CHECK_VALUE(work != nullptr, "a stage needs work to run");
  state_ =
      std::make_shared<State>(checked(std::move(options)), std::move(work));
}

Stage::~Stage() {
  close();
}

void Stage::start() {
  state_->start();
}

void Stage::prime() {
  State& st = *state_;
  st.start();
  // No producer at work: the caller makes the item, as a consumer would
  // in take() (nothing while one is buffered or on its way).
  st.produce_inline();
}

TakeStatus Stage::take(StageItem& out) {
  trace::Span span(trace::Kind::kTake, state_->range_take);
  const TakeStatus status =
      take_for(out, std::chrono::milliseconds(state_->options.timeout_ms));
  span.set_item(out.index);
  span.set_outcome(take_outcome(status, out));
  return status;
}

int32_t Stage::take_span_name() const {
  return state_->range_take;
}

TakeStatus Stage::take_for(
    StageItem& out,
    std::chrono::milliseconds timeout,
    bool may_produce) {
  State& st = *state_;
  st.start();
  if (st.first_take_ns.load() < 0) {
    st.taking(now_ns()); // (the clock is read once per stage)
  }
  const auto deadline = deadline_after(timeout);
  // A producer of another stage reading this one waits without its slot.
  give_back_slot();
  {
    std::unique_lock<std::mutex> lock(st.clients_mu);
    if (!st.clients_cv.wait_until(lock, deadline, [&] {
          return st.takers < st.options.num_clients;
        })) {
      return TakeStatus::kTimeout;
    }
    ++st.takers;
  }
  BufferStatus status;
  while (true) {
    if (may_produce) {
      st.produce_inline();
    }
    auto until = deadline;
    if (may_produce && st.consumers_produce()) {
      // Nothing may arrive unless this consumer makes it: look again soon.
      until = std::min(until, Clock::now() + std::chrono::milliseconds(2));
    }
    status = st.buffer.try_take_until(out, until);
    if (status != BufferStatus::kTimeout || Clock::now() >= deadline) {
      break;
    }
  }
  {
    std::lock_guard<std::mutex> lock(st.clients_mu);
    --st.takers;
  }
  st.clients_cv.notify_one();
  switch (status) {
    case BufferStatus::kOk:
      break;
    case BufferStatus::kTimeout:
      return TakeStatus::kTimeout;
    case BufferStatus::kClosed:
      if (!st.end_taken.exchange(true)) {
        st.took(now_ns()); // finding the end is part of the loop
      }
      return TakeStatus::kEnd;
    case BufferStatus::kCancelled:
    case BufferStatus::kTooLarge:
      return TakeStatus::kClosed;
  }
  trace::sample(st.counter_occupancy, static_cast<int64_t>(st.buffer.size()));
  if (!out.error) {
    DeviceStager::hand_over(out);
    ++st.consumed;
    st.took(now_ns());
    st.tune();
  }
  return TakeStatus::kItem;
}

// Own items' CPU time is read for the first item, and then for the item
// after those since the last read took kOwnCpuEveryNs of wall time; each
// read's share stands for the wall time since the last read, so the
// tuner's share of production on the CPU is an estimate over its window
// (at least 50 ms: some fifty reads). A read is a system call (~0.2 us
// alone, more between the ops of a loop): read for every item over 50 us,
// as before, each DataLoader batch of 16 or 64 small rows paid two.
constexpr int64_t kOwnCpuEveryNs = 1'000'000;

bool Stage::begin_own_item(int64_t* positions) {
  State& st = *state_;
  if (!st.consumers_produce() || st.stop.load()) {
    return false;
  }
  std::unique_lock<std::mutex> lock(st.source_mu, std::try_to_lock);
  if (!lock.owns_lock() || st.source_done || st.consumer_owns ||
      st.in_flight.load() != 0 || st.buffer.size() != 0 ||
      !st.consumers_produce() || st.stop.load()) {
    return false;
  }
  st.consumer_owns = true;
  if (positions != nullptr) {
    *positions = st.next_index;
  }
  st.own_cpu_start_ns = st.own_items == 0 || st.own_unread_ns >= kOwnCpuEveryNs
      ? thread_cpu_ns()
      : -1;
  st.own_start_ns = now_ns();
  return true;
}

void Stage::end_own_item(bool made) {
  State& st = *state_;
  int64_t ns = 0;
  int64_t cpu_ns = 0;
  int64_t now = 0;
  {
    std::lock_guard<std::mutex> lock(st.source_mu);
    if (!st.consumer_owns) {
      return;
    }
    st.consumer_owns = false;
    if (made) {
      now = now_ns();
      ns = now - st.own_start_ns;
      ++st.own_items;
      st.own_unread_ns += ns;
      if (st.own_cpu_start_ns >= 0) {
        const int64_t cpu = thread_cpu_ns();
        if (cpu > 0 && ns > 0) {
          const double share = std::min(
              1.0, static_cast<double>(cpu - st.own_cpu_start_ns) / ns);
          cpu_ns = static_cast<int64_t>(share * st.own_unread_ns);
          st.own_unread_ns = 0;
        }
      }
    }
  }
  st.source_cv.notify_all();
  if (!made) {
    return;
  }
  st.inline_cpu_ns += cpu_ns;
  st.inline_ns += ns;
  ++st.inline_items;
  ++st.produced;
  ++st.consumed;
  st.taking(now - ns);
  st.took(now);
  if (trace::enabled()) {
    trace::Record r;
    r.end_ns = trace::now_ns();
    r.start_ns = r.end_ns - ns;
    r.name = st.range_pull;
    r.kind = trace::Kind::kPull;
    trace::record(r);
  }
  st.tune();
}

void Stage::close() {
  state_->close(state_->options.join_timeout, true);
}

void Stage::close(std::chrono::milliseconds join_timeout, bool warn_if_left) {
  state_->close(join_timeout, warn_if_left);
}

bool Stage::started() const {
  std::lock_guard<std::mutex> lock(state_->life_mu);
  return state_->started;
}

bool Stage::closed() const {
  std::lock_guard<std::mutex> lock(state_->life_mu);
  return state_->closed;
}

bool Stage::quiescent() const {
  if (!closed()) {
    return false;
  }
  std::lock_guard<std::mutex> lock(state_->exit_mu);
  return state_->live == 0;
}

int64_t Stage::buffered() const {
  return static_cast<int64_t>(state_->buffer.size());
}

int64_t Stage::consumed() const {
  return state_->consumed.load();
}

bool Stage::failed() const {
  return state_->failed.load();
}

const std::string& Stage::name() const {
  return state_->options.name;
}

const StageOptions& Stage::options() const {
  return state_->options;
}

StageStats Stage::stats() const {
  const BufferStats b = state_->buffer.stats();
  StageStats s;
  s.produced = state_->produced.load();
  s.consumed = state_->consumed.load();
  s.skipped = state_->skipped.load();
  s.dropped = state_->dropped.load();
  s.discarded = static_cast<int64_t>(b.dropped);
  s.errors = state_->errors.load();
  s.consumer_wait_ns = b.consumer_wait_ns;
  s.producer_blocked_ns = b.producer_blocked_ns + state_->blocked_ns.load();
  s.pull_ns = state_->pull_ns.load();
  s.process_ns = state_->process_ns.load();
  s.copy_ns = state_->copy_ns.load();
  s.occupancy_sum = static_cast<int64_t>(b.occupancy_sum);
  s.max_occupancy = static_cast<int64_t>(b.max_size);
  s.capacity = static_cast<int64_t>(b.capacity);
  if (state_->stager) {
    const DeviceStagerStats d = state_->stager->stats();
    s.staged_items = d.items;
    s.fused_tensors = d.fused_tensors;
    s.staged_bytes = d.bytes;
    s.host_buffers = d.host_buffers_allocated;
    s.host_buffer_reuses = d.host_buffer_reuses;
    s.host_buffer_waits = d.host_buffer_waits;
    s.direct_copies = d.direct_copies;
  }
  s.threads = state_->active.load();
  s.inline_items = state_->inline_items.load();
  s.inline_ns = state_->inline_ns.load();
  const int64_t first = state_->first_take_ns.load();
  s.loop_ns = first < 0 ? 0 : state_->last_take_ns.load() - first;
  s.auto_tune = state_->options.auto_tune;
  if (state_->tuner) {
    std::lock_guard<std::mutex> lock(state_->tune_mu);
    s.tuning_windows = state_->tuner->windows();
    s.tuning_trials = state_->tuner->trials();
    s.tuning_trial_windows = state_->tuner->trial_windows();
    s.tuning_max_capacity = state_->tuner->limits().max_capacity;
  }
  s.started = started();
  s.finished = state_->finished.load();
  s.failed = state_->failed.load();
  return s;
}

std::string Stage::describe() const {
  return state_->describe();
}

std::vector<std::string> Stage::tuning_log() const {
  if (!state_->tuner) {
    return {};
  }
  std::lock_guard<std::mutex> lock(state_->tune_mu);
  const auto& log = state_->tuner->log();
  return {log.begin(), log.end()};
}

void Stage::limit_threads(int64_t max_threads, const std::string& why) {
  State& s = *state_;
  if (!s.tuner) {
    return;
  }
  std::lock_guard<std::mutex> lock(s.tune_mu);
  if (s.tuner->set_max_threads(max_threads, why)) {
    (void)s.apply(s.tuner->setting()); // (a lower bound starts no thread)
  }
}

std::optional<TunerMemory> Stage::tuning_memory() const {
  if (!state_->tuner) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(state_->tune_mu);
  return state_->tuner->memory();
}

std::string Stage::timeout_message(
    std::chrono::milliseconds waited,
    int64_t consumed_before) const {
  const StageStats s = stats();
  const std::string counts = c10::str(
      s.produced, " item(s) produced and ", s.consumed, " consumed so far; ");
  const int64_t to_others =
      consumed_before < 0 ? 0 : s.consumed - consumed_before;
  if (to_others > 0) {
    // Each item goes to one consumer: this one starved while others were
    // served, which no timeout on the source explains.
    return c10::str(
        "stage '",
        name(),
        "' gave this consumer no item for ",
        waited.count(),
        " ms (timeout_millis=",
        state_->options.timeout_ms,
        ") while it delivered ",
        to_others,
        " to other consumers; ",
        counts,
        describe(),
        ". Each item goes to one consumer: with more consumers than the "
        "producers keep busy, one may wait while the others take every item "
        "(fewer consumers, more num_threads, or a larger timeout_millis).");
  }
  return c10::str(
      "stage '",
      name(),
      "' delivered no item for ",
      waited.count(),
      " ms (timeout_millis=",
      state_->options.timeout_ms,
      "); ",
      counts,
      describe(),
      ". A slow source needs a larger timeout_millis; a source that never "
      "returns is a bug in the source.");
}

void Stage::set_warning_handler(WarnFn fn) {
  std::lock_guard<std::mutex> lock(state_->warn_mu);
  state_->warn = std::move(fn);
}

} // namespace torch_stage
