"""Whether a stream plan pays: what its calls cost the host, measured, against
the device time its streams can overlap.

A multi-stream forward adds host work (fork, a sync before each node that
changes stream or waits, a record after each producer another stream needs,
a ``record_stream`` per tensor kept, join) to win device time (kernels of
independent branches running side by side). Where kernels are small, as at
batch size 1, the device already waits for the host, so every added call is
lost time: on an H200 such plans ran at 0.56x of one stream.

:func:`estimate` replays a plan, with the calls the rewrite would add, on
a two-clock model:

* the host issues the nodes in graph order: :attr:`HostCosts.launch_us` per
  node that launches work, plus what each stream call costs;
* a node's kernel starts when it is issued, its stream is free and its
  inputs are done, and runs for its cost (the cost model's microseconds of
  device time);
* the forward ends when the host is done and every stream is idle.

The same replay on one stream, without the calls, is what the plan competes
with. :func:`paying_plan` merges side streams that do not pay for their
calls into the stream they fork from, moves branches too small to pay for
theirs, makes fewer calls for the same plan where that pays
(torch_stage/streams/fx/calls.py), and declines a plan that still loses.
Host costs are measured once per device and process
(:func:`host_costs`); device times come from the cost model. On a CPU, where
streams run nothing side by side, the kernels are the nominal accelerator's
of the cost model and the calls are the CPU's, cheaper than a GPU's
(under a microsecond against a few): a CPU keeps plans a GPU would
decline. :func:`planning_with` plans with another device's costs. Each
call is measured where a forward makes it, between two launches: a call
between ops costs several times what it costs in a loop of calls alone.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import statistics
import threading
import time
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from torch_stage import _C
from torch_stage.streams.fx import _ops
from torch_stage.streams.fx._example import tensors_in
from torch_stage.streams.fx.calls import compact, segments, stream_order
from torch_stage.streams.fx.cost_model import LAUNCH_US
from torch_stage.streams.fx.stream_plan import plan, with_raw

__all__ = [
    "Estimate",
    "HostCosts",
    "device_costs",
    "device_of",
    "estimate",
    "host_costs",
    "paying_plan",
    "plan_estimate",
    "planning_with",
]


@dataclass(frozen=True)
class HostCosts:
    """Host microseconds of the calls a rewritten forward makes, on one device.

    Attributes:
        launch_us: issuing one small op on the device (what each node of the
            graph costs the host, with or without streams): the mean of a
            small matrix product and an elementwise op.
        fork_join_us: one ``fork`` and its ``join``: once per forward.
        sync_us: a ``sync`` that switches stream, without waits or keeps.
        record_us: recording one event.
        wait_us: one event waited on inside a ``sync``.
        keep_us: one tensor marked used on a stream (``record_stream``).
        device: where they were measured (``"given"`` when not measured).
    """

    launch_us: float
    fork_join_us: float
    sync_us: float
    record_us: float
    wait_us: float
    keep_us: float
    device: str = "given"

    def __post_init__(self):
        for f in fields(self):
            if f.name == "device":
                continue
            value = getattr(self, f.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"HostCosts.{f.name} must be a finite number >= 0 (microseconds), got {value!r}"
                )
            object.__setattr__(self, f.name, float(value))

    @classmethod
    def free(cls) -> HostCosts:
        """Calls that cost nothing: a plan pays wherever streams overlap
        kernels (what replaying CUDA graphs approaches)."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    @property
    def dependency_us(self) -> float:
        """One dependency between two streams: a record, a sync and a wait."""
        return self.record_us + self.sync_us + self.wait_us


@dataclass(frozen=True)
class Estimate:
    """A plan's modelled time per forward against one stream's.

    Attributes:
        one_stream_us: the graph on one stream, without stream calls.
        planned_us: the graph as planned, with its calls.
        calls_us: host time of the calls the plan adds.
        calls: how many calls it adds.
        host: the host costs used.
    """

    one_stream_us: float
    planned_us: float
    calls_us: float
    calls: int
    host: HostCosts

    @property
    def speedup(self) -> float:
        """``one_stream_us / planned_us`` (above 1: the plan is faster)."""
        return self.one_stream_us / self.planned_us if self.planned_us > 0 else 1.0

    @property
    def pays(self) -> bool:
        return self.planned_us < self.one_stream_us

    def __str__(self) -> str:
        where = (
            "given host costs"
            if self.host.device == "given"
            else f"host costs measured on {self.host.device}"
        )
        return (
            f"modelled {self.planned_us:.4g} us per forward on streams against "
            f"{self.one_stream_us:.4g} us on one ({self.speedup:.2f}x), "
            f"{self.calls} stream calls costing {self.calls_us:.4g} us of host time "
            f"({where})"
        )


