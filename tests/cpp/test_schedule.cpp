// Properties of the whole scheduler (csrc/schedule/schedule.h) over
// thousands of random DAGs, every strategy and several pool sizes, and a
// 10,000-node graph planned by every strategy.
#include "schedule/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace torch_stage::schedule {
namespace {

enum class Shape { kRandom, kLayered, kTowers };

// Random DAGs in three shapes: uniform random edges along the numbering;
// layers like a network's (each node reads one to three nodes of the
// previous two layers); independent towers joined at the end.
Dag random_dag(std::mt19937& rng, Shape shape, int n) {
  Dag dag(n);
  auto pick = [&rng](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  switch (shape) {
    case Shape::kRandom: {
      std::bernoulli_distribution edge(
          std::uniform_real_distribution<>(0.0, 0.4)(rng));
      for (int u = 0; u < n; ++u) {
        for (int v = u + 1; v < n; ++v) {
          if (edge(rng)) {
            dag.add_edge(u, v);
          }
        }
      }
      break;
    }
    case Shape::kLayered: {
      const int layer_width = pick(1, 8);
      for (int v = layer_width; v < n; ++v) {
        const int layer_start = (v / layer_width) * layer_width;
        const int lo = std::max(0, layer_start - 2 * layer_width);
        for (int k = pick(1, 3); k > 0; --k) {
          const int u = pick(lo, layer_start - 1);
          dag.add_edge(u, v);
        }
      }
      break;
    }
    case Shape::kTowers: {
      const int towers = pick(1, 8);
      for (int v = towers; v < n - 1; ++v) {
        dag.add_edge(v - towers, v);
      }
      for (int v = std::max(0, n - 1 - towers); v < n - 1; ++v) {
        dag.add_edge(v, n - 1);
      }
      break;
    }
  }
  return dag;
}

struct Case {
  Dag dag;
  ScheduleOptions options;
  bool placements = false;
};

void decorate(std::mt19937& rng, Case& c) {
  auto chance = [&rng](double p) {
    return std::bernoulli_distribution(p)(rng);
  };
  const int n = c.dag.size();
  for (int v = 0; v < n; ++v) {
    c.dag.set_cost(v, chance(0.15) ? 0.0 : 1.0 + rng() % 100);
  }
  if (chance(0.3)) {
    c.placements = true;
    for (int v = 0; v < n; ++v) {
      if (chance(0.2)) {
        c.dag.fix_stream(v, static_cast<int>(rng() % c.options.num_streams));
      }
    }
    // Groups of unfixed nodes, plus at most one fixed member each.
    std::map<int, int> group_fixed;
    for (int v = 0; v < n; ++v) {
      if (!chance(0.2)) {
        continue;
      }
      const int group = static_cast<int>(rng() % 4);
      const int fixed = c.dag.fixed_stream(v);
      if (fixed != Dag::kNone) {
        auto [it, first] = group_fixed.emplace(group, fixed);
        if (!first && it->second != fixed) {
          continue;
        }
      }
      c.dag.set_colocation_group(v, group);
    }
  }
  if (chance(0.4) && n > 0) {
    for (int k = static_cast<int>(rng() % 5); k > 0; --k) {
      c.options.embedding_groups.push_back({static_cast<int>(rng() % n)});
    }
  }
}

void check(const Case& c, const Schedule& s, const std::string& where) {
  const Dag& dag = c.dag;
  const SyncPlan& plan = s.plan;
  const auto problems = verify_plan(dag, plan);
  ASSERT_TRUE(problems.empty()) << where << ": " << problems.front();
  for (int v = 0; v < dag.size(); ++v) {
    ASSERT_GE(plan.stream[v], 0) << where;
    ASSERT_LT(plan.stream[v], c.options.num_streams) << where;
    if (dag.fixed_stream(v) != Dag::kNone) {
      ASSERT_EQ(plan.stream[v], dag.fixed_stream(v)) << where << " node " << v;
    }
  }
  std::map<int, int> group_stream;
  for (int v = 0; v < dag.size(); ++v) {
    const int g = dag.colocation_group(v);
    if (g != Dag::kNone) {
      auto [it, first] = group_stream.emplace(g, plan.stream[v]);
      ASSERT_EQ(it->second, plan.stream[v]) << where << " group " << g;
    }
  }
  // Never more waits than edges crossing streams, nor more events than
  // producers with a consumer elsewhere.
  ASSERT_LE(plan.num_waits(), s.cross_stream_edges) << where;
  std::set<int> cross_producers;
  for (const Edge& e : dag.edges()) {
    if (plan.stream[e.from] != plan.stream[e.to]) {
      cross_producers.insert(e.from);
    }
  }
  ASSERT_LE(plan.num_events(), static_cast<int>(cross_producers.size()))
      << where;
  // One stream: nothing to synchronise.
  if (plan.used_streams().size() == 1 && plan.used_streams()[0] == 0) {
    ASSERT_EQ(plan.num_events(), 0) << where;
    ASSERT_TRUE(plan.fork.empty() && plan.join.empty()) << where;
  }
}

TEST(ScheduleProperties, RandomDagsEveryStrategy) {
  std::mt19937 rng(20240601);
  const std::vector<Strategy> strategies = {
      Strategy::kAuto,
      Strategy::kMinSync,
      Strategy::kCriticalPath,
      Strategy::kEmbedding,
      Strategy::kUser};
  int planned = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const Shape shape = static_cast<Shape>(trial % 3);
    const int n = 1 + static_cast<int>(rng() % 48);
    Case base;
    base.dag = random_dag(rng, shape, n);
    base.options.num_streams = std::vector<int>{1, 2, 3, 4, 8}[trial % 5];
    decorate(rng, base);
    const int w = width(base.dag);
    for (const Strategy strategy : strategies) {
      Case c = base;
      c.options.strategy = strategy;
      const std::string where = "trial " + std::to_string(trial) + " (" +
          strategy_name(strategy) + ", " +
          std::to_string(c.options.num_streams) + " streams, " +
          std::to_string(n) + " nodes)";
      const Schedule s = schedule(c.dag, c.options);
      ++planned;
      check(c, s, where);
      if (strategy == Strategy::kMinSync && !c.placements) {
        // The cover has exactly width-many chains; folding only merges.
        ASSERT_EQ(s.assignment.groups, w) << where;
        const int used = static_cast<int>(s.plan.used_streams().size());
        ASSERT_LE(used, w) << where;
        ASSERT_EQ(used, std::min(w, c.options.num_streams)) << where;
      }
      if (strategy == Strategy::kUser && !c.placements) {
        ASSERT_EQ(s.plan.num_events(), 0) << where;
      }
    }
  }
  EXPECT_EQ(planned, 3000 * 5);
}

TEST(ScheduleProperties, TenThousandNodesEveryStrategy) {
  std::mt19937 rng(5);
  Case c;
  c.dag = random_dag(rng, Shape::kLayered, 10000);
  c.options.num_streams = 4;
  for (int k = 0; k < 16; ++k) {
    c.options.embedding_groups.push_back({k * 600});
  }
  for (const Strategy strategy :
       {Strategy::kMinSync,
        Strategy::kCriticalPath,
        Strategy::kEmbedding,
        Strategy::kUser}) {
    c.options.strategy = strategy;
    const Schedule s = schedule(c.dag, c.options);
    check(c, s, strategy_name(strategy));
    EXPECT_EQ(static_cast<int>(s.plan.stream.size()), 10000);
  }
}

} // namespace
} // namespace torch_stage::schedule
