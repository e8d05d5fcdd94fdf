"""Host cost of multi-stream modules in instructions, which a loaded machine
does not change: each zoo model's forward (batch 1, CPU) eagerly, as its
plain FX GraphModule and rewritten by torch_stage.multi_stream, counted by
valgrind's callgrind over N calls. Prints a table, or JSON with --json.

Wall-clock ratios (benchmarks/multi_stream.py) move with the load of a
shared machine; instruction counts do not, though an instruction of Python
bookkeeping and one of a kernel do not cost the same time.

How: the script runs itself under callgrind with collection off; each
variant's N calls run inside one ctypes callback, and callgrind collects,
and dumps, only inside libffi's ffi_call around it.

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
MODELS = ["two_tower", "inception", "rec_8_towers"]
VARIANTS = ["eager", "fx_graph_module", "multi_stream"]


def _child(calls, models):
    """Under callgrind: each variant's calls inside one ctypes callback."""
    import ctypes

    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import zoo

    import torch_stage

    torch.set_num_threads(1)
    callback = ctypes.CFUNCTYPE(None)
    for name in models:
        entry = next(e for e in zoo.ZOO if e.name == name)
        module = zoo.build(entry).eval()
        inputs = entry.inputs(max(1, entry.min_batch), "cpu")
        variants = {
            "eager": module,
            "fx_graph_module": torch_stage.streams.fx.MultiStreamPass(num_streams=4).trace(module),
            "multi_stream": torch_stage.multi_stream(module, num_streams=4),
        }
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
                *models,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"the callgrind run failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
        labels = [line.split() for line in proc.stdout.splitlines() if line.strip()]
        dumps = sorted(glob.glob(f"{tmp}/cg.out.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        if len(dumps) != len(labels):
            raise SystemExit(f"expected {len(labels)} callgrind dumps, found {len(dumps)}")
        counts = {}
        for (name, variant), path in zip(labels, dumps):
            with open(path) as f:
                total = next(int(line.split()[1]) for line in f if line.startswith("totals:"))
            counts.setdefault(name, {})[variant] = total // calls
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=MODELS, help=f"zoo models ({MODELS})")
    parser.add_argument("--calls", type=int, default=200, help="forwards per variant")
    parser.add_argument("--json", action="store_true", help="JSON on stdout")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    if args.child:
        _child(args.calls, args.models)
        return 0
    counts = _measure(args.calls, args.models)
    rows = [
        {
            "model": name,
            "instructions_per_forward": per,
            "vs_eager": {v: round(per[v] / per["eager"], 3) for v in VARIANTS if v != "eager"},
        }
        for name, per in counts.items()
    ]
    if args.json:
        print(json.dumps({"benchmark": "host_instructions", "calls": args.calls, "models": rows}))
        return 0
    print(f"{'model':<14} {'eager':>10} {'fx':>10} {'multi_stream':>13}  fx/eager  ms/eager")
    for row in rows:
        per, ratio = row["instructions_per_forward"], row["vs_eager"]
        print(
            f"{row['model']:<14} {per['eager']:>10,} {per['fx_graph_module']:>10,} "
            f"{per['multi_stream']:>13,}  {ratio['fx_graph_module']:>8.3f}  "
            f"{ratio['multi_stream']:>8.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
