"""Chrome trace JSON of torch_stage's own spans: :func:`trace`.

While a trace records, every staged run writes, per thread:

* producers: ``torch_stage/<stage>/pull`` (the source), ``.../process``
  (the transform), ``.../copy_to_device`` (device staging on the host) and
  ``.../put`` (the hand-over: waiting for the item's turn and for buffer
  space, then the put);
* consumers: ``torch_stage/<stage>/take`` (waiting for the next item);
* the buffer's occupancy as a counter, sampled at every put and take;

and multi-stream runs (eager, scripted, compiled or C++ callers) write the
host time each pool stream was current (``stream k`` slices from the fork
or ``set_stream`` to the next ``set_stream`` or the join), and their fork,
event records and waits (joined by flow arrows), ``record_stream`` and join
as instants. The file opens in Perfetto (https://ui.perfetto.dev) and
``chrome://tracing``.

The recorder is C++ (``csrc/trace/trace_recorder.h``): per-thread buffers
behind one relaxed atomic check, so a program that does not trace pays
nothing measurable. The same spans are ``record_function`` ranges, so
:mod:`torch.profiler` shows them too, traced or not (producers record them
when the profiler was active on the thread that started the stage).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Union

from torch_stage import _library

_C = _library.load()

__all__ = ["KINDS", "Trace", "load", "trace"]

# Record kinds (csrc/trace/trace_recorder.h, trace::Kind), by number.
KINDS = (
    "pull",
    "process",
    "copy_to_device",
    "put",
    "take",
    "stream",
    "stream_op",
    "counter",
    "stage_info",
)
# Chrome trace categories: what a person filters by.
_CATEGORY = {
    "pull": "pull",
    "process": "transform",
    "copy_to_device": "hand_over",
    "put": "hand_over",
    "take": "take",
    "stream": "stream",
    "stream_op": "stream",
}
_OUTCOMES = {0: "item", 1: "end", 2: "skipped", 3: "error", 4: "closed"}
_PREFIX = "torch_stage/"

_lock = threading.Lock()
_recording: Optional[Trace] = None


def _check_path(path) -> Optional[str]:
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"trace path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not (path.endswith(".json") or path.endswith(".json.gz")):
        raise ValueError(
            f"trace path must end in .json or .json.gz (Chrome trace JSON), got {path!r}"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"trace path {path!r}: the folder {folder!r} does not exist")
    return path


class Trace:
    """A recording of torch_stage's spans; a context manager.

    Use :func:`trace`. After the ``with`` block, :attr:`events` holds the
    Chrome trace events and, when a path was given, the file is written.
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None):
        self.path = _check_path(path)
        self.events: List[Dict[str, Any]] = []
        self.stages: Dict[str, Dict[str, int]] = {}
        self.duration_us = 0.0

    def __enter__(self) -> Trace:
        global _recording
        with _lock:
            if _recording is not None:
                raise RuntimeError(
                    "a torch_stage.trace() is already recording; traces do not nest "
                    "(end the other one first)"
                )
            _C._trace_start()
            _recording = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _recording
        with _lock:
            raw = _C._trace_stop()
            _recording = None
        self._build(*raw)
        if self.path is not None:
            self.save(self.path)

    # -- building -------------------------------------------------------------------

    def _build(self, start_ns: int, stop_ns: int, names: List[str], threads) -> None:
        pid = os.getpid()
        python_names = {t.native_id: t.name for t in threading.enumerate()}
        events: List[Dict[str, Any]] = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "tid": 0,
                "args": {"name": "torch_stage"},
            }
        ]
        self.duration_us = (stop_ns - start_ns) / 1000

        def us(ns: int) -> float:
            return round((ns - start_ns) / 1000, 3)

        flows: Dict[tuple, Dict[str, Any]] = {}
        for tid, thread_name, records in threads:
            records = [r for r in records if r[0] >= start_ns]
            if not records:
                continue
            label = python_names.get(tid) or thread_name or f"thread {tid}"
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}}
            )
            for start, end, name_id, kind_id, a, b, c in records:
                kind = KINDS[kind_id]
                name = names[name_id]
                if kind in ("pull", "process", "copy_to_device", "put", "take"):
                    args = {"stage": _stage_of(name), "outcome": _OUTCOMES.get(b, str(b))}
                    if a >= 0:
                        args["item"] = a
                    events.append(
                        {
                            "ph": "X",
                            "name": name,
                            "cat": _CATEGORY[kind],
                            "ts": us(start),
                            "dur": round((end - start) / 1000, 3),
                            "pid": pid,
                            "tid": tid,
                            "args": args,
                        }
                    )
                elif kind == "stream":
                    scope = name.endswith("stream_scope")
                    events.append(
                        {
                            "ph": "X",
                            "name": f"{'scope ' if scope else ''}stream {a}",
                            "cat": "stream",
                            "ts": us(start),
                            "dur": round((end - start) / 1000, 3),
                            "pid": pid,
                            "tid": tid,
                            "args": {"stream": a, "scope" if scope else "run": c},
                        }
                    )
                elif kind == "stream_op":
                    op = name.split("::", 1)[-1]
                    events.append(_stream_op(op, us(start), pid, tid, a, b, c, flows))
                elif kind == "counter":
                    events.append(
                        {
                            "ph": "C",
                            "name": name,
                            "cat": "occupancy",
                            "ts": us(start),
                            "pid": pid,
                            "args": {"items": a},
                        }
                    )
                elif kind == "stage_info":
                    self.stages[name[len(_PREFIX) :]] = {"capacity": a, "num_threads": b}
        events.extend(f for pair in flows.values() for f in pair.values())
        self.events = events

    # -- reading ----------------------------------------------------------------------

    def to_json(self) -> Dict[str, Any]:
        """The Chrome trace (JSON Object Format) as a dict."""
        return {
            "traceEvents": self.events,
            "displayTimeUnit": "ms",
            "otherData": {
                "producer": "torch_stage.trace",
                "stages": self.stages,
                "duration_us": self.duration_us,
            },
        }

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the Chrome trace JSON (gzipped when the name ends in .gz)."""
        path = _check_path(path)
        data = json.dumps(self.to_json(), separators=(",", ":")).encode()
        if path.endswith(".gz"):
            data = gzip.compress(data)
        with open(path, "wb") as f:
            f.write(data)

    def spans(self, category: Optional[str] = None, stage: Optional[str] = None) -> List[dict]:
        """The complete ("X") events, optionally of one category (``pull``,
        ``transform``, ``hand_over``, ``take``, ``stream``) and one stage."""
        return [
            e
            for e in self.events
            if e["ph"] == "X"
            and (category is None or e["cat"] == category)
            and (stage is None or e["args"].get("stage") == stage)
        ]

    def stage_names(self) -> List[str]:
        """The stages that have spans, in order of their first span."""
        seen: Dict[str, None] = {}
        for e in self.spans():
            stage = e["args"].get("stage")
            if stage is not None and e["cat"] != "stream":
                seen.setdefault(stage, None)
        return list(seen)

    def stage_stats(self, stage: str) -> Dict[str, Any]:
        """A ``Stage.stats()``-like dict of one stage computed from the spans
        (seconds summed over items), plus ``steps`` and ``seconds``: the items
        taken and the time from the first take's start to the last take's end.
        Feed it to :func:`torch_stage.observe.diagnose.diagnose`."""
        spans = [e for e in self.spans(stage=stage) if e["args"].get("outcome") == "item"]

        def total(cat, name_end=None):
            return (
                sum(
                    e["dur"]
                    for e in spans
                    if e["cat"] == cat and (name_end is None or e["name"].endswith(name_end))
                )
                / 1e6
            )

        takes = sorted((e for e in spans if e["cat"] == "take"), key=lambda e: e["ts"])
        puts = [e for e in spans if e["name"].endswith("/put")]
        info = self.stages.get(stage, {})
        producers = {e["tid"] for e in spans if e["cat"] in ("pull", "transform", "hand_over")}
        occupancy = [
            e["args"]["items"]
            for e in self.events
            if e["ph"] == "C" and e["name"] == f"{_PREFIX}{stage}/occupancy"
        ]
        return {
            "produced": len(puts),
            "consumed": len(takes),
            "source_s": total("pull"),
            "transform_s": total("transform"),
            "copy_s": total("hand_over", "/copy_to_device"),
            "consumer_wait_s": total("take"),
            "producer_blocked_s": total("hand_over", "/put"),
            "capacity": info.get("capacity", max(occupancy, default=0)),
            "num_threads": info.get("num_threads", max(len(producers), 1)),
            "max_occupancy": max(occupancy, default=0),
            "steps": len(takes),
            "seconds": (takes[-1]["ts"] + takes[-1]["dur"] - takes[0]["ts"]) / 1e6
            if takes
            else 0.0,
        }

    def thread_names(self) -> Dict[int, str]:
        return {e["tid"]: e["args"]["name"] for e in self.events if e.get("name") == "thread_name"}

    def __iter__(self) -> Iterator[dict]:
        return iter(self.events)

    def __repr__(self) -> str:
        return f"Trace(path={self.path!r}, events={len(self.events)})"


def _stage_of(name: str) -> str:
    return name[len(_PREFIX) :].rsplit("/", 1)[0] if name.startswith(_PREFIX) else name


def _stream_op(op, ts, pid, tid, stream, event, owner, flows) -> Dict[str, Any]:
    args: Dict[str, Any] = {"run" if not op.startswith("scope") else "scope": owner}
    if op == "fork":
        label = f"fork ({stream} streams)"
        args["num_streams"] = stream
    elif op in ("record_event", "wait_event"):
        verb = "record" if op == "record_event" else "wait"
        label = f"{verb} e{event} on stream {stream}"
        args.update(stream=stream, event=event)
        # A flow arrow from the record to each wait (the first wait here;
        # Chrome's format has one end per id).
        key = (owner, event)
        pair = flows.setdefault(key, {})
        ph = "s" if verb == "record" else "f"
        if ph not in pair:
            flow = {
                "ph": ph,
                "name": f"e{event}",
                "cat": "stream",
                "id": f"{owner}.{event}",
                "ts": ts,
                "pid": pid,
                "tid": tid,
            }
            if ph == "f":
                flow["bp"] = "e"
            pair[ph] = flow
    elif op in ("stage_copy", "stage_hand_over"):
        label = f"{op} (staging stream {stream}, event {event})"
        args.update(stream=stream, event=event)
    else:
        label = op if stream < 0 else f"{op} stream {stream}"
        args["stream"] = stream
    return {
        "ph": "i",
        "s": "t",
        "name": label,
        "cat": "stream",
        "ts": ts,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def trace(path: Union[str, os.PathLike, None] = None) -> Trace:
    """Record torch_stage's spans while the ``with`` block runs.

    Args:
        path: where to write the Chrome trace JSON on exit (``.json``, or
            ``.json.gz`` for gzip); None keeps it in memory only
            (:attr:`Trace.events`, :meth:`Trace.save`).

    Returns:
        The :class:`Trace`, a context manager.

    Raises:
        TypeError / ValueError: a path that is not a str or path, does not
            end in .json or .json.gz, or whose folder does not exist
            (checked before anything records).
        RuntimeError: on entry, when another trace is recording.

    Example::

        with torch_stage.trace("train.json"):
            for batch in torch_stage.staged(loader, capacity=4):
                train_step(batch)
        # open train.json in https://ui.perfetto.dev
    """
    return Trace(path)


def load(path: Union[str, os.PathLike]) -> Trace:
    """Read a trace written by :meth:`Trace.save` back."""
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise ValueError(f"{path!r} is not Chrome trace JSON (no traceEvents)")
    out = Trace()
    out.path = path
    out.events = data["traceEvents"]
    other = data.get("otherData", {})
    out.stages = other.get("stages", {})
    out.duration_us = other.get("duration_us", 0.0)
    return out
