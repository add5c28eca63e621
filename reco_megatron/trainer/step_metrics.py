"""The numbers of one RL step: per-rank rollout counters and the global ``metrics.jsonl`` row."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.algo import diversity_metrics, pass_at_k
from reco_megatron.megatron.device import collective_device
from reco_megatron.megatron.microbatching import step_batching_metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def rollout_counters(
    rewards: torch.Tensor, completions: list[list[Any]], g: int
) -> dict[str, float]:
    """This DP rank's rollout counters, as sums (``*_sum``) and counts, so that summing them
    over DP ranks and dividing gives the global means. ``rewards``: ``[n_groups * g]``."""
    responses = [c.token_ids for group in completions for c in group]
    correct = (rewards >= 1.0).view(-1, g).sum(dim=1).tolist()
    out: dict[str, float] = {
        "reward_sum": float(rewards.sum()),
        "num_responses": float(len(responses)),
        "response_len_sum": float(sum(len(r) for r in responses)),
        "truncated_sum": float(
            sum(c.finish_reason == "length" for grp in completions for c in grp)
        ),
        "num_groups": float(len(correct)),
    }
    k = 1
    while k <= g:
        out[f"pass@{k}_sum"] = float(pass_at_k([g] * len(correct), correct, k).sum())
        k *= 2
    unique = [
        diversity_metrics([tuple(c.token_ids) for c in grp])["unique_frac"] for grp in completions
    ]
    out["unique_frac_sum"] = float(sum(unique))
    return out


def global_row(
    step: int,
    local: dict[str, float],
    steps: list[dict[str, float]],
    prep: dict[str, float],
    reward_metrics: dict[str, float],
    adv_metrics: dict[str, Any],
    engine: Any,
    layout: Any,
) -> dict[str, Any]:
    """One ``metrics.jsonl`` row: the rollout counters summed over DP ranks (collective over
    ``layout.dp_group``), the engine's per-update metrics (already global, broadcast from the
    last stage) averaged over the updates of this step, and the parse failures of the responses."""
    keys = sorted(local)
    t = torch.tensor([local[k] for k in keys], dtype=torch.float64)
    t = t.to(collective_device(layout.dp_group))
    dist.all_reduce(t, group=layout.dp_group)
    t = t.cpu()
    s = dict(zip(keys, t.tolist(), strict=True))
    n, groups = max(s["num_responses"], 1.0), max(s["num_groups"], 1.0)
    row: dict[str, Any] = {
        "step": step,
        "reward_mean": s["reward_sum"] / n,
        "response_len_mean": s["response_len_sum"] / n,
        "truncated_frac": s["truncated_sum"] / n,
        "unique_frac": s["unique_frac_sum"] / groups,
        # replicas whose model-parallel ranks got different tokens from their engines
        # (trainer/rollout_agreement.py); 0 with the embedded and megatron engines
        "rollout_mp_divergence": s.get("rollout_mp_divergence_sum", 0.0),
    }
    for key in keys:
        if key.startswith("pass@"):
            row[key.removesuffix("_sum")] = s[key] / groups
    last = [engine.broadcast_metrics(m) for m in steps]
    prep = engine.broadcast_metrics(prep)
    for name, out in (
        ("loss", "loss"),
        ("entropy", "entropy_mean"),
        ("clip_frac", "clip_frac"),
        ("weight_mean", "weight_mean"),
        ("weight_ess", "weight_ess"),
        ("weight_active", "weight_active"),
        ("grad_norm", "grad_norm"),
        ("kl_old_new", "kl_old_new"),
        ("token_ratio_max", "token_ratio_max"),
        ("ratio_max", "ratio_max"),
        ("lr", "lr"),
    ):
        row[out] = _mean([m[name] for m in last if name in m])
    row["logprob_mismatch"] = prep.get("logprob_mismatch", float("nan"))
    row.update(moe_columns(prep, last))
    row["updates_skipped"] = sum(m.get("update_skipped", 0.0) for m in last)
    row["zero_adv_frac"] = float(adv_metrics.get("zero_adv_frac/mean", float("nan")))
    row.update(step_batching_metrics(prep, last))  # pad_frac, micro-batches, DP balance
    for key, value in reward_metrics.items():
        # failures of the reward function: reward_health's reward_fail_* (global counts)
        if key == "reward/parse_failures/sum":
            row["reward_parse_failures"] = value
    return row


MOE_PREP = ("routing_mismatch", "routing_mismatch_layer", "logprob_mismatch_free")
"""Old-policy pass columns of mixture-of-experts runs with routing replay/record."""
MOE_STEPS = ("moe_load_imbalance", "moe_dropped_frac", "moe_aux_loss")
"""Per-update router columns of mixture-of-experts runs (mean over the step's updates)."""


def moe_columns(prep: dict[str, float], steps: list[dict[str, float]]) -> dict[str, float]:
    """The router columns of a ``metrics.jsonl`` row (none for dense models):
    ``moe_load_imbalance_max`` is the maximum over the step's updates, the others means."""
    row = {key: prep[key] for key in MOE_PREP if key in prep}
    for key in MOE_STEPS:
        values = [m[key] for m in steps if key in m]
        if values:
            row[key] = _mean(values)
    worst = [m["moe_load_imbalance_max"] for m in steps if "moe_load_imbalance_max" in m]
    if worst:
        row["moe_load_imbalance_max"] = max(worst)
    return row
