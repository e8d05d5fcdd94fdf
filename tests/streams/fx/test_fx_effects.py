"""torch_stage.streams.fx.effects: which arguments a node writes, from ATen schemas,
for every spelling of an in-place write; and plans over graphs with such
writes checked by the stream sanitizer, not by the planner's own analysis."""

import copy
import operator
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from stream_oracle import waits, without_wait

import torch_stage
from torch_stage.streams.fx import _ops
from torch_stage.streams.fx.effects import aliased_args, written_args


def _graph(*placeholders):
    g = torch.fx.Graph()
    return g, [g.placeholder(p) for p in placeholders]


@pytest.mark.parametrize(
    "build, written",
    [
        (lambda g, a, b: g.call_method("add_", (a, b)), [0]),
        (lambda g, a, b: g.call_method("__iadd__", (a, b)), [0]),
        (lambda g, a, b: g.call_function(operator.iadd, (a, b)), [0]),
        (lambda g, a, b: g.call_function(operator.imul, (a, 2.0)), [0]),
        (lambda g, a, b: g.call_function(operator.itruediv, (a, 2.0)), [0]),
        (lambda g, a, b: g.call_function(operator.setitem, (a, 0, 1.0)), [0]),
        # Indices of two or more dimensions, which a one-element stand-in
        # cannot take: the probe fails, and setitem still writes a.
        (lambda g, a, b: g.call_function(operator.setitem, (a, (slice(None), 0), 1.0)), [0]),
        (lambda g, a, b: g.call_function(operator.setitem, (a, (0, 0), b)), [0]),
        (lambda g, a, b: g.call_method("__setitem__", (a, (slice(2, None), 1), b)), [0]),
        (lambda g, a, b: g.call_function(torch._foreach_mul_, ([a, b], 2.0)), [0, 1]),
        (lambda g, a, b: g.call_function(torch._foreach_add_, ([a], [b])), [0]),
        (lambda g, a, b: g.call_function(torch.ops.aten.add_, (a, b)), [0]),
        (lambda g, a, b: g.call_function(torch.ops.aten.add_.Tensor, (a, b)), [0]),
        (lambda g, a, b: g.call_function(torch.add, (a, b), {"out": b}), [1]),
        (lambda g, a, b: g.call_function(F.relu, (a,), {"inplace": True}), [0]),
        (lambda g, a, b: g.call_function(torch.relu_, (a,)), [0]),
        (lambda g, a, b: g.call_method("copy_", (b, a)), [1]),
        (lambda g, a, b: g.call_function(torch.add, (a, b)), []),
        (lambda g, a, b: g.call_method("view", (a, -1)), []),
        (lambda g, a, b: g.call_function(torch._foreach_mul, ([a, b], 2.0)), []),
    ],
    ids=lambda v: "" if callable(v) else str(v),
)
def test_written_arguments_come_from_the_ops_schemas(build, written):
    g, (a, b) = _graph("a", "b")
    node = build(g, a, b)
    names = {a: 0, b: 1}
    assert sorted(names[x] for x in written_args(node)) == written


def test_fused_adam_writes_what_its_schema_marks():
    # Tensor(a!)[] self, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs,
    # Tensor(d!)[] exp_avg_sqs, ..., Tensor[] state_steps.
    g, (p, grad, m, v, step) = _graph("p", "grad", "m", "v", "step")
    node = g.call_function(
        torch._fused_adam_,
        ([p], [grad], [m], [v], [], [step]),
        dict(lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
             maximize=False),
    )  # fmt: skip
    assert {x.name for x in written_args(node)} == {"p", "grad", "m", "v"}


@pytest.mark.parametrize(
    "build, aliased, written",
    [
        (lambda g, w: g.call_function(getattr, (w, "data")), True, False),
        (lambda g, w: g.call_method("detach", (w,)), True, False),
        (lambda g, w: g.call_method("clamp_", (w, -1.0, 1.0)), True, True),
        # Two-dimensional indices: the weight's own shape answers them.
        (lambda g, w: g.call_function(operator.setitem, (w, (slice(None), 0), 0.0)), False, True),
        (lambda g, w: g.call_method("sum", (w,)), False, False),
    ],
    ids=["data", "detach", "clamp_", "setitem-2d", "sum"],
)
def test_parameters_are_probed_as_meta_tensors_of_their_shape(build, aliased, written):
    # A get_attr node's value is the graph owner's attribute: given the
    # owner, the probe runs on a meta tensor like it (nothing of the real
    # weight is touched), so .data of a parameter aliases it.
    root = torch.nn.Linear(4, 3)
    before = root.weight.detach().clone()
    g = torch.fx.Graph()
    w = g.get_attr("weight")
    node = build(g, w)
    assert aliased_args(node, root) == ([w] if aliased else [])
    assert written_args(node, root) == ([w] if written else [])
    assert torch.equal(root.weight, before)


