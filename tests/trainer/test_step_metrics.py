"""How one RL step's optimizer updates become one ``metrics.jsonl`` row: maxima are maxima
over the updates, means are means, counts are sums (``combine_updates``)."""

from __future__ import annotations

import math

import pytest

from reco_megatron.trainer.reporting.step_metrics import UPDATE_METRICS, combine_updates

# Two updates of one rollout batch: the first runs at theta == theta_old (r = c = 1), the
# second sees the spike; a mean over updates would log (1 + 27) / 2 = 14 as the "max".
UPDATES = [
    {"token_ratio_max": 1.0, "ratio_max": 1.0, "grad_norm": 0.5, "clip_frac": 0.0,
     "clip_frac_c": 0.0, "loss": 0.2, "lr": 1e-4, "update_skipped": 0.0},
    {"token_ratio_max": 27.0, "ratio_max": 1.7, "grad_norm": 1.5, "clip_frac": 0.1,
     "clip_frac_c": 0.004, "loss": -0.4, "lr": 3e-4, "update_skipped": 1.0},
]  # fmt: skip


def test_maxima_are_maxima_over_updates() -> None:
    row = combine_updates(UPDATES)
    assert row["token_ratio_max"] == 27.0
    assert row["ratio_max"] == 1.7
    assert row["grad_norm_max"] == 1.5


def test_means_are_means_over_updates() -> None:
    row = combine_updates(UPDATES)
    assert row["grad_norm"] == pytest.approx(1.0)
    assert row["clip_frac"] == pytest.approx(0.05)
    assert row["clip_frac_c"] == pytest.approx(0.002)
    assert row["loss"] == pytest.approx(-0.1)
    assert row["lr"] == pytest.approx(2e-4)


def test_counts_are_sums_over_updates() -> None:
    assert combine_updates(UPDATES)["updates_skipped"] == 2 * 0.5
    assert combine_updates([])["updates_skipped"] == 0.0


def test_missing_and_nan_values() -> None:
    # a skipped update has no gradient norm (NaN): ignored by mean and max
    row = combine_updates([{"grad_norm": math.nan}, {"grad_norm": 2.0}])
    assert row["grad_norm"] == 2.0 and row["grad_norm_max"] == 2.0
    # absent in every update (GRPO has no response weights, no c): NaN columns
    row = combine_updates([{"loss": 1.0}])
    assert math.isnan(row["weight_mean"]) and math.isnan(row["clip_frac_c"])
    assert math.isnan(combine_updates([{"grad_norm": math.nan}])["grad_norm_max"])


def test_every_reduction_is_known() -> None:
    assert {r for _, _, r in UPDATE_METRICS} == {"mean", "max", "sum"}
    maxima = {col for _, col, r in UPDATE_METRICS if r == "max"}
    assert maxima == {c for _, c, _ in UPDATE_METRICS if c.endswith("_max")}
