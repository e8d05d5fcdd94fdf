"""The stream sanitizer: check stream plans on any device, CPU included.

On a GPU a missing wait or a missing ``record_stream`` shows up, now and
then, as a wrong number; on a CPU the stream ops do nothing and it never
shows. :func:`sanitize_streams` runs a program as usual and models CUDA
stream semantics on the side, as PyTorch's CUDA sanitizer
(``torch.cuda._sanitizer``, ``TORCH_CUDA_SANITIZER=1``) does on a GPU:

* Streams are logical: ``"default"`` (the legacy default stream, shared by
  every thread), ``"pool<k>"`` (side stream ``k`` of torch_stage's pool,
  shared by every run and scope), ``"staging<k>"`` (a staging stream).
  Each has a vector clock. Every stream operation of torch_stage, from any
  caller (eager, scripted, compiled, C++), reaches the model through one
  C++ observer (``csrc/streams/stream_observer.h``): a fork, an event
  record and wait, a join, a scope's enter and exit, ``record_stream``.
  Each thread has a current stream, ``"default"`` to begin with.
* Every ATen op run by a sanitized thread is seen through a
  ``TorchDispatchMode``. What it reads and writes comes from its schema:
  an argument whose ``alias_info.is_write`` is set is written (in-place
  ops, ``out=``, ``_foreach_*_``, fused optimizers, setitem), one with a
  non-write alias set is only viewed (no access), every other tensor
  argument is read, and a fresh output is written (and allocated) on the
  current stream. No list of op names; the one write schemas leave out
  (batch norm's running statistics in training) comes from
  ``torch_stage.streams.fx.effects.understated_writes``. Accesses are tracked per
  storage, so views and the base they share memory with are one.
* An access that is not ordered after a conflicting access on another
  stream (read after write, write after read, write after write) is a
  race. So is a free that the caching allocator could turn into one: a
  storage is freed onto the stream it was allocated on, and the next
  allocation on that stream may be handed its memory, whatever its size.
  A free onto the caller's stream (or any stream torch_stage does not
  manage) while an access on another stream is not ordered before it and
  no ``record_stream`` names that stream is the race, reported at the
  free. On torch_stage's pool and staging streams, which allocate only
  after a fork, scope or copy has ordered them after the caller's stream,
  it is judged at their next allocation instead (a gradient made on a
  pool stream by backward, read by the optimizer and freed by
  ``zero_grad``, is ordered by the next forward's fork).
* Autograd: a backward node runs on the stream that ran the forward op
  that made it (tagged in ``node.metadata`` when the op returns), as
  PyTorch's engine does on a GPU. The engine orders a node after the
  producers of its input gradients; the model orders it after every node
  that ran before it in the same backward pass (a superset), so races
  between backward nodes running side by side are not reported, while
  everything between the forward pass, the backward pass and the optimizer
  is. When backward ends, the caller's stream waits on
  every stream backward used (the engine's leaf-stream sync). Nodes of
  scripted code are tagged the same way.

A race raises :class:`torch_stage.StreamRaceError` at the op that races
(for a free, at the next op after it, or on exit), or, with
``raise_on_race=False``, is appended to :attr:`StreamSanitizer.races`.

Scope: the model covers the threads that entered the sanitizer (each
thread enters it with ``with sanitizer:``; a TorchDispatchMode is
per-thread) and the stream ops of every thread. It sees what goes through
the dispatcher: kernels launched by other means (custom CUDA code behind a
pybind function, a CUDA graph replay) are invisible to it. While it is
active, an error raised by an op inside TorchScript code reaches the caller
without its message (PyTorch's Python dispatch under the TorchScript
interpreter); the error type and the TorchScript traceback remain.
"""

from __future__ import annotations

import atexit
import linecache
import os
import re
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_stage import _C
from torch_stage.errors import StreamRaceError
from torch_stage.streams.fx.effects import understated_writes

__all__ = ["StreamAccess", "StreamRace", "StreamSanitizer", "sanitize_streams"]

DEFAULT_STREAM = "default"
# Logical streams torch_stage manages: pool streams and staging streams.
_MANAGED_STREAMS = ("pool", "staging")

_Clock = Dict[str, int]
_ASSIGNED = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)")

# Frames of these files are left out of access stacks: they are the
# machinery, not the user's code.
_INTERNAL_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.abspath(__file__),
)


