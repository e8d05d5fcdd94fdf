"""torch_stage.staged(), Stage, make_prefetch_hook() and stage thread pools."""

import gc
import logging
import os
import random
import threading
import time
import warnings
import weakref

import pytest
import torch
from conftest import HANG_BOUND_S, devices
from torch.utils import _pytree as pytree

import torch_stage
from torch_stage import StageError, StageTimeoutError, staged


def jittery(x):
    # Finish out of order: a later item often overtakes an earlier one.
    time.sleep(random.random() * 0.003)
    return x


def drain(stage):
    return list(stage)


def assert_same_tree(got, want):
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec
    for a, b in zip(got_leaves, want_leaves):
        if isinstance(b, torch.Tensor):
            assert torch.equal(a.cpu(), b)
        else:
            assert a == b


# --- delivery ----------------------------------------------------------------


def test_items_pass_through_unchanged():
    items = [torch.arange(3), {"a": torch.ones(2), "b": [1, "x"]}, (torch.zeros(1), None), 7]
    out = drain(staged(items))
    assert out[0] is items[0]
    assert out[1] is items[1] and out[3] == 7


@pytest.mark.parametrize("capacity", [1, 3, 16])
def test_ordered_with_four_threads_keeps_source_order(capacity):
    out = drain(staged(range(300), num_threads=4, capacity=capacity, transform=jittery))
    assert out == list(range(300))


def test_unordered_delivers_every_item_once():
    out = drain(staged(range(300), num_threads=4, ordered=False, transform=jittery))
    assert sorted(out) == list(range(300))


def test_threads_run_the_transform_in_parallel():
    active, peak, lock = [0], [0], threading.Lock()

    def work(x):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.01)  # releases the GIL, as torch ops do
        with lock:
            active[0] -= 1
        return x

    assert drain(staged(range(40), num_threads=4, capacity=8, transform=work)) == list(range(40))
    assert peak[0] > 1


def _consume_in_threads(stage, num_threads):
    """What each of num_threads threads iterating stage got, in order."""
    got = [[] for _ in range(num_threads)]

    def consume(k):
        for x in stage:
            got[k].append(x)

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_BOUND_S)
        assert not t.is_alive()
    return got


def test_exactly_once_delivery_to_three_clients():
    n = 3000
    got = _consume_in_threads(staged(range(n), num_clients=3, capacity=4, num_threads=2), 3)
    # Every client saw the end; together they saw every item exactly once.
    assert sorted(sum(got, [])) == list(range(n))
    for g in got:
        assert g == sorted(g)  # each client sees source order


def test_more_consumers_than_num_clients_take_turns():
    got = _consume_in_threads(staged(range(600), num_clients=1, capacity=2), 3)
    assert sorted(sum(got, [])) == list(range(600))


def test_callable_source_with_feed_dict_ends_on_a_closed_exception():
    calls = []

    def produce(scale, limit):
        if len(calls) == limit:
            raise EOFError("no more")
        calls.append(1)
        return torch.full((2,), float(len(calls) * scale))

    stage = staged(
        produce,
        feed_dict={"scale": 2, "limit": 5},
        closed_exception_types=(EOFError,),
    )
    assert [t[0].item() for t in stage] == [2.0, 4.0, 6.0, 8.0, 10.0]


def test_stop_iteration_from_a_callable_ends_the_stream():
    it = iter(range(4))
    assert drain(staged(lambda: next(it))) == [0, 1, 2, 3]


@pytest.mark.parametrize("where", ["transform", "callable source"])
def test_a_stop_iteration_that_ends_nothing_raises_instead_of_ending_the_loop(where):
    # closed_exception_types=() says StopIteration ends nothing here: it is
    # an error at its item, and re-raised as itself it would end the
    # consumer's for loop silently, data cut short. Raised as StageError
    # from it (as Python does for a generator's StopIteration, PEP 479).
    def transform(x):
        if x == 2:
            raise StopIteration("not an end marker here")
        return x

    if where == "transform":
        stage = staged(list(range(5)), transform=transform, closed_exception_types=())
    else:
        items = iter(range(5))
        stage = staged(lambda: transform(next(items)), closed_exception_types=())
    got = []
    with pytest.raises(StageError, match="raised StopIteration") as info:
        for x in stage:
            got.append(x)
    assert got == [0, 1]
    assert isinstance(info.value.__cause__, StopIteration)
    assert str(info.value.__cause__) == "not an end marker here"
    stage.close()


@pytest.mark.parametrize("num_threads", [1, 3])
def test_close_from_the_stages_own_transform_does_not_wait_for_itself(num_threads):
    # "Stop after item 3", from inside the work: close() cannot join the
    # thread it runs on, so it waits for the other producers only (it
    # waited its whole join timeout, 10 s, and warned of a stuck thread).
    holder, took = {}, []

    def transform(x):
        if x == 3:
            start = time.monotonic()
            holder["stage"].close()
            took.append(time.monotonic() - start)
        return x

    before = thread_count()
    stage = staged(list(range(100)), transform=transform, num_threads=num_threads, capacity=2)
    holder["stage"] = stage
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "still inside user code" warning fails
        with pytest.raises(torch_stage.StageClosed):
            for _ in stage:
                pass
        deadline = time.monotonic() + HANG_BOUND_S
        while not took and time.monotonic() < deadline:
            time.sleep(0.01)
    assert took and took[0] < 5.0  # generous: the join timeout is 10 s
    assert thread_count_once_gone(before) == before


def test_items_before_a_closed_exception_are_delivered_with_many_threads():
    def source():
        yield from range(50)
        raise EOFError

    out = drain(
        staged(
            source(), num_threads=4, capacity=2, closed_exception_types=(StopIteration, EOFError)
        )
    )
    assert out == list(range(50))


def test_ignored_exceptions_skip_count_and_log(caplog):
    def transform(x):
        if x % 3 == 0:
            raise KeyError(f"corrupt {x}")
        return x

    with caplog.at_level(logging.WARNING, logger="torch_stage"):
        stage = staged(
            range(10), transform=transform, ignored_exception_types=(KeyError,), name="skippy"
        )
        out = drain(stage)
    assert out == [1, 2, 4, 5, 7, 8]
    assert stage.stats()["skipped"] == 4
    assert "stage 'skippy' skipped item 3: KeyError" in caplog.text


