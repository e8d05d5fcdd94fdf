"""torch_stage.DataLoader: torch.utils.data.DataLoader with staged prefetch.

Batches are produced by the usual DataLoader machinery (workers, sampler,
collate_fn) and staged ahead by background C++ threads: optionally
transformed, then copied to ``device`` (pinned, fused, reused host buffers;
one non-blocking copy per batch on a side stream), so the training loop gets
batches already on the device.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.data

from torch_stage.stage import Stage, staged

__all__ = ["DataLoader"]

_STATE_VERSION = 1


class _SkippingSampler:
    """An index sampler that skips the batches a resumed epoch already had.

    The skip happens lazily, on the first draw, so that random numbers are
    drawn in the plain DataLoader's order (the iterator's worker base seed
    when it is made, the sampler's seed at the first batch): a resumed epoch
    then replays the same order from the saved RNG state.
    """

    def __init__(self, sampler, skip: int):
        self._sampler = sampler
        self._skip = skip

    def __iter__(self):
        it = iter(self._sampler)
        for _ in itertools.islice(it, self._skip):
            pass
        yield from it

    def __len__(self) -> int:
        return len(self._sampler)


class DataLoader(torch.utils.data.DataLoader):
    """A drop-in ``torch.utils.data.DataLoader`` whose batches are staged.

    Every argument of ``torch.utils.data.DataLoader`` is accepted with the
    same meaning (``num_workers``, ``collate_fn``, ``pin_memory``,
    ``drop_last``, ``persistent_workers``, ``generator``,
    ``worker_init_fn``, ...). ``len()`` and ``sampler.set_epoch()`` work as
    before. The staging arguments are keyword-only:

    Args:
        device: deliver batches on this device (None: where collate_fn put
            them). Tensors anywhere in the batch (dicts, lists, tuples,
            namedtuples) are copied; other values pass through.
        capacity: batches staged ahead (>= 1).
        num_threads: staging threads; the loader is read by one at a time,
            ``transform`` and the copies run on all.
        stage_subgraph_stream_id: the pool stream for the copies (0: the
            consumer's current stream). The consumer's stream waits for each
            copy before the batch is handed over.
        transform: per-batch work run on the staging threads, before the
            copy to ``device``.
        timeout_millis: how long the training loop waits for a batch before
            ``StageTimeoutError`` (the plain ``timeout`` still bounds workers).
        name: the stage's name (errors, thread names, profiler ranges).

    ``state_dict()`` / ``load_state_dict()`` resume an epoch where the
    training loop was: batches staged but not yet consumed are not counted,
    so none is skipped or repeated. For map-style datasets the skipped
    batches are never loaded (so random augmentations drawn while loading
    later batches differ from the interrupted run's, as with torchdata's
    StatefulDataLoader); for iterable datasets they are read and discarded.
    """

    def __init__(
        self,
        dataset,
        batch_size: Optional[int] = 1,
        shuffle: Optional[bool] = None,
        sampler=None,
        batch_sampler=None,
        num_workers: int = 0,
        collate_fn: Optional[Callable] = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Optional[Callable] = None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        device=None,
        capacity: int = 2,
        num_threads: int = 1,
        stage_subgraph_stream_id: int = 1,
        transform: Optional[Callable[[Any], Any]] = None,
        timeout_millis: int = 300_000,
        name: Optional[str] = None,
        **loader_kwargs,
    ):
        # Validate the staging options now, before any thread or worker
        # exists, with the same rules staged() applies.
        self._stage_options = dict(
            capacity=capacity,
            num_threads=num_threads,
            stage_subgraph_stream_id=stage_subgraph_stream_id,
            transform=transform,
            timeout_millis=timeout_millis,
            device=device,
            name=name or "dataloader",
        )
        staged((), **self._stage_options).close()
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            **loader_kwargs,
        )
        self.device = None if device is None else torch.device(device)
        self._stage: Optional[Stage] = None
        self._prepared: Optional[_SkippingSampler] = None
        self._epoch: Optional[dict] = None  # the epoch in progress
        self._resume: Optional[dict] = None  # set by load_state_dict

    @property
    def _index_sampler(self):
        # The plain DataLoader's iterators read this once when made.
        if self._prepared is not None:
            return self._prepared
        return super()._index_sampler

    def _base_iterator(self, skip: int):
        map_style = not isinstance(self.dataset, torch.utils.data.IterableDataset)
        self._prepared = _SkippingSampler(super()._index_sampler, skip if map_style else 0)
        try:
            if self.persistent_workers and self.num_workers > 0 and self._iterator is not None:
                # Persistent workers: the plain DataLoader resets its one
                # iterator, which keeps its own copy of the index sampler.
                self._iterator._index_sampler = self._prepared
                self._iterator._reset(self)
                base = self._iterator
            elif self.persistent_workers and self.num_workers > 0:
                base = self._iterator = self._get_iterator()
            else:
                base = self._get_iterator()
        finally:
            self._prepared = None
        if not map_style and skip:
            base = itertools.islice(base, skip, None)
        return base

    def __iter__(self) -> Iterator[Any]:
        self.close()  # a new epoch ends the previous one
        resume, self._resume = self._resume, None
        if resume is not None:
            torch.set_rng_state(resume["rng_state"])
            if self.generator is not None and resume["generator_state"] is not None:
                self.generator.set_state(resume["generator_state"])
            skip = resume["consumed"]
        else:
            skip = 0
        self._epoch = {
            "rng_state": torch.get_rng_state(),
            "generator_state": None if self.generator is None else self.generator.get_state(),
            "consumed": skip,
        }
        self._stage = staged(self._base_iterator(skip), **self._stage_options)
        return _LoaderIter(self, self._stage, self._epoch)

    def state_dict(self) -> dict:
        """Where the training loop is in the current epoch.

        Only batches the loop has taken count; batches staged ahead do not.
        Between epochs the state is empty and loading it changes nothing.
        """
        if self._epoch is None:
            return {"version": _STATE_VERSION, "in_epoch": False}
        return {
            "version": _STATE_VERSION,
            "in_epoch": True,
            "consumed": self._epoch["consumed"],
            "rng_state": self._epoch["rng_state"].clone(),
            "generator_state": None
            if self._epoch["generator_state"] is None
            else self._epoch["generator_state"].clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` resume the saved epoch where it was.

        The sampler must be configured as when the state was saved (for a
        DistributedSampler, call ``set_epoch`` with the same epoch).
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"not a torch_stage.DataLoader state (version {_STATE_VERSION}): {state!r:.200}"
            )
        self._resume = dict(state) if state["in_epoch"] else None

    def stats(self) -> dict:
        """The current epoch's stage stats (see ``Stage.stats``)."""
        if self._stage is None:
            return {}
        return self._stage.stats()

    def close(self) -> None:
        """Stop the current epoch's staging threads (the next ``iter()``
        starts a new epoch). Worth calling before another loader restores
        this one's state in the same process: the threads read ahead and
        draw from the global RNG while they load."""
        stage, self._stage = self._stage, None
        if stage is not None:
            stage.close()

    def __del__(self):
        if "_stage" in self.__dict__:  # not when __init__ failed early
            self.close()


class _LoaderIter:
    """An epoch of a torch_stage.DataLoader."""

    def __init__(self, loader: DataLoader, stage: Stage, epoch: dict):
        self._loader = loader
        self._stage = stage
        self._epoch = epoch
        self._it = iter(stage)

    def __iter__(self) -> _LoaderIter:
        return self

    def __next__(self):
        try:
            batch = next(self._it)
        except StopIteration:
            if self._loader._epoch is self._epoch:
                self._loader._epoch = None
            self._stage.close()
            raise
        self._epoch["consumed"] += 1
        return batch

    def __len__(self) -> int:
        return len(self._loader)

    def stats(self) -> dict:
        return self._stage.stats()
