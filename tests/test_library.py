"""Loading the compiled library, and the error when it is missing."""

import shutil
import subprocess
import sys

import pytest
import torch

import torch_stage


def test_the_library_registers_its_ops_and_classes():
    assert torch_stage.library_path() in torch.ops.loaded_libraries
    assert hasattr(torch.ops.torch_stage, "build_info")
    assert torch.classes.torch_stage.StagingArea is not None


def test_a_missing_library_gives_one_actionable_error(run_python, tmp_path):
    proc = run_python(
        "import torch_stage",
        env={"TORCH_STAGE_LIBRARY": str(tmp_path / "nowhere" / "libtorch_stage.so")},
        check=False,
    )
    assert proc.returncode != 0
    assert "ImportError: torch_stage's compiled library is missing" in proc.stderr
    assert "make build" in proc.stderr
    # One error, not a chain of tracebacks.
    assert proc.stderr.count("Traceback (most recent call last)") == 1
    assert "During handling of the above exception" not in proc.stderr


def test_a_broken_library_says_to_rebuild(run_python, tmp_path):
    broken = tmp_path / "libtorch_stage.so"
    broken.write_bytes(b"not an ELF file")
    proc = run_python("import torch_stage", env={"TORCH_STAGE_LIBRARY": str(broken)}, check=False)
    assert proc.returncode != 0
    assert "torch_stage could not load" in proc.stderr
    assert "rebuild it with `make build`" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1


def _dynamic_symbols(path):
    out = subprocess.run(
        ["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True
    )
    return [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]


def _needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    return [
        line.split("[")[1].rstrip("]") for line in out.stdout.splitlines() if "(NEEDED)" in line
    ]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("nm") is None,
    reason="ELF and binutils' nm and readelf (Linux)",
)
@pytest.mark.parametrize("which", ["libtorch_stage", "_C"])
def test_the_libraries_use_the_processs_cxx_runtime_not_a_copy_of_their_own(which):
    # A copy of libstdc++ linked into our library beside the shared one torch
    # loads crashes at the first number formatted into a stream: a stage
    # naming its threads. It did, in every staged run on a GPU machine whose
    # CXX (/opt/gcc/bin/g++) links one in; setup.py now refuses such a build.
    # The symbols are those only a whole copy defines (setup.py's
    # _PRIVATE_RUNTIME_PREFIXES).
    import torch_stage._C as glue

    path = torch_stage.library_path() if which == "libtorch_stage" else glue.__file__
    assert any(name.startswith("libstdc++.so") for name in _needed(path)), _needed(path)
    private = [
        s for s in _dynamic_symbols(path) if s.startswith(("_ZNSt6locale", "_ZNSo9_M_insert"))
    ]
    assert private == []
