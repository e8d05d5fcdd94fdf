"""Shutdown: however a pipeline is left, its threads and workers are gone
within a second, and the interpreter exits without a hang or an abort."""

from __future__ import annotations

import functools
import itertools
import threading
import time

import torch

import torch_stage
from reliability.harness import check, python, scenario
from reliability.probes import child_processes, settle, stage_threads

GONE_WITHIN_S = 1.0


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        return torch.full((8,), float(i))


def _all_gone() -> bool:
    return stage_threads() == 0 and child_processes() == 0


def _gone(what: str) -> float:
    took = settle(_all_gone, GONE_WITHIN_S)
    check(
        took >= 0,
        f"{what}: {stage_threads()} staging threads and {child_processes()} worker "
        f"processes still there after {GONE_WITHIN_S} s",
    )
    return took


def _running(what: str, workers: int) -> None:
    # Otherwise the checks that they are gone could not fail. (Hence
    # num_threads in the loaders below: auto-tuned staging threads start
    # only where the tuner tries one.)
    check(stage_threads() > 0, f"{what}: no staging thread seen while it ran")
    check(child_processes() >= workers, f"{what}: {workers} workers expected while it ran")


@scenario("shutdown.break", timeout_s=120)
def break_out():
    """`break` out of staged() and out of DataLoader loops (0 and 2 workers)."""
    figures = {}
    for i, _ in enumerate(torch_stage.staged(itertools.count(), capacity=4, num_threads=2)):
        if i == 0:
            _running("staged", 0)
        if i == 10:
            break
    figures["staged_s"] = _gone("break out of staged()")
    for workers in (0, 2):
        loader = torch_stage.DataLoader(Squares(), batch_size=4, num_workers=workers, num_threads=2)
        for i, _ in enumerate(loader):
            if i == 0:
                _running(f"DataLoader(num_workers={workers})", workers)
            if i == 10:
                break
        figures[f"loader{workers}_s"] = _gone(f"break out of DataLoader(num_workers={workers})")
        del loader
    return figures


class _SlowFrom(torch.utils.data.Dataset):
    """Items from ``slow_at`` on wait for ``release``: a read that hangs."""

    def __init__(self, slow_at: int):
        self.slow_at = slow_at
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        self.calls += 1
        if i >= self.slow_at:
            self.entered.set()
            self.release.wait(60)
        return torch.full((8,), float(i))


@scenario("shutdown.break_mid_item", timeout_s=120)
def break_mid_item():
    """`break` while a staging thread is inside a slow __getitem__ returns at
    once (the plain loader without workers makes nothing ahead); the thread
    ends after its item, making no other, and the next epoch starts after it."""
    data = _SlowFrom(slow_at=4)
    loader = torch_stage.DataLoader(data, batch_size=1, num_threads=1, capacity=8)
    for i, _ in enumerate(loader):
        if i == 0:
            check(data.entered.wait(30), "the staging thread never reached the slow item")
            _running("DataLoader", 0)
        if i == 1:
            break
    check(not data.release.is_set(), "unreachable")
    calls = data.calls
    start = time.monotonic()
    data.release.set()
    took = _gone("the staging thread after its item")
    check(data.calls == calls, f"{data.calls - calls} item(s) made after the loop left")
    data.slow_at = len(data)
    first = next(iter(loader))
    check(first[0, 0].item() == 0.0, f"the next epoch began with {first}")
    return {
        "thread_gone_after_release_s": round(took, 3),
        "calls": calls,
        "release_to_gone_s": round(time.monotonic() - start, 3),
    }


@scenario("shutdown.dropped_iterator", timeout_s=120)
def dropped_iterator():
    """A DataLoader iterator dropped mid-epoch while the loader lives; persistent
    workers stay until the loader goes, as in the plain class."""
    figures = {}
    for workers in (0, 2):
        loader = torch_stage.DataLoader(Squares(), batch_size=4, num_workers=workers, num_threads=2)
        it = iter(loader)
        next(it)
        _running(f"iterator (num_workers={workers})", workers)
        del it
        figures[f"workers{workers}_s"] = _gone(f"dropped iterator, num_workers={workers}")
    loader = torch_stage.DataLoader(
        Squares(), batch_size=4, num_workers=2, persistent_workers=True, num_threads=2
    )
    it = iter(loader)
    next(it)
    del it
    check(
        settle(lambda: stage_threads() == 0, GONE_WITHIN_S) >= 0,
        "persistent workers: the dropped iterator's staging threads stayed",
    )
    time.sleep(0.2)
    check(child_processes() == 2, f"persistent workers: {child_processes()} workers, 2 expected")
    del loader
    figures["persistent_del_loader_s"] = _gone("del of a loader with persistent workers")
    return figures


