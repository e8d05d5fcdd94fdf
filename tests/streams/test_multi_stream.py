"""torch_stage.multi_stream, stream and colocate_with (torch_stage/streams/multi_stream.py)
over the model zoo (tests/zoo.py): results equal the original module's
(bit for bit on CPU; on a GPU with random delays on side streams), plans
as expected, scripting, and real overlap on a GPU."""

import random
import warnings

import pytest
import torch
from conftest import caller_stream, vm_costs
from stream_oracle import with_side_stream_delays
from torch import nn
from zoo import ZOO, build

import torch_stage
from torch_stage.streams.fx import _ops
from torch_stage.streams.fx.host_cost import HostCosts, planning_with

ENTRIES = {e.name: e for e in ZOO}


def run(module, inputs, seed=7):
    torch.manual_seed(seed)
    if any(t.is_cuda for t in inputs):
        torch.cuda.manual_seed(seed)
    return module(*[t.clone() for t in inputs])


def cases():
    for entry in ZOO:
        for strategy in torch_stage.STRATEGIES:
            for num_streams in (1, 2, 4):
                if entry.name == "two_tower" and num_streams == 1:
                    continue  # annotated with stream(1): needs two streams
                yield pytest.param(
                    entry, strategy, num_streams, id=f"{entry.name}-{strategy}-{num_streams}"
                )


@pytest.fixture
def verified(monkeypatch):
    """Debug mode: every plan is replayed by the C++ verifier."""
    monkeypatch.setenv("TORCH_STAGE_VERIFY", "1")


@pytest.mark.parametrize("entry, strategy, num_streams", cases())
@pytest.mark.parametrize("with_examples", [False, True], ids=["traced", "examples"])
def test_zoo_results_are_bit_identical_on_cpu(
    verified, entry, strategy, num_streams, with_examples
):
    module = build(entry)
    inputs = entry.inputs(4, "cpu")
    rewritten = torch_stage.multi_stream(
        module,
        num_streams=num_streams,
        strategy=strategy,
        example_inputs=inputs if with_examples else None,
    )
    assert isinstance(rewritten, torch.fx.GraphModule)
    for seed in (1, 2):
        assert torch.equal(run(rewritten, inputs, seed), run(module, inputs, seed))
    plan = rewritten.stream_plan
    assert plan.strategy != "auto"
    assert all(0 <= s < num_streams for s in plan.assignment.values())


def test_two_tower_regression_runs_x_on_stream_0_and_y_on_stream_1(verified):
    for strategy in torch_stage.STRATEGIES:
        gm = torch_stage.multi_stream(build(ENTRIES["two_tower"]), num_streams=2, strategy=strategy)
        plan = gm.stream_plan
        for name, s in plan.assignment.items():
            if name.startswith("x_") or name == "relu":
                assert s == 0, (strategy, name)
            if name.startswith("y_") or name == "relu_1":
                assert s == 1, (strategy, name)
        assert len(plan.events) == 1 and len(plan.waits) == 1, strategy


@pytest.mark.parametrize("name", ["plain_chain", "residual_mlp"])
def test_chains_get_one_stream_and_no_events(verified, name):
    for strategy in torch_stage.STRATEGIES:
        gm = torch_stage.multi_stream(build(ENTRIES[name]), num_streams=4, strategy=strategy)
        plan = gm.stream_plan
        assert plan.streams_used == [0], strategy
        assert plan.events == [] and plan.waits == [] and plan.fork == [], strategy
        assert "torch_stage" not in gm.code


def test_inception_branches_get_a_stream_each(verified):
    gm = torch_stage.multi_stream(build(ENTRIES["inception"]), num_streams=4, strategy="min_sync")
    plan = gm.stream_plan
    assert plan.strategy == "min_sync"
    assert plan.streams_used == [0, 1, 2, 3]
    branch_streams = {plan.assignment[n] for n in ("b1", "b2", "b3_b", "b4")}
    assert len(branch_streams) == 4
    # The stem is the input; the concat waits on three branches, once each.
    assert len(plan.events) == 3 and len(plan.waits) == 3
    assert [w.node for w in plan.waits] == ["cat"] * 3
    assert plan.join == []


def test_by_default_a_branch_that_ends_before_the_longest_shares_a_stream(verified):
    # Without shapes every kernel costs alike: the two-conv branch and b1
    # together end before the three-conv branch, so a stream of their own
    # would only add calls.
    with planning_with(HostCosts.free()):
        free = torch_stage.multi_stream(build(ENTRIES["inception"]), num_streams=4).stream_plan
    assert len({free.assignment[n] for n in ("b1", "b2", "b3_b", "b4")}) == 4
    with planning_with(vm_costs()):
        plan = torch_stage.multi_stream(build(ENTRIES["inception"]), num_streams=4).stream_plan
    assert plan.strategy == "min_sync"
    assert plan.assignment["b1"] == plan.assignment["b2"] == 0
    assert len({plan.assignment[n] for n in ("b1", "b3_b", "b4")}) == 3
    assert plan.note.startswith("side streams merged where their calls cost more than")
    assert plan.estimate.pays
    assert [w.node for w in plan.waits] == ["cat"] * 2


