"""torch_stage.observe.diagnose: the verdict and advice from real stages' stats."""

import time

import pytest

import torch_stage
from torch_stage.observe.diagnose import diagnose

STEPS = 25


def timed_run(source_ms, body_ms, num_threads=1, capacity=4, transform_ms=0):
    def make():
        time.sleep(source_ms / 1000)
        return 1

    def transform(item):
        time.sleep(transform_ms / 1000)
        return item

    stage = torch_stage.staged(
        make,
        capacity=capacity,
        num_threads=num_threads,
        transform=transform if transform_ms else None,
        name="diag",
    )
    with stage:
        it = iter(stage)
        next(it)  # the clock starts after the first item, as the demo's steady state
        start = time.perf_counter()
        for _ in range(STEPS):
            next(it)
            time.sleep(body_ms / 1000)
        seconds = time.perf_counter() - start
        stats = stage.stats()
    return stats, seconds


def test_a_slow_transform_is_input_bound_and_asks_for_threads():
    stats, seconds = timed_run(source_ms=0, transform_ms=12, body_ms=2)
    d = diagnose(stats, steps=STEPS, seconds=seconds, num_threads=1)
    assert d.bound == "input" == stats["bound"]
    assert d.data_ms >= 12 and d.wait_ms > 5 and d.source_ms < 2
    text = " ".join(d.sentences())
    assert "input-bound" in text
    assert "num_threads=" in text and "capacity does not help" in text


def test_a_slow_source_is_not_helped_by_threads_and_the_advice_says_so():
    # Four producers, one source: they take turns at it, so the step stays
    # the source's, whatever num_threads says.
    stats, seconds = timed_run(source_ms=12, body_ms=2, num_threads=4)
    d = diagnose(stats, steps=STEPS, seconds=seconds, num_threads=4)
    assert d.bound == "input" == stats["bound"]
    assert d.source_ms >= 12 and d.step_ms >= 11
    assert d.independent_ms >= d.source_ms  # the bound knows the source is serial
    text = " ".join(d.sentences())
    assert "pulled by one producer at a time" in text and "transform=" in text
    assert "num_threads=5" not in text


def test_a_slow_loop_body_is_compute_bound_and_leaves_the_input_alone():
    stats, seconds = timed_run(source_ms=1, body_ms=12)
    d = diagnose(stats, steps=STEPS, seconds=seconds, num_threads=1)
    assert d.bound == "compute" == stats["bound"]
    assert d.compute_ms >= 10 and d.wait_ms < 2
    # Overlap: the step is close to max(D, C), well under D + C.
    assert d.ideal_ms <= d.step_ms < d.data_ms + d.compute_ms + 2
    text = " ".join(d.sentences())
    assert "compute-bound" in text and "nothing on the input side" in text
    assert "smaller capacity" in text  # the buffer sat full
    table = d.table()
    assert "best possible" in table and "torch_stage step (measured)" in table


def test_bad_arguments():
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        diagnose({}, steps=0, seconds=1.0)
    with pytest.raises(ValueError, match="seconds must be > 0, got 0"):
        diagnose({}, steps=1, seconds=0)
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        diagnose({}, steps=1, seconds=1.0, num_threads=0)


def test_a_measured_side_by_side_step_bounds_the_best_possible():
    # D = 4 ms, C = 6 ms, one after the other 10 ms. Independent cores would
    # allow 6 ms (1.67x); a machine whose two threads slow each other ran
    # the same work side by side at 9 ms a step: the best possible is 1.11x.
    stats = {
        "produced": 100,
        "consumed": 100,
        "source_s": 0.4,
        "consumer_wait_s": 0.01,
        "producer_blocked_s": 0.3,
    }
    d = diagnose(stats, steps=100, seconds=0.95, plain_seconds=1.0, corun_seconds=0.9)
    assert d.independent_ms == pytest.approx(6.0)
    assert d.ideal_ms == pytest.approx(9.0)
    assert d.best_speedup == pytest.approx(10 / 9)
    text = " ".join(d.sentences())
    assert "side-by-side step measured on this machine" in text
    assert "slow each other even with nothing handed over" in text
    assert "both side by side, nothing handed over" in d.table()
    # Side by side slower than one after the other (a loaded machine): the
    # best possible is no overlap at all, 1.0x, never below.
    loaded = diagnose(stats, steps=100, seconds=0.95, plain_seconds=1.0, corun_seconds=1.3)
    assert loaded.ideal_ms == pytest.approx(10.0) and loaded.best_speedup == pytest.approx(1.0)
    # Without the measurement the bound is the independent-cores one.
    alone = diagnose(stats, steps=100, seconds=0.95, plain_seconds=1.0)
    assert alone.ideal_ms == pytest.approx(6.0) and "side by side" not in alone.table()
