#include "schedule/sync_plan.h"

#include <algorithm>
#include <functional>
#include <set>
#include <stdexcept>
#include <utility>

namespace torch_stage::schedule {

namespace {

using Clock = std::vector<int>;

void merge_into(Clock& into, const Clock& from) {
  for (size_t s = 0; s < into.size(); ++s) {
    into[s] = std::max(into[s], from[s]);
  }
}

void check_streams(
    const Dag& dag,
    const std::vector<int>& stream,
    int num_streams) {
  if (num_streams < 1) {
    throw std::invalid_argument(
        "num_streams must be >= 1, got " + std::to_string(num_streams));
  }
  if (static_cast<int>(stream.size()) != dag.size()) {
    throw std::invalid_argument(
        "the assignment has " + std::to_string(stream.size()) +
        " entries for a graph of " + std::to_string(dag.size()) + " nodes");
  }
  for (int v = 0; v < dag.size(); ++v) {
    if (stream[v] < 0 || stream[v] >= num_streams) {
      throw std::invalid_argument(
          node_name(v) + " is assigned stream " + std::to_string(stream[v]) +
          ", outside 0.." + std::to_string(num_streams - 1));
    }
  }
}

} // namespace

int SyncPlan::num_waits() const {
  int total = 0;
  for (const auto& w : waits) {
    total += static_cast<int>(w.size());
  }
  return total;
}

std::vector<int> SyncPlan::used_streams() const {
  std::vector<bool> used(num_streams, false);
  for (const int s : stream) {
    used[s] = true;
  }
  std::vector<int> out;
  for (int s = 0; s < num_streams; ++s) {
    if (used[s]) {
      out.push_back(s);
    }
  }
  return out;
}

int cross_stream_edges(const Dag& dag, const std::vector<int>& stream) {
  int count = 0;
  for (int v = 0; v < dag.size(); ++v) {
    for (const int u : dag.predecessors(v)) {
      count += stream[u] != stream[v] ? 1 : 0;
    }
  }
  return count;
}

SyncPlan plan_sync(
    const Dag& dag,
    const std::vector<int>& stream,
    int num_streams) {
  check_streams(dag, stream, num_streams);
  const int n = dag.size();
  SyncPlan plan;
  plan.num_streams = num_streams;
  plan.stream = stream;
  plan.event.assign(n, -1);
  plan.waits.assign(n, {});
  plan.keep.assign(n, {});

  // pos[v]: 1-based position of v among the nodes of its stream. clock[t][s]:
  // the last position of stream s that stream t is known to run after.
  std::vector<int> pos(n, 0);
  std::vector<int> count(num_streams, 0);
  std::vector<Clock> clock(num_streams, Clock(num_streams, 0));
  // Clock of a producer's stream right after it, kept for producers with a
  // consumer elsewhere (what a wait on its event would teach).
  std::vector<Clock> after(n);
  std::vector<bool> waited(n, false);
  std::vector<int> wait_on;
  std::set<std::pair<int, int>> kept; // (producer, stream)

  for (int v = 0; v < n; ++v) {
    const int t = stream[v];
    const auto& preds = dag.predecessors(v);
    const auto& kinds = dag.predecessor_kinds(v);
    wait_on.clear();
    for (const int u : preds) {
      if (stream[u] != t && clock[t][stream[u]] < pos[u]) {
        wait_on.push_back(u);
      }
    }
    // Latest producer first: an event can only imply earlier ones, so this
    // order keeps exactly the waits nothing else implies.
    std::sort(wait_on.begin(), wait_on.end(), std::greater<int>());
    for (const int u : wait_on) {
      if (clock[t][stream[u]] >= pos[u]) {
        continue;
      }
      merge_into(clock[t], after[u]);
      waited[u] = true;
      plan.waits[v].push_back(u); // a node for now; an event id below
    }
    for (size_t k = 0; k < preds.size(); ++k) {
      const int u = preds[k];
      if (kinds[k] == EdgeKind::kData && stream[u] != t &&
          kept.emplace(u, t).second) {
        plan.keep[v].push_back(u);
      }
    }
    pos[v] = ++count[t];
    clock[t][t] = pos[v];
    for (const int w : dag.successors(v)) {
      if (stream[w] != t) {
        after[v] = clock[t];
        break;
      }
    }
  }

  for (int v = 0; v < n; ++v) {
    if (waited[v]) {
      plan.event[v] = plan.num_events();
      plan.event_node.push_back(v);
      plan.event_stream.push_back(stream[v]);
    }
  }
  for (auto& waits : plan.waits) {
    for (int& w : waits) {
      w = plan.event[w];
    }
  }
  // Join the side streams stream 0 does not know the end of, except those
  // whose end another such stream knows (joining that one implies them).
  std::vector<int> unjoined;
  for (int s = 1; s < num_streams; ++s) {
    if (count[s] == 0) {
      continue;
    }
    plan.fork.push_back(s);
    if (clock[0][s] < count[s]) {
      unjoined.push_back(s);
    }
  }
  for (const int s : unjoined) {
    const bool implied =
        std::any_of(unjoined.begin(), unjoined.end(), [&](int other) {
          return other != s && clock[other][s] >= count[s];
        });
    if (!implied) {
      plan.join.push_back(s);
    }
  }
  return plan;
}

std::vector<std::string> verify_plan(const Dag& dag, const SyncPlan& plan) {
  std::vector<std::string> problems;
  const int n = dag.size();
  const int num_streams = plan.num_streams;
  auto shape_ok = [&](size_t size, const char* what) {
    if (static_cast<int>(size) != n) {
      problems.push_back(
          std::string(what) + " has " + std::to_string(size) + " entries for " +
          std::to_string(n) + " nodes");
      return false;
    }
    return true;
  };
  if (num_streams < 1) {
    problems.push_back("num_streams is " + std::to_string(num_streams));
    return problems;
  }
  bool ok = shape_ok(plan.stream.size(), "stream");
  ok = shape_ok(plan.event.size(), "event") && ok;
  ok = shape_ok(plan.waits.size(), "waits") && ok;
  ok = shape_ok(plan.keep.size(), "keep") && ok;
  if (plan.event_node.size() != plan.event_stream.size()) {
    problems.push_back("event_node and event_stream differ in length");
    ok = false;
  }
  if (!ok) {
    return problems;
  }
  for (int v = 0; v < n; ++v) {
    if (plan.stream[v] < 0 || plan.stream[v] >= num_streams) {
      problems.push_back(
          node_name(v) + " is on stream " + std::to_string(plan.stream[v]) +
          ", outside the pool of " + std::to_string(num_streams));
      return problems;
    }
  }
  const int num_events = plan.num_events();
  std::vector<int> recorder(num_events, -1);
  for (int v = 0; v < n; ++v) {
    const int e = plan.event[v];
    if (e == -1) {
      continue;
    }
    if (e < 0 || e >= num_events) {
      problems.push_back(
          node_name(v) + " records event " + std::to_string(e) +
          ", which does not exist");
    } else if (recorder[e] != -1) {
      problems.push_back(
          "event " + std::to_string(e) + " is recorded twice (after " +
          node_name(recorder[e]) + " and " + node_name(v) + ")");
    } else {
      recorder[e] = v;
      if (plan.event_node[e] != v || plan.event_stream[e] != plan.stream[v]) {
        problems.push_back(
            "event " + std::to_string(e) + " is described as following " +
            node_name(plan.event_node[e]) + " on stream " +
            std::to_string(plan.event_stream[e]) + " but is recorded after " +
            node_name(v) + " on stream " + std::to_string(plan.stream[v]));
      }
    }
  }

  std::vector<bool> used(num_streams, false);
  std::vector<int> first_node(num_streams, -1);
  for (int v = 0; v < n; ++v) {
    const int s = plan.stream[v];
    if (!used[s]) {
      first_node[s] = v;
    }
    used[s] = true;
  }
  std::vector<bool> forked(num_streams, false);
  for (const int s : plan.fork) {
    if (s <= 0 || s >= num_streams) {
      problems.push_back(
          "fork names stream " + std::to_string(s) +
          ", not a side stream of the pool");
    } else {
      forked[s] = true;
    }
  }
  for (int s = 1; s < num_streams; ++s) {
    if (used[s] && !forked[s]) {
      problems.push_back(
          "stream " + std::to_string(s) + " runs " + node_name(first_node[s]) +
          " but never waits for the entry (fork)");
    }
  }

  std::vector<int> pos(n, 0);
  std::vector<int> count(num_streams, 0);
  std::vector<Clock> clock(num_streams, Clock(num_streams, 0));
  std::vector<Clock> at_record(num_events);
  std::vector<bool> recorded(num_events, false);
  std::set<std::pair<int, int>> kept;
  for (int v = 0; v < n; ++v) {
    const int t = plan.stream[v];
    for (const int e : plan.waits[v]) {
      if (e < 0 || e >= num_events) {
        problems.push_back(
            "before " + node_name(v) + ", stream " + std::to_string(t) +
            " waits on event " + std::to_string(e) + ", which does not exist");
      } else if (!recorded[e]) {
        problems.push_back(
            "before " + node_name(v) + ", stream " + std::to_string(t) +
            " waits on event " + std::to_string(e) +
            ", which has not been recorded yet");
      } else {
        merge_into(clock[t], at_record[e]);
      }
    }
    for (const int u : plan.keep[v]) {
      kept.emplace(u, t);
    }
    const auto& preds = dag.predecessors(v);
    const auto& kinds = dag.predecessor_kinds(v);
    for (size_t k = 0; k < preds.size(); ++k) {
      const int u = preds[k];
      const int s = plan.stream[u];
      if (s == t) {
        continue;
      }
      if (clock[t][s] < pos[u]) {
        problems.push_back(
            "edge " + std::to_string(u) + " -> " + std::to_string(v) +
            " crosses from stream " + std::to_string(s) + " to " +
            std::to_string(t) + " with no record/wait chain ordering it");
      }
      if (kinds[k] == EdgeKind::kData && kept.count({u, t}) == 0) {
        problems.push_back(
            "edge " + std::to_string(u) + " -> " + std::to_string(v) + ": " +
            node_name(u) + "'s tensors are read on stream " +
            std::to_string(t) + " but not kept alive there");
      }
    }
    pos[v] = ++count[t];
    clock[t][t] = pos[v];
    const int e = plan.event[v];
    if (e >= 0 && e < num_events && recorder[e] == v) {
      recorded[e] = true;
      at_record[e] = clock[t];
    }
  }

  for (const int s : plan.join) {
    if (s <= 0 || s >= num_streams) {
      problems.push_back(
          "join names stream " + std::to_string(s) +
          ", not a side stream of the pool");
    } else {
      merge_into(clock[0], clock[s]);
    }
  }
  for (int s = 1; s < num_streams; ++s) {
    if (used[s] && clock[0][s] < count[s]) {
      problems.push_back(
          "stream " + std::to_string(s) +
          "'s last work is not joined into stream 0 at exit");
    }
  }
  return problems;
}

} // namespace torch_stage::schedule
