"""ReCo response weights: divide each response by its expected occurrence in the group.

A response the old policy emits with probability pi_old(o|q) appears on average
``G * pi_old(o|q)`` times in a group of G draws, so its contribution is divided by that
(when above 1). The ``prefix`` modes apply the same argument to every prefix: token t of
response i is divided by the (expected or counted) number of group members that share
``o_{i,<=t}``, so a prefix the whole group shares keeps GRPO's exact cancellation there.
All modes work on complete groups of consecutive rows and are always finite.
"""

from __future__ import annotations

import math

import torch

from reco_megatron.algo.advantages import check_groups
from reco_megatron.algo.config import (
    LOGPROB_WEIGHT_MODES,
    PER_TOKEN_WEIGHT_MODES,
    TOKEN_ID_WEIGHT_MODES,
    WEIGHT_MODES,
    LossConfig,
)

RESOLVED_WEIGHT_POLICIES: tuple[str, ...] = ("proximal", "behaviour")
"""What ``LossConfig.response_weight_policy`` resolves to once the placement is known."""

PREFIX_COUNT_CHUNK_ELEMENTS = 1 << 24
"""Bound on the ``[groups, G, G, T]`` pairwise comparison :func:`prefix_counts` holds at once
(16 Mi booleans = 16 MiB): groups are processed in chunks of at most this many elements."""

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
    ids = _token_keys(response_ids, mask)
    group_id = torch.arange(num_groups, device=ids.device).repeat_interleave(group_size)
    keyed = torch.cat([group_id.unsqueeze(1), ids], dim=1)
    _, inverse, counts = torch.unique(keyed, dim=0, return_inverse=True, return_counts=True)
    return counts[inverse]


