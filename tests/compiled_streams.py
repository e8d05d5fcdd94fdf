"""PyTorch's stream passes on a CPU machine, and an oracle for the stream
programs they make, for testing what the compile backend hands PyTorch's
compiler.

AOTAutograd's stream passes (``torch/_functorch/_aot_autograd/streams.py``)
only do their work where an accelerator is: they ask ``torch.accelerator``
for the current stream, skip syncs between tensors on the CPU, and time
nodes from the GPU's bandwidth and FLOPs (which they ask triton for).
:func:`emulate_streams` lets them run here on CPU tensors as they run on a
GPU, for the length of a test (pytest's ``monkeypatch`` undoes it): the
accelerator is "there", its current stream is a stand-in, every node's
device is reported as ``cuda``, and the GPU's figures are constants. The
compile backend is told the CPU has streams, so it writes its plan. Then
the program AOTAutograd builds, forward and backward, can be run op by op
(``executor="aot_eager"``) under torch_stage's stream sanitizer, on the CPU.

What this cannot show, and only a GPU can: inductor's code for such a
program (its generated code declares stream variables only for devices it
opens a guard for, never the CPU) and real kernels overlapping.
"""

from __future__ import annotations

import copy
import operator
from typing import Dict, List, Optional, Set, Tuple

import torch

from torch_stage.streams import compile_backend
from torch_stage.streams.fx import user_streams
from torch_stage.streams.fx.fusion import _is_view


def emulate_streams(monkeypatch) -> None:
    """See the module doc."""
    import torch._functorch._aot_autograd.streams as aot_streams
    import torch.utils._runtime_estimation as estimation

    stand_in = user_streams.current_stream("cpu", -1)
    monkeypatch.setattr(compile_backend, "_streams_on", lambda device: True)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: stand_in)
    monkeypatch.setattr(aot_streams, "get_device", lambda node: torch.device("cuda"))
    monkeypatch.setattr(estimation, "get_gpu_dram_gbps", lambda: 1000)
    monkeypatch.setattr(estimation, "get_device_tflops", lambda dtype: 100)


_SYNCS = ("wait_event", "sync_dealloc", "wait_stream")


def _op_name(n: torch.fx.Node) -> Optional[str]:
    if n.op != "call_function" or getattr(n.target, "namespace", None) != "streams":
        return None
    return n.target._schema.name.split("::")[-1]


def _subgraph(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Optional[torch.fx.GraphModule]:
    from torch._inductor.fx_passes.control_dependencies import control_deps

    if n.op == "call_function" and n.target is control_deps:
        return getattr(gm, n.args[1].target)
    return None


def waits(gm: torch.fx.GraphModule) -> List[Tuple[str, str]]:
    """Every wait of a program: ``(subgraph attribute or "", node name)``."""
    found = []
    for n in gm.graph.nodes:
        if _op_name(n) in _SYNCS:
            found.append(("", n.name))
        sub = _subgraph(gm, n)
        if sub is not None:
            found.extend(
                (n.args[1].target, m.name) for m in sub.graph.nodes if _op_name(m) in _SYNCS
            )
    return found


def remove_wait(gm: torch.fx.GraphModule, wait: Tuple[str, str]) -> torch.fx.Graph:
    """Remove ``wait`` from ``gm`` in place; returns what to give
    :func:`restore` to put it back."""
    where, name = wait
    owner = getattr(gm, where) if where else gm
    saved = copy.deepcopy(owner.graph)
    node = next(n for n in owner.graph.nodes if n.name == name)
    for user in list(node.users):
        # A wrapped wait's subgraph returns it first, then what it orders.
        user.args = torch.fx.node.map_arg(user.args, lambda a: None if a is node else a)
    owner.graph.erase_node(node)
    owner.recompile()
    return saved


def restore(gm: torch.fx.GraphModule, wait: Tuple[str, str], saved: torch.fx.Graph) -> None:
    where, _ = wait
    owner = getattr(gm, where) if where else gm
    owner.graph = saved
    owner.recompile()


class _Oracle:
    """Replays a program in order with a vector clock per stream and finds
    data dependencies between streams no sync orders (independent of the
    sanitizer)."""

    def __init__(self, names: Dict[int, tuple], ready: Set[str]):
        self.names = names
        self.ready = ready
        self.clock: Dict[str, Dict[str, int]] = {}
        self.events: Dict[int, Dict[str, int]] = {}
        self.unordered: List[Tuple[str, str]] = []

    def stream(self, index: Optional[int]) -> str:
        entry = self.names.get(index, ("current",))
        return f"pool{entry[1]}" if entry[0] == "stream" else "caller"

    def tick(self, s: str) -> int:
        c = self.clock.setdefault(s, {})
        c[s] = c.get(s, 0) + 1
        return c[s]

    def merge(self, s: str, other: Dict[str, int]) -> None:
        c = self.clock.setdefault(s, {})
        for k, v in other.items():
            c[k] = max(c.get(k, 0), v)

    def run(self, gm: torch.fx.GraphModule, env: Dict[torch.fx.Node, tuple]) -> None:
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                if n not in env:
                    # Made on the caller's stream before the program (or,
                    # a parameter, before everything).
                    env[n] = None if n.name in self.ready else ("caller", 1, n.name)
                continue
            if n.op == "output":
                continue
            s = self.stream(user_streams.stream_index(n))
            name = _op_name(n)
            sub = _subgraph(gm, n)
            if sub is not None:
                inner = {
                    p: env.get(a)
                    for p, a in zip(
                        [m for m in sub.graph.nodes if m.op == "placeholder"], n.args[2:]
                    )
                }
                self.run(sub, inner)
                env[n] = ("tuple", [None] + [env.get(a) for a in n.args[2:]])
                continue
            if name == "record_event":
                self.events[n.args[0]] = dict(self.clock.get(self.stream(n.args[1]), {}))
                continue
            if name in ("wait_event", "sync_dealloc"):
                self.merge(self.stream(n.args[1]), self.events.get(n.args[0], {}))
                continue
            if name == "wait_stream":
                self.merge(self.stream(n.args[0]), self.clock.get(self.stream(n.args[1]), {}))
                continue
            if name is not None:
                continue  # record_stream: no order
            if n.target is operator.getitem:
                base = env.get(n.args[0])
                env[n] = base[1][n.args[1]] if base and base[0] == "tuple" else base
                continue
            if _is_view(n.target):
                # A view launches nothing: it is what it views.
                env[n] = env.get(n.args[0]) if isinstance(n.args[0], torch.fx.Node) else None
                continue
            for a in n.all_input_nodes:
                made = env.get(a)
                if made is None or made[0] == "tuple":
                    continue
                p, seq, producer = made
                if p != s and self.clock.get(s, {}).get(p, 0) < seq:
                    self.unordered.append((n.name, producer))
            seq = self.tick(s)
            env[n] = (s, seq, n.name)


def unordered_dependencies(
    gm: torch.fx.GraphModule, names: Dict[int, tuple], ready: Set[str] = frozenset()
) -> List[Tuple[str, str]]:
    """``(consumer, producer)`` pairs of ``gm`` on different streams that no
    sync orders. ``names``: what each side-table index holds
    (``SideTable.entries``); ``ready``: placeholders made before
    everything (parameters)."""
    oracle = _Oracle(names, set(ready))
    oracle.clock["caller"] = {"caller": 1}
    oracle.run(gm, {})
    return oracle.unordered