# Graphs with independent branches and in-place writes in every spelling:
# each rewritten plan must order every conflicting pair, as the sanitizer
# sees it running.
def _iadd(x):
    h = x * 1.0
    y = h.pow(2).cumsum(0)
    h += 1
    return y, h


def _foreach(x):
    a, b = x * 1.0, x * 2.0
    y = a.sum() + b.sum()
    torch._foreach_mul_([a, b], 3.0)
    return y, a + b


def _setitem(x):
    h = x * 1.0
    y = h.exp()
    h[0] = 5.0
    return y, h.sin()


def _out(x):
    h = x * 1.0
    y = h.cos()
    torch.mul(x, 3.0, out=h)
    return y, h + 1


def _relu_inplace_branches(x):
    outs = [F.relu(x * float(i + 1), inplace=True) for i in range(4)]
    return sum(o.sum() for o in outs)


def _copy(x):
    h = x * 1.0
    y = h.tanh()
    h.copy_(x * 5)
    return y, h


def _mask_2d(x):
    # A mask built by writing into a fresh constant, read by two branches
    # (a constant the planner would otherwise copy onto each stream).
    h = x.view(8, 8) * 1.0
    w = torch.ones_like(h)
    w[:, 4:] = 0.0
    w[0, 0] = 5.0
    w[2:, 1::2] = 7.0
    w[:, 1:3] += 1.0
    return (h * w).sum(0), h.exp() * w


def _setitem_2d_input_branch(x):
    h = x.view(8, 8) * 1.0
    y = h.sum(0)
    h[:, :4] = x.view(8, 8)[:, 4:] * 2.0
    return y, h.cos()


