"""The rewrite with stream ops (torch_stage/streams/fx/multi_stream_pass.py)."""

import copy
import io
import operator
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import InPlaceModel, TwoTowerRegression, plain_chain

import torch_stage
from torch_stage.streams.fx import MultiStreamPass, _ops, trace
from torch_stage.streams.fx.multi_stream_pass import VERIFY_ENV


def _names(a):
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, tuple):
        return tuple(_names(v) for v in a)
    return a


def stream_calls(gm):
    """The stream ops of the rewritten graph, in order, with their constant
    arguments."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _ops.STREAM_OPS:
            name = getattr(n.target, "__name__", str(n.target)).split(".")[-1]
            args = [_names(a) for a in n.args[1:]]
            if name == "fork":
                args = [n.args[0], n.args[1], n.args[2]]
            out.append((name, *args))
    return out


def test_two_towers_are_rewritten_as_planned():
    gm = MultiStreamPass(num_streams=2, verify=True)(TwoTowerRegression())
    assert stream_calls(gm) == [
        ("fork", 2, (1,), 1),
        # Input y is read on stream 1: its memory is marked used there.
        ("sync", -1, 1, (), ("y",)),
        # y_out's event, recorded on stream 1 as the sync leaves it; the
        # add waits on stream 0 and keeps y_out's memory for stream 0.
        ("sync", 0, 0, (0,), ("y_out",)),
        ("join", ()),
    ]
    order = [n.name for n in gm.graph.nodes]
    # The Y tower runs between the switch to stream 1 and the sync that
    # records its event.
    assert order.index("sync") < order.index("y_hidden") < order.index("y_out")
    assert order.index("x_out") < order.index("sync")
    assert order.index("y_out") < order.index("sync_1") < order.index("add")
    assert order[-2:] == ["join", "output"]


class _InputsOnSideStreams(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x, pair):
        # x is read on every stream, pair[1] through a view on one.
        return self.a(x) + self.b(x) * self.c(pair[1].view(-1, 8)) + pair[0]


def test_inputs_read_on_side_streams_are_marked_used_there():
    # gpu-review #4: a caller handing over its last reference to an input
    # (LibTorch, TorchScript's last use) frees it during forward onto the
    # caller's stream; a side stream still reading it must have it marked,
    # once per stream, before its first read there.
    module = _InputsOnSideStreams()
    gm = MultiStreamPass(num_streams=3, strategy="min_sync")(module)
    kept = []
    current = 0
    side_reads = 0
    for n in gm.graph.nodes:
        if n.target is _ops.sync:
            current = n.args[2]
            kept += [(v.name, current) for v in n.args[4] or ()]
        elif n.op in ("call_module", "call_function") and n.target not in _ops.STREAM_OPS:
            if current != 0 and not _is_input_view(n):
                for p in _inputs_read(n):
                    side_reads += 1
                    assert (p, current) in kept, (n.name, p, kept)
    assert side_reads > 0, "the plan reads no input on a side stream"
    assert len(kept) == len(set(kept)), kept
    x, pair = torch.randn(2, 8), (torch.randn(2, 8), torch.randn(16))
    assert torch.equal(gm(x, pair), module(x, pair))


def _is_input_view(n):
    return n.target in (operator.getitem, "view") and bool(_inputs_read(n))


def _inputs_read(n):
    """Placeholders ``n`` reads directly or through getitem/view nodes."""
    found = set()
    for v in n.all_input_nodes:
        if v.op == "placeholder":
            found.add(v.name)
        elif v.target in (operator.getitem, "view"):
            found |= _inputs_read(v)
    return found


def test_a_graph_that_needs_one_stream_is_left_alone():
    module = plain_chain()
    gm = MultiStreamPass(num_streams=4)(module)
    assert stream_calls(gm) == []
    assert gm.code == torch.fx.symbolic_trace(module).code
    assert len(gm.stream_plan.events) == 0
    assert gm.stream_plan.streams_used == [0]


def test_the_input_graph_module_is_not_modified():
    traced = trace(TwoTowerRegression(), num_streams=2)
    before = traced.code
    gm = MultiStreamPass(num_streams=2)(traced)
    assert traced.code == before
    assert "torch_stage" in gm.code
    # Parameters are shared, not copied.
    assert gm.x_hidden.weight is traced.x_hidden.weight


def test_a_constant_of_the_inputs_that_streams_share_is_made_once_before_the_fork():
    model = InPlaceModel()
    gm = MultiStreamPass(num_streams=4, strategy="min_sync", verify=True)(model)
    plan = gm.stream_plan
    streams = sorted({plan.assignment["mul"], plan.assignment["mul_1"]})
    assert len(streams) == 2
    assert plan.shared_constants == {"ones_like": streams}
    assert plan.constants == {}
    assert "constant ones_like made once before the fork" in str(plan)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    (made,) = [n for n in nodes if n.target is torch.ones_like]
    assert nodes.index(made) < nodes.index(next(n for n in nodes if n.target is _ops.fork))
    # Marked used on the side stream by the sync that first switches to
    # it, not by a sync of its own.
    side = streams[1]
    (first,) = [n for n in nodes if n.target is _ops.sync and n.args[2] == side][:1]
    assert made in first.args[4]
    # No wait is due to a constant.
    assert all(w.after != "ones_like" for w in plan.waits)
    x = torch.randn(4, 32)
    assert torch.equal(gm(x), model(x))


class _InputReshapedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        x.unsqueeze_(1)  # ones_like(x) before this line has another shape
        scale = torch.ones_like(x)
        return self.a(x) * scale + self.b(x) * scale


def test_a_constant_of_an_input_written_in_place_stays_after_the_write():
    model = _InputReshapedInPlace()
    gm = MultiStreamPass(num_streams=4, strategy="min_sync", verify=True)(model)
    plan = gm.stream_plan
    assert len({plan.assignment["a"], plan.assignment["b"]}) == 2
    assert plan.shared_constants == {}
    x = torch.randn(4, 8)
    assert torch.equal(gm(x.clone()), model(x.clone()))


class _ConstantOfAResult(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        scale = torch.ones_like(h)  # made from a result: cannot move before the fork
        return self.b(h) * scale + self.c(h) * scale


def test_constants_that_cannot_move_before_the_fork_are_made_on_each_stream_that_reads_them():
    gm = MultiStreamPass(num_streams=4, strategy="min_sync", verify=True)(_ConstantOfAResult())
    plan = gm.stream_plan
    streams = plan.constants["ones_like"]
    assert len(streams) == 2
    assert plan.shared_constants == {}
    copies = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ones_like]
    assert len(copies) == len(streams)
    assert all(w.after != "ones_like" for w in plan.waits)


def test_parameters_and_inputs_never_cause_waits():
    class SharedWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x, y):
            return (x @ self.w).sum() + (y @ self.w).sum()

    gm = MultiStreamPass(num_streams=2, strategy="min_sync")(SharedWeight())
    plan = gm.stream_plan
    assert plan.streams_used == [0, 1]
    assert {w.after for w in plan.waits} <= set(plan.assignment)
    assert plan.cross_stream_edges == 1


def test_the_fork_probes_inputs_or_else_a_parameter_for_the_device():
    gm = MultiStreamPass(num_streams=2)(TwoTowerRegression())
    fork = next(n for n in gm.graph.nodes if n.target is _ops.fork)
    assert [p.name for p in fork.args[3]] == ["x", "y", "label"]

    class IntInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, n: int):
            x = self.a.weight.new_ones(n, 4)
            return self.a(x) + self.b(x)

    gm = MultiStreamPass(num_streams=2, strategy="min_sync")(IntInputs())
    fork = next(n for n in gm.graph.nodes if n.target is _ops.fork)
    (probe,) = fork.args[3]
    assert probe.op == "get_attr" and probe.target == "a.weight"
    assert torch.equal(gm(3), IntInputs.forward(gm, 3))


def test_verify_is_on_in_debug_mode(monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, "1")
    assert MultiStreamPass().verify
    monkeypatch.setenv(VERIFY_ENV, "0")
    assert not MultiStreamPass().verify
    assert MultiStreamPass(verify=True).verify


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(num_streams=0), ValueError, r"num_streams must be in 1..32, got 0"),
        (dict(num_streams=-3), ValueError, r"got -3"),
        (dict(num_streams=33), ValueError, r"got 33: PyTorch's stream pool hands out 32"),
        (dict(num_streams=2.0), TypeError, "num_streams must be an int, got float"),
        (dict(num_streams=True), TypeError, "got bool"),
        (
            dict(strategy="fastest"),
            ValueError,
            r"unknown strategy 'fastest': use one of 'auto', 'min_sync', 'critical_path', "
            r"'embedding', 'user'",
        ),
        (dict(cost_model=3), TypeError, "cost_model must be callable"),
        (dict(example_inputs=3), TypeError, "example_inputs must be a tuple"),
        (dict(example_kwargs=[3]), TypeError, "example_kwargs must be a dict of forward's"),
        (dict(example_kwargs={1: 3}), TypeError, "keys must be argument names, got 1"),
    ],
)
def test_bad_arguments_are_rejected_before_anything_runs(kwargs, error, message):
    with pytest.raises(error, match=message):
        MultiStreamPass(**kwargs)


def test_a_module_is_required():
    with pytest.raises(TypeError, match="needs a torch.nn.Module, got function"):
        MultiStreamPass()(lambda x: x)


def test_arguments_with_non_tensor_defaults_are_not_probed():
    class WithFlag(nn.Module):
        def forward(self, x, y, scale=None, names=()):
            return x.exp() + y.sin()

    gm = MultiStreamPass(num_streams=2, strategy="min_sync")(WithFlag())
    fork = next(n for n in gm.graph.nodes if n.target is _ops.fork)
    assert [p.name for p in fork.args[3]] == ["x", "y"]
    x = torch.ones(2)
    assert torch.equal(gm(x, x), x.exp() + x.sin())


class _Keywords(nn.Module):
    """Two towers; forward takes optional keyword inputs whose values decide
    what it does (symbolic tracing follows them with example inputs)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, scale=None, bias=None):
        y = self.a(x)
        if scale is not None:
            y = y * scale
        z = self.b(x)
        if bias is not None:
            z = z + bias
        return y.relu() + z.tanh()


