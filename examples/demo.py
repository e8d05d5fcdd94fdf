"""torch_stage's headline demonstration: the classic input-queue experiment.

A 2-layer MLP (1024 -> 1024 -> 1, ReLU, Adam with lr 1e-2) learns whether a
row of random-normal numbers sums to more than zero. The data side makes each
batch (128 x 1024 inputs, labels = row sum > 0). The plain loop makes a batch
and then trains on it; the staged loop lets torch_stage make the batches in a
background thread (and copy them to the GPU when there is one) while the
model trains. The classic queue tutorial reports 18 s -> 11.5 s for 5000 steps
on a GTX Titan X.

Ends with a short table and sentences (torch_stage.observe.diagnose): input-bound
or compute-bound, the speedup against the best the shapes allow (D + C over
max(D, C)), and what to change. --json prints the figures and the stage's
stats() as JSON instead; --out DIR also writes them (demo.json) and a trace
of a short staged run (trace.json, Chrome trace JSON: open it in
https://ui.perfetto.dev) for `python -m torch_stage.observe.report`.
"""

import argparse
import json
import os
import threading
import time

import torch

import torch_stage
from torch_stage.observe.diagnose import diagnose


def make_batch(batch: int, width: int, device: torch.device):
    """The data side: random inputs and their labels."""
    x = torch.randn(batch, width)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    if device.type != "cpu":
        x, y = x.to(device), y.to(device)
    return x, y


def make_model(width: int, device: torch.device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
    ).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model, opt, x, y) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
    loss.backward()
    opt.step()
    return loss


