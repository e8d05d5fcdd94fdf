"""Write the scripted modules that the C++ tests load with LibTorch alone.

Usage: python tests/cpp/make_fixtures.py OUT_DIR
"""

import os
import sys

import torch

import torch_stage  # noqa: F401  (loads torch.classes.torch_stage)

# The C++ example's model (examples/cpp/export_model.py), so that the tests
# serve exactly what the example serves.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "cpp"))
import export_model  # noqa: E402


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


def main(out_dir: str) -> int:
    os.makedirs(out_dir, exist_ok=True)
    modules = {"staged_consumer.pt": torch.jit.script(StagedConsumer(capacity=3))}
    towers = export_model.build()
    # The same model scripted with the multi-stream pass's ops, with its
    # `with torch_stage.stream(i):` blocks as StreamScopes, and plain.
    modules["towers_multi_stream.pt"] = torch.jit.script(
        torch_stage.multi_stream(towers, num_streams=2)
    )
    modules["towers_scoped.pt"] = torch.jit.script(towers)
    modules["towers_plain.pt"] = torch.jit.script(
        torch_stage.streams.fx.trace(towers, num_streams=2)
    )
    for name, scripted in modules.items():
        path = os.path.join(out_dir, name)
        scripted.save(path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
