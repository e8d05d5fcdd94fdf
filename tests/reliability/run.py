"""Run the reliability suite: one line per scenario, then ``N passed, M failed``.

    python tests/reliability/run.py                 # the full profile (make torture)
    python tests/reliability/run.py --profile quick # what make test runs
    python tests/reliability/run.py -k shutdown -k signals --json out.json
    python tests/reliability/run.py --list

Each scenario runs in a process of its own under a hard timeout; a hang is
killed after its Python (faulthandler) and native (gdb) stacks are printed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

from reliability import load_scenarios  # noqa: E402
from reliability.harness import (  # noqa: E402
    PROFILES,
    SCENARIOS,
    format_figures,
    run_child,
    run_scenario,
    select,
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", choices=PROFILES, default="full")
    p.add_argument("-k", action="append", default=[], help="run scenarios whose name has this")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    p.add_argument("--list", action="store_true", help="list the scenarios and stop")
    p.add_argument("--child", metavar="NAME", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        # A scenario named "<module>.<what>" lives in reliability/<module>.py.
        importlib.import_module("reliability." + args.child.split(".")[0])
        run_child(args.child, args.profile)
        return 0
    load_scenarios()
    names = select(args.k)
    if not names:
        p.error(f"no scenario matches {args.k}; --list shows them")
    if args.list:
        for n in names:
            print(f"{n:38s} {SCENARIOS[n].doc}")
        return 0
    width = max(len(n) for n in names)
    results = []
    for n in names:
        r = run_scenario(n, args.profile)
        results.append(r)
        verdict = "PASS" if r.passed else "FAIL"
        detail = format_figures(r.figures) if r.passed else r.error.splitlines()[0]
        print(f"{verdict}  {n:{width}s} {r.seconds:6.1f} s  {detail}", flush=True)
        if not r.passed:
            print("      " + "\n      ".join(r.output.splitlines()[-80:]), flush=True)
    passed = sum(r.passed for r in results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1, default=str)
    print(f"profile {args.profile}, {sum(r.seconds for r in results):.0f} s")
    print(f"reliability: {passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
