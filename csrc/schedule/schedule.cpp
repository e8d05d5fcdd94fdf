#include "schedule/schedule.h"

#include <stdexcept>
#include <string>

namespace torch_stage::schedule {

Schedule schedule(const Dag& dag, const ScheduleOptions& options) {
  Schedule out;
  out.assignment = assign_streams(dag, options);
  out.plan = plan_sync(dag, out.assignment.stream, options.num_streams);
  out.cross_stream_edges = cross_stream_edges(dag, out.assignment.stream);
  if (options.verify) {
    const auto problems = verify_plan(dag, out.plan);
    if (!problems.empty()) {
      std::string message = "the stream plan failed verification (" +
          std::to_string(problems.size()) + " problems):";
      for (const auto& p : problems) {
        message += "\n  " + p;
      }
      throw std::logic_error(message);
    }
  }
  return out;
}

} // namespace torch_stage::schedule
