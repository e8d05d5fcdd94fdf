// Tests of AutoTuner (csrc/staging/auto_tuner.h) with synthetic windows:
// plain C++, also run under ThreadSanitizer and AddressSanitizer.
#include "staging/auto_tuner.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch_stage {
namespace {

// Feeds windows of `items` items lasting `ns`, of which the consumer waited
// `wait` and producers were blocked `blocked` (fractions of the window).
class Feed {
 public:
  explicit Feed(AutoTuner& tuner) : tuner_(tuner) {
    tuner_.observe(sample_); // the first sample starts the clock
  }

  // One window; returns whether the setting changed at its end. The
  // samples skipped after a change come first, one item each, taking no time.
  bool window(
      double items_per_ms,
      double wait,
      double blocked = 0,
      int64_t ms = 100) {
    while (tuner_.settling()) {
      sample_.items += 1;
      tuner_.observe(sample_);
    }
    const int64_t ns = ms * 1'000'000;
    sample_.now_ns += ns;
    sample_.items += static_cast<int64_t>(items_per_ms * ms);
    sample_.wait_ns += static_cast<int64_t>(wait * ns);
    sample_.blocked_ns += static_cast<int64_t>(blocked * ns);
    if (inline_cpu_ >= 0 && tuner_.setting().threads == 0) {
      // With no thread the consumer's wait is its own production.
      sample_.inline_ns += static_cast<int64_t>(wait * ns);
      sample_.inline_cpu_ns += static_cast<int64_t>(inline_cpu_ * wait * ns);
      sample_.inline_parallel_ns +=
          static_cast<int64_t>(inline_parallel_ * wait * ns);
    }
    return tuner_.observe(sample_);
  }

  // From now on, inline production spends this share of its time on the
  // consumer's CPU (-1: not measured, the default).
  void set_inline_cpu(double share) {
    inline_cpu_ = share;
  }
  // ...and this share of it is work producers run side by side (the
  // transform), the rest reading the source.
  void set_inline_parallel(double share) {
    inline_parallel_ = share;
  }

