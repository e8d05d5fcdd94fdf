"""What the benchmarks share: progress bars and the JSON they print.

Progress goes to stderr through tqdm on a terminal only: when stderr is not
a TTY (a pipe, a log file) or the CI environment variable is set, nothing is
drawn, so logs and CI output hold just the JSON and the readable lines.
"""

import json
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
        help="also write the JSON report to PATH (as read by python -m torch_stage.report)",
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
