"""torch.fx side of multi-stream execution.

* :func:`trace` / :class:`AnnotatingTracer` (``annotate``): tracing that
  records :func:`torch_stage.stream` and :func:`torch_stage.colocate_with`.
* :class:`GraphAnalysis` / :class:`StreamPlan` (``partition``): the graph as
  the C++ scheduler sees it, and its plan.
* :class:`MultiStreamPass` (``multi_stream_pass``): the rewrite with
  ``torch.ops.torch_stage`` stream ops; :func:`torch_stage.multi_stream` is
  its one-call form.
"""

from torch_stage.streams.fx import _ops  # noqa: F401  (marks the stream ops side-effecting)
from torch_stage.streams.fx.analysis import GraphAnalysis
from torch_stage.streams.fx.annotate import AnnotatingTracer, trace
from torch_stage.streams.fx.cost_model import default_cost
from torch_stage.streams.fx.multi_stream_pass import MultiStreamPass
from torch_stage.streams.fx.stream_plan import PlanEvent, PlanWait, StreamPlan

__all__ = [
    "AnnotatingTracer",
    "GraphAnalysis",
    "MultiStreamPass",
    "PlanEvent",
    "PlanWait",
    "StreamPlan",
    "default_cost",
    "trace",
]
