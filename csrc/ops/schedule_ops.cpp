// torch.ops.torch_stage.plan_streams: the C++ stream scheduler
// (csrc/schedule/) for Python, as a plain op on flat integer and float
// lists, so no pybind11 is involved. The multi-stream FX pass
// (torch_stage/streams/fx/stream_plan.py) is its caller.
#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "schedule/schedule.h"

namespace torch_stage {
namespace {

using IntList = std::vector<int64_t>;

template <typename Container>
IntList to_list(const Container& values) {
  return IntList(values.begin(), values.end());
}

void check_length(const char* name, size_t size, int64_t num_nodes) {
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(size) == num_nodes,
      "plan_streams: ",
      name,
      " has ",
      size,
      " entries for ",
      num_nodes,
      " nodes");
}

schedule::Dag build_dag(
    int64_t num_nodes,
    const IntList& edge_from,
    const IntList& edge_to,
    const IntList& edge_kind,
    const std::vector<double>& cost,
    const IntList& fixed,
    const IntList& colocation) {
  TORCH_CHECK_VALUE(
      num_nodes >= 0, "plan_streams: num_nodes must be >= 0, got ", num_nodes);
  TORCH_CHECK_VALUE(
      edge_from.size() == edge_to.size() && edge_to.size() == edge_kind.size(),
      "plan_streams: edge_from, edge_to and edge_kind differ in length (",
      edge_from.size(),
      ", ",
      edge_to.size(),
      ", ",
      edge_kind.size(),
      ")");
  check_length("cost", cost.size(), num_nodes);
  check_length("fixed", fixed.size(), num_nodes);
  check_length("colocation", colocation.size(), num_nodes);
  schedule::Dag dag(static_cast<int>(num_nodes));
  for (int64_t v = 0; v < num_nodes; ++v) {
    const int node = static_cast<int>(v);
    dag.set_cost(node, cost[v]);
    if (fixed[v] >= 0) {
      dag.fix_stream(node, static_cast<int>(fixed[v]));
    }
    if (colocation[v] >= 0) {
      dag.set_colocation_group(node, static_cast<int>(colocation[v]));
    }
  }
  for (size_t k = 0; k < edge_from.size(); ++k) {
    TORCH_CHECK_VALUE(
        edge_kind[k] == 0 || edge_kind[k] == 1,
        "plan_streams: edge kind must be 0 (data) or 1 (order), got ",
        edge_kind[k]);
    dag.add_edge(
        static_cast<int>(edge_from[k]),
        static_cast<int>(edge_to[k]),
        edge_kind[k] == 0 ? schedule::EdgeKind::kData
                          : schedule::EdgeKind::kOrder);
  }
  return dag;
}

// Returns (strategy that ran, why, plan). Plan keys, all int lists:
//   stream      per node           event        per node, -1 if none
//   event_node  per event          event_stream per event
//   wait_node, wait_event          one entry per wait, in issue order
//   keep_node, keep_producer       one entry per record_stream
//   fork, join                     side streams
//   stats       [chains, groups, cross_stream_edges]
std::tuple<std::string, std::string, c10::Dict<std::string, IntList>>
plan_streams(
    int64_t num_nodes,
    IntList edge_from,
    IntList edge_to,
    IntList edge_kind,
    std::vector<double> cost,
    IntList fixed,
    IntList colocation,
    IntList embedding_group,
    std::string strategy,
    int64_t num_streams,
    bool costs_known,
    bool verify,
    double sync_cost) {
  try {
    const schedule::Dag dag = build_dag(
        num_nodes, edge_from, edge_to, edge_kind, cost, fixed, colocation);
    check_length("embedding_group", embedding_group.size(), num_nodes);
    schedule::ScheduleOptions options;
    options.strategy = schedule::parse_strategy(strategy);
    options.num_streams = static_cast<int>(num_streams);
    options.costs_known = costs_known;
    options.verify = verify;
    options.sync_cost = sync_cost;
    std::vector<int> group_index;
    for (int64_t v = 0; v < num_nodes; ++v) {
      const int64_t g = embedding_group[v];
      if (g < 0) {
        continue;
      }
      if (static_cast<size_t>(g) >= group_index.size()) {
        group_index.resize(g + 1, -1);
      }
      if (group_index[g] < 0) {
        group_index[g] = static_cast<int>(options.embedding_groups.size());
        options.embedding_groups.emplace_back();
      }
      options.embedding_groups[group_index[g]].push_back(static_cast<int>(v));
    }
    const schedule::Schedule s = schedule::schedule(dag, options);
    const schedule::SyncPlan& plan = s.plan;
    c10::Dict<std::string, IntList> out;
    out.insert("stream", to_list(plan.stream));
    out.insert("event", to_list(plan.event));
    out.insert("event_node", to_list(plan.event_node));
    out.insert("event_stream", to_list(plan.event_stream));
    IntList wait_node;
    IntList wait_event;
    IntList keep_node;
    IntList keep_producer;
    for (int64_t v = 0; v < num_nodes; ++v) {
      for (const int e : plan.waits[v]) {
        wait_node.push_back(v);
        wait_event.push_back(e);
      }
      for (const int u : plan.keep[v]) {
        keep_node.push_back(v);
        keep_producer.push_back(u);
      }
    }
    out.insert("wait_node", wait_node);
    out.insert("wait_event", wait_event);
    out.insert("keep_node", keep_node);
    out.insert("keep_producer", keep_producer);
    out.insert("fork", to_list(plan.fork));
    out.insert("join", to_list(plan.join));
    out.insert(
        "stats",
        IntList{
            s.assignment.chains, s.assignment.groups, s.cross_stream_edges});
    return {
        schedule::strategy_name(s.assignment.strategy),
        s.assignment.reason,
        out};
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "plan_streams: ", e.what());
  } catch (const std::logic_error& e) {
    TORCH_CHECK(false, "plan_streams: ", e.what());
  }
}

} // namespace

TORCH_LIBRARY_FRAGMENT(torch_stage, m) {
  m.def(
      "plan_streams(int num_nodes, int[] edge_from, int[] edge_to, "
      "int[] edge_kind, float[] cost, int[] fixed, int[] colocation, "
      "int[] embedding_group, str strategy, int num_streams, "
      "bool costs_known, bool verify, float sync_cost=0.0) "
      "-> (str, str, Dict(str, int[]))",
      &plan_streams);
}

} // namespace torch_stage
