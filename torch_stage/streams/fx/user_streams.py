"""A stream plan written the way PyTorch's compiler carries user streams.

When user code inside ``torch.compile`` says ``with torch.cuda.stream(s):``
and ``event.record()`` / ``event.wait()``, Dynamo's graph holds (torch >=
2.13):

* ``node.meta["custom"]["stream"]``: the stream a node runs on, as an index
  into Dynamo's side table of objects the compiled code reaches
  (``torch/_dynamo/graph_bytecode_inputs.py``); nodes on the caller's
  stream carry none;
* ``torch.ops.streams.record_event(event, stream)``,
  ``wait_event(event, stream)`` and ``record_stream(tensor, stream)``, the
  event and stream given by their side-table indices.

AOTAutograd carries that into the forward and backward graphs (backward
nodes on their forward's stream, syncs between backward streams, synced
deallocation) and inductor compiles it: kernels fused within a stream only,
``with streamN:`` blocks and the event calls in the generated code.
:class:`UserStreamWriter` writes torch_stage's plan in exactly that form, so
the plan gets inductor's fusion, AOTAutograd's backward and inductor's CUDA
graphs.

The objects: side stream ``k`` is stream ``k`` of torch_stage's pool (the
streams the eager executor and ``torch_stage.stream(k)`` use, taken once per
process: :func:`side_stream`); events are torch_stage's, reused from call
to call, one set per thread (:func:`pooled_event`): an event recorded anew
keeps the meaning of every wait already queued on it, so one thread's calls
in order can share them, and two threads never do. The compiled code gets
them through Dynamo's side table: :class:`SideTable` registers each with a
constructor that Dynamo's bytecode calls before every call of the graph.

Two things PyTorch leaves to the writer of user streams, done here for the
backward graph (:func:`write_backward_streams`): the side streams the
backward uses wait for the caller's stream at its start (a backward node on
a side stream reads gradients the caller's stream made), and the caller's
stream waits for them at its end (the autograd engine takes the gradients
as made on the caller's stream). And Dynamo's side table is one table for
the process, refilled by the bytecode of each compiled frame before its
graph runs: by the time a backward runs, another frame may have refilled
it. :class:`BackwardTable` puts this graph's objects back in place just
before its backward runs.
"""

from __future__ import annotations

import operator
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx

from torch_stage.streams._frames import skip_frames
from torch_stage.streams.fx.classify import ALIAS
from torch_stage.streams.fx.writer import PlanWriter

__all__ = [
    "BackwardTable",
    "SideTable",
    "UserStreamWriter",
    "current_stream",
    "pooled_event",
    "side_stream",
    "stream_index",
    "write_backward_streams",
]

# -- the objects ------------------------------------------------------------

_lock = threading.Lock()
# (device type, device index, k) -> torch.Stream; guarded by _lock.
_side_streams: Dict[Tuple[str, int, int], torch.Stream] = {}
# Stand-ins for the caller's stream on a device without streams.
_stand_ins: Dict[Tuple[str, int], torch.Stream] = {}
_events = threading.local()


def has_streams(device: torch.device) -> bool:
    """Whether ``device`` has streams (an accelerator), not the CPU."""
    return device.type != "cpu" and device.type != "meta"


def _device(device_type: str, device_index: int) -> torch.device:
    return (
        torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    )


# The three functions below run before every call of a compiled graph (the
# side table's constructors): Dynamo must not trace them, or each would
# become a graph of its own, recompiled for every stream and event number
# (skip_frames below, as torch.compiler.disable but without importing Dynamo).


def side_stream(device_type: str, device_index: int, k: int) -> torch.Stream:
    """Side stream ``k`` (>= 1) of torch_stage's pool on the device, as a
    ``torch.Stream``. On a device without streams, a stand-in object per
    ``k`` (work there runs in order whatever the stream)."""
    key = (device_type, device_index, k)
    found = _side_streams.get(key)
    if found is not None:
        return found
    device = _device(device_type, device_index)
    with _lock:
        found = _side_streams.get(key)
        if found is None:
            if has_streams(device):
                sid, index, dtype = torch.ops.torch_stage.side_stream(device, k)
                found = torch.Stream(stream_id=sid, device_index=index, device_type=dtype)
            else:
                found = torch.Stream(device)
            _side_streams[key] = found
    return found


