// Dag: the graph the stream scheduler works on. Plain C++17, no torch.
//
// Nodes are numbered 0..size()-1 in *issue order*: the order in which the
// host will launch them (for an FX graph, the order of its node list). Every
// edge goes from a lower to a higher number, so the numbering is a topological
// order and the graph is acyclic by construction; an edge that goes backwards
// is rejected. The scheduler never reorders nodes: it only decides which
// stream each node is launched on and where events are recorded and waited.
//
// Per node:
//   cost         >= 0, finite: the time the node keeps its stream busy, in any
//                unit (the strategies only compare costs). 0 marks nodes that
//                launch no device work (views, tuple indexing).
//   fixed stream a user placement (torch_stage.stream(i)); strategies keep it.
//   colocation   nodes sharing a group id share a stream
//                (torch_stage.colocate_with(x)).
//
// Edges are kData (the consumer reads what the producer wrote) or kOrder (no
// value flows, but the consumer must run after the producer: in-place writes,
// side effects). Both must be ordered across streams; only data edges make a
// tensor live on a second stream.
//
// Errors: bad arguments throw std::invalid_argument with a message that names
// the value and the rule.
//
// Threads: a Dag is a plain value. Const methods may be called from several
// threads at once; mutation needs exclusive access.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torch_stage::schedule {

enum class EdgeKind : uint8_t { kData = 0, kOrder = 1 };

struct Edge {
  int from;
  int to;
  EdgeKind kind;
};

class Dag {
 public:
  static constexpr int kNone = -1;

  Dag() = default;
  explicit Dag(int num_nodes, double cost = 1.0);

  // Appends a node and returns its number.
  int add_node(double cost = 1.0);
  // from < to. A repeated edge is kept once; data wins over order.
  void add_edge(int from, int to, EdgeKind kind = EdgeKind::kData);

  void set_cost(int node, double cost);
  // stream >= 0. Whether it is inside the pool is checked by the scheduler,
  // which knows the pool size.
  void fix_stream(int node, int stream);
  // group >= 0, or kNone to leave every group.
  void set_colocation_group(int node, int group);

  int size() const {
    return static_cast<int>(cost_.size());
  }
  int num_edges() const {
    return num_edges_;
  }
  double cost(int node) const {
    return cost_[node];
  }
  int fixed_stream(int node) const {
    return fixed_[node];
  }
  int colocation_group(int node) const {
    return coloc_[node];
  }
  // Sorted by node number; parallel to the kinds below.
  const std::vector<int>& successors(int node) const {
    return succ_[node];
  }
  const std::vector<int>& predecessors(int node) const {
    return pred_[node];
  }
  // Kind of the edge pred -> node, for each entry of predecessors(node).
  const std::vector<EdgeKind>& predecessor_kinds(int node) const {
    return pred_kind_[node];
  }
  std::vector<Edge> edges() const;

  // The graph on `nodes` (sorted, distinct), renumbered 0..n-1 in that order,
  // with the edges among them; costs, placements and groups carried over.
  Dag induced(const std::vector<int>& nodes) const;

 private:
  void check_node(int node, const char* what) const;

  std::vector<double> cost_;
  std::vector<int> fixed_;
  std::vector<int> coloc_;
  std::vector<std::vector<int>> succ_;
  std::vector<std::vector<int>> pred_;
  std::vector<std::vector<EdgeKind>> pred_kind_;
  int num_edges_ = 0;
};

// "node 3", for messages.
std::string node_name(int node);

} // namespace torch_stage::schedule
