#include "schedule/strategies.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include "schedule/matching.h"

namespace torch_stage::schedule {

namespace {

void check_num_streams(int num_streams) {
  if (num_streams < 1 || num_streams > kMaxStreams) {
    throw std::invalid_argument(
        "num_streams must be in 1.." + std::to_string(kMaxStreams) +
        " (PyTorch's stream pool gives " + std::to_string(kMaxStreams) +
        " streams per priority before they alias), got " +
        std::to_string(num_streams));
  }
}

// Fixed streams inside the pool, and the fixed stream of each colocation
// group that has one (-1 where none).
std::unordered_map<int, int> check_placements(const Dag& dag, int num_streams) {
  std::unordered_map<int, int> group_fixed;
  std::unordered_map<int, int> group_fixed_node;
  for (int v = 0; v < dag.size(); ++v) {
    const int fixed = dag.fixed_stream(v);
    if (fixed >= num_streams) {
      throw std::invalid_argument(
          node_name(v) + " is placed on stream " + std::to_string(fixed) +
          ", outside the pool of " + std::to_string(num_streams) +
          " streams (valid: 0.." + std::to_string(num_streams - 1) + ")");
    }
    const int group = dag.colocation_group(v);
    if (group == Dag::kNone) {
      continue;
    }
    auto it = group_fixed.find(group);
    if (it == group_fixed.end()) {
      group_fixed.emplace(group, fixed);
      group_fixed_node.emplace(group, v);
    } else if (fixed != Dag::kNone) {
      if (it->second == Dag::kNone) {
        it->second = fixed;
        group_fixed_node[group] = v;
      } else if (it->second != fixed) {
        throw std::invalid_argument(
            "colocation group " + std::to_string(group) + " holds " +
            node_name(group_fixed_node[group]) + " placed on stream " +
            std::to_string(it->second) + " and " + node_name(v) +
            " placed on stream " + std::to_string(fixed) +
            ": colocated nodes must share one stream");
      }
    }
  }
  return group_fixed;
}

// Placement precedence over a strategy's choice: fixed streams, then
// colocation groups (a fixed member's stream, else the stream of the
// lowest-numbered member).
void apply_placements(
    const Dag& dag,
    const std::unordered_map<int, int>& group_fixed,
    std::vector<int>& stream) {
  std::unordered_map<int, int> group_stream;
  for (int v = 0; v < dag.size(); ++v) {
    if (dag.fixed_stream(v) != Dag::kNone) {
      stream[v] = dag.fixed_stream(v);
    }
    const int group = dag.colocation_group(v);
    if (group == Dag::kNone) {
      continue;
    }
    const int fixed = group_fixed.at(group);
    if (fixed != Dag::kNone) {
      stream[v] = fixed;
      continue;
    }
    auto [it, first] = group_stream.emplace(group, stream[v]);
    if (!first) {
      stream[v] = it->second;
    }
  }
}

// Folds groups onto the pool. A group with fixed members goes to their most
// common stream. The group holding the last node (usually the one producing
// the outputs) goes to stream 0, so the caller's stream needs no join for
// it. The others, in order of their first node, go to the stream with the
// least cost so far (then the fewest groups, then the lowest number).
void fold_groups(
    const Dag& dag,
    const std::vector<std::vector<int>>& groups,
    const std::vector<int>& node_ids,
    std::vector<double>& load,
    std::vector<int>& count,
    std::vector<int>& stream) {
  const int num_streams = static_cast<int>(load.size());
  std::vector<bool> placed(groups.size(), false);
  auto place = [&](size_t g, int s) {
    for (const int local : groups[g]) {
      stream[node_ids[local]] = s;
      load[s] += dag.cost(node_ids[local]);
    }
    ++count[s];
    placed[g] = true;
  };
  std::vector<int> votes(num_streams);
  size_t last_group = 0;
  int last_node = -1;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::fill(votes.begin(), votes.end(), 0);
    bool any = false;
    for (const int local : groups[g]) {
      const int fixed = dag.fixed_stream(node_ids[local]);
      if (fixed != Dag::kNone) {
        ++votes[fixed];
        any = true;
      }
      if (node_ids[local] > last_node) {
        last_node = node_ids[local];
        last_group = g;
      }
    }
    if (any) {
      place(
          g,
          static_cast<int>(
              std::max_element(votes.begin(), votes.end()) - votes.begin()));
    }
  }
  if (!groups.empty() && !placed[last_group]) {
    place(last_group, 0);
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    if (placed[g]) {
      continue;
    }
    int best = 0;
    for (int s = 1; s < num_streams; ++s) {
      if (std::tie(load[s], count[s]) < std::tie(load[best], count[best])) {
        best = s;
      }
    }
    place(g, best);
  }
}

std::vector<std::vector<int>> groups_from_matching(const Matching& m) {
  std::vector<std::vector<int>> groups;
  for (int v = 0; v < static_cast<int>(m.right.size()); ++v) {
    if (m.right[v] >= 0) {
      continue;
    }
    groups.emplace_back();
    for (int u = v; u >= 0; u = m.left[u]) {
      groups.back().push_back(u);
    }
  }
  return groups;
}

Assignment run_min_sync(const Dag& dag, int num_streams) {
  Assignment out;
  out.stream.assign(dag.size(), 0);
  const auto groups = min_chain_groups(dag, &out.chains, nullptr);
  out.groups = static_cast<int>(groups.size());
  std::vector<int> ids(dag.size());
  for (int v = 0; v < dag.size(); ++v) {
    ids[v] = v;
  }
  std::vector<double> load(num_streams, 0.0);
  std::vector<int> count(num_streams, 0);
  fold_groups(dag, groups, ids, load, count, out.stream);
  return out;
}

Assignment run_critical_path(
    const Dag& dag,
    int num_streams,
    double sync_cost,
    const std::unordered_map<int, int>& group_fixed) {
  const int n = dag.size();
  Assignment out;
  out.stream.assign(n, 0);
  // Longest weighted path from each node to an exit, the node included.
  std::vector<double> rank(n, 0.0);
  for (int u = n - 1; u >= 0; --u) {
    double tail = 0.0;
    for (const int s : dag.successors(u)) {
      tail = std::max(tail, rank[s]);
    }
    rank[u] = dag.cost(u) + tail;
  }
  auto later = [&rank](int a, int b) {
    // Highest rank first, then issue order.
    return rank[a] != rank[b] ? rank[a] < rank[b] : a > b;
  };
  std::priority_queue<int, std::vector<int>, decltype(later)> ready(later);
  std::vector<int> waiting(n);
  for (int v = 0; v < n; ++v) {
    waiting[v] = static_cast<int>(dag.predecessors(v).size());
    if (waiting[v] == 0) {
      ready.push(v);
    }
  }
  std::vector<double> finish(n, 0.0);
  std::vector<double> free_at(num_streams, 0.0);
  std::unordered_map<int, int> group_stream;
  // When u's inputs are ready on stream c. A node without predecessors
  // reads only the graph's inputs, made on the caller's stream 0: another
  // stream gets them through the fork's event.
  auto arrival = [&dag, sync_cost](
                     int u,
                     int c,
                     const std::vector<int>& stream,
                     const std::vector<double>& finish) {
    double ready = dag.predecessors(u).empty() && c != 0 ? sync_cost : 0.0;
    for (const int p : dag.predecessors(u)) {
      ready = std::max(ready, finish[p] + (stream[p] == c ? 0.0 : sync_cost));
    }
    return ready;
  };
  while (!ready.empty()) {
    const int u = ready.top();
    ready.pop();
    int producer = -1;
    for (const int p : dag.predecessors(u)) {
      if (producer < 0 || finish[p] > finish[producer]) {
        producer = p;
      }
    }
    const int group = dag.colocation_group(u);
    int s = -1;
    if (dag.fixed_stream(u) != Dag::kNone) {
      s = dag.fixed_stream(u);
    } else if (group != Dag::kNone && group_fixed.at(group) != Dag::kNone) {
      s = group_fixed.at(group);
    } else if (group != Dag::kNone && group_stream.count(group) > 0) {
      s = group_stream[group];
    } else if (dag.cost(u) == 0.0) {
      s = producer >= 0 ? out.stream[producer] : 0;
    } else {
      // The stream that can start u earliest, data from other streams
      // arriving sync_cost later. Leaving the producer's stream must win
      // more than one sync besides: what u makes likely goes back (the
      // join, or a consumer on the producer's stream), so work too small
      // to pay for both events stays. On a tie the producer's stream (no
      // event needed), then the lowest number.
      const int preferred = producer >= 0 ? out.stream[producer] : 0;
      double best_start = 0.0;
      for (int c = 0; c < num_streams; ++c) {
        const double start =
            std::max(free_at[c], arrival(u, c, out.stream, finish)) +
            (c == preferred ? 0.0 : sync_cost);
        const bool better = s < 0 || start < best_start ||
            (start == best_start && c == preferred && s != preferred);
        if (better) {
          s = c;
          best_start = start;
        }
      }
    }
    out.stream[u] = s;
    if (group != Dag::kNone) {
      group_stream.emplace(group, s);
    }
    const double start =
        std::max(free_at[s], arrival(u, s, out.stream, finish));
    finish[u] = start + dag.cost(u);
    if (dag.cost(u) > 0.0) {
      free_at[s] = finish[u];
    }
    for (const int v : dag.successors(u)) {
      if (--waiting[v] == 0) {
        ready.push(v);
      }
    }
  }
  return out;
}

Assignment run_embedding(const Dag& dag, const AssignOptions& options) {
  const int n = dag.size();
  const int num_streams = options.num_streams;
  std::vector<int> member(n, -1);
  int num_groups = 0;
  for (const auto& seeds : options.embedding_groups) {
    bool any = false;
    for (const int v : seeds) {
      if (v < 0 || v >= n) {
        throw std::invalid_argument(
            "embedding group " + std::to_string(num_groups) + " names node " +
            std::to_string(v) + ", outside 0.." + std::to_string(n - 1));
      }
      if (member[v] < 0) {
        member[v] = num_groups;
        any = true;
      }
    }
    if (any) {
      ++num_groups;
    }
  }
  // What hangs only off a group joins it: forward, nodes whose producers are
  // all in the group; backward, nodes whose consumers all are (the lookup's
  // index preparation).
  for (int v = 0; v < n; ++v) {
    const auto& preds = dag.predecessors(v);
    if (member[v] >= 0 || preds.empty()) {
      continue;
    }
    const int g = member[preds.front()];
    if (g >= 0 && std::all_of(preds.begin(), preds.end(), [&](int p) {
          return member[p] == g;
        })) {
      member[v] = g;
    }
  }
  for (int v = n - 1; v >= 0; --v) {
    const auto& succs = dag.successors(v);
    if (member[v] >= 0 || succs.empty()) {
      continue;
    }
    const int g = member[succs.front()];
    if (g >= 0 && std::all_of(succs.begin(), succs.end(), [&](int s) {
          return member[s] == g;
        })) {
      member[v] = g;
    }
  }
  Assignment out;
  out.stream.assign(n, 0);
  std::vector<double> load(num_streams, 0.0);
  std::vector<int> count(num_streams, 0);
  std::vector<int> rest;
  for (int v = 0; v < n; ++v) {
    if (member[v] < 0) {
      rest.push_back(v);
      continue;
    }
    const int s = member[v] % num_streams;
    out.stream[v] = s;
    load[s] += dag.cost(v);
  }
  for (int g = 0; g < num_groups; ++g) {
    ++count[g % num_streams];
  }
  if (!rest.empty()) {
    const Dag sub = dag.induced(rest);
    const auto groups = min_chain_groups(sub, &out.chains, nullptr);
    out.groups = static_cast<int>(groups.size());
    fold_groups(dag, groups, rest, load, count, out.stream);
  }
  out.groups += num_groups;
  return out;
}

} // namespace

