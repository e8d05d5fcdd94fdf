"""The stream ops (torch.ops.torch_stage.fork/set_stream/record_event/
wait_event/record_stream/join, torch_stage/streams/fx/_ops.py) and plan_streams."""

import contextlib
import threading

import pytest
import torch
from conftest import caller_stream

import torch_stage  # noqa: F401
from torch_stage.streams.fx import _ops

ops = torch.ops.torch_stage


def test_a_cpu_run_is_inactive_but_checks_the_plan():
    run = ops.fork(3, [1, 2], 2, (torch.ones(2), 3, [torch.ones(1)]))
    assert not run.is_active()
    assert run.device() == "cpu"
    assert run.stream_ids() == []
    ops.set_stream(run, 2)
    ops.record_event(run, 0, 2)
    ops.set_stream(run, 0)
    ops.wait_event(run, 0, 0)
    ops.record_stream(run, (torch.ones(2), [torch.ones(1)], 3, None), 0)
    assert run.kept_tensors() == 0
    with pytest.raises(RuntimeError, match="waits on event 1, which has not been recorded"):
        ops.wait_event(run, 1, 0)
    with pytest.raises(RuntimeError, match="event 0 is recorded twice"):
        ops.record_event(run, 0, 1)
    with pytest.raises(
        ValueError, match=r"stream 3 is outside the pool of 3 streams \(valid: 0..2\)"
    ):
        ops.set_stream(run, 3)
    with pytest.raises(ValueError, match="event 5 does not exist"):
        ops.record_event(run, 5, 0)
    with pytest.raises(ValueError, match="stream 0 was not forked"):
        ops.join(run, [0])
    ops.join(run, [1, 2])
    with pytest.raises(RuntimeError, match="already joined"):
        ops.set_stream(run, 0)


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, [], 0), "num_streams must be in 1..32, got 0"),
        ((33, [], 0), "num_streams must be in 1..32, got 33"),
        ((2, [2], 0), r"side stream 2 is outside 1..1"),
        ((3, [1, 1], 0), "side stream 1 is listed twice"),
        ((2, [], -1), "num_events must be >= 0, got -1"),
    ],
)
def test_fork_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        ops.fork(*args, ())


def test_stream_ops_survive_fx_dead_code_elimination():
    for op in _ops.STREAM_OPS:
        assert op in torch.fx.node._side_effectful_functions
        if isinstance(op, torch._ops.OpOverloadPacket):
            assert op.default in torch.fx.node._side_effectful_functions
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    run = graph.call_function(_ops.fork, (2, [1], 1, (x,)))
    graph.call_function(_ops.set_stream, (run, 1))
    graph.call_function(_ops.record_event, (run, 0, 1))
    graph.call_function(_ops.wait_event, (run, 0, 0))
    graph.call_function(_ops.record_stream, (run, x, 0))
    graph.call_function(_ops.join, (run, []))
    graph.output(x)
    before = len(graph.nodes)
    assert not graph.eliminate_dead_code()
    assert len(graph.nodes) == before


def test_the_direct_path_and_the_ops_behave_alike():
    # Eagerly the pass's functions skip torch.ops (see _ops.py); both paths
    # must accept and refuse the same calls.
    x = torch.randn(3)
    for direct in (True, False):
        run = _ops.fork(3, [1, 2], 2, (x,))
        assert type(run) is torch_stage._C._StreamRun
        call = {f.__name__: f for f in _ops._FUNCTIONS}
        if not direct:
            run = run.script_object()
            assert isinstance(run, torch.ScriptObject)
            call = {name: getattr(torch.ops.torch_stage, name) for name in call}
        call["set_stream"](run, 1)
        call["record_event"](run, 0, 1)
        call["record_stream"](run, (x, None, [x, x]), 2)
        call["set_stream"](run, 2)
        call["wait_event"](run, 0, 2)
        with pytest.raises(RuntimeError, match="waits on event 1, which has not been recorded"):
            call["wait_event"](run, 1, 0)
        with pytest.raises(RuntimeError, match="waits on event 1, which has not been recorded"):
            call["sync"](run, -1, 0, [1], None)
        call["sync"](run, 1, 0, [0, 1], (x, [x], {"k": x}, 3))
        call["sync"](run, -1, 1, [], None)
        with pytest.raises(ValueError, match="stream 7 is outside the pool of 3"):
            call["set_stream"](run, 7)
        with pytest.raises(ValueError, match="stream 7 is outside the pool of 3"):
            call["sync"](run, -1, 7, [], None)
        with pytest.raises(RuntimeError, match="event 0 is recorded twice"):
            call["sync"](run, 0, 0, [], None)
        call["join"](run, [1, 2])
    # Anything but a run from fork goes to the op, which names the type.
    with pytest.raises(RuntimeError, match="to custom class type .*StreamRun"):
        _ops.set_stream(torch.classes.torch_stage.StagingArea(1), 0)


