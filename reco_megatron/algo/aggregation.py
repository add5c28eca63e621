"""How per-token losses ``[B, T]`` become one batch's share of the global loss."""

from __future__ import annotations

import torch

from reco_megatron.algo.config import AGGREGATIONS


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    global_num_tokens: float | torch.Tensor | None = None,
    global_num_seqs: float | torch.Tensor | None = None,
    loss_normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses ``[B, T]`` to this batch's contribution to the global loss.

    - ``token_mean``: ``sum_{i,t} m l / N_tok``;
    - ``seq_mean_token_mean``: ``sum_i (sum_t m l / max(1, n_i)) / N_seq``;
    - ``seq_mean_token_sum_norm``: ``sum_i (sum_t m l / loss_normalizer) / N_seq``.

    ``N_tok`` / ``N_seq`` are the token / sequence counts of the *global* batch (all
    micro-batches of one optimizer step on all data-parallel ranks); with them the sum of the
    returned values over micro-batches equals the full-batch loss, so the gradient does not
    depend on the split. ``None`` uses the local counts (``mask.sum()`` clamped to >= 1, and
    ``B``). Masked positions may hold any value, including inf/NaN: they are zeroed by ``where``.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    if per_token.dim() != 2 or mask.shape != per_token.shape:
        raise ValueError(
            f"per_token and mask must both be [B, T], got {tuple(per_token.shape)} and "
            f"{tuple(mask.shape)}: the sequence modes reduce over the last axis per row"
        )
    maskb = mask.bool()
    lt = torch.where(maskb, per_token, torch.zeros_like(per_token))
    if mode == "token_mean":
        denom = global_num_tokens if global_num_tokens is not None else maskb.sum().clamp(min=1)
        return lt.sum() / denom
    n_seq = global_num_seqs if global_num_seqs is not None else max(per_token.shape[0], 1)
    if mode == "seq_mean_token_mean":
        lengths = maskb.sum(dim=-1).clamp(min=1)  # int64; the division promotes to lt's dtype
        return (lt.sum(dim=-1) / lengths).sum() / n_seq
    if loss_normalizer is None or not loss_normalizer > 0:
        raise ValueError(
            f"seq_mean_token_sum_norm needs loss_normalizer > 0, got {loss_normalizer}: pass "
            "the maximum response length in tokens"
        )
    # sum_i (sum_t m l / loss_normalizer) / N_seq: the normaliser is one constant for all rows
    return lt.sum() / loss_normalizer / n_seq
