"""The torch.compile backend "torch_stage"
(torch_stage/streams/compile_backend.py): registration (entry point and
backend objects), options, modes and executors, the model zoo under
fullgraph=True against inductor and eager, training, annotations inside
compiled code, graph breaks, and Dynamo's own user streams.

On this CPU machine the inductor executor gets each graph as Dynamo made it
(the CPU has no streams), so it must compile exactly what inductor alone
compiles; the program it gets where there are streams is tested in
fx/test_fx_user_streams.py."""

import copy
import os
import warnings

import pytest
import torch
from conftest import ROOT, caller_stream, devices
from torch import nn
from zoo import ZOO, build

import torch_stage
from torch_stage.streams import annotations as _annotations
from torch_stage.streams import compile_backend
from torch_stage.streams.fx import _ops
from torch_stage.streams.fx.host_cost import HostCosts, planning_with

ENTRIES = {e.name: e for e in ZOO}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch (Dynamo caches per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(fn, inputs, seed=7):
    torch.manual_seed(seed)
    if any(t.is_cuda for t in inputs):
        torch.cuda.manual_seed(seed)
    return fn(*[t.clone() for t in inputs])


def _inductor(module, **kwargs):
    """torch.compile(module) with inductor alone, from scratch."""
    torch._dynamo.reset()
    return torch.compile(module, **kwargs)


# -- registration ---------------------------------------------------------


def test_backend_name_works_without_importing_torch_stage(run_python):
    # A fresh interpreter that never imports torch_stage: Dynamo finds the
    # backend through the torch_dynamo_backends entry point.
    proc = run_python(
        """
        import sys
        import torch
        from importlib.metadata import entry_points

        group = entry_points(group="torch_dynamo_backends")
        assert "torch_stage" in [ep.name for ep in group], list(group)
        assert "torch_stage" not in sys.modules
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        x = torch.randn(2, 4)
        compiled = torch.compile(model, backend="torch_stage", options={"num_streams": 2})
        assert torch.equal(compiled(x), model(x))
        assert "torch_stage" in sys.modules
        assert "torch_stage" in torch._dynamo.list_backends()
        print("ok")
        """
    )
    assert proc.stdout.strip().endswith("ok")


def test_importing_torch_stage_leaves_dynamo_and_the_environment_alone(run_python):
    # torch.compiler.disable on three functions imported Dynamo and with it
    # inductor's configuration, which set TORCHINDUCTOR_CACHE_DIR in the
    # environment every child process inherits (and cost a second).
    proc = run_python(
        """
        import os, sys
        import torch
        before = dict(os.environ)
        import torch_stage
        print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
        model = torch_stage.multi_stream(torch.nn.Linear(4, 4), num_streams=2)
        model(torch.randn(2, 4))
        print(sorted(set(os.environ.items()) ^ set(before.items())))
        """
    )
    assert proc.stdout.split("\n")[:2] == ["[]", "[]"], proc.stdout


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_backend_objects_are_backends_and_record_their_plans(executor):
    entry = ENTRIES["inception"]
    module = build(entry).eval()
    inputs = entry.inputs(2, "cpu")
    backend = torch_stage.backend(num_streams=3, strategy="min_sync", executor=executor)
    assert isinstance(backend, torch_stage.Backend)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    expected = _run(_inductor(module) if executor == "inductor" else module, inputs)
    torch._dynamo.reset()
    assert torch.equal(_run(compiled, inputs), expected)
    assert len(backend.plans) == 1 and len(backend.graphs) == 1
    plan = backend.plans[0]
    assert plan.strategy == "min_sync"
    assert plan.streams_used == [0, 1, 2]
    assert "num_streams=3" in repr(backend) and "strategy='min_sync'" in repr(backend)
    assert f"executor={executor!r}" in repr(backend)


def test_the_default_executor_is_inductor_on_this_torch():
    assert compile_backend.compiled_streams_available()
    assert torch_stage.backend().executor == "inductor"
    assert compile_backend.COMPILED_STREAMS_RELEASE == (2, 13)


def test_a_torch_without_compiled_streams_runs_eager_and_says_so_once(monkeypatch):
    monkeypatch.setattr(compile_backend, "compiled_streams_available", lambda: False)
    monkeypatch.setattr(compile_backend, "_warned_release", False)
    with pytest.warns(UserWarning, match=r"needs torch >= 2\.13.*executor='eager'"):
        backend = torch_stage.backend()
    assert backend.executor == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch_stage.backend().executor == "eager"  # said once
        assert torch_stage.backend(executor="eager").executor == "eager"
    for executor in ("inductor", "aot_eager"):
        with pytest.raises(RuntimeError, match=rf"executor='{executor}' needs torch >= 2\.13"):
            torch_stage.backend(executor=executor)


def test_unknown_options_are_an_error_that_lists_the_known_ones():
    message = (
        r"unknown torch_stage backend options 'colour', 'streams': the backend's options are "
        r"cost_model, cuda_graphs, executor, num_streams, strategy, verify, warmup and mode; "
        r"any other must be an inductor option \(torch._inductor.list_options\(\)\)"
    )
    with pytest.raises(ValueError, match=message):
        torch_stage.backend(streams=2, colour="red")
    compiled = torch.compile(nn.Linear(2, 2), backend="torch_stage", options={"streams": 2})
    with pytest.raises(Exception, match="unknown torch_stage backend option 'streams'"):
        compiled(torch.ones(1, 2))


def test_inductor_options_and_modes_pass_through(monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    seen = []
    real = compile_fx.compile_fx

    def spy(gm, example_inputs, **kwargs):
        seen.append(kwargs.get("config_patches"))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx", spy)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    options = {"num_streams": 2, "epilogue_fusion": False, "triton.unique_kernel_names": True}
    compiled = torch.compile(model, backend="torch_stage", options=options)
    torch.testing.assert_close(compiled(x), model(x))
    # (compile_fx calls itself once the patches are applied, without them.)
    assert seen[0] == {"epilogue_fusion": False, "triton.unique_kernel_names": True}
    backend = torch_stage.backend(**options)
    assert backend.inductor == {"epilogue_fusion": False, "triton.unique_kernel_names": True}
    torch._dynamo.reset()
    seen.clear()
    compiled = torch.compile(model, backend="torch_stage", mode="max-autotune-no-cudagraphs")
    torch.testing.assert_close(compiled(x), model(x))
    assert seen[0]["max_autotune"] is True
    torch._dynamo.reset()
    # inductor's CUDA graphs: on the CPU inductor leaves them out, as for
    # torch.compile(mode="reduce-overhead") alone.
    seen.clear()
    compiled = torch.compile(model, backend="torch_stage", mode="reduce-overhead")
    torch.testing.assert_close(compiled(x), model(x))
    assert seen[0] == {"triton.cudagraphs": True}


@pytest.mark.parametrize(
    "options, error, message",
    [
        (
            {"executor": "fast"},
            ValueError,
            "executor must be one of 'inductor', 'aot_eager', 'eager' \\(or None\\), got 'fast'",
        ),
        ({"mode": "fastest"}, ValueError, "unknown mode 'fastest'; use one of 'default'"),
        (
            {"executor": "eager", "max_autotune": True},
            ValueError,
            r"inductor options \(max_autotune\) need executor='inductor'",
        ),
        (
            {"executor": "eager", "mode": "max-autotune"},
            ValueError,
            "mode='max-autotune' autotunes inductor's kernels: it needs executor='inductor'",
        ),
        (
            {"executor": "aot_eager", "mode": "reduce-overhead"},
            ValueError,
            "executor='aot_eager' runs the program op by op: no CUDA graphs and no mode",
        ),
    ],
)
def test_bad_executor_and_mode_combinations_are_named(options, error, message):
    with pytest.raises(error, match=message):
        torch_stage.backend(**options)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"num_streams": 0}, ValueError, "num_streams must be in 1..32, got 0"),
        ({"num_streams": "4"}, TypeError, "num_streams must be an int, got str"),
        ({"strategy": "fastest"}, ValueError, "unknown strategy 'fastest'"),
        ({"warmup": 0}, ValueError, "warmup must be >= 1, got 0"),
        ({"cuda_graphs": "yes"}, TypeError, "cuda_graphs must be a bool, got str"),
        ({"cost_model": 3}, TypeError, "cost_model must be callable"),
        ({"verify": "no"}, TypeError, "verify must be a bool or None, got str"),
    ],
)
def test_bad_option_values_are_named(options, error, message):
    with pytest.raises(error, match=message):
        torch_stage.backend(**options)