def _notes(program):
    """The StreamObserver notes ``program(run)`` makes, fork and join included."""
    notes = []
    torch_stage._C._set_stream_observer(
        lambda op, owner, stream, event, *rest: notes.append((op, stream, event))
    )
    try:
        run = _ops.fork(3, [1, 2], 2, (torch.randn(3),))
        program(run)
        _ops.join(run, [])
    finally:
        torch_stage._C._set_stream_observer(None)
    return notes


def test_sync_is_the_ops_it_fuses_in_order():
    # What the stream sanitizer and a profile see of one sync call is what
    # they saw of the separate ops it replaces (csrc/streams/stream_run.h).
    x = torch.randn(3)

    def fused(run):
        _ops.sync(run, -1, 1, [], None)
        _ops.sync(run, 0, 2, [0], (x,))
        _ops.sync(run, 1, 2, [], None)
        _ops.sync(run, -1, 0, [1, 0], None)

    def separate(run):
        _ops.set_stream(run, 1)
        _ops.record_event(run, 0, 1)
        _ops.set_stream(run, 2)
        _ops.wait_event(run, 0, 2)
        _ops.record_stream(run, (x,), 2)
        _ops.record_event(run, 1, 2)
        _ops.set_stream(run, 0)
        _ops.wait_event(run, 1, 0)
        _ops.wait_event(run, 0, 0)

    notes = _notes(fused)
    assert notes == _notes(separate)
    assert notes == [
        ("fork", 3, -1),
        ("set_stream", 1, -1),
        ("record_event", 1, 0),
        ("set_stream", 2, -1),
        ("wait_event", 2, 0),
        ("record_stream", 2, -1),
        ("record_event", 2, 1),
        ("set_stream", 0, -1),
        ("wait_event", 0, 1),
        ("wait_event", 0, 0),
        ("join", 0, -1),
    ]


def test_join_with_a_keep_is_record_stream_on_the_callers_stream_then_join():
    # The pass folds the sync that marked the outputs made on side streams
    # used on the caller's stream into join: every path of it does what
    # record_stream then join did.
    x = torch.randn(3)

    def notes_of(program):
        notes = []
        torch_stage._C._set_stream_observer(
            lambda op, owner, stream, event, *rest: notes.append((op, stream, event))
        )
        try:
            run = _ops.fork(3, [1, 2], 0, (x,))
            program(run)
        finally:
            torch_stage._C._set_stream_observer(None)
        return notes

    def separate(run):
        _ops.record_stream(run, (x,), 0)
        _ops.join(run, [1, 2])

    expected = notes_of(separate)
    assert expected[-2:] == [("record_stream", 0, -1), ("join", 0, -1)]
    assert notes_of(lambda run: _ops.join(run, [1, 2], (x,))) == expected  # C function
    assert notes_of(lambda run: run.join([1, 2], (x,))) == expected  # the run's method
    assert (
        notes_of(lambda run: torch.ops.torch_stage.join(run.script_object(), [1, 2], (x,)))
        == expected
    )
    # Without a keep, as before.
    assert notes_of(lambda run: _ops.join(run, [1, 2], None)) == expected[:-2] + expected[-1:]


