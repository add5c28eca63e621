"""The GRPO-family / ReCo policy loss: a pure function of per-token log-probs.

Run on CPU: ``policy_loss(logp, logp_old, adv, mask, LossConfig.preset("reco"), weights=w)``
with ``logp [B, T]`` requiring grad. The formulas are in ``docs/loss.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reco_megatron.algo.aggregation import aggregate
from reco_megatron.algo.config import LossConfig
from reco_megatron.algo.metrics import masked_mean, quantile_metrics, weight_metrics
from reco_megatron.algo.ratios import importance_ratio, tis_weights, token_ratio
from reco_megatron.algo.token_stats import TokenStats


def c_growth(
    logp: torch.Tensor, token_ratio: str, sum_p2: torch.Tensor | None = None
) -> torch.Tensor:
    """The sign of ``d log c / d log p`` per token (detached, ``[B, T]``): where it is
    positive, raising the sampled token's probability raises the variance ratio c.

    - ``bernoulli``: ``d log c / d log p = (1 - 2p) / (1 - p)``, returned as ``1 - 2p``;
    - ``categorical``: with the other tokens keeping their shares of ``1 - p``
      (``p_v = (1 - p) q_v``), ``d log V / d log p = 2p (S - p) / ((1 - p)(1 - S))`` with
      ``S = sum_v p_v^2`` and ``V = 1 - S``; returned as ``S - p``. With two outcomes
      ``S - p = (1 - p)(1 - 2p)``: the Bernoulli case. Needs ``sum_p2`` (current policy).

    A policy-gradient update moves log p in the direction of the advantage A (the loss
    gradient on log p is ``-c A``), so the update raises c exactly where ``A * c_growth > 0``.
    """
    p = torch.exp(logp.detach())
    if token_ratio == "bernoulli":
        return 1.0 - 2.0 * p
    if token_ratio == "categorical":
        if sum_p2 is None:
            raise ValueError("c_growth for token_ratio='categorical' needs sum_p2 [B, T]")
        return sum_p2.detach().to(p.dtype) - p
    raise ValueError(
        f"c_growth is defined for the variance ratios 'bernoulli' and 'categorical', got "
        f"{token_ratio!r}"
    )


def _check_inputs(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("logp_old", logp_old), ("mask", mask), ("ref_logp", ref_logp)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} must match logp {tuple(logp.shape)}, got {tuple(t.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = [{logp.shape[0]}], got {tuple(advantages.shape)}"
        )
    if weights is not None and weights.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"weights must be [B] = [{logp.shape[0]}] (per response) or [B, T] = "
            f"{list(logp.shape)} (per token, the prefix modes), got {tuple(weights.shape)}"
        )


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    weights: torch.Tensor | None = None,
    stats: TokenStats | None = None,
    stats_old: TokenStats | None = None,
    ref_logp: torch.Tensor | None = None,
    global_num_tokens: float | torch.Tensor | None = None,
    global_num_seqs: float | torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss of one (micro-)batch and its detached metrics.

    Args:
        logp: ``[B, T]`` log p of the sampled tokens under the current policy (with grad).
        logp_old: ``[B, T]`` the same under the old (proximal) policy pi_old (no grad): the
            policy that sampled them, or with stale groups the one the clip is centred on.
        advantages: ``[B]`` per-response advantages (:func:`group_advantages`).
        mask: ``[B, T]`` 1 on response tokens.
        cfg: the loss configuration.
        weights: ``[B]`` response weights or ``[B, T]`` per-token ones (the ``prefix``
            modes) (:func:`response_weights`, computed on complete groups before the split);
            required unless ``cfg.response_weight == "none"``; finite everywhere.
            They multiply the policy term of every objective (not the KL/entropy terms).
        stats, stats_old: :class:`TokenStats` ``[B, T]`` of the current / old policy; ``stats``
            for the entropy bonus and metric, both for ``token_ratio="categorical"``.
        ref_logp: ``[B, T]`` reference-policy log-probs; required when ``cfg.kl_coef > 0``.
        global_num_tokens, global_num_seqs: counts of the whole global batch (see
            :func:`aggregate`); ``None`` means this batch is the whole batch.
        rollout_logp: ``[B, T]`` log-probs reported by the inference engine (the behaviour
            policy mu); required when ``cfg.tis_cap`` is set (truncated importance sampling of
            the mismatch, decoupled PPO's ``min(pi_old / mu, C)`` on every policy term).

    Per-token policy term (``r = p / p_old``, A the advantage, w the weight):
        - ``ppo_clip``: ``w * max(-r A, -clip(r, 1-eps_low, 1+eps_high) A)``, optionally
          ``min(., -dual_clip_c A)`` for A < 0;
        - ``reco``: ``-w sg(c) A log p`` on tokens where the clip does not fire in A's
          direction (not (A > 0 and r > 1+eps_high), not (A < 0 and r < 1-eps_low), not
          (A < 0 and r > dual_clip_c) when set), 0 else; so ``d loss / d log p = -w c A / Z``
          there, with Z the aggregation denominator. With the trust region on c
          (``cfg.c_trust_bound`` = 1 + eps_c not None) the coefficient is ``min(c, 1 + eps_c)``
          and tokens with ``c > 1 + eps_c`` whose update would raise c further
          (``A * c_growth > 0``, :func:`c_growth`) are dropped as well;
        - ``cispo``: ``-w sg(clip(r, 1-cispo_eps_low, 1+cispo_eps_high)) A log p``, 0 where
          A < 0 and r > dual_clip_c (when set).
        plus ``kl_coef * KL_t`` (clamped to ``±kl_clamp`` when set) and ``- entropy_coef * H_t``.

    Returns:
        ``(loss, metrics)``: the scalar loss (this batch's contribution to the global loss)
        and a dict of detached 0-d tensors keyed ``"<name>/<reduction>"``
        (:mod:`reco_megatron.algo.metrics`).
    """
    _check_inputs(logp, logp_old, advantages, mask, weights, ref_logp)
    _check_requirements(cfg, weights, stats, stats_old, ref_logp, rollout_logp)
    t = _tokens(logp, logp_old, advantages, mask, cfg)
    maskb, zeros, lp, lp_old, r = t.mask, t.zeros, t.lp, t.lp_old, t.r
    c_raw: torch.Tensor | None = None
    clip_c: torch.Tensor | None = None  # set where the trust region on c acts
    if cfg.objective == "ppo_clip":
        per_token = _ppo_clip_surrogate(t, cfg)
    elif cfg.objective == "reco":
        per_token, c_raw, clip_c = _reco_surrogate(t, cfg, stats, stats_old)
    else:
        per_token = _cispo_surrogate(t, cfg)
    if weights is not None:
        w = weights.detach().to(logp.dtype)
        per_token = per_token * (w.unsqueeze(1) if w.dim() == 1 else w)
    tis_metrics: dict[str, torch.Tensor] = {}
    if cfg.tis_cap is not None and rollout_logp is not None:
        tis_fp32 = tis_weights(lp_old, rollout_logp, maskb, cfg.tis_cap)  # fp32 at least
        tis = tis_fp32.to(logp.dtype)
        per_token = per_token * tis
        # Where the cap binds the weight is exp(log cap), within an fp32 rounding of the cap;
        # in bf16 a weight 0.4 % below the cap would round onto it, so compare before the cast.
        capped = (tis_fp32 >= cfg.tis_cap * (1 - 1e-6)).float()
        tis_metrics = {
            "tis_weight/mean": masked_mean(tis, maskb),
            "tis_clip_frac/mean": masked_mean(capped, maskb),
        }

    kl_tok: torch.Tensor | None = None
    if ref_logp is not None:
        ref = torch.where(maskb, ref_logp.detach().to(logp.dtype), zeros)
        if cfg.kl_estimator == "k1":
            kl_tok = lp - ref
        else:
            d = (ref - lp).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
            kl_tok = torch.exp(d) - d - 1.0
        if cfg.kl_clamp is not None:
            kl_tok = kl_tok.clamp(-cfg.kl_clamp, cfg.kl_clamp)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl_tok
    entropy: torch.Tensor | None = None
    if stats is not None:
        entropy = torch.where(maskb, stats.entropy.to(logp.dtype), zeros)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * entropy

    loss = aggregate(
        per_token,
        maskb,
        cfg.aggregation,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_normalizer=cfg.loss_normalizer,
    )

    with torch.no_grad():
        metrics = _metrics(maskb, r, lp, lp_old, t.clip_low, t.clip_high, c_raw, weights, kl_tok)
        if cfg.dual_clip_c is not None:
            metrics["clip_frac_dual/mean"] = masked_mean(t.clip_dual.float(), maskb)
        if clip_c is not None:
            metrics["clip_frac_c/mean"] = masked_mean(clip_c.float(), maskb)
        if entropy is not None:
            metrics["entropy/mean"] = masked_mean(entropy, maskb)
        metrics.update(tis_metrics)
        metrics["loss/sum"] = loss.detach().float()
    return loss, metrics


