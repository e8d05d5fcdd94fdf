"""Integer arguments take numpy integers, as Python's own int checks do
(``operator.index``): numpy and torch arithmetic make them (``np.arange``,
``.item()`` of a shape product, a rank from a config array). Bools stay
refused wherever a count, a size or an id is meant."""

import numpy as np
import pytest
import torch
from torch import nn

import torch_stage
from torch_stage.records.example import FixedLenFeature, encode_example, parse_example
from torch_stage.streams.fx import trace
from torch_stage.streams.fx.annotate import META_KEY

NUMPY_INTS = [np.int64, np.int32, np.uint8]


class TwoStreams(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index = index

    def forward(self, x):
        with torch_stage.stream(self.index):
            y = x * 2
        return y + 1


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_stream_ids_and_pool_sizes(kind):
    gm = trace(TwoStreams(kind(1)), num_streams=kind(2))
    notes = [n.meta.get(META_KEY) for n in gm.graph.nodes if n.op == "call_function"]
    assert {"stream": 1} in notes
    assert all(type(v) is int for note in notes if note for v in note.values())
    x = torch.ones(3)
    planned = torch_stage.multi_stream(TwoStreams(kind(1)), num_streams=kind(2))
    assert torch.equal(planned(x), x * 2 + 1)
    with pytest.raises(TypeError, match="index must be an int, got bool"):
        torch_stage.stream(np.bool_(True))


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_feature_shapes_and_int64_values(kind):
    record = encode_example({"ids": [kind(3), kind(4)], "n": kind(7), "x": np.float32(0.5)})
    out = parse_example(
        [record],
        {
            "ids": FixedLenFeature((kind(2),), torch.int64),
            "n": FixedLenFeature(kind(1), torch.int64),
            "x": FixedLenFeature((), torch.float32),
        },
    )
    assert out["ids"].tolist() == [[3, 4]] and out["n"].tolist() == [[7]]
    assert out["x"].tolist() == [0.5]
    with pytest.raises(ValueError, match="shape dimensions must be ints >= 0"):
        FixedLenFeature((np.bool_(True),), torch.int64)


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_a_stage_state_with_numpy_positions(kind):
    stage = torch_stage.staged(list(range(10)), num_threads=1)
    it = iter(stage)
    assert [next(it) for _ in range(4)] == [0, 1, 2, 3]
    state = stage.state_dict()
    stage.close()
    state["position"] = kind(state["position"])
    resumed = torch_stage.staged(list(range(10)), num_threads=1)
    resumed.load_state_dict(state)
    assert list(resumed) == list(range(4, 10))