# -- measuring ------------------------------------------------------------

_lock = threading.Lock()
_measured: Dict[str, HostCosts] = {}
_given: List[HostCosts] = []  # planning_with's stack


@contextlib.contextmanager
def planning_with(costs: HostCosts) -> Iterator[HostCosts]:
    """Plans made inside use ``costs`` instead of measured host costs: to
    plan for a device measured elsewhere, or to make plans that do not
    depend on this machine's timing (the tests'). Process-wide while open."""
    if not isinstance(costs, HostCosts):
        raise TypeError(f"planning_with needs HostCosts, got {type(costs).__name__}")
    with _lock:
        _given.append(costs)
    try:
        yield costs
    finally:
        with _lock:
            _given.remove(costs)


def host_costs(device: Any = "cpu") -> HostCosts:
    """The host costs of the stream calls on ``device``: those given to an
    open :func:`planning_with`, else measured on the first call for that
    device in this process (tens of milliseconds) and kept."""
    with _lock:
        if _given:
            return _given[-1]
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        # No streams and no launches of their own: a model on meta is
        # planned for the host it will be made on.
        device = torch.device("cpu")
    elif device.index is None:
        try:
            device = torch.device(device.type, torch.empty(0, device=device).device.index)
        except (RuntimeError, AssertionError) as exc:
            raise RuntimeError(
                f"cannot measure the stream calls' host costs on {device}: torch cannot "
                f"make a tensor there ({str(exc).splitlines()[0]}); plan on a device "
                "this process can use, or give the costs with planning_with(HostCosts(...))"
            ) from None
    key = str(device)
    with _lock:
        found = _measured.get(key)
    if found is None:
        found = _measure(device)
        with _lock:
            found = _measured.setdefault(key, found)
    return found


def _per_call(bodies: Dict[str, Any], calls: int, rounds: int = 15) -> Dict[str, float]:
    """Microseconds per iteration of each body (which makes ``calls``
    iterations) over the ``"launching"`` body's, the median of ``rounds``
    interleaved rounds after one unmeasured one: a machine whose speed
    drifts during the timing slows a round's bodies alike."""
    for fn in bodies.values():
        fn()
    extra: Dict[str, List[float]] = {name: [] for name in bodies}
    for _ in range(rounds):
        times = {}
        for name, fn in bodies.items():
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        for name, t in times.items():
            extra[name].append((t - (times["launching"] if name != "launching" else 0.0)) * 1e6)
    return {name: statistics.median(v) / calls for name, v in extra.items()}


def _measure(device: torch.device) -> HostCosts:
    # Unobserved, and outside any dispatch or function mode: a sanitizer, a
    # trace or a `with torch.device(...)` that is on while planning must
    # neither see these runs nor make the calls look dearer than they are
    # (the figures are kept for the process).
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return _C._call_unobserved(lambda: _timings(device))


