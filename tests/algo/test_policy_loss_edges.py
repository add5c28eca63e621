"""policy_loss at its edges: exact clip bounds, zero advantages, caps taken from the config,
inputs that only feed metrics, the dtype of the loss, and rows or batches with no tokens.

fp64 throughout except where a dtype is the point. Ratios that sit exactly on a bound are
built as ``exp(0 - (-log x))`` with x in {0.5, 1.5, 2}, which fp64 returns as x exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from reco_megatron.algo import LossConfig, TokenStats, policy_loss
from reco_megatron.algo.policy_loss import c_growth

F64 = torch.float64


def _ratio_rows(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``logp = 0`` and ``logp_old = -log r`` per token: one row, ratio r exactly."""
    logp = torch.zeros(1, len(ratios), dtype=F64, requires_grad=True)
    return logp, torch.tensor([[-math.log(r) for r in ratios]], dtype=F64)


def _loss(cfg: LossConfig, logp, logp_old, adv, mask=None, **kw):
    mask = torch.ones(logp.shape) if mask is None else mask
    return policy_loss(logp, logp_old, torch.tensor(adv, dtype=F64), mask, cfg, **kw)


# ---- the PPO clip: strict bounds, and only in the advantage's direction ----------------------


def test_a_ratio_exactly_on_a_clip_bound_is_not_clipped() -> None:
    """The clip fires strictly beyond its bound (``r > 1 + eps_high``, ``r < 1 - eps_low``,
    ``r > dual_clip_c``): on the bound clip(r) = r, the two PPO terms agree and the token keeps
    its gradient, so no clip fraction counts it. Ratios 2 (eps_high 1), 0.5 (eps_low 0.5) and
    1.5 (dual_clip_c 1.5) sit exactly on their bounds."""
    cfg = LossConfig.preset("grpo", kl_coef=0.0, eps_high=1.0, eps_low=0.5, dual_clip_c=1.5)
    for ratio, adv in ((2.0, 1.0), (0.5, -1.0), (1.5, -1.0)):
        logp, logp_old = _ratio_rows([ratio])
        _, m = _loss(cfg, logp, logp_old, [adv])
        assert m["clip_frac/mean"].item() == 0.0, ratio
        assert m["clip_frac_dual/mean"].item() == 0.0, ratio
    # just beyond each bound the clip does count (the ratios are built the same way)
    for ratio, adv, key in ((2.001, 1.0, "clip_frac_high"), (0.499, -1.0, "clip_frac_low")):
        logp, logp_old = _ratio_rows([ratio])
        assert _loss(cfg, logp, logp_old, [adv])[1][f"{key}/mean"].item() == 1.0, ratio


def test_a_zero_advantage_is_never_clipped() -> None:
    """The clip acts in the advantage's direction; A = 0 has none, whatever the ratio: ratios
    far above 1 + eps_high and dual_clip_c and far below 1 - eps_low count as unclipped."""
    cfg = LossConfig.preset("grpo", kl_coef=0.0, dual_clip_c=3.0)
    logp, logp_old = _ratio_rows([10.0, 0.01])
    loss, m = _loss(cfg, logp, logp_old, [0.0])
    for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "clip_frac_dual"):
        assert m[f"{key}/mean"].item() == 0.0, key
    assert loss.item() == 0.0


# ---- the config's caps reach the functions that apply them ----------------------------------