GRAPHS = [_iadd, _foreach, _setitem, _out, _relu_inplace_branches, _copy, _mask_2d,
          _setitem_2d_input_branch]  # fmt: skip


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("fn", GRAPHS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("strategy", ["min_sync", "critical_path"])
@pytest.mark.own_sanitizer
def test_multi_stream_orders_every_in_place_write(fn, strategy):
    x = torch.randn(64)
    model = torch_stage.multi_stream(_Wrap(fn), num_streams=4, strategy=strategy)
    with torch_stage.sanitize_streams() as sanitizer:
        out = model(x)
    assert sanitizer.races == []
    torch.testing.assert_close(out, fn(x))


@pytest.mark.parametrize("fn", GRAPHS, ids=lambda f: f.__name__)
@pytest.mark.own_sanitizer
def test_the_compile_backend_orders_every_in_place_write(fn):
    torch._dynamo.reset()
    x = torch.randn(64)
    backend = torch_stage.backend(num_streams=4, strategy="min_sync", executor="eager")
    compiled = torch.compile(fn, backend=backend)
    with torch_stage.sanitize_streams() as sanitizer:
        out = compiled(x)
    assert sanitizer.races == []
    torch.testing.assert_close(out, fn(x))


def test_four_in_place_relu_branches_run_on_four_streams():
    model = torch_stage.multi_stream(
        _Wrap(_relu_inplace_branches), num_streams=4, strategy="min_sync"
    )
    relus = [n for n, s in model.stream_plan.assignment.items() if n.startswith("relu")]
    assert len({model.stream_plan.assignment[n] for n in relus}) == 4


class _ReshapeCopies(torch.nn.Module):
    def forward(self, x):
        t = (x * 2).t().reshape(-1)  # not viewable: reshape copies, on stream 0
        with torch_stage.stream(1):
            y = t.sum()
        return y + x.sum()


@pytest.mark.own_sanitizer
def test_a_reshape_that_copies_is_device_work_not_an_alias():
    # The sanitizer found this on torchvision's MaxViT: a reshape taken for
    # a mere alias copied on stream 0 after the event its reader waited on.
    model = torch_stage.multi_stream(_ReshapeCopies(), num_streams=2, strategy="user")
    assert "reshape" in model.stream_plan.assignment
    x = torch.randn(4, 8)
    with torch_stage.sanitize_streams() as sanitizer:
        out = model(x)
    assert sanitizer.races == []
    torch.testing.assert_close(out, _ReshapeCopies()(x))


# Batch norm's running statistics: written in training, though
# native_batch_norm's schema takes them as plain inputs (the one documented
# exception, torch_stage.streams.fx.effects.understated_writes).
@pytest.mark.parametrize(
    "call, written",
    [
        (lambda g, x, m, v: g.call_function(F.batch_norm, (x, m, v), {"training": True}), True),
        (lambda g, x, m, v: g.call_function(F.batch_norm, (x, m, v), {"training": False}), False),
        (
            lambda g, x, m, v: g.call_function(
                torch.ops.aten.native_batch_norm.default, (x, None, None, m, v, True, 0.1, 1e-5)
            ),
            True,
        ),
        (
            lambda g, x, m, v: g.call_function(
                torch.batch_norm, (x, None, None, m, v, False, 0.1, 1e-5, False)
            ),
            False,
        ),
    ],
    ids=[
        "F.batch_norm-train",
        "F.batch_norm-eval",
        "native_batch_norm-train",
        "torch.batch_norm-eval",
    ],
)
def test_batch_norm_running_stats_are_written_in_training(call, written):
    g = torch.fx.Graph()
    x, m, v = g.placeholder("x"), g.placeholder("m"), g.placeholder("v")
    assert {a.name for a in written_args(call(g, x, m, v))} == ({"m", "v"} if written else set())


class _SharedStats(torch.nn.Module):
    """Two towers normalised with one set of running statistics (a shared
    functional batch norm): both update the same buffers in training."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        ya = F.batch_norm(self.a(x), self.mean, self.var, training=True)
        yb = F.batch_norm(self.b(x), self.mean, self.var, training=True)
        return ya + yb


@pytest.mark.own_sanitizer
def test_shared_running_stats_are_ordered_across_streams():
    x = torch.randn(4, 8)
    eager = _SharedStats()
    model = torch_stage.multi_stream(copy.deepcopy(eager), num_streams=4, strategy="min_sync")
    with torch_stage.sanitize_streams() as sanitizer:
        out = model(x)
    assert sanitizer.races == []
    torch.testing.assert_close(out, eager(x))
    torch.testing.assert_close(model.mean, eager.mean)


def _spectral_norm_hook():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hook version is deprecated
        return torch.nn.utils.spectral_norm(torch.nn.Linear(8, 8))


# torch.nn modules that write their own buffers in training, through ops
# that the probe can only run with the arguments' shapes (unknown without
# example inputs): spectral norm's power iteration (torch.mv(..., out=u)),
# instance norm's running statistics.
STATEFUL = {
    "spectral_norm": lambda: torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(8, 8)),
    "spectral_norm_hook": _spectral_norm_hook,
    "instance_norm_tracked": lambda: torch.nn.Sequential(
        torch.nn.Unflatten(1, (4, 2)), torch.nn.InstanceNorm1d(4, track_running_stats=True)
    ),
}


class _SharedStateful(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.shared = make()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.shared(self.a(x)).sum() * self.shared(self.b(x)).sum()


@pytest.mark.own_sanitizer
@pytest.mark.parametrize("examples", [False, True], ids=["no_examples", "examples"])
@pytest.mark.parametrize("make", STATEFUL.values(), ids=list(STATEFUL))
def test_a_module_writing_its_buffers_is_ordered_with_or_without_examples(make, examples):
    torch.manual_seed(0)
    eager = _SharedStateful(make)
    model = copy.deepcopy(eager)
    x = torch.randn(4, 8)
    planned = torch_stage.multi_stream(
        model, num_streams=4, strategy="min_sync", example_inputs=(x,) if examples else None
    )
    with torch_stage.sanitize_streams() as sanitizer:
        out = planned(x)
    assert sanitizer.races == []
    torch.testing.assert_close(out, eager(x))
    torch.testing.assert_close(dict(model.named_buffers()), dict(eager.named_buffers()))


class _SharedUnderAutocast(torch.nn.Module):
    """One module called by two branches (a shared head, tied weights)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.shared = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.shared(self.a(x)) + self.shared(self.b(x))


def _autocast_plans():
    torch.manual_seed(0)
    planned = torch_stage.multi_stream(_SharedUnderAutocast(), num_streams=2, strategy="min_sync")
    assert planned.stream_plan.assignment["shared"] != planned.stream_plan.assignment["shared_1"]
    # (Not scripted: TorchScript runs the graph without eager autocast on
    # the CPU, in float32.)
    torch.manual_seed(0)
    compiled = torch.compile(_SharedUnderAutocast(), backend=torch_stage.backend(executor="eager"))
    return {"fx": planned, "compile_backend": compiled}


@pytest.mark.own_sanitizer
@pytest.mark.parametrize("kind", ["fx", "compile_backend"])
def test_autocasts_weight_cache_is_not_shared_across_streams(kind):
    # Autocast keeps one low-precision copy of each weight per thread, for
    # the whole region, whatever the stream: the second call of the shared
    # layer, on another stream, read the copy the first call made, with no
    # event between them.
    model = _autocast_plans()[kind]
    torch.manual_seed(0)
    eager = _SharedUnderAutocast()  # the same weights
    x = torch.randn(4, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = eager(x)
        with torch_stage.sanitize_streams() as sanitizer:
            out = model(x)
        assert torch.is_autocast_cache_enabled()  # the caller's setting, back
    assert sanitizer.races == []
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


@pytest.mark.no_sanitizer
def test_a_failed_run_gives_autocast_its_cache_back():
    model = _autocast_plans()["fx"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError):
            model(torch.randn(4, 3))
        assert torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        model(torch.randn(4, 8))
        assert not torch.is_autocast_cache_enabled()  # left as the caller had it
        torch.set_autocast_cache_enabled(True)


@pytest.mark.no_sanitizer
def test_a_run_outside_autocast_leaves_the_autocast_cache_alone():
    # With the cache off every op of a forward costs more host time (0.1-0.3
    # us on CPU), and outside autocast there is no cached copy to share.
    x = torch.ones(2)
    run = _ops.fork(2, [1], 0, (x,))
    try:
        assert torch.is_autocast_cache_enabled()
    finally:
        _ops.join(run, [1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run = _ops.fork(2, [1], 0, (x,))
        try:
            assert not torch.is_autocast_cache_enabled()
        finally:
            _ops.join(run, [1])
        assert torch.is_autocast_cache_enabled()


class _BasicConv(torch.nn.Module):
    """torchvision's BasicConv2d: conv, batch norm, in-place ReLU."""

    def __init__(self, cin, cout, k):
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = torch.nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)), inplace=True)


class _InceptionBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(_BasicConv(8, 4, 1), _BasicConv(4, 4, 3)) for _ in range(4)
        )

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], 1)


