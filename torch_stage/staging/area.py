"""The staging buffer: a bounded, blocking queue of tensor bundles in C++."""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import torch

from torch_stage import _C
from torch_stage._checks import check_int
from torch_stage.errors import StageClosed

__all__ = ["StagingArea"]


def _check_timeout(timeout_ms) -> int:
    return check_int("timeout_ms", timeout_ms, 0, ">= 0 (0 tries once without waiting)")


class StagingArea:
    """A bounded multi-producer, multi-consumer buffer of tensor bundles.

    The buffer lives in C++ (``torch.classes.torch_stage.StagingArea``), so
    producers and consumers in other threads, in TorchScript or in C++ share it
    without the GIL: every blocking call releases the GIL while it waits.

    From Python, puts and takes go through a fast path that holds the GIL only
    while they do not wait and releases it while they do; a main thread
    blocked in ``put`` or ``take`` still receives KeyboardInterrupt.

    Semantics: at most ``capacity`` bundles (and, if ``byte_limit > 0``, at
    most that many bytes) wait in the buffer; ``put`` blocks while it is full
    and ``take`` while it is empty. Bundles leave in FIFO order and each goes
    to exactly one consumer. ``close()`` refuses further puts and lets
    consumers drain what is buffered, after which ``take`` raises
    :class:`~torch_stage.StageClosed` (end of stream). ``cancel()`` wakes every
    waiter with :class:`~torch_stage.StageCancelled` and discards the buffered
    bundles.

    Args:
        capacity: the most bundles held at once (>= 1).
        byte_limit: the most bytes held at once, 0 for no limit (>= 0).

    Example::

        area = torch_stage.StagingArea(capacity=4)
        area.put([x, y])          # in a producer thread
        x, y = area.take()        # in a consumer thread
    """

    def __init__(self, capacity: int, byte_limit: int = 0):
        check_int("capacity", capacity, 1, ">= 1")
        check_int("byte_limit", byte_limit, 0, ">= 0 (0 means no limit)")
        self._area = torch.classes.torch_stage.StagingArea(capacity, byte_limit)
        self._fast = _C._StagingAreaHandle(self._area)

    @classmethod
    def wrap(cls, script_object) -> StagingArea:
        """Wrap an existing ``torch.classes.torch_stage.StagingArea`` object,
        for instance the attribute of a scripted or loaded module."""
        fast = _C._StagingAreaHandle(script_object)  # checks the type
        area = cls.__new__(cls)
        area._area = script_object
        area._fast = fast
        return area

    @property
    def script_object(self):
        """The underlying TorchScript object, to store on a module that will be
        scripted (``self.area = staging_area.script_object``)."""
        return self._area

    def put(self, tensors: Sequence[torch.Tensor]) -> None:
        """Append a bundle, blocking while the buffer is full.

        Raises:
            StageClosed: the buffer is (or becomes) closed.
            StageCancelled: the buffer is (or becomes) cancelled.
            ValueError: the bundle is larger than ``byte_limit``.
        """
        self._fast.put(tensors, -1)

    def try_put(self, tensors: Sequence[torch.Tensor], timeout_ms: int) -> bool:
        """As :meth:`put`, but return False if no room was free within
        ``timeout_ms`` milliseconds (0: try once). The bundle is not kept."""
        return self._fast.put(tensors, _check_timeout(timeout_ms))

    def take(self) -> List[torch.Tensor]:
        """Remove and return the oldest bundle, blocking while none is ready.

        Raises:
            StageClosed: the buffer is closed and drained (end of stream).
            StageCancelled: the buffer is (or becomes) cancelled.
        """
        return self._fast.take(-1)

    def try_take(self, timeout_ms: int) -> Optional[List[torch.Tensor]]:
        """As :meth:`take`, but return None if no bundle was ready within
        ``timeout_ms`` milliseconds (0: try once)."""
        return self._fast.take(_check_timeout(timeout_ms))

    def close(self) -> None:
        """Refuse further puts; consumers drain, then see StageClosed."""
        self._area.close()

    def cancel(self) -> None:
        """Wake every waiter with StageCancelled and discard buffered bundles."""
        self._area.cancel()

    def is_closed(self) -> bool:
        return self._area.is_closed()

    def is_cancelled(self) -> bool:
        return self._area.is_cancelled()

    def size(self) -> int:
        """Bundles buffered now."""
        return self._area.size()

    def capacity(self) -> int:
        return self._area.capacity()

    def byte_limit(self) -> int:
        return self._area.byte_limit()

    def stats(self) -> dict:
        """Counters: ``put``, ``taken``, ``dropped`` (discarded by cancel),
        ``size``, ``bytes``, ``max_size``, ``occupancy_sum`` (items found by
        takes, summed), ``consumer_wait_ns``, ``producer_blocked_ns``, and the
        ``capacity``, ``byte_limit``, ``closed`` and ``cancelled`` settings."""
        return dict(self._area.stats())

    def __len__(self) -> int:
        return self.size()

    def __iter__(self) -> Iterator[List[torch.Tensor]]:
        """Take bundles until the buffer is closed and drained."""
        while True:
            try:
                yield self.take()
            except StageClosed:
                return

    def __enter__(self) -> StagingArea:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Leaving normally means the producer side is done: let consumers
        # drain. Leaving on an error must not leave anyone waiting forever.
        if exc_type is None:
            self.close()
        else:
            self.cancel()

    def __repr__(self) -> str:
        return (
            f"StagingArea(capacity={self.capacity()}, byte_limit={self.byte_limit()}, "
            f"size={self.size()}, closed={self.is_closed()})"
        )
