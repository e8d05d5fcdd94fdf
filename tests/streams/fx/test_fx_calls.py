"""Fewer stream calls for the same plan: calls shared within a stream, and
nodes issued stream by stream (torch_stage/streams/fx/calls.py)."""

import copy
import dataclasses

import pytest
import torch
from stream_oracle import data_conflict_expected
from torch import nn
from zoo import ZOO, InPlaceModel, RandomBranches, build

import torch_stage
from torch_stage.streams.fx import MultiStreamPass, _ops, host_cost
from torch_stage.streams.fx.analysis import GraphAnalysis
from torch_stage.streams.fx.calls import compact, issue_in_order, stream_order
from torch_stage.streams.fx.host_cost import HostCosts, planning_with
from torch_stage.streams.fx.multi_stream_pass import MultiStreamGraphModule, _Rewrite
from torch_stage.streams.fx.stream_plan import plan

# A GPU's order of host costs (as in test_fx_host_cost.py), given: the
# model weighs calls against overlap.
GPU_LIKE = HostCosts(
    launch_us=6.0, fork_join_us=4.0, sync_us=2.0, record_us=1.5, wait_us=1.5, keep_us=0.5
)
# A host that launches faster than the nominal kernels run, with calls of a
# GPU's cost: the device is the bottleneck, and fewer calls let the host
# stay ahead of it.
FAST_LAUNCHES = HostCosts(
    launch_us=2.0, fork_join_us=4.0, sync_us=2.0, record_us=1.5, wait_us=1.5, keep_us=0.5
)


# The same, as if measured on a CPU, where streams overlap nothing: the
# fewest calls win.
CPU = HostCosts(
    launch_us=1.4, fork_join_us=0.5, sync_us=0.25, record_us=0.13, wait_us=0.02,
    keep_us=0.01, device="cpu",
)  # fmt: skip


def _stream_calls(gm):
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in _ops.STREAM_OPS and n.target is not _ops.fork
    ]


def _analysed(module, inputs=None):
    gm = MultiStreamPass(num_streams=4).trace(module)
    return GraphAnalysis(gm, inputs, None, 4)


def _rewritten(module, host, **kwargs):
    with planning_with(host):
        return torch_stage.multi_stream(module, num_streams=4, **kwargs)