@pytest.mark.own_sanitizer
def test_in_place_relus_of_independent_branches_are_not_ordered_with_each_other():
    # Each branch's ReLUs write only that branch's tensors: ordering them
    # with the other branches' (a global chain of writes) pulled every
    # branch after the first onto one stream in torchvision's GoogLeNet.
    block = _InceptionBlock().eval()
    x = torch.randn(1, 8, 6, 6)
    model = torch_stage.multi_stream(block, num_streams=4, strategy="min_sync")
    plan = model.stream_plan
    assert len(plan.streams_used) == 4, str(plan)
    # Only the concatenation waits, once for each side branch.
    assert len(plan.waits) == 3 and {w.node for w in plan.waits} == {"cat"}, str(plan)
    with torch.no_grad(), torch_stage.sanitize_streams() as sanitizer:
        out = model(x)
        assert torch.equal(out, block(x))
    assert sanitizer.races == []


# Ops that may return their input itself (or share its memory) though no
# list of views names them: a write through the result must be ordered with
# the other streams' uses of the input. Without example inputs, the pass
# learns it from the op (its schema's alias annotation, or a run on meta
# stand-ins).
class _AliasThenWrite(torch.nn.Module):
    def __init__(self, alias):
        super().__init__()
        self.alias = alias
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.drop, self.flat = torch.nn.Dropout(0.1), torch.nn.Flatten(0)

    def forward(self, x):
        h = torch.relu(x)
        c = self.alias(self, h)
        c.mul_(3)
        return self.a(h) + self.b(c.view(4, 8))


