"""Multi-stream execution: the model zoo of tests/zoo.py and planning time.

* ``models``: for each zoo model at a small batch (``--batch``, default 1),
  in the same run:

  - ``eager_single_stream``: the module as written;
  - ``fx_graph_module``: its traced graph before the multi-stream pass
    (what FX's generated code costs by itself), and
    ``fx_graph_module_again``, the same traced again: the spread of two
    equal modules in the same rounds;
  - ``eager_multi_stream``: ``torch_stage.multi_stream(module, 4 streams)``;
  - ``cuda_graph_single_stream`` / ``cuda_graph_multi_stream``: the same
    two replayed from CUDA graphs (``cuda_graphs=True``; GPU only);
  - ``compile_inductor``: ``torch.compile(module)`` (default backend);
  - ``compile_torch_stage``: ``torch.compile(module, backend="torch_stage")``
    (on inductor; benchmarks/compile_backends.py compares the backends);
  - ``scripted_single_stream`` / ``scripted_multi_stream``: the traced
    graph and the multi-stream plan scripted with TorchScript, called from
    Python; and the same two saved and run from C++ with LibTorch alone
    (``benchmarks/cpp/scripted_bench``, built by ``make build``; its own
    interleaved rounds, ``cpp_us``), as a serving program runs them.

  Each row says whether every variant's results match eager (exactly for
  the eager multi-stream variants on CPU, within float tolerance otherwise; random
  models are compared only where they draw in eager order), the plan's
  size, and times per call: on a GPU with CUDA events (``gpu_ms``, median of
  ``--iters`` calls after warm-up) and the ratio of each to eager single
  stream. On CPU there are no streams and no CUDA graphs: the stream ops do
  nothing, so ``cpu_ms`` (wall clock, same method) measures only what is
  meaningful there: the host overhead of the stream ops, of Dynamo, and
  inductor's CPU code. The CUDA graph variants are reported as skipped.
* ``sanitizer``: host time per forward of each rewritten zoo model with and
  without ``torch_stage.sanitize_streams`` (with and without Python stacks
  per access), and the slowdown: the price of checking a plan.
* ``planning``: time of the C++ scheduler (``torch.ops.torch_stage.
  plan_streams``, the sync plan included) per strategy on layered random
  DAGs of 100, 1,000 and 10,000 nodes, and of the whole FX pass (analysis,
  plan, rewrite) on a generated graph of the same size.

Prints one JSON document.

Usage: python benchmarks/multi_stream.py [--iters N] [--batch N] [--no-inductor]
"""

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

import torch_stage
from torch_stage.streams.fx import MultiStreamPass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The zoo is shared with the tests rather than installed with the package.
sys.path.insert(0, os.path.join(ROOT, "tests"))
import zoo  # noqa: E402
from _common import add_json_argument, emit, median_ci, progress, verdict  # noqa: E402

SIZES = [100, 1000, 10000]
STRATEGIES = ["min_sync", "critical_path", "embedding", "user"]
NUM_STREAMS = 4
#: Issue 36's bound on CPU: a rewritten module's time per forward at most
#: this many times its FX module's (the stream calls' host cost).
MULTI_VS_FX_BOUND = 1.05


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


def _cpu_ms(fn, inputs, iters):
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(*inputs)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _script(module):
    with warnings.catch_warnings():
        # Said of every GraphModule's instance attributes; not ours to fix.
        warnings.filterwarnings("ignore", "The TorchScript type system doesn't support")
        return torch.jit.script(module)


def _variants(module, device, inductor):
    """name -> callable; the CUDA graph ones only on a GPU."""
    torch._dynamo.reset()
    traced = MultiStreamPass(num_streams=NUM_STREAMS).trace(module)
    multi = torch_stage.multi_stream(module, num_streams=NUM_STREAMS)
    variants = {
        "eager_single_stream": module,
        # The traced graph before the pass: what FX itself costs.
        "fx_graph_module": traced,
        # The same traced again: the spread of two equal modules timed in
        # the same rounds, against which multi/fx is read.
        "fx_graph_module_again": MultiStreamPass(num_streams=NUM_STREAMS).trace(module),
        "eager_multi_stream": multi,
        "scripted_single_stream": _script(traced),
        "scripted_multi_stream": _script(multi),
    }
    if device == "cuda":
        variants["cuda_graph_single_stream"] = torch_stage.CUDAGraphModule(module)
        variants["cuda_graph_multi_stream"] = torch_stage.multi_stream(
            module, num_streams=NUM_STREAMS, cuda_graphs=True
        )
    if inductor:
        variants["compile_inductor"] = torch.compile(module)
    variants["compile_torch_stage"] = torch.compile(
        module, backend="torch_stage", options={"num_streams": NUM_STREAMS}
    )
    return variants


