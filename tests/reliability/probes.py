"""What a scenario can see of the process it runs in: threads by name, worker
processes, resident memory, and waiting for one of them to settle."""

from __future__ import annotations

import gc
import os
import time
from typing import Callable, List


def thread_names() -> List[str]:
    """The kernel's name of every thread of this process (15 characters at
    most: torch_stage's producers show as ``torch_stage:<name>``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return names


def stage_threads() -> int:
    """torch_stage's producer threads in this process (named
    ``torch_stage:<stage>:<i>``, or ``ts:<stage>:<i>`` where that is longer
    than the 15 characters Linux keeps)."""
    return sum(n.startswith(("torch_stage:", "ts:")) for n in thread_names())


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def child_processes() -> int:
    import psutil

    return len(psutil.Process().children(recursive=True))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def settle(predicate: Callable[[], bool], within_s: float) -> float:
    """Seconds until ``predicate()`` holds (collecting garbage meanwhile), or
    -1 if it does not within ``within_s``."""
    start = time.monotonic()
    while True:
        gc.collect()
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > within_s:
            return -1.0
        time.sleep(0.01)
