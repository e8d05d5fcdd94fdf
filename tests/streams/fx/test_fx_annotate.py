"""Tracing with stream annotations (torch_stage/streams/fx/annotate.py)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import torch_stage
from torch_stage.streams.fx import trace
from torch_stage.streams.fx.annotate import META_KEY


def _notes(gm):
    return {n.name: n.meta.get(META_KEY) for n in gm.graph.nodes if n.op.startswith("call_")}


class Nested(nn.Module):
    def forward(self, x):
        a = x + 1
        with torch_stage.stream(1):
            b = x * 2
            with torch_stage.stream(3):
                c = b - 1
            d = c * b
            with torch_stage.colocate_with(a):
                e = d + a
        f = e.sum()
        return f


def test_nodes_get_the_innermost_annotation():
    gm = trace(Nested(), num_streams=4)
    notes = _notes(gm)
    assert notes["add"] is None
    assert notes["mul"] == {"stream": 1}
    assert notes["sub"] == {"stream": 3}
    assert notes["mul_1"] == {"stream": 1}
    assert notes["add_1"]["colocate"] == "add"
    assert notes["sum_1"] is None


def test_annotations_change_nothing_in_eager_code():
    x = torch.randn(3, 4)
    module = Nested()
    expected = (((x * 2) - 1) * (x * 2) + (x + 1)).sum()
    assert torch.equal(module(x), expected)
    # Contexts leave no state behind, even when the block raises.
    with pytest.raises(KeyError):
        with torch_stage.stream(2):
            raise KeyError("inside")
    gm = trace(Nested(), num_streams=4)
    assert torch.equal(gm(x), expected)


def test_annotations_open_around_the_trace_do_not_leak_into_it():
    with torch_stage.stream(2):
        gm = trace(Nested(), num_streams=4)
    assert _notes(gm)["add"] is None


def test_stream_ids_are_checked_against_the_pool_being_traced():
    with pytest.raises(
        ValueError, match=r"stream id 3 is outside the pool of 2 streams \(valid ids: 0..1\)"
    ):
        trace(Nested(), num_streams=2)
    with pytest.raises(ValueError, match=r"stream id 32 is outside the pool of 32 streams"):
        torch_stage.stream(32)
    with pytest.raises(ValueError, match="stream id -1"):
        torch_stage.stream(-1)
    with pytest.raises(TypeError, match="index must be an int, got str"):
        torch_stage.stream("1")
    with pytest.raises(TypeError, match="index must be an int, got bool"):
        torch_stage.stream(True)
    with pytest.raises(TypeError, match="must be a tensor"):
        torch_stage.colocate_with(3)


def test_plain_fx_tracing_warns_that_annotations_are_lost():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.fx.symbolic_trace(Nested())
    lost = [
        str(w.message).split(" inside")[0] for w in caught if "inside torch.fx" in str(w.message)
    ]
    assert lost == [
        "torch_stage.stream(1)",
        "torch_stage.stream(3)",
        "torch_stage.colocate_with(...)",
    ]


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            y = x * 2
        else:
            y = x - 2
        rows = [r + 1 for r in y]
        return torch.stack(rows) * len(x)


def test_control_flow_needs_example_inputs_and_follows_them():
    with pytest.raises(torch.fx.proxy.TraceError, match="without example inputs"):
        trace(Branchy())
    positive = torch.ones(3, 2)
    with pytest.warns(UserWarning, match="decided from example_inputs"):
        gm = trace(Branchy(), example_inputs=(positive,))
    assert torch.equal(gm(positive), Branchy()(positive))
    # The graph holds the branch the example took.
    other = torch.full((3, 2), 5.0)
    assert torch.equal(gm(other), Branchy()(other))
    code = gm.code
    assert "mul" in code and "sub" not in code


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        y = nn.functional.dropout(self.bn(x), 0.5, training=True)
        if y.sum() > -1e9:
            return y * 2
        return y


def test_following_control_flow_leaves_no_trace():
    module = Counting().train()
    x = torch.randn(8, 4)
    stats = module.bn.running_mean.clone()
    tracked = module.bn.num_batches_tracked.clone()
    state = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace(module, example_inputs=(x,))
    assert torch.equal(module.bn.running_mean, stats)
    assert torch.equal(module.bn.num_batches_tracked, tracked)
    assert torch.equal(torch.get_rng_state(), state)


class _WritesItsWeights(nn.Module):
    """A forward that constrains its weights in place (max-norm, clamping),
    through .data, which no autograd version counter sees, and with
    branches on values, which planning from examples follows by running it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight  # tied: one memory, written once

    def forward(self, x):
        p, q = self.a(x), self.b(x)
        self.a.weight.data.mul_(0.5)
        torch.clamp(self.a.bias.data, -0.1, 0.1, out=self.a.bias.data)
        if p.sum() > -1e9:
            return p + q
        return p - q


@pytest.mark.parametrize("shapes", [False, True], ids=["tracing", "tracing_and_shapes"])
def test_planning_from_examples_leaves_the_parameters_a_forward_writes(shapes):
    torch.manual_seed(0)
    module = _WritesItsWeights()
    eager = copy.deepcopy(module)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if shapes:
            planned = torch_stage.multi_stream(module, num_streams=2, example_inputs=(x,))
        else:
            planned = trace(module, example_inputs=(x,))
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert module.b.weight is module.a.weight
    for _ in range(2):
        assert torch.equal(planned(x), eager(x))
    assert torch.equal(module.a.weight, eager.a.weight)


