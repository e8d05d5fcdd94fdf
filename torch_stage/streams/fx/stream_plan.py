"""The plan the C++ scheduler returns for an analysed graph
(:class:`StreamPlan`), and :func:`plan`, which asks for it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx

__all__ = ["PlanEvent", "PlanWait", "StreamPlan", "plan", "with_raw"]


@dataclass(frozen=True)
class PlanEvent:
    """Event ``id`` is recorded on ``stream`` right after node ``node``."""

    id: int
    node: str
    stream: int


@dataclass(frozen=True)
class PlanWait:
    """Before node ``node`` runs, its ``stream`` waits on ``event`` (recorded
    after node ``after``)."""

    node: str
    stream: int
    event: int
    after: str


@dataclass
class StreamPlan:
    """What the multi-stream pass decided for a graph.

    Attributes:
        strategy: the strategy that placed the nodes (never ``"auto"``).
        reason: why (``"requested"``, or the rule ``"auto"`` applied).
        num_streams: the pool size.
        assignment: node name -> stream, for every node that launches device
            work, in graph order.
        events: the events recorded, in the order of their nodes.
        waits: the waits, in issue order.
        keeps: ``(node, producer, stream)``: before ``node``, ``producer``'s
            tensors are marked as used on ``stream`` (``record_stream``).
        fork: side streams that wait for the caller's stream at entry.
        join: side streams the caller's stream waits on at exit.
        constants: constant node name -> streams it is created on.
        shared_constants: constant node name -> streams that read it, for
            constants made once, before the fork (the eager rewrite's,
            where only forward's inputs make them).
        cross_stream_edges: dependencies between nodes on different streams
            (each is ordered by a wait, directly or through earlier ones).
        note: what became of the plan where it did not run as planned (the
            compile backend on a device without streams; a plan that did
            not pay, run on one stream), else empty.
        estimate: the modelled time of the plan the scheduler made (or,
            after merges, of what is left of it) against one stream's
            (:class:`torch_stage.streams.fx.host_cost.Estimate`), for plans
            of :func:`torch_stage.multi_stream` that forked, declined ones
            included; else None.
    """

    strategy: str
    reason: str
    num_streams: int
    assignment: Dict[str, int]
    events: List[PlanEvent]
    waits: List[PlanWait]
    keeps: List[Tuple[str, str, int]]
    fork: List[int]
    join: List[int]
    constants: Dict[str, List[int]] = field(default_factory=dict)
    shared_constants: Dict[str, List[int]] = field(default_factory=dict)
    cross_stream_edges: int = 0
    chains: int = 0
    groups: int = 0
    note: str = ""
    estimate: Optional[Any] = None

    def declined(self, note: str) -> StreamPlan:
        """This plan, declined: every node on stream 0, no stream work, and
        ``note`` saying why (the estimate is kept)."""
        return replace(
            self,
            assignment={name: 0 for name in self.assignment},
            events=[],
            waits=[],
            keeps=[],
            fork=[],
            join=[],
            constants={},
            cross_stream_edges=0,
            note=note,
        )

    @property
    def streams_used(self) -> List[int]:
        """The streams that run at least one node, ascending."""
        return sorted(set(self.assignment.values()))

    def __str__(self) -> str:
        used = self.streams_used
        lines = [
            f"StreamPlan: strategy {self.strategy} ({self.reason}); "
            f"{len(used)} of {self.num_streams} streams used, {len(self.events)} events, "
            f"{len(self.waits)} waits for {self.cross_stream_edges} cross-stream dependencies"
        ]
        if self.note:
            lines.append(f"  note: {self.note}")
        if self.fork:
            lines.append(f"  fork: streams {self.fork} wait for stream 0 (the caller's)")
        waits: Dict[str, List[PlanWait]] = {}
        for w in self.waits:
            waits.setdefault(w.node, []).append(w)
        records = {e.node: e for e in self.events}
        width = max((len(n) for n in self.assignment), default=4)
        for name, s in self.assignment.items():
            notes = [f"wait e{w.event} ({w.after})" for w in waits.get(name, [])]
            if name in records:
                notes.append(f"record e{records[name].id}")
            line = f"  [{s}] {name:<{width}}"
            if notes:
                line += "  " + ", ".join(notes)
            lines.append(line.rstrip())
        for name, streams in self.constants.items():
            lines.append(f"  constant {name} created on streams {streams}")
        for name, streams in self.shared_constants.items():
            lines.append(f"  constant {name} made once before the fork, read on streams {streams}")
        if self.fork:
            if self.join:
                lines.append(f"  join: stream 0 waits on streams {self.join}")
            else:
                lines.append("  join: none needed (stream 0 already waited on every side stream)")
        return "\n".join(lines)


def plan(
    analysis: Any,
    strategy: str,
    verify: bool = False,
    sync_cost: float = 0.0,
    fixed: Optional[List[int]] = None,
) -> Tuple[StreamPlan, dict]:
    """Plan the analysed graph with the C++ scheduler.

    ``sync_cost``: what an event between two streams costs, in the costs'
    unit; ``critical_path`` moves work off its producers' stream only where
    it starts earlier even so (``csrc/schedule/strategies.h``). ``fixed``:
    streams per device node (-1: free) in place of the annotations'
    (``analysis.fixed``).

    Returns the :class:`StreamPlan` and the raw plan (per device node, by
    position in ``analysis.device_nodes``) the rewrite works from.
    """
    count = len(analysis.device_nodes)
    edges = sorted(analysis.edges.items())
    chosen, reason, raw = torch.ops.torch_stage.plan_streams(
        count,
        [u for (u, _), _ in edges],
        [v for (_, v), _ in edges],
        [kind for _, kind in edges],
        [float(c) for c in analysis.costs],
        analysis.fixed if fixed is None else fixed,
        analysis.colocation,
        analysis.embedding_group,
        strategy,
        analysis.num_streams,
        analysis.costs_known,
        verify,
        float(sync_cost),
    )
    chains, groups, _ = raw["stats"]
    result = StreamPlan(
        strategy=chosen,
        reason=reason,
        num_streams=analysis.num_streams,
        assignment={},
        events=[],
        waits=[],
        keeps=[],
        fork=[],
        join=[],
        chains=chains,
        groups=groups,
    )
    return with_raw(result, analysis, raw), dict(raw)


def with_raw(stream_plan: StreamPlan, analysis: Any, raw: dict) -> StreamPlan:
    """``stream_plan`` saying what ``raw`` does (streams, events, waits,
    keeps, fork and join), a plan of the analysed graph's device nodes in
    ``analysis``'s order: after the scheduler, and after the pass moves
    calls or nodes (torch_stage/streams/fx/calls.py)."""
    names = [n.name for n in analysis.device_nodes]
    stream = list(raw["stream"])
    events = [
        PlanEvent(id=e, node=names[node], stream=s)
        for e, (node, s) in enumerate(zip(raw["event_node"], raw["event_stream"]))
    ]
    waits = [
        PlanWait(
            node=names[node],
            stream=stream[node],
            event=e,
            after=names[raw["event_node"][e]],
        )
        for node, e in zip(raw["wait_node"], raw["wait_event"])
    ]
    keeps = [
        (names[node], names[producer], stream[node])
        for node, producer in zip(raw["keep_node"], raw["keep_producer"])
    ]
    return replace(
        stream_plan,
        assignment=dict(zip(names, stream)),
        events=events,
        waits=waits,
        keeps=keeps,
        fork=list(raw["fork"]),
        join=list(raw["join"]),
        cross_stream_edges=raw["stats"][2],
    )