def test_sync_takes_waits_as_a_list_or_a_tuple_and_refuses_anything_else():
    run = _ops.fork(2, [1], 2, (torch.ones(1),))
    run.sync(0, 1, [0], None)
    run.sync(1, 0, (1,), None)
    with pytest.raises(TypeError, match="waits must be a list of ints, got int"):
        run.sync(-1, 1, 0, None)
    run.join([])


def test_fx_retracing_a_rewritten_module_records_the_ops(planned_with_vm_costs):
    rewritten = torch_stage.multi_stream(_TwoBranches(), num_streams=2)
    ours = [n.target.__name__ for n in rewritten.graph.nodes if n.target in _ops._FUNCTIONS]
    assert ours == ["fork", "sync", "sync", "join"]
    retraced = torch.fx.symbolic_trace(rewritten)
    ops = [
        n.target
        for n in retraced.graph.nodes
        if isinstance(n.target, torch._ops.OpOverloadPacket) and n.target in _ops.STREAM_OPS
    ]
    assert [op.__name__ for op in ops] == ours
    x = torch.randn(2, 4)
    assert torch.equal(retraced(x), rewritten(x))


def _scripted_ops(x: torch.Tensor) -> torch.Tensor:
    run = torch.ops.torch_stage.fork(2, [1], 1, (x,))
    torch.ops.torch_stage.set_stream(run, 1)
    y = x * 2
    torch.ops.torch_stage.record_event(run, 0, 1)
    torch.ops.torch_stage.set_stream(run, 0)
    torch.ops.torch_stage.wait_event(run, 0, 0)
    torch.ops.torch_stage.record_stream(run, y, 0)
    z = y + x
    torch.ops.torch_stage.join(run, [])
    return z


def test_stream_ops_are_kept_in_place_by_torchscript_passes():
    scripted = torch.jit.script(_scripted_ops)
    x = torch.arange(4.0)
    assert torch.equal(scripted(x), x * 3)
    graph = scripted.graph
    torch._C._jit_pass_dce(graph)
    torch._C._jit_pass_cse(graph)
    torch._C._jit_pass_constant_propagation(graph)
    kinds = [n.kind() for n in graph.nodes() if n.kind().startswith("torch_stage::")]
    assert kinds == [
        "torch_stage::fork",
        "torch_stage::set_stream",
        "torch_stage::record_event",
        "torch_stage::set_stream",
        "torch_stage::wait_event",
        "torch_stage::record_stream",
        "torch_stage::join",
    ]
    # The multiply stays between the switch to stream 1 and its event.
    order = [n.kind() for n in graph.nodes()]
    assert order.index("aten::mul") > order.index("torch_stage::fork")
    assert order.index("aten::mul") < order.index("torch_stage::record_event")


def _plan(num_nodes, edges, strategy="min_sync", num_streams=2, **kwargs):
    fields = dict(
        cost=[1.0] * num_nodes,
        fixed=[-1] * num_nodes,
        colocation=[-1] * num_nodes,
        embedding_group=[-1] * num_nodes,
        sync_cost=0.0,
    )
    fields.update(kwargs)
    return ops.plan_streams(
        num_nodes,
        [u for u, _ in edges],
        [v for _, v in edges],
        [0] * len(edges),
        fields["cost"],
        fields["fixed"],
        fields["colocation"],
        fields["embedding_group"],
        strategy,
        num_streams,
        False,
        True,
        fields["sync_cost"],
    )


