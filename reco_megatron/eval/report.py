"""Outputs of an evaluation: a JSON table, a markdown table and a pass@k plot.

The JSON (``write_json``) holds, per checkpoint (label), the protocol, the per-k averages and
diversity numbers (``summary``) and the per-problem counts (``problems``); ``read_json`` loads
it back. The plot puts every checkpoint on one figure, pass@k against k on a log2 axis;
``plot_passk`` also takes a spread (min/max or +-std over seeds) for the experiment's bands.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from reco_megatron.eval.metrics import ProblemResult

DIVERSITY_KEYS: tuple[str, ...] = ("unique_frac", "distinct_2", "rare_correct_frac", "solved_frac")


def entry(
    label: str,
    source: str,
    summary: Mapping[str, float],
    results: Sequence[ProblemResult],
    protocol: Mapping[str, Any],
) -> dict[str, Any]:
    """One checkpoint's record of the JSON table."""
    return {
        "label": label,
        "checkpoint": source,
        "protocol": dict(protocol),
        "summary": dict(summary),
        "problems": [asdict(r) for r in results],
    }


def write_json(path: str | Path, entries: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``{"checkpoints": [...]}``; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"checkpoints": list(entries)}, indent=1) + "\n", encoding="utf-8")
    return out


def read_json(path: str | Path) -> list[dict[str, Any]]:
    """The checkpoint entries of a JSON table written by :func:`write_json`."""
    return list(json.loads(Path(path).read_text(encoding="utf-8"))["checkpoints"])


def ks_of(summary: Mapping[str, float]) -> list[int]:
    """The ``k`` values present in a summary (``pass@k`` keys), sorted."""
    return sorted(int(key.split("@")[1]) for key in summary if key.startswith("pass@"))


def markdown_table(
    rows: Sequence[tuple[str, Mapping[str, float]]],
    spread: Mapping[str, Mapping[str, float]] | None = None,
    extra_keys: Sequence[str] = DIVERSITY_KEYS,
) -> str:
    """A markdown table, one row per ``(label, summary)``: pass@k in percent, then the
    diversity columns. ``spread[label][key]`` (same units as the summary) is printed as
    ``+- x`` next to the value when given."""
    if not rows:
        raise ValueError("nothing to tabulate")
    ks = ks_of(rows[0][1])
    keys = [f"pass@{k}" for k in ks] + [k for k in extra_keys if k in rows[0][1]]
    lines = ["| checkpoint | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for label, summary in rows:
        cells = []
        for key in keys:
            value = 100.0 * summary.get(key, float("nan"))
            cell = f"{value:.1f}"
            if spread is not None and key in spread.get(label, {}):
                cell += f" ± {100.0 * spread[label][key]:.1f}"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_STYLES = (("o", "-", 3), ("x", "--", 7), ("+", ":", 9), ("s", "-.", 5))


def curve_styles(
    summaries: Sequence[Mapping[str, float]], labels: Sequence[str]
) -> list[dict[str, Any]]:
    """Matplotlib keywords per curve. A curve equal to an earlier one (same pass@k at every k,
    e.g. a checkpoint and its own HF export) gets another marker and line style, drawn on top,
    and ``(= first label)`` in its legend entry, so neither hides the other unnoticed."""
    styles: list[dict[str, Any]] = []
    for i, summary in enumerate(summaries):
        values = [summary[f"pass@{k}"] for k in ks_of(summary)]
        same = [
            j
            for j in range(i)
            if [summaries[j][f"pass@{k}"] for k in ks_of(summaries[j])] == values
        ]
        marker, linestyle, size = _STYLES[len(same) % len(_STYLES)]
        label = labels[i] + (f" (= {labels[same[0]]})" if same else "")
        styles.append(
            {"marker": marker, "linestyle": linestyle, "markersize": size, "label": label}
        )
    return styles


def plot_passk(
    path: str | Path,
    curves: Sequence[tuple[str, Mapping[str, float]]],
    bands: Mapping[str, tuple[Mapping[str, float], Mapping[str, float]]] | None = None,
    title: str = "pass@k",
) -> Path:
    """PNG of pass@k against k (log2 x axis), one line per ``(label, summary)``.

    ``bands[label] = (low, high)`` summaries shade the spread (e.g. min/max over seeds).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    styles = curve_styles([c[1] for c in curves], [c[0] for c in curves])
    for (label, summary), style in zip(curves, styles, strict=True):
        ks = ks_of(summary)
        ys = [100.0 * summary[f"pass@{k}"] for k in ks]
        (line,) = ax.plot(ks, ys, **style)
        if bands and label in bands:
            low, high = bands[label]
            ax.fill_between(
                ks,
                [100.0 * low[f"pass@{k}"] for k in ks],
                [100.0 * high[f"pass@{k}"] for k in ks],
                color=line.get_color(),
                alpha=0.15,
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("pass@k (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_over_training(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path | None:
    """PNG of the periodic evaluation (``eval.jsonl`` rows): pass@k for each k against the
    training step, and the diversity numbers on a second panel. ``None`` when no rows."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for k in ks_of(rows[0]):
        ax1.plot(steps, [100.0 * r[f"pass@{k}"] for r in rows], marker="o", label=f"pass@{k}")
    ax1.set_xlabel("training step")
    ax1.set_ylabel("pass@k (%)")
    ax1.set_title("coverage on held-out prompts")
    ax1.legend(fontsize=7)
    for key in DIVERSITY_KEYS:
        if key in rows[0]:
            ax2.plot(steps, [r[key] for r in rows], marker="o", label=key)
    ax2.set_xlabel("training step")
    ax2.set_title("diversity")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
