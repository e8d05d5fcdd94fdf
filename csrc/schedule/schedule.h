// The scheduler's entry point: stream assignment followed by sync planning,
// optionally verified. Plain C++17, no torch; a pure function.
//
// The torch op torch.ops.torch_stage.plan_streams (csrc/ops/schedule_ops.cpp)
// exposes it to Python; the multi-stream FX pass (torch_stage/streams/fx/)
// builds the Dag from a GraphModule and turns the plan into stream ops.
#pragma once

#include "schedule/dag.h"
#include "schedule/strategies.h"
#include "schedule/sync_plan.h"

namespace torch_stage::schedule {

struct ScheduleOptions : AssignOptions {
  // Replay the plan with verify_plan() and throw std::logic_error listing
  // the problems if it is unsound (tests, and debug mode at run time).
  bool verify = false;
};

struct Schedule {
  Assignment assignment;
  SyncPlan plan;
  int cross_stream_edges = 0;
};

Schedule schedule(const Dag& dag, const ScheduleOptions& options);

} // namespace torch_stage::schedule
