"""pass@k against the exact binomial expression, edge cases, and diversity metrics."""

import math

import numpy as np
import pytest

from reco_megatron.algo import diversity_metrics, pass_at_k


def _exact(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_matches_math_comb_for_all_small_cases() -> None:
    cases = [(n, c, k) for n in range(1, 21) for c in range(n + 1) for k in range(1, n + 1)]
    n, c, k = (np.array(x) for x in zip(*cases, strict=True))
    got = pass_at_k(n, c, k)
    want = np.array([_exact(*t) for t in cases])
    # The product form accumulates ~n roundings in fp64: 1e-12 absolute is ample for n <= 20.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # the n - c < k shortcut gives exactly 1, not 1 up to rounding
    np.testing.assert_array_equal(got[n - c < k], 1.0)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        pytest.param(10, 8, 3, 1.0, id="n-c<k->1"),
        pytest.param(10, 0, 3, 0.0, id="c=0->0"),
        pytest.param(10, 1, 10, 1.0, id="k=n,c>0->1"),
        pytest.param(10, 0, 10, 0.0, id="k=n,c=0->0"),
        pytest.param(5, 1, 1, 0.2, id="k=1->c/n"),
    ],
)
def test_edge_cases(n: int, c: int, k: int, expected: float) -> None:
    assert float(pass_at_k(n, c, k)) == pytest.approx(expected, abs=1e-15)


def test_large_n_stable() -> None:
    # C(1024, 256) overflows floats; the product form stays in [0, 1] and matches big ints.
    got = pass_at_k(np.array([1024, 1024]), np.array([3, 500]), 256)
    want = [_exact(1024, 3, 256), _exact(1024, 500, 256)]
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_vectorised_shape_and_scalar() -> None:
    assert pass_at_k(np.full((2, 3), 8), np.arange(6).reshape(2, 3), 4).shape == (2, 3)
    assert np.ndim(pass_at_k(4, 1, 2)) == 0


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_invalid_raise(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="need"):
        pass_at_k(n, c, k)


def test_invalid_counts_are_quoted_as_the_integers_they_are() -> None:
    """The error quotes the counts as counts (``n=[4, 4]``), also when they came as floats."""
    with pytest.raises(ValueError, match=r"^need 0 <= c <= n, got n=\[4, 4\] c=\[1, 5\]$"):
        pass_at_k([4.0, 4.0], [1, 5], 1)


def test_diversity_token_ids() -> None:
    group = [[1, 2, 3], [1, 2, 3], [1, 2, 4], [5]]
    m = diversity_metrics(group, orders=(1, 2))
    assert m["unique_frac"] == 3 / 4
    # unigrams: 10 total, distinct {1,2,3,4,5}; bigrams: 6 total, distinct {12, 23, 24}.
    assert m["distinct_1"] == 5 / 10
    assert m["distinct_2"] == 3 / 6


def test_diversity_strings_and_empty() -> None:
    m = diversity_metrics(["a b", "a b", "b a"], orders=(1, 3))
    assert m == {"unique_frac": 2 / 3, "distinct_1": 2 / 6, "distinct_3": 0.0}
    assert diversity_metrics([])["unique_frac"] == 0.0


def test_certain_cases_stay_exact_where_the_product_would_overflow() -> None:
    """``n - c < k`` must be decided before the product: with n = c = 2000, k = 1500 the
    factors ``1 - k/i`` for i < 1500 are as large as -1499 and their product overflows to inf
    long before the zero factor at i = k, giving inf * 0 = NaN. (A shortcut that never fires,
    such as ``n + c < k``, agrees with math.comb on small n and fails here.)"""
    with np.errstate(all="ignore"):
        got = pass_at_k(np.array([2000, 2000]), np.array([2000, 600]), 1500)
    np.testing.assert_array_equal(got, [1.0, 1.0])


@pytest.mark.parametrize(
    ("n", "c", "k", "name"),
    [
        (2.7, 1, 1, "n"),
        (4, 1.5, 1, "c"),
        (4, 1, 2.5, "k"),
        (4, 1, float("nan"), "k"),
        (float("inf"), 1, 1, "n"),
    ],
)
def test_fractional_counts_are_refused_not_truncated(
    n: float, c: float, k: float, name: str
) -> None:
    """A cast to int64 would read c = 1.5 as 1 and answer silently; the error names the value."""
    with pytest.raises(ValueError, match=rf"counts must be whole numbers, got {name}="):
        pass_at_k(n, c, k)


def test_whole_valued_floats_are_counts() -> None:
    """Counts read from JSON or averaged arrays arrive as floats: 8.0 is the count 8."""
    assert float(pass_at_k(8.0, 2.0, 4.0)) == float(pass_at_k(8, 2, 4))
