"""Group-relative advantages: GRPO, Dr.GRPO and RLOO from per-response rewards."""

from __future__ import annotations

import torch

from reco_megatron.algo.config import ADVANTAGE_MODES


def check_groups(num_rows: int, group_size: int, what: str = "rows") -> int:
    """Number of groups in ``num_rows`` rows; raises unless ``num_rows`` is a multiple of G."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if num_rows % group_size != 0:
        raise ValueError(
            f"{num_rows} {what} is not a multiple of group_size={group_size}: statistics are "
            "computed per complete group, so pass whole groups (before any split into "
            "micro-batches or ranks)"
        )
    return num_rows // group_size


def group_advantages(
    rewards: torch.Tensor, group_size: int, mode: str = "grpo", *, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-response advantages from rewards of consecutive groups of ``group_size`` responses.

    Args:
        rewards: ``[B*G]`` scalar rewards, group-major (rows ``g*G .. g*G+G-1`` are group g).
        group_size: G.
        mode: ``grpo`` ``(R - mean) / (std + eps)`` with the unbiased std (as TRL/verl);
            ``dr_grpo`` ``R - mean``; ``rloo`` ``R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean)``.
        eps: added to the std in ``grpo``.

    Returns:
        ``(advantages [B*G], metrics)``: advantages in the dtype of ``rewards`` (fp32 at least).
        Groups whose rewards are all equal (including every group when G = 1) get exactly zero
        advantage. ``metrics`` (see :mod:`reco_megatron.algo.metrics` for the key convention):
        ``num_groups/sum``, ``zero_adv_groups/sum`` (all-equal groups), ``zero_adv_frac/mean``,
        ``reward/mean``, ``reward_std/mean`` (mean within-group std).
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"advantage mode must be one of {ADVANTAGE_MODES}, got {mode!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {tuple(rewards.shape)}")
    num_groups = check_groups(rewards.shape[0], group_size, "rewards")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.detach().to(dtype).view(num_groups, group_size)
    mean = r.mean(dim=1, keepdim=True)
    centred = r - mean
    degenerate = (r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1)
    std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    if mode == "grpo":
        adv = centred / (std + eps)
    elif mode == "dr_grpo":
        adv = centred
    else:
        adv = centred * (group_size / (group_size - 1)) if group_size > 1 else centred
    adv = torch.where(degenerate, torch.zeros_like(adv), adv).reshape(-1)
    n_zero = degenerate.sum().float()
    metrics = {
        "num_groups/sum": torch.tensor(float(num_groups)),
        "zero_adv_groups/sum": n_zero,
        "zero_adv_frac/mean": n_zero / max(num_groups, 1),
        "reward/mean": r.mean().float() if r.numel() else torch.zeros(()),
        "reward_std/mean": std.mean().float() if r.numel() else torch.zeros(()),
    }
    return adv, metrics
