// Stream assignment strategies (csrc/schedule/strategies.h) on graphs drawn
// below, with every node's stream asserted. Nodes are numbered in issue
// order; arrows point from producer to consumer.
#include "schedule/strategies.h"

#include <gtest/gtest.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "schedule/matching.h"

#include "schedule_test_util.h"

namespace torch_stage::schedule {
namespace {

using Edges = std::vector<std::pair<int, int>>;

Dag make_dag(int n, const Edges& edges) {
  Dag dag(n);
  for (const auto& [u, v] : edges) {
    dag.add_edge(u, v);
  }
  return dag;
}

std::vector<int> assign(
    const Dag& dag,
    Strategy strategy,
    int num_streams,
    std::vector<std::vector<int>> embedding = {}) {
  AssignOptions options;
  options.strategy = strategy;
  options.num_streams = num_streams;
  options.embedding_groups = std::move(embedding);
  const Assignment a = assign_streams(dag, options);
  EXPECT_EQ(a.strategy, strategy);
  return a.stream;
}

using testing::expect_invalid;

const std::vector<Strategy> kStrategies = {
    Strategy::kMinSync,
    Strategy::kCriticalPath,
    Strategy::kEmbedding,
    Strategy::kUser};

// 0 -> 1 -> 2 -> 3 -> 4
TEST(Strategies, AChainGetsOneStream) {
  const Dag chain = make_dag(5, {{0, 1}, {1, 2}, {2, 3}, {3, 4}});
  for (const Strategy s : kStrategies) {
    for (const int n : {1, 2, 4, 32}) {
      EXPECT_EQ(assign(chain, s, n), (std::vector<int>{0, 0, 0, 0, 0}))
          << strategy_name(s) << " with " << n << " streams";
    }
  }
}

//     0
//    / \       .
//   1   2
//    \ /
//     3
TEST(Strategies, Diamond) {
  const Dag diamond = make_dag(4, {{0, 1}, {0, 2}, {1, 3}, {2, 3}});
  const std::vector<int> expected = {0, 0, 1, 0};
  EXPECT_EQ(assign(diamond, Strategy::kMinSync, 4), expected);
  EXPECT_EQ(assign(diamond, Strategy::kCriticalPath, 4), expected);
  EXPECT_EQ(assign(diamond, Strategy::kEmbedding, 4), expected);
  EXPECT_EQ(
      assign(diamond, Strategy::kUser, 4), (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(
      assign(diamond, Strategy::kMinSync, 1), (std::vector<int>{0, 0, 0, 0}));
}

// An Inception block: a stem, four branches of 1, 2, 3 and 2 nodes, concat.
//
//              0
//      ,-----+-+-----+-----.
//      1     2       4     7
//      |     3       5     8
//      |     |       6     |
//      `-----+---+---+-----'
//                9
Dag inception() {
  return make_dag(
      10,
      {{0, 1},
       {0, 2},
       {2, 3},
       {0, 4},
       {4, 5},
       {5, 6},
       {0, 7},
       {7, 8},
       {1, 9},
       {3, 9},
       {6, 9},
       {8, 9}});
}

TEST(Strategies, InceptionBlockMinSync) {
  // Chains: [0 1 9] [2 3] [4 5 6] [7 8]; the one ending in the output keeps
  // stream 0, the others go to the least loaded stream.
  EXPECT_EQ(
      assign(inception(), Strategy::kMinSync, 4),
      (std::vector<int>{0, 0, 1, 1, 2, 2, 2, 3, 3, 0}));
  // Folded onto two: [4 5 6] joins [2 3] on stream 1 (load 2 < 3), then
  // [7 8] goes back to stream 0 (load 3 < 5).
  EXPECT_EQ(
      assign(inception(), Strategy::kMinSync, 2),
      (std::vector<int>{0, 0, 1, 1, 1, 1, 1, 0, 0, 0}));
  int chains = 0;
  int merged = 0;
  EXPECT_EQ(min_chain_groups(inception(), &chains, &merged).size(), 4u);
  EXPECT_EQ(chains, 4);
  EXPECT_EQ(merged, 4);
  EXPECT_EQ(width(inception()), 4);
}

TEST(Strategies, InceptionBlockCriticalPath) {
  // Unit costs. The longest branch (4 5 6) goes first and stays on the
  // stem's stream; each other branch starts on the earliest free stream.
  EXPECT_EQ(
      assign(inception(), Strategy::kCriticalPath, 4),
      (std::vector<int>{0, 3, 1, 1, 0, 0, 0, 2, 2, 0}));
}

// Eight towers of three nodes, a concat and a two-node MLP on top:
//
//   0   3   6   9  12  15  18  21
//   1   4   7  10  13  16  19  22
//   2   5   8  11  14  17  20  23
//    `---`---`---`-+-'---'---'---'
//                 24
//                 25
//                 26
Dag towers() {
  Edges edges;
  for (int t = 0; t < 8; ++t) {
    edges.push_back({3 * t, 3 * t + 1});
    edges.push_back({3 * t + 1, 3 * t + 2});
    edges.push_back({3 * t + 2, 24});
  }
  edges.push_back({24, 25});
  edges.push_back({25, 26});
  return make_dag(27, edges);
}

std::vector<int> tower_streams(const std::vector<int>& tower, int top) {
  std::vector<int> out;
  for (const int s : tower) {
    out.insert(out.end(), {s, s, s});
  }
  out.insert(out.end(), {top, top, top});
  return out;
}

TEST(Strategies, EightTowers) {
  EXPECT_EQ(
      assign(towers(), Strategy::kMinSync, 8),
      tower_streams({0, 1, 2, 3, 4, 5, 6, 7}, 0));
  // Folded onto four by load: tower 0 shares stream 0 with the MLP.
  EXPECT_EQ(
      assign(towers(), Strategy::kMinSync, 4),
      tower_streams({0, 1, 2, 3, 1, 2, 3, 0}, 0));
  // One embedding group per tower (seeded by its first node), round robin.
  std::vector<std::vector<int>> lookups;
  for (int t = 0; t < 8; ++t) {
    lookups.push_back({3 * t});
  }
  EXPECT_EQ(
      assign(towers(), Strategy::kEmbedding, 4, lookups),
      tower_streams({0, 1, 2, 3, 0, 1, 2, 3}, 0));
  EXPECT_EQ(
      assign(towers(), Strategy::kUser, 4),
      tower_streams({0, 0, 0, 0, 0, 0, 0, 0}, 0));
  EXPECT_EQ(width(towers()), 8);
}

// Eight independent towers of three nodes, no join:
//
//   0   3   6   9  12  15  18  21
//   1   4   7  10  13  16  19  22
//   2   5   8  11  14  17  20  23
TEST(Strategies, EightIndependentTowers) {
  Edges edges;
  for (int t = 0; t < 8; ++t) {
    edges.push_back({3 * t, 3 * t + 1});
    edges.push_back({3 * t + 1, 3 * t + 2});
  }
  const Dag dag = make_dag(24, edges);
  auto expand = [](const std::vector<int>& tower) {
    std::vector<int> out;
    for (const int s : tower) {
      out.insert(out.end(), {s, s, s});
    }
    return out;
  };
  // The tower holding the last node (7) stays on the caller's stream; the
  // others fill the remaining streams in order.
  EXPECT_EQ(
      assign(dag, Strategy::kMinSync, 8), expand({1, 2, 3, 4, 5, 6, 7, 0}));
  // Onto four streams by load: two towers each.
  EXPECT_EQ(
      assign(dag, Strategy::kMinSync, 4), expand({1, 2, 3, 0, 1, 2, 3, 0}));
  EXPECT_EQ(
      assign(dag, Strategy::kCriticalPath, 8),
      expand({0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(width(dag), 8);
}

// Embedding groups grow backwards over what only feeds them (index
// preparation 0, 2) and forwards over what only they feed (pooling 4, 5);
// the dense node 6 and the concat 7 are left to min_sync, whose one chain
// holds the output and so stays on stream 0.
//
//   0     2
//   1     3    6
//   4     5    |
//    `--7-'----'
TEST(Strategies, EmbeddingGroupsTakeWhatHangsOnlyOffThem) {
  const Dag g =
      make_dag(8, {{0, 1}, {2, 3}, {1, 4}, {3, 5}, {4, 7}, {5, 7}, {6, 7}});
  EXPECT_EQ(
      assign(g, Strategy::kEmbedding, 4, {{1}, {3}}),
      (std::vector<int>{0, 0, 1, 1, 0, 1, 0, 0}));
  // Three lookups on two streams: round robin puts the third on stream 0;
  // the dense chain 6 7 ends in the output 8, so it stays on stream 0 too.
  const Dag three = make_dag(
      9, {{0, 1}, {2, 3}, {4, 5}, {1, 8}, {3, 8}, {5, 8}, {6, 7}, {7, 8}});
  //   0   2   4   6
  //   1   3   5   7
  //    `--`-8-'---'
  EXPECT_EQ(
      assign(three, Strategy::kEmbedding, 2, {{0}, {2}, {4}}),
      (std::vector<int>{0, 0, 1, 1, 0, 0, 0, 0, 0}));
}

// The two-tower regression of DeepRec's MultiStream doc:
//
//   X: 0 -> 1 -> 2 --.
//                     6 (loss)
//   Y: 3 -> 4 -> 5 --'
Dag two_towers() {
  return make_dag(7, {{0, 1}, {1, 2}, {3, 4}, {4, 5}, {2, 6}, {5, 6}});
}

TEST(Strategies, FixedPlacementsAreHonouredByEveryStrategy) {
  Dag dag = two_towers();
  for (int v = 0; v < 3; ++v) {
    dag.fix_stream(v, 0);
    dag.fix_stream(v + 3, 1);
  }
  for (const Strategy s : kStrategies) {
    EXPECT_EQ(assign(dag, s, 2), (std::vector<int>{0, 0, 0, 1, 1, 1, 0}))
        << strategy_name(s);
  }
  // The other way round: the loss follows X's chain under min_sync (its
  // group votes for stream 1) and stays on stream 0 under user.
  Dag swapped = two_towers();
  for (int v = 0; v < 3; ++v) {
    swapped.fix_stream(v, 1);
    swapped.fix_stream(v + 3, 0);
  }
  EXPECT_EQ(
      assign(swapped, Strategy::kMinSync, 2),
      (std::vector<int>{1, 1, 1, 0, 0, 0, 1}));
  EXPECT_EQ(
      assign(swapped, Strategy::kUser, 2),
      (std::vector<int>{1, 1, 1, 0, 0, 0, 0}));
  EXPECT_EQ(
      assign(swapped, Strategy::kCriticalPath, 4),
      (std::vector<int>{1, 1, 1, 0, 0, 0, 1}));
}

TEST(Strategies, ColocationGroupsShareAStream) {
  // Towers of two_towers(); node 4 is colocated with node 1, which is fixed
  // on stream 3; nodes 0 and 5 form an unfixed group, which takes the
  // stream of its lowest-numbered member (0).
  Dag dag = two_towers();
  dag.fix_stream(1, 3);
  dag.set_colocation_group(1, 7);
  dag.set_colocation_group(4, 7);
  dag.set_colocation_group(0, 9);
  dag.set_colocation_group(5, 9);
  for (const Strategy s : kStrategies) {
    const auto streams = assign(dag, s, 4);
    EXPECT_EQ(streams[1], 3) << strategy_name(s);
    EXPECT_EQ(streams[4], 3) << strategy_name(s);
    EXPECT_EQ(streams[5], streams[0]) << strategy_name(s);
  }
  EXPECT_EQ(
      assign(dag, Strategy::kUser, 4), (std::vector<int>{0, 3, 0, 0, 3, 0, 0}));
}

TEST(Strategies, ConflictingColocationIsAnError) {
  Dag dag = two_towers();
  dag.fix_stream(0, 0);
  dag.fix_stream(3, 1);
  dag.set_colocation_group(0, 2);
  dag.set_colocation_group(3, 2);
  expect_invalid(
      [&] { assign_streams(dag, AssignOptions{}); },
      "colocation group 2 holds node 0 placed on stream 0 and node 3 placed "
      "on stream 1");
}

//   0 (cost 1) -> 1 (cost 0: a view) -> 3 (cost 1)
//   2 (cost 5) --------------------------^
TEST(Strategies, ZeroCostNodesFollowTheirProducer) {
  Dag dag = make_dag(4, {{0, 1}, {1, 3}, {2, 3}});
  dag.set_cost(1, 0.0);
  dag.set_cost(2, 5.0);
  // 2 (rank 6) starts first on stream 0; 0 goes to stream 1; the view 1
  // follows 0 there although stream 0 is no busier at that time.
  EXPECT_EQ(
      assign(dag, Strategy::kCriticalPath, 2), (std::vector<int>{1, 1, 0, 0}));
}

//   0 (1) -> 1 (10) -> 3 (10) -> 4 (1)
//    `----> 2 (1) ------------^
TEST(Strategies, CriticalPathKeepsTheLongPathTogether) {
  Dag dag = make_dag(5, {{0, 1}, {0, 2}, {1, 3}, {2, 4}, {3, 4}});
  dag.set_cost(1, 10.0);
  dag.set_cost(3, 10.0);
  EXPECT_EQ(
      assign(dag, Strategy::kCriticalPath, 2),
      (std::vector<int>{0, 0, 1, 0, 0}));
}

// Nimble merges whole chains, and on some graphs that leaves more streams
// than the width. Here the first matching yields the chains [0 2] [1 3 4]
// [5 6] [7], no chain's end reaches another's start, so they stay 4; the
// width is 3 ({4, 6, 7}), reached by re-linking: [0 2 6] [1 3 4] [5 7].
//
//   0          1        5
//   |          |       / \          .
//   v          v      v   v
//   2 -------> 3 ---> 6   7
//   |  0 -> 3  |      ^
//   |          v      |
//   |          4      |
//   `-----------------'   (2 -> 6)
std::vector<int> critical_path(
    const Dag& dag,
    int num_streams,
    double sync_cost) {
  AssignOptions options;
  options.strategy = Strategy::kCriticalPath;
  options.num_streams = num_streams;
  options.sync_cost = sync_cost;
  return assign_streams(dag, options).stream;
}

// Two branches of cost `branch` between a stem and a join (unit costs):
//
//     0
//    / \       .
//   1   2
//    \ /
//     3
Dag weighted_diamond(double branch) {
  Dag dag = make_dag(4, {{0, 1}, {0, 2}, {1, 3}, {2, 3}});
  dag.set_cost(1, branch);
  dag.set_cost(2, branch);
  return dag;
}

TEST(Strategies, CriticalPathSpreadsOnlyWorkThatPaysForItsEvents) {
  // Without a sync cost any parallel work moves to a stream of its own.
  EXPECT_EQ(
      critical_path(weighted_diamond(0.5), 4, 0.0),
      (std::vector<int>{0, 0, 1, 0}));
  // Branches of 0.5 against two syncs of 1 (fork and join): one stream
  // finishes at 3, two at 4.
  EXPECT_EQ(
      critical_path(weighted_diamond(0.5), 4, 1.0),
      (std::vector<int>{0, 0, 0, 0}));
  // Branches of 10: on one stream the join ends at 22, with the second
  // branch on stream 1 at 1 + 1 + 10 + 1 = 13 (where the join goes: its
  // input from stream 0 arrives at 12, the one from stream 1 at 12).
  EXPECT_EQ(
      critical_path(weighted_diamond(10.0), 4, 1.0),
      (std::vector<int>{0, 0, 1, 1}));
  // Two independent nodes read only the graph's inputs, on stream 0:
  // another stream gets them through the fork's event.
  Dag pair(2);
  pair.set_cost(0, 0.5);
  pair.set_cost(1, 0.5);
  EXPECT_EQ(critical_path(pair, 4, 1.0), (std::vector<int>{0, 0}));
  pair.set_cost(0, 10.0);
  pair.set_cost(1, 10.0);
  EXPECT_EQ(critical_path(pair, 4, 1.0), (std::vector<int>{0, 1}));
  // A chain never leaves its stream, whatever the costs.
  Dag chain = make_dag(4, {{0, 1}, {1, 2}, {2, 3}});
  EXPECT_EQ(critical_path(chain, 4, 3.0), (std::vector<int>{0, 0, 0, 0}));
}

TEST(Strategies, ASyncCostMustBeAFiniteNumberAtLeastZero) {
  AssignOptions options;
  options.strategy = Strategy::kCriticalPath;
  for (const double bad :
       {-1.0,
        std::numeric_limits<double>::infinity(),
        std::numeric_limits<double>::quiet_NaN()}) {
    options.sync_cost = bad;
    expect_invalid(
        [&] { assign_streams(inception(), options); },
        "sync_cost must be a finite number >= 0");
  }
}

TEST(Strategies, ChainMergeCanExceedTheWidthAndIsRepaired) {
  const Dag dag = make_dag(
      8,
      {{0, 2}, {0, 3}, {1, 3}, {2, 3}, {3, 4}, {2, 6}, {3, 6}, {5, 6}, {5, 7}});
  int chains = 0;
  int merged = 0;
  const auto groups = min_chain_groups(dag, &chains, &merged);
  EXPECT_EQ(chains, 4);
  EXPECT_EQ(merged, 4);
  EXPECT_EQ(width(dag), 3);
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(
      groups, (std::vector<std::vector<int>>{{0, 2, 6}, {1, 3, 4}, {5, 7}}));
  const BitMatrix reach = reachability(dag);
  std::vector<int> seen(8, 0);
  for (const auto& g : groups) {
    for (size_t k = 0; k < g.size(); ++k) {
      ++seen[g[k]];
      if (k > 0) {
        EXPECT_TRUE(reach.test(g[k - 1], g[k])) << g[k - 1] << " " << g[k];
      }
    }
  }
  EXPECT_EQ(seen, std::vector<int>(8, 1));
  // [5 7] holds the last node: stream 0; the others by load.
  EXPECT_EQ(
      assign(dag, Strategy::kMinSync, 4),
      (std::vector<int>{1, 2, 1, 2, 2, 0, 1, 0}));
}

TEST(Strategies, AutoRule) {
  AssignOptions options;
  std::string reason;
  EXPECT_EQ(choose_strategy(inception(), options, &reason), Strategy::kMinSync);
  EXPECT_NE(reason.find("default"), std::string::npos);
  options.costs_known = true;
  EXPECT_EQ(
      choose_strategy(inception(), options, &reason), Strategy::kCriticalPath);
  options.embedding_groups = {{1}, {2}};
  EXPECT_EQ(
      choose_strategy(inception(), options, &reason), Strategy::kEmbedding);
  Dag fixed = make_dag(2, {{0, 1}});
  fixed.fix_stream(0, 1);
  fixed.fix_stream(1, 0);
  EXPECT_EQ(choose_strategy(fixed, options, &reason), Strategy::kUser);
  EXPECT_EQ(reason, "auto: every node has a stream annotation");
  AssignOptions plain;
  EXPECT_EQ(
      choose_strategy(Dag(kAutoMinSyncNodes + 1), plain, &reason),
      Strategy::kCriticalPath);
  // assign_streams reports what auto chose, and why.
  plain.num_streams = 4;
  const Assignment a = assign_streams(inception(), plain);
  EXPECT_EQ(a.strategy, Strategy::kMinSync);
  EXPECT_EQ(a.stream, (std::vector<int>{0, 0, 1, 1, 2, 2, 2, 3, 3, 0}));
}

TEST(Strategies, BadInputIsAClearError) {
  AssignOptions options;
  options.num_streams = 0;
  expect_invalid(
      [&] { assign_streams(inception(), options); },
      "num_streams must be in 1..32");
  options.num_streams = 33;
  expect_invalid([&] { assign_streams(inception(), options); }, "got 33");
  Dag dag = two_towers();
  dag.fix_stream(2, 4);
  options.num_streams = 4;
  expect_invalid(
      [&] { assign_streams(dag, options); },
      "node 2 is placed on stream 4, outside the pool of 4 streams (valid: "
      "0..3)");
  expect_invalid(
      [] { parse_strategy("fastest"); },
      "unknown strategy 'fastest': use one of 'auto', 'min_sync'");
  options.strategy = Strategy::kEmbedding;
  options.embedding_groups = {{9}};
  expect_invalid(
      [&] { assign_streams(two_towers(), options); },
      "embedding group 0 names node 9");
  expect_invalid(
      [] { min_chain_groups(Dag(kMaxMinSyncNodes + 1)); },
      "use strategy 'critical_path'");
}

TEST(Strategies, NamesRoundTrip) {
  for (const Strategy s :
       {Strategy::kAuto,
        Strategy::kMinSync,
        Strategy::kCriticalPath,
        Strategy::kEmbedding,
        Strategy::kUser}) {
    EXPECT_EQ(parse_strategy(strategy_name(s)), s);
  }
}

} // namespace
} // namespace torch_stage::schedule
