"""The multi-stream pass: plan a graph's streams and rewrite it with stream ops.

(The design sketch calls this module ``fx/pass``; ``pass`` is a Python
keyword, so it could not be imported by that name.)

For each node that launches device work, in the order it is issued (the
graph's, or stream by stream: torch_stage/streams/fx/calls.py), the
rewritten graph does::

    sync(run, r, s, [e, ...], (x, ...))    when anything below is needed:
        record event r on the current stream (the one the previous node
        ran on; r = -1 for none), make pool stream s current, wait on each
        event e the plan puts before the node, and mark each producer x
        first read on s here as used on s (record_stream)
    <the node>                   (constants it reads re-created on s)
    record_event(run, e, s)      if another stream waits for this node, and
                                 the next node has no sync to carry it

between ``run = fork(...)`` after the inputs and ``join(run, ...)`` before
the output (``join(run, streams, (out, ...))`` where outputs made on side
streams are to be marked used on the caller's stream: the sync that did it
before costs a call). One call between two nodes instead of one per stream
op: the host cost of a rewritten forward is mostly these calls. The event is
recorded at the same point of the stream's work either way (nothing
between the node and the sync launches work; a constant re-created in
between keeps the record where it was). A graph that needs a single
stream is returned unchanged (no stream ops at all).
"""

from __future__ import annotations

import copy
import inspect
import linecache
import os
import sys
import threading
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx

from torch_stage import _C
from torch_stage._checks import check_int
from torch_stage.errors import MultiStreamTraceError
from torch_stage.streams import annotations as _annotations
from torch_stage.streams.annotations import _check_num_streams, _check_strategy
from torch_stage.streams.cuda_graphs import CUDAGraphModule, check_cuda_graphs
from torch_stage.streams.fx import _ops
from torch_stage.streams.fx.analysis import GraphAnalysis
from torch_stage.streams.fx.annotate import (
    AnnotatingTracer,
    bind_examples,
    check_none,
    examples_by_position,
)
from torch_stage.streams.fx.calls import issue_in_order
from torch_stage.streams.fx.classify import HOST_META
from torch_stage.streams.fx.host_cost import (
    HostCosts,
    device_of,
    host_costs,
    paying_plan,
    plan_estimate,
)
from torch_stage.streams.fx.stream_plan import StreamPlan, plan
from torch_stage.streams.fx.writer import PlanWriter

__all__ = ["MultiStreamGraphModule", "MultiStreamPass"]

#: Set to 1 to check every plan with the C++ verifier while planning.
VERIFY_ENV = "TORCH_STAGE_VERIFY"


