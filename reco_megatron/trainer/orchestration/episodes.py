"""Multi-turn episodes in a colocated run: the environment pool and one step's episodes.

With ``rollout.env`` set, every response of a step is an episode
(:func:`reco_megatron.envs.run_episodes`) driven on the run's engine with the run's sampling
(per-prompt seeds, ``max_new_tokens`` as the whole episode's budget); the environments live in
``rollout.env_workers`` isolated workers for the whole run.
"""

from __future__ import annotations

from dataclasses import replace

from reco_megatron.data.tokenizer import Tokenizer
from reco_megatron.envs import EnvPool, EpisodeResult, run_episodes
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
