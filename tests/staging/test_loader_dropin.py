"""torch_stage.DataLoader behaves as torch.utils.data.DataLoader (issue 17).

Each test runs a scenario with the loader class under test and with the
plain DataLoader, and compares what the training loop sees: batches,
errors, warnings, RNG state, threads and processes. The plain class is a
parameter too, so a scenario that is not deterministic by itself shows up.
"""

import gc
import inspect
import os
import sys
import threading
import time
import warnings
import weakref
from typing import List

import psutil
import pytest
import torch
import torch.utils.data as tud
from conftest import HANG_BOUND_S, devices
from reliability.probes import stage_threads
from torch.utils._python_dispatch import TorchDispatchMode

import torch_stage

# warnings.warn as torch_stage found it.
_plain_warn = warnings.warn

PLAIN = tud.DataLoader
CLASSES = [pytest.param(PLAIN, id="plain"), pytest.param(torch_stage.DataLoader, id="staged")]


class Restless(torch_stage.DataLoader):
    """Ours, auto-tuned with a window of one batch: the setting changes all
    the time, between batches made in the loop's next() and by 1 or 2
    staging threads."""

    def _make_stage(self, source, transform):
        saved = (
            torch_stage.staging.stage._TUNE_WINDOW,
            torch_stage.staging.stage._TUNE_EXPLORE_SHARE,
        )
        torch_stage.staging.stage._TUNE_WINDOW, torch_stage.staging.stage._TUNE_EXPLORE_SHARE = (
            (1, 0),
            0,
        )
        try:
            return super()._make_stage(source, transform)
        finally:
            (
                torch_stage.staging.stage._TUNE_WINDOW,
                torch_stage.staging.stage._TUNE_EXPLORE_SHARE,
            ) = saved


# The loaders under test: the plain one, ours with its defaults (auto-tuned),
# auto-tuned restlessly, and with 1, 2 and 4 staging threads (which read the
# loader in turns and finish batches out of order).
LOADERS = [
    pytest.param((PLAIN, {}), id="plain"),
    pytest.param((torch_stage.DataLoader, {}), id="staged-auto"),
    pytest.param((Restless, {}), id="staged-restless"),
    pytest.param((torch_stage.DataLoader, {"num_threads": 1}), id="staged-1thread"),
    pytest.param((torch_stage.DataLoader, {"num_threads": 2, "capacity": 3}), id="staged-2threads"),
    pytest.param((torch_stage.DataLoader, {"num_threads": 4, "capacity": 4}), id="staged-4threads"),
]
WORKERS = [
    pytest.param(0, id="0workers"),
    pytest.param(2, id="2workers", marks=pytest.mark.workers),
]

timeout = pytest.mark.timeout(60)


def loader(cls, dataset, staging=None, **kwargs):
    if cls is PLAIN:
        return PLAIN(dataset, **kwargs)
    return cls(dataset, **kwargs, **(staging or {}))


class Failing(tud.Dataset):
    """Items in ``bad`` raise; the others are their index."""

    def __init__(self, n=24, bad=(7, 13)):
        self.n = n
        self.bad = bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError(f"item {i} is bad")
        return torch.tensor([i])


class _FailingIter:
    """An iterator that raises at ``bad`` positions and goes on after."""

    def __init__(self, items, bad):
        self.items = list(items)
        self.bad = bad
        self.pos = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= len(self.items):
            raise StopIteration
        item = self.items[self.pos]
        self.pos += 1
        if item in self.bad:
            raise KeyError(f"record {item} is bad")
        return torch.tensor([item])


class FailingStream(tud.IterableDataset):
    """Sharded over workers; ``generator=True``: a generator, which ends
    after its first error (in the plain DataLoader too)."""

    def __init__(self, n=20, bad=(5, 12), generator=False):
        self.n = n
        self.bad = bad
        self.generator = generator

    def __iter__(self):
        info = tud.get_worker_info()
        items = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        it = _FailingIter(items, self.bad)
        return (x for x in it) if self.generator else it


def picky_collate(items):
    if any(int(x) == 9 for x in items):
        raise TypeError("cannot collate item 9")
    return torch.cat(items)


def outcomes(it, steps):
    """What ``steps`` calls of next() give: batches, errors, the end."""
    seen = []
    for _ in range(steps):
        try:
            seen.append(("batch", next(it).flatten().tolist()))
        except StopIteration:
            seen.append(("end",))
        except Exception as exc:  # noqa: BLE001 (compared, not handled)
            seen.append(("error", type(exc), str(exc)))
            # The plain iterator's frames in it form a cycle with the
            # exception; left to the garbage collector, stopping its workers
            # takes 5 s each, at some later test.
            exc.__traceback__ = None
    return seen


@pytest.fixture(params=CLASSES)
def cls(request):
    return request.param


@pytest.fixture(params=LOADERS)
def make(request):
    """Makes the loader under test: ``make(dataset, **plain_kwargs)``."""
    cls, staging = request.param
    return lambda dataset, **kwargs: loader(cls, dataset, staging, **kwargs)


# --- 1. Errors mid-epoch -----------------------------------------------------