ALIASING = {
    "contiguous": lambda s, h: h.contiguous(),
    "float": lambda s, h: h.float(),
    "to_same_dtype": lambda s, h: h.to(torch.float32),
    "type_as": lambda s, h: h.type_as(h),
    "data": lambda s, h: h.data,
    "atleast_2d": lambda s, h: torch.atleast_2d(h),
    "dropout_module_eval": lambda s, h: s.drop(h),
    "functional_dropout_eval": lambda s, h: F.dropout(h, 0.1, training=False),
    "flatten_module": lambda s, h: s.flat(h),
}


@pytest.mark.parametrize("alias", list(ALIASING), ids=str)
@pytest.mark.own_sanitizer
def test_a_write_through_an_op_that_returns_its_input_is_ordered(alias):
    torch.manual_seed(0)
    model = _AliasThenWrite(ALIASING[alias]).eval()
    x = torch.randn(4, 8)
    expected = model(x)
    planned = torch_stage.multi_stream(model, num_streams=4)
    with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        out = planned(x)
    assert [r.kind for r in sanitizer.races] == []
    torch.testing.assert_close(out, expected)


class _TwoLookupsWithMaxNorm(torch.nn.Module):
    """Two lookups into one table with max_norm: each renormalises the rows
    it reads, in place (embedding_renorm_), so the lookups write the table."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, max_norm=1.0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, u, v):
        return self.a(self.emb(u)).sum(1) + self.b(self.emb(v)).sum(1)


@pytest.mark.parametrize("strategy", ["auto", "embedding", "min_sync"])
@pytest.mark.own_sanitizer
def test_lookups_that_renormalise_a_shared_table_are_ordered(strategy):
    torch.manual_seed(0)
    u, v = torch.randint(0, 50, (4, 6)), torch.randint(0, 50, (4, 6))
    model = _TwoLookupsWithMaxNorm()
    expected = copy.deepcopy(model)(u, v)
    planned = torch_stage.multi_stream(model, num_streams=4, strategy=strategy)
    with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        out = planned(u, v)
    assert [r.kind for r in sanitizer.races] == []
    torch.testing.assert_close(out, expected)


# -- module state: parameters and buffers, which are no nodes of the graph --
#
# A call_module node reads its module's parameters and buffers (and writes
# them when the module writes its own state); get_attr nodes reach the same
# tensors, and .data, views and detach() of them share their storage. A
# write through one and a read through the other touch one storage, so the
# plan must order them, in graph order, whichever streams they run on.
#
#   x ─ a ─ n ─┐                x ─ a ─ n ─┐
#              add    with      a.weight ─ .data ─ clamp_   (stream 1)
#   x ─ b ─────┘


def _zero_left_half(s):
    s.a.weight[:, :4] = 0.0


# name -> (write through the attributes, the written node, the module call
# that reads the same storage)
STATE_WRITES = {
    "weight.data.clamp_": (lambda s: s.a.weight.data.clamp_(-0.1, 0.1), "clamp_", "a"),
    "weight.detach().clamp_": (lambda s: s.a.weight.detach().clamp_(-0.1, 0.1), "clamp_", "a"),
    "weight.view(-1).mul_": (lambda s: s.a.weight.view(-1).mul_(0.5), "mul_", "a"),
    "weight.mul_": (lambda s: s.a.weight.mul_(0.5), "mul_", "a"),
    "weight[:, :4] = 0": (_zero_left_half, "setitem", "a"),
    "weight.data[:, 4:].fill_": (lambda s: s.a.weight.data[:, 4:].fill_(0.5), "fill_", "a"),
    "running_mean.add_": (lambda s: s.n.running_mean.add_(1.0), "add_", "n"),
}


class _WritesSubmoduleState(torch.nn.Module):
    """Towers ``n(a(x))`` and ``b(x)``; ``write`` changes ``a``'s or ``n``'s
    state through their attributes (on stream ``stream``, if given), before
    or after ``self.a(x)`` and ``self.n(...)`` read it."""

    def __init__(self, write, write_first, stream=None):
        super().__init__()
        self.a, self.n, self.b = (
            torch.nn.Linear(8, 8),
            torch.nn.BatchNorm1d(8),
            torch.nn.Linear(8, 8),
        )
        self.write, self.write_first, self.stream = write, write_first, stream

    def _write(self):
        if self.stream is None:
            self.write(self)
        else:
            with torch_stage.stream(self.stream):
                self.write(self)

    def forward(self, x):
        if self.write_first:
            self._write()
        y = self.n(self.a(x))
        if not self.write_first:
            self._write()
        return y + self.b(x)


def _edges(module, num_streams, example_inputs=None):
    from torch_stage.streams.fx import GraphAnalysis, trace

    gm = trace(module, num_streams=num_streams, example_inputs=example_inputs)
    analysis = GraphAnalysis(gm, example_inputs, None, num_streams)
    names = [n.name for n in analysis.device_nodes]
    return {(names[u], names[v]) for u, v in analysis.edges}


def _run_sanitized(model, *inputs):
    with torch.no_grad(), torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        out = model(*inputs)
    return out, sanitizer.races


def _check_state_access_ordered(make, writer, reader, write_first, x):
    """``make()`` builds the model (twice: eager and planned, from one seed);
    its ``writer`` and ``reader`` nodes are annotated onto different
    streams. The plan orders them in graph order, the sanitizer sees no
    race, results and state equal eager's bit for bit; and without the wait
    that orders them the sanitizer reports the race between them, so the
    check can fail."""
    torch.manual_seed(0)
    eager = make().eval()
    torch.manual_seed(0)
    model = make().eval()
    edge = (writer, reader) if write_first else (reader, writer)
    assert edge in _edges(model, 2)
    planned = torch_stage.multi_stream(model, num_streams=2, strategy="user")
    plan = planned.stream_plan
    assert plan.assignment[writer] != plan.assignment[reader], str(plan)
    mutants = [without_wait(planned, w, share_state=True)[0] for w in waits(planned)]
    out, races = _run_sanitized(planned, x)
    assert races == [], [str(r) for r in races]
    with torch.no_grad():
        expected = eager(x)
    assert torch.equal(out, expected)
    for (name, value), (_, want) in zip(model.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(value, want), name
    # (The sanitizer names a setitem's access after the tensor written,
    # a_weight, the name its line of generated code assigns.)
    raced = set()
    for mutant in mutants:
        _, races = _run_sanitized(mutant, x)
        raced |= {(r.previous.node, r.current.node) for r in races}
    assert any(reader in pair for pair in raced), raced


@pytest.mark.parametrize("write_first", [True, False], ids=["write-then-call", "call-then-write"])
@pytest.mark.parametrize("write", list(STATE_WRITES), ids=str)
@pytest.mark.own_sanitizer
def test_a_write_to_a_submodules_state_is_ordered_with_the_module_call(write, write_first):
    fn, writer, reader = STATE_WRITES[write]
    _check_state_access_ordered(
        lambda: _WritesSubmoduleState(fn, write_first, stream=1),
        writer,
        reader,
        write_first,
        torch.randn(4, 8),
    )


@pytest.mark.cuda
@pytest.mark.parametrize("write_first", [True, False], ids=["write-then-call", "call-then-write"])
@pytest.mark.parametrize("write", list(STATE_WRITES), ids=str)
def test_a_write_to_a_submodules_state_is_ordered_on_real_streams(write, write_first):
    # The same plans on a GPU, with random sleeps before every node on
    # either stream: a write not ordered with the module call reads or
    # clobbers the weights too early, which changes the values.
    from conftest import caller_stream
    from stream_oracle import with_side_stream_delays

    fn, writer, reader = STATE_WRITES[write]
    random.seed(0)
    torch.manual_seed(0)
    eager = _WritesSubmoduleState(fn, write_first, stream=1).cuda().eval()
    torch.manual_seed(0)
    model = _WritesSubmoduleState(fn, write_first, stream=1).cuda().eval()
    planned = torch_stage.multi_stream(model, num_streams=2, strategy="user")
    assert planned.stream_plan.assignment[writer] != planned.stream_plan.assignment[reader]
    planned = with_side_stream_delays(planned, all_streams=True)
    x = torch.randn(64, 8, device="cuda")
    caller = caller_stream()
    with torch.no_grad(), torch.cuda.stream(caller):
        for i in range(20):
            expected = eager(x)
            got = planned(x)
            assert torch.cuda.current_stream() == caller
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"call {i}")
            for (name, value), (_, want) in zip(
                model.state_dict().items(), eager.state_dict().items()
            ):
                torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=name)


# Planning with example inputs runs forward once, and puts buffers back but
# not parameters (torch_stage/streams/fx/_example.py): only the buffer's write is
# planned that way here.
_REPEATABLE = ["running_mean.add_"]


@pytest.mark.parametrize(
    "write, strategy, example_inputs",
    [(w, s, False) for w in STATE_WRITES for s in ("min_sync", "critical_path", "auto")]
    + [(w, "min_sync", True) for w in _REPEATABLE],
    ids=lambda v: v if isinstance(v, str) else ("example-inputs" if v else ""),
)
@pytest.mark.parametrize("write_first", [True, False], ids=["write-then-call", "call-then-write"])
@pytest.mark.own_sanitizer
def test_a_write_to_a_submodules_state_equals_eager(write, write_first, strategy, example_inputs):
    fn, _, _ = STATE_WRITES[write]
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    eager = _WritesSubmoduleState(fn, write_first).eval()
    torch.manual_seed(0)
    model = _WritesSubmoduleState(fn, write_first).eval()
    planned = torch_stage.multi_stream(
        model, num_streams=4, strategy=strategy, example_inputs=(x,) if example_inputs else None
    )
    out, races = _run_sanitized(planned, x)
    assert races == [], [str(r) for r in races]
    with torch.no_grad():
        assert torch.equal(out, eager(x))
    for (name, value), (_, want) in zip(model.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(value, want), name


class _TiedWrite(torch.nn.Module):
    """``b.weight`` is ``a.weight`` (one Parameter), or another Parameter
    over the same storage; one is written through its attribute, the other
    read by its module's call."""

    def __init__(self, tie, written, write_first):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))
        if tie == "parameter":
            self.b.weight = self.a.weight
        else:
            self.b.weight = torch.nn.Parameter(self.a.weight.data)
        self.written, self.write_first = written, write_first

    def _write(self):
        with torch_stage.stream(1):
            getattr(self, self.written).weight.data.clamp_(-0.1, 0.1)

    def forward(self, x):
        if self.write_first:
            self._write()
        y = (self.b if self.written == "a" else self.a)(x)
        if not self.write_first:
            self._write()
        return y + self.c(x)


