"""Resume: a pipeline cut at any point and resumed from its state, saved with
torch.save, yields exactly the items not yet received, in the same order."""

from __future__ import annotations

import io
import random

import torch

import torch_stage
from reliability.harness import check, scenario


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _cuts(seed: int, count: int, length: int):
    # ``count`` distinct cuts; both ends among them: before the first item
    # and after the last.
    inner = random.Random(seed).sample(range(1, length), min(count, length + 1) - 2)
    return sorted([0, length, *inner])


@scenario("resume.staged", timeout_s=300, quick={"cuts": 6}, full={"cuts": 20})
def staged(cuts: int, items: int = 200, seed: int = 2026):
    """staged() over a re-iterable source, 1 and 4 threads, cut at random
    points (buffered items included): the resumed stage is exact."""
    expected = [i * i for i in range(items)]
    figures = {"seed": seed}
    for threads in (1, 4):

        def make(threads=threads):
            return torch_stage.staged(
                range(items), num_threads=threads, capacity=8, transform=lambda i: i * i
            )

        points = _cuts(seed + threads, cuts, items)
        for cut in points:
            stage = make()
            it = iter(stage)
            head = [next(it) for _ in range(cut)]
            state = _roundtrip(stage.state_dict())
            stage.close()
            resumed = make()
            resumed.load_state_dict(state)
            rest = list(resumed)
            check(
                head + rest == expected,
                f"{threads} threads, cut at {cut}: resumed with {rest[:5]}..., "
                f"{len(head) + len(rest)} items in all, {items} expected",
            )
        figures[f"threads{threads}_cuts"] = len(points)
    return figures


class _Indices(torch.utils.data.Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        return i


@scenario("resume.loader", timeout_s=600, quick={"cuts": 4}, full={"cuts": 20})
def loader(cuts: int, seed: int = 2027):
    """torch_stage.DataLoader with 0 and 2 workers, shuffled by a generator
    and by the global seed, cut at random batches: the resumed epoch is the
    rest of the uninterrupted one."""
    figures = {"seed": seed}
    batch = 4
    for workers in (0, 2):
        for rng in ("generator", "global"):

            def make(rng=rng, workers=workers):
                gen = torch.Generator().manual_seed(seed) if rng == "generator" else None
                return torch_stage.DataLoader(
                    _Indices(),
                    batch_size=batch,
                    shuffle=True,
                    generator=gen,
                    num_workers=workers,
                    capacity=4,
                )

            torch.manual_seed(seed)
            full = [b.tolist() for b in make()]
            points = _cuts(seed + workers, cuts, len(full))
            for cut in points:
                torch.manual_seed(seed)
                first = make()
                it = iter(first)
                head = [next(it).tolist() for _ in range(cut)]
                state = _roundtrip(first.state_dict())
                del it
                first.close()
                torch.manual_seed(seed + 1000 + cut)  # the resumed run starts elsewhere
                resumed = make()
                resumed.load_state_dict(state)
                rest = [b.tolist() for b in resumed]
                check(
                    head + rest == full,
                    f"num_workers={workers}, shuffle by {rng}, cut at batch {cut}: "
                    f"{len(head)}+{len(rest)} batches, resumed with {rest[:2]}, "
                    f"expected {full[cut : cut + 2]}",
                )
            figures[f"w{workers}_{rng}_cuts"] = len(points)
    return figures