@timeout
@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(dict(dataset=Failing(bad=(7, 13))), id="map"),
        pytest.param(dict(dataset=Failing(bad=(0, 23))), id="map-first-and-last"),
        pytest.param(dict(dataset=Failing(bad=()), collate_fn=picky_collate), id="collate"),
        pytest.param(dict(dataset=FailingStream(), batch_size=3), id="iterable"),
        pytest.param(dict(dataset=FailingStream(generator=True), batch_size=3), id="generator"),
    ],
)
def test_an_error_raises_for_its_batch_and_the_epoch_goes_on(make, num_workers, case):
    case = dict(case)
    dataset = case.pop("dataset")
    kwargs = dict(batch_size=4, num_workers=num_workers)
    kwargs.update(case)
    expected = outcomes(iter(PLAIN(dataset, **kwargs)), 12)
    got = outcomes(iter(make(dataset, **kwargs)), 12)
    assert got == expected
    assert ("end",) in got and any(o[0] == "error" for o in got)
    if num_workers:
        # The worker's traceback, as torch's ExceptionWrapper words it.
        assert all("in DataLoader worker process" in o[2] for o in got if o[0] == "error")


def refuse_nine(batch):
    """A per-batch step that fails on one batch: ``transform=`` for ours, the
    end of ``collate_fn`` for the plain class (where that work goes there)."""
    if 9 in batch.flatten().tolist():
        raise TypeError("cannot transform a batch holding item 9")
    return -batch


def collate_then_refuse_nine(items):
    return refuse_nine(tud.default_collate(items))


def same_error_text(seen):
    # A worker wraps its error's text in ExceptionWrapper's; a transform runs
    # in the main process, so only the original message is comparable.
    def text(o):
        return o[:2] + (o[2].splitlines()[-1].split(": ", 1)[-1],)

    return [text(o) if o[0] == "error" else o for o in seen]


@timeout
@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("cls_staging", LOADERS)
def test_a_transform_error_raises_for_its_batch_and_the_epoch_goes_on(cls_staging, num_workers):
    cls, staging = cls_staging
    dataset = Failing(bad=(17,))
    kwargs = dict(batch_size=4, num_workers=num_workers)
    expected = outcomes(iter(PLAIN(dataset, collate_fn=collate_then_refuse_nine, **kwargs)), 8)
    if cls is PLAIN:
        made = PLAIN(dataset, collate_fn=collate_then_refuse_nine, **kwargs)
    else:
        made = cls(dataset, transform=refuse_nine, **kwargs, **staging)
    got = outcomes(iter(made), 8)
    assert same_error_text(got) == same_error_text(expected)
    kinds = ["batch", "batch", "error", "batch", "error", "batch", "end", "end"]
    assert [o[0] for o in got] == kinds
    if cls is not PLAIN:
        # Raised to the training loop, so not counted as skipped.
        assert made.stats()["skipped"] == 0


class MetaBatches(tud.Dataset):
    """Items are their index, on the meta device (no data) in the batches of
    4 numbered ``bad``: copying those off it fails."""

    def __init__(self, n=24, bad=(2, 4)):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i], device="meta" if i // 4 in self.bad else "cpu")


def collate_to(device):
    return lambda items: tud.default_collate(items).to(device)


@timeout
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("cls_staging", LOADERS)
def test_a_failed_copy_to_the_device_raises_for_its_batch_and_the_epoch_goes_on(
    cls_staging, device
):
    # The plain DataLoader raises an error of pin_memory (its last step of a
    # batch) at that batch and goes on; ours copies to `device` last. Here
    # the copy fails for the meta batches; the plain class fails there in
    # collate_fn.
    cls, staging = cls_staging
    if cls is PLAIN:
        made = PLAIN(MetaBatches(), batch_size=4, collate_fn=collate_to(device))
    else:
        made = cls(MetaBatches(), batch_size=4, device=device, **staging)
    it = iter(made)
    got = outcomes(it, 3)
    if cls is not PLAIN:
        # The failed batch counts as taken: a resume goes on after it.
        assert made.state_dict()["consumed"] == 3
    got += outcomes(it, 5)
    kinds = ["batch", "batch", "error", "batch", "error", "batch", "end", "end"]
    assert [o[0] for o in got] == kinds
    batches = [o[1] for o in got if o[0] == "batch"]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 22, 23]]
    assert all("meta" in o[2] for o in got if o[0] == "error")