def test_the_importance_ratio_is_clamped_at_the_configured_max_log_ratio() -> None:
    """``max_log_ratio`` = 1: a log-ratio of 3 gives r = e, in the ratio metric and, with the
    importance token ratio, as reco's coefficient c (A < 0: no clip fires upwards)."""
    cfg = LossConfig.preset(
        "reco", response_weight="none", token_ratio="importance", c_trust=False, max_log_ratio=1.0
    )
    logp = torch.full((1, 1), -0.5, dtype=F64, requires_grad=True)
    loss, m = _loss(cfg, logp, torch.full((1, 1), -3.5, dtype=F64), [-1.0])
    assert m["ratio_max/max"].item() == pytest.approx(math.e, rel=1e-6)
    assert m["token_ratio_max/max"].item() == pytest.approx(math.e, rel=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(math.e, rel=1e-12)  # d(-c A log p) = -c A = e


def test_the_bernoulli_ratio_uses_the_configured_prob_eps() -> None:
    """``prob_eps`` = 0.01 clamps p and 1 - p of a near-certain token (p = 1 - 1e-9) to
    [0.01, 0.99]: c = 0.99 * 0.01 / (0.5 * 0.5) (the default 1e-6 would give ~4e-9)."""
    cfg = LossConfig.preset("reco", response_weight="none", c_trust=False, prob_eps=0.01)
    logp = torch.full((1, 1), -1e-9, dtype=F64, requires_grad=True)
    _, m = _loss(cfg, logp, torch.full((1, 1), math.log(0.5), dtype=F64), [-1.0])
    assert m["token_ratio_max/max"].item() == pytest.approx(0.99 * 0.01 / 0.25, rel=1e-6)


# ---- the trust region on c -------------------------------------------------------------------


def _categorical(sum_p2: float, sum_p2_old: float, logp: float, adv: float, bound_eps: float):
    cfg = LossConfig.preset(
        "reco", response_weight="none", token_ratio="categorical", c_trust_eps=bound_eps
    )
    lp = torch.full((1, 1), logp, dtype=F64, requires_grad=True)
    z = torch.zeros(1, 1, dtype=F64)
    stats = TokenStats(logprob=z, entropy=z, sum_p2=torch.full((1, 1), sum_p2, dtype=F64))
    old = TokenStats(logprob=z, entropy=z, sum_p2=torch.full((1, 1), sum_p2_old, dtype=F64))
    loss, m = _loss(cfg, lp, lp.detach(), [adv], stats=stats, stats_old=old)
    loss.backward()
    return lp.grad.item(), m


def test_a_variance_ratio_exactly_on_the_trust_bound_keeps_its_token() -> None:
    """c = (1 - 0.5) / (1 - 0.75) = 2 exactly, bound 1 + 1: the token is dropped only where
    c > bound, so it keeps the coefficient min(c, bound) = 2 (p = 0.1 < S = 0.5, A > 0: the
    update would raise c, which is what drops it once c is beyond the bound)."""
    grad, m = _categorical(0.5, 0.75, math.log(0.1), 1.0, 1.0)
    assert m["clip_frac_c/mean"].item() == 0.0
    assert grad == pytest.approx(-2.0, rel=1e-12)
    grad, m = _categorical(0.49, 0.75, math.log(0.1), 1.0, 1.0)  # c = 2.04: dropped
    assert (m["clip_frac_c/mean"].item(), grad) == (1.0, 0.0)


def test_a_token_whose_update_leaves_c_unchanged_is_not_dropped() -> None:
    """Bernoulli at p = 1/2, the variance's maximum: d c / d p = 0 (``c_growth`` = 1 - 2p = 0),
    so raising p cannot raise c and the trust region keeps the token with c = 1.026 beyond the
    bound 1 + 0.01, at the coefficient min(c, 1.01). (r = 0.5 / 0.42 = 1.19 stays inside the
    PPO clip, A > 0.)"""
    cfg = LossConfig.preset("reco", response_weight="none", c_trust_eps=0.01)
    logp = torch.full((1, 1), math.log(0.5), dtype=F64, requires_grad=True)
    p_old = 0.42
    loss, m = _loss(cfg, logp, torch.full((1, 1), math.log(p_old), dtype=F64), [1.0])
    assert c_growth(logp, "bernoulli").item() == 0.0
    assert m["token_ratio_max/max"].item() == pytest.approx(0.25 / (p_old * (1 - p_old)))
    assert m["clip_frac_c/mean"].item() == 0.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.01, rel=1e-12)


def test_c_growth_has_the_dtype_of_logp() -> None:
    """A detached [B, T] direction in logp's dtype, whatever the statistics' dtype."""
    got = c_growth(torch.zeros(1, 2), "categorical", torch.full((1, 2), 0.5, dtype=F64))
    assert got.dtype == torch.float32


# ---- the KL term -----------------------------------------------------------------------------


def test_the_k3_log_ratio_is_clamped_both_ways_at_max_log_ratio() -> None:
    """k3 = exp(d) - d - 1 with d = log p_ref - log p clamped to ±max_log_ratio (2 here), so
    a reference far above or below the policy gives a finite, bounded KL."""
    cfg = LossConfig.preset("grpo", kl_coef=0.1, max_log_ratio=2.0)
    logp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    ref = torch.tensor([[5.0, -5.0]], dtype=F64)
    _, m = _loss(cfg, logp, logp.detach(), [1.0], ref_logp=ref)
    expected = ((math.exp(2.0) - 3.0) + (math.exp(-2.0) + 1.0)) / 2
    assert m["kl_ref/mean"].item() == pytest.approx(expected, rel=1e-6)  # metrics are fp32


