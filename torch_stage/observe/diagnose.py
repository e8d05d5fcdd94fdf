"""Where a staged loop's time goes, in numbers and sentences:
:func:`diagnose` reads a stage's ``stats()`` (or a trace's spans) and says
whether the loop is input-bound or compute-bound, how close it comes to the
best overlap, and what to change.

The model: making one item costs ``D`` (source + transform + device copy on
one producer thread), of which ``S`` is the source's, the loop body costs
``C`` per step. One after the other a step costs ``D + C``; overlapped at
best ``max(S, D / threads, C)`` on cores that do not slow each other (the
source is pulled by one producer at a time, so ``S`` does not divide).
Where they do (two hyperthreads of one core, a shared memory bus), the
machine's own bound is measured: the same data and
compute work run side by side on free threads with nothing handed over
(``corun_seconds``), which no pipeline can beat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["Diagnosis", "diagnose"]


@dataclass
class Diagnosis:
    """What :func:`diagnose` found. Times are milliseconds per step (item)."""

    bound: str  # "input", "compute" or "balanced"
    steps: int
    data_ms: float  # D: making one item on one producer thread
    compute_ms: float  # C: the loop body, outside the wait for items
    wait_ms: float  # the consumer's wait for an item, per step
    blocked_ms: float  # a producer's wait for space or its turn, per item
    step_ms: float  # measured, with torch_stage
    num_threads: int
    capacity: int
    max_occupancy: int = 0
    gil_wait_ms: float = 0.0  # producers waiting for the GIL, per item
    plain_step_ms: Optional[float] = None  # measured without torch_stage, if known
    corun_step_ms: Optional[float] = None  # data and compute side by side, if measured
    advice: List[str] = field(default_factory=list)
    source_ms: float = 0.0  # S: the source's part of D (serial: one producer at a time)

    @property
    def sequential_ms(self) -> float:
        """D + C: a step when nothing overlaps (the plain loop's, if measured)."""
        if self.plain_step_ms is not None:
            return self.plain_step_ms
        return self.data_ms + self.compute_ms

    @property
    def independent_ms(self) -> float:
        """max(S, D / threads, C): the best a step can cost with overlap on
        cores that do not slow each other."""
        return max(self.source_ms, self.data_ms / max(self.num_threads, 1), self.compute_ms)

    @property
    def ideal_ms(self) -> float:
        """The best a step can cost with overlap on this machine: the
        measured side-by-side step when known (never below max(S, D/threads, C),
        and never above the step without overlap, which is always possible)."""
        if self.corun_step_ms is not None:
            return min(max(self.independent_ms, self.corun_step_ms), self.sequential_ms)
        return self.independent_ms

    @property
    def speedup(self) -> float:
        return self.sequential_ms / self.step_ms if self.step_ms > 0 else float("nan")

    @property
    def best_speedup(self) -> float:
        return self.sequential_ms / self.ideal_ms if self.ideal_ms > 0 else float("nan")

    def table(self) -> str:
        """A short fixed-width table of the figures."""
        rows = [
            ("data (make one item, 1 thread)", self.data_ms),
            ("compute (loop body per step)", self.compute_ms),
            (
                "plain loop step (measured)"
                if self.plain_step_ms is not None
                else "data + compute (no overlap)",
                self.sequential_ms,
            ),
            (f"on independent cores: max(S, D/{self.num_threads}, C)", self.independent_ms),
        ]
        if self.corun_step_ms is not None:
            rows.append(("both side by side, nothing handed over", self.corun_step_ms))
        rows += [
            ("best possible (the larger)", self.ideal_ms),
            ("torch_stage step (measured)", self.step_ms),
            ("  of which waiting for input", self.wait_ms),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"{'':<{width}}  ms/step"]
        lines += [f"{name:<{width}}  {ms:8.3f}" for name, ms in rows]
        return "\n".join(lines)

    def sentences(self) -> List[str]:
        """The verdict, the speedup against the best possible, and advice."""
        what = {
            "input": "input-bound: the loop waits for data "
            f"({self.wait_ms:.2f} ms of each {self.step_ms:.2f} ms step)",
            "compute": "compute-bound: the data is ready before the loop asks "
            f"(producers waited {self.blocked_ms:.2f} ms per item for space)",
            "balanced": "balanced: data and compute take about as long "
            f"(the loop waits {self.wait_ms:.2f} ms per step, producers "
            f"{self.blocked_ms:.2f} ms per item)",
        }[self.bound]
        out = [f"The staged loop is {what}."]
        if math.isfinite(self.speedup) and math.isfinite(self.best_speedup):
            reach = (
                (self.speedup - 1) / (self.best_speedup - 1) if self.best_speedup > 1.001 else 1.0
            )
            out.append(
                f"Speedup {self.speedup:.2f}x against the steps without overlap; the best "
                f"possible is {self.best_speedup:.2f}x ({self._bound_text()}), so torch_stage "
                f"reaches {self.speedup / self.best_speedup:.2f} of it and realises "
                f"{max(0.0, min(reach, 1.0)) * 100:.0f}% of the possible gain."
            )
            if self.corun_step_ms is not None and self.corun_step_ms > 1.1 * self.independent_ms:
                out.append(
                    f"On this machine data and compute slow each other even with nothing "
                    f"handed over: side by side a step costs {self.corun_step_ms:.2f} ms, "
                    f"against {self.independent_ms:.2f} ms on independent cores (two "
                    "hyperthreads of one core, or a shared memory bus, look like this)."
                )
        out.extend(self.advice)
        return out

    def _bound_text(self) -> str:
        if self.corun_step_ms is not None and self.corun_step_ms > self.independent_ms:
            return "D + C over the side-by-side step measured on this machine"
        return "D + C over max(S, D/threads, C)"

    def __str__(self) -> str:
        return self.table() + "\n\n" + "\n".join(self.sentences())


def diagnose(
    stats: dict,
    *,
    steps: int,
    seconds: float,
    num_threads: int = 1,
    plain_seconds: Optional[float] = None,
    corun_seconds: Optional[float] = None,
) -> Diagnosis:
    """Read a stage's ``stats()`` after a timed loop.

    Args:
        stats: ``Stage.stats()`` (summed over runs when several were timed).
        steps: items the loop took.
        seconds: the loop's wall time with torch_stage.
        num_threads: the stage's producer threads.
        plain_seconds: the same loop's time without torch_stage, if measured
            (else ``D + C`` stands for it).
        corun_seconds: the time to make ``steps`` items on one free thread
            while the loop body runs ``steps`` times on another, nothing
            handed over, if measured: the machine's bound on overlap.

    Returns:
        A :class:`Diagnosis`.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    produced = max(int(stats.get("produced", 0)), 1)
    consumed = max(int(stats.get("consumed", steps)), 1)
    data_s = stats.get("source_s", 0.0) + stats.get("transform_s", 0.0) + stats.get("copy_s", 0.0)
    step_ms = seconds * 1000 / steps
    wait_ms = stats.get("consumer_wait_s", 0.0) * 1000 / consumed
    blocked_ms = stats.get("producer_blocked_s", 0.0) * 1000 / produced
    data_ms = data_s * 1000 / produced
    # C from the plain loop when it was measured (its step is D + C with
    # nothing competing); else the staged step minus the wait for items.
    if plain_seconds is not None:
        compute_ms = plain_seconds * 1000 / steps - data_ms
    else:
        compute_ms = step_ms - wait_ms
    d = Diagnosis(
        bound=_bound(stats.get("consumer_wait_s", 0.0), stats.get("producer_blocked_s", 0.0)),
        steps=steps,
        data_ms=data_ms,
        compute_ms=max(compute_ms, 0.0),
        wait_ms=wait_ms,
        blocked_ms=blocked_ms,
        step_ms=step_ms,
        num_threads=num_threads,
        capacity=int(stats.get("capacity", 0)),
        max_occupancy=int(stats.get("max_occupancy", 0)),
        gil_wait_ms=stats.get("gil_wait_s", 0.0) * 1000 / produced,
        plain_step_ms=None if plain_seconds is None else plain_seconds * 1000 / steps,
        corun_step_ms=None if corun_seconds is None else corun_seconds * 1000 / steps,
        source_ms=stats.get("source_s", 0.0) * 1000 / produced,
    )
    d.advice = _advice(d)
    return d


def _bound(wait: float, blocked: float) -> str:
    # The rule of Stage.stats()["bound"].
    if wait > 2 * blocked and wait > 0:
        return "input"
    if blocked > 2 * wait and blocked > 0:
        return "compute"
    return "balanced"


def _advice(d: Diagnosis) -> List[str]:
    out = []
    per_thread = d.data_ms / d.num_threads
    if d.bound == "input":
        need = max(d.num_threads + 1, math.ceil(d.data_ms / max(d.compute_ms, 1e-6)))
        if d.source_ms >= 0.9 * max(d.compute_ms, d.data_ms / d.num_threads):
            out.append(
                f"What to change: the source takes {d.source_ms:.2f} ms of each item's "
                f"{d.data_ms:.2f} ms and is pulled by one producer at a time, so more "
                f"threads will not help (the loop body takes {d.compute_ms:.2f} ms); make "
                "the source cheap and move the per-item work into transform=, which the "
                "producers run side by side, or use a DataLoader with worker processes as "
                "the source."
            )
        elif d.gil_wait_ms > 0.25 * d.data_ms:
            out.append(
                f"What to change: the producers spend {d.gil_wait_ms:.2f} ms of each item's "
                f"{d.data_ms:.2f} ms waiting for the GIL, so more threads will not help; make "
                "the transform release the GIL (torch ops, C++ parsing such as "
                "torch_stage.parse_example) or use DataLoader worker processes as the source."
            )
        else:
            out.append(
                f"What to change: making an item ({d.data_ms:.2f} ms on one thread, "
                f"{per_thread:.2f} ms with {d.num_threads}) is slower than the loop body "
                f"({d.compute_ms:.2f} ms): use num_threads={need}, or make the source or "
                "transform cheaper. A larger capacity does not help a loop that is always "
                "waiting."
            )
    elif d.bound == "compute":
        if d.capacity > 2 and d.max_occupancy >= d.capacity:
            out.append(
                f"What to change: nothing on the input side; the step is the loop body's. "
                f"The buffer stays full ({d.max_occupancy} of {d.capacity}): a smaller "
                "capacity would hold less memory at no cost in speed."
            )
        else:
            out.append(
                "What to change: nothing on the input side; the step is the loop body's "
                "(make the model faster, or give it the cores the producers leave idle)."
            )
    else:
        out.append(
            f"What to change: producers and loop take turns ({per_thread:.2f} ms per item "
            f"against {d.compute_ms:.2f} ms per step); one more producer thread "
            f"(num_threads={d.num_threads + 1}) gives headroom, and a larger capacity "
            f"(now {d.capacity}) absorbs jitter."
        )
    if d.step_ms > 1.15 * d.ideal_ms and d.bound != "input":
        out.append(
            f"The measured step is {d.step_ms / d.ideal_ms:.2f}x the best possible: "
            "the two sides slow each other (on a CPU they share the cores and memory "
            "bandwidth; the demo leaves one core to the producer)."
        )
    return out
