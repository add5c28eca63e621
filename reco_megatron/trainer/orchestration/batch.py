"""Turn prompts and sampled completions into the :class:`RolloutBatch` the engine trains on.

Alignment (the classic off-by-one): row ``i`` holds ``tokens = prompt + response``; response
token ``k`` sits at position ``p + k`` (``p`` = prompt length) and is predicted from position
``p + k - 1``, so its rollout log-prob goes to label index ``p + k - 1`` of the ``[B, L-1]``
per-token tensors, and ``response_mask[p + k] = 1``.

Multi-turn episodes (``reco_megatron.envs``) carry a per-token loss mask: observation tokens
the environment appended stay in ``tokens`` (the model reads them) but get
``response_mask = 0`` and rollout log-prob 0, so no loss, statistic or metric counts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reco_megatron.parallel.batch import RolloutBatch
from reco_megatron.rollout.requests import Completion


def build_rollout_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    response_logprobs: Sequence[Sequence[float]],
    advantages: torch.Tensor,
    group_size: int,
    pad_id: int,
    pad_to_multiple: int = 8,
    routed_experts: Sequence[torch.Tensor | None] | None = None,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> RolloutBatch:
    """A right-padded batch of ``len(responses)`` rows (group-major, ``G`` rows per prompt).

    Args:
        prompts: one token list per *group* (``B`` of them).
        responses: ``B * G`` response token lists; row ``g * G + j`` answers prompt ``g``.
        response_logprobs: per-token log-probs the rollout engine reported, same shapes.
        advantages: ``[B * G]``.
        pad_id: id written into padding (never scored: the mask is 0 there).
        pad_to_multiple: the length ``L - 1`` the model sees is rounded up to this multiple
            (fewer distinct shapes; sequence/context parallel need divisibility).
        routed_experts: per row, the rollout's experts of every position of ``prompt +
            response`` (``[P + T, layers, top-k]``, from :class:`Completion`), or None; they
            become ``RolloutBatch.routed_experts`` at input positions ``0 .. L-2`` (``-1``
            where unknown, padding included).
        loss_masks: per row, ``[T]`` 1 on the policy's tokens and 0 on an environment's
            observation tokens (:attr:`Completion.loss_mask`), or None (all ones: a
            single-turn response). They become ``response_mask[p : p + T]``.
    """
    n = len(responses)
    if n != len(prompts) * group_size or n != len(response_logprobs):
        raise ValueError(
            f"{len(prompts)} prompts x group_size {group_size} != {n} responses "
            f"({len(response_logprobs)} log-prob rows)"
        )
    rows = [list(prompts[i // group_size]) + list(responses[i]) for i in range(n)]
    seq = max(len(r) for r in rows) - 1
    seq = -(-max(seq, 1) // pad_to_multiple) * pad_to_multiple
    length = seq + 1
    tokens = torch.full((n, length), pad_id, dtype=torch.long)
    mask = torch.zeros(n, length)
    logprobs = torch.zeros(n, seq)
    for i, row in enumerate(rows):
        p = len(prompts[i // group_size])
        r = len(responses[i])
        if len(response_logprobs[i]) != r:
            raise ValueError(
                f"response {i} has {r} tokens but {len(response_logprobs[i])} log-probs"
            )
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        row_mask = None if loss_masks is None else loss_masks[i]
        if row_mask is None:
            mask[i, p : p + r] = 1.0
        elif len(row_mask) != r:
            raise ValueError(f"response {i} has {r} tokens but a loss mask of {len(row_mask)}")
        elif r:
            mask[i, p : p + r] = torch.tensor(row_mask, dtype=mask.dtype)
        if r:
            logprobs[i, p - 1 : p - 1 + r] = torch.tensor(response_logprobs[i])
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        advantages=advantages.float(),
        group_size=group_size,
        rollout_logprobs=logprobs,
        routed_experts=_routed(routed_experts, rows, seq),
    )


def completions_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    advantages: torch.Tensor,
    group_size: int,
    pad_id: int,
) -> RolloutBatch:
    """:func:`build_rollout_batch` of ``completions`` (group-major, ``G`` per prompt): their
    tokens, log-probs, routed experts and loss masks."""
    return build_rollout_batch(
        prompts,
        [c.token_ids for c in completions],
        [c.logprobs for c in completions],
        advantages,
        group_size,
        pad_id,
        routed_experts=[c.routed_experts for c in completions],
        loss_masks=[c.loss_mask for c in completions],
    )


def _routed(
    per_row: Sequence[torch.Tensor | None] | None, rows: list[list[int]], seq: int
) -> torch.Tensor | None:
    """``[B, seq, layers, k]`` int16 from each row's ``[len(row), layers, k]`` (``-1`` fill)."""
    if per_row is None or all(r is None for r in per_row):
        return None
    if any(r is None for r in per_row) or len(per_row) != len(rows):
        raise ValueError(
            "routed experts are missing for some responses: the rollout engine must return "
            "them for every response or none"
        )
    first = per_row[0]
    assert first is not None
    out = torch.full((len(rows), seq, *first.shape[1:]), -1, dtype=torch.int16)
    for i, (row, routed) in enumerate(zip(rows, per_row, strict=True)):
        assert routed is not None
        if routed.shape[0] != len(row) or routed.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"response {i}: routed experts {tuple(routed.shape)} for {len(row)} tokens "
                f"(expected [{len(row)}, {', '.join(map(str, first.shape[1:]))}])"
            )
        n = min(len(row), seq)
        out[i, :n] = routed[:n].to(torch.int16)
    return out