def current_stream(device_type: str, device_index: int) -> torch.Stream:
    """The calling thread's current stream on the device (a fixed stand-in
    on a device without streams)."""
    device = _device(device_type, device_index)
    if has_streams(device):
        return torch.accelerator.current_stream(device)
    key = (device_type, device_index)
    found = _stand_ins.get(key)
    if found is None:
        with _lock:
            found = _stand_ins.setdefault(key, torch.Stream(device))
    return found


def pooled_event(device_type: str, device_index: int, slot: Any) -> torch.Event:
    """This thread's event ``slot`` for the device, made once."""
    pool = getattr(_events, "pool", None)
    if pool is None:
        pool = _events.pool = {}
    key = (device_type, device_index, slot)
    found = pool.get(key)
    if found is None:
        found = pool[key] = torch.Event(_device(device_type, device_index))
    return found


skip_frames(side_stream, current_stream, pooled_event, nested=True)


# -- Dynamo's side table ------------------------------------------------------


def _constructor(function: str, *args: Any) -> Callable[[int, Any], None]:
    """Bytecode that calls ``function(*args)`` of this module: what Dynamo
    runs before each call of the graph to fill the side table."""

    def construct(index: int, codegen: Any) -> None:
        from torch._dynamo.bytecode_transformation import create_call_function

        codegen.add_push_null(lambda: codegen.load_import_from(__name__, function))
        for a in args:
            codegen.append_output(codegen.create_load_const(a))
        codegen.extend_output(create_call_function(len(args), False))

    return construct


class SideTable:
    """torch_stage's streams and events in Dynamo's side table, for the graph
    being compiled (use it while Dynamo compiles: in a backend).

    ``entries`` maps each index registered here to what it holds:
    ``("current",)``, ``("stream", k)`` or ``("event", slot)``.
    """

    def __init__(self, device: torch.device):
        from torch._dynamo import graph_bytecode_inputs as table

        self._table = table
        self.device = device
        self._type = device.type
        self._index = -1 if device.index is None else device.index
        self.entries: Dict[int, Tuple[Any, ...]] = {}
        self._streams: Dict[int, int] = {}
        self._slots: Dict[Any, int] = {}

    def _register(self, example: Any, construct, entry: Tuple[Any, ...]) -> int:
        index = self._table.register_graph_created_object(example, construct)
        self.entries[index] = entry
        return index

    def stream(self, k: int) -> int:
        """The index of stream ``k``: the caller's (0) or side stream ``k``."""
        found = self._streams.get(k)
        if found is not None:
            return found
        if k == 0:
            found = self._current_index()
        else:
            found = self._register(
                side_stream(self._type, self._index, k),
                _constructor("side_stream", self._type, self._index, k),
                ("stream", k),
            )
        self._streams[k] = found
        return found

    def _current_index(self) -> int:
        # Dynamo registers the current stream at CURRENT_STREAM_INDEX when an
        # accelerator is there, and inductor's CUDA graphs put the capture
        # stream there while capturing: the caller's stream must be that one.
        table = self._table
        index = getattr(table, "CURRENT_STREAM_INDEX", None)
        if (
            index is not None
            and has_streams(self.device)
            and index in table.index_to_bytecode_constructor
            and torch.accelerator.is_available()
            and torch.accelerator.current_stream().device == self.device
        ):
            self.entries[index] = ("current",)
            return index
        return self._register(
            current_stream(self._type, self._index),
            _constructor("current_stream", self._type, self._index),
            ("current",),
        )

    def event(self, slot: Any) -> int:
        """The index of this graph's event ``slot``."""
        found = self._slots.get(slot)
        if found is None:
            found = self._slots[slot] = self._register(
                pooled_event(self._type, self._index, slot),
                _constructor("pooled_event", self._type, self._index, slot),
                ("event", slot),
            )
        return found

    def registered(self) -> int:
        """How many objects the side table holds (for telling which indices
        a later compile step added)."""
        return len(self._table.index_to_bytecode_constructor)

    def adopt(self, start: int) -> None:
        """Take the objects registered from index ``start`` on by others
        (AOTAutograd's events and current streams) into ``entries``, so
        :class:`BackwardTable` can put them back too."""
        table = self._table
        for index in range(start, self.registered()):
            if index in self.entries:
                continue
            ref = table.index_to_external_object_weakref.get(index)
            obj = ref() if ref is not None else None
            if isinstance(obj, torch.Event):
                self.entries[index] = ("event", ("aot", index))
            elif isinstance(obj, torch.Stream):
                self.entries[index] = ("current",)


