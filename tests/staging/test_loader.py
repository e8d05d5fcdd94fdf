"""torch_stage.DataLoader: a drop-in torch.utils.data.DataLoader with staging."""

import random
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from conftest import devices

import torch_stage
from torch_stage.staging import loader as _loader


class Squares(tud.Dataset):
    """Items carry a random draw so that worker seeding shows in the data."""

    def __init__(self, n=40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": torch.tensor(i), "x": torch.full((3,), float(i * i)), "r": torch.rand(1)}


class Counting(tud.IterableDataset):
    def __init__(self, n=30):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n).split(1))


def batches(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k].cpu(), y[k].cpu(), rtol=0, atol=0)


def pair(seed=0, **kwargs):
    """A torch_stage.DataLoader and a plain one with identical settings."""
    ours = torch_stage.DataLoader(
        Squares(), generator=torch.Generator().manual_seed(seed), **kwargs
    )
    plain_kwargs = {
        k: v for k, v in kwargs.items() if k not in ("capacity", "num_threads", "device")
    }
    plain = tud.DataLoader(Squares(), generator=torch.Generator().manual_seed(seed), **plain_kwargs)
    return ours, plain


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_batches_as_the_plain_dataloader(num_workers, shuffle):
    ours, plain = pair(batch_size=6, shuffle=shuffle, num_workers=num_workers, capacity=3)
    assert len(ours) == len(plain) == 7
    torch.manual_seed(1)
    a = batches(ours)
    torch.manual_seed(1)
    b = batches(plain)
    assert_same(a, b)


def test_drop_last_collate_fn_and_worker_init_fn():
    seen = []

    def collate(items):
        return {"sum": torch.stack([it["x"] for it in items]).sum(0)}

    ours = torch_stage.DataLoader(
        Squares(),
        batch_size=7,
        drop_last=True,
        collate_fn=collate,
        num_workers=1,
        worker_init_fn=lambda wid: seen.append(wid),
    )
    out = list(ours)
    assert len(out) == len(ours) == 5
    expected = sum(float(i * i) for i in range(7))
    assert out[0]["sum"].tolist() == [expected] * 3


def test_persistent_workers_over_two_epochs():
    ours, plain = pair(batch_size=5, shuffle=True, num_workers=2, persistent_workers=True)
    torch.manual_seed(3)
    a = [batches(ours), batches(ours)]
    torch.manual_seed(3)
    b = [batches(plain), batches(plain)]
    for x, y in zip(a, b):
        assert_same(x, y)


def test_distributed_sampler_set_epoch_reaches_the_sampler():
    ds = Squares(40)
    ours_sampler = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=7)
    plain_sampler = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=7)
    ours = torch_stage.DataLoader(ds, batch_size=4, sampler=ours_sampler)
    plain = tud.DataLoader(ds, batch_size=4, sampler=plain_sampler)
    assert ours.sampler is ours_sampler
    orders = []
    for epoch in (0, 5):
        ours.sampler.set_epoch(epoch)
        plain.sampler.set_epoch(epoch)
        a = [b["i"].tolist() for b in ours]
        b = [b["i"].tolist() for b in plain]
        assert a == b
        orders.append(a)
    assert orders[0] != orders[1]  # the epoch reached the sampler


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_repeats_and_skips_nothing(num_workers):
    def make():
        return torch_stage.DataLoader(
            Squares(), batch_size=3, shuffle=True, num_workers=num_workers, capacity=4
        )

    torch.manual_seed(11)
    full = batches(make())

    torch.manual_seed(11)
    loader = make()
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    # More batches are staged than were consumed; they must not count.
    state = loader.state_dict()
    assert state["consumed"] == 5
    # Its producers read ahead, drawing from the global RNG; stop them before
    # another loader restores that RNG in this process.
    loader.close()

    torch.manual_seed(999)  # the resumed run may be anywhere else
    resumed = make()
    resumed.load_state_dict(state)
    rest = batches(resumed)
    # The same items in the same order: none repeated, none skipped. (Random
    # augmentation draws after the resume point differ: the skipped batches
    # are never loaded, so they do not advance the RNG.)
    assert [b["i"].tolist() for b in first + rest] == [b["i"].tolist() for b in full]
    assert_same([{"x": b["x"]} for b in first + rest], [{"x": b["x"]} for b in full])
    assert resumed.state_dict() == {"version": 1, "in_epoch": False}


