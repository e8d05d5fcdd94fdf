"""The reliability suite's harness: a registry of scenarios, each run in a
process of its own under a hard timeout, with every thread's stack dumped
when it hangs.

A scenario is a function decorated with :func:`scenario`. It runs in a fresh
interpreter (``run.py --child``), gets its profile's keyword arguments
(``quick`` inside ``make test``, ``full`` for ``make torture``), checks what it
promises with plain ``assert`` or :func:`check`, and returns a dict of the
figures it saw (counts, latencies), which the report prints. A scenario that
needs a process to die, be signalled or exit starts grandchildren of its own
with :func:`python` or :func:`spawn`.

Why a process each: a broken scenario may wedge the interpreter (a thread that
never lets go of the GIL, a hang at exit, a crash in C++); it must fail alone,
with a stack dump, and let the others run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
RESULT_MARK = "@@reliability-result@@ "
PROFILES = ("quick", "full")


@dataclass
class Scenario:
    name: str
    func: Callable[..., dict]
    timeout_s: float
    profiles: Dict[str, dict]
    doc: str


@dataclass
class Result:
    name: str
    profile: str
    passed: bool
    seconds: float
    figures: dict = field(default_factory=dict)
    error: str = ""
    output: str = ""


SCENARIOS: Dict[str, Scenario] = {}


def scenario(name: str, *, timeout_s: float = 120, quick=None, full=None):
    """Register a scenario. ``quick``/``full``: its keyword arguments under each
    profile (``full`` defaults to ``quick``); ``timeout_s``: the hard limit on
    its process under the full profile (a hang, not a speed bound)."""

    def register(func):
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} registered twice")
        q = dict(quick or {})
        SCENARIOS[name] = Scenario(
            name=name,
            func=func,
            timeout_s=timeout_s,
            profiles={"quick": q, "full": dict(full if full is not None else q)},
            doc=(func.__doc__ or "").strip().split("\n")[0],
        )
        return func

    return register


class ScenarioFailure(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    """``assert`` that survives ``python -O`` and says what was expected."""
    if not condition:
        raise ScenarioFailure(message)


def child_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")])
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if extra:
        env.update(extra)
    return env


def spawn(code: str, *, env: Optional[dict] = None, **popen) -> subprocess.Popen:
    """Start ``code`` in a fresh interpreter (a grandchild of the suite), its
    stdout and stderr piped as text."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(env),
        cwd=ROOT,
        start_new_session=True,
        **popen,
    )


def python(code: str, *, timeout_s: float = 60, env: Optional[dict] = None):
    """Run ``code`` in a fresh interpreter; return (returncode, stdout, stderr).
    A hang past ``timeout_s`` dumps its stacks and fails the scenario."""
    proc = spawn(code, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        native = native_stacks(proc.pid)
        kill_group(proc)
        out, err = proc.communicate()
        raise ScenarioFailure(  # noqa: B904  (the hang is the error, not the timeout)
            f"a grandchild hung for {timeout_s} s\n--- its stderr ---\n{err[-6000:]}"
            f"\n--- native stacks ---\n{native}"
        )
    return proc.returncode, out, err


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def native_stacks(pid: int, timeout_s: float = 30) -> str:
    """Every thread's native stack of a live process, by gdb when it is there
    (C++ producer threads have no Python frame for faulthandler to show)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(gdb not installed: no native stacks)"
    try:
        got = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return "(gdb timed out)"
    lines = [ln for ln in got.stdout.splitlines() if ln.startswith(("Thread ", "#"))]
    return "\n".join(lines[:400]) or got.stderr[-2000:]


def run_child(name: str, profile: str) -> None:
    """The body of ``run.py --child``: run one scenario in this process."""
    import faulthandler
    import traceback

    sc = SCENARIOS[name]
    # Python stacks of every thread shortly before the parent's hard limit.
    faulthandler.dump_traceback_later(max(1.0, timeout_for(sc, profile) - 5), exit=False)
    try:
        figures = sc.func(**sc.profiles[profile]) or {}
    except BaseException as e:  # noqa: BLE001  (a scenario's failure, whatever it is)
        sys.stdout.flush()
        print(
            RESULT_MARK + json.dumps({"passed": False, "error": f"{type(e).__name__}: {e}"[:4000]}),
            flush=True,
        )
        traceback.print_exc()
        sys.exit(1)
    faulthandler.cancel_dump_traceback_later()
    print(RESULT_MARK + json.dumps({"passed": True, "figures": figures}, default=str), flush=True)


def timeout_for(sc: Scenario, profile: str) -> float:
    return sc.timeout_s if profile == "full" else max(30.0, sc.timeout_s / 2)


def run_scenario(name: str, profile: str = "quick") -> Result:
    """Run one scenario in a process of its own and judge it: it passes when
    it says so and its process then exits by itself with status 0 (so a hang
    or a crash at interpreter exit fails it too)."""
    sc = SCENARIOS[name]
    limit = timeout_for(sc, profile)
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "run.py"), "--child", name, "--profile", profile],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=limit)
        hung = False
    except subprocess.TimeoutExpired:
        native = native_stacks(proc.pid)
        kill_group(proc)
        out, _ = proc.communicate()
        out += "\n--- native stacks (gdb) ---\n" + native
        hung = True
    seconds = time.monotonic() - start
    verdict = None
    for line in out.splitlines():
        if line.startswith(RESULT_MARK):
            verdict = json.loads(line[len(RESULT_MARK) :])
    result = Result(name=name, profile=profile, passed=False, seconds=seconds, output=out)
    if hung:
        result.error = f"hung: killed after {limit:.0f} s (stacks in the output)"
    elif verdict is None:
        result.error = f"the process ended with status {proc.returncode} before a verdict"
    elif not verdict["passed"]:
        result.error = verdict["error"]
    elif proc.returncode != 0:
        result.error = f"passed, then the process exited with status {proc.returncode}"
    elif "terminate called" in out or "Fatal Python error" in out:
        result.error = "passed, then the process aborted at exit"
    else:
        result.passed = True
        result.figures = verdict.get("figures", {})
    return result


def format_figures(figures: dict) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return " ".join(f"{k}={fmt(v)}" for k, v in figures.items())


def select(patterns: List[str]) -> List[str]:
    names = sorted(SCENARIOS)
    if not patterns:
        return names
    return [n for n in names if any(p in n for p in patterns)]
