"""torch_stage.StagingArea: the Python facade over the C++ staging buffer."""

import threading
import time

import pytest
import torch
from conftest import HANG_BOUND_S

import torch_stage
from torch_stage import StageCancelled, StageClosed, StagingArea


def start(fn, *args):
    """Run fn in a daemon thread; returns (thread, result holder)."""
    result = {}

    def body():
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, result


def join(t):
    t.join(HANG_BOUND_S)
    assert not t.is_alive(), "thread still blocked: a wait did not wake"


def test_put_take_hands_over_the_same_tensors_in_fifo_order():
    area = StagingArea(capacity=3)
    bundles = [[torch.full((2,), float(i)), torch.arange(i + 1)] for i in range(3)]
    for b in bundles:
        area.put(b)
    assert area.size() == len(area) == 3
    for b in bundles:
        out = area.take()
        assert len(out) == 2
        assert out[0].data_ptr() == b[0].data_ptr()
        assert torch.equal(out[1], b[1])
    assert area.size() == 0


def test_tuple_and_empty_bundles():
    area = StagingArea(2)
    area.put((torch.ones(1), torch.zeros(2)))
    area.put([])
    assert [t.shape for t in area.take()] == [torch.Size([1]), torch.Size([2])]
    assert area.take() == []


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"capacity": 0}, ValueError, "capacity must be >= 1, got 0"),
        ({"capacity": -2}, ValueError, "got -2"),
        ({"capacity": 1.5}, TypeError, "capacity must be an int, got float"),
        ({"capacity": True}, TypeError, "capacity must be an int, got bool"),
        ({"capacity": 1, "byte_limit": -1}, ValueError, "byte_limit must be >= 0"),
    ],
)
def test_bad_construction_names_the_value_and_the_rule(kwargs, error, text):
    with pytest.raises(error, match=text):
        StagingArea(**kwargs)


def test_the_script_class_checks_arguments_too():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        torch.classes.torch_stage.StagingArea(0)
    with pytest.raises(ValueError, match="byte_limit must be >= 0"):
        torch.classes.torch_stage.StagingArea(1, -5)


@pytest.mark.parametrize(
    "bundle, text",
    [
        (torch.ones(2), "takes a list of tensors, got Tensor"),
        ("abc", "takes a list of tensors, got str"),
        ([torch.ones(1), 3], "element 1 of the bundle is a int"),
        ([None], "element 0 of the bundle is a NoneType"),
    ],
)
def test_putting_non_tensors_is_a_type_error(bundle, text):
    area = StagingArea(1)
    with pytest.raises(TypeError, match=text):
        area.put(bundle)
    with pytest.raises(TypeError, match=text):
        area.try_put(bundle, 0)
    assert area.size() == 0


def test_timeouts_return_false_and_none():
    area = StagingArea(1)
    assert area.try_take(10) is None
    assert area.try_take(0) is None
    assert area.try_put([torch.ones(1)], 0) is True
    assert area.try_put([torch.ones(1)], 10) is False
    assert area.size() == 1
    stats = area.stats()
    assert stats["consumer_wait_ns"] >= 10_000_000
    assert stats["producer_blocked_ns"] >= 10_000_000


@pytest.mark.parametrize("method", ["try_put", "try_take"])
def test_negative_timeouts_are_value_errors(method):
    area = StagingArea(1)
    args = ([torch.ones(1)], -1) if method == "try_put" else (-1,)
    with pytest.raises(ValueError, match=r"timeout_ms must be >= 0 .*, got -1"):
        getattr(area, method)(*args)
    with pytest.raises(ValueError, match="got -1"):
        getattr(area.script_object, method)(*args)


def test_close_refuses_puts_and_drains_before_end_of_stream():
    area = StagingArea(4)
    area.put([torch.ones(1)])
    area.put([torch.zeros(1)])
    area.close()
    assert area.is_closed()
    with pytest.raises(StageClosed, match="accepts no more items"):
        area.put([torch.ones(1)])
    with pytest.raises(StageClosed):
        area.try_put([torch.ones(1)], 5)
    assert torch.equal(area.take()[0], torch.ones(1))
    assert torch.equal(area.try_take(5)[0], torch.zeros(1))
    with pytest.raises(StageClosed, match="end of stream"):
        area.take()
    with pytest.raises(StageClosed):
        area.try_take(5)


def test_iteration_ends_at_end_of_stream():
    area = StagingArea(8)
    for i in range(5):
        area.put([torch.tensor(i)])
    area.close()
    assert [int(b[0]) for b in area] == list(range(5))


def test_close_wakes_a_blocked_consumer_and_producer():
    empty = StagingArea(1)
    full = StagingArea(1)
    full.put([torch.ones(1)])
    consumer, c_result = start(empty.take)
    producer, p_result = start(full.put, [torch.ones(1)])
    time.sleep(0.05)
    empty.close()
    full.close()
    join(consumer)
    join(producer)
    assert isinstance(c_result["error"], StageClosed)
    assert isinstance(p_result["error"], StageClosed)


