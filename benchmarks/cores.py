"""Are this machine's CPUs separate cores? Runs the same work in one process,
then in as many processes as there are CPUs at once, and prints how much
slower each ran side by side (1.0: independent cores; ~1.5-2: hyperthreads
of one core, or a host that shares them). Every overlap figure in this
project's README depends on it: a staging thread overlaps the step only as
far as the cores let it.

Two kinds of work: a pure Python loop, and torch ops on one intra-op thread
(a 256x256 matmul and a randn), each timed by the process that runs it.

Usage: python benchmarks/cores.py [--rounds R] [--json PATH]
"""

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

from _common import add_json_argument, emit, machine


def _python_work(_):
    start = time.perf_counter()
    s = 0
    for i in range(3_000_000):
        s += i * i
    return time.perf_counter() - start


def _torch_work(_):
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(300):
        a @ a
        torch.randn(256, 256)
    return time.perf_counter() - start


def measure(work, procs: int, rounds: int) -> dict:
    ctx = mp.get_context("fork")
    alone, together = [], []
    with ctx.Pool(procs) as pool:
        pool.map(work, range(procs))  # warm up: imports, page faults
        for _ in range(rounds):
            alone.append(pool.apply(work, (0,)))
            together.append(statistics.mean(pool.map(work, range(procs))))
    ratios = [t / a for a, t in zip(alone, together)]
    return {
        "alone_s": round(statistics.median(alone), 4),
        "side_by_side_s": round(statistics.median(together), 4),
        "slowdown": round(statistics.median(ratios), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    add_json_argument(parser)
    args = parser.parse_args()
    procs = os.cpu_count() or 1
    report = {
        "benchmark": "cores",
        "machine": machine(),
        "processes": procs,
        "python_loop": measure(_python_work, procs, args.rounds),
        "torch_ops": measure(_torch_work, procs, args.rounds),
    }
    print(
        f"{procs} processes side by side, each against one alone (median of {args.rounds}):",
        file=sys.stderr,
    )
    for kind in ("python_loop", "torch_ops"):
        r = report[kind]
        print(
            f"  {kind:12s} alone {r['alone_s']:.3f} s, side by side {r['side_by_side_s']:.3f} s: "
            f"x{r['slowdown']:.2f} slower",
            file=sys.stderr,
        )
    emit(report, args.json)


if __name__ == "__main__":
    main()
