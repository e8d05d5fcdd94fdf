"""torch_stage.DataLoader: torch.utils.data.DataLoader with staged prefetch.

Batches are produced by the usual DataLoader machinery (workers, sampler,
collate_fn) and staged ahead by background C++ threads: optionally
transformed, then copied to ``device`` (pinned, fused, reused host buffers;
one non-blocking copy per batch on a side stream), so the training loop gets
batches already on the device.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import inspect
import random
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch
import torch.utils.data

from torch_stage import _C
from torch_stage.errors import StageClosed, StageError, StageTimeoutError
from torch_stage.staging import _pytree
from torch_stage.staging.stage import _DEFAULT_TIMEOUT_MS, Stage, staged

__all__ = ["DataLoader", "STAGING_OPTIONS"]

_STATE_VERSION = 1
_T_co = TypeVar("_T_co", covariant=True)
# torch 2.5 has no in_order; newer ones do. Accept it everywhere, and only
# pass it on where the plain DataLoader knows it.
_PLAIN_HAS_IN_ORDER = "in_order" in inspect.signature(torch.utils.data.DataLoader).parameters


class _SkippingSampler:
    """An index sampler that skips the batches a resumed epoch already had.

    ``iter()`` reaches the sampler at once, as the plain DataLoader's does
    when its iterator is made (before it draws the workers' base seed): a
    sampler that shuffles in ``__iter__`` itself then draws from the same
    RNG state, and reads its epoch then. The skip happens on the first draw
    (a generator sampler draws its seed there, after the base seed), or
    when a resumed epoch settles it (see ``_SkippingIter.settle``).
    """

    def __init__(self, sampler, skip: int):
        self._sampler = sampler
        self._skip = skip

    def __iter__(self):
        return _SkippingIter(iter(self._sampler), self._skip)

    def __len__(self) -> int:
        return len(self._sampler)


class _SkippingIter:
    def __init__(self, it, skip: int):
        self._it = it
        self._skip = skip
        self._ahead: Optional[tuple] = None  # settle()'s draw: (value,) or () at the end

    def __iter__(self):
        return self

    def _skip_now(self) -> None:
        while self._skip:
            self._skip -= 1
            if next(self._it, _END) is _END:
                self._skip = 0
                self._ahead = ()

    def settle(self) -> None:
        """Make the epoch's first draws now: the skip, and the first index
        batch after it, kept for the next draw. A resumed epoch replays them
        from the saved RNG state and then gives the global RNG back."""
        self._skip_now()
        if self._ahead is None:
            value = next(self._it, _END)
            self._ahead = () if value is _END else (value,)

    def passes_through(self) -> bool:
        """Whether every draw from now on is the sampler's own."""
        return not self._skip and self._ahead is None

    def __next__(self):
        self._skip_now()
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            if not ahead:
                raise StopIteration
            return ahead[0]
        return next(self._it)


_END = object()


class _Skipping:
    """An iterable dataset's epoch without the batches a resumed epoch
    already had. Not itertools.islice: it ends for good at the first error,
    where the plain DataLoader goes on."""

    def __init__(self, it, skip: int):
        self._it = it
        self._skip = skip

    def __iter__(self):
        return self

    def __next__(self):
        while self._skip:
            self._skip -= 1
            try:
                next(self._it)
            except StopIteration:
                raise
            except Exception:  # noqa: BLE001, S110 (the interrupted run raised it already)
                pass
        return next(self._it)


# --- Warnings raised while a batch is produced -------------------------------
#
# The plain DataLoader raises the warnings of a batch (the IterableDataset
# length warning, a dataset's or collate_fn's own warnings) in the consumer's
# next(), where the caller's warning filters and catch_warnings() apply. Here
# batches are produced on staging threads, so their warnings are recorded
# there and raised again in the consumer's next() for that batch.
#
# warnings.catch_warnings() cannot record them: it swaps the warnings
# module's process-wide state, so a staging thread entering and leaving it
# would race with the consumer's own catch_warnings() (and could leave the
# consumer's recording context installed forever). Instead warnings.warn is
# wrapped while staging threads may make batches (from the first live run of
# any loader to the end of the last: _Recorder), and records only on a thread
# that is producing a batch; on every other thread it is the plain
# warnings.warn. When no run is live, warnings.warn, catch_warnings and
# TorchScript's table of builtins are what they were: a library that
# replaces the standard library's functions for the whole process, for good,
# surprises every other code that wraps them. Warnings raised from C
# (PyErr_WarnEx) or through warnings.warn_explicit are not recorded and
# still appear on the staging thread.
#
# A batch's code that enters catch_warnings() of its own decides its
# warnings there, as in the plain DataLoader, where it runs inside next():
# a warning it ignores is dropped, one it makes an error raises in it (and
# may be caught), one it records is its own. catch_warnings is wrapped to
# count, per thread, the contexts entered: a warning made inside more of
# them than the batch started in goes to the plain warnings.warn at once.
# (Its filters are process-wide, so two staging threads in catch_warnings()
# at once can undo each other's, as in any threaded code before Python
# 3.14's context-aware warnings.)

_recording = threading.local()
_install_lock = threading.Lock()
# Guarded by _install_lock: live runs; whether other code wrapped our
# wrapper, so that it stays (in their chain) for good; the functions the
# recorder replaced (kept after it is taken out: a wrapper of ours another
# library holds still calls them).
_live_recorders = 0
_wrapped_by_others = False
_plain_warn: Optional[Callable] = None
_plain_enter: Optional[Callable] = None
_plain_exit: Optional[Callable] = None


def _acquire_recorder() -> None:
    """A run begins: the recorder is in place until every run has ended."""
    global _live_recorders, _plain_warn, _plain_enter, _plain_exit
    with _install_lock:
        _live_recorders += 1
        if _live_recorders > 1 or _wrapped_by_others:
            return
        _plain_enter = warnings.catch_warnings.__enter__
        _plain_exit = warnings.catch_warnings.__exit__
        _plain_warn = warnings.warn
        warnings.catch_warnings.__enter__ = _enter_catch_warnings
        warnings.catch_warnings.__exit__ = _exit_catch_warnings
        # TorchScript compiles a call to warnings.warn (F.embedding_bag
        # has one) as aten::warn by the function's identity: the wrapper
        # must map there too, or scripting tries to compile it.
        torch.jit._builtins._register_builtin(_warn, "aten::warn")
        warnings.warn = _warn


def _release_recorder() -> None:
    """A run ended: the last puts back what the first replaced. (Where some
    other code wrapped one of them since, its wrapper stays, and so does
    ours inside it, which passes every warning on when no batch is made.)"""
    global _live_recorders, _wrapped_by_others
    with _install_lock:
        _live_recorders -= 1
        if _live_recorders > 0 or _wrapped_by_others:
            return
        cls = warnings.catch_warnings
        for now, ours, plain, put in (
            (warnings.warn, _warn, _plain_warn, lambda f: setattr(warnings, "warn", f)),
            (
                cls.__enter__,
                _enter_catch_warnings,
                _plain_enter,
                lambda f: setattr(cls, "__enter__", f),
            ),
            (
                cls.__exit__,
                _exit_catch_warnings,
                _plain_exit,
                lambda f: setattr(cls, "__exit__", f),
            ),
        ):
            if now is ours:
                put(plain)
            elif now is not plain:
                # Another library wrapped ours: it stays in their chain, for
                # good (installing ours again would call ours from inside
                # itself).
                _wrapped_by_others = True
        if not _wrapped_by_others:
            torch.jit._builtins._get_builtin_table().pop(id(_warn), None)


class _Recorder:
    """A run's hold on the recorder: released once, by ``release()`` or
    when the run is collected."""

    __slots__ = ("held", "__weakref__")

    def __init__(self) -> None:
        self.held = True
        _acquire_recorder()

    def release(self) -> None:
        if self.held:
            self.held = False
            _release_recorder()


def _enter_catch_warnings(self):
    got = _plain_enter(self)
    _recording.contexts = getattr(_recording, "contexts", 0) + 1
    return got


def _exit_catch_warnings(self, *exc_info):
    got = _plain_exit(self, *exc_info)
    _recording.contexts = getattr(_recording, "contexts", 1) - 1
    return got


def _start_recording(records: Optional[list]):
    """Records this thread's warnings into ``records`` (None: stops);
    returns what to pass back to end it."""
    previous = getattr(_recording, "records", None), getattr(_recording, "base", 0)
    _recording.records = records
    _recording.base = getattr(_recording, "contexts", 0)
    return previous


def _end_recording(previous) -> None:
    _recording.records, _recording.base = previous


def _warn(message, category=None, stacklevel=1, source=None, **kwargs):
    # One level more than asked: this wrapper's own frame. (The plain
    # function takes any stacklevel of 1 or less as its caller.)
    level = max(stacklevel, 1) + 1
    records = getattr(_recording, "records", None)
    if records is None or getattr(_recording, "contexts", 0) > _recording.base:
        # Not producing a batch, or inside a catch_warnings() the batch's
        # own code entered. A warning aimed at a frame of this module (the
        # plain iterator's length warning, at its caller: __next__) is
        # aimed at the consumer's caller, as in the plain DataLoader, which
        # has no frames between them.
        try:
            frame = sys._getframe(level - 1)
        except ValueError:  # a level past the outermost frame
            frame = None
        while frame is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back
            level += 1
        return _plain_warn(message, category, level, source, **kwargs)
    if isinstance(message, Warning):
        category = type(message)
    elif category is None:
        category = UserWarning
    frame = sys._getframe(1)
    for _ in range(level - 2):
        if frame is None:
            break
        frame = frame.f_back
    if (
        not (isinstance(category, type) and issubclass(category, Warning))
        or frame is not None
        and _filter_action(message, category, frame) == "error"
    ):
        # The plain DataLoader makes the batch inside next(), where warn()
        # raises this (the filters' error, or TypeError for a category that
        # is no Warning) at the call: the batch's code may catch it, or
        # fail with it at its own position, as it would there.
        return _plain_warn(message, category, level, source, **kwargs)
    if frame is None or frame.f_code.co_filename == __file__:
        # Aimed at whoever called the plain iterator's next(): that is the
        # consumer's caller in the plain DataLoader.
        records.append((message, category, None))
    else:
        records.append(
            (message, category, (frame.f_code.co_filename, frame.f_lineno, frame.f_globals))
        )
    return None


def _filter_action(message, category, frame) -> str:
    """The action the warning filters give a warning made at ``frame``, by
    the rules of warnings.warn_explicit (the first matching filter, else
    the default action). Only "error" is acted on: a recorded warning is
    raised again in next(), where every other action applies as usual."""
    text = str(message)
    module = frame.f_globals.get("__name__", "<string>")
    lineno = frame.f_lineno
    for action, msg, cat, mod, ln in warnings.filters:
        if (
            (msg is None or msg.match(text))
            and issubclass(category, cat)
            and (mod is None or mod.match(module))
            and (ln == 0 or lineno == ln)
        ):
            return action
    return warnings.defaultaction


def _reemit(records) -> None:
    """Raise recorded warnings again; call it directly from ``__next__``."""
    for message, category, where in records:
        if where is None:
            # Levels: _reemit, __next__, the consumer's caller.
            _plain_warn(message, category, stacklevel=3)
        else:
            filename, lineno, module_globals = where
            warnings.warn_explicit(
                message,
                category,
                filename,
                lineno,
                module=module_globals.get("__name__", "<string>"),
                registry=module_globals.setdefault("__warningregistry__", {}),
                module_globals=module_globals,
            )


# --- An epoch ----------------------------------------------------------------


# next() calls of an epoch during which _GlobalDraws watches. A reading of
# the generators takes ~1 us (_Fingerprints), a comparison less: two
# readings per batch made in the loop, one per batch a thread made.
_WATCHED_BATCHES = 64
_GENERATORS = ("torch's CPU generator", "Python's random", "NumPy's global generator")


class _Fingerprints:
    """Readings of the global random generators that a dataset, a sampler,
    a transform or a training loop may draw from, each of which changes with
    every draw: for torch's CPU generator what its C++ side reads in place,
    and for Python's ``random`` and NumPy's legacy global generator
    (Mersenne twisters both) the twister's position in its 624 words and
    its first word (a draw moves the position; 624 of them regenerate the
    words), plus ``random``'s cached Gaussian.

    One call reads all three (``_C._GeneratorReader``): the twisters are
    read in place because their state getters copy 2.5 KB into Python
    objects, 7 us for ``random.getstate()`` and 31 for NumPy's
    ``get_state()``, at two readings per batch, and each call between a
    batch's own calls costs several times what it does alone. The addresses
    are found here and checked once against the getters; if the layout is
    not the one expected (another interpreter, another NumPy), the getters
    are used. NumPy's legacy cached Gaussian is not read (it has no reader
    short of ``get_state()``): a normal draw that takes only the cache goes
    unseen, its neighbours are seen.
    """

    def __init__(self) -> None:
        self._numpy_module = None
        self.reader = self._make_reader(sys.modules.get("numpy"))

    @staticmethod
    def _random_view() -> Optional[tuple]:
        """(the generator, its position's address, its first word's), or None."""
        inst = random._inst  # what random.random() and the rest draw from
        try:
            # _randommodule.c: PyObject_HEAD; int index; uint32_t state[624].
            base = id(inst) + object.__basicsize__
            index = ctypes.c_int.from_address(base)
            first = ctypes.c_uint32.from_address(base + ctypes.sizeof(ctypes.c_int))
            _, words, _ = inst.getstate()
            if (index.value, first.value) == (words[624], words[0]):
                return inst, base, base + ctypes.sizeof(ctypes.c_int)
        except Exception:  # noqa: BLE001 (any surprise: the getter)
            pass
        return None

    @staticmethod
    def _numpy_view(numpy) -> Optional[tuple]:
        """(the bit generator, its position's address, its first word's), or None."""
        legacy = numpy.random.mtrand._rand
        try:
            bits = legacy._bit_generator
            # randomkit's mt19937_state: uint32_t key[624]; int pos.
            address = bits.ctypes.state_address
            first = ctypes.c_uint32.from_address(address)
            pos = ctypes.c_int.from_address(address + 624 * 4)
            _, keys, position, _, _ = legacy.get_state()
            if (pos.value, first.value) == (position, int(keys[0])):
                return bits, address + 624 * 4, address
        except Exception:  # noqa: BLE001 (any surprise: the getter)
            pass
        return None

    def _make_reader(self, numpy) -> Callable[[], Optional[tuple]]:
        """A reading in one call where the views hold, else the getters'."""
        self._numpy_module = numpy
        random_view = self._random_view()
        numpy_view = None if numpy is None else self._numpy_view(numpy)
        if random_view is not None and (numpy is None or numpy_view is not None):
            owner, pos, first = numpy_view if numpy_view is not None else (None, 0, 0)
            return _C._GeneratorReader(*random_view, numpy, owner, pos, first)
        inst = random._inst
        legacy = None if numpy is None else numpy.random.mtrand._rand

        def getters() -> Optional[tuple]:
            if sys.modules.get("numpy") is not self._numpy_module:
                return None
            numpy_state = None
            if legacy is not None:
                kind, keys, pos, has_gauss, gauss = legacy.get_state()
                numpy_state = (pos, keys.tobytes(), has_gauss, gauss)
            return (_C._cpu_generator_fingerprint(), inst.getstate(), numpy_state)

        return getters

    def read(self) -> tuple:
        got = self.reader()
        if got is None:  # NumPy was imported (or removed) since the reader was made
            self.reader = self._make_reader(sys.modules.get("numpy"))
            got = self.reader()
        return got


_fingerprints: Optional[_Fingerprints] = None
_own_next = _C._own_next


def _watch_reader() -> Optional[Any]:
    """The one-call reader of the generators, where their layout checked
    out (else None: the getters, which only the Python watch uses)."""
    global _fingerprints
    if _fingerprints is None:
        _fingerprints = _Fingerprints()
    reader = _fingerprints.reader
    return reader if isinstance(reader, _C._GeneratorReader) else None


def _generator_states() -> tuple:
    global _fingerprints
    if _fingerprints is None:
        _fingerprints = _Fingerprints()
    return _fingerprints.read()


class _GlobalDraws:
    """Whether making batches and the training loop draw from one global
    random generator (torch's CPU one, Python's ``random``, NumPy's).

    The plain DataLoader without workers makes each batch in ``next()``, so
    the dataset's draws (a random crop) and the loop's (dropout on the CPU)
    take turns in one order, and a seeded run repeats. A staging thread
    makes batches while the loop runs: which of the two draws first is then
    up to timing, and the run does not repeat. (The same holds with workers
    for a sampler that draws as it yields: it runs in the main process.)
    Pulls stay in order on any number of threads (the source's lock), but
    transforms run side by side. So: pulls or transforms and the loop
    drawing from one generator allow no staging thread; transforms drawing
    allow one. The tuner is told so (``Stage.limit_threads``), and
    ``decisions`` says why.

    Watched where it can be told, on the loop's own thread: the states are
    read at the start of each ``next()`` and after each batch made there
    (the tuner's no-thread setting), and what changed between two readings
    goes to what ran between them: the loop, or that making (``next()``
    itself draws nothing between them). An interval in which a batch was
    being made on another thread tells nothing. For the first
    ``_WATCHED_BATCHES`` batches of an epoch.
    """

    def __init__(self):
        self.pull: set = set()  # generators the pulls drew from
        self.transform: set = set()
        self.loop: set = set()
        self.loop_thread: Optional[int] = None
        self.lock = threading.Lock()
        self.elsewhere = 0  # makings under way on other threads
        self.made_elsewhere = 0  # makings begun on other threads, ever
        # The last reading on the loop's thread, (states, made_elsewhere),
        # or None where a making elsewhere was under way then.
        self.last: Optional[tuple] = None
        self.watched = 0
        # A reading found a generator drawn from that it had not seen
        # drawn there before: limit() may say more (reset by loop_leaves).
        self.found = False

    def watching(self) -> bool:
        return self.watched < _WATCHED_BATCHES

    def stop(self) -> None:
        """Watch no more (nothing it finds would change what stages)."""
        self.watched = _WATCHED_BATCHES

    def _read(self, drew: Optional[set]) -> None:
        """A reading on the loop's thread: what changed since the last goes
        to ``drew`` (None: to nothing)."""
        if self.elsewhere:
            self.last = None
            return
        # (Written out, as next() is: each call costs a batch made in the
        # loop several times what it costs alone.)
        states = _fingerprints.reader() if _fingerprints is not None else None
        if states is None:
            states = _generator_states()
        now = (states, self.made_elsewhere)
        last, self.last = self.last, now
        if drew is not None and last is not None and last[1] == now[1] and last[0] != states:
            before = last[0]
            for k in (0, 1, 2):
                if k not in drew and before[k] != states[k]:
                    drew.add(k)
                    self.found = True

    def make(self, drew: Optional[set], fn, arg):
        """``fn(arg)``, a pull or a transform; ``drew``: ``self.pull`` or
        ``self.transform``, where what it drew goes (None: a run's first
        pull, whose draws are in order whatever threads do later)."""
        if not self.watching():
            return fn(arg)
        if threading.get_ident() != self.loop_thread:
            with self.lock:
                self.elsewhere += 1
                self.made_elsewhere += 1
            try:
                return fn(arg)
            finally:
                with self.lock:
                    self.elsewhere -= 1
        try:
            return fn(arg)
        finally:
            self._read(drew)

    def loop_resumes(self) -> None:
        """At the start of ``next()``: what the loop drew since the last."""
        self.loop_thread = threading.get_ident()
        self._read(self.loop)

    def loop_leaves(self) -> bool:
        """At the end of ``next()``: whether a reading since the last found
        a generator drawn from where it had not been (limit() may say more)."""
        self.watched += 1
        found, self.found = self.found, False
        return found

    def limit(self) -> Optional[tuple]:
        """(most staging threads, why) for what was seen, or None."""
        both = sorted((self.pull | self.transform) & self.loop)
        if both:
            return 0, (
                f"no staging thread: the batches' making and the training loop both "
                f"draw from {_GENERATORS[both[0]]}, so a staging thread would leave the "
                "order of their draws to timing and a seeded run would not repeat "
                "(give the dataset or sampler a generator of its own, or pass "
                "num_threads to stage anyway)"
            )
        if self.transform:
            return 1, (
                f"at most one staging thread: the transform draws from "
                f"{_GENERATORS[min(self.transform)]}, so transforms side by side would "
                "leave the order of their draws to timing (pass num_threads to stage "
                "anyway)"
            )
        return None


class _Epoch:
    """The plain iterator of an epoch and what has been pulled from it.

    Shared by the consumer's iterator and the stage sources reading it, and
    refers to neither: the stage holds its source, so a reference back to the
    iterator would be a cycle through C++ that the garbage collector cannot
    see, and dropping the iterator would no longer stop the threads.
    """

    def __init__(self, base, known: Optional[int]):
        self.base = base
        # Batches the sampler says are left; None when it has no len().
        # Staging never pulls beyond them unasked: pulling past the end runs
        # the sampler again (RandomSampler draws another permutation).
        self.known = known
        self.pulled = 0
        self.warnings: dict = {}  # index -> records, for staged batches
        # index -> (exception, records, ends_run): batches that raised on a
        # staging thread (in the plain iterator, which ends the run, or in
        # transform), for the consumer to raise at their position.
        self.failed: dict = {}
        # The plain iterator whose worker processes the epoch owns (not
        # persistent ones: the loader keeps those).
        self.workers = None
        self.draws = _GlobalDraws()

    def pull(self, records: list, watched: bool = True):
        """The plain iterator's next batch, recording its warnings;
        ``watched``: its draws count (not a run's first batch, which the
        loop always pulls itself, and in which a sampler draws its seed for
        the epoch: that draw is in order whatever threads do later)."""
        previous = _start_recording(records)
        try:
            draws = self.draws
            return draws.make(draws.pull if watched else None, next, self.base)
        finally:
            _end_recording(previous)
            self.pulled += 1


# Runs whose source may be waiting for demand (see _Run.source).
_live_runs: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_runs() -> None:
    # Before torch_stage.staging.stage's own exit handler (atexit runs handlers in
    # the reverse order of registration, and this module imports that one)
    # closes the stages: a source waiting at the sampler's end for a next()
    # that will never come would hold each producer until its join timeout
    # and then be left behind, with a warning, at every such exit.
    for run in list(_live_runs):
        run.stop()


class _Run:
    """One stage's source: the epoch from a batch the consumer pulled on.

    A batch that raises in the plain iterator ends the run (the stage ends
    cleanly, nothing staged is lost) and the consumer raises it after the
    batches before it; the consumer's next call pulls the following batch
    itself and starts a new run, as the plain DataLoader goes on after an
    error.
    """

    def __init__(self, epoch: _Epoch):
        self.epoch = epoch
        self.demand = threading.Semaphore(0)
        self.stopped = False
        # Staging threads inside the dataset or the transform (`busy`), and
        # whether the consumer has left (`closing`): then none enters again,
        # and the last one out releases the recorder. `idle` is notified then.
        self.idle = threading.Condition(threading.Lock())
        self.busy = 0
        self.closing = False
        # The warning recorder is in place from now until the stage has
        # stopped making batches (close(): at once, or when the last staging
        # thread leaves user code), or until the run is collected.
        self.recorder = _Recorder()
        weakref.finalize(self, self.recorder.release)
        _live_runs.add(self)
        self.handled: list = []  # indices whose transform raised
        # Producer thread (threading.get_ident(): the stage's C++ threads get
        # a new Python thread state, so threading.local() data, each time
        # they take the GIL) -> the index of the batch it pulled last, which
        # is the batch it transforms next.
        self.pulled_by: dict = {}

    def source(self, index, first):
        # A producer thread runs the transform of the batch it pulled (here,
        # in its call of next()) itself: the batch's index is left for it.
        pulled_by = self.pulled_by
        pulled_by[threading.get_ident()] = index
        yield first
        epoch = self.epoch
        while True:
            if epoch.known is not None and epoch.pulled >= epoch.known:
                # Past the end the sampler says there is: only when asked.
                self.demand.acquire()
                if self.stopped:
                    return
            if not self.enter():
                return
            index = epoch.pulled
            records: list = []
            try:
                batch = epoch.pull(records)
            except StopIteration:
                return
            except BaseException as exc:  # noqa: BLE001 (re-raised to the consumer,
                # as the plain DataLoader raises any exception of a batch)
                epoch.failed[index] = (exc, records, True)
                return
            finally:
                self.leave()
            if records:
                epoch.warnings[index] = records
            pulled_by[threading.get_ident()] = index
            yield batch

    def stop(self) -> None:
        # A source waiting for demand would hold close() for its join timeout.
        self.stopped = True
        self.demand.release()

    def enter(self) -> bool:
        """A staging thread is about to call user code (the dataset, the
        transform); False once the consumer has left, and then it must not."""
        with self.idle:
            if self.closing:
                return False
            self.busy += 1
            return True

    def leave(self) -> None:
        with self.idle:
            self.busy -= 1
            if self.busy or not self.closing:
                return
            self.idle.notify_all()
        self.recorder.release()

    def close(self) -> bool:
        """The consumer has left: no staging thread enters user code again.
        Returns whether one is still inside (it ends after its call, and the
        recorder goes with the last one out)."""
        self.stop()
        with self.idle:
            self.closing = True
            if self.busy:
                return True
        self.recorder.release()
        return False

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no staging thread of the closed run is in user code."""
        with self.idle:
            return self.idle.wait_for(lambda: self.busy == 0, timeout_s)

    def transform(self, transform: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``transform`` for the stage.

        A batch whose transform raises is recorded for the consumer, which
        raises it at the batch's position, and skipped by the stage (which
        lists ``_pytree.Handled`` as ignored), so that the epoch goes on as
        after an error in a plain ``collate_fn``; a stage error would end it.
        Warnings are recorded, as while pulling, for the consumer's next().
        """
        epoch, handled, pulled_by = self.epoch, self.handled, self.pulled_by
        draws = epoch.draws
        run = self

        def staged_transform(batch):
            if not run.enter():
                # The consumer has left and the stage is closing: this batch
                # is discarded with it, and user code may no longer run here.
                return batch
            index = pulled_by[threading.get_ident()]
            records: list = []
            previous = _start_recording(records)
            try:
                out = draws.make(draws.transform, transform, batch)
            except BaseException as exc:  # noqa: BLE001 (re-raised to the consumer)
                # Without this frame: it refers to the epoch, which would then
                # hold itself through the exception until the consumer takes it.
                exc.__traceback__ = exc.__traceback__.tb_next
                epoch.failed[index] = (exc, records, False)
                handled.append(index)
                raise _pytree.Handled from None
            finally:
                _end_recording(previous)
                run.leave()
            if records:
                epoch.warnings.setdefault(index, []).extend(records)
            return out

        return staged_transform


# The keyword-only arguments a torch_stage.DataLoader adds, kept as attributes
# of the same names: what a rebuilt loader must carry over to stage the same.
STAGING_OPTIONS = (
    "device",
    "capacity",
    "num_threads",
    "autotune",
    "stage_subgraph_stream_id",
    "transform",
    "timeout_millis",
    "name",
)
# Accelerate's functions that rebuild a loader as a plain DataLoader from its
# attributes (accelerate/data_loader.py, 0.3x to 1.x); both read
# prefetch_factor while doing so.
_ACCELERATE_MODULE = "accelerate.data_loader"
_ACCELERATE_REBUILDERS = frozenset({"prepare_data_loader", "skip_first_batches"})


def _accelerate_rebuilding(frame) -> bool:
    """Whether ``frame`` is Accelerate's rebuild reading a loader attribute:
    the frames from it back to the first outside accelerate.data_loader
    include prepare_data_loader or skip_first_batches (a dict comprehension
    or DataLoaderAdapter.__getattr__ may sit between)."""
    while frame is not None and frame.f_globals.get("__name__") == _ACCELERATE_MODULE:
        if frame.f_code.co_name in _ACCELERATE_REBUILDERS:
            return True
        frame = frame.f_back
    return False


def _outside_accelerate_stacklevel(frame) -> int:
    """The warnings.warn stacklevel, from the property getter, of the first
    frame outside Accelerate and torch_stage: the user's prepare() line."""
    level = 2  # the getter's caller
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("accelerate") or module.startswith("torch_stage")):
            break
        frame = frame.f_back
        level += 1
    return level


