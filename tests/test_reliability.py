"""The reliability suite's quick profile (tests/reliability/, `make torture`
for the full one): each scenario in a process of its own, as run.py runs it."""

import pytest
from reliability import load_scenarios
from reliability.harness import SCENARIOS, run_scenario, timeout_for

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
