"""inductor's view of a graph Dynamo captured (torch_stage/streams/fx/fusion.py):
which nodes one fused kernel is made from, which run extern kernels, what
each costs; and plans that keep a fusion unit on one stream."""

import torch
import torch.nn.functional as F
from torch import nn
from zoo import ZOO, build

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
