#include "schedule/dag.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace torch_stage::schedule {

namespace {

void check_cost(double cost) {
  if (!std::isfinite(cost) || cost < 0) {
    throw std::invalid_argument(
        "node costs must be finite and >= 0, got " + std::to_string(cost));
  }
}

} // namespace

std::string node_name(int node) {
  return "node " + std::to_string(node);
}

Dag::Dag(int num_nodes, double cost) {
  if (num_nodes < 0) {
    throw std::invalid_argument(
        "num_nodes must be >= 0, got " + std::to_string(num_nodes));
  }
  for (int i = 0; i < num_nodes; ++i) {
    add_node(cost);
  }
}

int Dag::add_node(double cost) {
  check_cost(cost);
  cost_.push_back(cost);
  fixed_.push_back(kNone);
  coloc_.push_back(kNone);
  succ_.emplace_back();
  pred_.emplace_back();
  pred_kind_.emplace_back();
  return size() - 1;
}

void Dag::check_node(int node, const char* what) const {
  if (node < 0 || node >= size()) {
    throw std::invalid_argument(
        std::string(what) + " " + std::to_string(node) +
        " is not a node (the graph has " + std::to_string(size()) +
        " nodes: 0.." + std::to_string(size() - 1) + ")");
  }
}

void Dag::add_edge(int from, int to, EdgeKind kind) {
  check_node(from, "edge source");
  check_node(to, "edge target");
  if (from >= to) {
    throw std::invalid_argument(
        "edge " + std::to_string(from) + " -> " + std::to_string(to) +
        " does not go forward: nodes are numbered in issue order, so every "
        "edge must go from a lower to a higher number");
  }
  auto& preds = pred_[to];
  auto it = std::lower_bound(preds.begin(), preds.end(), from);
  const auto index = it - preds.begin();
  if (it != preds.end() && *it == from) {
    if (kind == EdgeKind::kData) {
      pred_kind_[to][index] = EdgeKind::kData;
    }
    return;
  }
  preds.insert(it, from);
  pred_kind_[to].insert(pred_kind_[to].begin() + index, kind);
  auto& succs = succ_[from];
  succs.insert(std::lower_bound(succs.begin(), succs.end(), to), to);
  ++num_edges_;
}

void Dag::set_cost(int node, double cost) {
  check_node(node, "node");
  check_cost(cost);
  cost_[node] = cost;
}

void Dag::fix_stream(int node, int stream) {
  check_node(node, "node");
  if (stream < 0) {
    throw std::invalid_argument(
        "a fixed stream must be >= 0, got " + std::to_string(stream) + " for " +
        node_name(node));
  }
  fixed_[node] = stream;
}

void Dag::set_colocation_group(int node, int group) {
  check_node(node, "node");
  if (group < kNone) {
    throw std::invalid_argument(
        "a colocation group must be >= 0 (or -1 for none), got " +
        std::to_string(group) + " for " + node_name(node));
  }
  coloc_[node] = group;
}

std::vector<Edge> Dag::edges() const {
  std::vector<Edge> out;
  out.reserve(num_edges_);
  for (int v = 0; v < size(); ++v) {
    for (size_t k = 0; k < pred_[v].size(); ++k) {
      out.push_back({pred_[v][k], v, pred_kind_[v][k]});
    }
  }
  return out;
}

Dag Dag::induced(const std::vector<int>& nodes) const {
  std::vector<int> index(size(), kNone);
  Dag sub;
  for (size_t k = 0; k < nodes.size(); ++k) {
    const int v = nodes[k];
    check_node(v, "node");
    if (k > 0 && v <= nodes[k - 1]) {
      throw std::invalid_argument(
          "induced(): the nodes must be sorted and distinct");
    }
    index[v] = sub.add_node(cost_[v]);
    sub.fixed_[index[v]] = fixed_[v];
    sub.coloc_[index[v]] = coloc_[v];
  }
  for (const int v : nodes) {
    for (size_t k = 0; k < pred_[v].size(); ++k) {
      const int u = pred_[v][k];
      if (index[u] != kNone) {
        sub.add_edge(index[u], index[v], pred_kind_[v][k]);
      }
    }
  }
  return sub;
}

} // namespace torch_stage::schedule