def stream_index(n: torch.fx.Node) -> Optional[int]:
    """The side-table index of the stream node ``n`` is annotated with."""
    return (n.meta.get("custom") or {}).get("stream")


def _annotate(n: torch.fx.Node, index: int) -> None:
    n.meta["custom"] = dict(n.meta.get("custom") or {}, stream=index)


def _example(n: torch.fx.Node) -> Any:
    return n.meta.get("example_value", n.meta.get("val"))


def _streams_op(name: str) -> Any:
    return getattr(torch.ops.streams, name).default


# -- the forward: the plan ----------------------------------------------------


class UserStreamWriter(PlanWriter):
    """Writes a raw plan onto a graph Dynamo captured, as user streams (see
    the module doc).

    Args:
        graph: the graph to write into (a copy of Dynamo's).
        analysis, raw, stream_plan: the plan (:func:`~torch_stage.streams.fx.
            stream_plan.plan`).
        table: the side table of the graph being compiled.
        keep_memory: mark tensors read on a stream other than the one that
            allocated them (``record_stream``); off under CUDA graphs, whose
            memory pool keeps every block until the replay ends.

    Event slots: the plan's events are ``0..E-1``, the fork's ``E``, the
    join's ``E+1..`` (or, with nothing to join, the end's ``E+1``);
    :attr:`next_slot` is the first one left.
    """

    def __init__(self, graph, analysis, raw, stream_plan, table: SideTable, keep_memory: bool):
        super().__init__(graph, analysis, raw, stream_plan)
        self.table = table
        self.keep_memory = keep_memory
        self.next_slot = self.num_events + 1 + max(1, len(self.join_streams))

    def _op(self, name: str, args: tuple, s: int) -> torch.fx.Node:
        n = self.graph.call_function(_streams_op(name), args)
        _annotate(n, self.table.stream(s))
        return n

    def fork(self, placeholders: List[torch.fx.Node]) -> None:
        if not self.fork_streams:
            return
        e = self.table.event(self.num_events)
        self._op("record_event", (e, self.table.stream(0)), 0)
        for s in self.fork_streams:
            self._op("wait_event", (e, self.table.stream(s)), s)

    def host_stream(self) -> int:
        # Nothing switches streams between nodes here: a node without an
        # annotation of its own (a view of constants) runs on the caller's.
        return 0

    def needs_sync(self, s: int, waits: List[int], keeps: List[torch.fx.Node]) -> bool:
        # Streams switch by annotation, not by a call.
        return bool(waits) or (self.keep_memory and bool(keeps))

    def sync(self, s: int, waits: List[int], keeps: List[torch.fx.Node]) -> None:
        for e in waits:
            self._op("wait_event", (self.table.event(e), self.table.stream(s)), s)
        if self.keep_memory:
            for k in keeps:
                for t in self._tensor_values(k):
                    self._op("record_stream", (t, self.table.stream(s)), s)

    def _tensor_values(self, n: torch.fx.Node) -> List[torch.fx.Node]:
        """Nodes for the tensors ``n`` holds (its getitems for a tuple).
        Parameters are left out: nothing frees them during forward."""
        value = _example(n)
        if isinstance(value, torch.nn.Parameter):
            return []
        if isinstance(value, torch.Tensor):
            return [n]
        if isinstance(value, (list, tuple)):
            return [
                self.graph.call_function(operator.getitem, (n, i))
                for i, v in enumerate(value)
                if isinstance(v, torch.Tensor)
            ]
        return []

    def place(self, n: torch.fx.Node, s: int) -> None:
        _annotate(n, self.table.stream(s))

    def record(self, n: torch.fx.Node, e: int, s: int) -> None:
        self._op("record_event", (self.table.event(e), self.table.stream(s)), s)

    def join(self, keeps: List[torch.fx.Node]) -> None:
        for j, s in enumerate(self.join_streams):
            e = self.table.event(self.num_events + 1 + j)
            self._op("record_event", (e, self.table.stream(s)), s)
            self._op("wait_event", (e, self.table.stream(0)), 0)
        if not self.join_streams:
            # A sync on the caller's stream closes the forward there, as the
            # join's wait does: AOTAutograd wraps each backward sync in
            # control_deps on every node of its stream since that stream's
            # last sync, forward nodes included, and cannot save a forward
            # node of several outputs (native_layer_norm) for the backward:
            # partitioning fails (torch 2.13, 2.14; swin_v2_t's last norm).
            e = self.table.event(self.num_events + 1)
            self._op("record_event", (e, self.table.stream(0)), 0)

    def run(self) -> None:
        super().run()
        # Views run where what they view was made: annotated otherwise,
        # inductor would take each for a stream boundary and realize its
        # input, splitting a kernel it fuses on one stream.
        for n in self.graph.nodes:
            if self.analysis.kind.get(n) != ALIAS or stream_index(n) is not None:
                continue
            streams = {self.stream[self.analysis.index[r]] for r in self.analysis.roots(n)}
            if len(streams) == 1:
                _annotate(n, self.table.stream(streams.pop()))