@scenario("shutdown.del_loader", timeout_s=120)
def del_loader():
    """`del` a loader (and its iterator) mid-epoch, persistent workers or not."""
    figures = {}
    for persistent in (False, True):
        loader = torch_stage.DataLoader(
            Squares(),
            batch_size=4,
            num_workers=2,
            persistent_workers=persistent,
            capacity=2,
            num_threads=2,
        )
        it = iter(loader)
        for _ in range(5):
            next(it)
        _running(f"persistent_workers={persistent}", 2)
        del loader, it
        figures[f"persistent{int(persistent)}_s"] = _gone(f"del loader, persistent={persistent}")
    return figures


@scenario("shutdown.consumer_raises", timeout_s=120)
def consumer_raises():
    """The loop body raises: once the exception is handled, nothing is left."""
    figures = {}

    def loop(iterable):
        for i, _ in enumerate(iterable):
            if i == 5:
                raise ValueError("the training step failed")

    for label, make in (
        ("staged", lambda: torch_stage.staged(itertools.count(), capacity=4, num_threads=2)),
        ("loader2", lambda: torch_stage.DataLoader(Squares(), batch_size=4, num_workers=2)),
    ):
        try:
            loop(make())
        except ValueError:
            pass
        figures[f"{label}_s"] = _gone(f"a consumer of {label} raised")
    # Inside `with`, the exit closes the stage even while the traceback lives.
    try:
        with torch_stage.staged(itertools.count(), capacity=4) as stage:
            loop(stage)
    except ValueError as e:
        kept = e  # noqa: F841  (the traceback keeps the stage's frame alive)
        figures["with_s"] = settle(lambda: stage_threads() == 0, GONE_WITHIN_S)
        check(figures["with_s"] >= 0, "leaving `with staged(...)` by an exception left threads")
    return figures


@scenario("shutdown.blocked_producer", timeout_s=120)
def blocked_producer():
    """close() while producers wait on a full buffer: prompt, nothing left."""
    figures = {}
    stage = torch_stage.staged(itertools.count(), capacity=1, num_threads=2)
    it = iter(stage)
    next(it)
    blocked = settle(lambda: stage.stats()["producer_blocked_s"] > 0, 10)
    check(blocked >= 0, f"the producers never blocked on the full buffer: {stage.stats()}")
    start = time.monotonic()
    stage.close()
    figures["stage_close_s"] = time.monotonic() - start
    check(
        figures["stage_close_s"] < GONE_WITHIN_S, f"close() took {figures['stage_close_s']:.2f} s"
    )
    figures["stage_threads_s"] = _gone("close() of a stage with blocked producers")

    # A Python thread blocked in put() on a full StagingArea, and one in take()
    # on an empty one, woken by close() and cancel().
    for how in ("close", "cancel"):
        full = torch_stage.StagingArea(capacity=1)
        full.put([torch.zeros(1)])
        empty = torch_stage.StagingArea(capacity=1)
        woke = {}

        def wait(name, fn, woke=woke):
            try:
                fn()
                woke[name] = "returned"
            except (torch_stage.StageClosed, torch_stage.StageCancelled) as e:
                woke[name] = type(e).__name__

        put = functools.partial(full.put, [torch.ones(1)])
        threads = [
            threading.Thread(target=wait, args=("put", put)),
            threading.Thread(target=wait, args=("take", empty.take)),
        ]
        for t in threads:
            t.start()
        time.sleep(0.2)
        start = time.monotonic()
        getattr(full, how)()
        getattr(empty, how)()
        for t in threads:
            t.join(GONE_WITHIN_S)
        took = time.monotonic() - start
        check(all(not t.is_alive() for t in threads), f"{how}() left a waiter blocked: {woke}")
        expected = "StageClosed" if how == "close" else "StageCancelled"
        check(woke == {"put": expected, "take": expected}, f"after {how}(): {woke}")
        figures[f"area_{how}_s"] = took
    return figures


# A process in the middle of everything at once: producers blocked on a full
# buffer, DataLoader workers mid-epoch, a RecordInput reading, daemon threads
# waiting in put(), take() and a stage's and a RecordInput's next(). It then
# leaves by sys.exit() or by falling off the end.
_MID_FLIGHT = """
import itertools, os, sys, tempfile, threading
import torch, torch_stage

class Squares(torch.utils.data.Dataset):
    def __len__(self): return 10_000
    def __getitem__(self, i): return torch.full((8,), float(i))

stage = torch_stage.staged(itertools.count(), capacity=1, num_threads=2)
next(iter(stage))
loader = torch_stage.DataLoader(Squares(), batch_size=4, num_workers=2)
it = iter(loader); next(it)
path = os.path.join(tempfile.mkdtemp(), "r.tfrecord")
with torch_stage.RecordWriter(path) as w:
    for i in range(1000):
        w.write(torch_stage.encode_example({{"x": [i]}}))
records = torch_stage.RecordInput(path, parallelism=2, buffer_size=100, batch_size=8)
next(records)
area = torch_stage.StagingArea(capacity=1)
area.put([torch.zeros(1)])
empty = torch_stage.StagingArea(capacity=1)
slow = torch_stage.staged(iter(lambda: __import__("time").sleep(0.05), 1), capacity=1)
# Daemon threads waiting in every blocking call when the interpreter exits.
for wait in (lambda: area.put([torch.ones(1)]), empty.take, lambda: list(slow),
             lambda: list(records)):
    threading.Thread(target=wait, daemon=True).start()
print("mid-flight", flush=True)
{leave}
"""


