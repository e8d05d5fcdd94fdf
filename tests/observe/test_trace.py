"""torch_stage.trace: Chrome trace JSON of staged runs and stream ops, and
the same spans as torch.profiler ranges."""

import collections
import copy
import gzip
import json
import time

import pytest
import torch
import zoo  # noqa: E402

import torch_stage
from torch_stage.observe import tracing
from torch_stage.streams.fx import _ops

N = 24

# Chrome's Trace Event Format: the phases this recorder writes and the keys
# each needs (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).
REQUIRED = {
    "X": {"name", "cat", "ts", "dur", "pid", "tid"},
    "i": {"name", "ts", "pid", "tid", "s"},
    "M": {"name", "pid", "tid", "args"},
    "C": {"name", "ts", "pid", "args"},
    "s": {"name", "id", "ts", "pid", "tid"},
    "f": {"name", "id", "ts", "pid", "tid", "bp"},
}


def check_chrome_trace(path):
    with open(path) as f:
        data = json.load(f)
    assert isinstance(data["traceEvents"], list)
    for e in data["traceEvents"]:
        assert e["ph"] in REQUIRED, e
        missing = REQUIRED[e["ph"]] - set(e)
        assert not missing, (e, missing)
        if "ts" in e:
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    return data


def slow_double(x):
    time.sleep(0.001)
    return 2 * x


def test_a_known_pipeline_gives_one_span_of_each_kind_per_item(tmp_path):
    path = tmp_path / "known.json"
    stage = torch_stage.staged(
        range(N), transform=slow_double, num_threads=2, capacity=3, name="known"
    )
    with torch_stage.trace(path) as rec, stage:
        got = list(stage)
    assert got == [2 * i for i in range(N)]
    data = check_chrome_trace(path)
    events = data["traceEvents"]
    assert rec.events == events

    def items(suffix):
        spans = [
            e
            for e in events
            if e["ph"] == "X"
            and e["name"] == f"torch_stage/known/{suffix}"
            and e["args"]["outcome"] == "item"
        ]
        return spans

    for suffix, cat in (("pull", "pull"), ("process", "transform"), ("put", "hand_over")):
        spans = items(suffix)
        assert sorted(e["args"]["item"] for e in spans) == list(range(N)), suffix
        assert {e["cat"] for e in spans} == {cat}
    takes = items("take")
    assert len(takes) == N and {e["cat"] for e in takes} == {"take"}
    # The consumer's last take sees the end.
    ends = [e for e in events if e.get("name") == "torch_stage/known/take" and e["ph"] == "X"]
    assert [e["args"]["outcome"] for e in ends].count("end") == 1

    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    producer_threads = {names[e["tid"]] for e in items("pull") + items("process")}
    assert producer_threads <= {"torch_stage:known:0", "torch_stage:known:1"}
    assert {names[e["tid"]] for e in takes} == {"MainThread"}

    # Causality, item by item: pulled, processed, put, then taken.
    by_item = {s: {e["args"]["item"]: e for e in items(s)} for s in ("pull", "process", "put")}
    for k, take in enumerate(sorted(takes, key=lambda e: e["ts"])):
        pull, process, put = (by_item[s][k] for s in ("pull", "process", "put"))
        assert pull["ts"] + pull["dur"] <= process["ts"] + 1e-3
        assert process["ts"] + process["dur"] <= put["ts"] + 1e-3
        assert put["ts"] <= take["ts"] + take["dur"] + 1e-3

    samples = [e for e in events if e["ph"] == "C"]
    assert len(samples) == 2 * N  # one per put and one per take
    assert all(0 <= e["args"]["items"] <= 3 for e in samples)
    assert data["otherData"]["stages"] == {"known": {"capacity": 3, "num_threads": 2}}

    stats = rec.stage_stats("known")
    assert (stats["produced"], stats["consumed"], stats["steps"]) == (N, N, N)
    assert stats["transform_s"] >= N * 0.001


def test_nothing_is_recorded_outside_a_trace_and_traces_do_not_leak():
    list(torch_stage.staged(range(5), name="before"))  # not traced
    with torch_stage.trace() as empty:
        pass
    assert [e for e in empty.events if e["ph"] != "M"] == []
    with torch_stage.trace() as rec:
        list(torch_stage.staged(range(5), name="inside"))
    stages = {e["args"]["stage"] for e in rec.events if e["ph"] == "X"}
    assert stages == {"inside"}
    assert not tracing._C._trace_enabled()


def test_device_staging_records_the_copy_span(tmp_path):
    # On CPU the copy is skipped, but with a device the hand-over span exists.
    if not torch.cuda.is_available():
        pytest.skip("device staging copies only with an accelerator")
    with torch_stage.trace() as rec:
        list(torch_stage.staged([torch.ones(4)] * 5, device="cuda", name="dev"))
    copies = [e for e in rec.spans("hand_over") if e["name"].endswith("/copy_to_device")]
    assert len(copies) == 5


