"""Fewer stream calls per forward, for the same plan: calls that share a
stream share one call, and nodes are issued stream by stream where that
changes no result.

The eager rewrite makes a ``sync`` before a node that changes stream, waits
or keeps, and a ``record_event`` of its own after a node whose event no
sync carries (torch_stage/streams/fx/multi_stream_pass.py). The scheduler
puts each wait, keep and record at the node that needs it, which can cost
a call each where a branch of small kernels reads several tensors of
another stream. On a host that issues kernels of a few microseconds, each
of those calls is time the device waits.

:func:`compact` moves them, within a *segment* (consecutive device nodes
on one stream in issue order), to the call the segment makes anyway:

* keeps (``record_stream``) to its first call: a tensor may be marked used
  on a stream at any point after it is made (its producer is issued before
  the segment: the segment reads it from another stream). Free on the
  device;
* waits to its first call: the event is recorded before it (on another
  stream, so before the segment began). The nodes before the waiter then
  wait too: less overlap;
* records to its last node, where the switch to the next stream carries
  them: every wait on the event is on another stream, so after that
  switch. Waiters then wait for the whole segment: less overlap.

:func:`stream_order` reorders the graph so that each stream's ready nodes
are issued together before switching: fewer segments, so fewer switches,
records and waits. It keeps every dependency of the analysis, the relative
order of random ops (their values are fixed by launch order on the host),
views and size reads on their side of every in-place write to what they
read, and nodes whose effects are not known (a user's function or module,
side-effecting ops) where they were, with everything else on the side of
them it was. The cost model decides whether either pays
(:func:`torch_stage.streams.fx.host_cost.paying_plan`): both trade launch
overlap for calls.
"""

from __future__ import annotations

import heapq
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set

import torch
import torch.fx

from torch_stage.streams.fx.classify import ALIAS, CONST, DEVICE, HOST, OUTPUT
from torch_stage.streams.fx.effects import known_effects

__all__ = ["compact", "issue_in_order", "segments", "stream_order"]


def compact(raw: Mapping[str, Any], waits: bool = True, records: bool = True) -> dict:
    """``raw`` (a scheduler plan, :func:`~torch_stage.streams.fx.stream_plan.plan`)
    with each segment's keeps, and with ``waits`` its waits, at its first
    call, and with ``records`` its records at its last node (see the module
    doc). A new dict; events are numbered again in issue order."""
    stream = list(raw["stream"])
    count = len(stream)
    event = list(raw["event"])
    event_node = list(raw["event_node"])
    # Sparse: most nodes neither wait nor keep (and a list per node of a
    # graph of thousands costs the garbage collector more than the rest).
    waits_at: Dict[int, List[int]] = {}
    for node, e in zip(raw["wait_node"], raw["wait_event"]):
        waits_at.setdefault(node, []).append(e)
    keeps_at: Dict[int, List[int]] = {}
    for node, producer in zip(raw["keep_node"], raw["keep_producer"]):
        keeps_at.setdefault(node, []).append(producer)
    # Records first: merged events change what the waits name.
    alias: Dict[int, int] = {}
    if records:
        for first, last in segments(stream):
            if last + 1 >= count:
                continue  # no switch after it to carry a record
            for k in range(first, last):
                e = event[k]
                if e < 0:
                    continue
                event[k] = -1
                if event[last] < 0:
                    event[last] = e
                    event_node[e] = last
                else:
                    alias[e] = event[last]
                    event_node[e] = -1
    current, call = 0, -1  # the node the segment's first call is before
    moved_waits: Dict[int, List[int]] = {}
    moved_keeps: Dict[int, List[int]] = {}
    # What each node's call holds already (a segment can hold thousands).
    kept: Dict[int, Set[int]] = {}
    waited: Dict[int, Set[int]] = {}
    for i in range(count):
        if stream[i] != current:
            current, call = stream[i], i
        wanted = [alias.get(e, e) for e in waits_at.get(i, ())]
        keeps = keeps_at.get(i, ())
        if not wanted and not keeps:
            continue
        if call < 0:
            call = i
        # (A keep's producer and a wait's event come from another stream,
        # so before the segment; checked all the same, as what the
        # rewrite's calls may refer to.)
        for p in keeps:
            at = call if p < call else i
            seen = kept.setdefault(at, set())
            if p not in seen:
                seen.add(p)
                moved_keeps.setdefault(at, []).append(p)
        for e in wanted:
            at = call if waits and event_node[e] < call else i
            seen = waited.setdefault(at, set())
            if e not in seen:
                seen.add(e)
                moved_waits.setdefault(at, []).append(e)
    # Events numbered again in the order of their nodes.
    live = sorted((n, e) for e, n in enumerate(event_node) if n >= 0)
    number = {e: new for new, (_, e) in enumerate(live)}
    out = dict(raw)
    out["event"] = [number[e] if e >= 0 else -1 for e in event]
    out["event_node"] = [n for n, _ in live]
    out["event_stream"] = [stream[n] for n, _ in live]
    nodes = sorted(moved_waits)
    out["wait_node"] = [i for i in nodes for _ in moved_waits[i]]
    out["wait_event"] = [number[e] for i in nodes for e in sorted(moved_waits[i])]
    nodes = sorted(moved_keeps)
    out["keep_node"] = [i for i in nodes for _ in moved_keeps[i]]
    out["keep_producer"] = [p for i in nodes for p in moved_keeps[i]]
    return out