class MultiStreamPass:
    """A pass (``call(graph_module) -> graph_module``) that places the nodes
    of a graph on a pool of streams and inserts the stream ops.

    Calling the pass object on an ``nn.Module`` traces it first (with
    :class:`torch_stage.streams.fx.annotate.AnnotatingTracer`); :func:`call` takes a
    ``GraphModule``. The input is never modified: the result is a new
    ``GraphModule`` sharing the input's parameters and submodules, with a
    ``stream_plan`` attribute. Arguments are those of
    :func:`torch_stage.multi_stream`, plus:

    Args:
        verify: replay the plan with the C++ verifier while planning and
            raise if it is unsound. Default: on when the environment variable
            ``TORCH_STAGE_VERIFY=1`` (debug mode).
        cuda_graphs: return a :class:`torch_stage.CUDAGraphModule` that
            replays the rewritten module from CUDA graphs (needs a GPU).
        warmup: eager runs before each CUDA graph capture (``>= 1``).
    """

    def __init__(
        self,
        num_streams: int = 4,
        strategy: str = "auto",
        example_inputs: Optional[Sequence[Any]] = None,
        cost_model: Optional[Callable[[torch.fx.Node], float]] = None,
        verify: Optional[bool] = None,
        cuda_graphs: bool = False,
        warmup: int = 3,
        example_kwargs: Optional[Mapping[str, Any]] = None,
    ):
        self.num_streams = _check_num_streams(num_streams)
        self.strategy = _check_strategy(strategy)
        # Checked first among the rest: without a GPU it is the one error
        # that no other argument can fix.
        self.cuda_graphs = check_cuda_graphs(cuda_graphs)
        self.warmup = check_int("warmup", warmup, 1, ">= 1")
        if cost_model is not None and not callable(cost_model):
            raise TypeError(
                "cost_model must be callable as cost_model(node) -> float, "
                f"got {type(cost_model).__name__}"
            )
        self.cost_model = cost_model
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        elif example_inputs is not None:
            if not isinstance(example_inputs, (list, tuple)):
                raise TypeError(
                    "example_inputs must be a tuple (or list) of forward's positional "
                    f"arguments, got {type(example_inputs).__name__}"
                )
            example_inputs = tuple(example_inputs)
        if example_kwargs is not None:
            if not isinstance(example_kwargs, Mapping):
                raise TypeError(
                    "example_kwargs must be a dict of forward's keyword arguments, "
                    f"got {type(example_kwargs).__name__}"
                )
            bad = [k for k in example_kwargs if not isinstance(k, str)]
            if bad:
                raise TypeError(f"example_kwargs keys must be argument names, got {bad[0]!r}")
            example_kwargs = dict(example_kwargs) or None
            if example_kwargs is not None and example_inputs is None:
                example_inputs = ()
        self.example_inputs = example_inputs
        self.example_kwargs = example_kwargs
        if verify is None:
            verify = os.environ.get(VERIFY_ENV, "0") == "1"
        elif not isinstance(verify, bool):
            raise TypeError(
                f"verify must be a bool or None, got {type(verify).__name__} ({verify!r})"
            )
        self.verify = verify

    def __call__(self, module: torch.nn.Module) -> torch.nn.Module:
        if isinstance(module, torch.fx.GraphModule):
            return self.call(module)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"multi_stream needs a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, torch.jit.ScriptModule):
            raise TypeError(
                f"multi_stream needs the Python module, got a {type(module).__name__} "
                "(TorchScript: what torch.jit.script, trace or load make), which "
                "torch.fx cannot trace; plan the module first and script the result: "
                "torch.jit.script(torch_stage.multi_stream(model))"
            )
        original = getattr(module, "_orig_mod", None)
        if isinstance(original, torch.nn.Module) and type(module).__name__ == "OptimizedModule":
            raise TypeError(
                "multi_stream needs the Python module, got torch.compile's wrapper "
                "(OptimizedModule), which torch.fx cannot trace; plan the module itself "
                "(multi_stream(compiled._orig_mod)), or compile with "
                'torch.compile(model, backend="torch_stage"), which plans streams in '
                "what it compiles"
            )
        if self.example_kwargs:
            bind_examples(module, self.example_inputs, self.example_kwargs)  # fails here, if at all
        traced = self.trace(module)
        host = self.host_costs_for(traced)
        result = self.call(traced, host)
        if isinstance(result, _GraphModule) and not self.cuda_graphs:
            # A plan for the other training mode weighs the same host costs.
            result._mode_source = _ModeSource(self, module, traced.code, host)
        guard = _ExampleCallGuard.of(module, traced, self.example_inputs, self.example_kwargs)
        if guard is not None and isinstance(result, _GraphModule):
            # An attribute its __call__ checks, not a hook: a GraphModule's
            # deep copy and pickle keep attributes, not hooks.
            result._example_guard = guard
        elif guard is not None:
            result.register_forward_pre_hook(guard, with_kwargs=True)
        return result

    def trace(self, module: torch.nn.Module) -> torch.fx.GraphModule:
        """Trace ``module`` keeping stream annotations, or explain why not."""
        name = type(module).__name__
        inputs = self._inputs_by_position(module)
        if inputs is None and self.example_inputs is not None:
            return self._export(
                module,
                name,
                TypeError(
                    "symbolic tracing takes forward's arguments by position, and an "
                    "example has none (it goes to **kwargs, or to *args before a "
                    "keyword-only argument)"
                ),
            )
        tracer = AnnotatingTracer(self.num_streams, inputs)
        try:
            graph = tracer.trace(module)
        except (ValueError, TypeError) as exc:
            if str(exc).startswith("torch_stage."):
                raise  # a bad annotation: its own message says what to fix
            return self._export(module, name, exc)
        except Exception as exc:  # noqa: BLE001  (any tracing failure: try export, else explain)
            return self._export(module, name, exc)
        _drop_unmet_return_type(graph)
        traced = torch.fx.GraphModule(tracer.root, graph, name)
        if tracer.fixed_arguments:
            traced.meta[_FIXED_ARGUMENTS] = dict(tracer.fixed_arguments)
        return traced

    def _export(self, module: torch.nn.Module, name: str, exc: Exception) -> torch.fx.GraphModule:
        """Symbolic tracing failed: with example inputs, capture ``module``
        with ``torch.export`` instead.

        Non-strict export runs forward as Python on fake tensors, so it
        follows what symbolic tracing cannot (Hugging Face models read
        configs, iterate tensors, branch on shapes); its graph holds ATen
        ops, which the planner reads from their schemas like any other.
        ``ExportedProgram.module()`` keeps forward's call signature (its
        pytree codegen flattens the arguments and rebuilds the outputs);
        every dimension is dynamic (``Dim.AUTO``) so that other batch and
        sequence sizes run too, where the model allows. Stream annotations
        are not seen by export: a module that has them is refused rather
        than planned without them.
        """
        if self.example_inputs is None:
            raise self._trace_error(name, exc) from exc
        # A keyword given as None where that is its default is left out:
        # export would make it a required argument of the result, so every
        # call would have to spell it out. (A later value for it is refused:
        # _ExampleCallGuard.)
        parameters = inspect.signature(module.forward).parameters
        kwargs = {
            k: v
            for k, v in (self.example_kwargs or {}).items()
            if not (v is None and k in parameters and parameters[k].default is None)
        } or None
        state = _annotations._annotations
        entered = state.entered
        try:
            program = torch.export.export(
                module,
                self.example_inputs,
                kwargs=kwargs,
                dynamic_shapes=_all_dynamic(module, self.example_inputs, kwargs),
                strict=False,
            )
        except Exception as export_exc:  # noqa: BLE001  (explained, with the first failure)
            raise self._trace_error(name, exc, export_exc) from exc
        if state.entered != entered:
            raise MultiStreamTraceError(
                f"torch_stage.multi_stream could not trace {name} with torch.fx "
                f"({type(exc).__name__}: {exc}), and torch.export, which could, does not "
                "keep its torch_stage.stream / colocate_with annotations. Compile the "
                'model with torch.compile(model, backend="torch_stage"), which keeps '
                "them (torch >= 2.10)."
            )
        exported, guards = _module_and_guards(program)
        exported._torch_stage_example_kwargs = kwargs or {}
        exported._torch_stage_guards = guards
        for n in exported.graph.nodes:
            # The input checks export adds (shapes, dtypes): host work.
            if n.op == "call_module" and n.target == "_guards_fn":
                n.meta[HOST_META] = True
        return exported

    def _trace_error(
        self, name: str, exc: Exception, export_exc: Optional[Exception] = None
    ) -> MultiStreamTraceError:
        if export_exc is not None:
            hint = (
                f"torch.export with example_inputs could not capture it either "
                f"({type(export_exc).__name__}: {str(export_exc).splitlines()[0]}); compile "
                'the model with torch.compile(model, backend="torch_stage"), which splits '
                "it where tracing stops."
            )
        else:
            hint = (
                "Pass example_inputs=(...) so that control flow on tensor values is "
                "decided from real values while tracing (and torch.export can capture "
                "what tracing cannot), or compile the model with torch.compile(model, "
                'backend="torch_stage"), which splits it where tracing stops.'
            )
        return MultiStreamTraceError(
            f"torch_stage.multi_stream could not trace {name} with torch.fx: "
            f"{type(exc).__name__}: {exc}. {hint}"
        )

    def _inputs_by_position(self, module: torch.nn.Module) -> Optional[Tuple[Any, ...]]:
        if self.example_inputs is None:
            return None
        return examples_by_position(module, self.example_inputs, self.example_kwargs)

    def _inputs_of(self, graph_module: torch.fx.GraphModule) -> Optional[Tuple[Any, ...]]:
        """The example inputs in the order of ``graph_module``'s
        placeholders."""
        if not self.example_kwargs:
            return self.example_inputs
        in_spec = _export_input_spec(graph_module)
        if in_spec is not None:
            # Captured by torch.export: the placeholders are the leaves of
            # (args, kwargs), in the order its input spec gives them.
            from torch.fx._pytree import tree_flatten_spec

            kwargs = getattr(graph_module, "_torch_stage_example_kwargs", self.example_kwargs)
            return tuple(tree_flatten_spec((self.example_inputs, kwargs), in_spec))
        return self._inputs_by_position(graph_module)

    def host_costs_for(self, graph_module: torch.nn.Module) -> HostCosts:
        """What the stream calls cost the host where ``graph_module`` runs:
        nothing when replayed from CUDA graphs, else measured on its
        examples' (or parameters') device."""
        if self.cuda_graphs:
            return HostCosts.free()
        return host_costs(device_of(graph_module, self._inputs_of(graph_module)))

    def call(
        self, graph_module: torch.fx.GraphModule, host: Optional[HostCosts] = None
    ) -> torch.nn.Module:
        """Plan ``graph_module`` and return the rewritten copy (wrapped in a
        :class:`torch_stage.CUDAGraphModule` when ``cuda_graphs`` is set);
        ``host`` as for :meth:`rewrite`."""
        result = self.rewrite(graph_module, host)
        if self.cuda_graphs:
            return CUDAGraphModule(result, warmup=self.warmup)
        return result

    def rewrite(
        self, graph_module: torch.fx.GraphModule, host: Optional[HostCosts] = None
    ) -> torch.fx.GraphModule:
        """Plan ``graph_module`` and return the rewritten ``GraphModule``.

        ``host``: the host costs of the stream calls (default: those of the
        device the graph's examples or parameters are on,
        :func:`~torch_stage.streams.fx.host_cost.host_costs`)."""
        graph = copy.deepcopy(graph_module.graph)
        analysis = GraphAnalysis(
            graph_module,
            self._inputs_of(graph_module),
            self.cost_model,
            self.num_streams,
            graph=graph,
        )
        if host is None:
            host = self.host_costs_for(graph_module)
        # What a user gets by default is never slower than one stream; a
        # strategy or streams asked for are planned as asked.
        checked = self.strategy == "auto" and all(f < 0 for f in analysis.fixed)
        # The scheduler's costs are device microseconds only when known; a
        # dependency then costs a branch what its calls cost the host.
        sync_cost = host.dependency_us if checked and analysis.costs_known else 0.0
        stream_plan, raw = plan(analysis, self.strategy, self.verify, sync_cost)
        if checked and sync_cost > 0 and not raw["fork"]:
            # The charge alone kept every node on stream 0. The plan made
            # without it goes through the pay rule below, which declines it
            # with a note saying what streams would cost (or finds what
            # pays), instead of one stream without a word.
            free_plan, free_raw = plan(analysis, self.strategy, self.verify, 0.0)
            if free_raw["fork"]:
                stream_plan, raw = free_plan, free_raw
        if raw["fork"]:
            if checked:
                stream_plan, raw, issued = paying_plan(
                    analysis, stream_plan, raw, host, self.verify
                )
                if issued is not analysis:
                    issue_in_order(graph, issued.nodes)
                    analysis = issued
            else:
                stream_plan.estimate = plan_estimate(analysis, raw, host)
                if not stream_plan.estimate.pays:
                    stream_plan.note = (
                        f"kept as asked, though it may not pay: {stream_plan.estimate}"
                    )
        if raw["fork"]:
            _Rewrite(graph_module, graph, analysis, raw, stream_plan).run()
            graph.lint()
        cls = MultiStreamGraphModule if raw["fork"] else _GraphModule
        result = cls(graph_module, graph, type(graph_module).__name__)
        result.stream_plan = stream_plan
        guards = graph_module.__dict__.get("_torch_stage_guards")
        if guards:
            result._torch_stage_guards = guards
        return result


