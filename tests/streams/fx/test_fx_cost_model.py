"""The default cost model (torch_stage/streams/fx/cost_model.py)."""

import operator

import torch
from torch import nn

from torch_stage.streams.fx import GraphAnalysis, trace
from torch_stage.streams.fx.cost_model import (
    BYTES_PER_US,
    FLOPS_PER_US,
    LAUNCH_US,
    default_cost,
    is_view,
)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(256, 256)
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.table = nn.EmbeddingBag(100, 32)

    def forward(self, x, image, ids, offsets):
        h = self.big(x)
        r = h.relu()
        v = r.view(-1)
        m = torch.matmul(x, x.t())
        c = self.conv(image)
        e = self.table(ids, offsets)
        return v.sum() + m.sum() + c.sum() + e.sum()


def mixed_inputs():
    return (
        torch.randn(64, 256),
        torch.randn(2, 8, 16, 16),
        torch.randint(0, 100, (40,)),
        torch.arange(0, 40, 4),
    )


def costs():
    inputs = mixed_inputs()
    gm = trace(Mixed(), example_inputs=inputs)
    analysis = GraphAnalysis(gm, inputs, None, 4)
    nodes = {n.name: n for n in analysis.device_nodes}
    return {name: default_cost(n, gm) for name, n in nodes.items()}


def test_costs_follow_flops_and_bytes():
    c = costs()
    f32 = 4
    # Linear 256 -> 256 on 64 rows: 2 * 64 * 256 * 256 FLOPs, input and
    # output activations moved.
    assert (
        c["big"]
        == LAUNCH_US + 2 * 64 * 256 * 256 / FLOPS_PER_US + 2 * 64 * 256 * f32 / BYTES_PER_US
    )
    # The elementwise relu on the same tensor costs less than the matmul.
    assert c["relu"] == LAUNCH_US + 64 * 256 / FLOPS_PER_US + 2 * 64 * 256 * f32 / BYTES_PER_US
    assert c["big"] > c["relu"]
    # torch.matmul of (64, 256) by (256, 64): inner dimension 256.
    assert c["matmul"] > LAUNCH_US + 2 * 64 * 64 * 256 / FLOPS_PER_US
    # Conv: 2 * out elements * in_channels * 3 * 3.
    out = 2 * 16 * 16 * 16
    assert c["conv"] > LAUNCH_US + 2 * out * 8 * 9 / FLOPS_PER_US
    # An embedding bag moves memory and does no FLOPs worth counting.
    assert LAUNCH_US < c["table"] < c["big"]


def test_views_cost_nothing():
    inputs = mixed_inputs()
    gm = trace(Mixed(), example_inputs=inputs)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert default_cost(nodes["view"], gm) == 0.0
    assert default_cost(nodes["t"], gm) == 0.0
    # Nor are they nodes of the plan: aliases get no stream of their own.
    names = {n.name for n in GraphAnalysis(gm, inputs, None, 4).device_nodes}
    assert not {"view", "t"} & names


def test_without_shapes_every_kernel_costs_one():
    gm = trace(Mixed())
    nodes = {n.name: n for n in gm.graph.nodes}
    assert default_cost(nodes["big"], gm) == 1.0
    assert default_cost(nodes["view"], gm) == 0.0


def test_views_are_recognised_in_every_spelling():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    i = graph.placeholder("i")
    views = [
        graph.call_method("view", (x, -1)),
        graph.call_function(getattr, (x, "T")),
        graph.call_function(torch.ops.aten.t.default, (x,)),
        graph.call_function(torch.ops.aten.select.int, (x, 0, 0)),
        graph.call_function(torch.transpose, (x, 0, 1)),
        graph.call_function(operator.getitem, (x, 0)),
    ]
    kernels = [
        graph.call_function(torch.ops.aten.add_.Tensor, (x, x)),  # writes, not a view
        graph.call_function(torch.ops.aten.mm.default, (x, x)),
        graph.call_function(operator.getitem, (x, i)),  # gathers
        graph.call_function(getattr, (x, "shape")),
        graph.call_method("relu", (x,)),
    ]
    assert [is_view(n) for n in views] == [True] * len(views)
    assert [is_view(n) for n in kernels] == [False] * len(kernels)