@dataclass(frozen=True)
class StreamAccess:
    """One access of a storage by an op (or its free).

    Attributes:
        stream: the logical stream (``"default"``, ``"pool1"``, ...).
        seq: the op's position on that stream.
        op: the ATen op (``"aten::add_.Tensor"``) or ``"free"``.
        node: the FX node whose generated code ran the op, if any.
        is_write: whether the op writes the storage.
        frames: ``(file, line, function)`` of the Python stack, innermost
            last, without torch's own frames.
    """

    stream: str
    seq: int
    op: str
    node: Optional[str]
    is_write: bool
    frames: Tuple[Tuple[str, int, str], ...] = ()

    def describe(self) -> str:
        kind = "write" if self.is_write else "read"
        where = f" (FX node {self.node})" if self.node else ""
        return f"{kind} by {self.op}{where} on stream {self.stream}"

    def stack(self) -> str:
        lines = []
        for filename, lineno, name in self.frames:
            lines.append(f'    File "{filename}", line {lineno}, in {name}')
            text = linecache.getline(filename, lineno).strip()
            if text:
                lines.append(f"      {text}")
        return "\n".join(lines)


@dataclass(frozen=True)
class StreamRace:
    """Two accesses of one storage on different streams with no order.

    Attributes:
        kind: ``"read after write"``, ``"write after read"``, ``"write
            after write"``, or ``"free while in use"``.
        storage: the storage's address (an id; the memory may be reused
            since).
        shape: the shape of the tensor of the current access.
        previous: the earlier access.
        current: the access that is not ordered after it; for a race
            with a free, the free itself (``op == "free"``, with the stack
            of the line that dropped the last reference), or, on a pool or
            staging stream, the next allocation there, which may be handed
            the memory.
    """

    kind: str
    storage: int
    shape: Tuple[int, ...]
    previous: StreamAccess
    current: StreamAccess

    def __str__(self) -> str:
        lines = [
            f"stream race ({self.kind}) on storage {self.storage:#x} "
            f"(tensor of shape {list(self.shape)}):",
            f"  {self.current.describe()}",
            f"  is not ordered after the {self.previous.describe()}.",
        ]
        if self.kind == "free while in use" and self.current.op == "free":
            lines[1] = (
                f"  the memory was freed onto its allocation stream {self.current.stream}, "
                "whose next allocation may be handed it,"
            )
            lines[2] = (
                f"  while the {self.previous.describe()} is not ordered before the free "
                f"and no record_stream names stream {self.previous.stream}."
            )
        elif self.kind == "free while in use":
            lines[1] = (
                f"  the memory was freed onto its allocation stream {self.current.stream}, "
                f"whose next allocation ({self.current.op}) may reuse it,"
            )
            lines[2] = (
                f"  while the {self.previous.describe()} is not ordered before that "
                "allocation and no record_stream names that stream."
            )
        for title, access in (("current", self.current), ("previous", self.previous)):
            stack = access.stack()
            if stack:
                what = "free" if access.op == "free" else f"{title} access"
                lines.append(f"  stack of the {what}:\n{stack}")
        return "\n".join(lines)


class _Storage:
    __slots__ = ("alloc_stream", "last_write", "reads", "recorded", "shape", "finalizer")

    def __init__(self, alloc_stream: Optional[str], shape: Tuple[int, ...]):
        self.alloc_stream = alloc_stream
        self.last_write: Optional[StreamAccess] = None
        # Reads since the last write, at most one per stream (the latest:
        # ordering after it implies ordering after the earlier ones).
        self.reads: Dict[str, StreamAccess] = {}
        self.recorded: Set[str] = set()
        self.shape = shape
        self.finalizer = None


class _Thread:
    __slots__ = ("current", "scopes", "backward", "untagged", "program")

    def __init__(self):
        self.current = DEFAULT_STREAM
        # (stream, FX node) of the stream program node this thread runs
        # (torch_stage.streams.fx.program), or None.
        self.program: Optional[Tuple[str, Optional[str]]] = None
        # Outputs of the last op and its stream: autograd sets their grad_fn
        # after the dispatch mode returns, so they are tagged at the next op.
        self.untagged: List[Tuple[torch.Tensor, str]] = []
        # (scope id, enclosing stream, target stream), outermost first.
        self.scopes: List[Tuple[int, str, str]] = []
        self.backward: Optional[_Backward] = None


