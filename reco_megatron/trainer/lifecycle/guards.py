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
from collections.abc import Sequence
from pathlib import Path

from reco_megatron.rewards.types import PARSE_FAILURE
from reco_megatron.trainer.sections import Action, StabilityConfig
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class StabilityStop(RuntimeError):
    """A guard with action ``stop`` fired, or too many consecutive steps were skipped."""


_ORDER = {"ok": 0, "warn": 1, "skip": 2, "stop": 3}


class StabilityGuard:
    """Decides ``ok`` / ``warn`` / ``skip`` / ``stop`` for one optimizer step's metrics."""

    def __init__(self, cfg: StabilityConfig, c_max: float = math.inf) -> None:
        self.cfg = cfg
        self.token_ratio_max = c_max if cfg.token_ratio_max is None else cfg.token_ratio_max
        self.consecutive_skips = 0
        self.total_skips = 0
        self.fired: dict[str, int] = {}

    def _checks(self, m: dict[str, float]) -> list[tuple[str, bool, Action]]:
        c = self.cfg
        return [
            (
                "token_ratio_max",
                m.get("token_ratio_max", 0.0) > self.token_ratio_max,
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
                hint = f": {self.describe(name)}" if name == "token_ratio_max" else ""
                reasons.append(f"{name}={metrics.get(name)!r} ({action}{hint})")
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

    def describe(self, name: str) -> str:
        """What a fired check means, for the warning."""
        if name == "token_ratio_max":
            return (
                f"raw c above {self.token_ratio_max:g}: a near-certain token lost probability "
                "(c = r (1-p)/(1-p_old)); c_max caps its value, not its push; loss.c_trust "
                "bounds it"
            )
        return name


def unparsable_count(statuses: Sequence[str] | None) -> float:
    """How many of this rank's scored responses got the ``parse_failure`` verdict (an answer
    was found but could not be parsed); 0 on ranks that do not score."""
    return float(sum(status == PARSE_FAILURE for status in statuses or ()))


class DeadRunGuard:
    """Stops a run that has died: for ``dead_run_steps`` consecutive steps every reward was 0
    or too many answers were unparsable, after at least one step with a non-zero reward
    (a run that never earned one is not dead, it never lived: nothing to go back to).

    :meth:`observe` takes each step's global ``metrics.jsonl`` row (``reward_nonzero_frac``,
    ``reward_unparsable_frac``; the same on every rank, so every rank decides alike).
    """

    def __init__(
        self,
        cfg: StabilityConfig,
        ckpt_root: Path,
        init: str | None = None,
        *,
        save_interval: int = 0,
        keep_last: int = 0,
    ) -> None:
        self.cfg = cfg
        self.ckpt_root = Path(ckpt_root)
        self.init = init
        self.armed = False
        self.streak_start: int | None = None
        self.no_signal = NoSignalGuard(cfg)  # watches the same rows (observe drives both)
        k = cfg.dead_run_steps
        # the stop comes before the save of the streak's k-th step, so the newest checkpoint
        # is at most k - 2 steps after the streak began; the kept ones reach
        # (keep_last - 1) * save_interval further back, and must reach 2 steps before it
        if k and save_interval and keep_last and (keep_last - 1) * save_interval < k:
            logger.warning(
                "checkpoint.keep_last=%d x checkpoint.save_interval=%d may rotate out the last "
                "checkpoint from before a dead run (stability.dead_run_steps=%d): keep at least "
                "%d checkpoints to be able to go back",
                keep_last,
                save_interval,
                k,
                1 + -(-k // save_interval),
            )

    def is_dead_step(self, row: dict[str, float]) -> bool:
        """Whether one step's row is dead: no non-zero reward, or too many unparsable answers."""
        no_reward = row.get("reward_nonzero_frac", 1.0) == 0.0
        unparsable = row.get("reward_unparsable_frac", 0.0) > self.cfg.dead_run_unparsable_frac
        return no_reward or unparsable

    def last_good_checkpoint(self) -> str:
        """The newest checkpoint still on disk whose weights sampled a live step: saved at a
        step k with k + 1 < the first dead step (the weights after step k sample step k + 1)."""
        assert self.streak_start is not None
        steps = []
        for path in self.ckpt_root.glob("step_*"):
            try:
                k = int(path.name.removeprefix("step_"))
            except ValueError:
                continue
            if k + 1 < self.streak_start and (path / "meta.json").exists():
                steps.append((k, path))
        if steps:
            return str(max(steps)[1])
        if self.init:
            return f"{self.init} (the initial weights; no checkpoint of this run is older)"
        return (
            "none (no checkpoint of this run predates it: save more often, "
            "checkpoint.save_interval, or keep more, checkpoint.keep_last)"
        )

    def observe(self, row: dict[str, float]) -> None:
        """Update the streak with one step's row; raise :class:`StabilityStop` (action
        ``stop``) or log one warning (``warn``) when the run is dead; then the same row for
        the :class:`NoSignalGuard`."""
        self._observe_dead(row)
        self.no_signal.observe(row)

    def _observe_dead(self, row: dict[str, float]) -> None:
        k = self.cfg.dead_run_steps
        if not k:
            return
        step = int(row["step"])
        dead = self.is_dead_step(row)
        if not dead:
            self.streak_start = None
            self.armed = self.armed or row.get("reward_nonzero_frac", 0.0) > 0.0
            return
        if not self.armed:
            return
        if self.streak_start is None:
            self.streak_start = step
        if step - self.streak_start + 1 != k:  # fire once per streak, at its k-th step
            return
        message = (
            f"dead run: steps {self.streak_start}-{step} had no non-zero reward or more than "
            f"{self.cfg.dead_run_unparsable_frac:.0%} unparsable answers (last: reward "
            f"{row.get('reward_mean', float('nan')):.3g}, unparsable "
            f"{row.get('reward_unparsable_frac', float('nan')):.0%}); last good checkpoint: "
            f"{self.last_good_checkpoint()}"
        )
        if self.cfg.dead_run_action == "stop":
            raise DeadRunStop(message)
        logger.warning("%s", message)


class DeadRunStop(StabilityStop):
    """The dead-run guard stopped the run (exit status 3)."""


class NoSignalGuard:
    """Says so when for ``stability.no_signal_steps`` consecutive steps every group's rewards
    were all equal (the row's ``zero_adv_frac`` is 1, the same on every rank): every advantage
    is 0, the loss and the gradient are 0, and the run trains nothing. Unlike
    :class:`DeadRunGuard` it fires on a run that never earned a reward: the usual cause is a
    reward that cannot score the task's answers (a custom reward's first run). One line per
    streak, at its k-th step; ``stability.no_signal_action=stop`` raises :class:`NoSignalStop`.
    """

    def __init__(self, cfg: StabilityConfig) -> None:
        self.cfg = cfg
        self.streak_start: int | None = None

    def observe(self, row: dict[str, float]) -> None:
        """Update the streak with one step's ``metrics.jsonl`` row (``step``,
        ``zero_adv_frac``, ``reward_mean``)."""
        k = self.cfg.no_signal_steps
        if not k:
            return
        step = int(row["step"])
        if row.get("zero_adv_frac", 0.0) < 1.0:
            self.streak_start = None
            return
        if self.streak_start is None:
            self.streak_start = step
        if step - self.streak_start + 1 != k:
            return
        message = (
            f"no learning signal: in steps {self.streak_start}-{step} every group's responses "
            f"had the same reward (last mean reward {row.get('reward_mean', float('nan')):.3g}), "
            "so every advantage and gradient is 0; check that the reward scores this task's "
            "answers (call it on a response from a rollout and its gold answer), or raise "
            "rollout.group_size or rollout.temperature so that a group's responses differ"
        )
        if self.cfg.no_signal_action == "stop":
            raise NoSignalStop(message)
        logger.warning("%s", message)


class NoSignalStop(StabilityStop):
    """The no-signal guard stopped the run (exit status 3)."""
