"""The reliability suite's quick profile (tests/reliability/, `make torture`
for the full one): each scenario in a process of its own, as run.py runs it."""

import pytest
from reliability import load_scenarios
from reliability.harness import SCENARIOS, run_scenario, timeout_for
from reliability.probes import settle

load_scenarios()


@pytest.mark.parametrize(
    "name",
    # The harness kills a hung scenario (with its stacks) before pytest-timeout would.
    [
        pytest.param(n, marks=pytest.mark.timeout(timeout_for(SCENARIOS[n], "quick") + 60))
        for n in sorted(SCENARIOS)
    ],
)
def test_scenario(name):
    result = run_scenario(name, "quick")
    if not result.passed:
        pytest.fail(f"{name}: {result.error}\n{result.output[-8000:]}", pytrace=False)


# The harness's torchrun jobs (tests/reliability/ddp.py): torchrun starts
# each rank in a session of its own, so what a rank leaves behind and a hung
# rank must be found beyond the agent's session, and killed.

_DETACHED_CHILD = """
import os, subprocess, sys
if os.environ["RANK"] == "0":
    subprocess.Popen([sys.executable, __file__ + ".child"], start_new_session=True{output})
"""

_HUNG_RANK = """
import time
time.sleep(300)
"""


def _rank_script(tmp_path, text):
    path = tmp_path / "rank.py"
    path.write_text(text)
    (tmp_path / "rank.py.child").write_text("import time\ntime.sleep(300)\n")
    return str(path)


def _processes_naming(token):
    from reliability.ddp import processes_whose

    return processes_whose("cmdline", token.encode())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "output, error",
    [
        # Its own output: the job ends, and the process is found after it.
        (", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL", "outlived it"),
        # The job's output, inherited: the job's output stays open until it
        # is killed (the harness used to wait for that forever).
        ("", "hung for 15 s"),
    ],
    ids=["own_output", "jobs_output"],
)
def test_a_process_a_rank_leaves_behind_fails_the_job_and_is_killed(tmp_path, output, error):
    from reliability import ddp
    from reliability.harness import ScenarioFailure

    script = _DETACHED_CHILD.format(output=output)
    with pytest.raises(ScenarioFailure, match=error):
        ddp._job([_rank_script(tmp_path, script)], str(tmp_path), "the job", 15)
    assert settle(lambda: not _processes_naming(str(tmp_path)), 10) >= 0


@pytest.mark.timeout(120)
def test_a_hung_rank_is_reported_with_its_stack_and_killed(tmp_path):
    from reliability import ddp
    from reliability.harness import ScenarioFailure

    with pytest.raises(ScenarioFailure, match="hung for 20 s") as failed:
        ddp._job([_rank_script(tmp_path, _HUNG_RANK)], str(tmp_path), "the job", 20)
    assert str(failed.value).count("--- rank process") == ddp.RANKS
    assert settle(lambda: not _processes_naming(str(tmp_path)), 10) >= 0