class _Backward:
    """One backward pass on one thread (see the module doc)."""

    __slots__ = ("caller", "node", "stream", "frontier", "streams", "written")

    def __init__(self, caller: str, frontier: _Clock):
        self.caller = caller
        # Storages written during this pass (gradients, mostly).
        self.written: Set[int] = set()
        self.node: Any = None
        self.stream = caller
        self.frontier = frontier
        self.streams = {caller}


class _Run:
    __slots__ = ("streams", "thread")

    def __init__(self, streams: List[str], thread: int):
        self.streams = streams
        self.thread = thread


_STREAM_KEY = "torch_stage_stream"


class StreamSanitizer(TorchDispatchMode):
    """The model behind :func:`sanitize_streams` (see the module doc).

    Enter it (``with sanitizer:``) on each thread whose ops it should see;
    one thread cannot enter it twice. :attr:`races` lists what was found.
    """

    def __init__(self, raise_on_race: bool = True, stacks: bool = True):
        super().__init__()
        for name, value in (("raise_on_race", raise_on_race), ("stacks", stacks)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
        self.raise_on_race = raise_on_race
        self.stacks = stacks
        self.races: List[StreamRace] = []
        self._lock = threading.RLock()
        self._clocks: Dict[str, _Clock] = {}
        self._storages: Dict[int, _Storage] = {}
        self._threads: Dict[int, _Thread] = {}
        self._runs: Dict[int, _Run] = {}
        self._events: Dict[Tuple[int, int], _Clock] = {}
        # scope id -> (id, enclosing stream, target stream, entering thread)
        self._scopes: Dict[int, Tuple[int, str, str, int]] = {}
        self._pending: List[StreamRace] = []
        # Allocation stream -> storages freed onto it while an access on
        # another stream was pending: (id, shape, those accesses).
        self._freed: Dict[str, List[Tuple[int, Tuple[int, ...], List[StreamAccess]]]] = {}
        self._entered: Set[int] = set()  # threads inside `with self:`
        self.ops_seen = 0

    # -- entering and leaving --------------------------------------------

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while torch.compile traces (fake tensors, no real accesses),
        # on while the compiled code runs.
        return True

    def __enter__(self):
        me = threading.get_ident()
        with self._lock:
            if me in self._entered:
                raise RuntimeError(
                    "torch_stage.sanitize_streams: this sanitizer is already active on this "
                    "thread; sanitizers do not nest (leave the outer one first)"
                )
            if _active_sanitizer() not in (None, self):
                raise RuntimeError(
                    "torch_stage.sanitize_streams: another stream sanitizer is active in this "
                    "process; one at a time (the stream observer is process-wide)"
                )
            _check_not_capturing()
            first = not self._entered
            self._entered.add(me)
        if first:
            _install(self)
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        super().__exit__(exc_type, exc, tb)
        me = threading.get_ident()
        with self._lock:
            self._entered.discard(me)
            last = not self._entered
        if last:
            _uninstall(self)
            # Storages freed after this point are not ours to judge.
            with self._lock:
                for state in self._storages.values():
                    if state.finalizer is not None:
                        state.finalizer.detach()
                self._storages.clear()
        if exc_type is None:
            self._raise_pending()
        return False

    # -- the model -------------------------------------------------------

    def _clock(self, stream: str) -> _Clock:
        clock = self._clocks.get(stream)
        if clock is None:
            clock = self._clocks[stream] = {stream: 0}
        return clock

    def _merge(self, into: str, clock: _Clock) -> None:
        target = self._clock(into)
        for s, v in clock.items():
            if target.get(s, 0) < v:
                target[s] = v

    def _ordered(self, access: StreamAccess, stream: str) -> bool:
        return access.stream == stream or self._clock(stream).get(access.stream, 0) >= access.seq

    def _thread(self, ident: Optional[int] = None) -> _Thread:
        ident = threading.get_ident() if ident is None else ident
        state = self._threads.get(ident)
        if state is None:
            state = self._threads[ident] = _Thread()
        return state

    def current_stream(self) -> str:
        """The calling thread's current logical stream."""
        with self._lock:
            return self._thread().current

    def _report(self, race: StreamRace, now: bool) -> None:
        self.races.append(race)
        if self.raise_on_race:
            if now:
                raise StreamRaceError(str(race), race)
            self._pending.append(race)

    def _raise_pending(self) -> None:
        if self._pending:
            race = self._pending[0]
            self._pending.clear()
            raise StreamRaceError(str(race), race)

    # -- stream operations (from the C++ observer) -------------------------

    def _on_stream_op(self, op, owner, stream, event, streams, value, owner_thread):
        with self._lock:
            if op == "fork":
                me = threading.get_ident()
                caller = self._thread(me).current
                keys = [caller] + [f"pool{k}" for k in range(1, stream)]
                self._runs[owner] = _Run(keys, me)
                snapshot = dict(self._clock(caller))
                for s in streams:
                    self._merge(keys[s], snapshot)
                return
            if op in ("scope_enter", "scope_exit"):
                self._on_scope(op, owner, stream, owner_thread)
                return
            if op in ("stage_copy", "stage_hand_over"):
                self._on_stage(op, owner, stream, event, value)
                return
            run = self._runs.get(owner)
            if run is None:
                # Forked before the sanitizer was installed.
                return
            if op == "set_stream":
                self._thread(run.thread).current = run.streams[stream]
            elif op == "record_event":
                self._events[(owner, event)] = dict(self._clock(run.streams[stream]))
            elif op == "wait_event":
                self._merge(run.streams[stream], self._events.get((owner, event), {}))
            elif op == "record_stream":
                for t in _tensors(value):
                    state = self._storage_of(t)
                    if state is not None:
                        state.recorded.add(run.streams[stream])
            elif op == "join":
                caller = run.streams[0]
                for s in streams:
                    self._merge(caller, self._clock(run.streams[s]))
                if owner_thread:
                    self._thread(run.thread).current = caller
                del self._runs[owner]
                for key in [k for k in self._events if k[0] == owner]:
                    del self._events[key]

    def _on_scope(self, op: str, owner: int, index: int, owner_thread: bool) -> None:
        if op == "scope_enter":
            state = self._thread()
            current = state.current
            base = state.scopes[0][1] if state.scopes else current
            target = base if index == 0 else f"pool{index}"
            if target != current:
                self._merge(target, self._clock(current))
            entry = (owner, current, target)
            state.scopes.append(entry)
            self._scopes[owner] = entry + (threading.get_ident(),)
            state.current = target
            return
        entry = self._scopes.pop(owner, None)
        if entry is None:
            return
        _, enclosing, target, thread = entry
        if target != enclosing:
            self._merge(enclosing, self._clock(target))
        state = self._thread(thread)
        state.scopes = [s for s in state.scopes if s[0] != owner]
        if owner_thread:
            state.current = enclosing

    def _on_stage(self, op: str, owner: int, stream: int, event: int, value: Any) -> None:
        key = (-owner, event)
        if op == "stage_copy":
            name = f"staging{stream}"
            seq = self._tick(name)
            access = StreamAccess(name, seq, "stage_copy", None, True)
            self._check_reuse(name, access)
            for t in _tensors(value):
                state = self._storage_of(t, alloc_stream=name)
                if state is not None:
                    state.last_write = access
                    state.reads.clear()
            self._events[key] = dict(self._clock(name))
        else:
            clock = self._events.pop(key, None)
            if clock is not None:
                self._merge(self._thread().current, clock)

    # -- stream programs run op by op (torch_stage.streams.fx.program) -------
    #
    # A compiled stream program (AOTAutograd's graphs, ``torch.ops.streams``
    # events, a stream per node) runs on the calling thread; its runner
    # tells the model which stream each node runs on and what each stream
    # op does. Events are the program's side-table indices, per thread (the
    # compiled code's events are per thread too).

    def _program_base(self) -> str:
        """The stream the calling thread's ops run on outside a program: a
        program's caller's stream (in a backward pass, the stream the
        engine runs the program's autograd node on)."""
        with self._lock:
            self._thread().program = None
            return self._op_stream()

    def _program_at(self, stream: Optional[str], node: Optional[str]) -> None:
        """The calling thread runs program node ``node`` on ``stream``
        (None: the program ended)."""
        with self._lock:
            self._thread().program = None if stream is None else (stream, node)

    def _program_record(self, event: int, stream: str) -> None:
        with self._lock:
            key = ("program", threading.get_ident(), event)
            self._events[key] = dict(self._clock(stream))

    def _program_wait(self, event: int, stream: str) -> None:
        with self._lock:
            key = ("program", threading.get_ident(), event)
            self._merge(stream, self._events.get(key, {}))

    def _program_wait_stream(self, waiting: str, waited: str) -> None:
        with self._lock:
            self._merge(waiting, dict(self._clock(waited)))

    def _program_host_sync(self) -> None:
        """The host waited for the device: whatever any stream issues next
        comes after everything issued so far."""
        with self._lock:
            union: _Clock = {}
            for clock in self._clocks.values():
                for s, v in clock.items():
                    union[s] = max(union.get(s, 0), v)
            for name in list(self._clocks):
                self._merge(name, union)

    def _program_keep(self, value: Any, stream: str) -> None:
        """``record_stream``: the storages in ``value`` are used on
        ``stream``."""
        with self._lock:
            for t in _tensors(value):
                state = self._storage_of(t)
                if state is not None:
                    state.recorded.add(stream)

    # -- storages and accesses ---------------------------------------------

    def _tick(self, stream: str) -> int:
        clock = self._clock(stream)
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def _storage_of(
        self, t: torch.Tensor, alloc_stream: Optional[str] = None
    ) -> Optional[_Storage]:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        if storage.device.type == "meta":
            return None
        key = storage._cdata
        state = self._storages.get(key)
        if state is None:
            # Not seen before: allocated now on `alloc_stream`, or outside the
            # model (before it started, or by code it does not see, such as a
            # Python scalar wrapped into a tensor): written before everything,
            # on an allocation stream the model does not know, so its free is
            # not judged.
            state = self._storages[key] = _Storage(alloc_stream, tuple(t.shape))
            state.finalizer = weakref.finalize(storage, self._on_free, key)
        return state

    def _on_free(self, key: int) -> None:
        with self._lock:
            state = self._storages.pop(key, None)
            if state is None or state.alloc_stream is None:
                return
            alloc = state.alloc_stream
            accesses = list(state.reads.values())
            if state.last_write is not None:
                accesses.append(state.last_write)
            pending = [
                a
                for a in accesses
                if a.stream != alloc
                and a.stream not in state.recorded
                and not self._ordered(a, alloc)
            ]
            if not pending:
                return
            if alloc.startswith(_MANAGED_STREAMS):
                # torch_stage's own streams allocate only after a fork, a
                # scope or a staging copy has ordered them after the
                # caller's stream, which a later wait may order after the
                # access too (backward's gradients, read by the optimizer
                # and freed by zero_grad, are): judged at the next
                # allocation on `alloc`, against its clock.
                self._freed.setdefault(alloc, []).append((key, state.shape, pending))
                return
            # Any stream else (the caller's, a user's) may allocate next,
            # whatever the program does then: the block is the next
            # allocation's as of now, so the free is the race.
            node, frames = self._where()
            seq = self._clock(alloc).get(alloc, 0)
            free = StreamAccess(alloc, seq, "free", node, True, frames)
            race = StreamRace("free while in use", key, state.shape, pending[0], free)
            self._report(race, now=False)

    def _check_reuse(self, stream: str, allocation: StreamAccess) -> None:
        """A fresh allocation on ``stream`` may get any block freed onto it."""
        freed = self._freed.pop(stream, None)
        if not freed:
            return
        for key, shape, pending in freed:
            for access in pending:
                if not self._ordered(access, stream):
                    race = StreamRace("free while in use", key, shape, access, allocation)
                    self._report(race, now=False)
                    break

    def _access(self, t: torch.Tensor, access: StreamAccess, is_write: bool) -> None:
        state = self._storage_of(t)
        if state is None:
            return
        key = t.untyped_storage()._cdata
        stream = access.stream
        bw = self._thread().backward
        if bw is not None:
            if is_write:
                bw.written.add(key)
            elif key in bw.written:
                # A gradient passed between backward nodes: the engine marks
                # it used on the consumer's stream (record_stream in
                # InputBuffer), after ordering the consumer after it.
                state.recorded.add(stream)
        if state.last_write is not None and not self._ordered(state.last_write, stream):
            kind = "write after write" if is_write else "read after write"
            self._report(StreamRace(kind, key, tuple(t.shape), state.last_write, access), True)
        if is_write:
            for read in state.reads.values():
                if not self._ordered(read, stream):
                    race = StreamRace("write after read", key, tuple(t.shape), read, access)
                    self._report(race, True)
            state.last_write = access
            state.reads.clear()
        else:
            state.reads[stream] = access

    # -- the dispatch mode -------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.name.startswith("torch_stage::"):
            # Stream ops reach the model through the observer.
            return func(*args, **kwargs)
        if torch._C._get_tracing_state() is not None:
            # torch.jit.trace records this op. Traced under this mode, a
            # convolution's output reached the tracer as a constant, and
            # the traced module returned this one run's values, silently
            # (reading the output here is not the only cause: passing the
            # op straight through gave the same). Refused instead.
            raise RuntimeError(
                "torch_stage.sanitize_streams: torch.jit.trace cannot record a module under "
                "the stream sanitizer (the trace would hold this run's values as constants; "
                f"at {func}); trace it outside the sanitizer, then run the traced module "
                "under it"
            )
        with self._lock:
            self._raise_pending()
            self.ops_seen += 1
            stream = self._op_stream()
            reads: List[torch.Tensor] = []
            writes: List[torch.Tensor] = []
            named = {}
            for i, arg in enumerate(schema.arguments):
                if arg.kwarg_only or i >= len(args):
                    if arg.name not in kwargs:
                        continue
                    value = kwargs[arg.name]
                else:
                    value = args[i]
                named[arg.name] = value
                info = arg.alias_info
                if info is not None and not info.is_write:
                    continue  # a view: no data access
                tensors = list(_tensors(value))
                if info is not None and info.is_write:
                    writes.extend(tensors)
                else:
                    reads.extend(tensors)
            # Writes the schema leaves out (batch norm's running statistics).
            for value in understated_writes(named):
                for t in _tensors(value):
                    reads = [r for r in reads if r is not t]
                    writes.append(t)
            if reads or writes:
                seq = self._tick(stream)
                node, frames = self._where()
                name = str(func)
                for t in reads:
                    self._access(t, StreamAccess(stream, seq, name, node, False, frames), False)
                for t in writes:
                    self._access(t, StreamAccess(stream, seq, name, node, True, frames), True)
            else:
                seq = None
        out = func(*args, **kwargs)
        with self._lock:
            fresh = [
                t
                for ret, value in zip(schema.returns, _returns(out, len(schema.returns)))
                if ret.alias_info is None
                for t in _tensors(value)
            ]
            if fresh:
                if seq is None:
                    seq = self._tick(stream)
                    node, frames = self._where()
                access = StreamAccess(stream, seq, str(func), node, True, frames)
                self._check_reuse(stream, access)
                bw = self._thread().backward
                for t in fresh:
                    state = self._storage_of(t, alloc_stream=stream)
                    if state is not None and state.last_write is None:
                        state.last_write = access
                        if bw is not None:
                            bw.written.add(t.untyped_storage()._cdata)
            if torch.is_grad_enabled() and torch._C._current_autograd_node() is None:
                self._thread().untagged.extend((t, stream) for t in _tensors(out))
        return out

    def _op_stream(self) -> str:
        state = self._thread()
        if state.untagged:
            for t, stream in state.untagged:
                if t.grad_fn is not None:
                    _tag(t.grad_fn, stream)
            state.untagged.clear()
        node = torch._C._current_autograd_node()
        if node is None:
            if state.backward is not None:
                self._end_backward(state)
            return state.current if state.program is None else state.program[0]
        bw = state.backward
        if bw is None:
            bw = state.backward = _Backward(state.current, dict(self._clock(state.current)))
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._end_backward_locked(threading.get_ident())
            )
        if node is not bw.node:
            # The engine orders a node after the producers of its inputs;
            # the model after everything earlier in this backward pass.
            self._merge_into_frontier(bw, bw.stream)
            bw.node = node
            try:
                bw.stream = node.metadata.get(_STREAM_KEY, bw.caller)
            except (RuntimeError, AttributeError):
                bw.stream = bw.caller
            bw.streams.add(bw.stream)
            self._merge(bw.stream, bw.frontier)
        if state.program is not None:
            # A compiled backward runs as one autograd node: the engine
            # orders that node's stream (bw.stream) after its inputs, and
            # none of the streams the program switches to.
            return state.program[0]
        return bw.stream

    def _merge_into_frontier(self, bw: _Backward, stream: str) -> None:
        for s, v in self._clock(stream).items():
            if bw.frontier.get(s, 0) < v:
                bw.frontier[s] = v

    def _end_backward_locked(self, ident: int) -> None:
        with self._lock:
            state = self._threads.get(ident)
            if state is not None and state.backward is not None:
                self._end_backward(state)

    def _end_backward(self, state: _Thread) -> None:
        bw = state.backward
        state.backward = None
        for s in bw.streams:
            self._merge(bw.caller, self._clock(s))
        state.current = bw.caller

    def _where(self) -> Tuple[Optional[str], Tuple[Tuple[str, int, str], ...]]:
        program = self._thread().program
        node = program[1] if program is not None else None
        frames = []
        f = sys._getframe(2)
        while f is not None:
            code = f.f_code
            filename = code.co_filename
            if node is None and filename.startswith("<eval_with_key>"):
                # Generated code assigns each node to its name.
                match = _ASSIGNED.match(linecache.getline(filename, f.f_lineno))
                node = match.group(1) if match else None
            if self.stacks and not filename.startswith(_INTERNAL_DIRS):
                frames.append((filename, f.f_lineno, code.co_name))
            f = f.f_back
        frames.reverse()
        return node, tuple(frames[-8:])


