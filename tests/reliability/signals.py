"""SIGINT: a main thread blocked in any wait of torch_stage gets
KeyboardInterrupt within half a second, and the process then exits cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from reliability.harness import check, kill_group, native_stacks, scenario, spawn

LATENCY_BOUND_S = 0.5

_PRELUDE = """
import itertools, signal, sys, time
import torch, torch_stage

# Python leaves SIGINT ignored when it starts with it ignored (a background
# job, nohup): the scenario is a user's process, with Python's handler.
signal.signal(signal.SIGINT, signal.default_int_handler)

class Slow(torch.utils.data.Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        time.sleep(60)
        return torch.zeros(2)

def slow_source():
    while True:
        time.sleep(60)
        yield 1
"""

# name: (set-up, the blocking call). Each blocks the main thread for good.
WAITS = {
    "area_put_full": (
        "area = torch_stage.StagingArea(capacity=1); area.put([torch.zeros(1)])",
        "area.put([torch.ones(1)])",
    ),
    "area_take_empty": ("area = torch_stage.StagingArea(capacity=1)", "area.take()"),
    "area_try_take": ("area = torch_stage.StagingArea(capacity=1)", "area.try_take(120_000)"),
    "staged_slow_source": (
        "stage = torch_stage.staged(slow_source(), timeout_millis=120_000)",
        "next(iter(stage))",
    ),
    "staged_slow_transform": (
        "stage = torch_stage.staged(itertools.count(), timeout_millis=120_000,"
        " transform=lambda i: time.sleep(60))",
        "next(iter(stage))",
    ),
}
# The DataLoader side by side with the plain one: an interrupted next() on a
# slow dataset. With workers, both wait for them at exit (the plain class
# joins each with a 5 s bound, then terminates it).
for _workers in (0, 2):
    for _cls in ("torch_stage.DataLoader", "torch.utils.data.DataLoader"):
        _tag = "plain" if _cls.startswith("torch.") else "loader"
        WAITS[f"{_tag}{_workers}_slow_dataset"] = (
            f"loader = {_cls}(Slow(), batch_size=2, num_workers={_workers})",
            "next(iter(loader))",
        )
EXIT_MARGIN_S = 2.0


def _interrupt(setup: str, call: str) -> dict:
    code = (
        _PRELUDE
        + setup
        + "\nprint('READY', flush=True)\ntry:\n    "
        + call
        + "\nexcept KeyboardInterrupt:\n"
        + "    print('INTERRUPTED', time.monotonic(), flush=True)\n"
    )
    proc = spawn(code)
    try:
        line = proc.stdout.readline()
        if line.strip() != "READY":
            raise AssertionError(f"did not get ready: {line!r}\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.5)  # well inside the wait
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        line = proc.stdout.readline()
        check(line.startswith("INTERRUPTED"), f"no KeyboardInterrupt: {line!r}")
        latency = float(line.split()[1]) - sent
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            native = native_stacks(proc.pid)
            raise AssertionError(
                f"the process did not exit after the interrupt:\n{native}"
            ) from None
        exited = time.monotonic() - sent
        check(
            proc.returncode == 0 and "terminate called" not in err,
            f"exit status {proc.returncode} after the interrupt:\n{err[-3000:]}",
        )
    finally:
        if proc.poll() is None:
            kill_group(proc)
    return {"latency_s": latency, "exit_s": exited}


@scenario(
    "signals.sigint",
    timeout_s=300,
    # The waits with workers cost 10 s each at exit (plain and ours alike).
    quick={"waits": [w for w in WAITS if not w.endswith("2_slow_dataset")]},
    full={"waits": list(WAITS)},
)
def sigint(waits):
    """SIGINT in every blocking wait (full buffer, empty buffer, slow source,
    slow transform, DataLoader on a slow dataset with 0 and 2 workers)."""
    figures = {}
    slow = []
    for name in waits:
        got = _interrupt(*WAITS[name])
        figures[f"{name}_ms"] = round(got["latency_s"] * 1000)
        figures[f"{name}_exit_s"] = round(got["exit_s"], 2)
        if got["latency_s"] > LATENCY_BOUND_S:
            slow.append(f"{name}: {got['latency_s']:.2f} s")
    check(not slow, f"KeyboardInterrupt later than {LATENCY_BOUND_S} s: {slow}")
    for workers in sorted({int(w.split("_")[0][-1]) for w in waits if w.endswith("_slow_dataset")}):
        ours, plain = (
            figures[f"loader{workers}_slow_dataset_exit_s"],
            figures[f"plain{workers}_slow_dataset_exit_s"],
        )
        check(
            ours <= plain + EXIT_MARGIN_S,
            f"num_workers={workers}: exited {ours} s after the interrupt, "
            f"the plain DataLoader {plain} s",
        )
    return figures
