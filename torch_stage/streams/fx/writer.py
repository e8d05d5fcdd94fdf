"""Writing a stream plan into a graph: what every form of it shares.

A plan (:func:`torch_stage.streams.fx.stream_plan.plan`) says, per device
node, its stream, the events recorded after it, the waits before it and the
producers whose memory it reads on another stream. Two writers put it into
the graph:

* the eager rewrite (:mod:`~torch_stage.streams.fx.multi_stream_pass`):
  ``torch.ops.torch_stage.*`` calls that switch streams as the graph runs,
  for Python, TorchScript and C++;
* the user-stream writer (:mod:`~torch_stage.streams.fx.user_streams`): the
  form PyTorch's compiler carries, a stream annotation per node and
  ``torch.ops.streams.*`` events, for inductor.

Both walk the graph in order with :class:`PlanWriter`; what they emit is
theirs. The walk decides the rest, the same for both:

* constants (``torch.zeros(n)``) are made again on each stream that reads
  them, once per stream, as DeepRec duplicates Const nodes, so they never
  cause a wait. A writer with :attr:`PlanWriter.share_constants` makes a
  constant that only forward's inputs decide (``ones_like(x)``) and that
  device nodes of several streams read once instead, before the fork: the
  fork orders it before every side stream, as it does forward's inputs,
  and it is marked used on each side stream that reads it, as they are. A
  copy per stream costs the eager rewrite a launch each (on CPU, in_place's
  ``ones_like`` was 3% of its forward); inductor folds a constant into each
  reader's kernel, where a copy costs nothing;
* forward's inputs read on a side stream are marked used on it the first
  time (gpu-review #4: a caller that hands over its last reference frees
  them onto its own stream during forward), at the switch to the run of
  nodes on that stream that reads them;
* outputs made on a side stream are marked used on the caller's stream (by
  the join, for a writer with :attr:`PlanWriter.join_keeps`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx

from torch_stage.streams.fx.calls import segments
from torch_stage.streams.fx.classify import ALIAS, CONST, DEVICE, INPUT, OUTPUT

__all__ = ["PlanWriter"]


class PlanWriter(ABC):
    """Walks a graph and calls the hooks below where the plan needs stream
    work; subclasses emit it. ``run()`` once per writer.

    Hooks (each inserts nodes at the graph's current insertion point, set by
    the walk):

    * :meth:`fork`: before the first node after the inputs;
    * :meth:`sync`: before a node (or the output): make stream ``s``
      current, wait on ``waits`` there, mark ``keeps`` used on ``s``;
    * :meth:`place`: ``n`` (a device node, or a constant's copy) runs on
      ``s``;
    * :meth:`record`: after device node ``n``, record event ``e`` on ``s``;
    * :meth:`join`: before the output, the caller's stream waits on the
      side streams.
    """

    #: Make a constant that several streams read once, before the fork,
    #: where it can be (see the module doc).
    share_constants = False
    #: The join marks the outputs made on side streams used on the caller's
    #: stream (one call less where nothing else needs a sync before the
    #: output); else a sync before it does.
    join_keeps = False

    def __init__(self, graph: torch.fx.Graph, analysis, raw: dict, stream_plan):
        self.graph = graph
        self.analysis = analysis
        self.plan = stream_plan
        self.stream = raw["stream"]
        count = len(analysis.device_nodes)
        self.event = raw["event"]
        self.waits: List[List[int]] = [[] for _ in range(count)]
        for node, e in zip(raw["wait_node"], raw["wait_event"]):
            self.waits[node].append(e)
        self.keeps: List[List[int]] = [[] for _ in range(count)]
        for node, producer in zip(raw["keep_node"], raw["keep_producer"]):
            self.keeps[node].append(producer)
        # The last node of the run of consecutive nodes on one stream that
        # each node is in.
        self.segment_end = [
            last for first, last in segments(self.stream) for _ in range(first, last + 1)
        ]
        self.fork_streams = list(raw["fork"])
        self.join_streams = list(raw["join"])
        self.num_events = len(raw["event_node"])
        self.copies: Dict[Tuple[torch.fx.Node, int], torch.fx.Node] = {}
        # The stream the last sync made current.
        self.current = 0
        # (input, stream) pairs already marked used on a side stream.
        self.kept_inputs: Set[Tuple[torch.fx.Node, int]] = set()
        # Constants made once before the fork (share_constants): read as
        # forward's inputs are.
        self.shared: Dict[torch.fx.Node, List[int]] = {}

    # -- hooks ------------------------------------------------------------

    @abstractmethod
    def fork(self, placeholders: List[torch.fx.Node]) -> None: ...

    @abstractmethod
    def sync(self, s: int, waits: List[int], keeps: List[torch.fx.Node]) -> None: ...

    def host_stream(self) -> int:
        """The stream a node that launches no work of its own (a view, size
        arithmetic) runs on, for the constants it reads: the current one."""
        return self.current

    def needs_sync(self, s: int, waits: List[int], keeps: List[torch.fx.Node]) -> bool:
        """Whether a node on ``s`` needs :meth:`sync` before it."""
        return s != self.current or bool(waits) or bool(keeps)

    @abstractmethod
    def place(self, n: torch.fx.Node, s: int) -> None:
        """``n`` (a device node, or a constant's copy) runs on ``s``."""

    @abstractmethod
    def record(self, n: torch.fx.Node, e: int, s: int) -> None: ...

    @abstractmethod
    def join(self, keeps: List[torch.fx.Node]) -> None:
        """Before the output: the caller's stream waits on the side streams;
        ``keeps`` (only where :attr:`join_keeps`) are outputs made on side
        streams, marked used on the caller's stream."""

    # -- the walk ---------------------------------------------------------

    def run(self) -> None:
        nodes = list(self.graph.nodes)
        self.position = {n: i for i, n in enumerate(nodes)}
        placeholders = [n for n in nodes if n.op == "placeholder"]
        # After the last placeholder, not the first non-placeholder: graphs
        # from torch.export put their get_attr nodes before the inputs.
        last = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
        if self.share_constants:
            self.shared = self._constants_to_share()
        # The first node after the inputs that stays where it is; shared
        # constants go before it, in graph order, and the fork after them.
        anchor = next(n for n in nodes[last + 1 :] if n not in self.shared)
        for c in self.shared:
            anchor.prepend(c)
            self.place(c, 0)
        with self.graph.inserting_before(anchor):
            self.fork(placeholders)
        for n in nodes:
            kind = self.analysis.kind[n]
            if kind == DEVICE:
                self._device_node(n)
            elif kind == OUTPUT:
                self._output(n)
            elif kind != CONST:
                self._constants_for(n, self.host_stream())
        constants: Dict[str, List[int]] = {}
        for (c, s), _ in sorted(self.copies.items(), key=lambda kv: (kv[0][0].name, kv[0][1])):
            constants.setdefault(c.name, []).append(s)
        for c in reversed(self.analysis.constants):
            if not c.users:
                self.graph.erase_node(c)
        self.plan.constants = constants
        self.plan.shared_constants = {c.name: streams for c, streams in self.shared.items()}

    def _constants_to_share(self) -> Dict[torch.fx.Node, List[int]]:
        """Constants to make once before the fork, with the streams that
        read them: made from forward's inputs alone, none of them written in
        place (so they can move before the fork and read the same), and
        read by device nodes (or the output) alone, on two streams or more.
        A constant a view, a host node or another constant reads is made
        per stream, as before."""
        shared: Dict[torch.fx.Node, List[int]] = {}
        for c in self.analysis.constants:
            if any(
                a.op != "placeholder" or self.analysis.written_in_place(a)
                for a in c.all_input_nodes
            ):
                continue
            streams = set()
            for u in c.users:
                kind = self.analysis.kind.get(u)
                if kind == DEVICE:
                    streams.add(self.stream[self.analysis.index[u]])
                elif kind == OUTPUT:
                    streams.add(0)
                else:
                    break
            else:
                if len(streams) > 1:
                    shared[c] = sorted(streams)
        return shared

    def _device_node(self, n: torch.fx.Node) -> None:
        i = self.analysis.index[n]
        s = self.stream[i]
        keeps = [self.analysis.device_nodes[u] for u in self.keeps[i]]
        if s != self.current:
            keeps += self._shared_first_on(s)
            # The inputs the whole run of nodes on s reads, at the switch
            # it makes anyway, not at a sync of their own further on (those
            # made by then: a get_attr node can come later in the graph).
            for k in range(i + 1, self.segment_end[i] + 1):
                later = self.analysis.device_nodes[k]
                keeps += self._inputs_first_read(later, s, before=n)
        keeps += self._inputs_first_read(n, s)
        if self.needs_sync(s, self.waits[i], keeps):
            with self.graph.inserting_before(n):
                self.sync(s, self.waits[i], keeps)
            self.current = s
        self._constants_for(n, s)
        self.place(n, s)
        if self.event[i] >= 0:
            with self.graph.inserting_after(n):
                self.record(n, self.event[i], s)

    def _output(self, n: torch.fx.Node) -> None:
        # Outputs made on a side stream are used on the caller's stream from
        # here on: tell the allocator (pytorch#165391 does the same for
        # Inductor's user streams). Constants the output reads are made on
        # the caller's stream.
        keeps = [
            v
            for v in n.all_input_nodes
            if any(self.stream[self.analysis.index[r]] != 0 for r in self.analysis.roots(v))
        ]
        constants = any(
            self.analysis.kind.get(v) == CONST and v not in self.shared for v in n.all_input_nodes
        )
        if constants or (keeps and not self.join_keeps):
            with self.graph.inserting_before(n):
                self.sync(0, [], keeps)
            self.current = 0
            keeps = []
        self._constants_for(n, 0)
        with self.graph.inserting_before(n):
            self.join(keeps)
        self.current = 0

    def _constants_for(self, n: torch.fx.Node, s: int) -> None:
        """Re-create on stream ``s`` each constant ``n`` reads (once per
        stream), and each view of constants it reads (``arange(n)[:, None]``
        as an index: the view of a copy made on another stream would be read
        here unordered; the stream sanitizer found it in GPT-2)."""
        for c in list(n.all_input_nodes):
            if not self._constant_made(c):
                continue
            key = (c, s)
            if key not in self.copies:
                with self.graph.inserting_before(n):
                    self.copies[key] = self.graph.node_copy(c)
                # A copy is what its original is (a view of constants can
                # be reached through copies made for other streams).
                self.analysis.kind[self.copies[key]] = self.analysis.kind[c]
                self.place(self.copies[key], s)
                # zeros_like(c2) where c2 is a constant too.
                self._constants_for(self.copies[key], s)
            n.replace_input_with(c, self.copies[key])

    def _constant_made(self, c: torch.fx.Node) -> bool:
        """``c`` is a constant made per stream, or a view of constants only."""
        kind = self.analysis.kind.get(c)
        if kind == CONST:
            return c not in self.shared
        if kind != ALIAS or self.analysis.roots(c):
            return False
        return any(self._constant_made(a) for a in c.all_input_nodes)

    def _shared_first_on(self, s: int) -> List[torch.fx.Node]:
        """Shared constants that side stream ``s`` reads, where the walk
        first switches to ``s``: marked used there, at a sync the switch
        makes anyway, not at a sync of their own before their reader."""
        if s == 0:
            return []
        found = [
            c
            for c, streams in self.shared.items()
            if s in streams and (c, s) not in self.kept_inputs
        ]
        self.kept_inputs.update((c, s) for c in found)
        return found

    def _inputs_first_read(
        self, n: torch.fx.Node, s: int, before: Optional[torch.fx.Node] = None
    ) -> List[torch.fx.Node]:
        """Forward's inputs that ``n`` reads, directly or through views, on
        side stream ``s`` for the first time (see the module doc); with
        ``before``, only those that come before that node in the graph."""
        if s == 0:
            return []
        found: List[torch.fx.Node] = []
        for v in n.all_input_nodes:
            for p in self._input_roots(v):
                if before is not None and self.position[p] > self.position[before]:
                    continue
                if (p, s) not in self.kept_inputs:
                    self.kept_inputs.add((p, s))
                    found.append(p)
        return found

    def _input_roots(self, v: torch.fx.Node) -> List[torch.fx.Node]:
        kind = self.analysis.kind.get(v)
        if kind == INPUT:
            return [v]
        if kind != ALIAS:
            return []
        return [p for a in v.all_input_nodes for p in self._input_roots(a)]
