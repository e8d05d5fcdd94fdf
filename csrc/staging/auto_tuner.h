// AutoTuner: a stage's producer-thread count and buffer capacity, chosen at
// run time from what the consumer measures (torch_stage's AUTOTUNE).
//
// Plain C++17, no torch headers: tested under ThreadSanitizer and
// AddressSanitizer with the other pure units (tests/cpp/test_auto_tuner.cpp).
//
// What it optimises, and why that and not a model
// ------------------------------------------------
// The consumer's rate: items taken per second of the consumer's loop, which
// is the training step's throughput. tf.data's AUTOTUNE predicts that rate
// from a model of each stage's processing time; here it is measured, trial
// against baseline, because what decides it on a CPU is what no model of the
// pipeline sees: a producer thread and the training step share cores, the
// GIL and memory bandwidth, so one more thread can make the step slower
// (torch's OpenMP teams stall at barriers when a core is taken; a Python
// source holds the GIL the step needs between ops). Only a measurement says
// whether the extra thread paid.
//
// The search
// ----------
// Windows of at least `window_items` items and `window_ns` of time are
// measured one after the other. A window at the settled setting is a
// baseline; from it the tuner may try one move, for one window:
// * more threads, when the consumer waited for more than `wait_fraction` of
//   the window; from no thread (the consumer produced inline) also only
//   when the ideal gain of overlapping the two, (D + C) / max(D, C) with D
//   the production per item and C the rest of the step, is worth a trial,
//   or else two threads at once when making items side by side is:
//   (D + C) / max(S, D / 2, C), S the part of D read from the source, which
//   producers do one at a time (a loop that only gathers items from a slow
//   transform gains nothing from one thread, and twice from two);
// * more capacity, when the consumer waited while producers were also
//   blocked for space (bursty production: a deeper buffer absorbs it);
// * fewer threads, when the consumer did not wait (the thread may cost the
//   step more than it gives), or when it waited but more threads and
//   capacity were just refused (the producer thread may be what slows the
//   consumer: a Python source holding the GIL the step needs).
// A trial is kept when its rate beats the baseline by `gain_margin` (more
// threads or capacity) or stays within `loss_margin` of it (fewer threads:
// the cheaper setting wins ties), over two windows: one that passes is
// confirmed by a second, judged by the mean of both (a window's rate is
// noisy: on a shared machine one window in several is off by more than the
// margin, and a setting kept on such a window costs every window until it
// is tried away again); otherwise the setting goes back and that
// move waits four times as many windows as last time before it is tried again
// (up to `max_backoff`), so a rejected move costs a vanishing share of the
// run; a kept move makes its reverse wait the same way, so that two
// settings within the noise of each other do not take turns; a trial whose
// rate after half a window is already 15% below the
// baseline ends there. After any change the first items (what the old setting
// left in the buffer or in flight) are not measured.
// Trials are also held to a share of the run (`explore_share` of the
// windows so far, counted across the runs a memory carries): a trial that
// does not pay costs its windows, and a short run cannot earn that back. A
// DataLoader epoch of 60 steps is ~7 windows; on a 2-core machine the
// staging thread it tried there with no workers lost x0.57-0.96 for one
// window, and the epoch 2-7% against the plain loader
// (benchmarks/dataloader_grid.py). With a share of 1/20 (Stage's) the
// first trial waits for window 20, a refused one-window trial holds the next
// to window 40, and a run never spends more than a twentieth of its windows
// on settings it may not keep: with trials that lose up to a quarter of
// their window's rate, at most ~1.3% of the run. (At 1/10, a 100-step run
// of that grid tried a thread at window 10 of 12 and lost 2-3% to it, the
// whole of the margin a drop-in may take.) Two trials are free of it: a thread,
// from none, while the consumer's own production mostly waits rather than
// computes (under half of its time on the CPU: I/O, worker processes, a
// device). Overlapping a wait takes no core from the step, so that trial is
// cheap and pays at once, where a compute-bound producer needs a core the step
// may be using; and a thread more (two from none) where the loop only
// gathers items (under gain_margin of its time outside waiting for or
// making them): there is no step for it to slow.
// A trial is judged against the mean of the last two windows at the
// settled setting where there are two (one window is noisy), and the first
// trial of a run waits for a second window: a run's first window holds its
// start-up (caches, lazy initialisation, the first batches of a model), and
// a baseline that low alone makes the first trial look better than it is.
//
// Threads
// -------
// Not thread-safe: the stage calls it from consumers under its tuning mutex.
// It never blocks and allocates only when it logs a decision.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <sstream>
#include <string>

