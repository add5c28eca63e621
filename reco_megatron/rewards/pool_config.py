"""The reward pool's settings (``reward`` section) and what one batch of scores returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class RewardPoolConfig:
    """Configuration of :class:`RewardPool`."""

    reward: str = "math"
    """Built-in name (``math``, ``countdown``) or ``"module:function"`` import path."""
    num_workers: int = 2
    """Worker processes; each scores one item at a time."""
    timeout_s: float = 10.0
    """Per-item wall-clock limit; past it the worker is killed and the item scores 0.0."""
    grader_timeout_s: int = 3
    """Limit (whole seconds) of a grader's own timeouts, e.g. math_verify's parse and verify;
    an item it gives up on scores 0.0 and counts as ``reward_fail_grader_timeout`` (a
    failure, not a wrong answer). Keep it below ``timeout_s``, or the pool kills a slow grader
    first (``reward_fail_timeout``)."""
    max_abs_score: float = 1e6
    """A finite score beyond +-this is a failure (``reward_fail_out_of_range``, scores 0.0):
    the trainer computes in float32, where 3.4e38 is already infinite."""
    memory_limit_mb: int | None = 4096
    """RLIMIT_AS of each worker in MiB (address space, not RSS); None for no limit."""
    max_response_chars: int = 16384
    """Responses are cut to their last this-many characters before scoring."""
    max_gold_chars: int = 4096
    """Longer gold answers are cut likewise (they come from data, so a warning is logged)."""
    start_timeout_s: float = 60.0
    """How long a new worker may take to import the reward function."""
    self_check: bool = True
    """Score ``("", "")`` at start-up and raise if the function returns a non-number."""
    max_failed_frac: float = 0.5
    """Stop the run (exit 3) when more than this share of one step's rewards failed (raised,
    NaN, None, non-number, MemoryError, timeout, crash: ``reward_fail_*`` in metrics.jsonl);
    1.0 never stops. A reward that fails on most items trains on zeros, not on the task."""

    def __post_init__(self) -> None:
        checks = {
            "num_workers": self.num_workers >= 1,
            "timeout_s": self.timeout_s > 0,
            "max_response_chars": self.max_response_chars >= 1,
            "max_gold_chars": self.max_gold_chars >= 1,
            "start_timeout_s": self.start_timeout_s > 0,
            "memory_limit_mb": self.memory_limit_mb is None or self.memory_limit_mb >= 64,
            "max_abs_score": self.max_abs_score > 0,
        }
        grader = self.grader_timeout_s
        if isinstance(grader, bool) or not isinstance(grader, int) or grader < 1:
            raise ValueError(
                f"RewardPoolConfig.grader_timeout_s={grader!r} must be a whole number of seconds "
                ">= 1 (math_verify's timeouts use signal.alarm)"
            )
        frac = self.max_failed_frac
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 <= frac <= 1:
            raise ValueError(
                f"reward.max_failed_frac={frac!r} must be a share in [0, 1] (e.g. 0.5 stops "
                "when more than half of a step's rewards failed; 1.0 never stops)"
            )
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"RewardPoolConfig.{name}={getattr(self, name)!r} is out of range: counts "
                    "and limits must be positive (memory_limit_mb >= 64 or None)"
                )


@dataclass
class RewardBatch:
    """Scores of one batch. ``scores``/``statuses``: ``[B]``; ``metrics``: floats by key."""

    scores: list[float]
    statuses: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)
    """``[B]``: what went wrong with each failed item (the exception, the value), else ``""``."""
