"""The trust region on ReCo's variance ratio c (``LossConfig.c_trust``), in fp64.

Hand values: a near-certain token that lost a little probability (p° = 0.998 -> p = 0.98) has
c = p(1-p) / (p°(1-p°)) = 9.82 while r = 0.982 stays inside the PPO clip. The per-token
coefficient ``d loss / d log p`` (one token, w = 1, N = 1) is ``-c A`` in the plain form,
``-min(c, 1 + eps_c) A`` with the trust region, 0 where the update would raise c further
(A (1 - 2p) > 0), and ``-min(c, c_max) A`` with a plain value cap. Closed forms to rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reco_megatron.algo import (
    PRESETS,
    LossConfig,
    TokenStats,
    aggregate,
    c_growth,
    group_advantages,
    policy_loss,
    response_weights,
)

F64 = torch.float64
EXACT = {"rtol": 1e-12, "atol": 1e-14}


def _coef(cfg: LossConfig, p_old: float, p: float, adv: float) -> tuple[float, dict]:
    """d loss / d log p of one token with w = 1 (token-mean over one token: N = 1)."""
    logp = torch.tensor([[math.log(p)]], dtype=F64, requires_grad=True)
    loss, metrics = policy_loss(
        logp,
        torch.tensor([[math.log(p_old)]], dtype=F64),
        torch.tensor([adv], dtype=F64),
        torch.ones(1, 1),
        cfg,
        weights=torch.ones(1, dtype=F64),
    )
    loss.backward()
    return float(logp.grad), metrics


C = 0.98 * 0.02 / (0.998 * 0.002)  # 9.8196...


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param(dict(c_trust=False), {-1.0: C, 1.0: -C}, id="plain"),
        pytest.param({}, {-1.0: 0.0, 1.0: -1.28}, id="trust-region"),
        pytest.param(dict(c_trust=False, c_max=1.28), {-1.0: 1.28, 1.0: -1.28}, id="value-cap"),
        pytest.param(dict(c_trust_eps=0.5), {-1.0: 0.0, 1.0: -1.5}, id="trust-region-eps0.5"),
    ],
)
def test_near_certain_token_hand_values(overrides: dict, expected: dict) -> None:
    assert abs(C - 9.8196) < 1e-4
    cfg = LossConfig.preset("reco", eps_high=0.28, kl_coef=0.0, **overrides)
    for adv, coef in expected.items():
        got, metrics = _coef(cfg, 0.998, 0.98, adv)
        assert got == pytest.approx(coef, rel=1e-12, abs=1e-14), (adv, got)
        # the raw c is logged whatever bounds the coefficient
        assert float(metrics["token_ratio_max/max"]) == pytest.approx(C, rel=1e-6)
        assert float(metrics["clip_frac/mean"]) == 0.0  # r = 0.982: the PPO clip sees nothing
        if cfg.c_trust:
            assert float(metrics["clip_frac_c/mean"]) == (1.0 if coef == 0.0 else 0.0)
        else:
            assert "clip_frac_c/mean" not in metrics


def test_open_token_unchanged() -> None:
    """p° = 0.3 -> p = 0.45: c = 1.18 < 1.28, the trust region leaves it alone; r = 1.5
    is clipped by PPO for A > 0 in every form."""
    c = 0.45 * 0.55 / (0.3 * 0.7)
    coefs = []
    for overrides in (dict(c_trust=False), {}, dict(c_trust=False, c_max=1.28)):
        cfg = LossConfig.preset("reco", eps_high=0.28, kl_coef=0.0, **overrides)
        coefs.append([_coef(cfg, 0.3, 0.45, a)[0] for a in (-1.0, 1.0)])
    assert coefs[0] == pytest.approx([c, 0.0], rel=1e-12)
    assert coefs[1] == coefs[0] == coefs[2]


def test_c_trust_bound_and_validation() -> None:
    assert LossConfig.preset("reco").c_trust_bound == pytest.approx(1.2)  # eps_high 0.2
    assert LossConfig.preset("reco", eps_high=0.28).c_trust_bound == pytest.approx(1.28)
    assert LossConfig.preset("reco", c_trust_eps=0.1).c_trust_bound == pytest.approx(1.1)
    assert LossConfig.preset("reco_token_only").c_trust_bound == pytest.approx(1.2)
    for name in ("reco_plain", "reco_response_only", "grpo", "dapo", "cispo"):
        assert LossConfig.preset(name).c_trust_bound is None, name
    # the importance ratio is bounded by the PPO clip: the option has nothing to act on
    assert LossConfig.preset("reco", token_ratio="importance").c_trust_bound is None
    for bad in (0.0, -0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="c_trust_eps must be a finite number > 0"):
            LossConfig.preset("reco", c_trust_eps=bad)


def test_categorical_growth_direction_fp64() -> None:
    """d log V / d log p_y with the other tokens keeping their shares of 1 - p_y, by central
    finite differences, has the sign of S - p_y (S = sum p^2) and the closed form
    2 p (S - p) / ((1 - p)(1 - S)); with two outcomes it is the Bernoulli (1 - 2p)/(1 - p)."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)  # shares of the other tokens
    for p in (0.02, 0.2, 0.35, 0.6, 0.9, 0.995):

        def log_v(log_p: float) -> float:
            py = math.exp(log_p)
            probs = torch.cat([torch.tensor([py], dtype=F64), (1 - py) * q])
            return math.log(1.0 - float((probs**2).sum()))

        h = 1e-6
        fd = (log_v(math.log(p) + h) - log_v(math.log(p) - h)) / (2 * h)
        s = p * p + (1 - p) ** 2 * float((q**2).sum())
        closed = 2 * p * (s - p) / ((1 - p) * (1 - s))
        assert fd == pytest.approx(closed, rel=1e-6, abs=1e-8)
        growth = c_growth(
            torch.tensor([[math.log(p)]], dtype=F64), "categorical", torch.tensor([[s]], dtype=F64)
        )
        assert float(growth) == pytest.approx(s - p, rel=1e-12)
        assert (fd > 0) == (float(growth) > 0)
        # two outcomes: S - p = (1 - p)(1 - 2p), the Bernoulli direction
        s2 = p * p + (1 - p) ** 2
        bern = float(c_growth(torch.tensor([[math.log(p)]], dtype=F64), "bernoulli"))
        assert s2 - p == pytest.approx((1 - p) * bern, rel=1e-9, abs=1e-15)
    with pytest.raises(ValueError, match="needs sum_p2"):
        c_growth(torch.zeros(1, 1, dtype=F64), "categorical")
    with pytest.raises(ValueError, match="variance ratios"):
        c_growth(torch.zeros(1, 1, dtype=F64), "importance")


