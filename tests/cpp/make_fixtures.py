"""Write the scripted modules that the C++ tests load with LibTorch alone.

Usage: python tests/cpp/make_fixtures.py OUT_DIR
"""

import os
import sys

import torch

import torch_stage  # noqa: F401  (loads torch.classes.torch_stage)


class StagedConsumer(torch.nn.Module):
    """Takes (x, bias) bundles from its staging area and computes x @ w + bias."""

    def __init__(self, capacity: int):
        super().__init__()
        self.area = torch_stage.StagingArea(capacity).script_object
        self.weight = torch.nn.Parameter(torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10)

    def forward(self) -> torch.Tensor:
        x, bias = self.area.take()
        return x @ self.weight + bias

    @torch.jit.export
    def feed(self, x: torch.Tensor, bias: torch.Tensor) -> None:
        self.area.put([x, bias])


class Towers(torch.nn.Module):
    """Two annotated towers joined by a sum: multi_stream puts them on two
    streams."""

    def __init__(self):
        super().__init__()
        self.x = torch.nn.Linear(8, 8)
        self.y = torch.nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch_stage.stream(0):
            pa = torch.relu(self.x(a))
        with torch_stage.stream(1):
            pb = torch.tanh(self.y(b))
        return pa * pb


def main(out_dir: str) -> int:
    os.makedirs(out_dir, exist_ok=True)
    modules = {"staged_consumer.pt": torch.jit.script(StagedConsumer(capacity=3))}
    torch.manual_seed(0)
    towers = Towers().eval()
    # The same model scripted with and without the stream ops.
    modules["towers_multi_stream.pt"] = torch.jit.script(
        torch_stage.multi_stream(towers, num_streams=2)
    )
    modules["towers_plain.pt"] = torch.jit.script(torch_stage.fx.trace(towers, num_streams=2))
    for name, scripted in modules.items():
        path = os.path.join(out_dir, name)
        scripted.save(path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