def test_example_kwargs_are_traced_by_name_with_defaults_between():
    model = _Keywords()
    x, bias = torch.randn(4, 8), torch.randn(8)
    gm = torch_stage.multi_stream(
        model, num_streams=2, example_inputs=(x,), example_kwargs={"bias": bias}
    )
    # Traced with scale None (its default) and bias given: the plan has the
    # bias branch and not the scale one; the shapes came from the examples.
    targets = [str(n.target) for n in gm.graph.nodes]
    assert any("add" in t for t in targets) and not any("mul" in t for t in targets)
    assert gm.stream_plan.strategy == "critical_path"
    assert gm.stream_plan.streams_used == [0, 1]
    assert torch.equal(gm(x, bias=bias), model(x, bias=bias))
    # Only keywords, no positional examples.
    gm = torch_stage.multi_stream(model, num_streams=2, example_kwargs={"x": x, "bias": bias})
    assert torch.equal(gm(x, bias=bias), model(x, bias=bias))


def test_example_kwargs_that_do_not_fit_forward_say_what_forward_takes():
    with pytest.raises(TypeError, match=r"_Keywords.forward\(x, scale=None, bias=None\): "):
        torch_stage.multi_stream(_Keywords(), example_kwargs={"mask": torch.ones(2)})
    with pytest.raises(TypeError, match="multiple values for argument 'x'"):
        torch_stage.multi_stream(
            _Keywords(), example_inputs=(torch.ones(2, 8),), example_kwargs={"x": torch.ones(2)}
        )


