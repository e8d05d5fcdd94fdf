"""Helpers the C++ stage runtime calls, with the GIL, for Python items.

Items are any nesting of lists, tuples, dicts and namedtuples (a pytree);
device staging takes the tensors out (flatten), copies them, and the consumer
rebuilds the item around the copies (unflatten). Non-tensor leaves pass
through unchanged.
"""

import logging

import torch
from torch.utils import _pytree as pytree

_log = logging.getLogger("torch_stage")


def flatten(obj):
    """Split an item into its tensors and what rebuilds it around them."""
    leaves, spec = pytree.tree_flatten(obj)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    for i in positions:
        leaves[i] = None
    return tensors, (spec, positions, leaves)


def unflatten(tensors, rest):
    spec, positions, leaves = rest
    leaves = list(leaves)
    for i, t in zip(positions, tensors):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


def nbytes(obj) -> int:
    """Bytes of the tensors in an item (auto-tuning's memory budget); 0 for
    what it cannot walk: a size estimate must never fail an item."""
    try:
        leaves = pytree.tree_leaves(obj)
        return sum(
            leaf.nelement() * leaf.element_size()
            for leaf in leaves
            if isinstance(leaf, torch.Tensor)
        )
    except Exception:  # noqa: BLE001 (an estimate; the item itself is fine)
        return 0


class Handled(Exception):
    """Raised by a stage owner's transform for an item whose error the owner
    recorded and raises to its consumer itself (torch_stage.DataLoader):
    listed in ignored_exception_types, the stage skips the item and goes on,
    without logging a skip."""


def on_skip(stage, index, exc):
    if isinstance(exc, Handled):
        return
    _log.warning(
        "stage '%s' skipped item %d: %s: %s (in ignored_exception_types)",
        stage,
        index,
        type(exc).__name__,
        exc,
    )
