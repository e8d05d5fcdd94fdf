"""The host side of device staging, modelled in Python: pageable items
gathered into pinned buffers, each sent to the GPU by a non-blocking copy on
a side stream, for each number of gather threads and of pinned buffers.

This is the step DeviceStager runs in C++ (csrc/staging/device_stager.h),
with the same torch calls: ``pinned.copy_(item)`` on N intra-op threads,
then ``device.copy_(pinned, non_blocking=True)`` and an event; a buffer is
written again only after its event. With one buffer each gather waits for
the copy before; with two, a gather overlaps the copy of the item before.
It says how many gather threads and buffers the C++ side should use, and
why (stop 31: its table is in the README, under "GPU runs"). Needs a CUDA
device.

Also timed: one gather and one copy alone, for the item size.

Usage: python benchmarks/pinned_gather.py [--mb 64] [--items 48]
       [--threads 4 8 16] [--buffers 1 2 3] [--rounds 3] [--json PATH]
"""

import argparse
import sys
import time

import torch
from _common import add_json_argument, emit, machine


def ms(fn, reps: int = 8) -> float:
    times = []
    for k in range(reps):
        start = time.perf_counter()
        fn(k)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def pipeline(items, buffers, stream, n: int) -> float:
    """ms per item through len(buffers) pinned buffers."""
    numel = items[0].numel()
    events = [None] * len(buffers)
    kept = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k in range(n):
        b = k % len(buffers)
        if events[b] is not None:
            events[b].synchronize()
        buffers[b].copy_(items[k % len(items)])
        with torch.cuda.stream(stream):
            out = torch.empty(numel, device="cuda")
            out.copy_(buffers[b], non_blocking=True)
            events[b] = torch.cuda.Event()
            events[b].record(stream)
        kept = (kept + [out])[-3:]  # the consumer holds a few
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=64)
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--threads", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--buffers", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=3)
    add_json_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("pinned_gather.py needs a CUDA device", file=sys.stderr)
        return 2
    numel = int(args.mb * (1 << 20)) // 4
    items = [torch.randn(numel) for _ in range(min(args.items, 24))]
    buffers = [torch.empty(numel).pin_memory() for _ in range(max(args.buffers))]
    device = torch.empty(numel, device="cuda")
    stream = torch.cuda.Stream()
    threads_before = torch.get_num_threads()
    alone = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        alone[threads] = ms(lambda k: buffers[0].copy_(items[k % len(items)]))
    copy_ms = ms(lambda k: (device.copy_(buffers[0], non_blocking=True), torch.cuda.synchronize()))
    grid = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for count in args.buffers:
            pipeline(items, buffers[:count], stream, 4)  # warm-up
            grid[(threads, count)] = min(
                pipeline(items, buffers[:count], stream, args.items) for _ in range(args.rounds)
            )
    torch.set_num_threads(threads_before)
    print(f"{args.mb:g} MB pageable items; the copy of one alone: {copy_ms:.2f} ms")
    print("gather threads  gather alone  " + "  ".join(f"{c} buffer(s)" for c in args.buffers))
    for threads in args.threads:
        cells = "  ".join(f"{grid[(threads, c)]:11.2f}" for c in args.buffers)
        print(f"{threads:14d}  {alone[threads]:12.2f}  {cells}")
    print("(ms per item; the best of the rounds)")
    emit(
        {
            "benchmark": "pinned_gather",
            "machine": machine(),
            "device": torch.cuda.get_device_name(),
            "mb": args.mb,
            "items": args.items,
            "copy_ms": copy_ms,
            "gather_ms": {str(t): v for t, v in alone.items()},
            "ms_per_item": [
                {"threads": t, "buffers": c, "ms": v} for (t, c), v in sorted(grid.items())
            ],
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
