"""torch_stage.sanitize_streams: the CPU model of CUDA stream semantics
(torch_stage/streams/sanitizer.py) on raw programs of the project's stream ops, on
rewritten real models, and against its own misuse."""

import copy
import threading

import pytest
import torch
import zoo
from stream_oracle import waits, without_wait

import torch_stage
from torch_stage.streams.fx import _ops

ops = torch.ops.torch_stage

pytestmark = pytest.mark.own_sanitizer


def _write(spelling: str, x: torch.Tensor) -> None:
    if spelling == "add_":
        x.add_(1)
    elif spelling == "setitem":
        x[3] = 5.0
    elif spelling == "out=":
        torch.mul(x, 2, out=x)
    elif spelling == "_foreach_mul_":
        torch._foreach_mul_([x], 2.0)
    elif spelling == "fused_adam":
        state = [torch.zeros_like(x) for _ in range(2)]
        torch._fused_adam_(
            [x], [torch.ones_like(x)], state[:1], state[1:], [], [torch.tensor(1.0)],
            lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
            maximize=False,
        )  # fmt: skip
    elif spelling == "iadd":
        x += 1
    else:
        raise AssertionError(spelling)


SPELLINGS = ["add_", "setitem", "out=", "_foreach_mul_", "fused_adam", "iadd"]


def _raw_raw(spelling: str, wait: bool) -> torch.Tensor:
    """Stream 1 writes x, stream 0 reads it; ordered only with the wait."""
    x = torch.randn(64)
    run = ops.fork(2, [1], 1, (x,))
    _ops.set_stream(run, 1)
    _write(spelling, x)
    _ops.record_event(run, 0, 1)
    _ops.set_stream(run, 0)
    if wait:
        _ops.wait_event(run, 0, 0)
    y = x * 2
    _ops.join(run, [1])
    return y


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_write_on_a_side_stream_read_without_a_wait_is_a_race(spelling):
    with pytest.raises(torch_stage.StreamRaceError, match="read after write") as info:
        with torch_stage.sanitize_streams():
            _raw_raw(spelling, wait=False)
    race = info.value.race
    assert race.previous.stream == "pool1" and race.previous.is_write
    assert race.current.stream == "default" and race.current.op == "aten.mul.Tensor"
    assert race.shape == (64,)
    # The report names both ops, both streams and where they ran.
    text = str(info.value)
    assert "on stream pool1" in text and "on stream default" in text
    assert "_write(spelling, x)" in text and "y = x * 2" in text


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_same_program_with_the_wait_is_clean(spelling):
    with torch_stage.sanitize_streams() as sanitizer:
        y = _raw_raw(spelling, wait=True)
    assert sanitizer.races == []
    assert sanitizer.ops_seen > 0
    assert y.shape == (64,)


@pytest.mark.parametrize("wait", [False, True])
def test_a_write_after_a_read_on_another_stream_needs_a_wait(wait):
    def program():
        x = torch.randn(64)
        run = ops.fork(2, [1], 1, (x,))
        _ops.set_stream(run, 1)
        x.sum()
        _ops.record_event(run, 0, 1)
        _ops.set_stream(run, 0)
        if wait:
            _ops.wait_event(run, 0, 0)
        x.mul_(2)
        _ops.join(run, [1])

    with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        program()
    assert [r.kind for r in sanitizer.races] == ([] if wait else ["write after read"])


@pytest.mark.parametrize("raise_on_race", [False, True])
def test_a_free_while_another_stream_still_reads_is_reported_at_the_free(raise_on_race):
    # No allocation follows on the caller's stream while sanitized: the
    # caching allocator may still hand the block to whatever allocates next.
    def program():
        x = torch.randn(64)
        run = ops.fork(2, [1], 1, (x,))
        t = x * 3  # allocated on the caller's stream
        _ops.record_event(run, 0, 0)
        _ops.set_stream(run, 1)
        _ops.wait_event(run, 0, 1)
        y = t.sum()  # read on stream 1
        _ops.set_stream(run, 0)
        del t  # the free that races with the read
        _ops.join(run, [1])
        return y

    if raise_on_race:
        with pytest.raises(torch_stage.StreamRaceError, match="free while in use"):
            with torch_stage.sanitize_streams():
                program()
        return
    with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        program()
    assert [r.kind for r in sanitizer.races] == ["free while in use"]
    race = sanitizer.races[0]
    assert (race.current.op, race.current.stream) == ("free", "default")
    assert (race.previous.op, race.previous.stream) == ("aten.sum.default", "pool1")
    text = str(race)
    assert "freed onto its allocation stream default" in text
    assert "read by aten.sum.default on stream pool1 is not ordered before the free" in text
    assert "no record_stream names stream pool1" in text
    assert "del t  # the free that races with the read" in text  # where it was freed