def _module_and_guards(program) -> Tuple[torch.fx.GraphModule, List[str]]:
    """``program.module()``, and the input guards its ``_guards_fn`` checks,
    as Python expressions over the placeholders' names (for the scripted
    form, see :meth:`_GraphModule.__prepare_scriptable__`).

    torch.export makes the guard function from source it does not keep; its
    maker is wrapped for this call only, to see the code (another thread's
    call meanwhile goes through the wrapper unchanged, and unrecorded).
    """
    from torch.export import _unlift

    if not hasattr(_unlift, "_convert_guards_code_to_fn"):  # no guard module here
        return program.module(), []
    seen: List[Tuple[list, list]] = []
    me = threading.get_ident()
    # One of these calls at a time, so that each puts back the original
    # (two overlapping ones would leave the first one's wrapper in place).
    with _guards_lock:
        make = _unlift._convert_guards_code_to_fn

        def spy(guards_code, paths):
            if threading.get_ident() == me:
                seen.append((list(guards_code), list(paths)))
            return make(guards_code, paths)

        _unlift._convert_guards_code_to_fn = spy
        try:
            module = program.module()
        finally:
            _unlift._convert_guards_code_to_fn = make
    if not seen:
        return module, []
    from torch.utils import _pytree as pytree

    code, paths = seen[-1]
    names = [n.name for n in module.graph.find_nodes(op="placeholder")]
    guards = []
    for guard in code:
        for name, path in zip(names, paths):
            guard = guard.replace("L" + pytree.keystr(path), name)
        guards.append(guard.replace("\n", " "))
    return module, guards


