"""Helpers the C++ stage runtime calls, with the GIL, for Python items.

Items are any nesting of lists, tuples, dicts and namedtuples (a pytree);
device staging takes the tensors out (flatten), copies them, and the consumer
rebuilds the item around the copies (unflatten). Non-tensor leaves pass
through unchanged.
"""

import logging
import threading
from typing import Optional

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


def structure(obj):
    """The structure of an item: its pytree spec and where its tensors are."""
    leaves, spec = pytree.tree_flatten(obj)
    return spec, tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))


def _signature(obj, out: list) -> bool:
    """Appends a flat signature of ``obj`` to ``out``: equal signatures mean
    equal :func:`structure`. It mirrors ``pytree.tree_flatten``'s choices
    (a namedtuple is a node whatever is registered, then the registered
    node types, anything else a leaf) and returns False at a registered
    node type other than dict, list and tuple, whose flatten it does not
    know: the caller then takes the full structure.

    Why not the structure alone: torch's Python pytree builds a TreeSpec per
    node and compares them recursively, ~30 us for a parsed records batch
    (9 keys, 6 namedtuples), paid by a producer for every item; this walk
    takes ~5.
    """
    kind = type(obj)
    if kind is dict:
        out.append(tuple(obj))  # pytree's dict context: the keys, in order
        children = obj.values()
    elif kind is tuple or kind is list:
        out.append((kind, len(obj)))
        children = obj
    else:
        named = _namedtuple(kind)
        if named is None or (not named and kind in pytree.SUPPORTED_NODES):
            return False
        if not named:
            out.append(isinstance(obj, torch.Tensor))  # a leaf
            return True
        out.append(kind)  # pytree's namedtuple context: the type
        children = obj
    for child in children:
        if not _signature(child, out):
            return False
    return True


_namedtuples: dict = {}
# Public from torch 2.6; before it, tuple subclasses take the full path.
_is_namedtuple_class = getattr(pytree, "is_namedtuple_class", None)


def _namedtuple(kind) -> Optional[bool]:
    """Whether pytree takes ``kind`` as a namedtuple; None: not known here."""
    known = _namedtuples.get(kind)
    if known is None:
        if _is_namedtuple_class is not None:
            known = _is_namedtuple_class(kind)
        elif issubclass(kind, tuple):
            return None
        else:
            known = False
        _namedtuples[kind] = known
    return known


class StructureChecker:
    """Checks that every transformed item has the first item's structure.

    Producer threads call it concurrently; Python code can switch threads
    at any point, so the first structure is set and read under a lock.
    """

    def __init__(self, tagged: bool = False):
        self._lock = threading.Lock()
        self._first = None
        self._first_signature = None  # None: undecided, the full check runs
        # Items are (position, item) pairs (a resumable stage's, see
        # stage._tagged): the item is what the user's transform returned,
        # and what a message about its structure must show.
        self._tagged = tagged

    def __call__(self, obj, index):
        if self._tagged:
            obj = obj[1]
        with self._lock:
            first, first_signature = self._first, self._first_signature
        if first_signature is not None:
            signature = []
            if _signature(obj, signature) and signature == first_signature:
                return
        current = structure(obj)
        if first is None:
            with self._lock:
                if self._first is None:
                    signature = []
                    self._first = current
                    self._first_signature = signature if _signature(obj, signature) else None
                    return
                first = self._first
        if current != first:
            raise ValueError(
                f"the transform returned a different structure for item {index} than "
                f"for the first item: {_describe(current)} instead of {_describe(first)}"
            )


def _describe(struct):
    spec, positions = struct
    return f"{spec} with tensors at leaves {list(positions)}"


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


class _Helpers:
    """This module's helpers as the C++ stage calls them; the variants
    below differ in the structure check only."""

    flatten = staticmethod(flatten)
    nbytes = staticmethod(nbytes)
    on_skip = staticmethod(on_skip)


class TaggedHelpers(_Helpers):
    """For a stage whose items are (position, item) pairs (stage._tagged):
    structure checks look at the item."""

    @staticmethod
    def StructureChecker():  # noqa: N802 - the C++ side calls helpers.StructureChecker()
        return StructureChecker(tagged=True)


class _AnyStructure:
    """A structure check that accepts every item."""

    def __call__(self, obj, index):
        pass


class AnyStructureHelpers(_Helpers):
    """For a stage whose transform may return items of any structure
    (torch_stage.DataLoader's, which stands for the end of a collate_fn: a
    short last batch carries shorter lists). Each item carries its own
    structure through flatten, so nothing else needs the check; tagged
    items flatten the same way."""

    StructureChecker = _AnyStructure
