"""Volume: every item through the buffer exactly once, under contention."""

from __future__ import annotations

import threading

import torch

import torch_stage
from reliability.harness import check, scenario


def _tally(n: int, received) -> dict:
    seen = bytearray(n)
    duplicated = 0
    for i in received:
        if seen[i]:
            duplicated += 1
        seen[i] = 1
    lost = n - sum(seen)
    return {"items": n, "lost": lost, "duplicated": duplicated}


def _run_threads(targets) -> None:
    errors = []

    def guard(fn):
        def body():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001  (re-raised below)
                errors.append(e)

        return body

    threads = [threading.Thread(target=guard(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@scenario(
    "volume.staging_area",
    timeout_s=300,
    quick={"items": 100_000},
    full={"items": 1_000_000},
)
def staging_area(items: int, producers: int = 8, consumers: int = 4, capacity: int = 64):
    """StagingArea, 8 producer and 4 consumer threads: 0 lost, 0 duplicated,
    each producer's items in order within every consumer."""
    area = torch_stage.StagingArea(capacity=capacity)
    got = [[] for _ in range(consumers)]
    out_of_order = [0] * consumers
    done = threading.Barrier(producers + 1)

    def produce(p):
        def run():
            for i in range(p, items, producers):
                area.put([torch.tensor(i)])
            done.wait()

        return run

    def consume(c):
        def run():
            last = [-1] * producers
            mine = got[c]
            while True:
                try:
                    (t,) = area.take()
                except torch_stage.StageClosed:
                    return
                i = int(t)
                # A consumer takes in buffer order and a producer puts in its
                # own order, so one producer's items reach it increasing.
                if i <= last[i % producers]:
                    out_of_order[c] += 1
                last[i % producers] = i
                mine.append(i)

        return run

    def closer():
        done.wait()
        area.close()

    _run_threads(
        [produce(p) for p in range(producers)] + [consume(c) for c in range(consumers)] + [closer]
    )
    figures = _tally(items, (i for g in got for i in g))
    stats = area.stats()
    figures.update(out_of_order=sum(out_of_order), per_consumer_min=min(len(g) for g in got))
    check(
        figures["lost"] == 0 and figures["duplicated"] == 0, f"items lost or duplicated: {figures}"
    )
    check(
        figures["out_of_order"] == 0,
        f"a producer's items reached a consumer out of order: {figures}",
    )
    check(
        stats["put"] == items and stats["taken"] == items and stats["size"] == 0,
        f"stats disagree with the items: {stats}",
    )
    return figures


@scenario(
    "volume.staged",
    timeout_s=300,
    quick={"items": 100_000},
    full={"items": 1_000_000},
)
def staged_threads(items: int, threads: int = 4, consumers: int = 4):
    """staged(), 4 producer threads and 4 consumers: 0 lost, 0 duplicated,
    each consumer's items in source order (ordered=True)."""
    stage = torch_stage.staged(
        range(items),
        num_threads=threads,
        num_clients=consumers,
        capacity=64,
        transform=lambda i: i,
        name="volume",
    )
    got = [[] for _ in range(consumers)]

    def consume(c):
        def run():
            got[c].extend(stage)

        return run

    with stage:
        _run_threads([consume(c) for c in range(consumers)])
        stats = stage.stats()
    figures = _tally(items, (i for g in got for i in g))
    figures["out_of_order"] = sum(sum(a >= b for a, b in zip(g, g[1:])) for g in got)
    figures["per_consumer_min"] = min(len(g) for g in got)
    check(
        figures["lost"] == 0 and figures["duplicated"] == 0, f"items lost or duplicated: {figures}"
    )
    check(figures["out_of_order"] == 0, f"a consumer got items out of source order: {figures}")
    check(
        stats["produced"] == items and stats["consumed"] == items,
        f"stats disagree with the items: {stats['produced']} produced, "
        f"{stats['consumed']} consumed",
    )
    return figures
