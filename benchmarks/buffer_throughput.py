"""Staging buffer throughput: items/s through one buffer, by (producers,
consumers) and capacity, for

* ``cpp_threads``: StagingArea driven by C++ threads (benchmarks/cpp/
  buffer_bench, built by `make build`): the buffer's own cost;
* ``py_threads_staging_area``: torch_stage.StagingArea from Python threads;
* ``py_threads_queue``: Python's queue.Queue(maxsize=capacity) from Python
  threads moving the same tensor bundles, the peer;

all in the same run, with the ratio of the two Python-thread figures. Prints
one JSON document.

Usage: python benchmarks/buffer_throughput.py [--items N] [--cpp-items N]
"""

import argparse
import json
import os
import platform
import queue
import subprocess
import threading
import time

import torch
from _common import add_json_argument, emit, progress

import torch_stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [(1, 1), (4, 4), (8, 4)]
CAPACITIES = [1, 8, 64]
_END = object()


def _run_threads(producers, consumers, produce, consume):
    threads = [threading.Thread(target=produce) for _ in range(producers)]
    takers = [threading.Thread(target=consume) for _ in range(consumers)]
    start = time.perf_counter()
    for t in threads + takers:
        t.start()
    return start, threads, takers


def bench_staging_area(producers, consumers, capacity, items, payload):
    area = torch_stage.StagingArea(capacity)
    per_producer = items // producers
    bundle = [payload]

    def produce():
        for _ in range(per_producer):
            area.put(bundle)

    def consume():
        for _ in area:
            pass

    start, threads, takers = _run_threads(producers, consumers, produce, consume)
    for t in threads:
        t.join()
    area.close()
    for t in takers:
        t.join()
    elapsed = time.perf_counter() - start
    assert area.stats()["taken"] == per_producer * producers
    return per_producer * producers / elapsed


def bench_queue(producers, consumers, capacity, items, payload):
    q = queue.Queue(maxsize=capacity)
    per_producer = items // producers
    bundle = [payload]
    taken = []

    def produce():
        for _ in range(per_producer):
            q.put(bundle)

    def consume():
        n = 0
        while q.get() is not _END:
            n += 1
        taken.append(n)

    start, threads, takers = _run_threads(producers, consumers, produce, consume)
    for t in threads:
        t.join()
    for _ in takers:
        q.put(_END)
    for t in takers:
        t.join()
    elapsed = time.perf_counter() - start
    assert sum(taken) == per_producer * producers
    return per_producer * producers / elapsed


def bench_cpp(items):
    exe = os.path.join(ROOT, "build", "cpp", "benchmarks", "cpp", "buffer_bench")
    if not os.path.exists(exe):
        return None, f"{exe} is missing: run `make build`"
    args = [f"{p}:{c}:{cap}" for p, c in CONFIGS for cap in CAPACITIES]
    out = subprocess.run([exe, str(items), *args], capture_output=True, text=True, check=True)
    rates = {}
    for line in out.stdout.splitlines():
        row = json.loads(line)
        rates[(row["producers"], row["consumers"], row["capacity"])] = row["items_per_s"]
    return rates, None


def main() -> int:
    parser = argparse.ArgumentParser(description="staging buffer throughput")
    parser.add_argument("--items", type=int, default=20_000, help="items per Python run")
    parser.add_argument("--cpp-items", type=int, default=400_000, help="items per C++ run")
    add_json_argument(parser)
    args = parser.parse_args()

    payload = torch.ones(16)
    cpp, cpp_note = bench_cpp(args.cpp_items)
    rows = []
    grid = [(p, c, cap) for p, c in CONFIGS for cap in CAPACITIES]
    for producers, consumers, capacity in progress(grid, "buffer configurations"):
        sa = bench_staging_area(producers, consumers, capacity, args.items, payload)
        qq = bench_queue(producers, consumers, capacity, args.items, payload)
        row = {
            "producers": producers,
            "consumers": consumers,
            "capacity": capacity,
            "cpp_threads_items_per_s": None
            if cpp is None
            else cpp[(producers, consumers, capacity)],
            "py_threads_staging_area_items_per_s": round(sa, 1),
            "py_threads_queue_items_per_s": round(qq, 1),
            "staging_area_vs_queue": round(sa / qq, 3),
        }
        rows.append(row)
    report = {
        "benchmark": "buffer_throughput",
        "payload": "bundle of one float32 tensor of 16 elements",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "items_python": args.items,
        "items_cpp": args.cpp_items,
        "results": rows,
    }
    if cpp_note:
        report["note"] = cpp_note
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