def _seeded(module, *inputs, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return module(*inputs)


# -- sharing calls within a stream -------------------------------------------


def test_a_segments_waits_keeps_and_records_share_its_first_call():
    # random_branches with right, randn_like, add and mul on stream 1: the
    # scheduler waits for right before add and keeps dropout before mul,
    # a sync each; shared, stream 1 makes one call, at its switch.
    analysis = _analysed(RandomBranches())
    names = [n.name for n in analysis.device_nodes]
    assert names == ["left", "dropout", "right", "randn_like", "add", "mul"]
    _, raw = plan(analysis, "user", True, fixed=[0, 0, 0, 1, 1, 1])
    assert raw["wait_node"] == [4] and raw["keep_node"] == [4, 5]
    shared = compact(raw)
    assert shared["wait_node"] == [3] and shared["keep_node"] == [3, 3]
    assert sorted(shared["keep_producer"]) == [1, 2]
    # The record after right is carried by the switch either way.
    assert shared["event_node"] == raw["event_node"] == [2]
    costs = host_cost.device_costs(analysis.costs, analysis.costs_known)
    before = host_cost.estimate(costs, list(analysis.edges), raw, GPU_LIKE)
    after = host_cost.estimate(costs, list(analysis.edges), shared, GPU_LIKE)
    assert after.calls == before.calls - 2
    # Keeps alone move for free: the wait stays at add.
    keeps_only = compact(raw, waits=False, records=False)
    assert keeps_only["wait_node"] == [4] and keeps_only["keep_node"] == [3, 3]


def test_records_move_to_the_end_of_their_segment_and_events_merge():
    analysis = _analysed(InPlaceModel())
    # Every other node on stream 1, in runs: records inside a run move to
    # its last node, where the switch carries them.
    count = len(analysis.device_nodes)
    _, raw = plan(analysis, "user", True, fixed=[(i // 3) % 2 for i in range(count)])
    moved = compact(raw, waits=False)
    for e, node in enumerate(moved["event_node"]):
        assert node + 1 < count and moved["stream"][node + 1] != moved["stream"][node], (e, node)
        assert moved["event"][node] == e
    assert moved["event_node"] == sorted(moved["event_node"])
    assert len(moved["event_node"]) <= len(raw["event_node"])
    # Every wait still names an event recorded before its node.
    for node, e in zip(moved["wait_node"], moved["wait_event"]):
        assert moved["event_node"][e] < node


def test_shared_calls_leave_no_dependency_unordered_on_any_zoo_model():
    # Plans with few calls, checked by the replay of stream_oracle (vector
    # clocks over the rewritten graph's stream ops) and by the results.
    for entry in ZOO:
        module = build(entry).eval()
        inputs = entry.inputs(max(2, entry.min_batch), "cpu")
        for host in (GPU_LIKE, FAST_LAUNCHES, CPU):
            gm = _rewritten(module, host)
            assert not data_conflict_expected(gm, ("<no wait removed>", None)), (
                entry.name,
                gm.code,
            )
            assert torch.equal(_seeded(gm, *inputs), _seeded(module, *inputs)), entry.name


@pytest.mark.own_sanitizer
@pytest.mark.parametrize("name", ["two_tower", "inception", "rec_8_towers", "in_place"])
@pytest.mark.parametrize(
    "host", [GPU_LIKE, FAST_LAUNCHES, CPU], ids=["gpu_like", "fast_launches", "cpu"]
)
def test_plans_with_fewer_calls_are_race_free_in_eval_and_training(name, host):
    entry = next(e for e in ZOO if e.name == name)
    module = build(entry)
    gm = _rewritten(module, host)
    inputs = entry.inputs(max(4, entry.min_batch), "cpu")
    for train in (False, True):
        gm.train(train)
        module.train(train)
        with torch_stage.sanitize_streams() as sanitizer:
            out = gm(*inputs)
            if train:
                out.float().sum().backward()
        assert sanitizer.races == []


# -- issuing stream by stream ------------------------------------------------


def test_on_a_cpu_the_graphs_order_is_kept_and_calls_are_shared():
    module = InPlaceModel().eval()
    x = torch.randn(2, 32)
    gm = _rewritten(module, CPU)
    paid = gm.stream_plan
    assert "issued stream by stream" not in paid.note
    assert "calls shared within a stream" in paid.note
    analysis = _analysed(module)
    issued = [n.name for n in gm.graph.nodes if n.name in paid.assignment]
    assert issued == [n.name for n in analysis.device_nodes]
    # The same streams as the scheduler placed them, every call its own.
    fixed = [paid.assignment[n.name] for n in analysis.device_nodes]
    _, raw = plan(analysis, "user", True, fixed=fixed)
    as_planned = host_cost.plan_estimate(analysis, raw, CPU)
    assert paid.estimate.calls < as_planned.calls
    assert len(_stream_calls(gm)) == paid.estimate.calls - 1  # fork is left out
    assert torch.equal(gm(x), module(x))


@pytest.mark.own_sanitizer
def test_in_place_is_issued_stream_by_stream_where_the_model_says_it_pays():
    module = InPlaceModel()
    analysis = _analysed(module)
    given, raw = plan(analysis, "min_sync", True)
    paid, paid_raw, issued = host_cost.paying_plan(
        analysis, copy.copy(given), dict(raw), FAST_LAUNCHES, True
    )
    assert issued is not analysis and "issued stream by stream" in paid.note
    order = [paid.assignment[n.name] for n in issued.device_nodes]
    graph_order = [paid.assignment[n.name] for n in analysis.device_nodes]
    assert _switches(order) < _switches(graph_order)
    # Fewer calls than the same streams in the graph's order.
    _, same_streams = plan(analysis, "user", True, fixed=graph_order)
    assert (
        paid.estimate.calls < host_cost.plan_estimate(analysis, same_streams, FAST_LAUNCHES).calls
    )
    # Rewritten, it equals eager, race free, in eval and training.
    gm = _rewritten(module, FAST_LAUNCHES)
    assert "issued stream by stream" in gm.stream_plan.note
    x = torch.randn(4, 32)
    for train in (False, True):
        gm.train(train)
        module.train(train)
        with torch_stage.sanitize_streams() as sanitizer:
            out = gm(x)
            if train:
                out.sum().backward()
        assert sanitizer.races == []
        assert torch.equal(out, module(x))


def _switches(streams):
    return sum(1 for a, b in zip(streams, streams[1:]) if a != b)


def test_the_model_keeps_the_graphs_order_where_issuing_by_stream_loses_overlap():
    # Large kernels on two streams, issued alternately: grouped, stream 1
    # would start only after stream 0's launches; the model keeps the
    # interleaving. (On a CPU the graph's order is always kept.)
    class Interleaved(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(3))
            self.b = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(3))

        def forward(self, x):
            a, b = x, x
            for la, lb in zip(self.a, self.b):
                with torch_stage.stream(0):
                    a = la(a)
                with torch_stage.stream(1):
                    b = lb(b)
            return a + b

    module = Interleaved().eval()
    x = torch.randn(512, 1024)
    analysis = _analysed(module, (x,))
    order = [n.name for n in stream_order(analysis, analysis.fixed) if n in analysis.index]
    assert order[:3] == ["a_0", "a_1", "a_2"], order  # grouped, had it been chosen
    given, raw = plan(analysis, "user", True)
    for host in (GPU_LIKE, FAST_LAUNCHES, CPU):
        paid, _, issued = host_cost.paying_plan(analysis, copy.copy(given), dict(raw), host, True)
        assert issued is analysis and "issued stream by stream" not in paid.note


class _RandomOnTwoStreams(nn.Module):
    """Stream 0 makes ``b`` then draws ``c``; stream 1 draws ``a`` between
    them. Issued stream by stream, ``c`` would be drawn before ``a``."""

    def forward(self, x):
        with torch_stage.stream(0):
            b = x * 2
        with torch_stage.stream(1):
            a = torch.rand_like(x)
        with torch_stage.stream(0):
            c = torch.randn_like(b)
            d = b + c
        with torch_stage.stream(1):
            e = a * 3
        return d + e


def test_random_ops_keep_their_order_so_values_equal_eager():
    module = _RandomOnTwoStreams()
    analysis = _analysed(module)
    assert {n.name for n in analysis.random} == {"rand_like", "randn_like"}
    order = [n.name for n in stream_order(analysis, analysis.fixed) if n in analysis.index]
    assert order.index("rand_like") < order.index("randn_like")
    # Without the rule, the order would swap them (the test can fail).
    unruled = copy.copy(analysis)
    unruled.random = set()
    swapped = [n.name for n in stream_order(unruled, analysis.fixed) if n in analysis.index]
    assert swapped.index("randn_like") < swapped.index("rand_like")
    # Planned as the annotations say and issued stream by stream where the
    # model finds it faster (annotated plans are kept as asked, so the
    # pass's last steps are taken here): the values equal eager's.
    gm = MultiStreamPass(num_streams=4).trace(module)
    graph = copy.deepcopy(gm.graph)
    analysis = GraphAnalysis(gm, None, None, 4, graph=graph)
    given, raw = plan(analysis, "user", True)
    cheap_launches = HostCosts(0.5, 1.0, 0.5, 0.35, 0.35, 0.2)
    paid, paid_raw, issued = host_cost.paying_plan(
        analysis, copy.copy(given), dict(raw), cheap_launches, True
    )
    assert issued is not analysis and "issued stream by stream" in paid.note
    issue_in_order(graph, issued.nodes)
    _Rewrite(gm, graph, issued, paid_raw, paid).run()
    graph.lint()
    rewritten = MultiStreamGraphModule(gm, graph)
    x = torch.randn(8)
    for seed in range(3):
        assert torch.equal(_seeded(rewritten, x, seed=seed), _seeded(module, x, seed=seed))


@torch.fx.wrap
def _note(t, log):
    log.append(float(t.sum()))
    return t


class _Logged(nn.Module):
    """A user's function with a side effect between two streams' work."""

    def __init__(self):
        super().__init__()
        self.log = []

    def forward(self, x):
        with torch_stage.stream(1):
            a = x * 2
        with torch_stage.stream(0):
            b = x + 1
        b = _note(b, self.log)
        with torch_stage.stream(1):
            c = a * 3
        with torch_stage.stream(0):
            d = b * 4
        return c + d


def test_a_node_of_unknown_effects_keeps_everything_on_its_side():
    module = _Logged()
    analysis = _analysed(module)
    order = [n.name for n in stream_order(analysis, analysis.fixed) if n.op != "placeholder"]
    at = order.index("_note")
    assert set(order[:at]) == {"mul", "add"}
    assert set(order[at + 1 : -1]) == {"mul_1", "mul_2", "add_1"}


def test_views_stay_on_their_side_of_in_place_writes():
    analysis = _analysed(InPlaceModel())
    for stream in (
        [0] * len(analysis.device_nodes),
        [i % 3 for i in range(len(analysis.device_nodes))],
    ):
        order = stream_order(analysis, stream)
        at = {n: i for i, n in enumerate(order)}
        for m, targets in analysis.mutated.items():
            written = {analysis.family(t) for t in targets}
            for n in analysis.nodes:
                if analysis.kind[n] not in ("alias", "host", "const"):
                    continue
                touched = {analysis.family(n)} | {analysis.family(a) for a in n.all_input_nodes}
                if touched & written:
                    before = analysis.position[n] < analysis.position[m]
                    assert (at[n] < at[m]) == before, (n.name, m.name)


def test_the_order_keeps_every_dependency_of_the_analysis():
    for entry in ZOO:
        analysis = _analysed(build(entry))
        count = len(analysis.device_nodes)
        for stream in ([i % 4 for i in range(count)], [(i // 2) % 3 for i in range(count)]):
            order = stream_order(analysis, stream)
            assert order[-1].op == "output" and sorted(map(id, order)) == sorted(
                map(id, analysis.nodes)
            )
            at = {n: i for i, n in enumerate(order)}
            for n in order:
                for a in n.all_input_nodes:
                    assert at[a] < at[n], (entry.name, a.name, n.name)
            for u, v in analysis.edges:
                assert at[analysis.device_nodes[u]] < at[analysis.device_nodes[v]]


class _LateInput(nn.Module):
    """Stream 1 reads ``y`` first and ``x`` at its second node."""

    def forward(self, x, y):
        with torch_stage.stream(0):
            a = x * 2
        with torch_stage.stream(1):
            b = y * 3
            c = b + x
        return a + c


def test_inputs_a_run_of_nodes_reads_are_kept_at_its_switch():
    module = _LateInput()
    gm = torch_stage.multi_stream(module, num_streams=2)
    syncs = [n for n in gm.graph.nodes if n.target is _ops.sync]
    to_side = [n for n in syncs if n.args[2] == 1]
    assert len(to_side) == 1
    assert {a.name for a in to_side[0].args[4]} == {"x", "y"}
    # No sync of its own before c.
    c = next(n for n in gm.graph.nodes if n.name == "add")
    assert c.prev.target is not _ops.sync
    x, y = torch.randn(4), torch.randn(4)
    assert torch.equal(gm(x, y), module(x, y))


def test_a_declined_plan_runs_in_the_graphs_order(monkeypatch):
    # A plan whose calls are issued stream by stream and still loses to
    # one stream runs on one stream as traced, not in the order tried for
    # the streams. (Merging usually leaves such a plan on one stream before
    # the order is tried: the model is made to say it here.)
    analysis = _analysed(InPlaceModel())
    given, raw = plan(analysis, "min_sync", True)
    fewer_calls = host_cost._fewer_calls

    def losing(*args):
        a, p, r, found, switches, shares = fewer_calls(*args)
        assert a is not analysis  # reordered
        lost = dataclasses.replace(found, planned_us=found.one_stream_us * 2)
        return a, p, r, lost, switches, shares

    monkeypatch.setattr(host_cost, "_fewer_calls", losing)
    paid, paid_raw, issued = host_cost.paying_plan(
        analysis, copy.copy(given), dict(raw), FAST_LAUNCHES, True
    )
    assert paid.note.startswith("runs on one stream") and paid_raw == {"fork": []}
    assert issued is analysis


class _SideOutput(nn.Module):
    """The output is made on stream 1."""

    def forward(self, x):
        with torch_stage.stream(0):
            a = x * 2
        with torch_stage.stream(1):
            b = x + 1
            c = b * a
        return c


def test_join_marks_the_outputs_made_on_side_streams_used_on_the_callers_stream(tmp_path):
    module = _SideOutput()
    gm = torch_stage.multi_stream(module, num_streams=2)
    calls = _stream_calls(gm)
    join = calls[-1]
    assert join.target is _ops.join and [a.name for a in join.args[2]] == ["mul_1"]
    # No sync of its own before it.
    assert calls[-2].target is not _ops.sync or calls[-2].args[2] != 0
    x = torch.randn(4)
    assert torch.equal(gm(x), module(x))
    # Scripted, saved and loaded.
    scripted = torch.jit.script(gm)
    torch.jit.save(scripted, tmp_path / "plan.pt")
    assert torch.equal(torch.jit.load(tmp_path / "plan.pt")(x), module(x))


# Not under the sanitizer: torch.jit.trace cannot record under a dispatch
# mode (tests/streams/test_multi_stream.py says more).
@pytest.mark.no_sanitizer
def test_a_join_that_marks_the_outputs_traces_with_torch_jit_trace():
    module = _SideOutput()
    gm = torch_stage.multi_stream(module, num_streams=2)
    x = torch.randn(4)
    traced = torch.jit.trace(gm, (x,))
    assert torch.equal(traced(x), module(x))
    assert "torch_stage::record_stream_traced" in str(traced.graph)
