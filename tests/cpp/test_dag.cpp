// Tests of the scheduler's graph type (csrc/schedule/dag.h).
#include "schedule/dag.h"

#include <gtest/gtest.h>

#include <limits>
#include <stdexcept>
#include <string>

#include "schedule_test_util.h"

namespace torch_stage::schedule {
namespace {

using testing::expect_invalid;

TEST(Dag, KeepsEdgesSortedAndDeduplicated) {
  //  0 --> 2
  //  1 --> 2 --> 3      (2 -> 3 added twice: once as order, once as data)
  Dag dag(4);
  dag.add_edge(1, 2);
  dag.add_edge(0, 2);
  dag.add_edge(2, 3, EdgeKind::kOrder);
  dag.add_edge(2, 3, EdgeKind::kData);
  dag.add_edge(0, 2);
  EXPECT_EQ(dag.num_edges(), 3);
  EXPECT_EQ(dag.predecessors(2), (std::vector<int>{0, 1}));
  EXPECT_EQ(dag.successors(0), (std::vector<int>{2}));
  ASSERT_EQ(dag.predecessor_kinds(3).size(), 1u);
  // Data wins over order: the edge carries a tensor.
  EXPECT_EQ(dag.predecessor_kinds(3)[0], EdgeKind::kData);
  const auto edges = dag.edges();
  ASSERT_EQ(edges.size(), 3u);
  EXPECT_EQ(edges[0].from, 0);
  EXPECT_EQ(edges[0].to, 2);
  EXPECT_EQ(edges[2].from, 2);
  EXPECT_EQ(edges[2].to, 3);
}

TEST(Dag, OrderEdgeStaysOrderUnlessDataIsAdded) {
  Dag dag(2);
  dag.add_edge(0, 1, EdgeKind::kOrder);
  dag.add_edge(0, 1, EdgeKind::kOrder);
  EXPECT_EQ(dag.predecessor_kinds(1)[0], EdgeKind::kOrder);
}

TEST(Dag, RejectsBadInputNamingTheValue) {
  Dag dag(3);
  expect_invalid(
      [&] { dag.add_edge(2, 1); }, "edge 2 -> 1 does not go forward");
  expect_invalid([&] { dag.add_edge(1, 1); }, "edge 1 -> 1");
  expect_invalid([&] { dag.add_edge(0, 3); }, "edge target 3 is not a node");
  expect_invalid([&] { dag.add_edge(-1, 2); }, "edge source -1");
  expect_invalid([&] { dag.set_cost(0, -1.0); }, "got -1");
  expect_invalid(
      [&] { dag.set_cost(0, std::numeric_limits<double>::infinity()); },
      "finite");
  expect_invalid([&] { dag.fix_stream(0, -2); }, "got -2 for node 0");
  expect_invalid([&] { dag.set_colocation_group(1, -3); }, "got -3");
  expect_invalid([] { Dag bad(-1); }, "got -1");
}

TEST(Dag, InducedSubgraphRenumbersAndKeepsAttributes) {
  //  0 --> 1 --> 2 --> 3
  //        `----------^
  Dag dag(4);
  dag.add_edge(0, 1);
  dag.add_edge(1, 2);
  dag.add_edge(2, 3);
  dag.add_edge(1, 3, EdgeKind::kOrder);
  dag.set_cost(3, 7.0);
  dag.fix_stream(1, 2);
  dag.set_colocation_group(3, 5);
  const Dag sub = dag.induced({1, 3});
  ASSERT_EQ(sub.size(), 2);
  EXPECT_EQ(sub.num_edges(), 1);
  EXPECT_EQ(sub.predecessors(1), (std::vector<int>{0}));
  EXPECT_EQ(sub.predecessor_kinds(1)[0], EdgeKind::kOrder);
  EXPECT_EQ(sub.fixed_stream(0), 2);
  EXPECT_EQ(sub.cost(1), 7.0);
  EXPECT_EQ(sub.colocation_group(1), 5);
  expect_invalid([&] { (void)dag.induced({2, 1}); }, "sorted and distinct");
}

} // namespace
} // namespace torch_stage::schedule
