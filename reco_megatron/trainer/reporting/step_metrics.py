"""The numbers of one RL step: per-rank rollout counters and the global ``metrics.jsonl`` row."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from reco_megatron.algo import diversity_metrics, pass_at_k
from reco_megatron.parallel.collectives import collective_device
from reco_megatron.parallel.layout import RankLayout
from reco_megatron.rollout.requests import Completion


def rollout_counters(
    rewards: torch.Tensor, completions: list[list[Completion]], g: int
) -> dict[str, float]:
    """This DP rank's rollout counters, as sums (``*_sum``) and counts, so that summing them
    over DP ranks and dividing gives the global means. ``rewards``: ``[n_groups * g]``."""
    responses = [c.token_ids for group in completions for c in group]
    grouped = rewards.view(-1, g)
    correct = (grouped >= 1.0).sum(dim=1).tolist()
    out: dict[str, float] = {
        "reward_sum": float(rewards.sum()),
        "reward_nonzero_sum": float((rewards != 0).sum()),
        "num_responses": float(len(responses)),
        "response_len_sum": float(sum(len(r) for r in responses)),
        "truncated_sum": float(
            sum(c.finish_reason == "length" for grp in completions for c in grp)
        ),
        "num_groups": float(len(correct)),
        # groups whose G rewards are all equal: their advantages are 0 (algo.group_advantages)
        "zero_adv_groups": float((grouped.amax(dim=1) == grouped.amin(dim=1)).sum()),
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


class MetricsSource(Protocol):
    """What a step's row needs of the training engine (``ReCoEngine``)."""

    def broadcast_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last pipeline stage's ``metrics`` on every rank (collective)."""
        ...


UPDATE_METRICS: tuple[tuple[str, str, str], ...] = (
    # (engine metric, metrics.jsonl column, reduction over the optimizer updates of a step)
    ("loss", "loss", "mean"),
    ("entropy", "entropy_mean", "mean"),
    ("clip_frac", "clip_frac", "mean"),
    ("clip_frac_c", "clip_frac_c", "mean"),
    ("weight_mean", "weight_mean", "mean"),
    ("weight_ess", "weight_ess", "mean"),
    ("weight_active", "weight_active", "mean"),
    ("weight_active_tokens", "weight_active_tokens", "mean"),
    ("grad_norm", "grad_norm", "mean"),
    ("grad_norm", "grad_norm_max", "max"),
    ("kl_old_new", "kl_old_new", "mean"),
    ("tis_weight", "tis_weight_mean", "mean"),
    ("tis_clip_frac", "tis_clip_frac", "mean"),
    ("token_ratio_max", "token_ratio_max", "max"),
    ("ratio_max", "ratio_max", "max"),
    ("lr", "lr", "mean"),
    ("update_skipped", "updates_skipped", "sum"),
)
"""How each per-update engine metric becomes one number per RL step: ``mean`` over the
updates, ``max`` (a maximum stays a maximum: the first update of a rollout batch always has
r = c = 1, so a mean would halve a spike) or ``sum`` (counts). A metric absent from every
update is NaN (e.g. ``weight_mean`` without response weights, ``tis_*`` without
``loss.tis_cap``)."""


def combine_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """One step's columns from the global metrics of its optimizer updates (in order),
    by :data:`UPDATE_METRICS`. NaN values (e.g. ``grad_norm`` of a skipped update) are
    ignored by ``mean`` and ``max``; a metric that is NaN in every update is NaN."""
    out: dict[str, float] = {}
    for name, column, reduction in UPDATE_METRICS:
        values = [float(m[name]) for m in updates if name in m]
        finite = [v for v in values if not math.isnan(v)]
        if reduction == "sum":
            out[column] = float(sum(values))
        elif not finite:
            out[column] = float("nan")
        elif reduction == "max":
            out[column] = max(finite)
        else:
            out[column] = sum(finite) / len(finite)
    return out