CPP_BENCH = os.path.join(ROOT, "build", "cpp", "benchmarks", "cpp", "scripted_bench")
CPP_MODELS = ("scripted_single_stream", "scripted_multi_stream")


def _cpp_us(variants, inputs, iters, rounds):
    """The scripted variants saved and timed by the C++ program; None and
    the reason where it cannot run."""
    if not os.path.exists(CPP_BENCH):
        return None, f"{CPP_BENCH} is not built (make build)"
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name in CPP_MODELS:
            paths.append(os.path.join(tmp, f"{name}.pt"))
            torch.jit.save(variants[name], paths[-1])
        data = os.path.join(tmp, "inputs.pt")
        torch.save(tuple(inputs), data)
        proc = subprocess.run(
            [CPP_BENCH, data, str(iters), str(rounds), *paths],
            capture_output=True,
            text=True,
            timeout=600,
        )
    if proc.returncode != 0:
        return None, f"scripted_bench failed: {proc.stderr.strip()[-500:]}"
    got = json.loads(proc.stdout)
    return {
        "threads": got["threads"],
        "us_per_call": dict(zip(CPP_MODELS, (round(v, 2) for v in got["us_per_call"]))),
        "multi_vs_single_per_round_median": round(got["vs_first_per_round_median"][1], 3),
    }, None


def _matches(name, expected, got, device, random_ops):
    exact = device == "cpu" and name in (
        "fx_graph_module",
        "fx_graph_module_again",
        "eager_multi_stream",
        "scripted_single_stream",
        "scripted_multi_stream",
    )
    if exact:
        return bool(torch.equal(expected, got))
    if random_ops and name != "eager_multi_stream":
        # Inductor and graph replay draw random numbers differently.
        return "not compared (random ops)"
    return bool(torch.allclose(expected, got, rtol=1e-4, atol=1e-5))


