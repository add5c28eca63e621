"""The coverage report's stability table: which runs died, how far c went, how much the trust
region on c masked. From each run's ``metrics.jsonl`` (per RL step; ``token_ratio_max`` is the
maximum over the step's optimizer updates) and its held-out evaluation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DEAD_STEPS = 5
"""A run is dead in training from the first of ``DEAD_STEPS`` consecutive steps in which no
response earned a reward (``stability.dead_run_steps``' default)."""


def _no_reward(row: Mapping[str, Any]) -> bool:
    frac = row.get("reward_nonzero_frac")
    if frac is None:  # rows written before that column existed: countdown rewards are 0 or 1
        return float(row["reward_mean"]) == 0.0
    return float(frac) == 0.0


def dead_from(rows: Sequence[Mapping[str, Any]], k: int = DEAD_STEPS) -> int | None:
    """The first step of the first run of ``k`` consecutive steps without a reward, or None."""
    streak: list[int] = []
    for row in rows:
        streak = [*streak, int(row["step"])] if _no_reward(row) else []
        if len(streak) == k:
            return streak[0]
    return None


def _finite(rows: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    values = [row.get(key) for row in rows]
    return np.array([float(v) for v in values if v is not None and np.isfinite(float(v))])


def stability_table(
    runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    solves_nothing: Mapping[str, Sequence[bool]],
    c_max: float = 10.0,
) -> str:
    """Markdown, one row per method: runs dead in training (and from which step), runs that
    solve no held-out problem, the mean share of tokens masked by the trust region on c, the
    per-update maximum of the raw token ratio (median and largest over runs), and the steps
    whose raw ratio passed ``c_max``. ``runs[method]``: each seed's metric rows (empty when
    missing); ``solves_nothing[method]``: per seed, from the evaluation."""
    lines = [
        "| method | runs | dead in training (first dead step) | solve no held-out problem | "
        "masked by the trust region on c, % of tokens | max raw c per run: median | largest | "
        f"steps with raw c > {c_max:g} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, seeds in runs.items():
        trained = [rows for rows in seeds if rows]
        dead = [d for d in (dead_from(rows) for rows in trained) if d is not None]
        dead_cell = f"{len(dead)} of {len(trained)}" + (
            f" ({', '.join(str(d) for d in dead)})" if dead else ""
        )
        if len(trained) < len(seeds):
            dead_cell += f"; {len(seeds) - len(trained)} without metrics"
        nothing = solves_nothing.get(method, [])
        masked = [_finite(rows, "clip_frac_c") for rows in trained]
        masked = [m.mean() for m in masked if m.size]
        maxima = [_finite(rows, "token_ratio_max") for rows in trained]
        over = sum(int((m > c_max).sum()) for m in maxima if m.size)
        maxima = [m.max() for m in maxima if m.size]
        cells = [
            str(len(seeds)),
            dead_cell,
            f"{sum(nothing)} of {len(nothing)}",
            f"{100 * np.mean(masked):.3f}" if masked else "-",
            f"{np.median(maxima):.3g}" if maxima else "-",
            f"{max(maxima):.3g}" if maxima else "-",
            f"{over} of {sum(len(rows) for rows in trained)}" if maxima else "-",
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