def segments(stream: Sequence[int]) -> List[tuple]:
    """``(first, last)`` of each run of consecutive nodes on one stream
    (``stream``: per device node, in issue order)."""
    found = []
    first = 0
    for i in range(1, len(stream) + 1):
        if i == len(stream) or stream[i] != stream[first]:
            found.append((first, i - 1))
            first = i
    return found


def stream_order(
    analysis: Any, stream: Sequence[int], first: Optional[int] = None
) -> List[torch.fx.Node]:
    """The graph's nodes in an order that issues each stream's ready device
    nodes together (``stream``: per device node of ``analysis``), keeping
    what the module doc says; the graph's own order where nothing can move.
    ``first``: the stream to issue from first (default: the first device
    node's, as the graph does; 0, the caller's, saves a switch).
    Placeholders first and the output last, as in the graph."""
    nodes = analysis.nodes
    position = analysis.position
    kind = analysis.kind
    preds: Dict[torch.fx.Node, Set[torch.fx.Node]] = {n: set(n.all_input_nodes) for n in nodes}
    device = analysis.device_nodes
    for u, v in analysis.edges:
        preds[device[v]].add(device[u])
    root = analysis.gm
    # Random ops keep their order among themselves; nodes of unknown
    # effects stay between what came before and after them.
    previous_random = None
    fence = None
    since_fence: List[torch.fx.Node] = []
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if not known_effects(n, root) or analysis.untargeted_effects(n):
            preds[n].update(since_fence)
            if fence is not None:
                preds[n].add(fence)
            fence, since_fence = n, []
            previous_random = n  # orders later random ops after it too
            continue
        if fence is not None:
            preds[n].add(fence)
        since_fence.append(n)
        if n in analysis.random:
            if previous_random is not None:
                preds[n].add(previous_random)
            previous_random = n
    # Views, size reads and constants stay on their side of each in-place
    # write to the memory they read or are.
    writers: Dict[int, List[torch.fx.Node]] = {}
    for m, targets in analysis.mutated.items():
        if kind[m] == DEVICE:
            for f in {analysis.family(t) for t in targets}:
                writers.setdefault(f, []).append(m)
    if writers:
        for n in nodes:
            if kind[n] not in (ALIAS, HOST, CONST):
                continue
            touched = {analysis.family(n)} | {analysis.family(a) for a in n.all_input_nodes}
            for f in touched:
                for m in writers.get(f, ()):
                    if position[m] < position[n]:
                        preds[n].add(m)
                    else:
                        preds[m].add(n)
    index = analysis.index
    waiting = {n: len(p) for n, p in preds.items()}
    users: Dict[torch.fx.Node, List[torch.fx.Node]] = {n: [] for n in nodes}
    for n, p in preds.items():
        for u in p:
            users[u].append(n)
    # Ready nodes by graph position: those on no stream, and per stream.
    free: List[tuple] = []
    on: Dict[int, List[tuple]] = {}
    output = [n for n in nodes if kind[n] == OUTPUT]

    def ready(n: torch.fx.Node) -> None:
        if kind[n] == OUTPUT:
            return
        if kind[n] == DEVICE:
            heapq.heappush(on.setdefault(stream[index[n]], []), (position[n], n))
        else:
            heapq.heappush(free, (position[n], n))

    for n in nodes:
        if waiting[n] == 0:
            ready(n)
    order: List[torch.fx.Node] = []
    current = first if first is not None else (stream[0] if device else 0)
    while True:
        if free:
            _, n = heapq.heappop(free)
        else:
            if not on.get(current):
                heads = [(h[0][0], s) for s, h in on.items() if h]
                if not heads:
                    break
                current = min(heads)[1]
            _, n = heapq.heappop(on[current])
        order.append(n)
        for v in users[n]:
            waiting[v] -= 1
            if waiting[v] == 0:
                ready(v)
    if len(order) + len(output) != len(nodes):
        raise AssertionError(
            f"stream_order placed {len(order)} of {len(nodes) - len(output)} nodes: "
            "the graph's dependencies have a cycle"
        )
    return order + output


def issue_in_order(graph: torch.fx.Graph, nodes: Sequence[torch.fx.Node]) -> None:
    """Put ``graph``'s nodes in the order of ``nodes`` (all of them, the
    output last: :func:`stream_order`'s)."""
    output = nodes[-1]
    if output.op != "output" or len(nodes) != len(graph.nodes):
        raise ValueError("issue_in_order takes every node of the graph, the output last")
    for n in nodes[:-1]:
        output.prepend(n)
