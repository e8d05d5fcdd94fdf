"""Planning time of torch_stage.multi_stream without example inputs (what
torch.compile's backend always does), against torch.fx.symbolic_trace of
the same model, which planning includes: a model of T towers of L layers
(Linear, BatchNorm1d, in-place ReLU, Dropout; eval mode), median of R runs
after one warm-up run. The pass asks each node what it writes, what it may
alias and whether its module writes its own state, from runs on meta
stand-ins (torch_stage/streams/fx/effects.py); this measures what that costs.

Usage: python benchmarks/plan_time.py [--towers T] [--layers L] [--runs R] [--json]
"""

import argparse
import json
import statistics
import time

from _common import machine


def model(towers, layers):
    import torch

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(
                *[
                    m
                    for _ in range(layers)
                    for m in (
                        torch.nn.Linear(16, 16),
                        torch.nn.BatchNorm1d(16),
                        torch.nn.ReLU(inplace=True),
                        torch.nn.Dropout(0.1),
                    )
                ]
            )

        def forward(self, x):
            return self.layers(x)

    class Towers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.towers = torch.nn.ModuleList([Tower() for _ in range(towers)])

        def forward(self, x):
            return sum(t(x) for t in self.towers)

    return Towers().eval()


def timed(fn, runs):
    fn()  # warm-up: imports, first-call caches
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", type=int, default=8)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    import torch_stage

    m = model(args.towers, args.layers)
    modules = sum(1 for _ in m.modules())
    trace_s = timed(lambda: torch.fx.symbolic_trace(m), args.runs)
    plan_s = timed(lambda: torch_stage.multi_stream(m), args.runs)
    x = torch.randn(4, 16)
    assert torch.equal(torch_stage.multi_stream(m)(x), m(x))
    result = {
        "machine": machine(),
        "towers": args.towers,
        "layers_per_tower": args.layers,
        "modules": modules,
        "runs": args.runs,
        "symbolic_trace_s": round(trace_s, 4),
        "multi_stream_s": round(plan_s, 4),
        "multi_stream_over_trace": round(plan_s / trace_s, 1),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{modules} modules ({args.towers} towers x {args.layers} layers), median of {args.runs}")
    print(f"{'step':<32}{'seconds':>10}")
    print(f"{'torch.fx.symbolic_trace':<32}{trace_s:>10.3f}")
    print(f"{'torch_stage.multi_stream':<32}{plan_s:>10.3f}")
    print(f"multi_stream is {plan_s / trace_s:.1f}x the trace it starts from")


if __name__ == "__main__":
    main()