def bench_models(device, batch, iters, inductor, rounds=5):
    results = []
    timer = _gpu_ms if device == "cuda" else _cpu_ms
    for entry in progress(zoo.ZOO, "models"):
        module = zoo.build(entry, device).eval()
        row_batch = max(batch, entry.min_batch)
        inputs = entry.inputs(row_batch, device)
        row = {"model": entry.name, "batch": row_batch}
        with torch.no_grad():
            variants = _variants(module, device, inductor)
            torch.manual_seed(0)
            expected = module(*inputs)
            matches = {}
            for name, fn in variants.items():
                if name == "eager_single_stream":
                    continue
                torch.manual_seed(0)
                matches[name] = _matches(name, expected, fn(*inputs), device, entry.random)
            row["results_match_eager"] = matches
            plan = variants["eager_multi_stream"].stream_plan
            row.update(
                {
                    "strategy": plan.strategy,
                    "streams_used": len(plan.streams_used),
                    "events": len(plan.events),
                    "waits": len(plan.waits),
                    # The pass's own model of the plan (host costs measured
                    # here), and what it decided where the plan did not pay.
                    "modelled_speedup": (
                        round(plan.estimate.speedup, 3) if plan.estimate is not None else None
                    ),
                    "note": plan.note,
                }
            )
            for fn in variants.values():  # warm-up (and compile, capture)
                timer(fn, inputs, 5)
            # Interleaved rounds: a machine whose load changes during the
            # run slows every variant of a round alike, so the per-round
            # ratios are steadier than a ratio of separate medians.
            per_round = {name: [] for name in variants}
            for _ in range(rounds):
                for name, fn in variants.items():
                    per_round[name].append(timer(fn, inputs, max(1, iters // rounds)))
            times = {name: statistics.median(v) for name, v in per_round.items()}
        base = times["eager_single_stream"]
        key = "gpu_ms" if device == "cuda" else "cpu_ms"
        row[key] = {name: round(ms, 4) for name, ms in times.items()}
        row["speedup_vs_eager_single_stream"] = {
            name: round(base / ms, 3) for name, ms in times.items() if name != "eager_single_stream"
        }
        row["time_vs_eager_per_round_median"] = {
            name: round(
                statistics.median(t / b for t, b in zip(v, per_round["eager_single_stream"])),
                3,
            )
            for name, v in per_round.items()
            if name != "eager_single_stream"
        }
        # Issue 36's measure: what the stream calls add to the graph they
        # are inserted in.
        for name, label in (
            ("eager_multi_stream", "multi_vs_fx"),
            ("fx_graph_module_again", "fx_again_vs_fx"),
        ):
            ratios = [m / f for m, f in zip(per_round[name], per_round["fx_graph_module"])]
            low, high, coverage = median_ci(ratios)
            row[f"{label}_per_round_median"] = round(statistics.median(ratios), 3)
            row[f"{label}_interval"] = [round(low, 3), round(high, 3), round(coverage, 3)]
        # On CPU, where the calls are all a plan adds: shown when the whole
        # 95% interval of the median lies at or under the bound (a plan on
        # one stream has no calls to show; streams_used says which). On a
        # GPU the ratio holds the streams' overlap too: no bound applies.
        row["multi_vs_fx_bound"] = MULTI_VS_FX_BOUND if device == "cpu" else None
        row["multi_vs_fx_verdict"] = (
            verdict(row["multi_vs_fx_interval"], at_most=MULTI_VS_FX_BOUND)
            if device == "cpu"
            else "no bound on a GPU"
        )
        if device == "cpu":
            # On a GPU the C++ program would time only the launches.
            cpp, why = _cpp_us(variants, inputs, max(1, iters // rounds), rounds)
            if cpp is None:
                row.setdefault("skipped", {})["cpp"] = why
            else:
                row["cpp_us"] = cpp
        if device != "cuda":
            row.setdefault("skipped", {}).update(
                {
                    "cuda_graph_single_stream": "no GPU",
                    "cuda_graph_multi_stream": "no GPU",
                }
            )
        if not inductor:
            row.setdefault("skipped", {})["compile_inductor"] = "--no-inductor"
        results.append(row)
        _table_row(row, key)
    return results


def _table_row(row, key):
    """One readable line per model on stderr (stdout is the JSON)."""
    times = row[key]
    base = times["eager_single_stream"]
    ratio = row["time_vs_eager_per_round_median"]
    cells = "  ".join(
        f"{name} {ms:.3f} ({ratio[name]:.3f}x)" for name, ms in times.items() if name in _TABLE
    )
    low, high, _ = row["multi_vs_fx_interval"]
    again_low, again_high, _ = row["fx_again_vs_fx_interval"]
    cells += (
        f"  multi/fx {row['multi_vs_fx_per_round_median']:.3f}x [{low:.3f}, {high:.3f}] "
        f"{row['multi_vs_fx_verdict']} (bound {row['multi_vs_fx_bound']}; fx again "
        f"{row['fx_again_vs_fx_per_round_median']:.3f} [{again_low:.3f}, {again_high:.3f}])"
    )
    cpp = row.get("cpp_us")
    if cpp is not None:
        us = cpp["us_per_call"]
        cells += (
            f"  C++ scripted {us['scripted_single_stream']:.1f} -> "
            f"{us['scripted_multi_stream']:.1f} us ({cpp['multi_vs_single_per_round_median']:.3f}x)"
        )
    print(f"{row['model']:<16} {key} eager {base:.3f}  {cells}", file=sys.stderr, flush=True)


_TABLE = (
    "fx_graph_module",
    "eager_multi_stream",
    "scripted_single_stream",
    "scripted_multi_stream",
    "compile_torch_stage",
)


def bench_sanitizer(batch, iters):
    """Host time per forward of each rewritten zoo model, with and without
    torch_stage.sanitize_streams (a debugging tool: every op goes through a
    Python dispatch mode), measured in the same run on CPU."""
    rows = []
    for entry in progress(zoo.ZOO, "sanitizer"):
        module = zoo.build(entry, "cpu").eval()
        inputs = entry.inputs(max(batch, entry.min_batch), "cpu")
        rewritten = torch_stage.multi_stream(module, num_streams=NUM_STREAMS)
        with torch.no_grad():
            _cpu_ms(rewritten, inputs, 5)
            plain = _cpu_ms(rewritten, inputs, iters)
            with torch_stage.sanitize_streams(stacks=False) as sanitizer:
                _cpu_ms(rewritten, inputs, 2)
                fast = _cpu_ms(rewritten, inputs, iters)
            with torch_stage.sanitize_streams() as sanitizer:
                _cpu_ms(rewritten, inputs, 2)
                full = _cpu_ms(rewritten, inputs, iters)
        rows.append(
            {
                "model": entry.name,
                "ops_per_forward": sanitizer.ops_seen // (iters + 2),
                "cpu_ms": round(plain, 4),
                "sanitized_cpu_ms": round(full, 4),
                "sanitized_no_stacks_cpu_ms": round(fast, 4),
                "slowdown": round(full / plain, 1),
                "slowdown_no_stacks": round(fast / plain, 1),
                "races": len(sanitizer.races),
            }
        )
    return rows


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


#: Host costs of a GPU's order, given (not measured) for --decisions: what
#: a plan made on this machine would decide where calls cost microseconds.
GPU_LIKE = dict(
    launch_us=6.0, fork_join_us=4.0, sync_us=2.0, record_us=1.5, wait_us=1.5, keep_us=0.5
)


def bench_decisions(device, batches=(2, 256)):
    """What the pay rule decides for each zoo model planned with examples,
    with the host costs measured here and with GPU_LIKE's."""
    from torch_stage.streams.fx.host_cost import HostCosts, planning_with

    rows = []
    for entry in zoo.ZOO:
        for batch in batches:
            for costs in ("measured", "gpu_like"):
                module = zoo.build(entry, device).eval()
                inputs = entry.inputs(max(batch, entry.min_batch), device)
                given = planning_with(HostCosts(**GPU_LIKE)) if costs == "gpu_like" else None
                with given if given is not None else contextlib.nullcontext():
                    plan = torch_stage.multi_stream(
                        module, num_streams=NUM_STREAMS, example_inputs=inputs
                    ).stream_plan
                estimate = plan.estimate
                row = {
                    "model": entry.name,
                    "batch": max(batch, entry.min_batch),
                    "host_costs": costs,
                    "streams_used": len(plan.streams_used),
                    "modelled_speedup": None if estimate is None else round(estimate.speedup, 3),
                    "note": plan.note,
                }
                rows.append(row)
                print(
                    f"{row['model']:<16} batch {row['batch']:>3} {costs:<8} "
                    f"streams {row['streams_used']}  modelled {row['modelled_speedup']}  "
                    f"{plan.note[:60]}",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--iters", type=int, default=2100, help="timed calls per variant, over all rounds"
    )
    parser.add_argument("--batch", type=int, default=1, help="batch size (small: 1)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=21,
        help="interleaved rounds the calls are split into (21 give a 95%% interval "
        "of the per-round median)",
    )
    parser.add_argument(
        "--only-models",
        action="store_true",
        help="the models section alone (no sanitizer, planning)",
    )
    parser.add_argument(
        "--no-inductor", action="store_true", help="leave out torch.compile's default backend"
    )
    parser.add_argument(
        "--decisions",
        action="store_true",
        help="the pay rule's decisions alone, with measured and with GPU-like host costs",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.decisions:
        emit(
            {"benchmark": "multi_stream_decisions", "decisions": bench_decisions(device)}, args.json
        )
        return 0
    report = {
        "benchmark": "multi_stream",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or "cpu",
        "num_streams": NUM_STREAMS,
        "models": bench_models(
            device, args.batch, args.iters, not args.no_inductor, max(1, args.rounds)
        ),
    }
    if args.only_models:
        emit(report, args.json)
        return 0
    # Sanitized forwards take milliseconds: a few hundred tell the slowdown.
    report["sanitizer"] = bench_sanitizer(args.batch, min(args.iters, 200))
    report["planning"] = []
    if device == "cpu":
        report["note"] = (
            "no GPU: stream ops are no-ops on CPU and CUDA graphs need a GPU, so cpu_ms "
            "(wall clock) shows host overheads only (stream ops, Dynamo, inductor's CPU "
            "code); multi-stream speedups can only be measured on a GPU"
        )
    for n in progress(SIZES, "planning sizes"):
        for strategy in STRATEGIES:
            ms, edges = bench_scheduler(n, strategy, 3 if n >= 10000 else 10)
            report["planning"].append(
                {"nodes": n, "edges": edges, "strategy": strategy, "scheduler_ms": round(ms, 3)}
            )
        ms, count = bench_pass(n)
        report["planning"].append(
            {"nodes": count, "strategy": "auto", "whole_fx_pass_ms": round(ms, 1)}
        )
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
