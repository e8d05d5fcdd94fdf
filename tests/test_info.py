"""torch_stage.build_info() and `python -m torch_stage.info`."""

import json
import os
import subprocess
import sys

import torch
from conftest import ROOT

import torch_stage


def test_build_info_describes_the_build_and_the_runtime():
    info = torch_stage.build_info()
    for key in (
        "torch_version",
        "torch_runtime_version",
        "compiler",
        "cxx_standard",
        "build_type",
        "build_flags",
        "library",
        "cuda_available",
        "cuda_device_count",
    ):
        assert key in info, key
    # The library reports the torch it was compiled against; it must be the
    # one imported now, or the ABI would not match.
    assert torch.__version__.startswith(info["torch_version"])
    assert info["cuda_available"] == torch.cuda.is_available()
    assert info["build_type"] in ("release", "debug")
    assert os.path.samefile(info["library"], torch_stage.library_path())


def test_info_module_prints_json():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "torch_stage.info"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    )
    info = json.loads(out.stdout)
    assert info["torch_version"] == torch_stage.build_info()["torch_version"]
    assert "RuntimeWarning" not in out.stderr
