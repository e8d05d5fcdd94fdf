// Sync planning and the plan verifier (csrc/schedule/sync_plan.h), on graphs
// drawn below with each node's stream in brackets. Events are numbered in
// the order of the nodes they follow.
#include "schedule/sync_plan.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "schedule/schedule.h"

namespace torch_stage::schedule {
namespace {

using Edges = std::vector<std::pair<int, int>>;
using Lists = std::vector<std::vector<int>>;

Dag make_dag(int n, const Edges& edges) {
  Dag dag(n);
  for (const auto& [u, v] : edges) {
    dag.add_edge(u, v);
  }
  return dag;
}

bool mentions(const std::vector<std::string>& problems, const std::string& s) {
  for (const auto& p : problems) {
    if (p.find(s) != std::string::npos) {
      return true;
    }
  }
  return false;
}

std::string joined(const std::vector<std::string>& problems) {
  std::string out;
  for (const auto& p : problems) {
    out += p + "\n";
  }
  return out;
}

// 0[0] -> 1[0] -> 2[0] -> 3[0]
TEST(SyncPlan, AChainNeedsNothing) {
  const Dag chain = make_dag(4, {{0, 1}, {1, 2}, {2, 3}});
  const SyncPlan plan = plan_sync(chain, {0, 0, 0, 0}, 4);
  EXPECT_EQ(plan.num_events(), 0);
  EXPECT_EQ(plan.num_waits(), 0);
  EXPECT_EQ(plan.event, (std::vector<int>{-1, -1, -1, -1}));
  EXPECT_EQ(plan.keep, Lists(4));
  EXPECT_TRUE(plan.fork.empty());
  EXPECT_TRUE(plan.join.empty());
  EXPECT_EQ(plan.used_streams(), (std::vector<int>{0}));
  EXPECT_TRUE(verify_plan(chain, plan).empty());
}

//       0[0]
//      /    \          .
//   1[0]    2[1]
//      \    /
//       3[0]
TEST(SyncPlan, Diamond) {
  const Dag diamond = make_dag(4, {{0, 1}, {0, 2}, {1, 3}, {2, 3}});
  const SyncPlan plan = plan_sync(diamond, {0, 0, 1, 0}, 2);
  EXPECT_EQ(plan.event, (std::vector<int>{0, -1, 1, -1}));
  EXPECT_EQ(plan.event_node, (std::vector<int>{0, 2}));
  EXPECT_EQ(plan.event_stream, (std::vector<int>{0, 1}));
  EXPECT_EQ(plan.waits, (Lists{{}, {}, {0}, {1}}));
  EXPECT_EQ(plan.keep, (Lists{{}, {}, {0}, {2}}));
  EXPECT_EQ(plan.fork, (std::vector<int>{1}));
  // Stream 0 waited on 2, stream 1's last node: no join needed.
  EXPECT_TRUE(plan.join.empty());
  EXPECT_EQ(cross_stream_edges(diamond, plan.stream), 2);
  EXPECT_TRUE(verify_plan(diamond, plan).empty());
}

//   0[0] --> 1[1] --> 2[2]
//     `---------------^
// Stream 2 waits on 1's event only: stream 1 already waited for 0.
TEST(SyncPlan, WaitsImpliedByEarlierWaitsArePruned) {
  const Dag dag = make_dag(3, {{0, 1}, {0, 2}, {1, 2}});
  const SyncPlan plan = plan_sync(dag, {0, 1, 2}, 3);
  EXPECT_EQ(plan.event, (std::vector<int>{0, 1, -1}));
  EXPECT_EQ(plan.waits, (Lists{{}, {0}, {1}}));
  // Both producers' tensors are still read on stream 2.
  EXPECT_EQ(plan.keep, (Lists{{}, {0}, {0, 1}}));
  EXPECT_EQ(plan.fork, (std::vector<int>{1, 2}));
  EXPECT_EQ(plan.join, (std::vector<int>{2}));
  EXPECT_EQ(cross_stream_edges(dag, plan.stream), 3);
  EXPECT_TRUE(verify_plan(dag, plan).empty());
}

//   0[0] --> 1[0] --> 2[1]
//     `-------------> 3[1]
// Stream 1 learnt about 1 (and so 0) before 2; 3 needs no wait, and 0's
// event, which nobody waits on, is never recorded.
TEST(SyncPlan, UnneededEventsAreNotRecorded) {
  const Dag dag = make_dag(4, {{0, 1}, {1, 2}, {0, 3}});
  const SyncPlan plan = plan_sync(dag, {0, 0, 1, 1}, 2);
  EXPECT_EQ(plan.event, (std::vector<int>{-1, 0, -1, -1}));
  EXPECT_EQ(plan.waits, (Lists{{}, {}, {0}, {}}));
  EXPECT_EQ(plan.keep, (Lists{{}, {}, {1}, {0}}));
  EXPECT_EQ(plan.join, (std::vector<int>{1}));
  EXPECT_TRUE(verify_plan(dag, plan).empty());
}

//   0[1] --> 1[2]      2[0]
// Stream 2 knows the end of stream 1, so joining 2 joins both.
TEST(SyncPlan, JoinsOnlyWhatStreamZeroCannotInfer) {
  const Dag dag = make_dag(3, {{0, 1}});
  const SyncPlan plan = plan_sync(dag, {1, 2, 0}, 3);
  EXPECT_EQ(plan.fork, (std::vector<int>{1, 2}));
  EXPECT_EQ(plan.join, (std::vector<int>{2}));
  EXPECT_TRUE(verify_plan(dag, plan).empty());
}

//   0[0] ..> 1[1]     an order edge (in-place write after a read)
TEST(SyncPlan, OrderEdgesAreSynchronisedButKeepNothingAlive) {
  Dag dag(2);
  dag.add_edge(0, 1, EdgeKind::kOrder);
  const SyncPlan plan = plan_sync(dag, {0, 1}, 2);
  EXPECT_EQ(plan.waits, (Lists{{}, {0}}));
  EXPECT_EQ(plan.keep, Lists(2));
  EXPECT_TRUE(verify_plan(dag, plan).empty());
}

TEST(SyncPlan, RejectsAnAssignmentThatDoesNotFit) {
  const Dag dag = make_dag(2, {{0, 1}});
  EXPECT_THROW(plan_sync(dag, {0}, 2), std::invalid_argument);
  try {
    plan_sync(dag, {0, 2}, 2);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(
        std::string(e.what()).find("node 1 is assigned stream 2, outside 0..1"),
        std::string::npos)
        << e.what();
  }
}

// The verifier on broken versions of the diamond's plan.
TEST(Verifier, FindsEveryKindOfBrokenPlan) {
  const Dag diamond = make_dag(4, {{0, 1}, {0, 2}, {1, 3}, {2, 3}});
  const SyncPlan good = plan_sync(diamond, {0, 0, 1, 0}, 2);
  ASSERT_TRUE(verify_plan(diamond, good).empty());

  SyncPlan no_wait = good;
  no_wait.waits[3].clear();
  auto problems = verify_plan(diamond, no_wait);
  EXPECT_TRUE(mentions(
      problems,
      "edge 2 -> 3 crosses from stream 1 to 0 with no record/wait chain"))
      << joined(problems);

  SyncPlan early = good;
  early.waits[2] = {1}; // event 1 follows node 2 itself
  problems = verify_plan(diamond, early);
  EXPECT_TRUE(mentions(
      problems,
      "before node 2, stream 1 waits on event 1, which has not been "
      "recorded yet"))
      << joined(problems);

  SyncPlan unforked = good;
  unforked.fork.clear();
  problems = verify_plan(diamond, unforked);
  EXPECT_TRUE(
      mentions(problems, "stream 1 runs node 2 but never waits for the entry"))
      << joined(problems);

  SyncPlan unjoined = good;
  unjoined.waits[3].clear();
  problems = verify_plan(diamond, unjoined);
  EXPECT_TRUE(mentions(
      problems, "stream 1's last work is not joined into stream 0 at exit"))
      << joined(problems);

  SyncPlan not_kept = good;
  not_kept.keep[3].clear();
  problems = verify_plan(diamond, not_kept);
  EXPECT_TRUE(mentions(
      problems,
      "edge 2 -> 3: node 2's tensors are read on stream 0 but not kept alive"))
      << joined(problems);

  SyncPlan twice = good;
  twice.event[1] = 0;
  problems = verify_plan(diamond, twice);
  EXPECT_TRUE(
      mentions(problems, "event 0 is recorded twice (after node 0 and node 1)"))
      << joined(problems);

  SyncPlan missing = good;
  missing.waits[2] = {7};
  problems = verify_plan(diamond, missing);
  EXPECT_TRUE(mentions(problems, "waits on event 7, which does not exist"))
      << joined(problems);

  SyncPlan bad_fork = good;
  bad_fork.fork = {0, 1};
  problems = verify_plan(diamond, bad_fork);
  EXPECT_TRUE(mentions(problems, "fork names stream 0, not a side stream"))
      << joined(problems);

  SyncPlan short_plan = good;
  short_plan.keep.pop_back();
  problems = verify_plan(diamond, short_plan);
  EXPECT_TRUE(mentions(problems, "keep has 3 entries for 4 nodes"))
      << joined(problems);
}

TEST(Schedule, VerifiesWhenAsked) {
  const Dag diamond = make_dag(4, {{0, 1}, {0, 2}, {1, 3}, {2, 3}});
  ScheduleOptions options;
  options.num_streams = 2;
  options.verify = true;
  const Schedule s = schedule(diamond, options);
  EXPECT_EQ(s.assignment.strategy, Strategy::kMinSync);
  EXPECT_EQ(s.plan.stream, (std::vector<int>{0, 0, 1, 0}));
  EXPECT_EQ(s.cross_stream_edges, 2);
  EXPECT_EQ(s.plan.num_waits(), 2);
}

} // namespace
} // namespace torch_stage::schedule
