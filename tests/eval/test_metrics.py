"""pass@k tables against brute force; diversity and rare-correct numbers on hand cases."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from reco_megatron.eval.metrics import (
    ProblemResult,
    check_kmax,
    coverage_summary,
    ks_up_to,
    passk_table,
    summarize_group,
)


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that contain a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_ks_up_to() -> None:
    assert ks_up_to(1) == [1]
    assert ks_up_to(64) == [1, 2, 4, 8, 16, 32, 64]
    assert ks_up_to(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="kmax"):
        ks_up_to(0)


def test_passk_table_matches_brute_force() -> None:
    n = 8
    counts = [0, 1, 2, 5, 8, 3]
    results = [ProblemResult(id=str(i), n=n, correct=c) for i, c in enumerate(counts)]
    ks = ks_up_to(n)
    table = passk_table(results, ks)
    for k in ks:
        expected = np.mean([brute_pass_at_k(n, c, k) for c in counts])
        assert math.isclose(table[f"pass@{k}"], expected, rel_tol=0, abs_tol=1e-12), k
    assert math.isclose(table["pass@1"], np.mean(counts) / n)
    assert table[f"pass@{n}"] == pytest.approx(5 / 6)  # all but the unsolved problem


def test_kmax_above_n_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"kmax=16 > n=8"):
        check_kmax(16, 8)
    with pytest.raises(ValueError, match="fewer than k=4"):
        passk_table([ProblemResult(id="a", n=2, correct=1)], [1, 2, 4])
    with pytest.raises(ValueError, match="empty"):
        passk_table([], [1])


def test_diversity_hand_cases() -> None:
    same = summarize_group([[1, 2, 3]] * 4)
    assert same["unique_frac"] == 0.25
    assert same["distinct_2"] == pytest.approx(2 / 8)  # bigrams (1,2),(2,3) x 4
    assert same["mean_len"] == 3.0
    spread = summarize_group([[1, 2], [2, 1], [3, 4], [1, 2, 1]])
    assert spread["unique_frac"] == 1.0
    # bigrams: (1,2) (2,1) (3,4) (1,2) (2,1) -> 3 distinct of 5
    assert spread["distinct_2"] == pytest.approx(3 / 5)


def test_coverage_summary_rare_correct_and_solved() -> None:
    results = [
        ProblemResult(id="a", n=4, correct=1, unique_frac=1.0, distinct_2=0.5, truncated=1),
        ProblemResult(id="b", n=4, correct=0, unique_frac=0.5, distinct_2=0.5),
        ProblemResult(id="c", n=4, correct=4, unique_frac=0.25, distinct_2=0.2),
        ProblemResult(id="d", n=4, correct=1, unique_frac=0.25, distinct_2=0.2),
    ]
    out = coverage_summary(results, [1, 2, 4])
    assert out["rare_correct_frac"] == 0.5
    assert out["solved_frac"] == 0.75
    assert out["pass@4"] == 0.75
    assert out["accuracy"] == pytest.approx(6 / 16)
    assert out["unique_frac"] == pytest.approx(0.5)
    assert out["truncated_frac"] == pytest.approx(1 / 16)
    assert out["num_problems"] == 4