def test_plan_streams_plans_a_diamond():
    strategy, reason, plan = _plan(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    assert (strategy, reason) == ("min_sync", "requested")
    assert plan["stream"] == [0, 0, 1, 0]
    assert plan["event_node"] == [0, 2]
    assert plan["wait_node"] == [2, 3]
    assert plan["wait_event"] == [0, 1]
    assert plan["keep_node"] == [2, 3]
    assert plan["keep_producer"] == [0, 2]
    assert plan["fork"] == [1]
    assert plan["join"] == []
    assert plan["stats"] == [2, 2, 2]


def test_plan_streams_keeps_work_that_cannot_pay_for_its_events_on_one_stream():
    diamond = [(0, 1), (0, 2), (1, 3), (2, 3)]
    small = [1.0, 0.5, 0.5, 1.0]
    _, _, free = _plan(4, diamond, strategy="critical_path", cost=small)
    assert free["stream"] == [0, 0, 1, 0]
    _, _, paid = _plan(4, diamond, strategy="critical_path", cost=small, sync_cost=1.0)
    assert paid["stream"] == [0, 0, 0, 0]
    assert paid["fork"] == [] and paid["event_node"] == []
    big = [1.0, 10.0, 10.0, 1.0]
    _, _, worth = _plan(4, diamond, strategy="critical_path", cost=big, sync_cost=1.0)
    assert worth["stream"] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(num_nodes=2, edges=[(1, 0)]), ValueError, "edge 1 -> 0 does not go forward"),
        (
            dict(num_nodes=2, edges=[(0, 1)], sync_cost=-1.0),
            ValueError,
            "sync_cost must be a finite number >= 0, got -1",
        ),
        (
            dict(num_nodes=2, edges=[(0, 1)], strategy="fastest"),
            ValueError,
            "unknown strategy 'fastest'",
        ),
        (
            dict(num_nodes=2, edges=[(0, 1)], cost=[1.0, -2.0]),
            ValueError,
            "costs must be finite and >= 0",
        ),
        (dict(num_nodes=2, edges=[(0, 1)], cost=[1.0]), ValueError, "cost has 1 entries for 2"),
        (
            dict(num_nodes=2, edges=[(0, 1)], fixed=[0, 5]),
            ValueError,
            "node 1 is placed on stream 5, outside the pool of 2 streams",
        ),
        (dict(num_nodes=2, edges=[(0, 1)], num_streams=0), ValueError, "num_streams must be"),
    ],
)
def test_plan_streams_rejects_bad_input(kwargs, error, message):
    num_nodes = kwargs.pop("num_nodes")
    edges = kwargs.pop("edges")
    with pytest.raises(error, match=message):
        _plan(num_nodes, edges, **kwargs)


@pytest.mark.cuda
def test_a_cuda_run_uses_the_callers_stream_and_the_shared_pool():
    x = torch.ones(4, device="cuda")
    caller = caller_stream()
    with torch.cuda.stream(caller):
        run = ops.fork(4, [1, 2, 3], 1, (x,))
        assert run.is_active()
        assert run.device() == "cuda:0"
        ids = run.stream_ids()
        assert ids[0] == caller.stream_id
        assert len(set(ids)) == 4
        ops.set_stream(run, 2)
        assert torch.cuda.current_stream().stream_id == ids[2]
        y = x * 2
        ops.record_event(run, 0, 2)
        ops.set_stream(run, 0)
        ops.wait_event(run, 0, 0)
        ops.record_stream(run, [y, x.cpu()], 0)
        assert run.kept_tensors() == 1
        ops.join(run, [1, 3])
        assert torch.cuda.current_stream().stream_id == caller.stream_id
        # The same side streams serve every later run on the device.
        again = ops.fork(3, [1, 2], 0, (x,))
        assert again.stream_ids()[1:] == ids[1:3]
        ops.join(again, [1, 2])
    assert ops.stream_pool_size(torch.device("cuda:0")) >= 3
    # The compile backend's view of the same streams.
    for k in (1, 2, 3):
        sid, index, dtype = ops.side_stream(torch.device("cuda:0"), k)
        assert sid == ids[k] and index == 0
        assert torch.Stream(
            stream_id=sid, device_index=index, device_type=dtype
        ) == torch.cuda.Stream(stream_id=ids[k], device_index=0, device_type=dtype)
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)


@pytest.mark.parametrize("index", [0, 32, -1])
def test_side_stream_numbers_outside_the_pool_are_named(index):
    with pytest.raises(ValueError, match=f"side_stream: index must be in 1..31, got {index}"):
        ops.side_stream(torch.device("cpu"), index)


@pytest.mark.cuda
def test_an_abandoned_cuda_run_restores_the_callers_stream():
    x = torch.ones(4, device="cuda")
    before = torch.cuda.current_stream()

    def fail_midway():
        run = ops.fork(2, [1], 0, (x,))
        ops.set_stream(run, 1)
        assert torch.cuda.current_stream() != before
        raise KeyError("an op of the module failed")

    try:
        fail_midway()
    except KeyError:
        pass
    # Handled: the failed frame, and with it the run, is gone.
    assert torch.cuda.current_stream() == before


