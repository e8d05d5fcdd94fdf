"""One HTML page that shows where a torch_stage run's time goes.

``python -m torch_stage.observe.report`` draws, from the files ``make demo`` and
``make bench`` leave in ``build/`` (or the ones named on the command line):

* the verdict and advice of :mod:`torch_stage.observe.diagnose` for the staged run;
* the overlap bar: data + compute one after the other, the best possible
  max(S, D / threads, C), and the measured staged step;
* a per-thread timeline of a window of the staged run, from its trace
  (:func:`torch_stage.trace`): the loop's compute and waits, each
  producer's pull, transform and hand-over;
* the staging buffer's occupancy over the whole trace;
* a multi-stream plan as a graph: nodes coloured by stream, the events that
  order cross-stream dependencies as labelled edges (graphviz ``dot``);
* the benchmarks' tables against the peers, from their ``--json`` files.

Images are PNG files beside the page (``--inline``: embedded as data URIs).

``--plan SPEC`` draws the plan of any module: ``package.module:name`` where
``name`` is an ``nn.Module`` instance, class or factory (called without
arguments), or ``package.module:name(args)`` with literal arguments
(``torchvision.models:googlenet(aux_logits=False, init_weights=False)``);
``--input-shape 1,3,224,224`` (once per input) passes random example inputs,
which also lets the planner use costs. The default is torchvision's
GoogLeNet when torchvision imports (``make report`` runs the page from the
zoo venv, where it does).
"""

from __future__ import annotations

import argparse
import ast
import base64
import glob
import html
import importlib
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch_stage.observe import diagnose as _diagnose
from torch_stage.observe import tracing

__all__ = [
    "DotMissingError",
    "build_report",
    "draw_occupancy",
    "draw_overlap",
    "draw_plan",
    "draw_timeline",
    "load_module",
    "main",
]

DEFAULT_PLAN = "torchvision.models:googlenet(aux_logits=False, init_weights=False)"

# Colours per span kind (Okabe-Ito: distinguishable for colour-blind readers).
_KIND_COLOURS = {
    "compute": ("#009E73", "loop body (compute)"),
    "take": ("#D55E00", "waiting for data (take)"),
    "pull": ("#0072B2", "source (pull)"),
    "transform": ("#E69F00", "transform"),
    "copy": ("#CC79A7", "copy to device"),
    "put": ("#BBBBBB", "waiting to hand over (put)"),
}
_STREAM_COLOURS = [
    "#56B4E9",
    "#E69F00",
    "#009E73",
    "#F0E442",
    "#CC79A7",
    "#0072B2",
    "#D55E00",
    "#999999",
]


class DotMissingError(RuntimeError):
    """graphviz's ``dot`` is not installed."""


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "torch_stage.observe.report draws with matplotlib: pip install matplotlib"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- the staged run -----------------------------------------------------------------------


def _kind(event: dict) -> Optional[str]:
    name, cat = event["name"], event["cat"]
    if cat == "hand_over":
        return "copy" if name.endswith("/copy_to_device") else "put"
    return cat if cat in ("pull", "transform", "take") else None


