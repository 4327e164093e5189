"""Paired tests against scipy's reference values and hand-worked cases; the seed aggregation."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from vlbert_core.stats import (
    format_p_value,
    mcnemar_exact,
    mean_std,
    paired_bootstrap,
    paired_p_value,
)


def pairs(both: int, only_a: int, only_b: int, neither: int) -> tuple[list[bool], list[bool]]:
    a = [True] * both + [True] * only_a + [False] * only_b + [False] * neither
    b = [True] * both + [False] * only_a + [True] * only_b + [False] * neither
    return a, b


def test_mcnemar_by_hand():
    # 1 vs 5 discordant: P(X <= 1) for Binomial(6, 1/2) = (1 + 6) / 64, doubled = 14/64
    a, b = pairs(both=40, only_a=1, only_b=5, neither=10)
    assert mcnemar_exact(a, b) == pytest.approx(14 / 64, rel=1e-15)
    assert mcnemar_exact(b, a) == mcnemar_exact(a, b)  # two-sided: symmetric
    # no discordant pair: no evidence either way
    assert mcnemar_exact(*pairs(both=3, only_a=0, only_b=0, neither=2)) == 1.0
    # an even split of the discordant pairs is the most likely outcome under the null
    assert mcnemar_exact(*pairs(both=0, only_a=4, only_b=4, neither=0)) == 1.0


@pytest.mark.parametrize("only_a, only_b", [(0, 1), (3, 9), (10, 10), (11, 10), (57, 31), (0, 40), (400, 350)])
def test_mcnemar_equals_scipy_binomtest_on_the_discordant_pairs(only_a, only_b):
    a, b = pairs(both=25, only_a=only_a, only_b=only_b, neither=7)
    expected = scipy_stats.binomtest(only_a, only_a + only_b, 0.5).pvalue
    assert mcnemar_exact(a, b) == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_mcnemar_rejects_soft_scores_and_unpaired_inputs():
    with pytest.raises(ValueError, match="per-example correctness"):
        mcnemar_exact([1.0, 0.3], [1.0, 0.0])
    with pytest.raises(ValueError, match="same examples"):
        mcnemar_exact([True, False], [True])
    with pytest.raises(ValueError, match="at least one example"):
        mcnemar_exact([], [])


def test_bootstrap_by_hand():
    # the same scores: no difference, p = 1
    scores = [0.0, 1 / 3, 1.0, 0.6]
    assert paired_bootstrap(scores, scores, resamples=200) == 1.0
    # A beats B by the same amount on every example: no resample comes near 0, p = 1 / (1 + R)
    a = [0.5, 0.9, 1.0, 0.7]
    assert paired_bootstrap(a, [x - 0.25 for x in a], resamples=99) == pytest.approx(1 / 100)
    # fixed seed: the same p on every call
    rng = np.random.default_rng(3)
    x, y = rng.random(50), rng.random(50)
    assert paired_bootstrap(x, y) == paired_bootstrap(x, y)
    assert paired_bootstrap(x, y) == paired_bootstrap(y, x)  # two-sided


def test_bootstrap_against_a_loop_over_resamples():
    """The vectorised chunks count the same resamples as the plain definition."""
    rng = np.random.default_rng(7)
    a, b = rng.random(30), rng.random(30) * 0.9
    resamples, seed = 1_234, 5  # more than one chunk, and a partial last chunk
    diff = a - b
    observed = diff.mean()
    draw = np.random.default_rng(seed)
    extreme = 0
    done = 0
    while done < resamples:  # the same stream of indices, one resample at a time
        size = min(500, resamples - done)
        for idx in draw.integers(0, len(diff), size=(size, len(diff))):
            extreme += abs(diff[idx].mean() - observed) >= abs(observed)
        done += size
    assert paired_bootstrap(a, b, resamples=resamples, seed=seed) == (1 + extreme) / (1 + resamples)


def test_bootstrap_agrees_with_scipy_paired_t_test_on_a_large_sample():
    # With 2,000 examples the mean difference is close to normal, so the bootstrap p-value is close
    # to the paired t-test's (scipy.stats.ttest_rel); VQA-like scores in steps of 1/3.
    rng = np.random.default_rng(11)
    b = rng.choice([0.0, 1 / 3, 2 / 3, 1.0], size=2_000)
    a = np.clip(b + rng.choice([-1 / 3, 0.0, 1 / 3], size=2_000, p=[0.3, 0.4, 0.3]) + 0.02, 0, 1)
    reference = scipy_stats.ttest_rel(a, b).pvalue
    assert 0.001 < reference < 0.5  # a case where the p-value is neither ~0 nor ~1
    assert paired_bootstrap(a, b) == pytest.approx(reference, abs=0.01)


def test_paired_p_value_runs_the_named_test():
    a, b = pairs(both=5, only_a=6, only_b=1, neither=2)
    assert paired_p_value("mcnemar", a, b) == mcnemar_exact(a, b)
    assert paired_p_value("bootstrap", a, b) == paired_bootstrap(a, b)
    with pytest.raises(ValueError, match="unknown paired test 'wilcoxon'"):
        paired_p_value("wilcoxon", a, b)


def test_format_p_value():
    assert format_p_value(0.0123) == "p=0.012"
    assert format_p_value(0.01) == "p=0.01"
    assert format_p_value(1.0) == "p=1"
    assert format_p_value(0.0004) == "p<0.001"


def test_mean_std_over_seeds():
    cell = mean_std([30.0, 32.0, 34.0])
    assert (cell.mean, cell.n) == (32.0, 3)
    assert cell.std == pytest.approx(2.0)  # sample std: sqrt(((-2)^2 + 0 + 2^2) / (3 - 1))
    assert cell.format(1) == "32.0 ± 2.0"
    assert mean_std([1.0, 2.0, 4.0, 7.0]).std == pytest.approx(np.std([1.0, 2.0, 4.0, 7.0], ddof=1))
    with pytest.raises(ValueError, match="at least 2 values"):
        mean_std([31.0])
    with pytest.raises(ValueError, match="finite"):
        mean_std([31.0, math.nan])
