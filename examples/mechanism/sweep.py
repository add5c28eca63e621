"""Is the response weight active at a given response length? A synthetic length sweep.

A response of T tokens is drawn token by token from next-token distributions taken at random
from a *pool* measured on a real policy (``task.token_pool``: the mechanism policy at its SFT
start and after RL). All G responses of a group share the T distributions (one prompt, one
context per position), so duplicates arise exactly when G draws agree at every position.
The weights are ``reco_megatron.algo.response_weights`` on the drawn log-probs and token ids.

Limits: real next-token distributions depend on the prefix, and a real model's per-token
entropy varies along a response (forks between near-deterministic stretches); the pool keeps
the measured mix of distributions but not their order.
"""

from __future__ import annotations

import math

import torch

from reco_megatron.algo import response_weights

VARIANTS = ("sequence", "geometric", "empirical")


def draw_groups(
    pool: torch.Tensor, length: int, group_size: int, groups: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token ids, log-probs)``, both ``[groups * G, length]``, from ``pool [M, V]``."""
    idx = torch.randint(pool.shape[0], (groups, 1, length), generator=g)
    cdf = torch.cumsum(pool, dim=-1)[idx].expand(groups, group_size, length, pool.shape[1])
    u = torch.rand(groups, group_size, length, 1, generator=g) * cdf[..., -1:]
    ids = torch.searchsorted(cdf.contiguous(), u).squeeze(-1).clamp(max=pool.shape[1] - 1)
    probs = pool[idx.expand(groups, group_size, length), ids]
    return ids.reshape(-1, length), probs.clamp(min=1e-30).log().reshape(-1, length)


def activity(
    pool: torch.Tensor,
    lengths: list[int],
    group_size: int = 8,
    groups: int = 200,
    seed: int = 0,
) -> list[dict[str, float]]:
    """Per length: share of responses with w < 1 under each variant, the share of groups with
    at least one duplicate, and the pool's mean per-token NLL (nats)."""
    g = torch.Generator().manual_seed(seed)
    nll = float(-(pool * pool.clamp(min=1e-30).log()).sum(-1).mean())
    rows = []
    for length in lengths:
        ids, logp = draw_groups(pool, length, group_size, groups, g)
        mask = torch.ones_like(logp)
        row: dict[str, float] = {"length": length, "token_nll": nll, "groups": groups}
        for mode in VARIANTS:
            w = response_weights(logp, mask, group_size, mode, response_ids=ids)
            row[f"w_lt1_{mode}"] = float((w < 1.0 - 1e-6).float().mean())
        row["mean_logp_seq"] = float(logp.sum(-1).mean())
        rows.append(row)
    return rows


def sequence_threshold(group_size: int, token_nll: float) -> float:
    """Length above which a response of mean per-token NLL ``token_nll`` has
    ``G pi(o) < 1`` (so its ``sequence`` weight is 1): ``log G / token_nll``."""
    return math.log(group_size) / token_nll if token_nll > 0 else math.inf