class PassThrough(TorchDispatchMode):
    """Runs every op as it is, in Python: what torch.cuda._sanitizer (CSAN)
    and tensor subclasses do, so an op's error crosses Python inside C++."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@timeout
@pytest.mark.parametrize("cls_staging", LOADERS)
def test_a_failed_copy_under_a_python_dispatch_mode_raises_for_its_batch(cls_staging):
    # The copy's error comes back as a Python error inside the stage's C++
    # (found by CSAN on a GPU): its message must survive, and the Python
    # error state must not be left set on the thread, where it surfaced at
    # a later, unrelated call.
    cls, staging = cls_staging
    with PassThrough():
        if cls is PLAIN:
            made = PLAIN(MetaBatches(), batch_size=4, collate_fn=collate_to("cpu"))
        else:
            made = cls(MetaBatches(), batch_size=4, device="cpu", **staging)
        got = outcomes(iter(made), 8)
    kinds = ["batch", "batch", "error", "batch", "error", "batch", "end", "end"]
    assert [o[0] for o in got] == kinds
    assert all("Cannot copy out of meta tensor" in o[2] for o in got if o[0] == "error")


def refuse_nine_on_cpu(batch):
    if batch.device.type == "cpu" and 9 in batch.flatten().tolist():
        raise TypeError("cannot transform a batch holding item 9")
    return batch


def collate_refuse_nine_to_cpu(items):
    return refuse_nine_on_cpu(tud.default_collate(items)).to("cpu")


@timeout
@pytest.mark.parametrize("cls_staging", LOADERS)
def test_a_failed_copy_right_after_a_transform_error_raises_in_order(cls_staging):
    # The stage skips the batch whose transform raised and delivers the
    # failed copy after it: each raises at its own batch.
    cls, staging = cls_staging
    dataset = MetaBatches(bad=(3,))
    if cls is PLAIN:
        made = PLAIN(dataset, batch_size=4, collate_fn=collate_refuse_nine_to_cpu)
    else:
        made = cls(dataset, batch_size=4, device="cpu", transform=refuse_nine_on_cpu, **staging)
    got = outcomes(iter(made), 8)
    kinds = ["batch", "batch", "error", "error", "batch", "batch", "end", "end"]
    assert [o[0] for o in got] == kinds
    assert got[2][1] is TypeError and "meta" in got[3][2]
    assert [o[1] for o in got if o[0] == "batch"][2:] == [[16, 17, 18, 19], [20, 21, 22, 23]]


@timeout
@pytest.mark.parametrize(
    "transform", [None, refuse_nine_on_cpu], ids=["copy", "transform-then-copy"]
)
def test_an_iterator_dropped_after_a_copy_error_goes_without_the_collector(transform):
    # Its threads stop when it goes; a cycle through the exception's frames
    # would keep it until the garbage collector runs.
    made = torch_stage.DataLoader(
        MetaBatches(bad=(3,)), batch_size=4, device="cpu", num_threads=1, transform=transform
    )
    errors = 0
    gc.disable()
    try:
        it = iter(made)
        for _ in range(6):
            try:
                next(it)
            except torch_stage.StageError:
                errors += 1
            except TypeError:  # the transform's
                errors += 1
        assert errors == (2 if transform else 1)
        gone = weakref.ref(it)
        del it
        assert gone() is None
    finally:
        gc.enable()


@timeout
@pytest.mark.workers
def test_errors_with_persistent_workers_over_two_epochs(make):
    kwargs = dict(batch_size=4, num_workers=2, persistent_workers=True)
    plain = PLAIN(Failing(), **kwargs)
    ours = make(Failing(), **kwargs)
    for _ in range(2):
        assert outcomes(iter(ours), 8) == outcomes(iter(plain), 8)


class SlowAt(tud.Dataset):
    """Item ``slow`` takes half a second; the others are immediate."""

    def __init__(self, n=10, slow=2):
        self.n = n
        self.slow = slow

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.slow:
            time.sleep(0.5)
        return i


@timeout
@pytest.mark.workers
@pytest.mark.skipif(
    "in_order" not in inspect.signature(PLAIN).parameters, reason="torch < 2.6: no in_order"
)
@pytest.mark.parametrize("in_order", [True, False])
def test_in_order_gives_the_plain_loaders_order(cls, in_order):
    # As PyTorch's TestOutOfOrderDataLoader: with in_order=False a slow item
    # comes when it is ready and the others go past it (how far depends on
    # timing, in the plain loader too).
    got = list(loader(cls, SlowAt(), batch_size=None, num_workers=2, in_order=in_order))
    if in_order:
        assert got == list(range(10))
    else:
        assert sorted(got) == list(range(10))
        assert got.index(2) > 2


# --- 2. Generic over the item type -------------------------------------------


def test_generic_over_the_item_type(cls):
    alias = cls[List[torch.Tensor]]
    made = alias(Failing(bad=()), batch_size=4)
    assert type(made) is cls
    assert isinstance(made, tud.DataLoader)
    assert next(iter(made)).shape == (4, 1)


# --- 3. Warnings in next() ---------------------------------------------------


class Overlong(tud.IterableDataset):
    """Says it has 3 items and yields 8."""

    def __len__(self):
        return 3

    def __repr__(self):  # the warning names the dataset
        return "Overlong()"

    def __iter__(self):
        info = tud.get_worker_info()
        if info is None or info.id == 0:
            yield from (torch.tensor([i]) for i in range(8))


class Warning7(tud.Dataset):
    def __init__(self, odd=7):
        self.odd = odd

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == self.odd:
            warnings.warn(f"item {i} looks odd", UserWarning, stacklevel=1)
        return torch.tensor([i])


def warnings_per_next(it, steps):
    seen = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                next(it)
            except StopIteration:
                pass
        seen.append(
            [(w.category, str(w.message), os.path.basename(w.filename), w.lineno) for w in caught]
        )
    return seen


@timeout
@pytest.mark.parametrize("num_workers", WORKERS)
def test_the_length_warning_comes_with_its_batch(make, num_workers):
    def run(made):
        assert len(made) == 3  # what the warning compares with
        return warnings_per_next(iter(made), 10)

    kwargs = dict(batch_size=None, num_workers=num_workers)
    expected = run(PLAIN(Overlong(), **kwargs))
    got = run(make(Overlong(), **kwargs))
    assert got == expected
    assert [bool(w) for w in got] == [False] * 3 + [True] * 5 + [False] * 2
    assert all(w[0][2] == os.path.basename(__file__) for w in got if w)


@timeout
@pytest.mark.parametrize("odd", [1, 7])  # in the first batch (pulled in next()), a staged one
def test_a_dataset_warning_comes_with_its_batch(make, odd):
    expected = warnings_per_next(iter(PLAIN(Warning7(odd), batch_size=3)), 5)
    got = warnings_per_next(iter(make(Warning7(odd), batch_size=3)), 5)
    assert got == expected
    assert [bool(w) for w in got] == [i == odd // 3 for i in range(5)]


@timeout
@pytest.mark.parametrize("odd", [1, 7])
def test_a_warning_made_an_error_raises_for_its_batch(make, odd):
    def run(made):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return outcomes(iter(made), 6)

    expected = run(PLAIN(Warning7(odd), batch_size=3))
    assert run(make(Warning7(odd), batch_size=3)) == expected
    assert [o[0] for o in expected].count("batch") == 3


def warn_on_nine(batch):
    if 9 in batch.flatten().tolist():
        warnings.warn("a batch holding item 9", UserWarning, stacklevel=1)
    return batch


def collate_then_warn_on_nine(items):
    return warn_on_nine(tud.default_collate(items))


@timeout
@pytest.mark.parametrize("cls_staging", LOADERS)
def test_a_transform_warning_comes_with_its_batch(cls_staging):
    cls, staging = cls_staging
    plain = dict(batch_size=3, collate_fn=collate_then_warn_on_nine)
    expected = warnings_per_next(iter(PLAIN(Warning7(), **plain)), 5)
    if cls is PLAIN:
        made = PLAIN(Warning7(), **plain)
    else:
        made = cls(Warning7(), batch_size=3, transform=warn_on_nine, **staging)
    got = warnings_per_next(iter(made), 5)
    assert got == expected
    # Batch 2 holds items 6..8 (item 7 warns), batch 3 items 9..11.
    assert [len(w) for w in got] == [0, 0, 1, 1, 0]


class OwnFilters(tud.Dataset):
    """Decides with warning filters of its own, as libraries do: a warning
    it ignores, one it makes an error and catches (its fallback changes the
    item), and one it records itself."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.warn(f"item {i}: noise", UserWarning, stacklevel=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                warnings.warn(f"item {i}: lossy", UserWarning, stacklevel=1)
                fallback = 0
            except UserWarning:
                fallback = 1
        with warnings.catch_warnings(record=True) as own:
            warnings.simplefilter("always")
            warnings.warn(f"item {i}: its own", UserWarning, stacklevel=1)
        return torch.tensor([i, fallback, len(own)])


