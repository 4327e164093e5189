"""Paired significance tests and seed aggregation for the result tables (docs/significance.md).

Two models evaluated on the same held-out examples are compared example by example, which removes
the examples' own difficulty from the comparison:

- per-example correctness (VCR, RefCOCO+): the exact McNemar test. Only the discordant examples
  (right for one model, wrong for the other) carry information; under the null hypothesis each is
  equally likely to favour either model, so their split is Binomial(n, 1/2), tested two-sided.
- per-example soft scores (VQA accuracy of one question, in [0, 1]): a paired bootstrap. The
  examples are resampled with replacement (the same resample for both models); the p-value is the
  share of resampled mean differences at least as far from the observed difference as the observed
  difference is from 0 (the bootstrap distribution shifted to the null), two-sided.

Torch-free, numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
_BOOTSTRAP_CHUNK = 500  # resamples drawn at once: bounds memory at chunk x examples indices


def mcnemar_exact(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> float:
    """Two-sided exact McNemar p-value of paired per-example correctness.

    b = examples only A gets right, c = only B gets right, n = b + c. The p-value is
    P(|X - n/2| >= |b - n/2|) for X ~ Binomial(n, 1/2) = min(1, 2 P(X <= min(b, c))), the value
    of `scipy.stats.binomtest(b, n, 0.5)`; 1.0 when no example is discordant.
    """
    a, b = _paired(correct_a, correct_b)
    for name, values in (("A", a), ("B", b)):
        if not np.isin(values, (0.0, 1.0)).all():
            raise ValueError(f"McNemar needs per-example correctness (True/False or 0/1); model {name} "
                             f"has other values, e.g. {values[~np.isin(values, (0.0, 1.0))][:3].tolist()}")
    only_a = int(np.sum((a == 1) & (b == 0)))
    only_b = int(np.sum((a == 0) & (b == 1)))
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    # exact integer arithmetic; int / int rounds once, so large n neither overflows nor drifts
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_bootstrap(scores_a: Sequence[float], scores_b: Sequence[float], *,
                     resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> float:
    """Two-sided paired-bootstrap p-value of the mean difference of per-example scores.

    d = mean(A - B) on the examples; d*_r = the same on resample r (examples drawn with replacement,
    the same draw for both models). p = (1 + #{r: |d*_r - d| >= |d|}) / (1 + resamples): the +1
    counts the observed sample itself, so p is never 0. Fixed `seed`: the same inputs give the
    same p-value on every machine.
    """
    a, b = _paired(scores_a, scores_b)
    if resamples < 1:
        raise ValueError(f"paired bootstrap needs at least 1 resample, got {resamples}")
    diff = a - b
    observed = float(diff.mean())
    rng = np.random.default_rng(seed)
    extreme = 0
    done = 0
    while done < resamples:
        size = min(_BOOTSTRAP_CHUNK, resamples - done)
        means = diff[rng.integers(0, len(diff), size=(size, len(diff)))].mean(axis=1)
        extreme += int(np.sum(np.abs(means - observed) >= abs(observed)))
        done += size
    return (1 + extreme) / (1 + resamples)


def _paired(values_a: Sequence[float], values_b: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(values_a, dtype=np.float64).reshape(-1)
    b = np.asarray(values_b, dtype=np.float64).reshape(-1)
    if len(a) != len(b):
        raise ValueError(f"a paired test needs the same examples for both models; got {len(a)} and {len(b)}")
    if len(a) == 0:
        raise ValueError("a paired test needs at least one example")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a paired test needs finite per-example values")
    return a, b


# by name, as a task names its test (`Task.paired_test`): McNemar for 0/1 outcomes, the bootstrap
# for soft scores
PAIRED_TESTS = {"mcnemar": mcnemar_exact, "bootstrap": paired_bootstrap}


def paired_p_value(test: str, values_a: Sequence[float], values_b: Sequence[float]) -> float:
    """The p-value of the paired test named `test` (a key of `PAIRED_TESTS`)."""
    if test not in PAIRED_TESTS:
        raise ValueError(f"unknown paired test {test!r}; expected one of {sorted(PAIRED_TESTS)}")
    return PAIRED_TESTS[test](values_a, values_b)


def format_p_value(p: float) -> str:
    """A compact p for a table cell: `p=0.01`, `p=0.35`, `p<0.001`."""
    return "p<0.001" if p < 0.001 else f"p={p:.2g}"


@dataclass(frozen=True)
class MeanStd:
    """One cell over seeds: the mean and the sample standard deviation (ddof 1) of `n` runs."""

    mean: float
    std: float
    n: int

    def format(self, decimals: int) -> str:
        return f"{self.mean:.{decimals}f} ± {self.std:.{decimals}f}"


def mean_std(values: Sequence[float]) -> MeanStd:
    """Mean and sample standard deviation (n - 1 in the denominator: the seeds are a sample of the
    runs one could make); at least two values, since one run has no spread."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if len(x) < 2:
        raise ValueError(f"mean ± std over seeds needs at least 2 values, got {len(x)}")
    if not np.isfinite(x).all():
        raise ValueError(f"mean ± std over seeds needs finite values, got {x.tolist()}")
    return MeanStd(float(x.mean()), float(x.std(ddof=1)), len(x))