@pytest.mark.parametrize("write_first", [True, False], ids=["write-then-call", "call-then-write"])
@pytest.mark.parametrize("written", ["a", "b"])
@pytest.mark.parametrize("tie", ["parameter", "storage"])
@pytest.mark.own_sanitizer
def test_tied_weights_are_one_storage_whatever_the_name(tie, written, write_first):
    # By storage, not by name: with one Parameter, FX names the get_attr
    # node after its first name (a.weight) whichever module it was reached
    # through; with two Parameters over one storage, the names differ.
    _check_state_access_ordered(
        lambda: _TiedWrite(tie, written, write_first),
        "clamp_",
        "b" if written == "a" else "a",
        write_first,
        torch.randn(4, 8),
    )


class _ReadsStatsOfATrainingBatchNorm(torch.nn.Module):
    """Batch norm in training writes its running statistics; the mean is
    also read through the attribute, on another stream."""

    def __init__(self, read_first):
        super().__init__()
        self.n, self.b = torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8)
        self.read_first = read_first

    def _read(self):
        with torch_stage.stream(1):
            return self.n.running_mean * 2.0

    def forward(self, x):
        m = self._read() if self.read_first else None
        y = self.n(x)
        if not self.read_first:
            m = self._read()
        return y + self.b(x) + m


