"""Per-token ratios: the importance ratio r and ReCo's variance ratios c.

Every function returns detached-or-not tensors as documented and never NaN/inf on masked-out
positions as long as the caller zeroes them (``policy_loss`` does).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from reco_megatron.algo.config import RATIO_MODES


class TokenRatio(NamedTuple):
    """Result of :func:`token_ratio`; both fields have the shape of ``logp`` (``[B, T]``)."""

    ratio: torch.Tensor
    """The coefficient used by the loss: capped at ``c_max`` for ``bernoulli``/``categorical``;
    for ``importance`` r itself (differentiable if ``logp`` is)."""
    raw: torch.Tensor
    """The same before the ``c_max`` cap (detached; for metrics)."""


def importance_ratio(
    logp: torch.Tensor, logp_old: torch.Tensor, max_log_ratio: float = 20.0
) -> torch.Tensor:
    """``r = exp(clamp(logp - logp_old, -max_log_ratio, max_log_ratio))``, differentiable."""
    log_ratio = (logp - logp_old.detach()).clamp(-max_log_ratio, max_log_ratio)
    return torch.exp(log_ratio)


def bernoulli_variance(logp: torch.Tensor, prob_eps: float) -> torch.Tensor:
    """``p (1 - p)`` of the sampled token, with p and 1-p clamped to ``[prob_eps, 1]``.

    ``1 - p`` is computed as ``-expm1(logp)``, accurate when p is near 1. Detached.
    """
    lp = logp.detach()
    p = torch.exp(lp).clamp(min=prob_eps, max=1.0 - prob_eps)
    q = (-torch.expm1(lp)).clamp(min=prob_eps, max=1.0 - prob_eps)
    return p * q


def categorical_variance(sum_p2: torch.Tensor, prob_eps: float) -> torch.Tensor:
    """``1 - sum_v p_v^2`` clamped to ``>= prob_eps``. Detached. (No upper clamp: a sum of
    squares is >= 0, so the variance is <= 1 already.)"""
    return (1.0 - sum_p2.detach()).clamp(min=prob_eps)


def token_ratio(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    mode: str = "bernoulli",
    *,
    sum_p2: torch.Tensor | None = None,
    sum_p2_old: torch.Tensor | None = None,
    prob_eps: float = 1e-6,
    c_max: float = 10.0,
    max_log_ratio: float = 20.0,
) -> TokenRatio:
    """Per-token ratio of the current to the old policy, ``[B, T]`` (any matching shapes).

    - ``importance``: ``r = exp(logp - logp_old)`` (log-ratio clamped to ``±max_log_ratio``),
      not capped, differentiable through ``logp``.
    - ``bernoulli``: ``c = p(1-p) / (p_old(1-p_old))`` with p, 1-p clamped to
      ``[prob_eps, 1-prob_eps]``, capped at ``c_max``; detached.
    - ``categorical``: ``c = (1 - sum_p2) / (1 - sum_p2_old)`` from ``TokenStats.sum_p2`` of the
      current and old policy, both variances clamped to ``>= prob_eps``, capped at ``c_max``;
      detached.

    ``c == 1`` exactly when the two inputs are equal (same computation on both sides).
    """
    if mode not in RATIO_MODES:
        raise ValueError(f"token ratio mode must be one of {RATIO_MODES}, got {mode!r}")
    if mode == "importance":
        r = importance_ratio(logp, logp_old, max_log_ratio)
        return TokenRatio(ratio=r, raw=r.detach())
    if mode == "bernoulli":
        raw = bernoulli_variance(logp, prob_eps) / bernoulli_variance(logp_old, prob_eps)
    else:
        if sum_p2 is None or sum_p2_old is None:
            raise ValueError(
                "token ratio mode 'categorical' needs sum_p2 and sum_p2_old (TokenStats.sum_p2 "
                "of the current and the old policy); pass stats= and stats_old= to policy_loss"
            )
        raw = categorical_variance(sum_p2, prob_eps) / categorical_variance(sum_p2_old, prob_eps)
    return TokenRatio(ratio=raw.clamp(max=c_max), raw=raw)


def tis_weights(
    trainer_old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
) -> torch.Tensor:
    """Truncated importance-sampling weight per token, detached: ``[B, T]``.

    ``w = min(exp(trainer_old_logprobs - rollout_logprobs), cap)`` on response tokens and ``0``
    elsewhere, computed as ``exp(min(diff, log cap))`` so a large diff never overflows.

    Args:
        trainer_old_logprobs: ``[B, T]`` log pi_old as the trainer computes it.
        rollout_logprobs: ``[B, T]`` log-probs reported by the rollout engine.
        mask: ``[B, T]`` true on response tokens.
        cap: upper bound of the weight (> 0; 2.0 in the TIS paper).
    """
    if not isinstance(cap, int | float) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"TIS cap must be a finite number > 0, got {cap!r}")
    if not (trainer_old_logprobs.shape == rollout_logprobs.shape == mask.shape):
        raise ValueError(
            f"TIS inputs must share one shape [B, T], got {tuple(trainer_old_logprobs.shape)}, "
            f"{tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}"
        )
    m = mask.bool()
    dtype = torch.promote_types(trainer_old_logprobs.dtype, torch.float32)  # fp64 stays fp64
    diff = trainer_old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype)
    diff = torch.where(m, diff, torch.zeros_like(diff))
    w = torch.exp(torch.clamp(diff, max=math.log(cap)))
    return torch.where(m, w, torch.zeros_like(w))