namespace torch_stage {

struct TunerLimits {
  int64_t min_threads = 1; // 0: consumers may produce items themselves
  int64_t max_threads = 1;
  int64_t min_capacity = 1;
  int64_t max_capacity = 1;
  int64_t window_items = 8;
  int64_t window_ns = 50'000'000;
  double wait_fraction = 0.08; // consumer waiting above this: input-bound
  double gain_margin = 0.03; // more threads or capacity must gain this much
  double loss_margin = 0.03; // fewer threads may lose at most this much
  int64_t max_backoff = 64; // windows
  // Trials may take at most this share of the windows so far (see above);
  // 0: no bound. Stage passes StageOptions::tune_explore_share (0.1).
  double explore_share = 0;
  // Inline production under this share of its time on the consumer's CPU
  // mostly waits: a thread's trial from none is then free of the bound.
  // Stage passes StageOptions::tune_waiting_cpu_share (0.5).
  double waiting_cpu_share = 0.5;
  std::size_t log_size = 32;
};

struct TunerSetting {
  int64_t threads = 1;
  int64_t capacity = 1;
  bool operator==(const TunerSetting& o) const {
    return threads == o.threads && capacity == o.capacity;
  }
};

// What a tuner learnt, for another stage of the same work to start from (a
// DataLoader's next epoch): the setting it settled on, and each move's
// back-off and the windows it still waits. Without it every epoch explores
// from the start again, its refused trials included.
struct TunerMemory {
  TunerSetting setting;
  std::array<int64_t, 3> backoff{1, 1, 1}; // indexed by AutoTuner::Move
  std::array<int64_t, 3> cooldown{0, 0, 0};
  // Windows measured so far, and those at a trial's setting (the
  // exploration share counts both across runs).
  int64_t windows = 0;
  int64_t trial_windows = 0;
};

// Cumulative counters at one take.
struct TunerSample {
  int64_t now_ns = 0;
  int64_t items = 0; // items taken so far
  // Consumers waiting for an item, or producing it themselves (inline).
  int64_t wait_ns = 0;
  // Producers waiting for buffer space.
  int64_t blocked_ns = 0;
  // Consumers producing items themselves (part of wait_ns), and their
  // thread CPU time meanwhile; 0 when not measured.
  int64_t inline_ns = 0;
  int64_t inline_cpu_ns = 0;
  // The part of inline_ns that producer threads would run side by side (the
  // transform and the copy: the source is read by one at a time); 0 when
  // not measured, and then nothing is taken to run side by side.
  int64_t inline_parallel_ns = 0;
};

class AutoTuner {
 public:
  enum class Move : int {
    kNone = -1,
    kMoreThreads,
    kFewerThreads,
    kMoreCapacity
  };

  AutoTuner(TunerLimits limits, TunerSetting start)
      : limits_(limits), setting_(clamp(start)) {}
  // Resumes from what another tuner learnt (within these limits).
  AutoTuner(TunerLimits limits, const TunerMemory& memory)
      : limits_(limits), setting_(clamp(memory.setting)) {
    for (std::size_t i = 0; i < backoff_.size(); ++i) {
      backoff_[i] =
          std::clamp<int64_t>(memory.backoff[i], 1, limits_.max_backoff);
      cooldown_[i] =
          std::clamp<int64_t>(memory.cooldown[i], 0, limits_.max_backoff);
    }
    carried_windows_ = std::max<int64_t>(memory.windows, 0);
    carried_trial_windows_ =
        std::clamp<int64_t>(memory.trial_windows, 0, carried_windows_);
    std::ostringstream why;
    why << "resumed at " << describe(setting_)
        << " (from what an earlier run learnt)";
    record(why.str());
  }

