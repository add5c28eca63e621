"""The per-token ``prefix`` weights in the loss, in fp64: GRPO's cancellation on a prefix the
whole group shares (which the ``sequence`` weight breaks), per-token weights equal to
broadcast per-response ones, and the per-token metrics.

Tolerances: the shared-prefix gradient is ``sum_i w A_i / N`` with equal w, i.e. w times the
fp64 sum of centred advantages, 0 up to ~1e-16 rounding (asserted at 1e-15); gradients of
equal arithmetic are compared at 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch

from reco_megatron.algo import LossConfig, group_advantages, policy_loss, response_weights
from reco_megatron.algo.metrics import weight_metrics

F64 = torch.float64
G = 4
PREFIX = 3


def _shared_prefix_grad(mode: str, preset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """G responses sharing a 3-token prefix of probability 1 under pi_old, then 2 tokens
    each of different probabilities; theta = theta_old. The shared tokens' log-probs are one
    leaf (what one model gives to the same tokens in the same context), so their gradient is
    the group's gradient on them. Returns (gradient on the shared leaf [3], weights)."""
    tail_p = torch.tensor([[0.9, 0.95], [0.7, 0.5], [0.6, 0.4], [0.3, 0.2]], dtype=F64)
    tail_old = tail_p.log()
    shared = torch.zeros(PREFIX, dtype=F64, requires_grad=True)  # log 1
    logp = torch.cat([shared.expand(G, PREFIX), tail_old.clone()], dim=1)
    logp_old = torch.cat([torch.zeros(G, PREFIX, dtype=F64), tail_old], dim=1)
    mask = torch.ones(G, PREFIX + 2)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64), G, "grpo")[0]
    ids = torch.cat([torch.full((G, PREFIX), 7), torch.arange(2 * G).view(G, 2)], dim=1)
    w = response_weights(logp_old, mask, G, mode, response_ids=ids).double()
    cfg = LossConfig.preset(preset, kl_coef=0.0, response_weight=mode)
    loss, _ = policy_loss(logp, logp_old, adv, mask, cfg, weights=w)
    loss.backward()
    return shared.grad, w


@pytest.mark.parametrize("preset", ["reco", "grpo"])
@pytest.mark.parametrize("mode", ["prefix", "prefix_empirical"])
def test_shared_prefix_keeps_grpo_cancellation(mode: str, preset: str) -> None:
    grad, w = _shared_prefix_grad(mode, preset)
    torch.testing.assert_close(w[:, :PREFIX], torch.full((G, PREFIX), 1.0 / G, dtype=F64))
    assert grad.abs().max() < 1e-15, grad


@pytest.mark.parametrize("preset", ["reco", "grpo"])
def test_sequence_weight_breaks_the_cancellation(preset: str) -> None:
    # G pi_old(o_i) = 3.42, 1.4, 0.96, 0.24 -> w = 0.29, 0.71, 1, 1: sum_i w_i A_i != 0 on
    # every shared token (the shared-token effect of docs/loss.md).
    grad, w = _shared_prefix_grad("sequence", preset)
    torch.testing.assert_close(w, torch.tensor([1 / 3.42, 1 / 1.4, 1.0, 1.0], dtype=F64))
    assert (grad.abs() > 1e-3).all(), grad


@pytest.mark.parametrize("preset", ["reco", "grpo", "cispo"])
def test_per_token_weights_equal_broadcast_response_weights(preset: str) -> None:
    gen = torch.Generator().manual_seed(3)
    b, t = 8, 5
    logp_old = -torch.rand(b, t, generator=gen, dtype=F64) * 2
    logp = (logp_old + 0.3 * torch.randn(b, t, generator=gen, dtype=F64)).clamp(max=-1e-3)
    mask = (torch.rand(b, t, generator=gen) > 0.2).long()
    adv = torch.randn(b, generator=gen, dtype=F64)
    w = torch.rand(b, generator=gen, dtype=F64) + 0.2
    cfg = LossConfig.preset(preset, kl_coef=0.0)
    grads, losses = [], []
    for weights in (w, w.unsqueeze(1).expand(b, t)):
        x = logp.clone().requires_grad_()
        loss, _ = policy_loss(x, logp_old, adv, mask, cfg, weights=weights)
        loss.backward()
        losses.append(loss.detach())
        grads.append(x.grad)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


def test_weights_of_a_wrong_shape_name_both_shapes() -> None:
    x = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    with pytest.raises(ValueError, match=r"weights must be \[B\] = \[2\].*\[B, T\] = \[2, 3\]"):
        policy_loss(x, x.detach(), torch.zeros(2), torch.ones(2, 3), LossConfig(), weights=x[:1])


def test_weight_active_per_token_and_per_response() -> None:
    w = torch.tensor([[0.5, 1.0, 1.0], [1.0, 1.0, 0.25], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])  # row 1's 0.25 is padding
    m = weight_metrics(w, mask)
    assert m["weight_active/mean"].item() == pytest.approx(1 / 3)  # row 0 only
    assert m["weight_active_tokens/mean"].item() == pytest.approx(1 / 8)
    assert m["weight_min/min"].item() == 0.5 and m["weight_max/max"].item() == 1.0
    assert m["weight_mean/mean"].item() == pytest.approx(7.5 / 8)
    # a per-response weight acts on every token of its response
    m = weight_metrics(torch.tensor([0.5, 1.0, 1.0]), mask)
    assert m["weight_active/mean"].item() == pytest.approx(1 / 3)
    assert m["weight_active_tokens/mean"].item() == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="need a mask"):
        weight_metrics(w)


def test_prefix_weights_through_the_loss_metrics() -> None:
    # the first token of every response is likely (p = 0.9, G p = 3.6), the rest is not
    lp = torch.tensor([[math.log(0.9), math.log(0.1), math.log(0.1)]] * G, dtype=F64)
    mask = torch.ones(G, 3)
    w = response_weights(lp, mask, G, "prefix").double()
    cfg = LossConfig(response_weight="prefix")
    _, m = policy_loss(
        lp.clone().requires_grad_(), lp, torch.randn(G, dtype=F64), mask, cfg, weights=w
    )
    assert m["weight_active/mean"].item() == 1.0
    assert m["weight_active_tokens/mean"].item() == pytest.approx(1 / 3)
    # the same responses under `sequence`: pi_old = 0.009, G pi < 1 -> weight 1, inactive
    ws = response_weights(lp, mask, G, "sequence").double()
    _, m = policy_loss(
        lp.clone().requires_grad_(), lp, torch.randn(G, dtype=F64), mask, cfg, weights=ws
    )
    assert m["weight_active/mean"].item() == 0.0 and m["weight_active_tokens/mean"].item() == 0.0
