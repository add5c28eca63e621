"""Reduce per-micro-batch metric dicts over micro-batches and data-parallel ranks.

Keys follow ``reco_megatron.algo.metrics``: ``name/sum``, ``name/mean``, ``name/min``,
``name/max``, plus ``name/wsum`` (an already token-weighted sum). Across micro-batches and DP
ranks ``mean`` metrics are weighted by ``weight_key`` (the micro-batch's response-token
count), so the result is the mean over the global batch's tokens and does not depend on how the
batch was split; ``wsum`` is divided by the total weight. The returned dict has plain names
(``clip_frac``, ``entropy``), floats, plus ``loss`` = sum of loss numerators / sum of
denominators (the globally normalised loss the gradient belongs to).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from reco_megatron.parallel.collectives import collective_device


def _dp_group():
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return None
    return ps.get_data_parallel_group()


def reduce_metrics(
    parts: Sequence[Mapping[str, torch.Tensor]], weight_key: str, group: object = "dp"
) -> dict[str, float]:
    """Global metrics from this rank's micro-batch ``parts`` (collective over ``group``).

    ``group="dp"`` uses megatron's data-parallel group; ``None`` reduces locally only. Every
    rank of the group must call it with the same keys (an empty ``parts`` on every rank of
    the group returns ``{}`` without communicating).
    """
    if not parts:
        return {}
    if group == "dp":
        group = _dp_group()
    keys = sorted(parts[0])
    sums: dict[str, float] = {}
    mins: dict[str, float] = {}
    maxs: dict[str, float] = {}
    for part in parts:
        weight = float(part.get(weight_key, torch.ones(())))
        for key in keys:
            value = float(part[key])
            name, red = key.rsplit("/", 1)
            if red in ("sum", "wsum"):
                sums[key] = sums.get(key, 0.0) + value
            elif red == "mean":
                sums[key] = sums.get(key, 0.0) + value * weight
            elif red == "min":
                mins[key] = min(mins.get(key, value), value)
            elif red == "max":
                maxs[key] = max(maxs.get(key, value), value)
            else:
                raise ValueError(f"metric {key!r} has no known reduction suffix")
        sums["__weight__"] = sums.get("__weight__", 0.0) + weight
    reduced: dict[str, float] = {}
    for values, op in (
        (sums, dist.ReduceOp.SUM),
        (mins, dist.ReduceOp.MIN),
        (maxs, dist.ReduceOp.MAX),
    ):
        names = sorted(values)
        if not names:
            continue
        t = torch.tensor([values[n] for n in names], dtype=torch.float64)
        if group is not None and dist.get_world_size(group) > 1:
            t = t.to(collective_device(group))
            dist.all_reduce(t, op=op, group=group)
        reduced.update(zip(names, t.tolist(), strict=True))
    total_weight = reduced.pop("__weight__", 0.0)
    out: dict[str, float] = {}
    for key, value in reduced.items():
        name, red = key.rsplit("/", 1)
        if red in ("mean", "wsum"):
            out[name] = value / total_weight if total_weight > 0 else 0.0
        else:
            out[name] = value
    if "loss_numerator" in out and "loss_denominator" in out:
        out["loss"] = out["loss_numerator"] / max(out["loss_denominator"], 1.0)
    return out


def mismatch_sums(
    rollout_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    free_logprobs: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Rollout/trainer log-prob gap of one batch as ``wsum``/``max`` metrics (``[B, S]`` in):
    ``logprob_mismatch`` (mean of ``|mu - pi_old|`` over response tokens once reduced),
    ``logprob_mismatch_max`` and, given the log-probs of a pass without routing replay,
    ``logprob_mismatch_free``. With stale groups it is how far the behaviour policy mu is
    from the proximal one."""
    mu = rollout_logprobs.to(old_logprobs.dtype)
    diff = (mu - old_logprobs).abs() * mask
    out = {"logprob_mismatch/wsum": diff.sum(), "logprob_mismatch_max/max": diff.max()}
    if free_logprobs is not None:
        out["logprob_mismatch_free/wsum"] = ((mu - free_logprobs).abs() * mask).sum()
    return out
