import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A bound against hangs for tests that wait on threads: far above any healthy
# run, so it never measures speed, only that nothing blocks forever.
HANG_BOUND_S = 60

if os.environ.get("TORCH_CUDA_SANITIZER"):
    # torch enabled CSAN at import; set right what it gets wrong.
    from torch_csan import ignore_empty_tensors

    ignore_empty_tensors()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")
    config.addinivalue_line(
        "markers", "no_sanitizer: run without the stream sanitizer (the test installs its own)"
    )
    config.addinivalue_line(
        "markers", "own_sanitizer: makes stream sanitizers of its own (they do not nest)"
    )


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TORCH_STAGE_SANITIZE", "0") not in ("", "0"):
        # The process-wide sanitizer is active from import on: a test that
        # makes its own cannot run, and one that must run without any cannot.
        held = pytest.mark.skip(reason="TORCH_STAGE_SANITIZE=1 holds the process's sanitizer")
        for item in items:
            if "own_sanitizer" in item.keywords or "no_sanitizer" in item.keywords:
                item.add_marker(held)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def caller_stream():
    """A CUDA stream for a test's caller, ordered after the current stream.

    High priority: PyTorch's pools hand out low- and high-priority streams
    separately, so it cannot be one of the multi-stream side streams. Ordered:
    what the test made so far on the default stream (its model, its inputs)
    is ready for it, as CUDA asks of any program that switches streams. A
    blocking copy is finished on the host already, but torch.cuda._sanitizer
    cannot see that, and a fill kernel (torch.ones) is not.
    """
    stream = torch.cuda.Stream(priority=-1)
    stream.wait_stream(torch.cuda.current_stream())
    return stream


def devices():
    """Parametrisation over the CPU and, marked `cuda`, the GPU."""
    return [
        pytest.param("cpu", id="cpu"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
    ]


@pytest.fixture
def emulated(monkeypatch):
    """PyTorch's compiled-stream passes run as on a GPU, on the CPU
    (tests/compiled_streams.py), with Dynamo's caches cleared around."""
    from compiled_streams import emulate_streams

    torch._dynamo.reset()
    emulate_streams(monkeypatch)
    yield
    torch._dynamo.reset()


def vm_costs():
    """The stream calls' host costs as measured on this project's 2-vCPU
    VM, for plans that must not depend on the machine's timing: a faster
    one measured the calls at nothing (within its noise) and kept streams
    the VM merges; a loaded one may measure them dearer than what they
    save."""
    from torch_stage.streams.fx.host_cost import HostCosts

    return HostCosts(
        launch_us=1.5, fork_join_us=0.3, sync_us=0.15, record_us=0.02, wait_us=0.07, keep_us=0.0
    )


@pytest.fixture
def planned_with_vm_costs():
    """Plans made in the test weigh :func:`vm_costs`, not this
    machine's measurement (a test of the default plan's shape)."""
    from torch_stage.streams.fx.host_cost import planning_with

    with planning_with(vm_costs()) as costs:
        yield costs


@pytest.fixture
def run_python():
    """Run a Python snippet in a fresh interpreter, bounded against hangs.

    For behaviour that would wedge the test process itself when broken (a
    thread holding the GIL forever, interpreter exit, signals), or that needs
    a process of its own. ``env``: variables to set; None unsets one.
    """

    def run(code, timeout=HANG_BOUND_S, env=None, check=True):
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
        for name, value in (env or {}).items():
            if value is None:
                full_env.pop(name, None)
            else:
                full_env[name] = value
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=ROOT,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    return run


# Every test of the multi-stream half runs under the stream sanitizer
# (torch_stage/streams/sanitizer.py): on CPU the stream ops do nothing, so a plan
# with a missing wait or record_stream would pass them all without it.
_SANITIZED_MODULES = frozenset(
    {
        "test_compile_backend",
        "test_cuda_graphs",
        "test_fx_annotate",
        "test_fx_multi_stream_pass",
        "test_fx_analysis",
        "test_stream_ops",
        "test_stream_scope",
        "test_multi_stream",
    }
)


@pytest.fixture(autouse=True)
def _stream_sanitizer(request):
    module = request.module.__name__.rpartition(".")[2]
    if module not in _SANITIZED_MODULES or "no_sanitizer" in request.keywords:
        yield None
        return
    import torch_stage

    process = torch_stage._process_sanitizer
    if process is not None:
        # TORCH_STAGE_SANITIZE=1 checks the whole process already; sanitizers
        # do not nest, so judge this test's share of its races.
        before = len(process.races)
        yield process
        assert process.races[before:] == []
        return
    with torch_stage.sanitize_streams() as sanitizer:
        yield sanitizer
    assert sanitizer.races == []
