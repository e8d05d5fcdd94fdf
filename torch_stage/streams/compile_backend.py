"""The ``torch.compile`` backend ``"torch_stage"``: multi-stream execution of
the graphs Dynamo captures.

::

    model = torch.compile(model, backend="torch_stage",
                          options={"num_streams": 4, "strategy": "auto"})
    model = torch.compile(model, backend=torch_stage.backend(num_streams=4))

The name is registered through the ``torch_dynamo_backends`` entry point
(``pyproject.toml``), so ``backend="torch_stage"`` works once the package is
installed, without importing it first. Importing torch_stage registers it
too when no entry point is installed (a source checkout on ``PYTHONPATH``).

What it does with each graph Dynamo hands it (one per graph break):

1. reads torch_stage's annotations from the nodes
   (``torch_stage.stream(i)`` / ``colocate_with(x)`` inside compiled code
   become ``node.meta["custom"]["torch_stage"]``, torch >= 2.10), and
   Dynamo's own user-stream annotations (``with torch.cuda.stream(s):``,
   ``node.meta["custom"]["stream"]``; see :func:`prepare`);
2. runs the multi-stream pass (:class:`torch_stage.streams.fx.MultiStreamPass`) on
   it; the rewritten ``GraphModule`` is what Dynamo calls, eagerly;
3. with ``cuda_graphs=True``, wraps it in a
   :class:`torch_stage.CUDAGraphModule`.

Why Dynamo graphs and not AOTAutograd's forward and backward graphs: the
rewritten graph runs in eager mode, so autograd records its operations and
runs the backward of each one on the stream its forward ran on, with the
cross-stream synchronisation the autograd engine inserts (PyTorch's
``notes/cuda.rst``, "Stream semantics of backward passes"). The backward is
therefore multi-stream and correct without a second plan, results are those
of eager execution bit for bit (same kernels, same order on the host,
random ops included), and nothing depends on AOTAutograd's internals, which
changed across the supported releases. The cost: no operator fusion, and
the backward follows the forward's placement instead of a plan of its own.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from torch_stage.streams.annotations import COMPILE_KEY
from torch_stage.streams.cuda_graphs import CUDAGraphModule
from torch_stage.streams.fx.annotate import META_KEY
from torch_stage.streams.fx.multi_stream_pass import MultiStreamPass
from torch_stage.streams.fx.stream_plan import StreamPlan

__all__ = ["BACKEND_NAME", "MODES", "OPTIONS", "Backend", "backend", "prepare"]

BACKEND_NAME = "torch_stage"

#: The options the backend takes, with their defaults.
OPTIONS: Dict[str, Any] = {
    "num_streams": 4,
    "strategy": "auto",
    "cuda_graphs": False,
    "warmup": 3,
    "cost_model": None,
    "verify": None,
}

#: ``torch.compile(mode=...)`` values the backend accepts, and what they set.
MODES: Dict[Optional[str], Dict[str, Any]] = {
    None: {},
    "default": {},
    "reduce-overhead": {"cuda_graphs": True},
}


class Backend:
    """A ``torch.compile`` backend object: ``backend=Backend(...)``.

    Args:
        num_streams: streams per device, ``1..torch_stage.MAX_STREAMS``.
        strategy: one of :data:`torch_stage.STRATEGIES`.
        cuda_graphs: replay each compiled graph from CUDA graphs
            (inference only; needs a GPU).
        warmup: eager runs before each CUDA graph capture, ``>= 1``.
        cost_model: ``cost_model(node) -> float`` for the planner (nodes of
            Dynamo's graph), or None.
        verify: check every plan with the C++ verifier (default: the
            ``TORCH_STAGE_VERIFY`` environment variable).

    Attributes:
        plans: the :class:`torch_stage.streams.fx.StreamPlan` of every graph this
            backend compiled, in order (one per graph break and recompile).

    Raises:
        TypeError / ValueError: a bad option, named in the message.
        RuntimeError: ``cuda_graphs=True`` without a CUDA device.
    """

    def __init__(
        self,
        num_streams: int = 4,
        strategy: str = "auto",
        cuda_graphs: bool = False,
        warmup: int = 3,
        cost_model: Optional[Callable[[torch.fx.Node], float]] = None,
        verify: Optional[bool] = None,
    ):
        # The pass checks every option and keeps them.
        self.stream_pass = MultiStreamPass(
            num_streams=num_streams,
            strategy=strategy,
            cost_model=cost_model,
            verify=verify,
            cuda_graphs=cuda_graphs,
            warmup=warmup,
        )
        self.plans: List[StreamPlan] = []

    @property
    def options(self) -> Dict[str, Any]:
        p = self.stream_pass
        return {
            "num_streams": p.num_streams,
            "strategy": p.strategy,
            "cuda_graphs": p.cuda_graphs,
            "warmup": p.warmup,
            "cost_model": p.cost_model,
            "verify": p.verify,
        }

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        prepared = prepare(gm, self.stream_pass.num_streams)
        rewritten = self.stream_pass.rewrite(prepared)
        self.plans.append(rewritten.stream_plan)
        if not self.stream_pass.cuda_graphs:
            return rewritten
        _check_graphable(example_inputs)
        return CUDAGraphModule(rewritten, warmup=self.stream_pass.warmup)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"torch_stage.backend({shown})"


def backend(**options: Any) -> Backend:
    """The ``"torch_stage"`` backend with ``options``, for
    ``torch.compile(model, backend=torch_stage.backend(...))``.

    Args:
        **options: any of :data:`OPTIONS` (see :class:`Backend`).

    Returns:
        A :class:`Backend`; its ``plans`` list the plan of every graph it
        compiled.

    Raises:
        ValueError: an unknown option (the message lists the known ones), or
            a bad value.
        TypeError: a value of the wrong type.
        RuntimeError: ``cuda_graphs=True`` without a CUDA device.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        known = ", ".join(sorted(OPTIONS))
        names = ", ".join(repr(k) for k in unknown)
        raise ValueError(
            f"unknown torch_stage backend option{'s' if len(unknown) > 1 else ''} "
            f"{names}: the known options are {known}"
        )
    return Backend(**options)


def torch_stage_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Optional[Dict[str, Any]] = None,
    mode: Optional[str] = None,
) -> Callable:
    """The entry point of ``backend="torch_stage"``: ``torch.compile`` calls
    it with its ``options`` (a dict) and ``mode``."""
    if mode not in MODES:
        allowed = ", ".join(repr(m) for m in MODES if m is not None)
        raise ValueError(
            f'torch.compile(backend="torch_stage", mode={mode!r}): unknown mode; use '
            f"{allowed} (reduce-overhead sets cuda_graphs=True)"
        )
    if options is not None and not isinstance(options, dict):
        raise TypeError(
            f'torch.compile(backend="torch_stage", options=...) must be a dict, '
            f"got {type(options).__name__}"
        )
    merged = dict(MODES[mode])
    merged.update(options or {})
    return backend(**merged)(gm, example_inputs)


