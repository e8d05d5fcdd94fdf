"""Loading the compiled library, and the error when it is missing."""

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