const char* strategy_name(Strategy strategy) {
  switch (strategy) {
    case Strategy::kAuto:
      return "auto";
    case Strategy::kMinSync:
      return "min_sync";
    case Strategy::kCriticalPath:
      return "critical_path";
    case Strategy::kEmbedding:
      return "embedding";
    case Strategy::kUser:
      return "user";
  }
  return "unknown";
}

Strategy parse_strategy(const std::string& name) {
  for (const Strategy s :
       {Strategy::kAuto,
        Strategy::kMinSync,
        Strategy::kCriticalPath,
        Strategy::kEmbedding,
        Strategy::kUser}) {
    if (name == strategy_name(s)) {
      return s;
    }
  }
  throw std::invalid_argument(
      "unknown strategy '" + name +
      "': use one of 'auto', 'min_sync', 'critical_path', 'embedding', "
      "'user'");
}

Strategy choose_strategy(
    const Dag& dag,
    const AssignOptions& options,
    std::string* reason) {
  auto because = [reason](const char* why) {
    if (reason != nullptr) {
      *reason = why;
    }
  };
  bool all_fixed = dag.size() > 0;
  for (int v = 0; v < dag.size() && all_fixed; ++v) {
    all_fixed = dag.fixed_stream(v) != Dag::kNone;
  }
  if (all_fixed) {
    because("auto: every node has a stream annotation");
    return Strategy::kUser;
  }
  if (options.embedding_groups.size() >= 2) {
    because("auto: two or more embedding lookups");
    return Strategy::kEmbedding;
  }
  if (options.costs_known) {
    because("auto: costs known (cost model or example inputs)");
    return Strategy::kCriticalPath;
  }
  if (dag.size() > kAutoMinSyncNodes) {
    because("auto: graph too large for min_sync's V^2 reachability matrix");
    return Strategy::kCriticalPath;
  }
  because("auto: default (no costs, no embedding lookups)");
  return Strategy::kMinSync;
}

