"""What inductor will make of a graph Dynamo captured: its fusion units and
what each node costs, for planning streams that respect fusion.

inductor generates one kernel for a chain of pointwise ops, reductions and
data movement (``cat``, views), and runs matmuls, convolutions, attention
and every op it has no lowering for as extern kernels. A stream boundary
inside a fusible chain makes two kernels of one and adds an event between
them for nothing (inductor realizes every input that crosses a stream).
So the planner is told which nodes share a fusion unit, and colocates them.

Everything is asked of PyTorch itself:

* the ATen ops inductor lowers: Dynamo's graph traced with ``make_fx``
  under inductor's own decomposition table, on Dynamo's fake tensors (no
  real memory, no kernel), each ATen node tagged with the graph node it came
  from (``node.meta["custom"]``, which ``torch.fx.traceback`` carries as it
  carries user stream annotations);
* which of them become extern kernels: inductor's fallbacks, the ops whose
  inputs it must realize (``needs_realized_inputs``), the ops lowered by its
  kernel templates (``torch._inductor.kernel``: mm, bmm, convolution), and
  ops without a lowering;
* FLOPs: PyTorch's formulas (``torch.utils.flop_counter``), bytes from the
  fake tensors' shapes.

Costs are nominal microseconds on the cost model's device
(:mod:`torch_stage.streams.fx.cost_model`): one launch per kernel (an extern
op, or a fusion unit), FLOPs at its throughput, bytes at its bandwidth.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
import torch.fx

from torch_stage.streams.fx.cost_model import BYTES_PER_US, FLOPS_PER_US, LAUNCH_US

__all__ = ["InductorView", "inductor_view", "lowers_to_extern"]

# Tag put on Dynamo's nodes while tracing, read back from the ATen nodes.
_ORIGIN = "torch_stage_origin"
# Size hint for a symbolic dimension without one (unbacked): only the
# ratios between costs matter.
_UNKNOWN_DIM = 64


@dataclass
class InductorView:
    """inductor's view of a graph (see the module doc).

    Attributes:
        units: node names of each fusion unit that spans several graph
            nodes (the nodes one kernel, or one chain of kernels inductor
            fuses, is made from).
        cost: node name -> nominal microseconds.
        extern: names of nodes that run an extern kernel.
        kernels: how many kernels the graph makes: one per extern op and one
            per fusion unit that computes anything.
    """

    units: List[List[str]] = field(default_factory=list)
    cost: Dict[str, float] = field(default_factory=dict)
    extern: Set[str] = field(default_factory=set)
    kernels: int = 0


def lowers_to_extern(op: Any) -> bool:
    """Whether inductor runs ATen op ``op`` as an extern kernel (a fusion
    boundary) rather than generating code it can fuse."""
    # Importing lowering registers inductor's lowerings, its kernel
    # templates (mm, bmm, convolution) included.
    from torch._inductor import lowering

    if not isinstance(op, torch._ops.OpOverload):
        return False
    if op in lowering.fallbacks:
        return True
    realized = lowering.needs_realized_inputs
    if op in realized or op.overloadpacket in realized:
        return True
    fn = lowering.lowerings.get(op)
    if fn is None:
        return True
    return (getattr(fn, "__module__", None) or "").startswith("torch._inductor.kernel")


def _is_view(op: Any) -> bool:
    if op is operator.getitem:
        return True
    schema = getattr(op, "_schema", None)
    if not isinstance(op, torch._ops.OpOverload) or schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _hint(value: Any) -> int:
    if isinstance(value, int):
        return value
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None)
    if hint is not None:
        return int(hint(value, fallback=_UNKNOWN_DIM))
    node = getattr(value, "node", None)
    got = getattr(node, "hint", None)
    return int(got) if got is not None else _UNKNOWN_DIM


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _bytes(value: Any) -> int:
    return sum(math.prod(_hint(d) for d in t.shape) * t.element_size() for t in _tensors(value))


def _flops(node: torch.fx.Node) -> float:
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0.0

    def val(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    try:
        return float(_hint(formula(*args, **kwargs, out_val=node.meta.get("val"))))
    except (TypeError, ValueError, RuntimeError):
        return 0.0


def _trace(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """``gm`` as the ATen graph inductor lowers (inference, on fake tensors)."""
    # inductor's decompositions ask its lowering module (max_pool2d's does).
    import torch._inductor.lowering  # noqa: F401
    import torch.fx.traceback as fx_traceback
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    with fx_traceback.preserve_node_meta(), torch.no_grad(), fake_mode:
        return make_fx(torch.fx.Interpreter(gm).run, decomposition_table=select_decomp_table())(
            *fakes
        )


class _UnionFind:
    def __init__(self) -> None:
        self.parent: Dict[Any, Any] = {}

    def find(self, x: Any) -> Any:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: Any, b: Any) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def inductor_view(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
) -> Optional[InductorView]:
    """Fusion units and costs of ``gm``'s nodes as inductor will compile
    them; None when the graph cannot be traced to ATen (the planner then
    plans without them, as for the eager executor).

    ``gm`` is not modified (its nodes are tagged while tracing and untagged
    after)."""
    saved = {}
    for n in gm.graph.nodes:
        saved[n] = n.meta.get("custom")
        n.meta["custom"] = dict(saved[n] or {}, **{_ORIGIN: n.name})
    try:
        aten = _trace(gm, example_inputs)
    except Exception:  # noqa: BLE001  (any failure: plan without inductor's view)
        return None
    finally:
        for n, custom in saved.items():
            if custom is None:
                n.meta.pop("custom", None)
            else:
                n.meta["custom"] = custom
    return _view_of(aten)


def _origin(n: torch.fx.Node) -> Optional[str]:
    return (n.meta.get("custom") or {}).get(_ORIGIN)


def _view_of(aten: torch.fx.GraphModule) -> InductorView:
    view = InductorView()
    units = _UnionFind()
    computes: Set[torch.fx.Node] = set()
    ops = [n for n in aten.graph.nodes if n.op == "call_function"]
    position = {n: i for i, n in enumerate(ops)}
    for n in ops:
        origin = _origin(n)
        if origin is None or not _tensors(n.meta.get("val")):
            continue  # symbolic size arithmetic, or an op of no graph node
        if lowers_to_extern(n.target):
            view.extern.add(origin)
            view.kernels += 1
            cost = LAUNCH_US + _flops(n) / FLOPS_PER_US
            cost += (
                sum(_bytes(a.meta.get("val")) for a in n.all_input_nodes)
                + _bytes(n.meta.get("val"))
            ) / BYTES_PER_US
            view.cost[origin] = view.cost.get(origin, 0.0) + cost
            continue
        units.find(n)
        if not _is_view(n.target):
            computes.add(n)
            cost = _flops(n) / FLOPS_PER_US + _bytes(n.meta.get("val")) / BYTES_PER_US
            view.cost[origin] = view.cost.get(origin, 0.0) + cost
        for a in n.all_input_nodes:
            if a.op == "call_function" and not lowers_to_extern(a.target) and _origin(a):
                units.union(a, n)
    members: Dict[Any, List[torch.fx.Node]] = {}
    for n in units.parent:
        members.setdefault(units.find(n), []).append(n)
    for group in members.values():
        group.sort(key=position.__getitem__)
        kernel = [n for n in group if n in computes]
        if kernel:
            # One launch per unit, on the node that starts it.
            view.kernels += 1
            first = _origin(kernel[0])
            view.cost[first] = view.cost.get(first, 0.0) + LAUNCH_US
        names: List[str] = []
        for n in group:
            name = _origin(n)
            if name not in names:
                names.append(name)
        if len(names) > 1:
            view.units.append(names)
    return view
