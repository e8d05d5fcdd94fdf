"""CUDA graph replay of multi-stream modules (torch_stage/cuda_graphs.py):
cuda_graphs=True through multi_stream, MultiStreamPass and the
torch.compile backend. The replay tests need a GPU (marked `cuda`); the
errors that protect a CPU machine run everywhere."""

import pytest
import torch
from conftest import caller_stream
from torch import nn
from zoo import ZOO, build

import torch_stage
from torch_stage.streams.fx import MultiStreamPass

ENTRIES = {e.name: e for e in ZOO}
# Random ops draw from the generator at replay time, not in eager order.
DETERMINISTIC = [e for e in ZOO if not e.random]

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")


@no_gpu
def test_cuda_graphs_without_a_gpu_is_a_clear_error_everywhere():
    message = r"cuda_graphs=True needs a CUDA device, but torch .* Leave cuda_graphs=False"
    module = build(ENTRIES["inception"])
    with pytest.raises(RuntimeError, match=message):
        torch_stage.multi_stream(module, cuda_graphs=True)
    with pytest.raises(RuntimeError, match=message):
        MultiStreamPass(cuda_graphs=True)
    with pytest.raises(RuntimeError, match=message):
        torch_stage.CUDAGraphModule(module)
    with pytest.raises(RuntimeError, match=message):
        torch_stage.backend(cuda_graphs=True)


def test_bad_cuda_graph_arguments_are_named():
    module = build(ENTRIES["inception"])
    with pytest.raises(TypeError, match=r"cuda_graphs must be a bool, got int \(1\)"):
        torch_stage.multi_stream(module, cuda_graphs=1)
    with pytest.raises(ValueError, match="warmup must be >= 1, got 0"):
        torch_stage.multi_stream(module, warmup=0)


# -- GPU -------------------------------------------------------------------


def _eager(module, inputs):
    with torch.no_grad():
        return module(*inputs)


@pytest.mark.cuda
@pytest.mark.parametrize("entry", DETERMINISTIC, ids=lambda e: e.name)
@pytest.mark.parametrize("num_streams", [1, 4])
def test_replay_equals_eager(entry, num_streams):
    module = build(entry, "cuda").eval()
    if entry.name == "two_tower" and num_streams == 1:
        # Its towers are annotated streams 0 and 1: a pool of one is refused
        # when the plan is made, before any capture.
        with pytest.raises(ValueError, match=r"stream id 1 is outside the pool of 1 streams"):
            torch_stage.multi_stream(module, num_streams=1, cuda_graphs=True)
        return
    graphed = torch_stage.multi_stream(module, num_streams=num_streams, cuda_graphs=True)
    assert isinstance(graphed, torch_stage.CUDAGraphModule)
    assert graphed.stream_plan is graphed.module.stream_plan
    with torch.no_grad():
        first = None
        for batch_seed in range(5):
            torch.manual_seed(batch_seed)
            inputs = tuple(
                t + torch.randn_like(t) if t.is_floating_point() else t
                for t in entry.inputs(8, "cuda")
            )
            got = graphed(*inputs)
            torch.testing.assert_close(got, _eager(module, inputs), rtol=1e-5, atol=1e-6)
            if first is None:
                first = got
        # One capture for one input signature; results are copies, so the
        # first call's output survived four more replays.
        assert graphed.num_graphs == 1
        assert first.data_ptr() != got.data_ptr()
        # A new batch size is a new signature: a second graph.
        graphed(*entry.inputs(4, "cuda"))
        assert graphed.num_graphs == 2
        graphed.reset()
        assert graphed.num_graphs == 0


@pytest.mark.cuda
def test_the_captured_graph_forks_and_joins_inside_capture():
    # Four branches on four streams: a capture that did not rejoin a side
    # stream would fail with "capturing stream has unjoined work"; one that
    # forked before capture began would not contain the side work, and the
    # replay would not match.
    entry = ENTRIES["inception"]
    module = build(entry, "cuda").eval()
    graphed = torch_stage.multi_stream(module, num_streams=4, cuda_graphs=True, warmup=2)
    assert graphed.stream_plan.streams_used == [0, 1, 2, 3]
    inputs = entry.inputs(16, "cuda")
    caller = caller_stream()
    with torch.no_grad(), torch.cuda.stream(caller):
        for _ in range(20):
            torch.testing.assert_close(graphed(*inputs), module(*inputs), rtol=1e-5, atol=1e-6)
            assert torch.cuda.current_stream() == caller


@pytest.mark.cuda
def test_training_mode_gradients_are_refused():
    module = build(ENTRIES["inception"], "cuda")
    graphed = torch_stage.multi_stream(module, cuda_graphs=True)
    with pytest.raises(RuntimeError, match="replays inference only"):
        graphed(*ENTRIES["inception"].inputs(2, "cuda"))


@pytest.mark.cuda
def test_cpu_inputs_are_refused():
    module = build(ENTRIES["inception"])
    graphed = torch_stage.multi_stream(module, cuda_graphs=True)
    with torch.no_grad(), pytest.raises(ValueError, match="move the model and its inputs"):
        graphed(*ENTRIES["inception"].inputs(2, "cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("entry", DETERMINISTIC, ids=lambda e: e.name)
def test_backend_option_replays_compiled_graphs(entry):
    torch._dynamo.reset()
    module = build(entry, "cuda").eval()
    backend = torch_stage.backend(num_streams=4, cuda_graphs=True)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    inputs = entry.inputs(8, "cuda")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(
                compiled(*inputs), _eager(module, inputs), rtol=1e-5, atol=1e-6
            )
    assert len(backend.plans) == 1


@pytest.mark.cuda
def test_reduce_overhead_mode_means_cuda_graphs():
    torch._dynamo.reset()
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).cuda().eval()
    compiled = torch.compile(module, backend="torch_stage", mode="reduce-overhead")
    x = torch.randn(4, 8, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
    torch._dynamo.reset()
    compiled = torch.compile(
        module, backend=torch_stage.backend(cuda_graphs=True, executor="eager")
    )
    with pytest.raises(Exception, match="replays inference only"):
        compiled(x.requires_grad_())


@pytest.mark.cuda
def test_replays_from_two_caller_streams_do_not_share_static_buffers_unordered():
    # gpu-review #3: call 1 on s1 (delayed by a sleep), call 2 on s2 at once.
    # Without ordering, call 2 overwrites the static input while replay 1
    # still waits to read it, and call 1 returns call 2's result.
    entry = ENTRIES["inception"]
    module = build(entry, "cuda").eval()
    graphed = torch_stage.multi_stream(module, num_streams=4, cuda_graphs=True, warmup=1)
    (x1,) = entry.inputs(16, "cuda")
    x2 = x1 + 1.0
    s1, s2 = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1)
    with torch.no_grad():
        graphed(x1)  # capture
        torch.cuda.synchronize()
        for _ in range(10):
            with torch.cuda.stream(s1):
                torch.cuda._sleep(10**8)
                o1 = graphed(x1)
            with torch.cuda.stream(s2):
                o2 = graphed(x2)
            torch.cuda.synchronize()
            torch.testing.assert_close(o1, module(x1), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(o2, module(x2), rtol=1e-5, atol=1e-6)