def _export_input_spec(graph_module: torch.fx.GraphModule) -> Any:
    """The input spec of a module ``torch.export`` captured (its pytree
    codegen's); None for one symbolic tracing made."""
    info = getattr(graph_module.graph._codegen, "pytree_info", None)
    return None if info is None else info.in_spec


def _all_dynamic(
    module: torch.nn.Module, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]] = None
):
    """``dynamic_shapes`` for torch.export: every dimension of every tensor
    input left for export to decide (``Dim.AUTO``, torch >= 2.6; static on
    older releases, where the graph then holds only for these shapes)."""
    auto = getattr(torch.export.Dim, "AUTO", None)
    if auto is None:
        return None

    def spec(x):
        return {d: auto for d in range(x.dim())} if isinstance(x, torch.Tensor) else None

    parameters = inspect.signature(module.forward).parameters
    positional = sum(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters.values()
    )
    if not kwargs and len(args) <= positional:
        return tuple(spec(x) for x in args)
    # By name, which export asks for with keywords, and which groups the
    # examples *args takes into its tuple.
    specs = {}
    for name, value in bind_examples(module, args, kwargs or {}).arguments.items():
        kind = parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            # torch.export (2.13) fails on any dynamic_shapes that reach
            # **kwargs (an AssertionError from its own structure check), so
            # such a call is captured with the examples' shapes.
            return None
        if kind is inspect.Parameter.VAR_POSITIONAL:
            specs[name] = tuple(spec(x) for x in value)
        else:
            specs[name] = spec(value)
    return specs


def _drop_unmet_return_type(graph: torch.fx.Graph) -> None:
    """Forget forward's return annotation when the traced graph does not
    build it.

    torchvision's GoogLeNet and Inception3 annotate forward with their
    NamedTuple outputs, which they build only on the scripted training path
    with aux logits; tracing takes the eager path, which returns a tensor,
    and the graph keeps the annotation, so TorchScript rejects the result
    ("Return value was annotated as having type GoogLeNetOutputs but is
    actually of type Tensor"). Without it TorchScript infers the type.
    """
    out = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    annotation = getattr(out, "type", None)
    if not (isinstance(annotation, type) and issubclass(annotation, tuple)):
        return
    value = out.args[0] if out.args else None
    if not (isinstance(value, torch.fx.Node) and value.target is annotation):
        out.type = None


# GraphModule.meta key: forward's scalar arguments that tracing decided
# control flow on, with their example values (AnnotatingTracer).
_FIXED_ARGUMENTS = "torch_stage_fixed_arguments"

_run_depth = _C._stream_run_depth
_module_call = torch.nn.Module.__call__


