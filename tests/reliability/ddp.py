"""Distributed: a 2-rank torchrun DDP job (gloo, CPU) trained through
torch_stage.DataLoader with a DistributedSampler ends with parameters
bit-equal to the same job trained through torch.utils.data.DataLoader.

Each job is tests/reliability/ddp_train.py under ``torchrun --standalone``
(rendezvous and gloo on the loopback interface only) under a hard limit: a
hang prints the ranks' Python stacks (their faulthandler) and native stacks
(gdb), then the whole job is killed. Its processes are known by a mark in
the environment they inherit: torchrun starts each rank in a session of its
own, which a process-group kill and a session scan do not reach (a rank's
process that held the job's output open once left the harness waiting on it
past the scenario's limit).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from reliability.harness import (
    HERE,
    ScenarioFailure,
    check,
    child_env,
    kill_group,
    native_stacks,
    scenario,
)
from reliability.probes import settle

SCRIPT = os.path.join(HERE, "ddp_train.py")
EXIT_SCRIPT = os.path.join(HERE, "gloo_exit.py")
RANKS = 2
# One torchrun job's hard limit (a healthy one takes 5-10 s).
JOB_LIMIT_S = 120
# The environment variable that marks a job's processes (_job_pids).
_MARK = "TORCH_STAGE_RELIABILITY_JOB"
KILLED_WITHIN_S = 30
WORKERS_GONE_WITHIN_S = 10


def processes_whose(proc_file: str, part: bytes) -> list:
    """The live processes whose ``/proc/PID/<proc_file>`` (``environ``,
    ``cmdline``) holds ``part``, of those this user may read."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/{proc_file}", "rb") as f:
                if part in f.read():
                    pids.append(int(entry))
        except OSError:
            continue  # gone, or not ours
    return sorted(pids)