# One staging thread at most: catch_warnings() swaps process-wide state, so
# two threads inside it at once undo each other's filters (in any Python
# code before 3.14's context-aware warnings), which no loader can help.
SINGLE_THREADED = [p for p in LOADERS if p.id in ("plain", "staged-auto", "staged-1thread")]


@timeout
@pytest.mark.parametrize("cls_staging", SINGLE_THREADED)
def test_a_datasets_own_warning_filters_decide_its_warnings(cls_staging):
    cls, staging = cls_staging

    def run(made):
        # One recording context around the whole loop: a staging thread's
        # catch_warnings() nests inside it, not across the loop's own.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = [b.tolist() for b in made]
        return batches, [str(w.message) for w in caught]

    expected = run(PLAIN(OwnFilters(), batch_size=3))
    assert run(loader(cls, OwnFilters(), staging, batch_size=3)) == expected
    assert expected == ([[[i, 1, 1] for i in range(k, k + 3)] for k in range(0, 12, 3)], [])


@timeout
def test_warnings_on_other_threads_are_untouched(cls):
    # A loader reading ahead must not catch the training loop's warnings.
    it = iter(loader(cls, Warning7(), batch_size=3))
    next(it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("from the training loop", RuntimeWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["from the training loop"]
    assert caught[0].filename == __file__


# --- 4. The iterator owns its threads and workers ----------------------------


def worker_processes():
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return len(alive)


def census():
    return stage_threads(), worker_processes()


def settles_to(expected, within=1.0):
    deadline = time.monotonic() + within
    while True:
        gc.collect()
        now = census()
        if now == expected or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


@timeout
@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("how", ["del", "break", "after-error"])
def test_dropping_the_iterator_stops_threads_and_workers(cls, num_workers, how):
    before = settles_to(census())
    bad = (5,) if how == "after-error" else ()  # an error ends a stage's threads
    # Staging threads asked for: auto-tuned ones start only where a trial
    # begins (test_a_loop_the_tuner_keeps_starts_no_staging_thread).
    staging = {"num_threads": 2}
    made = loader(cls, Failing(bad=bad), staging, batch_size=2, num_workers=num_workers)
    if how == "after-error":
        it = iter(made)
        assert [o[0] for o in outcomes(it, 4)] == ["batch", "batch", "error", "batch"]
        del it
    elif how == "del":
        it = iter(made)
        next(it)
        if cls is not PLAIN:
            assert stage_threads() > before[0]
        del it
    else:
        for _ in made:
            break
    assert settles_to(before) == before


@timeout
def test_a_loop_the_tuner_keeps_starts_no_staging_thread():
    # Batches made in the loop, as the plain class makes them, in an epoch
    # too short for the tuner's first window: no thread is tried, and none
    # is started (its start would cost each epoch some 100 us).
    before = settles_to(census())
    made = torch_stage.DataLoader(Failing(bad=()), batch_size=2)
    for i, _ in enumerate(made):
        assert census() == before, i
    assert made.stats()["threads"] == 0
    assert made.stats()["inline_items"] > 0


@timeout
@pytest.mark.workers
@pytest.mark.parametrize("persistent", [False, True])
def test_the_iterator_names_its_worker_processes(cls, persistent):
    # PyTorch's test_partial_workers and test_iterable_style_dataset read
    # the iterator's _workers to check that the processes exit cleanly.
    made = loader(cls, Failing(bad=()), batch_size=2, num_workers=2, persistent_workers=persistent)
    it = iter(made)
    workers = it._workers
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    for i, _ in enumerate(it):
        if i == 3:
            break
    assert it._workers == workers
    del it
    if persistent:
        assert all(w.is_alive() for w in workers)
        assert iter(made)._workers == workers  # the same processes, reset
        del made
    for w in workers:
        w.join(10)
    assert [w.exitcode for w in workers] == [0, 0]
    with pytest.raises(AttributeError):
        iter(loader(cls, Failing(bad=()), batch_size=2))._workers  # noqa: B018 (no workers)


@timeout
@pytest.mark.workers
def test_persistent_workers_stay_until_the_loader_goes(cls):
    before = settles_to(census())
    made = loader(cls, Failing(bad=()), batch_size=2, num_workers=2, persistent_workers=True)
    for _ in made:
        break
    assert settles_to((before[0], before[1] + 2)) == (before[0], before[1] + 2)
    del made
    assert settles_to(before) == before


@timeout
@pytest.mark.workers
def test_a_new_iterator_that_ends_the_epoch_of_one_in_use_says_so():
    # The plain class hands back its one iterator, reset: an outer loop
    # goes on into the new epoch. Here iter() ends the outer loop's epoch,
    # which it must not do without a word.
    made = torch_stage.DataLoader(
        Failing(bad=()), batch_size=2, num_workers=2, persistent_workers=True
    )
    outer = iter(made)
    next(outer)
    with pytest.warns(UserWarning, match=r"ends the epoch of the iterator before it after 1 batch"):
        inner = iter(made)
    assert next(inner).flatten().tolist() == [0, 1]
    with pytest.raises(StopIteration):
        next(outer)
    # An iterator done with its epoch, or dropped, ends silently.
    list(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in made:
            break
        list(made)


# --- 5. Read-ahead changes no sampler or RNG draw ----------------------------


class Noisy(tud.Dataset):
    """Items draw from the global RNG, as random augmentations do.

    24 items in batches of 4: the last batch is out before the sampler is
    asked again, and asking again makes RandomSampler draw a permutation.
    """

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item()])


def lightning_epochs(made, epochs=2):
    """Epochs as Lightning runs them: len(loader) next() calls, no
    StopIteration, then iter() again."""
    seen = []
    for _ in range(epochs):
        it = iter(made)
        seen.append([next(it).tolist() for _ in range(len(made))])
    return seen


@timeout
@pytest.mark.parametrize("num_workers", WORKERS)
def test_generator_draws_match_without_exhausting(make, num_workers):
    def run(make):
        gen = torch.Generator().manual_seed(5)
        torch.manual_seed(0)
        made = make(Noisy(), batch_size=4, shuffle=True, generator=gen, num_workers=num_workers)
        return lightning_epochs(made), gen.get_state(), torch.get_rng_state()

    expected = run(PLAIN)
    got = run(make)
    assert got[0] == expected[0]
    assert torch.equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2])


