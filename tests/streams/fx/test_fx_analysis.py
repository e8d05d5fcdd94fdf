"""The graph as the scheduler sees it (torch_stage/streams/fx/analysis.py,
torch_stage/streams/fx/classify.py), and plans (torch_stage/streams/fx/stream_plan.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import InPlaceModel

import torch_stage
from torch_stage.streams.fx import GraphAnalysis, trace
from torch_stage.streams.fx.classify import ALIAS, CONST, DEVICE, HOST, INPUT, OUTPUT
from torch_stage.streams.fx.stream_plan import plan


def analyse(module, num_streams=4, example_inputs=None, cost_model=None):
    gm = trace(module, num_streams=num_streams, example_inputs=example_inputs)
    return GraphAnalysis(gm, example_inputs, cost_model, num_streams)


def kinds(analysis):
    return {n.name: analysis.kind[n] for n in analysis.nodes}


def edges(analysis):
    names = [n.name for n in analysis.device_nodes]
    return {(names[u], names[v]): kind for (u, v), kind in analysis.edges.items()}


class Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        n = x.size(0) * 2
        rows = x.shape[0]
        ones = torch.ones_like(x)
        y = self.lin(x).repeat(2, 1) + ones.repeat(2, 1) * n
        return y.view(rows * 2, 4)


def test_nodes_are_sorted_into_inputs_host_constants_and_device_work():
    assert kinds(analyse(Shapes())) == {
        "x": INPUT,
        "size": HOST,
        "mul": HOST,
        "getattr_1": HOST,
        "getitem": HOST,
        "ones_like": CONST,
        "lin": DEVICE,
        "repeat": DEVICE,
        "repeat_1": DEVICE,
        "mul_1": DEVICE,
        "add": DEVICE,
        "mul_2": HOST,
        "view": ALIAS,  # launches nothing: no stream, no event of its own
        "output": OUTPUT,
    }


def test_host_values_and_constants_make_no_dependencies():
    analysis = analyse(Shapes())
    assert edges(analysis) == {
        ("lin", "repeat"): 0,
        ("repeat", "add"): 0,
        ("repeat_1", "mul_1"): 0,
        ("mul_1", "add"): 0,
    }
    assert analysis.costs == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert [n.name for n in analysis.roots(analysis.nodes[-2])] == ["add"]


def test_with_example_inputs_shapes_and_aliases_are_measured():
    x = torch.randn(3, 4)
    analysis = analyse(Shapes(), example_inputs=(x,))
    nodes = {n.name: n for n in analysis.nodes}
    assert nodes["lin"].meta["tensor_meta"].shape == torch.Size([3, 4])
    assert nodes["view"].meta["torch_stage_aliases"] == ["add"]
    assert nodes["lin"].meta["torch_stage_aliases"] == []
    assert analysis.costs_known
    costs = dict(zip([n.name for n in analysis.device_nodes], analysis.costs))
    assert "view" not in costs  # an alias: no device work to cost
    assert all(c > 0 for c in costs.values())


def test_in_place_writes_are_ordered_against_every_reader():
    analysis = analyse(InPlaceModel())
    e = edges(analysis)
    # a = left(x) * scale is "mul"; snapshot = a * 2 ("mul_2") reads it
    # before a.add_(1) ("add_") writes it: write after read.
    assert e[("mul_2", "add_")] == 1
    # Later readers of a come after it: the sum, and the copy_ that reads a
    # view of it.
    assert e[("add_", "sum_1")] == 1
    assert ("add_", "copy_") in e
    # Writes are ordered per storage, not in one global chain: a's writes
    # (add_, relu_) and its readers, buf's writes (setitem, then copy_
    # through a view); a.add_ and b.mul_ touch different tensors.
    for before, after in [
        ("add_", "relu_"),  # write after write, a
        ("copy_", "relu_"),  # write after read: copy_ reads a view of a
        ("setitem", "copy_"),  # write after write, buf
        ("mul_", "setitem"),  # setitem reads b after b.mul_
    ]:
        assert (before, after) in e, (before, after)
    assert ("add_", "mul_") not in e and ("mul_", "add_") not in e
    # zeros_like is written (item assignment, and through a view), so it is
    # device work, not a constant copied per stream; ones_like is constant.
    k = kinds(analysis)
    assert k["zeros_like"] == DEVICE
    assert k["ones_like"] == CONST


def test_random_ops_get_no_ordering_edges():
    class Noise(nn.Module):
        def forward(self, x):
            a = F.dropout(x, 0.5, training=True)
            b = torch.randn_like(x)
            return a + b

    analysis = analyse(Noise())
    assert edges(analysis) == {("dropout", "add"): 0, ("randn_like", "add"): 0}


def test_batch_norm_in_training_is_ordered_as_a_side_effect():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x, y):
            return self.bn(x) + self.bn(y)

    train = edges(analyse(Shared().train()))
    assert train[("bn", "bn_1")] == 1
    assert ("bn", "bn_1") not in edges(analyse(Shared().eval()))


def test_annotations_become_fixed_streams_and_colocation_groups():
    class Towers(nn.Module):
        def forward(self, x):
            with torch_stage.stream(2):
                a = x + 1
            b = x * 3
            with torch_stage.colocate_with(a):
                c = b - 1
            d = c.t()
            return d

    analysis = analyse(Towers())
    names = [n.name for n in analysis.device_nodes]
    # t, a view, launches nothing: not a node of the plan.
    assert names == ["add", "mul", "sub"]
    assert analysis.fixed == [2, -1, -1]
    # sub is colocated with add.
    group = analysis.colocation[0]
    assert group >= 0
    assert analysis.colocation == [group, -1, group]
    stream_plan, _ = plan(analysis, "min_sync", verify=True)
    assert stream_plan.assignment == {"add": 2, "mul": 0, "sub": 2}


def test_annotations_outside_the_pool_of_a_graph_module_are_rejected():
    class One(nn.Module):
        def forward(self, x):
            with torch_stage.stream(3):
                return x + 1

    gm = trace(One())
    with pytest.raises(
        ValueError,
        match=r"node 'add' is annotated torch_stage.stream\(3\), outside the pool of 2 "
        r"streams \(valid ids: 0..1\)",
    ):
        GraphAnalysis(gm, None, None, 2)


def test_embedding_lookups_are_found():
    class Lookups(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(10, 4)
            self.bag = nn.EmbeddingBag(10, 4)
            self.weight = nn.Parameter(torch.randn(10, 4))

        def forward(self, i, j, k):
            return self.table(i) + self.bag(j) + F.embedding(k, self.weight)

    analysis = analyse(Lookups())
    assert analysis.num_embedding_lookups == 3
    lookups = [n.name for n, g in zip(analysis.device_nodes, analysis.embedding_group) if g >= 0]
    assert lookups == ["table", "bag", "embedding"]


def test_cost_model_errors_name_the_node():
    with pytest.raises(
        ValueError, match=r"cost_model returned -1.0 for node 'lin'.*finite and >= 0"
    ):
        analyse(Shapes(), cost_model=lambda n: -1.0)
    with pytest.raises(ValueError, match="cost_model returned nan"):
        analyse(Shapes(), cost_model=lambda n: float("nan"))
    with pytest.raises(TypeError, match="cost_model must return a number, got str"):
        analyse(Shapes(), cost_model=lambda n: "cheap")
    seen = []
    analysis = analyse(Shapes(), cost_model=lambda n: seen.append(n.name) or 3)
    assert seen == ["lin", "repeat", "repeat_1", "mul_1", "add"]
    assert analysis.costs == [3.0] * 5


def test_a_rewritten_graph_is_refused():
    rewritten = torch_stage.multi_stream(InPlaceModel(), num_streams=2)
    with pytest.raises(ValueError, match="already contains torch_stage stream ops"):
        GraphAnalysis(rewritten, None, None, 2)


def test_the_plan_reads_as_a_program():
    class Diamond(nn.Module):
        def forward(self, x):
            a = x.exp()
            b = a.sin()
            c = a.cos()
            return b + c

    analysis = analyse(Diamond())
    stream_plan, raw = plan(analysis, "min_sync", verify=True)
    assert stream_plan.strategy == "min_sync"
    assert stream_plan.assignment == {"exp": 0, "sin": 0, "cos": 1, "add": 0}
    assert [(e.id, e.node, e.stream) for e in stream_plan.events] == [(0, "exp", 0), (1, "cos", 1)]
    assert [(w.node, w.stream, w.event, w.after) for w in stream_plan.waits] == [
        ("cos", 1, 0, "exp"),
        ("add", 0, 1, "cos"),
    ]
    assert stream_plan.keeps == [("cos", "exp", 1), ("add", "cos", 0)]
    assert stream_plan.fork == [1] and stream_plan.join == []
    assert stream_plan.streams_used == [0, 1]
    text = str(stream_plan)
    assert text.splitlines() == [
        "StreamPlan: strategy min_sync (requested); 2 of 4 streams used, 2 events, "
        "2 waits for 2 cross-stream dependencies",
        "  fork: streams [1] wait for stream 0 (the caller's)",
        "  [0] exp  record e0",
        "  [0] sin",
        "  [1] cos  wait e0 (exp), record e1",
        "  [0] add  wait e1 (cos)",
        "  join: none needed (stream 0 already waited on every side stream)",
    ]