def _tag(fn, stream: str) -> None:
    todo = [fn]
    while todo:
        fn = todo.pop()
        if fn is None:
            continue
        try:
            meta = fn.metadata
        except (RuntimeError, AttributeError):
            continue
        if _STREAM_KEY in meta:
            continue
        meta[_STREAM_KEY] = stream
        todo.extend(next_fn for next_fn, _ in fn.next_functions)


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _returns(out: Any, count: int) -> List[Any]:
    if count == 1:
        return [out]
    if isinstance(out, (list, tuple)) and len(out) == count:
        return list(out)
    return [out] * count


def _check_not_capturing() -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "torch_stage.sanitize_streams: cannot start while a CUDA graph is being "
            "captured on this thread; sanitize the eager module (a replay launches no "
            "ops the sanitizer could see)"
        )


_installed: List[StreamSanitizer] = []


def _active_sanitizer() -> Optional[StreamSanitizer]:
    return _installed[0] if _installed else None


def _install(sanitizer: StreamSanitizer) -> None:
    _installed.append(sanitizer)
    _C._set_stream_observer(sanitizer._on_stream_op)


def _uninstall(sanitizer: StreamSanitizer) -> None:
    if sanitizer in _installed:
        _installed.remove(sanitizer)
        _C._set_stream_observer(None)


