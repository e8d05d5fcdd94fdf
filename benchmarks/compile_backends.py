"""torch.compile backends side by side: what a user picks between.

For each model (tests/zoo.py's, and when installed Hugging Face's tiny BERT
and torchvision's GoogLeNet and MobileNetV3-small), each mode (``forward``:
inference under ``torch.no_grad()``; ``train``: forward, backward and an SGD
step) and each batch size (``--batches``, default 1 and 32), in the same
run, interleaved round by round:

* ``eager``: the module as written;
* ``inductor``: ``torch.compile(module)``;
* ``inductor_ro``: ``torch.compile(module, mode="reduce-overhead")``
  (inductor's CUDA graphs; GPU only);
* ``torch_stage``: ``torch.compile(module, backend="torch_stage")``
  (torch_stage's streams on inductor);
* ``torch_stage_ro``: the same with ``mode="reduce-overhead"`` (GPU only);
* ``torch_stage_eager``: ``backend=torch_stage.backend(executor="eager")``
  (Dynamo's graph rewritten with torch_stage's stream ops, run eagerly).

Times per call: on a GPU with CUDA events, on the CPU with the wall clock;
each round times every variant ``--iters`` calls and takes the median, and
the report gives each variant's median over rounds and its time relative
to ``inductor`` as the median of the per-round ratios (a machine whose load
changes slows every variant of a round alike). Each row also says whether
every variant's output matches eager within float tolerance, and the plan
torch_stage made (streams used; on the CPU a plan is recorded but not
applied: there are no streams, and inductor compiles Dynamo's graph as it
is).

Prints a table on stderr and one JSON document on stdout (``--json PATH``
also writes it).

Usage: python benchmarks/compile_backends.py [--batches 1,32] [--modes forward,train]
       [--models NAME,...] [--rounds N] [--iters N] [--json PATH]
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch

import torch_stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import zoo  # noqa: E402
from _common import add_json_argument, emit, machine, progress  # noqa: E402

NUM_STREAMS = 4
VARIANTS = (
    "eager",
    "inductor",
    "inductor_ro",
    "torch_stage",
    "torch_stage_ro",
    "torch_stage_eager",
)
GPU_ONLY = ("inductor_ro", "torch_stage_ro")


class _Model:
    def __init__(self, name, build, inputs, random=False):
        self.name, self.build, self.inputs, self.random = name, build, inputs, random


def _models():
    models = [
        _Model(
            e.name,
            lambda e=e: zoo.build(e),
            lambda b, d, e=e: e.inputs(max(b, e.min_batch), d),
            e.random,
        )
        for e in zoo.ZOO
    ]
    try:
        import transformers

        def bert():
            config = transformers.BertConfig(
                vocab_size=1000,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=64,
            )
            torch.manual_seed(0)
            return transformers.BertModel(config)

        def ids(batch, device):
            g = torch.Generator().manual_seed(0)
            return (torch.randint(0, 1000, (batch, 16), generator=g).to(device),)

        models.append(_Model("hf_bert_2_layers", bert, ids))
    except ImportError:
        pass
    try:
        import torchvision

        def image(batch, device):
            g = torch.Generator().manual_seed(0)
            return (torch.randn(batch, 3, 64, 64, generator=g).to(device),)

        def googlenet():
            torch.manual_seed(0)
            return torchvision.models.googlenet(aux_logits=False, init_weights=False)

        def mobilenet():
            torch.manual_seed(0)
            return torchvision.models.mobilenet_v3_small()

        models += [
            _Model("googlenet", googlenet, image),
            _Model("mobilenet_v3_small", mobilenet, image),
        ]
    except (ImportError, RuntimeError):
        pass
    return models


def _output(value):
    """The tensor to compare of a model's output."""
    if isinstance(value, torch.Tensor):
        return value
    hidden = getattr(value, "last_hidden_state", None)
    if hidden is not None:
        return hidden
    return value[0]


def _compiled(variant, module):
    torch._dynamo.reset()
    if variant == "eager":
        return module, None
    if variant in ("inductor", "inductor_ro"):
        mode = "reduce-overhead" if variant == "inductor_ro" else None
        return torch.compile(module, mode=mode), None
    executor = "eager" if variant == "torch_stage_eager" else "inductor"
    mode = "reduce-overhead" if variant == "torch_stage_ro" else None
    backend = torch_stage.backend(num_streams=NUM_STREAMS, executor=executor, mode=mode)
    return torch.compile(module, backend=backend), backend


