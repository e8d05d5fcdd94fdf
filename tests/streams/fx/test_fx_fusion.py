"""inductor's view of a graph Dynamo captured (torch_stage/streams/fx/fusion.py):
which nodes one fused kernel is made from, which run extern kernels, what
each costs; and plans that keep a fusion unit on one stream."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import ZOO, build

import torch_stage
from torch_stage.streams.fx.fusion import inductor_view, lowers_to_extern

ENTRIES = {e.name: e for e in ZOO}
aten = torch.ops.aten


def _captured(module, inputs):
    """Dynamo's graph of ``module`` and the example inputs it hands a
    backend."""
    got = {}

    def backend(gm, example_inputs):
        got["gm"], got["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return got["gm"], got["inputs"]


def test_extern_kernels_are_what_inductor_does_not_generate():
    assert lowers_to_extern(aten.mm.default)  # a kernel template (torch._inductor.kernel)
    assert lowers_to_extern(aten.convolution.default)
    assert lowers_to_extern(aten._embedding_bag.default)  # a fallback
    assert not lowers_to_extern(aten.relu.default)  # pointwise
    assert not lowers_to_extern(aten.sum.dim_IntList)  # a reduction
    assert not lowers_to_extern(aten.cat.default)  # data movement it fuses
    assert not lowers_to_extern(torch.sin)  # not an ATen op


def test_inception_units_join_the_branch_epilogues_with_the_concat():
    # Dynamo's graph (names Dynamo's):
    #
    #   x ─▶ conv2d ─▶ a ─────────────────────────────┐
    #   x ─▶ conv2d_1 ─▶ relu_1 ─▶ conv2d_2 ─▶ b ─────┤
    #   x ─▶ conv2d_3 ─▶ relu_3 ─▶ conv2d_4 ─▶ relu_4 ─▶ conv2d_5 ─▶ c ─┤─▶ cat
    #   x ─▶ max_pool2d ─▶ conv2d_6 ─▶ d ─────────────┘
    #
    # inductor writes each branch's relu into its slice of the concat: one
    # unit. The relus between convolutions are units of one node.
    gm, inputs = _captured(
        build(ENTRIES["inception"]).eval(), ENTRIES["inception"].inputs(2, "cpu")
    )
    view = inductor_view(gm, inputs)
    assert view.units == [["a", "b", "c", "d", "cat"]]
    assert view.extern == {f"conv2d{s}" for s in ["", "_1", "_2", "_3", "_4", "_5", "_6"]}
    # 7 convolutions, max pooling, 3 single relus, the concat unit.
    assert view.kernels == 12
    assert view.cost["conv2d_2"] > view.cost["conv2d"] > view.cost["relu_1"] > 0
    # Dynamo's graph is left as it was.
    assert not any("torch_stage_origin" in (n.meta.get("custom") or {}) for n in gm.graph.nodes)


def test_a_chain_of_pointwise_ops_is_one_unit_and_one_kernel():
    class Chain(nn.Module):
        def forward(self, x):
            return torch.tanh(F.gelu(x * 2 + 1)).sum(-1)

    gm, inputs = _captured(Chain(), (torch.randn(8, 16),))
    view = inductor_view(gm, inputs)
    assert view.units == [["mul", "add", "gelu", "tanh", "sum_1"]]
    assert view.extern == set() and view.kernels == 1


def test_a_graph_that_cannot_be_traced_to_aten_gives_no_view():
    gm, inputs = _captured(nn.Linear(4, 4), (torch.randn(2, 4),))
    assert inductor_view(gm, inputs[:1]) is None  # the weight and bias are missing


@pytest.mark.parametrize("executor", ["inductor", "aot_eager"])
def test_plans_keep_fusion_units_on_one_stream_and_chains_on_one_stream(executor):
    entry = ENTRIES["inception"]
    backend = torch_stage.backend(num_streams=4, executor=executor)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(build(entry).eval(), backend=backend, fullgraph=True)(*entry.inputs(2, "cpu"))
    plan = backend.plans[0]
    assert len({plan.assignment[n] for n in ("a", "b", "c", "d", "cat")}) == 1, str(plan)
    assert len(plan.streams_used) >= 2, str(plan)
    assert plan.strategy == "critical_path"  # costs known: inductor's view
    for name in ("plain_chain", "residual_mlp"):
        entry = ENTRIES[name]
        backend = torch_stage.backend(num_streams=4, executor=executor)
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(build(entry).eval(), backend=backend, fullgraph=True)(
                *entry.inputs(2, "cpu")
            )
        assert backend.plans[0].streams_used == [0], str(backend.plans[0])
        assert backend.tables == [None]
    torch._dynamo.reset()


def test_work_too_small_to_pay_for_an_event_stays_on_one_stream():
    class Tiny(nn.Module):
        # Two small independent branches: each a few elementwise ops, less
        # than the event a second stream would cost.
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x).sin() + self.b(x).cos()

    class Wide(Tiny):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(1024, 1024), nn.Linear(1024, 1024)

    def plan(module, width):
        backend = torch_stage.backend(num_streams=4)
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(module, backend=backend, fullgraph=True)(torch.randn(256, width))
        return backend.plans[0]

    assert plan(Tiny(), 4).streams_used == [0]
    assert plan(Wide(), 1024).streams_used == [0, 1]
    torch._dynamo.reset()