  // Whether observe() would use a sample now: call it on every take (cheap),
  // and build the full sample (which reads the buffer's counters) only then.
  bool due(int64_t now_ns, int64_t items) const {
    if (!started_ || settle_ > 0) {
      return true;
    }
    // A trial may end at half a window.
    return covers(
        items - start_.items, now_ns - start_.now_ns, trial_ != Move::kNone);
  }

  // Feeds one sample; returns true when setting() changed.
  bool observe(const TunerSample& s) {
    if (!started_) {
      started_ = true;
      start_ = s;
      return false;
    }
    if (settle_ > 0) {
      if (--settle_ == 0) {
        start_ = s;
      }
      return false;
    }
    const int64_t items = s.items - start_.items;
    const int64_t ns = s.now_ns - start_.now_ns;
    if (trial_ != Move::kNone && ns > 0 && covers(items, ns, /*half=*/true) &&
        static_cast<double>(items) / ns <
            base_rate_ * (1.0 - 5 * limits_.loss_margin)) {
      // Half a window already says the trial is far worse: end it there.
      start_ = s;
      ++windows_;
      ++trial_windows_;
      last_rate_ = static_cast<double>(items) / ns;
      return judge(last_rate_);
    }
    if (!covers(items, ns, /*half=*/false) || ns <= 0) {
      return false;
    }
    const double rate = static_cast<double>(items) / static_cast<double>(ns);
    // Consumers' waits add up: several waiting at once wait for one
    // stream of items, so the window's wait is at most the window.
    const double wait =
        std::min(static_cast<double>(s.wait_ns - start_.wait_ns) / ns, 1.0);
    const double blocked =
        static_cast<double>(s.blocked_ns - start_.blocked_ns) /
        (static_cast<double>(ns) * std::max<int64_t>(setting_.threads, 1));
    const double per_item = static_cast<double>(ns) / items;
    const double wait_per_item = wait * per_item;
    const double rest_per_item = per_item - wait_per_item;
    const int64_t inline_ns = s.inline_ns - start_.inline_ns;
    const double parallel_per_item = std::clamp(
        static_cast<double>(s.inline_parallel_ns - start_.inline_parallel_ns) /
            static_cast<double>(items),
        0.0,
        std::max(wait_per_item, 0.0));
    // The share of inline production spent on the consumer's CPU (-1: none
    // measured in this window). At most 1: a read's share stands for the
    // time since the read before, which may lie in the window before.
    const double inline_cpu = inline_ns > 0 && s.inline_cpu_ns > 0
        ? std::min(
              static_cast<double>(s.inline_cpu_ns - start_.inline_cpu_ns) /
                  static_cast<double>(inline_ns),
              1.0)
        : -1.0;
    start_ = s;
    ++windows_;
    last_rate_ = rate;
    if (trial_ != Move::kNone) {
      ++trial_windows_;
      return judge(rate);
    }
    for (auto& c : cooldown_) {
      c = std::max<int64_t>(c - 1, 0);
    }
    const double rate_for_base =
        last_base_rate_ > 0 ? (last_base_rate_ + rate) / 2 : rate;
    last_base_rate_ = rate;
    if (trials_ == 0 && windows_ == 1) {
      return false; // the opening window (see above)
    }
    double ideal_gain = (wait_per_item + rest_per_item) /
        std::max(wait_per_item, rest_per_item);
    // From none, one thread can only overlap the consumer's own production
    // with the rest of its step, which gains nothing when the step is all
    // production (a loop that only gathers items). Two threads can also make
    // items side by side, as far as they need not read the source in turn:
    // per item, max(serial, production / 2, rest).
    // The threads a move from none adds: 1 to overlap, 2 to also make items
    // side by side.
    int64_t from_none = 1;
    if (setting_.threads == 0 && limits_.max_threads >= 2 &&
        ideal_gain <= 1.0 + limits_.gain_margin) {
      const double two = (wait_per_item + rest_per_item) /
          std::max(
                             {wait_per_item - parallel_per_item,
                              wait_per_item / 2,
                              rest_per_item});
      if (two > 1.0 + limits_.gain_margin) {
        from_none = 2;
        ideal_gain = two;
      }
    }
    // Moves in order of preference, each when allowed and not cooling down.
    // A waiting consumer also tries a thread fewer once more threads and
    // capacity are out (refused lately, or at their bound): the thread may
    // be what slows it.
    const bool waiting = wait > limits_.wait_fraction;
    // From none, a thread can only overlap the consumer's own production
    // with the rest of its step; from one, more threads produce in
    // parallel, whatever the consumer does.
    const bool more_threads = waiting && ready(Move::kMoreThreads) &&
        setting_.threads < limits_.max_threads &&
        (setting_.threads > 0 || ideal_gain > 1.0 + limits_.gain_margin);
    const bool more_capacity = waiting && ready(Move::kMoreCapacity) &&
        setting_.threads > 0 && blocked > limits_.wait_fraction &&
        setting_.capacity < limits_.max_capacity;
    const bool fewer_threads =
        ready(Move::kFewerThreads) && setting_.threads > limits_.min_threads;
    const Move move = more_threads ? Move::kMoreThreads
        : more_capacity            ? Move::kMoreCapacity
        : fewer_threads            ? Move::kFewerThreads
                                   : Move::kNone;
    if (move == Move::kNone) {
      return false;
    }
    const bool overlaps_a_wait = setting_.threads == 0 && inline_cpu >= 0 &&
        inline_cpu < limits_.waiting_cpu_share;
    // A loop that does little but gather items has no step for a thread to
    // slow: a thread more (two from none) is tried whatever the share. Not
    // one from none: it could only overlap the gathering, which gains
    // nothing (its gain passes the margin only where the rest of the step
    // is within a hair of it, and there a trial lost x0.57 of its window).
    const bool only_gathers = move == Move::kMoreThreads &&
        rest_per_item <= limits_.gain_margin * per_item &&
        (setting_.threads > 0 || from_none == 2);
    const TunerSetting next = next_of(move, from_none);
    const auto why_move = [&] {
      return reason(
          move,
          setting_.threads == 0 ? from_none : 0,
          wait,
          blocked,
          ideal_gain,
          limits_.wait_fraction);
    };
    if (!overlaps_a_wait && !only_gathers && !within_share()) {
      if (!deferred_logged_) {
        deferred_logged_ = true;
        std::ostringstream why;
        why << "window " << windows_ << ": would try " << describe(next) << " ("
            << why_move() << "); trials wait while they would take over "
            << limits_.explore_share * 100 << "% of the windows so far";
        if (setting_.threads == 0 && inline_cpu >= 0) {
          why << " (the loop's own production was " << percent(inline_cpu)
              << "% on its CPU: a thread would need a core)";
        }
        record(why.str());
      }
      return false;
    }
    base_rate_ = rate_for_base;
    last_base_rate_ = 0;
    base_ = setting_;
    trial_ = move;
    std::ostringstream why;
    why << "window " << windows_ << ": trying " << describe(next) << " ("
        << why_move() << ")";
    change(next, why.str());
    return true;
  }

