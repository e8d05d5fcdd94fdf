"""A producer thread feeds a scripted consumer through a StagingArea.

The consumer is a TorchScript module whose forward() takes its next batch
from a StagingArea attribute, so the same module can be saved and served from
C++. A Python thread prepares batches (torch ops, which release the GIL) and
puts them; while the model computes on batch i, batch i+1 is being prepared.

Printed: the time of a plain loop (prepare, then compute, one after the other)
and of the staged loop, their ratio, and the area's stats.
"""

import argparse
import json
import threading
import time

import torch

import torch_stage


class StagedMLP(torch.nn.Module):
    def __init__(self, area: torch_stage.StagingArea, width: int):
        super().__init__()
        self.area = area.script_object
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 1),
        )

    def forward(self) -> torch.Tensor:
        x, y = self.area.take()
        return torch.nn.functional.mse_loss(self.net(x), y)


def make_batch(batch: int, width: int, work: int):
    """Data-side work: generate and normalise a batch (torch ops)."""
    x = torch.randn(batch, width)
    for _ in range(work):
        x = (x - x.mean(dim=0)) / (x.std(dim=0) + 1e-5)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    return [x, y]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--work", type=int, default=3, help="normalisation passes per batch")
    parser.add_argument("--capacity", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    area = torch_stage.StagingArea(args.capacity)
    model = torch.jit.script(StagedMLP(area, args.width))

    # Plain loop: the same module, fed one batch just before each step.
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(args.steps):
            area.put(make_batch(args.batch, args.width, args.work))
            model()
        plain_s = time.perf_counter() - start

    staged = torch_stage.StagingArea(args.capacity)
    model.area = staged.script_object

    def producer():
        # One intra-op thread per side: on a small machine the data side and
        # the model then each own a core instead of contending for both.
        torch.set_num_threads(1)
        for _ in range(args.steps):
            staged.put(make_batch(args.batch, args.width, args.work))
        staged.close()

    with torch.no_grad():
        start = time.perf_counter()
        thread = threading.Thread(target=producer, name="stage-producer")
        thread.start()
        for _ in range(args.steps):
            model()
        staged_s = time.perf_counter() - start
        thread.join()

    stats = staged.stats()
    taken = max(stats["taken"], 1)
    print(
        json.dumps(
            {
                "steps": args.steps,
                "plain_loop_s": round(plain_s, 3),
                "staged_s": round(staged_s, 3),
                "speedup": round(plain_s / staged_s, 3),
                "mean_occupancy_at_take": round(stats["occupancy_sum"] / taken, 2),
                "consumer_wait_s": round(stats["consumer_wait_ns"] / 1e9, 3),
                "producer_blocked_s": round(stats["producer_blocked_ns"] / 1e9, 3),
                "stats": stats,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
