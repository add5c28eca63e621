"""Sample ``n`` responses per problem, grade them, and count the correct ones.

:func:`evaluate_problems` is shared by ``reco-eval`` and the trainer's periodic coverage
evaluation. Each problem is sampled in its own ``generate`` call with its own seed, derived
from ``(seed, problem id)`` by :func:`problem_seed`: a problem's samples do not depend on which
other problems are evaluated, on their order or on the engine's call counter, so two runs of
the same checkpoint give the same counts, and two checkpoints are compared on the same noise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from reco_megatron.eval.metrics import ProblemResult, summarize_group
from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.requests import SamplingParams


@dataclass(frozen=True)
class EvalProblem:
    """One problem: ``id``, ``prompt_ids`` (formatted and tokenized), ``gold`` answer."""

    id: str
    prompt_ids: list[int]
    gold: str


def problem_seed(seed: int, problem_id: str) -> int:
    """A stable 63-bit seed for ``problem_id`` under the run's ``seed`` (independent of
    Python's hash randomisation)."""
    digest = hashlib.sha256(f"{seed}:{problem_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, desc=desc, unit="sample", dynamic_ncols=True, leave=False)


def evaluate_problems(
    engine: RolloutEngine,
    problems: Sequence[EvalProblem],
    *,
    n: int,
    sampling: SamplingParams,
    grade: Callable[[list[str], list[str]], list[float]],
    decode: Callable[[Sequence[int]], str],
    seed: int = 0,
    threshold: float = 1.0,
    progress: bool = False,
    desc: str = "pass@k",
    answer_key: Callable[[str, str], str | None] | None = None,
) -> list[ProblemResult]:
    """Draw ``n`` samples per problem, grade them, and return one :class:`ProblemResult` each.

    Args:
        engine: any :class:`RolloutEngine` holding the weights to evaluate.
        problems: the problems (``prompt_ids`` already formatted and tokenized).
        n: samples per problem.
        sampling: temperature / top-p / max_new_tokens / stop ids; its ``seed`` is replaced by
            the per-problem seed.
        grade: ``grade(texts, golds) -> scores`` (e.g. a reward pool's ``score``).
        decode: token ids -> text.
        seed: the evaluation seed (see :func:`problem_seed`).
        threshold: a sample is correct when its score is ``>= threshold``.
        progress: show a tqdm bar counting samples.
        answer_key: ``key(text, gold)`` naming the solution a response gives; with it each
            result's ``extra["distinct_correct"]`` counts the distinct keys among the correct
            samples (``TypeError`` if it returns anything but a string or None).
    """
    if not problems:
        raise ValueError("no problems to evaluate: the dataset is empty")
    bar = _progress(len(problems) * n, desc, progress)
    results: list[ProblemResult] = []
    try:
        for problem in problems:
            params = replace(sampling, seed=problem_seed(seed, problem.id))
            group = engine.generate([problem.prompt_ids], n, params)[0]
            responses = [c.token_ids for c in group]
            texts = [decode(ids) for ids in responses]
            scores = grade(texts, [problem.gold] * len(texts))
            stats = summarize_group(responses)
            correct = [text for text, s in zip(texts, scores, strict=True) if s >= threshold]
            extra = {}
            if answer_key is not None:
                extra["distinct_correct"] = float(_distinct(answer_key, correct, problem.gold))
            results.append(
                ProblemResult(
                    id=problem.id,
                    n=len(group),
                    correct=len(correct),
                    unique_frac=stats["unique_frac"],
                    distinct_2=stats["distinct_2"],
                    mean_len=stats["mean_len"],
                    truncated=sum(1 for c in group if c.finish_reason == "length"),
                    extra=extra,
                )
            )
            if bar is not None:
                bar.update(len(group))
    finally:
        if bar is not None:
            bar.close()
    return results


def _distinct(key: Callable[[str, str], str | None], texts: Sequence[str], gold: str) -> int:
    """Distinct solutions among ``texts`` (correct responses); a None key is not counted."""
    keys = set()
    for text in texts:
        value = key(text, gold)
        if value is not None and not isinstance(value, str):
            raise TypeError(
                f"answer key {getattr(key, '__name__', key)!r} returned {value!r} for "
                f"{text[:60]!r}: it must return a string naming the solution, or None"
            )
        keys.add(value)
    keys.discard(None)
    return len(keys)
