"""The coverage experiment's numbers: per-problem arrays from ``reco-eval``'s JSON, pass@k for
every k = 1..n by the unbiased estimator, 95 % intervals over seeds *and* held-out problems,
paired differences between methods, the tables and the figures of ``docs/results/coverage.md``.

Everything is recomputed from the raw per-problem counts (``n``, ``correct``,
``extra.distinct_correct``), never from the summaries, so the report cannot disagree with the
data it ships next to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from reco_megatron.algo.passk import pass_at_k
from reco_megatron.eval.stats import seed_problem_bootstrap

PASSK_SHOWN = (1, 4, 16, 64)
"""pass@k columns of the tables besides pass@n."""


class Scores:
    """One checkpoint's per-problem counts: ``n`` samples, ``c`` correct, ``distinct`` correct
    solutions, ``unique`` share of distinct responses; arrays of shape ``[P]`` in problem order."""

    def __init__(self, entry: Mapping[str, Any]) -> None:
        self.label = str(entry["label"])
        problems = sorted(entry["problems"], key=lambda p: p["id"])
        self.ids = [p["id"] for p in problems]
        self.n = np.array([p["n"] for p in problems])
        self.c = np.array([p["correct"] for p in problems])
        self.distinct = np.array(
            [p.get("extra", {}).get("distinct_correct", np.nan) for p in problems], dtype=float
        )
        self.unique = np.array([p["unique_frac"] for p in problems], dtype=float)

    def metric(self, name: str) -> np.ndarray:
        """``[P]`` per-problem values of ``pass@k``, ``distinct_correct``, ``unique_frac``."""
        if name.startswith("pass@"):
            return pass_at_k(self.n, self.c, int(name.split("@")[1]))
        if name == "distinct_correct":
            return self.distinct
        if name == "unique_frac":
            return self.unique
        raise KeyError(f"unknown metric {name!r}")


def label_order(label: str) -> tuple[str, int, str]:
    """Sort key of a checkpoint label ``method/sSEED``: by method, then by seed *number*
    (``s2`` before ``s10``, which a plain string sort would put after ``s1``)."""
    method, _, seed = label.partition("/")
    number = int(seed[1:]) if seed[:1] == "s" and seed[1:].isdigit() else -1
    return method, number, label


def seed_labels(runs: Sequence[Scores]) -> list[str]:
    """``["s1", "s2", ...]``: the seed part of each run's label, in the runs' order."""
    return [r.label.partition("/")[2] or r.label for r in runs]


def by_seed_number(runs: Sequence[Scores]) -> list[int]:
    """Positions of ``runs`` in seed-number order (``s1, s2, ..., s10``)."""
    return sorted(range(len(runs)), key=lambda i: label_order(runs[i].label))


def group(entries: Sequence[Mapping[str, Any]]) -> dict[str, list[Scores]]:
    """``{"base": [scores], "grpo": [runs], ...}`` from labels ``method/sSEED``; every
    checkpoint must hold the same problems (else the pairing is meaningless).

    The runs of a method are in *label* order (``s1, s10, s2, ...``), the same for every
    method, so positions pair; the bootstrap draws positions, so this order is part of how
    the stored intervals were drawn (another order moves their last digit by ~0.2 points).
    Anything shown per seed is put in seed-number order first (:func:`by_seed_number`)."""
    out: dict[str, list[Scores]] = {}
    ids = None
    for entry in sorted(entries, key=lambda e: e["label"]):
        scores = Scores(entry)
        if ids is None:
            ids = scores.ids
        elif scores.ids != ids:
            raise ValueError(
                f"{entry['label']} was evaluated on other problems than the first checkpoint: "
                "evaluate every checkpoint with the same --eval-prompts"
            )
        out.setdefault(entry["label"].split("/")[0], []).append(scores)
    return out


def values(runs: Sequence[Scores], metric: str) -> np.ndarray:
    """``[seeds, problems]`` values of ``metric``."""
    return np.stack([r.metric(metric) for r in runs])


def interval_cell(x: np.ndarray, scale: float, digits: int) -> str:
    """``"mean [lo, hi]"`` of ``x[seeds, problems]`` (95 % seed-and-problem bootstrap)."""
    lo, hi = seed_problem_bootstrap(x)
    return f"{scale * x.mean():.{digits}f} [{scale * lo:.{digits}f}, {scale * hi:.{digits}f}]"


def table_columns(n: int) -> list[tuple[str, str, float, int]]:
    """``(metric, header, scale, digits)`` of the result tables for ``n`` samples."""
    ks = [k for k in PASSK_SHOWN if k < n] + [n]
    return [(f"pass@{k}", f"pass@{k} %", 100.0, 1) for k in ks] + [
        ("distinct_correct", "distinct correct", 1.0, 2),
        ("unique_frac", "unique %", 100.0, 1),
    ]


def results_table(groups: Mapping[str, list[Scores]], methods: Sequence[str]) -> str:
    """Markdown: one row per method, ``mean [95 % interval]`` per column."""
    n = int(groups["base"][0].n.min())
    columns = table_columns(n)
    lines = [
        "| checkpoint | runs | " + " | ".join(c[1] for c in columns) + " |",
        "|---|---" + "|---" * len(columns) + "|",
    ]
    for name in ["base", *methods]:
        runs = groups[name]
        cells = [interval_cell(values(runs, m), s, d) for m, _, s, d in columns]
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def difference_table(
    groups: Mapping[str, list[Scores]], methods: Sequence[str], against: Sequence[str]
) -> str:
    """Markdown: paired differences ``method - reference`` (same seeds, same problems; the
    base is one checkpoint shared by every seed), mean and 95 % interval; ``*`` marks an
    interval that excludes 0."""
    n = int(groups["base"][0].n.min())
    columns = [c for c in table_columns(n) if c[0] != "unique_frac"]
    lines = [
        "| difference | " + " | ".join(c[1] for c in columns) + " |",
        "|---" + "|---" * len(columns) + "|",
    ]
    for reference in against:
        for name in methods:
            if name == reference:
                continue
            cells = []
            for metric, _, scale, digits in columns:
                mine = values(groups[name], metric)
                ref = values(groups[reference], metric)
                if ref.shape[0] == 1:
                    ref = np.repeat(ref, mine.shape[0], axis=0)
                elif seed_labels(groups[name]) != seed_labels(groups[reference]):
                    raise ValueError(f"{name} and {reference} have different seeds")
                d = mine - ref
                lo, hi = seed_problem_bootstrap(d)
                star = "*" if lo > 0 or hi < 0 else ""
                cells.append(
                    f"{scale * d.mean():+.{digits}f} [{scale * lo:+.{digits}f}, "
                    f"{scale * hi:+.{digits}f}]{star}"
                )
            lines.append(f"| {name} - {reference} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def budget_table(curve: Sequence[tuple[int, Mapping[str, Any]]]) -> str:
    """Markdown: the budget search, one row per evaluated step (step 0 = the base), with the
    paired difference of pass@64 to the base and its 95 % interval over problems (one seed: the
    interval says which problems we held out, not which run we trained; ``*``: excludes 0)."""
    base = Scores(curve[0][1])
    n = int(base.n.min())
    k = min(64, n)
    columns = [c for c in table_columns(n) if c[0] != "unique_frac"]
    lines = [
        "| RL step | " + " | ".join(c[1] for c in columns) + f" | pass@{k} - base |",
        "|---" * (len(columns) + 2) + "|",
    ]
    for step, entry in curve:
        scores = Scores(entry)
        cells = [f"{s * scores.metric(m).mean():.{d}f}" for m, _, s, d in columns]
        d = scores.metric(f"pass@{k}") - base.metric(f"pass@{k}")
        lo, hi = seed_problem_bootstrap(d[None, :])
        star = "*" if lo > 0 or hi < 0 else ""
        cells.append(f"{100 * d.mean():+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]{star}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def passk_curves(
    groups: Mapping[str, list[Scores]], methods: Sequence[str], n_boot: int = 400
) -> dict[str, dict[str, list[float]]]:
    """pass@k for every k = 1..n per checkpoint group: ``{"k": [...], name: {"mean": [...],
    "low": [...], "high": [...]}}`` (percent; 95 % seed-and-problem bootstrap at every k)."""
    n = int(groups["base"][0].n.min())
    ks = list(range(1, n + 1))
    out: dict[str, Any] = {"k": ks}
    for name in ["base", *methods]:
        rows = [values(groups[name], f"pass@{k}") for k in ks]
        bands = np.array([seed_problem_bootstrap(x, n_boot=n_boot) for x in rows])
        out[name] = {
            "mean": [round(100.0 * float(x.mean()), 3) for x in rows],
            "low": [round(100.0 * float(v), 3) for v in bands[:, 0]],
            "high": [round(100.0 * float(v), 3) for v in bands[:, 1]],
        }
    return out


def plot_passk_curves(path: Path, curves: Mapping[str, Any], title: str) -> Path:
    """pass@k against k = 1..n (log2 axis) from :func:`passk_curves`, with the 95 % bands;
    the right panel repeats the large-k end on its own scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = np.array(curves["k"])
    n = int(ks[-1])
    large = ks >= n // 8
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=(3, 2))
    for name, curve in curves.items():
        if name == "k":
            continue
        mean, low, high = (np.array(curve[key]) for key in ("mean", "low", "high"))
        style = {"linestyle": "--", "color": "black"} if name == "base" else {}
        (line,) = ax.plot(ks, mean, label=name, **style)
        ax.fill_between(ks, low, high, color=line.get_color(), alpha=0.12)
        zoom.plot(ks[large], mean[large], **{"color": line.get_color(), **style})
        zoom.fill_between(ks[large], low[large], high[large], color=line.get_color(), alpha=0.12)
    for axis in (ax, zoom):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("k (samples)")
        axis.grid(True, alpha=0.3)
    ax.set_ylabel("pass@k (%)")
    ax.set_title(title)
    zoom.set_title(f"large k (k >= {n // 8}), same data")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_budget(path: Path, curves: Mapping[str, Sequence[tuple[int, Mapping[str, Any]]]]) -> Path:
    """The budget search: pass@1, pass@64, pass@n and distinct correct solutions against the RL
    step, one line per curve run; the base (step 0) as a dotted reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, curve in curves.items():
        steps = [s for s, _ in curve]
        scores = [Scores(e) for _, e in curve]
        n = int(scores[0].n.min())
        for k in sorted({1, min(64, n), n}):
            ys = [100.0 * s.metric(f"pass@{k}").mean() for s in scores]
            (line,) = ax1.plot(steps, ys, marker="o", markersize=3, label=f"{label} pass@{k}")
            ax1.axhline(ys[0], color=line.get_color(), linestyle=":", linewidth=1)
        ys = [s.distinct.mean() for s in scores]
        ax2.plot(steps, ys, marker="o", markersize=3, label=label)
        ax2.axhline(ys[0], color="gray", linestyle=":", linewidth=1)
    ax1.set_ylabel("held-out pass@k (%)")
    ax2.set_ylabel("distinct correct solutions per problem")
    for axis in (ax1, ax2):
        axis.set_xlabel("RL step")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    ax1.set_title("budget search (dotted: the base)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


TRAINING_KEYS = (
    ("reward_mean", "reward", 1.0, 3),
    ("unique_frac", "unique in group", 1.0, 3),
    ("entropy_mean", "token entropy", 1.0, 3),
    ("weight_mean", "weight mean", 1.0, 3),
    ("weight_active", "w < 1 share", 1.0, 3),
)
"""Training metrics of the table: ``(metrics.jsonl key, header, scale, digits)``."""


def read_metrics(path: Path, last_step: int) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` up to ``last_step`` (a resumed run may have
    logged a step twice: the last row of a step wins); none when the file is missing."""
    import json

    if not path.exists():
        return []
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if row["step"] <= last_step:
                rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def training_table(
    runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], window: int = 20
) -> str:
    """Markdown: per method, the training metrics averaged over each run's first and last
    ``window`` steps, then over seeds (``first -> last``); a metric a run did not log (older
    code, e.g. ``weight_active``) is averaged over the runs that did, their count in brackets.
    ``runs[method]`` holds each seed's metric rows."""
    lines = [
        "| method | " + " | ".join(k[1] for k in TRAINING_KEYS) + " |",
        "|---" * (len(TRAINING_KEYS) + 1) + "|",
    ]
    for method, seeds in runs.items():
        cells = []
        for key, _, scale, digits in TRAINING_KEYS:
            pairs = []
            for rows in seeds:
                # NaN is written as null (e.g. weight_mean of a GRPO run): such rows are left out.
                logged = [r[key] for r in rows if r.get(key) is not None]
                logged = [v for v in logged if np.isfinite(v)]
                if logged:
                    pairs.append((np.mean(logged[:window]), np.mean(logged[-window:])))
            if not pairs:
                cells.append("-")
                continue
            a, b = np.mean(np.array(pairs), axis=0)
            note = f" ({len(pairs)} of {len(seeds)} runs)" if len(pairs) < len(seeds) else ""
            cells.append(f"{scale * a:.{digits}f} -> {scale * b:.{digits}f}{note}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def diverged_seeds(groups: Mapping[str, list[Scores]], methods: Sequence[str]) -> list[int]:
    """Seed indices (positions in each method's run list) where some method's run solves no
    held-out problem at all (pass@n = 0 while the base solves most): a training failure, not a
    coverage result."""
    n = int(groups["base"][0].n.min())
    return sorted(
        {
            i
            for m in methods
            for i, run in enumerate(groups[m])
            if run.metric(f"pass@{n}").mean() == 0.0
        }
    )


def without_seeds(
    groups: Mapping[str, list[Scores]], methods: Sequence[str], drop: Sequence[int]
) -> dict[str, list[Scores]]:
    """``groups`` with the seed positions ``drop`` left out of every method (the base kept),
    so the comparison stays paired."""
    out = {"base": list(groups["base"])}
    for m in methods:
        out[m] = [run for i, run in enumerate(groups[m]) if i not in drop]
    return out


def seed_test_table(
    groups: Mapping[str, list[Scores]], methods: Sequence[str], reference: str = "grpo"
) -> str:
    """Markdown: per-seed paired differences ``method - reference`` of pass@64 and distinct
    correct (each seed's mean over problems), how many seeds are positive, and the exact
    two-sided sign-flip p over seeds: the test that treats a training run, not a problem, as
    the unit (with s seeds the smallest possible p is 2 / 2^s)."""
    from reco_megatron.eval.stats import sign_flip_p

    n = int(groups["base"][0].n.min())
    k = min(64, n)
    shown = by_seed_number(groups[reference])
    order = ", ".join(seed_labels([groups[reference][i] for i in shown]))
    lines = [
        f"| method | Δ pass@{k} % per seed ({order}) | wins | p | Δ distinct correct per seed "
        "| wins | p |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        if m == reference:
            continue
        if seed_labels(groups[m]) != seed_labels(groups[reference]):
            raise ValueError(f"{m} and {reference} have different seeds")
        cells = []
        for metric, scale, digits in ((f"pass@{k}", 100.0, 1), ("distinct_correct", 1.0, 2)):
            d = values(groups[m], metric).mean(axis=1) - values(groups[reference], metric).mean(
                axis=1
            )
            listed = ", ".join(f"{scale * d[i]:+.{digits}f}" for i in shown)
            cells += [listed, f"{int((d > 0).sum())}/{len(d)}", f"{sign_flip_p(d):.2g}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


STEP_TIMES = ("time_rollout", "time_reward", "time_old_logprob", "time_train", "time_sync")
"""The per-step times of ``metrics.jsonl`` that add up to an RL step."""


def time_summary(
    out: Path,
    by_budget: Mapping[int, Sequence[Mapping[str, Any]]],
    curves: Mapping[str, Sequence[tuple[int, Mapping[str, Any]]]],
    sft_s: float | None,
) -> str:
    """``"SFT 1.5 min; RL 52.0 min (20 runs, ...); evaluation 31.0 min (53 checkpoints)."``:
    RL from the step times every run logged (all its steps, resumed runs included), the
    evaluation from each checkpoint's own ``time_s``; robust to interrupted and overlapping
    invocations, unlike a stopwatch around them."""
    rl_s, runs = 0.0, 0
    for metrics in sorted((out / "runs").glob("*/metrics.jsonl")):
        rows = read_metrics(metrics, 10**9)
        rl_s += sum(float(r.get(key) or 0.0) for r in rows for key in STEP_TIMES)
        runs += 1
    evaluated = {(e["label"], e.get("rl_step")): e for group in by_budget.values() for e in group}
    evaluated |= {(e["label"], e.get("rl_step")): e for c in curves.values() for _, e in c}
    eval_s = sum(float(e["summary"].get("time_s", 0.0)) for e in evaluated.values())
    sft = f"SFT {sft_s / 60:.1f} min; " if sft_s else ""
    return (
        f"{sft}RL {rl_s / 60:.1f} min ({runs} runs, all their steps); evaluation "
        f"{eval_s / 60:.1f} min ({len(evaluated)} checkpoint evaluations)."
    )