def draw_timeline(trace: tracing.Trace, path: str, stage: Optional[str] = None, items: int = 12):
    """A window of ``items`` steps of ``stage``'s run, one row per thread.

    The window starts a few steps in (past the warm-up); the consumer's
    compute is the time between its takes.
    """
    plt = _pyplot()
    stage = stage or _first_stage(trace)
    spans = [e for e in trace.spans(stage=stage) if _kind(e) is not None]
    takes = sorted((e for e in spans if e["cat"] == "take"), key=lambda e: e["ts"])
    if len(takes) < 2:
        raise ValueError(f"stage {stage!r} has fewer than 2 takes in the trace: nothing to draw")
    first = min(max(len(takes) // 4, 1), 10, len(takes) - 2)
    last = min(first + items, len(takes) - 1)
    t0, t1 = takes[first]["ts"], takes[last]["ts"] + takes[last]["dur"]
    names = trace.thread_names()
    consumers = sorted({e["tid"] for e in takes})
    producers = sorted({e["tid"] for e in spans} - set(consumers))
    rows = consumers + producers
    fig, ax = plt.subplots(figsize=(10, 0.7 * len(rows) + 1.6), dpi=100)
    bars: Dict[str, List[Tuple[float, float, int]]] = {k: [] for k in _KIND_COLOURS}
    for e in spans:
        start, end = e["ts"], e["ts"] + e["dur"]
        if end < t0 or start > t1:
            continue
        bars[_kind(e)].append((start, end, rows.index(e["tid"])))
    for tid in consumers:
        mine = [e for e in takes if e["tid"] == tid]
        for a, b in zip(mine, mine[1:]):
            start, end = a["ts"] + a["dur"], b["ts"]
            if end >= t0 and start <= t1 and end > start:
                bars["compute"].append((start, end, rows.index(tid)))
    for kind, spans_of in bars.items():
        colour, label = _KIND_COLOURS[kind]
        for i, row in enumerate(sorted({r for _, _, r in spans_of})):
            segments = [
                ((max(s, t0) - t0) / 1000, (min(e, t1) - max(s, t0)) / 1000)
                for s, e, r in spans_of
                if r == row
            ]
            ax.broken_barh(
                segments,
                (row - 0.35, 0.7),
                facecolors=colour,
                edgecolor="white",
                linewidth=0.3,
                label=label if i == 0 else None,
            )
    labels = [
        f"{names.get(tid, tid)}\n({'consumer' if tid in consumers else 'producer'})" for tid in rows
    ]
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / 1000)
    ax.set_xlabel(f"ms (steps {first} to {last} of {len(takes)})")
    ax.set_title(f"Stage '{stage}': what each thread does", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_occupancy(trace: tracing.Trace, path: str, stage: Optional[str] = None):
    """The buffer's occupancy at every put and take, with its capacity."""
    plt = _pyplot()
    stage = stage or _first_stage(trace)
    samples = sorted(
        (e["ts"], e["args"]["items"])
        for e in trace.events
        if e["ph"] == "C" and e["name"] == f"torch_stage/{stage}/occupancy"
    )
    if not samples:
        raise ValueError(f"stage {stage!r} has no occupancy samples in the trace")
    stats = trace.stage_stats(stage)
    fig, ax = plt.subplots(figsize=(10, 2.6), dpi=100)
    xs = [(t - samples[0][0]) / 1e6 for t, _ in samples]
    ys = [v for _, v in samples]
    ax.step(xs, ys, where="post", color="#0072B2", linewidth=0.8, label="items in the buffer")
    capacity = stats["capacity"]
    if capacity:
        ax.axhline(capacity, color="#D55E00", linestyle="--", linewidth=1, label="capacity")
    # Weighted by how long each level lasted, not by sample.
    span = xs[-1] - xs[0]
    mean = sum(v * (b - a) for v, a, b in zip(ys, xs, xs[1:])) / span if span > 0 else float(ys[0])
    ax.axhline(mean, color="#009E73", linestyle=":", linewidth=1, label=f"mean {mean:.2f}")
    ax.set_ylim(-0.2, max(max(ys), capacity or 0) + 0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("items")
    ax.set_title(f"Stage '{stage}': buffer occupancy (sampled at every put and take)", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_overlap(d: _diagnose.Diagnosis, path: str):
    """Sum vs max vs measured: what overlap can gain and what it gained."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 2.4), dpi=100)
    data = d.data_ms
    sequential = d.sequential_ms
    rows = [
        (
            "plain loop (measured)" if d.plain_step_ms is not None else "data + compute",
            [
                (data, "#0072B2", "data (make an item)"),
                (max(sequential - data, 0), "#009E73", "compute"),
            ],
        ),
        (
            f"on independent cores: max(S, D/{d.num_threads}, C)",
            [(d.independent_ms, "#999999", "max(S, D/threads, C)")],
        ),
    ]
    if d.corun_step_ms is not None:
        rows.append(
            (
                "side by side, nothing handed over (measured)",
                [(d.corun_step_ms, "#CC79A7", "the machine's bound")],
            )
        )
    rows += [
        (
            "torch_stage (measured)",
            [
                (max(d.step_ms - d.wait_ms, 0), "#009E73", None),
                (d.wait_ms, "#D55E00", "waiting for data"),
            ],
        ),
    ]
    seen = set()
    for y, (_, parts) in enumerate(rows):
        left = 0.0
        for width, colour, label in parts:
            show = label if label and label not in seen else None
            seen.add(label)
            ax.barh(y, width, left=left, color=colour, height=0.6, label=show)
            left += width
        ax.text(left, y, f"  {left:.2f} ms", va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(sequential, d.step_ms, d.ideal_ms) * 1.18)
    ax.set_xlabel("ms per step")
    ax.set_title(
        f"Overlap: {d.speedup:.2f}x faster than no overlap, best possible {d.best_speedup:.2f}x",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _first_stage(trace: tracing.Trace) -> str:
    stages = trace.stage_names()
    if not stages:
        raise ValueError(f"the trace {trace.path or ''} has no stage spans")
    return stages[0]


# -- the multi-stream plan ----------------------------------------------------------------


def load_module(spec: str):
    """The ``nn.Module`` named by ``package.module:name`` or
    ``package.module:name(literal args)`` (see the module docstring)."""
    import torch

    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(
            f"--plan must look like package.module:name or package.module:name(args), got {spec!r}"
        )
    module_name, _, target = spec.partition(":")
    args: list = []
    kwargs: dict = {}
    call = "(" in target
    if call:
        try:
            tree = ast.parse(target, mode="eval").body
            if not isinstance(tree, ast.Call):
                raise SyntaxError("not a call")
            args = [ast.literal_eval(a) for a in tree.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in tree.keywords}
        except (SyntaxError, ValueError) as e:
            raise ValueError(
                f"--plan {spec!r}: the arguments must be Python literals "
                f"(numbers, strings, True/False/None, lists, dicts): {e}"
            ) from None
        target = target[: target.index("(")]
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (a package that fails while importing, too)
        raise ValueError(f"--plan {spec!r}: cannot import {module_name!r}: {e}") from None
    for part in target.strip().split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--plan {spec!r}: {module_name} has no attribute {target!r}")
        obj = getattr(obj, part)
    if isinstance(obj, torch.nn.Module):
        if call:
            raise ValueError(f"--plan {spec!r}: {target} is a module instance, not callable")
        return obj
    if not callable(obj):
        raise TypeError(f"--plan {spec!r}: {target} is a {type(obj).__name__}, not a module")
    model = obj(*args, **kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"--plan {spec!r}: {target}(...) returned a {type(model).__name__}, "
            "not a torch.nn.Module"
        )
    return model


def _dot() -> str:
    dot = shutil.which("dot")
    if dot is None:
        raise DotMissingError(
            "drawing a stream plan needs graphviz's `dot`, which is not on PATH: install "
            "Debian's graphviz package (apt-get install graphviz; `make` set-up does it), "
            "or leave the plan out with --no-plan"
        )
    return dot


def plan_dot(graph_module, max_nodes: int = 0) -> str:
    """The plan of a ``multi_stream`` GraphModule in graphviz's language:
    nodes that launch work coloured by stream, inputs as ellipses, data
    dependencies as grey edges and each event that orders a cross-stream
    dependency as a bold edge labelled with the event."""
    plan = graph_module.stream_plan
    assignment = dict(plan.assignment)
    if max_nodes > 0:
        assignment = dict(list(assignment.items())[:max_nodes])
    nodes = {n.name: n for n in graph_module.graph.nodes}
    memo: Dict[str, set] = {}

    def sources(node) -> set:
        # The device nodes and inputs a node reads, through host-only nodes.
        if node.name in memo:
            return memo[node.name]
        memo[node.name] = set()
        found = set()
        for inp in node.all_input_nodes:
            if inp.name in plan.assignment or inp.op == "placeholder":
                found.add(inp.name)
            elif inp.op != "get_attr":
                found |= sources(inp)
        memo[node.name] = found
        return found

    lines = [
        "digraph plan {",
        '  graph [rankdir=TB, nodesep=0.25, ranksep=0.3, fontname="Helvetica", fontsize=11,'
        f' label="{_dot_escape(_plan_title(plan, len(assignment)))}", labelloc=t];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=9, height=0.3];',
        '  edge [color="#888888", arrowsize=0.5];',
    ]
    used_inputs = set()
    waits = {(w.after, w.node): w for w in plan.waits}
    edges = []
    for name in assignment:
        for src in sorted(sources(nodes[name])):
            if src in assignment:
                edges.append((src, name))
            elif nodes[src].op == "placeholder":
                used_inputs.add(src)
                edges.append((src, name))
    for name in sorted(used_inputs):
        lines.append(f'  "{name}" [shape=ellipse, style=solid, label="{name}"];')
    for name, stream in assignment.items():
        colour = _colour(stream)
        lines.append(f'  "{name}" [fillcolor="{colour}", label="{_dot_escape(name)}"];')
    drawn = set()
    for src, dst in edges:
        w = waits.get((src, dst))
        if w is not None:
            colour = _colour(assignment[src])
            lines.append(
                f'  "{src}" -> "{dst}" [color="{colour}", penwidth=2.2, label="e{w.event}", '
                'fontsize=8, fontname="Helvetica"];'
            )
            drawn.add((src, dst))
        elif src in assignment and assignment[src] != assignment[dst]:
            # Ordered by an earlier wait on the same stream (pruned).
            lines.append(f'  "{src}" -> "{dst}" [style=dashed];')
        else:
            lines.append(f'  "{src}" -> "{dst}";')
    for (src, dst), w in waits.items():
        if (src, dst) not in drawn and src in assignment and dst in assignment:
            colour = _colour(assignment[src])
            lines.append(
                f'  "{src}" -> "{dst}" [color="{colour}", penwidth=2.2, label="e{w.event}", '
                'fontsize=8, fontname="Helvetica"];'
            )
    legend = [
        f'    "legend_{s}" [label="stream {s}", fillcolor="{_colour(s)}"];'
        for s in sorted(set(assignment.values()))
    ]
    lines += [
        "  subgraph cluster_legend {",
        '    label="streams"; fontsize=9; style=dashed; color="#AAAAAA";',
        *legend,
        "  }",
        "}",
    ]
    return "\n".join(lines)


def _colour(stream: int) -> str:
    return _STREAM_COLOURS[stream % len(_STREAM_COLOURS)]


def _plan_title(plan, shown: int) -> str:
    title = (
        f"{plan.strategy} ({plan.reason}): {len(plan.streams_used)} of {plan.num_streams} streams, "
        f"{len(plan.events)} events, {len(plan.waits)} waits"
    )
    if shown < len(plan.assignment):
        title += f"; the first {shown} of {len(plan.assignment)} nodes"
    return title


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def draw_plan(graph_module, path: str, max_nodes: int = 0) -> None:
    """Render :func:`plan_dot` to a PNG with graphviz's ``dot``."""
    dot = _dot()
    source = plan_dot(graph_module, max_nodes)
    proc = subprocess.run(
        [dot, "-Tpng", "-Gdpi=80", "-o", path],
        input=source.encode(),
        capture_output=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"dot failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")


def plan_of(spec: str, input_shapes: Sequence[Sequence[int]] = (), num_streams: int = 4):
    """``multi_stream`` of the module named by ``spec`` (eval mode)."""
    import torch

    import torch_stage

    model = load_module(spec).eval()
    example = None
    if input_shapes:
        gen = torch.Generator().manual_seed(0)
        example = tuple(torch.randn(*shape, generator=gen) for shape in input_shapes)
    return torch_stage.multi_stream(model, num_streams=num_streams, example_inputs=example)


# -- benchmarks ---------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if v is None:
        return "-"
    return html.escape(str(v))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def bench_section(report: dict) -> Tuple[str, str]:
    """(title, HTML) for one benchmark's JSON report."""
    kind = report.get("benchmark", "benchmark")
    if kind == "overlap":
        cols = [
            "plain",
            "dataloader_w0",
            "dataloader_w2",
            "torchdata_prefetcher",
            "torch_stage",
            "torch_stage_efficiency",
        ]
        rows = [[c["data_ms"], c["compute_ms"], *[c.get(k) for k in cols]] for c in report["cells"]]
        note = (
            "<p>ms per step over a grid of data time D and compute time C (median over rounds); "
            "efficiency = torch_stage's step / max(D, C), 1.0 is perfect overlap.</p>"
        )
        return "Overlap against the peers (benchmarks/overlap.py)", note + _table(
            ["D ms", "C ms", *cols], rows
        )
    if kind == "buffer_throughput":
        rows = [
            [
                r["producers"],
                r["consumers"],
                r["capacity"],
                r.get("cpp_threads_items_per_s"),
                r["py_threads_staging_area_items_per_s"],
                r["py_threads_queue_items_per_s"],
                r["staging_area_vs_queue"],
            ]
            for r in report["results"]
        ]
        return "Staging buffer throughput (benchmarks/buffer_throughput.py)", _table(
            [
                "producers",
                "consumers",
                "capacity",
                "C++ threads items/s",
                "StagingArea items/s",
                "queue.Queue items/s",
                "StagingArea / Queue",
            ],
            rows,
        )
    if kind == "multi_stream":
        key = "gpu_ms" if report["models"] and "gpu_ms" in report["models"][0] else "cpu_ms"
        variants: List[str] = []
        for m in report["models"]:
            for v in m.get(key, {}):
                if v not in variants:
                    variants.append(v)
        rows = [[m["model"], *[m.get(key, {}).get(v) for v in variants]] for m in report["models"]]
        note = f"<p>{html.escape(report.get('note', ''))}</p>" if report.get("note") else ""
        return (
            f"Multi-stream, {key.replace('_', ' ')} per call (benchmarks/multi_stream.py)",
            note + _table(["model", *variants], rows),
        )
    if kind == "record_pipeline":
        rows = [
            [name, r.get("examples_per_s"), r.get("skipped", "")]
            for name, r in report["results"].items()
        ]
        return "TFRecord pipelines (benchmarks/record_pipeline.py)", _table(
            ["pipeline", "examples/s (median)", "note"], rows
        )
    if kind == "device_staging":
        methods: List[str] = []
        for c in report["cells"]:
            methods += [m for m in c["ms_per_item"] if m not in methods]
        rows = [
            [
                c["mb"],
                c["memory"],
                c["compute_ms"],
                *[c["ms_per_item"].get(m) for m in methods],
                c["staged_vs_best_peer"],
            ]
            for c in report["cells"]
        ]
        device = report.get("machine", {}).get("device", "")
        note = (
            f"<p>ms per item into a CUDA loop{' on ' + html.escape(device) if device else ''} "
            "(median over rounds); staged / best peer &gt; 1: torch_stage faster.</p>"
        )
        return "Host-to-device staging (benchmarks/device_staging.py)", note + _table(
            ["MB", "memory", "GPU ms", *methods, "staged / best peer"], rows
        )
    flat = [[k, json.dumps(v)[:200]] for k, v in report.items()]
    return f"{kind}", _table(["key", "value"], flat)


# -- the page -----------------------------------------------------------------------------

_CSS = """
body { font-family: -apple-system, Helvetica, Arial, sans-serif; max-width: 1100px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; }
img { max-width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; } td:first-child { text-align: left; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.note { color: #666; font-size: 0.9em; }
"""


def build_report(
    out: str,
    *,
    trace_path: Optional[str] = None,
    demo_path: Optional[str] = None,
    bench_paths: Sequence[str] = (),
    plan: Optional[str] = None,
    input_shapes: Sequence[Sequence[int]] = (),
    num_streams: int = 4,
    plan_max_nodes: int = 0,
    timeline_items: int = 12,
    inline: bool = False,
    plan_optional: bool = False,
) -> List[str]:
    """Write the page at ``out`` and its images beside it; returns the image
    paths. See the module docstring for the sections."""
    if plan is not None:
        _dot()  # before any drawing: a missing tool fails fast
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    images: List[str] = []
    sections: List[str] = []

    def image(name: str, alt: str) -> str:
        path = os.path.join(folder, name)
        images.append(path)
        if inline:
            with open(path, "rb") as f:
                src = "data:image/png;base64," + base64.b64encode(f.read()).decode()
        else:
            src = name
        return f'<img src="{src}" alt="{html.escape(alt)}">'

    trace = tracing.load(trace_path) if trace_path else None
    demo = None
    if demo_path:
        with open(demo_path) as f:
            demo = json.load(f)
    diagnosis = _diagnosis(trace, demo)
    if diagnosis is not None:
        what = "the demo (examples/demo.py)" if demo is not None else f"the trace {trace_path}"
        sentences = "".join(f"<p>{html.escape(s)}</p>" for s in diagnosis.sentences())
        draw_overlap(diagnosis, os.path.join(folder, "overlap.png"))
        sections.append(
            f"<h2>Where does the time go?</h2><p class=note>From {html.escape(what)}.</p>"
            f"{sentences}<pre>{html.escape(diagnosis.table())}</pre>"
            + image("overlap.png", "overlap bar: sum vs max vs measured step")
        )
    if trace is not None:
        stage = _first_stage(trace)
        draw_timeline(trace, os.path.join(folder, "timeline.png"), stage, timeline_items)
        draw_occupancy(trace, os.path.join(folder, "occupancy.png"), stage)
        sections.append(
            "<h2>Timeline</h2><p>Each row is a thread; the window is a few steps of the staged "
            f"run of stage <code>{html.escape(stage)}</code>. Open the trace itself "
            f"(<code>{html.escape(os.path.abspath(trace_path))}</code>) in "
            '<a href="https://ui.perfetto.dev">Perfetto</a> or <code>chrome://tracing</code> '
            "for every step.</p>"
            + image("timeline.png", "per-thread timeline")
            + "<h2>Buffer occupancy</h2><p>Near zero: the loop takes items as soon as they "
            "arrive (input-bound); at capacity: producers are ahead (compute-bound).</p>"
            + image("occupancy.png", "buffer occupancy over time")
        )
    plan_html = None
    if plan is not None:
        try:
            gm = plan_of(plan, input_shapes, num_streams)
            draw_plan(gm, os.path.join(folder, "plan.png"), plan_max_nodes)
        except DotMissingError:
            raise
        except (ImportError, ValueError) as e:
            if not plan_optional:
                raise
            plan_html = f"<p class=note>No plan drawn: {html.escape(str(e))}</p>"
        else:
            shown = (
                f"the first {plan_max_nodes} of {len(gm.stream_plan.assignment)} nodes"
                if 0 < plan_max_nodes < len(gm.stream_plan.assignment)
                else f"all {len(gm.stream_plan.assignment)} nodes"
            )
            plan_html = (
                f"<p>The plan <code>torch_stage.multi_stream</code> makes for "
                f"<code>{html.escape(plan)}</code> with {num_streams} streams ({shown}). "
                "Node colour: the stream it runs on; bold coloured edges: a cross-stream "
                "dependency ordered by the labelled event (recorded after the source, waited "
                "on before the target); dashed: ordered by an earlier wait; grey: same stream."
                "</p>"
                + image("plan.png", "multi-stream plan")
                + f"<pre>{html.escape(str(gm.stream_plan))}</pre>"
            )
        sections.append("<h2>Multi-stream plan</h2>" + plan_html)
    benches = []
    for path in bench_paths:
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not a benchmark's JSON output: {e}") from None
        title, body = bench_section(data)
        benches.append(f"<h3>{html.escape(title)}</h3>{body}")
    if benches:
        sections.append("<h2>Benchmarks against the peers</h2>" + "".join(benches))
    if not sections:
        raise ValueError(
            "nothing to report: give --trace, --demo, --bench or --plan (or run `make demo` first)"
        )
    page = (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        "<title>torch_stage report</title>"
        f"<style>{_CSS}</style></head><body><h1>torch_stage report</h1>"
        + "".join(sections)
        + "</body></html>"
    )
    with open(out, "w") as f:
        f.write(page)
    return images


def _diagnosis(trace, demo) -> Optional[_diagnose.Diagnosis]:
    if demo is not None:
        stats = demo["stage_stats"]
        return _diagnose.diagnose(
            stats,
            steps=demo["steps"],
            seconds=demo["torch_stage_s"],
            num_threads=demo.get("num_threads", 1),
            plain_seconds=demo["plain_loop_s"],
            corun_seconds=demo.get("side_by_side_s"),
        )
    if trace is not None and trace.stage_names():
        stats = trace.stage_stats(_first_stage(trace))
        if stats["steps"] >= 2 and stats["seconds"] > 0:
            return _diagnose.diagnose(
                stats,
                steps=stats["steps"],
                seconds=stats["seconds"],
                num_threads=stats["num_threads"],
            )
    return None


def _shape(text: str) -> List[int]:
    try:
        dims = [int(d) for d in text.split(",")]
    except ValueError:
        dims = []
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(
            f"an input shape is positive integers separated by commas (1,3,224,224), got {text!r}"
        )
    return dims


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_stage.observe.report",
        description="One HTML page with pictures of a torch_stage run.",
    )
    parser.add_argument("-o", "--out", default="build/report/index.html", help="the page to write")
    parser.add_argument(
        "--from", dest="source", default="build", help="where make demo/bench wrote"
    )
    parser.add_argument("--trace", default=None, help="a torch_stage.trace() JSON file")
    parser.add_argument("--demo", default=None, help="examples/demo.py --out's demo.json")
    parser.add_argument("--bench", nargs="*", default=None, help="benchmarks' --json files")
    parser.add_argument("--no-bench", action="store_true", help="leave the benchmarks out")
    parser.add_argument("--plan", default=None, help="package.module:name[(args)] to plan")
    parser.add_argument("--no-plan", action="store_true", help="draw no plan")
    parser.add_argument(
        "--input-shape", action="append", type=_shape, default=[], help="example input shape"
    )
    parser.add_argument("--num-streams", type=int, default=4)
    parser.add_argument("--plan-max-nodes", type=int, default=0, help="draw only the first N")
    parser.add_argument("--timeline-items", type=int, default=12, help="steps in the timeline")
    parser.add_argument("--inline", action="store_true", help="embed images as data URIs")
    args = parser.parse_args(argv)

    def default(path: str) -> Optional[str]:
        path = os.path.join(args.source, path)
        return path if os.path.exists(path) else None

    trace_path = args.trace or default("demo/trace.json")
    demo_path = args.demo or default("demo/demo.json")
    if args.no_bench:
        bench = []
    elif args.bench is not None:
        bench = args.bench
    else:
        bench = sorted(glob.glob(os.path.join(args.source, "bench", "*.json")))
    plan = None if args.no_plan else (args.plan or DEFAULT_PLAN)
    try:
        images = build_report(
            args.out,
            trace_path=trace_path,
            demo_path=demo_path,
            bench_paths=bench,
            plan=plan,
            input_shapes=args.input_shape,
            num_streams=args.num_streams,
            plan_max_nodes=args.plan_max_nodes,
            timeline_items=args.timeline_items,
            inline=args.inline,
            # The default plan needs torchvision: without it the page says so.
            plan_optional=args.plan is None,
        )
    except (DotMissingError, ValueError, TypeError, OSError) as e:
        print(f"torch_stage.observe.report: {e}", file=sys.stderr)
        return 2
    used = [p for p in (trace_path, demo_path, *bench) if p]
    print(f"wrote {args.out} ({len(images)} images) from {', '.join(used) or 'no run files'}")
    if plan is not None and not any(p.endswith("plan.png") for p in images):
        print(
            f"no plan drawn: {plan} does not import here (torchvision needs its own venv: "
            "`make report` draws GoogLeNet's from .venv-zoo), or pass --plan "
            "package.module:name",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