def _graph_module_call(self, *args, **kwargs):
    """``__call__`` of the pass's GraphModules: ``nn.Module.__call__``.

    In place of the ``__call__`` ``GraphModule.recompile()`` installs (two
    Python calls more, ~2.5k instructions a forward); what that one adds,
    a report of the failing line of the generated code, is made here on the
    error path (:func:`_report_generated_code`).
    """
    guard = self.__dict__.get("_example_guard")
    if guard is not None:
        guard(self, args, kwargs)
    try:
        return _module_call(self, *args, **kwargs)
    except Exception as exc:
        _note_arguments_traced_as_given(self, args, kwargs, exc)
        _report_generated_code(exc)
        raise


def _finishing_call(self, *args, **kwargs):
    """``MultiStreamGraphModule.__call__``: :func:`_graph_module_call` that
    also finishes the runs forward forked if it raises."""
    guard = self.__dict__.get("_example_guard")
    if guard is not None:
        guard(self, args, kwargs)
    depth = _run_depth()
    try:
        return _module_call(self, *args, **kwargs)
    except BaseException as exc:
        _C._stream_abort_runs(depth)
        if isinstance(exc, Exception):
            _note_arguments_traced_as_given(self, args, kwargs, exc)
            _report_generated_code(exc)
        raise


def _note_arguments_traced_as_given(
    module: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], exc: Exception
) -> None:
    """On an error in forward, name the optional arguments (default None)
    that this call leaves None but the graph was traced with: planned without
    examples (torch.fx traces every argument as given) or from examples that
    gave them. The graph then holds forward's branch for a value (``if mask
    is not None``), and an op fails on the None.

    A note, not a check before the call (as :class:`_ExampleCallGuard` makes
    for exported graphs): a torch.fx graph's ops may take the None, as
    ``F.linear``'s bias does, so refusing every such call would refuse good
    ones. (Exception notes are Python >= 3.11; before it the error goes on
    as plain torch.fx raises it.)
    """
    add_note = getattr(exc, "add_note", None)
    graph = getattr(module, "graph", None)
    if add_note is None or not isinstance(graph, torch.fx.Graph):
        return
    traced = [
        n.target
        for n in graph.nodes
        if n.op == "placeholder"
        and n.args == (None,)
        and any(user.target is not check_none for user in n.users)
    ]
    if not traced:
        return
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return
    bound.apply_defaults()
    for name in traced:
        if name in bound.arguments and bound.arguments[name] is None:
            add_note(
                f"torch_stage: {name} is None in this call, but the plan was traced with "
                f"{name} given, so the graph holds what forward does with a {name}; for "
                f"calls without it, plan from examples where {name} is None (leave it out "
                "of example_inputs / example_kwargs), one plan per case"
            )


def _report_generated_code(exc: Exception) -> None:
    """What ``torch.fx.graph_module._WrappedCall`` does with an exception
    raised in a GraphModule's generated code: print the failing line in
    its context to stderr and raise the exception without its traceback.
    (Without that private helper, on a torch that lacks it, the exception
    goes on unchanged.)"""
    wrapped_call = getattr(torch.fx.graph_module, "_WrappedCall", None)
    message = getattr(wrapped_call, "_generate_error_message", None)
    if message is None or exc.__traceback__ is None:
        return
    top = traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__))[-1]
    if "eval_with_key" in top.filename:
        print(message(top), file=sys.stderr)
        raise exc.with_traceback(None)


def _unpickle_guarded(rebuild, args, guard):
    module = rebuild(*args)
    module.register_forward_pre_hook(guard, with_kwargs=True)
    return module


