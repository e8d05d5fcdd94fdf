// The trace recorder's StreamObserver (streams/stream_observer.h): turns the
// notes of stream runs, scopes and staging copies into trace records on the
// thread that performed each operation.
//
// A run's `stream` segments: pool stream 0 is current from the fork; each
// set_stream to another stream closes the open segment and opens one for
// it; the join closes it. A StreamScope's segment lasts from scope_enter to
// scope_exit. fork, record_event, wait_event, record_stream, join,
// stage_copy and stage_hand_over are instants.
//
// Threads: installed and removed by trace::start()/stop() (the controlling
// thread); the observer runs on whichever thread performs the operation and
// keeps its open segments in thread-local state.
#pragma once

namespace torch_stage::trace {

void install_stream_tracer();
void remove_stream_tracer();

} // namespace torch_stage::trace
