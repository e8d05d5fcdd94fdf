"""What torch_stage.DataLoader costs per batch over the plain DataLoader
where the batches themselves cost almost nothing: a TensorDataset of small
rows (a tabular or recommendation loop), one intra-op thread, no training
step, so each batch's time is the loader's own.

Per cell (batch size, num_workers), every round runs three epochs (their
first --batches batches) in an order that rotates with the round: the plain
DataLoader, ours with the same arguments, and the plain one again
(``plain2``), whose difference to the
first is the noise floor of the round. The table gives each one's median
microseconds per batch (steady state: each clock starts after the first
batch), the median over rounds of ours minus plain within a round, that
difference's 95% confidence interval, and the same for plain2 minus plain.

It also times the generator watch (torch_stage.DataLoader's check, over the
first 64 batches of an epoch, of whether a batch's making and the loop draw
from one global random generator): what it adds to a batch made in the
loop, in place, with torch, ``random`` and NumPy loaded: those batches of
ours against the same with the watch off, alternated (timed by itself, a
reading cost a sixth of what it costs between a batch's own calls).

Usage: python benchmarks/dataloader_per_batch.py [--rounds R] [--rows N]
       [--batch-sizes B...] [--workers W...] [--batches N0 NW] [--json PATH]
"""

import argparse
import statistics
import time

import numpy  # noqa: F401 (loaded, as in most training scripts: the watch reads it)
import torch
import torch.utils.data as tud
from _common import add_json_argument, emit, machine, median_ci, progress

import torch_stage
from torch_stage.staging import loader as _loader

METHODS = ("plain", "ours", "plain2")


def per_batch_us(loader, batches: int) -> float:
    it = iter(loader)
    next(it)
    n = 0
    start = time.perf_counter()
    for _ in it:
        n += 1
        if n == batches:
            break
    elapsed = time.perf_counter() - start
    del it  # the epoch's end, its workers' shutdown too, is not timed
    return elapsed / max(n, 1) * 1e6


def make(method: str, dataset, batch_size: int, workers: int):
    cls = torch_stage.DataLoader if method == "ours" else tud.DataLoader
    return cls(dataset, batch_size=batch_size, num_workers=workers)


def _first_batches_us(loader, count: int) -> float:
    """Microseconds per batch of batches 2..count of an epoch (the clock
    starts after the first, which makes the stage)."""
    it = iter(loader)
    next(it)
    next(it)
    start = time.perf_counter()
    for _ in range(count - 2):
        next(it)
    elapsed = time.perf_counter() - start
    del it
    return elapsed / (count - 2) * 1e6


def watch_us(dataset, batch_size: int, rounds: int) -> tuple:
    """What the generator watch adds to a batch made in the loop while it
    runs, in place (readings between a batch's own calls cost more than
    alone): the first _WATCHED_BATCHES batches of ours with the watch,
    less the same with it off, alternated; (median, 95% interval)."""
    watched = _loader._WATCHED_BATCHES
    diffs = []
    for r in range(rounds):
        times = {}
        for on in (r % 2 == 0, r % 2 != 0):
            _loader._WATCHED_BATCHES = watched if on else 0
            try:
                times[on] = _first_batches_us(make("ours", dataset, batch_size, 0), watched)
            finally:
                _loader._WATCHED_BATCHES = watched
        diffs.append(times[True] - times[False])
    return statistics.median(diffs), median_ci(diffs)[:2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument(
        "--batches",
        type=int,
        nargs=2,
        default=[5000, 500],
        metavar=("NO_WORKERS", "WORKERS"),
        help="batches timed per epoch without and with workers (at most the epoch)",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = tud.TensorDataset(torch.randn(args.rows, 8), torch.randint(0, 2, (args.rows,)))

    cells = []
    for workers in args.workers:
        for batch_size in args.batch_sizes:
            times = {m: [] for m in METHODS}
            for r in progress(range(args.rounds), f"b{batch_size} w{workers}"):
                order = METHODS[r % 3 :] + METHODS[: r % 3]
                for method in order:
                    loader = make(method, dataset, batch_size, workers)
                    batches = args.batches[0] if workers == 0 else args.batches[1]
                    times[method].append(per_batch_us(loader, batches))
            extra = [o - p for o, p in zip(times["ours"], times["plain"])]
            noise = [q - p for q, p in zip(times["plain2"], times["plain"])]
            ratio = [p / o for o, p in zip(times["ours"], times["plain"])]
            cells.append(
                {
                    "batch_size": batch_size,
                    "num_workers": workers,
                    "us_per_batch": {m: statistics.median(v) for m, v in times.items()},
                    "ours_minus_plain_us": statistics.median(extra),
                    "ours_minus_plain_ci": median_ci(extra)[:2],
                    "plain2_minus_plain_us": statistics.median(noise),
                    "plain2_minus_plain_ci": median_ci(noise)[:2],
                    "speed_vs_plain": statistics.median(ratio),
                    "rounds": args.rounds,
                }
            )
    watch, watch_ci = watch_us(dataset, args.batch_sizes[0], max(args.rounds, 21))

    print(
        f"{'batch':>5} {'workers':>7} {'plain us':>9} {'ours us':>8} {'ours-plain':>11} "
        f"{'95% CI':>15} {'plain2-plain':>13} {'95% CI':>15} {'speed':>6}"
    )
    for c in cells:
        us = c["us_per_batch"]
        lo, hi = c["ours_minus_plain_ci"]
        nlo, nhi = c["plain2_minus_plain_ci"]
        print(
            f"{c['batch_size']:>5} {c['num_workers']:>7} {us['plain']:>9.1f} {us['ours']:>8.1f} "
            f"{c['ours_minus_plain_us']:>+11.1f} {f'[{lo:+.1f}, {hi:+.1f}]':>15} "
            f"{c['plain2_minus_plain_us']:>+13.1f} {f'[{nlo:+.1f}, {nhi:+.1f}]':>15} "
            f"{c['speed_vs_plain']:>6.3f}"
        )
    print(
        f"generator watch: {watch:+.1f} us [{watch_ci[0]:+.1f}, {watch_ci[1]:+.1f}] per batch "
        f"made in the loop (the first {_loader._WATCHED_BATCHES} of an epoch, batch size "
        f"{args.batch_sizes[0]}), against the same loader with the watch off"
    )
    emit(
        {
            "machine": machine(),
            "cells": cells,
            "watch_us_per_batch": watch,
            "watch_us_per_batch_ci": watch_ci,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