def _step(variant, model, fn, optimizer, inputs, train):
    if variant.endswith("_ro"):
        torch.compiler.cudagraph_mark_step_begin()
    if not train:
        with torch.no_grad():
            return _output(fn(*inputs))
    optimizer.zero_grad(set_to_none=True)
    out = _output(fn(*inputs))
    out.float().pow(2).mean().backward()
    optimizer.step()
    return out.detach()


def _timer(device):
    if device == "cuda":

        def run(call, iters):
            times = []
            for _ in range(iters):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                call()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)

        return run

    def run(call, iters):
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return run


def bench(model, device, batch, train, rounds, iters, variants):
    timer = _timer(device)
    base = model.build().to(device).train(train)
    inputs = model.inputs(batch, device)
    row = {
        "model": model.name,
        "mode": "train" if train else "forward",
        "batch": inputs[0].shape[0],
    }
    calls, matches, plan = {}, {}, None
    torch.manual_seed(0)
    expected = _step("eager", base, copy.deepcopy(base), None, inputs, False) if not train else None
    for variant in variants:
        module = copy.deepcopy(base)
        fn, backend = _compiled(variant, module)
        optimizer = torch.optim.SGD(module.parameters(), lr=1e-3) if train else None

        def call(variant=variant, module=module, fn=fn, optimizer=optimizer):
            return _step(variant, module, fn, optimizer, inputs, train)

        torch.manual_seed(0)
        got = call()  # compiles, captures
        if expected is not None and not model.random:
            matches[variant] = bool(
                torch.allclose(got.float(), expected.float(), rtol=1e-3, atol=1e-4)
            )
        for _ in range(3):
            call()
        calls[variant] = call
        if backend is not None and variant == "torch_stage" and backend.plans:
            p = backend.plans[0]
            plan = {
                "graphs": len(backend.plans),
                "streams_used": len(p.streams_used),
                "note": p.note,
            }
    per_round = {v: [] for v in calls}
    for _ in range(rounds):
        for variant, call in calls.items():
            per_round[variant].append(timer(call, iters))
    key = "gpu_ms" if device == "cuda" else "cpu_ms"
    row[key] = {v: round(statistics.median(t), 4) for v, t in per_round.items()}
    row["time_vs_inductor"] = {
        v: round(statistics.median(a / b for a, b in zip(t, per_round["inductor"])), 3)
        for v, t in per_round.items()
    }
    if matches:
        row["matches_eager"] = matches
    if plan is not None:
        row["torch_stage_plan"] = plan
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,32", help="batch sizes (default 1,32)")
    parser.add_argument("--modes", default="forward,train", help="forward, train or both")
    parser.add_argument("--models", default=None, help="model names (default: all available)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per variant per round")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on the CPU (default 1)"
    )
    add_json_argument(parser)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    bad = set(modes) - {"forward", "train"}
    if bad:
        parser.error(f"--modes takes forward and train, got {sorted(bad)}")
    models = _models()
    if args.models:
        wanted = args.models.split(",")
        unknown = set(wanted) - {m.name for m in models}
        if unknown:
            known = ", ".join(m.name for m in models)
            parser.error(f"unknown models {sorted(unknown)}; available here: {known}")
        models = [m for m in models if m.name in wanted]
    variants = [v for v in VARIANTS if device == "cuda" or v not in GPU_ONLY]
    key = "gpu_ms" if device == "cuda" else "cpu_ms"
    header = f"{'model':<20}{'mode':<8}{'batch':>6}  " + "  ".join(f"{v:>17}" for v in variants)
    print(
        f"{key}, and time relative to inductor (median of {args.rounds} interleaved rounds)",
        file=sys.stderr,
    )
    print(header, file=sys.stderr)
    rows = []
    work = [(m, mode, b) for m in models for mode in modes for b in batches]
    for model, mode, batch in progress(work, "compile backends"):
        row = bench(model, device, batch, mode == "train", args.rounds, args.iters, variants)
        rows.append(row)
        cells = "  ".join(
            f"{row[key][v]:>8.3f} ({row['time_vs_inductor'][v]:.2f}x)" for v in variants
        )
        print(f"{model.name:<20}{mode:<8}{row['batch']:>6}  {cells}", file=sys.stderr, flush=True)
    skipped = {v: "no GPU" for v in GPU_ONLY} if device == "cpu" else {}
    emit(
        {
            "benchmark": "compile_backends",
            "device": device,
            "machine": machine(),
            "num_streams": NUM_STREAMS,
            "rounds": args.rounds,
            "iters": args.iters,
            "skipped": skipped,
            "rows": rows,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