def test_a_keyword_that_only_var_keywords_takes_is_captured_by_export():
    class Extra(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, **extra):
            return self.a(x).relu() + self.b(extra["y"]).tanh()

    model = Extra()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm = torch_stage.multi_stream(
        model, num_streams=2, example_inputs=(x,), example_kwargs={"y": y}
    )
    assert gm.stream_plan.streams_used == [0, 1]
    assert torch.equal(gm(x, y=y), model(x, y=y))


class _ShapeGuarded(nn.Module):
    """Only torch.export captures it (its input comes by **kwargs), and
    export guards the shape it branched on."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, **inputs):
        x = inputs["x"]
        if x.shape[0] > 2:
            return self.a(x).relu() + self.b(x).sigmoid()
        return self.a(x)


def test_an_exported_plan_scripts_with_export_input_guards(tmp_path):
    model = _ShapeGuarded()
    x = torch.randn(4, 8)
    gm = torch_stage.multi_stream(model, num_streams=2, example_kwargs={"x": x})
    assert gm.stream_plan.streams_used == [0, 1]
    scripted = torch.jit.script(gm)
    torch.jit.save(scripted, str(tmp_path / "m.pt"))
    loaded = torch.jit.load(str(tmp_path / "m.pt"))
    for module in (scripted, loaded):
        # Flat inputs in, a tuple out; the same result as eager.
        (out,) = module(x)
        assert torch.equal(out, model(x=x))
        # The guard the Python module checks holds in TorchScript too.
        with pytest.raises(torch.jit.Error, match=r"Guard failed: x.size\(\)\[0\] =="):
            module(torch.randn(2, 8))
    with pytest.raises(AssertionError, match="Guard failed"):
        gm(x=torch.randn(2, 8))
    # Scripting left the Python module as it was.
    assert torch.equal(gm(x=x), model(x=x))


class _FailingBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        return self.a(x) * self.b(y)


# Without the sanitizer: its dispatch mode would raise the error from
# torch/_ops.py rather than the generated code (and it holds the observer).
@pytest.mark.no_sanitizer
def test_a_forward_that_raises_finishes_its_run_and_reports_the_generated_line(
    capsys, planned_with_vm_costs
):
    rewritten = torch_stage.multi_stream(_FailingBranch(), num_streams=2)
    plain = MultiStreamPass(num_streams=2).trace(_FailingBranch())
    assert len(rewritten.stream_plan.streams_used) == 2
    notes = []
    torch_stage._C._set_stream_observer(lambda op, owner, *rest: notes.append(op))
    try:
        depth = torch_stage._C._stream_run_depth()
        with pytest.raises(RuntimeError, match="must match the size") as ours:
            rewritten(torch.randn(2, 4), torch.randn(3, 4))
        assert torch_stage._C._stream_run_depth() == depth
    finally:
        torch_stage._C._set_stream_observer(None)
    assert notes[0] == "fork" and notes[-1] == "join"
    report = capsys.readouterr().err
    with pytest.raises(RuntimeError, match="must match the size") as theirs:
        plain(torch.randn(2, 4), torch.randn(3, 4))
    # What a plain GraphModule says of an error in its generated code.
    assert "Call using an FX-traced Module, line" in report
    assert "mul = a * b" in report
    assert "Call using an FX-traced Module, line" in capsys.readouterr().err
    assert ours.value.__traceback__ is not None and theirs.value.__traceback__ is not None
    # A one-stream plan's GraphModule (no stream ops) reports alike.
    one = torch_stage.multi_stream(_FailingBranch(), num_streams=1)
    assert stream_calls(one) == []
    with pytest.raises(RuntimeError, match="must match the size"):
        one(torch.randn(2, 4), torch.randn(3, 4))
    assert "mul = a * b" in capsys.readouterr().err


def test_a_run_forked_before_a_forward_that_raises_is_left_running():
    # The forward finishes the runs it forked, not its caller's (an outer
    # forward that catches the error goes on with its own run).
    inner = torch_stage.multi_stream(_FailingBranch(), num_streams=2)
    x = torch.randn(2, 4)
    run = _ops.fork(2, [1], 1, (x,))
    _ops.sync(run, -1, 1, [], (x,))
    depth = torch_stage._C._stream_run_depth()
    with pytest.raises(RuntimeError, match="must match the size"):
        inner(x, torch.randn(3, 4))
    assert torch_stage._C._stream_run_depth() == depth
    _ops.record_event(run, 0, 1)
    _ops.sync(run, -1, 0, [0], None)
    _ops.join(run, [1])


class _ModeReadingBranches(nn.Module):
    """Two branches that read ``self.training`` as a value, as torchvision's
    stochastic depth and functional dropout do: tracing freezes it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)  # reads its flag when it runs

    def forward(self, x):
        left = nn.functional.dropout(self.a(x), 0.5, training=self.training)
        right = self.b(x)
        if self.training:
            right = right * 2
        return self.bn(left + right)