def test_cancel_wakes_waiters_and_fails_every_later_call():
    area = StagingArea(1)
    consumers = [start(area.take) for _ in range(3)]
    time.sleep(0.05)
    area.cancel()
    for t, result in consumers:
        join(t)
        assert isinstance(result["error"], StageCancelled)
    assert area.is_cancelled()
    with pytest.raises(StageCancelled, match="cancelled"):
        area.put([torch.ones(1)])
    with pytest.raises(StageCancelled):
        area.take()


def test_cancel_discards_and_counts_buffered_items():
    area = StagingArea(4)
    for _ in range(3):
        area.put([torch.ones(1)])
    area.cancel()
    stats = area.stats()
    assert stats["dropped"] == 3
    assert stats["size"] == 0
    assert stats["cancelled"] == 1


def test_byte_limit():
    area = StagingArea(8, byte_limit=64)
    area.put([torch.zeros(8, dtype=torch.float32)])  # 32 bytes
    area.put([torch.zeros(4, dtype=torch.float64)])  # 32 bytes
    assert area.try_put([torch.zeros(1, dtype=torch.uint8)], 5) is False
    with pytest.raises(ValueError, match="holds 72 bytes, more than the area's byte_limit of 64"):
        area.put([torch.zeros(9, dtype=torch.float64)])
    assert area.stats()["bytes"] == 64
    area.take()
    assert area.try_put([torch.zeros(1, dtype=torch.uint8)], 5) is True


def test_stats():
    area = StagingArea(4)
    for _ in range(3):
        area.put([torch.ones(1)])
    area.take()
    stats = area.stats()
    assert stats == {
        **stats,
        "capacity": 4,
        "byte_limit": 0,
        "size": 2,
        "put": 3,
        "taken": 1,
        "dropped": 0,
        "max_size": 3,
        "occupancy_sum": 3,
        "closed": 0,
        "cancelled": 0,
    }
    assert set(stats) >= {"bytes", "consumer_wait_ns", "producer_blocked_ns"}


def test_context_manager_closes_on_success_and_cancels_on_error():
    with StagingArea(2) as area:
        area.put([torch.ones(1)])
    assert area.is_closed() and not area.is_cancelled()
    assert area.take()[0].item() == 1
    with pytest.raises(KeyError):
        with StagingArea(2) as failed:
            failed.put([torch.ones(1)])
            raise KeyError("boom")
    assert failed.is_cancelled()


def test_repr_and_accessors():
    area = StagingArea(5, byte_limit=1024)
    assert area.capacity() == 5
    assert area.byte_limit() == 1024
    assert repr(area) == "StagingArea(capacity=5, byte_limit=1024, size=0, closed=False)"


def test_wrap_shares_the_underlying_buffer():
    area = StagingArea(2)
    other = StagingArea.wrap(area.script_object)
    area.put([torch.ones(1)])
    assert other.size() == 1
    with pytest.raises(TypeError, match="got int"):
        StagingArea.wrap(3)


def test_many_python_threads_deliver_every_item_exactly_once():
    area = StagingArea(3)
    per_producer, producers, consumers = 300, 4, 3
    seen = []
    lock = threading.Lock()

    def produce(p):
        for i in range(per_producer):
            area.put([torch.tensor(p * per_producer + i)])

    def consume():
        for bundle in area:
            with lock:
                seen.append(int(bundle[0]))

    ps = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    cs = [threading.Thread(target=consume) for _ in range(consumers)]
    for t in ps + cs:
        t.start()
    for t in ps:
        join(t)
    area.close()
    for t in cs:
        join(t)
    assert sorted(seen) == list(range(per_producer * producers))


@pytest.mark.parametrize("api", ["script_class", "facade"])
def test_blocked_take_releases_the_gil(run_python, api):
    # If take() held the GIL while it waits, the main thread could never run
    # the Python loop or the put below and the subprocess would hang (and be
    # killed by the bound). The ticker proves other Python threads progress.
    proc = run_python(
        f"""
        import threading, time, torch, torch_stage
        area = torch_stage.StagingArea(1)
        take = area.script_object.take if "{api}" == "script_class" else area.take
        got = []
        consumer = threading.Thread(target=lambda: got.append(take()))
        consumer.start()
        time.sleep(0.1)
        ticks = 0
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            ticks += 1
        area.put([torch.ones(3)])
        consumer.join()
        print(ticks, len(got))
        """
    )
    ticks, got = map(int, proc.stdout.split())
    assert got == 1
    assert ticks > 0


def test_keyboard_interrupt_reaches_a_main_thread_blocked_in_take(run_python):
    proc = run_python(
        """
        import os, signal, threading, time, torch_stage
        # Python ignores SIGINT when started with it ignored (a background job, nohup).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        area = torch_stage.StagingArea(1)
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            area.take()
        except KeyboardInterrupt:
            print("interrupted")
        """
    )
    assert proc.stdout.strip() == "interrupted"


def test_error_classes():
    assert issubclass(torch_stage.StageTimeoutError, TimeoutError)
    for cls in (StageClosed, StageCancelled, torch_stage.StageTimeoutError):
        assert issubclass(cls, torch_stage.StageError)
        assert issubclass(cls, RuntimeError)