def global_row(
    step: int,
    local: dict[str, float],
    steps: list[dict[str, float]],
    prep: dict[str, float],
    reward_metrics: dict[str, float],
    adv_metrics: dict[str, Any],
    engine: MetricsSource,
    layout: RankLayout,
) -> dict[str, Any]:
    """One ``metrics.jsonl`` row: the rollout counters summed over DP ranks (collective over
    ``layout.dp_group``), the engine's per-update metrics (already global, broadcast from the
    last stage) combined over the updates of this step (:func:`combine_updates`), and the
    parse failures of the responses."""
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
        "reward_nonzero_frac": s["reward_nonzero_sum"] / n,
        "response_len_mean": s["response_len_sum"] / n,
        "truncated_frac": s["truncated_sum"] / n,
        "unique_frac": s["unique_frac_sum"] / groups,
        # replicas whose model-parallel ranks got different tokens from their engines
        # (trainer/orchestration/agreement.py); 0 with the embedded and megatron engines
        "rollout_mp_divergence": s.get("rollout_mp_divergence_sum", 0.0),
    }
    for key in keys:
        if key.startswith("pass@"):
            row[key.removesuffix("_sum")] = s[key] / groups
    row.update(episode_columns(s))
    last = [engine.broadcast_metrics(m) for m in steps]
    prep = engine.broadcast_metrics(prep)
    row.update(combine_updates(last))
    row["logprob_mismatch"] = prep.get("logprob_mismatch", float("nan"))
    row.update(moe_columns(prep, last))
    # over every DP rank's groups (the advantage metrics are this rank's): the same on every
    # rank, so the no-signal guard decides alike everywhere
    row["zero_adv_frac"] = s["zero_adv_groups"] / groups
    row.update(step_batching_metrics(prep, last))  # pad_frac, micro-batches, DP balance
    for key, value in reward_metrics.items():
        # failures of the reward function: reward_health's reward_fail_* (global counts)
        if key == "reward/parse_failures/sum":
            row["reward_parse_failures"] = value
    return row


def episode_columns(sums: dict[str, float]) -> dict[str, float]:
    """Multi-turn episodes' columns from the ``env_*`` counters summed over ranks (none for
    single-turn runs): turns, tool calls and length per episode, the share of episode tokens
    the environment wrote (``env_observation_frac``), and counts of episodes that hit
    ``max_turns`` or the token budget and of failed environment calls by kind
    (``env_error``, ``env_timeout``, ``env_crash``, ...; each such episode scores 0)."""
    if "env_episodes" not in sums:
        return {}
    episodes = max(sums["env_episodes"], 1.0)
    row = {
        "env_turns_mean": sums["env_turns_sum"] / episodes,
        "env_tool_calls_mean": sums["env_tool_calls_sum"] / episodes,
        "env_episode_len_mean": sums["env_episode_len_sum"] / episodes,
        "env_observation_frac": sums["env_observation_tokens_sum"]
        / max(sums["env_episode_len_sum"], 1.0),
    }
    for key, value in sums.items():
        if key.startswith("env_") and key.endswith("_sum") and key not in (
            "env_turns_sum", "env_tool_calls_sum", "env_episode_len_sum",
            "env_observation_tokens_sum",
        ):  # fmt: skip
            row[key.removesuffix("_sum")] = value
    return row


WALL_CLOCK_PREFIXES = ("time_",)
"""Columns that measure wall-clock time: ``time_*`` (seconds per phase) and the ones below."""
WALL_CLOCK_COLUMNS = (
    "tokens_per_s",
    "weight_push_s",
    "trainer_wait_s",
    "worker_idle_s",
    "worker_generate_s",
)
"""Wall-clock columns without the prefix: throughput and the separate placement's waits.
Two runs of the same seeds agree on every other column (resume, faults, layouts compare so)."""


def is_wall_clock(column: str) -> bool:
    """Whether a ``metrics.jsonl`` column measures wall-clock time (varies run to run)."""
    return column.startswith(WALL_CLOCK_PREFIXES) or column in WALL_CLOCK_COLUMNS


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
            row[key] = sum(values) / len(values)
    worst = [m["moe_load_imbalance_max"] for m in steps if "moe_load_imbalance_max" in m]
    if worst:
        row["moe_load_imbalance_max"] = max(worst)
    return row


def step_batching_metrics(prep: dict[str, float], updates: Sequence[dict]) -> dict[str, float]:
    """The micro-batching columns of one step's ``metrics.jsonl`` row, from the engine's global
    metrics of the old-policy pass (``prep``) and of each update:

    * ``pad_frac``: share of the positions computed in the old-policy pass and the updates
      that are padding;
    * ``microbatches_per_rank``: micro-batches per rank per optimizer step (the same on every
      data-parallel rank);
    * ``dp_tokens_max`` / ``dp_tokens_min``: positions computed per optimizer step on the
      busiest and the idlest data-parallel rank;
    * ``balance_tokens_*``: needed tokens per rank before (``_before``) and after the groups
      were balanced, when they were.
    """
    computed = prep.get("old_tokens_computed", 0.0) + sum(
        m.get("tokens_computed", 0.0) for m in updates
    )
    real = prep.get("old_tokens_real", 0.0) + sum(m.get("tokens_real", 0.0) for m in updates)
    out = {"pad_frac": 1.0 - real / computed if computed else float("nan")}
    for key, name in (
        ("microbatches", "microbatches_per_rank"),
        ("rank_tokens_max", "dp_tokens_max"),
        ("rank_tokens_min", "dp_tokens_min"),
    ):
        values = [m[key] for m in updates if key in m]
        out[name] = sum(values) / len(values) if values else float("nan")
    out.update({k: v for k, v in prep.items() if k.startswith("balance_tokens_")})
    return out