def _timings(device: torch.device) -> HostCosts:
    # Each call is timed between two launches, a matrix product and an
    # elementwise op, as a rewritten forward makes it, against the same
    # launches without it. A call timed in a loop of calls alone cost a
    # sixth to a third of what it adds between the ops of a forward on this
    # project's 2-vCPU VM (a sync: 0.12 us alone; 0.3 us between two
    # one-element negations, 0.6-0.9 us between two small matrix products;
    # a call to a builtin that does nothing costs as much there), and the
    # pay rule kept plans whose calls cost more than it thought.
    x = torch.ones(1, 16, device=device)
    w = torch.ones(16, 16, device=device)
    probes = (x,)
    n = 64  # iterations per timing, two launches each
    linear, neg = torch.nn.functional.linear, torch.neg

    def launching():
        for _ in range(n):
            linear(x, w)
            neg(x)

    def fork_join():
        for _ in range(n):
            linear(x, w)
            run = _ops.fork(2, (1,), 0, probes)
            neg(x)
            _ops.join(run, (1,))
            # Dropped, as a forward drops it: fork may start it again then.
            run = None

    def switching(keep=None):
        def body():
            run = _ops.fork(2, (1,), 0, probes)
            for i in range(n):
                linear(x, w)
                _ops.sync(run, -1, 1 - i % 2, (), keep)
                neg(x)
            _ops.join(run, (1,))

        return body

    def recording():
        run = _ops.fork(2, (1,), n, probes)
        for i in range(n):
            linear(x, w)
            _ops.record_event(run, i, 0)
            neg(x)
        _ops.join(run, (1,))

    def waiting():
        run = _ops.fork(2, (1,), n, probes)
        for i in range(n):
            linear(x, w)
            _ops.record_event(run, i, i % 2)
            neg(x)
            _ops.sync(run, -1, 1 - i % 2, (i,), None)
        _ops.join(run, (1,))

    extra = _per_call(
        {
            "launching": launching,
            "fork_join": fork_join,
            "switching": switching(),
            "keeping": switching(probes),
            "recording": recording,
            "waiting": waiting,
        },
        n,
    )
    fj = max(0.0, extra["fork_join"])
    base = fj / n  # each body below holds one fork and join besides its calls
    sync = max(0.0, extra["switching"] - base)
    record = max(0.0, extra["recording"] - base)
    wait = max(0.0, extra["waiting"] - base - sync - record)
    keep = max(0.0, extra["keeping"] - base - sync)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # Two launches an iteration.
    return HostCosts(extra["launching"] / 2, fj, sync, record, wait, keep, device=str(device))


def device_of(module: torch.nn.Module, example_inputs: Optional[Sequence[Any]]) -> torch.device:
    """The device a plan is made for: its first example tensor's, else its
    module's first parameter's or buffer's, else the CPU."""
    for t in tensors_in(tuple(example_inputs or ())):
        return t.device
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


# -- the model ------------------------------------------------------------


def estimate(
    costs_us: Sequence[float],
    edges: Sequence[tuple],
    raw: Mapping[str, Any],
    host: HostCosts,
) -> Estimate:
    """Replay a plan on the model of the module doc, and the same nodes on
    one stream without calls.

    Args:
        costs_us: device microseconds per device node, in graph order.
        edges: ``(u, v)`` index pairs: ``v`` needs ``u`` done first.
        raw: the scheduler's plan (:func:`~torch_stage.streams.fx.stream_plan.plan`):
            ``stream``, ``event`` (recorded after each node, or -1),
            ``event_node``, ``wait_node``, ``wait_event``, ``keep_node``,
            ``fork``.
        host: what the calls cost.

    The calls are counted as the rewrite makes them (see
    :mod:`~torch_stage.streams.fx.multi_stream_pass`): a sync before a node
    that changes stream, waits or keeps, carrying the record of the node
    before it; a record of its own otherwise; fork and join. What the
    rewrite adds beyond the plan (forward's inputs marked on the side
    streams that read them, constants made again per stream) is left out.
    """
    count = len(costs_us)
    preds: List[List[int]] = [[] for _ in range(count)]
    for u, v in edges:
        preds[v].append(u)
    one = _replay([(i, 0) for i in range(count)], preds, costs_us, host)
    if not raw["fork"] and not any(raw["stream"]):
        return Estimate(one, one, 0.0, 0, host)
    waits = [0] * count
    # A wait orders its node after the event's, which may be more than the
    # node's own inputs (a wait moved to the first call of its segment,
    # a record to the last node of its: torch_stage/streams/fx/calls.py).
    planned_preds = list(preds)
    for node, e in zip(raw["wait_node"], raw["wait_event"]):
        waits[node] += 1
        planned_preds[node] = planned_preds[node] + [raw["event_node"][e]]
    keeps = [0] * count
    for node in raw["keep_node"]:
        keeps[node] += 1
    stream, event = raw["stream"], raw["event"]
    calls, calls_us = 2, host.fork_join_us  # fork and join
    steps: List[tuple] = [(None, host.fork_join_us)]
    current, pending = 0, False

    def call(us: float) -> None:
        nonlocal calls, calls_us
        calls += 1
        calls_us += us
        steps.append((None, us))

    for i in range(count):
        if stream[i] != current or waits[i] or keeps[i]:
            call(
                host.sync_us
                + (host.record_us if pending else 0.0)
                + host.wait_us * waits[i]
                + host.keep_us * keeps[i]
            )
            current = stream[i]
        elif pending:
            call(host.record_us)
        pending = event[i] >= 0
        steps.append((i, stream[i]))
    # Back to the caller's stream: join does that, and marks the outputs
    # made on side streams used there (multi_stream_pass.py).
    if pending:
        call(host.record_us)
    planned = _replay(steps, planned_preds, costs_us, host)
    return Estimate(one, planned, calls_us, calls, host)