def test_the_kl_clamp_bounds_k1_from_below_too() -> None:
    """k1 = log p - log p_ref can be negative; ``kl_clamp`` = 1 bounds it to [-1, 1]."""
    cfg = LossConfig.preset("grpo", kl_coef=0.1, kl_estimator="k1", kl_clamp=1.0)
    logp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    ref = torch.tensor([[5.0, -5.0]], dtype=F64)
    _, m = _loss(cfg, logp, logp.detach(), [1.0], ref_logp=ref)
    assert m["kl_ref/mean"].item() == 0.0  # (-1 + 1) / 2


# ---- inputs that feed only metrics -----------------------------------------------------------


def test_metric_only_inputs_do_not_reach_the_loss() -> None:
    """With ``kl_coef = 0``, ``entropy_coef = 0`` and no ``tis_cap``, the reference log-probs,
    the token statistics and the engine's log-probs are read for metrics only: NaN or -inf in
    them leaves the loss and its gradient exactly as without them (0 * NaN would not)."""
    cfg = LossConfig.preset("grpo", kl_coef=0.0, kl_estimator="k1")
    logp_old = torch.log(torch.tensor([[0.5, 0.25]], dtype=F64))
    bad = torch.tensor([[float("nan"), -float("inf")]], dtype=F64)
    stats = TokenStats(logprob=bad, entropy=bad, sum_p2=bad)
    results = []
    for kw in ({}, {"ref_logp": bad, "stats": stats, "rollout_logp": bad}):
        logp = torch.log(torch.tensor([[0.6, 0.2]], dtype=F64)).requires_grad_()
        loss, m = _loss(cfg, logp, logp_old, [1.0], **kw)
        loss.backward()
        results.append((loss.item(), logp.grad.clone()))
        assert "tis_weight/mean" not in m  # the engine's log-probs are unused without a cap
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


# ---- the loss's dtype ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_is_computed_in_the_dtype_of_logp(dtype: torch.dtype) -> None:
    """Every other input is cast to logp's dtype: fp32 or bf16 log-probs with fp64 old
    log-probs, advantages, weights, reference, statistics and engine log-probs give a loss and
    gradient in logp's dtype (a loss promoted to fp64, or the fp32 TIS weights, would not)."""
    cfg = LossConfig.preset("reco", kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)
    logp = torch.log(torch.tensor([[0.6, 0.2]])).to(dtype).requires_grad_()
    d = torch.log(torch.tensor([[0.5, 0.25]], dtype=F64))
    stats = TokenStats(logprob=d, entropy=-d, sum_p2=d.exp())
    loss, _ = policy_loss(
        logp,
        d,
        torch.ones(1, dtype=F64),
        torch.ones(1, 2, dtype=F64),
        cfg,
        weights=torch.full((1,), 0.5, dtype=F64),
        stats=stats,
        ref_logp=d,
        rollout_logp=d - 0.1,
    )
    loss.backward()
    assert loss.dtype == dtype
    assert logp.grad is not None and logp.grad.dtype == dtype


# ---- rows and batches without tokens ---------------------------------------------------------


def test_the_sequence_count_is_the_number_of_rows() -> None:
    """``num_seqs/sum`` counts rows (B = 3), not positions (T = 2)."""
    cfg = LossConfig.preset("grpo", kl_coef=0.0)
    logp = torch.zeros(3, 2, dtype=F64, requires_grad=True)
    _, m = _loss(cfg, logp, logp.detach(), [1.0, 0.0, -1.0])
    assert m["num_seqs/sum"].item() == 3.0
    assert m["num_tokens/sum"].item() == 6.0


@pytest.mark.parametrize("preset", ["grpo", "reco_token_only", "cispo"])
def test_an_all_masked_batch_gives_zero_loss_and_gradient(preset: str) -> None:
    """A micro-batch of padding only (-inf log-probs there): loss 0, gradient 0, no NaN in
    any metric (every mean is over no tokens: 0)."""
    cfg = LossConfig.preset(preset, kl_coef=0.0)
    logp = torch.full((2, 3), -float("inf"), dtype=F64, requires_grad=True)
    loss, m = _loss(cfg, logp, logp.detach(), [1.0, -1.0], mask=torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(2, 3, dtype=F64))
    assert all(math.isfinite(v.item()) for v in m.values()), m