class _ExampleCallGuard:
    """A check before each call of a plan made from example inputs: refuses a
    call the graph would run wrongly, silently, because it holds something
    fixed to the examples that it cannot check itself.

    * An argument that was None in the examples (given, or a default left
      out) where ``torch.export`` captured the module: export makes None a
      constant of its input spec and then ignores a tensor given there (an
      attention mask). (A torch.fx graph checks this itself:
      :func:`torch_stage.streams.fx.annotate.check_none`.)
    * An optional argument (default None) that the examples gave, where
      ``torch.export`` captured the module: the graph holds the branch for a
      value (``mask is not None``), and export's result only says the
      argument is missing. (A torch.fx graph is left to run: its ops may
      take None, as ``F.linear``'s bias does.)
    * ``*args`` and ``**kwargs``: tracing with examples unrolls them, so the
      graph takes as many positional extras and the same keywords as the
      examples had, and ignores any others.
    * An argument of a Python scalar value (a bool flag, an int) that
      control flow was decided on while tracing: the graph holds the
      branch of the example's value, and ran it for any other silently.
    """

    __slots__ = (
        "signature",
        "none_names",
        "given_names",
        "var_positional",
        "var_keyword",
        "fixed",
    )

    def __init__(self, signature, none_names, given_names, var_positional, var_keyword, fixed=None):
        self.signature = signature
        self.none_names = none_names
        self.given_names = given_names
        self.var_positional = var_positional  # (name, count) or None
        self.var_keyword = var_keyword  # (name, sorted keys) or None
        self.fixed = fixed or {}  # name -> the example's value

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state):
        self.fixed = {}  # (pickled before it existed)
        for k, v in state.items():
            setattr(self, k, v)

    @classmethod
    def of(cls, module, traced, args, kwargs) -> Optional[_ExampleCallGuard]:
        if args is None:
            return None
        signature = inspect.signature(module.forward)
        bound = bind_examples(module, args, kwargs or {}).arguments
        exported = _export_input_spec(traced) is not None
        none_names, given_names, var_positional, var_keyword = [], [], None, None
        for p in signature.parameters.values():
            if p.kind is p.VAR_POSITIONAL:
                var_positional = (p.name, len(bound.get(p.name, ())))
            elif p.kind is p.VAR_KEYWORD:
                var_keyword = (p.name, sorted(bound.get(p.name, {})))
            elif not exported:
                continue  # a torch.fx graph checks a None itself, and may take None
            elif (bound[p.name] if p.name in bound else p.default) is None:
                none_names.append(p.name)
            elif p.default is None:
                given_names.append(p.name)
        fixed = dict(traced.meta.get(_FIXED_ARGUMENTS, {}))
        if not (none_names or given_names or var_positional or var_keyword or fixed):
            return None
        return cls(signature, none_names, given_names, var_positional, var_keyword, fixed)

    def __call__(self, module, args, kwargs):
        try:
            bound = self.signature.bind(*args, **kwargs).arguments
        except TypeError:
            return None  # the graph's own call says what does not fit
        for name in self.none_names:
            if bound.get(name) is not None:
                raise AssertionError(
                    f"{name} has been specialized to have value None but got another value: "
                    f"the plan was made from examples where {name} was None, and torch.export "
                    f"would ignore it; plan with an example that gives {name} "
                    "(example_inputs / example_kwargs)"
                )
        for name, expected in self.fixed.items():
            got = bound[name] if name in bound else self.signature.parameters[name].default
            if not (type(got) in (bool, int, float, str) and got == expected):
                raise AssertionError(
                    f"{name} has been specialized to {expected!r} but got {got!r}: "
                    f"control flow in forward was decided on {name} while tracing, from "
                    f"examples where it was {expected!r}, and the graph holds that branch "
                    f"only; plan with examples where {name} is {got!r} for such calls "
                    "(one plan per value)"
                )
        for name in self.given_names:
            if bound.get(name) is None:
                raise AssertionError(
                    f"{name} has been specialized to have a value but got None: the plan "
                    f"was made from examples that gave {name}, and holds what forward does "
                    f"with it; plan with examples where {name} is None for calls without it"
                )
        if self.var_positional is not None:
            name, count = self.var_positional
            got = len(bound.get(name, ()))
            if got != count:
                raise TypeError(
                    f"the plan was made from examples with {count} argument(s) through "
                    f"*{name}, and this call gives {got}: the graph unrolled *{name} from "
                    "the examples; plan with examples shaped like this call"
                )
        if self.var_keyword is not None:
            name, keys = self.var_keyword
            got = sorted(bound.get(name, {}))
            if got != keys:
                raise TypeError(
                    f"the plan was made from examples with keyword(s) {keys} through "
                    f"**{name}, and this call gives {got}: the graph unrolled **{name} "
                    "from the examples; plan with examples shaped like this call"
                )
        return None


class _ModeSource:
    """What a traced module needs to be planned again in the other training
    mode.

    Tracing runs forward once, so whatever forward reads of ``self.training``
    as a value is frozen into the graph: ``F.dropout(x, training=
    self.training)``, torchvision's ``stochastic_depth(x, p, mode,
    self.training)``, a branch on ``if self.training``. (Modules called as
    modules, ``nn.Dropout`` and ``nn.BatchNorm2d``, read their flag when they
    run and need nothing.) ``torch.fx`` leaves such a graph in the mode it
    was traced in whatever ``train()`` says; ``torch.compile`` guards on the
    flag and recompiles. A plan made with ``model.eval()`` and trained with
    would then skip stochastic depth and dropout, silently: the first GPU
    run of the zoo trained a plan made in eval, and torchvision's
    EfficientNet, ConvNeXt, Swin and MaxViT came out wrong. So
    ``train(mode)`` on the result traces the module in the new mode, once,
    and if the graph differs, plans it and runs that plan while the mode
    holds. Both plans share the module's parameters. (A
    pickled or scripted result is the plan in effect: it no longer
    switches.)
    """

    __slots__ = ("stream_pass", "module", "code", "plans", "host")

    def __init__(
        self, stream_pass: MultiStreamPass, module: torch.nn.Module, code: str, host: HostCosts
    ):
        self.stream_pass = stream_pass
        self.module = module
        self.code = code
        self.host = host
        # training mode -> the rewritten module for it (None: the graph
        # traced in that mode is this one's).
        self.plans: Dict[bool, Optional[torch.fx.GraphModule]] = {module.training: None}

    def plan_for(self, mode: bool) -> Optional[torch.fx.GraphModule]:
        # The result's submodules are the module's own (train() on the
        # result has set them); the module's own flag, which its forward
        # may read, and those of submodules the graph does not hold, are
        # set to match, at every switch: set only when planning, the module
        # was left in the first mode planned while its submodules moved on.
        self.module.train(mode)
        if mode not in self.plans:
            traced = self.stream_pass.trace(self.module)
            self.plans[mode] = (
                None if traced.code == self.code else self.stream_pass.rewrite(traced, self.host)
            )
        return self.plans[mode]


