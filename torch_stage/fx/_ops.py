"""The stream ops the multi-stream pass emits, marked side-effecting for FX.

The ops (csrc/ops/stream_ops.cpp) return nothing, so FX's
``Graph.eliminate_dead_code()`` would drop them unless they are known to be
impure. ``torch.fx.node.has_side_effect`` is the mechanism every supported
torch (2.5 and newer) consults for ``call_function`` targets; newer releases
point operators to ``torch.library._register_effectful_op`` instead, but
that registers an effect token for AOTAutograd and functionalisation, which
would change how these ops trace under ``torch.compile``. Both the overload
packet (the target the pass uses, which prints and scripts as
``torch.ops.torch_stage.<op>``) and its default overload are registered.
TorchScript is covered in C++ (AliasAnalysisKind::CONSERVATIVE).
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

__all__ = [
    "STREAM_OPS",
    "colocate_marker",
    "fork",
    "join",
    "record_event",
    "record_stream",
    "set_stream",
    "wait_event",
]

_ns = torch.ops.torch_stage
fork = _ns.fork
set_stream = _ns.set_stream
record_event = _ns.record_event
wait_event = _ns.wait_event
record_stream = _ns.record_stream
join = _ns.join

STREAM_OPS = (fork, set_stream, record_event, wait_event, record_stream, join)

for _op in STREAM_OPS:
    has_side_effect(_op)
    has_side_effect(_op.default)


# A marker for torch.compile graphs only: torch_stage.colocate_with(x) under
# Dynamo calls it with x, so the "torch_stage" backend learns which node
# produced x (node annotations hold constants, not tensors). The backend
# removes the node; under other backends it is a no-op that AOTAutograd
# drops (no result, mutates nothing). Not registered for TorchScript.
@torch.library.custom_op("torch_stage::colocate_marker", mutates_args=())
def colocate_marker(x: torch.Tensor, scope: int) -> None:
    return None


@colocate_marker.register_fake
def _colocate_marker_fake(x: torch.Tensor, scope: int) -> None:
    return None
