"""Write the scripted multi-stream model the C++ example serves.

Usage: python examples/cpp/export_model.py OUT.pt

The model is two towers annotated with torch_stage.stream(0) and (1),
rewritten by torch_stage.multi_stream (two streams, events between them) and
scripted; the file runs with LibTorch and libtorch_stage.so alone.
"""

import sys

import torch

import torch_stage


class Towers(torch.nn.Module):
    """Two annotated towers joined by a product."""

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


def build() -> Towers:
    torch.manual_seed(0)
    return Towers().eval()


def export(path: str) -> None:
    scripted = torch.jit.script(torch_stage.multi_stream(build(), num_streams=2))
    scripted.save(path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    export(sys.argv[1])
    print(f"wrote {sys.argv[1]}")