def _check_graphable(example_inputs: Sequence[Any]) -> None:
    # Checked when Dynamo compiles, with the grad mode it traced under (a
    # guard, so a call under another grad mode recompiles and checks again).
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    ):
        raise RuntimeError(
            "cuda_graphs=True replays inference only: autograd does not record the work "
            "of a replayed graph, so gradients would be lost. Call the compiled model "
            "under torch.no_grad() or torch.inference_mode(), or compile without "
            "cuda_graphs for training"
        )


# -- from Dynamo's graph to the pass's ------------------------------------


def prepare(gm: torch.fx.GraphModule, num_streams: int) -> torch.fx.GraphModule:
    """A copy of Dynamo's graph that :class:`MultiStreamPass` reads as it
    reads its own traces.

    * ``node.meta["custom"]["torch_stage"]`` (torch_stage's annotations
      inside compiled code) becomes ``node.meta["torch_stage"]``; the
      ``colocate_marker`` nodes ``colocate_with(x)`` leaves name the anchor
      (``x``'s producer) and are removed.
    * Dynamo's user streams (``with torch.cuda.stream(s):`` in compiled
      code; since pytorch#166472 they travel as
      ``node.meta["custom"]["stream"]`` = the stream's index in Dynamo's
      object table, not as set_stream nodes, pytorch#176154): each distinct
      stream gets a side stream of the pool, in order of first use (1, 2,
      ..., folded onto ``num_streams``), and nodes with both annotations
      keep torch_stage's. Dynamo's ``torch.ops.streams.*`` event and wait
      nodes are removed: the plan orders every dependency with its own
      events (which also avoids the CPU-typed events of pytorch#176486).
      A warning says so.
    * Placeholders record whether they hold a tensor (from Dynamo's
      ``example_value``), so symbolic sizes are not passed to ``fork``.
    """
    graph = copy.deepcopy(gm.graph)
    anchors: Dict[int, Optional[str]] = {}
    for n in list(graph.nodes):
        if n.op == "call_function" and _is_marker(n.target):
            x = n.args[0]
            anchors[n.args[1]] = x.name if isinstance(x, torch.fx.Node) else None
            graph.erase_node(n)
    user_streams: Dict[Any, int] = {}
    removed_stream_ops = 0
    for n in list(graph.nodes):
        if n.op == "placeholder":
            value = n.meta.get("example_value", n.meta.get("val"))
            if value is not None:
                n.meta["torch_stage_has_tensor"] = isinstance(value, torch.Tensor)
            continue
        if not n.op.startswith("call_"):
            continue
        if _is_dynamo_stream_op(n.target) and not n.users:
            graph.erase_node(n)
            removed_stream_ops += 1
            continue
        custom = n.meta.get("custom") or {}
        note = custom.get(COMPILE_KEY)
        if note:
            note = dict(note)
            if "scope" in note:
                note["colocate"] = anchors.get(note["scope"])
            n.meta[META_KEY] = note
        elif isinstance(custom.get("stream"), int) and META_KEY not in n.meta:
            index = custom["stream"]
            if index not in user_streams:
                user_streams[index] = len(user_streams)
            n.meta[META_KEY] = {"stream": _fold(user_streams[index], num_streams)}
    if user_streams or removed_stream_ops:
        warnings.warn(
            f"torch_stage backend: {len(user_streams)} user stream(s) "
            "(torch.cuda.stream(...) in compiled code) run on torch_stage's side "
            f"streams {sorted({_fold(k, num_streams) for k in user_streams.values()})} "
            f"of {num_streams}; their {removed_stream_ops} explicit event/wait "
            "operation(s) are replaced by the plan's synchronisation, which orders "
            "every data dependency (and side effect) between streams",
            stacklevel=2,
        )
    graph.lint()
    return torch.fx.GraphModule(gm, graph, type(gm).__name__)


