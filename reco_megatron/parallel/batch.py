"""The rollout batch one data-parallel rank trains on, and its split over data-parallel ranks.

A :class:`RolloutBatch` holds *whole groups*: ``B = groups x G`` sequences of prompt +
response tokens, right-padded to one length. Training predicts token ``t+1`` from position
``t``, so every per-token tensor the loss sees is aligned with ``labels = tokens[:, 1:]``
(shape ``[B, S]`` with ``S = L - 1``): ``loss_mask[:, t]`` is 1 when ``tokens[:, t+1]`` is a
response token. Getting this alignment wrong by one is the classic RL-trainer bug; it is
done once, here. Micro-batches (fixed or token-budget) are cut in
:mod:`reco_megatron.megatron.step.microbatching`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class RolloutBatch:
    """One DP rank's share of a rollout batch (whole groups of ``group_size`` responses).

    ``tokens`` and ``response_mask`` are ``[B, L]``; every other per-token tensor is ``[B, L-1]``
    aligned with ``labels``; per-sequence tensors are ``[B]``.
    """

    tokens: torch.Tensor
    """``[B, L]`` int64 prompt + response token ids, right-padded (any pad id)."""
    response_mask: torch.Tensor
    """``[B, L]`` 1 on tokens the policy generated (the response), 0 on prompt and padding and,
    in a multi-turn episode, on the observation tokens an environment appended (they stay in
    ``tokens`` as model input, but no loss, statistic or metric counts them)."""
    advantages: torch.Tensor
    """``[B]`` group-relative advantages."""
    group_size: int
    """G, responses per prompt; rows ``[k G, (k+1) G)`` form group k."""
    rollout_logprobs: torch.Tensor | None = None
    """``[B, L-1]`` log-probs the inference engine reported for the sampled tokens."""
    old_logprobs: torch.Tensor | None = None
    """``[B, L-1]`` log p_old(label) from the old-policy pass (filled by the engine)."""
    old_sum_p2: torch.Tensor | None = None
    """``[B, L-1]`` sum_v p_old^2 from the old-policy pass (categorical ratio)."""
    ref_logprobs: torch.Tensor | None = None
    """``[B, L-1]`` reference-policy log-probs (KL term), when a reference model is used."""
    weights: torch.Tensor | None = None
    """``[B]`` ReCo response weights, or ``[B, L-1]`` per token for the prefix modes; computed
    on the complete groups (filled by the engine)."""
    routed_experts: torch.Tensor | None = None
    """``[B, L-1, layers, top-k]`` int16: the experts the rollout engine routed input position
    ``t`` to in each MoE layer (``-1``: not recorded); for routing replay / its metrics."""

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.shape != self.response_mask.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and response_mask "
                f"{tuple(self.response_mask.shape)} must both be [B, L]"
            )
        b = self.tokens.shape[0]
        if self.group_size < 1 or b % self.group_size:
            raise ValueError(
                f"a rollout batch holds whole groups: {b} sequences is not a multiple of "
                f"group_size={self.group_size}"
            )
        if self.advantages.shape != (b,):
            raise ValueError(f"advantages must be [B] = [{b}], got {tuple(self.advantages.shape)}")
        if self.tokens.shape[1] < 2:
            raise ValueError("sequences need at least 2 tokens (a prompt token and a response)")
        routed = self.routed_experts
        if routed is not None and (routed.dim() != 4 or routed.shape[:2] != self.labels.shape):
            raise ValueError(
                f"routed_experts must be [B, L-1, layers, top-k] = [{b}, "
                f"{self.tokens.shape[1] - 1}, ...], got {tuple(routed.shape)}"
            )

    @property
    def num_sequences(self) -> int:
        """B."""
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        """S = L - 1, the length the model runs on."""
        return self.tokens.shape[1] - 1

    @property
    def input_ids(self) -> torch.Tensor:
        """``[B, S]`` model input."""
        return self.tokens[:, :-1]

    @property
    def labels(self) -> torch.Tensor:
        """``[B, S]`` next-token targets."""
        return self.tokens[:, 1:]

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[B, S]`` 1 where the label is a token the policy sampled (never an observation)."""
        return self.response_mask[:, 1:].float()

    def select(self, index: torch.Tensor | slice) -> RolloutBatch:
        """Rows ``index`` of every tensor (group structure is the caller's business)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value[index] if isinstance(value, torch.Tensor) else value
        b = out["tokens"].shape[0]
        group = self.group_size if b % self.group_size == 0 else 1
        return replace(self, **{**out, "group_size": group})

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The batch with every tensor on ``device``."""
        out = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **out)


def data_parallel_groups(
    num_groups: int, dp_rank: int, dp_size: int, minibatches: int
) -> list[int]:
    """Indices of the groups (prompts) of a global rollout batch owned by one DP rank.

    The global batch is read mini-batch-major: global mini-batch ``k`` is groups
    ``[k P/M, (k+1) P/M)`` whatever the DP size, and within it rank ``r`` owns the ``r``-th of
    ``dp_size`` equal slices. A rank's groups are its slices in order, so splitting its share
    into ``minibatches`` consecutive parts (what the engine does) gives every rank its part of
    the *same* global mini-batch ``k``: training is identical for any DP size.
    """
    per = num_groups // (dp_size * minibatches) if dp_size * minibatches else 0
    if per == 0 or num_groups % (dp_size * minibatches):
        raise ValueError(
            f"{num_groups} prompts per step cannot be split into {minibatches} mini-batches x "
            f"{dp_size} data-parallel ranks: make rollout.prompts_per_step a multiple of "
            f"update.minibatches_per_rollout x DP = {minibatches * dp_size}"
        )
    return [k * dp_size * per + dp_rank * per + i for k in range(minibatches) for i in range(per)]


def data_parallel_share(
    batch: RolloutBatch, dp_rank: int, dp_size: int, minibatches: int
) -> RolloutBatch:
    """This DP rank's rows of a *global* rollout batch (see :func:`data_parallel_groups`)."""
    g = batch.group_size
    groups = data_parallel_groups(batch.num_sequences // g, dp_rank, dp_size, minibatches)
    rows = torch.tensor([grp * g + j for grp in groups for j in range(g)], dtype=torch.long)
    return batch.select(rows)
