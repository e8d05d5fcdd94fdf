"""Overlap of data and compute: step time over a grid of data time D and
compute time C, for the peers and torch_stage, in one run.

Data work releases the GIL (time.sleep, as I/O does) and yields a tensor;
compute is torch ops (matmuls) sized to take C ms. For each (D, C) cell the
step time of:

* ``plain``: make the item, then compute, one after the other;
* ``dataloader_w0`` / ``dataloader_w2``: torch.utils.data.DataLoader with 0
  and 2 worker processes (batch_size=None: one item per step);
* ``torchdata_prefetcher``: torchdata.nodes Prefetcher over the source;
* ``torch_stage``: torch_stage.staged over the source;

plus torch_stage's efficiency = step time / max(D, C) (1.0 is perfect
overlap), with D and C measured alone in the same round, and the producers'
GIL wait per item. Each cell runs every method once per round, for several
rounds, and reports medians. Then the per-item overhead of
torch_stage and the Prefetcher with a trivial source (range). Steady state
only: every method's clock starts after its first item. Prints JSON.

Usage: python benchmarks/overlap.py [--steps N] [--quick]
"""

import argparse
import os
import platform
import statistics
import time

import torch
import torch.utils.data as tud
from _common import add_json_argument, emit, progress

import torch_stage

try:
    from torchdata.nodes import IterableWrapper, Loader, Prefetcher
except ImportError:  # the peer is optional
    Prefetcher = None


class SleepData(tud.Dataset):
    def __init__(self, n, data_ms):
        self.n, self.data_ms = n, data_ms

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.data_ms / 1000)
        return torch.full((256,), float(i))


def source(n, data_ms):
    for i in range(n):
        time.sleep(data_ms / 1000)
        yield torch.full((256,), float(i))


class Compute:
    """Torch ops that take about `ms` milliseconds (calibrated once)."""

    def __init__(self, ms):
        self.ms = ms
        self.a = torch.randn(256, 256)
        one = self._time(1)
        self.reps = max(1, round(ms / one))

    def _time(self, reps, trials=20):
        start = time.perf_counter()
        for _ in range(trials):
            self(reps)
        return (time.perf_counter() - start) / trials * 1000

    def __call__(self, reps=None, item=None):
        x = self.a
        for _ in range(reps or self.reps):
            x = torch.tanh(x @ self.a)
        return x


def timed(iterable, compute, steps):
    """Mean ms per step after the first item."""
    it = iter(iterable)
    next(it)  # start-up (workers, threads) is not part of the steady state
    start = time.perf_counter()
    n = 0
    for item in it:
        compute(item=item)
        n += 1
        if n == steps:
            break
    return (time.perf_counter() - start) / n * 1000


def cell(data_ms, compute, steps, rounds):
    """One (D, C) cell: every method once per round, medians over rounds.

    Each round also measures D and C alone, so each round's efficiency
    compares measurements taken side by side; a noisy neighbour then moves
    numerator and denominator together.
    """
    n = steps + 1

    def plain_source():
        for i in range(n):
            time.sleep(data_ms / 1000)
            yield torch.full((256,), float(i))

    items = [torch.full((256,), float(i)) for i in range(n)]
    runs = {}

    def record(name, value):
        runs.setdefault(name, []).append(value)

    for _ in range(rounds):
        record("data_alone", timed(plain_source(), lambda item: None, steps))
        record("compute_alone", timed(items, compute, steps))
        record("plain", timed(plain_source(), compute, steps))
        record(
            "dataloader_w0",
            timed(tud.DataLoader(SleepData(n, data_ms), batch_size=None), compute, steps),
        )
        record(
            "dataloader_w2",
            timed(
                tud.DataLoader(SleepData(n, data_ms), batch_size=None, num_workers=2),
                compute,
                steps,
            ),
        )
        if Prefetcher is not None:
            record(
                "torchdata_prefetcher",
                timed(
                    Loader(Prefetcher(IterableWrapper(source(n, data_ms)), prefetch_factor=2)),
                    compute,
                    steps,
                ),
            )
        stage = torch_stage.staged(source(n, data_ms), capacity=2, name="overlap")
        record("torch_stage", timed(stage, compute, steps))
        stats = stage.stats()
        stage.close()
        record(
            "torch_stage_efficiency",
            runs["torch_stage"][-1] / max(runs["data_alone"][-1], runs["compute_alone"][-1]),
        )
        record(
            "torch_stage_gil_wait_ms_per_item",
            stats["gil_wait_s"] * 1000 / max(stats["produced"], 1),
        )

    results = {"data_ms": data_ms, "compute_ms": compute.ms}
    results.update({k: round(statistics.median(v), 4) for k, v in runs.items()})
    results["torch_stage_vs_plain"] = round(results["plain"] / results["torch_stage"], 3)
    return results


def per_item_overhead(n):
    def run(make):
        start = time.perf_counter()
        count = sum(1 for _ in make())
        assert count == n
        return (time.perf_counter() - start) / n * 1e6

    out = {"items": n, "plain_us": round(run(lambda: iter(range(n))), 3)}
    for capacity in (1, 8, 64):
        row = {
            "torch_stage_us": round(
                run(lambda c=capacity: torch_stage.staged(range(n), capacity=c)), 3
            )
        }
        if Prefetcher is not None:
            row["torchdata_prefetcher_us"] = round(
                run(
                    lambda c=capacity: Loader(
                        Prefetcher(IterableWrapper(range(n)), prefetch_factor=c)
                    )
                ),
                3,
            )
            row["torch_stage_vs_prefetcher"] = round(
                row["torchdata_prefetcher_us"] / row["torch_stage_us"], 3
            )
        out[f"capacity_{capacity}"] = row
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="data/compute overlap")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="alternations per cell")
    parser.add_argument("--quick", action="store_true", help="a small grid")
    parser.add_argument(
        "--intra-op-threads",
        type=int,
        default=1,
        help="the compute side's torch threads (the same for every method); with 1,"
        " a 2-core machine keeps a core for the data side, and OpenMP team"
        " barriers do not stall when a neighbour takes a core",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.intra_op_threads)
    data = [1, 5, 10, 20] if not args.quick else [5]
    comp = [Compute(c) for c in ([5, 10, 20] if not args.quick else [5])]
    grid = [(d, c) for d in data for c in comp]
    cells = [cell(d, c, args.steps, args.rounds) for d, c in progress(grid, "overlap cells")]
    big = [c for c in cells if c["data_ms"] >= 5 and c["compute_ms"] >= 5]
    report = {
        "benchmark": "overlap",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "intra_op_threads": torch.get_num_threads(),
        },
        "steps": args.steps,
        "rounds": args.rounds,
        "unit": "ms per step (steady state), median over rounds",
        "cells": cells,
        "worst_efficiency_for_D_C_at_least_5ms": max(c["torch_stage_efficiency"] for c in big),
        "trivial_source_per_item": per_item_overhead(50_000 if not args.quick else 5_000),
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
