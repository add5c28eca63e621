"""``aggregate``: its input checks and the local denominators of each mode."""

from __future__ import annotations

import re

import pytest
import torch

from reco_megatron.algo.aggregation import aggregate


@pytest.mark.parametrize(
    ("per_token", "mask"),
    [
        pytest.param(torch.zeros(6), torch.ones(6), id="1-D"),
        pytest.param(torch.zeros(2, 3, 1), torch.ones(2, 3, 1), id="3-D"),
        pytest.param(torch.zeros(2, 3), torch.ones(3, 2), id="transposed-mask"),
    ],
)
def test_inputs_must_be_b_by_t(per_token: torch.Tensor, mask: torch.Tensor) -> None:
    """The sequence modes sum over the last axis per row: a 1-D input would be read as one
    row (a per-sequence mean over the whole batch), so anything but matching [B, T] is refused,
    naming both shapes."""
    shapes = f"got {tuple(per_token.shape)} and {tuple(mask.shape)}"
    with pytest.raises(ValueError, match=r"must both be \[B, T\], " + re.escape(shapes)):
        aggregate(per_token, mask, "seq_mean_token_mean")


def test_unknown_mode_quotes_it() -> None:
    with pytest.raises(ValueError, match=r"aggregation must be one of .* got 'mean'"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean")


def test_token_mean_of_a_fully_masked_batch_is_zero_not_nan() -> None:
    """No response token anywhere (a micro-batch of padding): the local token count is clamped
    to 1, so the share is 0 (the numerator is 0), not 0/0."""
    got = aggregate(torch.full((2, 3), float("nan")), torch.zeros(2, 3), "token_mean")
    assert got.item() == 0.0


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_sequence_modes_of_no_rows_are_zero_not_nan(mode: str) -> None:
    """B = 0: the local sequence count is clamped to 1 (the numerator is 0), not 0/0."""
    got = aggregate(torch.zeros(0, 3), torch.zeros(0, 3), mode, loss_normalizer=4.0)
    assert got.item() == 0.0


def test_an_all_masked_row_adds_nothing_but_counts_as_a_sequence() -> None:
    """seq_mean_token_mean: an empty row's length is clamped to 1 (its sum is 0, so it adds 0
    rather than NaN) and it still counts in the local sequence count B. Row 0: mean 2."""
    per_token = torch.tensor([[1.0, 3.0], [7.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate(per_token, mask, "seq_mean_token_mean").item() == 2.0 / 2


def test_token_mean_divides_by_the_local_token_count() -> None:
    """Without a global count the denominator is this batch's response tokens: (1+3+7)/3."""
    per_token = torch.tensor([[1.0, 3.0], [7.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    assert aggregate(per_token, mask).item() == pytest.approx(11.0 / 3, rel=1e-15)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_one_row_is_its_own_sequence_mean(mode: str) -> None:
    """B = 1: the local sequence count is 1, so the share is that row's value: its token mean
    (3 + 5) / 2, or its sum over the normaliser (3 + 5) / 4."""
    per_token = torch.tensor([[3.0, 5.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    got = aggregate(per_token, mask, mode, loss_normalizer=4.0)
    assert got.item() == (4.0 if mode == "seq_mean_token_mean" else 2.0)
