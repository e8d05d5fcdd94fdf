"""Replaying a (multi-stream) module from CUDA graphs: ``cuda_graphs=True``.

:class:`CUDAGraphModule` wraps a module, usually the ``GraphModule`` that
:func:`torch_stage.multi_stream` or the ``"torch_stage"`` backend produced,
and runs it by replaying a CUDA graph captured on the first call with each
new input signature. Both ``multi_stream(..., cuda_graphs=True)`` and
``torch.compile(backend="torch_stage", options={"cuda_graphs": True})``
return one.

Capture follows PyTorch's rules for graphs with several streams
(``notes/cuda.rst``, "Usage with multiple streams"): the module's own stream
ops fork the side streams from the current stream, which during capture is
the capture stream, after capture began (``torch_stage.fork`` makes every
side stream wait on an event recorded there), and join them back into it
before ``forward`` returns (``torch_stage.join``), so capture ends with no
unjoined work. Warm-up runs on the capture stream come first (they also
take the pool's streams and events, and let lazy initialisation such as
cuBLAS handles happen outside capture). Inputs are copied into static
buffers before each replay; parameters, buffers and tensors marked static
by Dynamo are read in place.

Memory held while a graph exists (per captured input signature):

* the graph's private memory pool: every intermediate and output of one
  forward pass at that signature, allocated during capture on any of the
  streams and kept until the graph is released (roughly the forward's peak
  activation memory, on top of the parameters);
* one static copy of each non-static tensor input;
* each call returns fresh copies of the outputs (ordinary allocations
  that the caller owns), so a later replay never overwrites a result the
  caller still holds.

:meth:`CUDAGraphModule.reset` releases the graphs (and their pools);
deleting the module does too. The side streams and events come from the
per-process pool every multi-stream module shares, whatever the number of
graphs.

Limits: inference only (autograd does not record a replayed graph: a call
with gradients required is an error); no host synchronisation inside the
module (``.item()``, printing tensors, data-dependent Python control flow);
every tensor on one CUDA device.

Threads: calls are serialised by a lock (a replay writes the static
buffers); capture may run while other threads use the GPU, since capture
uses the ``"thread_local"`` error mode (staging threads keep copying).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import torch
from torch.utils import _pytree as pytree

from torch_stage import _C
from torch_stage._checks import check_int

__all__ = ["CUDAGraphModule", "check_cuda_graphs"]


def check_cuda_graphs(cuda_graphs: Any) -> bool:
    """``cuda_graphs`` as a bool; an error if it is true without a GPU."""
    if not isinstance(cuda_graphs, bool):
        raise TypeError(
            f"cuda_graphs must be a bool, got {type(cuda_graphs).__name__} ({cuda_graphs!r})"
        )
    if cuda_graphs and not torch.cuda.is_available():
        built = torch.version.cuda
        why = (
            f"torch {torch.__version__} was built without CUDA"
            if built is None
            else f"no CUDA device is visible to torch {torch.__version__} (CUDA {built})"
        )
        raise RuntimeError(
            f"cuda_graphs=True needs a CUDA device, but {why}. Leave cuda_graphs=False "
            "on this machine: the multi-stream module runs without graphs."
        )
    return cuda_graphs


def _is_static(t: torch.Tensor) -> bool:
    # Parameters and buffers keep their storage between calls (optimizers
    # update them in place); Dynamo marks lifted buffers and
    # mark_static_address tensors with _dynamo_static_input_type.
    return isinstance(t, torch.nn.Parameter) or (
        getattr(t, "_dynamo_static_input_type", None) is not None
    )


class _Captured:
    """One captured graph: its static inputs and outputs."""

    def __init__(self, graph, static_leaves: List[Any], copied: List[int], outputs: Any, device):
        self.graph = graph
        self.static_leaves = static_leaves
        self.copied = copied
        self.outputs = outputs
        self.device = device
        # Recorded on the last call's stream after its output clones.
        self.done: Optional[torch.cuda.Event] = None
        self.done_stream: Optional[torch.cuda.Stream] = None


class CUDAGraphModule(torch.nn.Module):
    """Runs ``module`` by replaying CUDA graphs (see the module doc).

    Args:
        module: the module to capture; typically a multi-stream
            ``GraphModule``. Its ``stream_plan`` (if any) is kept as
            ``self.stream_plan``.
        warmup: eager runs before each capture, ``>= 1``.

    Raises:
        RuntimeError: no CUDA device (``torch.cuda.is_available()`` false).
        TypeError / ValueError: a bad argument.
    """

    def __init__(self, module: torch.nn.Module, warmup: int = 3):
        super().__init__()
        check_cuda_graphs(True)
        if not callable(module):
            raise TypeError(f"module must be callable, got {type(module).__name__}")
        self.module = module
        self.warmup = check_int("warmup", warmup, 1, ">= 1")
        self.stream_plan = getattr(module, "stream_plan", None)
        self._graphs: Dict[tuple, _Captured] = {}
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far (one per input signature)."""
        return len(self._graphs)

    def reset(self) -> None:
        """Release every captured graph and its memory pool."""
        with self._lock:
            self._graphs.clear()

    def forward(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = (spec, tuple(self._signature(i, leaf) for i, leaf in enumerate(leaves)))
        with self._lock:
            captured = self._graphs.get(key)
            if captured is None:
                captured = self._capture(leaves, spec)
                self._graphs[key] = captured
            # The lock orders the host calls only. A call from another
            # stream (a second serving thread, or one thread switching
            # streams) would overwrite the static inputs while the previous
            # replay still reads them, or replay while the previous call's
            # clones still read the outputs (gpu-review #3): each call's
            # stream waits for the end of the previous call.
            device = captured.device
            stream = torch.cuda.current_stream(device)
            if captured.done is not None and captured.done_stream != stream:
                stream.wait_event(captured.done)
            for i in captured.copied:
                captured.static_leaves[i].copy_(leaves[i])
            captured.graph.replay()
            out = pytree.tree_map(
                lambda v: v.clone() if isinstance(v, torch.Tensor) else v, captured.outputs
            )
            if captured.done is None:
                captured.done = torch.cuda.Event()
            captured.done.record(stream)
            captured.done_stream = stream
            return out

    def _signature(self, position: int, leaf: Any) -> tuple:
        if isinstance(leaf, torch.Tensor):
            sig = (tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad)
            # Read in place: the graph is only valid for this storage.
            return sig + ((leaf.data_ptr(),) if _is_static(leaf) else ())
        try:
            hash(leaf)
        except TypeError:
            raise TypeError(
                f"cuda_graphs=True: input leaf {position} is a {type(leaf).__name__}, which "
                "can neither be copied into a static buffer nor compared between calls; "
                "pass tensors, numbers, strings or None"
            ) from None
        return ("value", leaf)

    def _device(self, leaves: List[Any]) -> torch.device:
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if isinstance(self.module, torch.nn.Module):
            tensors += list(self.module.parameters()) + list(self.module.buffers())
        devices = {t.device for t in tensors}
        cuda = sorted((d for d in devices if d.type == "cuda"), key=str)
        if not cuda:
            found = ", ".join(sorted(str(d) for d in devices)) or "no tensors"
            raise ValueError(
                f"cuda_graphs=True captures CUDA work, but the module's inputs and "
                f"parameters are on {found}: move the model and its inputs to a CUDA "
                "device, or leave cuda_graphs=False"
            )
        if len(devices) > 1:
            raise ValueError(
                "cuda_graphs=True needs every input and parameter on one CUDA device, "
                f"got {', '.join(sorted(str(d) for d in devices))}"
            )
        return cuda[0]

    def _check_inference(self, leaves: List[Any]) -> None:
        if not torch.is_grad_enabled():
            return
        needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
        if isinstance(self.module, torch.nn.Module):
            needs_grad = needs_grad or any(p.requires_grad for p in self.module.parameters())
        if needs_grad:
            raise RuntimeError(
                "cuda_graphs=True replays inference only: autograd does not record the "
                "work of a replayed graph, so gradients would be lost. Call the module "
                "under torch.no_grad() or torch.inference_mode(), or use "
                "cuda_graphs=False for training"
            )

    def _capture(self, leaves: List[Any], spec) -> _Captured:
        self._check_inference(leaves)
        device = self._device(leaves)
        static_leaves = list(leaves)
        copied = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and not _is_static(leaf):
                buffer = torch.empty_strided(
                    leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device
                )
                buffer.copy_(leaf)
                static_leaves[i] = buffer
                copied.append(i)
        args, kwargs = pytree.tree_unflatten(static_leaves, spec)
        # StreamPool's capture stream: high priority, so never one of the
        # multi-stream side streams (PyTorch's pools hand out low- and
        # high-priority streams separately), and never a staging stream,
        # whose copies a capture would pull in (gpu-review #2).
        stream = self._streams.get(device)
        if stream is None:
            stream_id, index, device_type = _C._capture_stream(str(device))
            stream = torch.cuda.Stream(
                stream_id=stream_id, device_index=index, device_type=device_type
            )
            self._streams[device] = stream
        caller = torch.cuda.current_stream(device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self.module(*args, **kwargs)
        caller.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Capture begins on `stream`, which is then the current stream: the
        # module's fork op makes its side streams wait on it (so they join
        # the capture) and its join op makes it wait on them before the
        # module returns, i.e. before capture ends.
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            outputs = self.module(*args, **kwargs)
        # A capture runs nothing, so on the GPU this waits for nothing. But
        # PyTorch's CSAN (TORCH_CUDA_SANITIZER=1) counts the captured kernels
        # as launched on the capture and side streams, and without it reports
        # the caller's next copy into a static input as racing with them.
        caller.wait_stream(stream)
        return _Captured(graph, static_leaves, copied, outputs, device)

    def extra_repr(self) -> str:
        return f"warmup={self.warmup}, graphs={self.num_graphs}"
