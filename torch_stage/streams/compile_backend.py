"""The ``torch.compile`` backend ``"torch_stage"``: torch_stage decides the
streams, PyTorch's compiler does the rest.

::

    model = torch.compile(model, backend="torch_stage")
    model = torch.compile(model, backend="torch_stage", mode="reduce-overhead")
    model = torch.compile(model, backend="torch_stage",
                          options={"num_streams": 4, "max_autotune": True})
    model = torch.compile(model, backend=torch_stage.backend(num_streams=4))

The name is registered through the ``torch_dynamo_backends`` entry point
(``pyproject.toml``), so ``backend="torch_stage"`` works once the package is
installed, without importing it first. Importing torch_stage registers it
too when no entry point is installed (a source checkout on ``PYTHONPATH``).

What it does with each graph Dynamo hands it (one per graph break):

1. reads torch_stage's annotations (``torch_stage.stream(i)`` /
   ``colocate_with(x)`` inside compiled code) and Dynamo's own user streams
   from the nodes (:func:`prepare`);
2. plans the streams on inductor's terms: the nodes one fused kernel is
   made from share a stream, each node costs what its ATen ops cost
   (:mod:`torch_stage.streams.fx.fusion`), and work moves to another
   stream only where it starts earlier even after paying for the event
   (the scheduler's ``sync_cost``);
3. runs it with the executor:

   * ``"inductor"`` (the default, torch >= 2.13): the plan is written onto
     the graph the way PyTorch writes user streams (a stream per node,
     ``torch.ops.streams`` events; :mod:`torch_stage.streams.fx.user_streams`)
     and ``torch._inductor.compile_fx`` compiles it: kernels fused within a
     stream, events between streams, AOTAutograd's backward on the forward's
     streams, inductor's CUDA graphs with ``mode="reduce-overhead"``. Modes
     and options the backend does not own go to inductor as they are.
   * ``"aot_eager"``: the same program, forward and backward, run op by op
     instead of compiled (:mod:`torch_stage.streams.fx.program`): to tell a
     plan's fault from the compiler's, and for the stream sanitizer, which
     sees every op there.
   * ``"eager"``: the graph rewritten with torch_stage's stream ops and run
     eagerly (:class:`torch_stage.streams.fx.MultiStreamPass`), autograd
     recording it op by op; no fusion. The default on torch < 2.13, which
     cannot carry streams through inductor (one warning says so).

Where the device has no streams (the CPU), there is nothing to overlap:
inductor gets the graph without annotations and compiles exactly what it
compiles for ``torch.compile(model)``; the plan is still made and recorded
(:attr:`Backend.plans`), with a note saying it was not applied. (inductor's
generated code would not run an annotated CPU graph anyway: it declares the
stream variables inside a device guard, which CPU code does not get.)
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from torch_stage.streams.annotations import COMPILE_KEY
from torch_stage.streams.cuda_graphs import CUDAGraphModule
from torch_stage.streams.fx.analysis import GraphAnalysis
from torch_stage.streams.fx.annotate import META_KEY
from torch_stage.streams.fx.cost_model import SYNC_US
from torch_stage.streams.fx.fusion import inductor_view
from torch_stage.streams.fx.multi_stream_pass import MultiStreamPass
from torch_stage.streams.fx.stream_plan import StreamPlan, plan
from torch_stage.streams.fx.user_streams import (
    BackwardTable,
    SideTable,
    UserStreamWriter,
    has_streams,
    write_backward_streams,
)

__all__ = [
    "BACKEND_NAME",
    "COMPILED_STREAMS_RELEASE",
    "EXECUTORS",
    "MODES",
    "OPTIONS",
    "Backend",
    "backend",
    "compiled_streams_available",
    "prepare",
]

BACKEND_NAME = "torch_stage"

#: How each graph runs (see the module doc).
EXECUTORS = ("inductor", "aot_eager", "eager")

#: The first torch release whose compiler carries user streams through
#: Dynamo, AOTAutograd and inductor.
COMPILED_STREAMS_RELEASE = (2, 13)

#: The options the backend owns, with their defaults; any other option is
#: an inductor option (``torch._inductor.list_options()``).
OPTIONS: Dict[str, Any] = {
    "num_streams": 4,
    "strategy": "auto",
    "executor": None,
    "cuda_graphs": False,
    "warmup": 3,
    "cost_model": None,
    "verify": None,
}

#: ``torch.compile(mode=...)``: inductor's modes, and for the eager
#: executor what each sets (it has no autotuning).
MODES: Dict[Optional[str], Dict[str, Any]] = {
    None: {},
    "default": {},
    "reduce-overhead": {"cuda_graphs": True},
    "max-autotune": {"cuda_graphs": True},
    "max-autotune-no-cudagraphs": {},
}

_warned_release = False


def _torch_version() -> tuple:
    parts = []
    for piece in torch.__version__.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.cache
def compiled_streams_available() -> bool:
    """Whether this torch carries user streams through Dynamo, AOTAutograd
    and inductor (torch >= 2.13 with the pieces in place)."""
    if _torch_version() < COMPILED_STREAMS_RELEASE:
        return False
    try:
        import torch._dynamo.variables.streams  # noqa: F401  (defines torch.ops.streams)
        from torch._dynamo import graph_bytecode_inputs
        from torch._functorch._aot_autograd import streams

        return (
            hasattr(graph_bytecode_inputs, "register_graph_created_object")
            and hasattr(streams, "wrap_all_sync_nodes_with_control_deps")
            and hasattr(torch.ops.streams, "record_event")
        )
    except (ImportError, AttributeError):
        return False


def _default_executor() -> str:
    global _warned_release
    if compiled_streams_available():
        return "inductor"
    if not _warned_release:
        _warned_release = True
        warnings.warn(
            f"torch_stage backend: torch {torch.__version__} cannot carry streams through "
            "inductor (that needs torch >= "
            f"{'.'.join(map(str, COMPILED_STREAMS_RELEASE))}); graphs run with torch_stage's "
            "eager multi-stream executor, without inductor's fusion. Pass "
            "executor='eager' to say so and silence this warning.",
            stacklevel=3,
        )
    return "eager"


def _inductor_option_names() -> Dict[str, str]:
    """inductor's option names (``triton.cudagraphs``, ``max_autotune``),
    with ``-`` spelled ``_`` as ``torch.compile(options=...)`` allows."""
    from torch._inductor import config

    return {name: name for name in config.get_config_copy()}


class Backend:
    """A ``torch.compile`` backend object: ``backend=Backend(...)``.

    Args:
        num_streams: streams per device, ``1..torch_stage.MAX_STREAMS``.
        strategy: one of :data:`torch_stage.STRATEGIES`.
        executor: ``"inductor"``, ``"aot_eager"`` or ``"eager"`` (see the
            module doc); None: ``"inductor"`` where this torch can carry
            streams through it (>= 2.13), else ``"eager"`` with a warning.
        cuda_graphs: replay each compiled graph from CUDA graphs: inductor's
            (training too) with the inductor executor, a
            :class:`torch_stage.CUDAGraphModule` (inference only) with the
            eager one. Needs a GPU.
        warmup: eager runs before each CUDA graph capture (eager executor),
            ``>= 1``.
        cost_model: ``cost_model(node) -> float`` for the planner (nodes of
            Dynamo's graph), or None: inductor's view of the graph
            (FLOPs and bytes of the ATen ops it lowers), or for the eager
            executor unit costs.
        verify: check every plan with the C++ verifier (default: the
            ``TORCH_STAGE_VERIFY`` environment variable).
        mode: a ``torch.compile`` mode (:data:`MODES`): inductor's, as
            ``torch.compile(mode=...)`` gives it; for the eager executor
            ``"reduce-overhead"`` sets ``cuda_graphs``.
        inductor: inductor options (``{"max_autotune": True}``), for the
            inductor executor.

    Attributes:
        plans: the :class:`torch_stage.streams.fx.StreamPlan` of every graph
            this backend compiled, in order (one per graph break and
            recompile).
        graphs: the graph each executor got, in the same order (the one the
            plan is written onto, for the inductor and aot_eager executors).
        tables: per graph, the :class:`~torch_stage.streams.fx.user_streams.
            SideTable` of the streams and events its code reaches (None where
            the plan was not written: one stream, or a device without them).
        programs: with the aot_eager executor, ``(kind, graph)`` of each
            program AOTAutograd made (``"forward"``, ``"backward"``,
            ``"inference"``), as it runs.

    Raises:
        TypeError / ValueError: a bad option, named in the message.
        RuntimeError: ``cuda_graphs=True`` without a CUDA device, or
            ``executor="inductor"`` on a torch that cannot carry streams.
    """

    def __init__(
        self,
        num_streams: int = 4,
        strategy: str = "auto",
        executor: Optional[str] = None,
        cuda_graphs: bool = False,
        warmup: int = 3,
        cost_model: Optional[Callable[[torch.fx.Node], float]] = None,
        verify: Optional[bool] = None,
        mode: Optional[str] = None,
        inductor: Optional[Dict[str, Any]] = None,
    ):
        if mode not in MODES:
            allowed = ", ".join(repr(m) for m in MODES if m is not None)
            raise ValueError(f"unknown mode {mode!r}; use one of {allowed}")
        if executor is not None and executor not in EXECUTORS:
            allowed = ", ".join(repr(e) for e in EXECUTORS)
            raise ValueError(f"executor must be one of {allowed} (or None), got {executor!r}")
        if executor in ("inductor", "aot_eager") and not compiled_streams_available():
            raise RuntimeError(
                f"executor={executor!r} needs torch >= "
                f"{'.'.join(map(str, COMPILED_STREAMS_RELEASE))} (streams through Dynamo, "
                f"AOTAutograd and inductor); this is torch {torch.__version__}: use "
                "executor='eager'"
            )
        if inductor is not None and not isinstance(inductor, dict):
            raise TypeError(f"inductor options must be a dict, got {type(inductor).__name__}")
        if executor is None:
            executor = _default_executor()
        self.executor = executor
        self.mode = mode
        self.inductor = dict(inductor or {})
        if executor == "eager":
            if self.inductor:
                names = ", ".join(sorted(self.inductor))
                raise ValueError(
                    f"inductor options ({names}) need executor='inductor'; the eager "
                    "executor runs Dynamo's graph without inductor"
                )
            if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
                raise ValueError(
                    f"mode={mode!r} autotunes inductor's kernels: it needs executor='inductor'"
                )
            cuda_graphs = cuda_graphs or MODES[mode].get("cuda_graphs", False)
        if executor == "aot_eager" and (cuda_graphs or mode not in (None, "default")):
            raise ValueError(
                "executor='aot_eager' runs the program op by op: no CUDA graphs and no "
                f"mode (got cuda_graphs={cuda_graphs!r}, mode={mode!r}); use "
                "executor='inductor'"
            )
        # The pass checks the shared options and keeps them.
        self.stream_pass = MultiStreamPass(
            num_streams=num_streams,
            strategy=strategy,
            cost_model=cost_model,
            verify=verify,
            cuda_graphs=cuda_graphs,
            warmup=warmup,
        )
        self.plans: List[StreamPlan] = []
        self.graphs: List[torch.fx.GraphModule] = []
        self.tables: List[Optional[SideTable]] = []
        self.programs: List[Any] = []

    @property
    def options(self) -> Dict[str, Any]:
        p = self.stream_pass
        shown = {
            "num_streams": p.num_streams,
            "strategy": p.strategy,
            "executor": self.executor,
            "cuda_graphs": p.cuda_graphs,
            "warmup": p.warmup,
            "cost_model": p.cost_model,
            "verify": p.verify,
        }
        if self.mode is not None:
            shown["mode"] = self.mode
        if self.inductor:
            shown["inductor"] = dict(self.inductor)
        return shown

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"torch_stage.backend({shown})"

    # -- compiling one graph ---------------------------------------------

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        prepared = prepare(gm, self.stream_pass.num_streams)
        if self.executor == "eager":
            return self._eager(prepared, example_inputs)
        device = _device_of(example_inputs)
        view = inductor_view(prepared, example_inputs)
        graph = copy.deepcopy(prepared.graph)
        p = self.stream_pass
        cost_model = p.cost_model
        if cost_model is None and view is not None:
            costs = view.cost
            cost_model = lambda n: costs.get(n.name, 0.0)  # noqa: E731
        analysis = GraphAnalysis(
            prepared,
            None,
            cost_model,
            p.num_streams,
            graph=graph,
            colocate=view.units if view is not None else (),
        )
        sync_cost = SYNC_US if analysis.costs_known else 0.0
        stream_plan, raw = plan(analysis, p.strategy, p.verify, sync_cost)
        self.plans.append(stream_plan)
        table: Optional[SideTable] = None
        if not raw["fork"]:
            stream_plan.note = "one stream: the graph goes to the compiler as it is"
        elif not _streams_on(device):
            stream_plan.note = (
                f"not applied: {device.type} has no streams, so the graph goes to the "
                "compiler as it is"
            )
        else:
            table = SideTable(device)
            writer = UserStreamWriter(
                graph, analysis, raw, stream_plan, table, keep_memory=not self._graphs_on()
            )
            writer.run()
            graph.lint()
            # The backward's fork and joins, registered now: AOTAutograd may
            # compile the backward after Dynamo wrote the bytecode that fills
            # the side table.
            backward_slot = writer.next_slot
            for j in range(p.num_streams + 1):
                table.event(backward_slot + j)
            prepared = torch.fx.GraphModule(prepared, graph, type(gm).__name__)
        self.graphs.append(prepared)
        self.tables.append(table)
        if table is None:
            return self._compile(prepared, example_inputs, None, device, 0)
        return self._compile(prepared, example_inputs, table, device, backward_slot)

    def _graphs_on(self) -> bool:
        """Whether inductor replays the graphs from CUDA graphs."""
        if self.executor != "inductor":
            return False
        if self.stream_pass.cuda_graphs:
            return True
        patches = self._inductor_patches()
        return bool(patches.get("triton.cudagraphs", False))

    def _inductor_patches(self) -> Dict[str, Any]:
        patches: Dict[str, Any] = {}
        if self.mode not in (None, "default"):
            from torch._inductor import list_mode_options

            patches.update(list_mode_options(self.mode))
        if self.stream_pass.cuda_graphs:
            patches["triton.cudagraphs"] = True
        patches.update(self.inductor)
        return patches

    def _compile(self, gm, example_inputs, table, device, backward_slot) -> Callable:
        keep_memory = not self._graphs_on()

        def backward_streams(bw: torch.fx.GraphModule) -> None:
            if table is not None:
                write_backward_streams(bw, table, backward_slot, keep_memory)

        if self.executor == "aot_eager":
            from torch._dynamo.backends.common import aot_autograd
            from torch._functorch.partitioners import min_cut_rematerialization_partition

            from torch_stage.streams.fx.program import compile_program

            names = table.entries if table is not None else {}
            run = compile_program(names, device)

            def program(kind: str):
                def compiler(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable:
                    if kind == "backward":
                        backward_streams(graph)
                    self.programs.append((kind, graph))
                    return run(graph, inputs)

                return compiler

            compile_fn = aot_autograd(
                fw_compiler=program("forward"),
                bw_compiler=program("backward"),
                inference_compiler=program("inference"),
                partition_fn=min_cut_rematerialization_partition,
                keep_inference_input_mutations=True,
            )
            return self._with_table(table, lambda: compile_fn(gm, example_inputs))

        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        patches = self._inductor_patches()
        if table is None:
            return compile_fx(gm, example_inputs, config_patches=patches)

        def inner_compile(bw_or_fw, inputs, **kwargs):
            if kwargs.get("is_backward"):
                backward_streams(bw_or_fw)
            return compile_fx_inner(bw_or_fw, inputs, **kwargs)

        return self._with_table(
            table,
            lambda: compile_fx(
                gm, example_inputs, inner_compile=inner_compile, config_patches=patches
            ),
        )

    @staticmethod
    def _with_table(table: Optional[SideTable], compile_fn: Callable[[], Callable]) -> Callable:
        if table is None:
            return compile_fn()
        import torch._functorch.config as functorch_config

        start = table.registered()
        # AOTAutograd's cache would skip the passes that register the
        # backward's events in Dynamo's side table, which this compile's
        # bytecode must fill. And its common subexpression elimination
        # ignores the stream a node runs on: it would make the copies of a
        # constant made for each stream one node again, read across streams
        # with no event (T5's position arange, on torch 2.13).
        with functorch_config.patch(enable_autograd_cache=False, cse=False):
            compiled = compile_fn()
        table.adopt(start)
        return BackwardTable(compiled, table)

    def _eager(self, prepared: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        rewritten = self.stream_pass.rewrite(prepared)
        self.plans.append(rewritten.stream_plan)
        self.graphs.append(rewritten)
        self.tables.append(None)
        if not self.stream_pass.cuda_graphs:
            return rewritten
        _check_graphable(example_inputs)
        return CUDAGraphModule(rewritten, warmup=self.stream_pass.warmup)


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    """The device a graph runs on: its inputs' accelerator, else the CPU."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and has_streams(t.device):
            return t.device
    return torch.device("cpu")


def _streams_on(device: torch.device) -> bool:
    """Whether the plan is written for ``device``: it has streams, and
    inductor puts stream code in the device guard it opens for it."""
    return has_streams(device)


def backend(**options: Any) -> Backend:
    """The ``"torch_stage"`` backend with ``options``, for
    ``torch.compile(model, backend=torch_stage.backend(...))``.

    Args:
        **options: any of :data:`OPTIONS` and ``mode`` (see
            :class:`Backend`); any other name is an inductor option
            (``torch._inductor.list_options()``), passed to inductor.

    Returns:
        A :class:`Backend`; its ``plans`` list the plan of every graph it
        compiled.

    Raises:
        ValueError: a name that is neither the backend's nor inductor's (the
            message lists the backend's), or a bad value.
        TypeError: a value of the wrong type.
        RuntimeError: ``cuda_graphs=True`` without a CUDA device.
    """
    own = dict(options)
    mode = own.pop("mode", None)
    inductor = {k: own.pop(k) for k in list(own) if k not in OPTIONS}
    if inductor:
        known = _inductor_option_names()
        unknown = sorted(k for k in inductor if k.replace("-", "_") not in known)
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise ValueError(
                f"unknown torch_stage backend option{'s' if len(unknown) > 1 else ''} "
                f"{names}: the backend's options are {', '.join(sorted(OPTIONS))} and mode; "
                "any other must be an inductor option (torch._inductor.list_options())"
            )
        inductor = {k.replace("-", "_"): v for k, v in inductor.items()}
    return Backend(mode=mode, inductor=inductor or None, **own)


def torch_stage_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Optional[Dict[str, Any]] = None,
    mode: Optional[str] = None,
) -> Callable:
    """The entry point of ``backend="torch_stage"``: ``torch.compile`` calls
    it with its ``options`` (a dict) and ``mode``."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(
            f'torch.compile(backend="torch_stage", options=...) must be a dict, '
            f"got {type(options).__name__}"
        )
    return backend(mode=mode, **(options or {}))(gm, example_inputs)


def _check_graphable(example_inputs: Sequence[Any]) -> None:
    # Checked when Dynamo compiles, with the grad mode it traced under (a
    # guard, so a call under another grad mode recompiles and checks again).
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    ):
        raise RuntimeError(
            "cuda_graphs=True with the eager executor replays inference only: autograd "
            "does not record the work of a replayed graph, so gradients would be lost. "
            "Call the compiled model under torch.no_grad() or torch.inference_mode(), "
            "or use the inductor executor (its CUDA graphs train)"
        )


# -- from Dynamo's graph to the pass's ------------------------------------


def prepare(gm: torch.fx.GraphModule, num_streams: int) -> torch.fx.GraphModule:
    """A copy of Dynamo's graph that the planner reads as it reads its own
    traces.

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
      keep torch_stage's; the node's own ``stream`` entry is dropped (the
      plan writes its own). Dynamo's ``torch.ops.streams.*`` event and wait
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
        user_stream = custom.get("stream")
        if "stream" in custom:
            n.meta["custom"] = {k: v for k, v in custom.items() if k != "stream"}
        note = custom.get(COMPILE_KEY)
        if note:
            note = dict(note)
            if "scope" in note:
                note["colocate"] = anchors.get(note["scope"])
            n.meta[META_KEY] = note
        elif isinstance(user_stream, int) and META_KEY not in n.meta:
            if user_stream not in user_streams:
                user_streams[user_stream] = len(user_streams)
            n.meta[META_KEY] = {"stream": _fold(user_streams[user_stream], num_streams)}
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