@pytest.mark.parametrize("where", ["source", "transform"])
@pytest.mark.parametrize("num_threads", [1, 4])
def test_an_error_is_raised_at_its_position_with_type_and_traceback(where, num_threads):
    def source():
        for i in range(20):
            if where == "source" and i == 7:
                raise ZeroDivisionError("bad record 7")
            yield i

    def transform(i):
        if where == "transform" and i == 7:
            raise ZeroDivisionError("bad record 7")
        return jittery(i)

    stage = staged(source(), num_threads=num_threads, capacity=3, transform=transform)
    got = []
    with pytest.raises(ZeroDivisionError, match="bad record 7") as info:
        for x in stage:
            got.append(x)
    assert got == list(range(7))
    # The traceback reaches into the producer's code.
    frames = [f.name for f in info.traceback]
    assert ("source" if where == "source" else "transform") in frames
    # After the failure the stage has nothing more to give.
    with pytest.raises(StageError, match="failed on an earlier item"):
        next(iter(stage))
    assert stage.stats()["errors"] == 1


@pytest.mark.parametrize("source", [list, iter], ids=["resumable list", "iterator"])
@pytest.mark.parametrize("device", devices())
def test_a_transform_may_return_items_of_any_structure(source, device):
    # As a collate_fn may: each item carries its own structure through the
    # stage (a resumable source's items travel as (position, item) pairs).
    items = [
        (torch.tensor(0), torch.tensor(0)),
        [torch.tensor(1)],
        {"a": torch.ones(2), "names": ["x", "y"]},
        {"a": torch.ones(2), "names": ["z"]},
        7,
    ]
    out = drain(staged(source(items), transform=lambda item: item, device=device, num_threads=2))
    assert len(out) == len(items)
    for got, want in zip(out, items):
        assert_same_tree(got, want)


class Named(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "name": f"item{i}"}


@pytest.mark.parametrize("transform", [None, lambda batch: batch], ids=["plain", "transform"])
def test_a_dataloader_with_string_fields_and_a_short_last_batch_stages(transform):
    # The last batch carries 2 names where the others carry 4: another
    # pytree structure, which the transform must not be held to.
    loader = torch.utils.data.DataLoader(Named(), batch_size=4)
    out = drain(staged(loader, transform=transform))
    assert [b["name"] for b in out] == [b["name"] for b in loader]
    assert [len(b["name"]) for b in out] == [4, 4, 2]
    for got, want in zip(out, loader):
        assert_same_tree(got, want)


def test_stages_compose():
    read = staged(range(100), name="read", capacity=4)
    prep = staged(read, name="prep", transform=lambda x: x * 2, num_threads=2, capacity=4)
    assert drain(prep) == [2 * x for x in range(100)]


# --- timeouts, waiting and the GIL --------------------------------------------


def test_timeout_names_the_stage_and_what_producers_do():
    def slow():
        time.sleep(2)
        yield 1

    stage = staged(slow(), timeout_millis=100, name="slowpoke", num_threads=1)
    with pytest.raises(StageTimeoutError) as info:
        next(iter(stage))
    message = str(info.value)
    assert "stage 'slowpoke' delivered no item for" in message
    assert "timeout_millis=100" in message
    assert "producer 0: pulling from the source (item 0)" in message
    assert isinstance(info.value, TimeoutError)
    stage.close()


def test_a_given_timeout_keeps_a_thread_and_none_given_makes_items_in_the_loop():
    def slow():
        time.sleep(0.3)
        yield 1

    # No timeout given: the stage starts with no thread, and the consumer
    # makes the item, as a plain loop over the source would.
    with staged(slow()) as stage:
        assert list(stage) == [1]
        s = stage.stats()
    assert s["inline_items"] == 1 and s["threads"] == 0, s
    # Given, the bound holds: a thread makes the item and the consumer's
    # wait is cut short...
    with staged(slow(), timeout_millis=100, name="bounded") as stage:
        with pytest.raises(StageTimeoutError, match="stage 'bounded'"):
            next(iter(stage))
    # ...and the tuner never parks the last thread, even where none pays
    # (a quick source and a slow consumer).
    with staged(range(400), timeout_millis=60_000) as stage:
        for _ in stage:
            time.sleep(0.0005)
        s = stage.stats()
    assert s["threads"] >= 1 and s["inline_items"] == 0, s


def test_the_gil_is_not_held_while_a_consumer_waits(run_python):
    # The source needs the GIL to produce: if the waiting consumer held it,
    # the subprocess would deadlock and hit the bound.
    proc = run_python(
        """
        import threading, time, torch_stage
        def source():
            for i in range(5):
                time.sleep(0.05)
                yield i
        ticks = [0]
        stop = threading.Event()
        def ticker():
            while not stop.is_set():
                ticks[0] += 1
        t = threading.Thread(target=ticker); t.start()
        out = list(torch_stage.staged(source()))
        stop.set(); t.join()
        print(out, ticks[0] > 0)
        """
    )
    assert proc.stdout.strip() == "[0, 1, 2, 3, 4] True"


def test_gil_wait_is_measured():
    stats = None
    stage = staged(range(200), capacity=2)
    for _ in stage:
        sum(range(200))  # keep the GIL busy between takes
    stats = stage.stats()
    assert stats["gil_wait_s"] > 0
    assert stats["source_s"] > 0


# --- shutdown -----------------------------------------------------------------


def forever():
    i = 0
    while True:
        yield torch.full((4,), i)
        i += 1


def thread_count():
    return len(os.listdir("/proc/self/task"))


def thread_count_once_gone(expected):
    """The thread count once threads that were joined have left /proc.

    pthread_join returns when the kernel clears the thread's id (in exit_mm),
    before it unlists the task from /proc/self/task (release_task): on a busy
    machine a count taken right after close() joined every producer can
    still include one for a while (4 in 30 closes on this project's 2-vCPU
    VM). Waits, bounded against hangs, for the count to reach ``expected``.
    """
    deadline = time.monotonic() + HANG_BOUND_S
    while thread_count() != expected and time.monotonic() < deadline:
        time.sleep(0.001)
    return thread_count()


def test_close_stops_and_joins_promptly():
    before = thread_count()
    stage = staged(forever(), num_threads=3, capacity=2)
    it = iter(stage)
    next(it)
    assert thread_count() >= before + 3
    start = time.monotonic()
    stage.close()
    assert time.monotonic() - start < HANG_BOUND_S
    assert thread_count_once_gone(before) == before
    with pytest.raises(torch_stage.StageClosed):
        next(it)


def test_context_manager_closes():
    before = thread_count()
    with staged(forever(), capacity=2) as stage:
        assert next(iter(stage)).shape == (4,)
    assert thread_count_once_gone(before) == before
    assert "closed" in repr(stage)


def test_an_abandoned_iterator_is_collected_and_its_threads_stop():
    before = thread_count()
    for x in staged(forever(), num_threads=2, capacity=3):
        if x[0] == 5:
            break
    gc.collect()
    assert thread_count_once_gone(before) == before


