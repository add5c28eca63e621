"""Where a step's groups come from: the colocated engine or the separate workers.

The loop asks its source for each step's groups (:meth:`RolloutSource.next_step`), lets it
free memory for the update (:meth:`RolloutSource.before_update`) and hands it the new weights
after (:meth:`RolloutSource.after_update`). :class:`ColocatedRollout` generates on this rank
with the current weights; :class:`~reco_megatron.trainer.orchestration.separate.SeparateRollout`
receives groups the workers generated while the trainer trained. Both draw the prompts from
the trainer's one sampler and seed each prompt by ``(trainer.seed, step, group)``, so the same
step samples the same responses wherever it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from reco_megatron.data.chat import PromptFormatter
from reco_megatron.data.dataset import PromptDataset
from reco_megatron.data.sampler import PromptSampler
from reco_megatron.data.tokenizer import Tokenizer
from reco_megatron.parallel.batch import data_parallel_groups
from reco_megatron.parallel.layout import RankLayout
from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.requests import Completion
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.trainer.orchestration.agreement import agree_on_completions
from reco_megatron.trainer.orchestration.sync import RolloutClient

if TYPE_CHECKING:
    from reco_megatron.trainer.orchestration.episodes import EpisodeDriver


def prompt_seed(seed: int, step: int, group: int) -> int:
    """The sampling seed of global group ``group`` of RL step ``step`` (0-based steps done)."""
    return hash((seed, step, group)) % (2**31)


@dataclass
class StepRollout:
    """One step's groups as this data-parallel rank trains on them."""

    indices: list[int]
    """Dataset indices of the step's prompts (all groups, global order)."""
    prompts: list[list[int]]
    """This rank's prompts' token ids."""
    completions: list[list[Completion]]
    """This rank's groups: ``completions[i][j]`` is response ``j`` to ``prompts[i]``."""
    golds: list[str]
    """This rank's reference answers."""
    diverged: bool = False
    """The model-parallel ranks' engines had disagreed (colocated, per-stage engines)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The source's columns of the step's ``metrics.jsonl`` row (the same on every rank)."""
    turn_rewards: list[list[float]] | None = None
    """Multi-turn episodes: ``[groups][G]`` the discounted sum of the per-turn rewards."""
    failed: list[list[bool]] | None = None
    """Multi-turn episodes: ``[groups][G]`` an environment call failed (the episode scores 0)."""
    counters: dict[str, float] = field(default_factory=dict)
    """This rank's ``env_*`` counters (summed over data-parallel ranks in the step's row)."""

    def episode_rewards(self, rewards: torch.Tensor) -> torch.Tensor:
        """The rewards ``[groups * G]`` of the reward function plus the per-turn rewards,
        0 where an environment failed (single-turn: ``rewards`` unchanged)."""
        if self.turn_rewards is None or self.failed is None:
            return rewards
        turn = torch.tensor([r for grp in self.turn_rewards for r in grp], dtype=rewards.dtype)
        failed = torch.tensor([f for grp in self.failed for f in grp], dtype=torch.bool)
        return torch.where(failed, torch.zeros_like(rewards), rewards + turn)


class RolloutSource(Protocol):
    """What the loop needs of a source of groups."""

    def start(self, step: int) -> None:
        """The weights of ``step`` are ready: send them, begin generating."""

    def next_step(self, step: int) -> StepRollout:
        """The groups step ``step + 1`` trains on (collective)."""

    def before_update(self) -> None:
        """The update begins (free rollout memory where it is shared)."""

    def after_update(self, version: int) -> dict[str, float]:
        """The weights of ``version`` are trained: hand them on; returns timing columns."""

    def sampler_state(self) -> dict[str, Any]:
        """The sampler position a resume starts from (the first step not yet trained)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @property
    def engine(self) -> RolloutEngine:
        """An engine to evaluate with, at the current weights (rank 0)."""

    def close(self) -> None: ...


@dataclass
class StepPrompts:
    """A step's prompts as the sampler drew them."""

    indices: list[int]
    sampler_before: dict[str, Any]
    """The sampler's state before drawing them (what a checkpoint taken before the step
    stores, so a resume draws them again)."""


