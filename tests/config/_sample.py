"""A sample config tree using every supported annotation (string annotations on purpose)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from reco_megatron.algo.config import LossConfig


@dataclass(kw_only=True)
class OptimSection:
    """Optimizer settings (a section with a required field)."""

    lr: float
    """Peak learning rate (> 0)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""

    weight_decay: float = 0.0
    """Decoupled weight decay (>= 0)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr} (try 1e-6)")


@dataclass(kw_only=True)
class RolloutSection:
    """Generation settings."""

    group_size: int = 8
    """Responses per prompt (>= 2)."""

    temperature: float = 1.0
    """Sampling temperature."""

    stop: list[str] = field(default_factory=list)
    """Stop strings."""

    seeds: tuple[int, ...] = (1, 2)
    """Seeds, one per rollout worker."""

    engine: Literal["vllm", "hf"] = "vllm"
    """Generation backend."""

    max_tokens: int | None = None
    """Response length cap; null for the engine's default."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {self.group_size}: GRPO needs groups")


@dataclass(kw_only=True)
class SampleConfig:
    """A trainer-like config for the loader's tests."""

    name: str = "run"
    """Run name."""

    seed: int = 0
    """Global seed."""

    debug: bool = False
    """Extra checks."""

    output_dir: Path = Path("runs/default")
    """Where metrics go."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The ReCo loss."""

    rollout: RolloutSection = field(default_factory=lambda: RolloutSection(group_size=4))
    """Generation (the default section has group_size 4, not the class default 8)."""

    optim: Optional[OptimSection] = None  # noqa: UP045 - typing.Optional on purpose
    """Optimizer; null keeps the trainer's default."""

    reward_weights: dict[str, float] = field(default_factory=lambda: {"math": 1.0})
    """Weight of each reward function by name."""

    tags: list[str] = field(default_factory=list)
    """Free-form labels."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Anything, unchecked."""

    mode: Literal["train", "eval", 3] = "train"
    """A literal mixing strings and an int."""

    budget: int | str = 100
    """A two-type union."""
