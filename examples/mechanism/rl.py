"""One RL run of the mechanism experiment, driven by the project's own loss code.

The advantages, response weights, token ratios and the loss are
``reco_megatron.algo.group_advantages`` / ``response_weights`` / ``policy_loss`` exactly as the
trainer calls them (weights on complete groups before the mini-batch split, several
mini-batch updates per rollout batch so the token ratio acts from the second one); only the
policy (``task.Policy``) and the sampler replace the Megatron model and the rollout engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reco_megatron.algo import LossConfig, group_advantages, policy_loss, response_weights

try:  # run as a script (examples/mechanism on sys.path) or imported as a package module
    from task import Task, TaskSpec, make_policy, token_pool, valid_stats
except ImportError:  # pragma: no cover
    from examples.mechanism.task import Task, TaskSpec, make_policy, token_pool, valid_stats

# Every method has the same clip (DAPO's clip-higher, as examples/tiny_cpu.yaml) and no KL;
# they differ only in the response weight and the token ratio.
COMMON: dict[str, Any] = dict(eps_low=0.2, eps_high=0.28, kl_coef=0.0)
METHODS: dict[str, dict[str, str]] = {
    "grpo": dict(objective="ppo_clip", response_weight="none", token_ratio="importance"),
    "reco": dict(objective="reco", response_weight="sequence", token_ratio="bernoulli"),
    "weight_sequence": dict(objective="reco", response_weight="sequence", token_ratio="importance"),
    "weight_geometric": dict(
        objective="reco", response_weight="geometric", token_ratio="importance"
    ),
    "weight_empirical": dict(
        objective="reco", response_weight="empirical", token_ratio="importance"
    ),
    "token_only": dict(objective="reco", response_weight="none", token_ratio="bernoulli"),
}
"""Method name -> LossConfig fields. ``weight_*``: the response weight alone (importance ratio,
i.e. GRPO's gradient times w); ``token_only``: the Bernoulli token ratio alone."""

VARIANT_METHODS: dict[str, dict[str, str]] = {
    f"reco_{mode}": dict(objective="reco", response_weight=mode, token_ratio="bernoulli")
    for mode in ("prefix", "prefix_empirical", "geometric", "empirical")
}
"""ReCo (Bernoulli ratio) with another response weight: the methods of the length study
(``length.py``), which differ from ``reco`` (sequence weight) only in the weight."""

WEIGHT_VARIANTS = ("sequence", "geometric", "empirical", "prefix", "prefix_empirical")


@dataclass(kw_only=True)
class RunSpec:
    """The RL budget, identical for every method."""

    steps: int = 200
    """Rollout batches (each followed by ``minibatches`` optimizer steps)."""
    prompts_per_step: int = 8
    """Prompts per rollout batch (drawn without replacement, the same order for all methods)."""
    group_size: int = 8
    """G responses per prompt."""
    minibatches: int = 2
    """Optimizer steps per rollout batch, each on whole groups (as the trainer)."""
    lr: float = 1e-3
    """Adam learning rate of the RL phase."""
    eval_every: int = 10
    """Exact valid-answer statistics every this many rollout batches (and at 0 and the end)."""
    n_samples: int = 16
    """n of the expected number of distinct valid answers among n samples."""


def weight_activity(
    logp_old: torch.Tensor, responses: torch.Tensor, group_size: int, cfg: LossConfig
) -> dict[str, float]:
    """Share of responses (``w_lt1_<mode>``: w < 1 on at least one token) and of tokens
    (``w_lt1_tok_<mode>``) with w < 1 under each response-weight variant, on the same batch."""
    mask = torch.ones_like(logp_old)
    out = {}
    for mode in WEIGHT_VARIANTS:
        w = response_weights(
            logp_old,
            mask,
            group_size,
            mode,
            response_ids=responses,
            w_min=cfg.geometric_w_min,
            w_max=cfg.geometric_w_max,
        )
        active = w < 1.0 - 1e-6  # [N] or [N, L]
        per_tok = active if active.dim() == 2 else active.unsqueeze(1).expand_as(mask)
        out[f"w_lt1_{mode}"] = float(per_tok.any(dim=1).float().mean())
        out[f"w_lt1_tok_{mode}"] = float(per_tok.float().mean())
    return out


def run_one(
    method: str, seed: int, spec: TaskSpec, run: RunSpec, start: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Train ``method`` from the SFT state ``start`` of seed ``seed``; returns the curves.

    The same seed gives every method the same task, start, prompt order and sampler seeds.
    """
    task = Task(spec, seed)
    torch.manual_seed(seed)
    policy = make_policy(spec)
    policy.load_state_dict(start)
    cfg = LossConfig(**COMMON, **{**METHODS, **VARIANT_METHODS}[method])
    opt = torch.optim.Adam(policy.parameters(), lr=run.lr)
    g_prompts = torch.Generator().manual_seed(10_000 + seed)
    g_sample = torch.Generator().manual_seed(20_000 + seed)
    G, B = run.group_size, run.prompts_per_step
    per_mb = B // run.minibatches * G
    curves: dict[str, list[float]] = {"step": []}
    window: dict[str, list[float]] = {}

    def record(step: int) -> None:
        curves["step"].append(step)
        for k, v in valid_stats(policy, task, run.n_samples).items():
            curves.setdefault(k, []).append(v)
        for k, vs in window.items():  # training-batch metrics, averaged since the last record
            curves.setdefault(k, []).append(sum(vs) / len(vs) if vs else float("nan"))
            vs.clear()

    order = torch.zeros(0, dtype=torch.long)
    for step in range(run.steps):
        if step % run.eval_every == 0:
            record(step)
        if order.numel() < B:
            order = torch.cat([order, torch.randperm(spec.prompts, generator=g_prompts)])
        chosen, order = order[:B], order[B:]
        prompts = chosen.repeat_interleave(G)
        responses, logp_old, _ = policy.sample(prompts, g_sample)
        rewards = task.reward(prompts, responses)
        adv, _ = group_advantages(rewards, G, cfg.advantage_mode, eps=cfg.advantage_eps)
        mask = torch.ones_like(logp_old)
        weights = None
        if cfg.response_weight != "none":
            weights = response_weights(
                logp_old,
                mask,
                G,
                cfg.response_weight,
                response_ids=responses,
                w_min=cfg.geometric_w_min,
                w_max=cfg.geometric_w_max,
            )
        stats = {"reward": float(rewards.mean()), **weight_activity(logp_old, responses, G, cfg)}
        for i in range(run.minibatches):
            sl = slice(i * per_mb, (i + 1) * per_mb)
            logp = policy.token_logp(prompts[sl], responses[sl])
            loss, metrics = policy_loss(
                logp,
                logp_old[sl],
                adv[sl],
                mask[sl],
                cfg,
                weights=None if weights is None else weights[sl],
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            stats[f"clip_frac_mb{i}"] = float(metrics["clip_frac/mean"])
        for k, v in stats.items():
            window.setdefault(k, []).append(v)
    record(run.steps)
    pool = token_pool(policy, G, seed)
    return {"method": method, "seed": seed, "curves": curves, "pool": pool.tolist()}
