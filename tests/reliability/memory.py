"""Memory: resident memory stays flat over many batches (nothing retained
per item by the buffer, the stage, or the records reader)."""

from __future__ import annotations

import gc
import os
import tempfile
import threading

import torch

import torch_stage
from reliability.harness import check, scenario
from reliability.probes import rss_mb

GROWTH_BOUND_MB = 10.0
_PROFILES = {"quick": {"batches": 20_000}, "full": {"batches": 100_000}}


def _measure(name: str, batches: int, step) -> dict:
    """Run ``step(i)`` for every batch; RSS after a warm-up tenth (caches,
    allocator pools and torch's lazy state filled) and at the end."""
    warm = max(1000, batches // 10)
    samples = []
    for i in range(batches):
        step(i)
        if i + 1 == warm or (i + 1) % (batches // 5) == 0:
            gc.collect()
            samples.append(rss_mb())
    growth = samples[-1] - samples[0]
    check(
        growth < GROWTH_BOUND_MB,
        f"{name}: resident memory grew {growth:.1f} MB over {batches - warm} batches "
        f"after warm-up (samples {[round(s, 1) for s in samples]} MB)",
    )
    return {f"{name}_growth_mb": round(growth, 2), f"{name}_rss_mb": round(samples[-1], 1)}


@scenario("memory.staging_area", timeout_s=300, **_PROFILES)
def staging_area(batches: int):
    """StagingArea: a producer thread and a consumer, fresh tensors each batch."""
    area = torch_stage.StagingArea(capacity=8)

    def produce():
        for i in range(batches):
            area.put([torch.randn(256), torch.full((4,), i)])
        area.close()

    producer = threading.Thread(target=produce)
    producer.start()

    def take(i):
        x, tag = area.take()
        assert int(tag[0]) == i

    figures = _measure("area", batches, take)
    producer.join()
    return figures


@scenario("memory.staged", timeout_s=300, **_PROFILES)
def staged(batches: int):
    """staged() with two producer threads and a transform that allocates."""
    stage = torch_stage.staged(
        range(batches),
        num_threads=2,
        capacity=8,
        transform=lambda i: {"x": torch.randn(256), "i": i},
    )
    it = iter(stage)

    def take(i):
        assert next(it)["i"] == i

    with stage:
        return _measure("staged", batches, take)


@scenario("memory.record_input", timeout_s=300, **_PROFILES)
def record_input(batches: int):
    """RecordInput repeating over a file, each batch parsed."""
    path = os.path.join(tempfile.mkdtemp(), "mem.tfrecord")
    with torch_stage.RecordWriter(path) as w:
        for i in range(2000):
            w.write(
                torch_stage.encode_example(
                    {"id": [i], "x": [0.5] * 8, "tag": [b"ab"] * (i % 4 + 1)}
                )
            )
    spec = {
        "id": torch_stage.FixedLenFeature([1], torch.int64),
        "x": torch_stage.FixedLenFeature([8], torch.float32),
        "tag": torch_stage.VarLenFeature(torch.uint8),
    }
    reader = torch_stage.RecordInput(
        path, parallelism=2, buffer_size=512, batch_size=32, epochs=None
    )

    def take(i):
        parsed = torch_stage.parse_example(next(reader), spec)
        assert parsed["x"].shape == (32, 8)

    try:
        return _measure("records", batches, take)
    finally:
        reader.close()
