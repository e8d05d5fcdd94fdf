"""Multi-stream execution: stream annotations and :func:`multi_stream`.

Independent parts of a model (towers, branches, embedding lookups) can run on
different streams of one device, synchronised by events, so small kernels
that leave the GPU half idle run side by side (DeepRec's GPU MultiStream, in
PyTorch). :func:`multi_stream` traces a module with ``torch.fx``, plans the
streams with torch_stage's C++ scheduler and returns a ``GraphModule`` whose
code calls ``torch.ops.torch_stage.*`` stream ops around the original nodes.

:func:`stream` and :func:`colocate_with` annotate code: while
:func:`multi_stream` (or :func:`torch_stage.streams.fx.trace`) traces a module, the
nodes created inside them are placed accordingly; in plain eager execution
they change nothing, so annotated code computes the same results anywhere.
Inside ``torch.compile`` they become node annotations that the
``"torch_stage"`` backend honours (torch >= 2.10; older releases warn that
they are dropped), and inside ``torch.jit.script`` code ``with
torch_stage.stream(i):`` runs the block on pool stream ``i``
(``torch.classes.torch_stage.StreamScope``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from torch_stage.streams.annotations import (
    MAX_STREAMS,
    STRATEGIES,
    ColocateAnnotation,
    StreamAnnotation,
    colocate_with,
    stream,
)
from torch_stage.streams.fx.multi_stream_pass import MultiStreamPass

__all__ = [
    "MAX_STREAMS",
    "STRATEGIES",
    "ColocateAnnotation",
    "StreamAnnotation",
    "colocate_with",
    "multi_stream",
    "stream",
]


def multi_stream(
    module: torch.nn.Module,
    num_streams: int = 4,
    strategy: str = "auto",
    example_inputs: Optional[Sequence[Any]] = None,
    cost_model: Optional[Callable[[torch.fx.Node], float]] = None,
    cuda_graphs: bool = False,
    warmup: int = 3,
    example_kwargs: Optional[Mapping[str, Any]] = None,
) -> torch.nn.Module:
    """Rewrite ``module`` to run its independent parts on several streams.

    The module is traced with ``torch.fx`` (a ``GraphModule`` is taken as
    is), its nodes are assigned to ``num_streams`` streams of the device it
    runs on, and the returned ``GraphModule`` calls
    ``torch.ops.torch_stage.*`` stream ops: it forks side streams from the
    caller's current stream on entry, records an event after each producer
    whose result another stream needs, makes consumers wait on them (skipping
    waits earlier ones imply), marks tensors used off their allocation
    stream with ``record_stream`` and joins every side stream back into the
    caller's stream before returning. It can be scripted with
    ``torch.jit.script``. On CPU the stream ops do nothing and the results
    are those of ``module``.

    Placement: :func:`stream` and :func:`colocate_with` annotations first,
    then ``strategy`` for the rest:

    * ``"min_sync"``: as few streams and events as the graph allows (minimum
      chain cover, Nimble / DeepRec), folded onto ``num_streams``;
    * ``"critical_path"``: list scheduling by the longest remaining weighted
      path, using the cost model;
    * ``"embedding"``: each embedding lookup (``nn.Embedding``,
      ``nn.EmbeddingBag``, ``F.embedding``, ``F.embedding_bag``) and what
      hangs only off it on its own stream, round robin; the rest by min_sync;
    * ``"user"``: annotations only; everything else on stream 0;
    * ``"auto"``: ``"user"`` when every node is annotated, else
      ``"embedding"`` with two or more embedding lookups, else
      ``"critical_path"`` when costs are known (``cost_model`` or
      ``example_inputs`` given) or the graph has more than 20,000 nodes,
      else ``"min_sync"``.

    In-place writes and other side effects keep their order (an event orders
    them across streams); random ops keep their launch order, which fixes
    their values. Inputs, parameters and small constants never cause waits.

    Args:
        module: the module, or a ``torch.fx.GraphModule`` (for instance one
            traced by :func:`torch_stage.streams.fx.trace`).
        num_streams: streams in the pool, 1..:data:`MAX_STREAMS`; stream 0
            is the caller's current stream at call time.
        strategy: one of :data:`STRATEGIES`.
        example_inputs: positional inputs for one forward call. With them,
            control flow on tensor values is decided from real values while
            tracing (the result assumes the same branches), and the default
            cost model uses their shapes (FLOPs and bytes per op). The module
            runs once on copies of them (random state, buffers and parameters
            it writes restored).
        example_kwargs: keyword inputs for the same call, by forward's
            argument names (``{"attention_mask": mask}``), with or without
            ``example_inputs``; what is said of those holds for these. The
            result takes them by keyword as ``module`` does. A model that
            symbolic tracing cannot follow is captured by ``torch.export``
            with both.
        cost_model: ``cost_model(node) -> float``: the cost of a
            ``torch.fx.Node`` (``node.meta["tensor_meta"]`` holds shapes when
            ``example_inputs`` are given); finite and ``>= 0``.
        cuda_graphs: capture the rewritten module in CUDA graphs and replay
            them (inference only; needs a GPU): the result is a
            :class:`torch_stage.CUDAGraphModule` around the ``GraphModule``.
        warmup: eager runs before each CUDA graph capture, ``>= 1``.

    Returns:
        A ``torch.fx.GraphModule`` with a ``stream_plan`` attribute
        (:class:`torch_stage.streams.fx.StreamPlan`): the stream of each node, the
        events and waits, and a readable ``str()``. With ``cuda_graphs=True``
        a :class:`torch_stage.CUDAGraphModule` whose ``module`` is that
        ``GraphModule`` (and whose ``stream_plan`` is its plan).
        ``train()`` and ``eval()`` on the ``GraphModule`` switch plans where
        tracing froze the mode into the graph (functional dropout,
        stochastic depth, ``if self.training``): the module is traced in the
        new mode once and, if the graph differs, planned again; both plans
        share the parameters.

    Raises:
        TypeError / ValueError: a bad argument (named in the message).
        RuntimeError: ``cuda_graphs=True`` without a CUDA device.
        torch_stage.MultiStreamTraceError: the module cannot be traced; the
            message says why and what to do.
    """
    stream_pass = MultiStreamPass(
        num_streams=num_streams,
        strategy=strategy,
        example_inputs=example_inputs,
        cost_model=cost_model,
        cuda_graphs=cuda_graphs,
        warmup=warmup,
        example_kwargs=example_kwargs,
    )
    return stream_pass(module)
