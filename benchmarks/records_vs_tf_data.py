"""Criteo-like TFRecord files through tf.data, the plain DataLoader and
torch_stage's records pipeline, side by side in one run: first the same
parsed values from all of them, then examples/s.

Each Example is one Criteo-like row: a label, 13 integer (count) features,
20 single-valued categorical ids and 6 multi-hot categorical features
(variable-length lists of 0..6 ids). Counts are small, heavy-tailed ints
with an occasional -1 (Criteo's I2 has a few negatives, which take 10
varint bytes); categorical ids are 32-bit hashes (5 varint bytes). Every
feature is int64, every key is present in every row. Two layouts of the
same values:

* ``columns`` (default): one feature per column, as a CSV -> Example
  conversion writes it: ``label``, ``I1``..``I13``, ``C1``..``C20`` (one
  value each) and ``C21``..``C26`` (variable-length): 40 features, about
  720 bytes a row in the file.
* ``packed``: the integer and single-valued categorical columns packed in
  one list each, as recommender pipelines often write them: ``label``,
  ``dense`` (13 values), ``cat`` (20 values), ``C21``..``C26``: 9 features,
  about 340 bytes a row in the file.

Pipelines (each yields a dict of batched tensors: fixed-length features as
(B,) or (B, n) int64, variable-length ones as values + row offsets):

* ``torch_stage``: what a user writes: ``RecordInput(files,
  batch_size=B)`` (C++ readers, 10000-record shuffle pool) under
  ``staged(records, transform=parse)`` with every other argument left at
  its default, where ``parse`` is ``parse_example`` (C++, GIL released,
  decoded straight into batch tensors).
* ``torch_stage_2t``: the same with ``num_threads=2`` given to ``staged``:
  two producer threads, each pulling a batch (under the source's lock: a
  hand-over of the bytes the mixer assembled) and parsing it concurrently.
* ``torch_stage_inline``: the same RecordInput, ``parse_example`` called in
  the training loop's thread (on torch's intra-op threads), no stage.
* ``dataloader``: the plain ``torch.utils.data.DataLoader(batch_size=B,
  num_workers=2)`` over an IterableDataset that parses each Example with
  the PyPI ``tfrecord`` package (protobuf), files split between workers,
  and a collate_fn that stacks the fixed features and concatenates the
  variable-length ones with their offsets: the peer a PyTorch user picks.
* ``tf_data``: ``tf.data.TFRecordDataset(files).shuffle(10000).repeat()
  .batch(B).map(lambda s: tf.io.parse_example(s, features),
  num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)`` with FixedLenFeature
  and RaggedFeature(int64, row_splits_dtype=int64) (values + row splits,
  the layout of torch_stage's Ragged), in a Python with TensorFlow
  (``--tf-python``, e.g. the venv ``make bench-tf`` makes), kept running
  between rounds as a subprocess. Skipped, and said so, without one.

Equality first: the first --check-records records of the first file, in
file order (no shuffle), parsed by every pipeline's parse step (TensorFlow
in its subprocess), must give identical tensors: every fixed feature, and
every variable-length feature's values and offsets. Any difference stops
the run with an error naming the feature before anything is timed.

Timing: rounds interleave the pipelines (torch_stage, 2t, inline,
dataloader, tf_data, torch_stage, ...) so that load from other processes on a shared
machine falls on all alike; each run builds its pipeline afresh, skips
--warmup batches (start-up, shuffle-pool fill), then counts examples for
at least --seconds. The median of the rounds is reported, with every run
in the JSON. Ratios are torch_stage's rate over each pipeline's: the ratio
of the medians, and the median of the ratios within each round (steadier
when the machine's load changes between rounds). The JSON also says
whether torch_stage reached the issue's target of 3,000,000 examples/s.

Where the CPU goes (Linux): for torch_stage's pipelines each run also reads
every thread's CPU time (/proc/self/task) before and after the timed
window and reports nanoseconds of CPU per example by phase: ``read``
(RecordInput's reader threads: file reads, CRC32C, framing), ``shuffle``
(its mixer thread: the shuffle pool and batch assembly), ``stage`` (the
stage's producer threads: the pull and the parse), ``consumer`` (the
loop's own thread; for inline runs, the parse) and ``other`` (torch's
intra-op threads). Their sum bounds the rate on free cores: 2 cores /
(total ns per example).

``--parse-only``: parse_example alone instead, over the first 50 batches
of the first file held in memory, on one thread (torch.set_num_threads(1)),
as examples per second of that thread's CPU time (which other processes on
a shared machine disturb far less than wall time).

``--stage-cost``: what a stage adds to the parse: the same batches, held in
memory, through ``staged(batches, transform=parse)`` (one producer thread,
the consumer doing nothing) and through parse_example in the loop,
alternated --rounds times; the median ratio of their wall times (1.0: the
stage costs nothing beyond the parse).

The files are generated once into build/bench_data/records_vs_tf_data/
and reused.

Usage: python benchmarks/records_vs_tf_data.py [--layout columns|packed]
       [--batch-size B] [--rounds R] [--seconds S] [--tf-python PATH]
       [--skip name,...] [--json] [--parse-only | --stage-cost]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from _common import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_ROOT = os.path.join(ROOT, "build", "bench_data", "records_vs_tf_data")
DATA_VERSION = 1
N_DENSE = 13
N_CAT = 20  # single-valued categorical columns C1..C20
N_MULTI = 6  # multi-hot categorical columns C21..C26
MAX_MULTI = 6  # ids per multi-hot feature: 0..6
PIPELINES = ("torch_stage", "torch_stage_2t", "torch_stage_inline", "dataloader", "tf_data")
OURS = ("torch_stage", "torch_stage_2t", "torch_stage_inline")
TARGET = 3_000_000  # examples/s on 2 cores, with defaults but batch size (issue 15)


# ---------------------------------------------------------------- schema


def schema(layout):
    """[(key, kind, width)]: kind "fixed" (width values a row; 0: a
    scalar) or "var" (a variable-length list)."""
    multi = [(f"C{N_CAT + 1 + k}", "var", None) for k in range(N_MULTI)]
    if layout == "packed":
        return [("label", "fixed", 0), ("dense", "fixed", N_DENSE), ("cat", "fixed", N_CAT)] + multi
    return (
        [("label", "fixed", 0)]
        + [(f"I{k + 1}", "fixed", 0) for k in range(N_DENSE)]
        + [(f"C{k + 1}", "fixed", 0) for k in range(N_CAT)]
        + multi
    )


def stage_features(layout):
    import torch

    import torch_stage

    out = {}
    for key, kind, width in schema(layout):
        if kind == "var":
            out[key] = torch_stage.VarLenFeature(torch.int64)
        else:
            out[key] = torch_stage.FixedLenFeature((width,) if width else (), torch.int64)
    return out


def rows(rng, n):
    """n Criteo-like rows as column arrays (shared by both layouts)."""
    dense = np.floor(np.exp(rng.normal(1.0, 1.6, size=(n, N_DENSE)))).astype(np.int64)
    dense[:, 1] = np.where(rng.random(n) < 0.03, -1, dense[:, 1])
    cat = rng.integers(0, 2**32, size=(n, N_CAT), dtype=np.int64)
    lengths = rng.integers(0, MAX_MULTI + 1, size=(n, N_MULTI))
    ids = rng.integers(0, 2**32, size=(n, N_MULTI, MAX_MULTI), dtype=np.int64)
    label = (rng.random(n) < 0.26).astype(np.int64)
    return label, dense, cat, lengths, ids


def encode_rows(layout, label, dense, cat, lengths, ids):
    import torch

    import torch_stage

    out = []
    for i in range(len(label)):
        ex = {"label": int(label[i])}
        if layout == "packed":
            ex["dense"] = dense[i].tolist()
            ex["cat"] = cat[i].tolist()
        else:
            for k in range(N_DENSE):
                ex[f"I{k + 1}"] = int(dense[i, k])
            for k in range(N_CAT):
                ex[f"C{k + 1}"] = int(cat[i, k])
        for k in range(N_MULTI):
            ex[f"C{N_CAT + 1 + k}"] = (ids[i, k, : lengths[i, k]].tolist(), torch.int64)
        out.append(torch_stage.encode_example(ex))
    return out


def data_files(layout, files, per_file):
    """Generate the files once (cached by a manifest); return paths, bytes."""
    import torch_stage

    data_dir = os.path.join(DATA_ROOT, layout)
    os.makedirs(data_dir, exist_ok=True)
    manifest = os.path.join(data_dir, "manifest.json")
    want = {"version": DATA_VERSION, "files": files, "per_file": per_file, "seed": 15}
    paths = [
        os.path.join(data_dir, f"criteo-{k:03d}-of-{files:03d}.tfrecord") for k in range(files)
    ]
    if os.path.exists(manifest):
        with open(manifest) as f:
            have = json.load(f)
        if have.get("spec") == want and all(os.path.exists(p) for p in paths):
            return paths, have["bytes"]
    print(f"generating {files} x {per_file} {layout} rows into {data_dir}", file=sys.stderr)
    rng = np.random.default_rng(want["seed"])
    total = 0
    for path in paths:
        with torch_stage.RecordWriter(path) as w:
            for start in range(0, per_file, 10_000):
                for rec in encode_rows(layout, *rows(rng, min(10_000, per_file - start))):
                    w.write(rec)
        total += os.path.getsize(path)
    with open(manifest, "w") as f:
        json.dump({"spec": want, "bytes": total}, f)
    return paths, total


# ------------------------------------------------------- torch pipelines


def run_torch_stage(paths, args):
    import torch_stage

    features = stage_features(args.layout)

    def parse(batch):
        return torch_stage.parse_example(batch, features)

    with torch_stage.RecordInput(paths, batch_size=args.batch_size) as records:
        with torch_stage.staged(records, transform=parse) as stage:
            return measure(stage, args, phases=True)


def run_torch_stage_2t(paths, args):
    import torch_stage

    features = stage_features(args.layout)

    def parse(batch):
        return torch_stage.parse_example(batch, features)

    with torch_stage.RecordInput(paths, batch_size=args.batch_size) as records:
        with torch_stage.staged(records, transform=parse, num_threads=2) as stage:
            return measure(stage, args, phases=True)


def run_torch_stage_inline(paths, args):
    import torch_stage

    features = stage_features(args.layout)
    with torch_stage.RecordInput(paths, batch_size=args.batch_size) as records:
        return measure((torch_stage.parse_example(b, features) for b in records), args, phases=True)


def make_per_example_dataset(paths, layout):
    import torch
    from tfrecord.reader import tfrecord_loader

    description = {key: "int" for key, _, _ in schema(layout)}

    class PerExample(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            mine = paths if info is None else paths[info.id :: info.num_workers]
            while True:  # repeat, as the other pipelines do
                for path in mine:
                    yield from tfrecord_loader(path, None, description)

    return PerExample()


class Collate:
    """Examples (dicts of int64 numpy arrays) -> a batch in torch_stage's
    layout: fixed features stacked, variable-length ones as
    (values, offsets). Picklable, runs in the workers."""

    def __init__(self, layout):
        self.schema = schema(layout)

    def __call__(self, examples):
        import torch

        out = {}
        for key, kind, width in self.schema:
            cols = [ex[key] for ex in examples]
            if kind == "var":
                sizes = torch.tensor([0] + [len(c) for c in cols], dtype=torch.int64)
                out[key] = (torch.from_numpy(np.concatenate(cols)), torch.cumsum(sizes, 0))
            else:
                stacked = torch.from_numpy(np.stack(cols))
                out[key] = stacked if width else stacked.reshape(-1)
        return out


def run_dataloader(paths, args):
    import torch

    loader = torch.utils.data.DataLoader(
        make_per_example_dataset(paths, args.layout),
        batch_size=args.batch_size,
        num_workers=args.workers,
        collate_fn=Collate(args.layout),
    )
    return measure(loader, args)


def thread_cpu():
    """{tid: (name, CPU seconds)} for this process's threads, or None where
    /proc/self/task is not there."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def phase_of(tid, name):
    if tid == os.getpid():
        return "consumer"
    if name.startswith("tsrec:read"):
        return "read"
    if name.startswith("tsrec:mix"):
        return "shuffle"
    if name.startswith(("torch_stage:", "ts:")):
        return "stage"
    return "other"