def test_rec_model_puts_each_lookup_on_a_stream_round_robin(verified):
    # The strategy's placement, before the pay rule (tested with given costs
    # in tests/streams/fx/test_fx_host_cost.py): with the calls measured on
    # a loaded machine, it merged a side stream.
    with planning_with(HostCosts.free()):
        gm = torch_stage.multi_stream(build(ENTRIES["rec_8_towers"]), num_streams=4)
    plan = gm.stream_plan
    assert plan.strategy == "embedding"
    assert plan.reason == "auto: two or more embedding lookups"
    for i in range(8):
        assert plan.assignment[f"tables_{i}"] == i % 4
        assert plan.assignment[f"projections_{i}"] == i % 4
    assert plan.assignment["cat"] == 0


def test_auto_picks_critical_path_when_costs_are_known(verified):
    entry = ENTRIES["inception"]
    gm = torch_stage.multi_stream(
        build(entry), num_streams=4, example_inputs=entry.inputs(2, "cpu")
    )
    assert gm.stream_plan.strategy == "critical_path"
    gm = torch_stage.multi_stream(build(entry), num_streams=4, cost_model=lambda n: 2.0)
    assert gm.stream_plan.strategy == "critical_path"


@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_the_rewritten_zoo_scripts_saves_and_loads(entry, tmp_path):
    module = build(entry).eval()
    inputs = entry.inputs(4, "cpu")
    rewritten = torch_stage.multi_stream(module, num_streams=4)
    scripted = torch.jit.script(rewritten)
    path = tmp_path / f"{entry.name}.pt"
    scripted.save(str(path))
    loaded = torch.jit.load(str(path))
    expected = run(module, inputs)
    assert torch.equal(run(scripted, inputs), expected)
    assert torch.equal(run(loaded, inputs), expected)
    # The stream ops survive freezing and inference optimisation.
    emitted = sum(n.target in _ops.STREAM_OPS for n in rewritten.graph.nodes)
    frozen = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.script(rewritten).eval()))
    kept = [n for n in frozen.graph.nodes() if n.kind().startswith("torch_stage::")]
    assert len(kept) == emitted


# Not under the sanitizer: torch.jit.trace cannot record under a dispatch
# mode (it refuses), and a traced module of this zoo cannot run under one
# (torch's own limit: a plain trace of in_place, without torch_stage, fails
# under a do-nothing TorchDispatchMode in aten::equal). The stream ops the
# trace holds are checked to be the rewritten module's, in its order, and
# that module's plan is sanitized by the tests above.
@pytest.mark.no_sanitizer
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_the_rewritten_zoo_traces_with_torch_jit_trace_saves_and_loads(entry, tmp_path):
    # torch.jit.trace records the stream ops too (their Any arguments have
    # Tensor[] variants the tracer can record), so a traced module runs on
    # the plan's streams as a scripted one does.
    module = build(entry).eval()
    inputs = entry.inputs(4, "cpu")
    rewritten = torch_stage.multi_stream(module, num_streams=4)
    if not any(n.target in _ops.STREAM_OPS for n in rewritten.graph.nodes):
        pytest.skip("a chain: the plan needs one stream")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(rewritten, tuple(t.clone() for t in inputs), check_trace=False)
    path = tmp_path / f"{entry.name}.pt"
    traced.save(str(path))
    loaded = torch.jit.load(str(path))
    expected = run(module, inputs)
    assert torch.equal(run(traced, inputs), expected)
    assert torch.equal(run(loaded, inputs), expected)
    kinds = [n.kind() for n in loaded.inlined_graph.nodes()]
    emitted = [n.target.__name__ for n in rewritten.graph.nodes if n.target in _ops.STREAM_OPS]
    ours = [k.split("::")[1] for k in kinds if k.startswith("torch_stage::")]
    assert [k.removesuffix("_traced") for k in ours] == emitted


def test_stream_ops_survive_fx_dead_code_elimination():
    gm = torch_stage.multi_stream(build(ENTRIES["inception"]), num_streams=4)
    before = [n.name for n in gm.graph.nodes if n.target in _ops.STREAM_OPS]
    assert before
    gm.graph.eliminate_dead_code()
    assert [n.name for n in gm.graph.nodes if n.target in _ops.STREAM_OPS] == before


class DataDependent(nn.Module):
    def forward(self, x):
        if x.mean() > 0:
            return x.exp()
        return x.sin()


