"""From a ``torch.fx`` graph to the scheduler's DAG.

:class:`GraphAnalysis` sorts the nodes of a graph
(:mod:`torch_stage.streams.fx.classify`) into

* inputs (placeholders, parameters): ready at entry, never waited on;
* host nodes: metadata and Python arithmetic on it (``x.shape``,
  ``x.size(0) * 2``): no device work, so no stream and no event;
* constants: deterministic factories of fresh tensors (``torch.zeros(n)``):
  re-created on each stream that uses them, as DeepRec duplicates Const
  nodes, so they never cause a wait;
* aliases: views, ``getitem`` of a multi-output result, ``nn.Identity``:
  they launch no device work, so they get no stream and no event of their
  own; a node that reads one depends on the device nodes whose memory it
  aliases (unless the alias is annotated or written in place: then it is a
  device node);
* device nodes: everything else, the nodes of the scheduler's DAG, numbered
  in graph order (which is the issue order: where the pass issues the
  nodes stream by stream, :meth:`GraphAnalysis.reordered` numbers them
  again in that order).

Dependencies are data edges (a device node reads another's result) and
order edges: side-effecting nodes (in-place writes, impure modules: those
that write their own parameters or buffers, from the ops they run) stay in
their relative order, and an in-place write is ordered after every earlier
reader and before every later reader of the tensors it may alias. What may
alias what comes from real storage when example inputs are given, else from
the ops (fx/effects.py: views, and any op that may return its input itself,
``contiguous`` or eval-mode dropout, by its schema or a run on meta
stand-ins). Parameters and buffers are not nodes: ``get_attr`` nodes reach
them, and a ``call_module`` node reads its module's (and writes them, if it
writes its own state); both are tied to the tensors' storage, so a write
through ``self.a.weight.data`` and the call ``self.a(x)``, or two modules
sharing one weight, are ordered like any other write and read. Random ops
need no edge between streams: their values are fixed by their launch order
on the host, which the rewrite keeps (an issue order of
torch_stage/streams/fx/calls.py keeps them in their relative order;
:attr:`GraphAnalysis.random` holds them).

:func:`torch_stage.streams.fx.stream_plan.plan` sends the DAG to the C++ scheduler
and wraps the answer in a :class:`~torch_stage.streams.fx.stream_plan.StreamPlan`.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx
from torch.fx.passes.shape_prop import ShapeProp

from torch_stage.streams.fx import _ops
from torch_stage.streams.fx._example import attribute, clone_inputs, isolated, tensors_in
from torch_stage.streams.fx.annotate import META_KEY
from torch_stage.streams.fx.classify import (
    ALIAS,
    CONST,
    DEVICE,
    HOST,
    INPUT,
    OUTPUT,
    classify,
    is_alias,
    is_embedding,
)
from torch_stage.streams.fx.cost_model import default_cost, is_view
from torch_stage.streams.fx.effects import (
    aliased_args,
    draws_random,
    known_effects,
    probe_cache,
    user_callable_args,
    writes_module_state,
    written_args,
)

__all__ = ["GraphAnalysis"]


class _ShapeAndAlias(ShapeProp):
    """ShapeProp that also records, per node, whether its result holds a
    tensor and which input nodes its result shares memory with."""

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:  # noqa: BLE001  (any failure of forward: re-raised, explained)
            # ShapeProp's own message names the node but not the failure,
            # which it keeps as the cause.
            cause = exc.__cause__ or exc
            raise RuntimeError(
                f"forward fails on the example inputs at {n.format_node()}: "
                f"{type(cause).__name__}: {cause}"
            ) from cause
        produced = tensors_in(result)
        n.meta["torch_stage_has_tensor"] = bool(produced)
        ptrs = {_storage_ptr(t) for t in produced} - {None}
        aliases = []
        for arg in n.all_input_nodes:
            if ptrs & {_storage_ptr(t) for t in tensors_in(self.env.get(arg))}:
                aliases.append(arg.name)
        n.meta["torch_stage_aliases"] = aliases
        return result


def _storage_ptr(t: torch.Tensor) -> Optional[int]:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def add(self) -> int:
        """A new element, in a set of its own."""
        self.parent.append(len(self.parent))
        return len(self.parent) - 1


class GraphAnalysis:
    """The scheduler's view of a graph (see the module doc).

    Args:
        gm: the graph module (or the module owning ``graph``'s submodules
            and parameters).
        example_inputs: positional inputs for one forward call, or None.
            With them the nodes get ``meta["tensor_meta"]`` (and torch_stage
            keys).
        cost_model: ``cost_model(node) -> float`` or None for the default.
        num_streams: the pool size annotations are checked against.
        graph: the graph to analyse, if not ``gm.graph`` (a copy about to
            be rewritten).
        colocate: groups of node names that should share a stream (the
            nodes of one kernel a compiler fuses), unless annotations put
            them apart.
    """

    def __init__(
        self,
        gm: torch.nn.Module,
        example_inputs: Optional[Sequence[Any]],
        cost_model: Optional[Callable[[torch.fx.Node], float]],
        num_streams: int,
        graph: Optional[torch.fx.Graph] = None,
        colocate: Sequence[Sequence[str]] = (),
    ):
        self._colocate = colocate
        # Each node is run on meta stand-ins once, though its writes, its
        # aliases and its module's state are asked about separately.
        with probe_cache():
            self._analyse(gm, example_inputs, cost_model, num_streams, graph)

    def _analyse(self, gm, example_inputs, cost_model, num_streams, graph) -> None:
        self.gm = gm
        self.graph = graph if graph is not None else gm.graph
        self.num_streams = num_streams
        self.nodes: List[torch.fx.Node] = list(self.graph.nodes)
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.shapes_known = example_inputs is not None
        self.costs_known = cost_model is not None or self.shapes_known
        for n in self.nodes:
            if n.op == "call_function" and n.target in _ops.STREAM_OPS:
                raise ValueError(
                    f"the graph already contains torch_stage stream ops ({n.name}); "
                    "give multi_stream the original module or graph"
                )
        if self.shapes_known:
            self._propagate(example_inputs)
        self.kind: Dict[torch.fx.Node, str] = {}
        for n in self.nodes:
            self.kind[n] = classify(self, n)
        self._state_writes: Dict[torch.fx.Node, bool] = {}
        self.mutated: Dict[torch.fx.Node, List[torch.fx.Node]] = {}
        for n in self.nodes:
            if self.kind[n] not in (INPUT, OUTPUT, HOST):
                targets = self._mutated_args(n)
                if targets:
                    self.mutated[n] = targets
        self._families = self._alias_families()
        written = {
            self._families.find(self.position[t]) for ts in self.mutated.values() for t in ts
        }
        self._written = written
        for n in self.nodes:
            if self.kind[n] == CONST and (
                n in self.mutated or self._families.find(self.position[n]) in written
            ):
                self.kind[n] = DEVICE
        for n in self.nodes:
            if self.kind[n] == DEVICE and n not in self.mutated and is_alias(self.gm, n):
                self.kind[n] = ALIAS
        self.device_nodes = [n for n in self.nodes if self.kind[n] == DEVICE]
        self.index = {n: i for i, n in enumerate(self.device_nodes)}
        self.constants = [n for n in self.nodes if self.kind[n] == CONST]
        self.edges: Dict[Tuple[int, int], int] = {}
        self._data_edges()
        self._order_edges()
        self.costs = [self._cost(n, cost_model) for n in self.device_nodes]
        self.fixed, self.colocation = self._placements()
        self.embedding_group = self._embedding_groups()
        # Asked here, where the probes are cached, for the issue order
        # (torch_stage/streams/fx/calls.py).
        self.random = {n for n in self.device_nodes if draws_random(n, gm)}

    # -- shapes -----------------------------------------------------------

    def _propagate(self, example_inputs: Sequence[Any]) -> None:
        inputs = clone_inputs(tuple(example_inputs))
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        if len(inputs) > len(placeholders) and not any(
            p.target.startswith("*") for p in placeholders
        ):
            names = ", ".join(p.target for p in placeholders)
            raise ValueError(
                f"example_inputs has {len(inputs)} values, but forward takes "
                f"{len(placeholders)} ({names})"
            )
        runnable = self.gm
        if not isinstance(runnable, torch.fx.GraphModule) or runnable.graph is not self.graph:
            runnable = torch.fx.GraphModule(self.gm, self.graph)
        with isolated(runnable, inputs):
            _ShapeAndAlias(runnable).propagate(*inputs)

    def reordered(self, nodes: Sequence[torch.fx.Node]) -> GraphAnalysis:
        """This analysis with its device nodes numbered in the order they
        have in ``nodes`` (every node of the graph, in an order that keeps
        its dependencies: torch_stage/streams/fx/calls.py); the graph itself
        is not changed. What nodes are, read and write stays as analysed."""
        if len(nodes) != len(self.nodes) or set(nodes) != set(self.nodes):
            raise ValueError("reordered takes every node of the analysed graph, once")
        out = copy.copy(self)
        out.nodes = list(nodes)
        out.device_nodes = [n for n in nodes if self.kind[n] == DEVICE]
        out.index = {n: i for i, n in enumerate(out.device_nodes)}
        out.constants = [n for n in nodes if self.kind[n] == CONST]
        new = [out.index[n] for n in self.device_nodes]  # old index -> new
        old = [self.index[n] for n in out.device_nodes]  # new index -> old
        out.edges = {(new[u], new[v]): kind for (u, v), kind in self.edges.items()}
        if any(u >= v for u, v in out.edges):
            raise ValueError("reordered: the order puts a node before one it depends on")
        out.costs = [self.costs[i] for i in old]
        out.fixed = [self.fixed[i] for i in old]
        out.colocation = [self.colocation[i] for i in old]
        out.embedding_group = [self.embedding_group[i] for i in old]
        return out

    # -- classification ---------------------------------------------------

    def written_in_place(self, n: torch.fx.Node) -> bool:
        """Whether a node of the graph writes ``n``, or what ``n`` may
        alias, in place (its shape too may change: ``unsqueeze_``)."""
        return n in self.mutated or self._families.find(self.position[n]) in self._written

    def family(self, n: torch.fx.Node) -> int:
        """The set of nodes whose memory ``n`` may share (an id)."""
        return self._families.find(self.position[n])

    def untargeted_effects(self, n: torch.fx.Node) -> bool:
        """Whether ``n`` has side effects with no known target (an impure
        module, an effectful function): such nodes keep their order among
        themselves."""
        return n not in self.mutated and self._impure(n)

    def roots(self, n: torch.fx.Node) -> List[torch.fx.Node]:
        """The device nodes whose result ``n`` is or aliases."""
        kind = self.kind.get(n)
        if kind == DEVICE:
            return [n]
        if kind != ALIAS:
            return []
        found: List[torch.fx.Node] = []
        for a in n.all_input_nodes:
            for r in self.roots(a):
                if r not in found:
                    found.append(r)
        return found

    def _mutated_args(self, n: torch.fx.Node) -> List[torch.fx.Node]:
        found: List[Any] = []
        if n.op == "call_module":
            module = self.gm.get_submodule(n.target)
            if getattr(module, "inplace", False) is True and n.args:
                found.append(n.args[0])
            elif not known_effects(n, self.gm):
                # A user's leaf module is not run at planning time: it may
                # write any tensor it is given (fx/effects.py).
                found.extend(user_callable_args(n))
        elif n.op in ("call_function", "call_method"):
            # From the ATen schemas of what the node runs (fx/effects.py).
            found.extend(_flat_nodes(written_args(n, self.gm)))
            if "out" in n.kwargs:
                found.extend(_flat_nodes(n.kwargs["out"]))
        return [x for x in found if isinstance(x, torch.fx.Node)]

    def _impure(self, n: torch.fx.Node) -> bool:
        if n in self.mutated:
            return True
        if n.op == "call_module":
            return self._writes_own_state(n)
        if n.op == "call_function":
            effectful = getattr(torch.fx.node, "_side_effectful_functions", set())
            return n.target in effectful
        return False

    def _writes_own_state(self, n: torch.fx.Node) -> bool:
        """Whether the ``call_module`` node ``n`` writes its module's
        parameters or buffers (or may: a module marked impure)."""
        if n in self._state_writes:
            return self._state_writes[n]
        module = self.gm.get_submodule(n.target)
        if getattr(module, "_is_impure", False):
            writes = True
        elif (
            isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            and module.training
            and module.track_running_stats
        ):
            # Batch norm in training updates its running statistics.
            writes = True
        else:
            # Any other torch.nn module that writes its own parameters or
            # buffers, from the ops it runs (an embedding with max_norm
            # renormalises the rows it reads: two lookups into one table
            # both write it).
            writes = writes_module_state(n, self.gm)
            if writes is None:
                # Not known: in training, a module that holds buffers is
                # taken to write them, as spectral norm's power iteration
                # and instance norm's running statistics do. (At worst, two
                # calls of one such module then keep their order.)
                writes = module.training and next(module.buffers(), None) is not None
        self._state_writes[n] = writes
        return writes

    # -- dependencies -----------------------------------------------------

    def _aliases(self, n: torch.fx.Node) -> List[torch.fx.Node]:
        """Input nodes whose memory ``n``'s result may share."""
        if self.shapes_known and "torch_stage_aliases" in n.meta:
            names = set(n.meta["torch_stage_aliases"])
            return [a for a in n.all_input_nodes if a.name in names]
        found = []
        identity = n.op == "call_module" and isinstance(
            self.gm.get_submodule(n.target), torch.nn.Identity
        )
        if (is_view(n) or identity) and n.args and isinstance(n.args[0], torch.fx.Node):
            found.append(n.args[0])
        # Ops that may return an input itself, from the op (effects.py).
        found.extend(a for a in aliased_args(n, self.gm) if a not in found)
        # In-place ops return (an alias of) what they write.
        found.extend(self.mutated.get(n, []))
        return found

    def _alias_families(self) -> _UnionFind:
        """Sets of nodes that may share memory; besides the graph's nodes,
        the union-find holds an element per storage of a parameter or
        buffer (``self._storage_elements``), in the set of the ``get_attr``
        nodes that read it."""
        families = _UnionFind(len(self.nodes))
        self._storage_elements: Dict[Any, int] = {}
        for n in self.nodes:
            for a in self._aliases(n):
                families.union(self.position[n], self.position[a])
        # FX makes a get_attr node per access: every node of one parameter
        # or buffer (or of tied ones, which share storage) is one family.
        for n in self.nodes:
            if n.op == "get_attr":
                key = _attribute_storage(self.gm, n.target)
                families.union(self._storage_element(families, key), self.position[n])
        # The caller may pass one tensor (or views of one) as two inputs:
        # nothing at planning time says they are distinct, so where the
        # graph writes an input, every input is taken to be what it writes.
        # Not Dynamo's inputs (a "grapharg"): Dynamo passes a tensor given
        # twice as one input, and its parameters and buffers are inputs too,
        # which batch norm in training writes (all would be one family).
        inputs = [
            self.position[n]
            for n in self.nodes
            if n.op == "placeholder" and "grapharg" not in n.meta
        ]
        written = {families.find(self.position[t]) for ts in self.mutated.values() for t in ts}
        if any(families.find(p) in written for p in inputs):
            for p in inputs[1:]:
                families.union(inputs[0], p)
        return families

    def _storage_element(self, families: _UnionFind, key: Any) -> int:
        element = self._storage_elements.get(key)
        if element is None:
            element = self._storage_elements[key] = families.add()
        return element

    def _module_state(self, written: Set[int]) -> Dict[int, List[torch.fx.Node]]:
        """Family -> the ``call_module`` device nodes whose module's
        parameters or buffers are in it (they read them, and write them
        where the module writes its own state), for the families of
        ``written`` and those of the state that modules write; empty when
        nothing writes a parameter or buffer, the common case, so that
        planning does not walk every module's parameters for nothing."""
        families = self._families
        calls = [n for n in self.device_nodes if n.op == "call_module"]
        writers = [n for n in calls if self._writes_own_state(n)]
        holding_state = {families.find(e) for e in self._storage_elements.values()}
        if not writers and not (written & holding_state):
            return {}
        found: Dict[int, List[torch.fx.Node]] = {}
        for n in calls:
            module = self.gm.get_submodule(n.target)
            roots = set()
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                key = _storage_key(t, f"{n.target}.{name}")
                roots.add(families.find(self._storage_element(families, key)))
            for root in roots:
                found.setdefault(root, []).append(n)
        return found

    def _add_edge(self, u: torch.fx.Node, v: torch.fx.Node, kind: int) -> None:
        key = (self.index[u], self.index[v])
        if key[0] == key[1]:
            return
        # Data (0) wins over order (1).
        self.edges[key] = min(kind, self.edges.get(key, 1))

    def _data_edges(self) -> None:
        for v in self.device_nodes:
            for u in v.all_input_nodes:
                for r in self.roots(u):
                    self._add_edge(r, v, 0)

    def _order_edges(self) -> None:
        # Side effects with no known target (impure modules, effectful
        # functions, batch norm's running statistics) keep their order among
        # themselves. In-place writes with known targets do not join that
        # chain: they are ordered per storage below, so writes to different
        # tensors (each branch's in-place ReLU) stay free.
        previous = None
        for v in self.device_nodes:
            if self.untargeted_effects(v):
                if previous is not None:
                    self._add_edge(previous, v, 1)
                previous = v
        find = self._families.find
        members: Dict[int, List[torch.fx.Node]] = {}
        for n in self.nodes:
            members.setdefault(find(self.position[n]), []).append(n)
        writes: List[Tuple[torch.fx.Node, Set[int]]] = [
            (m, {find(self.position[t]) for t in targets})
            for m, targets in self.mutated.items()
            if self.kind[m] == DEVICE
        ]
        # Module calls touch their parameters and buffers, which are not
        # nodes: through their storage's family (see _module_state).
        state = self._module_state({f for _, fs in writes for f in fs})
        calls: Dict[torch.fx.Node, Set[int]] = {}
        for root, nodes in state.items():
            for n in nodes:
                calls.setdefault(n, set()).add(root)
        writes += [(n, fs) for n, fs in calls.items() if self._writes_own_state(n)]
        for m, written in writes:
            # Every device node that touches the families, members included:
            # another writer of them (write after write), a view that may
            # copy (a read), a module call reading its parameters.
            touching: Set[torch.fx.Node] = set()
            for f in written:
                for member in members.get(f, ()):
                    touching.update(member.users)
                touching.update(state.get(f, ()))
            for r in touching:
                if r is m or self.kind.get(r) != DEVICE:
                    continue
                if self.position[r] < self.position[m]:
                    self._add_edge(r, m, 1)
                else:
                    self._add_edge(m, r, 1)
            # Views created from the family before the write and read after
            # it are covered through their readers above.

    # -- costs and placements ---------------------------------------------

    def _cost(self, n: torch.fx.Node, cost_model) -> float:
        if cost_model is None:
            if self.shapes_known:
                return default_cost(n, self.gm)
            return 0.0 if is_view(n) else 1.0
        value = cost_model(n)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"cost_model must return a number, got {type(value).__name__} ({value!r}) "
                f"for node {n.name!r} ({n.op} {_target_name(n)})"
            )
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"cost_model returned {value} for node {n.name!r} ({n.op} {_target_name(n)}): "
                "costs must be finite and >= 0"
            )
        return value

    def _placements(self) -> Tuple[List[int], List[int]]:
        count = len(self.device_nodes)
        fixed = [-1] * count
        for i, n in enumerate(self.device_nodes):
            note = n.meta.get(META_KEY) or {}
            if "stream" in note:
                s = note["stream"]
                if not 0 <= s < self.num_streams:
                    raise ValueError(
                        f"node {n.name!r} is annotated torch_stage.stream({s}), outside the "
                        f"pool of {self.num_streams} streams (valid ids: "
                        f"0..{self.num_streams - 1})"
                    )
                fixed[i] = s
        groups = _UnionFind(count)
        group_fixed = list(fixed)

        def join(a: int, b: int, strict: bool) -> None:
            ra, rb = groups.find(a), groups.find(b)
            if ra == rb:
                return
            fa, fb = group_fixed[ra], group_fixed[rb]
            if fa >= 0 and fb >= 0 and fa != fb:
                if strict:
                    raise ValueError(
                        f"torch_stage.colocate_with: {self.device_nodes[a].name!r} and "
                        f"{self.device_nodes[b].name!r} must share a stream but are "
                        f"annotated with streams {fa} and {fb}"
                    )
                return
            groups.union(ra, rb)
            group_fixed[groups.find(ra)] = fa if fa >= 0 else fb

        by_name = {n.name: n for n in self.nodes}
        scopes: Dict[int, int] = {}
        for i, n in enumerate(self.device_nodes):
            note = n.meta.get(META_KEY) or {}
            if "scope" not in note:
                continue
            first = scopes.setdefault(note["scope"], i)
            join(first, i, True)
            anchor = by_name.get(note.get("colocate"))
            if anchor is not None and anchor in self.index:
                join(self.index[anchor], i, True)
        # Views follow their producer (they launch nothing), unless annotated.
        for i, n in enumerate(self.device_nodes):
            if META_KEY in n.meta or not is_view(n):
                continue
            producer = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
            if producer is not None and producer in self.index:
                join(self.index[producer], i, False)
        for names in self._colocate:
            members = [self.index[by_name[m]] for m in names if by_name.get(m) in self.index]
            for i in members[1:]:
                join(members[0], i, False)
        colocation = [-1] * count
        sizes: Dict[int, int] = {}
        for i in range(count):
            root = groups.find(i)
            sizes[root] = sizes.get(root, 0) + 1
        for i in range(count):
            root = groups.find(i)
            if sizes[root] > 1:
                colocation[i] = root
        return fixed, colocation

    def _embedding_groups(self) -> List[int]:
        groups = [-1] * len(self.device_nodes)
        count = 0
        for i, n in enumerate(self.device_nodes):
            if is_embedding(self.gm, n):
                groups[i] = count
                count += 1
        self.num_embedding_lookups = count
        return groups


def _attribute_storage(gm: torch.nn.Module, target: str) -> Any:
    """What a get_attr node reads, for telling when two read the same
    memory: a tensor's storage (see :func:`_storage_key`), else (an
    attribute that is no tensor) the target's name."""
    try:
        value = attribute(gm, target)
    except AttributeError:
        return ("name", target)
    if not isinstance(value, torch.Tensor):
        return ("name", target)
    return _storage_key(value, target)


def _storage_key(t: torch.Tensor, name: str) -> Any:
    """The memory of parameter or buffer ``t`` (named ``name``), the same
    for every tensor over one storage (tied weights, ``.data``): its
    storage's address and device. A tensor without storage (a subclass's
    wrapper) or without memory (no elements, the meta device: nothing to
    race on, and their address, 0, is shared) goes by its name."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return ("name", name)
    return ("storage", ptr, t.device) if ptr else ("name", name)


def _flat_nodes(value: Any) -> List[Any]:
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flat_nodes(item)]
    return [value]


def _target_name(n: torch.fx.Node) -> str:
    target = n.target
    if isinstance(target, str):
        return target
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
