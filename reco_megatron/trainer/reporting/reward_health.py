"""Reward failures of one step: counted by kind, summed over data-parallel ranks, and a stop
when more than ``reward.max_failed_frac`` of the step's rewards failed.

A reward function that raises, returns NaN, None or a string, runs out of memory, hangs or
crashes scores 0.0 in the pool (``reco_megatron.rewards.pool``). One such item is noise; a
step where most items fail trains on zeros, not on the task, and must stop the run (exit 3)
rather than go on silently. Every step's ``metrics.jsonl`` row has one ``reward_fail_<kind>``
column per kind of :data:`~reco_megatron.rewards.types.FAILURE_KINDS` and
``reward_fail_frac``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from reco_megatron.rewards.types import FAILURE_KINDS
from reco_megatron.trainer.lifecycle import StabilityStop

__all__ = ["FAILURE_COLUMNS", "RewardFailureStop", "check_failures", "failure_row", "local_counts"]

FAILURE_COLUMNS: tuple[str, ...] = tuple(f"reward_fail_{k}" for k in FAILURE_KINDS.values())
"""The per-kind columns of ``metrics.jsonl``, in the order of :func:`local_counts`."""


class RewardFailureStop(StabilityStop):
    """More than ``reward.max_failed_frac`` of one step's rewards failed (exit status 3)."""


def local_counts(statuses: Sequence[str] | None, n_items: int) -> torch.Tensor:
    """``[len(FAILURE_KINDS) + 1]`` float64: this rank's failures per kind, then ``n_items``
    (the items scored; ``statuses`` is None on ranks that do not score)."""
    counts = Counter(statuses or ())
    values = [float(counts.get(status, 0)) for status in FAILURE_KINDS]
    return torch.tensor([*values, float(n_items)], dtype=torch.float64)


def failure_row(counts: torch.Tensor) -> dict[str, float]:
    """The ``metrics.jsonl`` columns from *global* counts (:func:`local_counts`, summed over
    data-parallel ranks)."""
    values = counts.tolist()
    row = dict(zip(FAILURE_COLUMNS, values[:-1], strict=True))
    row["reward_fail_frac"] = sum(values[:-1]) / max(values[-1], 1.0)
    return row


def check_failures(step: int, row: dict[str, float], max_failed_frac: float, spec: str) -> None:
    """Raise :class:`RewardFailureStop` when ``row["reward_fail_frac"] > max_failed_frac``.
    Every rank holds the same global row, so every rank takes the same decision."""
    frac = row["reward_fail_frac"]
    if frac <= max_failed_frac:
        return
    kinds = ", ".join(
        f"{col.removeprefix('reward_fail_')}={int(row[col])}" for col in FAILURE_COLUMNS if row[col]
    )
    raise RewardFailureStop(
        f"step {step}: {frac:.0%} of the rewards failed ({kinds}), more than "
        f"reward.max_failed_frac={max_failed_frac}: the reward function {spec!r} is broken for "
        "this data (the first failure of each kind is logged above with an example); fix it, "
        "or raise reward.max_failed_frac to go on (nothing of this step was trained on)"
    )
