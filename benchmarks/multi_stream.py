"""Multi-stream execution: the model zoo of tests/zoo.py and planning time.

* ``models``: for each zoo model, whether the rewritten module
  (``torch_stage.multi_stream``, 4 streams) returns exactly what the eager
  module returns, the plan's size, and on a GPU the time per call of eager
  single-stream execution against the rewritten module, measured in the same
  run with CUDA events (median of ``--iters`` calls after warm-up), and their
  ratio. On CPU the stream ops do nothing, so only the match is reported.
* ``planning``: time of the C++ scheduler (``torch.ops.torch_stage.
  plan_streams``, the sync plan included) per strategy on layered random
  DAGs of 100, 1,000 and 10,000 nodes, and of the whole FX pass (analysis,
  plan, rewrite) on a generated graph of the same size.

Prints one JSON document.

Usage: python benchmarks/multi_stream.py [--iters N] [--batch N]
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

import torch_stage
from torch_stage.fx import MultiStreamPass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The zoo is shared with the tests rather than installed with the package.
sys.path.insert(0, os.path.join(ROOT, "tests"))
import zoo  # noqa: E402

SIZES = [100, 1000, 10000]
STRATEGIES = ["min_sync", "critical_path", "embedding", "user"]


def _gpu_ms(fn, inputs, iters):
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_models(device, batch, iters):
    results = []
    for entry in zoo.ZOO:
        module = zoo.build(entry, device).eval()
        inputs = entry.inputs(batch, device)
        rewritten = torch_stage.multi_stream(module, num_streams=4)
        with torch.no_grad():
            torch.manual_seed(0)
            expected = module(*inputs)
            torch.manual_seed(0)
            got = rewritten(*inputs)
        plan = rewritten.stream_plan
        row = {
            "model": entry.name,
            "results_match": bool(torch.equal(expected, got)),
            "strategy": plan.strategy,
            "streams_used": len(plan.streams_used),
            "events": len(plan.events),
            "waits": len(plan.waits),
        }
        if device == "cuda":
            with torch.no_grad():
                for fn in (module, rewritten):
                    _gpu_ms(fn, inputs, 5)
                eager = _gpu_ms(module, inputs, iters)
                multi = _gpu_ms(rewritten, inputs, iters)
            row.update(
                {
                    "eager_single_stream_ms": round(eager, 4),
                    "multi_stream_ms": round(multi, 4),
                    "speedup": round(eager / multi, 3),
                }
            )
        results.append(row)
    return results


def layered_dag(n, seed=0, width=8):
    """Edges of a layered DAG like a network's: each node reads one to three
    nodes of the two previous layers."""
    rng = random.Random(seed)
    edges = set()
    for v in range(width, n):
        layer_start = (v // width) * width
        lo = max(0, layer_start - 2 * width)
        for _ in range(rng.randint(1, 3)):
            edges.add((rng.randint(lo, layer_start - 1), v))
    return sorted(edges)


def _median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_scheduler(n, strategy, repeats):
    edges = layered_dag(n)
    rng = random.Random(1)
    costs = [float(rng.randint(1, 100)) for _ in range(n)]
    groups = [k if v % 97 == 0 else -1 for k, v in enumerate(range(n))]
    args = (
        n,
        [u for u, _ in edges],
        [v for _, v in edges],
        [0] * len(edges),
        costs,
        [-1] * n,
        [-1] * n,
        groups,
        strategy,
        4,
        True,
        False,
    )
    return _median_ms(lambda: torch.ops.torch_stage.plan_streams(*args), repeats), len(edges)


def generated_graph(n):
    """A GraphModule of n elementwise nodes with the layered DAG's shape."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(torch.sin, (x,)) for _ in range(min(8, n))]
    preds = {}
    for u, v in layered_dag(n):
        preds.setdefault(v, []).append(u)
    for v in range(len(nodes), n):
        args = [nodes[u] for u in preds[v]]
        value = args[0]
        for other in args[1:]:
            value = graph.call_function(torch.add, (value, other))
            nodes.append(value)
        nodes.append(graph.call_function(torch.cos, (value,)))
        if len(nodes) >= n:
            break
    graph.output(nodes[-1])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def bench_pass(n):
    gm = generated_graph(n)
    count = sum(1 for node in gm.graph.nodes if node.op == "call_function")
    stream_pass = MultiStreamPass(num_streams=4)
    ms = _median_ms(lambda: stream_pass.call(gm), 1 if n >= 10000 else 3)
    return ms, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=50, help="timed calls per model (GPU)")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {
        "benchmark": "multi_stream",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or "cpu",
        "num_streams": 4,
        "models": bench_models(device, args.batch, args.iters),
        "planning": [],
    }
    if device == "cpu":
        report["note"] = "no GPU: stream ops are no-ops on CPU, so only result equality is reported"
    for n in SIZES:
        for strategy in STRATEGIES:
            ms, edges = bench_scheduler(n, strategy, 3 if n >= 10000 else 10)
            report["planning"].append(
                {"nodes": n, "edges": edges, "strategy": strategy, "scheduler_ms": round(ms, 3)}
            )
        ms, count = bench_pass(n)
        report["planning"].append(
            {"nodes": count, "strategy": "auto", "whole_fx_pass_ms": round(ms, 1)}
        )
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