def _replay(steps, preds, costs_us, host: HostCosts) -> float:
    """Host clock and per-stream device clocks over ``steps``: ``(node,
    stream)`` for a device node, ``(None, host_us)`` for a call."""
    now = 0.0
    free: Dict[int, float] = {}
    finish = [0.0] * len(costs_us)
    for node, value in steps:
        if node is None:
            now += value
            continue
        cost = costs_us[node]
        if cost > 0:
            now += host.launch_us
        start = max([now, free.get(value, 0.0)] + [finish[u] for u in preds[node]])
        finish[node] = start + cost
        free[value] = finish[node]
    return max([now] + list(free.values()))


def plan_estimate(analysis: Any, raw: Mapping[str, Any], host: HostCosts) -> Estimate:
    """:func:`estimate` of ``raw``, a plan of the analysed graph."""
    return estimate(
        device_costs(analysis.costs, analysis.costs_known), list(analysis.edges), raw, host
    )


def paying_plan(analysis: Any, stream_plan: Any, raw: dict, host: HostCosts, verify: bool):
    """``stream_plan`` made to pay, or declined: each side stream whose
    work saves less than its calls cost the host (by :func:`estimate`) is
    merged into the stream it forks from, least work first, while that
    makes the forward faster; then each branch (consecutive nodes on a side
    stream) whose kernels take less time than the calls around it goes to
    the stream current before it or to its input's, where that makes the
    forward faster (:func:`_small_branches`, at most
    :data:`MAX_BRANCH_TRIALS` tries); then the plan makes fewer calls where
    that makes the forward faster: its nodes issued stream by stream, the
    calls of each stretch of one stream shared
    (:func:`_fewer_calls`); then, if the plan is still slower than one
    stream, it is declined (every node on stream 0, a note saying why).

    Returns the plan and its raw form, with ``estimate`` set, and the
    analysis they number the device nodes of: ``analysis``, or a copy with
    the nodes in the order they are to be issued
    (:meth:`~torch_stage.streams.fx.analysis.GraphAnalysis.reordered`).
    """
    costs_us = device_costs(analysis.costs, analysis.costs_known)
    edges = list(analysis.edges)
    first = best = plan_estimate(analysis, raw, host)
    merged: List[str] = []

    def tried(streams):
        tried_plan, tried_raw = plan(analysis, "user", verify, fixed=streams)
        found = estimate(costs_us, edges, tried_raw, host)
        if found.planned_us >= best.planned_us:
            return None
        return (
            replace(
                tried_plan,
                strategy=stream_plan.strategy,
                reason=stream_plan.reason,
                chains=stream_plan.chains,
                groups=stream_plan.groups,
            ),
            tried_raw,
            found,
        )

    producers = _producers(edges)
    while raw["fork"]:
        for side in _side_streams_by_work(raw["stream"], costs_us):
            on_side = [i for i, s in enumerate(raw["stream"]) if s == side]
            parent = _input_stream(on_side, raw["stream"], producers)
            better = tried([parent if s == side else s for s in raw["stream"]])
            if better is not None:
                merged.append(f"{side} into {parent}")
                stream_plan, raw, best = better
                break
        else:
            break
    # Then branch by branch: a side stream that pays as a whole may still
    # run a branch too small to pay for the switches and events around it.
    branches = 0
    trials = 0
    failed = set()  # (first, last, target) tried without gain
    while raw["fork"]:
        candidates = [
            (first_node, last_node, target)
            for first_node, last_node, targets in _small_branches(
                raw["stream"], costs_us, producers, host
            )
            for target in targets
            if (first_node, last_node, target) not in failed
        ]
        better = None
        for first_node, last_node, target in candidates[: MAX_BRANCH_TRIALS - trials]:
            failed.add((first_node, last_node, target))
            trials += 1
            streams = list(raw["stream"])
            # With the nodes colocated with it (views follow their
            # producer; colocate_with): a group never spans two streams.
            for i in _with_colocated(range(first_node, last_node + 1), analysis.colocation):
                streams[i] = target
            better = tried(streams)
            if better is not None:
                break
        if better is None:
            break
        branches += 1
        stream_plan, raw, best = better
    reorders = shares = 0
    as_analysed = analysis
    if raw["fork"]:
        analysis, stream_plan, raw, best, reorders, shares = _fewer_calls(
            analysis, stream_plan, raw, best, host, verify
        )
    if not raw["fork"] or not best.pays:
        # (Said of the whole plan: merging ends on one stream where it
        # cannot pay with fewer streams either.)
        stream_plan.estimate = first
        hint = (
            ""
            if analysis.costs_known
            else " (without shapes each kernel counts as one launch: example_inputs "
            "give the real sizes)"
        )
        return (
            stream_plan.declined(
                f"runs on one stream: the plan does not pay, {first}{hint}; "
                f'strategy="{stream_plan.strategy}" keeps it'
            ),
            {"fork": []},
            as_analysed,  # one stream, in the graph's order
        )
    stream_plan.estimate = best
    notes = []
    if merged:
        shown = ", ".join(merged[:8]) + (f" and {len(merged) - 8} more" if len(merged) > 8 else "")
        notes.append(f"side streams merged where their calls cost more than they save: {shown}")
    if branches:
        notes.append(
            f"{branches} branch{'es' if branches > 1 else ''} too small to pay for the "
            f"switches and events around {'them' if branches > 1 else 'it'} moved to a "
            "neighbouring stream"
        )
    if reorders:
        notes.append(f"issued stream by stream: {reorders} fewer stream switches")
    if shares:
        notes.append(f"{shares} call{'s' if shares > 1 else ''} shared within a stream")
    if notes:
        stream_plan.note = "; ".join(notes)
    return stream_plan, raw, analysis


