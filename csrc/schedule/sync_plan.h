// Sync planning: given a Dag and the stream of each node, where to record
// events and where streams wait on them, so that every edge that crosses
// streams is ordered on the device. Plain C++17, no torch; pure functions.
//
// The plan is executed in issue order (node 0, 1, ...):
//
//   entry   stream 0 (the caller's stream) records the fork event and every
//           side stream in `fork` waits on it: work queued on the caller's
//           stream before the call (inputs, memory the allocator may hand
//           out again) is ordered before any side-stream work, even for
//           side streams that read nothing from stream 0.
//   node v  its stream first waits on each event in waits[v], then tensors
//           in keep[v] are marked as used on v's stream, then v runs, then
//           v's stream records event[v] if v has one.
//   exit    each side stream in `join` records an exit event and stream 0
//           waits on it, so everything is ordered before the caller's next
//           work (and a CUDA-graph capture ends joined).
//
// Events: one after each producer whose value or ordering is needed on
// another stream. Waits are pruned with vector clocks: a stream skips a wait
// when earlier waits already ordered it after that producer (Nimble's and
// TF_REDUCE_STREAM_WAIT's idea). Events nobody ends up waiting on are not
// recorded. Side streams already known to stream 0 at exit are not joined
// again.
#pragma once

#include <string>
#include <vector>

#include "schedule/dag.h"

namespace torch_stage::schedule {

struct SyncPlan {
  int num_streams = 1;
  std::vector<int> stream; // per node
  std::vector<int> event; // per node: event recorded after it, or -1
  std::vector<int> event_node; // per event: the node it follows
  std::vector<int> event_stream; // per event: the stream that records it
  // Per node: events its stream waits on before it runs.
  std::vector<std::vector<int>> waits;
  // Per node: producers whose tensors the node reads on a stream other than
  // theirs; the runtime marks them as used on that stream
  // (record_stream), once per (producer, stream).
  std::vector<std::vector<int>> keep;
  std::vector<int> fork; // side streams that wait on the entry, ascending
  std::vector<int> join; // side streams stream 0 waits on at exit, ascending

  int num_events() const {
    return static_cast<int>(event_node.size());
  }
  int num_waits() const;
  // Streams that run at least one node.
  std::vector<int> used_streams() const;
};

// Edges whose ends are on different streams.
int cross_stream_edges(const Dag& dag, const std::vector<int>& stream);

// stream[v] in [0, num_streams) for every node.
SyncPlan plan_sync(
    const Dag& dag,
    const std::vector<int>& stream,
    int num_streams);

// Checks a plan against its graph by replaying it with vector clocks: every
// cross-stream edge is ordered by a chain of records and waits; no wait on an
// event before it is recorded; every event recorded once; every used side
// stream forked before its first node and joined at exit; every cross-stream
// data edge kept alive on the consumer's stream. Returns the problems found
// (empty: the plan is sound).
std::vector<std::string> verify_plan(const Dag& dag, const SyncPlan& plan);

} // namespace torch_stage::schedule