def _fold(k: int, num_streams: int) -> int:
    """The pool stream of the k-th user stream: 1, 2, ..., wrapping onto the
    side streams (stream 0 when the pool has only the caller's)."""
    if num_streams == 1:
        return 0
    return 1 + k % (num_streams - 1)


def _is_marker(target: Any) -> bool:
    packet = torch.ops.torch_stage.colocate_marker
    return target is packet or getattr(target, "overloadpacket", None) is packet


def _is_dynamo_stream_op(target: Any) -> bool:
    # torch.ops.streams.* (torch/_dynamo/variables/streams.py, torch >= 2.10).
    return getattr(target, "namespace", None) == "streams"


def _register() -> None:
    """Register ``"torch_stage"`` with Dynamo when no entry point does.

    With the package installed, Dynamo finds the ``torch_dynamo_backends``
    entry point itself and registers it on first lookup; registering here as
    well would make that lookup fail as a duplicate. So this only runs for a
    source checkout without installed metadata.
    """
    from importlib.metadata import entry_points

    try:
        found = entry_points(group="torch_dynamo_backends")
    except TypeError:  # Python < 3.10: a dict of groups
        found = entry_points().get("torch_dynamo_backends", [])
    if any(ep.name == BACKEND_NAME for ep in found):
        return
    from torch._dynamo import register_backend

    register_backend(compiler_fn=torch_stage_backend, name=BACKEND_NAME)