class PromptSource:
    """The run's prompts: dataset records, their formatted token ids and their groups."""

    def __init__(
        self,
        cfg: TrainConfig,
        dataset: PromptDataset,
        tokenizer: Tokenizer,
        formatter: PromptFormatter,
        sampler: PromptSampler,
    ) -> None:
        self.cfg = cfg
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.formatter = formatter
        self.sampler = sampler

    def draw(self) -> StepPrompts:
        before = self.sampler.state_dict()
        return StepPrompts(self.sampler.next_batch(), before)

    def rows(self, indices: list[int], groups: list[int]) -> list[dict[str, Any]]:
        """What an environment's ``reset`` reads for ``groups``: the record's ``prompt`` and
        ``answer`` and the formatted ``prompt_ids``."""
        prompts, _ = self.encode(indices, groups)
        records = [self.dataset[indices[g]] for g in groups]
        return [
            {"prompt": rec.prompt, "answer": rec.answer, "prompt_ids": ids}
            for rec, ids in zip(records, prompts, strict=True)
        ]

    def encode(self, indices: list[int], groups: list[int]) -> tuple[list[list[int]], list[str]]:
        """Token ids and gold answers of ``groups`` (positions in ``indices``)."""
        records = [self.dataset[indices[g]] for g in groups]
        prompts = [self.tokenizer.encode(self.formatter.format(rec.prompt)) for rec in records]
        return prompts, [rec.answer for rec in records]

    def mine(self, num_groups: int, dp_rank: int, dp_size: int) -> list[int]:
        return data_parallel_groups(
            num_groups, dp_rank, dp_size, self.cfg.update.minibatches_per_rollout
        )


class ColocatedRollout:
    """Generate on this rank, with the current weights, between updates.

    ``sync`` streams the policy's current weights into ``client``'s engine (collective;
    :func:`~reco_megatron.trainer.orchestration.engines.sync_weights` bound to the run's engine)."""

    def __init__(
        self,
        cfg: TrainConfig,
        client: RolloutClient,
        sync: Callable[[], None],
        prompts: PromptSource,
        layout: RankLayout,
        episodes: EpisodeDriver | None = None,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.sync = sync
        self.prompts = prompts
        self.layout = layout
        self.episodes = episodes
        """Multi-turn episodes (``rollout.env``), else None."""

    def start(self, step: int) -> None:
        self.sync()

    def next_step(self, step: int) -> StepRollout:
        drawn = self.prompts.draw()
        mine = self.prompts.mine(len(drawn.indices), self.layout.dp_rank, self.layout.dp_size)
        prompts, golds = self.prompts.encode(drawn.indices, mine)
        seeds = [prompt_seed(self.cfg.trainer.seed, step, g) for g in mine]
        if self.episodes is not None:
            rows = self.prompts.rows(drawn.indices, mine)
            got = self.episodes.run(rows, self.cfg.rollout.group_size, seeds)
            completions, diverged = agree_on_completions(got.completions, self.layout.mp_group)
            return StepRollout(
                drawn.indices, got.prompts, completions, golds, diverged,
                turn_rewards=got.turn_rewards, failed=got.failed, counters=got.metrics,
            )  # fmt: skip
        completions = self.client.generate_seeded(prompts, self.cfg.rollout.group_size, seeds)
        completions, diverged = agree_on_completions(completions, self.layout.mp_group)
        return StepRollout(drawn.indices, prompts, completions, golds, diverged)

    def before_update(self) -> None:
        self.client.sleep()  # vLLM frees its memory for the update; sync_weights wakes it

    def after_update(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        self.sync()
        return {"time_sync": time.perf_counter() - start}

    def sampler_state(self) -> dict[str, Any]:
        return self.prompts.sampler.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return self.client.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("placement") == "separate":
            return  # a separate run's in-flight record: nothing for a colocated engine
        self.client.load_state_dict(state)

    @property
    def engine(self) -> RolloutEngine:
        if self.episodes is not None:  # the evaluation runs episodes with the tool too
            from reco_megatron.trainer.orchestration.episodes import EpisodeEngine

            return EpisodeEngine(self.episodes)  # type: ignore[return-value]
        return self.client.engine

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        self.client.close()
