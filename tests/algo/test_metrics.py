"""Metric naming convention and the single-process merge."""

import pytest
import torch

from reco_megatron.algo import merge_metrics, reduction_of
from reco_megatron.algo.metrics import quantile_metrics, weight_metrics


def test_merge_by_suffix() -> None:
    parts = [
        {"n/sum": torch.tensor(2.0), "f/mean": torch.tensor(0.2), "lo/min": torch.tensor(1.0)},
        {"n/sum": torch.tensor(3.0), "f/mean": torch.tensor(0.4), "lo/min": torch.tensor(-1.0)},
    ]
    merged = merge_metrics(parts)
    assert merged["n/sum"].item() == 5.0
    assert merged["f/mean"].item() == pytest.approx(0.3)
    assert merged["lo/min"].item() == -1.0


def test_reduction_of_rejects_unknown_suffix() -> None:
    assert reduction_of("ratio_max/max") == "max"
    with pytest.raises(ValueError, match="'clip_frac'"):
        reduction_of("clip_frac")


def test_quantiles_empty_and_values() -> None:
    m = quantile_metrics("r", torch.arange(1.0, 102.0), torch.ones(101, dtype=torch.bool))
    assert m["r_p50/mean"].item() == 51.0 and m["r_max/max"].item() == 101.0
    m = quantile_metrics("r", torch.ones(3), torch.zeros(3, dtype=torch.bool))
    assert all(v.item() == 0.0 for v in m.values())


def test_ess_uniform_is_one() -> None:
    assert weight_metrics(torch.full((5,), 0.3))["weight_ess/mean"].item() == pytest.approx(1.0)
    # One weight dominating: ESS -> 1/n.
    ess = weight_metrics(torch.tensor([1.0, 1e-9, 1e-9, 1e-9]))["weight_ess/mean"].item()
    assert ess == pytest.approx(0.25, rel=1e-6)


def test_quantile_keys_name_the_percentile() -> None:
    """The keys read p50 and p99 for q = 0.5 and 0.99, and the max reduces by max."""
    got = quantile_metrics("ratio", torch.arange(4.0), torch.ones(4))
    assert set(got) == {"ratio_p50/mean", "ratio_p99/mean", "ratio_max/max"}


@pytest.mark.parametrize(
    ("weights", "mask"),
    [
        pytest.param(torch.zeros(0), None, id="per-response"),
        pytest.param(torch.zeros(0, 3), torch.zeros(0, 3), id="per-token"),
        pytest.param(torch.ones(2, 3), torch.zeros(2, 3), id="per-token-all-masked"),
    ],
)
def test_weight_metrics_of_no_weights_are_zeros_not_nan(
    weights: torch.Tensor, mask: torch.Tensor | None
) -> None:
    """An empty micro-batch (or one with no response token) reports 0 for every weight metric;
    a NaN would poison the step's merged metrics."""
    got = weight_metrics(weights, mask)
    assert got and all(v.item() == 0.0 for v in got.values()), got
    assert all(v.dtype == torch.float32 for v in got.values())


def test_ess_of_a_single_weight_is_one() -> None:
    """One weight is trivially uniform: ESS = w^2 / w^2 / 1 = 1."""
    assert weight_metrics(torch.tensor([0.3]))["weight_ess/mean"].item() == pytest.approx(1.0)