class _TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) * self.b(x)


def test_the_emitted_targets_are_c_functions_named_as_their_ops():
    # fork, sync, record_event and join run on every forward: C functions,
    # named and documented as the Python functions they replace, which FX
    # codegen, pickle and inspect find under torch_stage.streams.fx._ops.
    import inspect
    import pickle
    import types

    for f, params in [
        (_ops.fork, ["num_streams", "side_streams", "num_events", "probes"]),
        (_ops.sync, ["run", "record", "stream", "waits", "keep"]),
        (_ops.record_event, ["run", "event", "stream"]),
        (_ops.join, ["run", "side_streams", "keep"]),
    ]:
        assert isinstance(f, types.BuiltinFunctionType)
        assert (f.__module__, f.__qualname__) == ("torch_stage.streams.fx._ops", f.__name__)
        assert list(inspect.signature(f).parameters) == params
        assert pickle.loads(pickle.dumps(f)) is f
        assert torch.jit._builtins._find_builtin(f) == f"torch_stage::{f.__name__}"
    rewritten = torch_stage.multi_stream(_TwoBranches(), num_streams=2)
    x = torch.randn(2, 4)
    copy = pickle.loads(pickle.dumps(rewritten))
    assert torch.equal(copy(x), rewritten(x))


@pytest.mark.no_sanitizer
def test_what_the_inline_path_does_not_read_goes_the_general_way():
    # More waits than the inline path holds, a bool for an int, an int too
    # large: read by the general path, as before (errors included).
    run = _ops.fork(2, [1], 10, (torch.ones(1),))
    for e in range(9):
        _ops.record_event(run, e, e % 2)
    _ops.sync(run, 9, 1, list(range(10)), None)
    with pytest.raises(RuntimeError, match="event 9 is recorded twice"):
        _ops.record_event(run, 9, 0)
    _ops.sync(run, -1, True, [], None)  # stream 1, as torch.ops reads a bool
    with pytest.raises(OverflowError):
        _ops.sync(run, -1, 2**70, [], None)
    with pytest.raises(OverflowError):
        _ops.record_event(run, -(2**70), 0)
    # Ints of more than one CPython digit (30 bits) fit an int64 but not the
    # inline path's one-digit read.
    with pytest.raises(ValueError, match=f"stream {2**40} is outside the pool of 2 streams"):
        _ops.sync(run, -1, 2**40, [], None)
    with pytest.raises(ValueError, match=f"event {-(2**40)} does not exist"):
        _ops.record_event(run, -(2**40), 0)
    _ops.sync(run, -(2**40), 0, [], None)  # a negative record records nothing
    with pytest.raises(ValueError, match=f"stream {2**40} was not forked"):
        _ops.join(run, [2**40])
    _ops.join(run, [1])


# Unprofiled, a CPU run's sync, record_event and join take their inline
# path (StreamRun::sync_inactive, join_inactive); forked under a profiler,
# the general one: the same checks, the same errors.
@pytest.mark.parametrize("profiled", [True, pytest.param(False, marks=pytest.mark.no_sanitizer)])
def test_the_c_functions_check_their_arguments(profiled):
    with contextlib.ExitStack() as stack:
        if profiled:
            prof = stack.enter_context(
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            )
        _check_the_c_functions_arguments()
    if profiled:
        names = {e.name for e in prof.events()}
        assert {"torch_stage::sync", "torch_stage::record_event", "torch_stage::join"} <= names


