"""Staged prefetch: ``staged()``, ``Stage``, ``make_prefetch_hook()`` and stage
thread pools (the PyTorch counterpart of DeepRec's ``tf.staged``)."""

from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import ctypes
import itertools
import operator
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from torch_stage import _C
from torch_stage._checks import MAX_STAGE_THREADS, MAX_THREADS, check_int, is_int
from torch_stage.errors import StageClosed, StageTimeoutError
from torch_stage.staging import _pytree

__all__ = ["Stage", "add_stage_thread_pool", "make_prefetch_hook", "staged"]

_MAX_STREAMS = _C._MAX_STREAMS
_names = itertools.count()
_creation = itertools.count()
_live: weakref.WeakSet[Stage] = weakref.WeakSet()
# Per thread: the stage lists of its active make_prefetch_hook blocks,
# innermost last. A hook owns what its own thread makes in its block: a
# stage made on another thread belongs to that thread's code.
_hooks = threading.local()
_registry_lock = threading.Lock()
# How long close() waits for a producer stuck in user code before leaving it.
_JOIN_TIMEOUT_MS = 10_000
# At interpreter exit a producer stuck in user code is not waited for long:
# it is left behind (parked if it ever wants the GIL again, see
# csrc/python/bindings.h), and every live stage shares this one bound.
_EXIT_JOIN_TIMEOUT_MS = 1_000
# Set once the interpreter exits (_close_all): the threads still iterating
# then are daemon threads, which the interpreter leaves where they are.
_exiting = False
# Stage.state_dict()'s format; load_state_dict() reads only this version.
_STATE_VERSION = 1
_STATE_TYPE = "torch_stage.Stage"