def make_stage(args, device: torch.device):
    """The demo's input stage: batches made on the CPU by background
    threads, copied to ``device`` on a staging stream."""
    cpu = torch.device("cpu")
    return torch_stage.staged(
        lambda: make_batch(args.batch, args.width, cpu),
        capacity=args.capacity,
        num_threads=args.num_threads,
        device=None if device.type == "cpu" else device,
        stage_subgraph_stream_id=1,
        name="demo_input",
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def side_by_side(args, device: torch.device, model, opt, steps: int) -> float:
    """Seconds for one free thread to make ``steps`` batches while this one
    trains ``steps`` steps on a batch made before, nothing handed over: the
    least an overlapped loop can cost on this machine, whatever its cores
    share (hyperthreads of one core run two such threads at far less than
    twice the speed)."""
    cpu = torch.device("cpu")
    # As many batches as the stage holds and hands over, used in turn, so
    # the step reads batches out of cache as often as the staged one does.
    batches = [make_batch(args.batch, args.width, cpu) for _ in range(args.capacity + 2)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]

    def produce():
        for _ in range(steps):
            make_batch(args.batch, args.width, cpu)

    sync(device)
    start = time.perf_counter()
    producer = threading.Thread(target=produce)
    producer.start()
    for i in range(steps):
        train_step(model, opt, *batches[i % len(batches)])
    producer.join()
    sync(device)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two loops")
    # The tutorial's shapes (128 x 1024) on a GPU. On a small CPU machine
    # that MLP's step costs ~10x the batch, so overlap could gain at most
    # ~1.1x; 1024 x 128 makes data and compute comparable, the regime staging
    # is for. best_possible_speedup in the output says what the shapes allow.
    gpu = torch.cuda.is_available()
    parser.add_argument("--batch", type=int, default=128 if gpu else 1024)
    parser.add_argument("--width", type=int, default=1024 if gpu else 128)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--intra-op-threads",
        type=int,
        default=None,
        help="torch threads of the training step, the same for both loops (default on CPU: "
        "the cores left after --num-threads stage threads; on a GPU: torch's default)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--out",
        default=None,
        help="a folder for demo.json and trace.json (a traced staged run), as read by "
        "`python -m torch_stage.observe.report`",
    )
    parser.add_argument(
        "--trace-steps", type=int, default=200, help="steps of the traced run (with --out)"
    )
    args = parser.parse_args()
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    # On CPU the training step and the stage's producer share the cores. With
    # every core in the step's OpenMP team, each barrier waits for the thread
    # whose core the producer took, and the overlapped loop can end up slower
    # than the sequential one; a data pipeline needs cores of its own (as
    # DataLoader workers do). Both loops run with the same setting.
    threads = args.intra_op_threads
    if threads is None and device.type == "cpu":
        threads = max(1, (os.cpu_count() or 1) - args.num_threads)
    if threads is not None:
        torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    chunk = max(1, args.steps // args.rounds)

    plain_model, plain_opt = make_model(args.width, device)
    staged_model, staged_opt = make_model(args.width, device)
    side_model, side_opt = make_model(args.width, device)
    # Warm-up (allocator, kernels) outside the timings.
    for model, opt in (
        (plain_model, plain_opt),
        (staged_model, staged_opt),
        (side_model, side_opt),
    ):
        x, y = make_batch(args.batch, args.width, cpu)
        train_step(model, opt, x.to(device), y.to(device))

    # The two loops alternate in rounds, so that both see the same machine:
    # a busy neighbour slows them alike instead of skewing the ratio.
    plain_s = staged_s = side_s = 0.0
    totals: dict = {}
    for _ in range(args.rounds):
        # Plain loop: make a batch, then train on it.
        sync(device)
        start = time.perf_counter()
        for _ in range(chunk):
            x, y = make_batch(args.batch, args.width, cpu)
            plain_loss = train_step(plain_model, plain_opt, x.to(device), y.to(device))
        sync(device)
        plain_s += time.perf_counter() - start

        # The machine's bound: the same work side by side, nothing handed over.
        side_s += side_by_side(args, device, side_model, side_opt, chunk)

        # Staged: torch_stage makes the batches (and copies them to the
        # device) in the background while the model trains. The stage starts
        # on the first next(), inside the timing.
        stage = make_stage(args, device)
        with stage:
            sync(device)
            start = time.perf_counter()
            batches = iter(stage)
            for _ in range(chunk):
                x, y = next(batches)
                staged_loss = train_step(staged_model, staged_opt, x, y)
            sync(device)
            staged_s += time.perf_counter() - start
            for key, value in stage.stats().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    if key in ("capacity", "max_occupancy", "mean_occupancy"):
                        totals[key] = max(totals.get(key, 0), value)
                    else:
                        totals[key] = totals.get(key, 0) + value

    steps = chunk * args.rounds
    diagnosis = diagnose(
        totals,
        steps=steps,
        seconds=staged_s,
        num_threads=args.num_threads,
        plain_seconds=plain_s,
        corun_seconds=side_s,
    )
    report = {
        "device": str(device),
        "steps": steps,
        "intra_op_threads": torch.get_num_threads(),
        "plain_loop_s": round(plain_s, 3),
        "torch_stage_s": round(staged_s, 3),
        "side_by_side_s": round(side_s, 3),
        "speedup": round(plain_s / staged_s, 3),
        # Overlap can at best hide the shorter of data and compute:
        # plain = D + C per step, staged >= max(D, C), with D the
        # producer's time per batch, and no faster than the two side by
        # side on this machine's cores.
        "best_possible_speedup": round(diagnosis.best_speedup, 3),
        "of_best_possible": round(diagnosis.speedup / diagnosis.best_speedup, 3),
        "final_loss": {
            "plain": round(plain_loss.item(), 4),
            "staged": round(staged_loss.item(), 4),
        },
        "stage_stats": {k: round(v, 4) if isinstance(v, float) else v for k, v in totals.items()},
        "num_threads": args.num_threads,
        "capacity": args.capacity,
        "diagnosis": {
            "bound": diagnosis.bound,
            "data_ms": round(diagnosis.data_ms, 4),
            "compute_ms": round(diagnosis.compute_ms, 4),
            "plain_step_ms": round(diagnosis.sequential_ms, 4),
            "ideal_step_ms": round(diagnosis.ideal_ms, 4),
            "independent_cores_step_ms": round(diagnosis.independent_ms, 4),
            "side_by_side_step_ms": round(diagnosis.corun_step_ms, 4),
            "staged_step_ms": round(diagnosis.step_ms, 4),
            "wait_ms": round(diagnosis.wait_ms, 4),
            "sentences": diagnosis.sentences(),
        },
    }
    if args.out is not None:
        # A short staged run under torch_stage.trace, after the timings so
        # that they are the untraced loop's.
        trace_path = os.path.join(args.out, "trace.json")
        stage = make_stage(args, device)
        with torch_stage.trace(trace_path), stage:
            batches = iter(stage)
            for _ in range(args.trace_steps):
                x, y = next(batches)
                train_step(staged_model, staged_opt, x, y)
        report["trace"] = os.path.abspath(trace_path)
        with open(os.path.join(args.out, "demo.json"), "w") as f:
            json.dump(report, f, indent=2)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"torch_stage demo on {device}: {steps} training steps of a 2-layer MLP on "
        f"batches of {args.batch} x {args.width}, {torch.get_num_threads()} intra-op "
        f"thread(s) for the step, {args.num_threads} producer thread(s), capacity "
        f"{args.capacity}\n"
    )
    print(f"plain loop   {plain_s:7.2f} s   (make a batch, then train)")
    print(f"torch_stage  {staged_s:7.2f} s   (batches made in a background thread)\n")
    print(diagnosis.table())
    print()
    for sentence in diagnosis.sentences():
        print(sentence)
    print(
        f"\nFinal loss: plain {plain_loss.item():.4f}, staged {staged_loss.item():.4f}. "
        "--json for the figures as JSON."
    )
    if args.out is not None:
        print(
            f"Wrote {os.path.join(args.out, 'demo.json')} and a trace of {args.trace_steps} "
            f"staged steps, {report['trace']} (open it in https://ui.perfetto.dev); "
            "`make report` draws the pictures."
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