PHASES = ("read", "shuffle", "stage", "consumer", "other")


def measure(batches, args, phases=False):
    """examples/s over at least args.seconds after args.warmup batches; with
    phases, the CPU nanoseconds per example of each phase too."""
    it = iter(batches)
    for _ in range(args.warmup):
        next(it)
    seen = 0
    before = thread_cpu() if phases else None
    start = time.perf_counter()
    while True:
        batch = next(it)
        seen += batch["label"].shape[0]
        elapsed = time.perf_counter() - start
        if elapsed >= args.seconds:
            break
    got = {"examples": seen, "seconds": round(elapsed, 3), "examples_per_s": seen / elapsed}
    after = thread_cpu() if before is not None else None
    if after is not None:
        ns = dict.fromkeys(PHASES, 0.0)
        for tid, (name, cpu) in after.items():
            ns[phase_of(tid, name)] += (cpu - before.get(tid, (name, 0.0))[1]) * 1e9 / seen
        got["cpu_ns_per_example"] = {k: round(v) for k, v in ns.items()}
    return got


# ---------------------------------------------------------------- tf.data

# Runs in the TensorFlow Python. argv[1]: JSON {schema, paths, batch_size,
# check_records, check_path}. Writes the parse of the first check_records
# records of paths[0] to check_path (.npz), prints "ready", then answers
# each "run SECONDS WARMUP" line on stdin with one JSON line.
TF_WORKER = r"""
import json, sys, time
import numpy as np
import tensorflow as tf

spec = json.loads(sys.argv[1])
features = {}
for key, kind, width in spec["schema"]:
    if kind == "var":
        features[key] = tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64)
    else:
        features[key] = tf.io.FixedLenFeature([width] if width else [], tf.int64)

def parse(serialized):
    return tf.io.parse_example(serialized, features)

n = spec["check_records"]
check = next(iter(tf.data.TFRecordDataset(spec["paths"][:1]).take(n).batch(n).map(parse)))
arrays = {}
for key, kind, _ in spec["schema"]:
    if kind == "var":
        arrays[key + ".values"] = check[key].values.numpy()
        arrays[key + ".offsets"] = check[key].row_splits.numpy()
    else:
        arrays[key] = check[key].numpy()
np.savez(spec["check_path"], **arrays)
print(json.dumps({"ready": True, "tensorflow": tf.__version__}), flush=True)

for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] != "run":
        break
    seconds, warmup = float(cmd[1]), int(cmd[2])
    ds = (tf.data.TFRecordDataset(spec["paths"])
          .shuffle(10000)
          .repeat()
          .batch(spec["batch_size"])
          .map(parse, num_parallel_calls=tf.data.AUTOTUNE)
          .prefetch(tf.data.AUTOTUNE))
    it = iter(ds)
    for _ in range(warmup):
        next(it)
    seen, start = 0, time.perf_counter()
    while True:
        batch = next(it)
        seen += int(batch["label"].shape[0])
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    del it, ds
    print(json.dumps({"examples": seen, "seconds": round(elapsed, 3),
                      "examples_per_s": seen / elapsed}), flush=True)
"""


