"""Pass@k tables and coverage/diversity summaries from per-problem evaluation results.

Pure Python + numpy (no torch, no engine): the inputs are, per problem, the number of samples
``n``, the number of correct ones ``c`` and the sampled responses (token ids). Everything the
evaluation CLI and the trainer's periodic evaluation report is computed here, so it is tested
against brute force once.

Reading the numbers (see ``docs/evaluation.md``):

- ``pass@k``: mean over problems of the unbiased estimator ``1 - C(n-c, k) / C(n, k)``
  (:func:`reco_megatron.algo.passk.pass_at_k`); pass@1 is the mean accuracy, large-k pass@k
  the *coverage*: the share of problems the model can solve at all given k tries.
- ``unique_frac``: distinct responses / responses, averaged over problems (1 = no repeats).
- ``distinct_2``: distinct token bigrams / bigrams pooled over a problem's responses, averaged.
- ``rare_correct_frac``: share of problems solved by *exactly one* of the n samples: solutions
  the policy still finds, but rarely; the mass ReCo is meant to protect and GRPO to lose.
- ``solved_frac``: share of problems with at least one correct sample (= pass@n).
- ``distinct_correct``: distinct correct *solutions* per problem among the n samples, averaged
  (only with an answer key, e.g. countdown's: answers equal up to commutativity count once).
  Coverage of the answer set, not just of the problems: a policy can keep pass@n and still
  collapse onto one solution per problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from reco_megatron.algo.passk import diversity_metrics, pass_at_k


@dataclass(kw_only=True)
class ProblemResult:
    """Evaluation of one problem: ``n`` samples, ``correct`` of them graded correct."""

    id: str
    """The problem's id (from the dataset)."""
    n: int
    """Samples drawn."""
    correct: int
    """Samples graded correct (reward >= the threshold)."""
    unique_frac: float = 0.0
    """Distinct responses / ``n``."""
    distinct_2: float = 0.0
    """Distinct bigrams / bigrams over the ``n`` responses."""
    mean_len: float = 0.0
    """Mean response length in tokens."""
    truncated: int = 0
    """Responses that hit ``max_new_tokens``."""
    extra: dict[str, float] = field(default_factory=dict)
    """Free-form per-problem numbers (kept in the JSON output)."""


def ks_up_to(kmax: int) -> list[int]:
    """``[1, 2, 4, ..., kmax]``: powers of two up to ``kmax``, plus ``kmax`` itself if it is not
    one (``ks_up_to(48) == [1, 2, 4, 8, 16, 32, 48]``). ``ValueError`` for ``kmax < 1``."""
    if isinstance(kmax, bool) or not isinstance(kmax, int) or kmax < 1:
        raise ValueError(f"kmax must be an int >= 1, got {kmax!r}")
    ks, k = [], 1
    while k <= kmax:
        ks.append(k)
        k *= 2
    if ks[-1] != kmax:
        ks.append(kmax)
    return ks


def check_kmax(kmax: int, n: int) -> None:
    """Refuse ``kmax > n``: the unbiased estimator needs at least ``k`` samples a problem."""
    if kmax > n:
        raise ValueError(
            f"kmax={kmax} > n={n} samples per problem: pass@k needs n >= k; raise n "
            f"(e.g. n={kmax}) or lower kmax"
        )


def summarize_group(responses: Sequence[Sequence[int]]) -> dict[str, float]:
    """``unique_frac``, ``distinct_2`` and ``mean_len`` of one problem's responses."""
    div = diversity_metrics([tuple(r) for r in responses], orders=(2,))
    lens = [len(r) for r in responses]
    return {
        "unique_frac": div["unique_frac"],
        "distinct_2": div["distinct_2"],
        "mean_len": float(np.mean(lens)) if lens else 0.0,
    }


def passk_table(results: Sequence[ProblemResult], ks: Sequence[int]) -> dict[str, float]:
    """Mean pass@k over problems for each ``k``: ``{"pass@1": ..., "pass@2": ...}``.

    ``ValueError`` when there are no results or some ``k`` exceeds a problem's ``n``.
    """
    if not results:
        raise ValueError("no problems were evaluated: the dataset is empty")
    n = np.array([r.n for r in results])
    c = np.array([r.correct for r in results])
    too_few = [r.id for r in results if r.n < max(ks)]
    if too_few:
        raise ValueError(f"problems {too_few[:5]} have fewer than k={max(ks)} samples")
    return {f"pass@{k}": float(pass_at_k(n, c, k).mean()) for k in ks}


def coverage_summary(results: Sequence[ProblemResult], ks: Sequence[int]) -> dict[str, float]:
    """pass@k for every ``k`` plus the diversity and coverage numbers (module docstring)."""
    out = passk_table(results, ks)
    out["unique_frac"] = float(np.mean([r.unique_frac for r in results]))
    out["distinct_2"] = float(np.mean([r.distinct_2 for r in results]))
    out["rare_correct_frac"] = float(np.mean([r.correct == 1 for r in results]))
    out["solved_frac"] = float(np.mean([r.correct > 0 for r in results]))
    out["accuracy"] = float(np.mean([r.correct / r.n for r in results]))
    out["mean_len"] = float(np.mean([r.mean_len for r in results]))
    out["truncated_frac"] = float(sum(r.truncated for r in results) / sum(r.n for r in results))
    out["num_problems"] = float(len(results))
    if all("distinct_correct" in r.extra for r in results):
        out["distinct_correct"] = float(np.mean([r.extra["distinct_correct"] for r in results]))
    return out