# -- the backward ---------------------------------------------------------------


def _all_nodes(gm: torch.fx.GraphModule):
    """The nodes of ``gm`` and of the subgraphs its control_deps nodes run."""
    for n in gm.graph.nodes:
        yield n
        if n.op == "get_attr":
            sub = getattr(gm, n.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                yield from _all_nodes(sub)


def write_backward_streams(
    gm: torch.fx.GraphModule, table: SideTable, first_slot: int, keep_memory: bool
) -> List[int]:
    """Fork and join the side streams AOTAutograd's backward graph ``gm``
    uses (see the module doc), in place, with events ``first_slot..``
    (registered beforehand: a backward may be compiled after Dynamo wrote
    the bytecode that fills the side table). Outputs made on a side stream
    are marked used on the caller's stream. Returns the side streams' pool
    numbers."""
    by_index = {i: e[1] for i, e in table.entries.items() if e[0] == "stream"}
    used = sorted({by_index[i] for n in _all_nodes(gm) if (i := stream_index(n)) in by_index})
    if not used:
        return []
    graph = gm.graph
    nodes = list(graph.nodes)
    last = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    caller = table.stream(0)

    def op(name: str, args: tuple, stream: int) -> None:
        _annotate(graph.call_function(_streams_op(name), args), stream)

    with graph.inserting_before(nodes[last + 1]):
        fork = table.event(first_slot)
        op("record_event", (fork, caller), caller)
        for k in used:
            op("wait_event", (fork, table.stream(k)), table.stream(k))
    output = next(n for n in reversed(nodes) if n.op == "output")
    with graph.inserting_before(output):
        if keep_memory:
            for v in output.all_input_nodes:
                if stream_index(v) in by_index and isinstance(_example(v), torch.Tensor):
                    op("record_stream", (v, caller), caller)
        for j, k in enumerate(used):
            e = table.event(first_slot + 1 + j)
            op("record_event", (e, table.stream(k)), table.stream(k))
            op("wait_event", (e, caller), caller)
    from torch._functorch._aot_autograd.streams import wrap_all_sync_nodes_with_control_deps

    # Ordered as AOTAutograd orders its own syncs: each wrapped with what
    # came before it on its stream.
    wrap_all_sync_nodes_with_control_deps(gm)
    graph.lint()
    gm.recompile()
    return used


class BackwardTable:
    """Puts a compiled graph's side-table objects back in place just before
    its backward runs (see the module doc): a pre-hook on the autograd node
    of each output that needs a gradient, registered when the forward
    returns. Wraps the compiled forward; calling convention (boxed or not)
    unchanged."""

    def __init__(self, compiled: Callable, table: SideTable):
        self.compiled = compiled
        self.entries = dict(table.entries)
        self._type = table._type
        self._index = table._index
        self._boxed_call = getattr(compiled, "_boxed_call", False)
        self._ref = table._table.index_to_external_object_weakref

    def __call__(self, *args: Any) -> Any:
        out = self.compiled(*args)
        if torch.is_grad_enabled():
            seen = set()
            for t in out if isinstance(out, (list, tuple)) else (out,):
                node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
                if node is not None and id(node) not in seen:
                    seen.add(id(node))
                    node.register_prehook(self._restore)
        return out

    def _restore(self, grad_outputs: Any) -> None:
        keep: List[Any] = []
        for index, entry in self.entries.items():
            if entry[0] == "current":
                obj = current_stream(self._type, self._index)
            elif entry[0] == "stream":
                obj = side_stream(self._type, self._index, entry[1])
            else:
                obj = pooled_event(self._type, self._index, entry[1])
            keep.append(obj)
            self._ref[index] = weakref.ref(obj)
        # The current stream object lives as long as this thread's backward
        # may read it.
        _events.keep = keep
        return None
