"""How the planner sorts the nodes of a graph (see
:mod:`torch_stage.streams.fx.analysis`): inputs, host work, constants, aliases and
device work, and which device nodes are embedding lookups.

Views and writes come from ATen schemas (:mod:`torch_stage.streams.fx.cost_model`,
:mod:`torch_stage.streams.fx.effects`); what is left here names Python-level
callables that have no schema of their own (``x.shape``, ``operator.mul``,
``torch.zeros``), where symbolic tracing records them instead of ATen ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from torch_stage.streams.fx.annotate import META_KEY
from torch_stage.streams.fx.cost_model import is_view, may_copy
from torch_stage.streams.fx.effects import reads_metadata_only

__all__ = [
    "ALIAS",
    "CONST",
    "DEVICE",
    "HOST",
    "HOST_META",
    "INPUT",
    "OUTPUT",
    "classify",
    "is_alias",
    "is_embedding",
    "is_factory",
    "is_host_function",
]

INPUT, OUTPUT, HOST, CONST, DEVICE, ALIAS = "input", "output", "host", "const", "device", "alias"
#: node.meta key set by whoever inserted a node known to be host work (the
#: input guards torch.export adds: torch_stage/streams/fx/multi_stream_pass.py).
HOST_META = "torch_stage_host"

_HOST_ATTRS = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "is_cuda",
        "layout",
        "requires_grad",
        "is_sparse",
        "is_quantized",
        "is_leaf",
        "names",
    }
)
_HOST_METHODS = frozenset(
    {
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "get_device",
        "element_size",
        "storage_offset",
        "has_names",
    }
)
_CONST_FACTORIES = frozenset(
    {
        torch.zeros,
        torch.ones,
        torch.full,
        torch.empty,
        torch.arange,
        torch.eye,
        torch.tensor,
        torch.linspace,
        torch.logspace,
        torch.scalar_tensor,
        torch.zeros_like,
        torch.ones_like,
        torch.full_like,
        torch.empty_like,
    }
)
# The same in ATen graphs (torch.compile), by overload packet.
_CONST_ATEN = frozenset(
    {
        torch.ops.aten.zeros,
        torch.ops.aten.ones,
        torch.ops.aten.full,
        torch.ops.aten.empty,
        torch.ops.aten.arange,
        torch.ops.aten.eye,
        torch.ops.aten.scalar_tensor,
        torch.ops.aten.zeros_like,
        torch.ops.aten.ones_like,
        torch.ops.aten.full_like,
        torch.ops.aten.empty_like,
    }
)
_EMBEDDING_FUNCTIONS = frozenset(
    {F.embedding, F.embedding_bag, torch.embedding, torch.embedding_bag}
)
_EMBEDDING_ATEN = frozenset(
    {
        torch.ops.aten.embedding,
        torch.ops.aten.embedding_bag,
        torch.ops.aten._embedding_bag,
        torch.ops.aten._embedding_bag_forward_only,
    }
)
_HOST_MODULES = frozenset({"_operator", "operator", "math", "builtins"})


def classify(analysis: Any, n: torch.fx.Node) -> str:
    """The kind of ``n`` (see :mod:`torch_stage.streams.fx.analysis`), given the
    kinds of the nodes before it (``analysis.kind``) and whether example
    shapes were recorded (``analysis.shapes_known``)."""
    if n.op in ("placeholder", "get_attr"):
        return INPUT
    if n.op == "output":
        return OUTPUT
    inputs = n.all_input_nodes
    host_inputs = all(analysis.kind[a] == HOST for a in inputs)
    if n.op == "call_function" and n.target is getattr and n.args[1] in _HOST_ATTRS:
        return HOST
    if n.op == "call_method" and n.target in _HOST_METHODS:
        return HOST
    if n.op == "call_function" and is_factory(n.target) and "out" not in n.kwargs:
        packet = getattr(n.target, "overloadpacket", n.target)
        like = str(getattr(packet, "__name__", packet)).endswith("_like")
        rest = inputs[1:] if like and inputs and n.args and n.args[0] is inputs[0] else inputs
        if all(analysis.kind[a] == HOST for a in rest):
            return CONST
    if n.op == "call_function" and inputs and host_inputs and is_host_function(n.target):
        return HOST
    if n.op == "call_method" and inputs and host_inputs:
        # A method of a host value (host nodes never hold tensors).
        return HOST
    if analysis.shapes_known and inputs and host_inputs:
        # Python computing on host values only (the example run saw no
        # tensor come out).
        if not n.meta.get("torch_stage_has_tensor", True):
            return HOST
    if (
        n.op == "call_function"
        and inputs
        and not n.users
        and (host_inputs or not any(a.meta.get("torch_stage_has_tensor", True) for a in inputs))
    ):
        # A check on host values (torch._assert on shapes), or on inputs the
        # example run saw hold no tensor (torch.fx's check that an argument
        # traced as None is None): it cannot read device memory, and nothing
        # on the device waits for it.
        return HOST
    if n.meta.get(HOST_META) or reads_metadata_only(n):
        return HOST
    return DEVICE


def is_alias(gm: torch.nn.Module, n: torch.fx.Node) -> bool:
    """A device-kind node that launches no work of its own: a view that
    cannot copy, or an ``nn.Identity`` (unless annotated)."""
    if META_KEY in n.meta:
        return False
    if n.op == "call_module":
        return isinstance(gm.get_submodule(n.target), torch.nn.Identity)
    return is_view(n) and not may_copy(n)


def is_factory(target: Any) -> bool:
    """A deterministic factory of fresh tensors (``torch.zeros(n)``)."""
    if target in _CONST_FACTORIES:
        return True
    return getattr(target, "overloadpacket", None) in _CONST_ATEN


def is_host_function(target: Any) -> bool:
    """A Python function of host values (``operator``, ``math``)."""
    return getattr(target, "__module__", None) in _HOST_MODULES


def is_embedding(gm: torch.nn.Module, n: torch.fx.Node) -> bool:
    """An embedding lookup (module, function or ATen op)."""
    if n.op == "call_module":
        return isinstance(gm.get_submodule(n.target), (torch.nn.Embedding, torch.nn.EmbeddingBag))
    if n.op == "call_function":
        target = n.target
        packet = getattr(target, "overloadpacket", target)
        return target in _EMBEDDING_FUNCTIONS or packet in _EMBEDDING_ATEN
    return False