def test_two_unordered_writers_race():
    with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        x = torch.zeros(8)
        run = ops.fork(3, [1, 2], 0, (x,))
        _ops.set_stream(run, 1)
        x.add_(1)
        _ops.set_stream(run, 2)
        x.mul_(3)
        _ops.join(run, [1, 2])
    assert [r.kind for r in sanitizer.races] == ["write after write"]


@pytest.mark.parametrize("keep", [False, True])
def test_a_temporary_read_on_a_side_stream_needs_record_stream(keep):
    def program():
        x = torch.randn(64)
        run = ops.fork(2, [1], 1, (x,))
        t = x * 3  # allocated on stream 0
        _ops.record_event(run, 0, 0)
        _ops.set_stream(run, 1)
        _ops.wait_event(run, 0, 1)
        y = t.sum()  # read on stream 1
        if keep:
            _ops.record_stream(run, t, 1)
        _ops.set_stream(run, 0)
        del t  # back to stream 0's free list while stream 1 may still read it
        u = x + 1  # the next allocation on stream 0 may get t's memory
        _ops.join(run, [1])
        return y, u

    with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        program()
    kinds = [r.kind for r in sanitizer.races]
    assert kinds == ([] if keep else ["free while in use"])
    if not keep:
        assert sanitizer.races[0].previous.op == "aten.sum.default"
        assert sanitizer.races[0].current.stream == "default"
        # Reported at the free, before the allocation that may reuse it.
        assert sanitizer.races[0].current.op == "free"


def test_a_free_after_the_join_is_safe():
    with torch_stage.sanitize_streams() as sanitizer:
        x = torch.randn(64)
        t = x * 3
        run = ops.fork(2, [1], 0, (x,))
        _ops.set_stream(run, 1)
        t.sum()
        _ops.set_stream(run, 0)
        _ops.join(run, [1])
        del t
    assert sanitizer.races == []


def test_views_share_their_base_storage():
    with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        x = torch.randn(4, 4)
        run = ops.fork(2, [1], 0, (x,))
        _ops.set_stream(run, 1)
        x[1:].transpose(0, 1).mul_(2)  # writes x through a view
        _ops.set_stream(run, 0)
        x[0].sum()
        _ops.join(run, [1])
    assert [r.kind for r in sanitizer.races] == ["read after write"]