def sanitize_streams(raise_on_race: bool = True, stacks: bool = True) -> StreamSanitizer:
    """Check every stream plan that runs inside the block for races.

    Use it as a context manager around code that runs torch_stage
    multi-stream modules (eager, scripted, compiled), stream annotations,
    or staged device copies, on any device::

        with torch_stage.sanitize_streams():
            out = model(x)          # raises StreamRaceError on a race
            out.sum().backward()

    See :mod:`torch_stage.streams.sanitizer` for what is modelled. The program
    computes what it would without the sanitizer, only slower (every op
    goes through a Python dispatch mode). ``TORCH_STAGE_SANITIZE=1`` in the
    environment enables one for the main thread of a whole process, from
    ``import torch_stage`` on.

    Args:
        raise_on_race: raise :class:`torch_stage.StreamRaceError` at the
            first race (default), or only collect races in ``.races``.
        stacks: keep the Python stack of each access for the report.

    Returns:
        A :class:`StreamSanitizer`; enter it on each thread to check.

    Raises:
        RuntimeError: entered twice on one thread, while another sanitizer
            is active, or while a CUDA graph is being captured.
    """
    return StreamSanitizer(raise_on_race=raise_on_race, stacks=stacks)


def _enable_from_environment() -> Optional[StreamSanitizer]:
    value = os.environ.get("TORCH_STAGE_SANITIZE", "")
    if value in ("", "0"):
        return None
    if value != "1":
        raise ValueError(f"TORCH_STAGE_SANITIZE must be 0 or 1, got {value!r}")
    sanitizer = sanitize_streams()
    sanitizer.__enter__()
    # Runs freed while the interpreter finalizes must not call back into it.
    atexit.register(_uninstall, sanitizer)
    return sanitizer
