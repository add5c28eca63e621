"""Episodes as a service: the environment settings of a run and the groups it asks for.

:class:`EnvSettings` is what a process needs to run a run's environments (the ``rollout.env*``
fields, the reward's memory limit and the tokenizer); the trainer builds it from its config
and sends it, as a plain map, to a separate rollout worker in its setup. An
:class:`EpisodeService` holds the environment pool for the life of the process and runs the
groups it is asked for on an engine's ``generate`` (:func:`run_episodes`): the colocated
trainer and the separate worker (:mod:`reco_megatron.rollout_worker`) run episodes through it
alike, so the same step gives the same episodes wherever it runs.

    service = EpisodeService(EnvSettings(env="calculator", tokenizer="tok.model"))
    result = service.run(engine.generate, rows, n, sampling)   # an EpisodeResult
    service.close()
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from reco_megatron.envs.episodes import EpisodeResult, Generate, run_episodes
from reco_megatron.envs.pool import EnvPool, Outcome
from reco_megatron.rollout.requests import SamplingParams


class Pool(Protocol):
    """What :func:`run_episodes` needs of a pool (an :class:`EnvPool`, or the trainer's
    model-parallel group sharing one)."""

    def reset(self, rows: dict[int, dict[str, Any]]) -> dict[int, Outcome]: ...

    def step(self, actions: dict[int, tuple[list[int], str]]) -> dict[int, Outcome]: ...

    def release(self, eids: list[int]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class EnvSettings:
    """The environments of a run (``rollout.env`` and the fields that go with it)."""

    env: str
    """The environment spec (a built-in name, ``module:Class`` or ``file.py:Class``)."""
    max_turns: int = 8
    """Most actions per episode."""
    env_workers: int = 8
    """Isolated environment worker processes (at most this many steps at once)."""
    step_timeout_s: float = 30.0
    """Time limit of one ``reset`` or ``step`` call."""
    turn_discount: float = 1.0
    """Per-turn rewards count ``turn_discount**k`` at turn k."""
    memory_limit_mb: int | None = 4096
    """Address-space limit of an environment worker (the reward's ``memory_limit_mb``)."""
    tokenizer: str = ""
    """The tokenizer an environment gets (its path or name)."""
    vocab_size: int | None = None
    """Observation ids must be below it."""

    def __post_init__(self) -> None:
        def whole(name: str, low: int, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"env settings: {name} must be an integer >= {low}, got {v!r}")

        if not isinstance(self.env, str) or not self.env:
            raise ValueError(f"env settings: env must name an environment, got {self.env!r}")
        if not isinstance(self.tokenizer, str):
            raise ValueError(f"env settings: tokenizer must be a string, got {self.tokenizer!r}")
        whole("max_turns", 1)
        whole("env_workers", 1)
        whole("memory_limit_mb", 1, optional=True)
        whole("vocab_size", 1, optional=True)
        t, g = self.step_timeout_s, self.turn_discount
        if isinstance(t, bool) or not isinstance(t, int | float) or not (0 < t < math.inf):
            raise ValueError(f"env settings: step_timeout_s must be seconds > 0, got {t!r}")
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0 < g <= 1:
            raise ValueError(f"env settings: turn_discount must be in (0, 1], got {g!r}")

    def to_wire(self) -> dict[str, Any]:
        """A plain map of the fields (what a worker's setup carries)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> EnvSettings:
        """The settings a setup carried; ``ValueError`` for missing, unknown or bad fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        if set(fields) != names:
            raise ValueError(
                f"env settings: fields {sorted(fields)} are not the expected {sorted(names)}"
            )
        return cls(**fields)

    def pool(self) -> EnvPool:
        """Start the environment workers (the caller closes them)."""
        return EnvPool(
            self.env,
            num_workers=self.env_workers,
            step_timeout_s=self.step_timeout_s,
            memory_limit_mb=self.memory_limit_mb,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
        )


class EpisodeService:
    """A process's environments and the episodes it runs with them. ``pool``: the pool to
    use (the trainer's model-parallel group shares one); None starts the settings' own."""

    def __init__(self, settings: EnvSettings, pool: Pool | None = None) -> None:
        self.settings = settings
        self.pool: Pool = settings.pool() if pool is None else pool
        self.next_id = 0
        """The pool's id of the next episode (ids never repeat while the pool lives)."""

    def run(
        self,
        generate: Generate,
        rows: Sequence[Mapping[str, Any]],
        n: int,
        sampling: Sequence[SamplingParams],
    ) -> EpisodeResult:
        """``n`` episodes of each row on ``generate``, row ``i`` sampled with
        ``sampling[i]`` (its seed and the whole episode's token budget)."""
        result = run_episodes(
            generate,
            self.pool,  # type: ignore[arg-type]
            rows,
            n,
            sampling,
            max_turns=self.settings.max_turns,
            turn_discount=self.settings.turn_discount,
            first_id=self.next_id,
        )
        self.next_id += len(rows) * n
        return result

    def close(self) -> None:
        """Stop the environment workers (and whatever their environments started)."""
        self.pool.close()


def group_records(result: EpisodeResult) -> list[dict[str, Any]]:
    """``[groups]`` what a separate worker sends of each group besides its completions
    (``result.episodes`` on the wire): the prompt the environment chose, each episode's
    per-turn rewards and failure, and the group's ``env_*`` counters."""
    return [
        {"prompt": list(prompt), "turn_rewards": list(rewards), "failed": list(failed),
         "metrics": dict(counters)}
        for prompt, rewards, failed, counters in zip(
            result.prompts, result.turn_rewards, result.failed, result.group_metrics, strict=True
        )
    ]  # fmt: skip