 private:
  AutoTuner& tuner_;
  TunerSample sample_;
  double inline_cpu_ = -1;
  double inline_parallel_ = 0;
};

TunerLimits limits(int64_t min_threads, int64_t max_threads) {
  TunerLimits l;
  l.min_threads = min_threads;
  l.max_threads = max_threads;
  l.min_capacity = 2;
  l.max_capacity = 8;
  l.window_items = 8;
  l.window_ns = 50'000'000;
  return l;
}

// limits(0, 4) with trials held to a tenth of the run, as Stage holds them.
TunerLimits sharing_limits() {
  TunerLimits l = limits(0, 4);
  l.explore_share = 0.1;
  return l;
}

TEST(AutoTuner, AWaitingConsumerGetsAThreadThatPays) {
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  // Inline: the consumer spends half of each step producing. The first
  // window is only a baseline; the second, too, then the trial.
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_TRUE(feed.window(1.0, 0.5));
  EXPECT_EQ(tuner.setting().threads, 1);
  // The thread overlaps the two: 1.8x the rate, in the trial's window and
  // in the one that confirms it.
  EXPECT_FALSE(feed.window(1.8, 0.0));
  EXPECT_EQ(tuner.trials(), 0); // confirming
  EXPECT_FALSE(feed.window(1.8, 0.0));
  EXPECT_EQ(tuner.setting().threads, 1);
  EXPECT_NE(tuner.log().back().find("kept 1 thread"), std::string::npos)
      << tuner.log().back();
}

TEST(AutoTuner, TheFirstTrialWaitsForTwoWindowsAndIsJudgedAgainstBoth) {
  // The run's first window measured 20% fast by noise, its second 20% slow
  // (mean 1.0), and a thread that gives 0.9: against the second window
  // alone it would pass (x1.125); against the two it is refused.
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  EXPECT_FALSE(feed.window(1.2, 0.5));
  EXPECT_EQ(tuner.setting().threads, 0);
  EXPECT_TRUE(tuner.log().empty());
  ASSERT_TRUE(feed.window(0.8, 0.5));
  EXPECT_NE(
      tuner.log().back().find("window 2: trying 1 thread"), std::string::npos)
      << tuner.log().back();
  EXPECT_TRUE(feed.window(0.9, 0.0));
  EXPECT_EQ(tuner.setting().threads, 0);
  EXPECT_EQ(tuner.trials(), 1);
  // Then the refused move waits its back-off (4 windows), as before.
  for (int w = 0; w < 3; ++w) {
    EXPECT_FALSE(feed.window(1.0, 0.5)) << "window " << tuner.windows();
  }
  EXPECT_TRUE(feed.window(1.0, 0.5));
  EXPECT_NE(
      tuner.log().back().find("window 7: trying 1 thread"), std::string::npos)
      << tuner.log().back();
}

TEST(AutoTuner, EveryTrialIsJudgedAgainstTheLastTwoSettledWindows) {
  // A later trial too: after a refusal the windows before the next trial
  // read 1.2 and 0.8 (mean 1.0); a thread giving 0.9 would pass against
  // the last alone (x1.125) and is refused against both.
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_TRUE(feed.window(1.0, 0.5));
  ASSERT_TRUE(feed.window(0.7, 0.0)); // refused; tried again in 4 windows
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_FALSE(feed.window(1.2, 0.5));
  ASSERT_TRUE(feed.window(0.8, 0.5));
  EXPECT_EQ(tuner.setting().threads, 1);
  EXPECT_TRUE(feed.window(0.9, 0.0));
  EXPECT_EQ(tuner.setting().threads, 0);
  EXPECT_EQ(tuner.trials(), 2);
  EXPECT_NE(tuner.log().back().find("rate x0.9 "), std::string::npos)
      << tuner.log().back();
}

TEST(AutoTuner, ATrialThatPassesOneWindowByLuckIsNotKept) {
  // A thread that does not pay, measured 8% faster in its first window by
  // noise and 8% slower in the next: judged by the two, it goes.
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_TRUE(feed.window(1.0, 0.5));
  EXPECT_FALSE(feed.window(1.08, 0.0));
  EXPECT_TRUE(feed.window(0.92, 0.0));
  EXPECT_EQ(tuner.setting().threads, 0);
  EXPECT_NE(
      tuner.log().back().find("back to no producer thread"), std::string::npos)
      << tuner.log().back();
}

TEST(AutoTuner, AThreadThatDoesNotPayIsRefusedAndRetriedLessAndLessOften) {
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  std::vector<int64_t> trials_at;
  for (int w = 0; w < 100; ++w) {
    const bool threaded = tuner.setting().threads > 0;
    // Inline rate 1.0 with half the time producing; with the thread the
    // consumer is slower (it fights the producer for the GIL).
    if (feed.window(threaded ? 0.7 : 1.0, 0.5) && tuner.setting().threads > 0) {
      trials_at.push_back(tuner.windows());
    }
  }
  EXPECT_EQ(tuner.setting().threads, 0);
  ASSERT_GE(trials_at.size(), 3u);
  // Back-off grows four-fold: the gaps between trials grow.
  for (size_t i = 2; i < trials_at.size(); ++i) {
    EXPECT_GT(
        trials_at[i] - trials_at[i - 1], trials_at[i - 1] - trials_at[i - 2]);
  }
  EXPECT_LE(trials_at.size(), 6u);
}

TEST(AutoTuner, AFarWorseTrialEndsAtHalfAWindow) {
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_TRUE(feed.window(1.0, 0.5));
  ASSERT_EQ(tuner.setting().threads, 1);
  // 30 ms (over half the 50 ms window) at half the rate: judged already.
  EXPECT_TRUE(feed.window(0.5, 0.2, 0, /*ms=*/30));
  EXPECT_EQ(tuner.setting().threads, 0);
  // A trial only a little worse is judged on its whole window.
  AutoTuner patient(limits(0, 4), TunerSetting{0, 2});
  Feed slow(patient);
  ASSERT_FALSE(slow.window(1.0, 0.5));
  ASSERT_TRUE(slow.window(1.0, 0.5));
  EXPECT_FALSE(slow.window(0.95, 0.2, 0, /*ms=*/30));
  EXPECT_EQ(patient.setting().threads, 1);
  EXPECT_TRUE(
      slow.window(0.95, 0.2, 0, /*ms=*/30)); // the whole window: refused
  EXPECT_EQ(patient.setting().threads, 0);
}

TEST(AutoTuner, TwoSettingsAlikeDoNotTakeTurns) {
  // With 2 threads the consumer never waits, with 1 it waits 30%; the rates
  // are alike, but noise makes every trial window measure 6% faster than
  // the one before it: each change looks worth keeping.
  AutoTuner tuner(limits(1, 2), TunerSetting{1, 2});
  Feed feed(tuner);
  int changes = 0;
  bool trial = false;
  double rate = 1.0;
  for (int w = 0; w < 100; ++w) {
    const double measured = trial ? rate * 1.06 : rate;
    const bool changed =
        feed.window(measured, tuner.setting().threads == 2 ? 0.0 : 0.3);
    if (trial && !changed) {
      rate = measured; // kept: the new baseline
    }
    trial = changed && !trial; // a change after a trial is its revert
    changes += changed ? 1 : 0;
  }
  EXPECT_LE(changes, 8) << "settings taking turns";
}

TEST(AutoTuner, ANonWaitingConsumerGivesThreadsBackOnTies) {
  AutoTuner tuner(limits(1, 4), TunerSetting{3, 2});
  Feed feed(tuner);
  for (int w = 0; w < 12; ++w) {
    feed.window(1.0, 0.0);
  }
  EXPECT_EQ(tuner.setting().threads, 1); // never below min_threads
}

TEST(AutoTuner, BurstyProductionGetsCapacityUpToItsBound) {
  AutoTuner tuner(limits(1, 1), TunerSetting{1, 2});
  Feed feed(tuner);
  double rate = 1.0;
  for (int w = 0; w < 40; ++w) {
    if (feed.window(rate, 0.2, 0.3)) {
      rate *= 1.1; // each deeper buffer pays
    }
  }
  EXPECT_EQ(tuner.setting().capacity, 8);
}

TEST(AutoTuner, TheMemoryBudgetLowersCapacity) {
  AutoTuner tuner(limits(1, 2), TunerSetting{1, 6});
  EXPECT_TRUE(tuner.set_max_capacity(3));
  EXPECT_EQ(tuner.setting().capacity, 3);
  EXPECT_TRUE(tuner.set_max_capacity(1)); // never below min_capacity (2)
  EXPECT_EQ(tuner.setting().capacity, 2);
}

TEST(AutoTuner, ShortWindowsAreNotJudged) {
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  TunerSample s;
  tuner.observe(s);
  s.items = 100;
  s.now_ns = 1'000'000; // 1 ms: shorter than the 50 ms window
  s.wait_ns = 900'000;
  EXPECT_FALSE(tuner.due(s.now_ns, s.items));
  EXPECT_FALSE(tuner.observe(s));
  EXPECT_EQ(tuner.windows(), 0);
}

// Epochs of 12 windows where a thread does not pay (as above), each epoch a
// new tuner: started afresh every epoch retries the thread at the same
// points; resumed from the last epoch's memory, the back-off carries on and
// the trials thin out across epochs.
TEST(AutoTuner, ResumingFromMemoryCarriesTheBackOffAcrossRuns) {
  auto run_epochs = [](bool resume) {
    std::vector<int64_t> trials;
    TunerMemory memory;
    memory.setting = TunerSetting{0, 2};
    for (int epoch = 0; epoch < 6; ++epoch) {
      AutoTuner tuner = resume ? AutoTuner(limits(0, 4), memory)
                               : AutoTuner(limits(0, 4), TunerSetting{0, 2});
      Feed feed(tuner);
      for (int w = 0; w < 12; ++w) {
        feed.window(tuner.setting().threads > 0 ? 0.7 : 1.0, 0.5);
      }
      trials.push_back(tuner.trials());
      memory = tuner.memory();
      EXPECT_EQ(memory.setting.threads, 0);
    }
    return trials;
  };
  const std::vector<int64_t> fresh = run_epochs(false);
  const std::vector<int64_t> resumed = run_epochs(true);
  int64_t fresh_total = 0;
  int64_t resumed_total = 0;
  for (size_t e = 0; e < fresh.size(); ++e) {
    EXPECT_GE(fresh[e], 2) << "epoch " << e;
    fresh_total += fresh[e];
    resumed_total += resumed[e];
  }
  EXPECT_EQ(resumed[0], fresh[0]);
  // The later epochs wait out the grown back-off: at most one trial each.
  for (size_t e = 2; e < resumed.size(); ++e) {
    EXPECT_LE(resumed[e], 1) << "epoch " << e;
  }
  EXPECT_LT(resumed_total * 2, fresh_total);
}

TEST(AutoTuner, MemoryIsTheSettledSettingNotATrialAndIsClampedOnResume) {
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  ASSERT_FALSE(feed.window(1.0, 0.5)); // the opening baseline
  ASSERT_TRUE(feed.window(1.0, 0.5)); // trying a thread
  EXPECT_EQ(tuner.setting().threads, 1);
  EXPECT_EQ(tuner.memory().setting.threads, 0); // not kept yet
  EXPECT_FALSE(feed.window(1.8, 0.0)); // passed, confirming
  EXPECT_EQ(tuner.memory().setting.threads, 0);
  EXPECT_FALSE(feed.window(1.8, 0.0)); // kept
  EXPECT_EQ(tuner.memory().setting.threads, 1);

  TunerMemory wild;
  wild.setting = TunerSetting{9, 100};
  wild.backoff = {1000, -5, 2};
  wild.cooldown = {-1, 1000, 3};
  AutoTuner resumed(limits(0, 4), wild);
  EXPECT_EQ(resumed.setting(), (TunerSetting{4, 8}));
  const TunerMemory m = resumed.memory();
  EXPECT_EQ(m.backoff[0], resumed.limits().max_backoff);
  EXPECT_EQ(m.backoff[1], 1);
  EXPECT_EQ(m.cooldown[0], 0);
  EXPECT_EQ(m.cooldown[1], resumed.limits().max_backoff);
  EXPECT_NE(
      resumed.log().front().find("resumed at 4 threads"), std::string::npos)
      << resumed.log().front();
}

// Exploration held to a tenth of the run: production that computes (a
// thread would need a core) waits for window 10 before a thread is tried,
// and a refused trial's window holds the next to window 20.
TEST(AutoTuner, TrialsTakeAtMostTheirShareOfTheRun) {
  const TunerLimits l = sharing_limits();
  AutoTuner tuner(l, TunerSetting{0, 2});
  Feed feed(tuner);
  feed.set_inline_cpu(0.95);
  for (int w = 1; w < 10; ++w) {
    ASSERT_FALSE(feed.window(1.0, 0.5)) << "window " << w;
  }
  ASSERT_EQ(tuner.log().size(), 1u); // the deferral, said once
  EXPECT_NE(
      tuner.log().front().find("window 2: would try 1 thread"),
      std::string::npos)
      << tuner.log().front();
  EXPECT_NE(tuner.log().front().find("95% on its CPU"), std::string::npos)
      << tuner.log().front();
  ASSERT_TRUE(feed.window(1.0, 0.5));
  EXPECT_NE(
      tuner.log().back().find("window 10: trying 1 thread"), std::string::npos)
      << tuner.log().back();
  EXPECT_TRUE(feed.window(0.7, 0.0)); // refused
  EXPECT_EQ(tuner.trial_windows(), 1);
  int64_t next = 0;
  for (int w = 0; w < 30 && next == 0; ++w) {
    if (feed.window(1.0, 0.5)) {
      next = tuner.windows();
    }
  }
  // The back-off alone (4 windows) would try it at window 15.
  EXPECT_EQ(next, 20) << tuner.log().back();
  const TunerMemory m = tuner.memory();
  EXPECT_EQ(m.windows, 20);
  EXPECT_EQ(m.trial_windows, 1);
}

// A CPU time read stands for the time since the read before, which may lie
// in the window before: a window's share can come out over 1. It is a
// share, at most 1 (a loop at 103% was judged compute-bound where the line
// was drawn at 101%).
TEST(AutoTuner, TheShareOfProductionOnTheCpuIsAtMostOne) {
  AutoTuner tuner(sharing_limits(), TunerSetting{0, 2});
  Feed feed(tuner);
  feed.set_inline_cpu(1.3);
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_EQ(tuner.log().size(), 1u);
  EXPECT_NE(tuner.log().front().find("100% on its CPU"), std::string::npos)
      << tuner.log().front();
}

// A consumer whose own production mostly waits (here 10% of it on its CPU:
// reading, worker processes) gets its thread's trial at once: overlapping
// a wait takes no core from the step.
TEST(AutoTuner, OverlappingAWaitIsNotHeldToTheShare) {
  const TunerLimits l = sharing_limits();
  AutoTuner tuner(l, TunerSetting{0, 2});
  Feed feed(tuner);
  feed.set_inline_cpu(0.1);
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_TRUE(feed.window(1.0, 0.5));
  EXPECT_EQ(tuner.setting().threads, 1);
  EXPECT_FALSE(feed.window(1.8, 0.0));
  EXPECT_FALSE(feed.window(1.8, 0.0));
  EXPECT_EQ(tuner.setting().threads, 1); // kept
  // From one thread on, the consumer does not produce: the share holds
  // (4 windows so far, 2 of them a trial's), whatever it waits.
  for (int w = 0; w < 10; ++w) {
    EXPECT_FALSE(feed.window(1.0, 0.5)) << "window " << tuner.windows();
  }
}

// A loop that only gathers items (the consumer makes them all the time)
// gains nothing from one thread overlapping it; two making items side by
// side can double its rate, as far as the source need not be read in turn.
TEST(
    AutoTuner,
    AConsumerThatOnlyMakesItemsTriesTwoThreadsWhenTheyCanWorkSideBySide) {
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  feed.set_inline_cpu(0.1);
  feed.set_inline_parallel(0.9); // a slow transform over a quick source
  ASSERT_FALSE(feed.window(1.0, 0.99));
  ASSERT_TRUE(feed.window(1.0, 0.99));
  EXPECT_EQ(tuner.setting().threads, 2) << tuner.log().back();
  EXPECT_NE(
      tuner.log().back().find("making items on 2 threads side by side"),
      std::string::npos)
      << tuner.log().back();
  EXPECT_FALSE(feed.window(1.9, 0.9));
  EXPECT_FALSE(feed.window(1.9, 0.9));
  EXPECT_EQ(tuner.setting().threads, 2);
  EXPECT_NE(tuner.log().back().find("kept 2 threads"), std::string::npos)
      << tuner.log().back();
}

// Making items on the consumer's CPU, the first trial waits for its share
// of the run, unless the loop only gathers items: then no step is slowed.
TEST(AutoTuner, TwoThreadsForALoopThatOnlyGathersAreNotHeldToTheShare) {
  AutoTuner tuner(sharing_limits(), TunerSetting{0, 2});
  Feed feed(tuner);
  feed.set_inline_cpu(1.0);
  feed.set_inline_parallel(0.9);
  ASSERT_FALSE(feed.window(1.0, 0.99));
  ASSERT_TRUE(feed.window(1.0, 0.99));
  EXPECT_EQ(tuner.setting().threads, 2) << tuner.log().back();
  // A loop with a step of its own (half of it) tries one thread, at its
  // share: window 10.
  AutoTuner stepping(sharing_limits(), TunerSetting{0, 2});
  Feed feed2(stepping);
  feed2.set_inline_cpu(1.0);
  feed2.set_inline_parallel(0.9);
  int tried_at = 0;
  for (int w = 1; w <= 12 && tried_at == 0; ++w) {
    if (feed2.window(1.0, 0.5)) {
      tried_at = w;
    }
  }
  EXPECT_EQ(tried_at, 10);
  EXPECT_EQ(stepping.setting().threads, 1) << stepping.log().back();
}

// One thread from none can only overlap a loop that only gathers items
// with nothing: not a free trial. (With the rest of the step at 2.95% its
// modelled gain, x1.030, passes the margin; the DataLoader's batches of 16
// rows from a TensorDataset, gathered and dropped, lost x0.57 in it.)
TEST(AutoTuner, OneThreadFromNoneIsNoFreeTrialForALoopThatOnlyGathers) {
  AutoTuner tuner(sharing_limits(), TunerSetting{0, 2});
  Feed feed(tuner);
  feed.set_inline_cpu(1.0);
  for (int w = 1; w < 10; ++w) {
    EXPECT_FALSE(feed.window(1.0, 0.9705)) << tuner.log().back();
  }
  EXPECT_EQ(tuner.trials(), 0);
  ASSERT_EQ(tuner.log().size(), 1u);
  EXPECT_NE(
      tuner.log().front().find("window 2: would try 1 thread"),
      std::string::npos)
      << tuner.log().front();
}

TEST(AutoTuner, AConsumerThatOnlyReadsTheSourceGetsNoThread) {
  // All of the production is reading the source (no transform measured):
  // producers would read it in turn, so neither one nor two threads gain.
  for (const double parallel : {0.0, 0.01}) {
    AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
    Feed feed(tuner);
    feed.set_inline_cpu(0.1);
    feed.set_inline_parallel(parallel);
    for (int w = 0; w < 12; ++w) {
      EXPECT_FALSE(feed.window(1.0, 0.99)) << "window " << tuner.windows();
    }
    EXPECT_EQ(tuner.setting().threads, 0);
    EXPECT_EQ(tuner.trials(), 0);
  }
}

TEST(AutoTuner, OneThreadAtMostNeverJumpsToTwo) {
  AutoTuner tuner(limits(0, 1), TunerSetting{0, 2});
  Feed feed(tuner);
  feed.set_inline_cpu(0.1);
  feed.set_inline_parallel(0.9);
  for (int w = 0; w < 12; ++w) {
    EXPECT_FALSE(feed.window(1.0, 0.99)) << "window " << tuner.windows();
  }
  EXPECT_EQ(tuner.setting().threads, 0);
}

// Several consumers waiting at once add up more wait than the window
// lasts: it counts as the whole window (a loop that only gathers items),
// not as a negative rest of the step that no thread could help.
TEST(AutoTuner, ConsumersWaitingTogetherStillGetThreads) {
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  feed.set_inline_cpu(0.1);
  feed.set_inline_parallel(0.9);
  ASSERT_FALSE(feed.window(1.0, 3.0)); // three consumers, all waiting
  ASSERT_TRUE(feed.window(1.0, 3.0));
  EXPECT_EQ(tuner.setting().threads, 2) << tuner.log().back();
}

// From one thread on, a loop that only gathers items gets its next thread's
// trial at once too: there is no step for it to slow.
TEST(AutoTuner, ALoopThatOnlyGathersGetsMoreThreadsWhateverTheShare) {
  AutoTuner tuner(sharing_limits(), TunerSetting{1, 2});
  Feed feed(tuner);
  ASSERT_FALSE(feed.window(1.0, 0.99));
  ASSERT_TRUE(feed.window(1.0, 0.99));
  EXPECT_EQ(tuner.setting().threads, 2);
  EXPECT_NE(
      tuner.log().back().find("a thread more can make items side by side"),
      std::string::npos)
      << tuner.log().back();
  // A loop with a step of its own waits for its share.
  AutoTuner stepping(sharing_limits(), TunerSetting{1, 2});
  Feed feed2(stepping);
  for (int w = 1; w <= 9; ++w) {
    EXPECT_FALSE(feed2.window(1.0, 0.5)) << "window " << stepping.windows();
  }
}

TEST(AutoTuner, AThreadLimitEndsATrialAndHoldsFromThenOn) {
  AutoTuner tuner(limits(0, 4), TunerSetting{0, 2});
  Feed feed(tuner);
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_TRUE(feed.window(1.0, 0.5)); // trying a thread
  ASSERT_EQ(tuner.setting().threads, 1);
  // What the tuner cannot measure says no thread: the trial ends, the
  // setting goes back to none, and the reason is in the log.
  EXPECT_TRUE(tuner.set_max_threads(0, "no thread: because"));
  EXPECT_EQ(tuner.setting().threads, 0);
  EXPECT_EQ(tuner.log().back(), "no thread: because");
  // However much the consumer waits, no thread is tried again.
  for (int w = 0; w < 40; ++w) {
    EXPECT_FALSE(feed.window(1.0, 0.9)) << "window " << tuner.windows();
    EXPECT_EQ(tuner.setting().threads, 0);
  }
  EXPECT_EQ(tuner.memory().setting.threads, 0);
  // At the limit already: nothing changes, the reason is logged.
  EXPECT_FALSE(tuner.set_max_threads(0, "again"));
  EXPECT_EQ(tuner.log().back(), "again");
  // Never under the least the stage allows.
  AutoTuner at_least_one(limits(1, 4), TunerSetting{2, 2});
  EXPECT_TRUE(at_least_one.set_max_threads(0, "fewer"));
  EXPECT_EQ(at_least_one.setting().threads, 1);
}

// The share counts the windows of the runs a memory carries: an epoch of
// 7 windows tries nothing; the next, resumed, tries at its 3rd (the 10th).
TEST(AutoTuner, TheShareCountsAcrossResumedRuns) {
  const TunerLimits l = sharing_limits();
  AutoTuner first(l, TunerSetting{0, 2});
  {
    Feed feed(first);
    feed.set_inline_cpu(0.9);
    for (int w = 0; w < 7; ++w) {
      ASSERT_FALSE(feed.window(1.0, 0.5));
    }
  }
  EXPECT_EQ(first.trials(), 0);
  const TunerMemory m = first.memory();
  EXPECT_EQ(m.windows, 7);
  AutoTuner second(l, m);
  Feed feed(second);
  feed.set_inline_cpu(0.9);
  ASSERT_FALSE(feed.window(1.0, 0.5)); // this run's opening
  ASSERT_FALSE(feed.window(1.0, 0.5));
  ASSERT_TRUE(feed.window(1.0, 0.5));
  EXPECT_EQ(second.setting().threads, 1);
  EXPECT_EQ(second.memory().windows, 10);
}

} // namespace
} // namespace torch_stage