def _check_the_c_functions_arguments():
    run = _ops.fork(2, [1], 1, (torch.ones(1),))
    assert type(run) is torch_stage._C._StreamRun
    with pytest.raises(TypeError, match="sync: record must be an int, got float"):
        _ops.sync(run, 1.5, 1, [], None)
    with pytest.raises(TypeError, match="sync: waits must be a list of ints, got int"):
        _ops.sync(run, -1, 1, 0, None)
    with pytest.raises(TypeError, match="sync: waits must be an int, got str"):
        _ops.sync(run, -1, 1, ["0"], None)
    with pytest.raises(ValueError, match="stream 2 is outside the pool of 2 streams"):
        _ops.sync(run, -1, 2, [], None)
    with pytest.raises(TypeError, match="fork: side_streams must be a list of ints, got int"):
        _ops.fork(2, 1, 1, (torch.ones(1),))
    with pytest.raises(ValueError, match="side stream 3 is outside 1..1"):
        _ops.fork(2, [3], 1, (torch.ones(1),))
    with pytest.raises(RuntimeError, match="waits on event 0, which has not been recorded"):
        _ops.sync(run, -1, 1, [0], None)
    _ops.sync(run, 0, 1, (0,), None)  # records event 0, then waits on it
    with pytest.raises(RuntimeError, match="event 0 is recorded twice"):
        _ops.sync(run, 0, 0, [], None)
    with pytest.raises(RuntimeError, match="event 0 is recorded twice"):
        _ops.record_event(run, 0, 0)
    with pytest.raises(ValueError, match="event 1 does not exist"):
        _ops.record_event(run, 1, 0)
    with pytest.raises(ValueError, match="stream -1 is outside the pool of 2 streams"):
        _ops.sync(run, -1, -1, [], None)
    errors = []

    def elsewhere():
        try:
            _ops.sync(run, -1, 0, [], None)
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "forked on another thread" in errors[0]
    with pytest.raises(TypeError, match="record_event: event must be an int, got NoneType"):
        _ops.record_event(run, None, 1)
    with pytest.raises(TypeError, match="the stream run holds no run"):
        _ops.join(torch_stage._C._StreamRun.__new__(torch_stage._C._StreamRun), [])
    with pytest.raises(ValueError, match="stream 0 was not forked by this run"):
        _ops.join(run, [0])
    with pytest.raises(TypeError, match="join: side_streams must be an int, got float"):
        _ops.join(run, [1.0])
    _ops.join(run, [1])
    with pytest.raises(RuntimeError, match="already joined"):
        _ops.join(run, [])


@pytest.mark.no_sanitizer
def test_fork_starts_a_joined_cpu_run_again_only_where_no_one_can_tell():
    # An eager forward on CPU forks and drops a run per call; fork starts the
    # last one again (same id) when nothing but fork's own slot holds it.
    x = torch.ones(1)
    run = _ops.fork(2, [1], 1, (x,))
    first = run.id()
    _ops.join(run, [1])
    del run
    again = _ops.fork(3, [1, 2], 2, (x,))
    assert again.id() == first
    # As a new run would be: three streams, no event recorded yet.
    with pytest.raises(RuntimeError, match="waits on event 1, which has not been recorded"):
        _ops.sync(again, 0, 2, [1], None)
    _ops.sync(again, 1, 0, [0, 1], None)
    with pytest.raises(RuntimeError, match="event 1 is recorded twice"):
        _ops.record_event(again, 1, 0)
    _ops.join(again, [1, 2])
    del again
    # Held by the caller, or as a ScriptObject: a new run.
    held = _ops.fork(2, [1], 0, (x,))
    assert held.id() == first
    other = _ops.fork(2, [1], 0, (x,))
    assert other.id() != first
    _ops.join(other, [1])
    _ops.join(held, [1])
    script = held.script_object()
    del held, other
    assert _ops.fork(2, [1], 0, (x,)).id() != first
    del script
    # Bad arguments are refused as ever, a run to start again or not.
    run = _ops.fork(2, [1], 0, (x,))
    _ops.join(run, [1])
    del run
    with pytest.raises(ValueError, match="num_streams must be in 1..32, got 0"):
        _ops.fork(0, [], 0, (x,))
    # Started again inside autocast, a run turns its weight cache off and
    # back on, as a new one does.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run = _ops.fork(2, [1], 0, (x,))
        assert not torch.is_autocast_cache_enabled()
        _ops.join(run, [1])
        assert torch.is_autocast_cache_enabled()
        del run
    # An observer tells runs apart by id: each forward gets a new one.
    ids = set()
    with torch_stage.sanitize_streams():
        for _ in range(2):
            run = _ops.fork(2, [1], 0, (x,))
            ids.add(run.id())
            _ops.join(run, [1])
            del run
    assert len(ids) == 2


