// Stream assignment: which stream of a pool of N each node of a Dag runs on.
// Plain C++17, no torch; every function is pure and may run on several
// threads at once.
//
// Placement precedence (design.md, "Multi-stream semantics"):
//   1. fixed streams (torch_stage.stream(i)) are kept;
//   2. a colocation group takes the fixed stream of a member, otherwise the
//      stream its lowest-numbered member got (members with two different
//      fixed streams are an error);
//   3. a strategy places the rest:
//      min_sync      minimum chain cover (Nimble, NeurIPS 2020; DeepRec's
//                    FULL_GRAPH rule): transitive reduction, Hopcroft-Karp
//                    matching on it (chains whose links need no event), chains
//                    merged by a second matching on the chain DAG's closure,
//                    then folded onto N streams.
//      critical_path list scheduling by longest remaining weighted path; each
//                    node goes to the stream that can start it earliest,
//                    where data from another stream arrives sync_cost
//                    later (the event between them; the graph's inputs are
//                    on stream 0); zero-cost nodes follow their producer.
//      embedding     each embedding group (a lookup and what hangs only off
//                    it) on its own stream, round robin; the rest by min_sync.
//      user          fixed placements only; everything else on stream 0.
//      auto          see choose_strategy().
//
// Stream 0 is the caller's stream: a graph that needs only one stream gets
// stream 0 everywhere.
#pragma once

#include <string>
#include <vector>

#include "schedule/dag.h"

namespace torch_stage::schedule {

enum class Strategy { kAuto, kMinSync, kCriticalPath, kEmbedding, kUser };

// "auto", "min_sync", "critical_path", "embedding", "user".
const char* strategy_name(Strategy strategy);
// The inverse; an unknown name throws std::invalid_argument listing the known
// ones.
Strategy parse_strategy(const std::string& name);

// The most streams a pool may have: PyTorch's CUDA pool hands out 32 streams
// per priority round robin, so a 33rd would alias the first (pytorch#9646).
constexpr int kMaxStreams = 32;
// min_sync keeps a V x V reachability bit matrix (V^2 / 8 bytes); beyond this
// many nodes it refuses (critical_path plans any size in O(E log V)).
constexpr int kMaxMinSyncNodes = 40000;
// auto does not pick min_sync beyond this many nodes.
constexpr int kAutoMinSyncNodes = 20000;

struct AssignOptions {
  int num_streams = 4;
  Strategy strategy = Strategy::kAuto;
  // Seeds of embedding groups, one list per group (usually one lookup each).
  std::vector<std::vector<int>> embedding_groups;
  // Costs come from a cost model or measured shapes rather than defaults;
  // auto prefers critical_path when they do.
  bool costs_known = false;
  // What a dependency between two streams costs critical_path, in the
  // costs' unit (an event record and wait): a node moves off its
  // producers' stream only when it starts earlier even so, so work too
  // small to pay for an event stays on one stream. >= 0; 0 ignores it.
  double sync_cost = 0.0;
};

struct Assignment {
  Strategy strategy = Strategy::kUser; // the one that ran, never kAuto
  std::string reason; // why (auto's rule, or "requested")
  std::vector<int> stream; // per node, in [0, num_streams)
  // min_sync / embedding: chains of the path cover, groups after merging
  // (the width of the graph placed by min_sync), before folding onto N.
  int chains = 0;
  int groups = 0;
};

// auto's rule, in order: every node fixed -> user; two or more embedding
// groups -> embedding; costs known -> critical_path; more than
// kAutoMinSyncNodes nodes -> critical_path; otherwise min_sync.
Strategy choose_strategy(
    const Dag& dag,
    const AssignOptions& options,
    std::string* reason);

Assignment assign_streams(const Dag& dag, const AssignOptions& options);

// min_sync's cover before folding: groups of nodes, each a chain of the
// partial order (every node reaches the next), together a partition of the
// nodes, as few as the graph's width. Groups are in the order of their first
// node. `chains` / `merged` (optional) receive the count after the first and
// the second matching.
std::vector<std::vector<int>> min_chain_groups(
    const Dag& dag,
    int* chains = nullptr,
    int* merged = nullptr);

// The graph's width: its largest set of nodes no two of which are connected
// by a path (Dilworth: the fewest chains that cover it). O(V^2) memory.
int width(const Dag& dag);

} // namespace torch_stage::schedule
