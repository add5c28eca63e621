"""Exact gradients of the losses w.r.t. logp (fp64; rtol 1e-12 since every term is closed-form).

The loss is minimised, so d loss / d logp is minus the policy-gradient coefficient:
reco: -w c A / Z on unclipped tokens, 0 on clipped and padded ones; ppo_clip: -w r A / Z.
"""

import pytest
import torch

from reco_megatron.algo import LossConfig, TokenStats, policy_loss, token_ratio

F64 = torch.float64
EXACT = {"rtol": 1e-12, "atol": 1e-15}
B, T = 6, 7


def _batch(spread: float = 0.5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    logp_old = -torch.rand(B, T, generator=g, dtype=F64) * 3.0
    logp = (logp_old + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    mask = (torch.rand(B, T, generator=g) > 0.2).long()
    adv = torch.randn(B, generator=g, dtype=F64)
    w = torch.rand(B, generator=g, dtype=F64) + 0.1
    s2 = torch.rand(B, T, generator=g, dtype=F64) * 0.9
    s2_old = torch.rand(B, T, generator=g, dtype=F64) * 0.9
    return dict(logp=logp, logp_old=logp_old, mask=mask, adv=adv, w=w, s2=s2, s2_old=s2_old)


def _grad(cfg: LossConfig, d: dict, logp: torch.Tensor | None = None) -> torch.Tensor:
    lp = (d["logp"] if logp is None else logp).clone().requires_grad_()
    zeros = torch.zeros(B, T, dtype=F64)
    stats = TokenStats(lp.detach(), zeros, d["s2"])
    stats_old = TokenStats(d["logp_old"], zeros, d["s2_old"])
    loss, _ = policy_loss(
        lp,
        d["logp_old"],
        d["adv"],
        d["mask"],
        cfg,
        weights=d["w"],
        stats=stats,
        stats_old=stats_old,
    )
    loss.backward()
    return lp.grad


def _clipped(d: dict, logp: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    r = torch.exp(logp - d["logp_old"])
    a = d["adv"].unsqueeze(1)
    return ((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 1 - eps_low))


@pytest.mark.parametrize("ratio_mode", ["bernoulli", "categorical", "importance"])
def test_reco_gradient_is_w_c_a(ratio_mode: str) -> None:
    d = _batch()
    # the paper's plain form (the trust region on c: tests/algo/test_c_trust.py)
    cfg = LossConfig(
        objective="reco", token_ratio=ratio_mode, response_weight="sequence", c_trust=False
    )
    grad = _grad(cfg, d)
    c = token_ratio(
        d["logp"], d["logp_old"], ratio_mode, sum_p2=d["s2"], sum_p2_old=d["s2_old"]
    ).ratio.detach()
    z = d["mask"].sum()
    clipped = _clipped(d, d["logp"], cfg.eps_low, cfg.eps_high)
    assert clipped[d["mask"].bool()].any() and not clipped[d["mask"].bool()].all()
    keep = d["mask"].bool() & ~clipped
    expected = torch.where(keep, -d["w"][:, None] * c * d["adv"][:, None] / z, 0.0)
    torch.testing.assert_close(grad, expected, **EXACT)


@pytest.mark.parametrize("ratio_mode", ["bernoulli", "categorical"])
def test_reco_at_old_policy_is_weighted_reinforce(ratio_mode: str) -> None:
    # theta == theta_old: c == 1, r == 1, nothing clipped -> gradient -w A / Z on every token.
    d = _batch()
    d["s2"] = d["s2_old"]
    cfg = LossConfig(objective="reco", token_ratio=ratio_mode)
    grad = _grad(cfg, d, logp=d["logp_old"])
    expected = torch.where(
        d["mask"].bool(), -d["w"][:, None] * d["adv"][:, None] / d["mask"].sum(), 0.0
    )
    torch.testing.assert_close(grad, expected, **EXACT)


def test_ppo_clip_matches_textbook_gradient() -> None:
    d = _batch()
    cfg = LossConfig(objective="ppo_clip", token_ratio="importance", response_weight="sequence")
    grad = _grad(cfg, d)
    r = torch.exp(d["logp"] - d["logp_old"])
    clipped = _clipped(d, d["logp"], 0.2, 0.2)
    keep = d["mask"].bool() & ~clipped
    # d/dlogp of -min(rA, clip(r)A) = -r A where unclipped, 0 where clipped.
    expected = torch.where(keep, -d["w"][:, None] * r * d["adv"][:, None] / d["mask"].sum(), 0.0)
    torch.testing.assert_close(grad, expected, **EXACT)


@pytest.mark.parametrize("dual_clip_c", [None, 1.5])
def test_reco_importance_equals_ppo_clip_gradient(dual_clip_c: float | None) -> None:
    # spread 1.0: some A < 0 tokens have r > 1.5, so the dual clip fires (checked below).
    d = _batch(spread=1.0)
    kw = dict(token_ratio="importance", dual_clip_c=dual_clip_c)
    g_ppo = _grad(LossConfig(objective="ppo_clip", **kw), d)
    g_reco = _grad(LossConfig(objective="reco", **kw), d)
    torch.testing.assert_close(g_reco, g_ppo, **EXACT)
    r = torch.exp(d["logp"] - d["logp_old"])
    dual = d["mask"].bool() & (d["adv"][:, None] < 0) & (r > 1.5)
    assert dual.any()
    assert (g_ppo[dual] == 0).all() == (dual_clip_c is not None)


@pytest.mark.parametrize(
    ("objective", "ratio_mode"),
    [("reco", "bernoulli"), ("reco", "categorical"), ("cispo", "importance")],
)
def test_dual_clip_masks_reco_and_cispo(objective: str, ratio_mode: str) -> None:
    # Exactly the dual-clip tokens (A < 0, r > c) lose their gradient; the others keep it.
    d = _batch(spread=1.0)
    kw = dict(objective=objective, token_ratio=ratio_mode, c_trust=False)  # the dual clip alone
    base = _grad(LossConfig(**kw), d)
    dual = _grad(LossConfig(**kw, dual_clip_c=1.5), d)
    r = torch.exp(d["logp"] - d["logp_old"])
    fired = d["mask"].bool() & (d["adv"][:, None] < 0) & (r > 1.5)
    assert fired.any() and (base[fired] != 0).all()
    torch.testing.assert_close(dual, torch.where(fired, 0.0, base), **EXACT)


def test_cispo_gradient_never_masks() -> None:
    d = _batch(spread=1.0)
    grad = _grad(LossConfig(objective="cispo", token_ratio="importance"), d)
    r = torch.exp(d["logp"] - d["logp_old"]).clamp(max=1.2)
    coef = -d["w"][:, None] * r * d["adv"][:, None] / d["mask"].sum()
    torch.testing.assert_close(grad, torch.where(d["mask"].bool(), coef, 0.0), **EXACT)
