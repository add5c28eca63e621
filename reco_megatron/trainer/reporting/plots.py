"""``training_curves.png``: what a run did, readable at a glance.

Four panels against the RL step, each a smoothed curve (exponential moving average) over
the raw per-step values drawn faint: the mean reward of the training groups; the share of
distinct responses per group (``unique_frac``, what ReCo is meant to keep); pass@k of the
training groups; the share of responses whose ReCo weight is below 1 (``weight_active``).
Fractions are on a 0..1 axis so that a change of a few percent does not fill the panel.
The title says which run and which loss. Rank 0, matplotlib's Agg backend.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

PANELS: tuple[tuple[str, str], ...] = (
    ("reward_mean", "mean reward (training groups)"),
    ("unique_frac", "distinct responses per group (share)"),
    ("pass@k", "pass@k (training groups)"),
    ("weight_active", "responses down-weighted by ReCo (share)"),
)
"""``(metric, panel title)``; ``pass@k`` stands for every ``pass@<k>`` column."""

RAW_ALPHA = 0.25
"""Opacity of the raw per-step curves under the smoothed ones."""


EMPTY = {
    "weight_active": "weight_active is null in metrics.jsonl:\nthis loss computes no response "
    "weight (GRPO and its variants)"
}
"""What an empty panel says, where the reason is known."""
_CENTRED = {"ha": "center", "va": "center", "fontsize": 9}


def smooth(values: Sequence[float | None], window: int = 10) -> list[float]:
    """Exponential moving average with the weight of a ``window``-step mean (alpha =
    2 / (window + 1)); missing values (None, NaN) are skipped and stay NaN."""
    alpha = 2.0 / (window + 1)
    out, level = [], None
    for value in values:
        if value is None or not math.isfinite(value):
            out.append(float("nan"))
            continue
        level = value if level is None else level + alpha * (value - level)
        out.append(level)
    return out


def _column(rows: Sequence[Mapping[str, Any]], key: str) -> list[float | None]:
    return [r.get(key) if isinstance(r.get(key), int | float) else None for r in rows]


def training_figure(rows: Sequence[Mapping[str, Any]], title: str = "") -> Any:
    """The matplotlib Figure of :data:`PANELS` for ``metrics.jsonl`` rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    window = max(2, min(10, len(rows) // 5))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (key, panel) in zip(axes.flat, PANELS, strict=True):
        if key == "pass@k":
            ks = sorted(
                {k for r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:])
            )
            series = [(k, _column(rows, k)) for k in ks]
        else:
            series = [(key, _column(rows, key))]
        for name, raw in series:
            (line,) = ax.plot(steps, smooth(raw, window), lw=1.8, label=name)
            ax.plot(steps, raw, lw=0.8, alpha=RAW_ALPHA, color=line.get_color())
        ax.set_title(panel, fontsize=10)
        ax.grid(alpha=0.3)
        if key != "reward_mean" or all(v is None or 0 <= v <= 1 for _, raw in series for v in raw):
            ax.set_ylim(0, 1.02)
        if key == "pass@k" and series:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        if not any(v is not None for _, raw in series for v in raw):
            note = EMPTY.get(key, f"no {key} in metrics.jsonl")
            ax.text(0.5, 0.5, note, transform=ax.transAxes, **_CENTRED)
    for ax in axes[1]:
        ax.set_xlabel("RL step")
    fig.suptitle(
        f"{title}\nsmoothed (EMA over ~{window} steps); raw per-step values faint", fontsize=10
    )
    fig.tight_layout()
    return fig


def run_title(out_dir: Path) -> str:
    """``runs/tiny_cpu: reco loss, G = 8, 60 steps`` from the run's ``config.yaml``."""
    try:
        import yaml

        cfg = yaml.safe_load((out_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, ValueError):
        return str(out_dir)
    loss, rollout = cfg.get("loss") or {}, cfg.get("rollout") or {}
    parts = [
        f"objective {loss.get('objective')}, weight {loss.get('response_weight')}, "
        f"ratio {loss.get('token_ratio')}",
        f"G = {rollout.get('group_size')}",
    ]
    return f"{out_dir}: " + ", ".join(parts)


def plot_training_curves(metrics_path: Path, out_png: Path) -> Path | None:
    """Write :func:`training_figure` of ``metrics_path`` to ``out_png`` (None without rows or
    without matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return None
    with metrics_path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        return None
    import matplotlib.pyplot as plt

    fig = training_figure(rows, run_title(metrics_path.parent))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