def _check_exception_types(name: str, types) -> tuple:
    if isinstance(types, type):
        types = (types,)
    if not isinstance(types, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of exception classes, got {types!r}")
    for t in types:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise TypeError(f"{name} must hold exception classes only, got {t!r}")
    return tuple(types)


def _check_device(device) -> Optional[torch.device]:
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a device: {exc}") from None
    if dev.type == "cpu":
        return dev
    module = getattr(torch, dev.type, None)
    if not (callable(getattr(module, "is_available", None)) and hasattr(module, "device_count")):
        # Not an accelerator (meta, mkldnn, ...): nothing to copy items to.
        raise ValueError(
            f"device {device!r} is not one to stage to: its type must be "
            f"{_staging_device_types()} (the CPU, or this machine's accelerator), "
            f"got {dev.type!r}"
        )
    count = module.device_count() if module.is_available() else 0
    index = dev.index if dev.index is not None else 0
    if index >= count:
        raise ValueError(
            f"device {device!r} does not exist: {count} {dev.type} device(s) are visible "
            f"(device types to stage to here: {_staging_device_types()})"
        )
    return dev


def _staging_device_types() -> str:
    types = ["cpu"]
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is not None:
        types.append(current.type)
    return " or ".join(repr(t) for t in types)


class Stage:
    """Items of a source, produced ahead by background C++ threads (or, where
    auto-tuning finds that no thread pays, by the consumer in ``next()``).

    Made by :func:`staged`; see it for the arguments. A stage is a one-pass
    stream: iterate it (from several threads if need be) to get the items,
    in source order when ``ordered``. It starts on first use, or
    eagerly under :func:`make_prefetch_hook`, and stops on :meth:`close`,
    when leaving a ``with`` block, when garbage collected, and at interpreter
    exit.
    """

    def __init__(self, source, *, _options: dict):
        self._name = _options["name"]
        self._order = next(_creation)
        self._timeout_ms = _options["timeout_ms"]
        self._ordered = _options["ordered"] or _options["num_threads"] == 1
        self._resume_kind = None if _options["call_source"] else _resume_kind(source)
        self._source_type = type(source).__name__
        # A generator, for _close_all (_keep_if_running).
        self._generator = source if hasattr(source, "gi_running") else None
        self._cursor: Optional[_Cursor] = None
        _options = dict(_options)
        # A DataLoader's stages are its iterators' (made and closed by them):
        # never a hook's to prime or close.
        self._thread = None if _options.pop("internal") else threading.current_thread()
        if self._resume_kind is not None:
            # Resumable: items travel tagged with their source position (see
            # _Cursor), so the state counts exactly what consumers received.
            self._cursor = _Cursor(source, self._resume_kind, _options["ignored_types"])
            source = self._cursor
            transform = _options["transform"]
            if transform is not None:
                _options = dict(_options, transform=_tagged(transform))
        self._impl = _C._Stage(
            source=source,
            helpers=_pytree,
            warn=_warn,
            join_timeout_ms=_JOIN_TIMEOUT_MS,
            **_options,
        )
        with _registry_lock:
            _live.add(self)
        hooks = _hook_stack() if self._thread is not None else None
        if hooks:
            hooks[-1].append(self)
            self._prime()

    @property
    def name(self) -> str:
        return self._name

    def start(self) -> None:
        """Start the stage now (otherwise the first take does): all of its
        producer threads, or, auto-tuned, those the tuner's first setting
        lets work (the others start when a setting first does)."""
        self._impl.start()

    def __iter__(self) -> Iterator[Any]:
        """A consumer's iterator. Several threads may each iterate the stage:
        every item goes to exactly one of them and each sees the end."""
        return _Client(self)

    def close(self) -> None:
        """Stop the producers and join them; buffered items are discarded."""
        impl = getattr(self, "_impl", None)
        if impl is not None:
            impl.close()

    def _tuning_memory(self) -> Optional[dict]:
        """What auto-tuning learnt (setting, back-off), for a later stage of
        the same work: ``staged(..., _tuning_memory=...)``. None unless
        auto-tuned."""
        return self._impl.tuning_memory()

    def stats(self) -> dict:
        """Counters and times, enough to tell input-bound from compute-bound.

        ``produced``, ``consumed``, ``skipped`` (ignored exceptions),
        ``dropped`` (only with the opt-in ``put_timeout_millis``),
        ``discarded`` (buffered when closed), ``errors``; seconds spent:
        ``consumer_wait_s`` (consumers waiting for items: input-bound when
        large), ``producer_blocked_s`` (producers waiting for space or for
        their turn: compute-bound when large), ``inline_s`` (consumers
        making items themselves, ``inline_items`` of them, while no producer
        thread was at work), ``loop_s`` (from the start of consumers' first
        take to the end of their last), ``source_s``, ``transform_s``,
        ``copy_s`` (device staging on the host), ``gil_wait_s`` (producers
        waiting for the GIL); ``mean_occupancy`` and ``max_occupancy`` of the
        buffer as consumers found it, ``capacity``, ``threads`` (producer
        threads at work now); ``bound``: "input", "compute" or "balanced" by
        those waits (where consumers made every item, by the share of their
        loop spent making them). With ``device``:
        ``staged_items``, ``staged_bytes``, ``fused_tensors`` (gathered into
        one transfer per item), ``pinned_direct_copies`` (large pinned
        tensors sent as they are), ``pinned_buffers``,
        ``pinned_buffer_reuses`` and ``pinned_buffer_waits`` (reuses that
        waited for the copy still reading the buffer).
        """
        s = self._impl.stats()
        # Consumers making items themselves are as input-bound as waiting.
        wait = s["consumer_wait_s"] + s["inline_s"]
        blocked = s["producer_blocked_s"]
        if s["inline_items"] and s["produced"] <= s["inline_items"]:
            # No producer thread made an item, so none was ever blocked:
            # the compute side is the rest of the consumers' loop.
            blocked = max(s["loop_s"] - wait, 0.0)
        if wait > 2 * blocked and wait > 0:
            s["bound"] = "input"
        elif blocked > 2 * wait and blocked > 0:
            s["bound"] = "compute"
        else:
            s["bound"] = "balanced"
        return s

    def describe(self) -> str:
        """What each producer thread is doing now."""
        return self._impl.describe()

    def state_dict(self) -> dict:
        """Where the consumers are in the source, to resume from there.

        Only items a consumer has received count: items produced ahead and
        still in the buffer (or in a producer's hands) do not, so a new
        pipeline built the same way and given this state with
        :meth:`load_state_dict` yields exactly the items not yet received,
        in the same order. An item that raised is not counted (the resumed
        stage reads it again); items skipped by ``ignored_exception_types``
        before a received item are.

        The source must be one of (checked here and by
        :meth:`load_state_dict`):

        * **re-iterable**: an iterable that is not its own iterator (a list,
          a range, a map-style Dataset, an object whose ``__iter__`` makes a
          fresh iterator) and that gives the same items in the same order
          each time it is iterated. Resuming iterates it again and reads
          and discards the items already received (a DataLoader that
          shuffles is not such a source; ``torch_stage.DataLoader`` is
          stateful, below).
        * **stateful** (torchdata's ``Stateful`` protocol): it has
          ``state_dict()`` and ``load_state_dict(state)``, and iterating it
          after ``load_state_dict`` continues from the loaded state, as
          torchdata's ``StatefulDataLoader``, ``torch_stage.DataLoader`` and
          another :class:`Stage` do. Its ``state_dict()`` is taken (and
          deep-copied) after each item the producers read, like torchdata's
          ``snapshot_frequency=1``, and saved with the item's position.

        Returns:
            A dict of plain values (``torch.save``-able): ``version``,
            ``type``, ``source`` ("iterable" or "stateful"), ``position``
            (source items received or skipped), and for a stateful source
            ``source_state`` and ``source_position`` (the position it
            describes).

        Raises:
            TypeError: the source is a one-pass iterator (a generator, a
                RecordInput...) or a callable: neither re-iterable nor
                stateful, so there is nothing to resume from.
            ValueError: ``ordered=False`` with ``num_threads > 1``: items
                arrive out of order, so there is no single resume point.
        """
        cursor = self._resumable_cursor("state_dict")
        return cursor.state()

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`'s state: the stage then yields the
        items its saver had not received, in the same order.

        Call it on a new stage built the same way (same source contents,
        same ``transform``), before its first item is taken or it is
        started (stages made inside :func:`make_prefetch_hook` start at
        once: build and load them before entering it). A stateful source's
        ``load_state_dict`` is called here.

        Raises:
            RuntimeError: the stage has started (or is closed).
            TypeError: the source is neither re-iterable nor stateful (see
                :meth:`state_dict`).
            ValueError: not a Stage state, a state of another version, or
                one saved over the other kind of source.
        """
        cursor = self._resumable_cursor("load_state_dict")
        if not isinstance(state, dict) or state.get("type") != _STATE_TYPE:
            raise ValueError(
                f"not a torch_stage.Stage state (a dict with type "
                f"{_STATE_TYPE!r}), got {state!r:.200}"
            )
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"stage '{self._name}' reads state version {_STATE_VERSION}, the state has "
                f"version {state.get('version')!r}: it was saved by another torch_stage"
            )
        if state.get("source") != cursor.kind:
            raise ValueError(
                f"the state was saved over a {state.get('source')!r} source, stage "
                f"'{self._name}' has a {cursor.kind!r} one: build the pipeline as it was"
            )
        if self._impl.started or self._impl.closed:
            raise RuntimeError(
                f"load_state_dict() on stage '{self._name}' after it "
                f"{'was closed' if self._impl.closed else 'started'}: its producers have "
                "read from the source already; load the state into a new stage before "
                "taking its first item"
            )
        cursor.load(state)

    def _resumable_cursor(self, what: str) -> _Cursor:
        if self._cursor is None:
            raise TypeError(
                f"{what}(): stage '{self._name}' cannot be resumed: its source (a "
                f"{self._source_type}) is a callable or a one-pass iterator (it is its "
                "own iterator and has no state_dict()/load_state_dict(); a Stage over "
                "such a source is one too). Give staged() a re-iterable source "
                "(a list, a Dataset, an object whose __iter__ makes a fresh iterator) "
                "or a stateful one (state_dict() and load_state_dict(), as torchdata's "
                "StatefulDataLoader)"
            )
        if not self._ordered:
            raise ValueError(
                f"{what}(): stage '{self._name}' has ordered=False with several "
                "producer threads: items arrive out of source order, so no position "
                "says which were received; use ordered=True to save and resume"
            )
        return self._cursor

    @property
    def _resumable(self) -> bool:
        return self._cursor is not None and self._ordered

    def _prime(self) -> None:
        # Warm-up as tf_cnn_benchmarks does: one item in the buffer before the
        # first step, so the first step does not wait for a full pipeline.
        # With no producer at work the caller makes the item, as the first
        # next() would have (prime() returns once it is buffered).
        self._impl.prime()
        deadline = time.monotonic() + self._timeout_ms / 1000
        while self._impl.buffered() == 0 and not self._impl.finished:
            if time.monotonic() > deadline:
                raise StageTimeoutError(
                    f"stage '{self._name}' produced no item within timeout_millis="
                    f"{self._timeout_ms} while priming: {self._impl.describe()}"
                )
            time.sleep(0.001)

    def __enter__(self) -> Stage:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __del__(self):
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._impl.closed else "started" if self._impl.started else "new"
        return f"Stage(name={self._name!r}, {state})"


class _Client:
    """One consumer's iterator over a stage."""

    __slots__ = ("_stage", "_next", "_cursor", "_done")

    def __init__(self, stage: Stage):
        self._stage = stage  # keeps the stage open while it is iterated
        self._next = stage._impl.next
        self._cursor = stage._cursor
        self._done = False

    def __iter__(self) -> _Client:
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            item = self._next()
        except StopIteration:
            self._done = True
            raise
        except StageClosed:
            if _exiting and threading.current_thread() is not threading.main_thread():
                _park_daemon()
            raise
        if self._cursor is None:
            return item
        position, item = item
        self._cursor.received(position)
        return item


def _resume_kind(source) -> Optional[str]:
    """ "stateful", "iterable" or None (cannot be resumed)."""
    if isinstance(source, Stage):
        # A stage is stateful only over a resumable source of its own.
        return "stateful" if source._resumable else None
    if callable(getattr(source, "state_dict", None)) and callable(
        getattr(source, "load_state_dict", None)
    ):
        return "stateful"
    # An iterator (has __next__) is consumed once; an iterable without
    # __next__ makes a fresh iterator on each iter() (a list, a Dataset).
    iterable = hasattr(source, "__iter__") or hasattr(source, "__getitem__")
    if iterable and not hasattr(source, "__next__"):
        return "iterable"
    return None


def _tagged(transform: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def run(tagged):
        return tagged[0], transform(tagged[1])

    return run


class _Cursor:
    """The source a resumable stage's producers read: its iterator yields
    ``(position, item)``, ``position`` counting source items from the
    start of the source (across resumes), and it records where the
    consumers are.

    Threads: ``__iter__`` and ``__next__`` run on producer threads, one
    at a time (the stage reads its source under a lock); ``received`` on
    consumer threads; ``state`` on any; ``load`` before the stage starts.
    ``_lock`` guards ``_received`` and ``_snapshots``; ``_pulled``,
    ``_skip`` and ``_it`` belong to the producer reading the source.
    """

    def __init__(self, source, kind: str, ignored: tuple):
        self.kind = kind
        self._source = source
        self._ignored = ignored
        self._lock = threading.Lock()
        self._it = None  # the stateful source's iterator
        self._pulled = 0  # the position of the next source item
        self._skip = 0  # items to read and drop before the first (resume)
        self._received = 0  # 1 + the last position a consumer received
        # (position, source state at that position), oldest first; the
        # oldest is always <= _received.
        self._snapshots: collections.deque = collections.deque()
        if kind == "stateful":
            self._snapshots.append((0, copy.deepcopy(source.state_dict())))

    def __iter__(self):
        # The stage calls this once, on a producer thread, before its first
        # item: the resume's reading and discarding happens there, off the
        # consumer's thread.
        it = iter(self._source)
        while self._skip > 0:
            self._skip -= 1
            try:
                next(it)
            except StopIteration:
                break
            except self._ignored:
                pass  # skipped in the saved run as well
        if self.kind == "iterable" and hasattr(it, "__iter__"):
            # No Python frame per item: a Python __next__ on the producer
            # thread fights the consumer for the GIL (about 5x the cost of
            # an item). zip advances the count before it reads the source,
            # so an item that raises takes its position, as in __next__.
            return zip(itertools.count(self._pulled), it)
        self._it = it
        return self

    def __next__(self):
        position = self._pulled
        try:
            item = next(self._it)
        except StopIteration:
            raise
        except BaseException:
            self._advance()
            raise
        self._advance()
        return position, item

    def _advance(self) -> None:
        self._pulled += 1
        if self.kind != "stateful":
            return
        snapshot = copy.deepcopy(self._source.state_dict())
        with self._lock:
            self._snapshots.append((self._pulled, snapshot))
            # Keep the newest snapshot at or before the consumers.
            while len(self._snapshots) > 1 and self._snapshots[1][0] <= self._received:
                self._snapshots.popleft()

    def received(self, position: int) -> None:
        with self._lock:
            if position >= self._received:
                self._received = position + 1

    def state(self) -> dict:
        with self._lock:
            position = self._received
            state = {
                "version": _STATE_VERSION,
                "type": _STATE_TYPE,
                "source": self.kind,
                "position": position,
            }
            if self.kind == "stateful":
                base = max((s for s in self._snapshots if s[0] <= position), key=lambda s: s[0])
                state["source_position"] = base[0]
                state["source_state"] = copy.deepcopy(base[1])
            return state

    def load(self, state: dict) -> None:
        position = state.get("position")
        if not is_int(position) or position < 0:
            raise ValueError(f"the state's position must be an int >= 0, got {position!r}")
        position = operator.index(position)
        base = 0
        if self.kind == "stateful":
            base = state.get("source_position")
            if not is_int(base) or not 0 <= base <= position or "source_state" not in state:
                raise ValueError(
                    "a stateful source's state needs source_state and a source_position "
                    f"in [0, position={position}], got {base!r}"
                )
            base = operator.index(base)
            self._source.load_state_dict(copy.deepcopy(state["source_state"]))
        with self._lock:
            self._pulled = position
            self._received = position
            self._skip = position - base
            if self.kind == "stateful":
                self._snapshots = collections.deque([(base, copy.deepcopy(state["source_state"]))])


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def staged(
    source,
    *,
    capacity: Optional[int] = None,
    num_threads: Optional[int] = None,
    num_clients: int = 1,
    timeout_millis: Optional[int] = None,
    closed_exception_types=(StopIteration,),
    ignored_exception_types=(),
    use_stage_subgraph_thread_pool: bool = False,
    stage_subgraph_thread_pool_id: int = 0,
    stage_subgraph_stream_id: int = 1,
    name: Optional[str] = None,
    feed_dict: Optional[dict] = None,
    device=None,
    transform: Optional[Callable[[Any], Any]] = None,
    ordered: bool = True,
    put_timeout_millis: Optional[int] = None,
    autotune: bool = True,
    _min_threads: Optional[int] = None,
    _initial_threads: Optional[int] = None,
    _tuning_memory: Optional[dict] = None,
    _internal: bool = False,
    _item_errors: bool = False,
) -> Stage:
    """Produce the items of ``source`` ahead of the consumer, in C++ threads.

    The PyTorch counterpart of DeepRec's ``tf.staged``: reading (the source),
    the per-item work (``transform``) and the copy to ``device`` run in
    background threads into a bounded buffer, so a training step costs
    ``max(data, compute)`` instead of ``data + compute``.

    Args:
        source: an iterable or iterator (a DataLoader, a generator, another
            Stage), or, if not iterable, a callable re-run for every item
            (with ``feed_dict`` as keyword arguments). Items are tensors,
            lists, tuples, dicts or any nesting of them; other leaves pass
            through unchanged. Exhausting an iterable ends the stream.
        capacity: finished items that may wait in the buffer (>= 1). None
            (default): chosen by auto-tuning, from 2 up to 16 items and a
            memory budget (see ``autotune``); 1 without it.
        num_threads: producer threads (>= 1); the source is read by one at a
            time, the transform and the copy run on all at once. None
            (default): chosen by auto-tuning between none and the cores
            this process may use (at most 8), starting from none: the
            consumer makes each item itself in ``next()``, as the same loop
            over ``source`` would, until a thread pays (one to overlap
            making items with the rest of the loop, two when the loop only
            gathers items and the transform can run side by side), so a
            stage never costs what a thread the machine cannot spare would
            (on a small machine one can slow the loop's own work by a
            third). Items, order, errors and end of data are the same
            either way. A consumer making an item waits for no producer, so
            no timeout bounds it: with ``timeout_millis`` given, tuning
            starts from one thread and never goes below it. A stage primed by
            :func:`make_prefetch_hook` with no thread at work has its first
            item made by the hook's caller. 1 without auto-tuning. Give a
            number for threads from the first item.
        autotune: choose what ``capacity`` and ``num_threads`` leave as
            None while the stage runs (tf.data's AUTOTUNE, measured instead
            of modelled): windows of items are timed at the consumer, and a
            thread more (when the consumer waits), a deeper buffer (when it
            waits while producers are blocked: bursty production) or a
            thread fewer (when it does not wait) is tried for a window and
            kept only when the consumer's rate says so. Trials take at most
            a twentieth of the windows so far (the first waits for window
            20), since a short run cannot earn back one that did not pay.
            Capacity stays within
            1/16 of the machine's memory (at most 2 GiB) over the first
            item's size. ``stats()["threads"]``, ``stats()["capacity"]`` and
            ``stats()["tuning"]["decisions"]`` say what it chose and why.
            Explicit values are never changed.
        num_clients: consumers served at once (>= 1; DeepRec's Take pool).
            Any number of threads may iterate the stage; beyond
            ``num_clients`` they wait for a turn. Each item goes to exactly
            one consumer, and every consumer sees the end of the stream.
        timeout_millis: how long a consumer waits for an item before
            :class:`~torch_stage.StageTimeoutError`, which says what the
            producers are doing (> 0). Given, a hung source or transform
            raises it, so tuned threads never go below one (an item the
            consumer made itself could hang it). None (default): 300000,
            and tuned threads may go down to none.
        closed_exception_types: exceptions from the source or transform that
            end the stream; the items before are delivered first.
        ignored_exception_types: exceptions that skip the item (counted in
            ``stats()["skipped"]`` and logged to the ``torch_stage`` logger).
            Any other exception stops the producers and is raised to the
            consumer at that item's position, with its type and traceback.
        use_stage_subgraph_thread_pool: run the producers under a pool from
            :func:`add_stage_thread_pool`...
        stage_subgraph_thread_pool_id: ...this one (the id it returned).
            Otherwise producers use the default settings: one intra-op thread
            each, named ``torch_stage:<name>:<i>`` (in ``torch_stage.trace``;
            Linux keeps 15 characters, so ``top -H`` shows ``ts:<name>:<i>``
            with the name cut to fit where the whole does not).
        stage_subgraph_stream_id: with ``device``, the staging stream the
            copies run on (1..31: torch_stage's own staging streams, which
            no multi-stream plan or CUDA graph capture uses), or 0 for the
            consumer's current stream, which queues each copy behind the
            consumer's compute (no overlap). Consumers' streams always wait
            for the copy before they get the item.
        name: the stage's name, in errors, thread names and profiler ranges.
        feed_dict: keyword arguments for a callable source.
        device: copy items' tensors to this device (pinned, fused, reused host
            buffers; one non-blocking copy per item). Pinned tensors of
            256 KiB or more (a ``pin_memory=True`` loader's) are copied from
            where they are, after the source has moved on: as with any
            non-blocking copy, the source must not write into a tensor it
            yielded. None: no copy.
        transform: per-item work, run by the producer threads in parallel.
            Items may come out of it with any structure, each its own (as
            from a ``collate_fn``: a short last batch carries shorter lists).
        ordered: deliver in source order even with several threads (True) or
            as items finish (False).
        put_timeout_millis: opt-in DeepRec behaviour: a producer that waits
            this long for buffer space discards its item (counted in
            ``stats()["dropped"]`` and warned; an item the consumer makes
            itself is never dropped). None (default): never drop.

    Returns:
        The :class:`Stage`. Iterate it; ``with staged(...) as stage:`` closes
        it on exit. Over a re-iterable or stateful source it can be saved
        and resumed with :meth:`Stage.state_dict` /
        :meth:`Stage.load_state_dict` (see there for what a source must
        provide).

    Raises:
        ValueError, TypeError: a bad argument, before any thread starts.
    """
    if capacity is not None:
        check_int("capacity", capacity, 1, ">= 1 (or None: auto-tuned)")
    if num_threads is not None:
        check_int("num_threads", num_threads, 1, ">= 1 (or None: auto-tuned)", MAX_STAGE_THREADS)
    if not isinstance(autotune, bool):
        raise TypeError(f"autotune must be a bool, got {autotune!r}")
    if not isinstance(ordered, bool):
        raise TypeError(f"ordered must be a bool, got {ordered!r}")
    # A bound on waiting asks for the items to be made where the consumer
    # does not wait for itself: by a thread, always.
    bounded = timeout_millis is not None
    if timeout_millis is None:
        timeout_millis = _DEFAULT_TIMEOUT_MS
    check_int("timeout_millis", timeout_millis, 1, "> 0 (or None)")
    if _min_threads is None:
        _min_threads = 1 if bounded else 0
    if _initial_threads is None:
        _initial_threads = _min_threads
    tuning = _tuning(capacity, num_threads, autotune, _min_threads, _initial_threads)
    if _tuning_memory is not None and tuning.get("auto_tune"):
        # What an earlier stage of the same work settled on (a DataLoader's
        # previous epoch), clamped to this stage's bounds in C++.
        tuning["tuning_memory"] = _tuning_memory
    check_int("num_clients", num_clients, 1, ">= 1")
    closed = _check_exception_types("closed_exception_types", closed_exception_types)
    ignored = _check_exception_types("ignored_exception_types", ignored_exception_types)
    check_int(
        "stage_subgraph_stream_id",
        stage_subgraph_stream_id,
        0,
        f"in [0, {_MAX_STREAMS}) (0 is the consumer's current stream)",
    )
    if stage_subgraph_stream_id >= _MAX_STREAMS:
        raise ValueError(
            f"stage_subgraph_stream_id must be in [0, {_MAX_STREAMS}) (PyTorch's "
            f"stream pool holds {_MAX_STREAMS} streams before they alias), "
            f"got {stage_subgraph_stream_id}"
        )
    pool_index = 0
    if use_stage_subgraph_thread_pool:
        check_int("stage_subgraph_thread_pool_id", stage_subgraph_thread_pool_id, 0, ">= 0")
        pools = _C._stage_thread_pool_count() - 1
        if stage_subgraph_thread_pool_id >= pools:
            raise ValueError(
                f"stage_subgraph_thread_pool_id {stage_subgraph_thread_pool_id} is unknown: "
                f"{pools} pool(s) were added with add_stage_thread_pool "
                f"(valid ids: {list(range(pools))})"
            )
        pool_index = stage_subgraph_thread_pool_id + 1
    if put_timeout_millis is not None:
        check_int("put_timeout_millis", put_timeout_millis, 1, ">= 1 (or None)")
    if name is None:
        name = f"stage_{next(_names)}"
    elif not isinstance(name, str):
        raise TypeError(f"name must be a str (or None), got {type(name).__name__}")
    elif not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be callable, got {type(transform).__name__}")
    if feed_dict is not None:
        if not isinstance(feed_dict, dict) or not all(isinstance(k, str) for k in feed_dict):
            raise TypeError(f"feed_dict must be a dict with str keys, got {feed_dict!r}")
        if not callable(source):
            raise TypeError("feed_dict is given, so source must be callable")
    iterable = feed_dict is None and (hasattr(source, "__iter__") or hasattr(source, "__getitem__"))
    if not iterable and not callable(source):
        raise TypeError(
            f"source must be an iterable, an iterator or a callable, got {type(source).__name__}"
        )
    dev = _check_device(device)
    return Stage(
        source,
        _options=dict(
            call_source=not iterable,
            feed_dict=dict(feed_dict or {}),
            transform=transform,
            closed_types=closed,
            ignored_types=ignored,
            name=name,
            num_clients=num_clients,
            timeout_ms=timeout_millis,
            ordered=ordered,
            pool_id=pool_index,
            device=dev,
            stream_id=stage_subgraph_stream_id,
            put_timeout_ms=put_timeout_millis,
            internal=bool(_internal),
            item_errors=bool(_item_errors),
            **tuning,
        ),
    )


# How long a consumer waits for producers when timeout_millis is not given.
_DEFAULT_TIMEOUT_MS = 300_000
# Auto-tuning's bounds: capacity from 2 up to 16 items and a memory budget
# of 1/16 of the machine's memory, at most 2 GiB, over the first item's size.
_AUTO_CAPACITY = (2, 16)
# At most this many producer threads, however many cores: each, once a
# setting used it, exists (parked when unused) for the stage's life, and
# stages chain.
_AUTO_MAX_THREADS = 8
_BUDGET_FRACTION = 16
_BUDGET_MAX = 2 << 30
# The tuner's window: at least this many items and nanoseconds (tests make
# it (1, 0) to change the setting after every item).
_TUNE_WINDOW = (8, 50_000_000)
# The share of the tuner's windows that trials may take, across a
# DataLoader's epochs (csrc/staging/auto_tuner.h says why; tests make it 0
# with the window above).
_TUNE_EXPLORE_SHARE = 0.05
# Inline production under this share of its time on the consumer's CPU
# counts as waiting: a first thread's trial then runs at once (auto_tuner.h).
_TUNE_WAITING_CPU_SHARE = 0.5


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 16 << 30


def _tuning(capacity, num_threads, autotune: bool, min_threads: int, initial_threads: int) -> dict:
    """The stage options for the capacity and thread count a user gave or
    left to auto-tuning (None). Tuned threads go down to ``min_threads``: 0
    lets the tuner park every thread where none pays, and the consumer then
    makes each item itself in ``next()``, as a plain loop does."""
    tune_threads = autotune and num_threads is None
    tune_capacity = autotune and capacity is None
    if tune_threads:
        threads = max(min(_usable_cores(), _AUTO_MAX_THREADS), min_threads, 1)
        initial = min(max(initial_threads, min_threads), threads)
    else:
        threads = initial = 1 if num_threads is None else num_threads
    if tune_capacity:
        first, most = _AUTO_CAPACITY
    else:
        first = most = 1 if capacity is None else capacity
    if not (tune_threads or tune_capacity):
        return dict(capacity=first, num_threads=threads)
    return dict(
        capacity=first,
        num_threads=threads,
        auto_tune=True,
        min_threads=min_threads if tune_threads else threads,
        initial_threads=initial,
        max_capacity=most,
        memory_budget_bytes=min(_memory_bytes() // _BUDGET_FRACTION, _BUDGET_MAX)
        if tune_capacity
        else 0,
        tune_window_items=_TUNE_WINDOW[0],
        tune_window_ns=_TUNE_WINDOW[1],
        tune_explore_share=_TUNE_EXPLORE_SHARE,
        tune_waiting_cpu_share=_TUNE_WAITING_CPU_SHARE,
    )


def add_stage_thread_pool(
    inter_op_threads: int = 1, intra_op_threads: int = 1, global_name: str = ""
) -> int:
    """Add an independent pool for stage work (DeepRec's
    ``session_stage_subgraph_thread_pool``) and return its id.

    Stages select it with ``use_stage_subgraph_thread_pool=True,
    stage_subgraph_thread_pool_id=<id>``. Their producer threads carry
    ``global_name`` (visible in ``top -H`` and profilers), use
    ``intra_op_threads`` intra-op threads each (so staging does not take the
    training step's cores), and at most ``inter_op_threads`` of them, across
    every stage of the pool, do stage work at once. A producer holds its slot
    only while it reads and processes an item, not while it waits for its
    turn to read, for another stage's item (a stage whose source is a stage
    of the same pool) or for buffer space, so stages sharing a pool, chained
    ones too, cannot starve one another.

    Ids count from 0 in the order pools are added.
    """
    check_int("inter_op_threads", inter_op_threads, 1, ">= 1")
    check_int("intra_op_threads", intra_op_threads, 1, ">= 1", MAX_THREADS)
    if not isinstance(global_name, str):
        raise TypeError(f"global_name must be a str, got {type(global_name).__name__}")
    if not global_name:
        global_name = f"stage_pool_{_C._stage_thread_pool_count() - 1}"
    return _C._add_stage_thread_pool(inter_op_threads, intra_op_threads, global_name) - 1


def _hook_stack() -> list:
    stack = getattr(_hooks, "stack", None)
    if stack is None:
        stack = _hooks.stack = []
    return stack


@contextlib.contextmanager
def make_prefetch_hook():
    """Start stages eagerly, primed, and close on exit those made inside.

    On entering, the open stages this thread made with :func:`staged`
    before are started and primed with one item (the warm-up of
    TensorFlow's staged input pipeline: the first step finds its input
    ready); so is every stage this thread makes inside the block, as it is
    made. Items are made here where no producer thread is at work
    (auto-tuning starts with none), in creation order so that an upstream
    stage primes before the stages that read it. On exit the hook closes
    the stages made inside its block (not those of an enclosing hook's
    block) and joins their threads; stages made before it go on, for the
    code that made them to close. Stages of other threads, and the stages
    of a :class:`~torch_stage.DataLoader`'s iterators, are never the
    hook's. Stages also start on first use without the hook, so forgetting
    it never hangs.
    """
    me = threading.current_thread()
    with _registry_lock:
        earlier = sorted(
            (s for s in _live if s._thread is me and not s._impl.closed), key=lambda s: s._order
        )
    stack = _hook_stack()
    mine: list = []
    stack.append(mine)
    try:
        for stage in earlier:
            stage._prime()
        yield
    finally:
        # By identity: the lists of two hooks with no stages yet are equal.
        del stack[next(i for i, hook in enumerate(stack) if hook is mine)]
        for stage in mine:
            stage.close()


def _park_daemon() -> None:
    # A daemon thread waiting for an item when the interpreter exits: the
    # exit closed the stage under it. A plain daemon thread in a blocking
    # call (a queue's get(), the plain DataLoader's next()) stays there
    # until the process ends, saying nothing; so does this one, instead of
    # raising StageClosed into a traceback printed during shutdown.
    threading.Event().wait()


@atexit.register
def _close_all() -> None:
    # C++ producer threads are not joined by threading's shutdown; stop them
    # before the interpreter goes away. First, no producer may start waiting
    # for the GIL from a destructor any more (such a wait could end in
    # finalization, where CPython ends the thread from inside it), and the
    # waits that began before end now (ExitGate, csrc/python/bindings.h).
    _C._interpreter_exit_begins(drain_timeout_ms=_EXIT_JOIN_TIMEOUT_MS)
    global _exiting
    _exiting = True
    deadline = time.monotonic() + _EXIT_JOIN_TIMEOUT_MS / 1000
    for stage in list(_live):
        impl = getattr(stage, "_impl", None)
        if impl is not None:
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            # Quietly: the process is going, and the producer with it.
            impl.close(join_timeout_ms=left_ms, warn_if_left=False)
            _keep_if_running(stage._generator)


def _keep_if_running(source) -> None:
    # A generator's frame holds no reference to the generator, so a
    # producer left inside one does not keep it alive: finalization would
    # free it and close() it under that thread ("generator already
    # executing"). A daemon thread inside a generator keeps it through its
    # own frame until the process ends; this reference stands for that.
    if source is not None and source.gi_running:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(source))