def prefix_log_prob(logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi_old(o_{i,<=t}|q) = sum_{s<=t} mask * logp_old`` ``[B, T]`` (fp32+).

    Padded positions add 0, so after the response ends the value stays the whole response's
    log-prob and before it starts it is 0."""
    return torch.cumsum(_masked_logp(logp_old, mask), dim=-1)


def _token_keys(response_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token ids with padded positions set to -1 (ids there are ignored), int64."""
    return torch.where(mask.bool(), response_ids.long(), torch.full_like(response_ids, -1).long())


def prefix_counts(response_ids: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Number of group members whose response shares ``o_{i,<=t}`` token for token, ``[B*G, T]``.

    Response j shares response i's prefix up to t when at every position ``s <= t`` both masks
    agree and, where they are 1, the token ids agree (responses of one group share the prompt,
    so their tokens are compared position by position). Counts include i itself (>= 1); on the
    last response token they equal :func:`empirical_counts` for responses of equal length.
    ``response_ids``, ``mask``: ``[B*G, T]``. Memory: ``G * G * T`` booleans per group, in
    chunks of at most :data:`PREFIX_COUNT_CHUNK_ELEMENTS`.
    """
    num_groups = check_groups(response_ids.shape[0], group_size, "responses")
    t = response_ids.shape[1]
    keys = _token_keys(response_ids, mask).view(num_groups, group_size, t)
    per_group = group_size * group_size * max(t, 1)  # >= 1: check_groups made G >= 1
    chunk = max(1, PREFIX_COUNT_CHUNK_ELEMENTS // per_group)
    out = []
    for start in range(0, num_groups, chunk):
        k = keys[start : start + chunk]  # [g, G, T]
        same = k.unsqueeze(2) == k.unsqueeze(1)  # [g, G, G, T]: i, j, position
        shared = torch.cummin(same.to(torch.uint8), dim=-1).values  # prefix still identical
        out.append(shared.sum(dim=2))  # [g, G, T], int64 (torch sums integers in int64)
    return torch.cat(out, dim=0).view(-1, t) if out else keys.view(-1, t)


def check_weight_policy(policy: object) -> None:
    """Raise unless ``policy`` is a resolved response weight policy (``proximal`` or
    ``behaviour``; ``auto`` is resolved by ``TrainConfig.response_weight_policy``)."""
    if policy not in RESOLVED_WEIGHT_POLICIES:
        raise ValueError(
            f"response weight policy must be one of {RESOLVED_WEIGHT_POLICIES} once resolved, "
            f"got {policy!r} (TrainConfig.response_weight_policy resolves 'auto')"
        )


def weight_logprobs(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    policy: str,
    mode: str,
) -> torch.Tensor:
    """The log-probs :func:`response_weights` reads, ``[B*G, T]`` in ``old_logprobs``' dtype.

    Args:
        old_logprobs: ``[B*G, T]`` log pi_old of the sampled tokens (the old-policy pass).
        rollout_logprobs: ``[B*G, T]`` log mu, what the rollout engine reported while sampling,
            or ``None``.
        mask: ``[B*G, T]`` 1 on response tokens.
        policy: ``proximal`` (returns ``old_logprobs`` itself) or ``behaviour`` (mu, cast to
            ``old_logprobs.dtype``, 0 at padded positions so whatever the engine put there,
            -inf or NaN, stays out). A mode that reads no log-probs (``empirical``,
            ``prefix_empirical``, ``none``) gets ``old_logprobs`` under either policy.
        mode: the response weight mode (``LossConfig.response_weight``).
    """
    check_weight_policy(policy)
    if policy == "proximal" or mode not in LOGPROB_WEIGHT_MODES:
        return old_logprobs
    if rollout_logprobs is None:
        raise ValueError(
            f"response_weight_policy='behaviour' with response_weight={mode!r} reads the "
            "rollout engine's log-probs of the sampled tokens, but the batch has no "
            "rollout_logprobs: fill RolloutBatch.rollout_logprobs [B, S] with them (the "
            "trainer's rollout engines always do), or set loss.response_weight_policy="
            "proximal to weigh responses by the old-policy pass"
        )
    if rollout_logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"rollout_logprobs must match old_logprobs {tuple(old_logprobs.shape)}, got "
            f"{tuple(rollout_logprobs.shape)}"
        )
    mu = rollout_logprobs.detach().to(device=old_logprobs.device, dtype=old_logprobs.dtype)
    return torch.where(mask.bool(), mu, torch.zeros_like(mu))


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
    """Response weights (fp32, detached, finite, > 0): ``w [B*G]`` per response, or
    ``w [B*G, T]`` per token for the ``prefix`` modes (:data:`PER_TOKEN_WEIGHT_MODES`).

    Args:
        logp_old: ``[B*G, T]`` log-probs of the sampled tokens under the policy that sampled
            the group (pi_old, or the rollout engine's mu with stale groups:
            :func:`weight_logprobs`).
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
            - ``prefix``: per token, ``w_t = 1 / max(1, G * pi_old(o_{<=t}))`` computed as
              ``exp(-max(0, log G + sum_{s<=t} logp_old))`` (padding adds 0): the expected
              number of group members sharing the prefix through token t. On the last
              response token it equals ``sequence``; -inf log-probs give 1 from there on.
            - ``prefix_empirical``: per token, ``1 / (number of group members whose response
              equals o_{<=t} token for token)`` (:func:`prefix_counts`); needs
              ``response_ids``. On the last token it equals ``empirical``.
            - ``none``: ones.
        response_ids: token ids of the responses (``empirical``, ``prefix_empirical``).
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
    if mode in TOKEN_ID_WEIGHT_MODES:
        if response_ids is None:
            raise ValueError(f"response weight mode {mode!r} needs response_ids= [B*G, T]")
        if response_ids.shape != mask.shape:
            raise ValueError(
                f"response_ids must match mask {tuple(mask.shape)}, got {tuple(response_ids.shape)}"
            )
        count = (empirical_counts if mode == "empirical" else prefix_counts)(
            response_ids, mask, group_size
        )
        return 1.0 / count.float()
    log_g = math.log(group_size)
    if mode in PER_TOKEN_WEIGHT_MODES:  # prefix
        # same clamp as sequence: -inf -> 1, NaN is not hidden
        return torch.exp(-torch.clamp(log_g + prefix_log_prob(logp_old, mask), min=0.0)).float()
    if mode == "sequence":
        log_seq = sequence_log_prob(logp_old, mask)
        # -inf -> clamp gives 0 -> w = 1; NaN is not a log-prob and is not silently hidden.
        log_w = -torch.clamp(log_g + log_seq, min=0.0)
        return torch.exp(log_w).float()
    # geometric
    lengths = mask.bool().sum(dim=-1).clamp(min=1)
    mean_logp = sequence_log_prob(logp_old, mask) / lengths
    mean_logp = torch.clamp(mean_logp, min=GEOMETRIC_MIN_MEAN_LOGP)
    # u / mean_group(u) == G * softmax(log u) within the group: exact, overflow-free; and
    # log u = -log G - mean_logp, whose constant -log G the softmax cancels.
    w = group_size * torch.softmax(-mean_logp.view(num_groups, group_size), dim=1)
    return w.reshape(-1).clamp(min=w_min, max=w_max).float()


def batch_response_weights(
    cfg: LossConfig,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    *,
    policy: str = "proximal",
    rollout_logprobs: torch.Tensor | None = None,
    response_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`response_weights` as ``cfg`` configures them (mode, geometric clip), on the
    log-probs ``policy`` names (:func:`weight_logprobs`): ``[B*G]``, or ``[B*G, T]`` for the
    prefix modes. ``old_logprobs``, ``mask``, ``rollout_logprobs``, ``response_ids``:
    ``[B*G, T]`` of complete groups; the token ids are read only by the counting modes."""
    mode = cfg.response_weight
    logp = weight_logprobs(old_logprobs, rollout_logprobs, mask, policy, mode)
    return response_weights(
        logp,
        mask,
        group_size,
        mode,
        response_ids=response_ids,  # read only by the counting modes
        w_min=cfg.geometric_w_min,
        w_max=cfg.geometric_w_max,
    )