def test_stream_scopes_in_torchscript_fork_and_join():
    class Scoped(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            with torch_stage.stream(1):
                z = y + 1
                z.mul_(3)
            return z + y

    scripted = torch.jit.script(Scoped())
    x = torch.randn(8)
    with torch_stage.sanitize_streams() as sanitizer:
        out = scripted(x)
    assert sanitizer.races == []
    torch.testing.assert_close(out, (x * 2 + 1) * 3 + x * 2)


def test_backward_runs_on_the_forward_streams_and_syncs_at_the_end():
    lin = torch.nn.Linear(8, 8)
    with torch_stage.sanitize_streams() as sanitizer:
        x = torch.randn(4, 8)
        run = ops.fork(2, [1], 1, (x,))
        _ops.set_stream(run, 1)
        h = lin(x).relu()
        _ops.record_event(run, 0, 1)
        _ops.set_stream(run, 0)
        _ops.wait_event(run, 0, 0)
        _ops.record_stream(run, h, 0)
        out = (h * 2).sum()
        _ops.join(run, [1])
        out.backward()
        # The optimizer on the default stream after backward's leaf sync.
        with torch.no_grad():
            for p in lin.parameters():
                p.sub_(0.1 * p.grad)
        assert h.grad_fn.metadata["torch_stage_stream"] == "pool1"
    assert sanitizer.races == []


def test_torch_jit_trace_under_the_sanitizer_is_a_clear_error():
    # Under a dispatch mode the tracer took the convolution's output for a
    # constant: the traced module returned this run's values for any input.
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    with torch_stage.sanitize_streams():
        with pytest.raises(RuntimeError, match="trace it outside the sanitizer"):
            torch.jit.trace(module, (x,), check_trace=False)
    traced = torch.jit.trace(module, (x,), check_trace=False)
    with torch_stage.sanitize_streams() as sanitizer:
        other = torch.randn(1, 3, 8, 8)
        assert torch.equal(traced(other), module(other))
    assert sanitizer.races == [] and sanitizer.ops_seen > 0


def test_nesting_and_a_second_sanitizer_are_errors():
    with torch_stage.sanitize_streams() as outer:
        with pytest.raises(RuntimeError, match="already active on this thread"):
            outer.__enter__()
        with pytest.raises(RuntimeError, match="another stream sanitizer is active"):
            with torch_stage.sanitize_streams():
                pass
    with pytest.raises(TypeError, match="raise_on_race must be a bool, got str"):
        torch_stage.sanitize_streams(raise_on_race="yes")


def test_other_threads_enter_the_same_sanitizer():
    sanitizer = torch_stage.sanitize_streams(raise_on_race=False)
    seen = []

    def worker():
        with sanitizer:
            x = torch.zeros(8)
            run = ops.fork(2, [1], 0, (x,))
            _ops.set_stream(run, 1)
            x.add_(1)
            _ops.set_stream(run, 0)
            seen.append(x.sum())  # no wait: a race on this thread's run
            _ops.join(run, [1])

    with sanitizer:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(timeout=60)
    assert seen and [r.kind for r in sanitizer.races] == ["read after write"]


def test_the_environment_variable_sanitizes_a_whole_process(run_python):
    code = """
        import torch, torch_stage
        from torch_stage.streams.fx import _ops
        x = torch.randn(4)
        run = torch.ops.torch_stage.fork(2, [1], 0, (x,))
        _ops.set_stream(run, 1)
        x.add_(1)
        _ops.set_stream(run, 0)
        try:
            x.sum()
        except torch_stage.StreamRaceError as e:
            print("raced:", e.race.kind)
    """
    proc = run_python(code, env={"TORCH_STAGE_SANITIZE": "1"})
    assert "raced: read after write" in proc.stdout
    proc = run_python(code, env={"TORCH_STAGE_SANITIZE": "2"}, check=False)
    assert "TORCH_STAGE_SANITIZE must be 0 or 1, got '2'" in proc.stderr


# -- rewritten models: clean plans, and plans with a wait removed ------------

BRANCHY = ["two_tower", "inception", "rec_8_towers", "in_place", "random_branches"]


def _entry(name):
    return next(e for e in zoo.ZOO if e.name == name)


def _run(model, entry, train):
    inputs = entry.inputs(max(4, entry.min_batch), "cpu")
    model.train(train)
    torch.manual_seed(0)
    out = model(*inputs)
    if train:
        sum(o.float().sum() for o in (out if isinstance(out, (tuple, list)) else [out])).backward()
    return out


@pytest.mark.parametrize("strategy", ["min_sync", "critical_path"])
@pytest.mark.parametrize("name", [e.name for e in zoo.ZOO])
def test_rewritten_zoo_models_are_race_free_in_eval_and_training(name, strategy):
    entry = _entry(name)
    model = torch_stage.multi_stream(zoo.build(entry), num_streams=4, strategy=strategy)
    for train in (False, True):
        with torch_stage.sanitize_streams() as sanitizer:
            _run(model, entry, train)
        assert sanitizer.races == []


@pytest.mark.parametrize("name", ["two_tower", "inception", "rec_8_towers"])
def test_every_wait_removal_that_breaks_a_dependency_is_reported(name):
    entry = _entry(name)
    model = torch_stage.multi_stream(zoo.build(entry), num_streams=4, strategy="min_sync")
    removals = waits(model)
    assert removals, "the plan has no waits to remove"
    reported = expected = 0
    for wait in removals:
        mutant, conflict = without_wait(model, wait)
        with torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
            _run(mutant, entry, train=False)
        found = [r for r in sanitizer.races if r.kind != "free while in use"]
        assert bool(found) == conflict, (wait, conflict, [str(r) for r in sanitizer.races])
        reported += bool(found)
        expected += conflict
    assert reported == expected > 0


# -- hazards of the stream runtime (../shared/research/gpu-review.md) --------


class _FailsOnASideStream(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x, y):
        with torch_stage.stream(1):
            v = self.b(y)
        return self.a(x) + v


def test_an_error_on_a_side_stream_restores_the_callers_stream_before_it_leaves():
    # gpu-review #5: the run was finished only when the failed frame died,
    # so an `except` block (an OOM retry) ran on side stream 1, unordered
    # with the caller's stream; kept exceptions kept it there.
    model = torch_stage.multi_stream(_FailsOnASideStream(), num_streams=2, strategy="user")
    x = torch.randn(4, 16)
    with torch_stage.sanitize_streams() as sanitizer:
        try:
            model(x, torch.randn(4, 7))
        except RuntimeError as e:
            kept = e
            assert sanitizer.current_stream() == "default"
            retried = model(x, torch.randn(4, 16))  # the retry's fork is the caller's
        assert sanitizer.current_stream() == "default"
        assert kept is not None and retried.shape == (4, 16)


class _TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        with torch_stage.stream(1):
            v = self.b(x)
        return self.a(x) + v


def test_staged_items_are_handed_over_with_a_wait():
    items = [torch.randn(16) for _ in range(4)]
    with torch_stage.sanitize_streams() as sanitizer:
        stage = torch_stage.staged(iter(items), device="cpu", stage_subgraph_stream_id=1)
        got = [t * 2 for t in stage]
    assert sanitizer.races == []
    assert [torch.equal(g, i * 2) for g, i in zip(got, items)] == [True] * 4


def test_staging_never_reuses_memory_that_multi_stream_training_freed():
    # gpu-review #2/#7: staging copies ran on pool stream 1, which also runs
    # the side-stream half of the model. A gradient made on stream 1 by
    # backward, read by the optimizer on the caller's stream and freed by
    # zero_grad goes back to stream 1's free list, where the next staging
    # allocation may take it while the optimizer's kernels are queued.
    torch.manual_seed(0)
    model = torch_stage.multi_stream(_TwoBranches(), num_streams=2, strategy="user")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gate = threading.Event()

    def source():
        yield torch.randn(4, 16)
        gate.wait(timeout=60)  # the next batch is staged after zero_grad
        yield torch.randn(4, 16)

    with torch_stage.sanitize_streams() as sanitizer:
        stage = torch_stage.staged(source(), device="cpu", stage_subgraph_stream_id=1, capacity=1)
        for batch in stage:
            model(batch).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            gate.set()
    assert sanitizer.races == []


class _Towers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.towers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True))
            for _ in range(3)
        )
        self.head = torch.nn.Linear(48, 1)

    def forward(self, x):
        h = [t(x) for t in self.towers]
        return self.head(torch.cat(h, dim=1)).sum()


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
        lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    ],
    ids=["sgd_foreach", "adam_fused"],
)
def test_compiled_training_steps_are_race_free_and_equal_eager(make_opt):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Towers()
    ours = copy.deepcopy(eager)
    backend = torch_stage.backend(num_streams=4, strategy="min_sync", executor="eager")
    opt_eager, opt_ours = make_opt(eager.parameters()), make_opt(ours.parameters())
    model = torch.compile(ours, backend=backend)

    @torch.compile(backend=backend)
    def step():
        opt_ours.step()

    batches = [torch.randn(8, 16) for _ in range(3)]
    with torch_stage.sanitize_streams() as sanitizer:
        for x in batches:
            model(x).backward()
            step()
            opt_ours.zero_grad()
    for x in batches:
        eager(x).backward()
        opt_eager.step()
        opt_eager.zero_grad()
    assert sanitizer.races == []
    # The forward and the optimizer step both got multi-stream plans.
    assert max(len(p.streams_used) for p in backend.plans) > 1
    for a, b in zip(eager.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b)