def _fewer_calls(analysis, stream_plan, raw, best, host, verify):
    """The plan with fewer calls where that makes the forward faster
    (torch_stage/streams/fx/calls.py): each segment's keeps, records and
    waits at the calls it makes anyway, and, on a device with streams, the
    nodes issued stream by stream. Returns the analysis (reordered or not),
    the plan, its raw form and estimate, the stream switches saved by the
    order and the calls saved by sharing."""
    cpu = host.device == "cpu"
    # (analysis, raw, estimate) as planned, then issued stream by stream.
    orders = [(analysis, raw, best)]
    # Not on a CPU, where the order also decides which ATen kernels run
    # back to back on the host: in_place issued stream by stream made 6
    # calls fewer (3.5k instructions a forward) but ran 3% slower without
    # any call, which callgrind's cache and branch simulation put on the
    # order (340 more instruction-cache misses and 120 more mispredicted
    # branches a forward). A GPU's host only launches, and its calls cost
    # microseconds each.
    if not cpu:
        seen = [analysis.device_nodes]
        # From the graph's first stream, or from the caller's (no switch
        # before the first node).
        for first in dict.fromkeys([raw["stream"][0], 0]):
            order = stream_order(analysis, raw["stream"], first)
            device_order = [n for n in order if n in analysis.index]
            if device_order in seen:
                continue
            seen.append(device_order)
            reordered = analysis.reordered(order)
            fixed = [raw["stream"][analysis.index[n]] for n in reordered.device_nodes]
            _, reordered_raw = plan(reordered, "user", verify, fixed=fixed)
            orders.append((reordered, reordered_raw, plan_estimate(reordered, reordered_raw, host)))
    # Where streams run nothing side by side (a CPU: the plan keeps the
    # nominal accelerator's streams, see the module doc), sharing changes
    # nothing but the calls, which are real there: the fewest win, among
    # the variants the model still finds paying. Elsewhere the model weighs
    # calls against lost overlap.
    if cpu:

        def key(found):
            return (not found.pays, found.calls_us, found.calls, found.planned_us)

    else:

        def key(found):
            return (found.planned_us, found.calls_us)

    chosen = (analysis, raw, best, best)
    for a, r, as_planned in orders:
        costs_us = device_costs(a.costs, a.costs_known)
        edges = list(a.edges)
        # Keeps alone move for free; records and waits trade overlap.
        candidates = [(r, as_planned)]
        for options in ({"waits": False, "records": False}, {"waits": False}, {}):
            shared = compact(r, **options)
            candidates.append((shared, estimate(costs_us, edges, shared, host)))
        for r2, found in candidates:
            if key(found) < key(chosen[2]):
                chosen = (a, r2, found, as_planned)
    a, r, found, as_planned = chosen
    if r is raw:
        return analysis, stream_plan, raw, best, 0, 0
    return (
        a,
        with_raw(stream_plan, a, r),
        r,
        found,
        len(segments(raw["stream"])) - len(segments(r["stream"])) if a is not analysis else 0,
        as_planned.calls - found.calls,
    )