Assignment assign_streams(const Dag& dag, const AssignOptions& options) {
  check_num_streams(options.num_streams);
  if (!(options.sync_cost >= 0.0) || std::isinf(options.sync_cost)) {
    throw std::invalid_argument(
        "sync_cost must be a finite number >= 0, got " +
        std::to_string(options.sync_cost));
  }
  const auto group_fixed = check_placements(dag, options.num_streams);
  std::string reason = "requested";
  Strategy strategy = options.strategy;
  if (strategy == Strategy::kAuto) {
    strategy = choose_strategy(dag, options, &reason);
  }
  Assignment out;
  switch (strategy) {
    case Strategy::kMinSync:
      out = run_min_sync(dag, options.num_streams);
      break;
    case Strategy::kCriticalPath:
      out = run_critical_path(
          dag, options.num_streams, options.sync_cost, group_fixed);
      break;
    case Strategy::kEmbedding:
      out = run_embedding(dag, options);
      break;
    case Strategy::kUser:
    case Strategy::kAuto:
      out.stream.assign(dag.size(), 0);
      break;
  }
  out.strategy = strategy;
  out.reason = reason;
  apply_placements(dag, group_fixed, out.stream);
  return out;
}

std::vector<std::vector<int>> min_chain_groups(
    const Dag& dag,
    int* chains,
    int* merged) {
  const int n = dag.size();
  if (n > kMaxMinSyncNodes) {
    throw std::invalid_argument(
        "min_sync plans graphs of at most " + std::to_string(kMaxMinSyncNodes) +
        " nodes (it keeps a V x V " + "reachability matrix), got " +
        std::to_string(n) + ": use strategy 'critical_path'");
  }
  const BitMatrix reach = reachability(dag);
  // 1. Path cover of the minimum equivalent graph: consecutive nodes of a
  //    chain are joined by an edge that no other path implies, so within a
  //    chain no event is ever needed.
  const auto meg = transitive_reduction(dag, reach);
  const Matching paths = hopcroft_karp(n, meg);
  const auto chain_list = groups_from_matching(paths);
  const int c = static_cast<int>(chain_list.size());
  if (chains != nullptr) {
    *chains = c;
  }
  // 2. Chain i may precede chain j on one stream when i's end reaches j's
  //    start; a maximum matching on that (transitively closed) relation
  //    merges chains into as few sequences as it allows.
  std::vector<int> chain_of_start(n, -1);
  BitMatrix not_start(1, n);
  for (int v = 0; v < n; ++v) {
    not_start.set(0, v);
  }
  for (int i = 0; i < c; ++i) {
    chain_of_start[chain_list[i].front()] = i;
  }
  for (int i = 0; i < c; ++i) {
    const int start = chain_list[i].front();
    not_start.row(0)[start >> 6] &= ~(uint64_t{1} << (start & 63));
  }
  BitMatrix chain_order(c, c);
  for (int i = 0; i < c; ++i) {
    const int end = chain_list[i].back();
    for (int s = reach.next(end, 0, not_start.row(0)); s >= 0;
         s = reach.next(end, s + 1, not_start.row(0))) {
      chain_order.set(i, chain_of_start[s]);
    }
  }
  const Matching links = hopcroft_karp(chain_order);
  // 3. The merged sequences as a node-level matching on the closure: u -> w
  //    for consecutive nodes of a sequence.
  Matching cover;
  cover.left.assign(n, -1);
  cover.right.assign(n, -1);
  int num_merged = 0;
  for (const auto& chain_seq : groups_from_matching(links)) {
    ++num_merged;
    int previous = -1;
    for (const int i : chain_seq) {
      for (const int v : chain_list[i]) {
        if (previous >= 0) {
          cover.left[previous] = v;
          cover.right[v] = previous;
        }
        previous = v;
      }
    }
  }
  if (merged != nullptr) {
    *merged = num_merged;
  }
  // 4. Departure from Nimble: chains are merged whole, and on some graphs
  //    (tests: "ChainMergeCanExceedTheWidth") that leaves more sequences
  //    than the graph's width. Augmenting the matching on the node-level
  //    closure reaches the width (Dilworth) and changes only the links along
  //    augmenting paths; when step 2 was already optimal it finds none.
  const Matching best = hopcroft_karp(reach, cover);
  auto groups = groups_from_matching(best);
  std::sort(groups.begin(), groups.end());
  return groups;
}

int width(const Dag& dag) {
  const Matching m = hopcroft_karp(reachability(dag));
  return dag.size() - m.size();
}

} // namespace torch_stage::schedule
