"""The default cost model of the multi-stream pass: FLOPs and bytes per op.

With shapes from ``example_inputs`` (``node.meta["tensor_meta"]``, filled by
``torch.fx.passes.shape_prop.ShapeProp``) a node costs

    launch + flops / FLOPS + bytes / BANDWIDTH      (microseconds)

on a nominal accelerator (:data:`LAUNCH_US`, :data:`FLOPS_PER_US`,
:data:`BYTES_PER_US`). Only ratios matter to the scheduler, so the nominal
figures need not match any device; what matters is that a large matmul
outweighs an elementwise op on the same tensor, and that every kernel pays a
launch. Nodes that launch no kernel (views, tuple indexing) cost 0. Without
shapes every kernel costs 1.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterable, List, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "BYTES_PER_US",
    "FLOPS_PER_US",
    "LAUNCH_US",
    "MAY_COPY",
    "SYNC_US",
    "default_cost",
    "is_view",
    "may_copy",
]

#: Kernel launch overhead, microseconds.
LAUNCH_US = 5.0
#: A dependency between two streams: an event recorded on one and waited
#: on by the other, about a launch's worth of host and device time.
SYNC_US = LAUNCH_US
#: Nominal compute throughput: 10 TFLOP/s.
FLOPS_PER_US = 10e12 / 1e6
#: Nominal memory bandwidth: 500 GB/s.
BYTES_PER_US = 500e9 / 1e6

# Ops whose result is a view of (or an element of) their first argument: no
# kernel, and the result shares memory with the argument.
VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "expand",
        "expand_as",
        "permute",
        "transpose",
        "t",
        "T",
        "mT",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "narrow",
        "select",
        "split",
        "chunk",
        "unbind",
        "movedim",
        "swapaxes",
        "swapdims",
        "diagonal",
        "detach",
        "as_strided",
        "real",
        "imag",
        "unfold",
        "__getitem__",
    }
)
VIEW_FUNCTIONS = frozenset(
    {
        operator.getitem,
        torch.reshape,
        torch.flatten,
        torch.unflatten,
        torch.transpose,
        torch.permute,
        torch.squeeze,
        torch.unsqueeze,
        torch.narrow,
        torch.select,
        torch.split,
        torch.chunk,
        torch.unbind,
        torch.t,
        torch.movedim,
        torch.swapaxes,
        torch.swapdims,
        torch.diagonal,
        torch.detach,
        torch.as_strided,
        torch.view_as_real,
        torch.view_as_complex,
    }
)

_MATMULS = frozenset(
    {torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, operator.matmul, F.linear}
)
_MATMUL_METHODS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__"})


_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


#: Views that copy when the input's strides do not allow a view (their
#: ATen schemas still say ``Tensor(a)``): they may launch a kernel and write
#: fresh memory, so they are never mere aliases.
MAY_COPY = frozenset({"reshape", "reshape_as", "flatten", torch.reshape, torch.flatten})


def may_copy(node: torch.fx.Node) -> bool:
    """Whether view-like ``node`` can copy: :data:`MAY_COPY`, and every ATen
    op whose schema returns an alias but whose kernel is
    CompositeImplicitAutograd (``aten.contiguous``, ``aten.reshape``,
    ``aten.flatten``): it decomposes at run time into a view or, when the
    strides do not allow one, a copy (the stream sanitizer caught
    ``aten.contiguous`` writing through a clone in GPT-2's attention). Ops
    of that kind that always alias (``aten.view_as``) are taken as copies
    too: a stream of their own, never a wrong order."""
    target = node.target
    if target in MAY_COPY:
        return True
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        target.name(), "CompositeImplicitAutograd"
    )


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` only reinterprets its first argument (no kernel)."""
    if node.op == "call_method":
        if node.target == "__getitem__":
            return not any(isinstance(a, torch.fx.Node) for a in _flat(node.args[1:]))
        return node.target in VIEW_METHODS
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        # Basic indexing is a view; indexing with a tensor gathers.
        return not any(isinstance(a, torch.fx.Node) for a in _flat(node.args[1:]))
    if target is getattr:
        return node.args[1] in _VIEW_ATTRIBUTES
    schema = getattr(target, "_schema", None)
    if isinstance(target, torch._ops.OpOverload) and schema is not None and schema.returns:
        # ATen views (graphs from torch.compile): the result aliases an
        # input without writing it (aten.view, aten.t, aten.select, ...).
        alias = schema.returns[0].alias_info
        return alias is not None and not alias.is_write
    return target in VIEW_FUNCTIONS


def _flat(value: Any) -> List[Any]:
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flat(item)]
    if isinstance(value, slice):
        return [value.start, value.stop, value.step]
    return [value]


def _metas(value: Any) -> Iterable[Any]:
    """TensorMetadata entries in a node's ``tensor_meta`` (possibly nested)."""
    if value is None:
        return []
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return [value]
    if isinstance(value, (list, tuple)):
        return [m for item in value for m in _metas(item)]
    if isinstance(value, dict):
        return [m for item in value.values() for m in _metas(item)]
    return []


def _numel(meta) -> int:
    return math.prod(int(d) for d in meta.shape)


def _bytes(meta) -> int:
    dtype = meta.dtype
    size = (
        dtype.itemsize
        if hasattr(dtype, "itemsize")
        else torch.empty((), dtype=dtype).element_size()
    )
    return _numel(meta) * size


def _first_meta(node: Any) -> Optional[Any]:
    if isinstance(node, torch.fx.Node):
        metas = list(_metas(node.meta.get("tensor_meta")))
        if metas:
            return metas[0]
    return None


def default_cost(node: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> float:
    """The cost of ``node`` in nominal microseconds (see the module doc).

    Args:
        node: a node of the graph being planned.
        root: the module owning the graph (for ``call_module`` nodes).
    """
    if is_view(node):
        return 0.0
    outputs = list(_metas(node.meta.get("tensor_meta")))
    if not outputs and "tensor_meta" not in node.meta:
        return 1.0
    out_numel = sum(_numel(m) for m in outputs)
    out_bytes = sum(_bytes(m) for m in outputs)
    in_bytes = sum(
        sum(_bytes(m) for m in _metas(a.meta.get("tensor_meta"))) for a in node.all_input_nodes
    )
    flops = float(out_numel)
    module = None
    if node.op == "call_module" and root is not None:
        module = root.get_submodule(node.target)
    if isinstance(module, torch.nn.Linear):
        flops = 2.0 * out_numel * module.in_features
    elif isinstance(module, torch.nn.modules.conv._ConvNd):
        kernel = math.prod(module.kernel_size)
        flops = 2.0 * out_numel * (module.in_channels // module.groups) * kernel
    elif isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        flops = 0.0
    elif (node.op == "call_function" and node.target in _MATMULS) or (
        node.op == "call_method" and node.target in _MATMUL_METHODS
    ):
        first = _first_meta(
            node.args[1]
            if node.target in (torch.addmm, torch.baddbmm, "addmm", "baddbmm")
            else node.args[0]
        )
        inner = int(first.shape[-1]) if first is not None and len(first.shape) else 1
        flops = 2.0 * out_numel * inner
    return LAUNCH_US + flops / FLOPS_PER_US + (in_bytes + out_bytes) / BYTES_PER_US