def test_an_untraceable_module_gets_an_error_that_says_what_to_do():
    with pytest.raises(torch_stage.MultiStreamTraceError) as info:
        torch_stage.multi_stream(DataDependent())
    message = str(info.value)
    assert "could not trace DataDependent with torch.fx" in message
    assert "TraceError" in message and "without example inputs" in message
    assert "example_inputs=(...)" in message
    assert 'torch.compile(model, backend="torch_stage")' in message
    x = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = torch_stage.multi_stream(DataDependent(), example_inputs=(x,))
    assert torch.equal(gm(x), x.exp())


def test_bad_annotations_keep_their_own_error():
    entry = ENTRIES["two_tower"]
    with pytest.raises(
        ValueError, match=r"stream id 1 is outside the pool of 1 streams \(valid ids: 0..0\)"
    ):
        torch_stage.multi_stream(build(entry), num_streams=1)


def test_example_inputs_of_the_wrong_length_are_rejected():
    entry = ENTRIES["inception"]
    x = entry.inputs(2, "cpu")[0]
    with pytest.raises(ValueError, match=r"example_inputs has 2 values, but forward takes 1 \(x\)"):
        torch_stage.multi_stream(build(entry), example_inputs=(x, x))


def test_public_names():
    assert torch_stage.__all__ == sorted(torch_stage.__all__)
    for name in ("colocate_with", "multi_stream", "stream", "MAX_STREAMS", "STRATEGIES"):
        assert name in torch_stage.__all__
    assert torch_stage.MAX_STREAMS == 32


# -- GPU ------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_zoo_is_bit_identical_on_gpu_with_random_delays_on_side_streams(entry):
    random.seed(0)
    module = build(entry, "cuda")
    inputs = entry.inputs(16, "cuda")
    gm = with_side_stream_delays(torch_stage.multi_stream(module, num_streams=4))
    _equals_eager_on_a_caller_stream(gm, module, inputs, calls=100)


def _equals_eager_on_a_caller_stream(planned, module, inputs, calls):
    """``planned`` gives ``module``'s results bit for bit, ``calls`` times
    (seeded), called on a stream of the caller's that it leaves current."""
    caller = caller_stream()
    with torch.cuda.stream(caller):
        for i in range(calls):
            expected = run(module, inputs, seed=i)
            got = run(planned, inputs, seed=i)
            assert torch.cuda.current_stream() == caller
            assert torch.equal(got, expected), f"iteration {i}"


@pytest.mark.cuda
@pytest.mark.parametrize(
    "how",
    # torch.jit.trace refuses under torch_stage's sanitizer, and a trace
    # cannot be made under any dispatch mode (CSAN's included).
    ["script", pytest.param("jit_trace", marks=pytest.mark.no_sanitizer)],
)
@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_the_scripted_and_traced_zoo_equal_eager_on_gpu_after_save_and_load(entry, how, tmp_path):
    # The stream ops in TorchScript (the scripted ops, or the _traced ones
    # jit.trace records) switch real streams and wait on real events.
    module = build(entry, "cuda").eval()
    inputs = entry.inputs(16, "cuda")
    rewritten = torch_stage.multi_stream(module, num_streams=4)
    if how == "script":
        compiled = torch.jit.script(rewritten)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            compiled = torch.jit.trace(
                rewritten, tuple(t.clone() for t in inputs), check_trace=False
            )
    path = tmp_path / f"{entry.name}.pt"
    compiled.save(str(path))
    loaded = torch.jit.load(str(path), map_location="cuda")
    _equals_eager_on_a_caller_stream(loaded, module, inputs, calls=20)


@torch.fx.wrap
def _spin(x: torch.Tensor, cycles: int) -> torch.Tensor:
    torch.cuda._sleep(cycles)
    return x + 1


class TwoSleepers(nn.Module):
    def __init__(self, cycles: int):
        super().__init__()
        self.cycles = cycles

    def forward(self, x):
        return _spin(x, self.cycles) + _spin(x, self.cycles)


def _elapsed_ms(fn) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


@pytest.mark.cuda
def test_two_sleeping_branches_overlap_on_two_streams():
    x = torch.ones(1, device="cuda")
    probe = 50_000_000
    _elapsed_ms(lambda: torch.cuda._sleep(probe))
    per_ms = probe / _elapsed_ms(lambda: torch.cuda._sleep(probe))
    cycles = int(per_ms * 100)  # about 100 ms per branch
    t = min(_elapsed_ms(lambda: _spin(x, cycles)) for _ in range(3))
    module = TwoSleepers(cycles)
    two = torch_stage.multi_stream(module, num_streams=2, strategy="min_sync")
    one = torch_stage.multi_stream(module, num_streams=1)
    assert two.stream_plan.streams_used == [0, 1]
    for fn in (two, one):
        fn(x)
    t_two = min(_elapsed_ms(lambda: two(x)) for _ in range(3))
    t_one = min(_elapsed_ms(lambda: one(x)) for _ in range(3))
    assert t_two <= 1.3 * t, (t_two, t)
    assert t_one >= 1.8 * t, (t_one, t)
    assert torch.equal(two(x), one(x))
