"""Statistics of the experiments (numpy only): bootstrap intervals of a mean over seeds, the
two-level bootstrap over seeds and problems, the paired sign-flip permutation test, and
Holm's adjustment for a family of such tests.

Used by ``examples/mechanism`` (seeds) and ``examples/coverage`` (seeds x held-out problems).
"""

from __future__ import annotations

import itertools

import numpy as np


def bootstrap_ci(
    x: np.ndarray, level: float = 0.95, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(x)`` (resampling the seeds with replacement)."""
    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def sign_flip_p(d: np.ndarray, n_perm: int = 200_000, seed: int = 0) -> float:
    """Two-sided p-value of ``mean(d) == 0`` for paired differences ``d`` (one per seed).

    Under the null each difference is symmetric about 0, so every sign pattern is equally
    likely; the p-value is the share of patterns whose |mean| is at least the observed one.
    Exact (all 2^n patterns) for n <= 20, Monte Carlo with ``n_perm`` patterns above.
    """
    d = np.asarray(d, dtype=float)
    n = len(d)
    observed = abs(d.mean())
    if n <= 20:
        signs = np.array(list(itertools.product((-1.0, 1.0), repeat=n)))
    else:
        signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=(n_perm, n))
    stats = np.abs(signs @ d) / n
    return float(np.mean(stats >= observed - 1e-12))


def holm(p: np.ndarray) -> np.ndarray:
    """Holm's step-down adjustment of the p-values ``p`` ``[m]`` of one family of tests:
    the i-th smallest becomes ``max_{j <= i} min(1, (m - j + 1) p_(j))``. Rejecting where the
    adjusted value is below alpha keeps the chance of any false rejection in the family at
    most alpha, whatever the tests' dependence."""
    p = np.asarray(p, dtype=float)
    m = len(p)
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.maximum.accumulate(scaled)
    return out


def seed_problem_bootstrap(
    values: np.ndarray, level: float = 0.95, n_boot: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of ``values.mean()`` for ``values[seed, problem]``, resampling both
    levels: the seeds (training runs) and, jointly for every seed, the problems (the same
    held-out problems are scored for every run, so a problem is resampled as a whole).

    Both sources of noise are in the interval: which runs we trained and which problems we
    happened to hold out. A paired difference of two methods (``a - b`` on the same seeds and
    problems) goes in as one array.
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 2 or 0 in x.shape:
        raise ValueError(f"values must be [seeds, problems] with both >= 1, got {x.shape}")
    rng = np.random.default_rng(seed)
    n_seeds, n_problems = x.shape
    means = np.empty(n_boot)
    for b in range(n_boot):
        rows = rng.integers(0, n_seeds, n_seeds)
        cols = rng.integers(0, n_problems, n_problems)
        means[b] = x[np.ix_(rows, cols)].mean()
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
