"""torch.classes.torch_stage.StagingArea from TorchScript: scripting, saving,
loading, and surviving TorchScript's optimisation passes."""

import io
import threading
from typing import Dict

import pytest
import torch
from conftest import HANG_BOUND_S

import torch_stage
from torch_stage import StagingArea

AreaType = torch.classes.torch_stage.StagingArea


class Consumer(torch.nn.Module):
    def __init__(self, capacity: int = 2):
        super().__init__()
        self.area = StagingArea(capacity).script_object
        self.linear = torch.nn.Linear(4, 3)

    def forward(self) -> torch.Tensor:
        (x,) = self.area.take()
        return self.linear(x)


class PutPutTake(torch.nn.Module):
    """Every call has a side effect; none returns anything the output needs
    except the last, so a pass that treated them as pure would drop them."""

    def __init__(self):
        super().__init__()
        self.area = StagingArea(4).script_object

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.area.put([x])
        self.area.put([x + 1])
        self.area.take()  # result unused on purpose
        y = self.area.take()
        self.area.put([y[0] * 3])
        return y[0]


def call_methods(graph):
    return [n.s("name") for n in graph.nodes() if n.kind() == "prim::CallMethod"]


def test_a_scripted_module_takes_from_its_area():
    module = torch.jit.script(Consumer())
    area = StagingArea.wrap(module.area)
    x = torch.randn(5, 4)
    area.put([x])
    torch.testing.assert_close(module(), module.linear(x))


def test_save_and_load_keep_the_configuration_not_the_contents():
    module = torch.jit.script(Consumer(capacity=7))
    StagingArea.wrap(module.area).put([torch.ones(1, 4)])
    buf = io.BytesIO()
    torch.jit.save(module, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    area = StagingArea.wrap(loaded.area)
    assert area.capacity() == 7
    assert area.size() == 0
    x = torch.randn(2, 4)
    area.put([x])
    torch.testing.assert_close(loaded(), module.linear(x))


def test_scripted_functions_take_the_class_as_an_argument():
    @torch.jit.script
    def consume(area: AreaType, n: int) -> torch.Tensor:
        total = torch.zeros(1)
        for _ in range(n):
            total += area.take()[0]
        return total

    area = StagingArea(2)

    def produce():
        for i in range(100):
            area.put([torch.tensor([float(i)])])

    producer = threading.Thread(target=produce)
    producer.start()
    # The scripted call releases the GIL while it waits, so the Python
    # producer thread runs meanwhile.
    total = consume(area.script_object, 100)
    producer.join(HANG_BOUND_S)
    assert not producer.is_alive()
    assert total.item() == sum(range(100))


def test_end_of_stream_surfaces_from_scripted_code():
    module = torch.jit.script(Consumer())
    StagingArea.wrap(module.area).close()
    with pytest.raises(Exception, match=r"\[StageClosed\]"):
        module()


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda m: m, id="scripted"),
        pytest.param(torch.jit.freeze, id="freeze"),
        pytest.param(torch.jit.optimize_for_inference, id="optimize_for_inference"),
    ],
)
def test_side_effects_survive_torchscript_passes(transform):
    module = transform(torch.jit.script(PutPutTake().eval()))
    assert call_methods(module.graph) == ["put", "put", "take", "take", "put"]
    x = torch.arange(3.0)
    torch.testing.assert_close(module(x), x + 1)
    # The area now holds (x + 1) * 3. A second call puts x and x + 1 behind
    # it; the unused take removes (x + 1) * 3, so the call returns x. Had any
    # call been dropped or reordered, it would return something else.
    torch.testing.assert_close(module(x), x)


def test_methods_visible_to_torchscript():
    expected = {
        "put",
        "take",
        "try_put",
        "try_take",
        "close",
        "cancel",
        "is_closed",
        "is_cancelled",
        "size",
        "capacity",
        "byte_limit",
        "stats",
    }
    area = StagingArea(1).script_object
    assert all(hasattr(area, name) for name in expected)

    @torch.jit.script
    def probe(area: AreaType) -> Dict[str, int]:
        ok = area.try_put([torch.ones(1)], 0)
        got = area.try_take(0)
        assert ok and got is not None
        area.close()
        assert area.is_closed()
        return area.stats()

    stats = probe(area)
    assert stats["put"] == 1 and stats["taken"] == 1 and stats["closed"] == 1


def test_facade_script_object_is_the_custom_class():
    assert isinstance(StagingArea(1).script_object, torch.ScriptObject)
    assert torch_stage.StagingArea is StagingArea
