"""The bad-input matrix: bad values across the public API, each call made in
a forked child, must raise a clear error of the documented type that names
the bad value, never crash or hang.

Every case is one call written as a Python expression (capacities, thread
counts, timeouts, devices, stream ids, exception types, feature specs,
record files, Example bytes, DataLoader arguments, dataset types), the
exception type its docstring documents, and the text its message must hold
(the bad value, and where there is one the argument's name). A few cases
are values at the edge of the valid range (huge timeouts, a shuffle pool
larger than the data): they must be honoured, or refused with a clear
error, and never crash.

A case runs in a child forked from the scenario's process, before any
torch_stage thread exists there, under a hard timeout: a child that
outlives it is killed and counted as a hang, one killed by a signal (or
gone without a report) as a crash. The child reports through a pipe the
exception's type and message, after closing what the call made (a close
that hangs is the case's hang), and leaves with ``os._exit``. Children run
one at a time.

Loader cases (``plain=True``) are evaluated twice in the same child: with
``DataLoader`` bound to torch.utils.data.DataLoader, then to
torch_stage.DataLoader, which is a drop-in and must raise an exception of
the plain class's type.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from reliability.harness import check, scenario

# A bad call answers in milliseconds; this bounds a hang, it is no speed limit.
CASE_TIMEOUT_S = 20.0
_MESSAGE_LIMIT = 1500
BIG = 2**64  # past the C++ side's int64 (and uint64)
HUGE = 2**40  # within int64, beyond any memory or thread count
INT64_MAX = 2**63 - 1


@dataclass
class Case:
    """One call, ``code``, evaluated in the namespace of :func:`_namespace`.

    It must raise an instance of one of ``expect`` (exception class names
    in that namespace) whose message holds every string of ``text``. With
    ``expect`` empty the call must succeed (its helper fails a ``check``
    when the value was not honoured); with ``may_succeed`` either is fine.
    ``plain``: the same code with torch.utils.data.DataLoader as
    ``DataLoader`` raises first, and the call must raise its type.
    """

    code: str
    expect: Tuple[str, ...]
    text: Tuple[str, ...]
    plain: bool = False
    may_succeed: bool = False


def case(code: str, expect, *text: str, plain: bool = False, may_succeed: bool = False) -> Case:
    expect = () if expect is None else (expect,) if isinstance(expect, str) else tuple(expect)
    return Case(code, expect, text, plain, may_succeed)


V, T = "ValueError", "TypeError"
FILE, CORRUPT = "RecordFileError", "CorruptRecordError"

MATRIX: List[Case] = [
    # -- StagingArea: capacities, byte limits, timeouts, bundles
    case("StagingArea(0)", V, "capacity", "0"),
    case("StagingArea(-1)", V, "capacity", "-1"),
    case("StagingArea(1.5)", T, "capacity", "1.5"),
    case("StagingArea(True)", T, "capacity", "True"),
    case("StagingArea('4')", T, "capacity", "'4'"),
    case("StagingArea(None)", T, "capacity", "None"),
    case("StagingArea(BIG)", V, "capacity", str(BIG)),
    case("StagingArea(2, byte_limit=-1)", V, "byte_limit", "-1"),
    case("StagingArea(2, byte_limit=BIG)", V, "byte_limit", str(BIG)),
    case("StagingArea(2).try_take(-1)", V, "timeout_ms", "-1"),
    case("StagingArea(2).try_take(0.5)", T, "timeout_ms", "0.5"),
    case("StagingArea(2).try_take(BIG)", V, "timeout_ms", str(BIG)),
    case("StagingArea(2).try_put([torch.zeros(1)], '10')", T, "timeout_ms", "'10'"),
    case("StagingArea(2).put(torch.zeros(1))", T, "Tensor"),
    case("StagingArea(2).put([1, 2])", T, "element 0", "int"),
    case("StagingArea(2, byte_limit=16).put([torch.zeros(64)])", V, "256", "16"),
    case("try_take_waits(timeout_ms=INT64_MAX)", None),
    # -- staged(): capacities, thread counts, timeouts, devices, stream ids
    case("staged([1, 2], capacity=0)", V, "capacity", "0"),
    case("staged([1, 2], capacity=True)", T, "capacity", "True"),
    case("staged([1, 2], capacity=BIG)", V, "capacity", str(BIG)),
    case("staged([1, 2], num_threads=0)", V, "num_threads", "0"),
    case("staged([1, 2], num_threads=2.0)", T, "num_threads", "2.0"),
    case("staged([1, 2], num_threads=HUGE)", V, "num_threads", str(HUGE)),
    case("staged([1, 2], num_clients=-3)", V, "num_clients", "-3"),
    case("staged([1, 2], num_clients=None)", T, "num_clients", "None"),
    case("staged([1, 2], timeout_millis=0)", V, "timeout_millis", "0"),
    case("staged([1, 2], timeout_millis=-5)", V, "timeout_millis", "-5"),
    case("staged([1, 2], timeout_millis=1.5)", T, "timeout_millis", "1.5"),
    case("staged([1, 2], timeout_millis=BIG)", V, "timeout_millis", str(BIG)),
    case("stage_waits(timeout_millis=INT64_MAX)", None),
    case("staged([1, 2], put_timeout_millis=0)", V, "put_timeout_millis", "0"),
    case("staged([1, 2], put_timeout_millis=-1)", V, "put_timeout_millis", "-1"),
    case("staged([1, 2], put_timeout_millis=BIG)", V, "put_timeout_millis", str(BIG)),
    case("staged([1, 2], device='cuda:99')", V, "device", "'cuda:99'"),
    case("staged([1, 2], device='gpu')", V, "device", "'gpu'"),
    case("staged([1, 2], device=3.5)", V, "device", "3.5"),
    case("staged([1, 2], device=-1)", V, "device", "-1"),
    case("staged([1, 2], stage_subgraph_stream_id=-1)", V, "stage_subgraph_stream_id", "-1"),
    case("staged([1, 2], stage_subgraph_stream_id=32)", V, "stage_subgraph_stream_id", "32"),
    case("staged([1, 2], stage_subgraph_stream_id=1.0)", T, "stage_subgraph_stream_id", "1.0"),
    case(
        "staged([1, 2], use_stage_subgraph_thread_pool=True, stage_subgraph_thread_pool_id=7)",
        V,
        "stage_subgraph_thread_pool_id",
        "7",
    ),
    # -- exception-type arguments that are not exception classes
    case("staged([1, 2], closed_exception_types=(int,))", T, "closed_exception_types", "int"),
    case("staged([1, 2], closed_exception_types=KeyError('k'))", T, "KeyError('k')"),
    case("staged([1, 2], ignored_exception_types='ValueError')", T, "'ValueError'"),
    case("staged([1, 2], ignored_exception_types=(KeyError, 3))", T, "got 3"),
    # -- other staged() arguments and Stage state
    case("staged([1, 2], name='')", V, "name", "''"),
    case("staged([1, 2], name=3)", T, "name", "int"),
    case("staged([1, 2], ordered='no')", T, "ordered", "'no'"),
    case("staged([1, 2], device='meta')", V, "device", "'meta'"),
    case("staged([1, 2], transform=5)", T, "transform", "int"),
    case("staged(5)", T, "source", "int"),
    case("staged(lambda: 1, feed_dict={1: 2})", T, "feed_dict", "{1: 2}"),
    case("staged([1, 2]).load_state_dict('state')", V, "'state'"),
    case("staged([1, 2]).load_state_dict(stage_state(position=-1))", V, "position", "-1"),
    case("staged(iter([1, 2])).state_dict()", T, "list_iterator"),
    # -- add_stage_thread_pool
    case("add_stage_thread_pool(0)", V, "inter_op_threads", "0"),
    case("add_stage_thread_pool(1, -1)", V, "intra_op_threads", "-1"),
    case("add_stage_thread_pool(1, HUGE)", V, "intra_op_threads", str(HUGE)),
    case("add_stage_thread_pool(1, 1, 5)", T, "global_name", "int"),
    # -- stream ids
    case("stream(-1)", V, "-1"),
    case("stream(32)", V, "32"),
    case("stream(1.5)", T, "1.5"),
    case("stream(True)", T, "True"),
    case("stream('0')", T, "'0'"),
    case("multi_stream(towers(stream=3), num_streams=2)", V, "stream(3)", "2 streams"),
    # -- multi_stream, colocate_with, backend, CUDA graphs
    case("multi_stream(towers(), num_streams=0)", V, "num_streams", "0"),
    case("multi_stream(towers(), num_streams=33)", V, "num_streams", "33"),
    case("multi_stream(towers(), num_streams=2.5)", T, "num_streams", "2.5"),
    case("multi_stream(towers(), strategy='fastest')", V, "strategy", "'fastest'"),
    case("multi_stream(towers(), strategy=None)", V, "strategy", "None"),
    case("multi_stream(towers(), warmup=0)", V, "warmup", "0"),
    case("multi_stream(towers(), cuda_graphs='yes')", T, "cuda_graphs", "'yes'"),
    case("multi_stream(towers(), cost_model=5)", T, "cost_model", "int"),
    case("multi_stream(towers(), example_inputs=5)", T, "example_inputs", "int"),
    case("multi_stream(5)", T, "int"),
    case("colocate_with(5)", T, "int"),
    case("backend(num_streams=0)", V, "num_streams", "0"),
    case("backend(no_such_option=1)", V, "'no_such_option'"),
    # -- sanitize_streams
    case("sanitize_streams(raise_on_race='yes')", T, "raise_on_race", "'yes'"),
    case("sanitize_streams(stacks=1)", T, "stacks", "1"),
    # -- feature specs
    case("FixedLenFeature((), torch.float64)", T, "dtype", "torch.float64"),
    case("FixedLenFeature((2,), 'int64')", T, "dtype", "'int64'"),
    case("FixedLenFeature((-1,), torch.int64)", V, "shape", "-1"),
    case("FixedLenFeature('3', torch.int64)", T, "shape", "'3'"),
    case("FixedLenFeature((HUGE, HUGE), torch.int64)", V, "shape", str(HUGE)),
    case("FixedLenFeature((2,), torch.int64, default_value=[1, 2, 3])", V, "3", "(2,)"),
    case("FixedLenFeature((4,), torch.uint8, default_value=b'abc')", V, "3 bytes", "(4,)"),
    case("FixedLenFeature((), torch.int64, default_value=1.5)", T, "default_value", "1.5"),
    case("FixedLenFeature((), torch.int64, default_value=BIG)", V, "default_value", str(BIG)),
    case("VarLenFeature(torch.int32)", T, "dtype", "torch.int32"),
    case("VarLenFeature(torch.int64, default_value='x')", T, "default_value", "'x'"),
    case("VarLenFeature(torch.int64, default_value=[1, BIG])", V, "default_value", str(BIG)),
    case("parse_example([env.example], {})", T, "features"),
    case("parse_example([env.example], {'x': 'int'})", T, "'x'", "'int'"),
    # -- Example bytes
    case("parse_example([b'\\xff\\xfe\\xfd garbage'], env.spec)", "ExampleParseError", "record 0"),
    case(
        "parse_example([env.example, env.example[:-3]], env.spec)", "ExampleParseError", "record 1"
    ),
    case(
        "parse_example([env.example], {'x': FixedLenFeature((2,), torch.float32)})",
        "FeatureError",
        "'x'",
        "Int64List",
    ),
    case(
        "parse_example([env.example], {'x': FixedLenFeature((3,), torch.int64)})",
        "FeatureError",
        "'x'",
        "3",
    ),
    case(
        "parse_example([env.example], {'y': FixedLenFeature((), torch.int64)})",
        "FeatureError",
        "'y'",
    ),
    case("parse_example(['abc'], env.spec)", T, "records[0]", "str"),
    case("parse_example(env.example, env.spec)", T, "records", "bytes"),
    case(
        "parse_example(RecordBatch(torch.zeros(8).byte(), torch.tensor([0, 6, 2])), env.spec)",
        V,
        "offsets",
        "6",
        "2",
    ),
    case("encode_example({'x': object()})", T, "'x'", "object"),
    case("encode_example({'x': []})", V, "'x'", "empty list"),
    case("encode_example({'x': ([1], torch.float64)})", T, "'x'", "torch.float64"),
    case("encode_example({'x': [1, BIG]})", V, "'x'", str(BIG)),
    case("encode_example('x')", T, "features", "str"),
    # -- record files
    case("read_records(env.missing)", FILE, "missing.tfrecord"),
    case("read_records(env.nomatch)", FILE, "*.nomatch"),
    case("list(read_records(env.directory))", FILE, "a_directory.tfrecord"),
    case("list(read_records(env.garbage))", CORRUPT, "garbage.tfrecord", "record 0"),
    case("list(read_records(env.good, compression='GZIP'))", CORRUPT, "good.tfrecord", "GZIP"),
    case("read_records(env.good, compression='BZIP2')", V, "compression", "'BZIP2'"),
    case("read_records(env.good, compression=1)", V, "compression", "1"),
    case("read_records(env.good, batch_size=0)", V, "batch_size", "0"),
    case("read_records(5)", T, "path_or_pattern", "5"),
    case("read_records([])", T, "path_or_pattern", "[]"),
    case("read_records(env.good + '\\0.bak')", V, "NUL", "good.tfrecord"),
    case("RecordWriter(env.directory)", FILE, "a_directory.tfrecord"),
    case("RecordWriter(env.unwritable)", FILE, "no_such_dir"),
    case("RecordWriter(env.out, compression='lz4')", V, "compression", "'lz4'"),
    case("RecordWriter(env.out + '\\0.bak')", V, "NUL", "out.tfrecord"),
    case("RecordWriter(5)", T, "path", "int"),
    case("RecordWriter(env.out).write('text')", T, "str"),
    case("RecordInput(env.missing)", FILE, "missing.tfrecord"),
    case("RecordInput(env.nomatch)", FILE, "*.nomatch"),
    case("next(RecordInput(env.directory, epochs=1))", FILE, "a_directory.tfrecord"),
    case("next(RecordInput(env.garbage, epochs=1))", CORRUPT, "garbage.tfrecord"),
    case("RecordInput(env.good, shard=(2, 2))", V, "shard", "(2, 2)"),
    case("RecordInput(env.good, shard=(0, 0))", V, "shard", "(0, 0)"),
    case("RecordInput(env.good, shard=(-1, 2))", V, "shard", "(-1, 2)"),
    case("RecordInput(env.good, shard=3)", T, "shard", "3"),
    case("RecordInput(env.good, shard=(1, 2))", V, "shard (1, 2)", "1 matched"),
    case("RecordInput(env.good, seed=-1)", V, "seed", "-1"),
    case("RecordInput(env.good, seed=BIG)", V, "seed", str(BIG)),
    case("RecordInput(env.good, seed=1.5)", T, "seed", "1.5"),
    case("RecordInput(env.good, shift_ratio=1.0)", V, "shift_ratio", "1.0"),
    case("RecordInput(env.good, shift_ratio=float('nan'))", V, "shift_ratio", "nan"),
    case("RecordInput(env.good, parallelism=0)", V, "parallelism", "0"),
    case("RecordInput(env.good, parallelism=BIG)", V, "parallelism", str(BIG)),
    case("RecordInput(env.good, buffer_size=-1)", V, "buffer_size", "-1"),
    case("RecordInput(env.good, batch_size=0)", V, "batch_size", "0"),
    case("RecordInput(env.good, epochs=0)", V, "epochs", "0"),
    case("RecordInput(env.good, prefetch_batches=0)", V, "prefetch_batches", "0"),
    case("RecordInput(env.good, compression='zip')", V, "compression", "'zip'"),
    case("RecordInput(env.good, epochs=1).next_batch(timeout=-1)", V, "timeout", "-1"),
    case("RecordInput(env.good, epochs=1).next_batch(timeout=float('nan'))", V, "timeout", "nan"),
    case("reads_all(RecordInput(env.good, epochs=1), timeout=float('inf'))", None),
    case(
        "reads_all(RecordInput(env.good, epochs=1, buffer_size=HUGE))",
        ("ValueError", "MemoryError"),
        "buffer_size",
        may_succeed=True,
    ),
    case(
        "reads_all(RecordInput(env.good, epochs=1, batch_size=HUGE))",
        ("ValueError", "MemoryError"),
        "batch_size",
        may_succeed=True,
    ),
    case("RecordDataset(env.missing)", FILE, "missing.tfrecord"),
    case("RecordDataset(env.good, batchsize=3)", T, "batchsize"),
    # -- DataLoader: the plain class's type for its arguments
    case("DataLoader(squares(), batch_size=0)", V, "batch_size", "0", plain=True),
    case("DataLoader(squares(), batch_size=-1)", V, "batch_size", "-1", plain=True),
    case("DataLoader(squares(), batch_size=1.5)", V, "batch_size", "1.5", plain=True),
    case("DataLoader(squares(), num_workers=-1)", V, "num_workers", "-1", plain=True),
    case("DataLoader(squares(), timeout=-1)", V, "timeout", "-1", plain=True),
    case(
        "DataLoader(squares(), prefetch_factor=2)", V, "prefetch_factor", "num_workers", plain=True
    ),
    case(
        "DataLoader(squares(), num_workers=1, prefetch_factor=-1)",
        V,
        "prefetch_factor",
        "-1",
        plain=True,
    ),
    case(
        "DataLoader(squares(), persistent_workers=True)",
        V,
        "persistent_workers",
        "num_workers",
        plain=True,
    ),
    case(
        "DataLoader(squares(), sampler=[0, 1], shuffle=True)", V, "sampler", "shuffle", plain=True
    ),
    case(
        "DataLoader(squares(), batch_sampler=[[0, 1]], batch_size=2)",
        V,
        "batch_sampler",
        "batch_size",
        plain=True,
    ),
    case("DataLoader(squares(), batch_size=None, drop_last=True)", V, "drop_last", plain=True),
    case(
        "DataLoader(squares(), num_workers=1, multiprocessing_context='no-such-method')",
        V,
        "'no-such-method'",
        plain=True,
    ),
    case(
        "DataLoader(squares(), num_workers=1, multiprocessing_context=5)",
        T,
        "multiprocessing_context=5",
        plain=True,
    ),
    case(
        "DataLoader(squares(), multiprocessing_context='fork')",
        V,
        "multiprocessing_context",
        "num_workers=0",
        plain=True,
    ),
    case("DataLoader(squares(), no_such_argument=1)", T, "no_such_argument", plain=True),
    # -- dataset types
    case("DataLoader(counting(), shuffle=True)", V, "shuffle=True", plain=True),
    case("DataLoader(counting(), sampler=[0, 1])", V, "sampler", plain=True),
    case(
        "DataLoader(RecordDataset(env.good), batch_size=None, shuffle=True)",
        V,
        "shuffle=True",
        plain=True,
    ),
    case("next(iter(DataLoader(NotADataset())))", T, "NotADataset", plain=True),
    case("staged(NotADataset())", T, "NotADataset"),
    # -- DataLoader: torch_stage's own arguments
    case("DataLoader(squares(), capacity=0)", V, "capacity", "0"),
    case("DataLoader(squares(), num_threads=-2)", V, "num_threads", "-2"),
    case("DataLoader(squares(), timeout_millis=0)", V, "timeout_millis", "0"),
    case("DataLoader(squares(), stage_subgraph_stream_id=32)", V, "stage_subgraph_stream_id", "32"),
    case("DataLoader(squares(), device='cuda:99')", V, "device", "'cuda:99'"),
    case("DataLoader(squares()).load_state_dict({'version': 7})", V, "'version': 7"),
]

# Only where there is no GPU: there these calls are valid.
NO_GPU_MATRIX: List[Case] = [
    case("staged([1, 2], device='cuda')", V, "'cuda'", "0 cuda device(s)"),
    case("multi_stream(towers(), cuda_graphs=True)", "RuntimeError", "cuda_graphs=True"),
    case("CUDAGraphModule(towers())", "RuntimeError", "CUDA device"),
]


@dataclass
class Outcome:
    case: Case
    verdict: str  # see VERDICTS
    seconds: float
    type: str = ""
    message: str = ""
    problems: List[str] = field(default_factory=list)


VERDICTS = ("clear", "no_error", "wrong_type", "unclear", "not_honoured", "hung", "crashed")


# ------------------------------------------------------------------ the cases' world


class _Env:
    """Files and values the cases use, made in the scenario's process before
    the first fork (making them starts no thread)."""

    def __init__(self, root: str):
        import torch

        import torch_stage

        self.example = torch_stage.encode_example({"x": [1, 2], "name": b"ab"})
        self.spec = {"x": torch_stage.FixedLenFeature((2,), torch.int64)}
        self.good = os.path.join(root, "good.tfrecord")
        with torch_stage.RecordWriter(self.good) as w:
            for _ in range(3):
                w.write(self.example)
        self.garbage = os.path.join(root, "garbage.tfrecord")
        with open(self.garbage, "wb") as f:
            f.write(b"this is not a TFRecord file, only text. " * 8)
        self.directory = os.path.join(root, "a_directory.tfrecord")
        os.mkdir(self.directory)
        self.missing = os.path.join(root, "missing.tfrecord")
        self.nomatch = os.path.join(root, "*.nomatch")
        self.unwritable = os.path.join(root, "no_such_dir", "out.tfrecord")
        self.out = os.path.join(root, "out.tfrecord")


class NotADataset:
    """Neither a Dataset nor iterable, callable or sized."""


def _namespace(env: _Env, plain: bool = False) -> dict:
    """What a case's code sees: torch, torch_stage's public names, ``env``,
    the constants above and the helpers below."""
    import torch

    import torch_stage

    ns = {name: getattr(torch_stage, name) for name in torch_stage.__all__}

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.tensor([i * i])

    class Counting(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    def towers(stream=None):
        class Towers(torch.nn.Module):
            def forward(self, x):
                if stream is None:
                    return x + 1
                with torch_stage.stream(stream):
                    y = x + 1
                return y * 2

        return Towers()

    def later(delay_s, fn):
        def run():
            time.sleep(delay_s)
            fn()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def try_take_waits(timeout_ms):
        # A valid timeout, however long, is waited: an item put later arrives.
        area = torch_stage.StagingArea(1)
        later(0.3, lambda: area.put([torch.ones(1)]))
        got = area.try_take(timeout_ms)
        check(got is not None, f"try_take({timeout_ms}) returned None at once")

    def stage_waits(timeout_millis):
        def slow():
            time.sleep(0.3)
            yield 1

        with torch_stage.staged(slow(), timeout_millis=timeout_millis) as stage:
            got = list(stage)
        check(got == [1], f"the stage gave {got}")

    def reads_all(ri, timeout=None):
        with ri:
            batch = ri.next_batch(timeout=timeout)
        check(batch is not None and batch.num_records == 3, f"next_batch gave {batch}")

    def stage_state(**kwargs):
        state = {"version": 1, "type": "torch_stage.Stage", "source": "iterable", "position": 0}
        return {**state, **kwargs}

    ns.update(
        torch=torch,
        torch_stage=torch_stage,
        env=env,
        BIG=BIG,
        HUGE=HUGE,
        INT64_MAX=INT64_MAX,
        NotADataset=NotADataset,
        squares=Squares,
        counting=Counting,
        towers=towers,
        try_take_waits=try_take_waits,
        stage_waits=stage_waits,
        reads_all=reads_all,
        stage_state=stage_state,
    )
    if plain:
        ns["DataLoader"] = torch.utils.data.DataLoader
    return ns


# ------------------------------------------------------------------ running a case


def _qualname(t: type) -> str:
    module = t.__module__
    return t.__qualname__ if module == "builtins" else f"{module}.{t.__qualname__}"


def _child(c: Case, env: _Env) -> dict:
    """The body of a case's child: make the call(s), say what happened."""
    import builtins

    report: dict = {"plain": None}
    plain_type = None
    if c.plain:
        try:
            eval(c.code, _namespace(env, plain=True))
        except BaseException as e:  # noqa: BLE001  (any type is an answer)
            plain_type = type(e)
            report["plain"] = _qualname(plain_type)
    ns = _namespace(env)
    expect = tuple(ns.get(name) or getattr(builtins, name) for name in c.expect)
    result = None
    try:
        result = eval(c.code, ns)
    except BaseException as e:  # noqa: BLE001
        report["type"] = _qualname(type(e))
        report["message"] = str(e)[:_MESSAGE_LIMIT]
        report["documented"] = isinstance(e, expect)
        report["as_plain"] = plain_type is None or isinstance(e, plain_type)
    else:
        report["type"] = None
        report["message"] = f"returned {type(result).__name__}"
    # What the call made (a stage, a reader) stops here, inside the time
    # limit: a close that hangs is a hang of this case.
    close = getattr(result, "close", None)
    if callable(close):
        close()
    del result
    gc.collect()
    from torch_stage.staging import stage

    stage._close_all()
    return report


