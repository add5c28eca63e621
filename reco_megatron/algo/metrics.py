"""Detached loss metrics and the naming convention that says how each one reduces.

Every metric key ends in its reduction across micro-batches and ranks: ``"<name>/sum"``,
``"<name>/mean"``, ``"<name>/min"`` or ``"<name>/max"`` (e.g. ``"clip_frac_high/mean"``,
``"ratio_max/max"``). Values are detached 0-d fp32 tensors. ``mean`` metrics are means over
the local micro-batch; :func:`merge_metrics` averages them with equal weight per micro-batch
(exact only for equal token counts). The trainer instead uses
``reco_megatron.megatron.step.metrics.reduce_metrics``, which weights ``mean`` metrics by
each micro-batch's token count and all-reduces over data-parallel ranks, so its numbers do not
depend on the split. Quantile metrics (``p50``, ``p99``) reduce by ``mean`` as an
approximation; their ``max`` is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

REDUCTIONS: tuple[str, ...] = ("sum", "mean", "min", "max")


def reduction_of(key: str) -> str:
    """The reduction named by a metric key's suffix (``"kl/mean"`` -> ``"mean"``)."""
    suffix = key.rsplit("/", 1)[-1]
    if suffix not in REDUCTIONS:
        raise ValueError(f"metric key {key!r} must end in one of /{'|/'.join(REDUCTIONS)}")
    return suffix


def merge_metrics(parts: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine metric dicts of several micro-batches by each key's reduction (single process,
    ``mean`` unweighted). The token-weighted, data-parallel version the trainer uses is
    ``reco_megatron.megatron.step.metrics.reduce_metrics``.
    """
    collected: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for key, value in part.items():
            collected.setdefault(key, []).append(value.detach().float())
    out: dict[str, torch.Tensor] = {}
    for key, values in collected.items():
        stacked = torch.stack(values)
        red = reduction_of(key)
        if red == "sum":
            out[key] = stacked.sum()
        elif red == "mean":
            out[key] = stacked.mean()
        elif red == "min":
            out[key] = stacked.min()
        else:
            out[key] = stacked.max()
    return out


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is true (0 when nothing is selected). Shapes match."""
    maskb = mask.bool()
    total = torch.where(maskb, values, torch.zeros_like(values)).sum()
    return (total / maskb.sum().clamp(min=1)).detach().float()


def quantile_metrics(
    name: str, values: torch.Tensor, mask: torch.Tensor, qs: tuple[float, ...] = (0.5, 0.99)
) -> dict[str, torch.Tensor]:
    """``{name}_p50/mean``, ``{name}_p99/mean``, ``{name}_max/max`` of ``values[mask]``.

    ``values``, ``mask``: same shape (e.g. ``[B, T]``). An empty selection gives zeros.
    Non-finite values are kept for ``max`` and excluded from the quantiles.
    """
    selected = values.detach().float()[mask.bool()]
    out: dict[str, torch.Tensor] = {}
    finite = selected[torch.isfinite(selected)]
    for q in qs:
        key = f"{name}_p{round(q * 100):d}/mean"
        out[key] = torch.quantile(finite, q) if finite.numel() else torch.zeros(())
    out[f"{name}_max/max"] = selected.max() if selected.numel() else torch.zeros(())
    return out


def weight_metrics(
    weights: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Mean, min, max, effective sample size and active shares of the response weights.

    ``weights``: ``[B]`` per response or ``[B, T]`` per token (the prefix modes; then ``mask``
    ``[B, T]`` is required and mean/min/max/ESS are over response tokens). ESS =
    (sum w)^2 / (sum w^2) / n, in (0, 1]; 1 means uniform weights. ``weight_active``: the share
    of responses with ``w < 1`` (per token: on at least one of their tokens), i.e. where
    ReCo's response weight acts at all (``docs/loss.md``: for ``sequence`` at long lengths it
    is usually 0); ``weight_active_tokens``: the share of response tokens with ``w < 1`` (a
    per-response weight counts on every token of its response; needs ``mask``).
    """
    w = weights.detach().double()
    zero = torch.zeros(())  # every value below is returned as .float()
    out: dict[str, torch.Tensor] = {}
    if w.dim() == 2:
        if mask is None or mask.shape != w.shape:
            raise ValueError(f"per-token weights {tuple(w.shape)} need a mask of the same shape")
        maskb = mask.bool()
        flat = w[maskb]
        active_rows = ((w < 1.0) & maskb).any(dim=-1).double()
        out["weight_active/mean"] = (active_rows.mean() if w.shape[0] else zero).float()
    else:
        flat = w
        out["weight_active/mean"] = (zero if not w.numel() else (w < 1.0).double().mean()).float()
    if mask is not None:
        maskb = mask.bool()
        per_tok = w if w.dim() == 2 else w.unsqueeze(1).expand(maskb.shape)
        out["weight_active_tokens/mean"] = masked_mean((per_tok < 1.0).double(), maskb)
    n = max(flat.numel(), 1)
    sq = (flat * flat).sum()
    ess = (flat.sum() ** 2 / sq / n) if sq > 0 else zero
    empty = flat.numel() == 0
    out.update(
        {
            "weight_mean/mean": (zero if empty else flat.mean()).float(),
            "weight_min/min": (zero if empty else flat.min()).float(),
            "weight_max/max": (zero if empty else flat.max()).float(),
            "weight_ess/mean": ess.float(),
        }
    )
    return out
