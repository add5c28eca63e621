"""The experiments' statistics (reco_megatron.eval.stats) against closed forms and limits."""

from __future__ import annotations

import numpy as np
import pytest

from reco_megatron.eval import stats


def test_sign_flip_and_bootstrap() -> None:
    # All 10 differences positive: only the all-plus and all-minus patterns are as extreme.
    assert stats.sign_flip_p(np.ones(10)) == pytest.approx(2 / 1024)
    assert stats.sign_flip_p(np.array([1.0, -1.0] * 5)) == 1.0
    x = np.arange(20.0)
    lo, hi = stats.bootstrap_ci(x)
    assert lo < x.mean() < hi and hi - lo < 6.0


def test_seed_problem_bootstrap_sees_both_levels_of_noise() -> None:
    rng = np.random.default_rng(0)
    problems = rng.normal(size=200)  # the problems differ, the seeds do not
    same_seeds = np.tile(problems, (5, 1))
    lo, hi = stats.seed_problem_bootstrap(same_seeds)
    se = problems.std(ddof=1) / np.sqrt(200)  # the interval is about mean +- 1.96 se
    assert lo < problems.mean() < hi
    assert (hi - lo) == pytest.approx(2 * 1.96 * se, rel=0.15)
    # Seed noise on top widens it; a constant gives a zero-width interval.
    noisy = same_seeds + rng.normal(scale=1.0, size=(5, 1))
    lo2, hi2 = stats.seed_problem_bootstrap(noisy)
    assert hi2 - lo2 > 2 * (hi - lo)
    assert stats.seed_problem_bootstrap(np.full((3, 4), 0.5)) == (0.5, 0.5)
    with pytest.raises(ValueError, match=r"\[seeds, problems\]"):
        stats.seed_problem_bootstrap(np.ones(5))


def test_holm_adjusts_step_down() -> None:
    # m = 4: sorted 0.01, 0.02, 0.03, 0.5 -> 0.04, 0.06, 0.06 (kept monotone), 0.5
    adjusted = stats.holm(np.array([0.03, 0.5, 0.01, 0.02]))
    np.testing.assert_allclose(adjusted, [0.06, 0.5, 0.04, 0.06])
    assert stats.holm(np.array([0.9, 0.8]))[0] == 1.0  # capped at 1
    np.testing.assert_allclose(stats.holm(np.array([0.2])), [0.2])  # one test: unchanged