def _check_requirements(
    cfg: LossConfig,
    weights: torch.Tensor | None,
    stats: TokenStats | None,
    stats_old: TokenStats | None,
    ref_logp: torch.Tensor | None,
    rollout_logp: torch.Tensor | None,
) -> None:
    """Raise naming the missing input when ``cfg`` needs one the caller did not pass."""
    if cfg.response_weight != "none" and weights is None:
        raise ValueError(
            f"cfg.response_weight={cfg.response_weight!r} needs weights= [B]: compute them with "
            "response_weights(logp_old, mask, group_size, mode) on complete groups before "
            "splitting the batch, or set response_weight='none'"
        )
    if cfg.entropy_coef > 0 and stats is None:
        raise ValueError(
            f"entropy_coef={cfg.entropy_coef} needs stats= (TokenStats of the current policy, "
            "with entropy); pass it or set entropy_coef=0"
        )
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError(
            f"kl_coef={cfg.kl_coef} needs ref_logp= [B, T] from the reference policy; pass it "
            "or set kl_coef=0"
        )
    if cfg.tis_cap is not None and rollout_logp is None:
        raise ValueError(
            f"tis_cap={cfg.tis_cap} needs rollout_logp= [B, T] (the inference engine's "
            "log-probs); pass it or set tis_cap=None"
        )
    if cfg.token_ratio == "categorical" and (stats is None or stats_old is None):
        raise ValueError(
            "token_ratio='categorical' needs stats= and stats_old= (TokenStats with sum_p2 of "
            "the current and the old policy)"
        )


