"""Host-to-device staging: items per second into a CUDA training loop, for
the ways a user would feed one, in one run.

Items are in host memory already (the source costs nothing), either pageable
(what a Dataset returns) or pinned (what a ``pin_memory=True`` loader hands
over). Each step takes one item on the device and runs GPU work of
``--compute-ms`` (``torch.cuda._sleep``; 0: copy-bound). Methods:

* ``plain_to``: ``x.to("cuda", non_blocking=True)`` in the loop;
* ``dataloader_pin``: ``torch.utils.data.DataLoader(batch_size=None,
  pin_memory=True)``, then ``.to("cuda", non_blocking=True)``;
* ``torchdata_pin``: torchdata.nodes ``PinMemory`` (pins in a thread of its
  own) over the items, then ``.to("cuda", non_blocking=True)``; skipped
  without torchdata;
* ``staged``: ``torch_stage.staged(items, device="cuda")``;
* ``ours_loader``: ``torch_stage.DataLoader`` with the plain DataLoader's
  arguments and ``device="cuda"``.

Steady state (the clock starts after the first item, and stops after the
GPU finished the last step), median over rounds, each round runs every
method once. Needs a CUDA device.

Usage: python benchmarks/device_staging.py [--mb 4 64] [--items 40]
       [--compute-ms 0 5] [--rounds 3] [--json PATH]
"""

import argparse
import statistics
import sys
import time

import torch
import torch.utils.data as tud
from _common import add_json_argument, emit, machine, progress

import torch_stage

try:
    from torchdata.nodes import IterableWrapper, Loader, PinMemory
except ImportError:  # the peer is optional
    PinMemory = None

METHODS = ("plain_to", "dataloader_pin", "torchdata_pin", "staged", "ours_loader")
PEERS = ("plain_to", "dataloader_pin", "torchdata_pin")


class Items(tud.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def feeds(method: str, items):
    if method == "plain_to":
        return (x.to("cuda", non_blocking=True) for x in items)
    if method == "dataloader_pin":
        loader = tud.DataLoader(Items(items), batch_size=None, pin_memory=True)
        return (x.to("cuda", non_blocking=True) for x in loader)
    if method == "torchdata_pin":
        loader = Loader(PinMemory(IterableWrapper(items)))
        return (x.to("cuda", non_blocking=True) for x in loader)
    if method == "staged":
        return iter(torch_stage.staged(iter(items), device="cuda"))
    if method == "ours_loader":
        return iter(torch_stage.DataLoader(Items(items), batch_size=None, device="cuda"))
    raise ValueError(method)


def run(method: str, items, cycles: int) -> float:
    """Seconds per item in steady state."""
    feed = feeds(method, items)
    first = next(feed)
    first.sum()
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 0
    for x in feed:
        if cycles:
            torch.cuda._sleep(cycles)
        x.sum()
        n += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def cycles_for(ms: float) -> int:
    if ms <= 0:
        return 0
    probe = 10_000_000
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    return max(1, int(probe * ms / begin.elapsed_time(end)))


def cell(mb: float, memory: str, compute_ms: float, n: int, rounds: int) -> dict:
    numel = int(mb * (1 << 20)) // 4
    items = [torch.randn(numel) for _ in range(n)]
    if memory == "pinned":
        items = [x.pin_memory() for x in items]
    cycles = cycles_for(compute_ms)
    methods = [m for m in METHODS if m != "torchdata_pin" or PinMemory is not None]
    per_item = {m: [] for m in methods}
    for _ in range(rounds):
        for m in methods:
            per_item[m].append(run(m, items, cycles))
    ms = {m: statistics.median(v) * 1000 for m, v in per_item.items()}
    best_peer = min(ms[m] for m in PEERS if m in ms)
    return {
        "mb": mb,
        "memory": memory,
        "compute_ms": compute_ms,
        "ms_per_item": ms,
        "gb_per_s": {m: mb / 1024 / (v / 1000) for m, v in ms.items()},
        # > 1: ours is faster than the fastest of the peers.
        "staged_vs_best_peer": best_peer / ms["staged"],
        "ours_loader_vs_dataloader_pin": ms["dataloader_pin"] / ms["ours_loader"],
    }


def table(rows) -> str:
    methods = list(rows[0]["ms_per_item"])
    head = f"{'MB':>5} {'memory':9} {'GPU ms':>6} " + " ".join(f"{m:>15}" for m in methods)
    lines = ["ms per item (GB/s)", head]
    for r in rows:
        cells = " ".join(
            f"{r['ms_per_item'][m]:7.2f} ({r['gb_per_s'][m]:5.1f})".rjust(15) for m in methods
        )
        lines.append(f"{r['mb']:5g} {r['memory']:9} {r['compute_ms']:6g} {cells}")
    lines.append("")
    lines.append("speed ratios (> 1: torch_stage faster)")
    lines.append(
        f"{'MB':>5} {'memory':9} {'GPU ms':>6} {'staged/best peer':>17} {'loader/pin':>11}"
    )
    for r in rows:
        lines.append(
            f"{r['mb']:5g} {r['memory']:9} {r['compute_ms']:6g} "
            f"{r['staged_vs_best_peer']:17.3f} {r['ours_loader_vs_dataloader_pin']:11.3f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[4, 64], help="item sizes")
    parser.add_argument("--items", type=int, default=40, help="items per run")
    parser.add_argument(
        "--compute-ms", type=float, nargs="+", default=[0, 5], help="GPU work per step"
    )
    parser.add_argument("--rounds", type=int, default=3)
    add_json_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "device_staging.py measures copies to a CUDA device: none is visible", file=sys.stderr
        )
        return 2
    if args.items < 2 or args.rounds < 1 or min(args.mb) <= 0 or min(args.compute_ms) < 0:
        parser.error("--items must be >= 2, --rounds >= 1, --mb > 0 and --compute-ms >= 0")
    grid = [
        (mb, memory, c)
        for mb in args.mb
        for memory in ("pageable", "pinned")
        for c in args.compute_ms
    ]
    rows = [cell(*g, args.items, args.rounds) for g in progress(grid, "cells")]
    print(table(rows))
    print()
    emit(
        {
            "benchmark": "device_staging",
            "machine": dict(machine(), device=torch.cuda.get_device_name()),
            "items": args.items,
            "rounds": args.rounds,
            "unit": "ms per item in steady state, median over rounds",
            "cells": rows,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