def test_multi_stream_runs_record_segments_events_and_waits(tmp_path):
    model = torch_stage.multi_stream(zoo.InceptionBlock().eval(), num_streams=4)
    plan = model.stream_plan
    x = torch.randn(1, 16, 8, 8)
    calls = 3
    path = tmp_path / "streams.json"
    with torch.no_grad(), torch_stage.trace(path):
        for _ in range(calls):
            model(x)
    events = check_chrome_trace(path)["traceEvents"]
    instants = collections.Counter(e["name"].split(" ")[0] for e in events if e["ph"] == "i")
    assert instants["fork"] == calls and instants["join"] == calls
    assert instants["record"] == calls * len(plan.events)
    assert instants["wait"] == calls * len(plan.waits)
    segments = [e for e in events if e["ph"] == "X" and e["cat"] == "stream"]
    assert {e["args"]["stream"] for e in segments} == set(plan.streams_used)
    # Within a run, segments follow each other on the thread without overlap.
    by_run = collections.defaultdict(list)
    for e in segments:
        by_run[e["args"]["run"]].append((e["ts"], e["ts"] + e["dur"]))
    assert len(by_run) == calls
    for spans in by_run.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))
    # Each event is an arrow from its record to a wait.
    starts = {e["id"] for e in events if e["ph"] == "s"}
    ends = {e["id"] for e in events if e["ph"] == "f"}
    assert ends <= starts and len(ends) == calls * len({w.event for w in plan.waits})


@pytest.mark.own_sanitizer
def test_the_trace_and_the_stream_sanitizer_observe_at_once():
    # A plan with its waits removed: the sanitizer must still see the race
    # while the trace records the same run.
    model = torch_stage.multi_stream(zoo.InceptionBlock().eval(), num_streams=4)
    mutant = copy.deepcopy(model)
    for node in list(mutant.graph.nodes):
        if node.target is _ops.wait_event:
            mutant.graph.erase_node(node)
        elif node.target is _ops.sync:
            node.update_arg(3, [])
    mutant.recompile()
    x = torch.randn(1, 16, 8, 8)
    with torch.no_grad(), torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
        with torch_stage.trace() as rec:
            mutant(x)
    assert sanitizer.races != []
    names = [e["name"] for e in rec.events if e["ph"] == "i"]
    assert names[0].startswith("fork") and names[-1].startswith("join")
    assert not any(n.startswith("wait") for n in names)
    assert any(n.startswith("record") for n in names)
    # The sanitizer alone again, and on the sound plan: no race.
    with torch.no_grad(), torch_stage.sanitize_streams() as alone:
        model(x)
    assert alone.races == []


def test_torch_profiler_shows_the_same_spans(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = list(torch_stage.staged(range(6), transform=slow_double, name="profiled"))
    assert got == [2 * i for i in range(6)]
    counts = collections.Counter(e.name for e in prof.events())
    for suffix in ("pull", "process", "put", "take"):
        # Six items, plus the spans that met the end of the data.
        assert counts[f"torch_stage/profiled/{suffix}"] >= 6, (suffix, counts)
    exported = tmp_path / "profile.json"
    prof.export_chrome_trace(str(exported))
    with open(exported) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {f"torch_stage/profiled/{s}" for s in ("pull", "process", "put", "take")} <= names


def test_gzip_and_load_round_trip(tmp_path):
    path = tmp_path / "t.json.gz"
    with torch_stage.trace(path) as rec:
        list(torch_stage.staged(range(4), name="gz"))
    with gzip.open(path, "rt") as f:
        assert json.load(f)["traceEvents"] == rec.events
    back = tracing.load(path)
    assert back.events == rec.events and back.stages == rec.stages


def test_bad_arguments_are_refused_before_recording(tmp_path):
    with pytest.raises(TypeError, match="str or os.PathLike, got int"):
        torch_stage.trace(3)
    with pytest.raises(ValueError, match=r"must end in \.json or \.json\.gz.*'t\.txt'"):
        torch_stage.trace("t.txt")
    with pytest.raises(ValueError, match="does not exist"):
        torch_stage.trace(tmp_path / "missing" / "t.json")
    assert not tracing._C._trace_enabled()
    with torch_stage.trace():
        with pytest.raises(RuntimeError, match="already recording"):
            with torch_stage.trace():
                pass
        assert tracing._C._trace_enabled()
    assert not tracing._C._trace_enabled()
    with pytest.raises(ValueError, match="not Chrome trace JSON"):
        bad = tmp_path / "bad.json"
        bad.write_text("[]")
        tracing.load(bad)
