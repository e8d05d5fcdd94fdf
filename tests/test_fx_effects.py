"""torch_stage.fx.effects: which arguments a node writes, from ATen schemas,
for every spelling of an in-place write; and plans over graphs with such
writes checked by the stream sanitizer, not by the planner's own analysis."""

import copy
import operator

import pytest
import torch
import torch.nn.functional as F

import torch_stage
from torch_stage.fx.effects import aliased_args, written_args


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
    compiled = torch.compile(fn, backend=torch_stage.backend(num_streams=4, strategy="min_sync"))
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
# exception, torch_stage.fx.effects.understated_writes).
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
