// Tests of reachability, transitive reduction and Hopcroft-Karp
// (csrc/schedule/matching.h), against brute force on many random graphs.
#include "schedule/matching.h"

#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <vector>

namespace torch_stage::schedule {
namespace {

Dag random_dag(std::mt19937& rng, int n, double p) {
  Dag dag(n);
  std::bernoulli_distribution edge(p);
  for (int u = 0; u < n; ++u) {
    for (int v = u + 1; v < n; ++v) {
      if (edge(rng)) {
        dag.add_edge(u, v);
      }
    }
  }
  return dag;
}

// Simple augmenting-path matching (Kuhn), the reference.
int kuhn(int num_right, const std::vector<std::vector<int>>& adj) {
  std::vector<int> right(num_right, -1);
  int size = 0;
  for (size_t u = 0; u < adj.size(); ++u) {
    std::vector<bool> seen(num_right, false);
    std::function<bool(int)> augment = [&](int x) {
      for (const int v : adj[x]) {
        if (seen[v]) {
          continue;
        }
        seen[v] = true;
        if (right[v] < 0 || augment(right[v])) {
          right[v] = x;
          return true;
        }
      }
      return false;
    };
    size += augment(static_cast<int>(u)) ? 1 : 0;
  }
  return size;
}

void expect_valid(
    const Matching& m,
    int num_right,
    const std::vector<std::vector<int>>& adj) {
  ASSERT_EQ(m.left.size(), adj.size());
  ASSERT_EQ(static_cast<int>(m.right.size()), num_right);
  for (size_t u = 0; u < adj.size(); ++u) {
    const int v = m.left[u];
    if (v < 0) {
      continue;
    }
    EXPECT_EQ(m.right[v], static_cast<int>(u));
    EXPECT_NE(std::find(adj[u].begin(), adj[u].end(), v), adj[u].end())
        << "matched along a non-edge " << u << "-" << v;
  }
  for (int v = 0; v < num_right; ++v) {
    if (m.right[v] >= 0) {
      EXPECT_EQ(m.left[m.right[v]], v);
    }
  }
}

TEST(BitMatrix, SetTestAndNextWithExclusion) {
  BitMatrix m(2, 130);
  m.set(0, 3);
  m.set(0, 64);
  m.set(0, 129);
  EXPECT_TRUE(m.test(0, 64));
  EXPECT_FALSE(m.test(1, 64));
  EXPECT_EQ(m.next(0, 0, nullptr), 3);
  EXPECT_EQ(m.next(0, 4, nullptr), 64);
  EXPECT_EQ(m.next(0, 65, nullptr), 129);
  EXPECT_EQ(m.next(0, 130, nullptr), -1);
  EXPECT_EQ(m.next(1, 0, nullptr), -1);
  std::vector<uint64_t> exclude(m.words_per_row(), 0);
  exclude[1] = uint64_t{1}; // column 64
  EXPECT_EQ(m.next(0, 4, exclude.data()), 129);
}

TEST(Reachability, MatchesDepthFirstSearch) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const Dag dag = random_dag(rng, 1 + trial % 40, 0.1);
    const BitMatrix reach = reachability(dag);
    for (int u = 0; u < dag.size(); ++u) {
      std::vector<bool> seen(dag.size(), false);
      std::vector<int> stack(dag.successors(u));
      while (!stack.empty()) {
        const int v = stack.back();
        stack.pop_back();
        if (seen[v]) {
          continue;
        }
        seen[v] = true;
        for (const int w : dag.successors(v)) {
          stack.push_back(w);
        }
      }
      for (int v = 0; v < dag.size(); ++v) {
        ASSERT_EQ(reach.test(u, v), seen[v]) << u << " -> " << v;
      }
    }
  }
}

TEST(TransitiveReduction, KeepsExactlyTheEdgesNoOtherPathImplies) {
  //  0 --> 1 --> 2
  //  `-----------^      0 -> 2 is implied by 0 -> 1 -> 2
  Dag dag(3);
  dag.add_edge(0, 1);
  dag.add_edge(1, 2);
  dag.add_edge(0, 2);
  const auto meg = transitive_reduction(dag, reachability(dag));
  EXPECT_EQ(meg[0], (std::vector<int>{1}));
  EXPECT_EQ(meg[1], (std::vector<int>{2}));
  EXPECT_TRUE(meg[2].empty());

  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const Dag g = random_dag(rng, 2 + trial % 30, 0.3);
    const BitMatrix reach = reachability(g);
    const auto kept = transitive_reduction(g, reach);
    // Same reachability, and no kept edge is implied by another path.
    Dag reduced(g.size());
    for (int u = 0; u < g.size(); ++u) {
      for (const int v : kept[u]) {
        reduced.add_edge(u, v);
      }
    }
    const BitMatrix reach2 = reachability(reduced);
    for (int u = 0; u < g.size(); ++u) {
      for (int v = 0; v < g.size(); ++v) {
        ASSERT_EQ(reach.test(u, v), reach2.test(u, v));
      }
      for (const int v : kept[u]) {
        for (const int w : kept[u]) {
          ASSERT_FALSE(w != v && reach.test(w, v))
              << u << " -> " << v << " is implied through " << w;
        }
      }
    }
  }
}

TEST(HopcroftKarp, FindsAMaximumMatchingOnListsAndBitRows) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 500; ++trial) {
    const int left = 1 + static_cast<int>(rng() % 25);
    const int right = 1 + static_cast<int>(rng() % 25);
    std::bernoulli_distribution edge(0.02 + (trial % 10) * 0.04);
    std::vector<std::vector<int>> adj(left);
    BitMatrix bits(left, right);
    for (int u = 0; u < left; ++u) {
      for (int v = 0; v < right; ++v) {
        if (edge(rng)) {
          adj[u].push_back(v);
          bits.set(u, v);
        }
      }
    }
    const int best = kuhn(right, adj);
    const Matching a = hopcroft_karp(right, adj);
    expect_valid(a, right, adj);
    EXPECT_EQ(a.size(), best);
    const Matching b = hopcroft_karp(bits);
    expect_valid(b, right, adj);
    EXPECT_EQ(b.size(), best);
  }
}

TEST(HopcroftKarp, AugmentsFromAGivenMatching) {
  // Left 0 - right 0 blocks left 1 (whose only neighbour is right 0) until
  // the augmenting path 1 -> 0 => 0 -> 1 moves left 0 over.
  std::vector<std::vector<int>> adj = {{0, 1}, {0}};
  Matching start;
  start.left = {0, -1};
  start.right = {0, -1};
  const Matching m = hopcroft_karp(2, adj, start);
  EXPECT_EQ(m.size(), 2);
  EXPECT_EQ(m.left[0], 1);
  EXPECT_EQ(m.left[1], 0);
}

TEST(HopcroftKarp, RejectsNeighboursOutsideTheRightSide) {
  EXPECT_THROW(hopcroft_karp(2, {{0, 2}}), std::invalid_argument);
}

} // namespace
} // namespace torch_stage::schedule