@scenario("shutdown.interpreter_exit", timeout_s=600, quick={"runs": 2}, full={"runs": 20})
def interpreter_exit(runs: int):
    """sys.exit() mid-flight and the end of the script with every kind of
    pipeline live: the process exits with its status, never hangs or aborts."""
    figures = {}
    for leave, status in (("sys.exit(3)", 3), ("", 0)):
        worst = 0.0
        for _ in range(runs):
            start = time.monotonic()
            rc, out, err = python(_MID_FLIGHT.format(leave=leave), timeout_s=60)
            worst = max(worst, time.monotonic() - start)
            check("mid-flight" in out, f"the pipelines did not start:\n{err[-3000:]}")
            check(
                rc == status and "terminate called" not in err and "Fatal" not in err,
                f"{leave or 'end of script'}: exit status {rc} (expected {status})\n{err[-3000:]}",
            )
        figures["sys_exit_worst_s" if leave else "end_worst_s"] = worst
    figures["runs"] = runs
    return figures


# A producer stuck in user code when the interpreter exits, coming back
# `delta` seconds after the exit's join bound ran out: during finalization,
# where CPython ends threads that want the GIL (this segfaulted in
# PyThreadState_Clear before the GIL guards of csrc/python/bindings.h).
_STUCK_AT_EXIT = """
import atexit, threading, time
import torch_stage
from torch_stage.staging import stage as stage_module

exit_began = threading.Event()
atexit.register(exit_began.set)  # runs before torch_stage's own exit hook

def wake_late(i):
    if i == 1:
        exit_began.wait()
        time.sleep(stage_module._EXIT_JOIN_TIMEOUT_MS / 1000 + {delta})
    return [i] * 3

stage = torch_stage.staged(range(100), capacity=1, transform=wake_late, {options})
next(iter(stage))
print("stuck", flush=True)
"""


@scenario(
    "shutdown.stuck_producer_at_exit",
    timeout_s=600,
    quick={"deltas": (0.0, 0.1)},
    full={"deltas": (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)},
)
def stuck_producer_at_exit(deltas):
    """A producer still in user code at exit, returning while the interpreter
    finalizes: the process exits with status 0, promptly, without a crash."""
    worst = 0.0
    runs = 0
    for options in ("num_threads=1", "num_threads=3"):
        for delta in deltas:
            start = time.monotonic()
            rc, out, err = python(_STUCK_AT_EXIT.format(delta=delta, options=options), timeout_s=60)
            took = time.monotonic() - start
            worst = max(worst, took)
            runs += 1
            check("stuck" in out, f"did not start:\n{err[-3000:]}")
            check(
                rc == 0 and "terminate called" not in err and "Fatal" not in err,
                f"{options}, back {delta} s after the exit bound: exit status {rc}\n{err[-3000:]}",
            )
    return {"runs": runs, "worst_process_s": round(worst, 2)}


# Producer threads the system refuses to start (an address-space limit that
# 1000 thread stacks exceed).
_THREADS_REFUSED = """
import os, resource, time
import torch_stage
from reliability.probes import stage_threads

with open("/proc/self/statm") as f:
    vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
limit = vm + (256 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
stage = torch_stage.staged(range(10), num_threads=1000, name="many")
try:
    next(iter(stage))
    print("NO-ERROR", flush=True)
except RuntimeError as e:
    print("REFUSED", type(e).__name__, str(e).splitlines()[0], flush=True)
try:
    next(iter(stage))
    print("SECOND NO-ERROR", flush=True)
except torch_stage.StageError as e:
    print("SECOND", type(e).__name__, flush=True)
start = time.monotonic()
stage.close()
print("CLOSED", time.monotonic() - start, stage_threads(), flush=True)
"""


@scenario("shutdown.threads_refused", timeout_s=120)
def threads_refused():
    """The system refuses producer threads: a clear error naming num_threads,
    later takes fail at once, close() is prompt, and the process exits."""
    rc, out, err = python(_THREADS_REFUSED, timeout_s=60)
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    refused = lines.get("REFUSED", "")
    check(
        "num_threads=1000" in refused,
        f"no error naming num_threads: {out!r}\n{err[-3000:]}",
    )
    check("SECOND" in lines and "NO-ERROR" not in lines["SECOND"], f"a later take: {out!r}")
    closed = lines.get("CLOSED", "CLOSED 999 -1").split()
    check(float(closed[1]) < GONE_WITHIN_S, f"close() took {closed[1]} s")
    check(closed[2] == "0", f"{closed[2]} producer threads left after close()")
    check(rc == 0 and "terminate called" not in err, f"exit status {rc}\n{err[-3000:]}")
    return {"close_s": round(float(closed[1]), 3), "second_take": lines["SECOND"].split()[1]}
