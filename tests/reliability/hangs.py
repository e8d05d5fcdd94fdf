"""Hangs: a source or transform that never returns gives the consumer a
StageTimeoutError on time, and the process can still exit."""

from __future__ import annotations

import time

from reliability.harness import check, python, scenario

_PRELUDE = """
import itertools, sys, threading, time
import torch, torch_stage

def hung_source():
    yield 0
    yield 1
    threading.Event().wait()  # never returns

def hung_at_two(i):
    if i == 2:
        threading.Event().wait()
    return i

class Hung(torch.utils.data.Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        if i >= 4:
            threading.Event().wait()
        return torch.zeros(2)
"""

CASES = {
    "hung_source": (
        "torch_stage.staged(hung_source(), timeout_millis={ms}, name='hung')",
        "torch_stage.StageTimeoutError",
        2,
    ),
    "hung_transform": (
        "torch_stage.staged(range(10), timeout_millis={ms}, name='hung', transform=hung_at_two)",
        "torch_stage.StageTimeoutError",
        2,
    ),
    "hung_transform_4_threads": (
        "torch_stage.staged(range(10), timeout_millis={ms}, name='hung', num_threads=4,"
        " transform=hung_at_two)",
        "torch_stage.StageTimeoutError",
        2,
    ),
    # The DataLoader's own `timeout` (seconds), as the plain class: RuntimeError.
    "loader_timeout_2_workers": (
        "torch_stage.DataLoader(Hung(), batch_size=4, num_workers=2, timeout={ms} / 1000)",
        "RuntimeError",
        1,
    ),
}

_CASE = """
source = {make}
it = iter(source)
for _ in range({good}):
    next(it)
start = time.monotonic()
try:
    next(it)
    print("NO-ERROR")
except {error} as e:
    print("RAISED", time.monotonic() - start, type(e).__name__, flush=True)
    print(str(e).replace(chr(10), " | "), flush=True)
"""


@scenario("hangs.timeout", timeout_s=300, quick={"timeout_ms": 1000}, full={"timeout_ms": 1000})
def timeout(timeout_ms: int):
    """A hung source, a hung transform (1 and 4 threads) and a hung DataLoader
    worker: the timeout error on time, naming the stage, then a clean exit."""
    figures = {}
    for name, (make, error, good) in CASES.items():
        code = _PRELUDE + _CASE.format(make=make.format(ms=timeout_ms), error=error, good=good)
        start = time.monotonic()
        rc, out, err = python(code, timeout_s=60)
        total = time.monotonic() - start
        lines = out.splitlines()
        check(
            lines and lines[0].startswith("RAISED"),
            f"{name}: no timeout error: {out!r}\n{err[-3000:]}",
        )
        waited = float(lines[0].split()[1])
        message = lines[1] if len(lines) > 1 else ""
        check(
            timeout_ms / 1000 * 0.9 <= waited <= timeout_ms / 1000 + 2.0,
            f"{name}: the error came after {waited:.2f} s for a {timeout_ms} ms timeout",
        )
        if "StageTimeoutError" in error:
            check("hung" in message, f"{name}: the error does not name the stage: {message}")
        else:
            check("timed out" in message, f"{name}: {message}")
        check(
            rc == 0 and "terminate called" not in err,
            f"{name}: exit status {rc} with a hung thread\n{err[-3000:]}",
        )
        figures[f"{name}_s"] = round(waited, 2)
        figures[f"{name}_process_s"] = round(total, 1)
    return figures
