"""Stability guards for the replaced ratio.

ReCo replaces the importance ratio, a well-understood term, and its paper reports no
stability analysis; these guards watch the quantities that would show trouble
(``docs/stability.md`` says what each one means). Each optimizer step's metrics are checked
*after* forward+backward and *before* the optimizer step, so ``skip`` really skips the update.
Decisions use globally reduced metrics, so every rank takes the same one.

Stop signals (SIGTERM, SIGUSR1, Ctrl-C) are handled in ``stop_signals``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

Action = Literal["warn", "skip", "stop"]


class StabilityStop(RuntimeError):
    """A guard with action ``stop`` fired, or too many consecutive steps were skipped."""


@dataclass(kw_only=True)
class StabilityConfig:
    """Thresholds on per-step ReCo quantities and the action taken when one is crossed."""

    max_consecutive_skips: int = 5
    """Stop the run after this many consecutive skipped optimizer steps (NaN/Inf or guards)."""
    token_ratio_max: float = 1e3
    """Largest ReCo token ratio c (before the cap) allowed; far above c_max means p_old ~ 0|1."""
    token_ratio_action: Action = "warn"
    """Action when ``token_ratio_max`` is exceeded."""
    ratio_max: float = 1e3
    """Largest importance ratio r = p / p_old before the clip; a blow-up means a policy jump."""
    ratio_action: Action = "skip"
    """Action when ``ratio_max`` is exceeded."""
    weight_ess_min: float = 0.05
    """Smallest effective sample size of the response weights (1 = uniform)."""
    weight_ess_action: Action = "warn"
    """Action when the ESS falls below ``weight_ess_min``."""
    kl_old_new_max: float = 1.0
    """Largest KL(old || new) estimate within one rollout batch."""
    kl_action: Action = "warn"
    """Action when ``kl_old_new_max`` is exceeded."""
    entropy_min: float = 0.0
    """Smallest mean token entropy (nats); collapse towards 0 means no exploration (0: off)."""
    entropy_action: Action = "warn"
    """Action when the entropy falls below ``entropy_min``."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_consecutive_skips, int) or self.max_consecutive_skips < 1:
            raise ValueError(
                f"stability.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips!r}"
            )
        for name in ("token_ratio", "ratio", "weight_ess", "kl", "entropy"):
            action = getattr(self, f"{name}_action")
            if action not in ("warn", "skip", "stop"):
                raise ValueError(
                    f"stability.{name}_action must be warn, skip or stop, got {action!r}"
                )


_ORDER = {"ok": 0, "warn": 1, "skip": 2, "stop": 3}


class StabilityGuard:
    """Decides ``ok`` / ``warn`` / ``skip`` / ``stop`` for one optimizer step's metrics."""

    def __init__(self, cfg: StabilityConfig) -> None:
        self.cfg = cfg
        self.consecutive_skips = 0
        self.total_skips = 0
        self.fired: dict[str, int] = {}

    def _checks(self, m: dict[str, float]) -> list[tuple[str, bool, Action]]:
        c = self.cfg
        return [
            (
                "token_ratio_max",
                m.get("token_ratio_max", 0.0) > c.token_ratio_max,
                c.token_ratio_action,
            ),
            ("ratio_max", m.get("ratio_max", 0.0) > c.ratio_max, c.ratio_action),
            ("weight_ess", m.get("weight_ess", 1.0) < c.weight_ess_min, c.weight_ess_action),
            ("kl_old_new", m.get("kl_old_new", 0.0) > c.kl_old_new_max, c.kl_action),
            ("entropy", m.get("entropy", math.inf) < c.entropy_min, c.entropy_action),
        ]

    def decide(self, metrics: dict[str, float], grads_finite: bool) -> str:
        """The action for a step; raises :class:`StabilityStop` for ``stop``."""
        decision, reasons = "ok", []
        if not grads_finite or not math.isfinite(metrics.get("loss", 0.0)):
            decision, reasons = "skip", ["non-finite loss or gradients"]
        for name, crossed, action in self._checks(metrics):
            if crossed:
                self.fired[name] = self.fired.get(name, 0) + 1
                reasons.append(f"{name}={metrics.get(name)!r} ({action})")
                if _ORDER[action] > _ORDER[decision]:
                    decision = action
        if decision == "stop":
            raise StabilityStop("stability guard stopped the run: " + "; ".join(reasons))
        if decision == "skip":
            self.consecutive_skips += 1
            self.total_skips += 1
            logger.warning("skipping optimizer step: %s", "; ".join(reasons))
            if self.consecutive_skips >= self.cfg.max_consecutive_skips:
                raise StabilityStop(
                    f"{self.consecutive_skips} consecutive optimizer steps skipped (last: "
                    f"{'; '.join(reasons)}): the run is diverging; lower the learning rate or "
                    "resume from an earlier checkpoint"
                )
        else:
            self.consecutive_skips = 0
            if decision == "warn":
                logger.warning("stability: %s", "; ".join(reasons))
        return decision
