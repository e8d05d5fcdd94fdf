""":class:`RecordInput`, a shuffled, threaded reader of TFRecord files in the
manner of TensorFlow's ``RecordInput`` (``csrc/records/record_input.cpp``),
and :class:`RecordDataset`, the same as an ``IterableDataset``.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Sequence, Union

import torch

from torch_stage import _C
from torch_stage._checks import MAX_WAIT_MS, check_int, is_int
from torch_stage.records.record_io import PathLike, RecordBatch, _check_compression, _patterns

__all__ = ["RecordDataset", "RecordInput"]


class RecordInput:
    """Shuffled batches of serialized records from TFRecord files, read by
    background C++ threads (TensorFlow's ``RecordInput``).

    ``parallelism`` threads read files concurrently into a shuffle pool of
    ``buffer_size`` records; batches flow once the pool is half full, and the
    pool keeps filling to full. Records are drawn uniformly from the pool.
    With a fixed ``seed`` the batches and their order are the same every run,
    whatever the threads do (the mixer takes records from the readers in a
    fixed round-robin; see ``csrc/records/record_input.h``).

    Iteration protocol (what ``staged()`` and ``DataLoader`` wrappers rely
    on): a RecordInput is its own iterator (``iter(ri) is ri``), so it is
    consumed once. ``next(ri)`` blocks, with the GIL released, until a
    :class:`RecordBatch` is ready; the threads start on the first call (or
    :meth:`start`). It raises ``StopIteration`` once ``epochs`` passes are
    delivered (the last batch may be short), and after :meth:`close`. A bad
    file raises its :class:`~torch_stage.RecordError` subclass at the
    position where its records would have come; calling ``next`` again goes
    on with the rest of the data (the bad file's remaining records are
    skipped), so a stage may skip and count such errors. Several threads may
    call ``next`` at once; each batch goes to one of them.

    Files without records: an empty file is a valid file of no records and
    adds nothing. A pass over the files that yields no record at all (every
    file empty, unreadable, deleted, or failing before its first complete
    record, whose errors come first) ends the data, because the next pass
    would find nothing again: with a finite ``epochs`` cleanly
    (``StopIteration``, as an empty dataset; the remaining passes are not
    spun through), with ``epochs=None`` by raising a
    :class:`~torch_stage.RecordFileError` naming the files, then
    ``StopIteration``: repeating forever over files without a record could
    never give an item, and a quiet end would hide the mistake. A file cut
    short while being read (truncated or rewritten in place) raises
    :class:`~torch_stage.RecordFileError` ("shrank while being read")
    rather than ending early; one deleted raises it ("cannot open") when a
    later pass reaches it.

    Args:
        file_pattern: a path, glob pattern, or list of them.
        parallelism: reader threads (at most one per file).
        buffer_size: records in the shuffle pool.
        batch_size: records per batch.
        seed: seed of the file order and the pool's draws; None for a
            random seed (and a different order every run).
        shift_ratio: in [0, 1): each epoch's shuffled file list is rotated by
            ``shift_ratio * files``, so workers sharing files start apart.
        compression: None / ``""``, ``"GZIP"`` or ``"ZLIB"``.
        shard: ``(rank, world_size)``: this reader gets the sorted files
            ``[rank::world_size]`` (sharding is by file).
        epochs: passes over the files, or None to repeat forever (as
            TensorFlow's RecordInput does).
        prefetch_batches: finished batches that may wait for the consumer.

    Raises (at construction, before any thread starts):
        RecordFileError: no file matches the pattern.
        ValueError / TypeError: a bad argument, naming it and the rule.
    """

    def __init__(
        self,
        file_pattern: Union[PathLike, Sequence[PathLike]],
        parallelism: int = 16,
        buffer_size: int = 10000,
        batch_size: int = 32,
        seed: Optional[int] = 301,
        shift_ratio: float = 0.0,
        compression: Optional[str] = None,
        shard=(0, 1),
        epochs: Optional[int] = None,
        *,
        prefetch_batches: int = 2,
    ):
        self._handle = None
        patterns = _patterns(file_pattern, "file_pattern")
        check_int("parallelism", parallelism, 1, ">= 1")
        check_int("buffer_size", buffer_size, 1, ">= 1")
        check_int("batch_size", batch_size, 1, ">= 1")
        check_int("prefetch_batches", prefetch_batches, 1, ">= 1")
        if seed is not None:
            check_int("seed", seed, 0, ">= 0 (or None for a random seed)", 2**64 - 1)
        if isinstance(shift_ratio, bool) or not isinstance(shift_ratio, (int, float)):
            raise TypeError(f"shift_ratio must be a float, got {shift_ratio!r}")
        if not 0.0 <= shift_ratio < 1.0:
            raise ValueError(f"shift_ratio must be in [0, 1), got {shift_ratio}")
        compression = _check_compression(compression)
        if (
            not isinstance(shard, (tuple, list))
            or len(shard) != 2
            or not all(is_int(v) for v in shard)
        ):
            raise TypeError(f"shard must be a (rank, world_size) pair of ints, got {shard!r}")
        rank, world = (operator.index(v) for v in shard)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(
                f"shard must be (rank, world_size) with world_size >= 1 and "
                f"0 <= rank < world_size, got {tuple(shard)}"
            )
        if epochs is not None:
            check_int("epochs", epochs, 1, ">= 1 (or None to repeat forever)")
        self.batch_size = batch_size
        self.epochs = epochs
        self._handle = _C._RecordInput(
            patterns,
            parallelism,
            buffer_size,
            batch_size,
            seed,
            float(shift_ratio),
            compression,
            rank,
            world,
            -1 if epochs is None else epochs,
            prefetch_batches,
        )

    @property
    def files(self) -> List[str]:
        """The files this reader reads (its shard), sorted."""
        return list(self._handle.files)

    def start(self) -> None:
        """Start the threads now rather than on the first ``next()``."""
        self._handle.start()

    def __iter__(self) -> RecordInput:
        return self

    def __next__(self) -> RecordBatch:
        return RecordBatch(*self._handle.take(-1))

    def next_batch(self, timeout: Optional[float] = None) -> Optional[RecordBatch]:
        """As ``next()``, but return None if no batch came within ``timeout``
        seconds (None waits without bound; 0 only tries)."""
        if timeout is None:
            return next(self)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout must be a number >= 0 or None, got {timeout!r}")
        # inf and other waits beyond the C++ side's reach: as long as it can.
        got = self._handle.take(int(min(timeout * 1000, MAX_WAIT_MS)))
        return None if got is None else RecordBatch(*got)

    def close(self) -> None:
        """Stop and join the threads; waiting ``next()`` calls raise
        StopIteration. Idempotent."""
        if self._handle is not None:
            self._handle.close()

    def stats(self) -> dict:
        """``files``, ``readers``, ``records_read``, ``records_out``,
        ``batches_out``, ``errors``, ``pool_size``, ``epoch``,
        ``buffer_bytes`` (the file blocks the pool's records lie in, as of
        the last batch: the pool's memory), ``records_compacted`` (records
        moved to free a nearly empty block), ``started``, ``closed``."""
        return self._handle.stats()

    def __enter__(self) -> RecordInput:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __del__(self):
        # Garbage collection stops the threads too (close() joins them; they
        # never need the GIL, so this cannot deadlock).
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()

    def __repr__(self) -> str:
        if self._handle is None:
            return "RecordInput(<not constructed>)"
        s = self._handle.stats()
        return (
            f"RecordInput(files={s['files']}, readers={s['readers']}, "
            f"batch_size={self.batch_size}, epochs={self.epochs}, closed={s['closed']})"
        )


class RecordDataset(torch.utils.data.IterableDataset):
    """TFRecord batches as an ``IterableDataset``, for ``torch_stage.DataLoader``
    (or ``torch.utils.data.DataLoader``) with ``batch_size=None``.

    Each iteration makes its own :class:`RecordInput`, in the process that
    iterates (reader threads do not survive a fork into DataLoader workers).
    With ``num_workers > 0``, worker ``w`` of ``W`` reads file shard
    ``rank * W + w`` of ``world_size * W``, so every file is read by exactly
    one worker of one rank: there must be at least that many files.

    Args:
        file_pattern: as for :class:`RecordInput`.
        **kwargs: the other :class:`RecordInput` arguments (``epochs``
            defaults to 1 here: one pass per DataLoader epoch).

    Example::

        loader = torch_stage.DataLoader(
            torch_stage.RecordDataset("train-*.tfrecord", batch_size=256),
            batch_size=None, num_workers=2,
            transform=lambda batch: torch_stage.parse_example(batch, features),
            device="cuda")
    """

    def __init__(self, file_pattern, **kwargs):
        kwargs.setdefault("epochs", 1)
        self.file_pattern = file_pattern
        self.kwargs = kwargs
        # Check the arguments and the files now (no thread starts until a
        # RecordInput is iterated).
        RecordInput(file_pattern, **kwargs).close()

    def __iter__(self) -> RecordInput:
        rank, world = self.kwargs.get("shard", (0, 1))
        info = torch.utils.data.get_worker_info()
        if info is not None:
            rank, world = rank * info.num_workers + info.id, world * info.num_workers
        kwargs = dict(self.kwargs, shard=(rank, world))
        return RecordInput(self.file_pattern, **kwargs)