@dataclass(frozen=True)
class _Tokens:
    """What the three surrogates share, ``[B, T]`` zeroed at padding (``adv``: ``[B, 1]``)."""

    mask: torch.Tensor
    zeros: torch.Tensor
    lp: torch.Tensor
    lp_old: torch.Tensor
    adv: torch.Tensor
    ratio: torch.Tensor
    """``r = p / p_old`` with its gradient; :attr:`r` is the same detached."""
    r: torch.Tensor
    clip_high: torch.Tensor
    """The PPO clip fires upwards: A > 0 and r > 1 + eps_high."""
    clip_low: torch.Tensor
    """The PPO clip fires downwards: A < 0 and r < 1 - eps_low."""
    clip_dual: torch.Tensor
    """The dual clip fires: A < 0 and r > dual_clip_c (all False when it is off)."""


def _tokens(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
) -> _Tokens:
    """The masked inputs, the importance ratio and the PPO clip masks of every surrogate."""
    maskb = mask.bool()
    zeros = torch.zeros_like(logp)
    # Padded positions may hold -inf/NaN: replace them before any arithmetic so that neither
    # the forward value nor the gradient sees them.
    lp = torch.where(maskb, logp, zeros)
    lp_old = torch.where(maskb, logp_old.detach().to(logp.dtype), zeros)
    adv = advantages.detach().to(logp.dtype).unsqueeze(1)
    ratio = importance_ratio(lp, lp_old, cfg.max_log_ratio)
    r = ratio.detach()
    clip_high = maskb & (adv > 0) & (r > 1.0 + cfg.eps_high)
    clip_low = maskb & (adv < 0) & (r < 1.0 - cfg.eps_low)
    # Dual clip: where ppo_clip's loss is capped at -c A (A < 0, r > c) it has no gradient;
    # reco and cispo drop the same tokens.
    clip_dual = torch.zeros_like(maskb)
    if cfg.dual_clip_c is not None:
        clip_dual = maskb & (adv < 0) & (r > cfg.dual_clip_c)
    return _Tokens(
        mask=maskb,
        zeros=zeros,
        lp=lp,
        lp_old=lp_old,
        adv=adv,
        ratio=ratio,
        r=r,
        clip_high=clip_high,
        clip_low=clip_low,
        clip_dual=clip_dual,
    )


