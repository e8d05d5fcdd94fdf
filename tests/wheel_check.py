"""What a user does first with the wheel, in a fresh venv that has only torch
and the wheel (make wheel-check runs it from outside the source tree)."""

import json
import os
import subprocess
import sys

here = os.getcwd()
assert not os.path.exists(os.path.join(here, "torch_stage")), "run outside the source tree"

# The backend is found through the entry point, before torch_stage is
# imported.
from importlib.metadata import entry_points  # noqa: E402

import torch  # noqa: E402

assert "torch_stage" in [ep.name for ep in entry_points(group="torch_dynamo_backends")]
assert "torch_stage" not in sys.modules
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
x = torch.randn(4, 8)
torch.testing.assert_close(torch.compile(model, backend="torch_stage")(x), model(x))
assert "torch_stage" in sys.modules

import torch_stage  # noqa: E402

assert os.path.realpath(torch_stage.__file__).startswith(os.path.realpath(sys.prefix)), (
    torch_stage.__file__
)
info = json.loads(
    subprocess.run(
        [sys.executable, "-m", "torch_stage.info"], capture_output=True, text=True, check=True
    ).stdout
)
# The library the wheel carries, built against this very torch.
assert os.path.realpath(info["library"]).startswith(os.path.realpath(sys.prefix)), info
assert info["torch_version"] == torch.__version__.split("+")[0], info

# A two-line staged loop.
batches = [torch.full((2, 3), float(i)) for i in range(10)]
assert [b[0, 0].item() for b in torch_stage.staged(batches, num_threads=2)] == list(range(10))
print(f"wheel check: ok (torch {info['torch_version']}, {info['library']})")