class _GraphModule(torch.fx.GraphModule):
    """The ``GraphModule`` the pass returns for a plan with one stream (the
    traced graph, no stream ops): called through ``nn.Module.__call__``
    directly (:func:`_graph_module_call`)."""

    _call = staticmethod(_graph_module_call)

    def __deepcopy__(self, memo):
        res = super().__deepcopy__(memo)
        # GraphModule's copy keeps only what the graph references.
        for name in (
            "stream_plan",
            "_own_stream_plan",
            "_mode_source",
            "_example_guard",
            "_torch_stage_guards",
        ):
            if name in self.__dict__:
                res.__dict__[name] = copy.deepcopy(self.__dict__[name], memo)
        if "forward" in self.__dict__:
            res.train(self.training)  # the copy runs its own copy of that plan
        return res

    def __reduce__(self):
        # Pickled: the plan in effect, without what planning again needs
        # (the pass may hold a cost model that does not pickle).
        active = self.__dict__.get("forward")
        if active is not None:
            reduced = active.__self__.__reduce__()
        else:
            source = self.__dict__.pop("_mode_source", None)
            try:
                reduced = super().__reduce__()
            finally:
                if source is not None:
                    self.__dict__["_mode_source"] = source
        guard = self.__dict__.get("_example_guard")
        if guard is None:
            return reduced
        # Unpickled, it is a plain GraphModule (torch.fx rebuilds one from
        # the code): the guard goes with it as a forward pre-hook.
        return (_unpickle_guarded, (reduced[0], reduced[1], guard))

    def __prepare_scriptable__(self):
        """What ``torch.jit.script`` compiles. A module torch.export captured
        calls through pytree (inputs flattened from ``(args, kwargs)``, the
        output rebuilt as forward's type, e.g. a Hugging Face
        ``ModelOutput``) and checks its inputs in a Python guard module,
        none of which TorchScript compiles; it is scripted as its flat
        graph: forward takes the inputs export flattened, in order, and
        returns the outputs as a tuple (Hugging Face's own TorchScript
        convention, ``torchscript=True``), with the same guards compiled by
        TorchScript. This module itself is unchanged."""
        if _export_input_spec(self) is None:
            return self
        active = self.__dict__.get("forward")
        source = active.__self__ if active is not None else self
        graph = copy.deepcopy(source.graph)
        graph._codegen = torch.fx.graph.CodeGen()
        guards = self.__dict__.get("_torch_stage_guards") or []
        for node in graph.find_nodes(op="call_module", target="_guards_fn"):
            if guards:
                with graph.inserting_before(node):
                    graph.call_function(_script_guards(node.args, guards), node.args)
            graph.erase_node(node)
        for node in graph.nodes:
            # TorchScript resolves an operator by its packet and the
            # arguments' types; it has no syntax for export's overloads.
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                node.target = node.target.overloadpacket
        (output,) = graph.find_nodes(op="output")
        flat = output.args[0]
        output.args = (tuple(flat) if isinstance(flat, (list, tuple)) else (flat,),)
        root = torch.nn.Module()
        for name, value in source.named_children():
            if name != "_guards_fn":
                root.add_module(name, value)
        for name, value in source.__dict__.get("_parameters", {}).items():
            root.register_parameter(name, value)
        for name, value in source.__dict__.get("_buffers", {}).items():
            root.register_buffer(name, value)
        for node in graph.find_nodes(op="get_attr"):
            head = node.target.split(".")[0]
            if not hasattr(root, head):
                setattr(root, head, getattr(source, head))
        flat_module = torch.fx.GraphModule(root, graph, type(self).__name__)
        flat_module.train(self.training)
        return flat_module

    def train(self, mode: bool = True):
        super().train(mode)
        source = self.__dict__.get("_mode_source")
        if source is None:
            return self
        other = source.plan_for(bool(mode))
        if other is None:
            # The forward traced in this mode: the class's generated code.
            self.__dict__.pop("forward", None)
            self.stream_plan = self.__dict__.get("_own_stream_plan", self.stream_plan)
        else:
            self.__dict__.setdefault("_own_stream_plan", self.stream_plan)
            other.training = bool(mode)
            # An instance attribute shadows the class's forward; hooks and
            # __call__ stay this module's. A plan that forks needs the
            # __call__ that finishes its runs on an exception.
            self.__dict__["forward"] = other.forward
            self.stream_plan = other.stream_plan
            if isinstance(other, MultiStreamGraphModule):
                type(self).__call__ = _finishing_call
        return self

    def recompile(self):
        code = super().recompile()
        # recompile() installs __call__ on this instance's own class.
        cls = type(self)
        if cls.__call__ is not self._call:
            cls.__call__ = self._call
        return code