class _Augmenter:
    """A training object holding a stage over its own method: the stage's
    C++ side holds the bound method, which holds the object (a cycle through
    C++)."""

    def __init__(self, how):
        if how == "transform":
            self.stage = staged(forever(), transform=self.augment, num_threads=2, capacity=2)
        else:
            self.stage = staged(self.batches(), num_threads=2, capacity=2)
        next(iter(self.stage))
        # A producer inside the method holds the object from its frame, and
        # the collector rightly counts that as a live reference: wait for
        # both to block on the full buffer, as a forgotten stage's do.
        deadline = time.monotonic() + HANG_BOUND_S
        while self.stage._impl.describe().count("waiting for") < 2:
            assert time.monotonic() < deadline, self.stage._impl.describe()
            time.sleep(0.001)

    def augment(self, x):
        return x + 1

    def batches(self):
        yield from forever()


@pytest.mark.parametrize("how", ["transform", "source"])
def test_a_forgotten_stage_over_its_owners_method_is_collected(how):
    # The garbage collector must see through the C++ stage to the owner's
    # bound method (or generator): otherwise the cycle is never found, and
    # the object, its stage and its producer threads live to the exit.
    before = thread_count()
    owner = _Augmenter(how)
    assert thread_count() >= before + 2
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None
    assert thread_count_once_gone(before) == before


def test_a_stage_over_its_owners_method_lives_while_a_loop_iterates_it():
    # A live consumer keeps the stage (and its owner) reachable: traversal
    # must not make the collector free what a running loop still uses.
    owner = _Augmenter("transform")
    it = iter(owner.stage)
    del owner
    gc.collect()
    got = [next(it)[0].item() for _ in range(5)]
    assert got == sorted(got) and all(v >= 1 for v in got)
    it._stage.close()


def test_interpreter_exit_with_running_stages(run_python):
    proc = run_python(
        """
        import torch, torch_stage
        def forever():
            while True:
                yield torch.ones(3)
        stages = [torch_stage.staged(forever(), num_threads=2, capacity=2) for _ in range(3)]
        for s in stages:
            next(iter(s))
        print("leaving")
        """,
        timeout=HANG_BOUND_S,
    )
    assert proc.stdout.strip() == "leaving"


def test_exit_with_a_producer_inside_a_generator_source_says_nothing(run_python):
    # As a daemon thread inside the same generator: the generator stays
    # alive with the thread in it, and is not closed under it.
    proc = run_python(
        """
        import time, torch_stage
        def slow():
            while True:
                time.sleep(30)
                yield 1
        stage = torch_stage.staged(slow(), num_threads=1)
        stage.start()
        time.sleep(0.3)
        print("leaving")
        """
    )
    assert (proc.stdout.strip(), proc.stderr) == ("leaving", "")


def test_keyboard_interrupt_reaches_a_waiting_consumer(run_python):
    proc = run_python(
        """
        import os, signal, threading, time, torch_stage
        def slow():
            while True:
                time.sleep(0.5)
                yield 1
        # Python ignores SIGINT when started with it ignored (a background job, nohup).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stage = torch_stage.staged(slow(), timeout_millis=60000)
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            for _ in stage:
                pass
        except KeyboardInterrupt:
            print("interrupted")
        """
    )
    assert proc.stdout.strip() == "interrupted"


def test_a_keyboard_interrupt_in_next_leaves_the_stage_running(run_python):
    # As with a plain generator interrupted in next(): the stage goes on,
    # and the loop may take the remaining items.
    proc = run_python(
        """
        import os, signal, threading, time, torch_stage
        def slow():
            for i in range(3):
                time.sleep(0.5)
                yield i
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stage = torch_stage.staged(slow(), num_threads=1)
        it = iter(stage)
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            next(it)
        except KeyboardInterrupt:
            print("interrupted", list(it))
        """
    )
    assert proc.stdout.strip() == "interrupted [0, 1, 2]"


# --- make_prefetch_hook -----------------------------------------------------


def counted(pulled, tag, n=100):
    for i in range(n):
        pulled.append((tag, i))
        yield i


def test_prefetch_hook_primes_earlier_and_new_stages_and_closes_only_its_own():
    pulled = []
    before = staged(counted(pulled, "before"), capacity=2)
    assert pulled == []  # lazily started
    with torch_stage.make_prefetch_hook():
        inside = staged(counted(pulled, "inside"), capacity=2)
        # Both were started and primed before the first take.
        assert ("before", 0) in pulled and ("inside", 0) in pulled
        assert before._impl.buffered() >= 1 and inside._impl.buffered() >= 1
        assert next(iter(before)) == 0
        # Tuned threads start with none: the hook's thread made the items.
        for stage in (before, inside):
            s = stage.stats()
            assert s["threads"] == 0 and s["inline_items"] >= 1, s
    # The hook owns what was made in its block; the earlier stage is the
    # code's that made it, and goes on.
    assert inside._impl.closed and not before._impl.closed
    assert list(before) == list(range(1, 100))


def test_nested_prefetch_hooks_close_only_the_stages_made_in_their_own_block():
    with torch_stage.make_prefetch_hook():
        outer = staged(range(50), capacity=2)
        with torch_stage.make_prefetch_hook():
            inner = staged(range(50), capacity=2)
            assert inner._impl.buffered() >= 1
        assert inner._impl.closed and not outer._impl.closed
        assert list(outer) == list(range(50))
    assert outer._impl.closed


def test_prefetch_hook_leaves_the_stages_of_other_threads_alone():
    pulled = []
    made = {}
    entered, done = threading.Event(), threading.Event()

    def elsewhere():
        made["before"] = staged(counted(pulled, "before"), capacity=2)
        entered.wait(HANG_BOUND_S)
        made["during"] = staged(counted(pulled, "during"), capacity=2)
        done.set()

    other = threading.Thread(target=elsewhere)
    other.start()
    try:
        while "before" not in made:
            time.sleep(0.001)
        with torch_stage.make_prefetch_hook():
            entered.set()
            assert done.wait(HANG_BOUND_S)
            mine = staged(range(10), capacity=2)
        other.join(HANG_BOUND_S)
        # Neither primed (not started: nothing pulled) nor closed.
        assert pulled == []
        for stage in made.values():
            assert not stage._impl.started and not stage._impl.closed
            assert list(stage) == list(range(100))
        assert mine._impl.closed
    finally:
        entered.set()
        other.join(HANG_BOUND_S)


def test_the_prefetch_hook_entered_after_a_default_stage_delivered_primes_it_at_once():
    # The stage makes its items in next() (no thread pays for range): the
    # hook's thread makes the next one, and the rest follow in order.
    stage = staged(range(100))
    it = iter(stage)
    assert [next(it), next(it)] == [0, 1]
    assert stage.stats()["threads"] == 0
    start = time.monotonic()
    with torch_stage.make_prefetch_hook():
        assert time.monotonic() - start < HANG_BOUND_S / 2
        assert list(it) == list(range(2, 100))


