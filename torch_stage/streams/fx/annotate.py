"""Tracing that records torch_stage's stream annotations.

:class:`AnnotatingTracer` is a ``torch.fx.Tracer`` that stamps every node
created inside :func:`torch_stage.stream` or :func:`torch_stage.colocate_with`
with ``node.meta["torch_stage"]``: ``{"stream": i}`` or
``{"colocate": anchor_name_or_None, "scope": id}`` (the innermost annotation
wins). With example inputs it also traces through control flow on tensor
values (``if x.sum() > 0``, ``for row in x``, ``len(x)``) by computing the
value from the example, like ``torch.jit.trace`` does; the graph then holds
the branch the example took, and a warning says so.
"""

from __future__ import annotations

import inspect
import operator
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx

from torch_stage.streams import annotations as _annotations
from torch_stage.streams.fx._example import attribute, clone_inputs, isolated

__all__ = ["AnnotatingTracer", "trace"]

META_KEY = "torch_stage"


def _version(t: torch.Tensor) -> Optional[int]:
    """``t``'s version counter; None for an inference tensor (it has none,
    and no write to one outside inference mode can happen)."""
    try:
        return t._version
    except RuntimeError:
        return None


class BufferAssignmentError(torch.fx.proxy.TraceError):
    """forward gives a buffer a new tensor while traced: a graph holds no
    attribute assignment (torch.export, the fallback, does)."""


class _ConcreteProxy(torch.fx.Proxy):
    """A proxy whose ``len()`` the tracer can compute from example inputs,
    and which records item assignment (``x[i] = v``, an in-place write the
    multi-stream pass orders) instead of failing."""

    def __len__(self) -> int:
        return self.tracer.length(self)

    def __setitem__(self, key, value) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


def check_none(value: Optional[torch.Tensor], message: str) -> None:
    """torch.fx's check that an argument traced as None is None at run time
    (``_assert_is_none``), in a form TorchScript compiles (fx's annotates
    the value as ``object``, which TorchScript has no type for)."""
    if not torch.jit.is_scripting():  # (alone: TorchScript skips the block)
        if isinstance(value, torch.fx.Proxy):
            # Traced again: an unpickled GraphModule re-traces its own code.
            value.tracer.create_proxy("call_function", check_none, (value, message), {})
            return
    if value is not None:
        raise AssertionError(message)


def _named_parameters(forward: Any) -> List[inspect.Parameter]:
    """forward's parameters as torch.fx makes its placeholders: positional
    ones, then keyword-only ones (then ``*args`` and ``**kwargs``, left
    out here)."""
    parameters = inspect.signature(forward).parameters.values()
    return [p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _keep_none_inputs(graph: torch.fx.Graph, forward: Any, names) -> None:
    """Mend the graph torch.fx made for the concrete None arguments
    ``names``: it calls the placeholder of ``scale`` ``scale_1`` (the code
    would take ``scale_1`` by keyword) and checks it with a function
    TorchScript cannot compile."""
    fx_check = getattr(torch.fx._symbolic_trace, "_assert_is_none", None)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is fx_check:
            node.target = check_none
            value, message = node.args
            # fx's message says what, not what to do.
            node.args = (
                value,
                f"{message}: it was None in the examples the graph was traced from, so "
                "the graph holds no branch for a value; trace or plan with examples that "
                "give it (example_inputs / example_kwargs)",
            )
    placeholders = [
        n for n in graph.nodes if n.op == "placeholder" and not n.target.startswith("*")
    ]
    for node, p in zip(placeholders, _named_parameters(forward)):
        if p.name in names:
            node.target = p.name
            if node.type is None:
                node.type = Optional[torch.Tensor]


def bind_examples(
    module: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> inspect.BoundArguments:
    """``args`` and ``kwargs`` bound to ``module.forward``'s parameters, or
    a TypeError that shows the signature."""
    signature = inspect.signature(module.forward)
    try:
        return signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"example_inputs and example_kwargs do not fit "
            f"{type(module).__name__}.forward{signature}: {exc}"
        ) from None


def examples_by_position(
    module: torch.nn.Module, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]] = None
) -> Optional[Tuple[Any, ...]]:
    """Example inputs as :class:`AnnotatingTracer`'s placeholders take them:
    forward's parameters in order, up to the last one given, defaults where
    none is; None when an example has no place there (it goes to
    ``**kwargs``, or to ``*args`` before a keyword-only argument)."""
    args = tuple(args)
    parameters = inspect.signature(module.forward).parameters.values()
    positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
    if not kwargs and (
        len(args) <= positional or not any(p.kind is p.KEYWORD_ONLY for p in parameters)
    ):
        # (Examples past the positional parameters go to *args, whose
        # placeholder comes after any keyword-only ones: placed below.)
        return args
    bound = bind_examples(module, args, kwargs or {}).arguments
    values: List[Any] = []
    missing: List[Any] = []  # defaults, added once a later argument is given
    # torch.fx's placeholders: positional parameters, then keyword-only
    # ones, then *args (fed from the examples left), then **kwargs.
    for p in parameters:
        if not bound:
            break
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if p.kind is p.VAR_POSITIONAL and not bound.pop(p.name, ()):
                continue
            return None
        if p.name in bound:
            values += missing + [bound.pop(p.name)]
            missing = []
        else:
            missing.append(p.default)
    return tuple(values)