class _ModeBlind(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)  # a module: reads its flag when it runs

    def forward(self, x):
        return self.drop(self.a(x)) + self.b(x)


def _reference(model, mode):
    return torch.fx.symbolic_trace(model.train(mode))


@pytest.mark.parametrize("first", [False, True], ids=["planned_in_eval", "planned_in_train"])
def test_a_plan_follows_train_and_eval_where_tracing_froze_the_mode(first):
    torch.manual_seed(0)
    model = _ModeReadingBranches().train(first)
    ms = torch_stage.multi_stream(model, num_streams=2)
    assert len(ms.stream_plan.streams_used) == 2
    planned = ms.stream_plan
    x = torch.randn(8, 16)
    calls = []
    ms.register_forward_hook(lambda *_: calls.append(1))
    for mode in (not first, first, not first):
        ms.train(mode)
        expected_module = _reference(_ModeReadingBranches(), mode)
        expected_module.load_state_dict(ms.state_dict())
        torch.manual_seed(1)
        expected = expected_module(x)
        torch.manual_seed(1)
        got = ms(x)
        assert torch.equal(got, expected), mode
        assert (ms.stream_plan is planned) == (mode == first)
    assert len(calls) == 3  # the module's own hooks, in either mode
    # A copy runs the plan of the mode it was copied in.
    copied = copy.deepcopy(ms)
    assert copied.training == (not first)
    torch.manual_seed(1)
    expected = copied(x)
    torch.manual_seed(1)
    assert torch.equal(ms(x), expected)
    assert copied.stream_plan is not None


