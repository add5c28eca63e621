"""Plots a person can read: training_curves.png (smoothed over faint raw curves, the
distinct-share and weight panels, honest axes) and passk.png (titled with the protocol, an
interval band over problems, y from 0), and distinct_correct in passk.md."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from reco_megatron.eval import report
from reco_megatron.trainer.reporting.plots import (
    RAW_ALPHA,
    plot_training_curves,
    smooth,
    training_figure,
)


def _rows(n: int = 60) -> list[dict]:
    rng = random.Random(0)
    return [
        {
            "step": i,
            "reward_mean": 0.15 + 0.1 * i / n + rng.gauss(0, 0.05),
            "unique_frac": 0.9 - 0.4 * i / n,
            "weight_active": 0.3,
            "pass@1": 0.2,
            "pass@8": 0.6,
        }
        for i in range(1, n + 1)
    ]


def test_smooth_is_an_ema_that_skips_gaps() -> None:
    out = smooth([1.0, None, 3.0], window=3)  # alpha 0.5
    assert out[0] == 1.0 and out[1] != out[1] and out[2] == 2.0


def test_training_figure_panels_axes_and_title() -> None:
    import matplotlib.pyplot as plt

    fig = training_figure(_rows(), "runs/x: objective reco")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        "mean reward (training groups)",
        "distinct responses per group (share)",
        "pass@k (training groups)",
        "responses down-weighted by ReCo (share)",
    ]
    for ax in fig.axes:
        assert ax.get_ylim() == (0.0, 1.02)  # fractions from 0: a few % stays a few %
        alphas = [line.get_alpha() for line in ax.get_lines()]
        assert alphas.count(RAW_ALPHA) == len(alphas) // 2  # a faint raw curve per smoothed one
    pass_ax = fig.axes[2]
    assert [t.get_text() for t in pass_ax.get_legend().get_texts()] == ["pass@1", "pass@8"]
    assert pass_ax.get_legend().get_bbox_to_anchor().x0 > pass_ax.bbox.x1 - 1  # beside, not over
    assert fig._suptitle.get_text().startswith("runs/x: objective reco\nsmoothed")
    plt.close(fig)


def test_a_grpo_runs_weight_panel_says_why_it_is_empty() -> None:
    """GRPO writes ``weight_active: null``: its panel says the loss has no response weight
    (it was a blank panel)."""
    import matplotlib.pyplot as plt

    rows = [{**row, "weight_active": None} for row in _rows()]
    fig = training_figure(rows, "runs/x: objective ppo_clip")
    texts = [t.get_text() for t in fig.axes[3].texts]
    assert len(texts) == 1 and "this loss computes no response weight" in texts[0], texts
    assert not fig.axes[0].texts  # a panel with data has no note
    plt.close(fig)


def test_training_curves_png(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    (tmp_path / "config.yaml").write_text("loss: {objective: reco}\nrollout: {group_size: 8}\n")
    png = plot_training_curves(metrics, tmp_path / "training_curves.png")
    assert png is not None and png.stat().st_size > 20_000


def _entry(label: str, correct: list[int], n: int = 16) -> dict:
    from reco_megatron.eval.metrics import ProblemResult, coverage_summary

    results = [ProblemResult(id=str(i), n=n, correct=c) for i, c in enumerate(correct)]
    summary = coverage_summary(results, [1, 2, 4, 8, 16])
    summary["distinct_correct"] = 2.5
    protocol = {"data": "/x/eval.jsonl", "n": n, "temperature": 0.6, "top_p": 0.95}
    return report.entry(label, "/ckpt", summary, results, protocol)


def test_passk_figure_protocol_title_band_and_axis(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    entries = [_entry("base", [0, 1, 3, 16, 0, 2] * 4), _entry("trained", [0, 4, 8, 16, 1, 0] * 4)]
    bands = report.problem_bands(entries, n_boot=500)
    for e in entries:
        low, high = bands[e["label"]]
        for k in (1, 4, 16):
            assert low[f"pass@{k}"] <= e["summary"][f"pass@{k}"] <= high[f"pass@{k}"]
    title = report.passk_title(entries[0]["protocol"], len(entries[0]["problems"]))
    assert title == "pass@k on eval.jsonl: 24 problems, n = 16 samples, T = 0.6, top-p 0.95"
    rows = [(e["label"], e["summary"]) for e in entries]
    fig = report.passk_figure(rows, bands, title, note="bands: 95% bootstrap over problems")
    (ax,) = fig.axes
    assert ax.get_title() == title and ax.get_ylim() == (0.0, 100.0)
    assert len(ax.collections) == 2  # one band per checkpoint
    plt.close(fig)
    png = report.plot_passk(tmp_path / "passk.png", rows, bands, title)
    assert png.stat().st_size > 10_000


def test_passk_table_has_distinct_correct_as_a_count() -> None:
    entries = [_entry("a", [0, 1, 3, 16])]
    table = report.markdown_table([(e["label"], e["summary"]) for e in entries])
    header, _, row = table.splitlines()
    assert header.split(" | ")[-1] == "distinct_correct |"
    assert row.endswith("| 2.50 |")
