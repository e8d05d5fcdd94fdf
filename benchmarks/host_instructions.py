"""Host cost of multi-stream modules in instructions, which a loaded machine
does not change: each zoo model's forward (batch 1, CPU) eagerly, as its
plain FX GraphModule and rewritten by torch_stage.multi_stream, counted by
valgrind's callgrind over N calls. Prints a table, or JSON with --json.

Wall-clock ratios (benchmarks/multi_stream.py) move with the load of a
shared machine; instruction counts do not, though an instruction of Python
bookkeeping and one of a kernel do not cost the same time.

How: the script runs itself under callgrind with collection off; each
variant's N calls run inside one ctypes callback, and callgrind collects,
and dumps, only inside libffi's ffi_call around it. The stream calls' host
costs are measured here, outside valgrind, and the child plans with them:
measured under valgrind, every call looks dozens of times dearer and the
pay rule declines the plans whose calls this counts.

Usage: python benchmarks/host_instructions.py [--calls N] [--json] [MODEL ...]
(needs valgrind; a few minutes: importing torch under valgrind is slow)
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ["two_tower", "inception", "rec_8_towers", "in_place", "random_branches"]
VARIANTS = ["eager", "fx_graph_module", "multi_stream"]


def _child(calls, models, costs):
    """Under callgrind: each variant's calls inside one ctypes callback."""
    import ctypes

    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import zoo

    import torch_stage
    from torch_stage.streams.fx import _ops
    from torch_stage.streams.fx.host_cost import HostCosts, planning_with

    given = HostCosts(**json.loads(costs))

    torch.set_num_threads(1)
    callback = ctypes.CFUNCTYPE(None)
    for name in models:
        entry = next(e for e in zoo.ZOO if e.name == name)
        module = zoo.build(entry).eval()
        inputs = entry.inputs(max(1, entry.min_batch), "cpu")
        variants = {
            "eager": module,
            "fx_graph_module": torch_stage.streams.fx.MultiStreamPass(num_streams=4).trace(module),
        }
        with planning_with(given):
            variants["multi_stream"] = torch_stage.multi_stream(module, num_streams=4)
        plan = variants["multi_stream"].stream_plan
        # The calls a forward makes: one line of generated code each.
        stream_calls = sum(
            n.op == "call_function" and n.target in _ops.STREAM_OPS
            for n in variants["multi_stream"].graph.nodes
        )
        print(f"plan {name} {len(plan.streams_used)} {stream_calls}", flush=True)
        with torch.no_grad():
            for fn in variants.values():
                for _ in range(20):
                    fn(*inputs)
            for variant in VARIANTS:
                fn = variants[variant]

                def body(fn=fn, inputs=inputs):
                    for _ in range(calls):
                        fn(*inputs)

                print(f"{name} {variant}", flush=True)
                callback(body)()


def _measure(calls, models):
    if shutil.which("valgrind") is None:
        raise SystemExit("host_instructions needs valgrind (Debian's valgrind)")
    from dataclasses import asdict

    from torch_stage.streams.fx.host_cost import host_costs

    # With the device they were measured on: the pass chooses an issue
    # order by them where it runs (calls.py).
    costs = asdict(host_costs("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                "--toggle-collect=ffi_call",
                "--dump-after=ffi_call",
                f"--callgrind-out-file={tmp}/cg.out",
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                "--calls",
                str(calls),
                "--host-costs",
                json.dumps(costs),
                *models,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"the callgrind run failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
        lines = [line.split() for line in proc.stdout.splitlines() if line.strip()]
        plans = {w[1]: (int(w[2]), int(w[3])) for w in lines if w[0] == "plan"}
        labels = [w for w in lines if w[0] != "plan"]
        dumps = sorted(glob.glob(f"{tmp}/cg.out.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        if len(dumps) != len(labels):
            raise SystemExit(f"expected {len(labels)} callgrind dumps, found {len(dumps)}")
        counts = {}
        for (name, variant), path in zip(labels, dumps):
            with open(path) as f:
                total = next(int(line.split()[1]) for line in f if line.startswith("totals:"))
            counts.setdefault(name, {})[variant] = total // calls
    return counts, plans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=MODELS, help=f"zoo models ({MODELS})")
    parser.add_argument("--calls", type=int, default=200, help="forwards per variant")
    parser.add_argument("--json", action="store_true", help="JSON on stdout")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host-costs", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    if args.child:
        _child(args.calls, args.models, args.host_costs)
        return 0
    counts, plans = _measure(args.calls, args.models)
    rows = []
    for name, per in counts.items():
        streams, stream_calls = plans[name]
        added = per["multi_stream"] - per["fx_graph_module"]
        rows.append(
            {
                "model": name,
                "instructions_per_forward": per,
                "vs_eager": {v: round(per[v] / per["eager"], 3) for v in VARIANTS if v != "eager"},
                "streams_used": streams,
                "stream_calls_per_forward": stream_calls,
                # What the rewrite adds over its FX module, per stream call.
                "added_per_stream_call": round(added / stream_calls) if stream_calls else None,
            }
        )
    if args.json:
        print(json.dumps({"benchmark": "host_instructions", "calls": args.calls, "models": rows}))
        return 0
    print(
        f"{'model':<16} {'eager':>10} {'fx':>10} {'multi_stream':>13}  fx/eager  ms/eager"
        "  streams  calls  added/call"
    )
    for row in rows:
        per, ratio = row["instructions_per_forward"], row["vs_eager"]
        added = row["added_per_stream_call"]
        print(
            f"{row['model']:<16} {per['eager']:>10,} {per['fx_graph_module']:>10,} "
            f"{per['multi_stream']:>13,}  {ratio['fx_graph_module']:>8.3f}  "
            f"{ratio['multi_stream']:>8.3f}  {row['streams_used']:>7}  "
            f"{row['stream_calls_per_forward']:>5}  {'' if added is None else f'{added:,}':>10}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
