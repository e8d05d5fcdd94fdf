"""python -m torch_stage.observe.report: the page from a real demo run, its trace, a
benchmark's JSON and a multi-stream plan, rendered by headless Chromium."""

import html.parser
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import HANG_BOUND_S, ROOT

from torch_stage.observe import report

TESTS = os.path.join(ROOT, "tests")
PNG = b"\x89PNG\r\n\x1a\n"


def run(args, env=None, cwd=ROOT, timeout=HANG_BOUND_S * 3):
    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, full.get("PYTHONPATH", "")])
    full.update(env or {})
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=full, cwd=cwd, timeout=timeout
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """What make demo and make bench leave: a short real demo run with its
    trace, and a small buffer benchmark's JSON."""
    base = tmp_path_factory.mktemp("runs")
    demo = run(
        [
            "examples/demo.py",
            "--steps",
            "60",
            "--rounds",
            "2",
            "--trace-steps",
            "40",
            "--out",
            str(base / "demo"),
        ]
    )
    assert demo.returncode == 0, demo.stderr
    bench = run(
        [
            "benchmarks/buffer_throughput.py",
            "--items",
            "300",
            "--cpp-items",
            "2000",
            "--json",
            str(base / "bench" / "buffer_throughput.json"),
        ]
    )
    assert bench.returncode == 0, bench.stderr
    return base, demo.stdout


class _Images(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])


def images_of(page):
    parser = _Images()
    parser.feed(page.read_text())
    return parser.srcs


HARNESS = """<!DOCTYPE html><html><body><iframe id=f src="{src}" onload="check()"></iframe>
<script>
function check() {{
  const imgs = [...document.getElementById("f").contentDocument.images];
  const bad = imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.getAttribute("src"));
  const out = document.createElement("pre");
  out.id = "result";
  out.textContent = JSON.stringify({{images: imgs.length, bad: bad}});
  document.body.appendChild(out);
}}
</script></body></html>"""


def render(page, tmp_path):
    """Load ``page`` in headless Chromium: (images loaded, images that did
    not load, console messages)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("Debian's chromium is not installed (make test installs it)")
    harness = page.parent / "_harness.html"
    harness.write_text(HARNESS.format(src=page.name))
    proc = subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",  # tests may run as root
            "--disable-gpu",
            "--allow-file-access-from-files",  # the harness reads the page's images
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=10000",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            "--dump-dom",
            harness.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=HANG_BOUND_S * 2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    dom = proc.stdout
    start = dom.index('<pre id="result">') + len('<pre id="result">')
    result = json.loads(dom[start : dom.index("</pre>", start)])
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return result["images"], result["bad"], console


def test_the_demo_ends_with_a_readable_verdict(runs):
    _, out = runs
    assert any(f"is {b}-bound" in out or "is balanced" in out for b in ("input", "compute"))
    assert "best possible" in out and "What to change" in out and "Speedup" in out


def test_the_page_renders_in_chromium_with_every_image(runs, tmp_path):
    base, _ = runs
    page = tmp_path / "report" / "index.html"
    proc = run(
        [
            "-m",
            "torch_stage.observe.report",
            "--from",
            str(base),
            "-o",
            str(page),
            "--plan",
            "zoo:InceptionBlock(16)",
            "--input-shape",
            "1,16,8,8",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    for heading in (
        "Where does the time go?",
        "Timeline",
        "Buffer occupancy",
        "Multi-stream plan",
        "Staging buffer throughput",
    ):
        assert heading in text, heading
    srcs = images_of(page)
    assert sorted(srcs) == ["occupancy.png", "overlap.png", "plan.png", "timeline.png"]
    for src in srcs:
        data = (page.parent / src).read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, src
    count, bad, console = render(page, tmp_path)
    assert (count, bad, console) == (4, [], [])


def test_the_render_check_sees_a_broken_page(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text('<img src="missing.png"><script>console.error("boom")</script>')
    count, bad, console = render(page, tmp_path)
    assert count == 1 and bad == ["missing.png"]
    assert len(console) == 1 and "boom" in console[0]


def test_inline_images_make_one_self_contained_page(runs, tmp_path):
    base, _ = runs
    page = tmp_path / "inline.html"
    assert report.main(["--from", str(base), "-o", str(page), "--no-plan", "--inline"]) == 0
    srcs = images_of(page)
    assert len(srcs) == 3 and all(s.startswith("data:image/png;base64,") for s in srcs)


def test_a_missing_dot_is_named(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot there
    out = tmp_path / "x.html"
    args = ["--from", str(runs[0]), "-o", str(out), "--plan", "zoo:InceptionBlock"]
    assert report.main(args) == 2
    err = capsys.readouterr().err
    assert "graphviz" in err and "apt-get install graphviz" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("zoo", ValueError, "must look like package.module:name"),
        ("no_such_module_xyz:f", ValueError, "cannot import 'no_such_module_xyz'"),
        ("zoo:Missing", ValueError, "zoo has no attribute 'Missing'"),
        ("zoo:InceptionBlock(channels=open)", ValueError, "must be Python literals"),
        ("zoo:ZOO", TypeError, "is a list, not a module"),
        ("zoo:plain_chain(8)", None, None),
    ],
)
def test_plan_specs(spec, error, message):
    if error is None:
        assert isinstance(report.load_module(spec), torch.nn.Module)
        return
    with pytest.raises(error, match=re.escape(message)):
        report.load_module(spec)


def test_a_bad_plan_spec_on_the_command_line_is_an_error_not_a_page(tmp_path, capsys):
    out = tmp_path / "x.html"
    assert report.main(["-o", str(out), "--plan", "zoo:Missing"]) == 2
    assert "zoo has no attribute 'Missing'" in capsys.readouterr().err
    assert not out.exists()


def test_the_device_staging_benchmark_has_a_table_of_its_own():
    # The JSON of a real run on an H200 (before torchdata was a column: a
    # report must take the methods each run has).
    from torch_stage.observe import report

    with open(os.path.join(ROOT, "tests", "data", "device_staging_h200.json")) as f:
        data = json.load(f)
    title, body = report.bench_section(data)
    assert title == "Host-to-device staging (benchmarks/device_staging.py)"
    assert "NVIDIA H200" in body
    header = re.findall(r"<th>(.*?)</th>", body)
    assert header == [
        "MB",
        "memory",
        "GPU ms",
        "plain_to",
        "dataloader_pin",
        "staged",
        "ours_loader",
        "staged / best peer",
    ]
    rows = re.findall(r"<tr>((?:<td>.*?</td>)+)</tr>", body)
    assert len(rows) == len(data["cells"]) == 8
    big = next(c for c in data["cells"] if c["mb"] == 64 and c["memory"] == "pinned")
    cells = re.findall(r"<td>(.*?)</td>", rows[data["cells"].index(big)])
    assert cells[3] == f"{big['ms_per_item']['plain_to']:,.3f}"
    assert cells[-1] == f"{big['staged_vs_best_peer']:,.3f}"