def test_resume_an_iterable_dataset():
    loader = torch_stage.DataLoader(Counting(30), batch_size=4, capacity=3)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    other = torch_stage.DataLoader(Counting(30), batch_size=4)
    other.load_state_dict(state)
    rest = [b.tolist() for b in other]
    assert head + rest == [b.tolist() for b in tud.DataLoader(Counting(30), batch_size=4)]


def test_dropping_the_iterator_closes_its_stage():
    loader = torch_stage.DataLoader(Squares(), batch_size=2, capacity=4)
    it = iter(loader)
    next(it)
    stage = it._stage
    del it
    assert stage._impl.closed
    assert len(list(loader)) == len(loader)


def test_a_new_epoch_with_persistent_workers_closes_the_previous_stage():
    # Both epochs read the same worker processes.
    loader = torch_stage.DataLoader(
        Squares(), batch_size=2, capacity=4, num_workers=1, persistent_workers=True
    )
    it = iter(loader)
    next(it)
    first_stage = it._stage
    assert len(list(loader)) == len(loader)
    assert first_stage._impl.closed


@pytest.mark.parametrize("device", devices())
def test_batches_arrive_on_the_device(device):
    ours, plain = pair(batch_size=4, num_workers=0, device=device, capacity=2)
    torch.manual_seed(0)
    a = list(ours)
    torch.manual_seed(0)
    b = batches(plain)
    for batch in a:
        assert all(v.device.type == device for v in batch.values())
    assert_same(a, b)
    assert ours.stats()["consumed"] == len(ours)