def test_train_and_eval_on_the_plan_leave_the_model_in_that_mode_throughout():
    # The plan shares the model's submodules, so train()/eval() on it set
    # theirs; the model's own flag, which its forward reads
    # (F.dropout(..., self.training)), must follow too, or the model is left
    # half in eval and trains without its dropout.
    torch.manual_seed(0)
    model = _ModeReadingBranches().train()
    ms = torch_stage.multi_stream(model, num_streams=2)
    x = torch.randn(8, 16)
    for mode in (False, True, False, True):
        ms.train(mode)
        assert {m.training for m in model.modules()} == {mode}, mode
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        assert torch.equal(ms(x), expected), mode


def test_a_graph_that_does_not_read_the_mode_is_planned_once():
    ms = torch_stage.multi_stream(_ModeBlind().eval(), num_streams=2)
    planned = ms.stream_plan
    ms.train()
    assert ms.stream_plan is planned
    assert "forward" not in ms.__dict__
    torch.manual_seed(1)
    out = ms(torch.ones(4, 16))
    assert (out == ms.b(torch.ones(4, 16))).any()  # dropout zeroed some of a's part


def test_a_pickled_plan_is_the_plan_in_effect_even_with_a_cost_model_that_does_not_pickle():
    torch.manual_seed(0)
    ms = torch_stage.multi_stream(
        _ModeReadingBranches().eval(), num_streams=2, cost_model=lambda node: 1.0
    )
    x = torch.randn(8, 16)
    for mode in (False, True):
        ms.train(mode)
        buffer = io.BytesIO()
        torch.save(ms, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert loaded.training == mode
        torch.manual_seed(1)
        expected = ms(x)
        torch.manual_seed(1)
        assert torch.equal(loaded(x), expected), mode


def test_a_scripted_plan_is_the_plan_in_effect():
    torch.manual_seed(0)
    ms = torch_stage.multi_stream(_ModeReadingBranches().eval(), num_streams=2).train()
    scripted = torch.jit.script(ms)
    x = torch.randn(8, 16)
    torch.manual_seed(1)
    expected = ms(x)
    torch.manual_seed(1)
    assert torch.equal(scripted(x), expected)


class _ClampsATowersWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        with torch_stage.stream(1):
            w = self.a.weight.data
            w.clamp_(-0.1, 0.1)
        return y + self.b(x)


def test_a_write_to_a_submodules_weight_waits_for_the_module_call():
    # self.a(x) reads a.weight, which is no node of the graph; the clamp on
    # stream 1 writes it through get_attr and .data: it waits for the call.
    torch.manual_seed(0)
    eager = _ClampsATowersWeight()
    torch.manual_seed(0)
    gm = MultiStreamPass(num_streams=2, strategy="user", verify=True)(_ClampsATowersWeight())
    plan = gm.stream_plan
    assert (plan.assignment["a"], plan.assignment["clamp_"]) == (0, 1)
    assert [(w.node, w.stream, w.after) for w in plan.waits] == [("clamp_", 1, "a")], str(plan)
    x = torch.randn(4, 8)
    assert torch.equal(gm(x), eager(x))
    assert torch.equal(gm.a.weight, eager.a.weight)


def test_an_argument_traced_as_none_must_stay_none_and_the_plan_scripts():
    model = _Keywords()
    x, bias = torch.randn(4, 8), torch.randn(8)
    gm = torch_stage.multi_stream(
        model, num_streams=2, example_inputs=(x,), example_kwargs={"bias": bias}
    )
    # scale was None in the examples: the graph has no scale branch, so a
    # scale given later is refused rather than ignored.
    with pytest.raises(AssertionError, match="scale has been specialized to have value None"):
        gm(x, scale=torch.ones(8), bias=bias)
    scripted = torch.jit.script(gm)
    assert torch.equal(scripted(x, bias=bias), model(x, bias=bias))
    assert torch.equal(scripted(x, None, bias), model(x, bias=bias))
    with pytest.raises(torch.jit.Error, match="scale has been specialized"):
        scripted(x, torch.ones(8), bias)


class _Optional(nn.Module):
    """An optional mask, positional or keyword-only."""

    def __init__(self, keyword_only=False):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        if keyword_only:
            self.forward = self._keyword_only

    def _keyword_only(self, x, *, mask=None):
        return self._body(x, mask)

    def forward(self, x, mask=None):
        return self._body(x, mask)

    def _body(self, x, mask):
        z = self.b(x)
        if mask is not None:
            z = z.masked_fill(mask, 0.0)
        return self.a(x) + z


@pytest.mark.parametrize("keyword_only", [False, True], ids=["positional", "keyword-only"])
def test_a_plan_with_an_argument_traced_as_none_pickles_and_refuses_a_value(keyword_only):
    import pickle

    model = _Optional(keyword_only).eval()
    x, mask = torch.randn(4, 8), torch.rand(4, 8) > 0.5
    gm = torch_stage.multi_stream(model, num_streams=2, example_inputs=(x,))
    assert torch.equal(gm(x), model(x))
    # Unpickling re-traces the graph's code: the check must trace too.
    again = pickle.loads(pickle.dumps(gm))
    for plan in (gm, again):
        assert torch.equal(plan(x), model(x))
        with pytest.raises(AssertionError, match="mask has been specialized to have value None"):
            plan(x, mask=mask)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes: Python 3.11")
@pytest.mark.parametrize("examples", ["none", "with_mask"])
def test_an_optional_argument_traced_as_given_and_left_none_is_named_in_the_error(examples):
    # Without examples torch.fx traces mask as given, and forward's branch
    # for a mask is in the graph; so it is when the examples give one. A
    # call without it fails inside the generated code, as it does in plain
    # torch.fx, and the error now says why and what to do.
    model = _Optional().eval()
    x, mask = torch.randn(4, 8), torch.rand(4, 8) > 0.5
    kwargs = {}
    if examples == "with_mask":
        kwargs = {"example_inputs": (x,), "example_kwargs": {"mask": mask}}
    gm = torch_stage.multi_stream(model, num_streams=2, **kwargs)
    assert torch.equal(gm(x, mask), model(x, mask))
    with pytest.raises(TypeError) as plain:
        torch.fx.symbolic_trace(model)(x)
    for call in (lambda: gm(x), lambda: gm(x, None), lambda: gm(x, mask=None)):
        with pytest.raises(type(plain.value)) as ours:
            call()
        notes = "\n".join(getattr(ours.value, "__notes__", []))
        assert "mask is None in this call" in notes, notes
        assert "example_kwargs" in notes
    # An error with mask given says nothing of it.
    with pytest.raises(RuntimeError) as other:
        gm(torch.randn(4, 3), mask)
    assert not getattr(other.value, "__notes__", [])


def test_an_argument_traced_as_none_and_given_says_how_to_plan_for_it():
    model = _Optional().eval()
    x, mask = torch.randn(4, 8), torch.rand(4, 8) > 0.5
    gm = torch_stage.multi_stream(model, num_streams=2, example_inputs=(x,))
    with pytest.raises(AssertionError, match=r"mask has been specialized.*example_kwargs"):
        gm(x, mask)
    with pytest.raises(torch.jit.Error, match=r"mask has been specialized.*example_kwargs"):
        torch.jit.script(gm)(x, mask)


class _DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, d):
        return self.a(d["u"]) + self.b(d["v"])