def test_categorical_trust_region_hand_values() -> None:
    """A peaked next-token distribution that flattened a little: V° = 1 - 0.9604 = 0.0396,
    V = 1 - 0.81 = 0.19, c = 4.80; the sampled token (p° = 0.98 -> p = 0.9) has
    S - p = -0.09 < 0, so A < 0 (pushing p further down) would raise c: dropped; A > 0
    gets the coefficient -1.28."""
    s_old, s_new = 0.9604, 0.81
    c = (1 - s_new) / (1 - s_old)
    p_old, p = 0.98, 0.9
    for c_trust, expected in ((False, {-1.0: c, 1.0: -c}), (True, {-1.0: 0.0, 1.0: -1.28})):
        cfg = LossConfig.preset(
            "reco", eps_high=0.28, kl_coef=0.0, token_ratio="categorical", c_trust=c_trust
        )
        for adv, coef in expected.items():
            logp = torch.tensor([[math.log(p)]], dtype=F64, requires_grad=True)
            lp_old = torch.tensor([[math.log(p_old)]], dtype=F64)
            ent = torch.zeros(1, 1, dtype=F64)
            loss, _ = policy_loss(
                logp,
                lp_old,
                torch.tensor([adv], dtype=F64),
                torch.ones(1, 1),
                cfg,
                weights=torch.ones(1, dtype=F64),
                stats=TokenStats(logp, ent, torch.tensor([[s_new]], dtype=F64)),
                stats_old=TokenStats(lp_old, ent, torch.tensor([[s_old]], dtype=F64)),
            )
            loss.backward()
            assert float(logp.grad) == pytest.approx(coef, rel=1e-12, abs=1e-14)


