"""`with torch_stage.stream(i):` inside torch.jit.script code: the op
torch.ops.torch_stage.stream and its context manager
torch.classes.torch_stage.StreamScope (csrc/streams/stream_scope.h)."""

from typing import List

import pytest
import torch
from conftest import caller_stream, devices
from torch import nn
from zoo import ZOO, build

import torch_stage

ENTRIES = {e.name: e for e in ZOO}
StreamScope = torch.classes.torch_stage.StreamScope


def _kinds(graph):
    return [n.kind() for n in graph.nodes()]


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch_stage.stream(0):
            a = self.a(x)
        with torch_stage.stream(1):
            b = self.b(y)
            with torch_stage.stream(2):
                c = b * 2 + a
        return a + b + c


@pytest.mark.parametrize("device", devices())
def test_the_annotated_zoo_model_scripts_and_matches_eager(device, tmp_path):
    # DeepRec's two-tower example, annotated with torch_stage.stream, is
    # scripted as written: no multi_stream, no tracing.
    entry = ENTRIES["two_tower"]
    module = build(entry, device).eval()
    inputs = entry.inputs(8, device)
    scripted = torch.jit.script(module)
    kinds = _kinds(scripted.graph)
    assert kinds.count("torch_stage::stream") == 2
    assert kinds.count("prim::Enter") == 2 and kinds.count("prim::Exit") == 2
    expected = module(*inputs)
    assert torch.equal(scripted(*inputs), expected)
    path = tmp_path / "two_tower.pt"
    scripted.save(str(path))
    loaded = torch.jit.load(str(path), map_location=device)
    assert torch.equal(loaded(*inputs), expected)


def test_scopes_survive_freezing_and_inference_optimisation():
    module = Nested().eval()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    frozen = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.script(module)))
    kinds = _kinds(frozen.graph)
    assert kinds.count("torch_stage::stream") == 3
    assert kinds.count("prim::Enter") == 3 and kinds.count("prim::Exit") == 3
    # The block's work stays between its enter and exit.
    assert (
        kinds.index("prim::Enter")
        < kinds.index("aten::mul")
        < len(kinds) - kinds[::-1].index("prim::Exit")
    )
    # optimize_for_inference rewrites linear layers, so compare closely
    # rather than bit for bit; the unoptimised script is exact.
    torch.testing.assert_close(frozen(x, y), module(x, y))
    assert torch.equal(torch.jit.script(module)(x, y), module(x, y))


def test_scopes_nest_and_expose_their_state():
    @torch.jit.script
    def probe(x: torch.Tensor) -> List[int]:
        with torch_stage.stream(3) as outer:
            with torch_stage.stream(0) as inner:
                x = x + 1
            state = [outer.index(), inner.index(), int(outer.is_entered())]
        return state + [int(outer.is_entered()), int(outer.is_active())]

    # Without a GPU a scope is inactive (it changes no stream) but still
    # tracks entry and exit.
    assert probe(torch.ones(1)) == [3, 0, 1, 0, int(torch.cuda.is_available())]


def test_a_block_that_raises_still_exits_its_scope():
    @torch.jit.script
    def fails(scope: StreamScope, x: torch.Tensor) -> torch.Tensor:
        with scope:
            if bool(x.sum() > 0):
                raise ValueError("positive")
        return x

    scope = torch.ops.torch_stage.stream(2)
    with pytest.raises(Exception, match="positive"):
        fails(scope, torch.ones(2))
    assert not scope.is_entered()
    assert torch.equal(fails(scope, -torch.ones(2)), -torch.ones(2))
    assert not scope.is_entered()


# Under a Python dispatch mode, an error raised inside TorchScript reaches the
# caller without its message (PyTorch's python_error crossing the
# interpreter), so this message check runs without the sanitizer.
@pytest.mark.no_sanitizer
def test_stream_ids_outside_the_pool_are_named():
    @torch.jit.script
    def too_far(x: torch.Tensor) -> torch.Tensor:
        with torch_stage.stream(40):
            return x * 2

    with pytest.raises(Exception, match=r"stream id 40 is outside the pool of 32 streams"):
        too_far(torch.ones(1))


def test_misuse_of_a_scope_is_an_error():
    scope = torch.ops.torch_stage.stream(1)
    assert scope.index() == 1
    with pytest.raises(RuntimeError, match="exit without enter"):
        scope.__exit__(None, None, None)
    scope.__enter__()
    with pytest.raises(RuntimeError, match="already entered"):
        scope.__enter__()
    outer_first = torch.ops.torch_stage.stream(2)
    outer_first.__enter__()
    with pytest.raises(RuntimeError, match="innermost first"):
        scope.__exit__(None, None, None)
    outer_first.__exit__(None, None, None)
    scope.__exit__(None, None, None)


def test_python_eager_stream_is_still_an_annotation():
    # Outside scripting, torch_stage.stream() switches nothing (design:
    # annotated code computes the same results anywhere).
    block = torch_stage.stream(1)
    assert repr(block) == "torch_stage.stream(1)"
    assert isinstance(block, torch_stage.streams.multi_stream.StreamAnnotation)
    with block:
        assert torch.equal(torch.ones(2) * 2, torch.full((2,), 2.0))


@pytest.mark.cuda
def test_scoped_blocks_run_on_side_streams_and_match_eager_on_gpu():
    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> List[int]:
            with torch_stage.stream(2) as scope:
                y = x * 2
                ids = [scope.stream_id(), scope.enclosing_stream_id()]
            return ids + [int(y.sum().item())]

    ids = torch.jit.script(Probe())(torch.ones(4, device="cuda"))
    assert ids[0] != ids[1] and ids[2] == 8
    module = Nested().cuda().eval()
    scripted = torch.jit.script(module)
    caller = caller_stream()
    with torch.cuda.stream(caller):
        for i in range(50):
            torch.manual_seed(i)
            x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, 8, device="cuda")
            assert torch.equal(scripted(x, y), module(x, y)), i
            assert torch.cuda.current_stream() == caller