class TfWorker:
    """The tf.data side in its own Python, alive across rounds."""

    def __init__(self, python, paths, args):
        self.check_path = os.path.join(DATA_ROOT, f"tf_check_{args.layout}.npz")
        spec = {
            "schema": schema(args.layout),
            "paths": paths,
            "batch_size": args.batch_size,
            "check_records": args.check_records,
            "check_path": self.check_path,
        }
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        self.proc = subprocess.Popen(
            [python, "-c", TF_WORKER, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        hello = self._line()
        self.tensorflow = hello["tensorflow"]
        self.python = python

    def _line(self):
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()
            raise RuntimeError(f"the tf.data worker failed:\n{err.strip()[-3000:]}")
        return json.loads(line)

    def check_arrays(self):
        with np.load(self.check_path) as f:
            return {k: f[k] for k in f.files}

    def run(self, args):
        self.proc.stdin.write(f"run {args.seconds} {args.warmup}\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def find_tf_python(args):
    if args.tf_python:
        if not os.path.exists(args.tf_python):
            raise SystemExit(f"--tf-python {args.tf_python!r} does not exist")
        return args.tf_python
    default = os.path.join(ROOT, ".venv-tf", "bin", "python")
    return default if os.path.exists(default) else None


# ------------------------------------------------------------- equality


def flatten(parsed, layout):
    """A parsed batch as {name: int64 numpy array} (var features: values and
    offsets)."""
    out = {}
    for key, kind, _ in schema(layout):
        v = parsed[key]
        if kind == "var":
            values, offsets = v[0], v[1]  # a Ragged or a (values, offsets) pair
            out[key + ".values"] = np.asarray(values)
            out[key + ".offsets"] = np.asarray(offsets)
        else:
            out[key] = np.asarray(v)
    return out


def check_equal(paths, args, tf_worker):
    """Every pipeline's parse of the same records gives the same tensors;
    raises SystemExit naming the first difference."""
    from tfrecord.reader import tfrecord_loader

    import torch_stage

    n = args.check_records
    batch = next(torch_stage.read_records(paths[0], batch_size=n))
    if batch.num_records != n:
        raise SystemExit(f"{paths[0]} holds fewer than --check-records={n} records")
    ours = flatten(torch_stage.parse_example(batch, stage_features(args.layout)), args.layout)
    description = {key: "int" for key, _, _ in schema(args.layout)}
    examples = []
    for ex in tfrecord_loader(paths[0], None, description):
        examples.append(ex)
        if len(examples) == n:
            break
    peers = {"dataloader": flatten(Collate(args.layout)(examples), args.layout)}
    if tf_worker is not None:
        peers["tf_data"] = tf_worker.check_arrays()
    for peer, got in peers.items():
        if sorted(got) != sorted(ours):
            raise SystemExit(
                f"equality check FAILED: {peer} gives {sorted(got)}, torch_stage {sorted(ours)}"
            )
        for name, want in ours.items():
            have = got[name]
            same = have.dtype == want.dtype and have.shape == want.shape
            if not (same and np.array_equal(have, want)):
                bad = (
                    ""
                    if have.shape != want.shape
                    else f", first difference at {np.argwhere(have != want)[0].tolist()}"
                )
                raise SystemExit(
                    f"equality check FAILED: '{name}' of the first {n} records of {paths[0]}: "
                    f"{peer} gives {have.dtype} {have.shape}, torch_stage {want.dtype} "
                    f"{want.shape}{bad}"
                )
    values = sum(int(v.size) for k, v in ours.items() if not k.endswith(".offsets"))
    return {"records": n, "values_compared": values, "peers": sorted(peers), "equal": True}


# ----------------------------------------------------------------- main


def parse_only(paths, args):
    """parse_example's rate per CPU-second of one thread."""
    import torch

    import torch_stage

    features = stage_features(args.layout)
    batches = [
        b for _, b in zip(range(50), torch_stage.read_records(paths[0], batch_size=args.batch_size))
    ]
    examples = sum(b.num_records for b in batches)
    torch.set_num_threads(1)
    rates = []
    for _ in range(args.rounds):
        start = time.thread_time()
        reps = 0
        while time.thread_time() - start < args.seconds:
            for b in batches:
                torch_stage.parse_example(b, features)
            reps += 1
        rates.append(reps * examples / (time.thread_time() - start))
    return {
        "benchmark": "records_vs_tf_data --parse-only",
        "layout": args.layout,
        "batch_size": args.batch_size,
        "examples_per_cpu_s": round(statistics.median(rates)),
        "runs": [round(r) for r in rates],
    }


def stage_cost(paths, args):
    """Wall time of staged(parse) over in-memory batches against the same
    parse in the loop, alternated; the median of the per-pair ratios."""
    import torch_stage

    features = stage_features(args.layout)
    with torch_stage.RecordInput(paths, batch_size=args.batch_size) as records:
        batches = [b for _, b in zip(range(200), records)]
    examples = len(batches) * args.batch_size

    def parse(batch):
        return torch_stage.parse_example(batch, features)

    def staged_run():
        start = time.perf_counter()
        with torch_stage.staged(batches, transform=parse, num_threads=1, capacity=4) as stage:
            for _ in stage:
                pass
        return time.perf_counter() - start

    def loop_run():
        start = time.perf_counter()
        for b in batches:
            parse(b)
        return time.perf_counter() - start

    pairs = [(staged_run(), loop_run()) for _ in range(max(args.rounds, 1) * 3)]
    ratios = [s / i for s, i in pairs]
    return {
        "benchmark": "records_vs_tf_data --stage-cost",
        "layout": args.layout,
        "batch_size": args.batch_size,
        "staged_over_loop": round(statistics.median(ratios), 3),
        "staged_ns_per_example": round(statistics.median(s for s, _ in pairs) / examples * 1e9),
        "loop_ns_per_example": round(statistics.median(i for _, i in pairs) / examples * 1e9),
        "ratios": [round(r, 3) for r in ratios],
    }


def table(report):
    lines = [
        f"records pipeline, {report['config']['layout']} Criteo-like rows, "
        f"batch {report['config']['batch_size']}, {report['machine']['cpus']} cores "
        f"(median of {report['config']['rounds']} interleaved rounds)",
        f"{'pipeline':<22}{'examples/s':>14}{'torch_stage is':>18}{'(per round)':>14}",
    ]
    for name in PIPELINES:
        r = report["results"][name]
        if "skipped" in r:
            lines.append(f"{name:<22}{'skipped: ' + r['skipped']:>14}")
            continue
        ratio = report["ratios"].get(name)
        per_round = report["ratios_median_per_round"].get(name)
        lines.append(
            f"{name:<22}{r['examples_per_s']:>14,.0f}"
            f"{'' if ratio is None else f'{ratio:.2f}x':>18}"
            f"{'' if per_round is None else f'{per_round:.2f}x':>14}"
        )
    for name in OURS:
        ns = report["results"][name].get("cpu_ns_per_example")
        if ns:
            lines.append(
                f"  {name} CPU ns per example: "
                + ", ".join(f"{k} {ns[k]}" for k in PHASES)
                + f"; total {ns['total']} (at most "
                f"{ns['bound_examples_per_s_on_free_cores']:,} examples/s on "
                f"{report['machine']['cpus']} free cores)"
            )
    target, load = report["target"], report["load_average"]
    lines.append(
        f"target {target['torch_stage_examples_per_s']:,} examples/s: "
        f"{'met' if target['met'] else 'not met'} with defaults, "
        f"{'met' if target['met_with_num_threads_2'] else 'not met'} with num_threads=2; "
        f"load average "
        f"{load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end"
    )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=("columns", "packed"), default="columns")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved runs per pipeline")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per run")
    parser.add_argument("--warmup", type=int, default=10, help="batches skipped per run")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--per-file", type=int, default=100_000)
    parser.add_argument("--check-records", type=int, default=4096)
    parser.add_argument("--tf-python", default=None, help="a Python with tensorflow")
    parser.add_argument("--skip", default="", help="pipelines to skip, comma-separated")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (table on stderr)")
    parser.add_argument(
        "--parse-only", action="store_true", help="parse_example alone, per CPU-second"
    )
    parser.add_argument(
        "--stage-cost", action="store_true", help="staged(parse) against parse in the loop"
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - set(PIPELINES)
    if unknown:
        raise SystemExit(f"--skip: unknown pipelines {sorted(unknown)}; known: {PIPELINES}")

    paths, total_bytes = data_files(args.layout, args.files, args.per_file)
    if args.parse_only:
        got = parse_only(paths, args)
        print(
            json.dumps(got, indent=2)
            if args.json
            else f"parse_example, {args.layout} rows, one thread: "
            f"{got['examples_per_cpu_s']:,} examples per CPU-second (median of {args.rounds})"
        )
        return
    if args.stage_cost:
        got = stage_cost(paths, args)
        print(
            json.dumps(got, indent=2)
            if args.json
            else f"staged(parse_example) over in-memory {args.layout} batches: "
            f"{got['staged_over_loop']}x the time of the parse in the loop "
            f"({got['staged_ns_per_example']} against {got['loop_ns_per_example']} ns per "
            f"example; median of {len(got['ratios'])} alternations)"
        )
        return
    load_start = list(os.getloadavg())
    tf_python = None if "tf_data" in skip else find_tf_python(args)
    tf_worker = TfWorker(tf_python, paths, args) if tf_python else None
    results = {}
    try:
        check = check_equal(paths, args, tf_worker)
        print(
            f"equality: the first {check['records']} records parse to the same "
            f"{check['values_compared']} values in torch_stage and {', '.join(check['peers'])}",
            file=sys.stderr,
        )
        runs = {
            "torch_stage": lambda: run_torch_stage(paths, args),
            "torch_stage_2t": lambda: run_torch_stage_2t(paths, args),
            "torch_stage_inline": lambda: run_torch_stage_inline(paths, args),
            "dataloader": lambda: run_dataloader(paths, args),
            "tf_data": lambda: tf_worker.run(args),
        }
        runs_of = {name: [] for name in PIPELINES}
        for r in range(args.rounds):
            for name in PIPELINES:
                if name in skip or (name == "tf_data" and tf_worker is None):
                    continue
                got = runs[name]()
                got["examples_per_s"] = round(got["examples_per_s"], 1)
                runs_of[name].append(got)
                print(
                    f"round {r + 1}/{args.rounds} {name:<20} {got['examples_per_s']:>12,.0f}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if tf_worker is not None:
            tf_worker.close()
    for name in PIPELINES:
        if name in skip:
            results[name] = {"skipped": "--skip"}
        elif name == "tf_data" and tf_worker is None:
            results[name] = {
                "skipped": "no Python with tensorflow (make bench-tf, or --tf-python PATH)"
            }
        else:
            rates = [r["examples_per_s"] for r in runs_of[name]]
            results[name] = {"examples_per_s": statistics.median(rates), "runs": runs_of[name]}
            phased = [r["cpu_ns_per_example"] for r in runs_of[name] if "cpu_ns_per_example" in r]
            if phased:
                ns = {k: round(statistics.median(p[k] for p in phased)) for k in PHASES}
                ns["total"] = sum(ns[k] for k in PHASES)
                ns["bound_examples_per_s_on_free_cores"] = round(
                    os.cpu_count() * 1e9 / max(ns["total"], 1)
                )
                results[name]["cpu_ns_per_example"] = ns
    if tf_worker is not None:
        results["tf_data"].update(tensorflow=tf_worker.tensorflow, python=tf_worker.python)
    ours = results["torch_stage"].get("examples_per_s")
    ratios = {
        name: round(ours / r["examples_per_s"], 2)
        for name, r in results.items()
        if ours and "examples_per_s" in r
    }
    per_round = {}
    for name in PIPELINES:
        ours_runs, their_runs = runs_of["torch_stage"], runs_of.get(name, [])
        if ours_runs and len(their_runs) == len(ours_runs):
            per_round[name] = round(
                statistics.median(
                    a["examples_per_s"] / b["examples_per_s"] for a, b in zip(ours_runs, their_runs)
                ),
                2,
            )
    bytes_per_row = total_bytes / (args.files * args.per_file)
    report = {
        "benchmark": "records_vs_tf_data",
        "machine": machine(),
        "data": {
            "layout": args.layout,
            "files": len(paths),
            "rows": args.files * args.per_file,
            "bytes": total_bytes,
            "bytes_per_row": round(bytes_per_row, 1),
            "features_per_row": len(schema(args.layout)),
        },
        "config": {
            "layout": args.layout,
            "batch_size": args.batch_size,
            "dataloader_workers": args.workers,
            "rounds": args.rounds,
            "seconds_per_run": args.seconds,
            "warmup_batches": args.warmup,
        },
        "equality": check,
        "results": results,
        "ratios": ratios,
        "ratios_median_per_round": per_round,
        "torch_stage_mb_per_s": round(ours * bytes_per_row / 1e6, 1) if ours else None,
        "target": {
            "torch_stage_examples_per_s": TARGET,
            "met": bool(ours and ours >= TARGET),
            "met_with_num_threads_2": bool(
                results["torch_stage_2t"].get("examples_per_s", 0) >= TARGET
            ),
        },
        "load_average": {"start": load_start, "end": list(os.getloadavg())},
    }
    text = table(report)
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(report, indent=2))
    else:
        print(text)


if __name__ == "__main__":
    main()