#: Branches :func:`paying_plan` tries on another stream, at most, per plan:
#: each trial plans the graph's events again (about 5 ms at 10,000 nodes on
#: this project's CPU: the whole pass took 2.2 s there, 2.4 s with the 32),
#: and the smallest branches, which gain most, come first.
MAX_BRANCH_TRIALS = 32


def _with_colocated(nodes: Sequence[int], colocation: Sequence[int]) -> List[int]:
    """``nodes`` and every node in a colocation group with one of them."""
    groups = {colocation[i] for i in nodes if colocation[i] >= 0}
    found = set(nodes)
    found.update(i for i, g in enumerate(colocation) if g >= 0 and g in groups)
    return sorted(found)


def _small_branches(
    stream: Sequence[int],
    costs_us: Sequence[float],
    producers: Mapping[int, List[int]],
    host: HostCosts,
) -> List[tuple]:
    """Branches of side streams whose kernels take less device time than
    the calls around them can cost (a switch in and out, a record and a
    wait each way), least work first: ``(first, last, targets)``, a run of
    consecutive device nodes on one side stream in graph order, and the
    streams to try it on: the one current before it (where it would need no
    switch) and the one its first input from another stream comes from."""
    limit = 2.0 * host.sync_us + 2.0 * (host.record_us + host.wait_us)
    found = []
    for i, j in segments(stream):
        s = stream[i]
        work = sum(costs_us[i : j + 1])
        if s != 0 and work < limit:
            targets = [stream[i - 1]] if i > 0 else []
            targets.append(_input_stream(range(i, j + 1), stream, producers))
            targets = list(dict.fromkeys(t for t in targets if t != s))
            found.append((work, i, j, targets))
    found.sort(key=lambda f: (f[0], f[1]))
    return [(i, j, targets) for _, i, j, targets in found]


def _side_streams_by_work(stream: Sequence[int], costs_us: Sequence[float]) -> List[int]:
    work: Dict[int, float] = {}
    for s, c in zip(stream, costs_us):
        if s != 0:
            work[s] = work.get(s, 0.0) + c
    return sorted(work, key=lambda s: (work[s], s))


def _producers(edges: Sequence[tuple]) -> Dict[int, List[int]]:
    """Each device node's producers (``u`` of the edges ``(u, v)``), ascending."""
    found: Dict[int, List[int]] = {}
    for u, v in sorted(edges):
        found.setdefault(v, []).append(u)
    return found


def _input_stream(
    nodes: Sequence[int], stream: Sequence[int], producers: Mapping[int, List[int]]
) -> int:
    """The stream the first input of ``nodes`` (ascending, all on one
    stream) from another stream comes from: the stream they fork from (0
    if none: the caller's)."""
    own = stream[nodes[0]]
    for v in nodes:
        for u in producers.get(v, ()):
            if stream[u] != own:
                return stream[u]
    return 0


def device_costs(costs: Sequence[float], costs_known: bool) -> List[float]:
    """The scheduler's costs as device microseconds: as given when known
    (the default model's and a ``cost_model``'s unit), else one launch per
    node that launches work (without shapes, the least a kernel takes)."""
    if costs_known:
        return list(costs)
    return [LAUNCH_US if c > 0 else 0.0 for c in costs]
