"""The run's life as the trainer holds it: signals, the run directory, the resume, the guards.

:class:`RunLife` is the one object the loop keeps for everything that starts, guards and ends a
run rather than computing a step. In the order the trainer calls it:

1. :meth:`RunLife.install_signals` once the pure checks passed (before that there is nothing
   to save, and a rank that torchrun stops because another failed them dies quietly);
2. :meth:`RunLife.take_directory`: one trainer per run directory, before anything is written;
3. :meth:`RunLife.check_resume` once the directory is ready: the config diff of a resume;
4. :meth:`RunLife.arm_guards`: the stability guard (per optimizer step) and the dead-run guard
   (per step, naming the last checkpoint saved before the run died);
5. :meth:`RunLife.record_start` (rank 0): the start in ``config_history.jsonl`` and the
   resolved ``config.yaml``;
6. per step, :meth:`RunLife.observe` and :meth:`RunLife.stop_here`; at the end
   :meth:`RunLife.close` (release the directory, restore the signal handlers it installed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reco_megatron.config import dump_config
from reco_megatron.config.dump import config_to_dict
from reco_megatron.trainer.lifecycle.config_history import CONFIG_HEADER, ResumeCheck
from reco_megatron.trainer.lifecycle.guards import DeadRunGuard, StabilityGuard
from reco_megatron.trainer.lifecycle.run_dir import take_run_directory
from reco_megatron.trainer.lifecycle.run_lock import RunLock
from reco_megatron.trainer.lifecycle.stop_signals import StopSignals, stop_here

if TYPE_CHECKING:  # annotations only: the configuration imports no room
    from reco_megatron.trainer.config import TrainConfig


class RunLife:
    """Signals, lock, run id, resume check, guards and unsaved progress of one run."""

    def __init__(self, cfg: TrainConfig, signals: StopSignals | None = None) -> None:
        self.cfg = cfg
        self.config_plain: dict[str, Any] = config_to_dict(cfg)
        """The config as loaded: what checkpoints record."""
        self._own_signals = signals is None  # the CLI passes its own; tests may not
        self.signals = signals or StopSignals()
        self.lock: RunLock | None = None
        self.run_id = ""
        self.resume: ResumeCheck | None = None
        self.guard = StabilityGuard(cfg.stability, c_max=cfg.loss.c_max)
        self.dead_run: DeadRunGuard | None = None
        self.unsaved_progress = False
        """Trained since the last checkpoint (or the start)."""

    def install_signals(self) -> None:
        self.signals.install()

    def take_directory(self, rank: int) -> None:
        """One trainer per run directory, before anything is written to it (collective)."""
        self.lock, self.run_id = take_run_directory(self.cfg.trainer.output_dir, rank)

    def check_resume(self, out: Path, rank: int) -> ResumeCheck:
        """The config diff of a resume against the checkpoint's (ConfigError when refused)."""
        self.resume = ResumeCheck(self.cfg, self.config_plain, out, rank)
        return self.resume

    def arm_guards(self, ckpt_root: Path) -> None:
        ck = self.cfg.checkpoint
        self.dead_run = DeadRunGuard(
            self.cfg.stability,
            ckpt_root,
            ck.init_megatron or ck.init_hf or None,
            save_interval=ck.save_interval,
            keep_last=ck.keep_last,
        )

    def record_start(self, out: Path, step: int, checkpoint: str | None) -> None:
        """This start in the config history and the resolved ``config.yaml`` (rank 0)."""
        assert self.resume is not None
        self.resume.record(step, checkpoint)
        dump_config(self.cfg, out / "config.yaml", header=CONFIG_HEADER)

    def observe(self, row: dict[str, Any]) -> None:
        """A finished step's row: the dead-run guard's evidence."""
        self.unsaved_progress = True
        if self.dead_run is not None:
            self.dead_run.observe(row)

    def stop_here(self, step: int, save: Callable[[], None]) -> bool:
        """True when a stop signal ends the run here (every rank agrees; saved if needed)."""
        return stop_here(self.signals, step=step, save=save if self.unsaved_progress else None)

    def close(self, *, failed_start: bool = False) -> None:
        """Release the run directory and restore the signal handlers (idempotent)."""
        if self.lock is not None:
            self.lock.release(failed_start=failed_start)
        if self._own_signals:
            self.signals.restore()
