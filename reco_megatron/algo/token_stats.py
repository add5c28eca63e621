"""The per-token statistics of the next-token distribution that the losses consume."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenStats(NamedTuple):
    """Per-token statistics of ``p = softmax(logits)`` over the true vocabulary.

    All fields are fp32 tensors of the same shape as the targets (``[...]``, typically
    ``[B, T]`` or ``[T]``). Produced by :func:`reco_megatron.parallel.vocab_parallel_stats`
    from vocabulary-sharded logits, or by :func:`token_stats_reference` from full logits.
    """

    logprob: torch.Tensor
    """log p(target): log-probability of the sampled / given token."""
    entropy: torch.Tensor
    """H = -sum_v p_v log p_v, the entropy of the next-token distribution."""
    sum_p2: torch.Tensor
    """sum_v p_v^2; ``1 - sum_p2`` is the categorical (Gini) variance used by ReCo."""


def token_stats_reference(logits: torch.Tensor, target: torch.Tensor) -> TokenStats:
    """Straightforward full-vocabulary statistics (autograd through ``log_softmax``).

    ``logits [..., V]`` (already restricted to the true vocabulary), ``target [...]`` with ids
    in ``[0, V)``. Computed in the dtype of ``logits``: pass fp64 for a reference. Used by
    tests as the oracle and by single-process code paths that hold the full logits.
    """
    logp_all = torch.log_softmax(logits, dim=-1)
    p = logp_all.exp()
    logprob = logp_all.gather(-1, target.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(p * logp_all).sum(-1)
    sum_p2 = (p * p).sum(-1)
    return TokenStats(logprob=logprob, entropy=entropy, sum_p2=sum_p2)