class _BufferOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        self.bn.running_mean.add_(1.0)
        return self.bn(x) + self.bn.running_mean * 2.0


def test_buffers_are_read_when_forward_runs_not_while_tracing():
    # torch.fx's default runs an op on a buffer alone while tracing: the
    # in-place add would change the module once, there, and be missing from
    # the graph, and the product would be a constant of the value then.
    module = _BufferOps().eval()
    gm = trace(module)
    assert torch.equal(module.bn.running_mean, torch.zeros(4))
    assert [n.target for n in gm.graph.nodes if n.op == "get_attr"] == ["bn.running_mean"]
    assert "add_" in [n.target for n in gm.graph.nodes]
    x = torch.randn(3, 4)
    eager = _BufferOps().eval()
    for _ in range(2):
        assert torch.equal(gm(x), eager(x))
    assert torch.equal(module.bn.running_mean, eager.bn.running_mean)


class _BufferAsPythonValue(nn.Module):
    """A forward that takes a buffer's value as a Python int, which a proxy
    of the buffer cannot give."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("steps", torch.tensor(3))

    def forward(self, x):
        y = self.a(x)
        for _ in range(int(self.steps)):
            y = y.relu() + self.b(x)
        return y


def test_a_buffer_used_as_a_python_value_traces_as_torch_fx_does():
    # Buffers as graph attributes must not cost the models that traced
    # before: this one did, with torch.fx's default (the buffer's value read
    # once, while tracing), and it still does, with the same results.
    module = _BufferAsPythonValue().eval()
    x = torch.randn(4, 8)
    result = torch_stage.multi_stream(module)
    assert torch.equal(result(x), module(x))
    assert isinstance(result, torch.fx.GraphModule)
    assert "steps" not in [n.target for n in result.graph.nodes if n.op == "get_attr"]


class _BufferState(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        if self.how == "iadd":
            self.count += 1
        elif self.how == "reassign":
            self.count = self.count + 1
        elif self.how == "ema":
            self.ema = 0.9 * self.ema + 0.1 * self.a(x).detach().mean(0)
        return self.a(x) + self.b(x) * self.count + self.ema


@pytest.mark.parametrize("how", ["iadd", "reassign", "ema"])
def test_a_forward_that_assigns_a_buffer_never_changes_the_input_module(how):
    # With buffers traced as proxies, `self.count = self.count + 1` stored
    # the tracer's proxy in the user's own module, which then returned
    # proxies, as did the result.
    module = _BufferState(how)
    eager, reference = copy.deepcopy(module), copy.deepcopy(module)
    x = torch.randn(2, 4)
    try:
        result = torch_stage.multi_stream(module)
    except torch_stage.MultiStreamTraceError as exc:
        # Refused with what to do instead, never half traced.
        assert "assigns buffer" in str(exc) and "in place" in str(exc), str(exc)
        result = None
    assert all(type(b) is torch.Tensor for b in module.buffers())
    assert torch.equal(module.count, torch.zeros(())) and torch.equal(module.ema, torch.zeros(4))
    if result is not None:
        for _ in range(3):
            assert torch.equal(result(x), eager(x))
        assert torch.equal(result.count, eager.count) and torch.equal(result.ema, eager.ema)
    for _ in range(3):
        assert torch.equal(module(x), reference(x))


@pytest.mark.parametrize("how", ["iadd", "reassign", "ema"])
def test_a_buffer_assignment_is_captured_by_torch_export_with_example_inputs(how):
    # torch.fx cannot hold `self.count += 1` (a proxy has no in-place add;
    # Python assigns the sum), torch.export can: the fallback, given inputs.
    module = _BufferState(how)
    eager = copy.deepcopy(module)
    x = torch.randn(2, 4)
    result = torch_stage.multi_stream(module, example_inputs=(x,))
    assert torch.equal(module.count, torch.zeros(()))  # planning changed nothing
    for _ in range(3):
        assert torch.equal(result(x), eager(x))
    got = dict(result.named_buffers())
    assert torch.equal(got["count"], eager.count) and torch.equal(got["ema"], eager.ema)


class _StepsRead(nn.Module):
    """Reads a buffer as a Python number and then advances it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("steps", torch.ones(()))

    def forward(self, x):
        y = self.a(x) + self.b(x) * int(self.steps)
        self.steps.add_(1)
        return y


def test_a_buffer_write_that_tracing_would_run_instead_of_record_is_refused():
    # Traced as torch.fx does by default (int() of the buffer needs its
    # value), the add_ ran once on the user's buffer while tracing and was
    # missing from the graph: every later call used steps == 1.
    module = _StepsRead()
    with pytest.raises(torch_stage.MultiStreamTraceError, match="buffer 'steps'"):
        torch_stage.multi_stream(module)
    assert torch.equal(module.steps, torch.ones(()))
    # torch.export cannot take int() of a tensor either: compile is named.
    with pytest.raises(torch_stage.MultiStreamTraceError, match="torch.compile"):
        torch_stage.multi_stream(module, example_inputs=(torch.randn(2, 4),))
    assert torch.equal(module.steps, torch.ones(()))


def test_a_model_made_in_inference_mode_traces_with_its_buffers():
    # Inference tensors have no version counter to watch.
    with torch.inference_mode():
        module = _BufferAsPythonValue().eval()
    x = torch.randn(4, 8)
    result = torch_stage.multi_stream(module)
    with torch.inference_mode():
        assert torch.equal(result(x), module(x))
