"""A stream plan written the way PyTorch writes user streams
(torch_stage/streams/fx/user_streams.py), and the program AOTAutograd makes
of it, forward and backward, run op by op (torch_stage/streams/fx/program.py)
under the stream sanitizer.

PyTorch's stream passes run here as they run on a GPU
(tests/compiled_streams.py, emulate_streams): so what these tests check is
the program inductor gets, every op of it but inductor's own kernels. What
only a GPU shows: inductor's generated code for it, and kernels overlapping
(tests/gpu_check.sh runs the cuda tests of test_compile_backend.py)."""

import copy
import operator
import threading

import pytest
import torch
from compiled_streams import remove_wait, restore, unordered_dependencies, waits
from torch import nn
from zoo import ZOO, build

import torch_stage
from torch_stage.streams.fx import user_streams
from torch_stage.streams.fx.user_streams import stream_index

ENTRIES = {e.name: e for e in ZOO}


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 256)

    def forward(self, x):
        return self.c(self.a(x).relu()) + self.b(x).sigmoid()


def _stream_ops(gm, names):
    """``gm``'s nodes in program order, the syncs AOTAutograd wrapped in
    ``control_deps`` included: ``(name, stream)``, or ``(op, event slot or
    tensor, stream)`` for a stream op (stream: the pool's number, 0 for the
    caller's, None for none)."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    out = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        if n.target is control_deps:
            out.extend(_stream_ops(getattr(gm, n.args[1].target), names))
            continue
        if n.target is operator.getitem:
            continue
        where = names.get(stream_index(n))
        stream = None if where is None else 0 if where[0] == "current" else where[1]
        if getattr(n.target, "namespace", None) == "streams":
            op = n.target._schema.name.split("::")[-1]
            first = n.args[0]
            if op == "record_stream":
                first = first.name
            elif names.get(first, ("",))[0] == "event":
                first = names[first][1]
            out.append((op, first, stream))
        else:
            out.append((n.name, stream))
    return out


def test_the_plan_is_written_as_pytorch_writes_user_streams(emulated):
    # Dynamo's graph, and the plan (the matmuls are what costs):
    #
    #   x ─▶ linear (a) ─▶ relu ─▶ linear_1 (c) ─┐      stream 0
    #   x ─▶ linear_2 (b) ─▶ sigmoid ──────────▶ add    stream 1
    #
    # written as user streams: each node annotated with its stream's side
    # table index, stream 1 forked from the caller's at entry and joined
    # back at exit, one event for c -> add, and record_stream where memory
    # is used off its allocation stream (x on stream 1, c on stream 1, the
    # output on the caller's).
    model, x = TwoBranches(), torch.randn(64, 256)
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    torch.compile(model, backend=backend, fullgraph=True)(x)
    names = backend.tables[0].entries
    assert _stream_ops(backend.graphs[0], names) == [
        ("record_event", 1, 0),  # the fork (slot 1: after the plan's one event)
        ("wait_event", 1, 1),
        ("linear", 0),
        ("relu", 0),
        ("linear_1", 0),
        ("record_event", 0, 0),  # c is ready
        ("record_stream", "l_x_", 1),
        ("linear_2", 1),
        ("sigmoid", 1),
        ("wait_event", 0, 1),  # add waits for c
        ("record_stream", "linear_1", 1),
        ("add", 1),
        ("record_stream", "add", 0),  # the output, used on the caller's stream
        ("record_event", 2, 1),  # the join
        ("wait_event", 2, 0),
    ]
    plan = backend.plans[0]
    assert plan.assignment == {
        "linear": 0,
        "relu": 0,
        "linear_1": 0,
        "linear_2": 1,
        "sigmoid": 1,
        "add": 1,
    }
    assert plan.note == ""


def test_the_side_tables_constructors_are_not_compiled(emulated):
    # Dynamo's bytecode calls them before every call of the graph: traced,
    # each would become a graph of its own, recompiled for every stream and
    # event number.
    model, x = TwoBranches(), torch.randn(64, 256)
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    compiled = torch.compile(model, backend=backend)
    for _ in range(3):
        compiled(x).sum().backward()
    assert len(backend.plans) == 1
    assert [kind for kind, _ in backend.programs] == ["forward", "backward"]


def test_the_side_table_holds_torch_stages_streams_and_events(emulated):
    model, x = TwoBranches(), torch.randn(64, 256)
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    torch.compile(model, backend=backend, fullgraph=True)(x)
    table = backend.tables[0]
    kinds = sorted(e[0] for e in table.entries.values())
    assert kinds.count("current") == 1 and kinds.count("stream") == 1
    from torch._dynamo.graph_bytecode_inputs import get_external_object_by_index

    for index, entry in table.entries.items():
        obj = get_external_object_by_index(index)
        if entry[0] == "stream":
            assert obj is user_streams.side_stream("cpu", -1, entry[1])
        elif entry[0] == "event" and not isinstance(entry[1], tuple):
            assert obj is user_streams.pooled_event("cpu", -1, entry[1])
    # The same stream object every time; events one set per thread.
    assert user_streams.side_stream("cpu", -1, 1) is user_streams.side_stream("cpu", -1, 1)
    assert user_streams.side_stream("cpu", -1, 1) is not user_streams.side_stream("cpu", -1, 2)
    other = []
    thread = threading.Thread(target=lambda: other.append(user_streams.pooled_event("cpu", -1, 0)))
    thread.start()
    thread.join()
    assert other[0] is not user_streams.pooled_event("cpu", -1, 0)
    assert user_streams.pooled_event("cpu", -1, 0) is user_streams.pooled_event("cpu", -1, 0)


def _train(model, compiled, inputs, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        torch.manual_seed(11 + step)
        opt.zero_grad()
        compiled(*[t.clone() for t in inputs]).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.own_sanitizer
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_the_stream_program_trains_race_free_and_equal_to_eager(entry, emulated):
    eager = build(entry).train()
    ours = copy.deepcopy(eager)
    inputs = entry.inputs(4, "cpu")
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    compiled = torch.compile(ours, backend=backend, fullgraph=True)
    with torch_stage.sanitize_streams() as sanitizer:
        _train(ours, compiled, inputs)
    _train(eager, eager, inputs)
    assert sanitizer.races == []
    for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
        if not entry.random:
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    kinds = [kind for kind, _ in backend.programs]
    assert kinds == ["forward", "backward"]
    if entry.name in ("inception", "two_tower", "rec_8_towers"):
        assert len(backend.plans[0].streams_used) >= 2, str(backend.plans[0])
        forward = backend.programs[0][1]
        assert {stream_index(n) for n in forward.graph.nodes} - {None}


@pytest.mark.own_sanitizer
@pytest.mark.parametrize("name", ["inception", "two_tower", "rec_8_towers"])
def test_inference_programs_run_race_free(name, emulated):
    entry = ENTRIES[name]
    model = build(entry).eval()
    inputs = entry.inputs(4, "cpu")
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad(), torch_stage.sanitize_streams() as sanitizer:
        out = compiled(*inputs)
    assert sanitizer.races == []
    torch.testing.assert_close(out, model(*inputs))
    assert [kind for kind, _ in backend.programs] == ["inference"]


def test_the_backward_forks_and_joins_the_side_streams_it_uses(emulated):
    model, x = TwoBranches(), torch.randn(64, 256)
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    names = backend.tables[0].entries
    backward = dict(backend.programs)["backward"]
    syncs = [op for op in _stream_ops(backward, names) if op[0] in ("record_event", "wait_event")]
    # Before anything else the caller's stream records, and stream 1 waits;
    # at the end stream 1 records and the caller's stream waits.
    fork, join = syncs[0][1], syncs[-1][1]
    assert syncs[:2] == [("record_event", fork, 0), ("wait_event", fork, 1)]
    assert syncs[-2:] == [("record_event", join, 1), ("wait_event", join, 0)]
    first = next(op for op in _stream_ops(backward, names) if op[0] not in ("record_event",))
    assert first == ("wait_event", fork, 1)


def _ready(program, example_inputs):
    """A forward program's placeholders for parameters (made before
    everything, and never written by the program)."""
    params = [
        p.name
        for p, value in zip(
            [n for n in program.graph.nodes if n.op == "placeholder"], example_inputs
        )
        if isinstance(value, nn.Parameter)
    ]
    return set(params)


@pytest.mark.own_sanitizer
@pytest.mark.parametrize("name", ["inception", "two_tower", "rec_8_towers"])
def test_removing_a_wait_that_orders_a_conflict_is_reported(name, emulated):
    entry = ENTRIES[name]
    model = build(entry).train()
    inputs = entry.inputs(4, "cpu")
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def step():
        # Inputs made under the sanitizer: written on the caller's stream
        # just before the call, as a training loop's batch is.
        model.zero_grad()
        compiled(*[t.clone() for t in inputs]).float().pow(2).mean().backward()

    step()
    names = backend.tables[0].entries
    arguments = [p for p in model.parameters()]
    load_bearing = 0
    for kind, program in list(backend.programs):
        ready = _ready(program, arguments + list(inputs)) if kind == "forward" else set()
        assert unordered_dependencies(program, names, ready) == [], kind
        for wait in waits(program):
            saved = remove_wait(program, wait)
            try:
                expected = unordered_dependencies(program, names, ready)
                with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
                    step()
            finally:
                restore(program, wait, saved)
            if expected:
                load_bearing += 1
                assert sanitizer.races, f"{kind} without {wait}: {expected} went unreported"
    # The test can fail: some waits order a real conflict.
    assert load_bearing >= 2


def test_a_backward_finds_its_objects_after_another_frame_refilled_the_side_table():
    from torch._dynamo import graph_bytecode_inputs as table_module

    table_module.reset_user_object_tracking()
    table = user_streams.SideTable(torch.device("cpu"))
    stream, event = table.stream(1), table.event(0)
    x = torch.ones(3, requires_grad=True)
    keeper = user_streams.BackwardTable(lambda t: t * 2, table)
    out = keeper(x)
    # What another compiled frame's bytecode does before its graph runs.
    strangers = [torch.Event("cpu"), torch.Event("cpu")]
    table_module.store_user_object_weakrefs(*strangers)
    assert table_module.get_external_object_by_index(stream) is strangers[stream]
    seen = {}

    def look(grad):
        seen["stream"] = table_module.get_external_object_by_index(stream)
        seen["event"] = table_module.get_external_object_by_index(event)

    # A hook on x's gradient runs after out's autograd node: by then the
    # table holds this graph's objects again.
    x.register_hook(look)
    out.sum().backward()
    assert seen["stream"] is user_streams.side_stream("cpu", -1, 1)
    assert seen["event"] is user_streams.pooled_event("cpu", -1, 0)
    table_module.reset_user_object_tracking()


class EndsInNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
        self.b = nn.Linear(512, 512)
        self.norm = nn.LayerNorm(512)

    def forward(self, x):
        return self.norm(self.a(x) + self.b(x)).relu()


@pytest.mark.own_sanitizer
def test_a_forward_that_ends_on_the_callers_stream_after_a_norm_trains(emulated):
    # The plan: b on stream 1, all the rest (its last node a layer norm, an
    # op of three outputs) on the caller's, with nothing to join. AOTAutograd
    # wraps each backward sync in control_deps on the nodes of its stream
    # since that stream's last sync, and cannot save the norm's tuple for
    # the backward: without a sync closing the forward, it failed to
    # partition the graph (swin_v2_t's last norm).
    eager = EndsInNorm()
    ours = copy.deepcopy(eager)
    x = torch.randn(64, 512)
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    compiled = torch.compile(ours, backend=backend, fullgraph=True)
    with torch_stage.sanitize_streams() as sanitizer:
        compiled(x).sum().backward()
    eager(x).sum().backward()
    plan = backend.plans[0]
    assert plan.join == [] and plan.streams_used == [0, 1], str(plan)
    assert sanitizer.races == []
    for (key, p), q in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=key)