@pytest.mark.no_sanitizer
def test_a_profiler_sees_the_calls_of_runs_forked_while_it_listens():
    # Whether anyone listens is asked once a run, at fork (StreamRun::
    # unprofiled): a run forked before the profiler started goes unseen to
    # its join, the next one is seen, a spare run started again included.
    x = torch.ones(1)
    before = _ops.fork(2, [1], 0, (x,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _ops.sync(before, -1, 1, [], None)
        _ops.join(before, [1])
        del before
        run = _ops.fork(2, [1], 1, (x,))
        _ops.sync(run, 0, 0, [0], None)
        _ops.join(run, [1])
        del run
    names = sorted(e.name for e in prof.events() if e.name.startswith("torch_stage::"))
    assert names == ["torch_stage::fork", "torch_stage::join", "torch_stage::sync"]


def test_the_profiler_sees_each_stream_op_of_an_eager_cpu_forward(planned_with_vm_costs):
    rewritten = torch_stage.multi_stream(_TwoBranches(), num_streams=2)
    x = torch.randn(2, 4)
    rewritten(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rewritten(x)
    names = sorted(e.name for e in prof.events() if e.name.startswith("torch_stage::"))
    assert names == [
        "torch_stage::fork",
        "torch_stage::join",
        "torch_stage::sync",
        "torch_stage::sync",
    ]


def test_calls_the_c_functions_do_not_take_go_through_the_ops():
    # Keywords, a ScriptObject run: the Python functions, so the op, as before.
    run = _ops.fork(num_streams=2, side_streams=[1], num_events=1, probes=(torch.ones(1),))
    assert type(run) is torch_stage._C._StreamRun
    _ops.sync(run, record=-1, stream=1, waits=[], keep=None)
    _ops.record_event(run, event=0, stream=1)
    _ops.join(run=run, side_streams=[1])
    script_run = ops.fork(2, [1], 1, (torch.ones(1),))
    _ops.sync(script_run, -1, 1, [], (torch.ones(1),))
    _ops.record_event(script_run, 0, 1)
    _ops.sync(script_run, -1, 0, [0], None)
    _ops.join(script_run, [1])
    with pytest.raises(RuntimeError, match="already joined"):
        ops.set_stream(script_run, 0)


def test_a_torch_function_mode_sees_every_stream_op_of_a_forward(planned_with_vm_costs):
    # A mode active while forward runs is an override the C functions defer
    # to: fork makes the op's run, and every stream op reaches the mode.
    from torch.overrides import TorchFunctionMode

    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if str(func).startswith("torch_stage."):
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    module = _TwoBranches()
    rewritten = torch_stage.multi_stream(module, num_streams=2)
    x = torch.randn(2, 4)
    with Record():
        got = rewritten(x)
    assert torch.equal(got, module(x))
    assert seen == [
        "torch_stage.fork",
        "torch_stage.sync",
        "torch_stage.sync",
        "torch_stage.join",
    ]


def test_dynamo_over_a_rewritten_module_equals_eager():
    torch._dynamo.reset()
    module = _TwoBranches()
    rewritten = torch_stage.multi_stream(module, num_streams=2)
    x = torch.randn(2, 4)
    compiled = torch.compile(rewritten, backend="eager")
    assert torch.equal(compiled(x), module(x))
    assert torch.equal(compiled(x), module(x))
    torch._dynamo.reset()


def test_fork_under_torch_export_makes_the_op_run(monkeypatch):
    # torch.export's non-strict tracing sets torch.compiler's flag (what
    # torch.compiler.is_compiling() returns); fork then calls the op.
    assert type(_ops.fork(2, [1], 0, (torch.ones(1),))) is torch_stage._C._StreamRun
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True, raising=False)
    assert torch.compiler.is_compiling()
    run = _ops.fork(2, [1], 0, (torch.ones(1),))
    assert isinstance(run, torch.ScriptObject)
    _ops.join(run, [1])