def test_a_primed_default_stage_over_a_slow_transform_gets_two_threads_at_once():
    def slow(x):
        time.sleep(0.004)
        return x

    stage = staged(range(300), transform=slow)
    with torch_stage.make_prefetch_hook():
        assert list(stage) == list(range(300))
        decisions = stage.stats()["tuning"]["decisions"]
    assert decisions[0].startswith("window 2: trying 2 threads"), decisions


def test_several_consumers_of_a_default_stage_get_threads():
    # Four consumers waiting at once add up four times the loop's time in
    # waits: still a loop that only gathers items, which threads serve.
    def slow(x):
        time.sleep(0.003)
        return x

    stage = staged(range(600), transform=slow, num_clients=4)
    got, lock = [], threading.Lock()

    def consume():
        for x in stage:
            with lock:
                got.append(x)

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_BOUND_S)
    assert sorted(got) == list(range(600))
    decisions = stage.stats()["tuning"]["decisions"]
    assert any(": trying 2 threads" in line for line in decisions), decisions


def test_prefetch_hook_primes_upstream_before_downstream():
    with torch_stage.make_prefetch_hook():
        read = staged(range(10), capacity=2, name="read")
        prep = staged(read, capacity=2, transform=lambda x: x + 100, name="prep")
        assert next(iter(prep)) == 100


# --- thread pools ---------------------------------------------------------------


def test_stage_thread_pool_names_threads_and_bounds_work():
    pool = torch_stage.add_stage_thread_pool(
        inter_op_threads=2, intra_op_threads=1, global_name="tsio"
    )
    active, peak, lock = [0], [0], threading.Lock()
    names, intra = set(), set()

    def work(x):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        names.add(open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip())
        intra.add(torch.get_num_threads())
        time.sleep(0.005)
        with lock:
            active[0] -= 1
        return x

    stages = [
        staged(
            range(30),
            num_threads=3,
            transform=work,
            use_stage_subgraph_thread_pool=True,
            stage_subgraph_thread_pool_id=pool,
            name=f"p{k}",
        )
        for k in range(2)
    ]
    results = [None, None]

    def consume(k):
        results[k] = drain(stages[k])

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_BOUND_S)
    assert results == [list(range(30))] * 2
    # Six producers across two stages, never more than two at work at once.
    assert 1 <= peak[0] <= 2
    assert all(n.startswith("tsio:p") for n in names), names
    assert intra == {1}


def test_thread_names_keep_the_stage_name_and_the_producer_id_within_linux_15_characters():
    # top -H, py-spy and gdb show the kernel's name, which Linux cuts at 15
    # characters: "torch_stage:augment_images:1" became "torch_stage:aug"
    # for every stage and every producer alike.
    names = set()

    def work(x):
        names.add(open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip())
        time.sleep(0.002)
        return x

    with staged(range(40), transform=work, num_threads=2, name="augment_images") as stage:
        assert list(stage) == list(range(40))
    with staged(range(4), transform=work, name="io", num_threads=1) as stage:
        assert list(stage) == list(range(4))
    assert names <= {"ts:augment_im:0", "ts:augment_im:1", "ts:io:0"}, names
    assert {"ts:augment_im:0", "ts:io:0"} <= names, names


@pytest.mark.parametrize("slots, prep_threads", [(1, 1), (2, 2), (2, 3)])
def test_a_stage_reading_another_of_its_pool_holds_no_slot_while_it_waits(slots, prep_threads):
    # prep's producers read from read, a stage of the same pool: a producer
    # waiting there for read's next item must not hold a slot read's own
    # producer needs to make it (with one slot, or two both held by prep,
    # nothing was ever delivered: a deadlock until timeout_millis).
    pool = torch_stage.add_stage_thread_pool(slots, 1, f"chain{slots}{prep_threads}")
    opts = dict(
        use_stage_subgraph_thread_pool=True,
        stage_subgraph_thread_pool_id=pool,
        timeout_millis=int(HANG_BOUND_S * 1000),
    )
    active, peak, lock = [0], [0], threading.Lock()

    def work(x):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.002)
        with lock:
            active[0] -= 1
        return x * 10

    for _ in range(3):
        read = staged(list(range(20)), num_threads=1, name="read", **opts)
        prep = staged(read, transform=work, num_threads=prep_threads, name="prep", **opts)
        assert drain(prep) == [x * 10 for x in range(20)]
        prep.close()
        read.close()
    # The pool still bounds the work: at most `slots` transforms at once.
    assert 1 <= peak[0] <= slots


def test_default_stage_threads_use_one_intra_op_thread_without_touching_others():
    main_threads = torch.get_num_threads()
    seen = drain(staged(range(3), transform=lambda x: torch.get_num_threads(), num_threads=1))
    assert seen == [1, 1, 1]
    assert torch.get_num_threads() == main_threads
    # Items the consumer makes itself (tuned threads start with none) run
    # with its own settings, as in a plain loop.
    seen = drain(staged(range(3), transform=lambda x: torch.get_num_threads()))
    assert seen == [main_threads] * 3
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [main_threads]


def test_pool_ids_count_from_zero_and_unknown_ids_are_errors():
    first = torch_stage.add_stage_thread_pool(1, 1, "ids_a")
    second = torch_stage.add_stage_thread_pool(1, 1, "ids_b")
    assert second == first + 1
    with pytest.raises(ValueError, match=f"stage_subgraph_thread_pool_id {second + 1} is unknown"):
        staged(
            range(3), use_stage_subgraph_thread_pool=True, stage_subgraph_thread_pool_id=second + 1
        )
    with pytest.raises(ValueError, match="already exists"):
        torch_stage.add_stage_thread_pool(1, 1, "ids_a")
    with pytest.raises(ValueError, match="inter_op_threads must be >= 1, got 0"):
        torch_stage.add_stage_thread_pool(0, 1, "ids_c")


# --- stats, drops, profiler ---------------------------------------------------------


