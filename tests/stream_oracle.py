"""An oracle for mutation tests of stream plans, independent of the
sanitizer: whether a rewritten graph, with one wait removed, leaves a data
dependency between two streams unordered. It replays the graph's stream
ops as vector clocks and checks every node's inputs against them."""

import torch

import torch_stage  # noqa: F401
from torch_stage.fx import _ops
from torch_stage.fx.cost_model import is_view, may_copy

ops = torch.ops.torch_stage


def data_conflict_expected(gm, removed):
    """Whether removing wait node ``removed`` leaves a data dependency
    between two streams unordered: an oracle from the graph's data edges
    and the remaining stream ops, independent of the sanitizer."""
    stream = 0
    pos = {}  # stream -> ops issued so far
    clocks = {0: {0: 0}}
    events = {}
    made = {}  # node -> (stream, position on it)
    fork = None
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is ops.fork:
            fork = n
            for s in n.args[1]:
                clocks[s] = dict(clocks[0])
            continue
        if n.op == "call_function" and n.target is _ops.set_stream:
            stream = n.args[1]
            clocks.setdefault(stream, {stream: 0})
            continue
        if n.op == "call_function" and n.target is _ops.record_event:
            events[n.args[1]] = dict(clocks[n.args[2]])
            continue
        if n.op == "call_function" and n.target is _ops.wait_event:
            if n is not removed:
                for s, v in events[n.args[1]].items():
                    c = clocks[n.args[2]]
                    c[s] = max(c.get(s, 0), v)
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