LOGP = st.floats(min_value=-12.0, max_value=-1e-6)


@settings(max_examples=40, deadline=None)
@given(
    lp=st.lists(st.tuples(LOGP, LOGP), min_size=6, max_size=6),
    adv=st.lists(st.sampled_from([-2.0, -1.0, -0.3, 0.0, 0.4, 1.0, 2.5]), min_size=3, max_size=3),
    eps_c=st.sampled_from([0.05, 0.2, 0.28, 1.0]),
)
@example(  # near-certain tokens, where the probability clamp binds (once failed on CI)
    lp=[(-1e-6, -0.1), (-0.5, -1e-6), (-1e-6, -0.05), (-2.0, -1e-6), (-1e-6, -0.2), (-1.0, -1.0)],
    adv=[1.0, -1.0, 0.4],
    eps_c=0.28,
)
def test_mask_and_bound_properties(lp: list, adv: list, eps_c: float) -> None:
    """Bernoulli, fp64: a token is dropped by the trust region only where c > 1 + eps_c and
    A (1 - 2p) > 0; every token's coefficient |d loss / d log p| / |w A| is <= 1 + eps_c; the
    kept tokens' coefficient is min(c, 1 + eps_c) or 0 where the PPO mask fires."""
    logp = torch.tensor([x[0] for x in lp], dtype=F64).view(3, 2)
    logp_old = torch.tensor([x[1] for x in lp], dtype=F64).view(3, 2)
    a = torch.tensor(adv, dtype=F64)
    w = torch.tensor([0.3, 1.0, 0.7], dtype=F64)
    cfg = LossConfig.preset("reco", eps_high=0.28, kl_coef=0.0, c_trust_eps=eps_c)
    plain = LossConfig.preset("reco", eps_high=0.28, kl_coef=0.0, c_trust=False, c_max=1e9)
    grads, metrics = [], []
    for c_ in (cfg, plain):
        x = logp.clone().requires_grad_()
        loss, m = policy_loss(x, logp_old, a, torch.ones(3, 2), c_, weights=w)
        loss.backward()
        grads.append(x.grad * 6)  # token-mean over 6 tokens
        metrics.append(m)
    coef = grads[0] / -(w * a).unsqueeze(1)
    c_plain = grads[1] / -(w * a).unsqueeze(1)  # c where PPO keeps the token, else 0
    p = logp.exp()
    # The spec clamps p and 1 - p to [prob_eps, 1 - prob_eps]: at log p = -1e-6, 1 - p is
    # 9.999995e-7 and the clamp makes it 1e-6 (a 5e-7 relative change, far above rtol).
    eps = cfg.prob_eps

    def variance(lp: torch.Tensor) -> torch.Tensor:
        return lp.exp().clamp(eps, 1 - eps) * (-torch.expm1(lp)).clamp(eps, 1 - eps)

    c = variance(logp) / variance(logp_old)
    grows = a.unsqueeze(1) * (1 - 2 * p) > 0
    ppo_kept = c_plain != 0
    live = (a != 0).unsqueeze(1).expand(3, 2)
    expected = torch.where(
        ppo_kept & ~((c > 1 + eps_c) & grows), c.clamp(max=1 + eps_c), torch.zeros_like(c)
    )
    torch.testing.assert_close(coef[live], expected[live], rtol=1e-9, atol=1e-12)
    assert bool((coef[live].abs() <= 1 + eps_c + 1e-12).all())
    dropped = ppo_kept & (coef == 0) & live
    assert bool(((c > 1 + eps_c) & grows)[dropped].all())
    n_c = int(((c > 1 + eps_c) & grows).sum())
    assert float(metrics[0]["clip_frac_c/mean"]) * 6 == pytest.approx(n_c)


