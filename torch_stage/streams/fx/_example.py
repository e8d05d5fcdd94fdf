"""Running a module on example inputs without leaving a trace.

The multi-stream pass runs the module on ``example_inputs`` to decide
control flow while tracing and to measure shapes for the cost model. Those
runs must not change what the user sees afterwards: gradients are off, the
random number generators are restored, buffers (batch-norm statistics) are
put back, the inputs are copies, and a parameter that forward writes in place
(a max-norm constraint, ``self.w.data.clamp_()``) is copied before the first
op that writes it and put back: all of them copied up front would double the
model's memory while planning, for a rare forward.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["attribute", "clone_inputs", "isolated", "storage_id", "tensors_in", "written_tensors"]


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


def written_tensors(func: Any, args: tuple, kwargs: dict) -> List[torch.Tensor]:
    """The tensors a call of the ATen op ``func`` writes, from its schema
    (the arguments annotated ``Tensor(a!)``)."""
    found: List[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if not arg.kwarg_only and i < len(args) else kwargs.get(arg.name)
        found.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return found


def storage_id(t: torch.Tensor) -> Any:
    """What identifies ``t``'s storage (its views, ``.data`` and tied
    tensors share it), or None for a tensor without one (a subclass's
    wrapper), which then matches nothing."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


class _KeepParameters(TorchDispatchMode):
    """Copies each parameter that an op is about to write (through the
    parameter, ``.data``, a view or ``out=``: by storage, which they share)
    and puts the copies back in :meth:`restore`."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.unsaved: Dict[Any, List[torch.nn.Parameter]] = {}
        for p in module.parameters():  # tied ones once
            key = storage_id(p)
            if key is not None:
                self.unsaved.setdefault(key, []).append(p)
        self.saved: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.unsaved:
            for t in written_tensors(func, args, kwargs):
                for p in self.unsaved.pop(storage_id(t), ()):
                    self.saved.append((p, p.detach().clone()))
        return func(*args, **kwargs)

    def restore(self) -> None:
        for p, value in self.saved:
            p.detach().copy_(value)


@contextlib.contextmanager
def isolated(module: torch.nn.Module, inputs: Any) -> Iterator[None]:
    """No gradients, random state, buffers and written parameters restored
    on exit."""
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
    keep = _KeepParameters(module)
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        try:
            with keep:
                yield
        finally:
            keep.restore()
            for owner, name, buf, copy in saved:
                owner._buffers[name] = buf
                buf.copy_(copy)
