"""Stream annotations: :func:`stream`, :func:`colocate_with` and the state
they share with the tracer, the pool limits, and the argument checks.

The lowest layer of the multi-stream half: ``torch_stage.streams.fx`` (the tracer,
the pass) and the compile backend read these; :mod:`torch_stage.streams.multi_stream`,
the public facade, re-exports the annotations and adds
:func:`~torch_stage.streams.multi_stream.multi_stream` on top of ``torch_stage.streams.fx``. Nothing
here imports either, so imports run one way.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
import warnings
from typing import List, Optional, Union

import torch

from torch_stage import _C
from torch_stage._checks import is_int
from torch_stage.streams._frames import skip_frames

#: The most streams a pool may have (counting the caller's): PyTorch's CUDA
#: pool hands out 32 streams per priority round robin, so a 33rd would alias
#: the first (pytorch#9646). The C++ pool's kMaxStreams, shared with device
#: staging's stage_subgraph_stream_id.
MAX_STREAMS = _C._MAX_STREAMS

#: The strategies :func:`multi_stream` accepts.
STRATEGIES = ("auto", "min_sync", "critical_path", "embedding", "user")


class _Annotations(threading.local):
    """Per-thread state shared by the context managers and the tracer."""

    def __init__(self):
        # Innermost last: ("stream", index) or ("colocate", _Scope).
        self.stack: List[tuple] = []
        # Set by torch_stage.streams.fx.annotate while it traces in this thread.
        self.tracing = False
        # Blocks entered (or met by torch.export) in this thread, ever: how
        # multi_stream's export fallback, which cannot keep them, knows that
        # a module has some.
        self.entered = 0
        self.pool_size: Optional[int] = None


_annotations = _Annotations()


def _is_plain_fx_tracing() -> bool:
    """True inside torch.fx tracing that is not torch_stage's own."""
    if _annotations.tracing:
        return False
    module = torch.fx._symbolic_trace
    # Newer torch splits symbolic tracing from torch.export and warns on the
    # older, ambiguous query.
    query = getattr(module, "is_fx_symbolic_tracing", None) or getattr(
        module, "is_fx_tracing", None
    )
    return bool(query and query())


def _warn_lost(what: str) -> None:
    warnings.warn(
        f"{what} inside torch.fx tracing that is not torch_stage's: the annotation "
        "is not recorded. Trace with torch_stage.multi_stream(...) or "
        "torch_stage.streams.fx.trace(...) to keep it.",
        stacklevel=3,
    )


def _torch_version() -> tuple:
    parts = torch.__version__.split("+")[0].split(".")
    return tuple(int(p) for p in parts[:2] if p.isdigit())


#: Whether Dynamo records ``torch.fx.traceback.annotate`` blocks on the nodes
#: it creates (``node.meta["custom"]``): torch 2.10 and newer
#: (pytorch#164916). A version check rather than a probe, so that importing
#: torch_stage does not import torch._dynamo (seconds).
_DYNAMO_CARRIES_ANNOTATIONS = _torch_version() >= (2, 10) and hasattr(
    torch.fx.traceback, "annotate"
)

#: The key of torch_stage's annotations in ``node.meta["custom"]`` of
#: Dynamo graphs; the value has the shape of ``node.meta["torch_stage"]``
#: (torch_stage.streams.fx.annotate.META_KEY): ``{"stream": i}`` or
#: ``{"colocate": None, "scope": k}``. One key for both, so the innermost
#: block wins, as in torch_stage's own tracer.
COMPILE_KEY = "torch_stage"

_compile_scopes = itertools.count()


def _annotation_dropped(what: str) -> bool:
    warnings.warn(
        f"{what} inside torch.compile: torch {torch.__version__}'s Dynamo does not "
        "record annotations on graph nodes (it does from torch 2.10), so the "
        '"torch_stage" backend places these operations by its strategy and the '
        "annotation is not honoured. Use torch_stage.multi_stream(...), which "
        "keeps it, or torch >= 2.10.",
        stacklevel=2,
    )
    return True


def _count_if_exporting() -> None:
    # torch.export (multi_stream's fallback) runs this branch too and keeps
    # no annotation; counting the block lets it refuse the module instead of
    # planning it without. Never under Dynamo proper, which would trace the
    # thread-local's mutation.
    exporting = getattr(torch.compiler, "is_exporting", None)
    if exporting is not None and exporting():
        _annotations.entered += 1