def test_at_old_policy_every_preset_is_reinforce() -> None:
    """theta = theta_old: r = c = 1 on every token, no clip fires, the KL to a reference equal
    to the old policy has zero gradient, so every preset's gradient is that of the weighted
    REINFORCE loss ``aggregate(-w A log p)``: -w A / N per token for token-mean."""
    g = torch.Generator().manual_seed(5)
    b, t, group = 8, 5, 4
    logp_old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    mask = (torch.rand(b, t, generator=g) > 0.2).long()
    adv = torch.randn(b, generator=g, dtype=F64)
    s2 = torch.rand(b, t, generator=g, dtype=F64) * 0.5
    for name in sorted(PRESETS):
        cfg = LossConfig.preset(name, loss_normalizer=float(t))
        w = response_weights(logp_old, mask, group, cfg.response_weight).double()
        x = logp_old.clone().requires_grad_()
        stats = TokenStats(x, torch.zeros_like(x), s2)
        loss, _ = policy_loss(
            x,
            logp_old,
            adv,
            mask,
            cfg,
            weights=None if cfg.response_weight == "none" else w,
            stats=stats,
            stats_old=TokenStats(logp_old, torch.zeros_like(x), s2),
            ref_logp=logp_old,
        )
        loss.backward()
        y = logp_old.clone().requires_grad_()
        wa = (w if cfg.response_weight != "none" else torch.ones_like(w)) * adv
        ref = aggregate(
            -wa.unsqueeze(1) * y, mask, cfg.aggregation, loss_normalizer=cfg.loss_normalizer
        )
        ref.backward()
        torch.testing.assert_close(x.grad, y.grad, **EXACT, msg=name)


def _shared_token_run(cfg: LossConfig, steps: int = 30) -> tuple[list[float], list[float]]:
    """The collapse's mechanism in miniature: one position whose format token (p = 0.998) all
    G = 8 responses share; 6 frequent correct responses with weight 0.25, 2 rare wrong ones
    with weight 1, so ``sum_i w_i A_i < 0`` pushes the shared token down. ``steps`` Adam
    updates on this one rollout batch (theta_old fixed). Returns p of the shared token and
    the raw c after each update."""
    z = torch.tensor([math.log(0.998), math.log(0.001), math.log(0.001)], dtype=F64)
    z.requires_grad_()
    opt = torch.optim.Adam([z], lr=0.05)
    g = 8
    adv = group_advantages(torch.tensor([1.0] * 6 + [0.0] * 2, dtype=F64), g, "grpo")[0]
    w = torch.tensor([0.25] * 6 + [1.0] * 2, dtype=F64)
    assert float((w * adv).sum()) < 0  # the group no longer cancels on the shared token
    lp_old = torch.log_softmax(z.detach(), 0)[0].expand(g, 1).clone()
    ps, cs = [], []
    for _ in range(steps):
        opt.zero_grad()
        lp = torch.log_softmax(z, 0)[0].expand(g, 1)
        loss, metrics = policy_loss(lp, lp_old, adv, torch.ones(g, 1), cfg, weights=w)
        loss.backward()
        opt.step()
        ps.append(float(torch.softmax(z.detach(), 0)[0]))
        cs.append(float(metrics["token_ratio_max/max"]))
    return ps, cs


def test_shared_format_token_is_not_pushed_out() -> None:
    """Plain form: the group pushes its shared near-certain token down update after update,
    c grows past 10 (0.998 -> ~0.95 in 30 updates); a value cap at 1.28 changes the push's
    size, not its direction, and Adam normalises the size away; the trust region stops the
    push once c leaves [.., 1.28] (the wrong responses' terms are masked, the right ones pull
    back): p stays above 0.996."""
    plain = _shared_token_run(LossConfig.preset("reco", eps_high=0.28, kl_coef=0.0, c_trust=False))
    cap = _shared_token_run(
        LossConfig.preset("reco", eps_high=0.28, kl_coef=0.0, c_trust=False, c_max=1.28)
    )
    trust = _shared_token_run(LossConfig.preset("reco", eps_high=0.28, kl_coef=0.0))
    assert plain[0][-1] < 0.96 and max(plain[1]) > 10.0
    assert cap[0][-1] < 0.96 and max(cap[1]) > 10.0
    assert min(trust[0]) > 0.996 and max(trust[1]) < 1.6
