"""ReCo response weights: divide each response by its expected occurrence in the group.

A response the old policy emits with probability pi_old(o|q) appears on average
``G * pi_old(o|q)`` times in a group of G draws, so its contribution is divided by that
(when above 1). All modes work on complete groups of consecutive rows and are always finite.
"""

from __future__ import annotations

import math

import torch

from reco_megatron.algo.advantages import check_groups
from reco_megatron.algo.config import WEIGHT_MODES

GEOMETRIC_MIN_MEAN_LOGP = -50.0
"""Floor of the per-token mean log-prob in ``geometric`` mode (e^-50 ~ 2e-22 is far below any
sampled response's geometric-mean token probability; keeps -inf inputs finite)."""


def _masked_logp(logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logp_old`` with padded positions set to 0 (also replaces -inf/NaN there), fp32+."""
    dtype = torch.promote_types(logp_old.dtype, torch.float32)
    lp = logp_old.detach().to(dtype)
    return torch.where(mask.bool(), lp, torch.zeros_like(lp))


def sequence_log_prob(logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi_old(o_i|q) = sum_t mask * logp_old`` ``[B]`` from ``[B, T]`` inputs."""
    return _masked_logp(logp_old, mask).sum(dim=-1)


def empirical_counts(
    response_ids: torch.Tensor, mask: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Number of token-identical responses in each response's group, ``[B*G]`` (>= 1).

    Two responses are identical when their token ids agree at every position and their masks
    agree (ids at padded positions are ignored). ``response_ids``, ``mask``: ``[B*G, T]``.
    """
    num_groups = check_groups(response_ids.shape[0], group_size, "responses")
    maskb = mask.bool()
    ids = torch.where(maskb, response_ids.long(), torch.full_like(response_ids, -1).long())
    group_id = torch.arange(num_groups, device=ids.device).repeat_interleave(group_size)
    keyed = torch.cat([group_id.unsqueeze(1), ids], dim=1)
    _, inverse, counts = torch.unique(keyed, dim=0, return_inverse=True, return_counts=True)
    return counts[inverse]


def response_weights(
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    mode: str = "sequence",
    *,
    response_ids: torch.Tensor | None = None,
    w_min: float = 0.1,
    w_max: float = 10.0,
) -> torch.Tensor:
    """Per-response weights ``w [B*G]`` (fp32, detached, finite, > 0).

    Args:
        logp_old: ``[B*G, T]`` log-probs of the sampled tokens under the old (rollout) policy.
        mask: ``[B*G, T]`` 1 on response tokens, 0 on prompt/padding.
        group_size: G; rows are complete, consecutive groups (``B*G % G == 0``, else
            ``ValueError``).
        mode:
            - ``sequence``: ``w = 1 / max(1, G * exp(sum_t logp_old))`` computed as
              ``exp(-max(0, log G + sum_t logp_old))``. An empty response (mask all 0) has
              probability 1 and weight 1/G; -inf log-probs give weight 1; G = 1 gives 1.
            - ``geometric``: ``u = 1 / (G * exp(mean_t logp_old))``, normalised to mean 1
              within each group, then clipped to ``[w_min, w_max]`` (the clip may move the mean
              off 1). The mean log-prob is floored at ``GEOMETRIC_MIN_MEAN_LOGP``.
            - ``empirical``: ``1 / (number of token-identical responses in the group)``;
              needs ``response_ids [B*G, T]``.
            - ``none``: ones.
        response_ids: token ids of the responses (``empirical`` only).
        w_min, w_max: clip of the ``geometric`` weights.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"response weight mode must be one of {WEIGHT_MODES}, got {mode!r}")
    if logp_old.shape != mask.shape or logp_old.dim() != 2:
        raise ValueError(
            f"logp_old and mask must both be [B*G, T], got {tuple(logp_old.shape)} and "
            f"{tuple(mask.shape)}"
        )
    num_groups = check_groups(logp_old.shape[0], group_size, "responses")
    n = logp_old.shape[0]
    if mode == "none":
        return torch.ones(n, dtype=torch.float32, device=logp_old.device)
    if mode == "empirical":
        if response_ids is None:
            raise ValueError("response weight mode 'empirical' needs response_ids= [B*G, T]")
        if response_ids.shape != mask.shape:
            raise ValueError(
                f"response_ids must match mask {tuple(mask.shape)}, got {tuple(response_ids.shape)}"
            )
        return 1.0 / empirical_counts(response_ids, mask, group_size).float()
    log_g = math.log(group_size)
    if mode == "sequence":
        log_seq = sequence_log_prob(logp_old, mask)
        # -inf -> clamp gives 0 -> w = 1; NaN is not a log-prob and is not silently hidden.
        log_w = -torch.clamp(log_g + log_seq, min=0.0)
        return torch.exp(log_w).float()
    # geometric
    lengths = mask.bool().sum(dim=-1).clamp(min=1)
    mean_logp = sequence_log_prob(logp_old, mask) / lengths
    mean_logp = torch.clamp(mean_logp, min=GEOMETRIC_MIN_MEAN_LOGP)
    log_u = (-log_g - mean_logp).view(num_groups, group_size)
    # u / mean_group(u) == G * softmax(log u) within the group: exact, overflow-free.
    w = group_size * torch.softmax(log_u, dim=1)
    return w.reshape(-1).clamp(min=w_min, max=w_max).float()
