"""Every rank of a model-parallel group trains on the same responses.

Each rank of a data-parallel replica (its TP x PP ranks) asks its rollout engine for the same
prompts with the same seeds. The embedded and megatron engines return the same tokens on every
rank by construction; separate vLLM engines (one per pipeline stage) need not, since vLLM is
not batch-invariant by default. A stage that embeds other tokens than the last stage scores
trains a wrong gradient silently, so after every rollout the group compares a fingerprint of
its token ids (a 32-byte digest, one all-gather) and, only when they differ, takes the first
rank's completions (one object broadcast) and counts the step in ``rollout_mp_divergence``.
"""

from __future__ import annotations

import hashlib
import struct

import torch
import torch.distributed as dist

from reco_megatron.parallel.collectives import collective_device
from reco_megatron.rollout.requests import Completion
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

_warned: dict[str, bool] = {"diverged": False}


def completions_fingerprint(completions: list[list[Completion]]) -> torch.Tensor:
    """``[4]`` int64: the sha256 of every response's token ids, finish reason and (episodes)
    loss mask, in order.

    Log-probs are left out: engines may differ in them by float noise, and the trainer
    recomputes the old policy's log-probs itself; the tokens are what every stage embeds.
    """
    digest = hashlib.sha256()
    for group in completions:
        digest.update(struct.pack("<q", len(group)))
        for c in group:
            digest.update(struct.pack("<q", len(c.token_ids)))
            digest.update(struct.pack(f"<{len(c.token_ids)}q", *c.token_ids))
            digest.update(c.finish_reason.encode())
            if c.loss_mask is not None:  # which tokens an environment wrote
                digest.update(bytes(c.loss_mask))
    return torch.tensor(struct.unpack("<4q", digest.digest()), dtype=torch.int64)


def agree_on_completions(
    completions: list[list[Completion]], group: dist.ProcessGroup | None
) -> tuple[list[list[Completion]], bool]:
    """The completions every rank of ``group`` trains on, and whether the ranks had differed.

    Collective over ``group`` (every rank calls it after its rollout). When all fingerprints
    match this is one all-gather of 4 integers per rank; otherwise every rank takes the
    completions of the group's first rank (``broadcast_object_list``) and a warning is logged
    once per process.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return completions, False
    device = collective_device(group)
    mine = completions_fingerprint(completions).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return completions, False
    box = [completions]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group, device=device)
    if not _warned["diverged"]:
        _warned["diverged"] = True
        logger.warning(
            "the rollout engines of one model-parallel group returned different tokens for the "
            "same prompts and seeds (separate, non-batch-invariant engines per pipeline stage?); "
            "every rank now trains on the first rank's responses (metric "
            "rollout_mp_divergence counts such steps)"
        )
    return box[0], True
