"""The reference docs (docs/, Sphinx): they build with warnings as errors,
every public name has a page, and every Python example in them and in the
README runs.

An example is a fenced ```python block (indented ones too). A page's
examples run in order, as one script, in one fresh interpreter (later
blocks use what earlier ones made), in an empty folder of their own (what
they write stays out of the repository), on the CPU. A block whose first
line is ``# not run: <why>`` is shown, not run (it needs a GPU, or files of
the user's)."""

import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import HANG_BOUND_S, ROOT

import torch_stage

sphinx = pytest.importorskip("sphinx")

DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)) + [
    os.path.join(ROOT, "README.md")
]
# A fence may be indented (inside a list item); the block is then dedented.
_BLOCK = re.compile(r"^([ \t]*)```python[^\n]*\n(.*?)^\1```", re.S | re.M)


def examples(path):
    """The page's runnable python blocks, in order."""
    with open(path) as f:
        found = _BLOCK.findall(f.read())
    blocks = [textwrap.dedent(block) for _, block in found]
    return [b for b in blocks if not b.lstrip().startswith("# not run:")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", DOCS, str(out)],
        capture_output=True,
        text=True,
        timeout=HANG_BOUND_S * 10,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_the_docs_build_with_warnings_as_errors(built):
    assert (built / "index.html").exists()
    for page in ("guide/staging", "guide/multi-stream", "measurements", "gpu-runs", "api"):
        assert (built / f"{page}.html").exists(), page


def test_every_public_name_has_a_page(built):
    missing = [
        name
        for name in torch_stage.__all__
        if not (built / "generated" / f"torch_stage.{name}.html").exists()
    ]
    assert missing == []
    for name in ("MultiStreamPass", "StreamPlan", "trace"):
        assert (built / "generated" / f"torch_stage.streams.fx.{name}.html").exists(), name


def test_there_are_examples_to_run():
    assert sum(len(examples(p)) for p in PAGES) >= 10


@pytest.mark.parametrize("path", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_python_example_runs(path, tmp_path):
    blocks = examples(path)
    if not blocks:
        pytest.skip("no python examples")
    script = "\n\n".join(
        f"# --- example {i + 1} of {os.path.relpath(path, ROOT)}\n{block}"
        for i, block in enumerate(blocks)
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TORCH_STAGE_SANITIZE", None)
    # From a file: torch.jit.script reads the source of what it compiles.
    page = tmp_path / "page.py"
    page.write_text(script)
    proc = subprocess.run(
        [sys.executable, str(page)],
        capture_output=True,
        text=True,
        timeout=HANG_BOUND_S * 5,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, f"{path}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