@timeout
@pytest.mark.parametrize("num_workers", WORKERS)
def test_global_seed_draws_match_without_exhausting(make, num_workers):
    def run(make):
        torch.manual_seed(17)
        made = make(Noisy(), batch_size=4, shuffle=True, num_workers=num_workers)
        return lightning_epochs(made), torch.get_rng_state()

    expected = run(PLAIN)
    got = run(make)
    assert got[0] == expected[0]
    assert torch.equal(got[1], expected[1])


@timeout
def test_draws_between_iter_and_next_are_not_taken_by_the_loader(cls):
    # The plain DataLoader draws the sampler's seed at the first next().
    def run(make):
        torch.manual_seed(2)
        it = iter(make(Noisy(), batch_size=4, shuffle=True))
        between = torch.rand(3).tolist()
        return between, next(it).tolist()

    assert run(lambda *a, **k: loader(cls, *a, **k)) == run(PLAIN)


# --- 6. Constructor arguments ------------------------------------------------


def test_every_plain_argument_is_accepted_with_its_default():
    plain = inspect.signature(PLAIN).parameters
    ours = inspect.signature(torch_stage.DataLoader).parameters
    for name, param in plain.items():
        assert name in ours, name
        assert ours[name].default == param.default, name
        assert ours[name].kind == param.kind, name


def lightning_rebuild(made):
    """A new loader from the signature and public attributes, as PyTorch
    Lightning re-creates loaders (to inject a DistributedSampler)."""
    params = inspect.signature(type(made).__init__).parameters
    attrs = {k: v for k, v in vars(made).items() if not k.startswith("_")}
    kwargs = {n: attrs[n] for n in params if n in attrs}
    # Lightning passes the sampler and leaves shuffle/batch_sampler default.
    kwargs.pop("batch_sampler", None)
    kwargs["sampler"] = made.sampler
    return type(made)(**kwargs)


def test_a_rebuilt_loader_keeps_every_option(cls):
    staging = dict(
        capacity=3,
        num_threads=2,
        device="cpu",
        transform=torch.neg,
        stage_subgraph_stream_id=2,
        timeout_millis=1234,
        name="rebuilt",
    )
    made = loader(cls, Failing(bad=()), staging, batch_size=5, drop_last=True, in_order=False)
    again = lightning_rebuild(made)
    assert (again.batch_size, again.drop_last, again.in_order) == (5, True, False)
    assert [b.tolist() for b in again] == [b.tolist() for b in made]
    if cls is not PLAIN:
        for key, value in staging.items():
            expected = torch.device(value) if key == "device" else value
            assert getattr(again, key) == expected, key


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(4))


