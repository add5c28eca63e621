"""Truncated importance sampling of the train/inference mismatch inside ``policy_loss``."""

import math

import pytest
import torch

from reco_megatron.algo import LossConfig, policy_loss


def test_tis_scales_the_policy_gradient_per_token_and_is_capped() -> None:
    # fp64: exact. Token 0: p_old/p_rollout = e^0.5 = 1.65 < cap 2 -> weight 1.65;
    # token 1: e^2 = 7.4 > cap -> weight 2; token 2 is padding.
    logp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[-1.5, -4.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    cfg = LossConfig.preset("reco", kl_coef=0.0, response_weight="none", tis_cap=2.0)
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask, cfg, rollout_logp=rollout)
    loss.backward()
    # reco at theta == theta_old: c = 1, d loss / d logp = -w_tis * A / N_tokens.
    expected = torch.tensor([[-math.exp(0.5) / 2, -2.0 / 2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)
    assert metrics["tis_clip_frac/mean"] == pytest.approx(0.5)


def test_tis_needs_rollout_logprobs_and_a_positive_cap() -> None:
    cfg = LossConfig.preset("reco", kl_coef=0.0, response_weight="none", tis_cap=2.0)
    x = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(x, x.detach(), torch.ones(1), torch.ones(1, 2), cfg)
    with pytest.raises(ValueError, match="tis_cap must be a finite number > 0"):
        LossConfig(tis_cap=0.0)


def test_a_bf16_weight_just_below_the_cap_is_not_counted_as_capped() -> None:
    """``tis_clip_frac`` counts the tokens whose weight the cap set. In bf16 a weight of
    e^0.2578 = 1.294 (below the cap 1.3) rounds to 1.296875, the bf16 value of the cap itself,
    so the fraction must be decided on the fp32 weights, before the cast; the weight the loss
    applies stays the bf16 one. Token 1 (e^2) is capped, token 0 is not: 1/2."""
    logp = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    rollout = torch.tensor([[-0.2578125, -2.0]], dtype=torch.bfloat16)  # exact in bf16
    cfg = LossConfig.preset("grpo", kl_coef=0.0, tis_cap=1.3)
    _, metrics = policy_loss(
        logp, logp.detach(), torch.ones(1), torch.ones(1, 2), cfg, rollout_logp=rollout
    )
    assert metrics["tis_clip_frac/mean"].item() == 0.5
    # the mean weight is that of the bf16 weights the loss used: (1.296875 + 1.296875) / 2
    assert metrics["tis_weight/mean"].item() == pytest.approx(1.296875, abs=1e-6)