def _next_compile_scope() -> int:
    return next(_compile_scopes)


# Dynamo runs functions marked this way while it traces (their result is a
# constant of the trace): the warning is raised once per trace, and scope
# ids are fresh per block, without a graph break. This is the attribute
# torch._dynamo.assume_constant_result sets (torch 2.0 to 2.13 at least);
# set here directly so that importing torch_stage does not import Dynamo.
_annotation_dropped._dynamo_marked_constant = True
_next_compile_scope._dynamo_marked_constant = True
# Run at trace time too: traced, its read of the thread-local became a
# guard (torch 2.11 on an H200: `_annotations.entered == 0`), and every
# eager call of the module in between recompiled it.
_count_if_exporting._dynamo_marked_constant = True


def _compiled_block(note: dict, what: str):
    """The context manager an annotation is under Dynamo."""
    if _DYNAMO_CARRIES_ANNOTATIONS:
        return torch.fx.traceback.annotate({COMPILE_KEY: note})
    _annotation_dropped(what)
    return contextlib.nullcontext()


class StreamAnnotation:
    """What :func:`stream` returns in Python: a context manager that records
    the block's stream while torch_stage traces, and does nothing else."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __enter__(self) -> StreamAnnotation:
        if _is_plain_fx_tracing():
            _warn_lost(f"torch_stage.stream({self.index})")
        _annotations.stack.append(("stream", self.index))
        _annotations.entered += 1
        return self

    def __exit__(self, *exc_info) -> None:
        _annotations.stack.pop()

    def __repr__(self) -> str:
        return f"torch_stage.stream({self.index})"


def stream(index: int):
    """Run the code inside on stream ``index`` of the multi-stream pool.

    ``with torch_stage.stream(i):`` means, depending on what runs the code:

    * traced by :func:`multi_stream` (or :func:`torch_stage.streams.fx.trace`):
      every operation created inside is placed on pool stream ``index``
      (0 is the caller's stream), synchronised per dependency;
    * compiled by ``torch.compile(backend="torch_stage")``: the same, through
      Dynamo's node annotations (torch >= 2.10; older releases warn that the
      annotation is dropped);
    * scripted by ``torch.jit.script``: the block runs on pool stream
      ``index`` of the current device, after what came before it and before
      what follows (``torch.classes.torch_stage.StreamScope``: fork on entry,
      join on exit);
    * plain eager Python: nothing changes; the code runs on the current
      stream with the same results.

    Blocks nest; the innermost wins.

    Args:
        index: the pool stream, ``0 <= index < num_streams`` of the
            :func:`multi_stream` call tracing the code (at most
            :data:`MAX_STREAMS` otherwise).

    Returns:
        A context manager.

    Raises:
        TypeError: ``index`` is not an int.
        ValueError: ``index`` is outside the pool.

    Example::

        def forward(self, x, y):
            with torch_stage.stream(0):
                a = self.tower_x(x)
            with torch_stage.stream(1):
                b = self.tower_y(y)
            return a + b
    """
    if isinstance(index, bool) or not isinstance(index, int):
        # Plain ints (what Dynamo traces) skip this: numpy ints are taken as
        # ints, as Python's own int checks (operator.index) take them.
        if not is_int(index):
            raise TypeError(
                f"torch_stage.stream(index): index must be an int, "
                f"got {type(index).__name__} ({index!r})"
            )
        index = operator.index(index)
    if torch.compiler.is_compiling():
        _count_if_exporting()
        # Dynamo traces this branch: no thread-local state, no pool size.
        if not 0 <= index < MAX_STREAMS:
            raise ValueError(
                f"torch_stage.stream({index}): stream id {index} is outside the pool of "
                f"{MAX_STREAMS} streams (valid ids: 0..{MAX_STREAMS - 1})"
            )
        return _compiled_block({"stream": index}, f"torch_stage.stream({index})")
    size = _annotations.pool_size if _annotations.tracing else None
    limit = size if size is not None else MAX_STREAMS
    if not 0 <= index < limit:
        raise ValueError(
            f"torch_stage.stream({index}): stream id {index} is outside the pool of "
            f"{limit} streams (valid ids: 0..{limit - 1})"
        )
    return StreamAnnotation(index)


def _register_script_builtin() -> None:
    # TorchScript resolves a call to a registered Python callable as a call
    # of the named op (torch.jit._builtins, the table behind `math.sqrt` ->
    # aten::sqrt), so `with torch_stage.stream(i):` in scripted code makes a
    # StreamScope, whose __enter__/__exit__ TorchScript's `with` calls.
    from torch.jit import _builtins

    _builtins._register_builtin(stream, "torch_stage::stream")


_register_script_builtin()


class _Scope:
    """One colocate_with block: its anchor node's name, if it has one."""

    __slots__ = ("anchor",)

    def __init__(self, anchor: Optional[str]):
        self.anchor = anchor