@timeout
@pytest.mark.parametrize(
    "dataset, kwargs",
    [
        (Failing(), dict(num_workers=-1)),
        (Failing(), dict(timeout=-1)),
        (Failing(), dict(prefetch_factor=2)),
        (Failing(), dict(persistent_workers=True)),
        (Failing(), dict(batch_sampler=[[0, 1]], batch_size=2)),
        (Failing(), dict(sampler=[0, 1], shuffle=True)),
        (Failing(), dict(batch_size=None, drop_last=True)),
        (Stream(), dict(shuffle=True)),
        (Stream(), dict(sampler=[0, 1])),
        (Failing(), dict(num_workers=1, multiprocessing_context="no-such-method")),
        (Failing(), dict(num_workers=1, multiprocessing_context=5)),
        (Failing(), dict(multiprocessing_context="fork")),
        (Failing(), dict(no_such_argument=1)),
    ],
)
def test_bad_arguments_raise_as_the_plain_loader_does(cls, dataset, kwargs):
    with pytest.raises(Exception) as plain_error:
        PLAIN(dataset, **kwargs)
    before = settles_to(census())
    with pytest.raises(plain_error.type):
        loader(cls, dataset, **kwargs)
    assert census() == before


# --- 7. What a subclass, a pickle or an odd sampler or exception sees ---------


class PlainCollating(PLAIN):
    """A loader subclass as users write them: its collate is a bound method,
    so worker processes under spawn get the loader itself, pickled."""

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, collate_fn=self.collate, **kwargs)

    def collate(self, items):
        return torch.stack(items) * 10


class StagedCollating(torch_stage.DataLoader):
    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, collate_fn=self.collate, **kwargs)

    collate = PlainCollating.collate


@timeout
def test_a_loader_pickles_after_an_epoch(cls):
    import pickle

    made = loader(cls, [torch.tensor(i) for i in range(4)], batch_size=2)
    assert [b.tolist() for b in made] == [[0, 1], [2, 3]]
    again = pickle.loads(pickle.dumps(made))
    assert [b.tolist() for b in again] == [[0, 1], [2, 3]]


@timeout
@pytest.mark.workers
def test_a_subclass_collating_in_a_method_runs_epochs_under_spawn(cls):
    # The spawned workers get the loader (through collate_fn's self) with
    # the dataset, so each epoch pickles it, after the last one ran.
    Loader = PlainCollating if cls is PLAIN else StagedCollating
    made = Loader(
        [torch.tensor(i) for i in range(4)],
        batch_size=2,
        num_workers=1,
        multiprocessing_context="spawn",
    )
    for _ in range(2):
        assert [b.tolist() for b in made] == [[0, 10], [20, 30]]


@timeout
def test_a_subclass_keeps_its_own_transform_and_device(cls):
    # Names torch_stage.DataLoader takes as staging options are a
    # subclass's own when it sets or defines them itself.
    class WithAttributes(cls):
        def __init__(self, dataset, transform, **kwargs):
            super().__init__(dataset, collate_fn=self.collate, **kwargs)
            self.transform = transform
            self.device = "meta"  # what the subclass moves batches to itself

        def collate(self, items):
            return torch.tensor([self.transform(x) for x in items])

    class WithMethod(cls):
        def transform(self, x):
            return x + 1000

        def collate(self, items):
            return torch.tensor([self.transform(x) for x in items])

    made = WithAttributes([0, 1, 2, 3], lambda x: x + 100, batch_size=2)
    assert [b.tolist() for b in made] == [[100, 101], [102, 103]]
    assert made.transform(1) == 101 and made.device == "meta"
    made = WithMethod([0, 1, 2, 3], batch_size=2)
    made.collate_fn = made.collate
    assert [b.tolist() for b in made] == [[1000, 1001], [1002, 1003]]


class UnknownLength(tud.Sampler):
    def __init__(self, error):
        self.error = error

    def __iter__(self):
        return iter([3, 1, 2, 0])

    def __len__(self):
        raise self.error("length unknown")


@timeout
@pytest.mark.parametrize("error", [RuntimeError, ValueError, TypeError])
def test_a_sampler_whose_len_raises_is_never_asked(make, error):
    # The plain DataLoader never calls len() of the sampler while iterating.
    made = make(range(4), batch_size=2, sampler=UnknownLength(error))
    assert [b.tolist() for b in made] == [[3, 1], [2, 0]]


class Abort(BaseException):
    """Not an Exception: what a dataset may raise to stop a step."""