  TunerSetting setting() const {
    return setting_;
  }
  // What this tuner learnt so far; a trial under way is not part of it.
  TunerMemory memory() const {
    TunerMemory m;
    m.setting = trial_ == Move::kNone ? setting_ : base_;
    m.backoff = backoff_;
    m.cooldown = cooldown_;
    m.windows = carried_windows_ + windows_;
    m.trial_windows = carried_trial_windows_ + trial_windows_;
    return m;
  }
  // Whether the samples after a change are still being skipped.
  bool settling() const {
    return settle_ > 0;
  }
  // The decisions so far, oldest first (the last `log_size`).
  const std::deque<std::string>& log() const {
    return log_;
  }
  int64_t windows() const {
    return windows_;
  }
  int64_t trials() const {
    return trials_;
  }
  // Windows of this run measured at a trial's setting.
  int64_t trial_windows() const {
    return trial_windows_;
  }
  // Items per second of the last full window (0 before the first).
  double last_rate_per_s() const {
    return last_rate_ * 1e9;
  }
  // The memory budget may lower the capacity bound once the item size is
  // known; the setting follows if it was above.
  bool set_max_capacity(int64_t max_capacity) {
    limits_.max_capacity = std::max(max_capacity, limits_.min_capacity);
    const TunerSetting bounded = clamp(setting_);
    base_ = clamp(base_);
    if (bounded == setting_) {
      return false;
    }
    change(
        bounded,
        "the memory budget bounds capacity to " +
            std::to_string(limits_.max_capacity));
    last_base_rate_ = 0;
    trial_ = Move::kNone;
    confirming_ = false;
    return true;
  }
  // From now on at most `max_threads` producer threads (never under
  // min_threads), for a reason the tuner cannot measure (`why`, logged): a
  // setting above moves down at once, a trial under way ends.
  bool set_max_threads(int64_t max_threads, std::string why) {
    limits_.max_threads = std::max(max_threads, limits_.min_threads);
    const TunerSetting bounded = clamp(setting_);
    base_ = clamp(base_);
    if (bounded == setting_) {
      record(std::move(why));
      return false;
    }
    change(bounded, std::move(why));
    last_base_rate_ = 0;
    trial_ = Move::kNone;
    confirming_ = false;
    return true;
  }
  const TunerLimits& limits() const {
    return limits_;
  }

