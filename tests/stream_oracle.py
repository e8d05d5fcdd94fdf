"""An oracle for mutation tests of stream plans, independent of the
sanitizer: whether a rewritten graph, with one wait removed, leaves a data
dependency between two streams unordered. It replays the graph's stream
ops as vector clocks and checks every node's inputs against them."""

import copy
import random

import torch

import torch_stage  # noqa: F401
from torch_stage.streams.fx import _ops
from torch_stage.streams.fx.cost_model import is_view, may_copy

ops = torch.ops.torch_stage


def waits(gm):
    """Every wait of a rewritten graph as ``(node name, index)``: a
    ``wait_event`` node (index None) or one event of a ``sync`` node's
    waits."""
    out = []
    for n in gm.graph.nodes:
        if n.target is _ops.wait_event:
            out.append((n.name, None))
        elif n.target is _ops.sync:
            out.extend((n.name, k) for k in range(len(n.args[3])))
    return out


def without_wait(gm, wait, share_state=False):
    """A copy of ``gm`` without ``wait`` (from :func:`waits`), and whether
    that leaves a data dependency between streams unordered. With
    ``share_state`` the copy shares ``gm``'s parameters and buffers (a deep
    copy gives two parameters over one storage a storage each)."""
    if share_state:
        mutant = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    else:
        mutant = copy.deepcopy(gm)
    name, k = wait
    node = next(n for n in mutant.graph.nodes if n.name == name)
    conflict = data_conflict_expected(mutant, wait)
    if k is None:
        mutant.graph.erase_node(node)
    else:
        events = list(node.args[3])
        del events[k]
        node.update_arg(3, events)
    mutant.recompile()
    return mutant, conflict


def data_conflict_expected(gm, removed):
    """Whether removing wait ``removed`` (``(node name, index)`` from
    :func:`waits`) leaves a data dependency between two streams unordered:
    an oracle from the graph's data edges and the remaining stream ops,
    independent of the sanitizer."""
    stream = 0
    pos = {}  # stream -> ops issued so far
    clocks = {0: {0: 0}}
    events = {}
    made = {}  # node -> (stream, position on it)
    fork = None

    def switch(s):
        nonlocal stream
        stream = s
        clocks.setdefault(stream, {stream: 0})

    def wait(e, s):
        for t, v in events[e].items():
            c = clocks[s]
            c[t] = max(c.get(t, 0), v)

    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (ops.fork, _ops.fork):
            fork = n
            for s in n.args[1]:
                clocks[s] = dict(clocks[0])
            continue
        if n.op == "call_function" and n.target is _ops.set_stream:
            switch(n.args[1])
            continue
        if n.op == "call_function" and n.target is _ops.record_event:
            events[n.args[1]] = dict(clocks[n.args[2]])
            continue
        if n.op == "call_function" and n.target is _ops.wait_event:
            if removed != (n.name, None):
                wait(n.args[1], n.args[2])
            continue
        if n.op == "call_function" and n.target is _ops.sync:
            _, record, s, waited, _ = n.args
            if record >= 0:
                events[record] = dict(clocks[stream])
            switch(s)
            for k, e in enumerate(waited):
                if removed != (n.name, k):
                    wait(e, s)
            continue
        if n.op != "call_function" and n.op != "call_module" and n.op != "call_method":
            continue
        if n.target in _ops.STREAM_OPS or n is fork:
            continue
        if is_view(n) and not may_copy(n):
            # No kernel: the view is made where its base was.
            base = n.args[0] if n.args else None
            if base in made:
                made[n] = made[base]
            continue
        pos[stream] = pos.get(stream, 0) + 1
        clocks[stream][stream] = pos[stream]
        for arg in n.all_input_nodes:
            if arg in made:
                s, p = made[arg]
                if s != stream and clocks[stream].get(s, 0) < p:
                    return True
        made[n] = (stream, pos[stream])
    return False


def _random_delay() -> None:
    torch.cuda._sleep(random.randint(0, 200_000))


def with_side_stream_delays(gm, all_streams=False):
    """``gm`` (a rewritten graph, changed in place) with a random GPU sleep
    before every node placed on a side stream (after its stream switch and
    waits), or on any stream: a missing wait then shows on a GPU as wrong
    values, not only now and then. A write that must wait for a read on
    the caller's stream needs the delays there too. Seeded by
    :mod:`random`."""
    side = {name for name, s in gm.stream_plan.assignment.items() if all_streams or s != 0}
    for node in list(gm.graph.nodes):
        if node.name in side:
            with gm.graph.inserting_before(node):
                gm.graph.call_function(_random_delay, ())
    gm.recompile()
    return gm