def _check_staging_options(options: dict) -> None:
    """Raises what staged() raises for these staging options (a name of
    None is the loader's default)."""
    name = options.get("name")
    staged(
        (),
        **{k: v for k, v in options.items() if k != "name"},
        name="dataloader" if name is None else name,
        _internal=True,
    ).close()


def _check_plain_numbers(num_workers, timeout, prefetch_factor) -> None:
    """The plain DataLoader's first checks, in its order, with its exception
    types and conditions, and messages that also name the bad value (the
    plain ones do not). Values it cannot compare are left to it."""
    number = (int, float)
    if not isinstance(num_workers, number):
        return
    if num_workers < 0:
        raise ValueError(
            f"num_workers option should be non-negative, got num_workers={num_workers!r}; "
            "use num_workers=0 to disable multiprocessing."
        )
    if not isinstance(timeout, number):
        return
    if timeout < 0:
        raise ValueError(f"timeout option should be non-negative, got timeout={timeout!r}")
    if num_workers > 0 and isinstance(prefetch_factor, number) and prefetch_factor < 0:
        raise ValueError(
            "prefetch_factor option should be non-negative, "
            f"got prefetch_factor={prefetch_factor!r}"
        )


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` whose batches are staged.

    Every argument of ``torch.utils.data.DataLoader`` is accepted with the
    same meaning (``num_workers``, ``collate_fn``, ``pin_memory``,
    ``drop_last``, ``persistent_workers``, ``generator``,
    ``worker_init_fn``, ``in_order``, ...). ``len()`` and
    ``sampler.set_epoch()`` work as before; a batch that raises raises in the
    training loop's ``next()`` and the following ``next()`` goes on, and the
    warnings of a batch are raised in the ``next()`` that returns it. The
    staging arguments are keyword-only and kept as attributes of the same
    names (so a loader rebuilt from its signature and attributes, as
    PyTorch Lightning does, stages the same way), except where a subclass
    has an attribute or method of that name of its own: a subclass of the
    plain class that sets ``self.transform`` or ``self.device`` keeps it,
    and staging then uses what was passed to this constructor:

    Args:
        device: deliver batches on this device (None: where collate_fn put
            them). Tensors anywhere in the batch (dicts, lists, tuples,
            namedtuples) are copied; other values pass through. A failed
            copy raises ``StageError`` in the ``next()`` for its batch and
            the epoch goes on, as after a failed ``pin_memory``.
        capacity: batches staged ahead (>= 1); None (default): auto-tuned
            from 2 (see ``autotune``).
        num_threads: staging threads; the loader is read by one at a time,
            ``transform`` and the copies run on all. None (default):
            auto-tuned, from none (batches made in the training loop's
            ``next()``, as by the plain DataLoader) up to the usable cores
            (at most 8).
        autotune: choose what ``capacity`` and ``num_threads`` leave as None
            at run time from the training loop's measured rate (see
            ``torch_stage.staged``); ``stats()["tuning"]`` says what it
            chose and why. Each epoch starts from what the last one's
            tuning learnt (capacity, which moves did not pay, how much of
            the run trials took), without a staging thread. A first thread
            is tried at once where ``next()`` mostly waits to make a batch
            (reading, or the workers' queue), and only after window 20
            where it computes (a thread would need a core the step uses).
            False: 1 thread and capacity 2 unless given.
        stage_subgraph_stream_id: the staging stream for the copies
            (torch_stage's own, never a multi-stream side stream; 0: the
            consumer's current stream). The consumer's stream waits for each
            copy before the batch is handed over.
        transform: per-batch work run on the staging threads, before the
            copy to ``device``. An exception from it is raised in the
            ``next()`` for its batch and the epoch goes on, as after an
            error in ``collate_fn``; its warnings are raised in that
            ``next()`` too. Batches may come out of it with any structure,
            as from a ``collate_fn`` (a short last batch carries shorter
            lists), as with ``staged()``.
        timeout_millis: how long the training loop waits for a batch before
            ``StageTimeoutError`` (the plain ``timeout`` still bounds workers;
            a batch the loop makes itself, when auto-tuning chose no staging
            thread, is its own work, unbounded as in the plain DataLoader).
        name: the stage's name (errors, thread names, profiler ranges);
            None: ``"dataloader"``.

    Staging never reads past the number of batches the sampler's ``len()``
    announces before the training loop asks for them, and the first batch
    of an epoch is produced in the training loop's ``next()``: the sampler
    and the random number generators are used as by the plain DataLoader.

    Each iterator owns its staging threads (and, without
    ``persistent_workers``, its worker processes): dropping it stops them.

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
        in_order: bool = True,
        device=None,
        capacity: Optional[int] = None,
        num_threads: Optional[int] = None,
        autotune: bool = True,
        stage_subgraph_stream_id: int = 1,
        transform: Optional[Callable[[Any], Any]] = None,
        timeout_millis: int = _DEFAULT_TIMEOUT_MS,
        name: Optional[str] = None,
        **loader_kwargs,
    ):
        # Validate the staging options now, before any thread or worker
        # exists, with the same rules staged() applies.
        _check_staging_options(
            dict(
                capacity=capacity,
                num_threads=num_threads,
                autotune=autotune,
                stage_subgraph_stream_id=stage_subgraph_stream_id,
                transform=transform,
                timeout_millis=timeout_millis,
                device=device,
                name=name,
            )
        )
        _check_plain_numbers(num_workers, timeout, prefetch_factor)
        if _PLAIN_HAS_IN_ORDER:
            loader_kwargs["in_order"] = in_order
        elif in_order is not True:
            raise TypeError(
                f"in_order={in_order!r} needs torch >= 2.6 (this is {torch.__version__}); "
                "leave it at True"
            )
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
        if not _PLAIN_HAS_IN_ORDER:
            self.in_order = in_order
        staging = {
            "device": None if device is None else torch.device(device),
            "capacity": capacity,
            "num_threads": num_threads,
            "autotune": autotune,
            "stage_subgraph_stream_id": stage_subgraph_stream_id,
            "transform": transform,
            "timeout_millis": timeout_millis,
            "name": name,
        }
        # A name a subclass defines on its class, or set before calling
        # this, is its own (and one it sets afterwards: _claim_options).
        mro = type(self).__mro__
        before = mro[: mro.index(DataLoader)]
        mine = {
            key for key in staging if key in self.__dict__ or any(key in c.__dict__ for c in before)
        }
        self.__dict__["_staging"] = staging
        self.__dict__["_subclass_options"] = mine
        for key, value in staging.items():
            if key not in mine:
                setattr(self, key, value)
        self._current: Optional[weakref.ref] = None  # the newest iterator
        self._last_stats: dict = {}
        self._tuning_memory: Optional[dict] = None  # the last epoch's auto-tuning
        self._prepared: Optional[_SkippingSampler] = None
        self._epoch: Optional[dict] = None  # the epoch in progress
        self._resume: Optional[dict] = None  # set by load_state_dict
        if self.__dict__.get("_init_depth", 0) == 0:  # else: _claim_options
            self.__dict__["_check_assignments"] = True

    def __setattr__(self, name: str, value) -> None:
        # A staging option set after construction is checked here, with
        # staged()'s rules, not at the next iter(), far from the line that
        # set it. Not while constructing (checked as arguments, and a
        # subclass may take a name for its own), nor a subclass's own name.
        if (
            name in STAGING_OPTIONS
            and self.__dict__.get("_check_assignments", False)
            and name not in self.__dict__["_subclass_options"]
        ):
            _check_staging_options({**self.staging_options(), name: value})
        super().__setattr__(name, value)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "_claims_options", False):
            return

        # Once the outermost __init__ of a subclass returns, the staging
        # options whose attributes it set to values of its own are its own.
        # (A wrapper, not a metaclass: a metaclass's __call__ would become
        # the class's signature, which tools read.)
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            depth = self.__dict__.get("_init_depth", 0)
            self.__dict__["_init_depth"] = depth + 1
            try:
                init(self, *args, **kwargs)
            finally:
                self.__dict__["_init_depth"] = depth
            if depth == 0:
                self._claim_options()

        __init__._claims_options = True
        cls.__init__ = __init__

    def _claim_options(self) -> None:
        given = self.__dict__.get("_staging")
        if given is None:  # a subclass that never called this __init__
            return
        mine = self.__dict__["_subclass_options"]
        for key, value in given.items():
            if key not in mine and self.__dict__.get(key, value) is not value:
                mine.add(key)
        self.__dict__["_check_assignments"] = True

    def _staging_option(self, key: str):
        """A staging option: the attribute of its name, which a user (or a
        loader rebuilt from the attributes) may have set, unless a subclass
        took the name for its own (then what this constructor was given)."""
        if key in self.__dict__.get("_subclass_options", ()):
            return self.__dict__["_staging"][key]
        return getattr(self, key, _STAGING_DEFAULTS[key])

    def staging_options(self) -> dict:
        """The staging options this loader stages with, by name."""
        return {key: self._staging_option(key) for key in STAGING_OPTIONS}

    def __getstate__(self):
        # The weak reference to the newest iterator (which owns threads)
        # does not travel: a copy has no iterator yet, nor threads left.
        state = dict(self.__dict__)
        state["_current"] = None
        state.pop("_left", None)
        return state

    def _left_runs(self) -> weakref.WeakSet:
        """Runs whose staging thread was inside user code when the loop
        left (_LoaderIter._close_stage); a run goes once nothing holds it."""
        left = self.__dict__.get("_left")
        if left is None:
            left = self.__dict__["_left"] = weakref.WeakSet()
        return left

    def _wait_left(self) -> None:
        """Wait, up to ``timeout_millis``, for staging threads a loop left
        inside the dataset: the next epoch's reads come after theirs."""
        left = self.__dict__.get("_left")
        if not left:
            return
        timeout_s = self._staging_option("timeout_millis") / 1000
        deadline = time.monotonic() + timeout_s
        for run in list(left):
            # In slices, so that Ctrl-C gets through.
            while not run.wait_idle(min(0.1, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise StageTimeoutError(
                        f"torch_stage.DataLoader: iter() waited {timeout_s:g} s for a "
                        "staging thread that the previous loop left inside the dataset "
                        "(or transform) to finish its call; the dataset is called by one "
                        "thread at a time (timeout_millis bounds this wait)"
                    )
            left.discard(run)

    # A data descriptor over the instance's own __dict__ entry, so that
    # vars(loader) still has prefetch_factor (PyTorch Lightning rebuilds a
    # loader from vars() and the signature) and pickling is unchanged.
    #
    # Why a property at all: Accelerate's prepare_data_loader and
    # skip_first_batches rebuild the loader as a plain
    # torch.utils.data.DataLoader from its attributes, with no hook for the
    # loader's class, so staging would vanish without a word. Both read
    # prefetch_factor while rebuilding; that read is the one place this
    # loader can notice and say what to do instead.
    @property
    def prefetch_factor(self) -> Optional[int]:
        frame = sys._getframe(1)
        quiet = self.__dict__.get("_accelerate_integration", False)
        if not quiet and _accelerate_rebuilding(frame):
            warnings.warn(
                f"accelerate is rebuilding torch_stage.DataLoader "
                f"{self._staging_option('name') or 'dataloader'!r} "
                "as a plain torch.utils.data.DataLoader, so its staging ("
                + ", ".join(f"{key}={value!r}" for key, value in self.staging_options().items())
                + ") is dropped. Use torch_stage.staging.integrations.accelerate_prepare("
                "accelerator, ...) instead of accelerator.prepare(...), and "
                "torch_stage.staging.integrations.accelerate_skip_first_batches(accelerator, "
                "loader, n) instead of accelerator.skip_first_batches(loader, n).",
                UserWarning,
                stacklevel=_outside_accelerate_stacklevel(frame),
            )
        return self.__dict__.get("prefetch_factor")

    @prefetch_factor.setter
    def prefetch_factor(self, value: Optional[int]) -> None:
        self.__dict__["prefetch_factor"] = value

    def _make_stage(self, source, transform) -> Stage:
        # Read from the attributes each time, so that what a user (or a
        # loader rebuilt from them) set is what stages.
        option = self._staging_option
        autotune = option("autotune")
        capacity = option("capacity")
        stage = staged(
            source,
            capacity=2 if capacity is None and not autotune else capacity,
            num_threads=option("num_threads"),
            autotune=autotune,
            # The plain DataLoader produces in the training loop's thread:
            # auto-tuning may come back to that (no staging thread) when a
            # thread does not pay, e.g. when the batches are made by Python
            # code that holds the GIL the training step needs.
            _min_threads=0,
            _initial_threads=0,
            _tuning_memory=self._next_tuning_memory() if autotune else None,
            _internal=True,
            # A failed copy to `device` raises at its batch and the epoch
            # goes on, as the plain DataLoader does after pin_memory fails.
            _item_errors=True,
            stage_subgraph_stream_id=option("stage_subgraph_stream_id"),
            transform=transform,
            ignored_exception_types=() if transform is None else (_pytree.Handled,),
            timeout_millis=option("timeout_millis"),
            device=option("device"),
            name=option("name") or "dataloader",
        )
        self._limit_stage(stage)
        return stage

    def _limit_stage(self, stage: Stage) -> None:
        """Bound the staging threads auto-tuning may use where a batch's
        making and the training loop draw from one global generator
        (_GlobalDraws): only threads left to the tuner; asked for, they
        stage."""
        limit = self.__dict__.get("_thread_limit")
        if limit is not None and self._tuned_threads():
            stage._impl.limit_threads(*limit)

    def _tuned_threads(self) -> bool:
        option = self._staging_option
        return bool(option("autotune")) and option("num_threads") is None

    def _next_tuning_memory(self) -> Optional[dict]:
        """What the next epoch's stage starts from: no staging thread, the
        plain DataLoader's way, with the last epoch's capacity and every
        move's back-off, so that a thread that did not pay is not tried again
        at the start of each epoch.

        Why not the last thread count too: a thread kept on a measurement the
        machine's noise made would then cost every later epoch until its
        reverse move's back-off ran out (seen on the compute-bound cell of
        benchmarks/dataloader_grid.py --epochs 3: a round at 0.65x the plain
        loader); adding a thread where one pays costs one window per epoch.
        When the last epoch did use threads, the moves wait no longer: a wait
        left by a refused third thread must not hold back the first.
        """
        memory = self.__dict__.get("_tuning_memory")
        if memory is None:
            return None
        start = dict(memory, threads=0)
        if memory["threads"] > 0:
            start["cooldown"] = [0] * len(memory["cooldown"])
        return start

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
        plain = base
        if not map_style and skip:
            base = _Skipping(base, skip)
        return base, plain

    def _known_batches(self, skip: int) -> Optional[int]:
        if isinstance(self.dataset, torch.utils.data.IterableDataset):
            # len(self) would make the plain iterator warn about the length;
            # an iterable's end is only known by reading it.
            return None
        try:
            return max(len(super()._index_sampler) - skip, 0)
        except Exception:  # noqa: BLE001 (a sampler without a len(): the plain
            # DataLoader never asks it while iterating, so neither may this)
            return None

    def __iter__(self) -> Iterator[_T_co]:
        self._wait_left()
        if self.persistent_workers and self.num_workers > 0:
            # The new epoch resets the workers the previous iterator reads.
            previous = self._current_iter()
            if previous is not None and not previous._done:
                warnings.warn(
                    "torch_stage.DataLoader: iter() ends the epoch of the iterator before "
                    f"it after {previous._taken} batch(es): its persistent workers are "
                    "reset for the new one, and it raises StopIteration from now on (the "
                    "plain DataLoader hands back the same iterator, reset); finish or "
                    "drop an iterator before making the next",
                    stacklevel=2,
                )
            self.close()
        resume, self._resume = self._resume, None
        user_rng = None
        if resume is not None:
            # The epoch's draws (the workers' base seed, the sampler's) are
            # replayed from its saved start; then the global RNG goes back
            # to where the caller had it, e.g. restored from the same
            # checkpoint, which already holds those draws. The loader's own
            # generator keeps the replay's state: that is where the
            # uninterrupted run left it.
            user_rng = torch.get_rng_state()
            torch.set_rng_state(resume["rng_state"])
            if self.generator is not None and resume["generator_state"] is not None:
                self.generator.set_state(resume["generator_state"])
            skip = resume["consumed"]
        else:
            skip = 0
        self._epoch = {
            "rng_state": torch.get_rng_state(),
            # (Not a torch.Generator: the plain iterator's TypeError says so.)
            "generator_state": self.generator.get_state()
            if isinstance(self.generator, torch.Generator)
            else None,
            "consumed": skip,
        }
        try:
            base, plain = self._base_iterator(skip)
            sampler_iter = getattr(plain, "_sampler_iter", None)
            if user_rng is not None and isinstance(sampler_iter, _SkippingIter):
                sampler_iter.settle()
            if isinstance(sampler_iter, _SkippingIter) and sampler_iter.passes_through():
                # Nothing to skip or replay: the plain iterator draws from
                # the sampler's own iterator, without a call more a batch.
                plain._sampler_iter = sampler_iter._it
        finally:
            if user_rng is not None:
                torch.set_rng_state(user_rng)
        epoch = _Epoch(base, self._known_batches(skip))
        limit = self.__dict__.get("_thread_limit")
        if not self._tuned_threads() or (limit is not None and limit[0] == 0):
            epoch.draws.stop()
        if not (self.persistent_workers and self.num_workers > 0):
            epoch.workers = plain
        it = _LoaderIter(self, epoch, self._epoch, getattr(plain, "_workers", None))
        self._current = weakref.ref(it)
        return it

    def state_dict(self) -> dict:
        """Where the training loop is in the current epoch.

        Only batches the loop has taken (or seen raise) count; batches
        staged ahead do not. Between epochs the state is empty and loading
        it changes nothing.

        Raises:
            ValueError: ``in_order=False`` with workers: batches come in no
                order a count of them could resume from.
        """
        if self._epoch is None:
            return {"version": _STATE_VERSION, "in_epoch": False}
        if self.num_workers > 0 and getattr(self, "in_order", True) is False:
            raise ValueError(
                "state_dict() needs batches in the sampler's order, and "
                f"in_order=False with num_workers={self.num_workers} hands them over "
                "as the workers finish them: a resume from the batches taken would "
                "drop some and repeat others. Use in_order=True (the default) to "
                "save and resume an epoch"
            )
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
        DistributedSampler, call ``set_epoch`` with the same epoch). That
        ``iter()`` replays the epoch's random draws (the workers' base seed,
        the sampler's) from the global RNG state saved with it, then puts
        the global RNG back as it found it.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"not a torch_stage.DataLoader state (version {_STATE_VERSION}): {state!r:.200}"
            )
        self._resume = dict(state) if state["in_epoch"] else None

    def _current_iter(self) -> Optional[_LoaderIter]:
        return None if self._current is None else self._current()

    def stats(self) -> dict:
        """The newest iterator's stage stats (see ``Stage.stats``); after
        it ended, those of its last stage."""
        it = self._current_iter()
        if it is not None and it._stage is not None:
            return it.stats()
        return dict(self._last_stats)

    def close(self) -> None:
        """End the newest iterator's epoch: stop its staging threads (and
        its workers unless they are persistent). Worth calling before
        another loader restores this one's state in the same process: the
        threads read ahead and draw from the global RNG while they load."""
        it = self._current_iter()
        if it is not None:
            it.close()


# What a staging option is when a loader has no attribute of its name (a
# subclass that never called DataLoader.__init__): the constructor's default.
_STAGING_DEFAULTS = {
    key: inspect.signature(DataLoader.__init__).parameters[key].default for key in STAGING_OPTIONS
}


class _FailedCopy:
    """What the stage delivered for a batch whose copy to the device failed:
    the error, to raise at that batch's position."""

    __slots__ = ("error",)

    def __init__(self, error: StageError):
        self.error = error


class _LoaderIter:
    """An epoch of a torch_stage.DataLoader; owns its stage and workers."""

    def __init__(self, loader: DataLoader, epoch: _Epoch, state: dict, workers: Optional[list]):
        self._loader = loader
        self._index_sampler = loader._index_sampler
        self._epoch = epoch
        self._state = state  # the loader's state_dict() bookkeeping
        self._worker_processes = workers
        self._taken = 0  # batches delivered or raised in this epoch
        self._run: Optional[_Run] = None
        self._stage: Optional[Stage] = None
        self._stage_iter = None
        # (index, batch) the stage delivered after batches whose transform
        # raised: those are raised first.
        self._pending: Optional[tuple] = None
        self._last_stats: dict = {}
        self._done = False
        # The stage's _impl while batches may be made here, outside the
        # stage (see __next__), else None; and the transform they then get.
        self._own_impl = None
        self._own_transform: Optional[Callable[[Any], Any]] = None
        # Whether _C._own_next reads the generators for the
        # watch (GeneratorWatch in csrc/python/stage_bindings.cpp), and the
        # byte where that watch signals news.
        self._own_watch = False
        self._watch_signal = bytearray(1)

    def __iter__(self) -> _LoaderIter:
        return self

    def __next__(self):
        impl = self._own_impl
        epoch = self._epoch
        draws = epoch.draws
        watching = draws.watched < _WATCHED_BATCHES
        resumed = False
        if impl is not None and self._pending is None and self._taken not in epoch.failed:
            # The tuner runs no staging thread and none has a batch on its
            # way (begin_own_item() is true): this one is made here, on the
            # loop's thread, as the plain DataLoader makes it (its warnings
            # and errors straight from the dataset), without the stage's
            # hand-over; an error or the end is the plain iterator's, and
            # the stage stays as it was. Written out, draws.make's steps
            # too: each call between a batch's own calls costs several
            # times what it does alone (a frame: a few tenths of a
            # microsecond a batch). With the stage's own watch
            # (_own_watch), _own_next reads the generators.
            python_watch = watching and not self._own_watch
            one_call = not python_watch and self._own_transform is None
            if one_call:
                # All of it in one call (_C._own_next).
                try:
                    batch = _own_next(impl, epoch.base)
                except StopIteration:
                    epoch.pulled += 1
                    if watching and impl.watch_news():
                        self._watch_news(impl, draws)
                    self._finish()
                    raise
                except BaseException:
                    epoch.pulled += 1
                    if watching and impl.watch_news():
                        self._watch_news(impl, draws)
                    self._count()
                    raise
                if batch is not impl:
                    epoch.pulled += 1
                    self._taken += 1
                    self._state["consumed"] += 1
                    if watching:
                        # The stage's watch read the generators; it writes
                        # what it found to the signal's byte (no call). The
                        # Python watch's last reading is older than its
                        # readings (the next batch made outside this path
                        # must not take their draws for the loop's).
                        draws.watched += 1
                        draws.last = None
                        if self._watch_signal[0] or draws.watched >= _WATCHED_BATCHES:
                            self._own_watched(impl, draws)
                    return batch
            else:
                # A transform, or the Python watch (the stage's own reads
                # only for batches without transform): the same steps in
                # three calls.
                if python_watch:
                    draws.loop_thread = threading.get_ident()
                    draws._read(draws.loop)
                    resumed = True
                if impl.begin_own_item():
                    try:
                        try:
                            batch = next(epoch.base)
                        finally:
                            if python_watch:
                                draws._read(draws.pull)
                    except StopIteration:
                        epoch.pulled += 1
                        impl.end_own_item(False)
                        self._finish()
                        raise
                    except BaseException:
                        epoch.pulled += 1
                        impl.end_own_item(False)
                        self._count()
                        raise
                    epoch.pulled += 1
                    transform = self._own_transform
                    if transform is not None:
                        try:
                            batch = (
                                draws.make(draws.transform, transform, batch)
                                if watching
                                else transform(batch)
                            )
                        except BaseException:
                            impl.end_own_item(False)
                            self._count()
                            raise
                    impl.end_own_item(True)
                    self._taken += 1
                    self._state["consumed"] += 1
                    if python_watch and draws.loop_leaves():
                        self._limit_threads(draws.limit())
                    return batch
            if self._own_watch:
                # A producer is at work: the Python watch, which sees where
                # batches are made, watches from here on, with what the
                # stage's watch found up to its last reading (this call read
                # nothing: the producer may have drawn since).
                if impl.watch_news():
                    self._watch_news(impl, draws)
                impl.watch_generators(None)
                self._own_watch = False
                draws.last = None
        if self._done:
            raise StopIteration
        index = self._taken
        if watching and not resumed:
            draws.loop_resumes()
        # Batches that raised on a staging thread, the stage's skipped
        # transform errors and a run's final error, raise at their position.
        failed = epoch.failed.pop(index, None)
        if failed is not None and failed[2] and self._stage is not None:
            # The run ended at this batch: every batch before it was taken.
            self._close_stage()
        if failed is None and self._pending is not None:
            batch = self._pending[1]
            self._pending = None
        elif failed is None:
            if self._stage is None:
                # The first batch of an epoch, and the one after an error in
                # the plain iterator, is pulled here, on the consumer's
                # thread, when it asks: the plain DataLoader draws the
                # sampler's seed there.
                records: list = []
                try:
                    batch = epoch.pull(records, watched=False)
                except StopIteration:
                    _reemit(records)
                    self._finish()
                    raise
                except BaseException:
                    self._count()
                    _reemit(records)
                    raise
                if records:
                    epoch.warnings[index] = records
                transform = self._loader._staging_option("transform")
                self._run = _Run(epoch)
                self._stage = self._loader._make_stage(
                    self._run.source(index, batch),
                    None if transform is None else self._run.transform(transform),
                )
                self._stage_iter = iter(self._stage)
                # A batch for `device` is copied by the stage (pinned buffers,
                # its stream): never made outside it.
                own = self._loader._staging_option("device") is None
                self._own_impl = self._stage._impl if own else None
                self._own_transform = transform
                reader = _watch_reader() if own and watching and transform is None else None
                if reader is not None:
                    self._own_impl.watch_generators(reader, self._watch_signal)
                    self._own_watch = True
            elif epoch.known is not None and index >= epoch.known:
                self._run.demand.release()
            try:
                batch = next(self._stage_iter)
            except StopIteration:
                self._close_stage()
                # The run ended at an error (raised from the next call on,
                # a new run follows it), or the epoch did.
                failed = epoch.failed.pop(index, None)
                if failed is None:
                    self._finish()
                    raise
            except StageError as exc:
                if isinstance(exc, (StageTimeoutError, StageClosed)) or self._stage._impl.failed:
                    raise  # no batch was taken (or the stage ended: a bug)
                # A failed copy to the device (the stage's item_errors): an
                # error at its batch only, and the stage goes on.
                # Without its traceback, whose frames (this one) would hold
                # the iterator while it is pending.
                batch = _FailedCopy(exc.with_traceback(None))
            if failed is None and epoch.failed and index in epoch.failed:
                # The stage skipped this batch (its transform raised) and
                # the ones after it recorded with it; it delivers in order
                # and records a skip before delivering past it, so what it
                # delivered is the first one after them.
                position = index + 1
                while position in epoch.failed:
                    position += 1
                self._pending = (position, batch)
                failed = epoch.failed.pop(index)
        if failed is None and isinstance(batch, _FailedCopy):
            # Delivered now, or pending after the transform errors before it.
            failed = (batch.error, epoch.warnings.pop(index, []), False)
        if failed is not None:
            # Raised outside the except clause: the plain DataLoader's
            # exception has no StopIteration as its context.
            exc, records, _ = failed
            self._count()
            _reemit(records)
            try:
                raise exc
            finally:
                # The traceback holds this frame: a local naming the
                # exception would be a cycle keeping the iterator (and its
                # threads and workers) alive until the garbage collector runs.
                exc = failed = batch = None
        records = epoch.warnings.pop(index, None)
        # Counted first: under an "error" filter the warning raises instead
        # of the batch, which the plain DataLoader has then used up too.
        self._count()
        if draws.watched < _WATCHED_BATCHES and draws.loop_leaves():
            self._limit_threads(draws.limit())
        if records:
            _reemit(records)
        return batch

    def _own_watched(self, impl, draws: _GlobalDraws) -> None:
        """After a batch the stage's watch saw made (counted), where it
        signalled news or the watch is over."""
        if impl.watch_news():
            self._watch_news(impl, draws)
        if draws.watched >= _WATCHED_BATCHES and self._own_watch:
            impl.watch_generators(None)
            self._own_watch = False

    def _watch_news(self, impl, draws: _GlobalDraws) -> None:
        """What the stage's generator watch found, into ``draws``; its
        limit, applied. A stale watch (NumPy imported since it was made)
        hands over to the Python watch."""
        loop, pull, stale = impl.watch_state()
        draws.loop.update(k for k in (0, 1, 2) if loop >> k & 1)
        draws.pull.update(k for k in (0, 1, 2) if pull >> k & 1)
        if stale:
            impl.watch_generators(None)
            self._own_watch = False
            draws.last = None
        self._limit_threads(draws.limit())

    def _limit_threads(self, limit: Optional[tuple]) -> None:
        """A limit on staging threads _GlobalDraws found: kept by the loader
        for its later stages, and applied to this one."""
        loader = self._loader
        known = loader.__dict__.get("_thread_limit")
        if limit is None or (known is not None and known[0] <= limit[0]):
            return
        loader._thread_limit = limit
        if self._stage is not None:
            loader._limit_stage(self._stage)

    def _count(self) -> None:
        self._taken += 1
        self._state["consumed"] += 1

    def _stats_of(self, stage: Stage, run: _Run) -> dict:
        stats = stage.stats()
        # Batches whose transform raised were raised to the training loop,
        # not skipped.
        stats["skipped"] -= len(run.handled)
        return stats

    def _close_stage(self) -> None:
        run, stage = self._run, self._stage
        self._run = self._stage = self._stage_iter = self._own_impl = None
        self._own_watch = False
        if run is None:
            return
        loader = self._loader
        if loader.num_workers == 0:
            # Leaving a loop is immediate, as with the plain loader: a
            # staging thread inside the dataset is not waited for; it ends
            # after that call and makes nothing more (run.close()), and the
            # loader's next iter() waits for it, so the dataset is still
            # called by one thread at a time.
            if run.close():
                loader._left_runs().add(run)
            stage._impl.close(join_timeout_ms=0, warn_if_left=False)
        else:
            # Worker processes are shut down after this: a staging thread
            # reading from them must be gone first (the plain loader's own
            # shutdown waits for them too).
            run.stop()
            stage.close()
            run.close()
        self._last_stats = loader._last_stats = self._stats_of(stage, run)
        loader._tuning_memory = stage._tuning_memory()

    def _finish(self) -> None:
        if self._loader._epoch is self._state:
            self._loader._epoch = None
        self.close()

    def close(self) -> None:
        """Stop the staging threads and, unless persistent, the workers."""
        self._done = True
        self._close_stage()
        self._pending = None
        self._epoch.failed.clear()
        workers, self._epoch.workers = self._epoch.workers, None
        self._epoch.base = None
        # Not left to the plain iterator's __del__: a batch's exception
        # keeps it alive in its traceback's frames until the garbage
        # collector runs, and that shutdown waits 5 s per worker.
        shutdown = getattr(workers, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __del__(self):
        if "_epoch" in self.__dict__:
            self.close()

    def __len__(self) -> int:
        # The plain iterator's: its index sampler's (an iterable dataset's
        # has none, even where the dataset and the loader have a len()).
        return len(self._index_sampler)

    @property
    def _workers(self) -> list:
        # The plain iterator's worker processes, read-only: PyTorch's own
        # DataLoader tests (and tools) read _workers to check that they exit
        # when the iterator goes. A single-process iterator has none.
        if self._worker_processes is None:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute '_workers' (num_workers=0)"
            )
        return self._worker_processes

    def stats(self) -> dict:
        if self._stage is not None:
            return self._stats_of(self._stage, self._run)
        return dict(self._last_stats)