def test_stats_say_input_bound_and_compute_bound():
    def slow_source():
        for i in range(15):
            time.sleep(0.01)
            yield i

    stage = staged(slow_source(), capacity=4)
    drain(stage)
    s = stage.stats()
    assert s["bound"] == "input"
    assert s["produced"] == s["consumed"] == 15

    stage = staged(range(15), capacity=4, num_threads=1)
    for _ in stage:
        time.sleep(0.01)
    s = stage.stats()
    assert s["bound"] == "compute"
    assert s["max_occupancy"] == 4 and s["mean_occupancy"] > 2

    # The consumer makes every item itself (no thread pays for a quick
    # source): no producer is ever blocked, and the rest of its loop is
    # what makes it compute-bound.
    stage = staged(range(15), capacity=4)
    for _ in stage:
        time.sleep(0.01)
    s = stage.stats()
    assert s["inline_items"] == 15 and s["threads"] == 0, s
    assert s["bound"] == "compute", s
    assert s["loop_s"] >= 14 * 0.01 and s["inline_s"] < s["loop_s"] / 3, s

    # The loop's time includes making its first item.
    def slow(x):
        time.sleep(0.05)
        return x

    stage = staged(range(3), transform=slow)
    drain(stage)
    s = stage.stats()
    assert s["bound"] == "input" and s["inline_s"] <= s["loop_s"], s
    for key in (
        "skipped",
        "dropped",
        "discarded",
        "consumer_wait_s",
        "producer_blocked_s",
        "transform_s",
        "copy_s",
        "gil_wait_s",
    ):
        assert key in s


def test_producers_never_drop_unless_asked():
    stage = staged(range(20), capacity=1)
    it = iter(stage)
    time.sleep(0.2)  # a slow consumer: producers wait, they do not drop
    assert list(it) == list(range(20))
    assert stage.stats()["dropped"] == 0


def test_opt_in_put_timeout_drops_counts_and_warns():
    stage = staged(range(50), capacity=1, put_timeout_millis=5, name="lossy", num_threads=1)
    it = iter(stage)
    with pytest.warns(RuntimeWarning, match="stage 'lossy' dropped item"):
        first = next(it)
        time.sleep(0.3)
        rest = list(it)
        gc.collect()
    got = [first, *rest]
    dropped = stage.stats()["dropped"]
    assert dropped > 0
    assert len(got) + dropped == 50
    assert got == sorted(got)


def test_close_counts_discarded_items():
    stage = staged(range(100), capacity=5, num_threads=1)
    it = iter(stage)
    next(it)
    deadline = time.monotonic() + HANG_BOUND_S
    while stage._impl.buffered() < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    stage.close()
    assert stage.stats()["discarded"] == 5


def test_profiler_shows_stage_ranges():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        drain(staged(range(5), name="profiled", transform=lambda x: x))
    names = {e.name for e in prof.events()}
    assert "torch_stage/profiled/pull" in names
    assert "torch_stage/profiled/process" in names


# --- device staging -------------------------------------------------------------------


def make_batch(i):
    return {
        "x": torch.randn(8, 16, generator=torch.Generator().manual_seed(i)),
        "y": torch.arange(8, dtype=torch.int64) + i,
        "mask": torch.ones(8, dtype=torch.bool).t(),
        "meta": {"id": i, "tags": ["a", "b"]},
        "view": torch.arange(20.0)[::2],
    }


@pytest.mark.parametrize("device", devices())
def test_device_staging_gives_the_cpu_results(device):
    stage = staged(
        (make_batch(i) for i in range(10)), device=device, capacity=3, stage_subgraph_stream_id=1
    )
    for i, batch in enumerate(stage):
        expected = make_batch(i)
        assert batch["meta"] == expected["meta"]
        for key in ("x", "y", "mask", "view"):
            assert batch[key].device.type == device
            assert batch[key].dtype == expected[key].dtype
            torch.testing.assert_close(batch[key].cpu(), expected[key], rtol=0, atol=0)
    assert stage.stats()["consumed"] == 10


@pytest.mark.cuda
def test_cuda_staging_fuses_tensors_and_reuses_pinned_buffers():
    stage = staged((make_batch(i) for i in range(50)), device="cuda", capacity=2)
    for batch in stage:
        # The fused tensors of one item share one device allocation.
        assert batch["x"].untyped_storage().data_ptr() == batch["y"].untyped_storage().data_ptr()
    s = stage.stats()
    assert s["staged_items"] == 50
    assert s["fused_tensors"] == 200
    assert s["pinned_buffer_reuses"] >= 40
    assert s["pinned_buffers"] <= 10


@pytest.mark.cuda
@pytest.mark.parametrize("threads", [1, 2])
def test_cuda_gathers_use_at_most_one_pinned_buffer_more_than_producers(threads):
    # The copies go on the consumer's stream (stream id 0) behind GPU sleep,
    # so copies are in flight when later gathers start: a gather then fills
    # another buffer, up to producers + 1 (one copied from, one filled per
    # producer), and only past that waits (the exact choices are the gtest
    # DeviceStager.AGatherTakesAnotherBufferWhileTheCopyBeforeRuns: on an
    # H200 the sleep ended early, most likely because making a pinned or
    # device buffer synchronizes the device, so how many buffers a run
    # makes is not fixed).
    items = [torch.full((4 << 20,), float(i)) for i in range(12)]  # 16 MB each
    stage = staged(
        iter(items), device="cuda", capacity=4, num_threads=threads, stage_subgraph_stream_id=0
    )
    torch.cuda._sleep(1 << 28)  # ~0.1 s on the stream the stage copies on
    for i, t in enumerate(stage):
        assert torch.equal(t.cpu(), items[i])
    s = stage.stats()
    assert s["staged_items"] == 12
    assert 1 <= s["pinned_buffers"] <= threads + 1
    assert s["pinned_buffers"] + s["pinned_buffer_reuses"] == 12
    assert s["pinned_buffer_waits"] <= s["pinned_buffer_reuses"]


@pytest.mark.cuda
def test_cuda_staging_sends_large_pinned_tensors_without_a_gather():
    # What a pin_memory=True loader hands over: pinned already. The large
    # pinned tensor is copied as it is; the small one and the pageable one
    # are gathered into one fused transfer.
    def item(i):
        return {
            "pinned": torch.full((1 << 20,), float(i)).pin_memory(),
            "small": torch.tensor([i]).pin_memory(),
            "pageable": torch.full((1 << 20,), -float(i)),
        }

    stage = staged((item(i) for i in range(20)), device="cuda", capacity=2)
    for i, batch in enumerate(stage):
        expected = item(i)
        for key, t in batch.items():
            assert t.device.type == "cuda"
            torch.testing.assert_close(t.cpu(), expected[key], rtol=0, atol=0)
        fused = batch["small"].untyped_storage().data_ptr()
        assert batch["pageable"].untyped_storage().data_ptr() == fused
        assert batch["pinned"].untyped_storage().data_ptr() != fused
    s = stage.stats()
    assert s["pinned_direct_copies"] == 20
    assert s["fused_tensors"] == 40
    assert s["staged_bytes"] >= 20 * 2 * 4 * (1 << 20)


def gpu_ms(fn):
    begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    done.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(done)