def _script_guards(args: Sequence[Any], guards: List[str]):
    """A TorchScript function asserting export's input ``guards`` (Python
    expressions over the placeholders' names) over ``args``."""
    params = []
    for node in args:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        kind = {bool: "bool", int: "int", float: "float"}.get(type(value), "Tensor")
        params.append(f"{node.name}: {kind}")
    body = "".join(
        f"    torch._assert({guard}, {('Guard failed: ' + guard)!r})\n" for guard in guards
    )
    source = f"def torch_stage_export_guards({', '.join(params)}) -> None:\n{body}    return\n"
    # TorchScript reads a function's source through linecache (as it does
    # for a GraphModule's generated code): a file name of its own.
    global _guard_sources
    _guard_sources += 1
    filename = f"<torch_stage export guards {_guard_sources}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: Dict[str, Any] = {"torch": torch, "Tensor": torch.Tensor, "__name__": __name__}
    exec(compile(source, filename, "exec"), namespace)
    function = namespace["torch_stage_export_guards"]
    try:
        torch.jit.script(function)
    except Exception as exc:  # noqa: BLE001 (said with the guards that did not compile)
        raise TypeError(
            "torch.jit.script: TorchScript cannot compile the input guards torch.export "
            f"made for this module ({type(exc).__name__}: {exc}); the guards: {guards}"
        ) from exc
    return function


_guard_sources = 0
_guards_lock = threading.Lock()


class MultiStreamGraphModule(_GraphModule):
    """The ``GraphModule`` :func:`torch_stage.multi_stream` returns for a
    plan that forks side streams.

    Its code is the rewritten graph's (TorchScript scripts it as any
    ``GraphModule``). Called from Python, a forward that raises finishes its
    stream run before the exception leaves: the caller's stream is current
    again and waits on the side streams, so an ``except`` block (an OOM
    retry) runs on the caller's stream. Without this the run would live on
    in the traceback's frame, and the thread on a side stream, for as long
    as the exception is kept (csrc/streams/stream_run.h).
    """

    _call = staticmethod(_finishing_call)


class _Rewrite(PlanWriter):
    """Inserts torch_stage's stream ops into ``graph`` following a raw plan
    (the module doc shows what goes where)."""

    share_constants = True
    join_keeps = True

    def __init__(
        self,
        root: torch.nn.Module,
        graph: torch.fx.Graph,
        analysis: GraphAnalysis,
        raw: dict,
        stream_plan: StreamPlan,
    ):
        super().__init__(graph, analysis, raw, stream_plan)
        self.root = root
        self.run_node: Optional[torch.fx.Node] = None
        # The record_event node after the last device node, while the next
        # sync may still carry it instead (no device work since).
        self.pending: Optional[torch.fx.Node] = None

    def _call(self, op, *args) -> torch.fx.Node:
        return self.graph.call_function(op, args)

    def fork(self, placeholders: List[torch.fx.Node]) -> None:
        probes: List[Any] = [p for p in placeholders if self._may_hold_tensor(p)]
        # A parameter decides the device for modules whose inputs are not
        # tensors; only for those: reading one through
        # nn.Module.__getattr__ on every call costs more host time than the
        # rest of the stream ops together. (A module given only CPU tensors
        # that it moves to its device itself then runs on one stream,
        # correctly; example inputs tell the pass which inputs hold tensors.)
        param = next(iter(self._tensor_attributes()), None)
        if param is not None and not probes:
            probes.append(self.graph.get_attr(param))
        # Stream lists as tuples: constants of the generated code, where a
        # list is built and freed on every forward (TorchScript reads a
        # tuple of ints as the ops' int[]).
        self.run_node = self._call(
            _ops.fork,
            self.plan.num_streams,
            tuple(self.fork_streams),
            self.num_events,
            tuple(probes),
        )

    def _may_hold_tensor(self, p: torch.fx.Node) -> bool:
        if p.target.startswith("**"):
            return False
        measured = p.meta.get("torch_stage_has_tensor")
        if measured is not None:
            return measured
        # An argument defaulting to a non-tensor (None, a flag, []) is
        # almost never given a tensor; leaving it out also keeps values
        # torch.ops cannot convert to `Any` (an empty list) out of fork.
        if p.args and not isinstance(p.args[0], torch.Tensor):
            return False
        # Annotated as a scalar or a string: never a tensor.
        return p.type not in (int, float, bool, str, complex)

    def _tensor_attributes(self):
        for name, _ in self.root.named_parameters():
            yield name
        for name, _ in self.root.named_buffers():
            yield name

    def sync(self, s: int, waits: List[int], keeps: List[torch.fx.Node]) -> None:
        """One sync, carrying the pending record."""
        record = -1
        if self.pending is not None:
            # sync records on the current stream: the pending record's.
            assert self.pending.args[2] == self.current, (self.pending, self.current)
            record = self.pending.args[1]
            self.graph.erase_node(self.pending)
            self.pending = None
        self._call(_ops.sync, self.run_node, record, s, tuple(waits), tuple(keeps) or None)

    def place(self, n: torch.fx.Node, s: int) -> None:
        # Device work on the current stream: a pending record stays before
        # it (the sync before n, if any, made s current).
        self.pending = None

    def record(self, n: torch.fx.Node, e: int, s: int) -> None:
        self.pending = self._call(_ops.record_event, self.run_node, e, s)

    def join(self, keeps: List[torch.fx.Node]) -> None:
        streams = tuple(self.join_streams)
        if keeps:
            self._call(_ops.join, self.run_node, streams, tuple(keeps))
        else:
            self._call(_ops.join, self.run_node, streams)
