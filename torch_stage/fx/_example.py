"""Running a module on example inputs without leaving a trace.

The multi-stream pass runs the module on ``example_inputs`` to decide
control flow while tracing and to measure shapes for the cost model. Those
runs must not change what the user sees afterwards: gradients are off, the
random number generators are restored, buffers (batch-norm statistics) are
put back, and the inputs are copies. Parameters are not copied: a forward
that writes its own parameters in place is not supported here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List

import torch

__all__ = ["attribute", "clone_inputs", "isolated", "tensors_in"]


def attribute(root: torch.nn.Module, target: str) -> Any:
    """The attribute of ``root`` a ``get_attr`` node's ``target`` names
    (``"a.weight"``); AttributeError where there is none."""
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def tensors_in(value: Any) -> List[torch.Tensor]:
    """Every tensor in ``value``, through lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


def clone_inputs(value: Any) -> Any:
    """``value`` with every tensor replaced by a copy (same structure)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(clone_inputs(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(clone_inputs(v) for v in value)
    if isinstance(value, dict):
        return {k: clone_inputs(v) for k, v in value.items()}
    return value


@contextlib.contextmanager
def isolated(module: torch.nn.Module, inputs: Any) -> Iterator[None]:
    """No gradients, random state and buffers restored on exit."""
    devices = sorted(
        {
            t.device.index or 0
            for t in tensors_in(inputs) + list(module.parameters()) + list(module.buffers())
            if t.device.type == "cuda"
        }
    )
    saved = []
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if buf is not None:
                saved.append((owner, name, buf, buf.detach().clone()))
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for owner, name, buf, copy in saved:
                owner._buffers[name] = buf
                buf.copy_(copy)
