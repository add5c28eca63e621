"""Multi-turn episodes in a colocated run: the environment pool and one step's episodes.

With ``rollout.env`` set, every response of a step is an episode
(:func:`reco_megatron.envs.run_episodes`) driven on the run's engine with the run's sampling
(per-prompt seeds, ``max_new_tokens`` as the whole episode's budget); the environments live in
``rollout.env_workers`` isolated workers for the whole run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from reco_megatron.data.tokenizer import Tokenizer
from reco_megatron.envs import EnvPool, EpisodeResult, run_episodes
from reco_megatron.rollout.requests import (
    Completion,
    SamplingArg,
    SamplingParams,
    per_prompt_sampling,
)
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.orchestration.sync import RolloutClient


class EpisodeDriver:
    """The run's environment pool and the episodes of each step (on every rank that
    generates)."""

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, client: RolloutClient) -> None:
        r = cfg.rollout
        self.cfg = cfg
        self.client = client
        self.pool = EnvPool(
            r.env,
            num_workers=r.env_workers,
            step_timeout_s=r.env_step_timeout_s,
            memory_limit_mb=cfg.reward.memory_limit_mb,
            tokenizer=cfg.data.tokenizer,
            vocab_size=tokenizer.vocab_size,
        )
        self.next_id = 0

    def run(self, rows: list[dict], n: int, seeds: list[int]) -> EpisodeResult:
        """``n`` episodes of each row, row ``i`` seeded with ``seeds[i]``."""
        params = [replace(self.client.sampling, seed=seed) for seed in seeds]
        return self.run_params(rows, n, params)

    def run_params(self, rows: list[dict], n: int, params: list[SamplingParams]) -> EpisodeResult:
        """``n`` episodes of each row with its own sampling settings."""
        r = self.cfg.rollout
        result = run_episodes(
            self.client.engine.generate,
            self.pool,
            rows,
            n,
            params,
            max_turns=r.max_turns,
            turn_discount=r.turn_discount,
            first_id=self.next_id,
        )
        self.next_id += len(rows) * n
        return result

    def close(self) -> None:
        self.pool.close()


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