class ColocateAnnotation:
    """What :func:`colocate_with` returns in Python (see there)."""

    __slots__ = ("_scope",)

    def __init__(self, anchor: Optional[str]):
        self._scope = _Scope(anchor)

    def __enter__(self) -> ColocateAnnotation:
        if _is_plain_fx_tracing():
            _warn_lost("torch_stage.colocate_with(...)")
        _annotations.stack.append(("colocate", self._scope))
        _annotations.entered += 1
        return self

    def __exit__(self, *exc_info) -> None:
        _annotations.stack.pop()


def colocate_with(x: Union[torch.Tensor, torch.fx.Proxy, torch.fx.Node]):
    """Run the code inside on the same stream as ``x``.

    While :func:`multi_stream` traces a module, or the ``"torch_stage"``
    backend compiles it (torch >= 2.10), the operations created inside the
    block share a stream with the operation that produced ``x`` (if ``x`` is
    an input or a parameter, they share a stream among themselves). Blocks
    nest with each other and with :func:`stream`; the innermost wins.
    Outside such tracing the block changes nothing. Not available in
    ``torch.jit.script`` code (a scripted tensor does not know the stream
    that produced it).

    Args:
        x: a tensor of the traced code (a ``torch.fx.Proxy`` while tracing),
            or a ``torch.fx.Node``.

    Returns:
        A context manager.

    Raises:
        TypeError: ``x`` is not a tensor, proxy or node.
    """
    if torch.compiler.is_compiling():
        _count_if_exporting()
        if not _DYNAMO_CARRIES_ANNOTATIONS:
            return _compiled_block({}, "torch_stage.colocate_with(...)")
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                "torch_stage.colocate_with(x) under torch.compile: x must be a tensor, "
                f"got {type(x).__name__}"
            )
        scope = _next_compile_scope()
        # A marker node whose argument is x: the backend reads x's producer
        # from it (an annotation can only hold constants) and removes it.
        torch.ops.torch_stage.colocate_marker(x, scope)
        return _compiled_block({"colocate": None, "scope": scope}, "")
    if isinstance(x, torch.fx.Proxy):
        anchor = x.node.name
    elif isinstance(x, torch.fx.Node):
        anchor = x.name
    elif isinstance(x, torch.Tensor):
        anchor = None
    else:
        raise TypeError(
            "torch_stage.colocate_with(x): x must be a tensor (a torch.fx.Proxy "
            f"while tracing) or a torch.fx.Node, got {type(x).__name__}"
        )
    return ColocateAnnotation(anchor)


# Dynamo compiles every frame that a frame it runs eagerly calls. It runs
# eagerly a frame with a graph break inside an annotation block (it cannot
# resume inside torch.fx.traceback.annotate), and then compiled stream() and
# colocate_with() by themselves: their compiled result, the annotate block,
# came back as a function (torch 2.13), a TypeError at the `with`. Inside a
# frame Dynamo traces they are still inlined.
skip_frames(stream, colocate_with)


def _check_num_streams(num_streams) -> int:
    if not is_int(num_streams):
        raise TypeError(
            f"num_streams must be an int, got {type(num_streams).__name__} ({num_streams!r})"
        )
    num_streams = operator.index(num_streams)
    if not 1 <= num_streams <= MAX_STREAMS:
        raise ValueError(
            f"num_streams must be in 1..{MAX_STREAMS}, got {num_streams}: PyTorch's "
            f"stream pool hands out {MAX_STREAMS} streams per priority, and more would "
            "alias (run on the same stream)"
        )
    return num_streams


def _check_strategy(strategy) -> str:
    if strategy not in STRATEGIES:
        allowed = ", ".join(repr(s) for s in STRATEGIES)
        raise ValueError(f"unknown strategy {strategy!r}: use one of {allowed}")
    return strategy