def test_an_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="unknown mode 'fast'; use one of 'default', 'reduce-"):
        compile_backend.torch_stage_backend(None, [], mode="fast")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_graphs_without_a_gpu_is_a_clear_error():
    message = r"cuda_graphs=True needs a CUDA device, but .*Leave cuda_graphs=False"
    with pytest.raises(RuntimeError, match=message):
        torch_stage.backend(cuda_graphs=True)
    with pytest.raises(RuntimeError, match=message):
        torch_stage.backend(executor="eager", mode="reduce-overhead")


# -- the zoo ---------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_zoo_compiles_with_fullgraph_and_matches_eager(entry, device):
    module = build(entry, device).eval()
    inputs = entry.inputs(4, device)
    backend = torch_stage.backend(num_streams=4, verify=True, executor="eager")
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        for seed in (1, 2):
            assert torch.equal(_run(compiled, inputs, seed), _run(module, inputs, seed))
    assert len(backend.plans) == 1  # fullgraph: one graph, no recompile
    plan = backend.plans[0]
    if entry.name in ("inception", "rec_8_towers", "two_tower", "in_place"):
        assert len(plan.streams_used) >= 2, str(plan)
    if entry.name in ("residual_mlp", "plain_chain"):
        assert plan.streams_used == [0]


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def _normalized(code: str) -> str:
    """inductor's generated code without what differs from compile to
    compile of the same graph (paths and hashes of its kernels)."""
    import re

    code = re.sub(r"# AOT ID: .*", "", code)
    code = re.sub(r"/tmp/[^'\"]+", "<path>", code)
    return re.sub(r"\b[a-z0-9]{52}\b", "<hash>", code)