 private:
  bool judge(double rate) {
    const Move move = trial_;
    const auto passes = [&](double ratio) {
      return move == Move::kFewerThreads ? ratio >= 1.0 - limits_.loss_margin
                                         : ratio >= 1.0 + limits_.gain_margin;
    };
    if (!confirming_ && base_rate_ > 0 && passes(rate / base_rate_)) {
      // One window is one sample of a noisy rate: a trial that passes goes
      // on for a second window, and is judged by the two together.
      confirming_ = true;
      first_rate_ = rate;
      return false;
    }
    if (confirming_) {
      rate = (first_rate_ + rate) / 2;
      confirming_ = false;
    }
    trial_ = Move::kNone;
    ++trials_;
    const double ratio = base_rate_ > 0 ? rate / base_rate_ : 1.0;
    const bool keep = passes(ratio);
    auto& backoff = backoff_[static_cast<int>(move)];
    std::ostringstream why;
    why.precision(3);
    if (keep) {
      // (Its own back-off is not reset: a move kept and refused in turns is
      // noise, and waits longer each time.) The way back waits, longer each
      // time it comes to this: two settings within the noise of each other
      // would otherwise take turns, each change costing its settling items.
      const Move back = move == Move::kMoreThreads ? Move::kFewerThreads
          : move == Move::kFewerThreads            ? Move::kMoreThreads
                                                   : Move::kNone;
      if (back != Move::kNone) {
        auto& back_off = backoff_[static_cast<int>(back)];
        back_off = std::min(back_off * 4, limits_.max_backoff);
        cooldown_[static_cast<int>(back)] = back_off;
      }
      why << "window " << windows_ << ": kept " << describe(setting_)
          << " (rate x" << ratio << " against " << describe(base_) << ")";
      record(why.str());
      return false;
    }
    backoff = std::min(backoff * 4, limits_.max_backoff);
    cooldown_[static_cast<int>(move)] = backoff;
    why << "window " << windows_ << ": back to " << describe(base_)
        << " (rate x" << ratio << " with " << describe(setting_)
        << "; tried again in " << backoff << " windows)";
    change(base_, why.str());
    return true;
  }

  // Whether one more trial window stays within the exploration share.
  bool within_share() const {
    if (limits_.explore_share <= 0) {
      return true;
    }
    const auto all = static_cast<double>(carried_windows_ + windows_);
    const auto trials =
        static_cast<double>(carried_trial_windows_ + trial_windows_);
    return trials + 1 <= limits_.explore_share * all;
  }

  // from_none: the threads a move to more adds from none.
  TunerSetting next_of(Move move, int64_t from_none = 1) const {
    TunerSetting next = setting_;
    switch (move) {
      case Move::kMoreThreads:
        next.threads += next.threads == 0 ? from_none : 1;
        break;
      case Move::kFewerThreads:
        --next.threads;
        break;
      case Move::kMoreCapacity:
        ++next.capacity;
        break;
      case Move::kNone:
        break;
    }
    return next;
  }