@pytest.mark.parametrize("read_first", [True, False], ids=["read-then-call", "call-then-read"])
@pytest.mark.own_sanitizer
def test_a_module_writing_its_state_is_ordered_with_reads_through_its_attributes(read_first):
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    eager = _ReadsStatsOfATrainingBatchNorm(read_first)
    torch.manual_seed(0)
    model = _ReadsStatsOfATrainingBatchNorm(read_first)
    edge = ("mul", "n") if read_first else ("n", "mul")
    assert edge in _edges(model, 2)
    planned = torch_stage.multi_stream(model, num_streams=2, strategy="user")
    mutants = [without_wait(planned, w, share_state=True)[0] for w in waits(planned)]
    out, races = _run_sanitized(planned, x)
    assert races == [], [str(r) for r in races]
    with torch.no_grad():
        assert torch.equal(out, eager(x))
    assert torch.equal(model.n.running_mean, eager.n.running_mean)
    raced = set()
    for mutant in mutants:
        _, found = _run_sanitized(mutant, x)
        raced |= {frozenset((r.previous.node, r.current.node)) for r in found}
    assert frozenset(("mul", "n")) in raced, raced


class _FourTowersReadingTheirWeights(torch.nn.Module):
    """Four towers, each calling its Linear and reading its weight through
    the attribute; optionally a write to tower 0's weight at the end."""

    def __init__(self, write):
        super().__init__()
        self.towers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.write = write

    def forward(self, x):
        outs = [t(x).relu() * t.weight.sum() for t in self.towers]
        if self.write:
            self.towers[0].weight.data.clamp_(-0.1, 0.1)
        return outs[0] + outs[1] + outs[2] + outs[3]