class AbortsAt4(tud.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 4:
            raise Abort("item 4")
        return i


@timeout
def test_a_base_exception_from_the_dataset_raises_for_its_batch(make):
    def run(made):
        it, seen = iter(made), []
        for _ in range(5):
            try:
                seen.append(next(it).tolist())
            except StopIteration:
                seen.append("end")
            except BaseException as exc:  # noqa: BLE001 (compared, not handled)
                seen.append(f"{type(exc).__name__}: {exc}")
        return seen

    expected = run(PLAIN(AbortsAt4(), batch_size=2))
    assert expected == [[0, 1], [2, 3], "Abort: item 4", [6, 7], "end"]
    assert run(make(AbortsAt4(), batch_size=2)) == expected


@timeout
def test_the_iterators_length_is_the_plain_iterators(cls):
    class Sized(tud.IterableDataset):
        def __iter__(self):
            return iter(range(10))

        def __len__(self):
            return 4

    def length(made):
        try:
            return len(iter(made))
        except TypeError as exc:
            return type(exc), str(exc)

    for dataset, kwargs in ((Sized(), dict(batch_size=2)), (list(range(10)), dict(batch_size=3))):
        assert length(loader(cls, dataset, **kwargs)) == length(PLAIN(dataset, **kwargs))


@timeout
@pytest.mark.parametrize(
    "make_loader", ["tud.DataLoader(", "torch_stage.DataLoader(num_threads=1, dataset="]
)
def test_exit_after_every_batch_but_no_stop_iteration_is_clean(run_python, make_loader):
    # A loop that takes exactly len(loader) batches (Lightning's way) never
    # asks past the end, so a staging thread waits at the end for that ask;
    # at interpreter exit it must stop waiting at once, not be left behind.
    proc = run_python(
        f"""
        import time, warnings
        import torch.utils.data as tud
        import torch_stage
        warnings.simplefilter("always")

        class Slow(tud.Dataset):
            def __len__(self):
                return 60

            def __getitem__(self, i):
                time.sleep(0.002)
                return i

        made = {make_loader}Slow(), batch_size=2)
        it = iter(made)
        for _ in range(len(made)):
            next(it)
        print("taken", flush=True)
        """
    )
    assert proc.stdout == "taken\n"
    assert proc.stderr == ""


class CatchesItsWarning(tud.Dataset):
    """Handles its own warning when the filters make it an error (as code
    run under ``pytest -W error`` may)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        try:
            warnings.warn("legacy format", UserWarning, stacklevel=1)
            return i
        except UserWarning:
            return -i - 100


@timeout
@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("cls_staging", LOADERS)
def test_a_warning_the_filters_make_an_error_raises_where_it_is_made(cls_staging, num_workers):
    cls, staging = cls_staging
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batches = loader(cls, CatchesItsWarning(), staging, batch_size=2, num_workers=num_workers)
        got = [b.tolist() for b in batches]
    assert got == [[-100, -101], [-102, -103], [-104, -105], [-106, -107]]


@pytest.mark.parametrize("stacklevel", [0, -3, 1])
def test_warn_with_a_stacklevel_below_one_points_at_its_caller_after_an_epoch(stacklevel):
    # An epoch wraps warnings.warn for the process (see loader.py); the
    # plain function takes a stacklevel of 1 or less as its caller's line.
    list(torch_stage.DataLoader([1, 2]))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        warnings.warn("here", stacklevel=stacklevel)
    assert [(w.filename, w.lineno) for w in seen] == [(__file__, line)]


class WarnsWithABadCategory(tud.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        warnings.warn("bad", category=int, stacklevel=1)
        return i


@timeout
@pytest.mark.parametrize("cls_staging", LOADERS)
def test_a_warning_category_that_is_no_warning_raises_the_plain_type_error(cls_staging):
    cls, staging = cls_staging
    with pytest.raises(TypeError, match="category must be a Warning subclass"):
        next(iter(loader(cls, WarnsWithABadCategory(), staging, batch_size=2)))


@pytest.mark.parametrize("cls_staging", LOADERS[:2])
def test_a_generator_that_is_no_generator_raises_the_plain_type_error(cls_staging):
    cls, staging = cls_staging
    bad = loader(cls, list(range(4)), staging, batch_size=2, shuffle=True, generator=3)
    with pytest.raises(TypeError, match="generator"):
        list(bad)


_PATCHES = """
import sys, time, warnings
import torch
from torch.jit import _builtins

original = (warnings.warn, warnings.catch_warnings.__enter__, warnings.catch_warnings.__exit__)


def warn_builtins():
    # What TorchScript compiles as aten::warn (torch_stage's own functions
    # registered as its own ops are no one else's business).
    return {k for k, v in _builtins._get_builtin_table().items() if v == "aten::warn"}


builtins = warn_builtins()


def untouched(when, settle_s=0.0):
    # settle_s: a loop left early, or an iterator closed, returns while a
    # staging thread may still be inside the dataset; the recorder goes
    # when it leaves (close() says so), so wait for that, bounded.
    deadline = time.monotonic() + settle_s
    while True:
        now = (warnings.warn, warnings.catch_warnings.__enter__, warnings.catch_warnings.__exit__)
        if now == original or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    assert now == original, (when, now, original)
    assert warn_builtins() == builtins, when


import torch_stage

untouched("after import")
data = torch.utils.data.TensorDataset(torch.arange(64.0))
loader = torch_stage.DataLoader(data, batch_size=4, num_threads=2, capacity=2)
seen = []
for (x,) in loader:
    seen.append(x)
    warnings.warn("from the loop")  # the loop's own warnings, as ever
untouched("after an epoch")
assert len(seen) == 16
for i, (x,) in enumerate(loader):
    if i == 3:
        break
it = None
del x
import gc

gc.collect()
untouched("after a loop left with break", settle_s=10)
it = iter(loader)
next(it)
it.close() if hasattr(it, "close") else None
del it
gc.collect()
untouched("after an iterator closed", settle_s=10)
print("ok")
"""


def test_nothing_of_warnings_or_torchscript_is_replaced_once_no_iterator_produces(run_python):
    # A library that wraps warnings.warn for the whole process surprises
    # every other library wrapping it too: the loader's recorder is in
    # place only while a staging thread may make a batch.
    assert run_python(_PATCHES).stdout.strip().endswith("ok")


_ENDING_THREAD_AT_EXIT = """
import threading, time, torch, torch_stage
from torch_stage import _C


class Slow:
    # Freed while the interpreter finalizes __main__, releasing the GIL for
    # a while: a thread waiting for it then is handed it during finalization.
    def __del__(self, sleep=time.sleep):
        sleep(1.0)


keep = Slow()


class Gated(torch.utils.data.Dataset):
    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= 2:
            self.inside.set()
            assert self.release.wait(60)
        return torch.tensor([i])


data = Gated()
loader = torch_stage.DataLoader(data, batch_size=1, num_threads=1)
for x in loader:
    if data.inside.wait(30):
        break  # at once, the staging thread inside __getitem__
# Its GIL waits (from destructors among them: the items and the thread
# state it drops on its way out) begin 300 ms after their last check of
# the exit.
_C._delay_gil_waits(300)
data.release.set()
deadline = time.monotonic() + 30
while _C._gated_gil_users() == 0 and time.monotonic() < deadline:
    time.sleep(0.001)
print("exits" if _C._gated_gil_users() else "no thread in the window", flush=True)
"""


def test_a_staging_thread_ending_as_the_interpreter_exits_does_not_abort_it(run_python):
    # A staging thread left inside the dataset by `break` ends while the
    # interpreter exits. It checked the exit flag before the exit hook set
    # it, then waited for the GIL from a destructor; handed the GIL during
    # finalization, CPython < 3.14 pthread_exits it there, which aborted the
    # process ("terminate called without an active exception", once in CI
    # after the test above). The exit hook now lets such waits end first.
    proc = run_python(_ENDING_THREAD_AT_EXIT, check=False)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "exits", "")


class _Gated(tud.Dataset):
    """Items from ``gate_at`` on wait for ``release`` (a slow read), and say
    when they start; records how many calls are inside at once."""

    def __init__(self, n=64, gate_at=4):
        self.n, self.gate_at = n, gate_at
        self.entered = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.inside = self.most_inside = 0
        self.calls = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.calls.append(i)
        try:
            if i >= self.gate_at:
                self.entered.set()
                assert self.release.wait(HANG_BOUND_S), "the test never released the item"
                warnings.warn(f"item {i}, made after the loop left", stacklevel=1)
            return torch.tensor([float(i)])
        finally:
            with self.lock:
                self.inside -= 1


def test_break_returns_while_a_staging_thread_is_still_inside_the_dataset():
    # The plain loader without workers makes nothing ahead, so `break`
    # returns at once; ours returns at once too, and the staging thread
    # inside __getitem__ ends after its item, making no other.
    data = _Gated()
    transformed = []

    def transform(batch):
        transformed.append(batch)
        return batch

    loader = torch_stage.DataLoader(
        data, batch_size=1, num_threads=1, capacity=8, transform=transform
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, _ in enumerate(loader):
            if i == 0:
                assert data.entered.wait(HANG_BOUND_S)
            if i == 1:
                break
        # Back from the loop while the item is still being made.
        assert not data.release.is_set() and data.inside == 1
        calls, transforms = len(data.calls), len(transformed)
        data.release.set()
        deadline = time.monotonic() + HANG_BOUND_S
        while stage_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert stage_threads() == 0
    # Nothing after the item it was in, not even that item's transform.
    assert (len(data.calls), len(transformed)) == (calls, transforms)
    # That item's warnings belong to a batch nobody takes: not shown.
    assert not [w for w in caught if "after the loop left" in str(w.message)]
    assert warnings.warn is _plain_warn  # the recorder went with the thread


def test_a_new_epoch_waits_for_the_item_a_left_thread_is_making():
    # The dataset is called by one thread at a time, as in the plain loader:
    # the next epoch's first item is made once the left one is done.
    data = _Gated()
    loader = torch_stage.DataLoader(data, batch_size=1, num_threads=1, capacity=8)
    for i, _ in enumerate(loader):
        if i == 0:
            assert data.entered.wait(HANG_BOUND_S)
        if i == 1:
            break
    data.gate_at = data.n  # the next epoch's items are quick
    got = []
    second = threading.Thread(target=lambda: got.append(next(iter(loader))))
    second.start()
    second.join(0.3)
    data.release.set()
    second.join(HANG_BOUND_S)
    assert not second.is_alive() and got[0].item() == 0.0
    assert data.most_inside == 1


_DAEMON_AT_EXIT = """
import sys, threading, time
import torch, torch.utils.data as tud
import torch_stage

class Slow(tud.Dataset):
    def __len__(self): return 10**6
    def __getitem__(self, i):
        time.sleep({item_s} if i > 20 else 0.005)
        return torch.tensor([i])

cls = torch_stage.DataLoader if sys.argv[1] == "ours" else tud.DataLoader
started = threading.Event()
def loop():
    for i, b in enumerate(cls(Slow(), batch_size=1, num_workers={workers})):
        if i == 20:
            started.set()
        time.sleep(0.005)
threading.Thread(target=loop, daemon=True).start()
assert started.wait(60)
time.sleep(0.2)
print("exits", flush=True)
"""


@pytest.mark.parametrize("cls", ["plain", "ours"])
@pytest.mark.parametrize("item_s", [0.01, 3.0], ids=["quick_items", "item_outlasts_exit"])
def test_a_daemon_thread_still_iterating_at_exit_prints_nothing(run_python, cls, item_s):
    # As a daemon thread in any blocking call: the interpreter exits under
    # it, with nothing said.
    code = _DAEMON_AT_EXIT.format(item_s=item_s, workers=0)
    proc = run_python(code.replace("sys.argv[1]", repr(cls)), check=False)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "exits", "")
