"""Evaluation metrics: the unbiased pass@k estimator and diversity of a group of responses.

numpy, not torch: these run on evaluation results (integer counts, strings), off the
training graph. ``pass_at_k`` accepts scalars or array-likes and broadcasts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def _count(name: str, x: npt.ArrayLike) -> np.ndarray:
    """``x`` as int64, refusing a fractional or non-finite count (a cast would truncate it)."""
    a = np.asarray(x)
    if a.dtype.kind == "f" and not np.all(np.isfinite(a) & (a == np.trunc(a))):
        raise ValueError(f"pass@k counts must be whole numbers, got {name}={a.tolist()}")
    return a.astype(np.int64)


def pass_at_k(n: npt.ArrayLike, c: npt.ArrayLike, k: npt.ArrayLike) -> np.ndarray:
    """Unbiased pass@k (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)``, float64.

    ``n`` samples per problem of which ``c`` are correct; ``n``, ``c``, ``k`` broadcast
    together (e.g. ``n`` and ``c`` of shape ``[P]`` for P problems, scalar ``k``); the result
    has the broadcast shape (a 0-d array for scalars). Computed as the stable product
    ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (no factorials); exactly 1 when ``n - c < k`` and 0
    when ``c == 0``. Requires whole numbers (floats such as ``3.0`` are accepted, ``2.5`` is
    not), ``0 <= c <= n`` and ``1 <= k <= n`` (``ValueError`` otherwise).
    """
    n_a, c_a, k_a = np.broadcast_arrays(_count("n", n), _count("c", c), _count("k", k))
    if np.any(c_a < 0) or np.any(c_a > n_a):
        raise ValueError(f"need 0 <= c <= n, got n={n_a.tolist()} c={c_a.tolist()}")
    if np.any(k_a < 1) or np.any(k_a > n_a):
        raise ValueError(f"need 1 <= k <= n, got n={n_a.tolist()} k={k_a.tolist()}")
    max_n = int(n_a.max()) if n_a.size else 0
    i = np.arange(1, max_n + 1)  # [max_n]; k / i below is true division: float64
    n_e, c_e, k_e = (x[..., None] for x in (n_a, c_a, k_a))
    in_range = (i > n_e - c_e) & (i <= n_e)
    certain = (n_a - c_a) < k_a
    # Where n - c < k some factor would be 1 - k/i <= 0: the answer is 1, so skip the terms.
    terms = np.where(in_range & ~certain[..., None], 1.0 - k_e / i, 1.0)
    prod = np.prod(terms, axis=-1)
    return np.where(certain, 1.0, 1.0 - prod)


def _ngrams(tokens: Sequence[object], order: int) -> list[tuple[object, ...]]:
    return [tuple(tokens[j : j + order]) for j in range(len(tokens) - order + 1)]


def diversity_metrics(
    responses: Sequence[Sequence[int] | str], orders: Sequence[int] = (1, 2, 3, 4)
) -> dict[str, float]:
    """Diversity of one group of responses (token-id sequences, or strings split on whitespace).

    Returns ``unique_frac`` (distinct responses / responses) and ``distinct_<n>`` for each
    order (distinct n-grams / total n-grams, pooled over the group; 0 when there is no n-gram).
    An empty group gives zeros.
    """
    seqs: list[tuple[object, ...]] = [
        tuple(r.split()) if isinstance(r, str) else tuple(int(t) for t in r) for r in responses
    ]
    out: dict[str, float] = {"unique_frac": len(set(seqs)) / len(seqs) if seqs else 0.0}
    for order in orders:
        if order < 1:
            raise ValueError(f"n-gram order must be >= 1, got {order}")
        grams = [g for s in seqs for g in _ngrams(s, order)]
        out[f"distinct_{order}"] = len(set(grams)) / len(grams) if grams else 0.0
    return out
