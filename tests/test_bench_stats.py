"""The benchmarks' statistics (benchmarks/_common.py): the confidence
interval of a median and the verdict on a bound that the DataLoader
benchmarks rest on."""

import math
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

from _common import median_ci, verdict  # noqa: E402


@pytest.mark.parametrize(
    "n, k",
    # The textbook ranks of the 95% interval of a median (x_(k), x_(n-k+1)).
    [(6, 1), (8, 1), (9, 2), (12, 3), (15, 4), (20, 6), (30, 10)],
)
def test_ranks_are_the_textbook_ones(n, k):
    low, high, coverage = median_ci(list(range(1, n + 1)))
    assert (low, high) == (k, n - k + 1)
    assert coverage >= 0.95
    # and k is the largest such rank: one step in would fall below 95%
    below = sum(math.comb(n, i) for i in range(k + 1))
    assert 1 - 2 * below / 2**n < 0.95


def test_too_few_rounds_give_the_whole_range_and_say_so():
    low, high, coverage = median_ci([1.2, 0.9, 1.0, 1.1, 0.8])
    assert (low, high) == (0.8, 1.2)
    assert coverage == pytest.approx(1 - 2 / 32)  # 93.75% < 95%


def test_order_does_not_matter_and_empty_is_an_error():
    assert median_ci([3, 1, 2, 5, 4, 6]) == median_ci([1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="at least one"):
        median_ci([])


def test_coverage_holds_for_a_skewed_distribution():
    # Rounds on a shared machine are skewed (a round slowed by a neighbour);
    # the interval must cover the true median at least 95% of the time
    # whatever the shape. Lognormal: median exp(0) = 1.
    rng = random.Random(15)
    trials, covered = 4000, 0
    for _ in range(trials):
        low, high, _ = median_ci([rng.lognormvariate(0.0, 0.5) for _ in range(15)])
        covered += low <= 1.0 <= high
    # 96.5% nominal for n = 15; 4000 trials: standard error ~0.3%
    assert covered / trials >= 0.95


def test_a_verdict_holds_the_whole_interval_to_the_bound():
    # At most: dataloader_per_batch.py's ours minus plain, in us a batch.
    assert verdict((-4.2, 2.3, 0.96), at_most=3.0) == "shown"
    assert verdict((-1.0, 3.0, 0.96), at_most=3.0) == "shown"  # at the bound
    # A median under the bound is not enough: the interval must be.
    assert verdict((-2.3, 5.0, 0.96), at_most=3.0) == "unresolved"
    assert verdict((3.5, 9.0, 0.96), at_most=3.0) == "violated"
    assert verdict((-268.0, -38.2, 0.96), at_most=24.8) == "shown"
    # At least: dataloader_grid.py's speed ratio against 0.97.
    assert verdict((0.97, 1.02, 0.96), at_least=0.97) == "shown"  # at the bound
    assert verdict((0.96, 1.02, 0.96), at_least=0.97) == "unresolved"
    assert verdict((0.90, 0.969, 0.96), at_least=0.97) == "violated"
    assert verdict((0.99, 1.0, 0.9375), at_least=0.97) == "too few rounds"
    with pytest.raises(ValueError, match="exactly one"):
        verdict((0.0, 1.0, 0.96))
    with pytest.raises(ValueError, match="exactly one"):
        verdict((0.0, 1.0, 0.96), at_least=0.0, at_most=1.0)