@pytest.mark.parametrize("write", [False, True], ids=["no-write", "write-to-tower-0"])
@pytest.mark.own_sanitizer
def test_module_state_orders_only_what_touches_the_written_storage(write):
    # Reads of parameters alone never order anything, and a write to one
    # tower's weight orders that tower only: the four towers keep their
    # four streams.
    torch.manual_seed(0)
    eager = _FourTowersReadingTheirWeights(write)
    torch.manual_seed(0)
    model = _FourTowersReadingTheirWeights(write)
    planned = torch_stage.multi_stream(model, num_streams=4, strategy="min_sync")
    plan = planned.stream_plan
    assert len(plan.streams_used) == 4, str(plan)
    edges = _edges(model, 4)
    if write:
        touching = {u for u, v in edges if v == "clamp_"} | {v for u, v in edges if u == "clamp_"}
        assert {"towers_0", "sum_1"} <= touching <= {"towers_0", "sum_1", "getattr_1"}, touching
    between_towers = {
        (u, v)
        for u, v in edges
        if u.startswith("towers_") and v.startswith("towers_") and u[7] != v[7]
    }
    assert between_towers == set()
    x = torch.randn(4, 8)
    out, races = _run_sanitized(planned, x)
    assert races == [], [str(r) for r in races]
    with torch.no_grad():
        assert torch.equal(out, eager(x))


# A user's function or leaf module is not run at planning time (it may do
# anything), so what it writes is unknown: it may write every tensor it is
# given. Taking it to write nothing let another stream read its argument
# while it wrote it (found by trying the pass as a new user would).
@torch.fx.wrap
def _users_in_place(t):
    t.add_(1)
    return t.sum()


class _UsersFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        base = x * 1
        h = self.a(base)
        s = _users_in_place(base)
        g = self.b(base)
        return h + g + s


class _Writer(torch.nn.Module):
    def forward(self, t):
        t.mul_(0.5)
        return t.sum()


class _UsersModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.w = _Writer()
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        base = x * 1
        return self.a(base) + self.w(base) + self.b(base)


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, _Writer) or super().is_leaf_module(m, qualname)


def _users_module_graph():
    root = _UsersModule()
    return torch.fx.GraphModule(root, _LeafTracer().trace(root))


@pytest.mark.parametrize("build", [_UsersFunction, _users_module_graph], ids=["function", "module"])
@pytest.mark.parametrize("strategy", ["min_sync", "critical_path"])
@pytest.mark.parametrize("examples", [False, True], ids=["", "examples"])
@pytest.mark.own_sanitizer
def test_a_users_function_or_leaf_module_may_write_its_arguments(build, strategy, examples):
    torch.manual_seed(0)
    module = build()
    x = torch.randn(2, 8)
    expected = module(x.clone())
    kwargs = {"example_inputs": (x.clone(),)} if examples else {}
    model = torch_stage.multi_stream(module, num_streams=2, strategy=strategy, **kwargs)
    with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        out = model(x.clone())
    assert sanitizer.races == []
    torch.testing.assert_close(out, expected)


class _WritesAnInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.a(x)
        y.mul_(2)
        return h + self.b(y)


@pytest.mark.parametrize("strategy", ["min_sync", "critical_path"])
@pytest.mark.own_sanitizer
def test_a_write_to_an_input_is_ordered_after_reads_of_inputs_it_may_alias(strategy):
    # The caller may pass one tensor as both inputs: nothing at planning
    # time says they are distinct.
    torch.manual_seed(0)
    module = _WritesAnInput()
    t = torch.randn(2, 8)
    same = t.clone()
    expected = module(same, same)
    model = torch_stage.multi_stream(module, num_streams=2, strategy=strategy)
    same = t.clone()
    with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        out = model(same, same)
    assert sanitizer.races == []
    torch.testing.assert_close(out, expected)