def _run_case(c: Case, env: _Env, log_path: str) -> Tuple[Optional[dict], str, float]:
    """Fork a child for ``c``; (its report or None, what went wrong, seconds)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 0
        try:
            os.setpgid(0, 0)
            os.close(read_fd)
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            try:
                report = _child(c, env)
            except BaseException:  # noqa: BLE001  (the scenario's own fault: say so)
                report = {"harness": traceback.format_exc()[-_MESSAGE_LIMIT:]}
            data = (json.dumps(report) + "\n").encode()
            while data:
                data = data[os.write(write_fd, data) :]
        except BaseException:  # noqa: BLE001
            status = 3
        finally:
            os._exit(status)
    try:  # here too, so that the group exists whichever process runs first
        os.setpgid(pid, pid)
    except OSError:
        pass
    os.close(write_fd)
    deadline = start + CASE_TIMEOUT_S
    got = b""
    try:
        while not got.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            got += chunk
    finally:
        os.close(read_fd)
    status = None
    while status is None and time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
        else:
            time.sleep(0.002)
    seconds = time.monotonic() - start
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:  # a hung child, and whatever it started
            kill()
        except OSError:
            pass
    if status is None:
        os.waitpid(pid, 0)
        return None, f"hung: killed after {CASE_TIMEOUT_S:.0f} s", seconds
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return None, f"crashed: killed by {sig}", seconds
    if not got.endswith(b"\n"):
        return None, f"crashed: exited with status {os.WEXITSTATUS(status)}, no report", seconds
    return json.loads(got), "", seconds


def _judge(c: Case, report: Optional[dict], failure: str, seconds: float) -> Outcome:
    if report is None:
        verdict = "hung" if failure.startswith("hung") else "crashed"
        return Outcome(c, verdict, seconds, problems=[failure])
    if "harness" in report:
        raise RuntimeError(f"case {c.code!r}: the scenario failed in the child:\n{report}")
    out = Outcome(c, "clear", seconds, type=report["type"] or "", message=report["message"])
    if report["type"] is None:
        if c.expect and not c.may_succeed:
            out.verdict = "no_error"
            out.problems.append(f"no error ({report['message']}); expected {' or '.join(c.expect)}")
        return out
    if not c.expect:
        out.verdict = "not_honoured"
        out.problems.append(f"a valid value, refused: {report['type']}")
        return out
    if not report["documented"]:
        out.verdict = "wrong_type"
        out.problems.append(f"raised {report['type']}, documented: {' or '.join(c.expect)}")
    if not report["as_plain"]:
        out.verdict = "wrong_type"
        out.problems.append(
            f"raised {report['type']}, torch.utils.data.DataLoader raises {report['plain']}"
        )
    missing = [t for t in c.text if t not in report["message"]]
    if missing:
        if out.verdict == "clear":
            out.verdict = "unclear"
        out.problems.append(f"the message lacks {missing}")
    return out


def _tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return ""


@scenario("bad_input.matrix", timeout_s=300, quick={}, full={})
def matrix() -> dict:
    """Bad inputs across the API, each in a forked child: a clear error, no crash, no hang."""
    # Imported once here rather than in every child.
    import torch

    import torch_stage  # noqa: F401
    import torch_stage.streams.fx.multi_stream_pass  # noqa: F401
    from reliability import probes

    cases = MATRIX + ([] if torch.cuda.is_available() else NO_GPU_MATRIX)
    codes = [c.code for c in cases]
    check(len(set(codes)) == len(codes), "a case repeats")
    check(len(cases) >= 60, f"the matrix has {len(cases)} cases, fewer than 60")
    outcomes: List[Outcome] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torch_stage_bad_input_") as root:
        env = _Env(root)
        check(
            probes.stage_threads() == 0,
            "a torch_stage thread runs in the scenario's process: forking it is unsafe",
        )
        log_path = os.path.join(root, "child.log")
        for c in cases:
            outcome = _judge(c, *_run_case(c, env, log_path))
            outcomes.append(outcome)
            if outcome.verdict in ("hung", "crashed"):
                outcome.problems.append("its output:\n" + _tail(log_path))
            first = outcome.message.splitlines()[0][:150] if outcome.message else ""
            print(
                f"{outcome.verdict:12s} {outcome.seconds * 1000:5.0f} ms  {c.code}  "
                f"-> {outcome.type or '-'}: {first}",
                flush=True,
            )
    seconds = time.monotonic() - start
    bad = [o for o in outcomes if o.verdict != "clear"]
    for o in bad:
        print(f"\nFAILED [{o.verdict}] {o.case.code}", flush=True)
        for p in o.problems:
            print("    " + p.replace("\n", "\n    "), flush=True)
        if o.message:
            print(f"    message: {o.message[:800]}", flush=True)
    check(
        not bad,
        f"{len(bad)} of {len(outcomes)} cases failed: "
        + "; ".join(f"{o.case.code} [{o.verdict}] {o.problems[0][:160]}" for o in bad),
    )
    return {
        "cases": len(outcomes),
        **{v: sum(o.verdict == v for o in outcomes) for v in VERDICTS},
        "seconds": round(seconds, 1),
        "slowest_case_s": round(max(o.seconds for o in outcomes), 2),
    }