def _job_pids(mark: str) -> list:
    """The live processes of the job marked ``mark``: torchrun's agent, its
    ranks and their DataLoader workers. Found by the environment they all
    inherit, not by session or parent: torchrun starts each rank in a
    session of its own, and what outlives the job is re-parented."""
    return processes_whose("environ", f"{_MARK}={mark}\0".encode())


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # After the command's ")": state, ppid, ...
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _kill_job(proc: subprocess.Popen, mark: str) -> None:
    """SIGKILL every process of the job, its ranks' sessions too."""
    kill_group(proc)
    for pid in _job_pids(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _job(args: list, cwd: str, what: str, limit_s=JOB_LIMIT_S) -> float:
    """Run torchrun on ``args`` (a script and its arguments) in ``cwd``;
    return its seconds. Fails the scenario when the job fails, hangs past
    ``limit_s`` or leaves a process behind."""
    mark = uuid.uuid4().hex
    env = child_env(
        {
            "OMP_NUM_THREADS": "1",
            # Loopback only: gloo's sockets and the rendezvous store.
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            # The ranks dump their stacks and exit a little before the limit.
            "DDP_TRAIN_LIMIT_S": str(max(10.0, limit_s - 15)),
            _MARK: mark,
        }
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(RANKS),
        "--max_restarts",
        "0",
        *args,
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        ranks = [pid for pid in _job_pids(mark) if _parent(pid) == proc.pid]
        stacks = "\n".join(
            f"--- rank process {pid} ---\n{native_stacks(pid, timeout_s=20)}"
            for pid in ranks[:RANKS]
        )
        _kill_job(proc, mark)
        try:
            output, _ = proc.communicate(timeout=KILLED_WITHIN_S)
        except subprocess.TimeoutExpired:
            output = "(its output still open after the kill)"
        raise ScenarioFailure(
            f"{what} hung for {limit_s:.0f} s\n"
            f"--- its output ---\n{output[-8000:]}\n--- native stacks ---\n{stacks}"
        ) from None
    seconds = time.monotonic() - start
    # A rank's worker or staging thread must not outlive the job (a worker
    # whose rank has ended may take a moment to see it).
    left = []
    if settle(lambda: not _job_pids(mark), WORKERS_GONE_WITHIN_S) < 0:
        left = _job_pids(mark)
        _kill_job(proc, mark)
    check(proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{output[-8000:]}")
    check(not left, f"processes {left} of {what} outlived it")
    return seconds


def _torchrun(kind: str, num_workers: int, out: str, limit_s=JOB_LIMIT_S, staging=None) -> float:
    """Run the training job; return its seconds."""
    what = f"torchrun ({kind}, num_workers={num_workers})"
    args = [SCRIPT, kind, str(num_workers), out, json.dumps(staging or {})]
    seconds = _job(args, os.path.dirname(out), what, limit_s)
    check(os.path.exists(out), f"{what} saved no {out}")
    return seconds


def _compare(plain: dict, staged: dict, num_workers: int, staging=None) -> int:
    """Bit-equal parameters, and the staged job really staged. Returns the
    number of parameter tensors compared."""
    import torch

    where = f"num_workers={num_workers}, staging {staging or {}}"
    for job, name in ((plain, "plain"), (staged, "staged")):
        check(len(job["ranks"]) == RANKS, f"{name}: {len(job['ranks'])} ranks reported")
        for r in job["ranks"]:
            check(
                all(torch.equal(v, job["params"][k]) for k, v in r["params"].items()),
                f"{name}, {where}: rank {r['rank']}'s parameters differ from rank 0's",
            )
    for r in staged["ranks"]:
        check(
            r["loader"] == "torch_stage.staging.loader.DataLoader"
            and r["staging"] == (staging or {}),
            f"the staged job's rank {r['rank']} trained with {r['loader']} {r['staging']}",
        )
        for epoch, s in enumerate(r["stats"]):
            check(
                s["batches"] == s["len"] and s["consumed"] == s["batches"],
                f"staged, {where}, rank {r['rank']}, epoch {epoch}: {s['batches']} batches "
                f"of {s['len']}, but the stage reports consumed={s['consumed']}",
            )
            check(
                s["produced"] is not None and s["produced"] >= s["consumed"],
                f"staged, {where}, rank {r['rank']}, epoch {epoch}: stats {s}",
            )
    for p, s in zip(plain["ranks"], staged["ranks"]):
        # What differs, so that a parameter mismatch says why.
        check(
            p["seen"] == s["seen"],
            f"{where}, rank {p['rank']}: the staged job trained on the examples "
            f"{s['seen']}, the plain one on {p['seen']}",
        )
    check(
        set(plain["params"]) == set(staged["params"]),
        f"{where}: the jobs saved different parameters",
    )
    different = [
        k
        for k, v in plain["params"].items()
        if v.dtype != staged["params"][k].dtype or not torch.equal(v, staged["params"][k])
    ]
    if different:
        worst = max(
            (plain["params"][k] - staged["params"][k]).abs().max().item() for k in different
        )
        first_loss = next(
            (
                i
                for i, (a, b) in enumerate(
                    zip(plain["ranks"][0]["losses"], staged["ranks"][0]["losses"])
                )
                if a != b
            ),
            None,
        )
        raise ScenarioFailure(
            f"{where}: parameters {different} differ between the plain and the staged "
            f"job (max |diff| {worst:.3g}; rank 0's losses first differ at step {first_loss})"
        )
    return len(plain["params"])


@scenario(
    "ddp.torchrun_bit_equal",
    timeout_s=480,
    quick={"num_workers": (0, 2), "stagings": ({},)},
    full={"num_workers": (0, 2), "stagings": ({}, {"num_threads": 2, "capacity": 4})},
)
def torchrun_bit_equal(num_workers, stagings) -> dict:
    """2-rank torchrun DDP (gloo): staged DataLoader's parameters == plain's"""
    import torch

    workdir = tempfile.mkdtemp(prefix="torch_stage_ddp_")
    figures = {}
    try:
        for w in num_workers:
            out = os.path.join(workdir, f"plain-{w}.pt")
            figures[f"plain_w{w}_s"] = _torchrun("plain", w, out)
            plain = torch.load(out, weights_only=False)
            for j, staging in enumerate(stagings):
                name = f"staged{j or ''}_w{w}"
                out = os.path.join(workdir, f"{name}.pt")
                figures[f"{name}_s"] = _torchrun("staged", w, out, staging=staging)
                staged = torch.load(out, weights_only=False)
                figures[f"{name}_params_equal"] = _compare(plain, staged, w, staging)
                figures[f"{name}_batches"] = sum(
                    s["consumed"] for r in staged["ranks"] for s in r["stats"]
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return figures


@scenario("ddp.gloo_exit", timeout_s=120)
def gloo_exit() -> dict:
    """A rank ends while gloo's worker thread waits for the GIL to free a work:
    no abort ("terminate called without an active exception")"""
    workdir = tempfile.mkdtemp(prefix="torch_stage_gloo_exit_")
    try:
        return {"job_s": _job([EXIT_SCRIPT], workdir, "the gloo_exit.py job")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