@pytest.mark.cuda
def test_cuda_copy_overlaps_compute_on_the_consumer_stream():
    n = 8
    # Pinned, as a pin_memory=True loader hands them over: each is copied as
    # it is, so the host has little to do and the copies over PCIe are what
    # the consumer's compute must hide. (Gathering pageable items costs the
    # host more than PCIe does, see benchmarks/device_staging.py: a step
    # would then wait for the host however the copies overlap.)
    items = [torch.randn(16_000_000).pin_memory() for _ in range(n)]  # 64 MB each
    copy_ms = gpu_ms(lambda: items[0].to("cuda", non_blocking=True))
    # The host side of staging an item, through a stage whose consumer only
    # takes, in case this machine's host is the slower side after all.
    start, host_ms = time.perf_counter(), []
    for _ in staged(iter(items), device="cuda", capacity=2, stage_subgraph_stream_id=1):
        host_ms.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
    host_ms = sorted(host_ms[1:])[(n - 1) // 2]  # the first one started the stage
    cycles = 10_000_000
    sleep_ms = gpu_ms(lambda: torch.cuda._sleep(cycles))
    # One step ~ 1.5 x the slower of the two per-item costs.
    cycles = max(1, int(cycles * 1.5 * max(copy_ms, host_ms) / sleep_ms))
    sleep_ms = gpu_ms(lambda: torch.cuda._sleep(cycles))

    def timed_pass():
        stage = staged(iter(items), device="cuda", capacity=2, stage_subgraph_stream_id=1)
        it = iter(stage)
        next(it)  # the pipeline is primed
        # The consumer stream's span over the remaining steps: sleeps, plus
        # any time it waited for copies that did not overlap with the sleeps.
        return gpu_ms(lambda: [torch.cuda._sleep(cycles) or x.sum() for x in it]), stage

    # Steady state: the host runs the whole loop ahead of the GPU, so no
    # item's device memory is free again before the loop ends, and a cold
    # caching allocator must cudaMalloc each one on the producer's thread.
    # On an H200 VM a single cold pass took 6 ms a step for 2.5 ms of sleep
    # and a 1.7 ms copy, more than the two in series, while the take-only
    # pass above (which frees each item in time) took 0.1 ms an item: the
    # likely cause is those allocations, not an unhidden copy. So a warm pass
    # first; the timed one reuses the blocks it freed.
    timed_pass()
    segments = torch.cuda.memory_stats()["segment.all.allocated"]
    span, stage = timed_pass()
    steps = n - 1
    serial = steps * (sleep_ms + copy_ms)
    assert span < steps * sleep_ms + 0.5 * steps * copy_ms, dict(
        span=span,
        sleep_ms=sleep_ms,
        copy_ms=copy_ms,
        host_ms=host_ms,
        serial=serial,
        # What the host did per item in the timed pass, and the cudaMallocs
        # it made (0 if the warm pass left enough blocks).
        staging_ms_per_item=stage.stats()["copy_s"] * 1000 / n,
        new_segments=torch.cuda.memory_stats()["segment.all.allocated"] - segments,
    )
    assert stage.stats()["pinned_direct_copies"] == n


@pytest.mark.cuda
def test_cuda_consumer_stream_waits_for_the_copy():
    side = torch.cuda.Stream()
    stage = staged(
        (torch.full((1 << 20,), float(i)) for i in range(20)),
        device="cuda",
        stage_subgraph_stream_id=2,
    )
    with torch.cuda.stream(side):
        for i, x in enumerate(stage):
            assert x.device.type == "cuda"
            assert x.sum().item() == float(i) * (1 << 20)


# --- resuming: state_dict / load_state_dict -------------------------------------


class Reiterable:
    """Not its own iterator: each iter() starts over."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class StatefulSource:
    """torchdata's Stateful protocol on an iterable (as StatefulDataLoader):
    iterating after load_state_dict() continues from the loaded state."""

    def __init__(self, n):
        self.n = n
        self.next = 0

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]

    def __iter__(self):
        while self.next < self.n:
            self.next += 1
            yield self.next - 1


class StatefulIterator(StatefulSource):
    """Stateful and its own iterator (as a torchdata node)."""

    def __iter__(self):
        return self

    def __next__(self):
        if self.next >= self.n:
            raise StopIteration
        self.next += 1
        return self.next - 1


class Flaky(Reiterable):
    """Re-iterable; its iterator raises KeyError at positions divisible by 7
    and goes on after."""

    def __iter__(self):
        return _FlakyIter(self.n)


class _FlakyIter:
    def __init__(self, n):
        self.i, self.n = 0, n

    def __iter__(self):
        return self

    def __next__(self):
        i = self.i
        if i >= self.n:
            raise StopIteration
        self.i += 1
        if i % 7 == 3:
            raise KeyError(i)
        return i


N_ITEMS = 60
RESUMABLE = {
    "list": lambda: list(range(N_ITEMS)),
    "reiterable": lambda: Reiterable(N_ITEMS),
    "stateful": lambda: StatefulSource(N_ITEMS),
    "stateful_iterator": lambda: StatefulIterator(N_ITEMS),
    "stage": lambda: staged(list(range(N_ITEMS)), capacity=3, name="inner"),
    "flaky": lambda: Flaky(N_ITEMS),
}


def make_resumable(kind, num_threads):
    return staged(
        RESUMABLE[kind](),
        num_threads=num_threads,
        capacity=4,
        transform=lambda x: (jittery(x), x * 10),
        ignored_exception_types=(KeyError,),
    )


def wait_for_buffered(stage):
    deadline = time.monotonic() + HANG_BOUND_S
    while stage._impl.buffered() == 0 and not stage._impl.finished:
        assert time.monotonic() < deadline
        time.sleep(0.001)


@pytest.mark.parametrize("num_threads", [1, 4])
@pytest.mark.parametrize("kind", sorted(RESUMABLE))
def test_resume_at_random_cuts_yields_exactly_the_rest(tmp_path, kind, num_threads):
    full = drain(make_resumable(kind, num_threads))
    want = [(x, 10 * x) for x in range(N_ITEMS) if kind != "flaky" or x % 7 != 3]
    assert full == want
    rng = random.Random(14)
    cuts = sorted(rng.sample(range(len(full) + 1), 20))
    buffered_at_cut = 0
    for cut in cuts:
        stage = make_resumable(kind, num_threads)
        stage.start()
        it = iter(stage)
        head = [next(it) for _ in range(cut)]
        wait_for_buffered(stage)  # items produced ahead sit in the buffer
        buffered_at_cut += stage._impl.buffered()
        path = tmp_path / f"stage-{cut}.pt"
        torch.save(stage.state_dict(), path)
        stage.close()
        resumed = make_resumable(kind, num_threads)
        resumed.load_state_dict(torch.load(path))
        assert head + drain(resumed) == full, f"cut at {cut}"
    assert buffered_at_cut > 0


@pytest.mark.parametrize("kind", ["list", "stateful", "stage"])
def test_a_resumed_stage_saves_and_resumes_again(kind):
    stage = make_resumable(kind, 4)
    got = [next(iter(stage)) for _ in range(11)]
    state = stage.state_dict()
    stage.close()
    for cut in (0, 17, 5):
        stage = make_resumable(kind, 4)
        stage.load_state_dict(state)
        it = iter(stage)
        got += [next(it) for _ in range(cut)]
        state = stage.state_dict()
        stage.close()
    stage = make_resumable(kind, 4)
    stage.load_state_dict(state)
    assert got + drain(stage) == [(x, 10 * x) for x in range(N_ITEMS)]


@pytest.mark.parametrize("num_threads", [1, 4])
def test_a_torch_stage_dataloader_is_a_stateful_source(tmp_path, num_threads):
    # Shuffled: only its own state (sampler generator included) resumes it.
    def make():
        loader = torch_stage.DataLoader(
            list(range(40)),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
        )
        return staged(loader, num_threads=num_threads, capacity=3)

    full = [b.tolist() for b in make()]
    assert sorted(x for b in full for x in b) == list(range(40))
    for cut in (0, 3, 9, 10):
        stage = make()
        it = iter(stage)
        head = [next(it).tolist() for _ in range(cut)]
        torch.save(stage.state_dict(), tmp_path / "state.pt")
        stage.close()
        resumed = make()
        resumed.load_state_dict(torch.load(tmp_path / "state.pt"))
        assert head + [b.tolist() for b in resumed] == full, f"cut at {cut}"


def test_the_state_of_a_finished_stage_resumes_to_nothing():
    stage = make_resumable("list", 2)
    assert len(drain(stage)) == N_ITEMS
    state = stage.state_dict()
    assert state["position"] == N_ITEMS and state["version"] == 1
    resumed = make_resumable("list", 2)
    resumed.load_state_dict(state)
    assert drain(resumed) == []


def test_resume_bad_use_is_a_clear_error():
    started = staged([1, 2, 3])
    state = started.state_dict()
    next(iter(started))
    with pytest.raises(RuntimeError, match="after it started"):
        started.load_state_dict(state)
    started.close()
    with pytest.raises(RuntimeError, match="after it was closed"):
        started.load_state_dict(state)

    for source in ((x for x in range(3)), iter([1, 2]), lambda: 1):
        stage = staged(source)
        with pytest.raises(
            TypeError, match=r"cannot be resumed: its source \(a .*\) is a callable or a one"
        ):
            stage.state_dict()
        with pytest.raises(TypeError, match="cannot be resumed"):
            stage.load_state_dict(state)
        stage.close()
    over_generator = staged(x for x in range(3))
    with pytest.raises(TypeError, match="cannot be resumed"):
        staged(over_generator).state_dict()
    over_generator.close()

    fresh = staged([1, 2, 3])
    with pytest.raises(ValueError, match="reads state version 1, the state has version 2"):
        fresh.load_state_dict(dict(state, version=2))
    with pytest.raises(ValueError, match="not a torch_stage.Stage state"):
        fresh.load_state_dict({"consumed": 3})
    with pytest.raises(ValueError, match="saved over a 'iterable' source.*'stateful'"):
        staged(StatefulSource(3)).load_state_dict(state)
    with pytest.raises(ValueError, match="position must be an int >= 0, got -1"):
        fresh.load_state_dict(dict(state, position=-1))
    with pytest.raises(ValueError, match="ordered=False"):
        staged([1, 2], num_threads=2, ordered=False).state_dict()
    # One thread delivers in order even when unordered.
    assert staged([1, 2], num_threads=1, ordered=False).state_dict()["position"] == 0


def test_describe_does_not_claim_a_measurement_before_any():
    # Auto-tuned, starting with no thread: none is started before a trial.
    with staged(forever(), capacity=2) as stage:
        next(iter(stage))
        text = stage._impl.describe()
        assert stage.stats()["tuning"]["windows"] == 0, stage.stats()["tuning"]
    assert "producer 1: not started (it starts with the stage, or when auto-tuning" in text
    assert "measured" not in text


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"capacity": 0}, ValueError, r"capacity must be >= 1 \(or None: auto-tuned\), got 0"),
        (
            {"num_threads": 0},
            ValueError,
            r"num_threads must be >= 1 \(or None: auto-tuned\), got 0",
        ),
        (
            # Each producer thread holds an item it is making; tens of
            # thousands started before the kernel refused (seconds, GBs).
            {"num_threads": 1025},
            ValueError,
            r"num_threads must be >= 1 \(or None: auto-tuned\) and at most 1024, got 1025",
        ),
        ({"num_clients": -1}, ValueError, "num_clients must be >= 1, got -1"),
        ({"timeout_millis": 0}, ValueError, r"timeout_millis must be > 0 \(or None\), got 0"),
        ({"timeout_millis": 1.5}, TypeError, "timeout_millis must be an int"),
        ({"closed_exception_types": (StopIteration, int)}, TypeError, "exception classes only"),
        ({"ignored_exception_types": ("KeyError",)}, TypeError, "exception classes only"),
        ({"stage_subgraph_stream_id": 32}, ValueError, r"in \[0, 32\)"),
        ({"stage_subgraph_stream_id": -1}, ValueError, "got -1"),
        (
            {"use_stage_subgraph_thread_pool": True, "stage_subgraph_thread_pool_id": 999},
            ValueError,
            "999 is unknown",
        ),
        ({"device": "cuda:7"}, ValueError, "does not exist"),
        ({"device": "nonsense"}, ValueError, "is not a device"),
        ({"transform": 3}, TypeError, "transform must be callable"),
        ({"put_timeout_millis": 0}, ValueError, "put_timeout_millis must be >= 1"),
        ({"name": ""}, ValueError, "name must be a non-empty str, got ''"),
        ({"name": 3}, TypeError, r"name must be a str \(or None\), got int"),
        ({"ordered": "no"}, TypeError, "ordered must be a bool, got 'no'"),
        (
            {"device": "meta"},
            ValueError,
            r"device 'meta' is not one to stage to: its type must be 'cpu'( or '\w+')? "
            r"\(the CPU, or this machine's accelerator\), got 'meta'",
        ),
    ],
)
def test_bad_arguments_fail_before_any_thread_starts(kwargs, error, text):
    before = thread_count()
    with pytest.raises(error, match=text):
        staged(range(3), **kwargs)
    assert thread_count() == before


def test_bad_sources():
    with pytest.raises(TypeError, match="source must be an iterable, an iterator or a callable"):
        staged(42)
    with pytest.raises(TypeError, match="source must be callable"):
        staged(range(3), feed_dict={"a": 1})
    with pytest.raises(TypeError, match="feed_dict must be a dict"):
        staged(lambda: 1, feed_dict={1: 2})


# --- auto-tuning ------------------------------------------------------------------------------


def test_autotune_tunes_what_is_left_as_none():
    with staged(range(10)) as stage:
        assert list(stage) == list(range(10))
        s = stage.stats()
        assert s["tuning"] is not None and s["tuning"]["windows"] >= 0
        assert s["capacity"] >= 2 and 0 <= s["threads"] <= torch_stage.staging.stage._usable_cores()
    with staged(range(10), capacity=3, num_threads=2) as stage:
        assert list(stage) == list(range(10))
        s = stage.stats()
        assert (s["tuning"], s["capacity"], s["threads"]) == (None, 3, 2)
    with staged(range(10), autotune=False) as stage:
        assert list(stage) == list(range(10))
        s = stage.stats()
        assert (s["tuning"], s["capacity"], s["threads"]) == (None, 1, 1)
    with pytest.raises(TypeError, match="autotune must be a bool, got 'yes'"):
        staged(range(3), autotune="yes")


def test_autotune_may_park_every_thread_and_the_consumer_makes_the_items():
    # Where no thread pays (a step that needs every core), staged() may end
    # up as a plain loop: the consumer makes each item in next(), in order,
    # errors at their positions. What the tuner decides from timings is
    # what limit_threads() says here, without them.
    def source():
        yield from range(5)
        raise ValueError("item 5 is bad")

    with staged(source()) as stage:
        it = iter(stage)
        assert next(it) == 0
        stage._impl.limit_threads(0, "the test says none pays")
        deadline = time.monotonic() + HANG_BOUND_S
        while stage.stats()["threads"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stage.stats()["threads"] == 0
        taken = [next(it) for _ in range(4)]
        with pytest.raises(ValueError, match="item 5 is bad"):
            next(it)
        s = stage.stats()
    assert taken == [1, 2, 3, 4]
    assert s["inline_items"] >= 1  # what was not staged before the limit
    assert "the test says none pays" in "\n".join(s["tuning"]["decisions"])


def test_autotune_adds_threads_for_a_slow_transform():
    # time.sleep releases the GIL, as I/O does: n threads make n items at
    # once whatever the machine's load. The consumer does nothing, so it
    # waits, and every thread added pays.
    cores = torch_stage.staging.stage._usable_cores()

    def slow(x):
        time.sleep(0.004)
        return x

    with staged(range(400), transform=slow) as stage:
        assert list(stage) == list(range(400))
        s = stage.stats()
    assert s["threads"] == min(cores, 4) or s["threads"] >= 2, s["tuning"]
    if cores >= 2:
        assert any("kept 2 threads" in line for line in s["tuning"]["decisions"]), s["tuning"]


def test_autotune_keeps_capacity_within_the_memory_budget(monkeypatch):
    # Items of 1 MiB and a budget of 3 MiB (1/16 of the "machine"): the
    # capacity may grow to 3 items, not to the usual 16.
    monkeypatch.setattr(torch_stage.staging.stage, "_memory_bytes", lambda: 3 << 24)
    items = (torch.zeros(1 << 18) for _ in range(50))  # 1 MiB each
    with staged(items, num_threads=1) as stage:
        assert sum(1 for _ in stage) == 50
        s = stage.stats()
    assert s["tuning"]["max_capacity"] == 3 and s["max_occupancy"] <= 3, s
    monkeypatch.undo()  # the machine's own memory: the usual bound
    with staged((torch.zeros(1 << 18) for _ in range(50)), num_threads=1) as stage:
        assert sum(1 for _ in stage) == 50
        assert stage.stats()["tuning"]["max_capacity"] == 16


def test_no_thread_setting_never_deadlocks_with_a_producer_in_the_source(run_python):
    # The setting changes after every item, between the consumer making
    # items itself and producer threads. A producer inside the source holds
    # the source lock and, after time.sleep, waits for the GIL: the consumer
    # must not wait for that lock while holding the GIL (its first, quick
    # attempt at each next() holds it). A deadlock holds the GIL, so it runs
    # in a process of its own, bounded.
    proc = run_python(
        """
        import time
        import torch_stage, torch_stage.staging.stage

        torch_stage.staging.stage._TUNE_WINDOW = (1, 0)
        torch_stage.staging.stage._TUNE_EXPLORE_SHARE = 0

        def source():
            for i in range(3000):
                time.sleep(0.0002)
                yield i

        with torch_stage.staged(source(), _min_threads=0) as stage:
            got = list(stage)
            assert got == list(range(3000)), got[:20]
            print("inline", stage.stats()["inline_items"])
        """,
        timeout=120,
    )
    assert int(proc.stdout.split()[-1]) > 0, proc.stdout  # the setting did change


def test_a_producer_keeps_its_python_thread_state_until_it_ends():
    # As in a thread Python made, a transform's threading.local() values
    # last as long as its producer thread (a per-thread cache or handle is
    # made once per thread, not once per item) and go with the thread.
    local = threading.local()
    made, freed = [], []

    class Cache:
        pass

    def transform(x):
        if not hasattr(local, "cache"):
            local.cache = Cache()
            weakref.finalize(local.cache, freed.append, threading.get_ident())
            made.append(threading.get_ident())
        return x

    with staged(range(300), transform=transform, num_threads=2, capacity=2) as stage:
        assert list(stage) == list(range(300))
        assert 1 <= len(made) <= 2, f"{len(made)} caches for 300 items"
    # close() joined the producers: their states, and the caches, are gone.
    assert sorted(freed) == sorted(made), (made, freed)


def test_autotune_makes_at_most_eight_threads(monkeypatch):
    monkeypatch.setattr(torch_stage.staging.stage, "_usable_cores", lambda: 64)
    with staged(range(5)) as stage:
        assert list(stage) == list(range(5))
        text = stage.describe()
    assert "producer 7:" in text and "producer 8:" not in text, text


def test_integers_from_numpy_are_ints():
    # Configs often hold numpy integers (np.arange, a pandas column, a
    # sweep); Python's own int checks take any integral type, and so does
    # the plain DataLoader's num_workers.
    np = pytest.importorskip("numpy")
    counts = dict(num_threads=np.int64(2), capacity=np.int32(3), timeout_millis=np.int64(5000))
    with torch_stage.staged(list(range(10)), **counts) as stage:
        assert sorted(stage) == list(range(10))
    with pytest.raises(TypeError, match=r"capacity must be an int, got bool"):
        torch_stage.staged(list(range(3)), capacity=np.bool_(True))
    area = torch_stage.StagingArea(np.int64(2))
    assert area.capacity() == 2