  // Whether `items` in `ns` fill a window (or half of one).
  bool covers(int64_t items, int64_t ns, bool half) const {
    const int64_t k = half ? 2 : 1;
    return k * items >= limits_.window_items && k * ns >= limits_.window_ns;
  }

  bool ready(Move move) const {
    return cooldown_[static_cast<int>(move)] == 0;
  }

  void change(TunerSetting next, std::string why) {
    // What the old setting left buffered or in flight is not the new one's.
    // From no thread nothing is (the consumer made every item itself): one
    // item lets the new thread start.
    settle_ = setting_.threads == 0
        ? 1
        : std::max(setting_.capacity, next.capacity) +
            std::max(setting_.threads, next.threads) + 1;
    setting_ = next;
    record(std::move(why));
  }

  void record(std::string line) {
    log_.push_back(std::move(line));
    while (log_.size() > limits_.log_size) {
      log_.pop_front();
    }
  }

  TunerSetting clamp(TunerSetting s) const {
    s.threads = std::clamp(s.threads, limits_.min_threads, limits_.max_threads);
    s.capacity =
        std::clamp(s.capacity, limits_.min_capacity, limits_.max_capacity);
    return s;
  }

  static std::string describe(TunerSetting s) {
    std::ostringstream out;
    if (s.threads == 0) {
      out << "no producer thread (the consumer produces)";
    } else {
      out << s.threads << " thread" << (s.threads == 1 ? "" : "s");
    }
    out << ", capacity " << s.capacity;
    return out.str();
  }

  // A share as a whole percentage (precision 2 would print 100 as 1e+02).
  static int percent(double share) {
    return static_cast<int>(share * 100 + 0.5);
  }

  // from_none: the threads a move from none adds; 0: not from none.
  static std::string reason(
      Move move,
      int64_t from_none,
      double wait,
      double blocked,
      double ideal_gain,
      double wait_fraction) {
    std::ostringstream out;
    out.precision(2);
    switch (move) {
      case Move::kMoreThreads:
        out << "the consumer waited " << percent(wait) << "% of the time; ";
        if (from_none == 0) {
          out << "a thread more can make items side by side";
        } else {
          out << (from_none == 2 ? "making items on 2 threads side by side"
                                 : "overlap")
              << " could gain up to x" << ideal_gain;
        }
        break;
      case Move::kMoreCapacity:
        out << "the consumer waited " << percent(wait)
            << "% of the time while producers were blocked for space "
            << percent(blocked) << "%: bursty production";
        break;
      case Move::kFewerThreads:
        out << "the consumer waited " << percent(wait) << "% of the time"
            << (wait > wait_fraction ? " and more threads did not pay" : "")
            << ": a thread fewer may leave the step more CPU";
        break;
      case Move::kNone:
        break;
    }
    return out.str();
  }

  TunerLimits limits_;
  TunerSetting setting_;
  TunerSetting base_;
  bool started_ = false;
  TunerSample start_;
  int64_t settle_ = 0;
  int64_t windows_ = 0;
  int64_t trials_ = 0;
  int64_t trial_windows_ = 0;
  // What a resumed tuner's earlier runs measured (for the share).
  int64_t carried_windows_ = 0;
  int64_t carried_trial_windows_ = 0;
  // A deferred trial is logged once per run, not every window.
  bool deferred_logged_ = false;
  Move trial_ = Move::kNone;
  // The trial passed its first window and runs a second (see judge()).
  bool confirming_ = false;
  double first_rate_ = 0;
  // The rate of the last window at the settled setting, averaged with the
  // next into a trial's baseline (0: none since the setting changed).
  double last_base_rate_ = 0;
  double base_rate_ = 0;
  double last_rate_ = 0;
  std::array<int64_t, 3> backoff_{1, 1, 1};
  std::array<int64_t, 3> cooldown_{0, 0, 0};
  std::deque<std::string> log_;
};

} // namespace torch_stage
