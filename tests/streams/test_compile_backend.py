"""The torch.compile backend "torch_stage" (torch_stage/compile_backend.py):
registration (entry point and backend objects), options, the model zoo
under fullgraph=True, training, annotations inside compiled code, graph
breaks, and Dynamo's own user streams."""

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


def test_backend_objects_are_backends_and_record_their_plans():
    entry = ENTRIES["inception"]
    module = build(entry).eval()
    inputs = entry.inputs(2, "cpu")
    backend = torch_stage.backend(num_streams=3, strategy="min_sync")
    assert isinstance(backend, torch_stage.Backend)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    assert torch.equal(_run(compiled, inputs), _run(module, inputs))
    assert len(backend.plans) == 1
    plan = backend.plans[0]
    assert plan.strategy == "min_sync"
    assert plan.streams_used == [0, 1, 2]
    assert "num_streams=3" in repr(backend) and "strategy='min_sync'" in repr(backend)


def test_unknown_options_are_an_error_that_lists_the_known_ones():
    message = (
        r"unknown torch_stage backend options 'colour', 'streams': the known options are "
        r"cost_model, cuda_graphs, num_streams, strategy, verify, warmup"
    )
    with pytest.raises(ValueError, match=message):
        torch_stage.backend(streams=2, colour="red")
    compiled = torch.compile(nn.Linear(2, 2), backend="torch_stage", options={"streams": 2})
    with pytest.raises(Exception, match="unknown torch_stage backend option 'streams'"):
        compiled(torch.ones(1, 2))


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"num_streams": 0}, ValueError, "num_streams must be in 1..32, got 0"),
        ({"num_streams": "4"}, TypeError, "num_streams must be an int, got str"),
        ({"strategy": "fastest"}, ValueError, "unknown strategy 'fastest'"),
        ({"warmup": 0}, ValueError, "warmup must be >= 1, got 0"),
        ({"cuda_graphs": "yes"}, TypeError, "cuda_graphs must be a bool, got str"),
        ({"cost_model": 3}, TypeError, "cost_model must be callable"),
    ],
)
def test_bad_option_values_are_named(options, error, message):
    with pytest.raises(error, match=message):
        torch_stage.backend(**options)


def test_an_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="unknown mode; use 'default', 'reduce-overhead'"):
        compile_backend.torch_stage_backend(None, [], mode="max-autotune")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_graphs_without_a_gpu_is_a_clear_error():
    message = r"cuda_graphs=True needs a CUDA device, but .*Leave cuda_graphs=False"
    with pytest.raises(RuntimeError, match=message):
        torch_stage.backend(cuda_graphs=True)
    compiled = torch.compile(nn.Linear(2, 2), backend="torch_stage", mode="reduce-overhead")
    with pytest.raises(Exception, match="cuda_graphs=True needs a CUDA device"):
        compiled(torch.ones(1, 2))


# -- the zoo ---------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_zoo_compiles_with_fullgraph_and_matches_eager(entry, device):
    module = build(entry, device).eval()
    inputs = entry.inputs(4, device)
    backend = torch_stage.backend(num_streams=4, verify=True)
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


def test_rec_model_lookups_go_round_robin_in_the_compiled_graph():
    entry = ENTRIES["rec_8_towers"]
    backend = torch_stage.backend(num_streams=4)
    compiled = torch.compile(build(entry).eval(), backend=backend, fullgraph=True)
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
    backend = torch_stage.backend(num_streams=4)
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
def test_annotations_inside_compiled_code_are_honoured():
    model = Annotated()
    x = torch.randn(3, 8)
    backend = torch_stage.backend(num_streams=4)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), model(x))
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
    backend = torch_stage.backend(num_streams=4)
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


# -- graph breaks ----------------------------------------------------------


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


def test_data_dependent_control_flow_falls_back_to_graph_breaks():
    model = DataDependent()
    backend = torch_stage.backend(num_streams=2)
    compiled = torch.compile(model, backend=backend)
    positive, negative = torch.full((2, 4), 3.0), torch.full((2, 4), -3.0)
    with torch.no_grad():
        # y = 2x: its sign picks the branch.
        for linear in (model.left, model.right):
            linear.weight.copy_(torch.eye(4))
            linear.bias.zero_()
        for x in (positive, negative, positive):
            assert torch.equal(compiled(x), model(x))
    # One graph before the break and one per branch taken, each planned.
    assert len(backend.plans) == 3
    assert all(len(p.streams_used) == 2 for p in backend.plans)
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
    backend = torch_stage.backend(num_streams=4)
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
def test_backward_after_a_multi_stream_forward_is_correct_on_gpu():
    # The forward of each branch runs on its own stream; autograd runs each
    # backward op on its forward's stream and synchronises across them.
    entry = ENTRIES["inception"]
    eager = build(entry, "cuda").train()
    compiled_model = copy.deepcopy(eager)
    backend = torch_stage.backend(num_streams=4)
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
backend = torch_stage.backend(num_streams=4)
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