@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_on_the_cpu_inductor_compiles_exactly_what_it_compiles_alone(entry):
    # The CPU has no streams: the plan is made and recorded, and inductor
    # gets Dynamo's graph as it is.
    from torch._inductor.utils import run_and_get_code

    module = build(entry).eval()
    inputs = entry.inputs(4, "cpu")
    backend = torch_stage.backend(num_streams=4)
    with torch.no_grad():
        torch.manual_seed(3)
        ours, codes = run_and_get_code(
            torch.compile(module, backend=backend, fullgraph=True), *inputs
        )
        torch._dynamo.reset()
        torch.manual_seed(3)
        theirs, their_codes = run_and_get_code(torch.compile(module, fullgraph=True), *inputs)
    assert torch.equal(ours, theirs)
    assert [_normalized(c) for c in codes] == [_normalized(c) for c in their_codes]
    assert "torch.ops.streams" not in "".join(codes)
    plan = backend.plans[0]
    if len(plan.streams_used) > 1:
        assert plan.note.startswith("not applied: cpu has no streams"), str(plan)
    else:
        assert plan.note.startswith("one stream"), str(plan)
    graph = backend.graphs[0].graph
    assert not any("stream" in (n.meta.get("custom") or {}) for n in graph.nodes)


_OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_training_steps_on_inductor_equal_inductor_alone_and_eager(entry, optimizer):
    def train(model, compiled, steps=3):
        opt = _OPTIMIZERS[optimizer](model.parameters())
        losses = []
        for step in range(steps):
            torch.manual_seed(11 + step)
            opt.zero_grad()
            loss = compiled(*[t.clone() for t in inputs]).float().pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    inputs = entry.inputs(4, "cpu")
    eager = build(entry).train()
    ours, alone = copy.deepcopy(eager), copy.deepcopy(eager)
    backend = torch_stage.backend(num_streams=4)
    got = train(ours, torch.compile(ours, backend=backend, fullgraph=True))
    torch._dynamo.reset()
    expected = train(alone, torch.compile(alone, fullgraph=True))
    train(eager, eager)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    for (name, p), q, r in zip(alone.named_parameters(), ours.parameters(), eager.parameters()):
        assert torch.equal(q, p), name
        if not entry.random:
            torch.testing.assert_close(q, r, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_rec_model_lookups_go_round_robin_in_the_compiled_graph(executor):
    entry = ENTRIES["rec_8_towers"]
    backend = torch_stage.backend(num_streams=4, executor=executor)
    compiled = torch.compile(build(entry).eval(), backend=backend, fullgraph=True)
    # The strategy's placement, before the pay rule (tested with given costs
    # in tests/streams/fx/test_fx_host_cost.py): with the calls measured on
    # a loaded machine, it merged a side stream.
    with planning_with(HostCosts.free()):
        compiled(*entry.inputs(2, "cpu"))
    plan = backend.plans[0]
    assert plan.strategy == "embedding"
    # Dynamo names each lookup after the variable it is assigned to.
    lookups = ["pooled"] + [f"pooled_{i}" for i in range(1, 8)]
    assert all(name in plan.assignment for name in lookups), str(plan)
    assert [plan.assignment[name] for name in lookups] == [0, 1, 2, 3, 0, 1, 2, 3]


# -- training --------------------------------------------------------------


def _train(model, inputs, steps, seed=11):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        torch.manual_seed(seed + step)
        optimizer.zero_grad()
        loss = model(*[t.clone() for t in inputs]).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_sgd_steps_through_the_compiled_model_equal_eager(entry, device):
    eager = build(entry, device).train()
    compiled_model = copy.deepcopy(eager)
    backend = torch_stage.backend(num_streams=4, executor="eager")
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    inputs = entry.inputs(4, device)
    expected = _train(eager, inputs, steps=3)
    got = _train(compiled, inputs, steps=3)
    named = dict(compiled_model.named_parameters())
    for name, p in eager.named_parameters():
        if device == "cpu":
            # Same kernels in the same order: bit for bit.
            assert torch.equal(named[name], p), name
        else:
            torch.testing.assert_close(named[name], p, rtol=1e-5, atol=1e-6, msg=name)
    for e, g in zip(expected, got):
        if device == "cpu":
            assert torch.equal(e, g)
    if entry.name in ("inception", "rec_8_towers", "two_tower"):
        assert len(backend.plans[0].streams_used) >= 2


# -- annotations in compiled code ------------------------------------------


class Annotated(nn.Module):
    """stream() and colocate_with() inside compiled code."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        with torch_stage.stream(2):
            a = self.a(x)
            with torch_stage.stream(3):
                inner = a * 2
        b = self.b(x)
        with torch_stage.colocate_with(a):
            c = torch.relu(self.c(x))
        return a + b + c + inner


@pytest.mark.skipif(
    not _annotations._DYNAMO_CARRIES_ANNOTATIONS, reason="this torch's Dynamo drops annotations"
)
@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_annotations_inside_compiled_code_are_honoured(executor):
    model = Annotated()
    x = torch.randn(3, 8)
    backend = torch_stage.backend(num_streams=4, executor=executor)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))
    plan = backend.plans[0]
    # Dynamo's graph (names are Dynamo's):
    #
    #   x ─▶ a (linear)   [stream 2]  ─▶ inner = a * 2     [stream 3]
    #   x ─▶ b (linear)   [planned]
    #   x ─▶ linear_2 ─▶ c (relu)      [colocated with a: stream 2]
    #   a + b + c + inner              [planned]
    assert plan.assignment["a"] == 2
    assert plan.assignment["inner"] == 3
    assert plan.assignment["linear_2"] == 2
    assert plan.assignment["c"] == 2
    # The colocate marker is gone from the planned graph.
    assert not any("colocate_marker" in name for name in plan.assignment)
    # The same annotations, traced by multi_stream, place the same nodes.
    traced = torch_stage.multi_stream(model, num_streams=4).stream_plan
    assert traced.assignment["a"] == 2 and traced.assignment["mul"] == 3
    assert traced.assignment["c"] == 2 and traced.assignment["relu"] == 2


def test_annotations_outside_the_pool_are_named_at_compile_time():
    class TooFar(nn.Module):
        def forward(self, x):
            with torch_stage.stream(3):
                return x.sin()

    compiled = torch.compile(TooFar(), backend=torch_stage.backend(num_streams=2))
    if _annotations._DYNAMO_CARRIES_ANNOTATIONS:
        with pytest.raises(Exception, match=r"annotated torch_stage.stream\(3\), outside the pool"):
            compiled(torch.ones(2))


def test_a_torch_whose_dynamo_drops_annotations_warns(monkeypatch):
    # What torch < 2.10 does (no fx.traceback.annotate support in Dynamo):
    # the block compiles to nothing, and a warning says the annotation is
    # not honoured; results are unchanged.
    monkeypatch.setattr(_annotations, "_DYNAMO_CARRIES_ANNOTATIONS", False)
    model = Annotated()
    x = torch.randn(3, 8)
    backend = torch_stage.backend(num_streams=4, executor="eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
    messages = {str(w.message).split(" inside ")[0] for w in caught}
    assert messages == {
        "torch_stage.stream(2)",
        "torch_stage.stream(3)",
        "torch_stage.colocate_with(...)",
    }
    assert all("the annotation is not honoured" in str(w.message) for w in caught)
    assert torch.equal(out, model(x))
    plan = backend.plans[0]
    assert "colocate_marker" not in str(plan)


def test_other_backends_ignore_the_annotations():
    model = Annotated()
    x = torch.randn(3, 8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), model(x))


class BatchNormTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
        self.b = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))

    def forward(self, x, y):
        return self.a(x) + self.b(y)


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_batch_norm_in_training_keeps_independent_towers_apart(executor):
    # Dynamo's parameters and buffers are graph inputs, and batch norm in
    # training writes two of them: taking every input to alias a written
    # one (right for multi_stream's own inputs, which Dynamo dedupes) chained
    # the towers through their running statistics.
    backend = torch_stage.backend(num_streams=2, strategy="min_sync", executor=executor)
    model = BatchNormTowers().train()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    expected = copy.deepcopy(model)(x, y)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x, y), expected)
    (plan,) = backend.plans
    assert plan.cross_stream_edges == 1, plan  # the towers meet at the sum alone


# -- graph breaks ----------------------------------------------------------


class BreakInsideAnnotations(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        with torch_stage.stream(1):
            h = self.a(x)
            torch._dynamo.graph_break()
            g = self.b(h)
        with torch_stage.colocate_with(g):
            torch._dynamo.graph_break()
            g = g * 2
        return g


@pytest.mark.parametrize("backend", ["eager", "inductor", "torch_stage"])
def test_a_graph_break_inside_an_annotation_runs_as_eager_does(backend):
    # Dynamo cannot resume inside a torch.fx.traceback.annotate block and
    # runs such a frame eagerly; the stream() and colocate_with() calls in
    # it were then compiled as frames of their own and handed back a
    # function where the block needs a context manager (TypeError).
    model = BreakInsideAnnotations()
    x = torch.randn(2, 8)
    compiled = torch.compile(model, backend=backend)
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(x), model(x))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(4, 4)
        self.right = nn.Linear(4, 4)

    def forward(self, x):
        y = self.left(x) + self.right(x)
        if y.mean() > 0:  # a graph break: Dynamo cannot trace it
            return torch.exp(self.left(y)) + torch.sin(self.right(y))
        return torch.cos(self.left(y)) * self.right(y)


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_data_dependent_control_flow_falls_back_to_graph_breaks(executor, planned_with_vm_costs):
    model = DataDependent()
    backend = torch_stage.backend(num_streams=2, executor=executor)
    compiled = torch.compile(model, backend=backend)
    positive, negative = torch.full((2, 4), 3.0), torch.full((2, 4), -3.0)
    with torch.no_grad():
        # y = 2x: its sign picks the branch.
        for linear in (model.left, model.right):
            linear.weight.copy_(torch.eye(4))
            linear.bias.zero_()
        for x in (positive, negative, positive):
            torch.testing.assert_close(compiled(x), model(x))
    # One graph before the break and one per branch taken, each planned:
    # without costs (eager) the two linears of each go side by side; on
    # inductor's costs, 4x4 linears do not pay for an event.
    assert len(backend.plans) == 3
    used = 2 if executor == "eager" else 1
    assert all(len(p.streams_used) == used for p in backend.plans), backend.plans
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Data-dependent"):
        torch.compile(model, backend=backend, fullgraph=True)(positive)


# -- Dynamo's user streams -------------------------------------------------


def test_dynamo_user_streams_map_onto_the_pool():
    # What Dynamo (torch >= 2.10) hands a backend for `with
    # torch.cuda.stream(s):` blocks: nodes annotated custom["stream"] = the
    # stream's object index, and torch.ops.streams.* sync nodes. Built by
    # hand here (a CPU machine cannot create CUDA streams).
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.sin, (x,))
    a.meta["custom"] = {"stream": 7}
    b = graph.call_function(torch.cos, (x,))
    b.meta["custom"] = {"stream": 9}
    c = graph.call_function(torch.exp, (x,))
    c.meta["custom"] = {"stream": 7, "torch_stage": {"stream": 3}}
    stream_ops = []
    wait = getattr(getattr(torch.ops, "streams", None), "wait_stream", None)
    if wait is not None and hasattr(wait, "default"):
        stream_ops.append(graph.call_function(wait.default, (1, 2)))
    out = graph.call_function(torch.add, (a, b))
    out = graph.call_function(torch.add, (out, c))
    graph.output(out)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    backend = torch_stage.backend(num_streams=4, executor="eager")
    with pytest.warns(UserWarning, match=r"2 user stream\(s\) .* side streams \[1, 2\] of 4"):
        compiled = backend(gm, [torch.ones(3)])
    plan = backend.plans[0]
    assert plan.assignment["sin"] == 1  # first user stream seen
    assert plan.assignment["cos"] == 2  # second
    assert plan.assignment["exp"] == 3  # torch_stage's annotation wins
    x = torch.linspace(-1, 1, 3)
    assert torch.equal(compiled(x), torch.sin(x) + torch.cos(x) + torch.exp(x))
    targets = [n.target for n in compiled.graph.nodes if n.op == "call_function"]
    assert not any(compile_backend._is_dynamo_stream_op(t) for t in targets)
    assert _ops.fork in targets and _ops.join in targets


def test_fold_user_streams_onto_the_side_streams():
    assert [compile_backend._fold(k, 3) for k in range(5)] == [1, 2, 1, 2, 1]
    assert compile_backend._fold(4, 1) == 0


# -- GPU -------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("executor", ["inductor", "aot_eager", "eager"])
def test_backward_after_a_multi_stream_forward_is_correct_on_gpu(executor):
    # The forward of each branch runs on its own stream; the backward on the
    # forward's streams (AOTAutograd's program, or autograd op by op),
    # synchronised across them.
    entry = ENTRIES["inception"]
    eager = build(entry, "cuda").train()
    compiled_model = copy.deepcopy(eager)
    backend = torch_stage.backend(num_streams=4, executor=executor)
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    caller = caller_stream()
    with torch.cuda.stream(caller):
        inputs = entry.inputs(32, "cuda")
        for _ in range(20):
            for model in (eager, compiled):
                model.zero_grad()
                model(*inputs).pow(2).mean().backward()
            for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert len(backend.plans[0].streams_used) == 4


# Dynamo compiles nothing while a TorchDispatchMode is active, and PyTorch's
# CSAN is one: under TORCH_CUDA_SANITIZER=1 the tests above run eager and the
# backend never sees a graph. So this compiles first, then turns CSAN on and
# calls what the backend returned, forward and backward, on the arguments
# Dynamo gave it (the real parameters, buffers and inputs).
_CSAN_COMPILED = """
import sys
import torch
import torch.cuda._sanitizer as csan
sys.path.insert(0, {tests!r})
from torch_csan import ignore_empty_tensors
from zoo import ZOO, build
import torch_stage

entry = {{e.name: e for e in ZOO}}[{name!r}]
model = build(entry, "cuda").train()
backend = torch_stage.backend(num_streams=4, executor="eager")
made = []

def recording(gm, example_inputs):
    compiled = backend(gm, example_inputs)
    made.append((compiled, list(example_inputs)))
    return compiled

torch.compile(model, backend=recording, fullgraph=True)(*entry.inputs(8, "cuda"))
torch.cuda.synchronize()
assert len(made) == 1, len(made)
compiled, arguments = made[0]
ignore_empty_tensors()
csan.enable_cuda_sanitizer()
for _ in range(3):
    outputs = [t for t in compiled(*arguments) if isinstance(t, torch.Tensor)]
    sum(t.float().pow(2).mean() for t in outputs if t.requires_grad).backward()
torch.cuda.synchronize()
print(len(backend.plans[0].streams_used))
"""


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["two_tower", "inception", "rec_8_towers"])
def test_compiled_plans_train_clean_under_torchs_own_cuda_sanitizer(name, run_python):
    tests = os.path.join(ROOT, "tests")
    code = _CSAN_COMPILED.format(tests=tests, name=name)
    # Not inherited: torch enables CSAN at import when the variable is set.
    proc = run_python(code, timeout=300, env={"TORCH_CUDA_SANITIZER": None})
    assert int(proc.stdout.strip().splitlines()[-1]) >= 2