LOADERS = [
    pytest.param(tud.DataLoader, id="plain"),
    pytest.param(torch_stage.DataLoader, id="torch_stage"),
]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cls", LOADERS)
def test_a_prefetch_hook_inside_an_epoch_leaves_the_loader_alone(cls, num_workers):
    # A validation pass staged under its own hook, in the middle of a
    # training epoch: the hook owns the validation stage only.
    train = cls(
        list(range(20)), batch_size=4, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    got = []
    for step, batch in enumerate(train):
        got.append(batch.tolist())
        if step == 1:
            with torch_stage.make_prefetch_hook():
                assert len(list(torch_stage.staged([torch.ones(2)] * 3))) == 3
    assert got == [list(range(i, i + 4)) for i in range(0, 20, 4)]
    assert len(list(train)) == 5


class Recorded(tud.Dataset):
    def __init__(self):
        self.read = []

    def __len__(self):
        return 8

    def __getitem__(self, i):
        self.read.append(i)
        return i


@pytest.mark.parametrize("cls", LOADERS)
def test_a_loader_iterated_inside_a_prefetch_hook_is_not_primed_by_it(cls):
    # As with the plain class, the first batch is made in the first next();
    # the loader's stage is its iterator's, never the hook's.
    dataset = Recorded()
    with torch_stage.make_prefetch_hook():
        loader = cls(dataset, batch_size=2)
        it = iter(loader)
        assert dataset.read == []
        assert next(it).tolist() == [0, 1]
    assert [b.tolist() for b in it] == [[2, 3], [4, 5], [6, 7]]


def test_bad_staging_arguments_fail_at_construction():
    with pytest.raises(ValueError, match=r"capacity must be >= 1 \(or None: auto-tuned\), got 0"):
        torch_stage.DataLoader(Squares(), capacity=0)
    with pytest.raises(ValueError, match="does not exist"):
        torch_stage.DataLoader(Squares(), device="cuda:9")
    with pytest.raises(ValueError, match="name must be a non-empty str, got ''"):
        torch_stage.DataLoader(Squares(), name="")
    with pytest.raises(ValueError, match="num_workers"):
        torch_stage.DataLoader(Squares(), num_workers=-1)
    with pytest.raises(ValueError, match="not a torch_stage.DataLoader state"):
        torch_stage.DataLoader(Squares()).load_state_dict({"consumed": 3})


@pytest.mark.parametrize(
    "key, value, error, text",
    [
        ("capacity", 0, ValueError, r"capacity must be >= 1 \(or None: auto-tuned\), got 0"),
        ("num_threads", 0, ValueError, "num_threads must be >= 1"),
        ("autotune", "yes", TypeError, "autotune must be a bool, got 'yes'"),
        ("timeout_millis", 0, ValueError, r"timeout_millis must be > 0 \(or None\), got 0"),
        ("stage_subgraph_stream_id", -1, ValueError, "stage_subgraph_stream_id must be in"),
        ("transform", 3, TypeError, "transform must be callable"),
        ("device", "cuda:9", ValueError, "does not exist"),
        ("name", 3, TypeError, r"name must be a str \(or None\), got int"),
        ("name", "", ValueError, "name must be a non-empty str, got ''"),
    ],
)
def test_a_bad_staging_option_fails_at_assignment(key, value, error, text):
    # Not at the next iter(), far from the line that set it.
    loader = torch_stage.DataLoader(Squares(), batch_size=4)
    before = getattr(loader, key)
    with pytest.raises(error, match=text):
        setattr(loader, key, value)
    assert getattr(loader, key) == before
    assert len(list(loader)) == len(loader)


def test_a_good_staging_option_set_after_construction_stages():
    loader = torch_stage.DataLoader(Squares(), batch_size=4)
    loader.capacity, loader.num_threads, loader.name = 3, 2, None
    assert len(list(loader)) == len(loader)
    assert loader.stats()["capacity"] == 3 and loader.stats()["threads"] == 2


def test_is_a_torch_dataloader():
    loader = torch_stage.DataLoader(Squares(), batch_size=8)
    assert isinstance(loader, tud.DataLoader)
    assert loader.batch_size == 8


def test_torchscript_still_compiles_warnings_after_a_loader_ran(run_python):
    # The loader wraps warnings.warn to carry a batch's warnings to next();
    # TorchScript compiles warnings.warn by identity (F.embedding_bag calls
    # it), so scripting after a loader ran once tried to compile the wrapper.
    run_python(
        """
        import torch, torch_stage
        assert list(torch_stage.DataLoader(list(range(4)), batch_size=2))
        bag = torch.jit.script(torch.nn.EmbeddingBag(10, 3, mode="sum"))
        bag(torch.tensor([1, 2, 3]), torch.tensor([0]))
        """
    )


def _busy(seconds: float) -> None:
    """Pure Python work: holds the GIL throughout."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class SlowOffTheLoop(torch.utils.data.Dataset):
    """Items that take 0.5 ms in the training loop's thread and 4 ms on any
    other (as a source a thread cannot help: one behind a lock the loop
    holds, or one that fights the loop for its core)."""

    def __len__(self):
        return 1200

    def __getitem__(self, i):
        if threading.current_thread() is threading.main_thread():
            _busy(0.0005)
        else:
            time.sleep(0.004)
        return i


def test_autotune_makes_batches_in_the_loop_when_a_thread_does_not_pay():
    # Made in next() a step costs 1.5 ms; with a staging thread 4 ms. The
    # tuner starts in the loop (the plain DataLoader's way), tries a thread,
    # measures it slower, and comes back, trying again less and less often.
    loader = torch_stage.DataLoader(SlowOffTheLoop(), batch_size=1)
    seen = []
    for batch in loader:
        seen.extend(batch.tolist())
        _busy(0.001)
    assert seen == list(range(1200))
    s = loader.stats()
    assert s["tuning"]["trials"] >= 1, s["tuning"]
    # Settled without a thread (a trial may be under way as the epoch ends).
    assert loader._tuning_memory["threads"] == 0, s["tuning"]
    assert s["inline_items"] >= 500, s["tuning"]
    decisions = s["tuning"]["decisions"]
    assert any("back to no producer thread" in line for line in decisions)
    # Made in the loop, a batch is CPU work (busy Python): a thread would
    # need a core, so its trial waits until it is a twentieth of the run.
    assert "on its CPU: a thread would need a core" in decisions[0], decisions
    first_trial = next(line for line in decisions if ": trying " in line)
    assert int(first_trial.split()[1].rstrip(":")) >= 20, decisions


class RandomCrops(torch.utils.data.Dataset):
    """A read that waits (a thread would pay: its trial comes at once) and
    an augmentation that draws from a global generator, as torchvision's
    RandomCrop and RandomHorizontalFlip do from torch's."""

    def __init__(self, draw):
        self.draw = draw

    def __len__(self):
        return 240

    def __getitem__(self, i):
        time.sleep(0.002)
        return i * 1000 + self.draw()


_DRAWS = {
    "torch": lambda: int(torch.randint(0, 1000, ())),
    "random": lambda: random.randrange(1000),
    "numpy": lambda: int(np.random.randint(1000)),
}


def _seeded_run(loader_class, draw, **kwargs):
    """A training loop that draws too (dropout on the CPU), seeded: the
    batches and the loop's draws, in order."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    loader = loader_class(RandomCrops(draw), batch_size=2, **kwargs)
    seen = []
    for batch in loader:
        time.sleep(0.003)  # the step, which a staging thread overlaps
        seen.append((batch.tolist(), draw()))
    return loader, seen


@pytest.mark.parametrize("generator", list(_DRAWS))
def test_a_seeded_run_whose_dataset_and_loop_draw_from_one_generator_repeats(generator):
    # The plain DataLoader makes each batch in next(): the dataset's draws and
    # the loop's take turns, and a seeded run repeats. A staging thread would
    # make batches while the loop draws, in an order left to timing; the
    # tuner, told so, keeps batches in the loop, so the run is the plain
    # class's, draw for draw.
    draw = _DRAWS[generator]
    _, plain = _seeded_run(torch.utils.data.DataLoader, draw)
    loader, ours = _seeded_run(torch_stage.DataLoader, draw)
    assert ours == plain
    s = loader.stats()
    assert s["threads"] == 0 and s["tuning"]["trials"] == 0, s["tuning"]
    assert s["inline_items"] >= len(plain) - 1, s
    reason = "no staging thread: the batches' making and the training loop both draw"
    assert any(reason in line for line in s["tuning"]["decisions"]), s["tuning"]
    # The next epoch starts with the limit.
    for _ in loader:
        time.sleep(0.003)
        draw()
    s = loader.stats()
    assert s["tuning"]["trials"] == 0 and s["inline_items"] >= len(plain) - 1, s["tuning"]
    assert reason in s["tuning"]["decisions"][-1], s["tuning"]


def _two_batches_watched_by_the_stage(draw):
    """A loader whose dataset draws with ``draw``, two batches in, made in
    the loop under the stage's watch, which saw the dataset draw."""
    loader = torch_stage.DataLoader(RandomCrops(draw), batch_size=2)
    it = iter(loader)
    next(it)
    next(it)
    impl = it._own_impl
    assert impl.watch_state() == (0, 1, False)  # the dataset drew
    return loader, it, impl


def test_a_call_that_finds_a_producer_at_work_puts_nothing_on_the_loop_and_hands_over(
    monkeypatch,
):
    # Since the stage watch's last reading, a producer at work (begin_own_item
    # false) may have drawn: the interval tells nothing, so the call reads
    # nothing; the Python watch, which sees where batches are made, takes
    # over and finds the loop's draws from there. (Before, the call read
    # first and put such a producer's draws on the loop.)
    draw = _DRAWS["torch"]
    loader, it, impl = _two_batches_watched_by_the_stage(draw)
    assert it._watch_signal == bytearray(1)  # its news taken
    draw()  # the loop, or a producer: the next call cannot tell which
    real = _loader._own_next

    def producer_at_work(stage, iterator):
        monkeypatch.setattr(_loader, "_own_next", real)
        assert stage.begin_own_item()  # as a producer's item would
        try:
            assert real(stage, iterator) is stage
            assert it._watch_signal == bytearray(1)  # nothing read
            return stage
        finally:
            stage.end_own_item(False)

    monkeypatch.setattr(_loader, "_own_next", producer_at_work)
    next(it)
    assert not it._own_watch  # the Python watch took over
    assert impl.watch_state()[0] == 0
    reason = "no staging thread: the batches' making and the training loop both draw"
    assert not any(reason in line for line in loader.stats()["tuning"]["decisions"])
    for _ in range(3):
        draw()  # the loop draws
        next(it)
    assert any(reason in line for line in loader.stats()["tuning"]["decisions"])
    with pytest.raises(TypeError, match="signal must be a bytearray"):
        impl.watch_generators(_loader._watch_reader(), b"x")


def test_a_pull_of_the_stage_between_two_batches_of_the_loop_is_not_the_loops_draw():
    # A producer the tuner starts as the loop's batch ends may pull, and
    # draw, before the loop's next batch; so may a take(). The stage's watch
    # read the generators at the next batch's start and put that draw on
    # the loop: a loop that draws nothing lost staging for good at the
    # tuner's first trial.
    draw = _DRAWS["torch"]
    _, it, impl = _two_batches_watched_by_the_stage(draw)
    impl.next()  # a take: the stage pulls a batch, which draws
    next(it)
    assert impl.watch_state() == (0, 1, False)  # not the loop
    draw()  # the loop draws: found, as ever
    next(it)
    assert impl.watch_state() == (1, 1, False)


@pytest.mark.parametrize("generator", list(_DRAWS))
def test_the_stage_watches_the_generators_of_batches_made_in_the_loop(generator):
    # The readings for batches the loop makes are the stage's own-item
    # calls' (no call of their own): they find the loop's draws and the
    # dataset's apart.
    draw = _DRAWS[generator]
    bit = 1 << list(_DRAWS).index(generator)
    loader = torch_stage.DataLoader(RandomCrops(draw), batch_size=2)
    it = iter(loader)
    next(it)
    assert it._own_watch
    assert it._own_impl.watch_state() == (0, 0, False)
    next(it)
    assert it._own_impl.watch_state() == (0, bit, False)  # the dataset drew
    draw()
    next(it)
    assert it._own_impl.watch_state() == (bit, bit, False)  # and the loop
    reason = "no staging thread: the batches' making and the training loop both draw"
    assert any(reason in line for line in loader.stats()["tuning"]["decisions"])
    for _ in range(_loader._WATCHED_BATCHES):
        next(it)
    assert not it._own_watch  # the watch is over


def test_a_stage_watch_made_before_numpy_was_imported_hands_over(monkeypatch):
    monkeypatch.delitem(sys.modules, "numpy")
    monkeypatch.setattr(_loader, "_fingerprints", None)
    loader = torch_stage.DataLoader(RandomCrops(_DRAWS["numpy"]), batch_size=2)
    it = iter(loader)
    next(it)
    assert it._own_watch
    monkeypatch.setitem(sys.modules, "numpy", np)
    next(it)
    assert not it._own_watch  # stale: the Python watch, with a new reader
    for _ in it:
        time.sleep(0.003)
        np.random.randint(1000)
    reason = "no staging thread: the batches' making and the training loop both draw from NumPy"
    assert any(reason in line for line in loader.stats()["tuning"]["decisions"])


@pytest.mark.parametrize("generator", list(_DRAWS))
def test_the_watch_reads_the_generators_with_their_getters_where_their_layout_is_unknown(
    generator, monkeypatch
):
    # Another interpreter or NumPy: the in-place views do not check out,
    # and the state getters find the same draws.
    from torch_stage.staging import loader as loader_module

    monkeypatch.setattr(loader_module._Fingerprints, "_random_view", staticmethod(lambda: None))
    monkeypatch.setattr(loader_module, "_fingerprints", None)
    draw = _DRAWS[generator]
    _, plain = _seeded_run(torch.utils.data.DataLoader, draw)
    loader, ours = _seeded_run(torch_stage.DataLoader, draw)
    assert not isinstance(loader_module._fingerprints.reader, torch_stage._C._GeneratorReader)
    assert ours == plain
    reason = "no staging thread: the batches' making and the training loop both draw"
    assert any(reason in line for line in loader.stats()["tuning"]["decisions"])


def test_a_reading_made_before_numpy_was_imported_is_made_again_after(monkeypatch):
    from torch_stage.staging import loader as loader_module

    monkeypatch.delitem(sys.modules, "numpy")
    fingerprints = loader_module._Fingerprints()
    assert isinstance(fingerprints.reader, torch_stage._C._GeneratorReader)
    assert fingerprints.read()[2] is None
    monkeypatch.setitem(sys.modules, "numpy", np)
    assert fingerprints.reader() is None  # made for no NumPy
    before = fingerprints.read()
    np.random.randint(1000)
    after = fingerprints.read()
    assert before[2] is not None and before[2] != after[2]
    assert before[:2] == after[:2]
    with pytest.raises(ValueError, match="NumPy's exactly when NumPy is given"):
        torch_stage._C._GeneratorReader(random._inst, 8, 12, None, None, 16, 0)


def test_a_dataset_drawing_alone_still_stages_and_a_thread_asked_for_stages():
    # Only the dataset draws: pulls happen in order on any thread, so a
    # thread keeps the run repeatable and the tuner may use one.
    torch.manual_seed(0)
    loader = torch_stage.DataLoader(RandomCrops(_DRAWS["torch"]), batch_size=2)
    first = []
    for batch in loader:
        first.append(batch.tolist())
        time.sleep(0.004)  # a step a thread overlaps with the reads
    assert loader.stats()["inline_items"] < len(first) - 1, loader.stats()["tuning"]
    torch.manual_seed(0)
    plain = [b.tolist() for b in torch.utils.data.DataLoader(RandomCrops(_DRAWS["torch"]), 2)]
    assert first == plain
    # Threads asked for are never limited.
    loader, _ = _seeded_run(torch_stage.DataLoader, _DRAWS["torch"], num_threads=1)
    assert loader.stats()["inline_items"] == 0
    # A shuffling sampler draws its seed once, in the epoch's first batch,
    # which the loop always makes itself: a loop that draws too stages.
    torch.manual_seed(0)
    loader = torch_stage.DataLoader(RandomCrops(lambda: 0), batch_size=2, shuffle=True)
    for _ in loader:
        time.sleep(0.004)
        torch.rand(())
    s = loader.stats()
    assert s["inline_items"] < len(loader) - 1, s["tuning"]
    assert not any("draw from" in line for line in s["tuning"]["decisions"]), s["tuning"]


def test_the_line_between_waiting_and_computing_in_the_loop_reaches_the_tuner(monkeypatch):
    # Everything under 100% of its time on the CPU counts as waiting: the
    # same busy loop as above now gets its thread's trial at once.
    monkeypatch.setattr(torch_stage.staging.stage, "_TUNE_WAITING_CPU_SHARE", 1.01)
    loader = torch_stage.DataLoader(SlowOffTheLoop(), batch_size=1)
    for i, _ in enumerate(loader):
        _busy(0.001)
        if i == 150:
            break
    decisions = loader.stats()["tuning"]["decisions"]
    assert decisions[0].startswith("window 2: trying 1 thread"), decisions


class WaitsInTheLoop(torch.utils.data.Dataset):
    """Items that take 3 ms of waiting and little CPU (as reading a file
    does, or the plain DataLoader's next() waiting for its workers)."""

    def __len__(self):
        return 300

    def __getitem__(self, i):
        time.sleep(0.003)
        return i


def test_autotune_tries_a_thread_at_once_where_the_loop_waits_for_its_batches():
    # Overlapping a wait takes no core from the step: the trial is not held
    # to the share of the run that other trials are (window 2, not 20).
    loader = torch_stage.DataLoader(WaitsInTheLoop(), batch_size=1)
    seen = []
    for batch in loader:
        seen.extend(batch.tolist())
        _busy(0.002)
    assert seen == list(range(300))
    decisions = loader.stats()["tuning"]["decisions"]
    assert decisions[0].startswith("window 2: trying 1 thread"), decisions


def test_autotune_carries_what_it_learnt_into_the_next_epoch():
    # As above, a thread does not pay. The first epoch tries one and backs
    # off; the next epochs start where it settled, with its back-off, instead
    # of trying the thread again at their start.
    loader = torch_stage.DataLoader(SlowOffTheLoop(), batch_size=1)
    trials, firsts, windows = [], [], []
    for _ in range(3):
        seen = []
        for batch in loader:
            seen.extend(batch.tolist())
            _busy(0.001)
        assert seen == list(range(1200))
        s = loader.stats()
        trials.append(s["tuning"]["trials"])
        firsts.append(s["tuning"]["decisions"][0])
        windows.append(s["tuning"]["windows"])
        memory = loader._tuning_memory
        assert memory["threads"] == 0, s["tuning"]
    assert trials[0] >= 1
    assert firsts[0].startswith("window"), firsts
    for epoch in (1, 2):
        assert firsts[epoch].startswith("resumed at no producer thread"), firsts
    # Afresh, each epoch would try once and wait 4 windows; carried, the
    # back-off grows across epochs (x4 a refusal) and the windows add up
    # (the share of them trials may take counts them all).
    assert memory["backoff"][0] >= min(4 ** sum(trials), 64), (trials, memory)
    assert memory["windows"] == sum(windows), (windows, memory)
    assert memory["trial_windows"] >= sum(trials), (trials, memory)


def test_autotune_memory_is_the_next_stages_start():
    memory = {"threads": 2, "capacity": 5, "backoff": [4, 1, 1], "cooldown": [3, 0, 0]}
    with torch_stage.staged(range(50), _tuning_memory=memory) as stage:
        s = stage.stats()
        assert (s["threads"], s["capacity"]) == (2, 5), s
        assert list(stage) == list(range(50))
        assert stage._tuning_memory()["backoff"][0] >= 4
    # Explicit values are never tuned: the memory does not apply.
    with torch_stage.staged(range(5), num_threads=1, capacity=1, _tuning_memory=memory) as stage:
        assert (stage.stats()["threads"], stage.stats()["capacity"]) == (1, 1)
        assert stage._tuning_memory() is None


def test_each_epoch_starts_without_a_thread_but_with_what_tuning_learnt():
    loader = torch_stage.DataLoader(list(range(40)), batch_size=4)
    # Settled at 3 threads: the next epoch starts at none, its moves free
    # to add them again at once.
    loader._tuning_memory = {
        "threads": 3,
        "capacity": 6,
        "backoff": [16, 4, 1],
        "cooldown": [9, 2, 5],
    }
    assert loader._next_tuning_memory() == {
        "threads": 0,
        "capacity": 6,
        "backoff": [16, 4, 1],
        "cooldown": [0, 0, 0],
    }
    assert [b.tolist() for b in loader] == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    first = loader.stats()["tuning"]["decisions"][0]
    assert first.startswith("resumed at no producer thread (the consumer produces), capacity 6")
    # Settled at none: a thread's trial keeps its wait.
    loader._tuning_memory = dict(loader._tuning_memory, threads=0, cooldown=[9, 0, 0])
    assert loader._next_tuning_memory()["cooldown"] == [9, 0, 0]
    # autotune=False: nothing carries.
    loader.autotune = False
    assert [b.tolist() for b in loader][0] == [0, 1, 2, 3]
    assert loader.stats()["tuning"] is None


class _EagerBucketSampler:
    """A batch sampler that shuffles in __iter__ itself (bucketing samplers
    do), not lazily in a generator."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        p = (torch.randperm(self.n) + 100 * self.epoch).tolist()
        return iter([p[i : i + self.size] for i in range(0, self.n, self.size)])

    def __len__(self) -> int:
        return (self.n + self.size - 1) // self.size


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_eager_batch_sampler_draws_where_the_plain_loaders_does(num_workers):
    # The plain DataLoader calls iter(batch_sampler) when its iterator is
    # made, before it draws the workers' base seed: a sampler that shuffles
    # there must see the same RNG, so the order is the same; and what it
    # reads then (its epoch) is what it reads with the plain one.
    def epoch(cls):
        torch.manual_seed(0)
        sampler = _EagerBucketSampler(400, 4)
        it = iter(cls(list(range(400)), batch_sampler=sampler, num_workers=num_workers))
        sampler.set_epoch(3)  # after iter(): too late for either loader
        return [b.tolist() for b in it], torch.rand(3).tolist()

    assert epoch(torch_stage.DataLoader) == epoch(tud.DataLoader)


@pytest.mark.parametrize("cls", [tud.DataLoader, torch_stage.DataLoader])
def test_a_batch_sampler_that_raises_in_iter_raises_at_iter(cls):
    class Broken:
        def __iter__(self):
            raise RuntimeError("sampler misconfigured")

        def __len__(self):
            return 2

    loader = cls(list(range(4)), batch_sampler=Broken())
    with pytest.raises(RuntimeError, match="sampler misconfigured"):
        iter(loader)


def test_state_dict_refuses_batches_out_of_sampler_order():
    # in_order=False hands batches over as workers finish them: a count of
    # batches taken is no position in the sampler's order, and a resume from
    # it would drop some batches and repeat others.
    loader = torch_stage.DataLoader(Squares(), batch_size=2, num_workers=2, in_order=False)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="in_order=False"):
        loader.state_dict()
    loader.close()
    # Without workers there is one order, and without an epoch no position.
    assert torch_stage.DataLoader(Squares(), in_order=False, num_workers=2).state_dict() == {
        "version": 1,
        "in_epoch": False,
    }
    solo = torch_stage.DataLoader(Squares(), batch_size=2, in_order=False)
    solo_it = iter(solo)
    next(solo_it)
    assert solo.state_dict()["consumed"] == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_leaves_the_global_rng_where_the_user_put_it(num_workers):
    # The resumed epoch replays the sampler's draws from the epoch's saved
    # RNG state, then hands the global RNG back: a training loop that
    # restored its own RNG checkpoint must draw on from there (dropout,
    # augmentation in the loop), as the uninterrupted run did.
    # (Items without draws of their own: those would interleave with the
    # loop's by the staging thread's timing.)
    def make():
        return torch_stage.DataLoader(
            list(range(40)), batch_size=4, shuffle=True, num_workers=num_workers
        )

    torch.manual_seed(0)
    loader = make()
    order, draws = [], []
    for k, b in enumerate(loader):
        order.append(b.tolist())
        draws.append(torch.rand(1).item())
        if k == 1:
            state, user_rng = loader.state_dict(), torch.get_rng_state()
    torch.manual_seed(123)
    resumed = make()
    torch.set_rng_state(user_rng)
    resumed.load_state_dict(state)
    order2, draws2 = [], []
    for b in resumed:
        order2.append(b.tolist())
        draws2.append(torch.rand(1).item())
    assert order2 == order[2:]
    assert draws2 == draws[2:]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_transform_takes_batches_of_any_structure_as_collate_fn_does(num_threads):
    # The last batch is short, and its list of file names with it: a
    # collate_fn may return batches of any structure, and so may the
    # transform that stands for its end.
    ds = [(torch.tensor(i), f"img{i}.jpg") for i in range(5)]

    def transform(batch):
        x, names = batch
        return {"x": x * 2, "names": names, "first": names[0]}

    def collate(items):
        return transform(tud.default_collate(items))

    ours = list(
        torch_stage.DataLoader(ds, batch_size=2, transform=transform, num_threads=num_threads)
    )
    plain = list(tud.DataLoader(ds, batch_size=2, collate_fn=collate))
    assert (
        [b["names"] for b in ours]
        == [b["names"] for b in plain]
        == [
            ("img0.jpg", "img1.jpg"),
            ("img2.jpg", "img3.jpg"),
            ("img4.jpg",),
        ]
    )
    assert [b["x"].tolist() for b in ours] == [b["x"].tolist() for b in plain]


class _FailsAt(torch.utils.data.Dataset):
    def __len__(self):
        return 200

    def __getitem__(self, i):
        if i == 150:
            raise KeyError(f"no item {i}")
        return i


@pytest.mark.parametrize("cls", [tud.DataLoader, torch_stage.DataLoader])
def test_an_error_of_a_batch_made_in_the_loop_is_the_datasets_own(cls):
    # Made in one C call (_C._own_next), as next() makes it: the dataset's
    # exception with its frames, at its batch, and the loop goes on after.
    it = iter(cls(_FailsAt(), batch_size=1))
    got = [int(next(it)) for _ in range(150)]
    with pytest.raises(KeyError, match="no item 150") as info:
        next(it)
    assert info.traceback[-1].name == "__getitem__"
    got += [int(b) for b in it]
    assert got == [i for i in range(200) if i != 150]


def test_the_one_call_batch_refuses_what_is_not_a_stage_and_an_iterator():
    with pytest.raises(TypeError, match=r"the stage must be a _Stage, got int"):
        torch_stage._C._own_next(1, iter([]))
    loader = torch_stage.DataLoader(range(10))
    it = iter(loader)
    next(it)
    with pytest.raises(TypeError, match=r"takes a _Stage and an iterator"):
        torch_stage._C._own_next(it._own_impl, [1])