def _forward(root: Any) -> Any:
    return root.forward if isinstance(root, torch.nn.Module) else root


class AnnotatingTracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` that records stream annotations in node meta.

    Args:
        num_streams: the pool size the annotations are checked against while
            tracing (``torch_stage.stream(i)`` needs ``i < num_streams``);
            ``None`` checks against :data:`torch_stage.MAX_STREAMS`.
        example_inputs: positional inputs of ``forward``; when given, control
            flow on traced values is decided from them.
    """

    def __init__(
        self,
        num_streams: Optional[int] = None,
        example_inputs: Optional[Sequence[Any]] = None,
    ):
        super().__init__()
        # Buffers read in forward become get_attr nodes, as parameters do:
        # otherwise an op on a buffer alone runs once, while tracing, and
        # the graph holds its result as a constant (self.bn.running_mean * 2
        # frozen at its value then) or nothing at all (an in-place write,
        # self.bn.running_mean.add_(1), done once to the module's buffer).
        self.proxy_buffer_attributes = True
        self.num_streams = num_streams
        self.example_inputs = None if example_inputs is None else tuple(example_inputs)
        self.specialised: List[str] = []
        # forward's arguments of a Python scalar value (a bool flag, an int)
        # that control flow was decided on, by name: their example values,
        # which the graph holds (the multi-stream pass checks each call).
        self.fixed_arguments: Dict[str, Any] = {}
        self._fixed_seen: set = set()  # nodes whose inputs _fix_arguments walked
        self._base_depth = 0
        self._values: Dict[torch.fx.Node, Any] = {}
        self._inputs: Optional[tuple] = None
        self._evaluating = False

    def trace(self, root, concrete_args=None) -> torch.fx.Graph:
        try:
            return self._trace(root, concrete_args)
        except BufferAssignmentError:
            raise  # tracing without proxies would lose the assignment silently
        except Exception as exc:
            buffers = root.buffers() if isinstance(root, torch.nn.Module) else ()
            if str(exc).startswith("torch_stage.") or next(iter(buffers), None) is None:
                raise  # a bad annotation, or nothing the retry would change
            first = exc
        # A forward that takes a buffer's value as a Python value
        # (int(self.steps), a branch on it) cannot have the buffer as a
        # proxy: trace as torch.fx does by default, where an op on a buffer
        # alone runs once, here (if that fails too, the first failure is the
        # one to explain). An in-place write to a buffer would then run on
        # the user's buffer and be missing from the graph: each buffer's
        # value is kept to put back, and such a write is refused.
        kept = [
            (name, b, _version(b), b.detach().clone())
            for name, b in root.named_buffers()
            if type(b) is torch.Tensor and _version(b) is not None
        ]
        self.proxy_buffer_attributes = False
        try:
            graph = self._trace(root, concrete_args)
        except Exception:  # noqa: BLE001  (any tracing failure: the first is explained)
            graph = None
        finally:
            self.proxy_buffer_attributes = True
            written = [name for name, b, version, _ in kept if _version(b) != version]
            with torch.no_grad():
                for _, b, version, value in kept:
                    if _version(b) != version:
                        b.copy_(value)
        if written:
            raise BufferAssignmentError(
                f"{type(root).__name__}.forward writes buffer '{written[0]}' and reads a "
                f"buffer as a Python value ({type(first).__name__}: {first}); traced with "
                "buffers as constants, as that needs, the write would run once, while "
                "tracing, instead of in the graph"
            ) from first
        if graph is None:
            raise first
        return graph

    def _trace(self, root, concrete_args) -> torch.fx.Graph:
        state = _annotations._annotations
        saved = (state.tracing, state.pool_size, len(state.stack))
        state.tracing = True
        state.pool_size = self.num_streams
        # Annotations already open around the call do not apply to the module.
        self._base_depth = len(state.stack)
        self._values = {}
        self._inputs = None
        self.specialised = []
        self.fixed_arguments = {}
        self._fixed_seen = set()
        assign = torch.nn.Module.__setattr__

        def guarded(module: torch.nn.Module, name: str, value: Any) -> None:
            if isinstance(value, torch.fx.Proxy) and name in module.__dict__.get("_buffers", {}):
                raise BufferAssignmentError(
                    f"{type(module).__name__}.forward assigns buffer '{name}' a new tensor "
                    f"(self.{name} = ... or self.{name} += ...), which a torch.fx graph "
                    "cannot hold; write it in place instead "
                    f"(self.{name}.add_(...), self.{name}.copy_(...))"
                )
            assign(module, name, value)

        # Patched for the trace only, as torch.fx patches Module.__call__:
        # left alone, the assignment stored the tracer's proxy in the
        # user's own module, which then returned proxies.
        torch.nn.Module.__setattr__ = guarded
        none_inputs = None
        if concrete_args is None:
            concrete_args = none_inputs = self._none_inputs(root)
        try:
            graph = super().trace(root, concrete_args)
        finally:
            torch.nn.Module.__setattr__ = assign
            state.tracing, state.pool_size = saved[0], saved[1]
            del state.stack[saved[2] :]
            self._values = {}
            self._inputs = None
        if none_inputs:
            _keep_none_inputs(graph, _forward(root), none_inputs)
        if self.specialised:
            warnings.warn(
                "torch_stage: control flow on traced values was decided from "
                f"example_inputs at {', '.join(self.specialised)}; the traced graph "
                "assumes inputs that take the same branches",
                stacklevel=2,
            )
        return graph

    def _none_inputs(self, root) -> Optional[Dict[str, None]]:
        """forward's arguments whose example value is None (given, or the
        default of one not given), as ``concrete_args``: a branch on ``mask
        is None`` is decided by the example, as a branch on a traced value
        is. (A proxy is never None, so it would otherwise take the branch
        for a tensor, which the example then fails.) torch.fx keeps the
        placeholder and checks at run time that the value is None."""
        if self.example_inputs is None:
            return None
        found = {}
        # The examples come in the order of the placeholders.
        for position, p in enumerate(_named_parameters(_forward(root))):
            if position < len(self.example_inputs):
                if self.example_inputs[position] is None:
                    found[p.name] = None
            elif p.default is None:
                found[p.name] = None
        return found or None

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        stack = _annotations._annotations.stack
        if kind.startswith("call_") and len(stack) > self._base_depth:
            what, value = stack[-1]
            if what == "stream":
                node.meta[META_KEY] = {"stream": value}
            else:
                node.meta[META_KEY] = {"colocate": value.anchor, "scope": id(value)}
        return node

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _ConcreteProxy(node, self)

    # While example values are computed, the module runs for real: the
    # tracer's patched Module.__call__ and parameter access must not record.
    def call_module(self, m, forward, args, kwargs):
        if self._evaluating:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._evaluating:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    # Control flow on traced values.
    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        value = bool(self._concrete(obj, "is used as a condition"))
        self.specialised.append(f"{obj.node.name} (taken as {value})")
        self._fix_arguments(obj.node)
        return value

    def iter(self, obj: torch.fx.Proxy) -> Iterator:
        count = len(self._concrete(obj, "is iterated"))
        self.specialised.append(f"{obj.node.name} (iterated over {count} items)")
        self._fix_arguments(obj.node)
        return iter([obj[i] for i in range(count)])

    def length(self, obj: torch.fx.Proxy) -> int:
        count = len(self._concrete(obj, "is passed to len()"))
        self.specialised.append(f"{obj.node.name} (length {count})")
        self._fix_arguments(obj.node)
        return count

    def _fix_arguments(self, node: torch.fx.Node) -> None:
        """Note the arguments of Python scalar values that a decision on
        ``node`` depends on: the graph holds their examples' branch, which
        a call can be checked against exactly (a tensor's values cannot).
        A node walked for an earlier decision is not walked again: what it
        depends on is noted already."""
        seen, todo = self._fixed_seen, [node]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            value = self._values.get(n)
            if (
                n.op == "placeholder"
                and not n.target.startswith("*")  # unrolled *args: their own guard
                and type(value) in (bool, int, float, str)
            ):
                self.fixed_arguments.setdefault(n.target, value)
            todo.extend(n.all_input_nodes)

    def _concrete(self, obj: torch.fx.Proxy, what: str) -> Any:
        if self.example_inputs is None:
            raise torch.fx.proxy.TraceError(
                f"the traced value {obj.node.name} {what}, which symbolic tracing "
                "cannot follow without example inputs"
            )
        node = obj.node
        if node not in self._values:
            self._evaluate_up_to(node)
        return self._values[node]

    def _evaluate_up_to(self, target: torch.fx.Node) -> None:
        root = self.root
        if self._inputs is None:
            self._inputs = clone_inputs(self.example_inputs)
        inputs = self._inputs
        position = 0
        self._evaluating = True
        try:
            with isolated(root, inputs):
                for node in self.graph.nodes:
                    if node.op == "placeholder":
                        value = self._placeholder(node, position, inputs)
                        position += 1
                    elif node in self._values:
                        continue
                    else:
                        value = self._run(node, root)
                    self._values[node] = value
                    if node is target:
                        return
        finally:
            self._evaluating = False

    def _placeholder(self, node: torch.fx.Node, position: int, inputs: tuple) -> Any:
        if node.target.startswith("*"):
            return tuple(inputs[position:])
        if position < len(inputs):
            return inputs[position]
        if node.args:
            return node.args[0]
        raise ValueError(
            f"example_inputs has {len(inputs)} values, but forward needs argument "
            f"{node.target!r} at position {position}"
        )

    def _run(self, node: torch.fx.Node, root: torch.nn.Module) -> Any:
        args = torch.fx.node.map_arg(node.args, self._values.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, self._values.__getitem__)
        if node.op == "get_attr":
            return attribute(root, node.target)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, node.target)(*rest, **kwargs)
        if node.op == "call_module":
            return root.get_submodule(node.target)(*args, **kwargs)
        raise AssertionError(f"cannot evaluate a {node.op} node")


def trace(
    module: torch.nn.Module,
    num_streams: Optional[int] = None,
    example_inputs: Optional[Sequence[Any]] = None,
    example_kwargs: Optional[Mapping[str, Any]] = None,
) -> torch.fx.GraphModule:
    """Trace ``module`` with :class:`AnnotatingTracer`.

    The result can be inspected or edited, then given to
    :func:`torch_stage.multi_stream`, which keeps its annotations.

    Args:
        module: the module to trace.
        num_streams: the pool size annotations must fit (``None``: up to
            :data:`torch_stage.MAX_STREAMS`).
        example_inputs: positional inputs; see :class:`AnnotatingTracer`.
        example_kwargs: keyword inputs of the same call, by forward's
            argument names (as for :func:`torch_stage.multi_stream`).

    Returns:
        A ``torch.fx.GraphModule`` whose nodes carry ``meta["torch_stage"]``
        where annotated.
    """
    if example_kwargs:
        example_inputs = examples_by_position(module, example_inputs or (), example_kwargs)
        if example_inputs is None:
            raise TypeError(
                f"example_kwargs {sorted(example_kwargs)}: symbolic tracing takes "
                "forward's arguments by position, and one of them has none (it goes to "
                "**kwargs); torch_stage.multi_stream captures such a call with torch.export"
            )
    tracer = AnnotatingTracer(num_streams=num_streams, example_inputs=example_inputs)
    graph = tracer.trace(module)
    name = type(module).__name__ if isinstance(module, torch.nn.Module) else "traced"
    return torch.fx.GraphModule(tracer.root, graph, name)
