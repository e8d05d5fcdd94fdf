"""The stream ops the multi-stream pass emits, marked side-effecting for FX.

The ops (csrc/ops/stream_ops.cpp) return nothing, so FX's
``Graph.eliminate_dead_code()`` would drop them unless they are known to be
impure. ``torch.fx.node.has_side_effect`` is the mechanism every supported
torch (2.5 and newer) consults for ``call_function`` targets; newer releases
point operators to ``torch.library._register_effectful_op`` instead, but
that registers an effect token for AOTAutograd and functionalisation, which
would change how these ops trace under ``torch.compile``. Every target a
stream op node may have is registered: ``fork``'s overload packet and its
default overload, the functions below through which the pass calls the ops
that take the run (see there why), and those ops' packets and overloads.
TorchScript is covered in C++ (AliasAnalysisKind::CONSERVATIVE).
"""

from __future__ import annotations

from typing import Any, List

import torch
from torch.fx.node import has_side_effect
from torch.jit import _builtins

from torch_stage import _C
from torch_stage.streams.fx._example import tensors_in

__all__ = [
    "STREAM_OPS",
    "colocate_marker",
    "fork",
    "join",
    "record_event",
    "record_stream",
    "set_stream",
    "sync",
    "wait_event",
]

_ns = torch.ops.torch_stage


# The ops that take the run are called through these functions, which the
# pass uses as node targets. Eagerly, fork returns the run as a
# torch_stage._C._StreamRun, whose methods skip torch.ops: torch.ops looks
# up __torch_function__ on every argument, and on a ScriptObject that
# lookup raises and catches a C++ exception inside ScriptObject.__getattr__,
# ~20 us per call against well under 1 us here
# (csrc/python/stream_bindings.cpp). The type of the run is the whole test:
# fork makes a _StreamRun only when neither Dynamo, torch.export nor
# torch.jit.trace runs and no input has __torch_function__, so everything
# that must see the ops (those, FX tracers, which pass Proxies) gets a
# ScriptObject from fork and calls torch.ops.torch_stage.*. TorchScript
# compiles each function as its op (registered as a builtin below), so
# scripted modules hold the ops themselves.
#
# fork, sync, record_event and join, the targets the pass emits on every
# forward, are C functions (made by _C._stream_fast_ops) that take the
# eager path themselves and hand every other call to the Python function
# of the same name below, the op path: a Python function in between cost
# more host time than the stream work of a forward (see there).
_Run = _C._StreamRun
_has_torch_function = torch._C._has_torch_function


def _op_run(run: Any) -> Any:
    """``run`` for torch.ops: a _StreamRun as its ScriptObject."""
    return run.script_object() if type(run) is _Run else run


# Traced, fork, sync and record_stream call the ops' _traced variants with
# the tensors among their Any arguments: torch.jit.trace cannot record an
# Any, and the ops use only the tensors of one (csrc/ops/stream_ops.cpp).
_jit_tracing = torch._C._get_tracing_state


def _fork(num_streams: int, side_streams: List[int], num_events: int, probes: Any) -> Any:
    # Eagerly (the C fork takes those calls itself but for keywords).
    if (
        not torch.compiler.is_compiling()
        and _jit_tracing() is None
        and not _has_torch_function(probes)
    ):
        return _C._stream_fork(num_streams, side_streams, num_events, probes)
    if _jit_tracing() is not None:
        return _ns.fork_traced(num_streams, side_streams, num_events, tensors_in(probes))
    return _ns.fork(num_streams, side_streams, num_events, probes)


def _sync(run: Any, record: int, stream: int, waits: List[int], keep: Any) -> None:
    if type(run) is _Run and (keep is None or not _has_torch_function(keep)):
        return run.sync(record, stream, waits, keep)
    if _jit_tracing() is not None:
        return _ns.sync_traced(run, record, stream, waits, tensors_in(keep))
    return _ns.sync(_op_run(run), record, stream, waits, keep)


def _record_event(run: Any, event: int, stream: int) -> None:
    if type(run) is _Run:
        return run.record_event(event, stream)
    return _ns.record_event(run, event, stream)


def _join(run: Any, side_streams: List[int], keep: Any = None) -> None:
    if type(run) is _Run and (keep is None or not _has_torch_function(keep)):
        return run.join(side_streams, keep)
    if _jit_tracing() is not None:
        if keep is not None:
            _ns.record_stream_traced(run, tensors_in(keep), 0)
        return _ns.join(run, side_streams)
    if keep is None:
        return _ns.join(run, side_streams)
    return _ns.join(_op_run(run), side_streams, keep)


fork, sync, record_event, join = _C._stream_fast_ops(
    __name__, _has_torch_function, torch.compiler, _fork, _sync, _record_event, _join
)


def set_stream(run: Any, stream: int) -> None:
    """Make pool stream ``stream`` current (``torch.ops.torch_stage.set_stream``)."""
    if type(run) is _Run:
        return run.set_stream(stream)
    return _ns.set_stream(run, stream)


def wait_event(run: Any, event: int, stream: int) -> None:
    """Pool stream ``stream`` waits on ``event`` (``torch.ops.torch_stage.wait_event``)."""
    if type(run) is _Run:
        return run.wait_event(event, stream)
    return _ns.wait_event(run, event, stream)


def _subclass(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and torch._C._has_torch_function_unary(value)


def record_stream(run: Any, value: Any, stream: int) -> None:
    """Mark the tensors in ``value`` used on pool stream ``stream``
    (``torch.ops.torch_stage.record_stream``)."""
    if type(run) is _Run and not _subclass(value):
        return run.record_stream(value, stream)
    if _jit_tracing() is not None:
        return _ns.record_stream_traced(run, tensors_in(value), stream)
    return _ns.record_stream(_op_run(run), value, stream)


_FUNCTIONS = (fork, set_stream, record_event, wait_event, record_stream, sync, join)

#: Every target a stream op node may have: the pass's functions, and the ops
#: (which graphs traced from a rewritten module hold).
STREAM_OPS = _FUNCTIONS + tuple(getattr(_ns, f.__name__) for f in _FUNCTIONS)

for _op in STREAM_OPS + (_ns.fork_traced, _ns.sync_traced, _ns.record_stream_traced):
    has_side_effect(_op)
    if isinstance(_op, torch._ops.OpOverloadPacket):
        for _overload in _op.overloads():
            has_side_effect(getattr(_op, _overload))
for _f in _FUNCTIONS:
    _builtins._register_builtin(_f, f"torch_stage::{_f.__name__}")


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