def _ppo_clip_surrogate(t: _Tokens, cfg: LossConfig) -> torch.Tensor:
    """``max(-r A, -clip(r, 1-eps_low, 1+eps_high) A)``, capped at ``-dual_clip_c A`` for
    A < 0 when the dual clip is set; ``[B, T]``."""
    adv, ratio = t.adv, t.ratio
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = torch.maximum(surr, surr_clipped)
    if cfg.dual_clip_c is not None:
        dual = torch.minimum(per_token, -adv * cfg.dual_clip_c)
        per_token = torch.where(adv < 0, dual, per_token)
    return per_token


def _reco_surrogate(
    t: _Tokens, cfg: LossConfig, stats: TokenStats | None, stats_old: TokenStats | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``-sg(c) A log p`` where no clip fires, 0 elsewhere; returns ``(per_token, c_raw,
    clip_c)``, all ``[B, T]``: the raw token ratio (metrics) and where the trust region on c
    dropped a token (``None`` without a trust region, ``cfg.c_trust_bound is None``)."""
    maskb, zeros, lp, adv = t.mask, t.zeros, t.lp, t.adv
    sum_p2 = None if stats is None else torch.where(maskb, stats.sum_p2, zeros)
    sum_p2_old = None if stats_old is None else torch.where(maskb, stats_old.sum_p2, zeros)
    tr = token_ratio(
        lp,
        t.lp_old,
        cfg.token_ratio,
        sum_p2=sum_p2,
        sum_p2_old=sum_p2_old,
        prob_eps=cfg.prob_eps,
        c_max=cfg.c_max,
        max_log_ratio=cfg.max_log_ratio,
    )
    c = tr.ratio.detach()
    clip_c = None
    dropped = t.clip_high | t.clip_low | t.clip_dual
    bound = cfg.c_trust_bound
    if bound is not None:
        clip_c = maskb & (tr.raw > bound) & (adv * c_growth(lp, cfg.token_ratio, sum_p2) > 0)
        c = c.clamp(max=bound)
        dropped = dropped | clip_c
    return torch.where(dropped, zeros, -(c * adv) * lp), tr.raw, clip_c


def _cispo_surrogate(t: _Tokens, cfg: LossConfig) -> torch.Tensor:
    """``-sg(clip(r, 1-cispo_eps_low, 1+cispo_eps_high)) A log p``, 0 where the dual clip
    fires; ``[B, T]``."""
    lo = 0.0 if cfg.cispo_eps_low is None else 1.0 - cfg.cispo_eps_low
    coef = t.r.clamp(min=lo, max=1.0 + cfg.cispo_eps_high)
    return torch.where(t.clip_dual, t.zeros, -(coef * t.adv) * t.lp)


def _metrics(
    maskb: torch.Tensor,
    r: torch.Tensor,
    lp: torch.Tensor,
    lp_old: torch.Tensor,
    clip_low: torch.Tensor,
    clip_high: torch.Tensor,
    c_raw: torch.Tensor | None,
    weights: torch.Tensor | None,
    kl_ref: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """Detached metrics of :func:`policy_loss` (inputs already zeroed at padding)."""
    m: dict[str, torch.Tensor] = {
        "num_tokens/sum": maskb.sum().float(),
        "num_seqs/sum": torch.tensor(float(maskb.shape[0])),
        "clip_frac_low/mean": masked_mean(clip_low.float(), maskb),
        "clip_frac_high/mean": masked_mean(clip_high.float(), maskb),
        "clip_frac/mean": masked_mean((clip_low | clip_high).float(), maskb),
    }
    m.update(quantile_metrics("ratio", r, maskb))
    if c_raw is not None:
        m.update(quantile_metrics("token_ratio", c_raw, maskb))
    # KL(old || new) on tokens sampled from old: k3 with log(p/p_old).
    log_r = (lp - lp_old).clamp(-20.0, 20.0)
    m["kl_old_new/mean"] = masked_mean(torch.exp(log_r) - log_r - 1.0, maskb)
    if kl_ref is not None:
        m["kl_ref/mean"] = masked_mean(kl_ref, maskb)
    if weights is not None:
        m.update(weight_metrics(weights, maskb))
    return m
