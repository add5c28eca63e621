"""Stale groups: response weights under the behaviour policy mu, decoupled PPO's TIS factor.

Everything in fp64. Where two computations must agree *exactly* (mu == pi_old) the tests use
``torch.equal``, not a tolerance: colocated runs must not change by a bit. The hand formulas
are written with Python floats, one response at a time, so they share no code with the
vectorised implementation; response weights are returned in fp32, so they agree to one fp32
rounding (relative 2^-24, checked at 2^-23).
"""

from __future__ import annotations

import math

import pytest
import torch

from reco_megatron.algo import (
    LossConfig,
    batch_response_weights,
    check_weight_policy,
    policy_loss,
    weight_logprobs,
)
from reco_megatron.algo.ratios import tis_weights

G = 4
HAND_RTOL = 2.0**-23  # response_weights returns fp32: one rounding of an fp64 value


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """One group of G = 4 short responses (2-4 tokens, right padding, one prompt position).

    Log-probs near 0 (probable tokens) so that ``G mu(o|q) > 1`` and the weights act; mu is
    pi_old moved by up to +-0.3 per token, the way a few steps of staleness move it. Padded
    positions of mu hold -inf and NaN, as an engine may leave them."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor(
        [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.float64
    )
    old = -0.3 * torch.rand(G, 5, generator=gen, dtype=torch.float64)
    mu = (old + 0.3 * (2 * torch.rand(G, 5, generator=gen, dtype=torch.float64) - 1)).clamp(max=0)
    mu = torch.where(mask.bool(), mu, torch.tensor(float("-inf"), dtype=torch.float64))
    mu[1, 4] = float("nan")
    logp = old + 0.3 * torch.randn(G, 5, generator=gen, dtype=torch.float64)  # theta != old
    adv = torch.tensor([1.0, -0.5, 0.8, -1.3], dtype=torch.float64)
    return {"mask": mask, "old": old, "mu": mu, "logp": logp.clamp(max=-1e-3), "adv": adv}


def _hand_sequence(lp: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """``1 / max(1, G exp(sum_t m log lp))`` per response, in Python floats."""
    out = []
    for i in range(lp.shape[0]):
        s = sum(float(lp[i, t]) for t in range(lp.shape[1]) if mask[i, t] > 0)
        out.append(1.0 / max(1.0, G * math.exp(s)))
    return out


def _hand_prefix(lp: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """``1 / max(1, G exp(sum_{s<=t} m log lp))`` per token, in Python floats."""
    out = []
    for i in range(lp.shape[0]):
        row, s = [], 0.0
        for t in range(lp.shape[1]):
            s += float(lp[i, t]) if mask[i, t] > 0 else 0.0
            row.append(1.0 / max(1.0, G * math.exp(s)))
        out.append(row)
    return out


def _weights(b: dict, mode: str, policy: str) -> torch.Tensor:
    cfg = LossConfig(response_weight=mode)
    return batch_response_weights(
        cfg, b["old"], b["mask"], G, policy=policy, rollout_logprobs=b["mu"]
    )


# ------------------------------------------------------------------ (a), (c): weights from mu
def test_behaviour_sequence_weights_are_the_hand_formula_on_mu() -> None:
    b = _batch()
    got = _weights(b, "sequence", "behaviour")
    want = torch.tensor(_hand_sequence(b["mu"], b["mask"]), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=0, rtol=HAND_RTOL)
    assert torch.isfinite(got).all()  # -inf and NaN at padded positions stay out
    assert (got < 1).any()  # the weights act on this batch
    proximal = _weights(b, "sequence", "proximal")
    want_old = torch.tensor(_hand_sequence(b["old"], b["mask"]), dtype=torch.float64)
    torch.testing.assert_close(proximal.double(), want_old, atol=0, rtol=HAND_RTOL)
    assert not torch.equal(got, proximal)  # mu != pi_old: the policy matters


def test_behaviour_prefix_weights_are_the_hand_formula_on_mu() -> None:
    b = _batch()
    got = _weights(b, "prefix", "behaviour")
    want = torch.tensor(_hand_prefix(b["mu"], b["mask"]), dtype=torch.float64)
    assert got.shape == (G, 5)
    torch.testing.assert_close(got.double(), want, atol=0, rtol=HAND_RTOL)
    assert torch.isfinite(got).all()
    proximal = _weights(b, "prefix", "proximal")
    assert not torch.equal(got, proximal)


def test_behaviour_geometric_weights_read_mu() -> None:
    b = _batch()
    got = _weights(b, "geometric", "behaviour")
    clean = torch.where(b["mask"].bool(), b["mu"], b["old"])  # any finite padding
    from_mu = batch_response_weights(LossConfig(response_weight="geometric"), clean, b["mask"], G)
    assert torch.equal(got, from_mu)
    assert not torch.equal(got, _weights(b, "geometric", "proximal"))


@pytest.mark.parametrize("mode", ["empirical", "prefix_empirical", "none"])
def test_counting_modes_do_not_read_log_probs(mode: str) -> None:
    b = _batch()
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 0, 0], [0, 5, 6, 7, 0], [0, 5, 6, 7, 8]])
    cfg = LossConfig(response_weight=mode)
    beh = batch_response_weights(
        cfg, b["old"], b["mask"], G, policy="behaviour", rollout_logprobs=None, response_ids=ids
    )
    prox = batch_response_weights(cfg, b["old"], b["mask"], G, response_ids=ids)
    assert torch.equal(beh, prox)


def test_weight_logprobs_casts_mu_to_the_old_dtype() -> None:
    b = _batch()
    got = weight_logprobs(b["old"], b["mu"].float(), b["mask"], "behaviour", "sequence")
    assert got.dtype == torch.float64
    assert torch.isfinite(got).all()
    assert torch.equal(got, torch.where(b["mask"].bool(), b["mu"].float().double(), 0.0))
    assert weight_logprobs(b["old"], b["mu"], b["mask"], "proximal", "sequence") is b["old"]


# ------------------------------------------------------------------ (b): mu == pi_old
def _loss_and_grad(b: dict, cfg: LossConfig, weights: torch.Tensor, rollout: torch.Tensor):
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        logp,
        b["old"],
        b["adv"],
        b["mask"],
        cfg,
        weights=weights,
        rollout_logp=rollout if cfg.tis_cap is not None else None,
    )
    loss.backward()
    return loss.detach(), logp.grad, metrics


@pytest.mark.parametrize("objective", ["reco", "ppo_clip"])
@pytest.mark.parametrize("mode", ["sequence", "prefix", "geometric"])
@pytest.mark.parametrize("tis_cap", [None, 2.0], ids=["no_tis", "tis2"])
def test_mu_equal_to_pi_old_gives_the_colocated_loss_bit_for_bit(objective, mode, tis_cap):
    b = _batch()
    mu = b["old"].clone()  # what a colocated engine with no numerical mismatch reports
    token_ratio = "bernoulli" if objective == "reco" else "importance"
    cfg = LossConfig(
        objective=objective, token_ratio=token_ratio, response_weight=mode, tis_cap=tis_cap
    )
    w_prox = batch_response_weights(cfg, b["old"], b["mask"], G, policy="proximal")
    w_beh = batch_response_weights(
        cfg, b["old"], b["mask"], G, policy="behaviour", rollout_logprobs=mu
    )
    assert torch.equal(w_prox, w_beh)
    assert (w_prox < 1).any()  # the weights act, so the comparison means something
    loss_p, grad_p, m_p = _loss_and_grad(b, cfg, w_prox, mu)
    loss_b, grad_b, _ = _loss_and_grad(b, cfg, w_beh, mu)
    assert torch.equal(loss_p, loss_b) and torch.equal(grad_p, grad_b)
    # ... and equal to the loss without any TIS factor: the weight is exactly 1.
    colocated = LossConfig(
        objective=objective, token_ratio=token_ratio, response_weight=mode, tis_cap=None
    )
    loss_c, grad_c, _ = _loss_and_grad(b, colocated, w_prox, mu)
    assert torch.equal(loss_p, loss_c) and torch.equal(grad_p, grad_c)
    assert m_p["clip_frac/mean"] > 0  # theta != theta_old: the clip fires on some tokens


# ------------------------------------------------------------------ (d): the TIS weight
@pytest.mark.parametrize("cap", [1.0, 2.0, 5.0])
def test_tis_weight_is_exactly_one_where_mu_equals_pi_old(cap: float) -> None:
    b = _batch()
    w = tis_weights(b["old"], b["old"].clone(), b["mask"], cap)
    assert torch.equal(w, b["mask"])  # 1 on response tokens, 0 on padding


def test_tis_weight_is_pi_old_over_mu_truncated_at_the_cap() -> None:
    b = _batch()
    cap = 1.1
    w = tis_weights(b["old"], b["mu"], b["mask"], cap)
    m = b["mask"].bool()
    ratio = torch.exp(b["old"] - torch.where(m, b["mu"], 0.0))
    truncated = m & (ratio > cap)
    assert truncated.any() and (m & (ratio < cap)).any()
    # exp(log(cap)) is cap up to one rounding of exp and one of log: 1 ulp-scale, rtol 1e-15
    torch.testing.assert_close(w[truncated], torch.full_like(w[truncated], cap), rtol=1e-15, atol=0)
    torch.testing.assert_close(w[m & ~truncated], ratio[m & ~truncated], rtol=1e-15, atol=0)
    assert torch.equal(w[~m], torch.zeros_like(w[~m]))
    # inside policy_loss: the gradient of every token is scaled by that weight (reco at
    # theta == theta_old: d loss / d log p = -w_tis A / N), and the metric counts truncations
    cfg = LossConfig(response_weight="none", tis_cap=cap)
    logp = b["old"].clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, b["old"], b["adv"], b["mask"], cfg, rollout_logp=b["mu"])
    loss.backward()
    want = -w * b["adv"].unsqueeze(1) / b["mask"].sum()
    torch.testing.assert_close(logp.grad, want, atol=1e-15, rtol=0)
    frac = float(truncated.sum() / m.sum())
    assert metrics["tis_clip_frac/mean"].item() == pytest.approx(frac, abs=1e-12)


# ------------------------------------------------------------------ (e), (f): config, errors
def test_bad_response_weight_policy_is_an_error_quoting_it() -> None:
    with pytest.raises(ValueError, match=r"response_weight_policy must be one of .*got 'mu'"):
        LossConfig(response_weight_policy="mu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"once resolved, got 'auto'"):
        check_weight_policy("auto")
    with pytest.raises(ValueError, match=r"tis_cap must be >= 1 or None, got 0.5"):
        LossConfig(tis_cap=0.5)


@pytest.mark.parametrize(
    ("placement", "staleness", "policy", "resolved"),
    [
        ("colocated", None, "auto", "proximal"),
        ("separate", None, "auto", "behaviour"),  # K defaults to 1 with separate placement
        ("separate", 2, "auto", "behaviour"),
        ("separate", 0, "auto", "proximal"),  # synchronous: samples from the current weights
        ("colocated", None, "behaviour", "behaviour"),
        ("separate", 1, "proximal", "proximal"),
    ],
)
def test_auto_resolves_by_placement(placement, staleness, policy, resolved) -> None:
    from reco_megatron.trainer.config import TrainConfig
    from reco_megatron.trainer.rollout_config import RolloutConfig

    tis_cap = 2.0 if placement == "separate" else None  # stale groups need the TIS factor
    cfg = TrainConfig(
        loss=LossConfig(response_weight_policy=policy, tis_cap=tis_cap),
        rollout=RolloutConfig(placement=placement, max_staleness=staleness),
    )
    assert cfg.response_weight_policy == resolved
    assert LossConfig().response_weight_policy == "auto"


def test_behaviour_without_rollout_logprobs_names_the_fix() -> None:
    b = _batch()
    for mode in ("sequence", "prefix", "geometric"):
        with pytest.raises(ValueError, match=r"no rollout_logprobs.*response_weight_policy="):
            batch_response_weights(
                LossConfig(response_weight=mode), b["old"], b["mask"], G, policy="behaviour"
            )
