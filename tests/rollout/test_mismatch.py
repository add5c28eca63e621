"""Mismatch metrics and TIS weights on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from reco_megatron.rollout import logprob_mismatch, mismatch_metrics, tis_weights

TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0], [0.0, 0.0, 0.0]])
ROLL = torch.tensor([[-1.5, -2.0, -0.2], [-0.1, -0.5, 7.0], [3.0, 3.0, 3.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
# diffs on the mask: row 0: 0.5, 0, -0.3; row 1: 0, 0.3 (row 2 has no response tokens)


def test_mismatch_metrics_hand_computed() -> None:
    m = mismatch_metrics(TRAIN, ROLL, MASK)
    assert m["mismatch/logprob_abs_diff/mean"].item() == pytest.approx(1.1 / 5)
    assert m["mismatch/logprob_abs_diff/max"].item() == pytest.approx(0.5)
    assert m["mismatch/logprob_diff/mean"].item() == pytest.approx(0.5 / 5)
    assert m["mismatch/seq_log_ratio/mean"].item() == pytest.approx((0.2 + 0.3) / 2)
    assert m["mismatch/seq_log_ratio_abs/max"].item() == pytest.approx(0.3)
    assert m["mismatch/num_tokens/sum"].item() == 5
    assert logprob_mismatch(TRAIN, ROLL, MASK).item() == pytest.approx(0.22)
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in m.values())


def test_mismatch_empty_mask_and_shape_errors() -> None:
    m = mismatch_metrics(TRAIN, ROLL, torch.zeros(3, 3))
    assert all(v.item() == 0 for v in m.values())
    with pytest.raises(ValueError, match=r"must have the same \[B, T\] shape"):
        mismatch_metrics(TRAIN, ROLL[:, :2], MASK)


def test_tis_weights_hand_computed() -> None:
    w = tis_weights(TRAIN, ROLL, MASK, cap=1.2)
    expected = torch.tensor(
        [[1.2, 1.0, math.exp(-0.3)], [1.0, 1.2, 0.0], [0.0, 0.0, 0.0]]
    )  # exp(0.5)=1.65 and exp(0.3)=1.35 capped at 1.2; masked tokens 0
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    huge = tis_weights(torch.tensor([[1e4]]), torch.tensor([[-1e4]]), torch.ones(1, 1), cap=2.0)
    assert huge.item() == pytest.approx(2.0)
    assert not tis_weights(TRAIN.requires_grad_(), ROLL, MASK).requires_grad
    with pytest.raises(ValueError, match="TIS cap must be a finite number > 0, got 0"):
        tis_weights(TRAIN, ROLL, MASK, cap=0)
