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
COUNT_KEYS: tuple[str, ...] = ("distinct_correct",)
"""Summary numbers that are counts per problem (tables print them as they are, not as %)."""
TABLE_KEYS: tuple[str, ...] = (*DIVERSITY_KEYS, *COUNT_KEYS)
"""The columns after pass@k in ``passk.md`` (those a summary has)."""


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
    extra_keys: Sequence[str] = TABLE_KEYS,
) -> str:
    """A markdown table, one row per ``(label, summary)``: pass@k in percent, then the
    diversity columns (percent) and the counts (``distinct_correct``: distinct correct
    solutions per problem, as is). ``spread[label][key]`` (same units as the summary) is
    printed as ``+- x`` next to the value when given."""
    if not rows:
        raise ValueError("nothing to tabulate")
    ks = ks_of(rows[0][1])
    keys = [f"pass@{k}" for k in ks] + [k for k in extra_keys if k in rows[0][1]]
    lines = ["| checkpoint | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for label, summary in rows:
        cells = []
        for key in keys:
            scale, digits = (1.0, 2) if key in COUNT_KEYS else (100.0, 1)
            value = scale * summary.get(key, float("nan"))
            cell = f"{value:.{digits}f}"
            if spread is not None and key in spread.get(label, {}):
                cell += f" ± {scale * spread[label][key]:.{digits}f}"
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


def passk_figure(
    curves: Sequence[tuple[str, Mapping[str, float]]],
    bands: Mapping[str, tuple[Mapping[str, float], Mapping[str, float]]] | None = None,
    title: str = "pass@k",
    note: str = "",
) -> Any:
    """The figure of pass@k against k (log2 x axis, y from 0 to 100 %), one line per
    ``(label, summary)``.

    ``bands[label] = (low, high)`` summaries shade the spread (an interval over problems,
    min/max over seeds); ``note`` goes under the plot (what the band is).
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
    if curves:
        ks_all = ks_of(curves[0][1])
        ax.set_xticks(ks_all, [str(k) for k in ks_all])
        ax.minorticks_off()
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("pass@k (%)")
    ax.set_ylim(0, 100)  # a difference of a few problems must not look like a result
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="0.35", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    return fig


def plot_passk(
    path: str | Path,
    curves: Sequence[tuple[str, Mapping[str, float]]],
    bands: Mapping[str, tuple[Mapping[str, float], Mapping[str, float]]] | None = None,
    title: str = "pass@k",
    note: str = "",
) -> Path:
    """:func:`passk_figure` written as a PNG to ``path``."""
    import matplotlib.pyplot as plt

    fig = passk_figure(curves, bands, title, note)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def passk_title(protocol: Mapping[str, Any], problems: int) -> str:
    """``pass@k on eval.jsonl: 24 problems, n = 16 samples, T = 0.6, top-p 0.95``."""
    data = Path(str(protocol.get("data", ""))).name or "held-out problems"
    return (
        f"pass@k on {data}: {problems} problems, n = {protocol.get('n')} samples, "
        f"T = {protocol.get('temperature')}, top-p {protocol.get('top_p')}"
    )


def problem_bands(
    entries: Sequence[Mapping[str, Any]], level: float = 0.95, n_boot: int = 2000
) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """Per checkpoint label, the percentile bootstrap interval over problems of each pass@k
    (resampling the problems, so a curve's band says how much a different draw of problems
    of the same kind would move it): ``{label: (low summary, high summary)}``."""
    import numpy as np

    from reco_megatron.algo.passk import pass_at_k
    from reco_megatron.eval.stats import bootstrap_ci

    bands = {}
    for e in entries:
        low, high = {}, {}
        n = np.array([p["n"] for p in e["problems"]])
        c = np.array([p["correct"] for p in e["problems"]])
        for k in ks_of(e["summary"]):
            low[f"pass@{k}"], high[f"pass@{k}"] = bootstrap_ci(pass_at_k(n, c, k), level, n_boot)
        bands[e["label"]] = (low, high)
    return bands


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