def test_planning_prints_nothing_of_the_ops_run_on_stand_ins():
    # The write probe ran d["u"] on a tensor stand-in, and torch's warning
    # about indexing with a sequence reached the user.
    with warnings.catch_warnings(record=True) as printed:
        warnings.simplefilter("always")
        gm = torch_stage.multi_stream(_DictInput(), num_streams=2)
    assert [str(w.message) for w in printed] == []
    d = {"u": torch.randn(2, 8), "v": torch.randn(2, 8)}
    assert torch.equal(gm(d), gm.a(d["u"]) + gm.b(d["v"]))


def test_a_scripted_or_compiled_module_is_refused_with_what_to_do():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(TypeError, match=r"RecursiveScriptModule.*script the result"):
        torch_stage.multi_stream(torch.jit.script(model))
    with pytest.raises(TypeError, match=r"OptimizedModule.*_orig_mod.*backend=\"torch_stage\""):
        torch_stage.multi_stream(torch.compile(model))


class _Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, flag: bool = False, repeats: int = 1):
        h = self.a(x)
        if flag:
            h = h + 100
        if repeats > 1:  # a decision on a value made of the argument
            h = h * repeats
        return h + self.b(x)


def test_a_scalar_argument_that_tracing_branched_on_must_keep_its_example_value():
    # With examples, `if flag:` and `if repeats > 1:` are decided while
    # tracing; a call with another flag ran the example's branch silently.
    import pickle

    model = _Flagged()
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="decided from example_inputs"):
        gm = torch_stage.multi_stream(model, num_streams=2, example_inputs=(x,))
    for plan in (gm, copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        assert torch.equal(plan(x), model(x))
        assert torch.equal(plan(x, False, 1), model(x))
        with pytest.raises(AssertionError, match="flag has been specialized to False but got True"):
            plan(x, flag=True)
        with pytest.raises(AssertionError, match="repeats has been specialized to 1 but got 3"):
            plan(x, repeats=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = torch_stage.multi_stream(model, num_streams=2, example_inputs=(x, True, 3))
    assert torch.equal(other(x, True, 3), model(x, True, 3))
    with pytest.raises(AssertionError, match=r"flag has been specialized to True but got False"):
        other(x, repeats=3)


class _VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, *rest, **options):
        out = self.a(x)
        for r in rest:
            out = out + self.b(r)
        if "mask" in options:
            out = out.masked_fill(options["mask"], 0.0)
        return out


def test_star_args_and_keywords_unrolled_from_the_examples_refuse_other_calls():
    model = _VarArgs()
    x, y, mask = torch.randn(4, 8), torch.randn(4, 8), torch.rand(4, 8) > 0.5
    with pytest.warns(UserWarning, match="decided from example_inputs"):
        gm = torch_stage.multi_stream(model, num_streams=2, example_inputs=(x, y))
    assert torch.equal(gm(x, y), model(x, y))
    import pickle

    for plan in (gm, copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        assert torch.equal(plan(x, y), model(x, y))
        with pytest.raises(
            TypeError, match=r"1 argument\(s\) through \*rest, and this call gives 2"
        ):
            plan(x, y, y)
        with pytest.raises(TypeError, match=r"keyword\(s\) \[\] through \*\*options.*\['mask'\]"):
            plan(x, y, mask=mask)


def test_examples_for_star_args_before_a_keyword_only_argument_are_not_fed_to_it():
    # torch.fx puts the placeholder of *rest after the keyword-only mask, so
    # feeding the examples by position would give y to mask.
    class RestThenMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, *rest, mask=None):
            out = self.a(x)
            for r in rest:
                out = out + self.b(r)
            return out if mask is None else out.masked_fill(mask, 0.0)

    model = RestThenMask()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm = torch_stage.multi_stream(model, num_streams=2, example_inputs=(x, y))
    assert torch.equal(gm(x, y), model(x, y))
    with pytest.raises(AssertionError, match="mask has been specialized to have value None"):
        gm(x, y, mask=torch.rand(4, 8) > 0.5)
    with pytest.raises(TypeError, match=r"through \*rest, and this call gives 2"):
        gm(x, y, y)


def test_examples_forward_fails_on_say_where_and_why():
    x, bad = torch.randn(4, 8), torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(
        RuntimeError,
        match=r"forward fails on the example inputs at %masked_fill.*The size of tensor a \(3\)",
    ):
        torch_stage.multi_stream(_Optional(), example_inputs=(x,), example_kwargs={"mask": bad})


def test_fx_trace_takes_keyword_examples_and_multi_stream_plans_its_graph():
    model = _Keywords()
    x, bias = torch.randn(4, 8), torch.randn(8)
    gm = trace(model, num_streams=2, example_inputs=(x,), example_kwargs={"bias": bias})
    assert torch.equal(gm(x, bias=bias), model(x, bias=bias))
    planned = torch_stage.multi_stream(
        gm, num_streams=2, example_inputs=(x,), example_kwargs={"bias": bias}
    )
    assert planned.stream_plan.strategy == "critical_path"
    assert torch.equal(planned(x, bias=bias), model(x, bias=bias))
    with pytest.raises(TypeError, match=r"example_kwargs \['y'\]: symbolic tracing takes"):
        trace(_VarArgs(), example_inputs=(x,), example_kwargs={"y": x})


def test_an_optional_argument_the_examples_gave_may_be_left_out_where_the_ops_take_none():
    # Only an exported plan refuses it (test_hf_models.py): in a torch.fx
    # graph the ops may take None, as F.linear's bias does.
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, bias=None):
            return self.a(x) + F.linear(x, self.b.weight, bias)

    model = Biased()
    x, bias = torch.randn(4, 8), torch.randn(8)
    gm = torch_stage.multi_stream(
        model, num_streams=2, example_inputs=(x,), example_kwargs={"bias": bias}
    )
    assert torch.equal(gm(x, bias=bias), model(x, bias=bias))
    assert torch.equal(gm(x), model(x))
