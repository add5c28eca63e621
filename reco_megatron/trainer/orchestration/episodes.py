"""Multi-turn episodes in a colocated run: the environment pool and one step's episodes.

With ``rollout.env`` set, every response of a step is an episode
(:func:`reco_megatron.envs.run_episodes`) driven on the run's engine with the run's sampling
(per-prompt seeds, ``max_new_tokens`` as the whole episode's budget); the environments live in
``rollout.env_workers`` isolated workers for the whole run. With model parallelism only the
first rank of each model-parallel group runs environments and every call's outcomes are
broadcast to its group (:class:`SharedEnvPool`): every rank then drives the same episodes and
makes the same engine calls (collective for the megatron engine), even when an environment
times out or fails on one call and not on another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from reco_megatron.data.tokenizer import Tokenizer
from reco_megatron.envs import EnvPool, EnvSettings, EpisodeResult, EpisodeService, Outcome
from reco_megatron.parallel.collectives import collective_device
from reco_megatron.rollout.requests import (
    Completion,
    SamplingArg,
    SamplingParams,
    per_prompt_sampling,
)
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.orchestration.sync import RolloutClient


class SharedEnvPool:
    """An :class:`EnvPool` on the first rank of ``group`` whose outcomes every rank of the
    group gets (collective: every rank calls :meth:`reset` and :meth:`step` alike). A call
    that raises on the first rank raises on every rank."""

    def __init__(self, pool: EnvPool | None, group: Any) -> None:
        self.pool = pool
        self.group = group

    def _shared(self, call: Any) -> dict[int, Outcome]:
        box: list[Any] = [None]
        if self.pool is not None:
            try:
                box = [("ok", call())]
            except Exception as exc:
                box = [("error", f"{type(exc).__name__}: {exc}")]
        device = collective_device(self.group)
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(self.group, 0), group=self.group, device=device
        )
        kind, value = box[0]
        if kind != "ok":
            raise RuntimeError(f"the environment pool of this model-parallel group failed: {value}")
        return value

    def reset(self, rows: dict[int, dict[str, Any]]) -> dict[int, Outcome]:
        return self._shared(lambda: self.pool.reset(rows))  # type: ignore[union-attr]

    def step(self, actions: dict[int, tuple[list[int], str]]) -> dict[int, Outcome]:
        return self._shared(lambda: self.pool.step(actions))  # type: ignore[union-attr]

    def release(self, eids: list[int]) -> None:
        if self.pool is not None:
            self.pool.release(eids)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def env_settings(cfg: TrainConfig, tokenizer: Tokenizer) -> EnvSettings:
    """The run's environment settings (what the trainer and a separate worker run with)."""
    r = cfg.rollout
    return EnvSettings(
        env=r.env,
        max_turns=r.max_turns,
        env_workers=r.env_workers,
        step_timeout_s=float(r.env_step_timeout_s),
        turn_discount=float(r.turn_discount),
        memory_limit_mb=cfg.reward.memory_limit_mb,
        tokenizer=cfg.data.tokenizer,
        vocab_size=tokenizer.vocab_size,
    )


def env_pool(settings: EnvSettings, group: Any = None) -> EnvPool | SharedEnvPool:
    """The run's environment workers; with a model-parallel ``group`` of more than one rank,
    on its first rank only, shared with the group (:class:`SharedEnvPool`)."""
    shared = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    if shared and dist.get_rank(group) != 0:
        return SharedEnvPool(None, group)
    pool = settings.pool()
    return SharedEnvPool(pool, group) if shared else pool


class EpisodeDriver:
    """The run's environment pool and the episodes of each step (on every rank that
    generates; ``group``: the model-parallel group, whose first rank runs the environments)."""

    def __init__(
        self, cfg: TrainConfig, tokenizer: Tokenizer, client: RolloutClient, group: Any = None
    ) -> None:
        self.client = client
        settings = env_settings(cfg, tokenizer)
        self.service = EpisodeService(settings, env_pool(settings, group))

    def run(self, rows: list[dict], n: int, seeds: list[int]) -> EpisodeResult:
        """``n`` episodes of each row, row ``i`` seeded with ``seeds[i]``."""
        params = [replace(self.client.sampling, seed=seed) for seed in seeds]
        return self.run_params(rows, n, params)

    def run_params(self, rows: list[dict], n: int, params: list[SamplingParams]) -> EpisodeResult:
        """``n`` episodes of each row with its own sampling settings."""
        return self.service.run(self.client.engine.generate, rows, n, params)

    def close(self) -> None:
        self.service.close()


class EpisodeEngine:
    """The run's engine seen through its environment, for the held-out evaluation
    (``eval.interval``): ``generate`` returns whole episodes, so pass@k measures the policy
    with its tool. The rows it gives ``reset`` hold only ``prompt_ids`` (``prompt`` and
    ``answer`` are empty: the evaluation passes token ids)."""

    def __init__(self, driver: EpisodeDriver) -> None:
        self.driver = driver

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingArg
    ) -> list[list[Completion]]:
        params = per_prompt_sampling(prompt_token_ids, sampling)
        rows = [{"prompt": "", "answer": "", "prompt_ids": list(p)} for p in prompt_token_ids]
        return self.driver.run_params(rows, n, params).completions
