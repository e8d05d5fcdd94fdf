"""What the benchmarks share: progress bars and the JSON they print.

Progress goes to stderr through tqdm on a terminal only: when stderr is not
a TTY (a pipe, a log file) or the CI environment variable is set, nothing is
drawn, so logs and CI output hold just the JSON and the readable lines.
"""

import json
import math
import os
import platform
import sys

from tqdm import tqdm


def quiet() -> bool:
    return not sys.stderr.isatty() or bool(os.environ.get("CI"))


def progress(iterable, desc: str, total=None):
    """``iterable`` with a progress bar on a terminal (see the module docstring)."""
    if quiet():
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)


def add_json_argument(parser) -> None:
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the JSON report to PATH (as read by python -m torch_stage.observe.report)",
    )


def emit(report: dict, path=None) -> None:
    """Print the JSON report on stdout, and write it to ``path`` if given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")


def machine() -> dict:
    """Where a benchmark ran, for its report."""
    import torch

    import torch_stage

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_stage": torch_stage.__version__,
    }


def median_ci(values, level: float = 0.95):
    """A distribution-free confidence interval for the median of ``values``:
    order statistics (k-th smallest, k-th largest) with the largest k whose
    coverage, from the binomial(n, 1/2) law of how many values fall below
    the median, is at least ``level``. Assumes nothing of the distribution
    (benchmark rounds on a shared machine are far from normal), only that
    the rounds are independent. Returns (low, high, coverage); with too few
    values for ``level`` (n < 6 at 0.95), the whole range and its coverage.
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_ci needs at least one value")

    def coverage(k):  # P(x_(k) <= median <= x_(n-k+1)), k counted from 1
        below = sum(math.comb(n, i) for i in range(k))
        return 1.0 - 2.0 * below / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def verdict(interval, *, at_least=None, at_most=None) -> str:
    """Whether a median is shown to be at least ``at_least`` (or at most
    ``at_most``; give one), from its ``median_ci`` interval (low, high,
    coverage): ``shown`` when the whole interval lies on the bound's side
    (the bound itself included), ``violated`` when it lies wholly beyond,
    ``unresolved`` when it straddles the bound (more rounds or a quieter
    machine may settle it), ``too few rounds`` under 95% coverage."""
    if (at_least is None) == (at_most is None):
        raise ValueError("verdict needs exactly one of at_least and at_most")
    low, high, coverage = interval
    if coverage < 0.95:
        return "too few rounds"
    if at_least is not None:
        low, high, bound = -high, -low, -at_least
    else:
        bound = at_most
    if high <= bound:
        return "shown"
    if low > bound:
        return "violated"
    return "unresolved"
